//! The memory planner: will a model and a context fit the memory budget, and what is the largest
//! context that does? One plan ([`MemoryPlan`], schemaVersion 1) serves `fit`, the server's
//! memory admission and its `/stats`.
//!
//! Everything is computed from `config.json` and the safetensors headers: no tensor is loaded
//! and the native runtime is not needed (except to ask MLX how much GPU memory there is).
//!
//! ```text
//! total(ctx) = weights + kv(ctx) + transient(ctx) + reserve        fits <=> total <= usable
//! usable     = budget = device memory × 0.75 (default) | FRACTION × device memory | BYTES
//! maxSafeContext = the largest ctx with total(ctx) <= usable, capped at the model's context
//! ```
use crate::error::{Error, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// The default share of device memory a model may use (unified memory on Macs, GPU memory on
/// CUDA, RAM on CPU): the rest stays with the OS and other programs.
pub const DEFAULT_BUDGET_FRACTION: f64 = 0.75;

/// Memory outside weights, KV and prefill activations that the serving process holds: the MLX
/// runtime and its allocator's buffer cache slack, the tokenizer, the Python interpreter with
/// aiohttp: 256 MiB, headroom over the serving process's resident set before the first request
/// (bench/RESULTS-fit.md).
pub const RESERVE_BYTES: u64 = 256 << 20;

/// KV caches grow in steps of this many tokens (`cache.rs`, mlx-lm's `KVCache.step`), so a full
/// attention layer holds ceil(ctx / 256) × 256 slots.
pub const KV_STEP: u64 = 256;

/// The prefill chunk (`LoadOptions::prefill_step_size`'s default).
pub const DEFAULT_PREFILL_STEP: u64 = 2048;

/// How a budget is given: the default fraction, a fraction of device memory, or bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    Default,
    Fraction(f64),
    Bytes(u64),
}

impl Budget {
    /// Parse `--memory-budget`: a number in (0, 1] is a fraction of device memory; anything else
    /// is bytes, optionally with a unit (K, M, G, T: powers of 1024; KB, MB, GB: of 1000).
    pub fn parse(s: &str) -> Result<Budget> {
        let t = s.trim();
        let bad = || {
            Error::Invalid(format!(
                "memory budget {s:?} is neither a fraction in (0, 1] (of device memory) nor a byte count (e.g. 8000000000, 12G, 512MiB)"
            ))
        };
        if t.is_empty() {
            return Err(bad());
        }
        if let Ok(f) = t.parse::<f64>() {
            if f.is_finite() && f > 0.0 && f <= 1.0 {
                return Ok(Budget::Fraction(f));
            }
            if f.is_finite() && f > 1.0 && f.fract() == 0.0 && f < 1e19 {
                return Ok(Budget::Bytes(f as u64));
            }
            return Err(bad());
        }
        let lower = t.to_ascii_lowercase();
        let split = lower.find(|c: char| c.is_ascii_alphabetic()).ok_or_else(bad)?;
        let (num, unit) = lower.split_at(split);
        let n: f64 = num.trim().parse().map_err(|_| bad())?;
        let mult: f64 = match unit.trim() {
            "b" => 1.0,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024f64.powi(2),
            "g" | "gib" => 1024f64.powi(3),
            "t" | "tib" => 1024f64.powi(4),
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => return Err(bad()),
        };
        let bytes = n * mult;
        if !bytes.is_finite() || !(1.0..1.8e19).contains(&bytes) {
            return Err(bad());
        }
        Ok(Budget::Bytes(bytes as u64))
    }
}

/// Where the device memory figure came from.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceMemory {
    pub bytes: u64,
    /// "mlx-gpu" (MLX's device info), "proc-meminfo", "sysctl" or "unknown".
    pub source: &'static str,
}

/// Physical RAM: /proc/meminfo on Linux, `sysctl hw.memsize` on macOS.
pub fn system_ram() -> Option<DeviceMemory> {
    if let Ok(text) = std::fs::read_to_string("/proc/meminfo") {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("MemTotal:") {
                let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
                return Some(DeviceMemory { bytes: kb * 1024, source: "proc-meminfo" });
            }
        }
    }
    let out = std::process::Command::new("sysctl").args(["-n", "hw.memsize"]).output().ok()?;
    let bytes: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some(DeviceMemory { bytes, source: "sysctl" })
}

/// The memory of the device MLX computes on: the GPU's (unified memory on Macs) when the
/// default device is a GPU and MLX reports it, else system RAM.
pub fn device_memory() -> DeviceMemory {
    if let Ok(dev) = crate::handle::default_device() {
        if dev.kind() == crate::handle::DeviceKind::Gpu {
            if let Some(b) = crate::handle::device_memory_size(&dev) {
                return DeviceMemory { bytes: b as u64, source: "mlx-gpu" };
            }
        }
    }
    system_ram().unwrap_or(DeviceMemory { bytes: 0, source: "unknown" })
}

/// The usable bytes for a budget on a device of `device_bytes`.
pub fn budget_bytes(budget: Budget, device_bytes: u64) -> u64 {
    match budget {
        Budget::Default => (device_bytes as f64 * DEFAULT_BUDGET_FRACTION) as u64,
        Budget::Fraction(f) => (device_bytes as f64 * f) as u64,
        Budget::Bytes(b) => b,
    }
}

/// What the planner needs to know about a model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelFacts {
    pub model_type: String,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    /// Per layer: Some(window) for sliding-window layers (their KV is capped at the window).
    pub sliding: Vec<Option<u64>>,
    /// Per layer: K and V elements per cached token (0: no KV cache of its own).
    pub kv_elems: Vec<u64>,
    /// Bytes of the fixed-size state one sequence holds beside its KV, whatever its length: the
    /// linear-attention layers' convolution inputs and recurrent states
    /// ([`crate::models::LayerLayout::state_bytes`]); 0 for a model without such layers.
    #[serde(default)]
    pub state_bytes: u64,
    /// Bytes per element of activations and of an unquantized KV cache (the model's float dtype).
    pub act_bytes: u64,
    /// Sum of every tensor's bytes, from the safetensors headers.
    pub weights_bytes: u64,
    /// The weights are MLX-quantized (config.json has `quantization`): a GPU prefill then
    /// dequantizes one weight at a time ([`Backend::dequant_rows`]).
    #[serde(default)]
    pub quantized_weights: bool,
    pub max_position_embeddings: Option<u64>,
    /// Bytes of the routed experts' tensors ([`crate::models::experts::is_expert_tensor`]): what a
    /// streamed plan leaves in the files. 0 for a dense model.
    #[serde(default)]
    pub expert_bytes: u64,
    /// Per layer: (experts, experts per token) of its MoE FFN; (0, 0) for a dense FFN.
    #[serde(default)]
    pub moe: Vec<(u64, u64)>,
    /// The peak transient of encoding one image at the model's largest image size with its vision
    /// tower ([`crate::vision::encode_transient_bytes`]); 0 without a modelled tower.
    #[serde(default)]
    pub media_transient_bytes: u64,
    /// [`ModelFacts::media_transient_bytes`] where a 16-bit tower runs on the CPU (its attention in
    /// the host op of `handle/half.rs`, which holds a bounded scratch instead of MLX's scores).
    #[serde(default)]
    pub media_transient_host_bytes: u64,
    /// The peak transient of encoding one audio clip of the longest length the feature extractor
    /// keeps with the audio encoder ([`crate::vision::audio_transient_bytes`]); 0 without one.
    #[serde(default)]
    pub audio_transient_bytes: u64,
}

