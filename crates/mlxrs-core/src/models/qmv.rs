//! A quantized matrix-vector product of our own on CUDA (MLX's affine 4- and 8-bit layout), and a
//! dense one for 16-bit weights ([`Weight::Dense`], [`SOURCE_DENSE`], [`DENSE_ENV`]), for the one to
//! four rows of a decode step. One warp per two output rows (the dense kernel's plain and residual
//! products one), 16-byte reads, float32 sums. 4-bit
//! weights: x rounded to int8 per 32 values and integer dot products (`dp4a`, [`SOURCE_Q8X`]), as
//! llama.cpp does; 8-bit weights (and 4-bit with `MLXRS_CUDA_QMV=float`): float products, each 4-bit
//! value decoded by moving its nibble into a float's mantissa ([`SOURCE`]).
//! Nsight Compute on the H200 (bench/RESULTS-gpu.md, `bench/device_qmv_variants.sh`): an 8B 4-bit decode
//! step's matvecs take 1.77 ms of GPU time through the int8 kernel, 2.39 through the float one (MLX
//! 0.32's kernel reads these weights at ~870 GB/s, the int8 kernel at 1.4–3.5 TB/s by shape).
//! `MLXRS_CUDA_QMV=1` (the default) turns it on, `float` on without the int8 rounding, `0` off (MLX's
//! kernel, the reference); read per request ([`refresh`], called by the engine beside
//! `layers::refresh_dequant_rows`).
//!
//! Each MLX op costs a decode step host time (~6.5 µs on the H200's host: the step waits on the host,
//! `info["decode_host_seconds"]`), so the kernel also does the ops around the product: after it
//! ([`Epilogue`]) a residual add, the fused gate/up's SwiGLU, or the fused q/k/v's rotary embedding
//! with q, k and v written as three arrays ([`qkv_rope`], [`ROPE_ENV`]); before it the RMSNorm of x
//! ([`Norm`], [`NORM_ENV`]). 8B 4-bit: 309 ops a step instead of 629; 1B bf16 158 instead of 318.
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, CudaKernel, Dtype, QuantMode, TemplateArg};
use crate::weights::QuantSpec;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// `0`: MLX's quantized matvec always.
pub const ENV: &str = "MLXRS_CUDA_QMV";

/// Output rows per warp (the kernel's `R`) of the quantized kernels, and of every kernel whose
/// epilogue pairs rows (SwiGLU's gate and up, a rotation pair).
const ROWS_PER_WARP: i32 = 2;

/// The dense kernel's rows per warp and loop steps in flight for a plain or residual epilogue:
/// measured on the H200 (Nsight Compute, `bench/dense_mv_variants.py --profile`, an 8B step's
/// matvecs): one row a warp with 8 steps in flight 3.81 ms against MLX's gemv 3.90 and two rows with
/// 4 steps 4.18.
const DENSE_ROWS_PER_WARP: i32 = 1;
const DENSE_UNROLL: &str = "#define MLXRS_DENSE_UNROLL 8\n";

/// Up to how many values of x (rows × K) the dense and float kernels take with the norm in their
/// prologue: the normed x lives in the block's static shared memory (x's dtype, 32 KiB).
pub const NORM_STAGE_MAX_VALUES: usize = 16384;
/// Up to how many rows of x (the kernel's `M`, unrolled).
pub const MAX_ROWS: usize = 4;

static SWITCH: AtomicU8 = AtomicU8::new(UNREAD);
const UNREAD: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;
/// On, with 4-bit weights through the float kernel too (the int8-activation kernel's reference).
const FLOAT: u8 = 3;

/// Whether the kernel runs when [`ENV`] is unset: on (measured on the H200, bench/RESULTS-gpu.md:
/// 8B 4-bit decode 221 against 152 tokens/s through MLX's kernel, 8-bit 215 against 179, 1B 4-bit
/// 421 against 427, alternating in one process).
const DEFAULT_ON: bool = true;

/// Read [`ENV`] again (the engine does per request): `0` off, `1` on, `float` on with every product
/// through the float kernel, unset [`DEFAULT_ON`]; and [`ROPE_ENV`], [`NORM_ENV`], [`DENSE_ENV`].
pub fn refresh() {
    let state = match std::env::var(ENV).as_deref().map(str::trim) {
        Ok("0") => OFF,
        Ok("1") => ON,
        Ok("float") => FLOAT,
        _ if DEFAULT_ON => ON,
        _ => OFF,
    };
    SWITCH.store(state, Ordering::Relaxed);
    for (switch, env) in
        [(&ROPE_SWITCH, ROPE_ENV), (&NORM_SWITCH, NORM_ENV), (&DENSE_SWITCH, DENSE_ENV), (&TABLE_SWITCH, POSITIONS_ENV)]
    {
        let off = std::env::var(env).is_ok_and(|v| v.trim() == "0");
        switch.store(if off { OFF } else { ON }, Ordering::Relaxed);
    }
}

/// The switch's state ([`ON`], [`OFF`] or [`FLOAT`]); OFF wherever the backend is not CUDA.
fn state() -> u8 {
    let s = read(&SWITCH);
    if s == OFF {
        return OFF;
    }
    if crate::plan::Backend::cuda() {
        s
    } else {
        OFF
    }
}

/// Up to how many values of x (rows × K) the int8-activation kernel takes: its int8 copy of x lives in
/// the block's static shared memory (48 KiB at most, with the per-block scales and sums beside it).
pub const Q8X_MAX_VALUES: usize = 32768;

/// Which kernel a product that [`fits`] takes: 4-bit weights with at most [`Q8X_MAX_VALUES`] values of
/// x the int8-activation one ([`SOURCE_Q8X`]) unless the switch says `float`; everything else the
/// float one ([`SOURCE`]).
fn int8_activations(x: &Array, q: QuantSpec, state: u8) -> bool {
    state == ON && q.bits == 4 && x.size() <= Q8X_MAX_VALUES
}

/// The values per row of W (its K: `w [N, K·bits/32]`).
pub(crate) fn k_of(w: &Array, q: QuantSpec) -> i32 {
    w.dim(-1) * (32 / q.bits.max(1))
}

/// How many rows of W's K values x holds.
fn rows_of(x: &Array, w: &Array, q: QuantSpec) -> usize {
    x.size() / (k_of(w, q).max(1) as usize)
}

/// 1 to [`MAX_ROWS`] rows of 16-bit x (x's values, rows × W's K, in any shape), affine 4- or 8-bit
/// weights with biases, whose 16-byte reads stay inside one group and whose rows are whole 16-byte
/// reads.
pub fn fits(x: &Array, w: &Array, biases: Option<&Array>, q: QuantSpec) -> bool {
    if w.ndim() != 2 || !(q.bits == 4 || q.bits == 8) {
        return false;
    }
    let k = k_of(w, q);
    let rows = rows_of(x, w, q);
    let per_read = 4 * 32 / q.bits; // values in one 16-byte read
    (1..=MAX_ROWS).contains(&rows)
        && x.size() == rows * k as usize
        && q.mode == QuantMode::Affine
        && biases.is_some()
        && matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        && q.group_size % per_read == 0
        && k % q.group_size == 0
        && k % per_read == 0
}

/// What the kernel does with a product before writing it.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    /// `x · Wᵀ`.
    Plain,
    /// `res + x · Wᵀ` (a decode step's residual after the output or down projection), rounded once.
    Residual(&'a Array),
    /// W the gate's rows then up's (a fused gate/up projection, `N = 2·inter`): `silu(g) · u` of the
    /// two halves, `[..., inter]`, each half rounded to x's dtype first (as the separate products are).
    SwiGlu,
}

