"""Type stubs for `mlxrs._native`, the PyO3 extension built from crates/mlxrs-py.

Checked against the built module by tests/test_stubs.py (`python -m mypy.stubtest mlxrs._native`):
every name the module exports must be declared here with its real signature. Add new exports in
the section they belong to (module constants, runtime, test hooks, classes at the end) and to
`__all__` (PyO3 lists every added function and class there, private ones included).

The test build (the `testing` cargo feature, scripts/setup.sh) has one more function, `_op`: every
handle op by name (crates/mlxrs-py/src/dispatch.rs). The wheel does not, so it is declared neither
here nor in the module's `__all__`; the tests reach it through tests/arrays_util.py.
"""

import os
from collections.abc import Callable, Sequence
from typing import Any, Final, TypedDict, final, type_check_only

__all__ = [
    "__version__",
    "BUILT_FOR_MLX",
    "BUILT_FOR_MLXC",
    "runtime_info",
    "_register_mlx_lib_dir",
    "_preload_blas",
    "_resolution_order",
    "_tiny_matmul",
    "describe",
    "_op_count",
    "_host_matmul_count",
    "_packed_matmul_count",
    "_half_matmul_count",
    "_half_gather_count",
    "_half_attention_count",
    "generation_config",
    "mlxrs_home",
    "set_memory_limit",
    "memory_limit",
    "memory_counters",
    "_array_roundtrip",
    "gguf_import",
    "default_import_dtype",
    "_sample",
    "_audio_decode",
    "_audio_resample",
    "_audio_log_mel",
    "plan",
    "device_memory",
    "model_facts",
    "SUPPORTED_MODEL_TYPES",
    "GGUF_ARCHITECTURES",
    "download",
    "native_pack_info",
    "native_pack_install",
    "_gguf_dequantize",
    "_gguf_header",
    "_gguf_tensor",
    "_gguf_tokenizer",
    "Session",
    "AudioClip",
    "TokenStream",
    "EventHub",
    "EngineHold",
]

# ---- module constants -------------------------------------------------------------------------

__version__: Final[str]
"""mlxrs's version (the Cargo workspace version)."""
BUILT_FOR_MLX: Final[str]
"""The MLX release (pip `mlx` version) this build expects, e.g. "0.32.4"."""
BUILT_FOR_MLXC: Final[str]
"""The mlx-c release this build was written against, e.g. "0.5.0"."""

# ---- runtime ----------------------------------------------------------------------------------

@type_check_only
class _RuntimeInfo(TypedDict):
    mlxrs_version: str
    mlx_version: str
    mlxc_version: str
    backend: str  # "cpu" | "cuda" | "metal"
    device: str  # "cpu" | "gpu"
    source: str  # "MLXRS_LIBMLXC" | "sidecar" | "native-pack cache" | "homebrew"
    libmlxc: str
    libmlx: str | None
    blas: str | None
    blas_gemv: str | None  # libmlxrs_blas: float32 matrix-vector products as BLAS gemv (Linux CPU)
    mlx_loaded_first: bool  # mlx.core was imported before mlxrs: MLX's own BLAS serves this process
    memory_size: int | None
    active_memory: int
    peak_memory: int

def runtime_info() -> _RuntimeInfo:
    """Load the native runtime if needed and describe it; when nothing is found before the
    native-pack cache and a pack source is known, the pack is fetched first (progress on stderr).
    Raises mlxrs.errors.NativeRuntimeError when libmlxc cannot be found (or fetched), opened or
    does not match this build."""

def _register_mlx_lib_dir(dir: str | os.PathLike[str]) -> None:
    """Tell the resolver about a directory that may hold libmlx (before the first load)."""

def _preload_blas() -> bool:
    """Put the optimized BLAS ahead of libmlx now (Linux CPU, where libmlxc is found locally): True
    when libmlx was loaded already (mlx.core imported first), whose BLAS calls then stay MLX's own."""

def _resolution_order() -> list[str]:
    """Where the resolver finds libmlxc ("<source>: <path>"), or its explanation of every place it tried."""

@type_check_only
class Description(TypedDict):
    """What `describe` returns: what `mlxrs ls` shows of a model directory."""

    model_type: str | None
    supported: bool
    note: str | None
    params: int
    weight_bytes: int
    dtype: str | None
    quantization: str | None
    context_length: int | None
    chat_template: bool
    tools: bool
    files: list[str]

