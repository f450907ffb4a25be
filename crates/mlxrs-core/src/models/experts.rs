//! Paged-expert IO: where a MoE layer's routed experts live ([`ExpertStore`] behind
//! [`super::layers::Experts`]).
//!
//! - Resident: the stacked `[experts, out, in]` arrays, all in memory (mlx-lm's way).
//! - Streamed: the expert tensors stay in the safetensors files; the layer's router runs on the
//!   device, its top-k indices come to the host, the experts not in the [`ExpertLru`] cache are read
//!   with positional reads on a small pool of reader threads (several in flight, off the engine
//!   thread, which waits for them), and the SwitchGLU runs over a compact stack of the selected
//!   experts with the indices remapped into it. Both layouts are read in place: the pre-stacked
//!   `switch_mlp.{proj}.{weight,scales,biases}` (expert e's row range by offset) and the Hugging Face
//!   per-expert `experts.{e}.{proj}.weight`.
//!
//! Reading ahead: each streamed layer registers how it routes ([`Predictor`]); layer N applies layer
//! N+1's to its own MoE input and reads the experts it picks while layer N computes, into a pending
//! set beside the cache (a wrong guess costs a read, never an eviction); layer N+1 takes its misses
//! from there when they are in it.
//!
//! The cache is one per model with a byte budget over all layers; [`ExpertStats`] counts what it does.
use super::layers::SwitchLinear;
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};
use crate::safetensors::TensorEntry;
use crate::weights::{Matrix, QuantSpec, Weights};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::hash::Hash;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Whether a tensor holds routed experts (what a streamed model leaves in the files): the stacked
/// `*.switch_mlp.*` of mlx-lm's layout or the per-expert `*.experts.*` of Hugging Face's (shared
/// experts, `*.shared_experts.*`, are not routed).
pub fn is_expert_tensor(name: &str) -> bool {
    name.contains(".switch_mlp.") || name.contains(".experts.")
}

/// Where one tensor's bytes are: its safetensors file and its entry (offsets into the data section,
/// which begins at `data_start`). Recorded by `Weights::load_dir` from the validated headers.
#[derive(Clone, Debug)]
pub struct TensorLoc {
    pub file: Arc<File>,
    pub path: Arc<PathBuf>,
    pub data_start: u64,
    pub entry: TensorEntry,
}

/// A least-recently-used map bounded by the bytes of its values (each inserted with its size).
pub struct ExpertLru<K, V> {
    budget: usize,
    used: usize,
    tick: u64,
    map: HashMap<K, (V, usize, u64)>,
    order: BTreeMap<u64, K>,
    evictions: u64,
}

impl<K: Hash + Eq + Clone, V: Clone> ExpertLru<K, V> {
    pub fn new(budget: usize) -> ExpertLru<K, V> {
        ExpertLru { budget, used: 0, tick: 0, map: HashMap::new(), order: BTreeMap::new(), evictions: 0 }
    }

    /// The value of `k`, now the most recently used.
    pub fn get(&mut self, k: &K) -> Option<V> {
        self.tick += 1;
        let t = self.tick;
        let (v, _, tick) = self.map.get_mut(k)?;
        self.order.remove(tick);
        *tick = t;
        self.order.insert(t, k.clone());
        Some(v.clone())
    }

    /// Insert `v` of `bytes`, evicting the least recently used entries until it fits. A value larger
    /// than the whole budget is not kept (false).
    pub fn insert(&mut self, k: K, v: V, bytes: usize) -> bool {
        self.remove(&k);
        if bytes > self.budget {
            return false;
        }
        self.shrink_to(self.budget - bytes);
        self.tick += 1;
        self.order.insert(self.tick, k.clone());
        self.map.insert(k, (v, bytes, self.tick));
        self.used += bytes;
        true
    }

    fn remove(&mut self, k: &K) {
        if let Some((_, b, t)) = self.map.remove(k) {
            self.order.remove(&t);
            self.used -= b;
        }
    }

    fn shrink_to(&mut self, limit: usize) {
        while self.used > limit {
            let Some((_, k)) = self.order.pop_first() else { break };
            if let Some((_, b, _)) = self.map.remove(&k) {
                self.used -= b;
                self.evictions += 1;
            }
        }
    }

    /// A new budget; entries beyond it are evicted, least recently used first.
    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.shrink_to(budget);
    }

    pub fn budget(&self) -> usize {
        self.budget
    }
    pub fn used(&self) -> usize {
        self.used
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
    pub fn contains(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }
}

/// Counters of a streamed model's expert cache. A hit or a miss is one expert of one layer needed
/// by one forward step (an expert routed to several tokens of the step counts once).
#[derive(Debug, Default)]
pub struct ExpertStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Wall time the engine thread waited for expert reads, in nanoseconds.
    pub read_ns: AtomicU64,
    /// Tokens that went through the model (counted at its first streamed layer).
    pub tokens: AtomicU64,
    /// Experts read ahead for the next streamed layer (its router applied to this layer's input).
    pub prefetched: AtomicU64,
    /// Misses whose expert had been read ahead: the read overlapped the previous layer's compute.
    pub prefetch_hits: AtomicU64,
}

