//! The engine thread: it owns every piece of MLX state (model, caches, stream) and runs the
//! scheduler ([`sched`]): requests from a channel, batched decoding of every running sequence,
//! chunked prefill in between, a prompt-prefix cache ([`prefix`]), events back per request.
mod prefix;
mod sched;
#[cfg(test)]
mod tests;

pub use prefix::{PrefixCache, PrefixStats};
use sched::{Cmd, Scheduler};

use crate::error::{Error, Result};
use crate::generate::Timings;
use crate::guide::{Grammar, Guides};
use crate::handle::{self as mx, Stream};
use crate::models::{self, CausalLm, ModelShape};
use crate::sample::SamplingParams;
use crate::template::{ChatInput, ChatTemplate};
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// How a model is loaded and run.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub kv_bits: Option<i32>,
    pub kv_group_size: i32,
    pub max_kv_size: Option<i32>,
    pub prefill_step_size: i32,
    /// Sequences decoded together at most; more wait in the queue.
    pub max_concurrency: usize,
    /// Requests waiting beyond the running ones at most; one more is refused
    /// ([`Error::Busy`], a 429 in the server).
    pub max_queue: usize,
    /// Bytes the prompt-prefix cache may hold (0: off).
    pub prompt_cache_bytes: usize,
    /// KV bytes all running sequences may reserve (prompt + max_tokens each); None: no limit.
    pub kv_budget_bytes: Option<usize>,
    /// Batched decode over the stacked KV of all rows (`cache::BatchKv`) where the model allows it;
    /// None: `MLXRS_BATCH_KV`, else on a GPU only (see `sched::stacked_kv_default`).
    pub stacked_kv: Option<bool>,
    /// Prompt tokens one batched prefill step may run over all its rows (several waiting sequences'
    /// chunks in one forward pass; docs/design/scheduler.md); None: `prefill_step_size`; 0: one
    /// sequence per step. `MLXRS_BATCH_PREFILL=0` also keeps prefill to one sequence per step.
    pub prefill_batch_tokens: Option<usize>,
    /// Leave MoE experts in the safetensors files and read the routed ones on demand into an
    /// expert cache (`models::experts`); the non-expert weights are resident.
    pub stream_experts: bool,
    /// The expert cache's byte budget when streaming; None: a quarter of the expert bytes.
    pub expert_cache_bytes: Option<usize>,
    /// Streaming: each MoE layer reads the next layer's predicted experts while it computes
    /// (`models::experts`); None: [`models::experts::PREFETCH_DEFAULT`].
    pub expert_prefetch: Option<bool>,
    /// LoRA/DoRA adapters (name, directory) in mlx-lm's format (`crate::lora`): one is fused into a
    /// dense base and applies to every request; several stay beside the base and a request picks
    /// one by name ([`Request::adapter`]; none: the base model).
    pub adapters: Vec<(String, PathBuf)>,
}

/// Defaults for [`LoadOptions::max_concurrency`], [`LoadOptions::max_queue`] and
/// [`LoadOptions::prompt_cache_bytes`].
pub const DEFAULT_MAX_CONCURRENCY: usize = 32;
pub const DEFAULT_MAX_QUEUE: usize = 64;
pub const DEFAULT_PROMPT_CACHE_BYTES: usize = 1 << 30;

/// KV cache quantization: MLX's bit widths and group sizes.
pub const KV_BITS: &[i32] = &[2, 3, 4, 6, 8];
pub const KV_GROUP_SIZES: &[i32] = &[32, 64, 128];

