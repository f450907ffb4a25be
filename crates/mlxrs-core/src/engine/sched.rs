//! The engine thread's step loop (the shape of mistral.rs's `Engine::run` and mlx-lm's
//! `BatchGenerator`): every iteration takes new requests without blocking, drops cancelled ones,
//! admits what fits, runs one prefill step (a chunk of each of several waiting sequences in one
//! forward pass, within a token budget), then one batched decode step
//! for every running sequence, and sends each its events. docs/design/scheduler.md explains the
//! choices (per-sequence caches, the stacked KV of full-attention layers while decoding, the prefix
//! cache, admission).
use super::prefix::PrefixCache;
use super::{Event, EventSink, FinishReason, LoadOptions, Request, Stats};
use crate::cache::{BatchKv, CacheOptions, Caches, LayerCache};
use crate::error::{Error, Result};
use crate::generate::{prefill_staging, Timings};
use crate::guide::{apply_mask, Guide};
use crate::handle::{self as mx, Array, Dtype, Stream};
use crate::models::{CausalLm, Staging};
use crate::sample::Sampler;
use crate::tokenizer::{Detokenizer, StopMatcher, Tokenizer};
use crate::weights::QuantSpec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

/// Generated tokens a sequence reserves KV for at admission (see `kv_reservation`).
const RESERVE_GENERATED: usize = 2048;

/// `1` / `0`: the stacked KV ([`BatchKv`]) for batched decode steps on / off, whatever the backend
/// (default: on a GPU, off on the CPU; [`LoadOptions::stacked_kv`] overrides both). Read when an
/// engine starts.
pub const BATCH_KV_ENV: &str = "MLXRS_BATCH_KV";

/// The stacked KV's default: `MLXRS_BATCH_KV` if set, else on a GPU only. On a GPU it replaces per-row
/// kernels that dominate large batches (H200, 1B bf16, 32 rows: 2.1x the per-row throughput). On the
/// CPU it measured no better than per-row attention: MLX's CPU stream cannot update the stack in
/// place while the previous step is still queued (double buffering), so every step copies the whole
/// stack, which on a CPU costs what it saves (docs/design/scheduler.md).
fn stacked_kv_default() -> bool {
    match std::env::var(BATCH_KV_ENV).ok().as_deref().map(str::trim) {
        Some("0") => false,
        Some("1") => true,
        _ => mx::default_device().map(|d| d.kind() == mx::DeviceKind::Gpu).unwrap_or(false),
    }
}

/// `0`: one sequence per prefill step, whatever [`LoadOptions::prefill_batch_tokens`] says (the
/// benchmark's switch between batched and one-at-a-time prefill). Read when an engine starts.
pub const BATCH_PREFILL_ENV: &str = "MLXRS_BATCH_PREFILL";

/// What the engine thread is asked to do.
pub(crate) enum Cmd {
    Generate {
        req: Box<Request>,
        events: EventSink,
        cancel: Arc<AtomicBool>,
        guide: Option<Box<Guide>>,
    },
    Logits {
        prompt: Vec<i32>,
        images: Vec<Arc<crate::vision::Pixels>>,
        audio: Vec<Arc<crate::vision::audio::Mel>>,
        reply: Sender<Result<Vec<f32>>>,
    },
    Embed {
        prompt: Vec<i32>,
        reply: Sender<Result<Vec<f32>>>,
    },
    /// The vision tower's projected features of images (float32, flattened `[N, tokens, hidden]`).
    ImageFeatures {
        pixels: Vec<Arc<crate::vision::Pixels>>,
        reply: Sender<Result<Vec<f32>>>,
    },
    /// The audio tower's projected features of clips (float32, flattened `[tokens, hidden]`).
    AudioFeatures {
        audio: Vec<Arc<crate::vision::audio::Mel>>,
        reply: Sender<Result<Vec<f32>>>,
    },
    /// Test-only ([`super::Engine::inject_panic`]): panic, as a bug inside the loop would.
    Panic,
    /// Wait until the sender is dropped ([`super::Engine::hold`]): what arrives meanwhile is taken
    /// together.
    Hold(Receiver<()>),
}

/// One generation in flight: everything it needs is its own.
struct Seq {
    /// Unique within the engine: names the sequence's row of the stacked KV.
    uid: u64,
    req: Request,
    events: EventSink,
    cancel: Arc<AtomicBool>,
    cache: Vec<LayerCache>,
    sampler: Sampler,
    /// The request's constraint: masks the logits before each sampling step.
    guide: Option<Box<Guide>>,
    detok: Detokenizer,
    stops: StopMatcher,
    /// Prompt tokens already in the cache (from the prefix cache or prefilled).
    done: usize,
    /// Prompt tokens the prefix cache supplied.
    cached: usize,
    /// The prompt's input embeddings with the images' merged in (a request with images, while
    /// its prefill runs).
    embeds: Option<Array>,
    /// The input of the next decode step when it is not the previous step's token (the last
    /// prompt token, before the first step).
    first_input: Option<Array>,
    /// The last queued step's token and log-probabilities, not read back yet.
    pending: Option<Step>,
    generated: Vec<i32>,
    started: Instant,
    first_token_at: Option<Instant>,
    /// The caller went away (its receiver is gone).
    gone: bool,
    /// `pending`'s token was read and emitted already (read at once while prompts prefill:
    /// `emit_now`); the next step only uses it as its input.
    early: bool,
    /// Its adapter (index into `LoadOptions::adapters`; `crate::lora`).
    adapter: Option<usize>,
    /// Neither reuses a cached prefix nor leaves one: a request with images (its image tokens are
    /// the same ids whatever the image), or with an unfused adapter (its KV is not the base's).
    no_prefix: bool,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.first_input.is_some() || self.pending.is_some()
    }

    fn send(&mut self, ev: Event) {
        if !self.events.send(ev) {
            self.gone = true;
        }
    }

    fn timings(&self) -> Timings {
        let now = Instant::now();
        let first = self.first_token_at.unwrap_or(now);
        Timings {
            prompt_tokens: self.req.prompt.len(),
            generated_tokens: self.generated.len(),
            cached_tokens: self.cached,
            prompt_seconds: (first - self.started).as_secs_f64(),
            generation_seconds: (now - first).as_secs_f64(),
            peak_memory: mx::peak_memory(),
        }
    }

    fn wants_logprobs(&self) -> bool {
        self.req.logprobs || self.req.top_logprobs > 0
    }

    /// The tokens its cache holds, in order.
    fn cached_tokens(&self) -> Vec<i32> {
        let held = self.cache.first().map_or(0, |c| c.offset()).max(0) as usize;
        self.req.prompt.iter().chain(&self.generated).take(held).copied().collect()
    }
}

/// One decode step's output for a batch of rows sampled together (greedy rows without logit
/// processors): tokens [n], log-probabilities [n, V] (None where no row reports them and the fused
/// greedy kernel took the tokens), read back once for all rows.
struct Shared {
    y: Array,
    lp: Option<Array>,
    tokens: std::cell::OnceCell<Vec<i32>>,
}

/// A queued step's result for one sequence.
enum Step {
    /// Sampled on its own: token [1], log-probabilities [1, V] (squeezed when read: most steps never
    /// are; None where the sequence reports none and the fused greedy kernel took the token).
    Own(Array, Option<Array>),
    /// Row `row` of a shared batch.
    Shared(std::rc::Rc<Shared>, usize),
}

impl Step {
    /// The token as an int32 array of shape [1] (lazy), the next step's input.
    fn token_array(&self) -> Result<Array> {
        match self {
            Step::Own(y, _) => Ok(y.clone()),
            Step::Shared(s, r) => mx::slice_axis(&s.y, 0, *r as i32, *r as i32 + 1),
        }
    }

