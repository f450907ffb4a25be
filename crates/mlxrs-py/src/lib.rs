//! `mlxrs._native`: thin PyO3 wrappers over mlxrs-core and the mapping of its errors onto
//! `mlxrs.errors`. No logic lives here.
use mlxrs_core::{Array, Dtype, Error};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

#[cfg(feature = "testing")]
mod dispatch;
mod download;
mod plan;
mod session;

/// Map a core error to the matching `mlxrs.errors` class.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let cls = match &e {
        Error::Mlx(_) => "MlxError",
        Error::Runtime(_) | Error::NoRuntime(_) => "NativeRuntimeError",
        Error::Invalid(_) => "InvalidArgumentError",
        Error::ModelLoad(_) | Error::Io { .. } => "ModelLoadError",
        Error::Unsupported(_) => "UnsupportedModelError",
        Error::Busy(_) => "BusyError",
        Error::Engine(_) => "EngineError",
    };
    let msg = e.to_string();
    match py.import("mlxrs.errors").and_then(|m| m.getattr(cls)) {
        Ok(c) => PyErr::from_value(c.call1((msg,)).unwrap_or_else(|err| err.into_value(py).into_bound(py).into_any())),
        Err(_) => PyValueError::new_err(msg),
    }
}

/// The one boundary between Python and the core: `f` runs without the GIL, its error maps to its
/// `mlxrs.errors` class, and a panic (a bug) to `MlxrsError` instead of PyO3's `PanicException`,
/// a BaseException that `except Exception` (and the server's error handling) would not catch.
pub(crate) fn native<T: Send>(py: Python<'_>, f: impl FnOnce() -> mlxrs_core::Result<T> + Send) -> PyResult<T> {
    match py.allow_threads(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))) {
        Ok(r) => r.py(py),
        Err(p) => {
            let msg =
                format!("internal error in mlxrs: {} (a bug: please report it)", mlxrs_core::engine::panic_text(&*p));
            match py.import("mlxrs.errors").and_then(|m| m.getattr("MlxrsError")) {
                Ok(c) => Err(PyErr::from_value(
                    c.call1((msg,)).unwrap_or_else(|err| err.into_value(py).into_bound(py).into_any()),
                )),
                Err(_) => Err(PyValueError::new_err(msg)),
            }
        }
    }
}

pub(crate) trait PyResultExt<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}
impl<T> PyResultExt<T> for mlxrs_core::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// Register a directory that may hold libmlx (the installed `mlx` package's lib/) before loading.
#[pyfunction]
fn _register_mlx_lib_dir(dir: std::path::PathBuf) {
    mlxrs_sys::register_mlx_lib_dir(dir);
}

/// Put the BLAS ahead of libmlx now, where the runtime is found locally (the package calls this when
/// it is imported, before anything may import `mlx.core`): whether libmlx was loaded already
/// (`mlx.core` imported first), so that MLX's own BLAS serves it in this process.
#[pyfunction]
fn _preload_blas() -> bool {
    mlxrs_sys::preload_blas_early().is_some_and(|p| p.mlx_loaded_first)
}

/// Load the native runtime and describe it (paths, versions, backend, BLAS, memory).
#[pyfunction]
fn runtime_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = crate::native(py, mlxrs_core::info::runtime_info)?;
    let d = PyDict::new(py);
    let v = serde_json::to_value(&info).map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let serde_json::Value::Object(m) = v {
        for (k, v) in m {
            let val: PyObject = match v {
                serde_json::Value::Null => py.None(),
                serde_json::Value::Number(n) => n
                    .as_u64()
                    .map(|u| u.into_pyobject(py).map(|o| o.into_any().unbind()))
                    .transpose()?
                    .unwrap_or_else(|| py.None()),
                serde_json::Value::String(s) => s.into_pyobject(py)?.into_any().unbind(),
                serde_json::Value::Bool(b) => pyo3::types::PyBool::new(py, b).to_owned().into_any().unbind(),
                other => other.to_string().into_pyobject(py)?.into_any().unbind(),
            };
            d.set_item(k, val)?;
        }
    }
    Ok(d)
}

/// `mlxrs info`'s tiny computation through MLX: `[[0,1,2],[3,4,5]] @ ones(3,2)`.
#[pyfunction]
fn _tiny_matmul(py: Python<'_>) -> PyResult<Vec<Vec<f32>>> {
    native(py, mlxrs_core::info::tiny_matmul)
}