fn dtype_bytes(name: &str) -> Option<u64> {
    Some(match name.to_ascii_uppercase().as_str() {
        "F64" | "I64" | "U64" | "FLOAT64" => 8,
        "F32" | "I32" | "U32" | "FLOAT32" => 4,
        "F16" | "BF16" | "I16" | "U16" | "FLOAT16" | "BFLOAT16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// One safetensors header, validated ([`crate::safetensors::read_header`]): (name, dtype, bytes).
fn safetensors_header(path: &Path) -> Result<Vec<(String, String, u64)>> {
    let h = crate::safetensors::read_header(path)?;
    Ok(h.tensors.into_iter().map(|t| (t.name.clone(), t.dtype.clone(), t.nbytes())).collect())
}

impl ModelFacts {
    /// Facts from a model directory: config.json plus the safetensors headers.
    pub fn from_dir(dir: &Path) -> Result<ModelFacts> {
        let config = crate::engine::read_config(dir)?;
        let files = crate::safetensors::model_files(dir)?;
        let mut tensors = Vec::new();
        for f in &files {
            tensors.extend(safetensors_header(f)?);
        }
        // an FP8 checkpoint is dequantized at load (weights::dequantize_fp8): its e4m3 weights are
        // resident as bfloat16, their scales dropped
        let fp8 = crate::weights::fp8_block(&config).ok().flatten().is_some();
        let weights_bytes = tensors
            .iter()
            .map(|t| match (fp8, t.1.as_str()) {
                (true, "F8_E4M3") => 2 * t.2,
                (true, _) if t.0.ends_with("_scale_inv") || t.0.ends_with("activation_scale") => 0,
                _ => t.2,
            })
            .sum();
        // the activation dtype: the embedding's (its scales' when quantized affine), else torch_dtype
        // (the microscaling modes' scales are uint8: MLX dequantizes those embeddings to bfloat16,
        // but the first norm's weights promote the hidden state back to the checkpoint's dtype)
        let find = |suffix: &str| tensors.iter().find(|t| t.0.ends_with(suffix)).and_then(|t| dtype_bytes(&t.1));
        let act = match find("embed_tokens.weight") {
            Some(b) if !tensors.iter().any(|t| t.0.ends_with("embed_tokens.scales")) => Some(b),
            _ => find("embed_tokens.scales").filter(|&b| b > 1),
        };
        let act = act.or_else(|| text_config(&config).get("torch_dtype").and_then(Value::as_str).and_then(dtype_bytes));
        let mut f = Self::from_config(&config, weights_bytes, act.unwrap_or(2))?;
        f.media_transient_bytes = crate::vision::encode_transient_bytes(&config, dir, f.act_bytes, false)?.unwrap_or(0);
        f.media_transient_host_bytes =
            crate::vision::encode_transient_bytes(&config, dir, f.act_bytes, true)?.unwrap_or(0);
        f.audio_transient_bytes = crate::vision::audio_transient_bytes(&config, dir)?.unwrap_or(0);
        if f.moe.iter().any(|m| m.0 > 0) {
            f.expert_bytes =
                tensors.iter().filter(|t| crate::models::experts::is_expert_tensor(&t.0)).map(|t| t.2).sum();
        }
        Ok(f)
    }

    /// Facts from a GGUF file as `serve` and `Session` import it on this backend
    /// (`gguf::import::OutDtype::default_for`: f32 on the CPU, bf16 on GPUs): the config the
    /// importer writes (`gguf::import::file_config`) and that dtype's bytes per element of every
    /// tensor it keeps (all but `rope_freqs`), and the Q8_0 head an f32 import keeps beside them
    /// (`gguf::import::q8_head`). Only the header and `rope_freqs.weight` are read.
    pub fn from_gguf(path: &Path) -> Result<ModelFacts> {
        Self::from_gguf_as(path, crate::gguf::import::OutDtype::default_for(Backend::detect()))
    }

    /// [`ModelFacts::from_gguf`] for an import as `dtype` (a float dtype; quantized imports are
    /// planned from their directory).
    pub fn from_gguf_as(path: &Path, dtype: crate::gguf::import::OutDtype) -> Result<ModelFacts> {
        let f = crate::gguf::GgufFile::open(path)?;
        let cfg = crate::gguf::import::file_config(&f)?;
        let elems: u64 =
            f.header.tensors.iter().filter(|t| t.name != "rope_freqs.weight").map(|t| t.n_elements()).sum();
        let b = dtype.float_bytes();
        // plus the output head and the linear projections kept as the file's blocks too (the CPU's f32
        // import)
        use crate::gguf::import::{host_blocks_bytes, q8_head_bytes};
        Self::from_config(&cfg, elems * b + q8_head_bytes(&f.header, dtype) + host_blocks_bytes(&f.header, dtype), b)
    }

    /// Facts from a model directory or a `.gguf` file (planned as its import here).
    pub fn from_path(path: &Path) -> Result<ModelFacts> {
        Self::from_path_on(path, None)
    }

    /// [`ModelFacts::from_path`], a `.gguf` file planned as its import on `backend` (None: this
    /// machine's), as `fit --skus` plans other machines.
    pub fn from_path_on(path: &Path, backend: Option<Backend>) -> Result<ModelFacts> {
        if path.is_file() && path.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf")) {
            let dtype = crate::gguf::import::OutDtype::default_for(backend.unwrap_or_else(Backend::detect));
            Self::from_gguf_as(path, dtype)
        } else {
            Self::from_dir(path)
        }
    }

    /// Facts from a config and known weight bytes / activation dtype size.
    pub fn from_config(config: &Value, weights_bytes: u64, act_bytes: u64) -> Result<ModelFacts> {
        let c = text_config(config);
        let u = |k: &str| c.get(k).and_then(Value::as_u64);
        let need = |k: &str| u(k).ok_or_else(|| Error::ModelLoad(format!("config.json has no {k}")));
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
        let num_layers = need("num_hidden_layers")?;
        let max_layers = crate::models::limits::LAYERS as u64;
        if !(1..=max_layers).contains(&num_layers) {
            return Err(Error::ModelLoad(format!(
                "config.json: num_hidden_layers = {num_layers} is out of range (1..={max_layers})"
            )));
        }
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?.max(1);
        let kv_heads = u("num_key_value_heads").unwrap_or(heads);
        let head_dim = u("head_dim").unwrap_or(hidden / heads);
        // the architecture's own layout (models/arch.rs); all layers full for an unknown
        // architecture or a config it refuses (loading it says why)
        let mut cfg = c.clone();
        if cfg.get("model_type").is_none() {
            cfg["model_type"] = Value::from(model_type.as_str());
        }
        let layout =
            crate::models::arch::layout_of(&cfg).and_then(Result::ok).filter(|l| l.len() == num_layers as usize);
        let sliding: Vec<Option<u64>> = match &layout {
            Some(l) => l
                .iter()
                .map(|l| match l.attn {
                    crate::models::AttnKind::Sliding { window } => Some(window as u64),
                    _ => None,
                })
                .collect(),
            None => vec![None; num_layers as usize],
        };
        let kv_elems: Vec<u64> = match &layout {
            Some(l) => l.iter().map(|l| l.kv_elems() as u64).collect(),
            None => vec![kv_heads * head_dim * 2; num_layers as usize],
        };
        let state_bytes =
            layout.as_ref().map_or(0, |l| l.iter().map(|l| l.state_bytes(act_bytes as usize) as u64).sum());
        let moe = match &layout {
            Some(l) => l
                .iter()
                .map(|l| match l.ffn {
                    crate::models::FfnKind::Moe { experts, top_k, .. } => (experts as u64, top_k as u64),
                    _ => (0, 0),
                })
                .collect(),
            None => vec![(0, 0); num_layers as usize],
        };
        Ok(ModelFacts {
            model_type,
            num_layers,
            hidden_size: hidden,
            intermediate_size: u("intermediate_size").unwrap_or(hidden * 4),
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            vocab_size: u("vocab_size").unwrap_or(0),
            sliding,
            kv_elems,
            state_bytes,
            act_bytes,
            weights_bytes,
            quantized_weights: config.get("quantization").or_else(|| config.get("quantization_config")).is_some()
                && !matches!(crate::weights::fp8_block(config), Ok(Some(_))),
            max_position_embeddings: u("max_position_embeddings"),
            expert_bytes: 0,
            moe,
            media_transient_bytes: 0,
            media_transient_host_bytes: 0,
            audio_transient_bytes: 0,
        })
    }
}

/// The text model's config: `text_config` when there is one (the multimodal configs), else the
/// whole config.
pub(crate) fn text_config(config: &Value) -> &Value {
    config.get("text_config").filter(|v| v.is_object()).unwrap_or(config)
}

/// The MLX backend a plan is for: it decides how attention runs and how many decoder layers'
/// prefill activations are alive at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl Backend {
    /// "cpu", "cuda" or "metal".
    pub fn parse(s: &str) -> Result<Backend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda),
            "metal" => Ok(Backend::Metal),
            _ => Err(Error::Invalid(format!("backend {s:?} is not one of cpu, cuda, metal"))),
        }
    }

    /// Whether MLX computes on its CUDA backend here (a GPU by [`Backend::detect`] and the loaded MLX's
    /// CUDA device): the condition of the engine's CUDA kernels and CUDA-only choices. Asked once.
    pub fn cuda() -> bool {
        static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *CUDA.get_or_init(|| Backend::detect() == Backend::Cuda && crate::handle::cuda_is_available())
    }

    /// The backend MLX computes on here: a GPU is Metal on macOS and CUDA elsewhere (as
    /// `runtime_info` says).
    pub fn detect() -> Backend {
        match crate::handle::default_device() {
            Ok(d) if d.kind() == crate::handle::DeviceKind::Gpu => {
                if cfg!(target_os = "macos") {
                    Backend::Metal
                } else {
                    Backend::Cuda
                }
            }
            _ => Backend::Cpu,
        }
    }

    /// Whether MLX's prefill attention is a fused kernel (no materialized scores) for a model with
    /// `act_bytes`-byte activations: always on Metal; on CUDA for 16-bit activations only (MLX 0.30.6
    /// runs cuDNN's fused attention for float16 / bfloat16 and the general path for float32: measured
    /// on an H200, bench/RESULTS-fit.md); never on the CPU.
    pub fn fused_attention(self, act_bytes: u64) -> bool {
        match self {
            Backend::Metal => true,
            Backend::Cuda => act_bytes == 2,
            Backend::Cpu => false,
        }
    }

    /// From how many rows (tokens of a prefill chunk, or sequences of a batched decode step) a
    /// matmul against `bits`-bit quantized weights dequantizes them and runs a plain matmul
    /// (`models::layers::quant_matmul`): on CUDA [`DEQUANT_ROWS_CUDA_4BIT`] for 4 bits or fewer,
    /// [`DEQUANT_ROWS_CUDA`] for more, where MLX's quantized matmul for more than one row passes over
    /// the weights about once per row and never on tensor cores (an 8B 4-bit model prefilled 2048
    /// tokens at 8.6k tok/s on an H200 against 38k for bf16, and decoded 8 / 32 sequences at 245 / 291
    /// tok/s together against 347 / 1206 dequantized; bench/RESULTS-gpu.md); on the CPU
    /// [`DEQUANT_ROWS_CPU`]; never on Metal, whose quantized kernels are fast.
    pub fn dequant_rows(self, bits: i32) -> u64 {
        match self {
            Backend::Cuda if bits <= 4 => DEQUANT_ROWS_CUDA_4BIT,
            Backend::Cuda => DEQUANT_ROWS_CUDA,
            Backend::Cpu => DEQUANT_ROWS_CPU,
            Backend::Metal => u64::MAX,
        }
    }

    /// Whether a weight dequantized for a matmul ([`Backend::dequant_rows`]) is float32 whatever the
    /// activations' dtype: on the CPU, where MLX's bfloat16 matmul has no BLAS behind it.
    pub fn dequant_float32(self) -> bool {
        matches!(self, Backend::Cpu)
    }

    /// How many decoder layers' prefill activations are alive at once: one on the CPU,
    /// [`GPU_LAYERS_IN_FLIGHT`] on a GPU.
    pub fn layers_in_flight(self) -> u64 {
        match self {
            Backend::Cpu => 1,
            Backend::Cuda | Backend::Metal => GPU_LAYERS_IN_FLIGHT,
        }
    }
}

