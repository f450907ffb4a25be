//! What generation shares with the engine's scheduler (engine/sched.rs, which runs prefill and
//! decode with mlx-lm `generate_step` semantics): how a prefill chunk evaluates between decoder
//! layers, and the timings a generation reports.
use crate::handle as mx;
use crate::models::Staging;

/// Overrides how the prefill evaluates between decoder layers: `k` (evaluate every k layers; 0: a
/// whole chunk's graph at a time) or `ka` (the same, queuing the next stage before waiting for the
/// previous one). Unset, empty or anything else: [`prefill_staging`]'s default.
pub const PREFILL_EVAL_ENV: &str = "MLXRS_PREFILL_EVAL_LAYERS";

/// How a prefill chunk evaluates between decoder layers ([`crate::models::CausalLm::forward_staged`]). On a GPU
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
        if self.prompt_seconds > 0.0 {
            self.prompt_tokens as f64 / self.prompt_seconds
        } else {
            0.0
        }
    }
    pub fn generation_tps(&self) -> f64 {
        if self.generation_seconds > 0.0 {
            self.generated_tokens as f64 / self.generation_seconds
        } else {
            0.0
        }
    }
}
