//! `Session` and `TokenStream`: thin wrappers over the core engine.
use crate::{to_py, PyResultExt};
use mlxrs_core::engine::{Engine, Event, LoadOptions, Pending, Request};
use mlxrs_core::sample::SamplingParams;
use mlxrs_core::Error;
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

fn json_arg(s: Option<&str>, what: &str) -> PyResult<Option<Value>> {
    s.map(|s| serde_json::from_str(s).map_err(|e| PyValueError::new_err(format!("{what}: invalid JSON: {e}")))).transpose()
}

#[pyclass(module = "mlxrs._native")]
pub struct Session {
    engine: Option<Arc<Engine>>,
}

impl Session {
    fn engine(&self, py: Python<'_>) -> PyResult<&Arc<Engine>> {
        self.engine.as_ref().ok_or_else(|| to_py(py, Error::Invalid("this session is closed".into())))
    }
}

/// Sampling and request parameters from a JSON object (the Python layer builds it).
pub(crate) fn request_from(params: &Value, prompt: Vec<i32>) -> Result<Request, Error> {
    let f = |k: &str| params.get(k).and_then(Value::as_f64);
    let i = |k: &str| params.get(k).and_then(Value::as_i64);
    let mut s = SamplingParams::default();
    if let Some(v) = f("temperature") {
        s.temperature = v as f32;
    }
    if let Some(v) = f("top_p") {
        s.top_p = v as f32;
    }
    if let Some(v) = i("top_k") {
        s.top_k = v as i32;
    }
    if let Some(v) = f("min_p") {
        s.min_p = v as f32;
    }
    if let Some(v) = i("min_tokens_to_keep") {
        s.min_tokens_to_keep = v.clamp(i32::MIN as i64, i32::MAX as i64) as i32;
    }
    s.repetition_penalty = f("repetition_penalty").map(|v| v as f32);
    if let Some(v) = i("repetition_context_size") {
        s.repetition_context_size = v as i32;
    }
    if let Some(v) = f("presence_penalty") {
        s.presence_penalty = v as f32;
    }
    if let Some(v) = f("frequency_penalty") {
        s.frequency_penalty = v as f32;
    }
    if let Some(Value::Object(m)) = params.get("logit_bias") {
        for (k, v) in m {
            let id: i32 = k.parse().map_err(|_| Error::Invalid(format!("logit_bias key {k:?} is not a token id")))?;
            s.logit_bias.push((id, v.as_f64().unwrap_or(0.0) as f32));
        }
    }
    s.seed = params.get("seed").and_then(Value::as_u64);
    let max_tokens = i("max_tokens").unwrap_or(256);
    if max_tokens < 0 {
        return Err(Error::Invalid(format!("max_tokens must be >= 0, got {max_tokens}")));
    }
    Ok(Request {
        prompt,
        sampling: s,
        max_tokens: max_tokens as usize,
        stop: params
            .get("stop")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
            .unwrap_or_default(),
        stop_token_ids: params
            .get("stop_token_ids")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_i64).map(|x| x as i32).collect())
            .unwrap_or_default(),
        ignore_eos: params.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false),
        logprobs: params.get("logprobs").and_then(Value::as_bool).unwrap_or(false),
        top_logprobs: i("top_logprobs").unwrap_or(0).max(0) as usize,
    })
}

#[pymethods]
impl Session {
    #[new]
    #[pyo3(signature = (model_dir, kv_bits=None, max_kv_size=None, prefill_step_size=2048, kv_group_size=64))]
    fn new(
        py: Python<'_>,
        model_dir: std::path::PathBuf,
        kv_bits: Option<i32>,
        max_kv_size: Option<i32>,
        prefill_step_size: i32,
        kv_group_size: i32,
    ) -> PyResult<Session> {
        let opts = LoadOptions { kv_bits, kv_group_size, max_kv_size, prefill_step_size };
        let engine = py.allow_threads(|| Engine::load(&model_dir, opts)).py(py)?;
        Ok(Session { engine: Some(Arc::new(engine)) })
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<i32>> {
        self.engine(py)?.tokenizer.encode(text, add_special_tokens).py(py)
    }

    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn detokenize(&self, py: Python<'_>, ids: Vec<i32>, skip_special_tokens: bool) -> PyResult<String> {
        let e = self.engine(py)?;
        let v = e.shape.vocab_size.max(e.tokenizer.vocab_size() as i32);
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= v) {
            return Err(to_py(py, Error::Invalid(format!("token id {bad} is outside the vocabulary (0..{v})"))));
        }
        e.tokenizer.decode(&ids, skip_special_tokens).py(py)
    }