    /// Read the token back (one read for every row of a shared batch). Call it on the read-back
    /// stream, not the generation stream: whatever a read queues (a conversion, a contiguous copy)
    /// would wait there behind the step just queued, and so would the read, losing the overlap of
    /// the host's work with the device's (measured on an H200: 8B 4-bit decode at 131-138 tok/s that
    /// way against 173-175 before the scheduler, which read on the default stream).
    fn token(&self) -> Result<i32> {
        match self {
            Step::Own(y, _) => y.item_i32(),
            Step::Shared(s, r) => {
                if s.tokens.get().is_none() {
                    let v = s.y.to_vec::<i32>()?;
                    let _ = s.tokens.set(v);
                }
                Ok(s.tokens.get().expect("set above")[*r])
            }
        }
    }

    /// Log-probabilities [V] (kept for every sequence that reports them).
    fn logprobs(&self) -> Result<Array> {
        let missing = || Error::Mlx("no log-probabilities were kept for this step".into());
        match self {
            Step::Own(_, lp) => mx::squeeze(lp.as_ref().ok_or_else(missing)?, &[0]),
            Step::Shared(s, r) => {
                let lp = s.lp.as_ref().ok_or_else(missing)?;
                mx::squeeze(&mx::slice_axis(lp, 0, *r as i32, *r as i32 + 1)?, &[0])
            }
        }
    }
}

/// The loop's state.
pub(crate) struct Scheduler<'a> {
    model: &'a dyn CausalLm,
    tok: &'a Tokenizer,
    opts: LoadOptions,
    stats: Arc<Stats>,
    stream: Stream,
    /// This thread's default stream: token read-back runs there (see `Step::token`).
    readback: Stream,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    prefix: PrefixCache,
    staging: Staging,
    steps: u64,
    next_uid: u64,
    /// Whether decode steps of two or more rows run over a [`BatchKv`]: every layer a full cache,
    /// unquantized, and not switched off.
    stackable: bool,
    /// The decoding rows' stacked KV and which sequence each slot holds (None: a hole).
    stack: Option<(BatchKv, Vec<Option<u64>>)>,
    /// The vision tower, for requests with images.
    vision: Option<&'a crate::vision::Tower>,
    /// Prompt tokens one prefill step may run over all its rows (`plan_prefill`).
    prefill_budget: usize,
    /// Prefill chunks must end where they would alone: what a chunk sees depends on where the
    /// previous one ended with a rotating cache that keeps its first tokens (`max_kv_size`) and with
    /// a quantized cache (a chunk attends over its own keys in full, the earlier ones quantized).
    exact_chunks: bool,
}

impl<'a> Scheduler<'a> {
    pub(crate) fn new(
        model: &'a dyn CausalLm,
        tok: &'a Tokenizer,
        opts: LoadOptions,
        stats: Arc<Stats>,
        stream: Stream,
    ) -> Self {
        let prefix = PrefixCache::new(opts.prompt_cache_bytes);
        stats.set_prefix(prefix.stats());
        let readback = Stream::default_stream().unwrap_or_else(|_| stream.clone());
        let kinds = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
        let stackable = opts.stacked_kv.unwrap_or_else(stacked_kv_default)
            && opts.kv_bits.is_none()
            && model.stackable()
            && kinds.iter().all(|c| matches!(c, LayerCache::Full(_)));
        // a quantized cache: a chunk attends over the earlier chunks' quantized keys, its own in full
        let opts_exact_chunks =
            opts.kv_bits.is_some() || kinds.iter().any(|c| matches!(c, LayerCache::Rotating(r) if r.keep > 0));
        let prefill_budget = match std::env::var(BATCH_PREFILL_ENV).ok().as_deref().map(str::trim) {
            Some("0") => 0,
            _ => opts.prefill_batch_tokens.unwrap_or(opts.prefill_step_size.max(1) as usize),
        };
        Scheduler {
            model,
            tok,
            opts,
            stats,
            stream,
            readback,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix,
            staging: prefill_staging(),
            steps: 0,
            next_uid: 0,
            stack: None,
            stackable,
            vision: None,
            prefill_budget,
            exact_chunks: opts_exact_chunks,
        }
    }

    /// The vision tower requests with images go through.
    pub(crate) fn with_vision(mut self, vision: Option<&'a crate::vision::Tower>) -> Self {
        self.vision = vision;
        self
    }

