//! The KV cache, outside the model: one [`LayerCache`] per layer. Semantics follow mlx-lm's
//! `KVCache`, `RotatingKVCache` and `QuantizedKVCache` (same growth step, trimming and masks), so
//! that the same prompt produces the same attention inputs.
use crate::error::Result;
use crate::handle::{self as mx, Array, Dtype};
use crate::weights::QuantSpec;

const STEP: i32 = 256;

/// What a layer attends over after appending the new keys/values.
#[derive(Clone)]
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
    /// A linear-attention layer's fixed-size state (no KV): [`RecurrentCache`].
    Recurrent(RecurrentCache),
}

impl LayerCache {
    pub fn full() -> LayerCache {
        LayerCache::Full(KvCache::default())
    }
    pub fn rotating(max_size: i32, keep: i32) -> LayerCache {
        LayerCache::Rotating(RotatingKvCache { keep, max_size, ..Default::default() })
    }

    pub fn recurrent() -> LayerCache {
        LayerCache::Recurrent(RecurrentCache::default())
    }

    /// Tokens seen so far (the RoPE offset).
    pub fn offset(&self) -> i32 {
        match self {
            LayerCache::Full(c) => c.offset,
            LayerCache::Rotating(c) => c.offset,
            LayerCache::Quantized(c) => c.offset,
            LayerCache::Recurrent(c) => c.offset,
        }
    }

    pub fn update_and_fetch(&mut self, k: Array, v: Array) -> Result<Fetched> {
        match self {
            LayerCache::Full(c) => c.update_and_fetch(&k, &v).map(|(k, v)| Fetched::Dense(k, v)),
            LayerCache::Rotating(c) => c.update_and_fetch(&k, &v).map(|(k, v)| Fetched::Dense(k, v)),
            LayerCache::Quantized(c) => c.update_and_fetch(&k, &v),
            LayerCache::Recurrent(_) => Err(crate::error::Error::Invalid(
                "a recurrent (linear-attention) layer cache holds no keys/values".into(),
            )),
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
            // mlx-lm's ArraysCache.make_mask without padding or lengths: no mask
            LayerCache::Recurrent(_) => Ok(Mask::None),
        }
    }