/// The rotary embedding of one token per row ([`qkv_rope`]): MLX's `fast::rope` of the q and k heads
/// of a fused q/k/v product, at position `positions[row]`, over the whole head.
#[derive(Clone, Copy)]
pub struct QkvRope<'a> {
    /// One per row of x (the kernel's int32 input, made only when it launches).
    pub positions: &'a [i32],
    /// Per-pair periods (MLX's `freqs`, float32 `[head_dim / 2]`); None: `base`'s.
    pub freqs: Option<&'a Array>,
    pub base: f32,
    pub scale: f32,
    pub traditional: bool,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
}

/// `0`: the rotary kernel's positions are an array of host data (the reference) instead of, where
/// they are consecutive (one sequence's decode step or chunk), a view into [`position_table`] (the
/// default). Measured on an H100 (`bench/dense_mv_variants.py --profile`, `ROPE`, Nsight Compute with
/// its cold caches): an 8B model's q/k/v kernel took 34.6 µs with its 4-byte positions array made from
/// host data, which MLX's CUDA allocator keeps in host-visible memory that every warp then reads
/// across the bus, and 23.2 µs with positions made on the GPU — as much as the same product without
/// the rotary epilogue (23.1). In the engine, with one positions array a step ([`positions_input`]),
/// the table decodes 4.9% faster on an 8B bf16 model and 6.7% on 1B (an H100, alternating in one
/// process; bench/RESULTS-gpu.md 2026-12-07), the same greedy tokens.
pub const POSITIONS_ENV: &str = "MLXRS_CUDA_ROPE_TABLE";

static TABLE_SWITCH: AtomicU8 = AtomicU8::new(UNREAD);

/// `0, 1, 2, …` (int32) made by `arange` on the device, at least `n` long (grown to the next power of
/// two, never shrunk): consecutive positions are a slice of it, a view into device memory that the
/// host never writes.
fn position_table(n: usize) -> Result<Array> {
    static TABLE: std::sync::Mutex<Option<Array>> = std::sync::Mutex::new(None);
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = t.as_ref().filter(|a| a.size() >= n) {
        return Ok(a.clone());
    }
    let len = n.next_power_of_two().max(4096);
    let a = mx::arange(0.0, len as f64, 1.0, Dtype::Int32)?;
    mx::eval(&[&a])?;
    *t = Some(a.clone());
    Ok(a)
}

/// The rotary kernel's `pos` input for `m` rows (one position a row): a view into
/// [`position_table`] where the positions are consecutive and `table` ([`POSITIONS_ENV`]), else an
/// array of them. The last [`POSITIONS_KEPT`] made are kept and given again for the same positions:
/// every layer of a decode step asks for the same ones (the rotary kernel for all rows, the attention
/// kernel for all rows or, over per-row caches, for each row), so a step makes one array for each,
/// not one a layer (host time: the 1B step waits on the host).
fn positions_input(positions: &[i32], m: i32, table: bool) -> Result<Array> {
    if positions.len() != m as usize {
        return Err(Error::Invalid(format!("{} rotary positions for {m} rows", positions.len())));
    }
    type Kept = std::collections::VecDeque<(Vec<i32>, bool, Array)>;
    thread_local! {
        static KEPT: std::cell::RefCell<Kept> = const { std::cell::RefCell::new(Kept::new()) };
    }
    // newest first: a step's layers ask for what the step made last
    let hit = KEPT.with_borrow(|k| k.iter().rev().find(|(p, t, _)| p == positions && *t == table).map(|e| e.2.clone()));
    if let Some(a) = hit {
        return Ok(a);
    }
    let a = make_positions(positions, m, table)?;
    KEPT.with_borrow_mut(|k| {
        if k.len() == POSITIONS_KEPT {
            k.pop_front();
        }
        k.push_back((positions.to_vec(), table, a.clone()));
    });
    Ok(a)
}

/// Positions arrays [`positions_input`] keeps: a step's one for all rows and one a row of a batch over
/// per-row caches.
const POSITIONS_KEPT: usize = 80;

/// The step's positions array for `positions` (one a row) as the rotary kernel takes it
/// ([`positions_input`], the same array for every layer of a step): for the other kernels of the step
/// that read positions ([`super::decode_attn`]).
pub(crate) fn step_positions(positions: &[i32]) -> Result<Array> {
    positions_input(positions, positions.len() as i32, read(&TABLE_SWITCH) == ON)
}

fn make_positions(positions: &[i32], m: i32, table: bool) -> Result<Array> {
    match positions.first() {
        Some(&first) if table && first >= 0 && positions.iter().zip(first..).all(|(&p, q)| p == q) => {
            let end = first + m;
            mx::slice(&position_table(end as usize)?, &[first], &[end], &[1])
        }
        // others (a batch's rows): gathered from the table, so that the kernels read device memory, not
        // the host-visible array the positions were made in (one op a step)
        Some(_) if table && positions.iter().all(|&p| p >= 0) => {
            let hi = positions.iter().copied().max().unwrap_or(0);
            mx::take(&position_table(hi as usize + 1)?, &Array::from_slice(positions, &[m])?, 0)
        }
        _ => Array::from_slice(positions, &[m]),
    }
}

/// An RMSNorm of x done in the kernel's prologue (MLX's `fast::rms_norm(x, weight, eps)`, each value
/// rounded as it writes it): every kernel (the dense and float ones for up to
/// [`NORM_STAGE_MAX_VALUES`] values of x).
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a Array,
    pub eps: f32,
}

/// Turns the norm in the prologue ([`Norm`]) off with `0` (MLX's rms_norm op before the product).
pub const NORM_ENV: &str = "MLXRS_CUDA_QMV_NORM";

static NORM_SWITCH: AtomicU8 = AtomicU8::new(UNREAD);

/// A switch's state, the environment read first ([`refresh`]) while it is unread.
fn read(switch: &AtomicU8) -> u8 {
    if switch.load(Ordering::Relaxed) == UNREAD {
        refresh();
    }
    switch.load(Ordering::Relaxed)
}

/// An MLX-quantized weight: `w [N, K·bits/32]` uint32, `scales`/`biases` `[N, K/group]`.
#[derive(Clone, Copy)]
pub struct QWeight<'a> {
    pub w: &'a Array,
    pub scales: &'a Array,
    pub biases: Option<&'a Array>,
    pub q: QuantSpec,
}

/// The weight of a product: MLX-quantized, or dense in x's dtype (`w [N, K]`, bf16 or f16: the
/// [`SOURCE_DENSE`] kernel, with the same prologue and epilogues).
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    Quant(QWeight<'a>),
    Dense(&'a Array),
}

impl<'a> From<QWeight<'a>> for Weight<'a> {
    fn from(q: QWeight<'a>) -> Self {
        Weight::Quant(q)
    }
}