    /// Serve until the command channel closes and everything in flight has finished. A panic
    /// inside the loop kills the engine, not silently: everything in flight fails with
    /// [`Error::Engine`], the fault is recorded in the stats (so later requests fail at once), and
    /// whatever still arrives is answered with the same error until the session closes.
    pub(crate) fn run(mut self, rx: Receiver<Cmd>) {
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve(&rx)));
        let Err(panic) = served else { return };
        let why = format!(
            "the engine thread failed: {} (a bug in mlxrs: please report it); this session can no longer \
             generate: close it and load the model again",
            super::panic_text(&*panic)
        );
        self.stats.set_fault(why.clone());
        let seqs: Vec<Seq> = self.waiting.drain(..).chain(self.running.drain(..)).collect();
        for s in seqs {
            // in flight since its submission, as a command still in the channel is
            self.refuse(Cmd::Generate { req: Box::new(s.req), events: s.events, cancel: s.cancel, guide: None }, &why);
        }
        self.publish();
        for cmd in rx.iter() {
            self.refuse(cmd, &why);
        }
    }

    /// Answer a command with the engine's death.
    fn refuse(&self, cmd: Cmd, why: &str) {
        match cmd {
            Cmd::Generate { events, .. } => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
                let _ = events.send(Event::Error(Error::Engine(why.to_string())));
            }
            Cmd::Logits { reply, .. }
            | Cmd::Embed { reply, .. }
            | Cmd::ImageFeatures { reply, .. }
            | Cmd::AudioFeatures { reply, .. } => {
                let _ = reply.send(Err(Error::Engine(why.to_string())));
            }
            Cmd::Panic | Cmd::Hold(_) => {}
        }
    }

    fn serve(&mut self, rx: &Receiver<Cmd>) {
        let mut open = true;
        loop {
            if self.waiting.is_empty() && self.running.is_empty() {
                if self.stack.take().is_some() {
                    mx::clear_cache(); // idle: the stack's buffers go back to the system
                }
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(cmd) => self.take(cmd),
                    Err(_) => return,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(cmd) => self.take(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            let stream = self.stream.clone();
            mx::with_stream(&stream, || self.iteration());
            self.publish();
        }
    }

    fn publish(&self) {
        self.stats.running.store(self.running.len() as u64, Ordering::Relaxed);
        self.stats.waiting.store(self.waiting.len() as u64, Ordering::Relaxed);
        self.stats.set_prefix(self.prefix.stats());
    }

    fn take(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Generate { req, events, cancel, guide } => match self.make_seq(*req, events.clone(), cancel, guide) {
                Ok(s) => self.waiting.push_back(s),
                Err(e) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
                    let _ = events.send(Event::Error(e));
                }
            },
            Cmd::Logits { prompt, images, audio, reply } => {
                let stream = self.stream.clone();
                let r = mx::with_stream(&stream, || {
                    let embeds = match (images.is_empty() && audio.is_empty(), self.vision) {
                        (true, _) => None,
                        (false, None) => return Err(Error::Invalid("this model has no vision or audio tower".into())),
                        (false, Some(t)) => {
                            let p: Vec<&crate::vision::Pixels> = images.iter().map(|p| &**p).collect();
                            let a: Vec<&crate::vision::audio::Mel> = audio.iter().map(|m| &**m).collect();
                            Some(t.merged_media(self.model, &prompt, &p, &a)?)
                        }
                    };
                    let ad = [(self.opts.adapters.len() == 1).then_some(0)];
                    crate::lora::with_rows(&ad, || last_logits(self.model, &prompt, &self.opts, embeds.as_ref()))
                });
                let _ = reply.send(r);
            }
            Cmd::Embed { prompt, reply } => {
                let stream = self.stream.clone();
                let ad = [(self.opts.adapters.len() == 1).then_some(0)];
                let r = mx::with_stream(&stream, || {
                    crate::lora::with_rows(&ad, || embedding(self.model, &prompt, &self.opts))
                });
                let _ = reply.send(r);
            }
            Cmd::ImageFeatures { pixels, reply } => {
                let stream = self.stream.clone();
                let r = mx::with_stream(&stream, || -> Result<Vec<f32>> {
                    let tower = self.vision.ok_or_else(|| Error::Invalid("this model has no vision tower".into()))?;
                    let p: Vec<&crate::vision::Pixels> = pixels.iter().map(|p| &**p).collect();
                    let dtype = self.model.embed_tokens(&Array::from_slice(&[0i32], &[1, 1])?)?.dtype();
                    mx::astype(&tower.features(&p, dtype)?, Dtype::Float32)?.to_vec::<f32>()
                });
                let _ = reply.send(r);
            }
            Cmd::AudioFeatures { audio, reply } => {
                let stream = self.stream.clone();
                let r = mx::with_stream(&stream, || -> Result<Vec<f32>> {
                    let tower = self.vision.ok_or_else(|| Error::Invalid("this model has no audio tower".into()))?;
                    let a: Vec<&crate::vision::audio::Mel> = audio.iter().map(|m| &**m).collect();
                    let dtype = self.model.embed_tokens(&Array::from_slice(&[0i32], &[1, 1])?)?.dtype();
                    mx::astype(&tower.audio_features(&a, dtype)?, Dtype::Float32)?.to_vec::<f32>()
                });
                let _ = reply.send(r);
            }
            Cmd::Panic => panic!("injected engine panic (test hook)"),
            Cmd::Hold(rx) => {
                let _ = rx.recv(); // returns when the holder drops its sender
            }
        }
    }

    /// The adapter a request names (index into the adapters), or the default: the one adapter of
    /// a model loaded with one, else none.
    fn adapter_of(&self, req: &Request) -> Result<Option<usize>> {
        let names = &self.opts.adapters;
        match &req.adapter {
            None => Ok((names.len() == 1).then_some(0)),
            Some(n) => names.iter().position(|(m, _)| m == n).map(Some).ok_or_else(|| {
                let known: Vec<&str> = names.iter().map(|(m, _)| m.as_str()).collect();
                Error::Invalid(format!(
                    "adapter {n:?} is not loaded ({})",
                    if known.is_empty() {
                        "this model has no adapters".to_string()
                    } else {
                        format!("loaded: {}", known.join(", "))
                    }
                ))
            }),
        }
    }

    /// The per-row adapters of a forward pass over `rows` (None: a row without a sequence).
    fn row_adapters(&self, rows: impl Iterator<Item = Option<usize>>) -> Vec<Option<usize>> {
        rows.map(|r| r.and_then(|i| self.running[i].adapter)).collect()
    }

    fn make_seq(
        &mut self,
        req: Request,
        events: EventSink,
        cancel: Arc<AtomicBool>,
        guide: Option<Box<Guide>>,
    ) -> Result<Seq> {
        let adapter = self.adapter_of(&req)?;
        crate::models::layers::refresh_dequant_rows();
        crate::models::qmv::refresh();
        crate::models::greedy::refresh();
        crate::models::decode_attn::refresh();
        // one adapter fused into the weights is the model itself: its prefixes are as reusable
        let no_prefix =
            !req.images.is_empty() || !req.audio.is_empty() || (adapter.is_some() && self.opts.adapters.len() > 1);
        let sampler = Sampler::new(req.sampling.clone(), self.model.shape().vocab_size)?;
        let detok = Detokenizer::new(&req.prompt);
        let stops = StopMatcher::new(req.stop.clone());
        self.next_uid += 1;
        Ok(Seq {
            uid: self.next_uid,
            cache: Vec::new(),
            sampler,
            guide,
            detok,
            stops,
            done: 0,
            cached: 0,
            embeds: None,
            first_input: None,
            pending: None,
            generated: Vec::new(),
            started: Instant::now(),
            first_token_at: None,
            gone: false,
            early: false,
            adapter,
            no_prefix,
            req,
            events,
            cancel,
        })
    }

    fn iteration(&mut self) {
        // cancelled or abandoned (or the engine is closing): out at once, queued or running
        let closing = self.stats.shutdown.load(Ordering::Relaxed);
        let cancelled = |s: &Seq| closing || s.cancel.load(Ordering::Relaxed) || s.gone;
        for mut s in std::mem::take(&mut self.waiting) {
            if cancelled(&s) {
                self.finish(&mut s, FinishReason::Cancelled, None, false);
            } else {
                self.waiting.push_back(s);
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if cancelled(&self.running[i]) {
                let mut s = self.running.swap_remove(i);
                self.finish(&mut s, FinishReason::Cancelled, None, false);
            } else {
                i += 1;
            }
        }
        self.admit();
        if let Err(e) = self.prefill_step() {
            self.fail_all(e);
            return;
        }
        if let Err(e) = self.decode_step() {
            self.fail_all(e);
        }
        self.steps += 1;
        if self.steps.is_multiple_of(256) {
            mx::clear_cache();
        }
    }

    /// Move waiting sequences to running while there is room: at most `max_concurrency`, and the
    /// KV cache they will need (prompt + max_tokens) within the KV budget, when there is one.
    fn admit(&mut self) {
        while self.running.len() < self.opts.max_concurrency.max(1) {
            let Some(front) = self.waiting.front() else { break };
            if let Some(budget) = self.opts.kv_budget_bytes {
                let need = self.kv_reservation(front);
                let held: usize = self.running.iter().map(|s| self.kv_reservation(s)).sum();
                // the prefix cache gives way first
                if held + need + self.prefix.stats().bytes > budget {
                    self.prefix.shrink_to(budget.saturating_sub(held + need));
                }
                if held + need > budget && !self.running.is_empty() {
                    break; // waits until running sequences free their KV
                }
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            // a request with images never reuses a cached prefix (nor leaves one)
            let hit = if !s.no_prefix { self.prefix.lookup(&s.req.prompt) } else { None };
            match hit {
                Some((cache, n)) => {
                    s.cache = cache;
                    s.done = n;
                    s.cached = n;
                }
                None => s.cache = self.model.make_cache(&CacheOptions { max_kv_size: self.opts.max_kv_size }),
            }
            s.started = Instant::now();
            s.send(Event::Progress { done: s.done, total: s.req.prompt.len() });
            self.running.push(s);
        }
    }

    /// The KV a sequence is admitted against: its prompt and up to [`RESERVE_GENERATED`] tokens of
    /// its max_tokens (clients that omit max_tokens get the whole context as the server's limit;
    /// reserving all of it would serialize them). A sequence that grows past its reservation is not
    /// stopped: the plan's reserve absorbs it.
    fn kv_reservation(&self, s: &Seq) -> usize {
        let tokens = s.req.prompt.len() + s.req.max_tokens.min(RESERVE_GENERATED);
        self.model.shape().kv_bytes(tokens, self.opts.kv_bits, self.opts.kv_group_size)
    }

    /// One prefill step: a chunk of every row [`plan_prefill`] picks, in one forward pass over a
    /// `[rows, L]` batch (every row the same L tokens: no padding, so every cache kind, recurrent
    /// states included, takes exactly its own tokens), each row over its own caches. A request with
    /// images or audio prefills alone (its chunks run from merged embeddings), when it is the
    /// oldest. Then every sequence whose prompt but its last token is in its cache is snapshotted
    /// into the prefix cache and starts decoding (its last token is its first decode input).
    /// Returns the pass's rows (indices into `running`) and its logits `[rows, L, vocab]` (lazy:
    /// the loop never evaluates them; the tests read them).
    fn prefill_step(&mut self) -> Result<Option<(Vec<usize>, Array)>> {
        let step = self.opts.prefill_step_size.max(1) as usize;
        let rest = |s: &Seq| s.req.prompt.len() - s.done - 1; // prompt left to prefill
        let media = |s: &Seq| !s.req.images.is_empty() || !s.req.audio.is_empty();
        let todo: Vec<usize> =
            (0..self.running.len()).filter(|&i| !self.running[i].decoding() && rest(&self.running[i]) > 0).collect();
        let mut pass = None;
        if let Some(&oldest) = todo.first() {
            let rows: Vec<usize> = if media(&self.running[oldest]) {
                vec![oldest]
            } else {
                todo.into_iter().filter(|&i| !media(&self.running[i])).collect()
            };
            let left: Vec<usize> = rows.iter().map(|&i| rest(&self.running[i])).collect();
            let (n, pick) = plan_prefill(&left, step, self.prefill_budget, self.exact_chunks);
            let rows: Vec<usize> = pick.into_iter().map(|k| rows[k]).collect();
            let logits = self.prefill_rows(&rows, n)?;
            pass = Some((rows, logits));
        }
        for s in self.running.iter_mut() {
            if s.decoding() || rest(s) > 0 {
                continue;
            }
            // the prompt but its last token is in the cache: snapshot it, then decode
            s.embeds = None;
            if self.prefix.enabled() && s.done > s.cached && !s.no_prefix {
                let tokens = s.req.prompt[..s.done].to_vec();
                self.prefix.insert(tokens, s.cache.clone());
            }
            s.first_input = Some(Array::from_slice(&s.req.prompt[s.done..], &[1, 1])?);
        }
        Ok(pass)
    }

    /// `n` more prompt tokens of each of `rows` (ascending indices into `running`) in one forward
    /// pass; a single row may run from its merged image/audio embeddings. Returns the pass's logits.
    fn prefill_rows(&mut self, rows: &[usize], n: usize) -> Result<Array> {
        if let [i] = *rows {
            let s = &mut self.running[i];
            if (!s.req.images.is_empty() || !s.req.audio.is_empty()) && s.embeds.is_none() {
                let tower =
                    self.vision.ok_or_else(|| Error::Invalid("this model has no vision or audio tower".into()))?;
                let pixels: Vec<&crate::vision::Pixels> = s.req.images.iter().map(|p| &**p).collect();
                let mels: Vec<&crate::vision::audio::Mel> = s.req.audio.iter().map(|m| &**m).collect();
                let e = tower.merged_media(self.model, &s.req.prompt, &pixels, &mels)?;
                e.eval()?;
                s.embeds = Some(e);
            }
        }
        let ads = self.row_adapters(rows.iter().map(|&i| Some(i)));
        let (model, staging) = (self.model, self.staging);
        let embeds = match rows {
            [i] => self.running[*i].embeds.as_ref().map(|e| {
                let at = self.running[*i].done as i32;
                mx::slice_axis(e, 1, at, at + n as i32)
            }),
            _ => None,
        }
        .transpose()?;
        let tokens: Vec<i32> = rows
            .iter()
            .flat_map(|&i| {
                let s = &self.running[i];
                s.req.prompt[s.done..s.done + n].iter().copied()
            })
            .collect();
        let tokens = Array::from_slice(&tokens, &[rows.len() as i32, n as i32])?;
        let logits = {
            let mut caches = Caches::many(row_caches(&mut self.running, rows));
            crate::lora::with_rows(&ads, || match &embeds {
                Some(e) => model.forward_embeds(e, &mut caches, staging),
                None => model.forward_caches(&tokens, &mut caches, staging),
            })?
        };
        for &i in rows {
            maybe_quantize(&mut self.running[i].cache, &self.opts)?;
        }
        let state: Vec<&Array> =
            rows.iter().flat_map(|&i| self.running[i].cache.iter().flat_map(|c| c.state())).collect();
        mx::eval(&state)?;
        for &i in rows {
            let s = &mut self.running[i];
            s.done += n;
            let (done, total) = (s.done, s.req.prompt.len());
            s.send(Event::Progress { done, total });
        }
        let st = &self.stats;
        st.prefill_steps.fetch_add(1, Ordering::Relaxed);
        st.prefill_rows.fetch_add(rows.len() as u64, Ordering::Relaxed);
        st.prefill_max_rows.fetch_max(rows.len() as u64, Ordering::Relaxed);
        mx::clear_cache();
        Ok(logits)
    }

    /// One decode step for every running sequence past its prefill: queue step n+1 for all of them
    /// in one batched forward pass, then read back step n's tokens (mlx-lm's double buffering).
    fn decode_step(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        let mut submitted = started;
        // who gets a new step: decoding, and not at max_tokens once the pending token is counted
        let mut rows: Vec<usize> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if !s.decoding() {
                continue;
            }
            let after_pending = s.generated.len() + usize::from(s.pending.is_some() && !s.early);
            if after_pending < s.req.max_tokens {
                rows.push(i);
            }
        }
        let mut queued: Vec<Option<Step>> = (0..self.running.len()).map(|_| None).collect();
        if rows.len() < 2 && self.stack.is_some() {
            self.plan_stack(&rows)?; // fewer than two rows: every slot back to its sequence, the stack freed
        }
        if !rows.is_empty() {
            // the inputs: when every row continues the same shared step in order, its tokens as they
            // are; otherwise one [1, 1] token per row, concatenated
            let same_batch = match &self.running[rows[0]].pending {
                Some(Step::Shared(first, _)) => rows.iter().enumerate().all(|(k, &i)| {
                    matches!(&self.running[i].pending, Some(Step::Shared(s, r)) if std::rc::Rc::ptr_eq(s, first) && *r == k)
                }) && first.y.dim(0) as usize == rows.len(),
                _ => false,
            };
            for &i in &rows {
                let s = &mut self.running[i];
                if let Some(p) = &s.pending {
                    let y = p.token_array()?;
                    s.sampler.observe(&y)?;
                }
            }
            let slots = self.plan_stack(&rows)?;
            // the stack's slots are the rows, in order (no holes)
            let in_order = slots
                .as_ref()
                .is_none_or(|o| o.len() == rows.len() && o.iter().zip(&rows).all(|(a, b)| *a == Some(*b)));
            let tokens = if same_batch && in_order {
                let Some(Step::Shared(s, _)) = &self.running[rows[0]].pending else { unreachable!("checked") };
                mx::reshape(&s.y, &[rows.len() as i32, 1])?
            } else {
                // one [1, 1] token per row (per slot of the stack, a hole's a dummy 0)
                let order: Vec<Option<usize>> = match &slots {
                    Some(v) => v.clone(),
                    None => rows.iter().map(|&i| Some(i)).collect(),
                };
                let mut inputs = Vec::with_capacity(order.len());
                for o in &order {
                    let input = match o.map(|i| &self.running[i]) {
                        Some(s) => match (&s.pending, &s.first_input) {
                            (Some(p), _) => mx::reshape(&p.token_array()?, &[1, 1])?,
                            (None, Some(first)) => first.clone(),
                            (None, None) => unreachable!("decoding"),
                        },
                        None => Array::from_slice(&[0i32], &[1, 1])?,
                    };
                    inputs.push(mx::astype(&input, Dtype::Int32)?);
                }
                let refs: Vec<&Array> = inputs.iter().collect();
                if refs.len() == 1 {
                    refs[0].clone()
                } else {
                    mx::concatenate(&refs, 0)?
                }
            };
            self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
            let logits = match (&mut self.stack, &slots) {
                (Some((kv, _)), Some(order)) => {
                    self.stats.stacked_steps.fetch_add(1, Ordering::Relaxed);
                    kv.begin_step(order.len())?;
                    let ads: Vec<Option<usize>> =
                        order.iter().map(|o| o.and_then(|i| self.running[i].adapter)).collect();
                    let model = self.model;
                    let logits = crate::lora::with_rows(&ads, || {
                        model.forward_caches(&tokens, &mut Caches::stacked(kv), Staging::NONE)
                    })?;
                    kv.advance();
                    // the decoding rows' logits, in `rows` order
                    let pick: Vec<i32> = rows
                        .iter()
                        .map(|i| order.iter().position(|o| *o == Some(*i)).expect("every row has a slot") as i32)
                        .collect();
                    if pick.iter().enumerate().all(|(k, &p)| k as i32 == p) && pick.len() == order.len() {
                        logits
                    } else {
                        mx::take(&logits, &Array::from_slice(&pick, &[pick.len() as i32])?, 0)?
                    }
                }
                _ => {
                    let ads = self.row_adapters(rows.iter().map(|&i| Some(i)));
                    let seqs = row_caches(&mut self.running, &rows);
                    let model = self.model;
                    crate::lora::with_rows(&ads, || {
                        model.forward_caches(&tokens, &mut Caches::many(seqs), Staging::NONE)
                    })?
                }
            };
            for &i in &rows {
                maybe_quantize(&mut self.running[i].cache, &self.opts)?;
            }
            let l = logits.dim(1);
            // [B, V] (a decode step's logits are one position already: no slice)
            let last = if l == 1 { logits.clone() } else { mx::slice_axis(&logits, 1, l - 1, l)? };
            let last = mx::squeeze(&last, &[1])?;
            // greedy rows without logit processors or a constraint: sampled together (one argmax,
            // one read back)
            let simple: Vec<usize> = (0..rows.len())
                .filter(|&r| self.running[rows[r]].sampler.is_plain_greedy() && self.running[rows[r]].guide.is_none())
                .collect();
            // constrained rows read their previous token back before their mask: the forward pass
            // is queued first, so the device runs it while the host computes the masks
            if rows.iter().any(|&i| self.running[i].guide.is_some()) {
                mx::async_eval(&[&last])?;
            }
            let mut outs: Vec<Array> = Vec::new();
            if simple.len() > 1 {
                let sub = if simple.len() == rows.len() {
                    last.clone()
                } else {
                    let idx: Vec<i32> = simple.iter().map(|&r| r as i32).collect();
                    mx::take(&last, &Array::from_slice(&idx, &[idx.len() as i32])?, 0)?
                };
                let wants = simple.iter().any(|&r| self.running[rows[r]].wants_logprobs());
                let (y, lp) = match if wants { None } else { crate::models::greedy::greedy(&sub)? } {
                    Some(y) => (y, None),
                    None => {
                        let (y, lp) = greedy_reference(&sub)?;
                        (y, Some(if wants { reported_logprobs(&sub, lp)? } else { lp }))
                    }
                };
                outs.push(y.clone());
                outs.extend(lp.clone());
                let shared = std::rc::Rc::new(Shared { y, lp, tokens: std::cell::OnceCell::new() });
                for (k, &r) in simple.iter().enumerate() {
                    queued[rows[r]] = Some(Step::Shared(shared.clone(), k));
                }
            }
            for (r, &i) in rows.iter().enumerate() {
                if queued[i].is_some() {
                    continue;
                }
                let readback = self.readback.clone();
                let s = &mut self.running[i];
                let allowed = match &mut s.guide {
                    Some(g) => {
                        if let Some(p) = &s.pending {
                            if !s.early && g.fed == s.generated.len() {
                                g.consume(mx::with_stream(&readback, || p.token())?);
                            }
                        }
                        match g.mask() {
                            Some(m) => Some(m),
                            None => continue, // complete (or failed): nothing more to sample
                        }
                    }
                    None => None,
                };
                let row =
                    if rows.len() == 1 { last.clone() } else { mx::slice_axis(&last, 0, r as i32, r as i32 + 1)? };
                if allowed.is_none() && s.sampler.is_plain_greedy() && !s.wants_logprobs() {
                    if let Some(y) = crate::models::greedy::greedy(&row)? {
                        outs.push(y.clone());
                        queued[i] = Some(Step::Own(y, None));
                        continue;
                    }
                }
                let mut row = s.sampler.process(&row)?;
                if let Some(m) = &allowed {
                    row = apply_mask(&row, m)?;
                }
                let lse = mx::logsumexp(&row, &[-1], true)?;
                let lp = mx::subtract(&row, &lse)?;
                let y = mx::astype(&s.sampler.sample(&lp)?, Dtype::Int32)?;
                let lp = if s.wants_logprobs() { reported_logprobs(&row, lp)? } else { lp };
                outs.push(y.clone());
                outs.push(lp.clone());
                queued[i] = Some(Step::Own(y, Some(lp)));
            }
            let refs: Vec<&Array> = outs.iter().collect();
            let built = std::time::Instant::now();
            mx::async_eval(&refs)?;
            submitted = std::time::Instant::now();
            let ns = |a: std::time::Instant, b: std::time::Instant| b.duration_since(a).as_nanos() as u64;
            self.stats.decode_build_ns.fetch_add(ns(started, built), Ordering::Relaxed);
            self.stats.decode_submit_ns.fetch_add(ns(built, submitted), Ordering::Relaxed);
        }
        // read back the previous step's tokens; emit; stop where a sequence is done
        let mut i = 0;
        let mut idx = 0; // index into `queued`, which follows the original order
        while i < self.running.len() {
            let next = queued[idx].take();
            idx += 1;
            let s = &mut self.running[i];
            let prev = s.pending.take();
            let early = std::mem::take(&mut s.early);
            if s.first_input.is_some() && next.is_some() {
                s.first_input = None;
            }
            s.pending = next;
            let outcome = match prev {
                Some(step) if !early => self.emit(i, &step)?,
                _ => None,
            };
            // nothing queued and nothing left to read: max_tokens reached (0 included)
            let s = &self.running[i];
            let outcome = outcome.or_else(|| {
                (s.decoding() && s.pending.is_none() && s.generated.len() >= s.req.max_tokens)
                    .then_some((FinishReason::Length, None))
            });
            // a constraint with nothing left to sample (complete, or no token allowed)
            let outcome = outcome.or_else(|| {
                (s.pending.is_none() && s.guide.as_ref().is_some_and(|g| g.done()))
                    .then_some((FinishReason::Stop, None))
            });
            match outcome {
                Some((reason, stop)) => {
                    let mut s = self.running.remove(i);
                    self.finish(&mut s, reason, stop, true);
                    // `queued` keeps its original indexing: shift by leaving `idx` as is
                }
                None => i += 1,
            }
        }
        self.stats.decode_read_ns.fetch_add(submitted.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if !self.waiting.is_empty() || self.running.iter().any(|s| !s.decoding()) {
            self.emit_now()?;
        }
        Ok(())
    }

    /// While prompts prefill, the step just queued is read back at once instead of at the next
    /// decode step: that read comes after the next prefill pass, which would hold every token back
    /// by a whole pass (a sequence's first token, and its first text when the detokenizer holds a
    /// partial character back; with prompts arriving together, all of them until the last pass).
    /// The double buffering is given up only while passes run, which dominate those iterations.
    /// The step stays pending as the next step's input (`Seq::early`).
    fn emit_now(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.early {
                i += 1;
                continue;
            }
            let Some(step) = s.pending.take() else {
                i += 1;
                continue;
            };
            let outcome = self.emit(i, &step)?;
            let s = &mut self.running[i];
            s.pending = Some(step);
            s.early = true;
            match outcome {
                Some((reason, stop)) => {
                    let mut s = self.running.remove(i);
                    self.finish(&mut s, reason, stop, true);
                }
                None => i += 1,
            }
        }
        Ok(())
    }

    /// Make the stack hold the decoding `rows` (indices into `running`) when they are two or more
    /// and the model is stackable; otherwise give every slot back to its sequence and drop it.
    /// Returns each slot's row (None: a hole) when this step runs over the stack. A sequence that
    /// stops decoding (still running) gets its row back; a joiner is written into the first hole or
    /// at the end; holes are closed by one compaction when they are more than a quarter.
    fn plan_stack(&mut self, rows: &[usize]) -> Result<Option<Vec<Option<usize>>>> {
        let uids: Vec<u64> = rows.iter().map(|&i| self.running[i].uid).collect();
        let want = self.stackable && rows.len() >= 2;
        let Some((mut kv, mut ids)) = self
            .stack
            .take()
            .or_else(|| want.then(|| (BatchKv::new(self.model.shape().num_layers as usize), Vec::new())))
        else {
            return Ok(None);
        };
        // slots whose sequence does not decode now: back to its own caches
        let mut pending = Vec::new();
        for (slot, id) in ids.iter_mut().enumerate() {
            let Some(uid) = *id else { continue };
            if want && uids.contains(&uid) {
                continue;
            }
            *id = None;
            match self.running.iter_mut().find(|s| s.uid == uid) {
                Some(s) => pending.extend(kv.take_row(slot, &mut s.cache)?),
                None => kv.clear(slot),
            }
        }
        // evaluated now, so that the stack's next write is in place
        let refs: Vec<&Array> = pending.iter().collect();
        mx::eval(&refs)?;
        if !want {
            drop(kv);
            mx::clear_cache(); // the stack's buffers go back to the system, not MLX's buffer cache
            return Ok(None);
        }
        for (&i, &uid) in rows.iter().zip(&uids) {
            if ids.contains(&Some(uid)) {
                continue;
            }
            let slot = match ids.iter().position(|x| x.is_none()) {
                Some(h) => h,
                None => {
                    ids.push(None);
                    ids.len() - 1
                }
            };
            let s = &mut self.running[i];
            kv.put_row(slot, &s.cache)?;
            ids[slot] = Some(uid);
            for c in s.cache.iter_mut() {
                if let LayerCache::Full(c) = c {
                    c.keys = None; // lives in the stack now
                    c.values = None;
                }
            }
        }
        while ids.last() == Some(&None) {
            ids.pop();
        }
        let holes = ids.iter().filter(|x| x.is_none()).count();
        if holes > 0 && holes * 4 > ids.len() {
            let keep: Vec<usize> = (0..ids.len()).filter(|&s| ids[s].is_some()).collect();
            kv = kv.compact(&keep)?;
            ids = keep.iter().map(|&s| ids[s]).collect();
        }
        let order = ids.iter().map(|id| id.and_then(|u| self.running.iter().position(|s| s.uid == u))).collect();
        self.stack = Some((kv, ids));
        Ok(Some(order))
    }

    /// A sequence leaving `running`: its row of the stack back into its own caches (`keep`: it will
    /// be snapshotted) or just freed.
    fn leave_stack(&mut self, s: &mut Seq, keep: bool) {
        let Some((kv, ids)) = &mut self.stack else { return };
        let Some(slot) = ids.iter().position(|h| *h == Some(s.uid)) else { return };
        ids[slot] = None;
        if !keep {
            kv.clear(slot);
            s.cache.clear();
            return;
        }
        match kv.take_row(slot, &mut s.cache) {
            Ok(arrays) => {
                let refs: Vec<&Array> = arrays.iter().collect();
                if mx::eval(&refs).is_err() {
                    s.cache.clear();
                }
            }
            Err(_) => s.cache.clear(), // nothing to snapshot rather than a wrong snapshot
        }
    }

    /// Read one sequence's token, send its text; Some(why) when the sequence is done.
    fn emit(&mut self, i: usize, step: &Step) -> Result<Option<(FinishReason, Option<String>)>> {
        let tok = self.tok;
        let readback = self.readback.clone();
        let s = &mut self.running[i];
        let token = mx::with_stream(&readback, || step.token())?;
        if s.first_token_at.is_none() {
            s.first_token_at = Some(Instant::now());
        }
        s.generated.push(token);
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let (logprob, top) = if s.wants_logprobs() {
            mx::with_stream(&readback, || top_logprobs(&step.logprobs()?, token, s.req.top_logprobs))?
        } else {
            (None, Vec::new())
        };
        let eos = !s.req.ignore_eos && tok.eos_ids.contains(&token);
        if eos || s.req.stop_token_ids.contains(&token) {
            return Ok(Some((FinishReason::Stop, None)));
        }
        let piece = s.detok.push(tok, token)?;
        let (text, hit) = s.stops.feed(&piece);
        s.send(Event::Token { id: token, text, logprob, top });
        if hit.is_some() {
            return Ok(Some((FinishReason::Stop, hit)));
        }
        if let Some(g) = &mut s.guide {
            if g.fed < s.generated.len() {
                g.consume(token);
            }
            if g.done() {
                return Ok(Some((FinishReason::Stop, None)));
            }
        }
        if s.gone {
            return Ok(Some((FinishReason::Cancelled, None)));
        }
        if s.generated.len() >= s.req.max_tokens {
            return Ok(Some((FinishReason::Length, None)));
        }
        Ok(None)
    }

    /// End a sequence: flush its text, snapshot its cache, send Done, count it.
    fn finish(&mut self, s: &mut Seq, reason: FinishReason, stop: Option<String>, ran: bool) {
        let keep = ran && reason != FinishReason::Cancelled && self.prefix.enabled() && !s.no_prefix;
        self.leave_stack(s, keep);
        let mut reason = reason;
        let mut stop_string = stop;
        if reason != FinishReason::Cancelled && stop_string.is_none() {
            let flushed = s.detok.flush(self.tok).unwrap_or_default();
            let (mut tail, hit) = s.stops.feed(&flushed);
            if hit.is_some() {
                reason = FinishReason::Stop;
                stop_string = hit;
            } else {
                tail.push_str(&s.stops.finish());
            }
            if !tail.is_empty() {
                s.send(Event::Token { id: -1, text: tail, logprob: None, top: Vec::new() });
            }
        }
        if keep {
            // the conversation so far, for the next turn (its pending step is dropped: evaluate
            // the cache so the snapshot holds no pending graph)
            let state: Vec<&Array> = s.cache.iter().flat_map(|c| c.state()).collect();
            if mx::eval(&state).is_ok() {
                let tokens = s.cached_tokens();
                if tokens.len() > s.req.prompt.len() {
                    self.prefix.insert(tokens, std::mem::take(&mut s.cache));
                }
            }
        }
        let timings = s.timings();
        let st = &self.stats;
        st.prompt_tokens.fetch_add(s.req.prompt.len() as u64, Ordering::Relaxed);
        match reason {
            FinishReason::Cancelled => st.cancelled.fetch_add(1, Ordering::Relaxed),
            _ => st.served.fetch_add(1, Ordering::Relaxed),
        };
        st.inflight.fetch_sub(1, Ordering::Relaxed);
        s.send(Event::Done { reason, stop_string, timings });
    }

    /// An MLX failure inside a step: every sequence in it gets the error; the engine goes on.
    fn fail_all(&mut self, e: Error) {
        let msg = e.to_string();
        self.stack = None;
        for mut s in self.running.drain(..) {
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
            self.stats.inflight.fetch_sub(1, Ordering::Relaxed);
            s.send(Event::Error(Error::Mlx(msg.clone())));
        }
        mx::clear_cache();
    }
}

