//! The KV cache, outside the model: one [`LayerCache`] per layer. Semantics follow mlx-lm's
//! `KVCache`, `RotatingKVCache` and `QuantizedKVCache` (same growth step, trimming and masks), so
//! that the same prompt produces the same attention inputs.
use crate::error::Result;
use crate::handle::{self as mx, Array, Dtype};
use crate::weights::QuantSpec;

const STEP: i32 = 256;

/// What a layer attends over after appending the new keys/values.
pub enum Fetched {
    Dense(Array, Array),
    Quant { k: [Array; 3], v: [Array; 3], q: QuantSpec },
}

/// An attention mask as mlx-lm passes it to SDPA.
pub enum Mask {
    None,
    Causal,
    Array(Array),
}

/// One layer's cache. Cloning is cheap (MLX arrays are reference-counted and never written in
/// place while shared): the prompt-prefix cache keeps clones as snapshots.
#[derive(Clone)]
pub enum LayerCache {
    Full(KvCache),
    Rotating(RotatingKvCache),
    Quantized(QuantizedKvCache),
}

impl LayerCache {
    pub fn full() -> LayerCache {
        LayerCache::Full(KvCache::default())
    }
    pub fn rotating(max_size: i32, keep: i32) -> LayerCache {
        LayerCache::Rotating(RotatingKvCache { keep, max_size, ..Default::default() })
    }

    /// Tokens seen so far (the RoPE offset).
    pub fn offset(&self) -> i32 {
        match self {
            LayerCache::Full(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::Quantized(c) => c.offset,
        }
    }

    /// Tokens currently held.
    pub fn size(&self) -> i32 {
        match self {
            LayerCache::Full(c) => c.offset,
            LayerCache::Rotating(c) => c.offset.min(c.max_size),
            LayerCache::Quantized(c) => c.offset,
        }
    }

    pub fn update_and_fetch(&mut self, k: Array, v: Array) -> Result<Fetched> {
        match self {
            LayerCache::Full(c) => c.update_and_fetch(&k, &v).map(|(k, v)| Fetched::Dense(k, v)),
            LayerCache::Rotating(c) => c.update_and_fetch(&k, &v).map(|(k, v)| Fetched::Dense(k, v)),
            LayerCache::Quantized(c) => c.update_and_fetch(&k, &v),
        }
    }

    /// mlx-lm's `make_mask` for a chunk of `n` tokens (before this chunk is appended).
    pub fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask> {
        match self {
            LayerCache::Full(KvCache { offset, .. }) | LayerCache::Quantized(QuantizedKvCache { offset, .. }) => {
                match window {
                    Some(w) => Ok(Mask::Array(causal_mask(n, *offset, Some(w))?)),
                    None if n == 1 => Ok(Mask::None),
                    None => Ok(Mask::Causal),
                }
            }
            LayerCache::Rotating(c) => c.make_mask(n, window),
        }
    }

    /// Whether [`LayerCache::trim`] can drop the last `n` tokens (a rotating cache only before it
    /// wrapped, as mlx-lm's `is_trimmable`).
    pub fn can_trim(&self, n: i32) -> bool {
        match self {
            LayerCache::Full(c) => n <= c.offset,
            LayerCache::Quantized(c) => n <= c.offset,
            LayerCache::Rotating(c) => n == 0 || (c.offset < c.max_size && n <= c.offset),
        }
    }

    /// Drop the last `n` tokens (where the cache allows it); returns how many were dropped.
    pub fn trim(&mut self, n: i32) -> i32 {
        match self {
            LayerCache::Full(c) => {
                let n = n.min(c.offset);
                c.offset -= n;
                n
            }
            LayerCache::Quantized(c) => {
                let n = n.min(c.offset);
                c.offset -= n;
                n
            }
            LayerCache::Rotating(c) => {
                if c.offset >= c.max_size {
                    return 0;
                }
                let n = n.min(c.offset);
                c.offset -= n;
                c.idx -= n;
                n
            }
        }
    }

    /// Convert a full cache to a quantized one (mlx-lm's `maybe_quantize_kv_cache`).
    pub fn quantize(&mut self, q: QuantSpec) -> Result<()> {
        if let LayerCache::Full(c) = self {
            let mut qc = QuantizedKvCache { offset: c.offset, q, keys: None, values: None };
            if let (Some(k), Some(v)) = (&c.keys, &c.values) {
                let (a, b, d) = mx::quantize(k, q.group_size, q.bits)?;
                let (e, f, g) = mx::quantize(v, q.group_size, q.bits)?;
                qc.keys = Some([a, b, d]);
                qc.values = Some([e, f, g]);
            }
            *self = LayerCache::Quantized(qc);
        }
        Ok(())
    }

    /// The arrays that hold state (evaluated after each prefill chunk).
    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Full(c) => c.keys.iter().chain(c.values.iter()).collect(),
            LayerCache::Rotating(c) => c.keys.iter().chain(c.values.iter()).collect(),
            LayerCache::Quantized(c) => c.keys.iter().flatten().chain(c.values.iter().flatten()).collect(),
        }
    }

    /// Bytes held by this layer's buffers.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
}