impl Weight<'_> {
    /// W's rows (the product's N).
    fn rows(&self) -> i32 {
        match self {
            Weight::Quant(q) => q.w.dim(0),
            Weight::Dense(w) => w.dim(0),
        }
    }

    /// The values per row of W (the product's K).
    fn k(&self) -> i32 {
        match self {
            Weight::Quant(q) => k_of(q.w, q.q),
            Weight::Dense(w) => w.dim(-1),
        }
    }

    /// How many rows of W's K values x holds.
    fn rows_of(&self, x: &Array) -> usize {
        x.size() / (self.k().max(1) as usize)
    }

    /// Whether a kernel takes `x · Wᵀ`: [`fits`] for quantized W; for dense W, 1 to [`MAX_ROWS`]
    /// rows of x in W's dtype (bf16 or f16) and rows of whole 16-byte reads.
    fn fits(&self, x: &Array) -> bool {
        match self {
            Weight::Quant(q) => fits(x, q.w, q.biases, q.q),
            Weight::Dense(w) => {
                let (k, rows) = (w.dim(-1), self.rows_of(x));
                w.ndim() == 2
                    && (1..=MAX_ROWS).contains(&rows)
                    && x.size() == rows * k as usize
                    && matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16)
                    && w.dtype() == x.dtype()
                    && k % 8 == 0
            }
        }
    }
}

/// Turns the dense kernel ([`Weight::Dense`], [`SOURCE_DENSE`]) off with `0`: MLX's matmul for
/// 16-bit weights (the reference), while the quantized kernels stay on.
pub const DENSE_ENV: &str = "MLXRS_CUDA_DENSE_MV";

static DENSE_SWITCH: AtomicU8 = AtomicU8::new(UNREAD);

/// What a launch writes: an [`Epilogue`]'s one output, or [`qkv_rope`]'s three.
#[derive(Clone, Copy)]
enum Kind<'a> {
    Epilogue(Epilogue<'a>),
    Rope(&'a QkvRope<'a>),
}

/// `x · Wᵀ` for MLX-quantized W (`w [N, K·bits/32]` uint32, `scales`/`biases` `[N, K/group]`) or
/// dense W (`[N, K]` in x's dtype) and x of rows × K values, through [`Epilogue`], in `shape` (default
/// x's leading axes and the output width, where x's last axis is K): where the kernel takes it (CUDA,
/// the switch on, a product it [`fits`], a residual of the result's shape and x's dtype); None
/// elsewhere. A given shape saves the reshape around the product: the attention's heads straight into
/// the output projection.
pub fn qmv(
    x: &Array,
    wt: Weight,
    epilogue: Epilogue,
    norm: Option<Norm>,
    shape: Option<&[i32]>,
) -> Result<Option<Array>> {
    if state() == OFF {
        return Ok(None); // (the CPU: before any shape is worked out)
    }
    let (n, k) = (wt.rows(), wt.k());
    let outs = match epilogue {
        Epilogue::SwiGlu if n % 2 != 0 => return Ok(None),
        Epilogue::SwiGlu => n / 2,
        _ => n,
    };
    let m = wt.rows_of(x);
    let shape = match shape {
        Some(s) if s.iter().map(|&d| d as i64).product::<i64>() == (m as i64) * outs as i64 => s.to_vec(),
        Some(_) => return Ok(None),
        None if x.ndim() > 0 && x.dim(-1) == k => {
            let mut s = x.shape().to_vec();
            *s.last_mut().expect("x has an axis") = outs;
            s
        }
        None => return Ok(None),
    };
    if let Epilogue::Residual(r) = epilogue {
        if r.dtype() != x.dtype() || r.shape() != shape {
            return Ok(None);
        }
    }
    Ok(launch(x, wt, Kind::Epilogue(epilogue), norm, &[shape])?.and_then(|mut o| o.pop()))
}

/// The fused q/k/v projection of one token per row (W's rows q's heads, then k's, then v's) with
/// the rotary embedding of q and k in the same kernel: q `[rows, n_heads, 1, head_dim]`, k and v
/// `[rows, n_kv_heads, 1, head_dim]`, each product rounded to x's dtype before it is rotated (as
/// the separate ops round it). A warp computes a rotation pair's two rows. Where the kernel takes
/// the product and [`ROPE_ENV`] is not `0`; None elsewhere.
pub fn qkv_rope(x: &Array, wt: Weight, rope: &QkvRope, norm: Option<Norm>) -> Result<Option<(Array, Array, Array)>> {
    if read(&ROPE_SWITCH) != ON || !rope_fits(x, wt, rope) {
        return Ok(None);
    }
    let (hd, hq, hkv) = (rope.head_dim, rope.n_heads, rope.n_kv_heads);
    let m = wt.rows_of(x) as i32;
    let shapes = [vec![m, hq, 1, hd], vec![m, hkv, 1, hd], vec![m, hkv, 1, hd]];
    let Some(out) = launch(x, wt, Kind::Rope(rope), norm, &shapes)? else { return Ok(None) };
    let mut it = out.into_iter();
    match (it.next(), it.next(), it.next()) {
        (Some(q), Some(k), Some(v)) => Ok(Some((q, k, v))),
        _ => Err(Error::Mlx("qkv_rope kernel: not three outputs".into())),
    }
}

/// Whether [`qkv_rope`]'s arguments agree: W's rows the heads' (q, k, v) of an even head_dim, one
/// position per row of x, head_dim / 2 float32 frequencies where given.
fn rope_fits(x: &Array, wt: Weight, rope: &QkvRope) -> bool {
    let (hd, hq, hkv) = (rope.head_dim, rope.n_heads, rope.n_kv_heads);
    hd > 0
        && hd % 2 == 0
        && wt.rows() == (hq + 2 * hkv) * hd
        && rope.positions.len() == wt.rows_of(x)
        && rope.freqs.is_none_or(|f| f.dtype() == Dtype::Float32 && f.size() == (hd / 2) as usize)
}

/// Turns [`qkv_rope`] off with `0` (the rotary embedding then runs as MLX's op after the product).
pub const ROPE_ENV: &str = "MLXRS_CUDA_QKV_ROPE";

static ROPE_SWITCH: AtomicU8 = AtomicU8::new(UNREAD);

/// The kernel a launch takes: [`SOURCE`] (float products of quantized W), [`SOURCE_Q8X`] (4-bit W
/// against x rounded to int8) or [`SOURCE_DENSE`] (16-bit W).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Float = 0,
    Q8x = 1,
    Dense = 2,
}

/// Which kernel takes `x · Wᵀ` (None: none does): dense W where [`DENSE_ENV`] is not `0`; quantized
/// W through [`int8_activations`]'s choice.
fn source_for(x: &Array, wt: Weight, state: u8) -> Option<Source> {
    if state == OFF || !wt.fits(x) {
        return None;
    }
    match wt {
        Weight::Dense(_) if read(&DENSE_SWITCH) != ON => None,
        Weight::Dense(_) => Some(Source::Dense),
        Weight::Quant(q) if int8_activations(x, q.q, state) => Some(Source::Q8x),
        Weight::Quant(_) => Some(Source::Float),
    }
}

