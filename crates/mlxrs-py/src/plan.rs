//! `mlxrs._native.plan` / `device_memory`: the memory planner (mlxrs-core's `plan.rs`).
use crate::PyResultExt;
use mlxrs_core::plan::{self as core_plan, Backend, Budget, ModelFacts, PlanOptions};
use mlxrs_core::Error;
use pyo3::prelude::*;

/// The memory plan (MemoryPlan schemaVersion 1, as JSON) for the model in `model_dir` (or a
/// `.gguf` file, planned as its import on `backend`: f32 on the CPU, bf16 on GPUs) at
/// `context_tokens` (None: the model's maximum), with a quantized KV cache of `kv_bits` and the
/// `budget` ("0.75"-style fraction of device memory or bytes such as "12G"; None: 0.75).
/// `device_bytes` overrides the device memory and `backend` ("cpu", "cuda", "metal") the backend
/// (what `--skus` evaluates; None: this machine's). The backend decides whether attention is
/// fused (Metal; CUDA with 16-bit activations) and how many layers' prefill activations are alive
/// at once (three on a GPU); `fused_attention` overrides the first. A MoE model that does not fit,
/// or `stream_experts`, is planned `streamed-experts` (its expert cache `expert_cache_bytes`, None:
/// what the budget leaves; `expert_prefetch` None: the engine's default).
#[pyfunction]
#[pyo3(signature = (model_dir, context_tokens=None, kv_bits=None, budget=None, kv_group_size=64,
                    prefill_step_size=2048, device_bytes=None, fused_attention=None, backend=None,
                    stream_experts=false, expert_cache_bytes=None, adapter_bytes=0, expert_prefetch=None))]
#[allow(clippy::too_many_arguments)]
pub fn plan(
    py: Python<'_>,
    model_dir: std::path::PathBuf,
    context_tokens: Option<u64>,
    kv_bits: Option<u32>,
    budget: Option<&str>,
    kv_group_size: u64,
    prefill_step_size: u64,
    device_bytes: Option<u64>,
    fused_attention: Option<bool>,
    backend: Option<&str>,
    stream_experts: bool,
    expert_cache_bytes: Option<u64>,
    adapter_bytes: u64,
    expert_prefetch: Option<bool>,
) -> PyResult<String> {
    if let Some(b) = kv_bits {
        if ![2, 3, 4, 6, 8].contains(&b) {
            return Err(Error::Invalid(format!("kv_bits must be one of 2, 3, 4, 6, 8 (got {b})"))).py(py);
        }
    }
    if kv_group_size == 0 || prefill_step_size == 0 {
        return Err(Error::Invalid("kv_group_size and prefill_step_size must be >= 1".into())).py(py);
    }
    let budget = budget.map(Budget::parse).transpose().py(py)?.unwrap_or(Budget::Default);
    let backend = backend.map(Backend::parse).transpose().py(py)?;
    let mut facts = crate::native(py, || ModelFacts::from_path_on(&model_dir, backend))?;
    // LoRA adapters' tensors: resident beside the weights (`mlxrs_core::lora`)
    facts.weights_bytes += adapter_bytes;
    let dev_bytes = match device_bytes {
        Some(b) => b,
        None => py.allow_threads(core_plan::device_memory).bytes,
    };
    let backend = match backend {
        Some(b) => b,
        None => py.allow_threads(Backend::detect),
    };
    let o = PlanOptions {
        context_tokens,
        kv_bits,
        kv_group_size,
        prefill_step: prefill_step_size,
        fused_attention: fused_attention.unwrap_or_else(|| backend.fused_attention(facts.act_bytes)),
        layers_in_flight: backend.layers_in_flight(),
        dequant_rows: backend.dequant_rows(4),
        dequant_float32: backend.dequant_float32(),
        usable_bytes: core_plan::budget_bytes(budget, dev_bytes),
        stream_experts,
        expert_cache_bytes,
        expert_prefetch: expert_prefetch.unwrap_or(mlxrs_core::models::experts::PREFETCH_DEFAULT),
    };
    serde_json::to_string(&facts.plan(&o)).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

/// The device memory the default budget is a fraction of: (bytes, source) where source is
/// "mlx-gpu", "proc-meminfo", "sysctl" or "unknown".
#[pyfunction]
pub fn device_memory(py: Python<'_>) -> (u64, String) {
    let d = py.allow_threads(core_plan::device_memory);
    (d.bytes, d.source.to_string())
}

/// What the planner knows about the model in `model_dir` (or a `.gguf` file), as JSON: the
/// fields of `ModelFacts` plus `kv_bytes_per_token_layer` for `kv_bits` (None: unquantized).
#[pyfunction]
#[pyo3(signature = (model_dir, kv_bits=None, kv_group_size=64))]
pub fn model_facts(
    py: Python<'_>,
    model_dir: std::path::PathBuf,
    kv_bits: Option<u32>,
    kv_group_size: u64,
) -> PyResult<String> {
    let facts = crate::native(py, || ModelFacts::from_path(&model_dir))?;
    let mut v = serde_json::to_value(&facts).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    v["kv_bytes_per_token_layer"] = serde_json::json!(facts.kv_bytes_per_token_layer(kv_bits, kv_group_size.max(1)));
    Ok(v.to_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(model_facts, m)?)?;
    // the model_type values mlxrs can load (models/mod.rs), for the registry's `supported` column
    m.add("SUPPORTED_MODEL_TYPES", mlxrs_core::models::supported())?;
    // GGUF general.architecture -> model_type, from the same table (gguf/import.rs)
    m.add("GGUF_ARCHITECTURES", mlxrs_core::gguf::import::importable())?;
    Ok(())
}