/// [`Backend::dequant_rows`] on CUDA for 5 to 8 bits, and for 4 bits or fewer: the batch sizes from
/// which the dequantized weight decodes faster, measured per batch size on an H200 by
/// bench/bench_dequant_rows.py (8B 8-bit: 0.91× at 8 rows, 1.51× at 16; 8B 4-bit: 0.91× at 4 rows, 1.42×
/// at 8; bench/RESULTS-gpu.md).
pub const DEQUANT_ROWS_CUDA: u64 = 16;
/// On the CPU, the products of up to 8 rows run through the packed kernel
/// (`handle::host_packed_matmul`, affine 4/8-bit); from 9 rows on (prefill chunks) through the weight
/// dequantized to float32 and the BLAS's sgemm: MLX's own CPU quantized matmul loops over every row
/// and, for a bfloat16 x on x86, accumulates in bfloat16 (a 64-token prompt of a 1B 4-bit bfloat16
/// model: 0.1 tok/s through it, 0.9 through a bfloat16 dequantization; bench/RESULTS.md).
pub const DEQUANT_ROWS_CPU: u64 = 9;
pub const DEQUANT_ROWS_CUDA_4BIT: u64 = 8;

/// Options of one plan.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// The context to evaluate; None: the model's maximum (max_position_embeddings).
    pub context_tokens: Option<u64>,
    /// Quantized KV cache bits (4 or 8; 2, 3, 6 accepted as the engine accepts them).
    pub kv_bits: Option<u32>,
    pub kv_group_size: u64,
    pub prefill_step: u64,
    /// Attention runs as a fused kernel that never materializes the scores:
    /// [`Backend::fused_attention`] for the plan's backend and model.
    pub fused_attention: bool,
    /// Decoder layers whose prefill activations are alive at once: [`Backend::layers_in_flight`].
    pub layers_in_flight: u64,
    /// Rows from which quantized weights are dequantized for a matmul: [`Backend::dequant_rows`] (the
    /// fewest over bit widths: the planner counts the transient from there).
    pub dequant_rows: u64,
    /// The dequantized weight is float32 rather than the activations' dtype: [`Backend::dequant_float32`].
    pub dequant_float32: bool,
    /// The usable bytes.
    pub usable_bytes: u64,
    /// Plan the MoE experts streamed even when every weight would fit (`--stream-experts`).
    pub stream_experts: bool,
    /// The expert cache's bytes when streamed; None: what the budget leaves (at most every expert).
    pub expert_cache_bytes: Option<u64>,
    /// Streamed: each MoE layer reads the next layer's predicted experts ahead, which one step
    /// then holds beside its own (`models::experts::PREFETCH_DEFAULT` unless told).
    pub expert_prefetch: bool,
}

