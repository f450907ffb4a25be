//! `Session` and `TokenStream`: thin wrappers over the core engine.
use crate::{to_py, PyResultExt};
use mlxrs_core::engine::{Engine, Event, EventSink, LoadOptions, Request};
use mlxrs_core::guide::Grammar;
use mlxrs_core::sample::SamplingParams;
use mlxrs_core::Error;
use pyo3::exceptions::{PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};

fn json_arg(s: Option<&str>, what: &str) -> PyResult<Option<Value>> {
    s.map(|s| serde_json::from_str(s).map_err(|e| PyValueError::new_err(format!("{what}: invalid JSON: {e}"))))
        .transpose()
}

#[pyclass(module = "mlxrs._native")]
pub struct Session {
    /// Kept after `close` (the engine thread is gone then), so that `info()` can say so.
    engine: Arc<Engine>,
    closed: bool,
}

/// The image limits in a request's `params` (`max_image_bytes`, `max_image_pixels`), else the defaults.
fn media_limits(params: &Value) -> mlxrs_core::vision::ImageLimits {
    let mut limits = mlxrs_core::vision::DEFAULT_LIMITS;
    if let Some(b) = params.get("max_image_bytes").and_then(Value::as_u64) {
        limits.max_bytes = b as usize;
    }
    if let Some(px) = params.get("max_image_pixels").and_then(Value::as_u64) {
        limits.max_pixels = px;
    }
    limits
}

/// A video's frames, each (encoded bytes, the name errors give it).
type NamedFrames = Vec<(Vec<u8>, String)>;

/// The audio limits in a request's `params` (`max_audio_bytes`, `max_audio_seconds`), else the defaults.
fn audio_limits(params: &Value) -> mlxrs_core::vision::audio::AudioLimits {
    let mut limits = mlxrs_core::vision::audio::DEFAULT_AUDIO_LIMITS;
    if let Some(b) = params.get("max_audio_bytes").and_then(Value::as_u64) {
        limits.max_bytes = b as usize;
    }
    if let Some(s) = params.get("max_audio_seconds").and_then(Value::as_f64) {
        limits.max_seconds = s;
    }
    limits
}

/// One audio clip, decoded and featurized (Gemma 4's log-mel), ready for a prompt.
#[pyclass(module = "mlxrs._native", frozen)]
pub struct AudioClip {
    mel: Arc<mlxrs_core::vision::audio::Mel>,
    /// The audio tokens it stands for in a prompt.
    #[pyo3(get)]
    tokens: usize,
}

#[pymethods]
impl AudioClip {
    /// Log-mel frames.
    #[getter]
    fn frames(&self) -> usize {
        self.mel.frames
    }
    /// Samples at 16 kHz (before the 30 s cut).
    #[getter]
    fn samples(&self) -> usize {
        self.mel.samples
    }
    /// (features `[frames, 128]` flattened float32, each frame's mask: true for real audio).
    fn features(&self) -> (Vec<f32>, Vec<bool>) {
        (self.mel.data.clone(), self.mel.mask.clone())
    }
}

impl Session {
    /// Decode and featurize audio clips (off the GIL) with the limits in `params`.
    fn clips(
        &self,
        py: Python<'_>,
        e: &Arc<Engine>,
        params: &Value,
        clips: Vec<(Vec<u8>, String)>,
    ) -> PyResult<Vec<AudioClip>> {
        let a = e.audio_processor().py(py)?.clone();
        let limits = audio_limits(params);
        let mels = crate::native(py, move || {
            clips
                .iter()
                .map(|(b, what)| a.mel(b, &limits, what).map(|m| (a.tokens_for(m.samples), Arc::new(m))))
                .collect::<Result<Vec<_>, Error>>()
        })?;
        Ok(mels.into_iter().map(|(tokens, mel)| AudioClip { mel, tokens }).collect())
    }

    /// Decode and preprocess images (off the GIL) with the limits in `params`.
    fn pixels(
        &self,
        py: Python<'_>,
        e: &Arc<Engine>,
        params: &Value,
        images: Vec<(Vec<u8>, String)>,
    ) -> PyResult<Vec<Arc<mlxrs_core::vision::Pixels>>> {
        let v = e.vision_processor("image").py(py)?.clone();
        let limits = media_limits(params);
        crate::native(py, move || {
            images.iter().map(|(b, what)| v.pixels(b, &limits, what).map(Arc::new)).collect::<Result<Vec<_>, Error>>()
        })
    }