def describe(model_dir: str | os.PathLike[str]) -> Description:
    """What `mlxrs ls` shows of a model directory, loadable or not (crates/mlxrs-core's
    `describe::describe`: config.json through the loader's reader, the safetensors headers, the
    chat template); `supported` False with a `note` saying why mlxrs cannot load it. Raises
    ModelLoadError when it is not a model directory at all."""

def generation_config(model_dir: str | os.PathLike[str]) -> str:
    """A model directory's generation_config.json as JSON text ("null" when it has none); raises
    ModelLoadError when it is not valid JSON."""

def mlxrs_home() -> str | None:
    """mlxrs's own directory: $MLXRS_HOME, else $XDG_CACHE_HOME/mlxrs, else ~/.cache/mlxrs (None
    without HOME)."""

def set_memory_limit(bytes: int) -> int:
    """Set MLX's memory limit (the memory plan's allocatorLimitBytes); returns the previous one."""

def memory_limit() -> int:
    """MLX's memory limit now."""

def memory_counters(reset_peak: bool = False) -> dict[str, int]:
    """MLX's memory counters in bytes: {"active", "peak", "cache"}; `reset_peak` first sets the peak
    to the active bytes (mlx-c's `mlx_reset_peak_memory`), for measuring one operation's peak."""

def _tiny_matmul() -> list[list[float]]:
    """`mlxrs info`'s tiny computation through MLX: [[0,1,2],[3,4,5]] @ ones(3,2), as rows."""

def _op_count() -> int:
    """MLX ops mlxrs has built since the process started (every thread; a compiled function or
    custom kernel counts once): the difference over generated tokens is the ops per decode step."""

def _packed_matmul_count() -> int:
    """Products the CPU backend computed with mlxrs's packed kernel for MLX's 4/8-bit affine weights
    (MLXRS_CPU_HOST_BLOCKS: decode steps of up to 8 rows) since the process started."""

def _half_matmul_count() -> int:
    """Products the CPU backend computed with mlxrs's host op for bfloat16/float16 weights
    (MLXRS_CPU_HALF: projections of decode steps and prompts) since the process started."""

def _half_gather_count() -> int:
    """Routed-expert products (a mixture's gather) the CPU backend computed with mlxrs's host op for
    bfloat16/float16 experts since the process started: MLX's CPU gather_mm has only float32, so a
    16-bit mixture's experts take it whatever MLXRS_CPU_HALF says."""

def _half_attention_count() -> int:
    """Prompt attentions (more than one query) the CPU backend computed with mlxrs's host op for
    bfloat16/float16 queries, keys and values (MLXRS_CPU_HALF) since the process started."""

def _host_matmul_count() -> int:
    """Float32 projections the CPU backend computed with mlxrs's host kernel (MLXRS_CPU_SMALL_MATMUL:
    decode steps of 2-32 rows, prompts of 2-12 tokens) since the process started."""

# ---- test hooks: raw arrays as (bytes, shape, MLX dtype name) ---------------------------------

_RawArray = tuple[bytes, list[int], str]

def _array_roundtrip(data: bytes, shape: Sequence[int], dtype: str) -> _RawArray:
    """Copy a buffer into an MLX array and back out."""

def _sample(logits: Sequence[float], params: str = "{}", draws: int = 1) -> tuple[list[float], list[int]]:
    """Apply sampling `params` (JSON) to fixed logits: the filtered log-probabilities and `draws`
    samples from one seeded sampler."""

# ---- test hooks: audio --------------------------------------------------------------------------

def _audio_decode(data: bytes) -> tuple[list[float], int]:
    """(mono float32 samples, sample rate) of a WAV clip, as the audio path decodes it."""

def _audio_resample(samples: Sequence[float], src: int, dst: int) -> list[float]:
    """Samples resampled from `src` Hz to `dst` Hz (scipy's resample_poly, kaiser_best filter)."""

def _audio_log_mel(samples: Sequence[float], fe: str = "{}") -> tuple[list[float], int, list[bool]]:
    """Gemma 4's log-mel features of 16 kHz samples (`fe`: the feature extractor's settings,
    JSON): (features [frames, 128] flattened, frames, each frame's mask)."""

# ---- test hooks: GGUF ---------------------------------------------------------------------------

def _gguf_dequantize(ty: int, raw: bytes, n: int) -> bytes:
    """Dequantize `n` values of ggml type id `ty` from raw block bytes; float32 bytes."""