/// One launch of a kernel ([`Source`] with `kind`'s epilogue and `norm`'s prologue) with outputs of
/// `shapes` in x's dtype: None where it does not take the product.
fn launch(x: &Array, wt: Weight, kind: Kind, norm: Option<Norm>, shapes: &[Vec<i32>]) -> Result<Option<Vec<Array>>> {
    let Some(src) = source_for(x, wt, state()) else { return Ok(None) };
    let (n, k) = (wt.rows(), wt.k());
    // the norm in the prologue: over a weight of x's dtype and K
    if let Some(nm) = norm {
        if read(&NORM_SWITCH) != ON
            || nm.weight.dtype() != x.dtype()
            || nm.weight.ndim() != 1
            || nm.weight.dim(0) != k
            || (src != Source::Q8x && x.size() > NORM_STAGE_MAX_VALUES)
        {
            return Ok(None);
        }
    }
    // one row a warp for the dense kernel's plain and residual products (more steps in flight)
    let (rows_per_warp, unroll) = match (src, kind) {
        (Source::Dense, Kind::Epilogue(Epilogue::Plain | Epilogue::Residual(_))) => (DENSE_ROWS_PER_WARP, DENSE_UNROLL),
        _ => (ROWS_PER_WARP, ""),
    };
    type Slot = OnceLock<std::result::Result<CudaKernel, String>>;
    // [float, int8 x, dense] × [plain, residual, swiglu, rope, rope with freqs] × [x, the norm of x]
    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = OnceLock::new();
    #[allow(clippy::declare_interior_mutable_const)]
    const ROW: [[Slot; 2]; 5] = [[EMPTY, EMPTY], [EMPTY, EMPTY], [EMPTY, EMPTY], [EMPTY, EMPTY], [EMPTY, EMPTY]];
    static KERNELS: [[[Slot; 2]; 5]; 3] = [ROW, ROW, ROW];
    let (body, stem, weight_inputs): (&str, &str, &[&str]) = match src {
        Source::Float => (SOURCE, "mlxrs_qmv", &["x", "w", "scales", "biases"]),
        Source::Q8x => (SOURCE_Q8X, "mlxrs_qmv_q8x", &["x", "w", "scales", "biases"]),
        Source::Dense => (SOURCE_DENSE, "mlxrs_mv", &["x", "w"]),
    };
    let (slot, extra, outputs, defines, suffix): (usize, &[&str], &[&str], &str, &str) = match kind {
        Kind::Epilogue(Epilogue::Plain) => (0, &[], &["y"], "", ""),
        Kind::Epilogue(Epilogue::Residual(_)) => {
            (1, &["res"], &["y"], "#define MLXRS_RES(i) static_cast<float>(res[i])\n", "_res")
        }
        Kind::Epilogue(Epilogue::SwiGlu) => (2, &[], &["y"], "#define MLXRS_SWIGLU\n", "_swiglu"),
        Kind::Rope(QkvRope { freqs: None, .. }) => {
            (3, &["pos"], &["q_out", "k_out", "v_out"], "#define MLXRS_ROPE\n", "_rope")
        }
        Kind::Rope(QkvRope { freqs: Some(_), .. }) => (
            4,
            &["pos", "freqs"],
            &["q_out", "k_out", "v_out"],
            "#define MLXRS_ROPE\n#define MLXRS_FREQS\n",
            "_rope_freqs",
        ),
    };
    let kern = KERNELS[src as usize][slot][norm.is_some() as usize]
        .get_or_init(|| {
            let mut inputs = [weight_inputs, extra].concat();
            let (mut defines, mut name) = (format!("{defines}{unroll}"), format!("{stem}{suffix}"));
            if norm.is_some() {
                inputs.push("nw");
                defines.push_str("#define MLXRS_NORM\n");
                name.push_str("_norm");
            }
            // the dense and float kernels read the normed x from shared memory (NORM_STAGE), the int8
            // one normalizes as it rounds x
            let stage = if src == Source::Q8x { "" } else { NORM_STAGE };
            let source = format!("{NORM_PROLOGUE}{stage}{body}");
            CudaKernel::new(&name, &inputs, outputs, &source, &format!("{defines}{HEADER}"), true)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let m = wt.rows_of(x) as i32;
    // a warp per rows_per_warp rows of W; with the SwiGLU epilogue a warp per output (its gate and up
    // rows), with the rotary one a warp per rotation pair (or two rows of v)
    let warps = match kind {
        Kind::Epilogue(Epilogue::SwiGlu) | Kind::Rope(_) => n / 2,
        Kind::Epilogue(_) => (n + rows_per_warp - 1) / rows_per_warp,
    };
    let mut template = vec![
        ("T", TemplateArg::Dtype(x.dtype())),
        ("M", TemplateArg::Int(m)),
        ("K", TemplateArg::Int(k)),
        ("N", TemplateArg::Int(n)),
        ("R", TemplateArg::Int(rows_per_warp)),
    ];
    let mut args = vec![x];
    match wt {
        Weight::Quant(QWeight { w, scales, biases: Some(biases), q }) => {
            args.extend([w, scales, biases]);
            template.extend([("GS", TemplateArg::Int(q.group_size)), ("BITS", TemplateArg::Int(q.bits))]);
        }
        Weight::Quant(QWeight { biases: None, .. }) => return Ok(None), // (fits says no first)
        Weight::Dense(w) => args.push(w),
    }
    let positions = match kind {
        Kind::Rope(r) => Some(positions_input(r.positions, m, read(&TABLE_SWITCH) == ON)?),
        Kind::Epilogue(_) => None,
    };
    match kind {
        Kind::Epilogue(Epilogue::Residual(r)) => args.push(r),
        Kind::Epilogue(_) => {}
        Kind::Rope(r) => {
            args.extend(positions.as_ref());
            if let Some(f) = r.freqs {
                args.push(f);
            }
            // floats as their bits (template arguments are integers): MLX's rope takes log2(base)
            template.extend([
                ("HD", TemplateArg::Int(r.head_dim)),
                ("QR", TemplateArg::Int(r.n_heads * r.head_dim)),
                ("KR", TemplateArg::Int(r.n_kv_heads * r.head_dim)),
                ("TRAD", TemplateArg::Int(r.traditional as i32)),
                ("SCALE_BITS", TemplateArg::Int(r.scale.to_bits() as i32)),
                ("LOG2B_BITS", TemplateArg::Int(r.base.log2().to_bits() as i32)),
            ]);
        }
    }
    if let Some(nm) = norm {
        args.push(nm.weight);
        template.push(("EPS_BITS", TemplateArg::Int(nm.eps.to_bits() as i32)));
    }
    let outs: Vec<(&[i32], Dtype)> = shapes.iter().map(|s| (s.as_slice(), x.dtype())).collect();
    let out = kern.apply(&args, &outs, (warps * 32, 1, 1), (256, 1, 1), &template)?;
    if out.len() != shapes.len() {
        return Err(Error::Mlx(format!("qmv kernel: {} outputs, not {}", out.len(), shapes.len())));
    }
    Ok(Some(out))
}

/// Every kernel's prologue: where `MLXRS_NORM` is defined, x is the input of an RMSNorm (weight `nw`,
/// epsilon `EPS_BITS`) whose output the product takes: the block first finds each row's 1/rms, and
/// `MLXRS_XN(m, k, f)` turns x's value f at row m, column k into what MLX's `rms_norm` writes there;
/// otherwise `MLXRS_XN` is f.
const NORM_PROLOGUE: &str = r#"
#ifdef MLXRS_NORM
    // x is the norm's input: each row's 1/rms first (MLX's rms_norm: rsqrt(mean(x^2) + eps)), then each
    // value as rms_norm writes it, nw * T(x / rms), before it is rounded to int8
    __shared__ float xinv[M];
    __shared__ float part[M * 32];
    {
        float ss[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) ss[m] = 0.f;
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const uint4 raw = reinterpret_cast<const uint4*>(x + (size_t)m * K)[i];
                const T* e = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int u = 0; u < 8; ++u) { const float f = static_cast<float>(e[u]); ss[m] += f * f; }
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float t = ss[m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
            if ((threadIdx.x & 31u) == 0) part[m * 32 + (threadIdx.x >> 5)] = t;
        }
        __syncthreads();
        if (threadIdx.x < M) {
            float t = 0.f;
            for (unsigned w_ = 0; w_ < (blockDim.x + 31) / 32; ++w_) t += part[threadIdx.x * 32 + w_];
            xinv[threadIdx.x] = rsqrt(t / K + __int_as_float(EPS_BITS));
        }
        __syncthreads();
    }
#define MLXRS_XN(m, k, f) static_cast<float>(nw[k] * static_cast<T>((f) * xinv[m]))
#else
#define MLXRS_XN(m, k, f) (f)
#endif
"#;

/// After [`NORM_PROLOGUE`] in the dense and float kernels: where `MLXRS_NORM` is defined, the block
/// writes the normed x (each value as MLX's `rms_norm` writes it) to shared memory once, and
/// `MLXRS_X(m)` is where the product reads row m of x from (there, or x itself). Measured on the
/// H200: normalizing each value where the product reads it instead cost an 8B step's matvecs 27% more
/// GPU time (`bench/dense_mv_variants.py --profile`, `engine_norm`).
const NORM_STAGE: &str = r#"
#ifdef MLXRS_NORM
    __shared__ __align__(16) T xn_[M * K];
    for (int i = threadIdx.x; i < M * K / 8; i += blockDim.x) {
        const int m = i / (K / 8), k0 = 8 * (i % (K / 8));
        const uint4 raw = reinterpret_cast<const uint4*>(x)[i];
        const T* e = reinterpret_cast<const T*>(&raw);
        uint4 o;
        T* oe = reinterpret_cast<T*>(&o);
        #pragma unroll
        for (int u = 0; u < 8; ++u) oe[u] = static_cast<T>(MLXRS_XN(m, k0 + u, static_cast<float>(e[u])));
        reinterpret_cast<uint4*>(xn_)[i] = o;
    }
    __syncthreads();
#define MLXRS_X(m) (xn_ + (size_t)(m) * K)
#else
#define MLXRS_X(m) (x + (size_t)(m) * K)
#endif
"#;

/// What the kernels share, ahead of the kernel function: which rows of W a warp reads and how a
/// warp's sums are written (`MLXRS_SWIGLU`: a warp per output, reading its gate row and its up row
/// `N/2` further; otherwise `R` consecutive rows, plus `MLXRS_RES(i)`, the residual where defined);
/// the warp's rows and accumulators (`MLXRS_WARP_ROWS`), one 16-byte read of each row with its group's
/// scale and bias (`MLXRS_READ_ROWS`), and the warp's sums reduced and stored (`MLXRS_SUM_STORE`).
const HEADER: &str = r#"
#define MLXRS_WARP_ROWS \
    const unsigned first = MLXRS_FIRST((blockIdx.x * blockDim.x + threadIdx.x) >> 5); \
    if (first >= (unsigned)MLXRS_OUTS) return; \
    float acc[R][M]; \
    _Pragma("unroll") \
    for (int r = 0; r < R; ++r) \
        _Pragma("unroll") \
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f; \
    const uint4* wbase = reinterpret_cast<const uint4*>(w);
#define MLXRS_READ_ROWS(i, k0) \
    uint4 q[R]; \
    float s[R], b[R]; \
    _Pragma("unroll") \
    for (int r = 0; r < R; ++r) { \
        const unsigned row = MLXRS_ROW(first, r); \
        q[r] = wbase[(size_t)row * (WPR / 4) + (i)]; \
        s[r] = static_cast<float>(scales[(size_t)row * NG + (k0) / GS]); \
        b[r] = static_cast<float>(biases[(size_t)row * NG + (k0) / GS]); \
    }
#define MLXRS_SUM_STORE \
    _Pragma("unroll") \
    for (int m = 0; m < M; ++m) { \
        float v[R]; \
        _Pragma("unroll") \
        for (int r = 0; r < R; ++r) { \
            v[r] = acc[r][m]; \
            _Pragma("unroll") \
            for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o); \
        } \
        if (lane == 0) MLXRS_STORE(m, first, v); \
    }