    /// Decode and preprocess a video's frames (off the GIL) with the limits in `params`.
    fn video(
        &self,
        py: Python<'_>,
        e: &Arc<Engine>,
        params: &Value,
        frames: Vec<(Vec<u8>, String)>,
    ) -> PyResult<Arc<mlxrs_core::vision::Pixels>> {
        let v = e.vision_processor("video").py(py)?.clone();
        if v.video_marker().is_none() {
            return Err(to_py(
                py,
                Error::Invalid(format!("model {} ({}) takes images but not video", e.model_name(), e.shape.model_type)),
            ));
        }
        let limits = media_limits(params);
        crate::native(py, move || {
            let refs: Vec<(&[u8], &str)> = frames.iter().map(|(b, w)| (b.as_slice(), w.as_str())).collect();
            v.video_pixels(&refs, &limits).map(Arc::new)
        })
    }

    fn engine(&self, py: Python<'_>) -> PyResult<&Arc<Engine>> {
        if self.closed {
            return Err(to_py(py, Error::Invalid("this session is closed".into())));
        }
        Ok(&self.engine)
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
    // constrained decoding: at most one of json_schema, json_object, regex, grammar
    let mut grammars = Vec::new();
    match params.get("json_schema") {
        None | Some(Value::Null) => {}
        Some(v @ (Value::Object(_) | Value::Bool(_))) => grammars.push(Grammar::JsonSchema(v.clone())),
        Some(_) => return Err(Error::Invalid("json_schema must be a JSON schema (an object)".into())),
    }
    if params.get("json_object").and_then(Value::as_bool).unwrap_or(false) {
        grammars.push(Grammar::JsonObject);
    }
    for (k, make) in [("regex", Grammar::Regex as fn(String) -> Grammar), ("grammar", Grammar::Lark)] {
        match params.get(k) {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) => grammars.push(make(t.clone())),
            Some(_) => return Err(Error::Invalid(format!("{k} must be a string"))),
        }
    }
    if grammars.len() > 1 {
        let names: Vec<&str> = grammars.iter().map(Grammar::param).collect();
        return Err(Error::Invalid(format!(
            "at most one of json_schema, json_object, regex, grammar (got {})",
            names.join(", ")
        )));
    }
    Ok(Request {
        grammar: grammars.pop(),
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
        images: Vec::new(),
        audio: Vec::new(),
        adapter: match params.get("adapter") {
            None | Some(Value::Null) => None,
            Some(Value::String(a)) => Some(a.clone()),
            Some(_) => return Err(Error::Invalid("adapter must be a string (an adapter's name)".into())),
        },
    })
}