    /// Render the chat template; `messages`, `tools` and `kwargs` are JSON.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=true, kwargs=None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &str,
        tools: Option<&str>,
        add_generation_prompt: bool,
        kwargs: Option<&str>,
    ) -> PyResult<String> {
        let m = json_arg(Some(messages), "messages")?.unwrap_or(Value::Null);
        let t = json_arg(tools, "tools")?;
        let extra = match json_arg(kwargs, "kwargs")? {
            Some(Value::Object(o)) => o,
            _ => serde_json::Map::new(),
        };
        self.engine(py)?.apply_chat_template(&m, t.as_ref(), add_generation_prompt, &extra).py(py)
    }

    /// Token ids of a rendered chat prompt (the template's BOS is not doubled).
    fn encode_rendered(&self, py: Python<'_>, text: &str) -> PyResult<Vec<i32>> {
        self.engine(py)?.encode_rendered(text).py(py)
    }

    /// Start generating from `prompt` token ids; `params` is a JSON object of sampling options.
    #[pyo3(signature = (prompt, params="{}"))]
    fn start(&self, py: Python<'_>, prompt: Vec<i32>, params: &str) -> PyResult<TokenStream> {
        let p = json_arg(Some(params), "params")?.unwrap_or(Value::Null);
        let req = request_from(&p, prompt).py(py)?;
        let pending = self.engine(py)?.submit(req).py(py)?;
        Ok(TokenStream { inner: Mutex::new(Some(pending)) })
    }

    /// Last-position logits of `prompt` (float32), from a fresh cache.
    fn logits(&self, py: Python<'_>, prompt: Vec<i32>) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        py.allow_threads(move || e.last_logits(prompt)).py(py)
    }

    /// Model facts: type, layers, vocab, context, weights bytes, options, eos ids, template presence.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = self.engine(py)?;
        let d = PyDict::new(py);
        d.set_item("model_type", &e.shape.model_type)?;
        d.set_item("model_dir", e.dir.display().to_string())?;
        d.set_item("num_layers", e.shape.num_layers)?;
        d.set_item("hidden_size", e.shape.hidden_size)?;
        d.set_item("vocab_size", e.shape.vocab_size)?;
        d.set_item("num_kv_heads", e.shape.num_kv_heads)?;
        d.set_item("head_dim", e.shape.head_dim)?;
        d.set_item("sliding_window", e.shape.sliding.iter().flatten().copied().max())?;
        d.set_item("max_position_embeddings", e.shape.max_position_embeddings)?;
        d.set_item("weights_bytes", e.weights_bytes)?;
        d.set_item("kv_bits", e.options.kv_bits)?;
        d.set_item("max_kv_size", e.options.max_kv_size)?;
        d.set_item("eos_token_ids", e.tokenizer.eos_ids.clone())?;
        d.set_item("bos_token", e.tokenizer.bos_token.clone())?;
        d.set_item("has_chat_template", e.has_chat_template())?;
        d.set_item("requests", e.stats.requests.load(Ordering::Relaxed))?;
        d.set_item("cancelled", e.stats.cancelled.load(Ordering::Relaxed))?;
        d.set_item("prompt_tokens_total", e.stats.prompt_tokens.load(Ordering::Relaxed))?;
        d.set_item("generated_tokens_total", e.stats.generated_tokens.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// Stop the engine thread; the session cannot be used afterwards.
    fn close(&mut self, py: Python<'_>) {
        if let Some(e) = self.engine.take() {
            py.allow_threads(|| e.close());
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.engine.is_none()
    }
}

/// Events of one generation; iterating blocks (without the GIL) until the next event.
#[pyclass(module = "mlxrs._native")]
pub struct TokenStream {
    inner: Mutex<Option<Pending>>,
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ev = py.allow_threads(|| {
            let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(|p| p.events.recv())
        });
        let ev = match ev {
            Some(Ok(ev)) => ev,
            _ => return Err(PyStopIteration::new_err(())),
        };
        let d = PyDict::new(py);
        match ev {
            Event::Progress { done, total } => {
                d.set_item("type", "progress")?;
                d.set_item("done", done)?;
                d.set_item("total", total)?;
            }
            Event::Token { id, text, logprob, top } => {
                d.set_item("type", "token")?;
                d.set_item("id", id)?;
                d.set_item("text", text)?;
                d.set_item("logprob", logprob)?;
                d.set_item("top", top)?;
            }
            Event::Done { reason, stop_string, timings } => {
                d.set_item("type", "done")?;
                d.set_item("finish_reason", reason.as_str())?;
                d.set_item("stop_string", stop_string)?;
                d.set_item("prompt_tokens", timings.prompt_tokens)?;
                d.set_item("completion_tokens", timings.generated_tokens)?;
                d.set_item("prompt_seconds", timings.prompt_seconds)?;
                d.set_item("generation_seconds", timings.generation_seconds)?;
                d.set_item("prompt_tps", timings.prompt_tps())?;
                d.set_item("generation_tps", timings.generation_tps())?;
                d.set_item("peak_memory", timings.peak_memory)?;
                self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
            }
            Event::Error(e) => {
                self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
                return Err(to_py(py, e));
            }
        }
        Ok(d)
    }

    /// Ask the engine to stop this generation (it ends within a token or two).
    fn cancel(&self) {
        if let Some(p) = self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            p.cancel.store(true, Ordering::Relaxed);
        }
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        self.cancel();
    }
}