impl LoadOptions {
    /// Every option that reaches a division or an allocation, checked (the Python layer checks
    /// too; this is the one the engine relies on).
    pub fn validate(&self) -> Result<()> {
        if let Some(b) = self.kv_bits {
            if !KV_BITS.contains(&b) {
                return Err(Error::Invalid(format!("kv_bits must be one of 2, 3, 4, 6, 8 (got {b})")));
            }
        }
        if self.kv_group_size < 1 || (self.kv_bits.is_some() && !KV_GROUP_SIZES.contains(&self.kv_group_size)) {
            return Err(Error::Invalid(format!(
                "kv_group_size must be one of 32, 64, 128 (got {}){}",
                self.kv_group_size,
                if self.kv_group_size < 1 { "" } else { " with kv_bits" }
            )));
        }
        if self.prefill_step_size < 1 {
            return Err(Error::Invalid(format!("prefill_step_size must be >= 1 (got {})", self.prefill_step_size)));
        }
        if let Some(m) = self.max_kv_size {
            if m < 8 {
                return Err(Error::Invalid(format!("max_kv_size must be at least 8 (got {m})")));
            }
        }
        for (i, (n, _)) in self.adapters.iter().enumerate() {
            if n.is_empty() || n.contains(':') {
                return Err(Error::Invalid(format!("adapter name {n:?} must be non-empty and without ':'")));
            }
            if self.adapters[..i].iter().any(|(m, _)| m == n) {
                return Err(Error::Invalid(format!("two adapters are named {n:?}")));
            }
        }
        if self.max_concurrency < 1 {
            return Err(Error::Invalid("max_concurrency must be >= 1 (got 0)".into()));
        }
        Ok(())
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            kv_bits: None,
            kv_group_size: 64,
            max_kv_size: None,
            prefill_step_size: 2048,
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            max_queue: DEFAULT_MAX_QUEUE,
            prompt_cache_bytes: DEFAULT_PROMPT_CACHE_BYTES,
            kv_budget_bytes: None,
            stacked_kv: None,
            prefill_batch_tokens: None,
            stream_experts: false,
            expert_cache_bytes: None,
            expert_prefetch: None,
            adapters: Vec::new(),
        }
    }
}

/// One generation request.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: Vec<i32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Token ids that end the generation besides the model's EOS ids.
    pub stop_token_ids: Vec<i32>,
    /// Do not stop at the model's EOS ids.
    pub ignore_eos: bool,
    pub logprobs: bool,
    pub top_logprobs: usize,
    /// What the output must match (constrained decoding); None: anything.
    pub grammar: Option<Grammar>,
    /// Images, in the order of their image-token runs in `prompt` (each run
    /// [`crate::vision::Processor::tokens_of`] long): the vision tower's embeddings replace
    /// those positions. A request with images bypasses the prompt-prefix cache (its image tokens
    /// are the same ids whatever the image).
    pub images: Vec<Arc<crate::vision::Pixels>>,
    /// Audio clips' log-mel features, in the order of their audio-token runs in `prompt` (each
    /// run [`crate::vision::gemma4_audio::AudioProcessor::tokens_for`] long): the audio tower's
    /// embeddings replace those positions; like images, no prompt-prefix cache.
    pub audio: Vec<Arc<crate::vision::audio::Mel>>,
    /// The adapter (its name in [`LoadOptions::adapters`]) this request runs with; None: the one
    /// adapter when the model was loaded with exactly one, else the base model.
    pub adapter: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
    /// Cancelled by the caller.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What a request produces, in order.
#[derive(Debug)]
pub enum Event {
    /// Prompt tokens processed so far.
    Progress {
        done: usize,
        total: usize,
    },
    /// One generated token and the text it completes (may be empty while a character or a
    /// possible stop string is incomplete).
    Token {
        id: i32,
        text: String,
        logprob: Option<f32>,
        top: Vec<(i32, f32)>,
    },
    /// The end: why, the matched stop string if any, and statistics.
    Done {
        reason: FinishReason,
        stop_string: Option<String>,
        timings: Timings,
    },
    Error(Error),
}

/// Counters the server reports at /stats. Every submitted request ends as exactly one of served,
/// cancelled, rejected (the queue was full) or failed: requests = served + cancelled + rejected +
/// failed + inflight.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub served: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    pub failed: AtomicU64,
    /// Submitted and not finished (waiting or running).
    pub inflight: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Batched decode steps run, and how many of them over the stacked KV (`BatchKv`).
    pub decode_steps: AtomicU64,
    pub stacked_steps: AtomicU64,
    /// Host time of the decode steps, in nanoseconds: building the step's graph (the forward pass and
    /// the sampling), submitting it (`async_eval`), and reading the step before back and emitting it
    /// (where the host waits for the device): where a step's time goes when decode is host-bound.
    pub decode_build_ns: AtomicU64,
    pub decode_submit_ns: AtomicU64,
    pub decode_read_ns: AtomicU64,
    /// Prefill forward passes run, the sequences' chunks they covered together (rows summed over
    /// the passes) and the most rows one pass covered: rows / steps is the mean prefill batch.
    pub prefill_steps: AtomicU64,
    pub prefill_rows: AtomicU64,
    pub prefill_max_rows: AtomicU64,
    prefix: Mutex<PrefixStats>,
    /// Set by [`Engine::close`]: the scheduler cancels everything and stops.
    pub(crate) shutdown: AtomicBool,
    /// Why the engine thread died (a panic in its step loop); None while it runs.
    fault: Mutex<Option<String>>,
}