/// MLX ops built since the process started (mlxrs-core's `handle::op_count`, every thread): the
/// difference over generated tokens is the ops per decode step (bench/ops_per_step.py).
#[pyfunction]
fn _op_count() -> u64 {
    mlxrs_core::handle::op_count()
}

/// Float32 projections computed by the host kernel of the CPU backend (mlxrs-core's
/// `handle::small_matmul_calls`): tests and benchmarks check that path ran.
#[pyfunction]
fn _host_matmul_count() -> u64 {
    mlxrs_core::handle::small_matmul_calls()
}

/// Products computed by the CPU's packed kernel for MLX's 4/8-bit affine weights (mlxrs-core's
/// `handle::packed_matmul_calls`): tests and benchmarks check that path ran.
#[pyfunction]
fn _packed_matmul_count() -> u64 {
    mlxrs_core::handle::packed_matmul_calls()
}

/// Products the CPU backend computed with mlxrs's host op for 16-bit float weights (mlxrs-core's
/// `handle::half_matmul_calls`): tests and benchmarks check that path ran.
#[pyfunction]
fn _half_matmul_count() -> u64 {
    mlxrs_core::handle::half_matmul_calls()
}

/// Routed-expert products (a mixture's gather) the CPU backend computed with mlxrs's host op for
/// 16-bit float experts (mlxrs-core's `handle::half_gather_calls`).
#[pyfunction]
fn _half_gather_count() -> u64 {
    mlxrs_core::handle::half_gather_calls()
}

/// Prompt attentions the CPU backend computed with mlxrs's host op for 16-bit floats (mlxrs-core's
/// `handle::half_attention_calls`).
#[pyfunction]
fn _half_attention_count() -> u64 {
    mlxrs_core::handle::half_attention_calls()
}

/// A model directory's generation_config.json as JSON text ("null" when it has none).
#[pyfunction]
fn generation_config(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<String> {
    native(py, || mlxrs_core::tokenizer::generation_config(&model_dir)).map(|v| v.to_string())
}

/// What `mlxrs ls` shows of a model directory, loadable or not (mlxrs-core's `describe::describe`):
/// a dict with the fields of `Description` (see `_native.pyi`). Raises ModelLoadError when it is
/// not a model directory (config.json, the weight files or a header missing or invalid).
#[pyfunction]
fn describe<'py>(py: Python<'py>, model_dir: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let d = native(py, || mlxrs_core::describe::describe(&model_dir))?;
    let out = PyDict::new(py);
    out.set_item("model_type", d.model_type)?;
    out.set_item("supported", d.supported)?;
    out.set_item("note", d.note)?;
    out.set_item("params", d.params)?;
    out.set_item("weight_bytes", d.weight_bytes)?;
    out.set_item("dtype", d.dtype)?;
    out.set_item("quantization", d.quantization)?;
    out.set_item("context_length", d.context_length)?;
    out.set_item("chat_template", d.chat_template)?;
    out.set_item("tools", d.tools)?;
    out.set_item("files", d.files)?;
    Ok(out)
}

/// mlxrs's own directory (`$MLXRS_HOME`, else `$XDG_CACHE_HOME/mlxrs`, else `~/.cache/mlxrs`;
/// None without any of them): the native packs, the registry, GGUF imports.
#[pyfunction]
fn mlxrs_home() -> Option<String> {
    mlxrs_sys::mlxrs_home().map(|p| p.to_string_lossy().into_owned())
}