#ifndef MLXRS_RES
#define MLXRS_RES(i) 0.f
#endif
#define MLXRS_STR(x) #x
#define MLXRS_UNROLL(n) _Pragma(MLXRS_STR(unroll n))
#ifndef MLXRS_DENSE_UNROLL
#define MLXRS_DENSE_UNROLL 4
#endif
__device__ __forceinline__ uint4 mlxrs_ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
#ifndef MLXRS_LDW
#define MLXRS_LDW(p) (*(p))
#endif
#ifdef MLXRS_SWIGLU
#define MLXRS_OUTS (N / 2)
#define MLXRS_FIRST(warp) (warp)
#define MLXRS_ROW(first, r) ((first) + (unsigned)(r) * (unsigned)(N / 2))
#define MLXRS_STORE(m, first, v) { \
    const float g_ = static_cast<float>(static_cast<T>(v[0])), u_ = static_cast<float>(static_cast<T>(v[1])); \
    y[(size_t)(m) * (N / 2) + (first)] = static_cast<T>(g_ / (1.f + __expf(-g_)) * u_); }
#elif defined(MLXRS_ROPE)
// a warp per two rows: a rotation pair of a q or k head (rows j and j + HD/2 of the head; TRAD: 2j and
// 2j + 1), or two consecutive rows of v; QR, KR: q's and k's rows (outputs q_out, k_out, v_out: `v` is
// MLXRS_SUM_STORE's sums). Each sum rounded to T, then
// rotated as MLX's rope_single does: theta = (scale * position) * inv_freq, inv_freq = 2^(-j/(HD/2)
// * log2(base)) or 1 / freqs[j]
#define MLXRS_OUTS (N / 2)
#define MLXRS_FIRST(warp) (warp)
#define MLXRS_ROW(w, r) ((!TRAD && 2u * (w) < (unsigned)(QR + KR)) \
    ? (2u * (w) / HD) * HD + (2u * (w) % HD) / 2 + (unsigned)(r) * (unsigned)(HD / 2) : 2u * (w) + (unsigned)(r))
#ifdef MLXRS_FREQS
#define MLXRS_INV_FREQ(j) static_cast<float>(1.0 / freqs[j])
#else
#define MLXRS_INV_FREQ(j) exp2(-(static_cast<float>(j) / static_cast<float>(HD / 2)) * __int_as_float(LOG2B_BITS))
#endif
#define MLXRS_STORE(m, w, v) { \
    const unsigned b_ = 2u * (w); \
    const float x1_ = static_cast<float>(static_cast<T>(v[0])), x2_ = static_cast<float>(static_cast<T>(v[1])); \
    if (b_ < (unsigned)(QR + KR)) { \
        const unsigned h_ = b_ / HD, j_ = (b_ % HD) / 2; \
        const float th_ = (__int_as_float(SCALE_BITS) * static_cast<float>(pos[m])) * MLXRS_INV_FREQ(j_); \
        const float c_ = cos(th_), s_ = sin(th_); \
        T* o_ = b_ < (unsigned)QR ? q_out + (size_t)(m) * QR + h_ * HD : k_out + (size_t)(m) * KR + (h_ - QR / HD) * HD; \
        o_[TRAD ? 2 * j_ : j_] = static_cast<T>(x1_ * c_ - x2_ * s_); \
        o_[TRAD ? 2 * j_ + 1 : j_ + HD / 2] = static_cast<T>(x1_ * s_ + x2_ * c_); \
    } else { \
        T* o_ = v_out + (size_t)(m) * KR + (b_ - QR - KR); \
        o_[0] = static_cast<T>(x1_); \
        o_[1] = static_cast<T>(x2_); \
    } }
