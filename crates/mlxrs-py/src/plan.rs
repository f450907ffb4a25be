//! `mlxrs._native.plan` / `device_memory`: the memory planner (mlxrs-core's `plan.rs`).
use crate::PyResultExt;
use mlxrs_core::plan::{self as core_plan, Budget, ModelFacts, PlanOptions};
use mlxrs_core::Error;
use pyo3::prelude::*;

/// The memory plan (MemoryPlan schemaVersion 1, as JSON) for the model in `model_dir` (or a
/// `.gguf` file, planned as its bf16 import) at
/// `context_tokens` (None: the model's maximum), with a quantized KV cache of `kv_bits` and the
/// `budget` ("0.75"-style fraction of device memory or bytes such as "12G"; None: 0.75).
/// `device_bytes` overrides the device memory (what `--skus` evaluates); `fused_attention`
/// defaults to true on Metal only: MLX 0.30.6 has no fused prefill attention on CUDA, where the
/// peaks measured on an H200 (bench/RESULTS-fit.md) are up to 3.4x the fused plan.
#[pyfunction]
#[pyo3(signature = (model_dir, context_tokens=None, kv_bits=None, budget=None, kv_group_size=64,
                    prefill_step_size=2048, device_bytes=None, fused_attention=None))]
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
    let facts = py.allow_threads(|| ModelFacts::from_path(&model_dir)).py(py)?;
    let (dev_bytes, gpu) = match (device_bytes, fused_attention) {
        (Some(b), Some(f)) => (b, f),
        _ => {
            let d = py.allow_threads(core_plan::device_memory);
            let metal = d.source == "mlx-gpu" && cfg!(target_os = "macos");
            (device_bytes.unwrap_or(d.bytes), fused_attention.unwrap_or(metal))
        }
    };
    let o = PlanOptions {
        context_tokens,
        kv_bits,
        kv_group_size,
        prefill_step: prefill_step_size,
        fused_attention: gpu,
        usable_bytes: core_plan::budget_bytes(budget, dev_bytes),
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
pub fn model_facts(py: Python<'_>, model_dir: std::path::PathBuf, kv_bits: Option<u32>, kv_group_size: u64) -> PyResult<String> {
    let facts = py.allow_threads(|| ModelFacts::from_path(&model_dir)).py(py)?;
    let mut v = serde_json::to_value(&facts).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    v["kv_bytes_per_token_layer"] = serde_json::json!(facts.kv_bytes_per_token_layer(kv_bits, kv_group_size.max(1)));
    Ok(v.to_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(model_facts, m)?)?;
    // the model_type values mlxrs can load (models/mod.rs), for the registry's `supported` column
    m.add("SUPPORTED_MODEL_TYPES", mlxrs_core::models::SUPPORTED.to_vec())?;
    Ok(())
}