/// Set MLX's memory limit (the memory plan's `allocatorLimitBytes`); returns the previous one.
/// MLX's memory counters (bytes): {"active", "peak", "cache"}; `reset_peak` first sets the peak
/// to the active bytes (mlx-c's `mlx_reset_peak_memory`), for measuring one operation's peak.
#[pyfunction]
#[pyo3(signature = (reset_peak=false))]
fn memory_counters(py: Python<'_>, reset_peak: bool) -> PyResult<Bound<'_, PyDict>> {
    let (active, peak, cache) = native(py, || {
        mlxrs_core::handle::init()?;
        if reset_peak {
            mlxrs_core::handle::reset_peak_memory();
        }
        Ok::<_, mlxrs_core::error::Error>((
            mlxrs_core::handle::active_memory(),
            mlxrs_core::handle::peak_memory(),
            mlxrs_core::handle::cache_memory(),
        ))
    })?;
    let d = PyDict::new(py);
    d.set_item("active", active)?;
    d.set_item("peak", peak)?;
    d.set_item("cache", cache)?;
    Ok(d)
}

#[pyfunction]
fn set_memory_limit(py: Python<'_>, bytes: usize) -> PyResult<usize> {
    native(py, || {
        mlxrs_core::handle::init()?;
        mlxrs_core::handle::set_memory_limit(bytes)
    })
}

/// MLX's memory limit now.
#[pyfunction]
fn memory_limit(py: Python<'_>) -> PyResult<usize> {
    native(py, || {
        mlxrs_core::handle::init()?;
        mlxrs_core::handle::memory_limit()
    })
}

/// The places the resolver would search, in order, without loading anything.
#[pyfunction]
fn _resolution_order() -> Vec<String> {
    let r = mlxrs_sys::Resolver::from_env();
    match r.find() {
        Ok((src, p)) => vec![format!("{src}: {}", p.display())],
        Err(e) => vec![e.to_string()],
    }
}

type Raw = (Py<PyBytes>, Vec<i32>, String);

fn array_in(data: &[u8], shape: &[i32], dtype: &str) -> mlxrs_core::Result<Array> {
    let dt = Dtype::from_name(dtype).ok_or_else(|| Error::Invalid(format!("unknown dtype {dtype}")))?;
    Array::from_bytes(data, shape, dt)
}

fn array_out(py: Python<'_>, a: &Array) -> mlxrs_core::Result<Raw> {
    let bytes = a.to_bytes()?;
    Ok((PyBytes::new(py, &bytes).unbind(), a.shape(), a.dtype().name().to_string()))
}

/// Copy a buffer into an MLX array and back out (proves the data path both ways).
#[pyfunction]
fn _array_roundtrip(py: Python<'_>, data: &[u8], shape: Vec<i32>, dtype: &str) -> PyResult<Raw> {
    let a = array_in(data, &shape, dtype).py(py)?;
    array_out(py, &a).py(py)
}

/// Run one op of the core's surface by name on raw arrays (the test suite checks each against numpy).
/// Only in the test build (the `testing` feature).
#[cfg(feature = "testing")]
#[pyfunction]
#[pyo3(signature = (name, inputs, params="{}"))]
fn _op(py: Python<'_>, name: &str, inputs: Vec<(Vec<u8>, Vec<i32>, String)>, params: &str) -> PyResult<Vec<Raw>> {
    let arrays = inputs.iter().map(|(d, s, t)| array_in(d, s, t)).collect::<mlxrs_core::Result<Vec<_>>>().py(py)?;
    let params: serde_json::Value = serde_json::from_str(params).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let outs = native(py, || dispatch::dispatch(name, &arrays, &params))?;
    outs.iter().map(|a| array_out(py, a).py(py)).collect()
}

/// Decode a WAV clip as the audio path does: (mono float32 samples, sample rate).
#[pyfunction]
fn _audio_decode(py: Python<'_>, data: Vec<u8>) -> PyResult<(Vec<f32>, u32)> {
    let w = crate::native(py, move || {
        mlxrs_core::vision::audio::decode(&data, &mlxrs_core::vision::audio::DEFAULT_AUDIO_LIMITS, "audio")
    })?;
    Ok((w.samples, w.rate))
}

/// Resample float32 samples from `src` Hz to `dst` Hz as the audio path does.
#[pyfunction]
fn _audio_resample(py: Python<'_>, samples: Vec<f32>, src: u32, dst: u32) -> PyResult<Vec<f32>> {
    crate::native(py, move || mlxrs_core::vision::audio::resample(&samples, src, dst))
}

/// Gemma 4's log-mel features of 16 kHz samples, `fe` the feature extractor's settings (JSON):
/// (features `[frames, 128]` flattened, frames, each frame's mask).
#[pyfunction]
#[pyo3(signature = (samples, fe="{}"))]
fn _audio_log_mel(py: Python<'_>, samples: Vec<f32>, fe: &str) -> PyResult<(Vec<f32>, usize, Vec<bool>)> {
    let fe: serde_json::Value = serde_json::from_str(fe).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let m = crate::native(py, move || {
        let cfg = mlxrs_core::vision::audio::FeatureConfig::from_json(&fe, "feature_extractor")?;
        mlxrs_core::vision::audio::log_mel(&samples, &cfg)
    })?;
    Ok((m.data, m.frames, m.mask))
}

/// Run the sampler on fixed logits: (filtered log-probabilities, `draws` seeded samples).
#[pyfunction]
#[pyo3(signature = (logits, params="{}", draws=1))]
fn _sample(py: Python<'_>, logits: Vec<f32>, params: &str, draws: usize) -> PyResult<(Vec<f32>, Vec<i32>)> {
    let p: serde_json::Value = serde_json::from_str(params).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let req = session::request_from(&p, Vec::new()).py(py)?;
    crate::native(py, || mlxrs_core::sample::sample_fixed(&logits, req.sampling, draws))
}

/// Dequantize `n` values of ggml type id `ty` from raw block bytes; returns float32 bytes.
#[pyfunction]
fn _gguf_dequantize<'py>(py: Python<'py>, ty: u32, raw: &[u8], n: usize) -> PyResult<Bound<'py, PyBytes>> {
    let t = mlxrs_core::gguf::GgmlType::from_id(ty);
    let v = native(py, || mlxrs_core::gguf::dequant::dequantize(t, raw, n).map_err(Error::Invalid))?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// Parse a GGUF header from bytes (or a file path): (version, metadata as JSON, tensors as
