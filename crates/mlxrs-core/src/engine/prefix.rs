//! The prompt-prefix cache: snapshots of sequences' KV caches keyed by the tokens they hold,
//! reused for the longest common prefix of a new prompt, least recently used out first, bounded in
//! bytes. A snapshot is a clone of the per-layer caches: MLX arrays are reference-counted and a
//! cache update writes a new array, so a snapshot never changes after it is taken.
use crate::cache::LayerCache;

/// One snapshot: the tokens its cache holds (in order) and the cache.
struct Entry {
    tokens: Vec<i32>,
    cache: Vec<LayerCache>,
    bytes: usize,
    last_used: u64,
}

/// Counters reported at /stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: usize,
    pub bytes: usize,
    pub budget: usize,
    /// Prompt tokens served from snapshots instead of prefilled.
    pub cached_tokens: u64,
}

/// A byte-bounded LRU of cache snapshots.
pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    bytes: usize,
    tick: u64,
    hits: u64,
    misses: u64,
    cached_tokens: u64,
}

fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn cache_bytes(c: &[LayerCache]) -> usize {
    c.iter().map(LayerCache::nbytes).sum()
}

impl PrefixCache {
    /// `budget` bytes (0 turns the cache off).
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), budget, bytes: 0, tick: 0, hits: 0, misses: 0, cached_tokens: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            hits: self.hits,
            misses: self.misses,
            entries: self.entries.len(),
            bytes: self.bytes,
            budget: self.budget,
            cached_tokens: self.cached_tokens,
        }
    }

    /// The cache for the longest reusable prefix of `prompt`, and its length. At least one prompt
    /// token is always left to run (the model must produce the logits of the last one). A snapshot
    /// longer than the common prefix is trimmed back to it, where every layer can be trimmed (full
    /// and quantized caches; a rotating cache only before it wrapped).
    pub fn lookup(&mut self, prompt: &[i32]) -> Option<(Vec<LayerCache>, usize)> {
        if !self.enabled() || prompt.len() < 2 {
            return None;
        }
        let limit = prompt.len() - 1;
        let mut best: Option<(usize, usize)> = None; // (entry, usable length)
        for (i, e) in self.entries.iter().enumerate() {
            let l = common_prefix(&e.tokens, prompt).min(limit);
            if l == 0 || best.is_some_and(|(_, b)| b >= l) {
                continue;
            }
            if l < e.tokens.len() && !trimmable(&e.cache, e.tokens.len() - l) {
                continue;
            }
            best = Some((i, l));
        }
        let Some((i, l)) = best else {
            self.misses += 1;
            return None;
        };
        self.tick += 1;
        let e = &mut self.entries[i];
        e.last_used = self.tick;
        let mut cache = e.cache.clone();
        let drop = (e.tokens.len() - l) as i32;
        if drop > 0 {
            for c in cache.iter_mut() {
                c.trim(drop);
            }
        }
        self.hits += 1;
        self.cached_tokens += l as u64;
        Some((cache, l))
    }

    /// Keep a snapshot of `cache`, which holds exactly `tokens`. Snapshots that are a strict prefix
    /// of it and fully trimmable are dropped (this one serves every lookup they would); then the
    /// least recently used go until the total fits the budget. A snapshot larger than the budget is
    /// not kept.
    pub fn insert(&mut self, tokens: Vec<i32>, cache: Vec<LayerCache>) {
        if !self.enabled() || tokens.is_empty() {
            return;
        }
        let bytes = cache_bytes(&cache);
        if bytes > self.budget {
            return;
        }
        if trimmable(&cache, tokens.len()) {
            let before = self.entries.len();
            self.entries.retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
            if self.entries.len() != before {
                self.bytes = self.entries.iter().map(|e| e.bytes).sum();
            }
        } else if self.entries.iter().any(|e| e.tokens == tokens) {
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
                break;
            };
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.bytes;
        }
        self.tick += 1;
        self.bytes += bytes;
        self.entries.push(Entry { tokens, cache, bytes, last_used: self.tick });
    }

    /// Drop every snapshot (memory pressure).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    /// Drop least recently used snapshots until at most `bytes` remain.
    pub fn shrink_to(&mut self, bytes: usize) {
        while self.bytes > bytes {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
                break;
            };
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.bytes;
        }
    }
}