/// `linds >= rinds` (and within `window`) for queries at offset..offset+n over keys 0..offset+n.
pub fn causal_mask(n: i32, offset: i32, window: Option<i32>) -> Result<Array> {
    let r = mx::arange(0.0, (offset + n) as f64, 1.0, Dtype::Int32)?;
    let l = mx::arange(offset as f64, (offset + n) as f64, 1.0, Dtype::Int32)?;
    let l = mx::expand_dims(&l, 1)?;
    let r = mx::expand_dims(&r, 0)?;
    let mut m = mx::greater_equal(&l, &r)?;
    if let Some(w) = window {
        let rw = mx::add(&r, &Array::scalar(w)?)?;
        m = mx::logical_and(&m, &mx::less(&l, &rw)?)?;
    }
    Ok(m)
}

fn seq_slice(a: &Array, lo: i32, hi: i32) -> Result<Array> {
    mx::slice_axis(a, 2, lo, hi)
}

fn write_seq(buf: &Array, upd: &Array, at: i32) -> Result<Array> {
    let sh = buf.shape();
    let n = upd.dim(2);
    mx::slice_update(buf, upd, &[0, 0, at, 0], &[sh[0], sh[1], at + n, sh[3]], &[1, 1, 1, 1])
}

/// Growing buffer in steps of 256 (mlx-lm `KVCache`).
#[derive(Clone, Default)]
pub struct KvCache {
    pub keys: Option<Array>,
    pub values: Option<Array>,
    pub offset: i32,
}