/// The caches of `rows` (ascending indices into `seqs`), borrowed together for one forward pass.
fn row_caches<'s>(seqs: &'s mut [Seq], rows: &[usize]) -> Vec<&'s mut [LayerCache]> {
    let mut out: Vec<&mut [LayerCache]> = Vec::with_capacity(rows.len());
    let mut rest: &mut [Seq] = seqs;
    let mut base = 0;
    for &i in rows {
        let (_, tail) = rest.split_at_mut(i - base);
        let (s, tail) = tail.split_first_mut().expect("row index in range");
        out.push(&mut s.cache);
        rest = tail;
        base = i + 1;
    }
    out
}

/// Which prefilling rows one step runs, and how many tokens each: `left[k]` is the k-th candidate's
/// prompt still to prefill (every one > 0), in admission order; the first, the oldest, is always in.
/// Every row of the pass runs the same L tokens (a `[rows, L]` batch without padding): L is at most
/// `step` (`prefill_step_size`) and the oldest row's rest. Among the lengths the candidates' rests
/// give, the one that covers the most tokens within `budget` (rows x L, the oldest alone at least)
/// wins, the longer on a tie: fewer rows, nearer to first come first served, which is what lowers
/// the mean time to first token where a pass costs what its tokens cost (a busy CPU); where a pass
/// costs much the same for one row as for many (a GPU on small chunks) the rows share it. A
/// `budget` of 0 (or below L) is one row per step. With `exact`, a row runs only the chunk it would
/// run alone (`step` tokens, then the rest): for caches whose content depends on where chunks end
/// (a rotating cache that keeps its first tokens, `max_kv_size`; a quantized cache; mlx-lm's too),
/// rows batch only when their next chunks are equally long.
fn plan_prefill(left: &[usize], step: usize, budget: usize, exact: bool) -> (usize, Vec<usize>) {
    let step = step.max(1);
    let cap = step.min(left[0]);
    if exact {
        // the chunks a row alone would run: rows whose next chunk is the oldest's length
        let rows = (0..left.len()).filter(|&k| left[k].min(step) == cap).take((budget / cap).max(1)).collect();
        return (cap, rows);
    }
    let mut lens: Vec<usize> = left.iter().map(|&r| r.min(cap)).filter(|&l| l > 0).collect();
    lens.sort_unstable();
    lens.dedup();
    let mut best = (0, cap, vec![0]);
    for &l in lens.iter().rev() {
        let rows: Vec<usize> = (0..left.len()).filter(|&k| left[k] >= l).take((budget / l).max(1)).collect();
        if rows.len() * l > best.0 {
            best = (rows.len() * l, l, rows);
        }
    }
    (best.1, best.2)
}

