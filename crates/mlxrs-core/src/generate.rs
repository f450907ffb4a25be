//! Prefill and decode for one sequence, with mlx-lm `generate_step` semantics: chunked prefill,
//! KV quantization after each model call, a dedicated stream, and double-buffered asynchronous
//! evaluation (step n+1 is queued before token n is read back).
use crate::cache::LayerCache;
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, Dtype, Stream};
use crate::models::{CausalLm, Staging};
use crate::sample::Sampler;
use crate::weights::QuantSpec;
use std::time::Instant;

/// Options of the decode loop.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub max_tokens: usize,
    pub prefill_step_size: i32,
    pub kv_bits: Option<i32>,
    pub kv_group_size: i32,
    pub quantized_kv_start: i32,
    /// How many alternatives to report per token (0: none; the chosen token's logprob is still
    /// reported when `logprobs` is set).
    pub top_logprobs: usize,
    pub logprobs: bool,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            max_tokens: 256,
            prefill_step_size: 2048,
            kv_bits: None,
            kv_group_size: 64,
            quantized_kv_start: 0,
            top_logprobs: 0,
            logprobs: false,
        }
    }
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct StepOut {
    pub token: i32,
    /// log p(token), when logprobs were requested.
    pub logprob: Option<f32>,
    /// The most likely alternatives (id, logprob), best first.
    pub top: Vec<(i32, f32)>,
}

/// Overrides how the prefill evaluates between decoder layers: `k` (evaluate every k layers; 0: a
/// whole chunk's graph at a time) or `ka` (the same, queuing the next stage before waiting for the
/// previous one). Unset, empty or anything else: [`prefill_staging`]'s default.
pub const PREFILL_EVAL_ENV: &str = "MLXRS_PREFILL_EVAL_LAYERS";

/// How a prefill chunk evaluates between decoder layers ([`CausalLm::forward_staged`]). On a GPU
/// (CUDA, Metal): after every layer, queuing the next layer before waiting for the previous one. A
/// chunk evaluated as one graph keeps several layers' intermediates alive at once there and peaked
/// up to 2.8× the per-layer memory plan on an H200; waiting for every layer held the peak to one
/// layer's activations but cost 20–35% of the prefill speed (the GPU idles while the host builds
/// the next layer); one layer queued ahead holds it to two or three layers' (what the planner counts
/// on a GPU: `plan::GPU_LAYERS_IN_FLIGHT`) at about the whole graph's prefill speed (0.8–1.2× on the
/// H200, bench/RESULTS-fit.md). On the
/// CPU, the whole chunk as one graph: execution is synchronous and a layer's intermediates are freed
/// as the next consumes them. [`PREFILL_EVAL_ENV`] overrides it. Decode steps always run as one graph.
pub fn prefill_staging() -> Staging {
    if let Ok(v) = std::env::var(PREFILL_EVAL_ENV) {
        let v = v.trim();
        let (num, lookahead) = match v.strip_suffix('a') {
            Some(n) => (n, true),
            None => (v, false),
        };
        if let Ok(every) = num.parse::<usize>() {
            return Staging { every, lookahead };
        }
    }
    match mx::default_device() {
        Ok(d) if d.kind() == mx::DeviceKind::Gpu => Staging { every: 1, lookahead: true },
        _ => Staging::NONE,
    }
}

/// Prefill/decode timing of one generation.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt tokens taken from the prompt-prefix cache (not prefilled).
    pub cached_tokens: usize,
    pub prompt_seconds: f64,
    pub generation_seconds: f64,
    pub peak_memory: usize,
}

impl Timings {
    pub fn prompt_tps(&self) -> f64 {
        if self.prompt_seconds > 0.0 { self.prompt_tokens as f64 / self.prompt_seconds } else { 0.0 }
    }
    pub fn generation_tps(&self) -> f64 {
        if self.generation_seconds > 0.0 { self.generated_tokens as f64 / self.generation_seconds } else { 0.0 }
    }
}

/// Progress callback: (prompt tokens processed, total).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

/// A running generation. Iterate with [`TokenGenerator::next_token`].
pub struct TokenGenerator<'a> {
    model: &'a dyn CausalLm,
    cache: &'a mut [LayerCache],
    sampler: Sampler,
    opts: GenOptions,
    stream: Stream,
    pending: Option<(Array, Array)>,
    n: usize,
    started: Instant,
    first_token_at: Option<Instant>,
    pub timings: Timings,
}

