//! Sampling: parameters as plain data, logits processors (penalties, bias) and the sampler
//! (temperature, top-p, min-p, top-k, then a categorical draw with an explicit PRNG key).
//! Filters follow mlx-lm's `sample_utils` (same order: top-p, min-p, top-k); everything runs as
//! MLX ops so the decode loop stays asynchronous.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype};

/// Sampling parameters of one request.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in (0, 1); 0 or 1 disables.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: i32,
    /// Keep tokens with p >= min_p * p_max; 0 disables.
    pub min_p: f32,
    pub min_tokens_to_keep: i32,
    /// Multiplicative penalty on the last `repetition_context_size` tokens (mlx-lm semantics).
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: i32,
    /// Subtracted once from the logit of every token generated so far (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence of every token generated so far (OpenAI semantics).
    pub frequency_penalty: f32,
    /// Additive bias by token id.
    pub logit_bias: Vec<(i32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Reject values that have no meaning (before any work starts).
    pub fn validate(&self, vocab: i32) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.min_tokens_to_keep < 1 {
            return bad(format!("min_tokens_to_keep must be >= 1, got {}", self.min_tokens_to_keep));
        }
        if self.top_k < 0 {
            return bad(format!("top_k must be >= 0, got {}", self.top_k));
        }
        if let Some(p) = self.repetition_penalty {
            if !p.is_finite() || p < 0.0 {
                return bad(format!("repetition_penalty must be >= 0, got {p}"));
            }
        }
        for (k, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return bad(format!("{k} must be finite"));
            }
        }
        for (id, b) in &self.logit_bias {
            if *id < 0 || *id >= vocab {
                return bad(format!("logit_bias token id {id} is outside the vocabulary (0..{vocab})"));
            }
            if !b.is_finite() {
                return bad(format!("logit_bias for token {id} must be finite"));
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Per-request sampling state: PRNG key, penalty history.
pub struct Sampler {
    p: SamplingParams,
    key: Array,
    /// Device history of generated tokens (repetition penalty window).
    history: Option<Array>,
    /// Device counts of generated tokens (presence/frequency).
    counts: Option<Array>,
    bias: Option<(Array, Array)>,
    vocab: i32,
}

impl Sampler {
    pub fn new(p: SamplingParams, vocab: i32) -> Result<Sampler> {
        p.validate(vocab)?;
        let seed = p.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        let bias = if p.logit_bias.is_empty() {
            None
        } else {
            let mut merged: std::collections::BTreeMap<i32, f32> = Default::default();
            for (i, b) in &p.logit_bias {
                *merged.entry(*i).or_default() += b;
            }
            let idx: Vec<i32> = merged.keys().copied().collect();
            let val: Vec<f32> = merged.values().copied().collect();
            let n = idx.len() as i32;
            Some((Array::from_slice(&idx, &[1, n])?, Array::from_slice(&val, &[1, n])?))
        };
        Ok(Sampler { key: mx::random_key(seed)?, p, history: None, counts: None, bias, vocab })
    }

    /// Greedy with no logit processors: the engine may sample such rows together.
    pub fn is_plain_greedy(&self) -> bool {
        self.p.is_greedy() && !self.has_processors()
    }

    /// Whether logits need processing (penalties or bias).
    fn has_processors(&self) -> bool {
        self.bias.is_some()
            || self.p.repetition_penalty.is_some_and(|r| r != 0.0 && r != 1.0)
            || self.p.presence_penalty != 0.0
            || self.p.frequency_penalty != 0.0
    }

    /// Record that `token` (a device scalar or [1]-array of int32) was generated.
    pub fn observe(&mut self, token: &Array) -> Result<()> {
        if !self.has_processors() {
            return Ok(());
        }
        let t = mx::reshape(&mx::astype(token, Dtype::Int32)?, &[1])?;
        if self.p.repetition_penalty.is_some() {
            let h = match self.history.take() {
                Some(h) => mx::concatenate(&[&h, &t], 0)?,
                None => t.clone(),
            };
            let n = h.dim(0);
            let ctx = self.p.repetition_context_size.max(1);
            self.history = Some(if n > ctx { mx::slice_axis(&h, 0, n - ctx, n)? } else { h });
        }
        if self.p.presence_penalty != 0.0 || self.p.frequency_penalty != 0.0 {
            let ar = mx::arange(0.0, self.vocab as f64, 1.0, Dtype::Int32)?;
            let hit = mx::astype(&mx::equal(&ar, &t)?, Dtype::Float32)?;
            self.counts = Some(match self.counts.take() {
                Some(c) => mx::add(&c, &hit)?,
                None => hit,
            });
        }
        Ok(())
    }

    /// Apply penalties and bias to logits `[1, V]`.
    pub fn process(&self, logits: &Array) -> Result<Array> {
        let mut l = logits.clone();
        if let Some((idx, val)) = &self.bias {
            let cur = mx::take_along_axis(&l, idx, -1)?;
            l = mx::put_along_axis(&l, idx, &mx::add(&cur, &mx::astype(val, l.dtype())?)?, -1)?;
        }
        if let (Some(pen), Some(h)) = (self.p.repetition_penalty, &self.history) {
            if pen != 0.0 && pen != 1.0 {
                let idx = mx::expand_dims(h, 0)?;
                let sel = mx::take_along_axis(&l, &idx, -1)?;
                let p = mx::scalar_as(pen as f64, l.dtype())?;
                let neg = mx::less(&sel, &mx::scalar_as(0.0, l.dtype())?)?;
                let upd = mx::where_(&neg, &mx::multiply(&sel, &p)?, &mx::divide(&sel, &p)?)?;
                l = mx::put_along_axis(&l, &idx, &upd, -1)?;
            }
        }
        if let Some(c) = &self.counts {
            let present = mx::astype(&mx::greater(c, &mx::scalar_as(0.0, Dtype::Float32)?)?, Dtype::Float32)?;
            let pen = mx::add(
                &mx::multiply(&present, &Array::f32(self.p.presence_penalty)?)?,
                &mx::multiply(c, &Array::f32(self.p.frequency_penalty)?)?,
            )?;
            l = mx::subtract(&l, &mx::astype(&mx::expand_dims(&pen, 0)?, l.dtype())?)?;
        }
        Ok(l)
    }

    /// Draw a token from log-probabilities `[1, V]`; returns an int32 array of shape [1].
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        if self.p.is_greedy() {
            return mx::argmax(logprobs, -1, false);
        }
        let mut lp = logprobs.clone();
        if self.p.top_p > 0.0 && self.p.top_p < 1.0 {
            lp = apply_top_p(&lp, self.p.top_p)?;
        }
        if self.p.min_p != 0.0 {
            lp = apply_min_p(&lp, self.p.min_p, self.p.min_tokens_to_keep)?;
        }
        if self.p.top_k > 0 && self.p.top_k < self.vocab {
            lp = apply_top_k(&lp, self.p.top_k)?;
        }
        let (next, sub) = mx::random_split(&self.key)?;
        self.key = next;
        let scaled = mx::multiply(&lp, &mx::scalar_as(1.0 / self.p.temperature as f64, lp.dtype())?)?;
        mx::random_categorical(&scaled, -1, Some(&sub))
    }
}

fn neg_inf(d: Dtype) -> Result<Array> {
    mx::scalar_as(f64::NEG_INFINITY, d)
}

fn inverse_perm(sorted_idx: &Array) -> Result<Array> {
    let n = sorted_idx.dim(-1);
    let zeros = mx::zeros(&sorted_idx.shape(), sorted_idx.dtype())?;
    let ar = mx::broadcast_to(&mx::arange(0.0, n as f64, 1.0, sorted_idx.dtype())?, &sorted_idx.shape())?;
    mx::put_along_axis(&zeros, sorted_idx, &ar, -1)
}

/// Keep the smallest set of most likely tokens whose mass exceeds `top_p`.
pub fn apply_top_p(logprobs: &Array, top_p: f32) -> Result<Array> {
    let probs = mx::exp(logprobs)?;
    let idx = mx::argsort(logprobs, -1)?;
    let sp = mx::take_along_axis(&probs, &idx, -1)?;
    let cum = mx::cumsum(&sp, -1, false, true)?;
    let cum = mx::take_along_axis(&cum, &inverse_perm(&idx)?, -1)?;
    let keep = mx::greater(&cum, &mx::scalar_as(1.0 - top_p as f64, cum.dtype())?)?;
    mx::where_(&keep, logprobs, &neg_inf(logprobs.dtype())?)
}

/// Keep tokens whose probability is at least `min_p` times the top token's.
pub fn apply_min_p(logprobs: &Array, min_p: f32, min_keep: i32) -> Result<Array> {
    let idx = mx::argsort(&mx::negative(logprobs)?, -1)?;
    let sorted = mx::take_along_axis(logprobs, &idx, -1)?;
    let top = mx::slice_axis(&sorted, -1, 0, 1)?;
    let thresh = mx::add(&top, &mx::scalar_as((min_p as f64).ln(), sorted.dtype())?)?;
    let remove = mx::less(&sorted, &thresh)?;
    let n = sorted.dim(-1);
    let pos = mx::arange(0.0, n as f64, 1.0, Dtype::Int32)?;
    let protected = mx::less(&pos, &Array::scalar(min_keep)?)?;
    let remove = mx::logical_and(&remove, &mx::logical_not(&protected)?)?;
    let sel = mx::where_(&remove, &neg_inf(sorted.dtype())?, &sorted)?;
    mx::take_along_axis(&sel, &inverse_perm(&idx)?, -1)
}

/// Keep the `k` most likely tokens.
pub fn apply_top_k(logprobs: &Array, k: i32) -> Result<Array> {
    let part = mx::argpartition(&mx::negative(logprobs)?, k - 1, -1)?;
    let n = part.dim(-1);
    let masked = mx::slice_axis(&part, -1, k, n)?;
    let ninf = mx::broadcast_to(&neg_inf(logprobs.dtype())?, &masked.shape())?;
    mx::put_along_axis(logprobs, &masked, &ninf, -1)
}

/// Test and diagnostics entry point: apply `params` to fixed `logits` (one row) and return the
/// filtered log-probabilities (what the categorical draw sees, before temperature) and `draws`
/// samples taken in sequence from one seeded sampler.
pub fn sample_fixed(logits: &[f32], params: SamplingParams, draws: usize) -> Result<(Vec<f32>, Vec<i32>)> {
    let v = logits.len() as i32;
    let mut s = Sampler::new(params, v)?;
    let l = Array::from_slice(logits, &[1, v])?;
    let l = s.process(&l)?;
    let lp = mx::subtract(&l, &mx::logsumexp(&l, &[-1], true)?)?;
    let mut filtered = lp.clone();
    if !s.p.is_greedy() {
        if s.p.top_p > 0.0 && s.p.top_p < 1.0 {
            filtered = apply_top_p(&filtered, s.p.top_p)?;
        }
        if s.p.min_p != 0.0 {
            filtered = apply_min_p(&filtered, s.p.min_p, s.p.min_tokens_to_keep)?;
        }
        if s.p.top_k > 0 && s.p.top_k < v {
            filtered = apply_top_k(&filtered, s.p.top_k)?;
        }
    }
    let mut out = Vec::with_capacity(draws);
    for _ in 0..draws {
        out.push(mx::astype(&s.sample(&lp)?, Dtype::Int32)?.item_i32()?);
    }
    Ok((mx::astype(&filtered, Dtype::Float32)?.to_vec::<f32>()?, out))
}