/// mlx-lm's `maybe_quantize_kv_cache` with quantized_kv_start 0: full caches become quantized
/// after every model call once kv_bits is set.
fn maybe_quantize(cache: &mut [LayerCache], opts: &LoadOptions) -> Result<()> {
    if let Some(bits) = opts.kv_bits {
        let q = QuantSpec::affine(opts.kv_group_size, bits);
        for c in cache.iter_mut() {
            if matches!(c, LayerCache::Full(_)) {
                c.quantize(q)?;
            }
        }
    }
    Ok(())
}

/// Last-position logits of `prompt` from a fresh cache on generation's schedule (the parity tests
/// compare them with mlx-lm's): all but the last token in chunks, then the last token.
/// With `embeds` (`[1, L, hidden]`, a prompt with images merged in), the chunks run from them.
pub(crate) fn last_logits(
    model: &dyn CausalLm,
    prompt: &[i32],
    opts: &LoadOptions,
    embeds: Option<&Array>,
) -> Result<Vec<f32>> {
    let mut cache = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
    let step = opts.prefill_step_size.max(1) as usize;
    let (head, tail) = prompt.split_at(prompt.len() - 1);
    let n_head = head.chunks(step).count();
    let staging = prefill_staging();
    let mut logits = None;
    let mut at = 0usize;
    for (i, chunk) in head.chunks(step).chain(std::iter::once(tail)).enumerate() {
        let st = if i < n_head { staging } else { Staging::NONE };
        logits = Some(match embeds {
            Some(e) => {
                let part = mx::slice_axis(e, 1, at as i32, (at + chunk.len()) as i32)?;
                model.forward_embeds(&part, &mut Caches::one(&mut cache), st)?
            }
            None => model.forward_staged(&Array::from_slice(chunk, &[1, chunk.len() as i32])?, &mut cache, st)?,
        });
        at += chunk.len();
        maybe_quantize(&mut cache, opts)?;
    }
    let l = logits.ok_or_else(|| Error::Invalid("empty prompt".into()))?;
    let n = l.dim(1);
    let last = mx::slice_axis(&l, 1, n - 1, n)?;
    mx::astype(&last, Dtype::Float32)?.to_vec::<f32>()
}