/// The admission contract (schemaVersion 1), serialized with camelCase keys.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryPlan {
    pub schema_version: u32,
    pub strategy: &'static str,
    pub fits: bool,
    pub context_tokens: u64,
    pub max_safe_context: u64,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub transient_bytes: u64,
    pub reserve_bytes: u64,
    pub total_bytes: u64,
    pub usable_bytes: u64,
    pub predicted_decode_tps: Option<f64>,
    pub allocator_limit_bytes: u64,
    /// `streamed-experts` only: the expert bytes left in the files, the expert cache's budget, its
    /// share of the experts, and the bytes read per decoded token predicted for uniform routing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streamed_expert_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_cache_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_cache_fraction: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_expert_bytes_per_token: Option<f64>,
    /// The part of `kv_bytes` that is the fixed-size state of linear-attention layers (one
    /// sequence's, whatever the context); absent for a model without such layers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_bytes: Option<u64>,
    /// `streamed-experts` with the cache left to the plan: the least cache it keeps
    /// ([`ModelFacts::expert_cache_floor`]); the context gives way to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_cache_floor_bytes: Option<u64>,
    /// The part of `transient_bytes` that is encoding one image at the model's largest image size
    /// with its vision tower; absent for a model without a modelled tower.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub media_transient_bytes: Option<u64>,
    /// Encoding one audio clip of the longest length the feature extractor keeps with the audio
    /// encoder; absent for a model without one. `transient_bytes` holds the larger of this and
    /// `media_transient_bytes` (a prompt's media are encoded one after another).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audio_transient_bytes: Option<u64>,
}

/// The largest context considered when a model does not say its own.
const NO_LIMIT_CONTEXT: u64 = 1 << 20;

impl ModelFacts {
    /// Bytes of one cached token in one layer (K and V; the most any layer of the layout caches, a
    /// latent-attention layer its latent and rope key).
    pub fn kv_bytes_per_token_layer(&self, kv_bits: Option<u32>, group: u64) -> f64 {
        let elems = self.kv_elems.iter().copied().max().unwrap_or(self.num_kv_heads * self.head_dim * 2);
        self.kv_bytes_per_token_elems(elems as f64, kv_bits, group)
    }

    fn kv_bytes_per_token_elems(&self, elems: f64, kv_bits: Option<u32>, group: u64) -> f64 {
        match kv_bits {
            // packed values plus one scale and one bias (in the activation dtype) per group
            Some(b) => elems * (b as f64 / 8.0 + 2.0 * self.act_bytes as f64 / group.max(1) as f64),
            None => elems * self.act_bytes as f64,
        }
    }

    /// Cache bytes of one sequence at `ctx` tokens: full layers hold ceil(ctx/256)×256 slots,
    /// sliding layers at most their window, and the recurrent layers their fixed state
    /// ([`ModelFacts::state_bytes`]) — what the engine's admission counts (`ModelShape::kv_bytes`).
    pub fn kv_bytes(&self, ctx: u64, kv_bits: Option<u32>, group: u64) -> u64 {
        if ctx == 0 {
            return 0;
        }
        self.kv_cache_bytes(ctx, kv_bits, group) + self.state_bytes
    }

    /// [`ModelFacts::kv_bytes`] without the recurrent state: the KV caches alone.
    fn kv_cache_bytes(&self, ctx: u64, kv_bits: Option<u32>, group: u64) -> u64 {
        let full_slots = ctx.div_ceil(KV_STEP) * KV_STEP;
        let mut total = 0f64;
        for (i, s) in self.sliding.iter().enumerate() {
            let slots = match s {
                Some(w) => full_slots.min(*w),
                None => full_slots,
            };
            let elems = self.kv_elems.get(i).copied().unwrap_or(self.num_kv_heads * self.head_dim * 2);
            total += slots as f64 * self.kv_bytes_per_token_elems(elems as f64, kv_bits, group);
        }
        total.ceil() as u64
    }