/// A snapshot of [`ExpertStats`] with the cache's state and derived rates.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct ExpertReport {
    pub hits: u64,
    pub misses: u64,
    /// hits / (hits + misses); None before the first step.
    pub hit_rate: Option<f64>,
    pub bytes_read: u64,
    pub tokens: u64,
    pub bytes_read_per_token: Option<f64>,
    /// bytes_read / the time spent waiting for reads, in bytes per second.
    pub read_bytes_per_second: Option<f64>,
    pub read_seconds: f64,
    pub cache_budget_bytes: u64,
    pub cache_bytes: u64,
    pub cached_experts: u64,
    pub evictions: u64,
    /// Bytes of the expert tensors left in the files (not resident).
    pub streamed_bytes: u64,
    pub streamed_layers: u64,
    /// Whether layers read the next layer's predicted experts ahead.
    pub prefetch: bool,
    /// Experts read ahead; of those, the ones the next layer then used (each also a miss: not in
    /// the cache); prefetch_hits / prefetched. bytes_read counts every read, wasted ones included:
    /// bytes_read = (misses − prefetch_hits + prefetched) × bytes per expert read (an expert's
    /// bytes, but in gpt-oss's released layout its gate and up rows interleave, so each of the two
    /// reads covers both: the gate_up bytes count twice).
    pub prefetched: u64,
    pub prefetch_hits: u64,
    pub prefetch_hit_rate: Option<f64>,
}

/// One expert's weights in memory: gate, up, down, each `(weight, scales, biases)` of one expert.
pub struct ExpertParts {
    pub projs: [Vec<Array>; 3],
}

type Key = (u32, u32);

/// How a streamed layer routes: its expert indices `[..., k]` for a hidden state (lazy). The
/// layer before applies it to its own MoE input to predict, and read ahead, this layer's experts.
pub type Predictor = Arc<dyn Fn(&Array) -> Result<Array> + Send + Sync>;

/// The files' places of one layer's experts: gate, up, down, their parts.
type LayerSrc = [Vec<PartSource>; 3];

/// A streamed model's shared state: the expert cache, its counters, and what the layers registered.
pub struct Streaming {
    cache: Mutex<ExpertLru<Key, Arc<ExpertParts>>>,
    pub stats: ExpertStats,
    layers: AtomicU32,
    streamed_bytes: AtomicU64,
    /// Expert bytes of one layer per expert (the largest seen), for the planner's estimates.
    expert_bytes: AtomicU64,
    budget_set: AtomicBool,
    prefetch: AtomicBool,
    /// Per streamed layer (in load order, which is the forward order): where its experts are and,
    /// once registered, how it routes.
    sources: Mutex<Vec<(Arc<LayerSrc>, Option<Predictor>)>>,
    /// The reads a layer started for the next one (at most one set in flight).
    pending: Mutex<Option<Inflight>>,
}

impl Streaming {
    /// `cache_bytes`: the expert cache's budget; None: a quarter of the streamed expert bytes
    /// (set once the model is built, [`Streaming::finish_load`]).
    pub fn new(cache_bytes: Option<usize>) -> Arc<Streaming> {
        Arc::new(Streaming {
            cache: Mutex::new(ExpertLru::new(cache_bytes.unwrap_or(usize::MAX))),
            stats: ExpertStats::default(),
            layers: AtomicU32::new(0),
            streamed_bytes: AtomicU64::new(0),
            expert_bytes: AtomicU64::new(0),
            budget_set: AtomicBool::new(cache_bytes.is_some()),
            prefetch: AtomicBool::new(PREFETCH_DEFAULT),
            sources: Mutex::new(Vec::new()),
            pending: Mutex::new(None),
        })
    }

    /// Read the next layer's predicted experts ahead ([`PREFETCH_DEFAULT`] unless set).
    pub fn set_prefetch(&self, on: bool) {
        self.prefetch.store(on, Ordering::Relaxed);
    }

    pub fn prefetching(&self) -> bool {
        self.prefetch.load(Ordering::Relaxed)
    }

    fn sources(&self) -> std::sync::MutexGuard<'_, Vec<(Arc<LayerSrc>, Option<Predictor>)>> {
        self.sources.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The router of streamed layer `layer + 1`, when prefetching and it registered one.
    fn next_predictor(&self, layer: u32) -> Option<Predictor> {
        if !self.prefetching() {
            return None;
        }
        self.sources().get(layer as usize + 1).and_then(|s| s.1.clone())
    }

    /// The reads started for `layer`, if the set in flight is that layer's (another is dropped:
    /// its reads are wasted).
    fn take_pending(&self, layer: u32) -> Option<Inflight> {
        let p = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
        p.filter(|p| p.layer == layer)
    }

    /// Start reading the experts `ids` of streamed layer `layer` that are not cached (ids outside
    /// the layer's experts ignored: a prediction, not a need); they wait in [`Streaming::pending`]
    /// for that layer, outside the cache (nothing is evicted for them).
    fn prefetch(&self, layer: u32, ids: &[i32]) -> Result<()> {
        let Some(src) = self.sources().get(layer as usize).map(|s| s.0.clone()) else { return Ok(()) };
        let count = src[0].first().map_or(0, |p| p.at.len());
        let mut want: Vec<u32> = Vec::new();
        {
            let c = self.lock();
            for &e in ids {
                if let Ok(u) = u32::try_from(e) {
                    if (u as usize) < count && !want.contains(&u) && !c.contains(&(layer, u)) {
                        want.push(u);
                    }
                }
            }
        }
        if want.is_empty() {
            return Ok(());
        }
        let bytes: usize = src.iter().flatten().map(PartSource::read_len).sum();
        self.stats.prefetched.fetch_add(want.len() as u64, Ordering::Relaxed);
        self.stats.bytes_read.fetch_add((want.len() * bytes) as u64, Ordering::Relaxed);
        let f = Inflight::start(layer, src, want)?;
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
        Ok(())
    }