#[pymethods]
impl Session {
    #[new]
    #[pyo3(signature = (model_dir, kv_bits=None, max_kv_size=None, prefill_step_size=2048, kv_group_size=64,
                        max_concurrency=None, max_queue=None, prompt_cache_bytes=None, kv_budget_bytes=None,
                        stream_experts=false, expert_cache_bytes=None, adapters=Vec::new(), expert_prefetch=None,
                        prefill_batch_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: std::path::PathBuf,
        kv_bits: Option<i32>,
        max_kv_size: Option<i32>,
        prefill_step_size: i32,
        kv_group_size: i32,
        max_concurrency: Option<usize>,
        max_queue: Option<usize>,
        prompt_cache_bytes: Option<usize>,
        kv_budget_bytes: Option<usize>,
        stream_experts: bool,
        expert_cache_bytes: Option<usize>,
        adapters: Vec<(String, std::path::PathBuf)>,
        expert_prefetch: Option<bool>,
        prefill_batch_tokens: Option<usize>,
    ) -> PyResult<Session> {
        let d = LoadOptions::default();
        let opts = LoadOptions {
            kv_bits,
            kv_group_size,
            max_kv_size,
            prefill_step_size,
            max_concurrency: max_concurrency.unwrap_or(d.max_concurrency).max(1),
            max_queue: max_queue.unwrap_or(d.max_queue),
            prompt_cache_bytes: prompt_cache_bytes.unwrap_or(d.prompt_cache_bytes),
            kv_budget_bytes,
            stacked_kv: None,
            prefill_batch_tokens,
            stream_experts,
            expert_cache_bytes,
            expert_prefetch,
            adapters,
        };
        let engine = crate::native(py, || Engine::load(&model_dir, opts))?;
        Ok(Session { engine: Arc::new(engine), closed: false })
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<i32>> {
        let e = self.engine(py)?.clone();
        crate::native(py, || e.tokenizer.encode(text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn detokenize(&self, py: Python<'_>, ids: Vec<i32>, skip_special_tokens: bool) -> PyResult<String> {
        let e = self.engine(py)?;
        let v = e.shape.vocab_size.max(e.tokenizer.vocab_size() as i32);
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= v) {
            return Err(to_py(py, Error::Invalid(format!("token id {bad} is outside the vocabulary (0..{v})"))));
        }
        let e = e.clone();
        crate::native(py, || e.tokenizer.decode(&ids, skip_special_tokens))
    }

    /// Render the chat template; `messages`, `tools` and `kwargs` are JSON. `template`: a Jinja
    /// source used instead of the model's own.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=true, kwargs=None, template=None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &str,
        tools: Option<&str>,
        add_generation_prompt: bool,
        kwargs: Option<&str>,
        template: Option<&str>,
    ) -> PyResult<String> {
        let m = json_arg(Some(messages), "messages")?.unwrap_or(Value::Null);
        let t = json_arg(tools, "tools")?;
        let extra = match json_arg(kwargs, "kwargs")? {
            Some(Value::Object(o)) => o,
            _ => serde_json::Map::new(),
        };
        let e = self.engine(py)?.clone();
        let source = template.map(str::to_owned);
        crate::native(py, || match source {
            Some(src) => {
                let tpl = mlxrs_core::template::ChatTemplate::new(&src)?;
                e.render_chat_template(&tpl, &m, t.as_ref(), add_generation_prompt, &extra)
            }
            None => e.apply_chat_template(&m, t.as_ref(), add_generation_prompt, &extra),
        })
    }

    /// Token ids of a rendered chat prompt (the template's BOS is not doubled).
    fn encode_rendered(&self, py: Python<'_>, text: &str) -> PyResult<Vec<i32>> {
        let e = self.engine(py)?.clone();
        crate::native(py, || e.encode_rendered(text))
    }

    /// Start generating from `prompt` token ids; `params` is a JSON object of sampling options.
    /// With `hub`, the events go to the hub (tagged with the returned stream's `id`) and the stream
    /// itself only cancels.
    /// `images`: (encoded bytes, the name errors give it) each, in the order of the prompt's
    /// image-token runs; `params` may hold `max_image_bytes` and `max_image_pixels`.
    /// `audio`: clips from `audio_clips`, in the order of the prompt's audio-token runs.
    /// `video`: a video's frames (each (encoded bytes, name)), after the images in prompt order;
    /// `videos`: several videos so (each its frames), after it.
    #[pyo3(signature = (prompt, params="{}", hub=None, images=None, audio=None, video=None, videos=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: one argument per kind of media
    fn start(
        &self,
        py: Python<'_>,
        prompt: Vec<i32>,
        params: &str,
        hub: Option<&EventHub>,
        images: Option<Vec<(Vec<u8>, String)>>,
        audio: Option<Vec<PyRef<'_, AudioClip>>>,
        video: Option<Vec<(Vec<u8>, String)>>,
        videos: Option<Vec<NamedFrames>>,
    ) -> PyResult<TokenStream> {
        let p = json_arg(Some(params), "params")?.unwrap_or(Value::Null);
        let mut req = request_from(&p, prompt).py(py)?;
        let e = self.engine(py)?.clone();
        if let Some(images) = images.filter(|v| !v.is_empty()) {
            req.images = self.pixels(py, &e, &p, images)?;
        }
        for frames in video.into_iter().chain(videos.unwrap_or_default()).filter(|v| !v.is_empty()) {
            req.images.push(self.video(py, &e, &p, frames)?);
        }
        if let Some(audio) = audio.filter(|v| !v.is_empty()) {
            e.audio_processor().py(py)?;
            req.audio = audio.iter().map(|c| c.mel.clone()).collect();
        }
        match hub {
            None => {
                let pending = crate::native(py, || e.submit(req))?;
                Ok(TokenStream { events: Mutex::new(Some(pending.events)), cancel: pending.cancel, id: 0 })
            }
            Some(h) => {
                let id = h.next_id.fetch_add(1, Ordering::Relaxed);
                let sink = EventSink::new(h.tx.clone(), id);
                let cancel = crate::native(py, || e.submit_to(req, sink))?;
                Ok(TokenStream { events: Mutex::new(None), cancel, id })
            }
        }
    }

    /// Pixel values `[3, H, W]` (flattened float32) of an encoded image, as the model's processor
    /// makes them.
    #[pyo3(signature = (data, params="{}"))]
    fn pixel_values(&self, py: Python<'_>, data: Vec<u8>, params: &str) -> PyResult<(Vec<f32>, u32, u32)> {
        let p = json_arg(Some(params), "params")?.unwrap_or(Value::Null);
        let e = self.engine(py)?.clone();
        let px = self.pixels(py, &e, &p, vec![(data, "image".into())])?;
        let px = &px[0];
        Ok((px.data.clone(), px.height, px.width))
    }

    /// The vision tower's projected features of encoded images (flattened float32: each image's
    /// tokens in order — `tokens_per_image` each, or per its size for Gemma 4 — `hidden` wide).
    fn image_features(&self, py: Python<'_>, images: Vec<Vec<u8>>) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        let named = images.into_iter().enumerate().map(|(i, b)| (b, format!("image {i}"))).collect();
        let px = self.pixels(py, &e, &Value::Null, named)?;
        crate::native(py, move || e.image_features(px))
    }

    /// A video's pixel values (flattened float32 `[frames, 3, H, W]`), frames, height and width.
    fn video_pixel_values(&self, py: Python<'_>, frames: Vec<Vec<u8>>) -> PyResult<(Vec<f32>, u32, u32, u32)> {
        let e = self.engine(py)?.clone();
        let named = frames.into_iter().enumerate().map(|(i, b)| (b, format!("video frame {i}"))).collect();
        let px = self.video(py, &e, &Value::Null, named)?;
        Ok((px.data.clone(), px.video_frames, px.height, px.width))
    }

    /// The vision tower's merged features of a video's frames (flattened float32).
    fn video_features(&self, py: Python<'_>, frames: Vec<Vec<u8>>) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        let named = frames.into_iter().enumerate().map(|(i, b)| (b, format!("video frame {i}"))).collect();
        let px = self.video(py, &e, &Value::Null, named)?;
        crate::native(py, move || e.image_features(vec![px]))
    }

    /// `text` with its video markers expanded, one per video in order: each video its frame
    /// count, its first frame's (height, width) (from `image_sizes`) and its frames' times in
    /// seconds (None: evenly at the video processor's fps).
    fn expand_video_markers(
        &self,
        py: Python<'_>,
        text: &str,
        videos: Vec<(u32, u32, u32, Option<Vec<f64>>)>,
    ) -> PyResult<String> {
        let e = self.engine(py)?;
        let v = e.vision_processor("video").py(py)?;
        let shapes: Vec<_> = videos
            .into_iter()
            .map(|(frames, height, width, times)| mlxrs_core::vision::qwen3_5::VideoShape {
                frames,
                height,
                width,
                times,
            })
            .collect();
        v.expand_videos(text, &shapes).py(py)
    }

    /// `text` with every image marker expanded to the model's image-token sequence; `images` must
    /// equal the markers' count. `sizes` (each image's (height, width), from `image_sizes`): needed
    /// when the count of image tokens depends on the image (Gemma 4; `info()["vision"]["sized"]`).
    #[pyo3(signature = (text, images, sizes=None))]
    fn expand_image_markers(
        &self,
        py: Python<'_>,
        text: &str,
        images: usize,
        sizes: Option<Vec<(u32, u32)>>,
    ) -> PyResult<String> {
        let e = self.engine(py)?;
        let v = e.vision_processor("image").py(py)?;
        v.expand(text, images, sizes.as_deref()).py(py)
    }

    /// The (height, width) of encoded images as decoded (EXIF orientation applied), from their
    /// headers; each `(bytes, where)`, `where` naming it in errors; `params` the media limits.
    #[pyo3(signature = (images, params="{}"))]
    fn image_sizes(&self, py: Python<'_>, images: Vec<(Vec<u8>, String)>, params: &str) -> PyResult<Vec<(u32, u32)>> {
        let p = json_arg(Some(params), "params")?.unwrap_or(Value::Null);
        let limits = media_limits(&p);
        crate::native(py, move || {
            images
                .iter()
                .map(|(b, what)| mlxrs_core::vision::image::dimensions(b, &limits, what).map(|(w, h)| (h, w)))
                .collect::<Result<Vec<_>, Error>>()
        })
    }

    /// Decode and featurize WAV clips, each `(bytes, where)` (`where` names it in errors);
    /// `params` may hold `max_audio_bytes` and `max_audio_seconds`.
    #[pyo3(signature = (clips, params="{}"))]
    fn audio_clips(&self, py: Python<'_>, clips: Vec<(Vec<u8>, String)>, params: &str) -> PyResult<Vec<AudioClip>> {
        let p = json_arg(Some(params), "params")?.unwrap_or(Value::Null);
        let e = self.engine(py)?.clone();
        self.clips(py, &e, &p, clips)
    }

    /// `text` with each audio marker expanded to `boa + audio_token × n + eoa`, `tokens` each
    /// clip's count (`AudioClip.tokens`).
    fn expand_audio_markers(&self, py: Python<'_>, text: &str, tokens: Vec<usize>) -> PyResult<String> {
        let e = self.engine(py)?;
        e.audio_processor().and_then(|a| a.expand(text, &tokens)).py(py)
    }

    /// The audio tower's projected features of clips (flattened float32: each clip's audio tokens
    /// in order, `hidden` wide): what replaces their audio tokens.
    fn audio_features(&self, py: Python<'_>, clips: Vec<PyRef<'_, AudioClip>>) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        let mels = clips.iter().map(|c| c.mel.clone()).collect();
        crate::native(py, move || e.audio_features(mels))
    }

    /// The embedding of `prompt`: final normed hidden states, mean-pooled, L2-normalised.
    fn embed(&self, py: Python<'_>, prompt: Vec<i32>) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        crate::native(py, move || e.embed(prompt))
    }

    /// Last-position logits of `prompt` (float32), from a fresh cache; with `images` (encoded
    /// bytes), their embeddings at the prompt's image tokens.
    /// `audio`: clips from `audio_clips`, their embeddings at the prompt's audio tokens.
    /// `video`: a video's frames (encoded bytes), after the images; `videos`: several, after it.
    #[pyo3(signature = (prompt, images=None, audio=None, video=None, videos=None))]
    fn logits(
        &self,
        py: Python<'_>,
        prompt: Vec<i32>,
        images: Option<Vec<Vec<u8>>>,
        audio: Option<Vec<PyRef<'_, AudioClip>>>,
        video: Option<Vec<Vec<u8>>>,
        videos: Option<Vec<Vec<Vec<u8>>>>,
    ) -> PyResult<Vec<f32>> {
        let e = self.engine(py)?.clone();
        let mels: Vec<_> = audio.unwrap_or_default().iter().map(|c| c.mel.clone()).collect();
        let mut px = match images.filter(|v| !v.is_empty()) {
            None => Vec::new(),
            Some(images) => {
                let named = images.into_iter().enumerate().map(|(i, b)| (b, format!("images[{i}]"))).collect();
                self.pixels(py, &e, &Value::Null, named)?
            }
        };
        for (k, frames) in video.into_iter().chain(videos.unwrap_or_default()).filter(|v| !v.is_empty()).enumerate() {
            let named = frames.into_iter().enumerate().map(|(i, b)| (b, format!("videos[{k}][{i}]"))).collect();
            px.push(self.video(py, &e, &Value::Null, named)?);
        }
        if px.is_empty() && mels.is_empty() {
            return crate::native(py, move || e.last_logits(prompt));
        }
        crate::native(py, move || e.last_logits_with_media(prompt, px, mels))
    }

    /// Model facts: type, layers, vocab, context, weights bytes, options, eos ids, template
    /// presence, counters, and the engine's state (running, dead with its error, or closed).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = &self.engine;
        let d = PyDict::new(py);
        let state = e.state();
        let engine = PyDict::new(py);
        engine.set_item("state", state.name())?;
        engine.set_item(
            "error",
            match &state {
                mlxrs_core::engine::EngineState::Dead(why) => Some(why.clone()),
                _ => None,
            },
        )?;
        d.set_item("engine", engine)?;
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
        // the model's own template (chat_template.jinja, else tokenizer_config.json's), read once in Rust
        d.set_item("chat_template", e.tokenizer.chat_template.clone())?;
        let s = &e.stats;
        let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        d.set_item("requests", n(&s.requests))?;
        d.set_item("served", n(&s.served))?;
        d.set_item("cancelled", n(&s.cancelled))?;
        d.set_item("rejected", n(&s.rejected))?;
        d.set_item("failed", n(&s.failed))?;
        d.set_item("inflight", n(&s.inflight))?;
        d.set_item("running", n(&s.running))?;
        d.set_item("waiting", n(&s.waiting))?;
        d.set_item("prompt_tokens_total", n(&s.prompt_tokens))?;
        d.set_item("generated_tokens_total", n(&s.generated_tokens))?;
        d.set_item("decode_steps", n(&s.decode_steps))?;
        d.set_item("stacked_decode_steps", n(&s.stacked_steps))?;
        let host = PyDict::new(py);
        host.set_item("build", n(&s.decode_build_ns) as f64 * 1e-9)?;
        host.set_item("submit", n(&s.decode_submit_ns) as f64 * 1e-9)?;
        host.set_item("read", n(&s.decode_read_ns) as f64 * 1e-9)?;
        d.set_item("decode_host_seconds", host)?;
        d.set_item("prefill_steps", n(&s.prefill_steps))?;
        d.set_item("prefill_rows", n(&s.prefill_rows))?;
        d.set_item("prefill_max_rows", n(&s.prefill_max_rows))?;
        let p = s.prefix();
        let pc = PyDict::new(py);
        pc.set_item("hits", p.hits)?;
        pc.set_item("misses", p.misses)?;
        pc.set_item("entries", p.entries)?;
        pc.set_item("bytes", p.bytes)?;
        pc.set_item("budget_bytes", p.budget)?;
        pc.set_item("cached_tokens", p.cached_tokens)?;
        d.set_item("prompt_cache", pc)?;
        match &e.vision {
            Some(v) => {
                let vd = PyDict::new(py);
                let (boi, eoi, image_token, image_token_id) = v.tokens();
                vd.set_item("tokens_per_image", v.fixed_tokens_per_image())?;
                vd.set_item("max_tokens_per_image", v.max_tokens_per_image())?;
                vd.set_item("image_size", v.image_size())?;
                vd.set_item("marker", v.marker())?;
                vd.set_item("sized", v.fixed_tokens_per_image().is_none())?;
                vd.set_item("boi_token", boi)?;
                vd.set_item("eoi_token", eoi)?;
                vd.set_item("image_token", image_token)?;
                vd.set_item("image_token_id", image_token_id)?;
                vd.set_item("video_marker", v.video_marker())?;
                // how a video file is sampled to frames (mlx-vlm's load_video with these)
                let (fps, min_frames, max_frames) =
                    v.video_sampling().map_or((None, None, None), |(f, a, b)| (Some(f), Some(a), Some(b)));
                vd.set_item("video_fps", fps)?;
                vd.set_item("video_min_frames", min_frames)?;
                vd.set_item("video_max_frames", max_frames)?;
                d.set_item("vision", vd)?;
            }
            None => d.set_item("vision", py.None())?,
        }
        match e.vision.as_ref().and_then(|v| v.audio()) {
            Some(a) => {
                let ad = PyDict::new(py);
                ad.set_item("marker", &a.audio_token)?;
                ad.set_item("boa_token", &a.boa)?;
                ad.set_item("eoa_token", &a.eoa)?;
                ad.set_item("audio_token", &a.audio_token)?;
                ad.set_item("audio_token_id", a.audio_token_id)?;
                ad.set_item("max_tokens_per_clip", a.seq_length)?;
                ad.set_item("ms_per_token", a.ms_per_token)?;
                ad.set_item("sampling_rate", a.features.sampling_rate)?;
                d.set_item("audio", ad)?;
            }
            None => d.set_item("audio", py.None())?,
        }
        d.set_item("max_concurrency", e.options.max_concurrency)?;
        d.set_item("max_queue", e.options.max_queue)?;
        d.set_item(
            "experts",
            match &e.experts {
                Some(x) => {
                    let r =
                        serde_json::to_string(&x.report()).map_err(|err| to_py(py, Error::Invalid(err.to_string())))?;
                    Some(py.import("json")?.call_method1("loads", (r,))?)
                }
                None => None,
            },
        )?;
        Ok(d)
    }

    /// Cancel what runs or waits, stop the engine thread; the session cannot be used afterwards.
    fn close(&mut self, py: Python<'_>) {
        if !self.closed {
            self.closed = true;
            let e = self.engine.clone();
            py.allow_threads(|| e.close());
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.closed
    }

    /// Test-only: make the engine thread panic at its next iteration (what callers see when the
    /// engine dies: tests/test_file_validation.py).
    fn _inject_engine_panic(&self, py: Python<'_>) -> PyResult<()> {
        let e = self.engine(py)?.clone();
        crate::native(py, move || e.inject_panic())
    }

    /// Hold the engine thread before its next step until `release()` (or until the hold is
    /// garbage-collected): generations started meanwhile are admitted together, so their prompts
    /// prefill together. Nothing runs while it is held.
    fn hold(&self, py: Python<'_>) -> PyResult<EngineHold> {
        let e = self.engine(py)?.clone();
        let h = crate::native(py, move || e.hold())?;
        Ok(EngineHold { hold: Mutex::new(Some(h)) })
    }
}