/// Whether every layer can drop its last `n` tokens.
fn trimmable(cache: &[LayerCache], n: usize) -> bool {
    cache.iter().all(|c| c.can_trim(n as i32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::KvCache;

    fn full(offset: i32) -> Vec<LayerCache> {
        vec![LayerCache::Full(KvCache { keys: None, values: None, offset })]
    }

    #[test]
    fn longest_prefix_wins_and_leaves_one_token() {
        let mut p = PrefixCache::new(1 << 30);
        p.insert(vec![1, 2, 3], full(3));
        p.insert(vec![1, 2, 9, 9], full(4));
        // [1,2,3,4]: entry [1,2,3] matches 3 tokens
        let (c, l) = p.lookup(&[1, 2, 3, 4]).unwrap();
        assert_eq!((l, c[0].offset()), (3, 3));
        // the whole prompt cached: one token is left to run, the snapshot is trimmed to 2
        let (c, l) = p.lookup(&[1, 2, 3]).unwrap();
        assert_eq!((l, c[0].offset()), (2, 2));
        // a diverging prompt reuses the common part of the best entry
        let (c, l) = p.lookup(&[1, 2, 9, 5, 5]).unwrap();
        assert_eq!((l, c[0].offset()), (3, 3));
        assert!(p.lookup(&[7, 7]).is_none());
        let s = p.stats();
        assert_eq!((s.hits, s.misses, s.cached_tokens), (3, 1, 8));
    }

    #[test]
    fn a_longer_snapshot_replaces_its_prefixes() {
        let mut p = PrefixCache::new(1 << 30);
        p.insert(vec![1, 2], full(2));
        p.insert(vec![1, 2, 3, 4], full(4));
        assert_eq!(p.stats().entries, 1);
    }

    #[test]
    fn a_wrapped_rotating_cache_is_reused_only_whole() {
        let wrapped = || {
            let mut c = LayerCache::rotating(4, 0);
            if let LayerCache::Rotating(r) = &mut c {
                r.offset = 10; // 10 tokens through a 4-slot window: wrapped
            }
            vec![c]
        };
        let mut p = PrefixCache::new(1 << 30);
        p.insert((0..10).collect(), wrapped());
        // exact prefix: no trim needed
        let (_, l) = p.lookup(&(0..12).collect::<Vec<_>>()).unwrap();
        assert_eq!(l, 10);
        // diverging inside: it cannot be trimmed, so no hit
        let mut q: Vec<i32> = (0..10).collect();
        q[8] = 99;
        q.push(5);
        assert!(p.lookup(&q).is_none());
    }

    #[test]
    fn off_when_the_budget_is_zero() {
        let mut p = PrefixCache::new(0);
        p.insert(vec![1, 2, 3], full(3));
        assert!(p.lookup(&[1, 2, 3, 4]).is_none());
        assert_eq!(p.stats().entries, 0);
    }

    /// A model with a recurrent layer: a snapshot serves only prompts that extend exactly the
    /// tokens it holds (a recurrent state cannot be rewound), never a diverging or shorter one.
    #[test]
    fn a_recurrent_snapshot_is_reused_only_whole() {
        let snap = || {
            let mut r = LayerCache::recurrent();
            if let LayerCache::Recurrent(c) = &mut r {
                c.offset = 4;
            }
            let mut kv = full(4);
            kv.push(r);
            kv
        };
        let mut p = PrefixCache::new(1 << 30);
        p.insert(vec![1, 2, 3, 4], snap());
        let (c, l) = p.lookup(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((l, c[0].offset(), c[1].offset()), (4, 4, 4));
        assert!(p.lookup(&[1, 2, 3, 9, 5]).is_none()); // diverges inside
        assert!(p.lookup(&[1, 2, 3, 4]).is_none()); // would need the last token rewound
                                                    // a shorter snapshot is kept beside a longer one (it cannot be cut from it)
        p.insert(vec![1, 2], {
            let mut s = snap();
            s[0] = full(2)[0].clone();
            s
        });
        p.insert(vec![1, 2, 3, 4, 5, 6], snap());
        assert_eq!(p.stats().entries, 3);
    }
}