    /// After the model is built: the default budget (a quarter of the streamed bytes) when none was given.
    pub fn finish_load(&self) {
        if !self.budget_set.load(Ordering::Relaxed) {
            let b = (self.streamed_bytes.load(Ordering::Relaxed) / 4) as usize;
            self.lock().set_budget(b);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExpertLru<Key, Arc<ExpertParts>>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn streamed_bytes(&self) -> u64 {
        self.streamed_bytes.load(Ordering::Relaxed)
    }

    pub fn report(&self) -> ExpertReport {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.stats;
        let (hits, misses, bytes, tokens) = (n(&s.hits), n(&s.misses), n(&s.bytes_read), n(&s.tokens));
        let secs = n(&s.read_ns) as f64 / 1e9;
        let (prefetched, prefetch_hits) = (n(&s.prefetched), n(&s.prefetch_hits));
        let c = self.lock();
        ExpertReport {
            hits,
            misses,
            hit_rate: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
            bytes_read: bytes,
            tokens,
            bytes_read_per_token: (tokens > 0).then(|| bytes as f64 / tokens as f64),
            read_bytes_per_second: (secs > 0.0).then(|| bytes as f64 / secs),
            read_seconds: secs,
            cache_budget_bytes: c.budget() as u64,
            cache_bytes: c.used() as u64,
            cached_experts: c.len() as u64,
            evictions: c.evictions(),
            streamed_bytes: self.streamed_bytes(),
            streamed_layers: self.layers.load(Ordering::Relaxed) as u64,
            prefetch: self.prefetching(),
            prefetched,
            prefetch_hits,
            prefetch_hit_rate: (prefetched > 0).then(|| prefetch_hits as f64 / prefetched as f64),
        }
    }
}

/// One part (weight, scales or biases) of one projection: per expert, where its bytes are.
struct PartSource {
    /// The tensor as named in the files (for errors), per expert.
    names: Vec<String>,
    at: Vec<(Arc<File>, Arc<PathBuf>, u64)>,
    shape: Vec<i32>,
    dtype: Dtype,
    bytes: usize,
    /// Some(k): the file holds this part's rows interleaved with another part's (gpt-oss's released
    /// `gate_up_proj_blocks`: row r is the file's row 2r + k), so a read covers both, and the rows
    /// with parity k are kept.
    interleaved: Option<usize>,
}

impl PartSource {
    /// Bytes one expert's read of this part covers in the file.
    fn read_len(&self) -> usize {
        if self.interleaved.is_some() {
            2 * self.bytes
        } else {
            self.bytes
        }
    }

    /// This part of one expert from the bytes its read returned.
    fn array(&self, b: &[u8]) -> Result<Array> {
        let Some(k) = self.interleaved else {
            return Array::from_bytes(b, &self.shape, self.dtype);
        };
        let rows = self.shape.first().map_or(1, |&r| r.max(1) as usize);
        let row = self.bytes / rows;
        let picked: Vec<u8> =
            (0..rows).flat_map(|r| b[(2 * r + k) * row..(2 * r + k + 1) * row].iter().copied()).collect();
        Array::from_bytes(&picked, &self.shape, self.dtype)
    }
}

/// Whether streamed layers read ahead by default (measured: bench/RESULTS.md, paged experts).
pub const PREFETCH_DEFAULT: bool = true;

/// Positional reads of some experts of one layer, in flight on the reader pool.
struct Inflight {
    layer: u32,
    experts: Vec<u32>,
    src: Arc<LayerSrc>,
    rx: Receiver<(usize, std::io::Result<Vec<u8>>)>,
    /// By tag (expert position × parts + part): what came back.
    bufs: Vec<Option<std::io::Result<Vec<u8>>>>,
}

/// The parts of a layer's experts in read order: (projection, part).
fn part_order(src: &LayerSrc) -> Vec<(usize, usize)> {
    src.iter().enumerate().flat_map(|(i, ps)| (0..ps.len()).map(move |j| (i, j))).collect()
}

impl Inflight {
    /// Every part of every one of `experts` one positional read, all queued at once.
    fn start(layer: u32, src: Arc<LayerSrc>, experts: Vec<u32>) -> Result<Inflight> {
        let order = part_order(&src);
        let (tx, rx) = channel();
        for (n, &e) in experts.iter().enumerate() {
            for (f, &(i, j)) in order.iter().enumerate() {
                let p = &src[i][j];
                let (file, _, off) = &p.at[e as usize];
                pool().send(Job {
                    file: file.clone(),
                    offset: *off,
                    len: p.read_len(),
                    tag: n * order.len() + f,
                    reply: tx.clone(),
                })?;
            }
        }
        let bufs = (0..experts.len() * order.len()).map(|_| None).collect();
        Ok(Inflight { layer, experts, src, rx, bufs })
    }

    /// The experts at positions `want` of the set, waiting for their reads.
    fn take(&mut self, want: &[usize]) -> Result<Vec<ExpertParts>> {
        let order = part_order(&self.src);
        let per = order.len();
        let complete = |bufs: &[Option<std::io::Result<Vec<u8>>>]| {
            want.iter().all(|&n| bufs[n * per..(n + 1) * per].iter().all(Option::is_some))
        };
        while !complete(&self.bufs) {
            let (tag, res) =
                self.rx.recv().map_err(|_| Error::ModelLoad("the expert reader threads stopped".into()))?;
            self.bufs[tag] = Some(res);
        }
        let mut out = Vec::with_capacity(want.len());
        for &n in want {
            let e = self.experts[n] as usize;
            let mut parts = ExpertParts { projs: Default::default() };
            for (f, &(i, j)) in order.iter().enumerate() {
                let p = &self.src[i][j];
                match self.bufs[n * per + f].take() {
                    Some(Ok(b)) => parts.projs[i].push(p.array(&b)?),
                    Some(Err(err)) => {
                        return Err(Error::ModelLoad(format!(
                            "reading expert {e} of weight {} from {} failed ({err}): the file changed or is truncated \
                             since the model was loaded; re-download the model",
                            p.names[e],
                            p.at[e].1.display()
                        )))
                    }
                    None => return Err(Error::ModelLoad("an expert read did not complete".into())),
                }
            }
            out.push(parts);
        }
        Ok(out)
    }
}

/// Experts of one layer read from the safetensors files on demand.
pub struct StreamedExperts {
    layer: u32,
    /// gate, up, down: their parts.
    src: Arc<LayerSrc>,
    q: Option<QuantSpec>,
    ctx: Arc<Streaming>,
    counts_tokens: bool,
}

/// Where a MoE layer's experts are.
pub enum ExpertStore {
    Resident { gate: SwitchLinear, up: SwitchLinear, down: SwitchLinear },
    Streamed(StreamedExperts),
}

const PROJS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl StreamedExperts {
    /// The experts `{prefix}.{gate,up,down}_proj` of `count` experts: their shapes checked as the
    /// resident load checks them (the lazily loaded arrays are dropped unread), then located in the
    /// files: the stacked tensor itself, else `{parent}.experts.{e}.{proj}.*` (Hugging Face layout).
    pub fn load(
        ws: &mut Weights,
        ctx: Arc<Streaming>,
        prefix: &str,
        count: i32,
        hidden: i32,
        inter: i32,
    ) -> Result<StreamedExperts> {
        let dims = [(inter, hidden), (inter, hidden), (hidden, inter)];
        let mut q = None;
        let mut src: [Vec<PartSource>; 3] = Default::default();
        for (i, proj) in PROJS.iter().enumerate() {
            let p = format!("{prefix}.{proj}");
            let (out, inp) = dims[i];
            let parts: Vec<(&str, Array)> = match ws.take_experts(&p, count, out, inp)? {
                Matrix::Dense(w) => vec![("weight", w)],
                Matrix::Quant { w, scales, biases, q: spec } => {
                    q = Some(spec);
                    let mut v = vec![("weight", w), ("scales", scales)];
                    v.extend(biases.map(|b| ("biases", b)));
                    v
                }
            };
            for (part, stacked) in parts {
                src[i].push(locate(ws, prefix, proj, part, count, &stacked)?);
            }
        }
        let src = Arc::new(src);
        let layer = {
            let mut srcs = ctx.sources();
            srcs.push((src.clone(), None));
            ctx.layers.fetch_add(1, Ordering::Relaxed);
            srcs.len() as u32 - 1
        };
        let per_expert: usize = src.iter().flatten().map(|p| p.bytes).sum();
        ctx.streamed_bytes.fetch_add((per_expert * count as usize) as u64, Ordering::Relaxed);
        ctx.expert_bytes.fetch_max(per_expert as u64, Ordering::Relaxed);
        Ok(StreamedExperts { layer, src, q, ctx, counts_tokens: layer == 0 })
    }

    /// Register how this layer routes, so that the streamed layer before it can read its likely
    /// experts ahead ([`Predictor`]).
    pub fn set_predictor(&self, f: Predictor) {
        if let Some(s) = self.ctx.sources().get_mut(self.layer as usize) {
            s.1 = Some(f);
        }
    }

    /// The next streamed layer's router, when prefetching and it registered one.
    pub fn next_predictor(&self) -> Option<Predictor> {
        self.ctx.next_predictor(self.layer)
    }

    /// Bytes of one expert (all its parts).
    pub fn expert_bytes(&self) -> usize {
        self.src.iter().flatten().map(|p| p.bytes).sum()
    }

    /// The compact SwitchLinears of `experts` (in that order), from the cache, the reads the layer
    /// before started for this one, or the files. `next`: the next streamed layer's predicted
    /// experts, read ahead (queued after this layer's own reads) while this layer computes.
    pub fn fetch(&self, experts: &[u32], next: Option<&[i32]>) -> Result<[SwitchLinear; 3]> {
        let mut have: Vec<Option<Arc<ExpertParts>>> = {
            let mut c = self.ctx.lock();
            experts.iter().map(|&e| c.get(&(self.layer, e))).collect()
        };
        let missing: Vec<usize> = (0..experts.len()).filter(|&i| have[i].is_none()).collect();
        let st = &self.ctx.stats;
        st.hits.fetch_add((experts.len() - missing.len()) as u64, Ordering::Relaxed);
        st.misses.fetch_add(missing.len() as u64, Ordering::Relaxed);
        let t0 = Instant::now();
        // the misses read ahead by the layer before (their position in its set), and the rest
        let mut pending = self.ctx.take_pending(self.layer);
        let (mut ahead, mut now) = (Vec::new(), Vec::new());
        for &i in &missing {
            match pending.as_ref().and_then(|p| p.experts.iter().position(|&e| e == experts[i])) {
                Some(n) => ahead.push((i, n)),
                None => now.push(i),
            }
        }
        let mut reads = if now.is_empty() {
            None
        } else {
            Some(Inflight::start(self.layer, self.src.clone(), now.iter().map(|&i| experts[i]).collect())?)
        };
        let bytes = self.expert_bytes();
        let read: usize = self.src.iter().flatten().map(PartSource::read_len).sum();
        st.bytes_read.fetch_add((now.len() * read) as u64, Ordering::Relaxed);
        st.prefetch_hits.fetch_add(ahead.len() as u64, Ordering::Relaxed);
        if let Some(next) = next {
            self.ctx.prefetch(self.layer + 1, next)?;
        }
        let mut got: Vec<(usize, ExpertParts)> = Vec::with_capacity(missing.len());
        if let Some(p) = pending.as_mut() {
            let parts = p.take(&ahead.iter().map(|a| a.1).collect::<Vec<_>>())?;
            got.extend(ahead.iter().map(|a| a.0).zip(parts));
        }
        drop(pending);
        if let Some(r) = reads.as_mut() {
            got.extend(now.iter().copied().zip(r.take(&(0..now.len()).collect::<Vec<_>>())?));
        }
        st.read_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if !got.is_empty() {
            let mut c = self.ctx.lock();
            for (i, parts) in got {
                let parts = Arc::new(parts);
                c.insert((self.layer, experts[i]), parts.clone(), bytes);
                have[i] = Some(parts);
            }
        }
        let have: Vec<Arc<ExpertParts>> = have.into_iter().map(|h| h.expect("filled above")).collect();
        let proj = |i: usize| -> Result<SwitchLinear> {
            let stack = |j: usize| -> Result<Array> {
                let parts: Vec<&Array> = have.iter().map(|h| &h.projs[i][j]).collect();
                mx::stack(&parts, 0)
            };
            let w = stack(0)?;
            Ok(match self.q {
                None => SwitchLinear::Dense { wt: mx::swapaxes(&w, -1, -2)?, w },
                Some(q) => SwitchLinear::Quant {
                    w,
                    scales: stack(1)?,
                    biases: if self.src[i].len() > 2 { Some(stack(2)?) } else { None },
                    q,
                },
            })
        };
        Ok([proj(0)?, proj(1)?, proj(2)?])
    }

    /// Count the tokens of a step (the first streamed layer only).
    pub fn count_tokens(&self, n: u64) {
        if self.counts_tokens {
            self.ctx.stats.tokens.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Locate one part of one projection: the stacked tensor `{prefix}.{proj}.{part}` (expert e's
/// rows by offset), else the per-expert tensors `{parent}.experts.{e}.{proj}.{part}`; each checked
/// against the stacked array's (already validated) shape and dtype.
fn locate(ws: &Weights, prefix: &str, proj: &str, part: &str, count: i32, stacked: &Array) -> Result<PartSource> {
    let shape: Vec<i32> = stacked.shape()[1..].to_vec();
    let dtype = stacked.dtype();
    let bytes = shape.iter().map(|&d| d as usize).product::<usize>() * dtype.size();
    let name = format!("{prefix}.{proj}.{part}");
    if let Some(l) = ws.location(&name) {
        let e = &l.entry;
        if e.shape.first() != Some(&count)
            || e.shape[1..] != shape[..]
            || e.mlx_dtype() != dtype
            || e.nbytes() != (bytes * count as usize) as u64
        {
            return Err(Error::ModelLoad(format!(
                "weight {name} in {} is {} {:?} but {count} experts of {} {shape:?} were expected: the checkpoint \
                 does not match config.json",
                l.path.display(),
                e.dtype,
                e.shape,
                dtype.name()
            )));
        }
        let base = l.data_start + e.begin;
        return Ok(PartSource {
            names: (0..count).map(|_| name.clone()).collect(),
            at: (0..count as u64).map(|i| (l.file.clone(), l.path.clone(), base + i * bytes as u64)).collect(),
            shape,
            dtype,
            bytes,
            interleaved: None,
        });
    }
    let parent = prefix.strip_suffix(".switch_mlp").or_else(|| prefix.strip_suffix(".switch_glu")).unwrap_or(prefix);
    // the Hugging Face fused layout (Qwen3.5-MoE, Gemma 4): `experts.gate_up_proj` [experts, 2 ×
    // width, hidden], gate rows first, and `experts.down_proj` [experts, hidden, width], no suffix
    if part == "weight" {
        let (fused, halves, within) = match proj {
            "gate_proj" => ("gate_up_proj", 2u64, 0u64),
            "up_proj" => ("gate_up_proj", 2, 1),
            _ => ("down_proj", 1, 0),
        };
        for n in [format!("{parent}.experts.{fused}"), format!("{parent}.{fused}")] {
            let Some(l) = ws.location(&n) else { continue };
            let e = &l.entry;
            let mut want = vec![count, shape[0] * halves as i32];
            want.extend_from_slice(&shape[1..]);
            if e.shape != want || e.mlx_dtype() != dtype || e.nbytes() != bytes as u64 * halves * count as u64 {
                return Err(Error::ModelLoad(format!(
                    "weight {n} in {} is {} {:?} but {want:?} {} was expected: the checkpoint does not match config.json",
                    l.path.display(),
                    e.dtype,
                    e.shape,
                    dtype.name()
                )));
            }
            let base = l.data_start + e.begin;
            let slab = bytes as u64 * halves;
            return Ok(PartSource {
                names: (0..count).map(|_| n.clone()).collect(),
                at: (0..count as u64)
                    .map(|i| (l.file.clone(), l.path.clone(), base + i * slab + within * bytes as u64))
                    .collect(),
                shape,
                dtype,
                bytes,
                interleaved: None,
            });
        }
    }
    // gpt-oss's released MXFP4 experts: `{fused}_blocks` uint8 [experts, rows, groups, 16] and
    // `{fused}_scales` uint8 [experts, rows, groups], gate and up rows interleaved in `gate_up_proj`
    // (the same bytes as the sanitized uint32 weight / scales, `gpt_oss::sanitize`)
    if let ("weight" | "scales", Some(fused)) = (
        part,
        match proj {
            "gate_proj" | "up_proj" => Some("gate_up_proj"),
            "down_proj" => Some("down_proj"),
            _ => None,
        },
    ) {
        let suffix = if part == "weight" { "blocks" } else { "scales" };
        for n in [format!("{parent}.{fused}_{suffix}"), format!("{parent}.experts.{fused}_{suffix}")] {
            let Some(l) = ws.location(&n) else { continue };
            let e = &l.entry;
            let halves: u64 = if fused == "gate_up_proj" { 2 } else { 1 };
            let rows = shape.first().copied().unwrap_or(0) as u64;
            if e.shape.first() != Some(&count)
                || e.shape.get(1).map(|&r| r as u64) != Some(rows * halves)
                || e.mlx_dtype() != Dtype::Uint8
                || e.nbytes() != bytes as u64 * halves * count as u64
            {
                return Err(Error::ModelLoad(format!(
                    "weight {n} in {} is {} {:?} but {count} experts of uint8 {} rows ({} bytes each) were expected: the \
                     checkpoint does not match config.json",
                    l.path.display(),
                    e.dtype,
                    e.shape,
                    rows * halves,
                    bytes as u64 * halves
                )));
            }
            let base = l.data_start + e.begin;
            let slab = bytes as u64 * halves;
            let interleaved = (halves == 2).then_some(usize::from(proj == "up_proj"));
            return Ok(PartSource {
                names: (0..count).map(|_| n.clone()).collect(),
                at: (0..count as u64).map(|i| (l.file.clone(), l.path.clone(), base + i * slab)).collect(),
                shape,
                dtype,
                bytes,
                interleaved,
            });
        }
    }
    // Mixtral's per-expert names: w1 (gate), w3 (up), w2 (down)
    let alias = match proj {
        "gate_proj" => "w1",
        "up_proj" => "w3",
        _ => "w2",
    };
    let mut names = Vec::new();
    let mut at = Vec::new();
    for i in 0..count {
        let n = format!("{parent}.experts.{i}.{proj}.{part}");
        let a = format!("{parent}.experts.{i}.{alias}.{part}");
        let (n, l) = match (ws.location(&n), ws.location(&a)) {
            (Some(l), _) => (n, l),
            (None, Some(l)) => (a, l),
            (None, None) => {
                return Err(Error::ModelLoad(format!(
                    "weight {name} (or {n}) is not in the model's safetensors files: streamed experts are read from \
                     there (weights that were not loaded from safetensors files cannot stream their experts)"
                )))
            }
        };
        if l.entry.shape != shape || l.entry.mlx_dtype() != dtype {
            return Err(Error::ModelLoad(format!(
                "weight {n} in {} is {} {:?} but {} {shape:?} was expected (like the other experts): the checkpoint \
                 does not match config.json",
                l.path.display(),
                l.entry.dtype,
                l.entry.shape,
                dtype.name()
            )));
        }
        at.push((l.file.clone(), l.path.clone(), l.data_start + l.entry.begin));
        names.push(n);
    }
    Ok(PartSource { names, at, shape, dtype, bytes, interleaved: None })
}

/// One positional read for the pool.
struct Job {
    file: Arc<File>,
    offset: u64,
    len: usize,
    tag: usize,
    reply: Sender<(usize, std::io::Result<Vec<u8>>)>,
}

/// Reader threads of the process (one pool for every streamed model).
pub const READ_THREADS: usize = 4;

struct Pool(Mutex<Sender<Job>>);

impl Pool {
    fn send(&self, j: Job) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(j)
            .map_err(|_| Error::ModelLoad("the expert reader threads stopped".into()))
    }
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..READ_THREADS {
            let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
            let _ = std::thread::Builder::new().name(format!("mlxrs-expert-io-{i}")).spawn(move || loop {
                let job = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                    Ok(j) => j,
                    Err(_) => return,
                };
                let mut buf = vec![0u8; job.len];
                let res = read_at(&job.file, &mut buf, job.offset).map(|_| buf);
                let _ = job.reply.send((job.tag, res));
            });
        }
        Pool(Mutex::new(tx))
    })
}

#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, off)
}

#[cfg(windows)]
fn read_at(f: &File, mut buf: &mut [u8], mut off: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match f.seek_read(buf, off)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                off += n as u64;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::{ExpertAct, Experts};

    /// A safetensors file of `tensors` (name, shape, f32 values), written by hand.
    fn write_safetensors(path: &std::path::Path, tensors: &[(&str, Vec<i32>, Vec<f32>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, shape, vals) in tensors {
            let begin = data.len();
            for v in vals {
                data.extend_from_slice(&v.to_le_bytes());
            }
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        let h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        std::fs::write(path, out).unwrap();
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    }

    /// Four stacked experts (hidden 64, width 32) in one file; a resident and a streamed `Experts`
    /// over it (the streamed one with room for 2 experts), run on the same inputs and routings.
    #[test]
    fn streamed_experts_match_resident_and_count_a_known_routing() {
        let dir = std::env::temp_dir().join(format!("mlxrs-experts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (e, h, i) = (4, 64, 32);
        let p = "model.layers.0.mlp.switch_mlp";
        write_safetensors(
            &dir.join("model.safetensors"),
            &[
                (&format!("{p}.gate_proj.weight"), vec![e, i, h], values((e * i * h) as usize, 1)),
                (&format!("{p}.up_proj.weight"), vec![e, i, h], values((e * i * h) as usize, 2)),
                (&format!("{p}.down_proj.weight"), vec![e, h, i], values((e * h * i) as usize, 3)),
            ],
        );
        let cfg = serde_json::json!({});
        let mut resident_w = Weights::load_dir(&dir, &cfg).unwrap();
        let resident = Experts::load(&mut resident_w, p, e, h, i).unwrap();
        let per_expert = 3 * (i * h) as usize * 4;
        let ctx = Streaming::new(Some(2 * per_expert));
        let mut streamed_w = Weights::load_dir(&dir, &cfg).unwrap();
        streamed_w.stream_experts(ctx.clone());
        let streamed = Experts::load(&mut streamed_w, p, e, h, i).unwrap();
        ctx.finish_load();
        assert_eq!(ctx.streamed_bytes(), (e as usize * per_expert) as u64);
        assert_eq!(streamed.nbytes(), 0);

        // steps of one token, top-2: {0,1} 2 misses; {1,2} 1 hit (1), 1 miss (2 evicts 0);
        // {2,0} 1 hit (2), 1 miss (0 evicts 1); {0,2} 2 hits; {3,3}: one expert twice, 1 miss
        let steps: [[i32; 2]; 5] = [[0, 1], [2, 1], [2, 0], [0, 2], [3, 3]];
        let (mut hits, mut misses) = (0u64, 0u64);
        for (n, ids) in steps.iter().enumerate() {
            let x = Array::from_slice(&values(h as usize, 10 + n as u32), &[1, 1, h]).unwrap();
            let idx = Array::from_slice(&ids.map(|v| v as u32), &[1, 1, 2]).unwrap();
            let a = resident.forward(&x, &idx).unwrap().to_vec::<f32>().unwrap();
            let b = streamed.forward(&x, &idx).unwrap().to_vec::<f32>().unwrap();
            let diff = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "step {n}: streamed differs from resident by {diff}");
            let (hh, mm) = [(0, 2), (1, 1), (1, 1), (2, 0), (0, 1)][n];
            hits += hh;
            misses += mm;
            let r = ctx.report();
            assert_eq!((r.hits, r.misses), (hits, misses), "step {n}");
            assert_eq!(r.bytes_read, misses * per_expert as u64);
            assert_eq!(r.tokens, n as u64 + 1);
            assert!(r.cache_bytes <= r.cache_budget_bytes);
        }
        // a prefill-sized step (≥ 64 pairs: the sorted path) over every expert
        let t = 40;
        let x = Array::from_slice(&values((t * h) as usize, 99), &[1, t, h]).unwrap();
        let ids: Vec<u32> = (0..t * 2).map(|j| ((j * 7 + j / 3) % e) as u32).collect();
        let idx = Array::from_slice(&ids, &[1, t, 2]).unwrap();
        let a = resident.forward(&x, &idx).unwrap().to_vec::<f32>().unwrap();
        let b = streamed.forward(&x, &idx).unwrap().to_vec::<f32>().unwrap();
        assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-5));
        let r = ctx.report();
        assert_eq!(r.tokens, 5 + t as u64);
        assert_eq!(r.cached_experts, 2);
        // an index outside the experts is refused, not read
        let bad = Array::from_slice(&[0u32, 4], &[1, 1, 2]).unwrap();
        let x = Array::from_slice(&values(h as usize, 5), &[1, 1, h]).unwrap();
        assert!(streamed.forward(&x, &bad).unwrap_err().to_string().contains("expert 4"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two streamed layers of four experts; layer 1 registers a predictor that picks a fixed set.
    /// Layer 0's step reads layer 1's predicted experts ahead (outside the cache); layer 1's step
    /// then takes the ones it routes to from there (prefetch hits) and reads the rest; the values
    /// equal the resident layers', and the cache sees the same hits and misses as without prefetch.
    #[test]
    fn prefetch_reads_the_next_layers_predicted_experts_and_counts_them() {
        let dir = std::env::temp_dir().join(format!("mlxrs-prefetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (e, h, i) = (4, 64, 32);
        let p = |l: i32| format!("model.layers.{l}.mlp.switch_mlp");
        let mut tensors = Vec::new();
        for l in 0..2 {
            tensors.push((
                format!("{}.gate_proj.weight", p(l)),
                vec![e, i, h],
                values((e * i * h) as usize, 1 + 3 * l as u32),
            ));
            tensors.push((
                format!("{}.up_proj.weight", p(l)),
                vec![e, i, h],
                values((e * i * h) as usize, 2 + 3 * l as u32),
            ));
            tensors.push((
                format!("{}.down_proj.weight", p(l)),
                vec![e, h, i],
                values((e * h * i) as usize, 3 + 3 * l as u32),
            ));
        }
        let refs: Vec<(&str, Vec<i32>, Vec<f32>)> =
            tensors.iter().map(|(n, s, v)| (n.as_str(), s.clone(), v.clone())).collect();
        write_safetensors(&dir.join("model.safetensors"), &refs);
        let cfg = serde_json::json!({});
        let per_expert = (3 * (i * h) as usize * 4) as u64;
        let mut rw = Weights::load_dir(&dir, &cfg).unwrap();
        let resident =
            [Experts::load(&mut rw, &p(0), e, h, i).unwrap(), Experts::load(&mut rw, &p(1), e, h, i).unwrap()];
        // run (layer 0 routes `a`, layer 1 routes `b`) with prefetch on or off; the stats after
        let run = |prefetch: bool, steps: &[([u32; 2], [u32; 2])]| -> ExpertReport {
            let ctx = Streaming::new(Some(2 * per_expert as usize));
            ctx.set_prefetch(prefetch);
            let mut sw = Weights::load_dir(&dir, &cfg).unwrap();
            sw.stream_experts(ctx.clone());
            let streamed =
                [Experts::load(&mut sw, &p(0), e, h, i).unwrap(), Experts::load(&mut sw, &p(1), e, h, i).unwrap()];
            ctx.finish_load();
            // layer 1's router, as the layer before sees it: always experts 1 and 2
            let ExpertStore::Streamed(s1) = &streamed[1].store else { panic!("not streamed") };
            s1.set_predictor(Arc::new(|_x: &Array| Array::from_slice(&[1i32, 2], &[1, 1, 2])));
            let ExpertStore::Streamed(s0) = &streamed[0].store else { panic!("not streamed") };
            assert_eq!(s0.next_predictor().is_some(), prefetch);
            assert!(s1.next_predictor().is_none(), "the last streamed layer has no next");
            for (n, (a, b)) in steps.iter().enumerate() {
                let x = Array::from_slice(&values(h as usize, 40 + n as u32), &[1, 1, h]).unwrap();
                for (l, ids) in [a, b].into_iter().enumerate() {
                    let idx = Array::from_slice(ids, &[1, 1, 2]).unwrap();
                    let want = resident[l].forward(&x, &idx).unwrap().to_vec::<f32>().unwrap();
                    let got = streamed[l]
                        .forward_ahead(&x, &idx, ExpertAct::Swiglu, None, Some(&x))
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap();
                    assert!(want.iter().zip(&got).all(|(p, q)| (p - q).abs() < 1e-5), "step {n} layer {l}");
                }
            }
            ctx.report()
        };
        // step 1: layer 1 routes {1, 3}: 1 was read ahead (a hit), 3 is read now, 2 was wasted;
        // step 2: of the prediction {1, 2}, 1 is still cached when layer 0 looks, so only 2 is read
        // ahead; layer 0's own reads then evict layer 1's experts (room for 2), and layer 1 routes
        // {1, 2}: 2 is taken from the reads ahead, 1 is read now
        let steps = [([0, 1], [1, 3]), ([0, 1], [1, 2])];
        let on = run(true, &steps);
        let off = run(false, &steps);
        // the cache is untouched by prefetching: same hits, misses, evictions, contents
        assert_eq!(
            (on.hits, on.misses, on.evictions, on.cached_experts),
            (off.hits, off.misses, off.evictions, off.cached_experts)
        );
        assert_eq!((off.prefetched, off.prefetch_hits, off.prefetch_hit_rate), (0, 0, None));
        assert!(!off.prefetch && on.prefetch);
        assert_eq!(off.bytes_read, off.misses * per_expert);
        // read ahead: step 1 {1, 2}, step 2 {2} (1 was cached by then)
        assert_eq!((on.prefetched, on.prefetch_hits), (3, 2));
        assert_eq!(on.prefetch_hit_rate, Some(2.0 / 3.0));
        assert_eq!(on.bytes_read, (on.misses - on.prefetch_hits + on.prefetched) * per_expert);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lru_keeps_within_its_byte_budget_evicting_the_least_recent() {
        let mut c: ExpertLru<u32, u32> = ExpertLru::new(100);
        assert!(c.insert(1, 10, 40));
        assert!(c.insert(2, 20, 40));
        assert_eq!(c.used(), 80);
        // 1 is now the most recent: inserting 3 evicts 2
        assert_eq!(c.get(&1), Some(10));
        assert!(c.insert(3, 30, 40));
        assert!(c.contains(&1) && !c.contains(&2) && c.contains(&3));
        assert_eq!((c.used(), c.len(), c.evictions()), (80, 2, 1));
        // larger than the budget: not kept, nothing evicted
        assert!(!c.insert(4, 40, 101));
        assert_eq!((c.len(), c.evictions()), (2, 1));
        // exactly the budget: everything else goes
        assert!(c.insert(5, 50, 100));
        assert_eq!((c.len(), c.used(), c.evictions()), (1, 100, 3));
        // re-inserting a key replaces it (no double count)
        assert!(c.insert(5, 55, 60));
        assert_eq!((c.len(), c.used(), c.get(&5)), (1, 60, Some(55)));
        // a smaller budget evicts down to it
        c.insert(6, 60, 30);
        c.set_budget(50);
        assert!(c.used() <= 50 && c.contains(&6) && !c.contains(&5));
        let mut z: ExpertLru<u32, u32> = ExpertLru::new(0);
        assert!(!z.insert(1, 1, 1) && z.is_empty());
    }

    #[test]
    fn lru_matches_a_reference_model() {
        // a naive reference: a Vec in recency order
        let mut seed = 12345u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        let mut c: ExpertLru<usize, usize> = ExpertLru::new(1000);
        let mut r: Vec<(usize, usize)> = Vec::new(); // (key, bytes), most recent last
        for _ in 0..5000 {
            let k = rnd() % 40;
            if rnd() % 2 == 0 {
                let got = c.get(&k).is_some();
                let pos = r.iter().position(|e| e.0 == k);
                assert_eq!(got, pos.is_some());
                if let Some(p) = pos {
                    let e = r.remove(p);
                    r.push(e);
                }
            } else {
                let b = rnd() % 300 + 1;
                c.insert(k, k, b);
                r.retain(|e| e.0 != k);
                while r.iter().map(|e| e.1).sum::<usize>() + b > 1000 {
                    r.remove(0);
                }
                r.push((k, b));
            }
            assert!(c.used() <= 1000);
            assert_eq!(c.used(), r.iter().map(|e| e.1).sum::<usize>());
            assert_eq!(c.len(), r.len());
        }
    }
}