#else
#define MLXRS_OUTS N
#define MLXRS_FIRST(warp) ((warp) * R)
#define MLXRS_ROW(first, r) min((first) + (unsigned)(r), (unsigned)N - 1u)
#define MLXRS_STORE(m, first, v) \
    for (int r_ = 0; r_ < R; ++r_) if ((first) + r_ < (unsigned)N) { \
        const size_t i_ = (size_t)(m) * N + (first) + r_; y[i_] = static_cast<T>(v[r_] + MLXRS_RES(i_)); }
#endif
"#;

/// `y[m, n] = Σ_k x[m, k] · (scale[n, g] · q[n, k] + bias[n, g])`, g = k / GS (MLX's affine mode);
/// bench/qmv_kernel_dev.py and bench/qmv_variants.py read this text from here to check and time it on
/// the device.
const SOURCE: &str = r#"
    // rows read and results written through HEADER's MLXRS_FIRST / MLXRS_ROW / MLXRS_STORE
    // y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]),  g = k / GS (MLX's affine mode).
    // Per 16-byte read of a row (VPU4 values of one group): the dot of q with x, times the scale, plus
    // the bias times the sum of x. x is converted 8 values at a time (few registers: occupancy).
    // 4-bit: four shifts of a packed word bring each nibble to bits 12-15 or 16-19 of a float whose
    // exponent is 1's, so a mask-or alone makes it 1 + q/2048 (class B) or 1 + q/128 (class A); the dot
    // is then 128 (sum_A x (1 + q/128) - sum_A x) + 2048 (sum_B ... - sum_B x). 8-bit: q as the float
    // 2^23 + q through its bits, minus 2^23.
    constexpr int PER_U32 = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int WPR = K / PER_U32;            // packed uint32 per weight row
    constexpr int VPU4 = 4 * PER_U32;           // values per 16-byte read
    constexpr int NG = K / GS;                  // groups per row
    const unsigned lane = threadIdx.x & 31u;
    MLXRS_WARP_ROWS
    #pragma unroll 2
    for (int i = lane; i < WPR / 4; i += 32) {
        const int k0 = i * VPU4;
        MLXRS_READ_ROWS(i, k0)
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xv4 = reinterpret_cast<const uint4*>(MLXRS_X(m) + k0);
            float xs = 0.f, xa = 0.f;   // sum of x; (4-bit) over class A
            float da[R], db[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) { da[r] = 0.f; db[r] = 0.f; }
            #pragma unroll
            for (int c = 0; c < VPU4 / 8; ++c) {
                const uint4 xr = xv4[c];
                const T* xe = reinterpret_cast<const T*>(&xr);
                float xf[8];
                #pragma unroll
                for (int t = 0; t < 8; ++t) { xf[t] = static_cast<float>(xe[t]); xs += xf[t]; }
                if (BITS == 4) xa += xf[0] + xf[2] + xf[4] + xf[6] + xf[7];
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned qs[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                    if (BITS == 4) {
                        // nibble t at bits 4t..4t+3: A = {0, 2, 4, 6, 7} to bits 16-19, B = {1, 3, 5} to 12-15
                        const unsigned w0 = qs[c & 3], l8 = w0 << 8, r8 = w0 >> 8, l16 = w0 << 16, r12 = w0 >> 12;
                        float a = da[r], bb = db[r];
                        a = fmaf(xf[0], __uint_as_float((l16 & 0x000F0000u) | 0x3F800000u), a);
                        bb = fmaf(xf[1], __uint_as_float((l8 & 0x0000F000u) | 0x3F800000u), bb);
                        a = fmaf(xf[2], __uint_as_float((l8 & 0x000F0000u) | 0x3F800000u), a);
                        bb = fmaf(xf[3], __uint_as_float((w0 & 0x0000F000u) | 0x3F800000u), bb);
                        a = fmaf(xf[4], __uint_as_float((w0 & 0x000F0000u) | 0x3F800000u), a);
                        bb = fmaf(xf[5], __uint_as_float((r8 & 0x0000F000u) | 0x3F800000u), bb);
                        a = fmaf(xf[6], __uint_as_float((r8 & 0x000F0000u) | 0x3F800000u), a);
                        a = fmaf(xf[7], __uint_as_float((r12 & 0x000F0000u) | 0x3F800000u), a);
                        da[r] = a;
                        db[r] = bb;
                    } else {
                        // 8 x values: two words of four bytes
                        #pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const unsigned wv = qs[(2 * c + h) & 3];
                            #pragma unroll
                            for (int t = 0; t < 4; ++t) {
                                const float qf = __uint_as_float(((wv >> (8 * t)) & MASK) | 0x4B000000u) - 8388608.f;
                                da[r] = fmaf(xf[4 * h + t], qf, da[r]);
                            }
                        }
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const float dot = BITS == 4 ? 128.f * (da[r] - xa) + 2048.f * (db[r] - (xs - xa)) : da[r];
                acc[r][m] = fmaf(s[r], dot, fmaf(b[r], xs, acc[r][m]));
            }
        }
    }
    MLXRS_SUM_STORE
"#;

/// The same product for 4-bit weights with x rounded to int8 on the way (llama.cpp's mmvq does the
/// same with its q8_1 blocks): the block's threads first round x to int8 per 16-byte read's worth of
/// values (32), a thread per block of x, into shared memory with the scale d = max|x|/127 and d·Σq_x;
/// then each packed word is two `dp4a` (the low and high nibbles masked into bytes, against x stored as
/// [x0 x2 x4 x6 | x1 x3 x5 x7] per eight), one integer dot I per read and row, and d·(s·I + b·Σq_x) in
/// float: the dequantized weights against the rounded x, so the rounding's error is Σ w·e, not
/// Σ (w − b)·e. Three times fewer instructions a weight than [`SOURCE`]: on the H200 an 8B 4-bit step's
/// matvecs 1.77 instead of 2.39 ms, at 0.5–0.6% of max |y| against the float kernel's 0.3% and MLX's
/// 0.35–0.67% (bench/RESULTS-gpu.md). Also written for 8-bit, where it is no faster and not used.
const SOURCE_Q8X: &str = r#"
    constexpr int PER_U32 = 32 / BITS;
    constexpr int WPR = K / PER_U32;            // packed uint32 per weight row
    constexpr int VPU4 = 4 * PER_U32;           // values per 16-byte read = one x block
    constexpr int NB = K / VPU4;                // x blocks per row of x
    constexpr int NG = K / GS;
    __shared__ __align__(16) int xq[M * K / 4];
    __shared__ float xd[M * NB];
    __shared__ float xsum[M * NB];
    const unsigned lane = threadIdx.x & 31u;
    // one thread per x block: its values converted, max |x|, rounded to int8 (4-bit: stored as
    // [x0 x2 x4 x6 | x1 x3 x5 x7] per eight), the scale d and d * (sum of the int8 values), so that the
    // dequantized weights meet the rounded x throughout: y = sum_blocks d (s I + b sum q_x)
    for (int bi = threadIdx.x; bi < M * NB; bi += blockDim.x) {
        const int m = bi / NB, blk = bi % NB;
        const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * K + blk * VPU4);
        float v[VPU4];
        float amax = 0.f;
        #pragma unroll
        for (int c = 0; c < VPU4 / 8; ++c) {
            const uint4 raw = src[c];
            const T* e = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
                v[8 * c + u] = MLXRS_XN(m, blk * VPU4 + 8 * c + u, static_cast<float>(e[u]));
                amax = fmaxf(amax, fabsf(v[8 * c + u]));
            }
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int packed[VPU4 / 4];
        #pragma unroll
        for (int u = 0; u < VPU4 / 4; ++u) packed[u] = 0;
        int qsum = 0;
        #pragma unroll
        for (int e = 0; e < VPU4; ++e) {
            const int qv = __float2int_rn(v[e] * inv);
            qsum += qv;
            const int te = e & 7;
            const int pos = BITS == 4 ? (e & ~7) | ((te & 1) ? 4 + (te >> 1) : (te >> 1)) : e;
            packed[pos >> 2] |= (qv & 0xff) << (8 * (pos & 3));
        }
        int4* dst = reinterpret_cast<int4*>(xq + ((size_t)m * K + blk * VPU4) / 4);
        #pragma unroll
        for (int c = 0; c < VPU4 / 16; ++c) dst[c] = make_int4(packed[4 * c], packed[4 * c + 1], packed[4 * c + 2], packed[4 * c + 3]);
        xd[bi] = amax * (1.f / 127.f);
        xsum[bi] = amax * (1.f / 127.f) * (float)qsum;
    }
    __syncthreads();
    MLXRS_WARP_ROWS
    #pragma unroll 2
    for (int i = lane; i < WPR / 4; i += 32) {
        const int k0 = i * VPU4;
        MLXRS_READ_ROWS(i, k0)
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const int4* xv = reinterpret_cast<const int4*>(xq + ((size_t)m * K + k0) / 4);
            int xw[VPU4 / 4];
            #pragma unroll
            for (int c = 0; c < VPU4 / 16; ++c) {
                const int4 t = xv[c];
                xw[4 * c] = t.x; xw[4 * c + 1] = t.y; xw[4 * c + 2] = t.z; xw[4 * c + 3] = t.w;
            }
            const float d = xd[m * NB + i], xs = xsum[m * NB + i];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned qs[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                int dot = 0;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (BITS == 4) {
                        const unsigned lo = qs[j] & 0x0F0F0F0Fu, hi = (qs[j] >> 4) & 0x0F0F0F0Fu;
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(lo), "r"(xw[2 * j]));
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(hi), "r"(xw[2 * j + 1]));
                    } else {
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(qs[j]), "r"(xw[j]));
                    }
                }
                acc[r][m] = fmaf(s[r] * d, (float)dot, fmaf(b[r], xs, acc[r][m]));
            }
        }
    }
    MLXRS_SUM_STORE