/// A hold on the engine thread ([`Session::hold`]); `release()` lets it go on.
#[pyclass(module = "mlxrs._native")]
pub struct EngineHold {
    hold: Mutex<Option<mlxrs_core::engine::Hold>>,
}

#[pymethods]
impl EngineHold {
    /// Let the engine go on (again: nothing).
    fn release(&self) {
        self.hold.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// Events of one generation; iterating blocks (without the GIL) until the next event. The cancel
/// flag lives outside the receiver's mutex: `cancel()` never waits for a blocked `__next__`.
#[pyclass(module = "mlxrs._native")]
pub struct TokenStream {
    events: Mutex<Option<Receiver<(u64, Event)>>>,
    cancel: Arc<AtomicBool>,
    /// The tag of its events in an [`EventHub`] (0 for a stream of its own).
    #[pyo3(get)]
    id: u64,
}

/// One event as the Python side sees it; Err for an engine error.
fn event_to_dict<'py>(py: Python<'py>, ev: Event) -> PyResult<Bound<'py, PyDict>> {
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
            d.set_item("cached_tokens", timings.cached_tokens)?;
            d.set_item("completion_tokens", timings.generated_tokens)?;
            d.set_item("prompt_seconds", timings.prompt_seconds)?;
            d.set_item("generation_seconds", timings.generation_seconds)?;
            d.set_item("prompt_tps", timings.prompt_tps())?;
            d.set_item("generation_tps", timings.generation_tps())?;
            d.set_item("peak_memory", timings.peak_memory)?;
        }
        Event::Error(e) => return Err(to_py(py, e)),
    }
    Ok(d)
}