    /// Whether [`LayerCache::trim`] can drop the last `n` tokens (a rotating cache only before it
    /// wrapped, as mlx-lm's `is_trimmable`).
    pub fn can_trim(&self, n: i32) -> bool {
        match self {
            LayerCache::Full(c) => n <= c.offset,
            LayerCache::Quantized(c) => n <= c.offset,
            LayerCache::Rotating(c) => n == 0 || (c.offset < c.max_size && n <= c.offset),
            // a recurrent state cannot be rewound: it is reused only whole
            LayerCache::Recurrent(_) => n == 0,
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
            LayerCache::Recurrent(_) => 0,
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
            LayerCache::Recurrent(c) => c.conv.iter().chain(c.state.iter()).collect(),
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

/// Rows added once to a growing KV buffer on MLX's CUDA backend so that its capacity is never a
/// multiple of 256. MLX 0.32's CUDA attention runs a one-token query through cuDNN whenever the keys
/// are a slice of a buffer whose capacity is a multiple of 256 (`use_cudnn_for_decoding`, written for
/// mlx-lm's 256-step `KVCache`): it attends over the whole buffer with a padding mask and builds two
/// small device arrays per call, and measured on the H200 a 1B bf16 model decodes at 396 tokens/s that
/// way against 596 through MLX's own one-query kernel (`sdpa_vector`), which the padded capacity selects
/// (bench/RESULTS-gpu.md). Prompts (more than one query) still go to cuDNN. 0 elsewhere, and with
/// `MLXRS_KV_PAD=0`.
pub(crate) fn capacity_pad() -> i32 {
    // read at each growth (every 256 rows), so a benchmark can switch it between requests
    if crate::plan::Backend::cuda() && !std::env::var("MLXRS_KV_PAD").is_ok_and(|v| v.trim() == "0") {
        8
    } else {
        0
    }
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
        self.update_and_fetch_padded(k, v, capacity_pad())
    }

    fn update_and_fetch_padded(&mut self, k: &Array, v: &Array, pad: i32) -> Result<(Array, Array)> {
        let (keys, values) = self.append_padded(k, v, pad)?;
        self.view(&keys, &values)
    }

    /// Append `k`, `v` `[B, kv_heads, n, head_dim]`: the whole buffers after the write (their first
    /// `offset` positions filled; [`KvCache::view`] cuts them there), for a reader that takes the
    /// buffers with the positions ([`crate::models::decode_attn`]).
    pub fn append(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        self.append_padded(k, v, capacity_pad())
    }

    fn append_padded(&mut self, k: &Array, v: &Array, pad: i32) -> Result<(Array, Array)> {
        let prev = self.offset;
        let n = k.dim(2);
        let cap = self.keys.as_ref().map_or(0, |a| a.dim(2));
        if self.keys.is_none() || prev + n > cap {
            let ks = k.shape();
            let vs = v.shape();
            let steps = (STEP + n - 1) / STEP;
            // on CUDA the capacity is kept at a whole number of steps plus `capacity_pad()` rows
            let first = if self.keys.is_none() { pad } else { 0 };
            let new_k = mx::zeros(&[ks[0], ks[1], steps * STEP + first, ks[3]], k.dtype())?;
            let new_v = mx::zeros(&[vs[0], vs[1], steps * STEP + first, vs[3]], v.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut ok), Some(mut ov)) => {
                    // mlx-lm's rule: a buffer not filled to a step boundary is cut at `prev`; with a
                    // pad, what is kept is `prev` and the zero rows up to the capacity's residue (so
                    // the new capacity is again whole steps plus the pad)
                    let keep = if pad > 0 {
                        prev + (cap - prev) % STEP
                    } else if prev % STEP != 0 {
                        prev
                    } else {
                        cap
                    };
                    if keep < cap {
                        ok = seq_slice(&ok, 0, keep)?;
                        ov = seq_slice(&ov, 0, keep)?;
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
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values))
    }

    /// The filled part (`..offset`) of buffers [`KvCache::append`] returned.
    pub fn view(&self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        Ok((seq_slice(keys, 0, self.offset)?, seq_slice(values, 0, self.offset)?))
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
            Ok([
                write_seq(&buf[0], new[0], prev)?,
                write_seq(&buf[1], new[1], prev)?,
                write_seq(&buf[2], new[2], prev)?,
            ])
        };
        let keys = write(self.keys.as_ref().expect("allocated"), [&qk0, &qk1, &qk2])?;
        let values = write(self.values.as_ref().expect("allocated"), [&qv0, &qv1, &qv2])?;
        let cut = |a: &[Array; 3]| -> Result<[Array; 3]> {
            Ok([
                seq_slice(&a[0], 0, self.offset)?,
                seq_slice(&a[1], 0, self.offset)?,
                seq_slice(&a[2], 0, self.offset)?,
            ])
        };
        let out = Fetched::Quant { k: cut(&keys)?, v: cut(&values)?, q: self.q };
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(out)
    }
}

/// The state of a linear-attention (Gated DeltaNet) layer, mlx-lm's `ArraysCache(size=2)`: the
/// last `kernel - 1` inputs of the causal depthwise convolution `conv` `[B, kernel-1, conv_dim]`
/// and the recurrent state `state` `[B, Hv, Dv, Dk]` (float32). Both are replaced, never written
/// in place, so a clone is a snapshot. Its size does not depend on the tokens seen; it cannot be
/// trimmed (a snapshot is reused only at exactly the tokens it holds).
#[derive(Clone, Default)]
pub struct RecurrentCache {
    pub conv: Option<Array>,
    pub state: Option<Array>,
    /// Tokens seen.
    pub offset: i32,
    /// Qwen3.5 after images: how far the sequence's rotary positions run behind its token count
    /// (M-RoPE gives an image fewer positions than tokens); None: a text-only sequence. Kept here
    /// because it belongs to the sequence, and every Qwen3.5 sequence has a recurrent layer.
    pub rope_delta: Option<i32>,
}

/// Options that shape the cache a model makes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheOptions {
    /// Rotating cache of this size (keep 4) for layers that would otherwise grow without bound.
    pub max_kv_size: Option<i32>,
}