"#;

/// `y[m, n] = Σ_k x[m, k] · w[n, k]` for dense 16-bit W of x's dtype ([`Weight::Dense`]), float32
/// sums: each lane reads 16 bytes (8 values) of each of its warp's R rows per step, several steps in
/// flight (`MLXRS_DENSE_UNROLL`; `MLXRS_LDW` the load, bench/dense_mv_variants.py's variants). The
/// same rows, prologue and epilogues as the quantized kernels (HEADER): a decode
/// step's dense projections, norms, rotary embeddings, SwiGLU and residual adds in 4 kernels a layer.
const SOURCE_DENSE: &str = r#"
    constexpr int RD = K / 8;                   // 16-byte reads per row of W
    const unsigned lane = threadIdx.x & 31u;
    MLXRS_WARP_ROWS
    MLXRS_UNROLL(MLXRS_DENSE_UNROLL)
    for (int i = lane; i < RD; i += 32) {
        uint4 wv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = MLXRS_LDW(wbase + (size_t)MLXRS_ROW(first, r) * RD + i);
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4 xr = reinterpret_cast<const uint4*>(MLXRS_X(m))[i];
            const T* xe = reinterpret_cast<const T*>(&xr);
            float xf[8];
            #pragma unroll
            for (int t = 0; t < 8; ++t) xf[t] = static_cast<float>(xe[t]);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const T* we = reinterpret_cast<const T*>(&wv[r]);
                #pragma unroll
                for (int t = 0; t < 8; ++t) acc[r][m] = fmaf(xf[t], static_cast<float>(we[t]), acc[r][m]);
            }
        }
    }
    MLXRS_SUM_STORE
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(shape: &[i32], dtype: Dtype) -> Array {
        mx::zeros(shape, dtype).unwrap()
    }

    /// The text MLX rebuilds and hashes per call ([`crate::handle::kernel::compact`]): a fifth or more
    /// shorter than the commented source.
    #[test]
    fn the_kernels_text_is_compacted() {
        for src in [SOURCE, SOURCE_Q8X, SOURCE_DENSE] {
            let full = format!("#define MLXRS_ROPE\n{HEADER}{NORM_PROLOGUE}{NORM_STAGE}{src}");
            let short = crate::handle::kernel::compact(&full);
            assert!(short.len() * 5 < full.len() * 4, "{} of {}", short.len(), full.len());
            assert!(short.contains("MLXRS_SUM_STORE") && !short.contains("//"));
        }
    }

    /// The products the kernel is given: decode rows of bf16/f16 against affine 4/8-bit weights with
    /// biases; not prefill chunks, float32 x, other bit widths or modes, groups a read would cross,
    /// or no biases. (The kernel itself runs on CUDA only: bench/qmv_check.py on the device.)
    #[test]
    fn fits_decode_rows_of_affine_4_and_8_bit() {
        let (w4, w8) = (arr(&[256, 4096 / 8], Dtype::Uint32), arr(&[256, 4096 / 4], Dtype::Uint32));
        let b = arr(&[256, 64], Dtype::Bfloat16);
        let q4 = QuantSpec::affine(64, 4);
        let q8 = QuantSpec::affine(64, 8);
        for rows in 1..=MAX_ROWS as i32 {
            let x = arr(&[1, rows, 4096], Dtype::Bfloat16);
            assert!(fits(&x, &w4, Some(&b), q4), "{rows} rows, 4-bit");
            assert!(fits(&x, &w8, Some(&b), q8), "{rows} rows, 8-bit");
        }
        assert!(fits(&arr(&[2, 4096], Dtype::Float16), &w4, Some(&b), q4));
        assert!(!fits(&arr(&[1, 5, 4096], Dtype::Bfloat16), &w4, Some(&b), q4), "a prefill chunk");
        assert!(!fits(&arr(&[1, 1, 4096], Dtype::Float32), &w4, Some(&b), q4), "float32 x");
        assert!(!fits(&arr(&[1, 1, 4096], Dtype::Bfloat16), &w4, None, q4), "no biases");
        let x = arr(&[1, 1, 4096], Dtype::Bfloat16);
        assert!(!fits(&x, &w4, Some(&b), QuantSpec::affine(16, 4)), "a 16-value group inside a 32-value read");
        assert!(!fits(&x, &arr(&[256, 4096 * 3 / 32], Dtype::Uint32), Some(&b), QuantSpec::affine(64, 3)));
        assert!(!fits(&x, &w8, Some(&b), q4), "packed width not the 4-bit one");
        let mut mx4 = q4;
        mx4.mode = QuantMode::Mxfp4;
        assert!(!fits(&x, &w4, Some(&b), mx4), "microscaling modes keep MLX's kernel");
        // x in any shape of rows × K values (the attention's heads straight into the output projection)
        assert!(fits(&arr(&[1, 32, 1, 128], Dtype::Bfloat16), &w4, Some(&b), q4));
        assert!(!fits(&arr(&[1, 32, 1, 127], Dtype::Bfloat16), &w4, Some(&b), q4), "not whole rows of K");
        // a residual of another shape or dtype than the product's is never fused, a shape of another
        // size never taken, nor a SwiGLU over an odd number of rows (any backend)
        let qw = QWeight { w: &w4, scales: &b, biases: Some(&b), q: q4 };
        let wt = Weight::Quant(qw);
        for res in
            [arr(&[1, 1, 255], Dtype::Bfloat16), arr(&[1, 256], Dtype::Bfloat16), arr(&[1, 1, 256], Dtype::Float16)]
        {
            let r = qmv(&x, wt, Epilogue::Residual(&res), None, None).unwrap();
            assert!(r.is_none(), "{:?}", res.shape());
        }
        assert!(qmv(&x, wt, Epilogue::Plain, None, Some(&[1, 2, 64])).unwrap().is_none());
        let odd = arr(&[255, 4096 / 8], Dtype::Uint32);
        assert!(qmv(&x, QWeight { w: &odd, ..qw }.into(), Epilogue::SwiGlu, None, None).unwrap().is_none());
        // heads-shaped x without a shape for the result: nothing to infer it from
        let heads = arr(&[1, 32, 1, 128], Dtype::Bfloat16);
        assert!(qmv(&heads, wt, Epilogue::Plain, None, None).unwrap().is_none());
        // the rotary epilogue: W's rows must be the heads' (q, k, v), one position per row of x (an
        // int32 slice: float positions do not type-check), head_dim / 2 float32 frequencies where
        // given (any backend)
        let (f32s, f16s) = (arr(&[32], Dtype::Float32), arr(&[32], Dtype::Float16));
        let rope = QkvRope {
            positions: &[5],
            freqs: None,
            base: 10000.0,
            scale: 1.0,
            traditional: false,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64, // (2 + 2·1) · 64 = W's 256 rows
        };
        assert!(rope_fits(&x, wt, &rope) && rope_fits(&x, wt, &QkvRope { freqs: Some(&f32s), ..rope }));
        let short = arr(&[16], Dtype::Float32);
        for (why, bad) in [
            ("rows not the heads'", QkvRope { n_heads: 3, ..rope }),
            ("two positions for one row", QkvRope { positions: &[5, 6], ..rope }),
            ("no position", QkvRope { positions: &[], ..rope }),
            ("16 frequencies for 32 pairs", QkvRope { freqs: Some(&short), ..rope }),
            ("float16 frequencies", QkvRope { freqs: Some(&f16s), ..rope }),
            ("an odd head_dim", QkvRope { head_dim: 1, n_heads: 254, n_kv_heads: 1, ..rope }),
        ] {
            assert!(!rope_fits(&x, wt, &bad), "{why}");
            assert!(qkv_rope(&x, wt, &bad, None).unwrap().is_none(), "{why}");
        }
        // dense W: 1 to MAX_ROWS rows of x in W's own 16-bit dtype, rows of whole 16-byte reads; the
        // rotary epilogue's checks as for quantized W
        let wd = arr(&[256, 4096], Dtype::Bfloat16);
        let dense = Weight::Dense(&wd);
        for rows in 1..=MAX_ROWS as i32 {
            assert!(dense.fits(&arr(&[rows, 1, 4096], Dtype::Bfloat16)), "{rows} rows, dense");
        }
        assert!(dense.fits(&heads) && (dense.rows(), dense.k()) == (256, 4096));
        for (why, bad) in [
            ("a prefill chunk", arr(&[1, 5, 4096], Dtype::Bfloat16)),
            ("x in float16 against bf16 W", arr(&[1, 1, 4096], Dtype::Float16)),
            ("float32 x", arr(&[1, 1, 4096], Dtype::Float32)),
            ("not whole rows of K", arr(&[1, 1, 4000], Dtype::Bfloat16)),
        ] {
            assert!(!dense.fits(&bad), "{why}");
        }
        let odd_k = arr(&[256, 4092], Dtype::Bfloat16);
        assert!(!Weight::Dense(&odd_k).fits(&arr(&[1, 4092], Dtype::Bfloat16)), "a row not of 16-byte reads");
        let w32 = arr(&[256, 4096], Dtype::Float32);
        assert!(!Weight::Dense(&w32).fits(&arr(&[1, 4096], Dtype::Float32)), "float32 W: MLX's matmul");
        assert!(rope_fits(&x, dense, &rope) && !rope_fits(&x, dense, &QkvRope { n_heads: 3, ..rope }));
        // 4-bit x of up to Q8X_MAX_VALUES values takes the int8-activation kernel when on, not `float`;
        // 8-bit never
        let big = arr(&[1, 8, 4096 + 512], Dtype::Bfloat16);
        assert!(int8_activations(&x, q4, ON) && !int8_activations(&x, q4, FLOAT) && !int8_activations(&x, q8, ON));
        assert!(!int8_activations(&big, q4, ON), "{} values", big.size());
        // on the CPU the kernel is never taken
        if crate::plan::Backend::detect() == crate::plan::Backend::Cpu {
            assert_eq!(state(), OFF);
            let res = arr(&[1, 1, 256], Dtype::Bfloat16);
            let nw = arr(&[4096], Dtype::Bfloat16);
            let norm = Norm { weight: &nw, eps: 1e-5 };
            for e in [Epilogue::Plain, Epilogue::Residual(&res), Epilogue::SwiGlu] {
                assert!(qmv(&x, wt, e, None, None).unwrap().is_none());
                assert!(qmv(&x, wt, e, Some(norm), None).unwrap().is_none());
            }
            assert!(qmv(&heads, wt, Epilogue::Plain, None, Some(&[1, 1, 256])).unwrap().is_none());
            assert!(qkv_rope(&x, wt, &rope, None).unwrap().is_none());
            assert!(qkv_rope(&x, wt, &rope, Some(norm)).unwrap().is_none());
            assert!(qmv(&x, dense, Epilogue::Plain, Some(norm), None).unwrap().is_none());
            assert!(qkv_rope(&x, dense, &rope, None).unwrap().is_none());
        }
    }

    /// The rotary kernel's positions: consecutive ones a view into the device table (grown past its
    /// length on demand), others (a batch's rows at their own offsets) gathered from it, the switch
    /// off an array of host data; the values either way are the positions; a count other than the
    /// rows' refused.
    #[test]
    fn positions_are_the_table_s_view_or_host_data() {
        let vals = |a: &Array| a.to_vec::<i32>().unwrap();
        for table in [true, false] {
            for ps in [vec![0], vec![700], vec![5, 6, 7, 8], vec![9000, 9001], vec![3, 9], vec![4, 4]] {
                // asked twice in a row (two layers of one step): the same array, then the right values
                // again for the next positions
                let a = positions_input(&ps, ps.len() as i32, table).unwrap();
                let again = positions_input(&ps, ps.len() as i32, table).unwrap();
                assert_eq!((a.shape(), vals(&a)), (vec![ps.len() as i32], ps.clone()));
                assert_eq!((again.shape(), vals(&again)), (vec![ps.len() as i32], ps.clone()));
            }
            // the other mode's array for the same positions is not the kept one
            assert_eq!(vals(&positions_input(&[4, 4], 2, !table).unwrap()), vec![4, 4]);
            assert_eq!(vals(&positions_input(&[4, 5], 2, table).unwrap()), vec![4, 5]);
            assert!(positions_input(&[1, 2], 3, table).is_err());
        }
        // the table outgrew 4096 for 9001 positions: the next power of two
        assert_eq!(position_table(1).unwrap().size(), 16384);
        assert_eq!(
            vals(&mx::slice(&position_table(20000).unwrap(), &[19998], &[20000], &[1]).unwrap()),
            vec![19998, 19999]
        );
    }
}