/// One channel for the events of many streams (`Session.start(..., hub=hub)`): the server's single
/// dispatcher thread waits on it, instead of a thread per stream.
#[pyclass(module = "mlxrs._native")]
pub struct EventHub {
    tx: Sender<(u64, Event)>,
    rx: Mutex<Receiver<(u64, Event)>>,
    next_id: std::sync::atomic::AtomicU64,
}

#[pymethods]
impl EventHub {
    #[new]
    fn new() -> EventHub {
        let (tx, rx) = channel();
        EventHub { tx, rx: Mutex::new(rx), next_id: std::sync::atomic::AtomicU64::new(1) }
    }

    /// Wait (without the GIL) up to `timeout` seconds for events; returns every event available
    /// then, as (stream id, event dict or exception) pairs, oldest first (empty after a timeout).
    fn wait<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Vec<(u64, PyObject)>> {
        let evs = py.allow_threads(|| {
            let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
            let mut out = Vec::new();
            match rx.recv_timeout(std::time::Duration::from_secs_f64(timeout.max(0.0))) {
                Ok(ev) => out.push(ev),
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => return out,
            }
            while let Ok(ev) = rx.try_recv() {
                out.push(ev);
            }
            out
        });
        evs.into_iter()
            .map(|(id, ev)| {
                let obj: PyObject = match event_to_dict(py, ev) {
                    Ok(d) => d.into_any().unbind(),
                    Err(e) => e.into_value(py).into_any(),
                };
                Ok((id, obj))
            })
            .collect()
    }
}

impl TokenStream {
    fn event_dict<'py>(&self, py: Python<'py>, ev: Event) -> PyResult<Bound<'py, PyDict>> {
        if matches!(ev, Event::Done { .. } | Event::Error(_)) {
            self.events.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        event_to_dict(py, ev)
    }
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ev = py.allow_threads(|| {
            let g = self.events.lock().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(|r| r.recv())
        });
        match ev {
            Some(Ok((_, ev))) => self.event_dict(py, ev),
            _ => Err(PyStopIteration::new_err(())),
        }
    }

    /// Ask the engine to stop this generation (at the next prefill chunk or decode step).
    fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}