/// [(name, row-major shape, ggml type id, offset)], data offset).
#[pyfunction]
#[allow(clippy::type_complexity)] // the Python tuple it returns, spelled out
fn _gguf_header(
    py: Python<'_>,
    data: Option<&[u8]>,
    path: Option<std::path::PathBuf>,
) -> PyResult<(u32, String, Vec<(String, Vec<u64>, u32, u64)>, u64)> {
    use mlxrs_core::gguf::{reader, GgmlType};
    let h = match (data, path) {
        (Some(d), _) => {
            native(py, || reader::parse_header(d, d.len() as u64).map_err(|e| Error::ModelLoad(e.to_string())))?
        }
        (None, Some(p)) => native(py, || mlxrs_core::gguf::GgufFile::open(&p))?.header,
        _ => return Err(PyValueError::new_err("pass data or path")),
    };
    let meta = mlxrs_core::gguf::import::metadata_json(&h);
    let tensors = h
        .tensors
        .iter()
        .map(|t| {
            let id = match t.ty {
                GgmlType::Other(i) => i,
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 => 3,
                GgmlType::Q5_0 => 6,
                GgmlType::Q5_1 => 7,
                GgmlType::Q8_0 => 8,
                GgmlType::Q2K => 10,
                GgmlType::Q3K => 11,
                GgmlType::Q4K => 12,
                GgmlType::Q5K => 13,
                GgmlType::Q6K => 14,
                GgmlType::BF16 => 30,
            };
            (t.name.clone(), t.shape(), id, t.offset)
        })
        .collect();
    Ok((h.version, meta.to_string(), tensors, h.data_offset))
}

/// Dequantize one tensor of a GGUF file to float32 bytes (row-major).
#[pyfunction]
fn _gguf_tensor<'py>(py: Python<'py>, path: std::path::PathBuf, name: &str) -> PyResult<Bound<'py, PyBytes>> {
    let f = native(py, || mlxrs_core::gguf::GgufFile::open(&path))?;
    let t = f.header.tensor(name).cloned().ok_or_else(|| PyValueError::new_err(format!("no tensor {name}")))?;
    let v = native(py, || {
        let raw = f.read_raw(&t)?;
        mlxrs_core::gguf::dequant::dequantize(t.ty, &raw, t.n_elements() as usize).map_err(Error::Invalid)
    })?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// Build the tokenizer a GGUF file describes: (tokenizer.json, tokenizer_config.json) as JSON text.
#[pyfunction]
fn _gguf_tokenizer(py: Python<'_>, path: std::path::PathBuf) -> PyResult<(String, String)> {
    let f = native(py, || mlxrs_core::gguf::GgufFile::open(&path))?;
    let (tok, cfg) = crate::native(py, || mlxrs_core::gguf::tokenizer::build_tokenizer_json(&f.header))?;
    Ok((tok.to_string(), cfg.to_string()))
}