def _gguf_header(
    data: bytes | None, path: str | os.PathLike[str] | None
) -> tuple[int, str, list[tuple[str, list[int], int, int]], int]:
    """Parse a GGUF header from bytes (or a file): (version, metadata as JSON, tensors as
    [(name, row-major shape, ggml type id, data offset)], data section offset). Raises
    mlxrs.errors.ModelLoadError naming the byte offset of a malformed or truncated header."""

def _gguf_tensor(path: str | os.PathLike[str], name: str) -> bytes:
    """One tensor of a GGUF file dequantized to float32 bytes (row-major)."""

def _gguf_tokenizer(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The tokenizer a GGUF file describes: (tokenizer.json, tokenizer_config.json) as JSON text."""

def gguf_import(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    dtype: str = "bf16",
    progress: Callable[[int, int, str], object] | None = None,
) -> None:
    """Import a GGUF file into a model directory (dtype: bf16, f16, f32, q8, q4)."""

def default_import_dtype() -> str:
    """The dtype a GGUF is imported as by default on the backend MLX computes on here ("f32" on the
    CPU, "bf16" on GPUs)."""

# ---- memory planner (crates/mlxrs-core/src/plan.rs) -------------------------------------------

def plan(
    model_dir: str | os.PathLike[str],
    context_tokens: int | None = None,
    kv_bits: int | None = None,
    budget: str | None = None,
    kv_group_size: int = 64,
    prefill_step_size: int = 2048,
    device_bytes: int | None = None,
    fused_attention: bool | None = None,
    backend: str | None = None,
    stream_experts: bool = False,
    expert_cache_bytes: int | None = None,
    adapter_bytes: int = 0,
    expert_prefetch: bool | None = None,
) -> str:
    """The MemoryPlan (schemaVersion 1) as JSON for the model in `model_dir` (config.json and
    safetensors headers only) at `context_tokens` (None: the model's maximum). `budget` is a
    fraction of device memory ("0.5") or bytes ("12G", "8000000000"); None: 0.75 × device memory.
    `device_bytes` overrides the device memory and `backend` ("cpu", "cuda", "metal"; None: this
    machine's) the backend, which decides whether attention is fused (Metal; CUDA with 16-bit
    activations; never on the CPU) and how many decoder layers' prefill activations are alive at
    once (three on a GPU, one on the CPU). `fused_attention` overrides the first. `adapter_bytes`:
    LoRA adapters' tensor bytes, counted as weights."""

def device_memory() -> tuple[int, str]:
    """(bytes, source) of the memory the default budget is a fraction of; source is "mlx-gpu",
    "proc-meminfo", "sysctl" or "unknown"."""

def model_facts(model_dir: str | os.PathLike[str], kv_bits: int | None = None, kv_group_size: int = 64) -> str:
    """What the planner knows about a model directory or .gguf file, as JSON: model_type,
    num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size,
    sliding (per layer: its window or null), kv_elems (per layer: K and V elements per token), act_bytes, weights_bytes, max_position_embeddings,
    and kv_bytes_per_token_layer for `kv_bits`."""

SUPPORTED_MODEL_TYPES: Final[list[str]]
"""The config.json model_type values mlxrs can load (the architecture table,
crates/mlxrs-core/src/models/arch.rs)."""

GGUF_ARCHITECTURES: Final[list[tuple[str, str]]]
"""(GGUF general.architecture, model_type) for every architecture the GGUF importer maps (the
same table)."""

# ---- transfers (crates/mlxrs-core/src/download.rs, native_pack.rs) ----------------------------

@type_check_only
class _DownloadResult(TypedDict):
    transferred: int  # body bytes received over the network (both fetches after a refetch)
    resumed_from: int  # length of the .incomplete prefix kept from an earlier run (0: none)
    refetched: bool  # a verification failure made the file be fetched again
    size: int  # the verified file's size

def download(
    url: str,
    dest: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    git_sha1: str | None = None,
    size: int | None = None,
    name: str | None = None,
    token: str | None = None,
    hub: bool = False,
    retries: int = 5,
    backoff: float = 0.5,
    progress: Callable[[int, int], object] | None = None,
) -> _DownloadResult:
    """Fetch `url` into `dest` through `dest + ".incomplete"` (resumed with a Range request when it
    exists), verified against `sha256` or the git blob id `git_sha1` (which needs `size`); a
    mismatch drops the bytes and refetches once, then raises mlxrs.errors.DownloadError naming
    `name`. `progress(done, total)` runs as bytes arrive (total 0 while unknown); an exception
    it raises, or Ctrl-C, stops the transfer (the partial file is kept) and propagates. `hub`
    phrases 401/403/404 for a Hugging Face repo (`hf auth login`, HF_TOKEN)."""

@type_check_only
class _NativePackInfo(TypedDict):
    version: str
    platform: str  # "<os>-<arch>-<backend>"
    backend: str  # "cpu" | "cuda" | "metal"
    dir: str | None  # where it is unpacked (None without MLXRS_HOME, XDG_CACHE_HOME or HOME)
    archive: str  # the tarball's file name
    files: list[str]  # what an unpacked pack must hold
    url: str | None
    sha256: str | None
    origin: str | None  # "MLXRS_NATIVE_PACK_URL" | "release"
    problem: str | None  # why it cannot be fetched (url and sha256 are then None)

def native_pack_info(backend: str | None = None) -> _NativePackInfo:
    """The native pack for `backend` (None: this machine's), where it comes from and goes."""

@type_check_only
class _NativePackInstalled(TypedDict):
    dir: str  # the pack directory
    fetched: bool  # False: it was already complete, nothing was transferred
    resumed_from: int  # length of the partial download kept from an earlier run (0: none)
    size: int  # the tarball's size (0 when nothing was fetched)

def native_pack_install(
    backend: str | None = None,
    *,
    force: bool = False,
    progress: Callable[[int, int], object] | None = None,
    on_wait: Callable[[], object] | None = None,
) -> _NativePackInstalled:
    """Fetch (resumable), verify against the pack's sha256 and unpack (atomically) the native pack
    for `backend` (None: this machine's) unless it is complete (or `force`): the code the runtime
    runs on first need. `progress(done, total)` runs as bytes arrive (an exception it raises, or
    Ctrl-C, stops the transfer and propagates); `on_wait()` runs when another process is fetching
    the same pack. Raises mlxrs.errors.DownloadError (no source, network, checksum, a bad pack)."""

# ---- classes ----------------------------------------------------------------------------------

@final
class Session:
    """A loaded model behind its engine thread (crates/mlxrs-py/src/session.rs)."""

    def __new__(
        cls,
        model_dir: str | os.PathLike[str],
        kv_bits: int | None = None,
        max_kv_size: int | None = None,
        prefill_step_size: int = 2048,
        kv_group_size: int = 64,
        max_concurrency: int | None = None,
        max_queue: int | None = None,
        prompt_cache_bytes: int | None = None,
        kv_budget_bytes: int | None = None,
        stream_experts: bool = False,
        expert_cache_bytes: int | None = None,
        adapters: Sequence[tuple[str, str | os.PathLike[str]]] = ...,
        expert_prefetch: bool | None = None,
        prefill_batch_tokens: int | None = None,
    ) -> Session:
        """`adapters`: (name, directory) of LoRA/DoRA adapters in mlx-lm's format (crates/mlxrs-core/src/lora.rs)."""
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(
        self,
        messages: str,
        tools: str | None = None,
        add_generation_prompt: bool = True,
        kwargs: str | None = None,
        template: str | None = None,
    ) -> str:
        """`messages`, `tools` and `kwargs` are JSON; `template`: a Jinja source used instead of the
        model's own."""
    def encode_rendered(self, text: str) -> list[int]: ...
    def start(
        self,
        prompt: Sequence[int],
        params: str = "{}",
        hub: EventHub | None = None,
        images: Sequence[tuple[bytes, str]] | None = None,
        audio: Sequence[AudioClip] | None = None,
        video: Sequence[tuple[bytes, str]] | None = None,
        videos: Sequence[Sequence[tuple[bytes, str]]] | None = None,
    ) -> TokenStream:
        """Queue a generation; `params` is a JSON object of sampling options (and
        `max_image_bytes`, `max_image_pixels`). With `hub`, its events go to the hub, tagged with
        the stream's `id`. `images`: (encoded bytes, the name errors give it) each, in the order
        of the prompt's image-token runs (a model with a vision tower). `audio`: clips from
        `audio_clips`, in the order of the prompt's audio-token runs. `video`: one video's
        frames as images are (a model whose tower takes video), after the images; `videos`:
        several videos so, in the order of the prompt's video-token runs, after it."""
    def audio_clips(self, clips: Sequence[tuple[bytes, str]], params: str = "{}") -> list[AudioClip]:
        """Decode and featurize WAV clips, each (bytes, the name errors give it); `params` may
        hold `max_audio_bytes` and `max_audio_seconds`."""
    def expand_audio_markers(self, text: str, tokens: Sequence[int]) -> str:
        """`text` with each audio marker expanded to boa, `tokens[i]` audio tokens, eoa."""
    def audio_features(self, clips: Sequence[AudioClip]) -> list[float]:
        """The audio tower's projected features of clips, flattened (each clip's audio tokens in
        order, `hidden` wide)."""
    def pixel_values(self, data: bytes, params: str = "{}") -> tuple[list[float], int, int]:
        """(pixel values [3, H, W] flattened, H, W) of an encoded image, as the model's processor
        makes them."""
    def image_features(self, images: Sequence[bytes]) -> list[float]:
        """The vision tower's projected features of encoded images, flattened (each image's tokens
        in order, `hidden` wide)."""
    def video_pixel_values(self, frames: Sequence[bytes]) -> tuple[list[float], int, int, int]:
        """(pixel values [frames, 3, H, W] flattened, frames, H, W) of a video's encoded frames."""
    def video_features(self, frames: Sequence[bytes]) -> list[float]:
        """The vision tower's merged features of a video's encoded frames, flattened."""
    def expand_video_markers(self, text: str, videos: Sequence[tuple[int, int, int, Sequence[float] | None]]) -> str:
        """`text` with its video markers expanded, one per video in order: each (frames, height,
        width of its first frame, its frames' times in seconds or None for evenly at the video
        processor's fps) (Qwen3.5: one timestamped vision block per temporal group)."""
    def expand_image_markers(self, text: str, images: int, sizes: Sequence[tuple[int, int]] | None = None) -> str:
        """`text` with each image marker expanded to the model's image-token sequence; `sizes`
        (each image's (height, width), from `image_sizes`) when the count of image tokens depends
        on the image (`info()["vision"]["sized"]`, Gemma 4)."""
    def image_sizes(self, images: Sequence[tuple[bytes, str]], params: str = "{}") -> list[tuple[int, int]]:
        """(height, width) of encoded images as decoded (EXIF orientation applied), from their
        headers; each (bytes, the name errors give it); `params` the media limits as JSON."""
    def embed(self, prompt: Sequence[int]) -> list[float]:
        """Final normed hidden states of `prompt`, mean-pooled, L2-normalised."""
    def logits(
        self,
        prompt: Sequence[int],
        images: Sequence[bytes] | None = None,
        audio: Sequence[AudioClip] | None = None,
        video: Sequence[bytes] | None = None,
        videos: Sequence[Sequence[bytes]] | None = None,
    ) -> list[float]:
        """Last-position logits (float32) from a fresh cache; with `images` (`audio`), their
        embeddings at the prompt's image (audio) tokens; `video`: one video's frames, after the
        images; `videos`: several videos' frames, after it."""
    def info(self) -> dict[str, Any]:
        """Model facts and counters; `info()["engine"]` is {"state": "running" | "dead" | "closed",
        "error": the engine's death message or None}. Works on a closed session."""
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def _inject_engine_panic(self) -> None:
        """TEST-ONLY hook: the engine thread panics at its next iteration, as a bug in its step loop
        would; in-flight and later requests then fail with `mlxrs.errors.EngineError`. Never call it
        outside tests: the session is unusable afterwards."""
    def hold(self) -> EngineHold:
        """Hold the engine thread before its next step until `release()`: generations started
        meanwhile are admitted together (their prompts prefill together). Nothing runs while held."""

@final
class EngineHold:
    """A hold on the engine thread (`Session.hold`)."""

    def release(self) -> None:
        """Let the engine go on (again: nothing)."""

@final
class AudioClip:
    """One WAV clip decoded and featurized (Gemma 4's log-mel), ready for a prompt."""
    @property
    def tokens(self) -> int:
        """The audio tokens it stands for in a prompt."""
    @property
    def frames(self) -> int:
        """Log-mel frames."""
    @property
    def samples(self) -> int:
        """Samples at 16 kHz (before the 30 s cut)."""
    def features(self) -> tuple[list[float], list[bool]]:
        """(features [frames, 128] flattened float32, each frame's mask: true for real audio)."""

@final
class TokenStream:
    """Events of one generation: dicts with "type" in {"progress", "token", "done"}."""

    @property
    def id(self) -> int: ...
    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> dict[str, Any]: ...
    def cancel(self) -> None: ...

@final
class EventHub:
    """One channel for the events of many streams (the dispatcher thread waits on it)."""

    def __new__(cls) -> EventHub: ...
    def wait(self, timeout: float) -> list[tuple[int, dict[str, Any] | BaseException]]: ...