/// The caches of the sequences one forward pass runs over: row `b` of the batch appends to
/// `seqs[b]` (one [`LayerCache`] per layer), each with its own length, offset and cache kinds (full,
/// rotating, quantized); attention then runs per row over exactly the keys that row alone would see.
/// One sequence is the plain case. Or all rows' layers live in one [`BatchKv`] (models whose layers
/// are all full caches), read and written for all rows at once. docs/design/scheduler.md says when
/// each is used, and what each costs.
pub struct Caches<'a> {
    seqs: Vec<&'a mut [LayerCache]>,
    stack: Option<&'a mut BatchKv>,
}

/// One layer's caches for a forward pass.
pub enum LayerCaches<'b> {
    /// One cache per row.
    Rows(Vec<&'b mut LayerCache>),
    /// Layer `.1` of the stack (a decode step: one token per row).
    Batch(&'b mut BatchKv, usize),
}

impl LayerCaches<'_> {
    /// Each row's offset (the position of its next token).
    pub fn offsets(&self) -> Vec<i32> {
        match self {
            LayerCaches::Rows(rows) => rows.iter().map(|c| c.offset()).collect(),
            LayerCaches::Batch(kv, _) => kv.offsets().to_vec(),
        }
    }
}

/// One layer's attention masks for a forward pass.
pub enum Masks {
    /// One per row.
    Rows(Vec<Mask>),
    /// `[B, 1, 1, keys]` for a [`BatchKv`]: row b sees its own keys only (and, with the sliding
    /// window `.1`, the last `.1` of them).
    Batch(Array, Option<i32>),
}

