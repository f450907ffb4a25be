//! The engine thread: it owns every piece of MLX state (model, cache, streams) and serves
//! generation requests one at a time from a FIFO channel, sending events back per request.
use crate::cache::CacheOptions;
use crate::error::{Error, Result};
use crate::generate::{GenOptions, TokenGenerator, Timings};
use crate::handle::{self as mx, Stream};
use crate::models::{self, CausalLm, ModelShape};
use crate::sample::{Sampler, SamplingParams};
use crate::template::{ChatInput, ChatTemplate};
use crate::tokenizer::{Detokenizer, StopMatcher, Tokenizer};
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
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { kv_bits: None, kv_group_size: 64, max_kv_size: None, prefill_step_size: 2048 }
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
    Progress { done: usize, total: usize },
    /// One generated token and the text it completes (may be empty while a character or a
    /// possible stop string is incomplete).
    Token { id: i32, text: String, logprob: Option<f32>, top: Vec<(i32, f32)> },
    /// The end: why, the matched stop string if any, and statistics.
    Done { reason: FinishReason, stop_string: Option<String>, timings: Timings },
    Error(Error),
}

/// Counters the server reports at /stats.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub last: Mutex<Option<Timings>>,
}

enum Cmd {
    Generate { req: Request, events: Sender<Event>, cancel: Arc<AtomicBool> },
    Logits { prompt: Vec<i32>, reply: Sender<Result<Vec<f32>>> },
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
    pub weights_bytes: usize,
}

/// A handle on a submitted request.
pub struct Pending {
    pub events: Receiver<Event>,
    pub cancel: Arc<AtomicBool>,
}

fn read_config(dir: &Path) -> Result<Value> {
    let p = dir.join("config.json");
    if !dir.is_dir() {
        return Err(Error::ModelLoad(format!("model directory {} does not exist", dir.display())));
    }
    let text = std::fs::read_to_string(&p).map_err(|e| {
        Error::ModelLoad(format!("{}: {e} (a model directory needs config.json, *.safetensors and tokenizer.json)", p.display()))
    })?;
    serde_json::from_str(&text).map_err(|e| Error::ModelLoad(format!("{}: invalid JSON: {e}", p.display())))
}

impl Engine {
    /// Load the model in `dir` on a new engine thread.
    pub fn load(dir: &Path, options: LoadOptions) -> Result<Engine> {
        if let Some(b) = options.kv_bits {
            if ![2, 3, 4, 6, 8].contains(&b) {
                return Err(Error::Invalid(format!("kv_bits must be one of 2, 3, 4, 6, 8 (got {b})")));
            }
        }
        if options.prefill_step_size < 1 {
            return Err(Error::Invalid(format!("prefill_step_size must be >= 1 (got {})", options.prefill_step_size)));
        }
        if let Some(m) = options.max_kv_size {
            if m < 8 {
                return Err(Error::Invalid(format!("max_kv_size must be at least 8 (got {m})")));
            }
        }
        let config = read_config(dir)?;
        let tokenizer = Arc::new(Tokenizer::load(dir, &config)?);
        let template = tokenizer.chat_template.as_deref().map(ChatTemplate::new).transpose()?;
        crate::handle::init()?;
        let (tx, rx) = channel::<Cmd>();
        let (ready_tx, ready_rx) = channel::<Result<(ModelShape, usize)>>();
        let stats = Arc::new(Stats::default());
        let (d, cfg, opts, st, tk) = (dir.to_path_buf(), config.clone(), options.clone(), stats.clone(), tokenizer.clone());
        let thread = std::thread::Builder::new()
            .name("mlxrs-engine".into())
            .spawn(move || {
                let loaded = (|| -> Result<(Box<dyn CausalLm>, usize)> {
                    let weights = Weights::load_dir(&d, &cfg)?;
                    let bytes = weights.nbytes();
                    let model = models::build(&cfg, weights)?;
                    Ok((model, bytes))
                })();
                match loaded {
                    Ok((model, bytes)) => {
                        let _ = ready_tx.send(Ok((model.shape().clone(), bytes)));
                        engine_loop(model, rx, opts, st, tk);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::ModelLoad(format!("could not start the engine thread: {e}")))?;
        let (shape, weights_bytes) = ready_rx
            .recv()
            .map_err(|_| Error::ModelLoad("the engine thread stopped while loading".into()))??;
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
        })
    }

    /// Queue a request; events arrive on the returned receiver.
    pub fn submit(&self, req: Request) -> Result<Pending> {
        if req.prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty: at least one token is needed".into()));
        }
        let vocab = self.shape.vocab_size;
        if let Some(bad) = req.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Invalid(format!("prompt token id {bad} is outside the vocabulary (0..{vocab})")));
        }
        req.sampling.validate(vocab)?;
        let (etx, erx) = channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
        tx.send(Cmd::Generate { req, events: etx, cancel: cancel.clone() })
            .map_err(|_| Error::Invalid("the engine thread has stopped".into()))?;
        Ok(Pending { events: erx, cancel })
    }

    /// Last-position logits (float32) of `prompt` from a fresh cache, through the same chunked
    /// prefill as generation (parity tests compare them with mlx-lm's).
    pub fn last_logits(&self, prompt: Vec<i32>) -> Result<Vec<f32>> {
        let vocab = self.shape.vocab_size;
        if prompt.is_empty() || prompt.iter().any(|&t| t < 0 || t >= vocab) {
            return Err(Error::Invalid("prompt must be non-empty token ids inside the vocabulary".into()));
        }
        let (tx, rx) = channel();
        {
            let guard = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            let s = guard.as_ref().ok_or_else(|| Error::Invalid("this session is closed".into()))?;
            s.send(Cmd::Logits { prompt, reply: tx }).map_err(|_| Error::Invalid("the engine thread has stopped".into()))?;
        }
        rx.recv().map_err(|_| Error::Invalid("the engine thread has stopped".into()))?
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

    /// Stop the engine thread (pending requests finish first).
    pub fn close(&self) {
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

fn engine_loop(model: Box<dyn CausalLm>, rx: Receiver<Cmd>, opts: LoadOptions, stats: Arc<Stats>, tok: Arc<Tokenizer>) {
    // A stream of this thread's own: on MLX 0.32 a stream belongs to the thread that made it (its
    // command encoder is thread-local; another thread cannot use it) and is released with it.
    let stream = match mx::default_device().and_then(|d| Stream::new(&d)) {
        Ok(s) => s,
        Err(_) => return,
    };
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Cmd::Generate { req, events, cancel } => {
                stats.requests.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = run_one(&*model, &tok, &req, &events, &cancel, &opts, &stream, &stats) {
                    let _ = events.send(Event::Error(e));
                }
            }
            Cmd::Logits { prompt, reply } => {
                let _ = reply.send(mx::with_stream(&stream, || last_logits(&*model, &prompt, &opts)));
            }
        }
    }
}