    /// Peak activation bytes while prefilling a context of `ctx` tokens in chunks of `step`.
    ///
    /// Derivation (`layers_in_flight` decoder layers are live at a time: one on the CPU, where MLX
    /// frees a layer's intermediates once the next consumes them; [`GPU_LAYERS_IN_FLIGHT`] on a GPU,
    /// where the prefill queues one layer ahead), for a chunk of P = min(step, ctx) tokens attending over ctx keys,
    /// in the activation dtype (a bytes) unless noted; per layer in flight:
    /// - hidden states: residual, normed input, attention output, MLP output: 4·P·hidden·a
    /// - q, k, v projections: P·(heads + 2·kv_heads)·head_dim·a
    /// - attention scores, materialized by SDPA's general path (CPU, float32 on CUDA; the fused
    ///   kernels do not, see [`Backend::fused_attention`], nor does the CPU's host attention of a
    ///   16-bit model): heads·P·ctx·a. MLX's precise
    ///   softmax accumulates in float32 row by row without a float32 copy of the scores: an
    ///   isolated `mx.fast.scaled_dot_product_attention` (L = 1024, causal) adds 4.5–6.3 bytes
    ///   per score element in float32 and 2.3–3.3 in bfloat16 (the scores, the masked copy
    ///   sharing their buffer, the boolean mask and the output)
    /// - MLP gate, up and their product: 3·P·intermediate·a
    /// - quantized weights dequantized for a prefill chunk of at least `dequant_rows` tokens: the
    ///   MLP's three matrices in the activation dtype, 3·intermediate·hidden·a (float32 where
    ///   `dequant_float32`: 4 bytes for a)
    ///
    /// - a quantized KV cache (`kv_bits`) of a float32 model on the CPU dequantized for a prefill
    ///   chunk of at least `dequant_rows` tokens: one layer's keys and values in float32,
    ///   slots(ctx)·kv_elems·4
    /// - a 16-bit model on the CPU (the host ops of `handle/half.rs`): a projection's input and
    ///   product in float32, P·(hidden + intermediate)·4, one float32 tile of a weight
    ///   (`HALF_TILE_BYTES`), and the host attention's scratch (one kv head's keys and values in
    ///   float32 and a pass's scores, at most `HALF_ATTN_SCRATCH_BYTES`:
    ///   `handle::half_attention_scratch_bytes`); a mixture's routed experts through the host gather
    ///   op besides, 2·P·top_k·(hidden + intermediate)·4 (its rows in float32 and their copies grouped
    ///   by expert)
    ///
    /// and once:
    /// - a KV cache growing by one step re-allocates one layer's buffer next to the old one:
    ///   kv(ctx) / layers
    /// - last-position logits and log-probabilities in float32: 2·vocab·4
    ///
    /// The sum is multiplied by [`TRANSIENT_SLACK`] for the allocator's rounding and the
    /// intermediates of norms and RoPE that the terms above do not name. A model with a vision
    /// tower adds the transient of encoding one image at its largest size
    /// ([`ModelFacts::media_transient_bytes`]) or, when larger, one audio clip of the longest length
    /// ([`ModelFacts::audio_transient_bytes`]), which a prompt with media allocates before its
    /// prefill's own.
    ///
    /// Calibrated against MLX's peak memory: see [`TRANSIENT_SLACK`] (CPU) and [`GPU_LAYERS_IN_FLIGHT`] (CUDA).
    pub fn transient_bytes(&self, ctx: u64, o: &PlanOptions) -> u64 {
        let (step, kv_bits, group) = (o.prefill_step, o.kv_bits, o.kv_group_size);
        if ctx == 0 {
            return 0;
        }
        let p = ctx.min(step.max(1)) as f64;
        let a = self.act_bytes as f64;
        let hidden = 4.0 * p * self.hidden_size as f64 * a;
        let qkv = p * ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim) as f64 * a;
        // 16-bit weights on the CPU: a prompt's attention runs in the host op (models/sdpa.rs
        // `cpu_half_prompt`: causal, or a sliding window's boolean mask; its scores counted in
        // `half_host`)
        let half_cpu = self.half_cpu(o);
        let scores = if o.fused_attention || half_cpu { 0.0 } else { self.num_heads as f64 * p * ctx as f64 * a };
        let mlp = 3.0 * p * self.intermediate_size as f64 * a;
        let dequant = if self.quantized_weights && p as u64 >= o.dequant_rows {
            3.0 * (self.intermediate_size * self.hidden_size) as f64 * if o.dequant_float32 { 4.0 } else { a }
        } else {
            0.0
        };
        // a quantized cache dequantized for the chunk's attention (float32 activations on the CPU,
        // models/layers.rs `dequant_kv`): one layer's keys and values in float32
        let kv_dequant = if kv_bits.is_some() && o.dequant_float32 && self.act_bytes == 4 && p as u64 >= o.dequant_rows
        {
            (ctx.div_ceil(KV_STEP) * KV_STEP) as f64 * self.kv_bytes_per_token_layer(None, group)
        } else {
            0.0
        };
        // 16-bit weights on the CPU (models/layers.rs `host_half`, models/sdpa.rs `cpu_half_prompt`): the
        // host ops' float32 copies
        let half_host = if half_cpu {
            let slots = ctx.div_ceil(KV_STEP) * KV_STEP;
            let attention = crate::handle::half_attention_scratch_bytes(
                self.num_heads,
                self.num_kv_heads,
                p as u64,
                slots,
                self.head_dim,
                self.head_dim,
            ) as f64;
            // a mixture's routed experts (handle/half.rs `host_half_gather_matmul`): every token's
            // top-k rows in and out in float32, and their copies grouped by expert
            let top_k = self.moe.iter().map(|m| m.1).max().unwrap_or(0) as f64;
            p * (self.hidden_size + self.intermediate_size) as f64 * 4.0
                + 2.0 * p * top_k * (self.hidden_size + self.intermediate_size) as f64 * 4.0
                + crate::handle::HALF_TILE_BYTES as f64
                + attention
        } else {
            0.0
        };
        let layers = o.layers_in_flight.clamp(1, self.num_layers.max(1)) as f64;
        let regrow = self.kv_cache_bytes(ctx, kv_bits, group) as f64 / self.num_layers.max(1) as f64;
        let logits = 2.0 * self.vocab_size as f64 * 4.0;
        ((layers * (hidden + qkv + scores + mlp + dequant + kv_dequant + half_host) + regrow + logits)
            * TRANSIENT_SLACK)
            .ceil() as u64
            + self.media_transient(o).max(self.audio_transient_bytes)
    }

    /// The model's own context limit.
    pub fn model_context(&self) -> u64 {
        self.max_position_embeddings.filter(|&m| m > 0).unwrap_or(NO_LIMIT_CONTEXT)
    }

    /// The total with `weights` resident bytes (the streamed plan: the non-expert weights plus the
    /// cache and the experts one step reads).
    fn total_with(&self, ctx: u64, o: &PlanOptions, weights: u64) -> u64 {
        weights + self.kv_bytes(ctx, o.kv_bits, o.kv_group_size) + self.transient_bytes(ctx, o) + RESERVE_BYTES
    }

    /// The largest context (≤ the model's) whose total fits `usable`; 0 when none does.
    pub fn max_safe_context(&self, o: &PlanOptions) -> u64 {
        self.max_context_with(o, self.weights_bytes)
    }

    fn max_context_with(&self, o: &PlanOptions, weights: u64) -> u64 {
        let cap = self.model_context();
        if self.total_with(1, o, weights) > o.usable_bytes {
            return 0;
        }
        if self.total_with(cap, o, weights) <= o.usable_bytes {
            return cap;
        }
        // total() is monotone in ctx: binary search the last fitting value
        let (mut lo, mut hi) = (1u64, cap);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.total_with(mid, o, weights) <= o.usable_bytes {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Bytes of one expert (all its projections), the experts being alike across MoE layers.
    pub fn bytes_per_expert(&self) -> u64 {
        let n: u64 = self.moe.iter().map(|m| m.0).sum();
        self.expert_bytes.checked_div(n).unwrap_or(0)
    }

    /// The experts a streamed step holds outside the cache at most: one layer's routed experts, read
    /// and stacked (two copies), and with `prefetch` the next layer's predicted experts read ahead
    /// (a third), for a prefill chunk of `step` tokens.
    fn streamed_step_bytes(&self, step: u64, prefetch: bool) -> u64 {
        let per = self.bytes_per_expert();
        let copies = if prefetch { 3 } else { 2 };
        self.moe.iter().map(|&(e, k)| copies * e.min(step.max(1) * k) * per).max().unwrap_or(0)
    }

    /// Expert bytes read per decoded token with a cache holding `fraction` of the experts, routing
    /// uniform (an LRU cache then hits with probability `fraction`; real routers are skewed, so
    /// real models read less): (1 − fraction) × Σ over MoE layers of top-k × bytes per expert.
    pub fn predicted_expert_bytes_per_token(&self, fraction: f64) -> f64 {
        let per = self.bytes_per_expert() as f64;
        let k: u64 = self.moe.iter().map(|m| m.1).sum();
        (1.0 - fraction.clamp(0.0, 1.0)) * k as f64 * per
    }

    /// The least expert cache a streamed plan keeps when the cache is left to it: one decoded
    /// token's routed experts in every MoE layer (Σ top-k × bytes per expert, at most every
    /// expert). The layers are visited in the same order at every step, so an LRU cache smaller
    /// than that evicts each expert before the next token could use it again: every expert that
    /// consecutive tokens share would be read again. The context gives way to this floor.
    pub fn expert_cache_floor(&self) -> u64 {
        let k: u64 = self.moe.iter().map(|m| m.1).sum();
        (k * self.bytes_per_expert()).min(self.expert_bytes)
    }

    /// The streamed-experts plan: resident = non-expert weights, expert cache, one step's experts,
    /// KV and transient; the cache gets what the budget leaves (at most every expert, at least
    /// [`ModelFacts::expert_cache_floor`]: a context that leaves less does not fit, and
    /// `max_safe_context` is the longest that leaves the floor), or `o.expert_cache_bytes`.
    fn plan_streamed(&self, o: &PlanOptions, ctx: u64) -> MemoryPlan {
        let step = self.streamed_step_bytes(o.prefill_step.min(ctx.max(1)), o.expert_prefetch);
        let base = self.weights_bytes.saturating_sub(self.expert_bytes) + step;
        let kv = self.kv_bytes(ctx, o.kv_bits, o.kv_group_size);
        let transient = self.transient_bytes(ctx, o);
        let rest = base + kv + transient + RESERVE_BYTES;
        let floor = if o.expert_cache_bytes.is_some() { None } else { Some(self.expert_cache_floor()) };
        let cache = o
            .expert_cache_bytes
            .unwrap_or_else(|| o.usable_bytes.saturating_sub(rest).min(self.expert_bytes).max(floor.unwrap_or(0)));
        let total = rest + cache;
        let fraction = if self.expert_bytes > 0 { (cache as f64 / self.expert_bytes as f64).min(1.0) } else { 1.0 };
        MemoryPlan {
            schema_version: 1,
            strategy: "streamed-experts",
            fits: total <= o.usable_bytes,
            context_tokens: ctx,
            max_safe_context: self.max_context_with(o, base + o.expert_cache_bytes.or(floor).unwrap_or(0)),
            weights_bytes: base - step + cache,
            kv_bytes: kv,
            transient_bytes: transient + step,
            reserve_bytes: RESERVE_BYTES,
            total_bytes: total,
            usable_bytes: o.usable_bytes,
            predicted_decode_tps: None,
            allocator_limit_bytes: o.usable_bytes.saturating_sub(RESERVE_BYTES),
            streamed_expert_bytes: Some(self.expert_bytes),
            expert_cache_bytes: Some(cache),
            expert_cache_fraction: Some(fraction),
            predicted_expert_bytes_per_token: Some(self.predicted_expert_bytes_per_token(fraction)),
            state_bytes: self.planned_state_bytes(),
            expert_cache_floor_bytes: floor,
            media_transient_bytes: self.planned_media_transient(o),
            audio_transient_bytes: self.planned_audio_transient(),
        }
    }

    /// Whether this model's 16-bit products and attention run on the CPU's host ops under `o`
    /// (`handle/half.rs`: 16-bit activations on the CPU backend).
    fn half_cpu(&self, o: &PlanOptions) -> bool {
        o.dequant_float32 && self.act_bytes == 2
    }

    /// One image's encoding on the backend of `o`: through the CPU's host attention for a 16-bit
    /// tower there ([`ModelFacts::media_transient_host_bytes`]), else MLX's.
    fn media_transient(&self, o: &PlanOptions) -> u64 {
        if self.half_cpu(o) && self.media_transient_host_bytes > 0 {
            self.media_transient_host_bytes
        } else {
            self.media_transient_bytes
        }
    }

    /// The plan's `mediaTransientBytes`: one image's encoding, for a model with a modelled tower.
    fn planned_media_transient(&self, o: &PlanOptions) -> Option<u64> {
        Some(self.media_transient(o)).filter(|&b| b > 0)
    }

    /// The plan's `audioTransientBytes`: one clip's encoding, for a model with an audio tower.
    fn planned_audio_transient(&self) -> Option<u64> {
        Some(self.audio_transient_bytes).filter(|&b| b > 0)
    }

    /// The plan's `stateBytes`: the recurrent state, for a model that has one.
    fn planned_state_bytes(&self) -> Option<u64> {
        Some(self.state_bytes).filter(|&b| b > 0)
    }

    /// The plan for `o`.
    pub fn plan(&self, o: &PlanOptions) -> MemoryPlan {
        let ctx = o.context_tokens.unwrap_or_else(|| self.model_context());
        let kv = self.kv_bytes(ctx, o.kv_bits, o.kv_group_size);
        let transient = self.transient_bytes(ctx, o);
        let total = self.weights_bytes + kv + transient + RESERVE_BYTES;
        // a MoE model that does not fit (or asked to): its experts streamed from the files
        if self.expert_bytes > 0 && (o.stream_experts || total > o.usable_bytes) {
            return self.plan_streamed(o, ctx);
        }
        MemoryPlan {
            schema_version: 1,
            strategy: "generic-kv",
            fits: total <= o.usable_bytes,
            context_tokens: ctx,
            max_safe_context: self.max_safe_context(o),
            weights_bytes: self.weights_bytes,
            kv_bytes: kv,
            transient_bytes: transient,
            reserve_bytes: RESERVE_BYTES,
            total_bytes: total,
            usable_bytes: o.usable_bytes,
            predicted_decode_tps: None,
            // what MLX's allocator may hold in all: the budget less the process reserve
            allocator_limit_bytes: o.usable_bytes.saturating_sub(RESERVE_BYTES),
            streamed_expert_bytes: None,
            expert_cache_bytes: None,
            expert_cache_fraction: None,
            predicted_expert_bytes_per_token: None,
            state_bytes: self.planned_state_bytes(),
            expert_cache_floor_bytes: None,
            media_transient_bytes: self.planned_media_transient(o),
            audio_transient_bytes: self.planned_audio_transient(),
        }
    }
}

/// Multiplier on the summed prefill terms (see [`ModelFacts::transient_bytes`]), calibrated so that
/// weights + kv + transient at n + 2 tokens covers MLX's peak memory (`Timings::peak_memory`) over
/// one generation of 2 tokens after a prompt of n random tokens, each in a fresh process (a session
/// keeps its last KV cache until the next generation replaces it). Linux x86_64, CPU backend with
/// OpenBLAS, MLX 0.30.6, prefill step 2048. tests/test_fit.py re-measures the fit-* rows and
/// requires every ratio within 15%.
///
/// The measured peaks against this plan, and the history of the constant: bench/RESULTS-fit.md (CPU).
pub const TRANSIENT_SLACK: f64 = 1.2;

/// Decoder layers whose prefill activations the planner counts on a GPU (CUDA, Metal), where the
/// prefill evaluates every layer and queues the next one before waiting for the previous one
/// (`generate::prefill_staging`): the layer being queued allocates while the previous one runs, and
/// MLX releases a finished layer's buffers from its completion thread, so part of the one before can
/// still be held. With [`TRANSIENT_SLACK`], and attention per [`Backend::fused_attention`].
///
/// Measured on an NVIDIA H200 (MLX 0.30.6's CUDA backend): the 1B and 3B shapes peak at two to two
/// and a half layers' worth, within 1.03–1.06 of this plan; the small float32 models, whose one layer
/// is mostly attention scores, below it (an upper bound for them). Every row, and the peaks before the
/// staged prefill: bench/RESULTS-fit.md (CUDA).
pub const GPU_LAYERS_IN_FLIGHT: u64 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> ModelFacts {
        let cfg = serde_json::json!({
            "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 512,
            "max_position_embeddings": 4096
        });
        ModelFacts::from_config(&cfg, 5_000_000, 4).unwrap()
    }

    fn opts(usable: u64) -> PlanOptions {
        PlanOptions {
            context_tokens: None,
            kv_bits: None,
            kv_group_size: 64,
            prefill_step: 2048,
            fused_attention: false,
            dequant_rows: u64::MAX,
            dequant_float32: false,
            layers_in_flight: 1,
            usable_bytes: usable,
            stream_experts: false,
            expert_cache_bytes: None,
            expert_prefetch: false,
        }
    }

    #[test]
    fn kv_per_token() {
        let f = facts();
        // 2 layers × 2 kv heads × 64 × 2 (K, V) × 4 bytes = 2048 bytes per token
        assert_eq!(f.kv_bytes(256, None, 64), 256 * 2048);
        assert_eq!(f.kv_bytes(1, None, 64), 256 * 2048); // one growth step
                                                         // 8-bit: 1 byte + 2 × 4 / 64 per element
        let q8 = f.kv_bytes_per_token_layer(Some(8), 64);
        assert!((q8 - 256.0 * (1.0 + 8.0 / 64.0)).abs() < 1e-9);
    }

    /// DeepSeek-V3's latent attention: the planner counts the cached latent + rope key per token
    /// and layer (576 elements), not heads × head dim × K,V (128 × 56 × 2); deepseek_v32 the
    /// indexer's key beside them.
    #[test]
    fn latent_attention_counts_the_compressed_cache() {
        let mut cfg = serde_json::json!({
            "model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 7168, "num_attention_heads": 128,
            "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536
        });
        let f = ModelFacts::from_config(&cfg, 0, 2).unwrap();
        assert_eq!(f.kv_elems, vec![576, 576]);
        assert_eq!(f.kv_bytes(256, None, 64), 2 * 256 * 576 * 2);
        assert_eq!(f.kv_bytes_per_token_layer(None, 64), 576.0 * 2.0);
        cfg["model_type"] = serde_json::json!("deepseek_v32");
        cfg["index_head_dim"] = serde_json::json!(128);
        assert_eq!(ModelFacts::from_config(&cfg, 0, 2).unwrap().kv_elems, vec![704, 704]);
    }

    /// Qwen3.5's linear-attention layers: no KV, a fixed state per sequence (float32 recurrence,
    /// convolution inputs in the activation dtype), counted once whatever the context, not quantized
    /// with the KV, and the same figure the engine's admission uses (`ModelShape::kv_bytes`).
    #[test]
    fn recurrent_state_is_counted_per_sequence() {
        let cfg = serde_json::json!({
            "model_type": "qwen3_5", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 512,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2
        });
        let f = ModelFacts::from_config(&cfg, 0, 2).unwrap();
        // 2 linear layers × (conv 3 × (2·2·32 + 4·16) × 2 bytes + state 4 × 16 × 32 × 4 bytes)
        let state = 2 * (3 * 192 * 2 + 4 * 16 * 32 * 4);
        assert_eq!(f.state_bytes, state);
        assert_eq!(f.kv_elems, vec![0, 256, 0, 256]);
        let kv = |ctx: u64| 2 * ctx.div_ceil(256) * 256 * 256 * 2;
        for ctx in [1, 300, 5000] {
            assert_eq!(f.kv_bytes(ctx, None, 64), kv(ctx) + state, "{ctx}");
        }
        assert_eq!(f.kv_bytes(0, None, 64), 0);
        let q8 = |ctx: u64| (2.0 * (ctx.div_ceil(256) * 256) as f64 * 256.0 * (1.0 + 4.0 / 64.0)).ceil() as u64;
        assert_eq!(f.kv_bytes(300, Some(8), 64), q8(300) + state);
        let p = f.plan(&PlanOptions { context_tokens: Some(300), ..opts(u64::MAX) });
        assert_eq!((p.state_bytes, p.kv_bytes), (Some(state), kv(300) + state));
        // the loaded model's shape gives the admission the same bytes
        let layout = crate::models::arch::layout_of(&cfg).unwrap().unwrap();
        let shape = crate::models::ModelShape::new("qwen3_5", layout, 256, 512, None, 2);
        assert_eq!(shape.kv_bytes(300, None, 64) as u64, f.kv_bytes(300, None, 64));
        // a model without recurrent layers: no stateBytes in its plan
        assert_eq!(facts().plan(&opts(u64::MAX)).state_bytes, None);
    }

    #[test]
    fn sliding_layers_are_capped() {
        let cfg = serde_json::json!({
            "model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 512,
            "sliding_window": 16, "sliding_window_pattern": 2
        });
        let f = ModelFacts::from_config(&cfg, 0, 4).unwrap();
        assert_eq!(f.sliding, vec![Some(16), None]);
        assert_eq!(f.kv_bytes(1024, None, 64), (1024 + 16) * 1024);
    }

    #[test]
    fn max_safe_context_is_the_boundary() {
        let f = facts();
        let o = opts(u64::MAX);
        assert_eq!(f.max_safe_context(&o), 4096);
        let at = |ctx| f.plan(&PlanOptions { context_tokens: Some(ctx), ..opts(u64::MAX) }).total_bytes;
        let budget = at(1000);
        let o = opts(budget);
        let m = f.max_safe_context(&o);
        assert!(m >= 1000 && at(m) <= budget && at(m + 1) > budget, "{m}");
        assert_eq!(f.max_safe_context(&opts(1000)), 0);
        let p = f.plan(&opts(budget));
        assert!(!p.fits);
        assert_eq!(p.context_tokens, 4096);
    }

    /// A 4-layer qwen3_moe (16 experts, top-2) of 100 MB, its context `max_pos` tokens.
    fn small_moe_facts(max_pos: u64) -> ModelFacts {
        let cfg = serde_json::json!({
            "model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 512,
            "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "max_position_embeddings": max_pos
        });
        ModelFacts::from_config(&cfg, 100_000_000, 4).unwrap()
    }

    #[test]
    fn a_moe_model_over_budget_is_planned_streamed() {
        let mut f = small_moe_facts(4096);
        assert_eq!(f.moe, vec![(16, 2); 4]);
        // no expert bytes known (a GGUF): never streamed
        let o = |usable, stream| PlanOptions { context_tokens: Some(512), stream_experts: stream, ..opts(usable) };
        assert_eq!(f.plan(&o(1, false)).strategy, "generic-kv");
        f.expert_bytes = 64_000_000; // 64 experts of 1 MB
        assert_eq!(f.bytes_per_expert(), 1_000_000);
        let resident = f.plan(&o(u64::MAX, false));
        assert_eq!(resident.strategy, "generic-kv");
        let budget = resident.total_bytes - 20_000_000;
        let p = f.plan(&o(budget, false));
        assert_eq!(p.strategy, "streamed-experts");
        assert!(p.fits && p.total_bytes == budget);
        // one layer's 16 experts read and stacked during a 512-token prefill chunk
        assert_eq!(p.transient_bytes, resident.transient_bytes + 32_000_000);
        // and, reading ahead, the next layer's 16 beside them
        let ahead = f.plan(&PlanOptions { expert_prefetch: true, ..o(budget, false) });
        assert_eq!(ahead.transient_bytes, resident.transient_bytes + 48_000_000);
        let cache = p.expert_cache_bytes.unwrap();
        assert_eq!(cache, 64_000_000 - 20_000_000 - 32_000_000);
        assert_eq!(p.weights_bytes, 36_000_000 + cache);
        let frac = cache as f64 / 64e6;
        assert!((p.predicted_expert_bytes_per_token.unwrap() - (1.0 - frac) * 8.0 * 1e6).abs() < 1.0);
        // too small for even the non-expert weights: streamed, not fitting, the cache at its floor
        // (one token's routed experts: 4 MoE layers × top-2 × 1 MB)
        assert_eq!(f.expert_cache_floor(), 8_000_000);
        let tiny = f.plan(&o(1_000, false));
        assert!(!tiny.fits && tiny.expert_cache_bytes == Some(8_000_000) && tiny.max_safe_context == 0);
        assert_eq!(p.expert_cache_floor_bytes, Some(8_000_000));
        // forced: streamed with the cache it is given, though everything fits
        let forced = f.plan(&PlanOptions { expert_cache_bytes: Some(5_000_000), ..o(u64::MAX, true) });
        assert_eq!((forced.strategy, forced.expert_cache_bytes), ("streamed-experts", Some(5_000_000)));
        assert_eq!(forced.expert_cache_floor_bytes, None);
    }

    /// A budget the context fills: the plan keeps the expert cache's floor (one token's routed
    /// experts) and the context gives way, instead of a cache of 0 bytes.
    #[test]
    fn the_context_gives_way_to_the_expert_cache_floor() {
        let mut f = small_moe_facts(65536);
        f.expert_bytes = 64_000_000;
        let floor = f.expert_cache_floor();
        assert_eq!(floor, 8_000_000);
        let at = |ctx: u64, usable: u64| {
            f.plan(&PlanOptions { context_tokens: Some(ctx), stream_experts: true, ..opts(usable) })
        };
        // the budget of 4096 tokens with no expert cache at all: at 4096 tokens the floor does not
        // fit, the plan says so and keeps the floor; the safe context is shorter and leaves it
        let zero = f.plan(&PlanOptions {
            context_tokens: Some(4096),
            stream_experts: true,
            expert_cache_bytes: Some(0),
            ..opts(u64::MAX)
        });
        let budget = zero.total_bytes;
        let p = at(4096, budget);
        assert_eq!(p.expert_cache_bytes, Some(floor));
        assert!(!p.fits && p.total_bytes == budget + floor);
        let m = p.max_safe_context;
        assert!(m > 0 && m < 4096, "{m}");
        let q = at(m, budget);
        assert!(q.fits && q.expert_cache_bytes.unwrap() >= floor, "{q:?}");
        let r = at(m + 1, budget);
        assert!(!r.fits && r.expert_cache_bytes == Some(floor));
        // with room to spare the cache takes what is left, above the floor
        let big = at(4096, budget + 3 * floor);
        assert!(big.fits && big.expert_cache_bytes == Some(3 * floor));
        // the model's whole context (65536) does not fit: the floor is still kept
        let whole = f.plan(&PlanOptions { stream_experts: true, ..opts(budget) });
        assert_eq!((whole.context_tokens, whole.expert_cache_bytes, whole.max_safe_context), (65536, Some(floor), m));
    }

    #[test]
    fn budgets_parse() {
        assert_eq!(Budget::parse("0.5").unwrap(), Budget::Fraction(0.5));
        assert_eq!(Budget::parse("1").unwrap(), Budget::Fraction(1.0));
        assert_eq!(Budget::parse("8000000000").unwrap(), Budget::Bytes(8_000_000_000));
        assert_eq!(Budget::parse("12G").unwrap(), Budget::Bytes(12 << 30));
        assert_eq!(Budget::parse("512MiB").unwrap(), Budget::Bytes(512 << 20));
        assert_eq!(Budget::parse("2GB").unwrap(), Budget::Bytes(2_000_000_000));
        for bad in ["", "-1", "0", "1.5", "abc", "12X", "nan"] {
            assert!(Budget::parse(bad).is_err(), "{bad}");
        }
    }
}