/// Import a GGUF file into a model directory; `progress(done_bytes, total_bytes, tensor)` is
/// called as tensors are converted.
#[pyfunction]
#[pyo3(signature = (src, out, dtype="bf16", progress=None))]
fn gguf_import(
    py: Python<'_>,
    src: std::path::PathBuf,
    out: std::path::PathBuf,
    dtype: &str,
    progress: Option<PyObject>,
) -> PyResult<()> {
    use mlxrs_core::gguf::import;
    let d = import::OutDtype::parse(dtype).py(py)?;
    native(py, || {
        let mut cb = |done: u64, total: u64, what: &str| {
            if let Some(p) = &progress {
                Python::with_gil(|py| {
                    let _ = p.call1(py, (done, total, what));
                });
            }
        };
        import::import(&src, &out, d, &mut cb)
    })
}

/// The dtype a GGUF is imported as by default on the backend MLX computes on here ("f32" on the
/// CPU, "bf16" on GPUs: `OutDtype::default_for`).
#[pyfunction]
fn default_import_dtype(py: Python<'_>) -> &'static str {
    let backend = py.allow_threads(mlxrs_core::plan::Backend::detect);
    mlxrs_core::gguf::import::OutDtype::default_for(backend).name()
}

/// Transfers the core makes on its own (the native pack fetched on first need) draw their progress
/// with Python's tqdm: `mlxrs.download.native_progress(name, done, total)`. A failure to draw is
/// not the transfer's: it is dropped.
fn progress_through_python(name: &str, done: u64, total: u64) {
    Python::with_gil(|py| {
        let _ = py
            .import("mlxrs.download")
            .and_then(|m| m.getattr("native_progress"))
            .and_then(|f| f.call1((name, done, total)));
    });
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    mlxrs_core::download::set_progress_hook(Box::new(progress_through_python));
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILT_FOR_MLX", mlxrs_sys::BUILT_FOR_MLX)?;
    m.add("BUILT_FOR_MLXC", mlxrs_sys::BUILT_FOR_MLXC)?;
    m.add_function(wrap_pyfunction!(runtime_info, m)?)?;
    m.add_function(wrap_pyfunction!(_register_mlx_lib_dir, m)?)?;
    m.add_function(wrap_pyfunction!(_preload_blas, m)?)?;
    m.add_function(wrap_pyfunction!(_resolution_order, m)?)?;
    m.add_function(wrap_pyfunction!(_tiny_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(_op_count, m)?)?;
    m.add_function(wrap_pyfunction!(_host_matmul_count, m)?)?;
    m.add_function(wrap_pyfunction!(_packed_matmul_count, m)?)?;
    m.add_function(wrap_pyfunction!(_half_matmul_count, m)?)?;
    m.add_function(wrap_pyfunction!(_half_gather_count, m)?)?;
    m.add_function(wrap_pyfunction!(_half_attention_count, m)?)?;
    m.add_function(wrap_pyfunction!(generation_config, m)?)?;
    m.add_function(wrap_pyfunction!(mlxrs_home, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(memory_counters, m)?)?;
    m.add_function(wrap_pyfunction!(memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(_array_roundtrip, m)?)?;
    // not through add_function, which lists it in __all__: the stub (as the wheel) has no _op
    #[cfg(feature = "testing")]
    m.setattr("_op", wrap_pyfunction!(_op, m)?)?;
    m.add_function(wrap_pyfunction!(_sample, m)?)?;
    m.add_function(wrap_pyfunction!(_audio_decode, m)?)?;
    m.add_function(wrap_pyfunction!(_audio_resample, m)?)?;
    m.add_function(wrap_pyfunction!(_audio_log_mel, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_import, m)?)?;
    m.add_function(wrap_pyfunction!(default_import_dtype, m)?)?;
    m.add_function(wrap_pyfunction!(_gguf_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(_gguf_header, m)?)?;
    m.add_function(wrap_pyfunction!(_gguf_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(_gguf_tokenizer, m)?)?;
    plan::register(m)?;
    download::register(m)?;
    m.add_class::<session::Session>()?;
    m.add_class::<session::AudioClip>()?;
    m.add_class::<session::TokenStream>()?;
    m.add_class::<session::EngineHold>()?;
    m.add_class::<session::EventHub>()?;
    Ok(())
}