impl Stats {
    pub fn prefix(&self) -> PrefixStats {
        *self.prefix.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn set_prefix(&self, p: PrefixStats) {
        *self.prefix.lock().unwrap_or_else(|e| e.into_inner()) = p;
    }
    /// The engine thread's death, when it has died.
    pub fn fault(&self) -> Option<String> {
        self.fault.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub(crate) fn set_fault(&self, why: String) {
        *self.fault.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }
}

/// Whether an engine can serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineState {
    Running,
    /// The engine thread died; the error every request now gets.
    Dead(String),
    /// [`Engine::close`] was called.
    Closed,
}

impl EngineState {
    pub fn name(&self) -> &'static str {
        match self {
            EngineState::Running => "running",
            EngineState::Dead(_) => "dead",
            EngineState::Closed => "closed",
        }
    }
}

/// The text of a caught panic's payload.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".into(),
    }
}

/// A loaded model behind its engine thread.
pub struct Engine {
    tx: Mutex<Option<Sender<Cmd>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    pub shape: ModelShape,
    pub config: Value,
    pub dir: PathBuf,
    pub options: LoadOptions,
    pub stats: Arc<Stats>,
    /// Bytes of the weights in memory (the streamed experts, left in the files, not counted).
    pub weights_bytes: usize,
    /// The expert cache and its counters when MoE experts are streamed.
    pub experts: Option<Arc<models::experts::Streaming>>,
    /// Constrained decoding's token environment, built on the first constrained request.
    guides: Guides,
    /// The image processor, when the model has a vision tower.
    pub vision: Option<crate::vision::Processor>,
}