impl KvCache {
    fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let prev = self.offset;
        let n = k.dim(2);
        let cap = self.keys.as_ref().map_or(0, |a| a.dim(2));
        if self.keys.is_none() || prev + n > cap {
            let ks = k.shape();
            let vs = v.shape();
            let steps = (STEP + n - 1) / STEP;
            let new_k = mx::zeros(&[ks[0], ks[1], steps * STEP, ks[3]], k.dtype())?;
            let new_v = mx::zeros(&[vs[0], vs[1], steps * STEP, vs[3]], v.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut ok), Some(mut ov)) => {
                    if prev % STEP != 0 {
                        ok = seq_slice(&ok, 0, prev)?;
                        ov = seq_slice(&ov, 0, prev)?;
                    }
                    self.keys = Some(mx::concatenate(&[&ok, &new_k], 2)?);
                    self.values = Some(mx::concatenate(&[&ov, &new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += n;
        let keys = write_seq(self.keys.as_ref().expect("allocated"), k, prev)?;
        let values = write_seq(self.values.as_ref().expect("allocated"), v, prev)?;
        let out = (seq_slice(&keys, 0, self.offset)?, seq_slice(&values, 0, self.offset)?);
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(out)
    }
}

/// Fixed-size ring buffer keeping the first `keep` tokens (mlx-lm `RotatingKVCache`).
#[derive(Clone, Default)]
pub struct RotatingKvCache {
    pub keys: Option<Array>,
    pub values: Option<Array>,
    pub offset: i32,
    pub max_size: i32,
    pub keep: i32,
    idx: i32,
}

impl RotatingKvCache {
    fn trim_buf(&self, trim: i32, v: &Array, append: Option<&Array>) -> Result<Array> {
        let mut parts = Vec::new();
        if trim > 0 {
            parts.push(seq_slice(v, 0, self.keep)?);
            parts.push(seq_slice(v, trim + self.keep, v.dim(2))?);
        } else {
            parts.push(v.clone());
        }
        if let Some(a) = append {
            parts.push(a.clone());
        }
        let refs: Vec<&Array> = parts.iter().collect();
        mx::concatenate(&refs, 2)
    }

    fn temporal_order(&self, v: &Array) -> Result<Array> {
        let len = v.dim(2);
        if self.idx == len {
            Ok(v.clone())
        } else if self.idx < self.offset {
            let a = seq_slice(v, 0, self.keep)?;
            let b = seq_slice(v, self.idx, len)?;
            let c = seq_slice(v, self.keep, self.idx)?;
            mx::concatenate(&[&a, &b, &c], 2)
        } else {
            seq_slice(v, 0, self.idx)
        }
    }

    fn update_concat(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        match (self.keys.take(), self.values.take()) {
            (Some(ok), Some(ov)) => {
                let ok = self.temporal_order(&ok)?;
                let ov = self.temporal_order(&ov)?;
                self.idx = ok.dim(2);
                let trim = self.idx - self.max_size + 1;
                self.keys = Some(self.trim_buf(trim, &ok, Some(k))?);
                self.values = Some(self.trim_buf(trim, &ov, Some(v))?);
            }
            _ => {
                self.keys = Some(k.clone());
                self.values = Some(v.clone());
            }
        }
        self.offset += k.dim(2);
        self.idx = self.keys.as_ref().expect("set").dim(2);
        Ok((self.keys.clone().expect("set"), self.values.clone().expect("set")))
    }

    fn update_in_place(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let ks = k.shape();
        let s = ks[2];
        let prev = self.offset;
        let cap = self.keys.as_ref().map_or(0, |a| a.dim(2));
        if self.keys.is_none() || (prev >= cap && cap < self.max_size) {
            let new_size = STEP.min(self.max_size - prev);
            let vs = v.shape();
            let new_k = mx::zeros(&[ks[0], ks[1], new_size, ks[3]], k.dtype())?;
            let new_v = mx::zeros(&[vs[0], vs[1], new_size, vs[3]], v.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(ok), Some(ov)) => {
                    self.keys = Some(mx::concatenate(&[&ok, &new_k], 2)?);
                    self.values = Some(mx::concatenate(&[&ov, &new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
            self.idx = prev;
        }
        let cap = self.keys.as_ref().expect("allocated").dim(2);
        let trim = cap - self.max_size;
        if trim > 0 {
            let ok = self.keys.take().expect("allocated");
            let ov = self.values.take().expect("allocated");
            self.keys = Some(self.trim_buf(trim, &ok, None)?);
            self.values = Some(self.trim_buf(trim, &ov, None)?);
            self.idx = self.max_size;
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        let keys = write_seq(self.keys.as_ref().expect("allocated"), k, self.idx)?;
        let values = write_seq(self.values.as_ref().expect("allocated"), v, self.idx)?;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        self.offset += s;
        self.idx += s;
        if self.offset < self.max_size {
            return Ok((seq_slice(&keys, 0, self.offset)?, seq_slice(&values, 0, self.offset)?));
        }
        Ok((keys, values))
    }

    fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        if k.dim(2) == 1 {
            self.update_in_place(k, v)
        } else {
            self.update_concat(k, v)
        }
    }

    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask> {
        if n > 1 {
            let w = window.unwrap_or(self.max_size);
            let offset = (self.max_size - 1).min(self.offset);
            if offset + n > w {
                Ok(Mask::Array(causal_mask(n, offset, Some(w))?))
            } else {
                Ok(Mask::Causal)
            }
        } else {
            match window {
                Some(w) if self.offset >= w && self.max_size > w => {
                    let mut idx = self.idx;
                    if idx >= self.max_size {
                        idx = 0;
                    }
                    let size = if self.offset < self.max_size { self.offset + 1 } else { self.max_size };
                    let ar = mx::arange(0.0, size as f64, 1.0, Dtype::Int32)?;
                    let m = mx::greater_equal(&ar, &Array::scalar(size - w)?)?;
                    // roll right by idx + 1
                    let shift = (idx + 1).rem_euclid(size.max(1));
                    let rolled = if shift == 0 {
                        m
                    } else {
                        let a = mx::slice_axis(&m, 0, size - shift, size)?;
                        let b = mx::slice_axis(&m, 0, 0, size - shift)?;
                        mx::concatenate(&[&a, &b], 0)?
                    };
                    Ok(Mask::Array(rolled))
                }
                _ => Ok(Mask::None),
            }
        }
    }
}

/// Keys and values stored MLX-quantized (mlx-lm `QuantizedKVCache`).
#[derive(Clone)]
pub struct QuantizedKvCache {
    pub keys: Option<[Array; 3]>,
    pub values: Option<[Array; 3]>,
    pub offset: i32,
    pub q: QuantSpec,
}

impl QuantizedKvCache {
    pub fn new(q: QuantSpec) -> Self {
        QuantizedKvCache { keys: None, values: None, offset: 0, q }
    }

    fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<Fetched> {
        let ks = k.shape();
        let (b, h, n, kd) = (ks[0], ks[1], ks[2], ks[3]);
        let vd = v.dim(3);
        let prev = self.offset;
        let cap = self.keys.as_ref().map_or(0, |a| a[0].dim(2));
        if self.keys.is_none() || prev + n > cap {
            let el_per_int = 32 / self.q.bits;
            let new_steps = (STEP + n - 1) / STEP * STEP;
            let init = |dim: i32| -> Result<[Array; 3]> {
                Ok([
                    mx::zeros(&[b, h, new_steps, dim / el_per_int], Dtype::Uint32)?,
                    mx::zeros(&[b, h, new_steps, dim / self.q.group_size], k.dtype())?,
                    mx::zeros(&[b, h, new_steps, dim / self.q.group_size], k.dtype())?,
                ])
            };
            match (self.keys.take(), self.values.take()) {
                (Some(ok), Some(ov)) => {
                    let expand = |parts: [Array; 3]| -> Result<[Array; 3]> {
                        let mut out = Vec::with_capacity(3);
                        for x in parts {
                            let x = if prev % STEP != 0 { seq_slice(&x, 0, prev)? } else { x };
                            let sh = x.shape();
                            let z = mx::zeros(&[b, h, new_steps, sh[3]], x.dtype())?;
                            out.push(mx::concatenate(&[&x, &z], 2)?);
                        }
                        let mut it = out.into_iter();
                        Ok([it.next().expect("3"), it.next().expect("3"), it.next().expect("3")])
                    };
                    self.keys = Some(expand(ok)?);
                    self.values = Some(expand(ov)?);
                }
                _ => {
                    self.keys = Some(init(kd)?);
                    self.values = Some(init(vd)?);
                }
            }
        }
        self.offset += n;
        let (qk0, qk1, qk2) = mx::quantize(k, self.q.group_size, self.q.bits)?;
        let (qv0, qv1, qv2) = mx::quantize(v, self.q.group_size, self.q.bits)?;
        let write = |buf: &[Array; 3], new: [&Array; 3]| -> Result<[Array; 3]> {
            Ok([write_seq(&buf[0], new[0], prev)?, write_seq(&buf[1], new[1], prev)?, write_seq(&buf[2], new[2], prev)?])
        };
        let keys = write(self.keys.as_ref().expect("allocated"), [&qk0, &qk1, &qk2])?;
        let values = write(self.values.as_ref().expect("allocated"), [&qv0, &qv1, &qv2])?;
        let cut = |a: &[Array; 3]| -> Result<[Array; 3]> {
            Ok([seq_slice(&a[0], 0, self.offset)?, seq_slice(&a[1], 0, self.offset)?, seq_slice(&a[2], 0, self.offset)?])
        };
        let out = Fetched::Quant { k: cut(&keys)?, v: cut(&values)?, q: self.q };
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(out)
    }
}

/// Options that shape the cache a model makes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheOptions {
    /// Rotating cache of this size (keep 4) for layers that would otherwise grow without bound.
    pub max_kv_size: Option<i32>,
}

/// The caches of the sequences one forward pass runs over: row `b` of the batch appends to
/// `seqs[b]` (one [`LayerCache`] per layer). One sequence is the plain case; the engine's batched
/// decode step passes several, each with its own length, offset and cache kinds (full, rotating,
/// quantized), so that attention runs per sequence over exactly the keys that sequence alone would
/// see (docs/design/scheduler.md says why, and what it costs).
pub struct Caches<'a> {
    seqs: Vec<&'a mut [LayerCache]>,
}

impl<'a> Caches<'a> {
    pub fn one(c: &'a mut [LayerCache]) -> Caches<'a> {
        Caches { seqs: vec![c] }
    }

    pub fn many(seqs: Vec<&'a mut [LayerCache]>) -> Caches<'a> {
        Caches { seqs }
    }

    /// Number of sequences (the batch size).
    pub fn batch(&self) -> usize {
        self.seqs.len()
    }

    /// Layers per sequence.
    pub fn layers(&self) -> usize {
        self.seqs.first().map_or(0, |s| s.len())
    }

    /// Each sequence's mask for a chunk of `n` new tokens at layer `layer`.
    pub fn masks(&self, layer: usize, n: i32, window: Option<i32>) -> Result<Vec<Mask>> {
        let layer = layer.min(self.layers().saturating_sub(1));
        self.seqs.iter().map(|s| s[layer].make_mask(n, window)).collect()
    }

    /// Layer `i`'s cache of every sequence, in batch order.
    pub fn layer_mut(&mut self, i: usize) -> Vec<&mut LayerCache> {
        self.seqs.iter_mut().map(|s| &mut s[i]).collect()
    }

    /// The state arrays of layers `lo..=hi` of every sequence.
    pub fn state(&self, lo: usize, hi: usize) -> Vec<&Array> {
        self.seqs.iter().flat_map(|s| s[lo..=hi].iter().flat_map(|c| c.state())).collect()
    }
}