impl<'a> TokenGenerator<'a> {
    /// Prefill `prompt` (all but its last token, in chunks) and queue the first decode step.
    pub fn new(
        model: &'a dyn CausalLm,
        cache: &'a mut [LayerCache],
        prompt: &[i32],
        sampler: Sampler,
        opts: GenOptions,
        stream: Stream,
        progress: Option<Progress<'_>>,
    ) -> Result<TokenGenerator<'a>> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty: at least one token is needed".into()));
        }
        if opts.prefill_step_size < 1 {
            return Err(Error::Invalid("prefill_step_size must be >= 1".into()));
        }
        mx::reset_peak_memory();
        let started = Instant::now();
        let mut g = TokenGenerator {
            model,
            cache,
            sampler,
            opts,
            stream,
            pending: None,
            n: 0,
            started,
            first_token_at: None,
            timings: Timings { prompt_tokens: prompt.len(), ..Default::default() },
        };
        let total = prompt.len();
        let mut done = 0usize;
        let mut progress = progress;
        if let Some(p) = progress.as_mut() {
            p(0, total);
        }
        let stream = g.stream.clone();
        let staging = prefill_staging();
        mx::with_stream(&stream, || -> Result<()> {
            while total - done > 1 {
                let n = (g.opts.prefill_step_size as usize).min(total - done - 1);
                let chunk = Array::from_slice(&prompt[done..done + n], &[1, n as i32])?;
                g.model.forward_staged(&chunk, g.cache, staging)?;
                g.maybe_quantize()?;
                let state: Vec<&Array> = g.cache.iter().flat_map(|c| c.state()).collect();
                mx::eval(&state)?;
                done += n;
                if let Some(p) = progress.as_mut() {
                    p(done, total);
                }
                mx::clear_cache();
            }
            let last = Array::from_slice(&prompt[done..], &[1, (total - done) as i32])?;
            let (y, lp) = g.step(&last)?;
            mx::async_eval(&[&y, &lp])?;
            g.pending = Some((y, lp));
            Ok(())
        })?;
        if let Some(p) = progress.as_mut() {
            p(total, total);
        }
        Ok(g)
    }

    fn maybe_quantize(&mut self) -> Result<()> {
        if let Some(bits) = self.opts.kv_bits {
            let q = QuantSpec { group_size: self.opts.kv_group_size, bits };
            for c in self.cache.iter_mut() {
                if matches!(c, LayerCache::Full(_)) && c.offset() >= self.opts.quantized_kv_start {
                    c.quantize(q)?;
                }
            }
        }
        Ok(())
    }

    /// Run the model on `input` [1, L] and sample from the last position.
    fn step(&mut self, input: &Array) -> Result<(Array, Array)> {
        let logits = self.model.forward(input, self.cache)?;
        let l = logits.dim(1);
        let last = mx::squeeze(&mx::slice_axis(&logits, 1, l - 1, l)?, &[1])?;
        let last = self.sampler.process(&last)?;
        self.maybe_quantize()?;
        let lse = mx::logsumexp(&last, &[-1], true)?;
        let logprobs = mx::subtract(&last, &lse)?;
        let y = self.sampler.sample(&logprobs)?;
        Ok((y, mx::squeeze(&logprobs, &[0])?))
    }

    /// The next token, or None once `max_tokens` were produced.
    pub fn next_token(&mut self) -> Result<Option<StepOut>> {
        if self.n >= self.opts.max_tokens {
            return Ok(None);
        }
        let Some((y, lp)) = self.pending.take() else { return Ok(None) };
        let stream = self.stream.clone();
        if self.n + 1 < self.opts.max_tokens {
            mx::with_stream(&stream, || -> Result<()> {
                self.sampler.observe(&y)?;
                let input = mx::reshape(&y, &[1, 1])?;
                let (ny, nlp) = self.step(&input)?;
                mx::async_eval(&[&ny, &nlp])?;
                self.pending = Some((ny, nlp));
                Ok(())
            })?;
        }
        let token = mx::astype(&y, Dtype::Int32)?.item_i32()?;
        if self.first_token_at.is_none() {
            let now = Instant::now();
            self.timings.prompt_seconds = (now - self.started).as_secs_f64();
            self.first_token_at = Some(now);
        }
        let (logprob, top) = if self.opts.logprobs || self.opts.top_logprobs > 0 {
            mx::with_stream(&stream, || top_logprobs(&lp, token, self.opts.top_logprobs))?
        } else {
            (None, Vec::new())
        };
        self.n += 1;
        self.timings.generated_tokens = self.n;
        if let Some(t0) = self.first_token_at {
            self.timings.generation_seconds = t0.elapsed().as_secs_f64();
        }
        self.timings.peak_memory = mx::peak_memory();
        if self.n % 256 == 0 {
            mx::clear_cache();
        }
        Ok(Some(StepOut { token, logprob, top }))
    }
}

fn top_logprobs(lp: &Array, token: i32, k: usize) -> Result<(Option<f32>, Vec<(i32, f32)>)> {
    let lp32 = mx::astype(lp, Dtype::Float32)?;
    let chosen = mx::take(&lp32, &Array::from_slice(&[token], &[1])?, 0)?.to_vec::<f32>()?;
    let mut top = Vec::new();
    if k > 0 {
        let v = lp32.dim(0) as usize;
        let k = k.min(v);
        let part = mx::argpartition(&mx::negative(&lp32)?, (k - 1) as i32, 0)?;
        let idx = mx::slice_axis(&part, 0, 0, k as i32)?;
        let vals = mx::take(&lp32, &idx, 0)?;
        let ids = idx.to_vec::<i32>()?;
        let vals = vals.to_vec::<f32>()?;
        top = ids.into_iter().zip(vals).collect();
        top.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
    }
    Ok((chosen.first().copied(), top))
}