/// The embedding of `prompt`: the final normed hidden states, mean-pooled over its tokens (in
/// float32) and L2-normalised; the prompt runs in prefill chunks from a fresh cache.
pub(crate) fn embedding(model: &dyn CausalLm, prompt: &[i32], opts: &LoadOptions) -> Result<Vec<f32>> {
    if prompt.is_empty() {
        return Err(Error::Invalid("empty prompt".into()));
    }
    let mut cache = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
    let step = opts.prefill_step_size.max(1) as usize;
    let mut total: Option<Array> = None;
    for chunk in prompt.chunks(step) {
        let a = Array::from_slice(chunk, &[1, chunk.len() as i32])?;
        let h = model.hidden_caches(&a, &mut Caches::one(&mut cache), Staging::NONE)?;
        let s = mx::sum(&mx::astype(&h, Dtype::Float32)?, &[0, 1], false)?; // [hidden]
        s.eval()?;
        total = Some(match total {
            Some(t) => mx::add(&t, &s)?,
            None => s,
        });
        maybe_quantize(&mut cache, opts)?;
    }
    let mean = mx::divide(&total.expect("non-empty"), &mx::scalar_as(prompt.len() as f64, Dtype::Float32)?)?;
    let norm = mx::sqrt(&mx::sum(&mx::square(&mean)?, &[0], false)?)?;
    let eps = mx::scalar_as(1e-12, Dtype::Float32)?;
    mx::divide(&mean, &mx::maximum(&norm, &eps)?)?.to_vec::<f32>()
}