impl<'a> Caches<'a> {
    pub fn one(c: &'a mut [LayerCache]) -> Caches<'a> {
        Caches { seqs: vec![c], stack: None }
    }

    pub fn many(seqs: Vec<&'a mut [LayerCache]>) -> Caches<'a> {
        Caches { seqs, stack: None }
    }

    /// The rows of a stack (after [`BatchKv::begin_step`]).
    pub fn stacked(stack: &'a mut BatchKv) -> Caches<'a> {
        Caches { seqs: Vec::new(), stack: Some(stack) }
    }

    /// Layers per sequence.
    pub fn layers(&self) -> usize {
        match &self.stack {
            Some(s) => s.layers(),
            None => self.seqs.first().map_or(0, |s| s.len()),
        }
    }

    /// Each sequence's mask for a chunk of `n` new tokens at layer `layer`.
    pub fn masks(&self, layer: usize, n: i32, window: Option<i32>) -> Result<Masks> {
        if let Some(s) = self.stack.as_deref() {
            return Ok(Masks::Batch(s.mask(window)?, window));
        }
        let layer = layer.min(self.layers().saturating_sub(1));
        Ok(Masks::Rows(self.seqs.iter().map(|s| s[layer].make_mask(n, window)).collect::<Result<_>>()?))
    }

    /// Layer `i`'s caches, in batch order.
    pub fn layer_mut(&mut self, i: usize) -> LayerCaches<'_> {
        match self.stack.as_deref_mut() {
            Some(s) => LayerCaches::Batch(s, i),
            None => LayerCaches::Rows(self.seqs.iter_mut().map(|s| &mut s[i]).collect()),
        }
    }

    /// The state arrays of layers `lo..=hi` of every sequence.
    pub fn state(&self, lo: usize, hi: usize) -> Vec<&Array> {
        match self.stack.as_deref() {
            Some(s) => s.layers[lo..=hi].iter().flatten().flat_map(|(k, v)| [k, v]).collect(),
            None => self.seqs.iter().flat_map(|s| s[lo..=hi].iter().flat_map(|c| c.state())).collect(),
        }
    }
}

/// The KV of the rows of a batched decode step, stacked, for models whose layers are all full
/// caches: per layer one key and one value buffer `[slots, kv_heads, cap, head_dim]`. Slot s holds
/// its sequence's `lens[s]` tokens at its start, anything after them is never read (right padding,
/// masked). A decode step runs over slots `0..hi`: it writes every row's new key at its own
/// position in one `put_along_axis` (in place: the buffers are held only here), and attends over
/// the first `max(lens) + 1` positions with a mask hiding each row's padding: the same few
/// operations per layer whatever the batch size. A sequence joins by one in-place write of its
/// caches into a free slot and leaves by one copy of its own row; a free slot (a hole) runs a dummy
/// row until a joiner takes it, and [`BatchKv::compact`] closes holes with one copy of the stack.
pub struct BatchKv {
    layers: Vec<Option<(Array, Array)>>,
    /// Per slot.
    lens: Vec<i32>,
    cap: i32,
    /// Slots in the current step (`begin_step`).
    hi: usize,
    /// This step's write positions `[slots, 1, 1, 1]`.
    at: Option<Array>,
}

impl BatchKv {
    pub fn new(layers: usize) -> BatchKv {
        BatchKv { layers: vec![None; layers], lens: Vec::new(), cap: 0, hi: 0, at: None }
    }

    /// Slots allocated.
    pub fn slots(&self) -> usize {
        self.lens.len()
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// The buffers (to evaluate).
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers.iter().flatten().flat_map(|(k, v)| [k, v]).collect()
    }

    /// Grow to at least `slots` slots and `cap` positions (one copy of the stack when it grows).
    fn reserve(&mut self, slots: usize, cap: i32) -> Result<()> {
        let s_old = self.lens.len();
        let s_new = if slots > s_old { slots.max(2 * s_old).max(4) } else { s_old };
        let c_new = if cap > self.cap { (cap + STEP - 1) / STEP * STEP + STEP } else { self.cap };
        if s_new != s_old || c_new != self.cap {
            for (k, v) in self.layers.iter_mut().flatten() {
                let z = mx::scalar_as(0.0, k.dtype())?;
                let (ds, dc) = ((s_new - s_old) as i32, c_new - self.cap);
                *k = mx::pad(k, &[0, 2], &[0, 0], &[ds, dc], &z)?;
                *v = mx::pad(v, &[0, 2], &[0, 0], &[ds, dc], &z)?;
            }
            self.lens.resize(s_new, 0);
            self.cap = c_new;
        }
        Ok(())
    }

    /// Write a sequence's caches (full caches, one per layer) into `slot`.
    pub fn put_row(&mut self, slot: usize, caches: &[LayerCache]) -> Result<()> {
        let len = caches.first().map_or(0, |c| c.offset());
        self.reserve(slot + 1, len + 1)?;
        let (slots, cap) = (self.lens.len() as i32, self.cap);
        let at = slot as i32;
        for (layer, c) in self.layers.iter_mut().zip(caches) {
            let LayerCache::Full(KvCache { keys: Some(k), values: Some(v), offset }) = c else { continue };
            let n = *offset;
            if n == 0 {
                continue;
            }
            if layer.is_none() {
                let (ks, vs) = (k.shape(), v.shape());
                *layer = Some((
                    mx::zeros(&[slots, ks[1], cap, ks[3]], k.dtype())?,
                    mx::zeros(&[slots, vs[1], cap, vs[3]], v.dtype())?,
                ));
            }
            let (kb, vb) = layer.as_mut().expect("allocated above");
            let put = |buf: &Array, x: &Array| -> Result<Array> {
                let x = if x.dim(2) != n { seq_slice(x, 0, n)? } else { x.clone() };
                let sh = buf.shape();
                mx::slice_update(buf, &x, &[at, 0, 0, 0], &[at + 1, sh[1], n, sh[3]], &[1, 1, 1, 1])
            };
            *kb = put(kb, k)?;
            *vb = put(vb, v)?;
        }
        self.lens[slot] = len;
        Ok(())
    }

    /// Slot `slot`'s tokens as full caches written into `into` (copies; evaluate the returned
    /// arrays before the stack is written again, so that the write stays in place).
    pub fn take_row(&mut self, slot: usize, into: &mut [LayerCache]) -> Result<Vec<Array>> {
        let len = self.lens[slot];
        let si = slot as i32;
        let mut out = Vec::new();
        for (layer, c) in self.layers.iter().zip(into.iter_mut()) {
            let (keys, values) = match layer {
                Some((k, v)) if len > 0 => {
                    let cut = |a: &Array| -> Result<Array> {
                        mx::copy(&seq_slice(&mx::slice_axis(a, 0, si, si + 1)?, 0, len)?)
                    };
                    let (k, v) = (cut(k)?, cut(v)?);
                    out.push(k.clone());
                    out.push(v.clone());
                    (Some(k), Some(v))
                }
                _ => (None, None),
            };
            *c = LayerCache::Full(KvCache { keys, values, offset: len });
        }
        self.lens[slot] = 0;
        Ok(out)
    }

    /// Free `slot` without reading it.
    pub fn clear(&mut self, slot: usize) {
        self.lens[slot] = 0;
    }

    /// A new stack of the slots `keep`, in that order (one copy).
    pub fn compact(&self, keep: &[usize]) -> Result<BatchKv> {
        let idx: Vec<i32> = keep.iter().map(|&s| s as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|(k, v)| Ok::<_, crate::error::Error>((mx::take(k, &idx, 0)?, mx::take(v, &idx, 0)?)))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BatchKv { layers, lens: keep.iter().map(|&s| self.lens[s]).collect(), cap: self.cap, hi: 0, at: None })
    }

    /// The rows' lengths before this step: their rotary offsets.
    pub fn offsets(&self) -> &[i32] {
        &self.lens[..self.hi]
    }

    /// Prepare a decode step over slots `0..hi`: room for one more token in each, write positions.
    pub fn begin_step(&mut self, hi: usize) -> Result<()> {
        let need = self.lens.iter().copied().max().unwrap_or(0) + 1;
        self.reserve(hi, need)?;
        self.hi = hi;
        self.at = Some(Array::from_slice(&self.lens, &[self.lens.len() as i32, 1, 1, 1])?);
        Ok(())
    }

    /// After the step's forward pass: every slot of the step holds one more token.
    pub fn advance(&mut self) {
        for l in self.lens[..self.hi].iter_mut() {
            *l += 1;
        }
        self.at = None;
    }

    /// `[hi, 1, 1, max+1]`: key j visible to row r iff j <= lens[r] (and within `window`).
    fn mask(&self, window: Option<i32>) -> Result<Array> {
        let lens = &self.lens[..self.hi];
        let n = lens.iter().copied().max().unwrap_or(0) + 1;
        let keys = mx::reshape(&mx::arange(0.0, n as f64, 1.0, Dtype::Int32)?, &[1, 1, 1, n])?;
        let at = Array::from_slice(lens, &[lens.len() as i32, 1, 1, 1])?;
        let mut m = mx::less_equal(&keys, &at)?;
        if let Some(w) = window {
            let lo = mx::subtract(&at, &Array::scalar(w)?)?;
            m = mx::logical_and(&m, &mx::greater(&keys, &lo)?)?;
        }
        Ok(m)
    }

    /// Write the step's keys/values `[hi, H, 1, D]` of layer `l`; the keys and values to attend over.
    pub fn update_and_fetch(&mut self, l: usize, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let (kb, vb) = self.append(l, k, v)?;
        self.view(&kb, &vb)
    }

    /// Write the step's keys/values `[hi, H, 1, D]` of layer `l`: the whole buffers after the write
    /// (slot `s` filled up to its length + 1; [`BatchKv::view`] cuts them for the mask's attention).
    pub fn append(&mut self, l: usize, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let at =
            self.at.clone().ok_or_else(|| crate::error::Error::Invalid("BatchKv: begin_step not called".into()))?;
        let (slots, cap, hi) = (self.lens.len() as i32, self.cap, self.hi as i32);
        let layer = &mut self.layers[l];
        if layer.is_none() {
            let (ks, vs) = (k.shape(), v.shape());
            *layer = Some((
                mx::zeros(&[slots, ks[1], cap, ks[3]], k.dtype())?,
                mx::zeros(&[slots, vs[1], cap, vs[3]], v.dtype())?,
            ));
        }
        let (kb, vb) = layer.as_mut().expect("allocated above");
        let rows = |x: &Array| -> Result<Array> {
            if hi == slots {
                return Ok(x.clone());
            }
            let z = mx::scalar_as(0.0, x.dtype())?;
            mx::pad(x, &[0], &[0], &[slots - hi], &z)
        };
        *kb = mx::put_along_axis(kb, &at, &rows(k)?, 2)?;
        *vb = mx::put_along_axis(vb, &at, &rows(v)?, 2)?;
        Ok((kb.clone(), vb.clone()))
    }

    /// The step's rows and the positions its mask covers (`..max(lens) + 1`) of buffers
    /// [`BatchKv::append`] returned.
    pub fn view(&self, kb: &Array, vb: &Array) -> Result<(Array, Array)> {
        let (slots, hi) = (self.lens.len() as i32, self.hi as i32);
        let n = self.lens[..self.hi].iter().copied().max().unwrap_or(0) + 1;
        let cut = |a: &Array| -> Result<Array> {
            let a = if hi == slots { a.clone() } else { mx::slice_axis(a, 0, 0, hi)? };
            seq_slice(&a, 0, n)
        };
        Ok((cut(kb)?, cut(vb)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::AttnMask;

    const H: i32 = 2;
    const D: i32 = 8;

    fn randn(seed: u64, shape: &[i32]) -> Array {
        mx::random_normal(shape, Dtype::Float32, &mx::random_key(seed).unwrap()).unwrap()
    }

    /// A sequence's one-layer full cache holding `len` random tokens.
    fn seq(seed: u64, len: i32) -> Vec<LayerCache> {
        let mut c = LayerCache::full();
        if len > 0 {
            c.update_and_fetch(randn(seed, &[1, H, len, D]), randn(seed + 1000, &[1, H, len, D])).unwrap();
        }
        vec![c]
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        let d = mx::abs(&mx::subtract(a, b).unwrap()).unwrap();
        d.to_vec::<f32>().unwrap().into_iter().fold(0.0, f32::max)
    }

    /// The CUDA capacity pad: the buffer's capacity stays whole steps plus the pad through prompts
    /// and decode steps that cross growth steps, trims and chunks of odd lengths, and what each call
    /// returns is exactly what the unpadded buffer (mlx-lm's layout) returns.
    #[test]
    fn a_padded_buffer_returns_the_unpadded_keys_and_never_reaches_a_step_multiple() {
        let (mut a, mut b) = (KvCache::default(), KvCache::default());
        let chunks = [600, 1, 1, 165, 1, 300, 7, 256, 1, 1, 513];
        for (i, &n) in chunks.iter().enumerate() {
            if i == 6 {
                for c in [&mut a, &mut b] {
                    c.offset -= 40; // a prefix-cache trim: the buffer stays, the offset goes back
                }
            }
            let (k, v) = (randn(i as u64, &[1, H, n, D]), randn(100 + i as u64, &[1, H, n, D]));
            let (pk, pv) = a.update_and_fetch_padded(&k, &v, 8).unwrap();
            let (uk, uv) = b.update_and_fetch_padded(&k, &v, 0).unwrap();
            assert_eq!(pk.shape(), uk.shape());
            assert_eq!(max_abs_diff(&pk, &uk), 0.0);
            assert_eq!(max_abs_diff(&pv, &uv), 0.0);
            let cap = a.keys.as_ref().unwrap().dim(2);
            assert_eq!(cap % STEP, 8, "capacity {cap} after chunk {i}");
            assert!(cap >= a.offset);
        }
    }

    /// One decode step over the stack (with a hole) gives each row the attention it gets over its
    /// own cache, and a row taken back out holds exactly its tokens.
    #[test]
    fn a_stacked_step_attends_like_each_row_alone() {
        let lens = [5, 0, 300, 17]; // slot 1 stays a hole; 300 crosses a growth step
        let mut rows: Vec<Vec<LayerCache>> = lens.iter().enumerate().map(|(i, &n)| seq(10 * i as u64, n)).collect();
        let mut kv = BatchKv::new(1);
        for (slot, r) in rows.iter().enumerate() {
            if slot != 1 {
                kv.put_row(slot, r).unwrap();
            }
        }
        kv.clear(1);
        let b = lens.len() as i32;
        for step in 0..3 {
            let (q, k, v) =
                (randn(100 + step, &[b, H, 1, D]), randn(200 + step, &[b, H, 1, D]), randn(300 + step, &[b, H, 1, D]));
            kv.begin_step(lens.len()).unwrap();
            let (kk, vv) = kv.update_and_fetch(0, &k, &v).unwrap();
            let mask = kv.mask(None).unwrap();
            let out = mx::scaled_dot_product_attention(&q, &kk, &vv, 0.3, AttnMask::Array(&mask), None).unwrap();
            kv.advance();
            for (r, cache) in rows.iter_mut().enumerate() {
                if r == 1 {
                    continue;
                }
                let row = |a: &Array| mx::slice_axis(a, 0, r as i32, r as i32 + 1).unwrap();
                let Fetched::Dense(k1, v1) = cache[0].update_and_fetch(row(&k), row(&v)).unwrap() else {
                    unreachable!()
                };
                let alone = mx::scaled_dot_product_attention(&row(&q), &k1, &v1, 0.3, AttnMask::None, None).unwrap();
                assert!(max_abs_diff(&row(&out), &alone) < 1e-5, "row {r}, step {step}");
            }
        }
        // out again: the same tokens as the row's own cache; compaction keeps rows in order
        let kept = kv.compact(&[0, 2, 3]).unwrap();
        let mut back = vec![LayerCache::full()];
        let mut kept = kept;
        kept.take_row(1, &mut back).unwrap();
        assert_eq!(back[0].offset(), rows[2][0].offset());
        let (LayerCache::Full(a), LayerCache::Full(b)) = (&back[0], &rows[2][0]) else { unreachable!() };
        let n = a.offset;
        let cut = |x: &Option<Array>| seq_slice(x.as_ref().unwrap(), 0, n).unwrap();
        assert_eq!(max_abs_diff(&cut(&a.keys), &cut(&b.keys)), 0.0);
        assert_eq!(max_abs_diff(&cut(&a.values), &cut(&b.values)), 0.0);
    }

    /// A recurrent layer: no keys/values, no mask, never trimmed (only 0 tokens), its state the
    /// two arrays it holds; a clone is a snapshot that later updates do not change.
    #[test]
    fn a_recurrent_cache_is_a_fixed_state_never_rewound() {
        let mut c = LayerCache::recurrent();
        assert!(c.update_and_fetch(randn(1, &[1, H, 1, D]), randn(2, &[1, H, 1, D])).is_err());
        assert!(matches!(c.make_mask(5, None).unwrap(), Mask::None));
        assert!(c.state().is_empty() && c.nbytes() == 0);
        let LayerCache::Recurrent(r) = &mut c else { unreachable!() };
        r.conv = Some(randn(3, &[1, 3, 16]));
        r.state = Some(randn(4, &[1, 2, 4, 8]));
        r.offset = 9;
        let snap = c.clone();
        assert_eq!((c.offset(), c.state().len(), c.nbytes()), (9, 2, (3 * 16 + 2 * 4 * 8) * 4));
        assert!(c.can_trim(0) && !c.can_trim(1));
        assert_eq!(c.trim(3), 0);
        assert_eq!(c.offset(), 9);
        let LayerCache::Recurrent(r) = &mut c else { unreachable!() };
        r.state = Some(randn(5, &[1, 2, 4, 8]));
        r.offset += 1;
        let (LayerCache::Recurrent(a), LayerCache::Recurrent(b)) = (&snap, &c) else { unreachable!() };
        assert_eq!(a.offset, 9);
        assert!(max_abs_diff(a.state.as_ref().unwrap(), b.state.as_ref().unwrap()) > 0.0);
    }
}