/// The engine thread waits while this lives ([`Engine::hold`]).
pub struct Hold(#[allow(dead_code)] Sender<()>);

/// A handle on a submitted request.
pub struct Pending {
    pub events: Receiver<(u64, Event)>,
    pub cancel: Arc<AtomicBool>,
}

/// Where a request's events go: a channel of its own, or one shared by many requests (the server's
/// dispatcher waits on one channel for every stream), each event tagged with the request's `id`.
#[derive(Clone)]
pub struct EventSink {
    tx: Sender<(u64, Event)>,
    id: u64,
}

impl EventSink {
    pub fn new(tx: Sender<(u64, Event)>, id: u64) -> EventSink {
        EventSink { tx, id }
    }

    /// False when the receiving side is gone.
    pub fn send(&self, ev: Event) -> bool {
        self.tx.send((self.id, ev)).is_ok()
    }
}

/// A model directory's config.json: the one reader of it (the loader, the planner).
pub fn read_config(dir: &Path) -> Result<Value> {
    let p = dir.join("config.json");
    if !dir.is_dir() {
        return Err(Error::ModelLoad(format!("model directory {} does not exist", dir.display())));
    }
    let text = std::fs::read_to_string(&p).map_err(|e| {
        Error::ModelLoad(format!(
            "{}: {e} (a model directory needs config.json, *.safetensors and tokenizer.json)",
            p.display()
        ))
    })?;
    serde_json::from_str(&text).map_err(|e| Error::ModelLoad(format!("{}: invalid JSON: {e}", p.display())))
}

impl Engine {
    /// Load the model in `dir` on a new engine thread.
    pub fn load(dir: &Path, options: LoadOptions) -> Result<Engine> {
        options.validate()?;
        let config = read_config(dir)?;
        let tokenizer = Arc::new(Tokenizer::load(dir, &config)?);
        let template = tokenizer.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
        let vision = crate::vision::processor(&config, dir, &tokenizer)?;
        let vproc = vision.clone();
        crate::handle::init()?;
        let (tx, rx) = channel::<Cmd>();
        let (ready_tx, ready_rx) = channel::<Result<(ModelShape, usize)>>();
        let stats = Arc::new(Stats::default());
        let streaming = options.stream_experts.then(|| {
            let s = models::experts::Streaming::new(options.expert_cache_bytes);
            s.set_prefetch(options.expert_prefetch.unwrap_or(models::experts::PREFETCH_DEFAULT));
            s
        });
        let (d, cfg, opts, st, tk) =
            (dir.to_path_buf(), config.clone(), options.clone(), stats.clone(), tokenizer.clone());
        let ctx = streaming.clone();
        let thread = std::thread::Builder::new()
            .name("mlxrs-engine".into())
            .spawn(move || {
                let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                    || -> Result<(Box<dyn CausalLm>, Option<crate::vision::Tower>, usize)> {
                        let mut weights = Weights::load_dir(&d, &cfg)?;
                        if let Some(c) = &ctx {
                            weights.stream_experts(c.clone());
                        }
                        let lora = if opts.adapters.is_empty() {
                            None
                        } else {
                            let reg = Arc::new(crate::lora::Registry::load(&opts.adapters, &cfg)?);
                            weights.set_lora(reg.clone());
                            Some(reg)
                        };
                        let bytes = weights.nbytes() + lora.as_ref().map_or(0, |r| r.nbytes());
                        let tower = crate::vision::load(&cfg, &mut weights, vproc).map_err(|e| match e {
                            Error::ModelLoad(m) => Error::ModelLoad(format!("{}: {m}", d.display())),
                            e => e,
                        })?;
                        // the config's and the weights' checks name the field or tensor; say which model
                        let model = models::build(&cfg, weights).map_err(|e| match e {
                            Error::ModelLoad(m) => Error::ModelLoad(format!("{}: {m}", d.display())),
                            e => e,
                        })?;
                        if let Some(reg) = &lora {
                            reg.check_consumed()?;
                        }
                        // the streamed experts' arrays were dropped unread: not in memory
                        let bytes = match &ctx {
                            Some(c) => {
                                c.finish_load();
                                bytes.saturating_sub(c.streamed_bytes() as usize)
                            }
                            None => bytes,
                        };
                        Ok((model, tower, bytes))
                    },
                ))
                .unwrap_or_else(|p| {
                    Err(Error::ModelLoad(format!(
                        "loading {} failed inside mlxrs: {} (a bug in mlxrs: please report it)",
                        d.display(),
                        panic_text(&*p)
                    )))
                });
                match loaded {
                    Ok((model, tower, bytes)) => {
                        let _ = ready_tx.send(Ok((model.shape().clone(), bytes)));
                        // A stream of this thread's own: on MLX 0.32 a stream belongs to the thread
                        // that made it (its command encoder is thread-local) and goes with it.
                        let Ok(stream) = mx::default_device().and_then(|d| Stream::new(&d)) else { return };
                        Scheduler::new(&*model, &tk, opts, st, stream).with_vision(tower.as_ref()).run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::ModelLoad(format!("could not start the engine thread: {e}")))?;
        let (shape, weights_bytes) =
            ready_rx.recv().map_err(|_| Error::ModelLoad("the engine thread stopped while loading".into()))??;
        if let Some(b) = options.kv_bits {
            // mlx-lm's multi-head latent attention cannot read a quantized cache either
            if shape.layers.iter().any(|l| matches!(l.attn, crate::models::AttnKind::Latent { .. })) {
                return Err(Error::Unsupported(format!(
                    "kv_bits {b}: a quantized KV cache with multi-head latent attention ({})",
                    shape.model_type
                )));
            }
            if shape.head_dim % options.kv_group_size != 0 {
                return Err(Error::Invalid(format!(
                    "kv_group_size {} does not divide the model's head_dim {} (needed with kv_bits {b})",
                    options.kv_group_size, shape.head_dim
                )));
            }
        }
        Ok(Engine {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            tokenizer,
            template,
            shape,
            config,
            dir: dir.to_path_buf(),
            options,
            stats,
            weights_bytes,
            experts: streaming,
            guides: Guides::default(),
            vision,
        })
    }

    /// Queue a request; events arrive on the returned receiver.
    pub fn submit(&self, req: Request) -> Result<Pending> {
        let (etx, erx) = channel();
        let cancel = self.submit_to(req, EventSink::new(etx, 0))?;
        Ok(Pending { events: erx, cancel })
    }

    /// Queue a request whose events go to `sink`; returns its cancel flag. [`Error::Busy`] when
    /// `max_concurrency + max_queue` requests are already in flight.
    pub fn submit_to(&self, req: Request, sink: EventSink) -> Result<Arc<AtomicBool>> {
        if req.prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty: at least one token is needed".into()));
        }
        let vocab = self.shape.vocab_size;
        if let Some(bad) = req.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Invalid(format!("prompt token id {bad} is outside the vocabulary (0..{vocab})")));
        }
        req.sampling.validate(vocab)?;
        if !req.images.is_empty() {
            let v = self.vision_processor("image")?;
            let (img, vid) = (v.image_token_id(), v.video_token_id());
            let n = req.prompt.iter().filter(|&&t| t == img || Some(t) == vid).count();
            let want: usize = req.images.iter().map(|p| v.tokens_of(p)).sum();
            if n != want {
                let what = if req.images.iter().any(|p| p.video_frames > 0) { "image or video" } else { "image" };
                return Err(Error::Invalid(format!(
                    "the prompt has {n} {what} tokens for {} image(s) of {want} tokens",
                    req.images.len()
                )));
            }
        }
        if !req.audio.is_empty() {
            let a = self.audio_processor()?;
            let mels: Vec<&crate::vision::audio::Mel> = req.audio.iter().map(|m| &**m).collect();
            crate::vision::gemma4_audio::check_tokens(a, &req.prompt, &mels)?;
        }
        // a grammar that does not compile is the caller's error, here rather than in the stream
        let guide = match &req.grammar {
            Some(g) => Some(Box::new(self.guides.guide(g, &self.tokenizer, vocab as usize)?)),
            None => None,
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
        let st = &self.stats;
        st.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = st.fault() {
            st.failed.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Engine(why));
        }
        let limit = (self.options.max_concurrency.max(1) + self.options.max_queue) as u64;
        if st.inflight.fetch_add(1, Ordering::Relaxed) >= limit {
            st.inflight.fetch_sub(1, Ordering::Relaxed);
            st.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Busy(format!(
                "{} requests are running or queued (--max-concurrency {} + --max-queue {}); retry shortly",
                limit, self.options.max_concurrency, self.options.max_queue
            )));
        }
        if tx.send(Cmd::Generate { req: Box::new(req), events: sink, cancel: cancel.clone(), guide }).is_err() {
            st.inflight.fetch_sub(1, Ordering::Relaxed);
            st.failed.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Engine("the engine thread has stopped".into()));
        }
        Ok(cancel)
    }

    /// The model's name for messages: its directory's.
    pub fn model_name(&self) -> String {
        self.dir.file_name().map_or_else(|| self.dir.display().to_string(), |n| n.to_string_lossy().into_owned())
    }

    /// Last-position logits (float32) of `prompt` from a fresh cache, through the same chunked
    /// prefill as generation (parity tests compare them with mlx-lm's).
    pub fn last_logits(&self, prompt: Vec<i32>) -> Result<Vec<f32>> {
        self.ask(prompt, |prompt, reply| Cmd::Logits { prompt, images: Vec::new(), audio: Vec::new(), reply })
    }

    /// [`Engine::last_logits`] of a prompt with images (its image tokens replaced by their
    /// embeddings, as a generation's prefill does).
    pub fn last_logits_with_images(
        &self,
        prompt: Vec<i32>,
        images: Vec<Arc<crate::vision::Pixels>>,
    ) -> Result<Vec<f32>> {
        self.ask(prompt, |prompt, reply| Cmd::Logits { prompt, images, audio: Vec::new(), reply })
    }

    /// [`Engine::last_logits`] of a prompt with images and audio clips.
    pub fn last_logits_with_media(
        &self,
        prompt: Vec<i32>,
        images: Vec<Arc<crate::vision::Pixels>>,
        audio: Vec<Arc<crate::vision::audio::Mel>>,
    ) -> Result<Vec<f32>> {
        self.ask(prompt, |prompt, reply| Cmd::Logits { prompt, images, audio, reply })
    }

    /// The vision processor, or the error naming the model and what it cannot take (`image`, `video`).
    pub fn vision_processor(&self, what: &str) -> Result<&crate::vision::Processor> {
        self.vision.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "model {} ({}) has no vision tower: it cannot take {what} input",
                self.model_name(),
                self.shape.model_type
            ))
        })
    }

    /// The audio processor, or the error naming the model and the modality.
    pub fn audio_processor(&self) -> Result<&crate::vision::gemma4_audio::AudioProcessor> {
        self.vision.as_ref().and_then(|v| v.audio()).ok_or_else(|| {
            Error::Invalid(format!(
                "model {} ({}) has no audio tower: it cannot take audio input",
                self.model_name(),
                self.shape.model_type
            ))
        })
    }

    /// The audio tower's projected features of clips (float32, every clip's audio tokens in
    /// order, each `hidden` wide, flattened): what replaces the audio tokens.
    pub fn audio_features(&self, audio: Vec<Arc<crate::vision::audio::Mel>>) -> Result<Vec<f32>> {
        self.audio_processor()?;
        let (tx, rx) = channel();
        {
            let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            let s = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
            s.send(Cmd::AudioFeatures { audio, reply: tx })
                .map_err(|_| Error::Engine("the engine thread has stopped".into()))?;
        }
        rx.recv().map_err(|_| Error::Engine("the engine thread has stopped".into()))?
    }

    /// The embedding of `prompt`: its final normed hidden states mean-pooled over the tokens and
    /// L2-normalised (float32, the model's hidden size).
    pub fn embed(&self, prompt: Vec<i32>) -> Result<Vec<f32>> {
        self.ask(prompt, |prompt, reply| Cmd::Embed { prompt, reply })
    }

    /// The vision tower's projected features of `pixels` (float32, every image's tokens in order,
    /// each `hidden` wide, flattened): what replaces the image tokens (before any merge scaling).
    pub fn image_features(&self, pixels: Vec<Arc<crate::vision::Pixels>>) -> Result<Vec<f32>> {
        if self.vision.is_none() {
            return Err(Error::Invalid(format!("model {} has no vision tower", self.model_name())));
        }
        let (tx, rx) = channel();
        {
            let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            let s = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
            s.send(Cmd::ImageFeatures { pixels, reply: tx })
                .map_err(|_| Error::Engine("the engine thread has stopped".into()))?;
        }
        rx.recv().map_err(|_| Error::Engine("the engine thread has stopped".into()))?
    }

    /// Run a one-off command over `prompt` (checked token ids) on the engine thread; wait for its reply.
    fn ask(&self, prompt: Vec<i32>, cmd: impl FnOnce(Vec<i32>, Sender<Result<Vec<f32>>>) -> Cmd) -> Result<Vec<f32>> {
        let vocab = self.shape.vocab_size;
        if prompt.is_empty() || prompt.iter().any(|&t| t < 0 || t >= vocab) {
            return Err(Error::Invalid("prompt must be non-empty token ids inside the vocabulary".into()));
        }
        let (tx, rx) = channel();
        {
            let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            let s = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
            if let Some(why) = self.stats.fault() {
                return Err(Error::Engine(why));
            }
            s.send(cmd(prompt, tx)).map_err(|_| Error::Engine("the engine thread has stopped".into()))?;
        }
        rx.recv().map_err(|_| Error::Engine("the engine thread has stopped".into()))?
    }

    /// Render the chat template (transformers semantics).
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| {
            Error::Invalid("this model has no chat template: pass a plain string prompt instead of messages".into())
        })?;
        self.render_chat_template(t, messages, tools, add_generation_prompt, extra)
    }

    /// Render `t` (a template other than the model's own, e.g. the server's --chat-template)
    /// with this model's BOS/EOS tokens.
    pub fn render_chat_template(
        &self,
        t: &ChatTemplate,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        t.render(&ChatInput {
            messages,
            tools,
            add_generation_prompt,
            bos_token: self.tokenizer.bos_token.as_deref(),
            eos_token: self.tokenizer.eos_token.as_deref(),
            extra,
        })
    }

    /// Tokens of a rendered chat prompt. Like transformers' `apply_chat_template(tokenize=True)`
    /// (and mlx-lm), no special tokens are added: the template writes its own BOS, if any.
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<i32>> {
        self.tokenizer.encode(text, false)
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Running, dead (with the error every request now gets) or closed.
    pub fn state(&self) -> EngineState {
        if self.tx.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            return EngineState::Closed;
        }
        match self.stats.fault() {
            Some(why) => EngineState::Dead(why),
            None => EngineState::Running,
        }
    }

    /// Test-only: make the engine thread panic at its next iteration, as a bug inside the step loop
    /// would (the tests of what callers see when the engine dies use it).
    pub fn inject_panic(&self) -> Result<()> {
        let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
        tx.send(Cmd::Panic).map_err(|_| Error::Engine("the engine thread has stopped".into()))
    }

    /// Hold the engine thread before its next step until the returned [`Hold`] is dropped: requests
    /// submitted meanwhile are admitted in one iteration, so their prompts prefill together
    /// (`Session.generate_batch` submits its prompts under one). Nothing runs while it is held: hold
    /// it only for as long as submitting takes.
    pub fn hold(&self) -> Result<Hold> {
        let (htx, hrx) = channel();
        let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
        tx.send(Cmd::Hold(hrx)).map_err(|_| Error::Engine("the engine thread has stopped".into()))?;
        Ok(Hold(htx))
    }

    /// Stop the engine thread: what runs or waits is cancelled (each gets its Done event), and the
    /// call returns once the current step has ended.
    pub fn close(&self) {
        self.stats.shutdown.store(true, Ordering::Relaxed);
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}