/// A greedy token per row of `logits` [n, V] as mlx-lm takes it — `argmax(logits - logsumexp(logits))`
/// in the logits' dtype — with those log-probabilities (the reference of `models::greedy`).
fn greedy_reference(logits: &Array) -> Result<(Array, Array)> {
    let lp = mx::subtract(logits, &mx::logsumexp(logits, &[-1], true)?)?;
    Ok((mx::astype(&mx::argmax(&lp, -1, false)?, Dtype::Int32)?, lp))
}

/// The log-probabilities a request reports: in float32 from the float32 logits whatever the model's
/// dtype (the token is still sampled from `lp`, computed in the model's dtype as mlx-lm does).
fn reported_logprobs(logits: &Array, lp: Array) -> Result<Array> {
    if logits.dtype() == Dtype::Float32 {
        return Ok(lp);
    }
    let l32 = mx::astype(logits, Dtype::Float32)?;
    mx::subtract(&l32, &mx::logsumexp(&l32, &[-1], true)?)
}

/// The chosen token's log-probability and the `k` most likely (id, log-probability).
type TopLogprobs = (Option<f32>, Vec<(i32, f32)>);

fn top_logprobs(lp: &Array, token: i32, k: usize) -> Result<TopLogprobs> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tests::tiny_llama_hd;

    #[test]
    fn plan_prefill_batches_equal_chunks_within_the_budget() {
        // the oldest row is always in; every row runs the same number of tokens
        assert_eq!(plan_prefill(&[5], 2048, 2048, false), (5, vec![0]));
        assert_eq!(plan_prefill(&[100, 100, 100], 2048, 2048, false), (100, vec![0, 1, 2]));
        // the length covering the most tokens: 3 rows x 40 beats 1 x 100 and 2 x 60
        assert_eq!(plan_prefill(&[100, 40, 60, 50], 2048, 2048, false), (40, vec![0, 1, 2, 3]));
        assert_eq!(plan_prefill(&[100, 10, 90], 2048, 2048, false), (90, vec![0, 2]));
        // capped by prefill_step_size and by the oldest row's rest
        assert_eq!(plan_prefill(&[5000, 6000], 2048, 8192, false), (2048, vec![0, 1]));
        assert_eq!(plan_prefill(&[30, 500, 500], 2048, 2048, false), (30, vec![0, 1, 2]));
        // the budget bounds rows x L; a tie keeps the longer chunk (fewer rows)
        assert_eq!(plan_prefill(&[100, 100, 100, 100], 2048, 250, false), (100, vec![0, 1]));
        assert_eq!(plan_prefill(&[100, 100, 50, 50, 50], 2048, 200, false), (100, vec![0, 1]));
        assert_eq!(plan_prefill(&[100, 50, 50, 50, 50], 2048, 200, false), (50, vec![0, 1, 2, 3]));
        // a budget of 0 (or below the chunk) is one row per step
        assert_eq!(plan_prefill(&[100, 100], 2048, 0, false), (100, vec![0]));
        assert_eq!(plan_prefill(&[100, 100], 64, 0, false), (64, vec![0]));
        // exact chunks: only the rows whose next chunk alone is the oldest's
        assert_eq!(plan_prefill(&[100, 40, 100, 3000], 2048, 2048, true), (100, vec![0, 2]));
        assert_eq!(plan_prefill(&[3000, 40, 2048, 5000], 2048, 8192, true), (2048, vec![0, 2, 3]));
        assert_eq!(plan_prefill(&[3000, 2048, 5000], 2048, 2048, true), (2048, vec![0]));
    }

    fn load(dir: &std::path::Path) -> (Box<dyn CausalLm>, Tokenizer) {
        let cfg = crate::engine::read_config(dir).unwrap();
        let model = crate::models::build(&cfg, crate::weights::Weights::load_dir(dir, &cfg).unwrap()).unwrap();
        (model, Tokenizer::load(dir, &cfg).unwrap())
    }

    /// 8 prompts of mixed lengths (2 to 66 tokens), some sharing their start.
    fn prompts() -> Vec<Vec<i32>> {
        [2usize, 66, 11, 25, 5, 48, 17, 33]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|t| 2 + ((t * 7 + i * (t % 3)) % 62) as i32).collect())
            .collect()
    }

    /// 1e-5 of the logits' scale (float32: a row batched with others sums in another order).
    fn tol(want: &[f32]) -> f32 {
        1e-5 * want.iter().fold(1f32, |m, x| m.max(x.abs()))
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// The logits of the last position of `head` prefilled alone from a fresh cache, in chunks of
    /// `prefill_step_size` as the scheduler runs a sequence alone.
    fn alone_prefill_logits(model: &dyn CausalLm, head: &[i32], opts: &LoadOptions) -> Vec<f32> {
        let mut cache = model.make_cache(&CacheOptions { max_kv_size: opts.max_kv_size });
        let mut last = None;
        for chunk in head.chunks(opts.prefill_step_size as usize) {
            let x = Array::from_slice(chunk, &[1, chunk.len() as i32]).unwrap();
            last = Some(model.forward_caches(&x, &mut Caches::one(&mut cache), prefill_staging()).unwrap());
            maybe_quantize(&mut cache, opts).unwrap();
        }
        let l = last.unwrap();
        let n = l.dim(1);
        mx::slice_axis(&l, 1, n - 1, n).unwrap().to_vec::<f32>().unwrap()
    }

    /// Prefill 8 prompts admitted together through the scheduler's own steps; each row's logits at
    /// its last prefilled position, and at its first decode position (its cache as batched prefill
    /// left it), against the one-at-a-time prefill of the same prompt from a fresh cache. Every pass
    /// within the budget; `batched`: some pass ran several rows.
    fn batched_prefill_matches_alone(opts: LoadOptions, budget: usize, batched: bool) {
        let dir = tiny_llama_hd(32);
        let (model, tok) = load(dir.path());
        let stats = Arc::new(Stats::default());
        let stream = Stream::default_stream().unwrap();
        let mut opts = opts;
        opts.prompt_cache_bytes = 0;
        let mut sched = Scheduler::new(&*model, &tok, opts.clone(), stats.clone(), stream);
        sched.prefill_budget = budget; // not MLXRS_BATCH_PREFILL's
        let ps = prompts();
        for p in &ps {
            let (tx, _rx) = std::sync::mpsc::channel();
            let req = crate::engine::Request { prompt: p.clone(), max_tokens: 4, ..Default::default() };
            let s = sched.make_seq(req, EventSink::new(tx, 0), Arc::default(), None).unwrap();
            sched.waiting.push_back(s);
        }
        sched.admit();
        assert_eq!(sched.running.len(), ps.len());
        // A quantized cache rounds each key and value to a level: a row whose projections ran batched
        // (another summation order, ~1e-7) can land one level away from its alone run, which moves its
        // logits by up to a few 1e-3 of their scale (measured 3.5e-3 for 8 bits) — rare, so most rows
        // still match to float32 rounding, and a batching mistake (a wrong mask or position) moves
        // every batched row by far more.
        let flip_slack = if opts.kv_bits.is_some() { 3000.0 } else { 1.0 };
        let (mut checked, mut tight) = (0, 0);
        while let Some((rows, logits)) = sched.prefill_step().unwrap() {
            let n = logits.dim(1);
            assert!(n <= opts.prefill_step_size && (rows.len() == 1 || rows.len() * n as usize <= budget));
            for (k, &i) in rows.iter().enumerate() {
                let s = &sched.running[i];
                if !s.decoding() {
                    continue; // more prompt to go
                }
                // the row's last prefilled position (prompt[len - 2])
                let got = mx::slice_axis(&mx::slice_axis(&logits, 0, k as i32, k as i32 + 1).unwrap(), 1, n - 1, n)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                let want = alone_prefill_logits(&*model, &s.req.prompt[..s.req.prompt.len() - 1], &opts);
                let d = max_diff(&got, &want);
                assert!(
                    d <= tol(&want) * flip_slack,
                    "prompt {i} ({} tokens): last prefill logits differ by {d}",
                    s.req.prompt.len()
                );
                tight += usize::from(d <= tol(&want));
                checked += 1;
            }
        }
        let prefilled = ps.iter().filter(|p| p.len() > 1).count();
        assert_eq!(checked, prefilled);
        // every row decodes next: its first decode logits from the cache batched prefill left
        for s in sched.running.iter_mut() {
            assert!(s.decoding());
            let x = s.first_input.clone().unwrap();
            let l = model.forward_caches(&x, &mut Caches::one(&mut s.cache), Staging::NONE).unwrap();
            let got = l.to_vec::<f32>().unwrap();
            let want = last_logits(&*model, &s.req.prompt, &opts, None).unwrap();
            let d = max_diff(&got, &want);
            tight += usize::from(d <= tol(&want));
            assert!(
                d <= tol(&want) * flip_slack,
                "prompt of {} tokens: first decode logits differ by {d}",
                s.req.prompt.len()
            );
        }
        let compared = prefilled + sched.running.len();
        assert!(tight * 4 >= compared * 3, "only {tight} of {compared} comparisons within float32 rounding");
        let (steps, rows) = (stats.prefill_steps.load(Ordering::Relaxed), stats.prefill_rows.load(Ordering::Relaxed));
        let most = stats.prefill_max_rows.load(Ordering::Relaxed);
        assert!(steps > 0 && rows >= steps && most as usize <= ps.len());
        assert_eq!(most > 1, batched, "rows of the largest prefill pass: {most}");
        assert_eq!(rows > steps, batched);
    }

    #[test]
    fn batched_prefill_logits_match_one_at_a_time_full_cache() {
        batched_prefill_matches_alone(LoadOptions::default(), 2048, true);
    }

    #[test]
    fn batched_prefill_logits_match_one_at_a_time_rotating_cache() {
        // a 16-slot rotating cache keeping its first 4 tokens: most prompts run past it, in chunks
        // of 8 (where chunks end matters here: rows batch when their next chunks are equal)
        let opts = LoadOptions { max_kv_size: Some(16), prefill_step_size: 8, ..Default::default() };
        batched_prefill_matches_alone(opts, 2048, true);
    }

    #[test]
    fn batched_prefill_logits_match_one_at_a_time_small_chunks_and_budget() {
        // chunks of at most 8 tokens, at most 24 tokens a pass
        batched_prefill_matches_alone(LoadOptions { prefill_step_size: 8, ..Default::default() }, 24, true);
    }

    #[test]
    fn batched_prefill_logits_match_one_at_a_time_quantized_cache() {
        for bits in [8, 4] {
            let opts =
                LoadOptions { kv_bits: Some(bits), kv_group_size: 32, prefill_step_size: 16, ..Default::default() };
            batched_prefill_matches_alone(opts, 2048, true);
        }
    }

    #[test]
    fn prefill_one_row_per_step_when_off() {
        batched_prefill_matches_alone(LoadOptions::default(), 0, false);
    }
}