fn last_logits(model: &dyn CausalLm, prompt: &[i32], opts: &LoadOptions) -> Result<Vec<f32>> {
    // the same schedule as generation: all but the last token in chunks, then the last token,
    // quantizing the KV cache after each call when kv_bits is set
    let mut cache = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
    let step = opts.prefill_step_size.max(1) as usize;
    let (head, tail) = prompt.split_at(prompt.len() - 1);
    let n_head = head.chunks(step).count();
    let staging = crate::generate::prefill_staging();
    let mut logits = None;
    for (i, chunk) in head.chunks(step).chain(std::iter::once(tail)).enumerate() {
        let a = crate::handle::Array::from_slice(chunk, &[1, chunk.len() as i32])?;
        // the prefill chunks layer by layer on a GPU, as generation does; the last token in one graph
        let st = if i < n_head { staging } else { models::Staging::NONE };
        logits = Some(model.forward_staged(&a, &mut cache, st)?);
        if let Some(bits) = opts.kv_bits {
            let q = crate::weights::QuantSpec { group_size: opts.kv_group_size, bits };
            for c in cache.iter_mut() {
                c.quantize(q)?;
            }
        }
    }
    let l = logits.ok_or_else(|| Error::Invalid("empty prompt".into()))?;
    let n = l.dim(1);
    let last = mx::slice_axis(&l, 1, n - 1, n)?;
    mx::astype(&last, crate::handle::Dtype::Float32)?.to_vec::<f32>()
}

#[allow(clippy::too_many_arguments)]
fn run_one(
    model: &dyn CausalLm,
    tok: &Tokenizer,
    req: &Request,
    events: &Sender<Event>,
    cancel: &AtomicBool,
    opts: &LoadOptions,
    stream: &Stream,
    stats: &Stats,
) -> Result<()> {
    let mut cache = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
    let sampler = Sampler::new(req.sampling.clone(), model.shape().vocab_size)?;
    let gen_opts = GenOptions {
        max_tokens: req.max_tokens,
        prefill_step_size: opts.prefill_step_size,
        kv_bits: opts.kv_bits,
        kv_group_size: opts.kv_group_size,
        quantized_kv_start: 0,
        top_logprobs: req.top_logprobs,
        logprobs: req.logprobs,
    };
    let mut progress = |done: usize, total: usize| {
        let _ = events.send(Event::Progress { done, total });
    };
    stats.prompt_tokens.fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
    let mut gen = TokenGenerator::new(model, &mut cache, &req.prompt, sampler, gen_opts, stream.clone(), Some(&mut progress))?;
    let mut detok = Detokenizer::new(&req.prompt);
    let mut stops = StopMatcher::new(req.stop.clone());
    let eos: Vec<i32> = if req.ignore_eos { Vec::new() } else { tok.eos_ids.clone() };
    let mut reason = FinishReason::Length;
    let mut stop_string = None;
    loop {
        if cancel.load(Ordering::Relaxed) {
            reason = FinishReason::Cancelled;
            stats.cancelled.fetch_add(1, Ordering::Relaxed);
            break;
        }
        let Some(step) = gen.next_token()? else { break };
        stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        if eos.contains(&step.token) || req.stop_token_ids.contains(&step.token) {
            reason = FinishReason::Stop;
            break;
        }
        let piece = detok.push(tok, step.token)?;
        let (text, hit) = stops.feed(&piece);
        let sent = events.send(Event::Token { id: step.token, text, logprob: step.logprob, top: step.top });
        if hit.is_some() {
            reason = FinishReason::Stop;
            stop_string = hit;
            break;
        }
        if sent.is_err() {
            // the receiver is gone: the caller disconnected
            reason = FinishReason::Cancelled;
            stats.cancelled.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    if stop_string.is_none() {
        let tail = detok.flush(tok)?;
        let (mut tail, hit) = stops.feed(&tail);
        if hit.is_some() {
            reason = FinishReason::Stop;
            stop_string = hit;
        } else {
            tail.push_str(&stops.finish());
        }
        if !tail.is_empty() {
            let _ = events.send(Event::Token { id: -1, text: tail, logprob: None, top: Vec::new() });
        }
    }
    let timings = gen.timings.clone();
    *stats.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(timings.clone());
    let _ = events.send(Event::Done { reason, stop_string, timings });
    Ok(())
}
