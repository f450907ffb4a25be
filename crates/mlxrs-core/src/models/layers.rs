//! Building blocks shared by the architectures: linear (dense or MLX-quantized), embedding,
//! RMSNorm, rotary embedding, attention over an external KV cache, gated MLPs.
pub use super::experts::{ExpertStore, StreamedExperts};
use super::qmv::Epilogue;
use crate::cache::{Fetched, LayerCache, LayerCaches, Mask, Masks};
use crate::error::Result;
use crate::handle::{self as mx, Array, AttnMask, Dtype};
use crate::weights::{Matrix, QuantSpec, Weights};

/// `y = x W^T + b`, W dense or quantized.
pub enum Linear {
    /// `wt` is `W^T`, a view of W's buffer made once at load (no copy): the matmul sees the same
    /// strides as with a per-call transpose, without one more graph node per call.
    /// `host`: the weights' own blocks for the CPU's decode steps ([`HostBlocks`]), where an import
    /// kept them.
    Dense {
        w: Array,
        wt: Array,
        b: Option<Array>,
        host: Option<Box<HostBlocks>>,
    },
    Quant {
        w: Array,
        scales: Array,
        biases: Option<Array>,
        b: Option<Array>,
        q: QuantSpec,
    },
    /// A base with LoRA/DoRA adapters beside it, added at run time (`crate::lora`).
    Lora(Box<crate::lora::LoraLinear>),
}

impl Linear {
    /// `{prefix}.weight` `[out, inp]` (and `{prefix}.bias` `[out]`), shapes checked.
    pub fn load(ws: &mut Weights, prefix: &str, bias: bool, out: i32, inp: i32) -> Result<Linear> {
        let bname = format!("{prefix}.bias");
        let b = if bias || ws.contains(&bname) { Some(ws.take_shaped(&bname, &[out])?) } else { None };
        let host = HostBlocks::take(ws, prefix, out, inp)?.map(Box::new);
        let base = match ws.take_matrix(prefix, out, inp)? {
            Matrix::Quant { w, scales, biases, q } => Linear::Quant { w, scales, biases, b, q },
            Matrix::Dense(w) => Linear::Dense { wt: mx::transpose(&w)?, w, b, host },
        };
        match ws.lora() {
            Some(reg) => reg.apply(prefix, base, out, inp),
            None => Ok(base),
        }
    }

    /// The same linear without its bias, and the bias.
    pub fn without_bias(self) -> (Linear, Option<Array>) {
        match self {
            Linear::Dense { w, wt, b, host } => (Linear::Dense { w, wt, b: None, host }, b),
            Linear::Quant { w, scales, biases, b, q } => (Linear::Quant { w, scales, biases, b: None, q }, b),
            Linear::Lora(l) => (Linear::Lora(l), None),
        }
    }

    /// Whether [`Linear::concat`] can stack these: all dense or all quantized alike (one
    /// [`QuantSpec`], dtypes and the presence of quantization biases equal), one input width, a bias
    /// on all or none, no adapter.
    fn stackable(parts: &[Linear]) -> bool {
        type Key = (bool, Dtype, i32, Option<QuantSpec>, Option<Dtype>, Option<Option<Dtype>>, Option<Dtype>);
        let key = |l: &Linear| -> Option<Key> {
            match l {
                Linear::Dense { w, b, .. } => {
                    Some((true, w.dtype(), w.dim(1), None, None, None, b.as_ref().map(Array::dtype)))
                }
                Linear::Quant { w, scales, biases, b, q } => Some((
                    false,
                    w.dtype(),
                    w.dim(1),
                    Some(*q),
                    Some(scales.dtype()),
                    Some(biases.as_ref().map(Array::dtype)),
                    b.as_ref().map(Array::dtype),
                )),
                Linear::Lora(_) => None,
            }
        };
        let Some(first) = parts.first().and_then(key) else { return false };
        parts.iter().all(|p| key(p) == Some(first))
    }

    /// `parts` (linears of one input) as one linear whose output is theirs side by side, in order:
    /// the weights (quantized: packed weights, scales and biases, row for row) and the biases
    /// concatenated along the output axis and evaluated here, so that the parts' buffers go (the
    /// resident weight bytes do not change). `Err(parts)`, unchanged, where they cannot be
    /// ([`Linear::stackable`]): an adapter on one of them (LoRA/DoRA are added at run time per
    /// module), different dtypes or quantizations, a bias on some only.
    pub fn concat(parts: Vec<Linear>) -> Result<std::result::Result<Linear, Vec<Linear>>> {
        if parts.len() < 2 || !Linear::stackable(&parts) {
            return Ok(Err(parts));
        }
        let cat = |xs: Vec<&Array>| -> Result<Array> { mx::concatenate(&xs, 0) };
        let bias = |xs: Vec<Option<&Array>>| -> Result<Option<Array>> {
            xs.into_iter().collect::<Option<Vec<_>>>().map(cat).transpose()
        };
        let fused = match &parts[0] {
            Linear::Dense { .. } => {
                let (mut ws, mut bs, mut hs) = (Vec::new(), Vec::new(), Vec::new());
                for p in &parts {
                    if let Linear::Dense { w, b, host, .. } = p {
                        ws.push(w);
                        bs.push(b.as_ref());
                        hs.push(host.as_deref());
                    }
                }
                let (w, b) = (cat(ws)?, bias(bs)?);
                // the blocks too where every part has them
                let host = match hs.into_iter().collect::<Option<Vec<_>>>() {
                    Some(hs) => Some(Box::new(HostBlocks::concat(&hs)?)),
                    None => None,
                };
                let mut all = vec![&w];
                all.extend(b.as_ref());
                if let Some(h) = &host {
                    all.extend(h.arrays());
                }
                mx::eval(&all)?;
                Linear::Dense { wt: mx::transpose(&w)?, w, b, host }
            }
            Linear::Quant { q, .. } => {
                let q = *q;
                let (mut ws, mut ss, mut qbs, mut bs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for p in &parts {
                    if let Linear::Quant { w, scales, biases, b, .. } = p {
                        ws.push(w);
                        ss.push(scales);
                        qbs.push(biases.as_ref());
                        bs.push(b.as_ref());
                    }
                }
                let (w, scales, biases, b) = (cat(ws)?, cat(ss)?, bias(qbs)?, bias(bs)?);
                let mut all = vec![&w, &scales];
                all.extend(biases.as_ref());
                all.extend(b.as_ref());
                mx::eval(&all)?;
                Linear::Quant { w, scales, biases, b, q }
            }
            Linear::Lora(_) => return Ok(Err(parts)),
        };
        Ok(Ok(fused))
    }

    /// Output rows of a dense or quantized linear (what [`Linear::concat`] stacks).
    fn out_rows(&self) -> Result<i32> {
        match self {
            Linear::Dense { w, .. } | Linear::Quant { w, .. } => Ok(w.dim(0)),
            Linear::Lora(_) => Err(crate::Error::Invalid("the rows of a linear with adapters".into())),
        }
    }

    /// The outputs of the parts of a [`Linear::concat`] (`rows` output rows each, in order), each
    /// through its own rows of the weights (views: no copy), as the separate linears computed them.
    /// For long inputs: one output of all the parts would live until the last part's reader is done,
    /// where the separate outputs go one by one (measured: a 2048-token prefill of an 8-layer float32
    /// model peaked 71 MB higher through the single output, tests/test_fit.py).
    pub fn forward_parts(&self, x: &Array, rows: &[i32]) -> Result<Vec<Array>> {
        let mut outs = Vec::with_capacity(rows.len());
        let mut lo = 0;
        for &n in rows {
            let part = |a: &Array| mx::slice_axis(a, 0, lo, lo + n);
            let y = match self {
                Linear::Dense { w, b, .. } => {
                    let (wp, bp) = (part(w)?, b.as_ref().map(part).transpose()?);
                    match host_half(x, &wp, bp.as_ref())? {
                        Some(y) => y,
                        None => {
                            let wt = mx::transpose(&wp)?;
                            match bp {
                                Some(b) => mx::addmm(&b, x, &wt, 1.0, 1.0)?,
                                None => mx::matmul(x, &wt)?,
                            }
                        }
                    }
                }
                Linear::Quant { w, scales, biases, b, q } => {
                    let qb = biases.as_ref().map(part).transpose()?;
                    let y = quant_matmul(x, &part(w)?, &part(scales)?, qb.as_ref(), *q, None)?;
                    match b {
                        Some(b) => mx::add(&y, &part(b)?)?,
                        None => y,
                    }
                }
                Linear::Lora(_) => {
                    return Err(crate::Error::Invalid(
                        "forward_parts of a linear with adapters (never concatenated)".into(),
                    ))
                }
            };
            outs.push(y);
            lo += n;
        }
        Ok(outs)
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Linear::Dense { w, wt, b, host } => {
                let y = match host {
                    Some(h) => h.matmul(x)?,
                    None => None,
                };
                let y = match y {
                    Some(y) => Some(y),
                    None => host_small_matmul(x, w)?,
                };
                if let Some(y) = y {
                    return match b {
                        Some(b) => mx::add(&y, b),
                        None => Ok(y),
                    };
                }
                if let Some(y) = host_half(x, w, b.as_ref())? {
                    return Ok(y);
                }
                match b {
                    Some(b) => mx::addmm(b, x, wt, 1.0, 1.0),
                    None => match self.qmv_into(x, Epilogue::Plain, None)? {
                        Some(y) => Ok(y),
                        None => mx::matmul(x, wt),
                    },
                }
            }
            Linear::Quant { w, scales, biases, b, q } => {
                let y = quant_matmul(x, w, scales, biases.as_ref(), *q, None)?;
                match b {
                    Some(b) => mx::add(&y, b),
                    None => Ok(y),
                }
            }
            Linear::Lora(l) => l.forward(x),
        }
    }

    /// `res + forward(x)`: one kernel where the CUDA quantized matvec takes the product
    /// ([`quant_matmul`]: a decode step's residual add after the output or down projection), the two
    /// ops elsewhere.
    pub fn forward_add(&self, x: &Array, res: &Array) -> Result<Array> {
        match self {
            Linear::Quant { w, scales, biases, b: None, q } => {
                quant_matmul(x, w, scales, biases.as_ref(), *q, Some(res))
            }
            Linear::Dense { b: None, host: None, .. } => match self.qmv_into(x, Epilogue::Residual(res), None)? {
                Some(y) => Ok(y),
                None => mx::add(res, &self.forward(x)?),
            },
            _ => mx::add(res, &self.forward(x)?),
        }
    }

    /// The product through CUDA's quantized matvec with its [`Epilogue`] and in `shape`
    /// ([`super::qmv::qmv`]) where it takes it: a quantized linear without a bias, a decode step's
    /// rows. None elsewhere (then the caller builds the ops it saves).
    pub fn qmv_into(&self, x: &Array, epilogue: Epilogue, shape: Option<&[i32]>) -> Result<Option<Array>> {
        self.qmv_normed_into(x, None, epilogue, shape)
    }

    /// [`Linear::qmv_into`] of `norm(x)` where given, the norm in the kernel's prologue
    /// ([`super::qmv::Norm`]; None where the kernel does not take it).
    pub fn qmv_normed_into(
        &self,
        x: &Array,
        norm: Option<&RmsNorm>,
        epilogue: Epilogue,
        shape: Option<&[i32]>,
    ) -> Result<Option<Array>> {
        match self.kernel_weight(x) {
            Some(wt) => super::qmv::qmv(x, wt, epilogue, norm.map(RmsNorm::as_kernel), shape),
            None => Ok(None),
        }
    }

    /// A fused q/k/v projection of `norm(x)` (x where no norm is given) with the rotary embedding of
    /// q and k in the same kernel ([`super::qmv::qkv_rope`]) where it takes it (as
    /// [`Linear::qmv_normed_into`]); None elsewhere.
    pub fn qkv_rope_into(
        &self,
        x: &Array,
        norm: Option<&RmsNorm>,
        rope: &super::qmv::QkvRope,
    ) -> Result<Option<(Array, Array, Array)>> {
        match self.kernel_weight(x) {
            Some(wt) => super::qmv::qkv_rope(x, wt, rope, norm.map(RmsNorm::as_kernel)),
            None => Ok(None),
        }
    }

    /// The weight as CUDA's matvec kernels take it ([`super::qmv::Weight`]): a linear without a bias
    /// (quantized: for fewer rows of x than [`dequant_rows`]; dense: without the CPU's blocks).
    fn kernel_weight(&self, x: &Array) -> Option<super::qmv::Weight<'_>> {
        match self {
            Linear::Quant { w, scales, biases, b: None, q } if packed_rows(x, w, *q) => {
                Some(super::qmv::QWeight { w, scales, biases: biases.as_ref(), q: *q }.into())
            }
            Linear::Dense { w, b: None, host: None, .. } => Some(super::qmv::Weight::Dense(w)),
            _ => None,
        }
    }
}

/// Whether a decode step's per-row attention goes through [`mx::rows_decode_attention`]: the CPU,
/// float32 queries (or 16-bit ones where [`cpu_half`]: MLX's rounding points, float32 sums), no
/// attention sinks, no row with a mask array (one query per row: `None` and `Causal` hide nothing),
/// and `MLXRS_CPU_ROWS_ATTENTION` not `0`.
fn rows_attention_applies(q: &Array, sinks: Option<&Array>, masks: &[Mask]) -> bool {
    (q.dtype() == Dtype::Float32 || (matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16) && cpu_half()))
        && sinks.is_none()
        && !on_gpu()
        && masks.iter().all(|m| matches!(m, Mask::None | Mask::Causal))
        && !std::env::var(CPU_ROWS_ATTENTION_ENV).is_ok_and(|v| v.trim() == "0")
}

/// One decode step's attention of the rows of `q` (`[rows, heads, 1, head_dim]`), row `i` over
/// `fetched[i]`, as one [`mx::rows_decode_attention`] op: where every row's keys and values are dense
/// and of q's dtype (the caller has checked [`rows_attention_applies`]); None elsewhere.
fn rows_op(q: &Array, fetched: &[Fetched], scale: f32) -> Result<Option<Array>> {
    let dense: Option<Vec<(&Array, &Array)>> = fetched
        .iter()
        .map(|f| match f {
            Fetched::Dense(k, v) if k.dtype() == q.dtype() && v.dtype() == q.dtype() => Some((k, v)),
            _ => None,
        })
        .collect();
    match dense {
        Some(pairs) => mx::rows_decode_attention(q, &pairs, scale),
        None => Ok(None),
    }
}

/// `0`: a CPU decode step's per-row attention runs as MLX's ops per row (the reference path);
/// otherwise as one op for all rows ([`mx::rows_decode_attention`]). Read at each step.
pub const CPU_ROWS_ATTENTION_ENV: &str = "MLXRS_CPU_ROWS_ATTENTION";

/// `0`: a bfloat16 or float16 model on the CPU backend runs its projections and its prompts'
/// attention as MLX's ops (its half-precision CPU matmul: a bfloat16 model prefilled ~20× and decoded
/// ~5× slower than its float32 copy); otherwise through [`mx::host_half_matmul`] ([`host_half`]) and
/// [`mx::host_half_attention`] (`sdpa::attention`). Read at each call.
pub const CPU_HALF_ENV: &str = "MLXRS_CPU_HALF";

/// Whether 16-bit float products run on the host ops here: the CPU backend, [`CPU_HALF_ENV`] not `0`.
pub fn cpu_half() -> bool {
    !on_gpu() && !std::env::var(CPU_HALF_ENV).is_ok_and(|v| v.trim() == "0")
}

/// `x Wᵀ + b` for a W of 16-bit floats on the CPU backend through the host op
/// ([`mx::host_half_matmul`]: W widened inside the op, a decode step's rows reading it in place,
/// anything else through float32 tiles and the BLAS), x taken in float32 and the product (plus the
/// bias, in float32: then through an add after the op) rounded once to x's dtype — as MLX's matmul and addmm round their float
/// accumulators, the sums in another order. x of W's dtype or float32 (the product's dtype is x's
/// then, as MLX promotes). None elsewhere: a GPU, other dtypes, [`CPU_HALF_ENV`] `0`, a libmlxc
/// without the op.
fn host_half(x: &Array, w: &Array, b: Option<&Array>) -> Result<Option<Array>> {
    if !cpu_half() {
        return Ok(None);
    }
    let f32 = Dtype::Float32;
    if !matches!(w.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        || w.ndim() != 2
        || !(x.dtype() == w.dtype() || x.dtype() == f32)
        || b.is_some_and(|b| b.ndim() != 1 || b.dim(0) != w.dim(0))
    {
        return Ok(None);
    }
    // without a bias x goes in as it is, and the product comes out rounded once to its type
    let Some(b) = b else { return mx::host_half_matmul(x, w) };
    let xf = if x.dtype() == f32 { x.clone() } else { mx::astype(x, f32)? };
    let Some(y) = mx::host_half_matmul(&xf, w)? else { return Ok(None) };
    let y = mx::add(&y, &mx::astype(b, f32)?)?;
    if x.dtype() == f32 {
        Ok(Some(y))
    } else {
        mx::astype(&y, x.dtype()).map(Some)
    }
}

/// `0`: a float32 projection of a batched decode step of 2 to [`mx::GRAPH_MAX_ROWS`] rows, or of a
/// short prompt of 2 to [`mx::SMALL_MAX_ROWS`] tokens, on the CPU backend runs as MLX's matmul (the
/// BLAS's sgemm); otherwise through [`mx::small_matmul`] (in a decode step as an op of the graph,
/// [`mx::host_matmul`]), faster there (the measurements are in its module). Read at each call.
pub const CPU_SMALL_MATMUL_ENV: &str = "MLXRS_CPU_SMALL_MATMUL";

/// `x Wᵀ` on the host ([`mx::small_matmul`]) where it applies: the CPU backend, float32 x and W; a
/// decode step of 2 to [`mx::GRAPH_MAX_ROWS`] rows (`[B, 1, cols]`) as one op of MLX's graph
/// ([`mx::host_matmul`]); otherwise (a short prompt, or a libmlxc without that op) 2 to
/// [`mx::SMALL_MAX_ROWS`] rows computed here after evaluating x. None elsewhere (x stays lazy then).
fn host_small_matmul(x: &Array, w: &Array) -> Result<Option<Array>> {
    let cols = x.dim(-1).max(1) as usize;
    let rows = x.size() / cols;
    if !(2..=mx::GRAPH_MAX_ROWS).contains(&rows)
        || x.dtype() != Dtype::Float32
        || w.dtype() != Dtype::Float32
        || w.ndim() != 2
        || w.dim(1) as usize != cols
        || on_gpu()
        || std::env::var(CPU_SMALL_MATMUL_ENV).is_ok_and(|v| v.trim() == "0")
    {
        return Ok(None);
    }
    // one position per row: a batched decode step. Not prefill chunks: a row's chunk must be computed
    // as it is alone whatever the pass's row count (sgemm gives each row the same sums at any count;
    // this kernel's differ from sgemm's in the last bits, which a quantized KV cache can round into
    // another level: engine::sched's batched-prefill test)
    if x.ndim() == 3 && x.dim(1) == 1 {
        if let Some(y) = mx::host_matmul(x, w)? {
            return Ok(Some(y));
        }
    }
    if rows > mx::SMALL_MAX_ROWS {
        return Ok(None);
    }
    let Some(wv) = w.f32_values()? else { return Ok(None) };
    let xv = x.to_vec::<f32>()?;
    let threads = mx::host_threads();
    let out = w.dim(0);
    let y = mx::small_matmul(wv, out as usize, cols, &xv, threads)?;
    let mut shape = x.shape();
    *shape.last_mut().expect("x has a last axis") = out;
    Ok(Some(Array::from_slice(&y, &shape)?))
}

/// Up to how many rows (tokens × sequences) a fused projection runs as one matmul: decode steps.
/// Longer inputs go through its parts ([`Linear::forward_parts`]).
const FUSED_MAX_ROWS: i32 = 32;

/// `0`: the dense decoders keep q/k/v and gate/up as separate projections (the reference path);
/// otherwise they are fused at load ([`Attention::fuse`], [`Mlp::fuse`]). Read at every load.
pub const FUSED_PROJ_ENV: &str = "MLXRS_FUSED_PROJ";

/// Whether loads fuse projections now ([`FUSED_PROJ_ENV`]).
pub fn fused_proj() -> bool {
    !std::env::var(FUSED_PROJ_ENV).is_ok_and(|v| v.trim() == "0")
}

/// Rows of `x` (all but its last axis) from which a quantized matmul dequantizes its weight to the
/// activation dtype and runs a plain matmul instead ([`dequant_rows`]).
pub const DEQUANT_ROWS_ENV: &str = "MLXRS_DEQUANT_PREFILL_ROWS";

/// From how many rows a matmul against `bits`-bit quantized weights goes through a dequantized
/// weight: [`crate::plan::Backend::dequant_rows`] for the backend here (why, and the transient the
/// planner counts for it, are there); [`DEQUANT_ROWS_ENV`] overrides it for every width (0: never).
/// The variable as read by the last [`refresh_dequant_rows`] (the engine calls it per request), or at
/// the first call.
pub fn dequant_rows(bits: i32) -> usize {
    let set = match DEQUANT_ROWS.load(std::sync::atomic::Ordering::Relaxed) {
        UNREAD => refresh_dequant_rows(),
        n => n,
    };
    if set != AUTO {
        return set;
    }
    usize::try_from(backend().dequant_rows(bits)).unwrap_or(usize::MAX)
}

/// The backend of this process, as the planner names it (what [`dequant_rows`] and [`quant_matmul`]
/// ask it: the same facts the memory plan counts).
fn backend() -> crate::plan::Backend {
    static BACKEND: std::sync::OnceLock<crate::plan::Backend> = std::sync::OnceLock::new();
    *BACKEND.get_or_init(crate::plan::Backend::detect)
}

/// [`DEQUANT_ROWS_ENV`] as last read: [`UNREAD`], [`AUTO`] (unset: the backend's default), or rows
/// (`usize::MAX`: never).
static DEQUANT_ROWS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(UNREAD);
const UNREAD: usize = 0;
const AUTO: usize = usize::MAX - 1;

/// Read [`DEQUANT_ROWS_ENV`] again: once per request, so that a process can compare settings between
/// requests (bench/bench_device.py `--ab-env`, bench/bench_dequant_rows.py).
pub fn refresh_dequant_rows() -> usize {
    let n = match std::env::var(DEQUANT_ROWS_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(0) => usize::MAX,
        Some(n) => n.min(AUTO - 1),
        None => AUTO,
    };
    DEQUANT_ROWS.store(n, std::sync::atomic::Ordering::Relaxed);
    n
}

/// Whether a product of `x` (its values as rows of W's K) with the MLX-quantized `w` keeps the packed
/// kernels (CUDA's [`super::qmv::qmv`] or MLX's): fewer rows than [`dequant_rows`], from which on W is
/// dequantized for a plain matmul ([`quant_matmul`]).
fn packed_rows(x: &Array, w: &Array, q: QuantSpec) -> bool {
    x.size() / (super::qmv::k_of(w, q).max(1) as usize) < dequant_rows(q.bits)
}

/// `x W^T` for an MLX-quantized W: the packed kernel, or from [`dequant_rows`] rows of `x` on,
/// W dequantized to x's dtype and a plain matmul (same values up to summation order).
///
/// Plus `res` where given (`res + x Wᵀ`): in the same kernel where [`super::qmv::qmv`] takes the
/// product, an add after it elsewhere.
fn quant_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    q: QuantSpec,
    res: Option<&Array>,
) -> Result<Array> {
    let packed = packed_rows(x, w, q);
    let y = if !packed && backend().dequant_float32() {
        dequant_matmul_f32(x, w, scales, biases, q)?
    } else if !packed {
        let wd = mx::dequantize(w, scales, biases, q.group_size, q.bits, q.mode)?;
        let wd = if wd.dtype() == x.dtype() { wd } else { mx::astype(&wd, x.dtype())? };
        mx::matmul(x, &mx::transpose(&wd)?)?
    } else if let Some(y) = host_packed(x, w, scales, biases, q)? {
        y
    } else if let Some(y) = super::qmv::qmv(
        x,
        super::qmv::QWeight { w, scales, biases, q }.into(),
        res.map_or(Epilogue::Plain, Epilogue::Residual),
        None,
        None,
    )? {
        return Ok(y);
    } else {
        mx::quantized_matmul(x, w, scales, biases, true, q.group_size, q.bits, q.mode)?
    };
    match res {
        Some(r) => mx::add(r, &y),
        None => Ok(y),
    }
}

/// `x Wᵀ` on the CPU from [`dequant_rows`] rows on: W dequantized to float32 (affine: with its scales
/// and biases in float32, so the values are exact), x in float32, the BLAS's sgemm, the product back
/// in x's dtype ([`crate::plan::Backend::dequant_float32`]; the planner counts the float32 weight).
fn dequant_matmul_f32(x: &Array, w: &Array, scales: &Array, biases: Option<&Array>, q: QuantSpec) -> Result<Array> {
    let f32 = Dtype::Float32;
    let to32 = |a: &Array| if a.dtype() == f32 { Ok(a.clone()) } else { mx::astype(a, f32) };
    let affine = q.mode == mx::QuantMode::Affine;
    let (s, b) =
        if affine { (to32(scales)?, biases.map(to32).transpose()?) } else { (scales.clone(), biases.cloned()) };
    let wd = to32(&mx::dequantize(w, &s, b.as_ref(), q.group_size, q.bits, q.mode)?)?;
    let y = mx::matmul(&to32(x)?, &mx::transpose(&wd)?)?;
    if x.dtype() == f32 {
        Ok(y)
    } else {
        mx::astype(&y, x.dtype())
    }
}

/// `x Wᵀ` for an MLX affine-quantized W of 4 or 8 bits through the CPU's packed kernel
/// ([`mx::host_packed_matmul`], an op of MLX's graph reading the model's own words; x taken in float32
/// and the product given back in x's dtype): on the CPU backend, for up to [`HOST_BLOCKS_MAX_ROWS`]
/// rows of x (decode steps), unless [`HOST_BLOCKS_ENV`] is `0` (read at each call). None elsewhere
/// (other bits, modes or groups, a GPU, longer inputs, a libmlxc without the op): MLX's own
/// quantized matmul then.
fn host_packed(x: &Array, w: &Array, scales: &Array, biases: Option<&Array>, q: QuantSpec) -> Result<Option<Array>> {
    let Some(b) = biases else { return Ok(None) };
    let cols = x.dim(-1).max(1) as usize;
    if on_gpu()
        || q.mode != mx::QuantMode::Affine
        || !matches!(q.bits, 4 | 8)
        || !(q.group_size as usize).is_multiple_of(mx::PACKED_GROUP_STEP)
        || !matches!(scales.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || !matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || x.size() / cols > HOST_BLOCKS_MAX_ROWS
        || std::env::var(HOST_BLOCKS_ENV).is_ok_and(|v| v.trim() == "0")
    {
        return Ok(None);
    }
    let xf = if x.dtype() == Dtype::Float32 { x.clone() } else { mx::astype(x, Dtype::Float32)? };
    match mx::host_packed_matmul(&xf, w, scales, b, q.bits)? {
        Some(y) if x.dtype() != Dtype::Float32 => mx::astype(&y, x.dtype()).map(Some),
        y => Ok(y),
    }
}

/// The file of a GGUF import (f32, the CPU default) that holds the output head as the GGUF stored it,
/// Q8_0 (int8 values, one scale per 32): [`Q8_HEAD_VALUES`] `[vocab, hidden]` int8 and
/// [`Q8_HEAD_SCALES`] `[vocab, hidden / 32]` float32. The f32 head in model.safetensors is its
/// dequantization, so both give the same logits up to float32 summation order.
pub const Q8_HEAD_FILE: &str = "head_q8_0.safetensors";
pub const Q8_HEAD_VALUES: &str = "head_q8_0.weight";
pub const Q8_HEAD_SCALES: &str = "head_q8_0.scales";
/// `0` turns the Q8_0 output head off (the f32 head through MLX's matmul then); on by default
/// on the CPU backend where an import has [`Q8_HEAD_FILE`]. Read at every load.
pub const Q8_HEAD_ENV: &str = "MLXRS_CPU_Q8_HEAD";

/// An f32 import's linear projections as the GGUF's own blocks too ([`HostBlocks`]; the file holds
/// `{module}.host_q`, `.host_scales` and, for formats with a minimum, `.host_biases`). mlx-lm reads
/// only `model*.safetensors`, so the directory stays its model.
pub const HOST_BLOCKS_FILE: &str = "host_blocks.safetensors";
/// `0`: the CPU's decode steps run every f32 projection from its f32 weights (OpenBLAS's gemv, the
/// reference path); otherwise those with blocks ([`HOST_BLOCKS_FILE`]) run from the blocks through
/// [`mx::host_blocks_matmul`], reading 1–1.5 bytes a weight instead of 4. Read at every load.
pub const HOST_BLOCKS_ENV: &str = "MLXRS_CPU_HOST_BLOCKS";

/// Up to how many rows of x (tokens × sequences) a product runs from blocks: decode steps. Longer
/// inputs (prefill chunks; `logits()` of a prompt) stay lazy graphs over the f32 weights.
const HOST_BLOCKS_MAX_ROWS: usize = 8;

/// A matrix `[out, inp]` as int8 values with a float32 scale (and bias) per group along its rows,
/// equal value for value to the f32 weights beside it ([`crate::gguf::dequant::blocks`]): the CPU's
/// decode-step products run from these ([`mx::host_blocks_matmul`], an op of MLX's graph).
pub struct HostBlocks {
    q: Array,
    s: Array,
    b: Option<Array>,
}

impl HostBlocks {
    pub fn values_name(base: &str) -> String {
        format!("{base}.host_q")
    }

    pub fn scales_name(base: &str) -> String {
        format!("{base}.host_scales")
    }

    pub fn biases_name(base: &str) -> String {
        format!("{base}.host_biases")
    }

    /// `{base}`'s blocks when the weights have them (taken out of `ws` either way): None when
    /// [`HOST_BLOCKS_ENV`] is `0` or MLX runs on a GPU. Shapes checked against `[out, inp]`.
    fn take(ws: &mut Weights, base: &str, out: i32, inp: i32) -> Result<Option<HostBlocks>> {
        let q = ws.remove(&Self::values_name(base));
        let s = ws.remove(&Self::scales_name(base));
        let b = ws.remove(&Self::biases_name(base));
        let (Some(q), Some(s)) = (q, s) else { return Ok(None) };
        if std::env::var(HOST_BLOCKS_ENV).is_ok_and(|v| v.trim() == "0") || on_gpu() {
            return Ok(None);
        }
        HostBlocks::checked(q, s, b, out, inp, &format!("{base} ({HOST_BLOCKS_FILE})")).map(Some)
    }

    /// The blocks after checking them against `[out, inp]`: int8 values of that shape, float32
    /// scales (and biases) `[out, groups]` with groups of a multiple of 16 values.
    fn checked(q: Array, s: Array, b: Option<Array>, out: i32, inp: i32, what: &str) -> Result<HostBlocks> {
        if q.dtype() != Dtype::Int8 || q.shape() != [out, inp] {
            return Err(crate::Error::ModelLoad(format!(
                "the blocks of {what} are {} {:?}, not int8 [{out}, {inp}]",
                q.dtype().name(),
                q.shape()
            )));
        }
        let groups = s.dim(-1);
        let step = mx::GROUP_STEP as i32;
        let good = |a: &Array| a.dtype() == Dtype::Float32 && a.ndim() == 2 && a.dim(0) == out && a.dim(1) == groups;
        if !good(&s) || groups < 1 || inp % groups != 0 || (inp / groups) % step != 0 || !b.as_ref().is_none_or(good) {
            return Err(crate::Error::ModelLoad(format!(
                "the scales (or biases) of {what} are {} {:?}: not float32 [{out}, groups] over groups of a multiple \
                 of {step} of its {inp} columns",
                s.dtype().name(),
                s.shape()
            )));
        }
        Ok(HostBlocks { q, s, b })
    }

    /// The arrays held (to evaluate after building them).
    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.q, &self.s];
        v.extend(self.b.as_ref());
        v
    }

    /// Group width in values.
    fn group(&self) -> i32 {
        self.q.dim(1) / self.s.dim(1)
    }

    /// The parts' rows stacked (for [`Linear::concat`]), in the smallest group of them (a group's
    /// scale repeated over its halves: the same values) and with zero biases for the parts without.
    fn concat(parts: &[&HostBlocks]) -> Result<HostBlocks> {
        let group = parts.iter().map(|p| p.group()).min().unwrap_or(mx::GROUP_STEP as i32);
        let widen = |a: &Array, f: i32| -> Result<Array> {
            if f == 1 {
                return Ok(a.clone());
            }
            let (r, g) = (a.dim(0), a.dim(1));
            let e = mx::broadcast_to(&mx::expand_dims(a, 2)?, &[r, g, f])?;
            mx::reshape(&e, &[r, g * f])
        };
        let any_b = parts.iter().any(|p| p.b.is_some());
        let (mut qs, mut ss, mut bs) = (Vec::new(), Vec::new(), Vec::new());
        for p in parts {
            let f = p.group() / group;
            if p.group() % group != 0 {
                return Err(crate::Error::Invalid(format!("groups of {} and {group} values", p.group())));
            }
            qs.push(p.q.clone());
            ss.push(widen(&p.s, f)?);
            if any_b {
                bs.push(match &p.b {
                    Some(b) => widen(b, f)?,
                    None => mx::zeros(&[p.s.dim(0), p.s.dim(1) * f], Dtype::Float32)?,
                });
            }
        }
        let cat = |xs: &[Array]| mx::concatenate(&xs.iter().collect::<Vec<_>>(), 0);
        Ok(HostBlocks { q: cat(&qs)?, s: cat(&ss)?, b: if any_b { Some(cat(&bs)?) } else { None } })
    }

    /// `x · dequant(W)ᵀ` for float32 `x` `[..., inp]` of up to [`HOST_BLOCKS_MAX_ROWS`] rows (a decode
    /// step); None elsewhere, or where the loaded libmlxc lacks the op.
    pub fn matmul(&self, x: &Array) -> Result<Option<Array>> {
        let cols = self.q.dim(1);
        if x.dtype() != Dtype::Float32 || x.dim(-1) != cols || x.size() / cols.max(1) as usize > HOST_BLOCKS_MAX_ROWS {
            return Ok(None);
        }
        mx::host_blocks_matmul(x, &self.q, &self.s, self.b.as_ref())
    }
}

/// The output head as Q8_0 blocks ([`HostBlocks`] of groups of 32, no biases): for the real Gemma 3
/// 270M's 262144 × 640 tied head 178 MB per token instead of 671 MB of float32.
pub struct Q8Head {
    m: HostBlocks,
}

impl Q8Head {
    /// The Q8_0 head of the weights when they have one (both tensors are taken out of `ws` either
    /// way): None when [`Q8_HEAD_ENV`] is `0` or MLX runs on a GPU. Shapes checked against `rows`
    /// (the logits' width) and `hidden`.
    pub fn take(ws: &mut Weights, rows: i32, hidden: i32) -> Result<Option<Q8Head>> {
        let (Some(q), Some(d)) = (ws.remove(Q8_HEAD_VALUES), ws.remove(Q8_HEAD_SCALES)) else { return Ok(None) };
        let off = std::env::var(Q8_HEAD_ENV).is_ok_and(|v| v.trim() == "0");
        if off || on_gpu() {
            return Ok(None);
        }
        let m = HostBlocks::checked(q, d, None, rows, hidden, &format!("{Q8_HEAD_VALUES} ({Q8_HEAD_FILE})"))?;
        Ok(Some(Q8Head { m }))
    }

    /// The logits of float32 hidden states `h` `[..., hidden]`, or None where this head does not
    /// apply (more than [`HOST_BLOCKS_MAX_ROWS`] rows, another dtype).
    pub fn logits(&self, h: &Array) -> Result<Option<Array>> {
        self.m.matmul(h)
    }
}

/// Token embedding (dense or quantized); `as_linear` is the tied output head.
pub enum Embedding {
    /// The table and its transposed view (for the tied output head; no copy); `q8` the model's
    /// output head (this table when tied, else the lm_head) as a GGUF's Q8_0 blocks, for the CPU.
    Dense {
        w: Array,
        wt: Array,
        q8: Option<Q8Head>,
    },
    Quant {
        w: Array,
        scales: Array,
        biases: Option<Array>,
        q: QuantSpec,
    },
}

impl Embedding {
    /// `{prefix}.weight` `[rows, hidden]` with at least `vocab` rows (a token id indexes it).
    pub fn load(ws: &mut Weights, prefix: &str, vocab: i32, hidden: i32) -> Result<Embedding> {
        let rows = ws.rows_of(prefix).unwrap_or(vocab);
        if rows < vocab {
            return Err(crate::Error::ModelLoad(format!(
                "weight {prefix}.weight has {rows} rows but config.json's vocab_size is {vocab}: token ids past \
                 row {rows} would read outside it; the checkpoint does not match config.json"
            )));
        }
        Ok(match ws.take_matrix(prefix, rows, hidden)? {
            Matrix::Quant { w, scales, biases, q } => Embedding::Quant { w, scales, biases, q },
            Matrix::Dense(w) => Embedding::Dense { wt: mx::transpose(&w)?, w, q8: Q8Head::take(ws, rows, hidden)? },
        })
    }

    /// Rows of the table (the logits' width when it is the tied output head).
    pub fn rows(&self) -> i32 {
        match self {
            Embedding::Dense { w, .. } | Embedding::Quant { w, .. } => w.dim(0),
        }
    }

    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { w, .. } => mx::take(w, ids, 0),
            Embedding::Quant { w, scales, biases, q } => {
                let rows = mx::take(w, ids, 0)?;
                let s = mx::take(scales, ids, 0)?;
                let b = biases.as_ref().map(|b| mx::take(b, ids, 0)).transpose()?;
                mx::dequantize(&rows, &s, b.as_ref(), q.group_size, q.bits, q.mode)
            }
        }
    }

    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { w, wt, .. } => {
                if let Some(y) = host_half(x, w, None)? {
                    return Ok(y);
                }
                match super::qmv::qmv(x, super::qmv::Weight::Dense(w), Epilogue::Plain, None, None)? {
                    Some(y) => Ok(y),
                    None => mx::matmul(x, wt),
                }
            }
            Embedding::Quant { w, scales, biases, q } => quant_matmul(x, w, scales, biases.as_ref(), *q, None),
        }
    }

    /// The logits of hidden states `h`: through the untied `lm_head` when the model has one, else
    /// through this (tied) embedding as a linear map.
    pub fn logits(&self, lm_head: Option<&Linear>, h: &Array) -> Result<Array> {
        // (an lm_head with adapters is not the file's head any more)
        if let (Embedding::Dense { q8: Some(q8), .. }, None | Some(Linear::Dense { b: None, .. })) = (self, lm_head) {
            if let Some(y) = q8.logits(h)? {
                return Ok(y);
            }
        }
        match lm_head {
            Some(head) => head.forward(h),
            None => self.as_linear(h),
        }
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            Embedding::Dense { w, .. } => w.dtype(),
            Embedding::Quant { scales, .. } => scales.dtype(),
        }
    }
}

/// RMSNorm with an effective weight (Gemma's `1 + w` is folded in at load).
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    /// `{prefix}.weight` `[dim]`.
    pub fn load(ws: &mut Weights, prefix: &str, eps: f32, dim: i32) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: ws.take_shaped(&format!("{prefix}.weight"), &[dim])?, eps })
    }
    /// Gemma's convention: the stored weight is an offset from one.
    pub fn load_offset(ws: &mut Weights, prefix: &str, eps: f32, dim: i32) -> Result<RmsNorm> {
        let w = ws.take_shaped(&format!("{prefix}.weight"), &[dim])?;
        let one = mx::scalar_as(1.0, w.dtype())?;
        Ok(RmsNorm { weight: mx::add(&one, &w)?, eps })
    }
    /// The norm as the CUDA matvec's prologue takes it ([`super::qmv::Norm`]).
    fn as_kernel(&self) -> super::qmv::Norm<'_> {
        super::qmv::Norm { weight: &self.weight, eps: self.eps }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        // compiled for decode-sized inputs only: the compiled function is traced once per input
        // shape, and prefill chunks come in every length
        let rows = x.size() / (x.dim(-1).max(1) as usize);
        if on_gpu() || rows > COMPILED_NORM_MAX_ROWS || std::env::var(COMPILED_NORM_ENV).is_ok_and(|v| v.trim() == "0")
        {
            return mx::rms_norm(x, Some(&self.weight), self.eps);
        }
        compiled_rms_norm(x, &self.weight, self.eps)
    }
}

/// `0`: RMSNorm on the CPU runs as MLX's plain op; otherwise compiled ([`compiled_rms_norm`]) for
/// inputs of up to [`COMPILED_NORM_MAX_ROWS`] rows.
pub const COMPILED_NORM_ENV: &str = "MLXRS_CPU_COMPILED_NORM";
const COMPILED_NORM_MAX_ROWS: usize = 32;

/// `mx::rms_norm` through MLX's compiler, one compiled function per `eps`. On the CPU MLX's
/// `fast::rms_norm` is its op-by-op fallback (float32 cast, square, mean, add, rsqrt, two
/// multiplies, cast back: seven ops, each paying MLX's per-op cost); compiled, the elementwise ones
/// fuse, with bit-identical results (the same float32 operations in the same order; checked against
/// the plain op in `compiled_rms_norm_is_bit_identical`). On a GPU `fast::rms_norm` is one kernel.
pub fn compiled_rms_norm(x: &Array, w: &Array, eps: f32) -> Result<Array> {
    static SLOTS: KeyedSlots<u32> = std::sync::OnceLock::new();
    let slot = keyed_compiled(&SLOTS, eps.to_bits(), || {
        mx::Compiled::new(move |a: &[Array]| Ok(vec![mx::rms_norm(&a[0], Some(&a[1]), eps)?]), false)
    });
    match slot {
        Some(c) => call_compiled(&c, &[x, w], "rms_norm"),
        None => mx::rms_norm(x, Some(w), eps),
    }
}

type SharedCompiled = std::sync::Arc<std::sync::Mutex<mx::Compiled>>;
type KeyedSlots<K> = std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<K, Option<SharedCompiled>>>>;

/// The compiled function of `key` in `slots`, made by `make` on first use (None, remembered, where
/// compiling failed: the caller runs the plain ops).
fn keyed_compiled<K: std::hash::Hash + Eq>(
    slots: &'static KeyedSlots<K>,
    key: K,
    make: impl FnOnce() -> Result<mx::Compiled>,
) -> Option<SharedCompiled> {
    let mut m = slots.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    m.entry(key).or_insert_with(|| make().ok().map(|c| std::sync::Arc::new(std::sync::Mutex::new(c)))).clone()
}

/// The first output of compiled function `c` (named `what` in errors) on `args`.
fn call_compiled(c: &SharedCompiled, args: &[&Array], what: &str) -> Result<Array> {
    c.lock()
        .unwrap_or_else(|e| e.into_inner())
        .call(args)?
        .into_iter()
        .next()
        .ok_or_else(|| crate::Error::Mlx(format!("compiled {what} returned nothing")))
}

/// `0`: the CPU rotary embedding of one token runs as separate ops; otherwise compiled
/// ([`Rope::forward`]).
pub const COMPILED_ROPE_ENV: &str = "MLXRS_CPU_COMPILED_ROPE";

/// MLX's rope fallback formula ([`Rope::forward`]) on `x` `[B, H, L, D]`, its first `dims` features
/// rotated with cos `c` and sin `s` (broadcast against its first `dims / 2`).
fn rotate(dims: i32, x: &Array, c: &Array, s: &Array) -> Result<Array> {
    let (d, half) = (x.dim(3), dims / 2);
    let x1 = mx::slice_axis(x, 3, 0, half)?;
    let x2 = mx::slice_axis(x, 3, half, dims)?;
    let a = mx::subtract(&mx::multiply(&x1, c)?, &mx::multiply(&x2, s)?)?;
    let b = mx::add(&mx::multiply(&x1, s)?, &mx::multiply(&x2, c)?)?;
    if dims < d {
        let rest = mx::slice_axis(x, 3, dims, d)?;
        mx::concatenate(&[&a, &b, &rest], 3)
    } else {
        mx::concatenate(&[&a, &b], 3)
    }
}

/// Rotary position embedding (default/linear scaling, or explicit frequencies for llama3).
pub struct Rope {
    pub dims: i32,
    pub traditional: bool,
    pub base: f32,
    pub scale: f32,
    pub freqs: Option<Array>,
    /// The bits of `freqs` (the key of the shared cos/sin table).
    freq_bits: Vec<u32>,
    /// YaRN's attention scaling: the rotated dims of `x` multiplied by it first (1: none).
    mscale: f32,
}

/// Whether the default device is a GPU (decided once per process).
fn on_gpu() -> bool {
    static GPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GPU.get_or_init(|| mx::default_device().map(|d| d.kind() == mx::DeviceKind::Gpu).unwrap_or(false))
}

/// cos/sin tables of the positions 0..len, one per set of rope parameters and dtype, shared by all
/// layers and models of the process; grown on demand.
type RopeKey = (i32, u32, u32, Vec<u32>, Dtype);
type RopeTables = std::collections::HashMap<RopeKey, (Array, Array, i32)>;
static ROPE_TABLES: std::sync::OnceLock<std::sync::Mutex<RopeTables>> = std::sync::OnceLock::new();

impl Rope {
    /// A rope of explicit per-pair periods `freqs` (`dims / 2` of them), no scaling.
    fn from_freqs(dims: i32, traditional: bool, base: f32, freqs: &[f32]) -> Result<Rope> {
        Ok(Rope {
            dims,
            traditional,
            base,
            scale: 1.0,
            freqs: Some(Array::from_slice(freqs, &[freqs.len() as i32])?),
            freq_bits: freqs.iter().map(|f| f.to_bits()).collect(),
            mscale: 1.0,
        })
    }

    /// mlx-lm's `initialize_rope` for the scaling types the supported architectures use.
    pub fn from_config(dims: i32, base: f32, traditional: bool, scaling: Option<&serde_json::Value>) -> Result<Rope> {
        let ty = scaling
            .and_then(|s| s.get("type").or_else(|| s.get("rope_type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let f = |k: &str, d: f64| scaling.and_then(|s| s.get(k)).and_then(|v| v.as_f64()).unwrap_or(d);
        match ty {
            "default" => {
                Ok(Rope { dims, traditional, base, scale: 1.0, freqs: None, freq_bits: Vec::new(), mscale: 1.0 })
            }
            "linear" => Ok(Rope {
                dims,
                traditional,
                base,
                scale: 1.0 / f("factor", 1.0) as f32,
                freqs: None,
                freq_bits: Vec::new(),
                mscale: 1.0,
            }),
            "llama3" => {
                let factor = f("factor", 1.0);
                let low = f("low_freq_factor", 1.0);
                let high = f("high_freq_factor", 4.0);
                let old = f("original_max_position_embeddings", 8192.0);
                let (low_wl, high_wl) = (old / low, old / high);
                // computed in float32 as mlx-lm does
                let freqs: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        let fr = base.powf((2 * i) as f32 / dims as f32);
                        let wl = 2.0 * std::f32::consts::PI * fr;
                        let fr2 = if (wl as f64) > low_wl { fr * factor as f32 } else { fr };
                        let medium = (wl as f64) > high_wl && (wl as f64) < low_wl;
                        if medium {
                            let smooth = ((old as f32) / wl - low as f32) / (high as f32 - low as f32);
                            fr2 / ((1.0 - smooth) / factor as f32 + smooth)
                        } else {
                            fr2
                        }
                    })
                    .collect();
                Rope::from_freqs(dims, traditional, base, &freqs)
            }
            "proportional" => {
                // mlx-lm's ProportionalRoPE (Gemma 4's global layers): the first
                // `partial_rotary_factor * dims` features' pairs rotate at `factor * base^(2i/dims)`,
                // the rest at an infinite period (not at all); the pairing spans all `dims`
                let rotated = (dims as f64 * f("partial_rotary_factor", 1.0)) as i32;
                if !(0..=dims).contains(&rotated) {
                    return Err(crate::Error::ModelLoad(format!(
                        "rope partial_rotary_factor {} rotates {rotated} of {dims} features (must be 0..={dims})",
                        f("partial_rotary_factor", 1.0)
                    )));
                }
                let factor = f("factor", 1.0) as f32;
                let freqs: Vec<f32> =
                    (0..dims / 2)
                        .map(|i| {
                            if 2 * i < rotated {
                                factor * base.powf((2 * i) as f32 / dims as f32)
                            } else {
                                f32::INFINITY
                            }
                        })
                        .collect();
                Rope::from_freqs(dims, traditional, base, &freqs)
            }
            "yarn" | "deepseek_yarn" | "telechat3-yarn" => Rope::yarn(dims, base, traditional, scaling),
            other => Err(crate::Error::Unsupported(format!(
                "rope_scaling type {other:?} is not supported (supported: default, linear, llama3, proportional, yarn)"
            ))),
        }
    }

    /// mlx-lm's `YarnRoPE`: frequencies blended between the original and the `factor`-scaled ones
    /// over the dims between the `beta_fast` and `beta_slow` correction dims (computed with MLX's
    /// float32 ops, as mlx-lm does), and the attention scaling `mscale`.
    fn yarn(dims: i32, base: f32, traditional: bool, scaling: Option<&serde_json::Value>) -> Result<Rope> {
        let f = |k: &str, d: f64| scaling.and_then(|s| s.get(k)).and_then(|v| v.as_f64()).unwrap_or(d);
        let factor = scaling
            .and_then(|s| s.get("factor"))
            .and_then(|v| v.as_f64())
            .ok_or_else(|| crate::Error::ModelLoad("config.json: rope_scaling of type yarn has no factor".into()))?;
        let (orig, beta_fast, beta_slow) =
            (f("original_max_position_embeddings", 4096.0), f("beta_fast", 32.0), f("beta_slow", 1.0));
        let (mscale, mscale_all) = (f("mscale", 1.0), f("mscale_all_dim", 0.0));
        if !(factor > 0.0 && orig > 0.0 && beta_fast > 0.0 && beta_slow > 0.0 && base > 1.0) {
            return Err(crate::Error::ModelLoad(format!(
                "config.json: rope_scaling {scaling:?} (yarn) has a value out of range"
            )));
        }
        let bf = base as f64;
        let corr = |rot: f64| (dims as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * bf.ln());
        let low = corr(beta_fast).floor().max(0.0);
        let mut high = corr(beta_slow).ceil().min((dims - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        let ms = get_mscale(factor, mscale) / get_mscale(factor, mscale_all);
        let f32s = |v: f64| mx::scalar_as(v, Dtype::Float32);
        let exps = mx::divide(&mx::arange(0.0, dims as f64, 2.0, Dtype::Float32)?, &f32s(dims as f64)?)?;
        let extra = mx::power(&f32s(bf)?, &exps)?;
        let inter = mx::multiply(&f32s(factor)?, &extra)?;
        let ramp = mx::divide(
            &mx::subtract(&mx::arange(0.0, (dims / 2) as f64, 1.0, Dtype::Float32)?, &f32s(low)?)?,
            &f32s(high - low)?,
        )?;
        let ramp = mx::clip(&ramp, Some(&f32s(0.0)?), Some(&f32s(1.0)?))?;
        let mask = mx::subtract(&f32s(1.0)?, &ramp)?;
        let one_minus = mx::subtract(&f32s(1.0)?, &mask)?;
        let freqs = mx::divide(
            &mx::multiply(&inter, &extra)?,
            &mx::add(&mx::multiply(&inter, &mask)?, &mx::multiply(&extra, &one_minus)?)?,
        )?;
        mx::eval(&[&freqs])?;
        let bits: Vec<u32> = freqs.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect();
        Ok(Rope { dims, traditional, base, scale: 1.0, freqs: Some(freqs), freq_bits: bits, mscale: ms as f32 })
    }

    /// `x` with its rotated dims multiplied by YaRN's `mscale` (x itself when it is 1).
    fn pre_scale(&self, x: &Array) -> Result<Array> {
        if self.mscale == 1.0 {
            return Ok(x.clone());
        }
        let m = mx::scalar_as(self.mscale as f64, x.dtype())?;
        let d = x.dim(-1);
        if self.dims >= d {
            return mx::multiply(x, &m);
        }
        let ax = x.ndim() as i32 - 1;
        let head = mx::multiply(&mx::slice_axis(x, ax, 0, self.dims)?, &m)?;
        mx::concatenate(&[&head, &mx::slice_axis(x, ax, self.dims, d)?], ax)
    }

    /// MLX's rope (on the CPU a composition of ~20 ops that recomputes the frequencies, cos and sin
    /// on every call).
    fn mlx_rope(&self, x: &Array, offset: i32) -> Result<Array> {
        match &self.freqs {
            Some(f) => mx::rope(x, self.dims, self.traditional, None, self.scale, offset, Some(f)),
            None => mx::rope(x, self.dims, self.traditional, Some(self.base), self.scale, offset, None),
        }
    }

    /// Rotate `x` `[B, H, L, D]` at positions offset..offset+L. Non-traditional rope reads cos/sin
    /// from a cached table and applies MLX's fallback formula (x1 cos - x2 sin, x1 sin + x2 cos, then
    /// the unrotated rest), which gives bit-identical results with about half the graph nodes.
    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        let x = &self.pre_scale(x)?;
        // The cos/sin table pays off only on the CPU, where MLX's rope is an op-by-op fallback; on a
        // GPU (Metal, CUDA) `fast::rope` is one fused kernel and is what mlx-lm runs there.
        if self.traditional || x.ndim() != 4 || offset < 0 || on_gpu() {
            return self.mlx_rope(x, offset);
        }
        let l = x.dim(2);
        let (cos, sin) = self.table(offset + l, x.dtype())?;
        let c = mx::slice_axis(&cos, 2, offset, offset + l)?;
        let s = mx::slice_axis(&sin, 2, offset, offset + l)?;
        self.rotate(x, &c, &s)
    }

    /// MLX's fallback formula ([`rotate`]) with cos `c` and sin `s` broadcast against `x`'s first
    /// half-dims. One token per row (a decode step), on the CPU, as one compiled function per rotated
    /// width, traced once per input shape (the nine slices, products and sums, one op to build
    /// instead of nine; on this CPU bit-identical: MLX compiles its CPU kernels without FMA
    /// contraction, `compiled_rope_is_bit_identical`); [`COMPILED_ROPE_ENV`] `0` turns it off.
    fn rotate(&self, x: &Array, c: &Array, s: &Array) -> Result<Array> {
        if x.dim(2) != 1 || std::env::var(COMPILED_ROPE_ENV).is_ok_and(|v| v.trim() == "0") {
            return rotate(self.dims, x, c, s);
        }
        static SLOTS: KeyedSlots<i32> = std::sync::OnceLock::new();
        let dims = self.dims;
        let slot = keyed_compiled(&SLOTS, dims, || {
            mx::Compiled::new(move |a: &[Array]| Ok(vec![rotate(dims, &a[0], &a[1], &a[2])?]), false)
        });
        match slot {
            Some(f) => call_compiled(&f, &[x, c, s], "rope"),
            None => rotate(dims, x, c, s),
        }
    }

    /// Rotate `x` `[B, H, 1, D]` (one decode token per row) with row b at position `offsets[b]`:
    /// the same values as [`Rope::forward`] on each row alone, in one set of ops for the batch.
    pub fn forward_rows(&self, x: &Array, offsets: &[i32]) -> Result<Array> {
        let x = &self.pre_scale(x)?;
        let b = offsets.len() as i32;
        if self.traditional || x.ndim() != 4 || x.dim(2) != 1 || offsets.iter().any(|&o| o < 0) || on_gpu() {
            let off = Array::from_slice(offsets, &[b])?;
            return match &self.freqs {
                Some(f) => mx::rope_rows(x, self.dims, self.traditional, None, self.scale, &off, Some(f)),
                None => mx::rope_rows(x, self.dims, self.traditional, Some(self.base), self.scale, &off, None),
            };
        }
        let half = self.dims / 2;
        let max = offsets.iter().copied().max().unwrap_or(0);
        let (cos, sin) = self.table(max + 1, x.dtype())?;
        let idx = Array::from_slice(offsets, &[b])?;
        let rows = |t: &Array| -> Result<Array> {
            let flat = mx::reshape(t, &[t.dim(2), half])?;
            mx::reshape(&mx::take(&flat, &idx, 0)?, &[b, 1, 1, half])
        };
        self.rotate(x, &rows(&cos)?, &rows(&sin)?)
    }

    /// cos and sin `[1, 1, len', dims/2]` (len' >= len) in `dtype`. They are computed by MLX's own
    /// rope applied to rows [1, .., 1, 0, .., 0] (x1 = 1, x2 = 0 gives exactly cos and sin), so they
    /// are the values its fallback computes, bit for bit.
    fn table(&self, len: i32, dtype: Dtype) -> Result<(Array, Array)> {
        let key: RopeKey = (self.dims, self.base.to_bits(), self.scale.to_bits(), self.freq_bits.clone(), dtype);
        let tables = ROPE_TABLES.get_or_init(Default::default);
        let mut tables = tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, s, n)) = tables.get(&key) {
            if *n >= len {
                return Ok((c.clone(), s.clone()));
            }
        }
        let n = (len.max(1024) as u32).checked_next_power_of_two().map_or(len, |n| n as i32);
        let half = self.dims / 2;
        let row: Vec<f32> = (0..self.dims).map(|i| if i < half { 1.0 } else { 0.0 }).collect();
        let ident = mx::broadcast_to(&Array::from_slice(&row, &[1, 1, 1, self.dims])?, &[1, 1, n, self.dims])?;
        let t = self.mlx_rope(&ident, 0)?;
        let c = mx::contiguous(&mx::astype(&mx::slice_axis(&t, 3, 0, half)?, dtype)?)?;
        let s = mx::contiguous(&mx::astype(&mx::slice_axis(&t, 3, half, self.dims)?, dtype)?)?;
        mx::eval(&[&c, &s])?;
        tables.insert(key, (c.clone(), s.clone(), n));
        Ok((c, s))
    }
}

/// Per-head normalisation of queries/keys (Qwen3, Gemma 3).
pub struct QkNorm {
    pub q: RmsNorm,
    pub k: RmsNorm,
}

/// The query, key and value projections of an [`Attention`].
pub enum Qkv {
    Separate {
        q: Linear,
        k: Linear,
        v: Linear,
    },
    /// One linear whose output is the query heads, then the key heads, then the value heads
    /// ([`Attention::fuse`]): one matmul instead of three, and q, k, v as views of its output.
    Fused(Linear),
}

impl Qkv {
    /// The three projections of `{prefix}.{q,k,v}_proj` (`[q_out, hidden]`, `[kv_out, hidden]` twice).
    pub fn load(ws: &mut Weights, prefix: &str, bias: bool, q_out: i32, kv_out: i32, hidden: i32) -> Result<Qkv> {
        Ok(Qkv::Separate {
            q: Linear::load(ws, &format!("{prefix}.q_proj"), bias, q_out, hidden)?,
            k: Linear::load(ws, &format!("{prefix}.k_proj"), bias, kv_out, hidden)?,
            v: Linear::load(ws, &format!("{prefix}.v_proj"), bias, kv_out, hidden)?,
        })
    }

    /// The separate projections (None once fused).
    pub fn separate(&self) -> Option<(&Linear, &Linear, &Linear)> {
        match self {
            Qkv::Separate { q, k, v } => Some((q, k, v)),
            Qkv::Fused(_) => None,
        }
    }
}

/// How [`Attention::attend_many_rotated`] rotates q and k.
#[derive(Clone, Copy)]
pub enum Rotation<'a> {
    /// The rotary embedding at each row's position; then the queries times the scale where given
    /// (`[rows or 1, 1, L, 1]`, in the queries' dtype).
    Rope(Option<&'a Array>),
    /// None: q and k come rotated ([`Attention::project_roped`]).
    Done,
}

/// Multi-head attention with grouped KV heads over an external cache.
pub struct Attention {
    pub qkv: Qkv,
    pub o_proj: Linear,
    pub qk_norm: Option<QkNorm>,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub rope: Rope,
}

impl Attention {
    pub fn forward(&self, x: &Array, mask: &Mask, cache: &mut LayerCache) -> Result<Array> {
        self.forward_sinks(x, mask, cache, None)
    }

    /// [`Attention::forward`] with per-head attention sinks `[heads]` (gpt_oss) when given.
    pub fn forward_sinks(
        &self,
        x: &Array,
        mask: &Mask,
        cache: &mut LayerCache,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let out = match self.project_roped(x, None, || vec![cache.offset()])? {
            Some((q, k, v)) => self.attend_roped(q, k, v, mask, cache, sinks)?,
            None => {
                let (q, k, v) = self.project(x)?;
                self.attend(q, k, v, mask, cache, sinks)?
            }
        };
        self.output(&out, b, l)
    }

    /// Attention over a batch (the engine's batched decode). The projections always run batched.
    /// Over a [`crate::cache::BatchKv`] layer the rest does too: rotary embedding at each row's
    /// offset, one write of every row's keys, one masked attention. Over rows with caches of their
    /// own (rotating, quantized), the cache update and the attention run per row, over exactly the
    /// keys that row alone would see.
    pub fn forward_many(&self, x: &Array, masks: &Masks, caches: LayerCaches) -> Result<Array> {
        self.forward_many_sinks(x, masks, caches, None)
    }

    /// [`Attention::forward_many`] with per-head attention sinks `[heads]` (gpt_oss) when given.
    pub fn forward_many_sinks(
        &self,
        x: &Array,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let out = self.project_attend_many(x, masks, caches, sinks)?;
        self.output(&out, b, l)
    }

    /// `res + forward_many_sinks(..)`, the residual added by the output projection
    /// ([`Linear::forward_add`]).
    pub fn forward_many_sinks_add(
        &self,
        x: &Array,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
        res: &Array,
    ) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let out = self.project_attend_many(x, masks, caches, sinks)?;
        self.output_add(&out, b, l, res)
    }

    /// `h + forward_many_sinks(norm(h), ..)`, a pre-norm block's attention with its residual: in a
    /// decode step on CUDA the norm in the q/k/v kernel's prologue and the rotary embedding in its
    /// epilogue ([`Attention::project_roped`]); elsewhere the norm first.
    pub fn forward_normed_add(
        &self,
        h: &Array,
        norm: &RmsNorm,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        if let Some((q, k, v)) = self.project_roped(h, Some(norm), || caches.offsets())? {
            let out = self.attend_many_rotated(q, k, v, masks, caches, sinks, Rotation::Done)?;
            return self.output_add(&out, h.dim(0), h.dim(1), h);
        }
        self.forward_many_sinks_add(&norm.forward(h)?, masks, caches, sinks, h)
    }

    /// The projections and [`Attention::attend_many`]: q and k rotated by the projection's kernel
    /// where [`Attention::project_roped`] applies.
    fn project_attend_many(
        &self,
        x: &Array,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        if let Some((q, k, v)) = self.project_roped(x, None, || caches.offsets())? {
            return self.attend_many_rotated(q, k, v, masks, caches, sinks, Rotation::Done);
        }
        let (q, k, v) = self.project(x)?;
        self.attend_many(q, k, v, masks, caches, sinks)
    }

    /// q and k rotated at each row's position (`offsets()`, asked only where the rest applies; one
    /// token per row: a decode step) and v,
    /// `[B, heads, 1, head_dim]`, from one kernel: CUDA's quantized matvec of the fused q/k/v with the
    /// rotary embedding as its epilogue ([`super::qmv::qkv_rope`]; 3 ops a layer fewer than
    /// [`Attention::project`] and the two ropes). Where it takes them: a GPU, fused q/k/v without a
    /// per-head norm, a rope over the whole head without YaRN's scaling. None elsewhere.
    fn project_roped(
        &self,
        x: &Array,
        norm: Option<&RmsNorm>,
        offsets: impl FnOnce() -> Vec<i32>,
    ) -> Result<Option<(Array, Array, Array)>> {
        let Qkv::Fused(f) = &self.qkv else { return Ok(None) };
        let rope = &self.rope;
        if !on_gpu()
            || x.ndim() != 3
            || x.dim(1) != 1
            || self.qk_norm.is_some()
            || rope.dims != self.head_dim
            || rope.mscale != 1.0
        {
            return Ok(None);
        }
        let offsets = offsets();
        if x.dim(0) as usize != offsets.len() || offsets.iter().any(|&o| o < 0) {
            return Ok(None);
        }
        f.qkv_rope_into(
            x,
            norm,
            &super::qmv::QkvRope {
                positions: &offsets,
                freqs: rope.freqs.as_ref(),
                base: rope.base,
                scale: rope.scale,
                traditional: rope.traditional,
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
            },
        )
    }

    /// The attention of [`Attention::forward_many`] for q, k, v already projected (`[B, heads, L,
    /// head_dim]`, before the rotary embedding): `[B, heads, L, head_dim]`, before the output
    /// projection. For architectures that project (or gate) differently.
    pub fn attend_many(
        &self,
        q: Array,
        k: Array,
        v: Array,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        self.attend_many_rotated(q, k, v, masks, caches, sinks, Rotation::Rope(None))
    }

    /// [`Attention::attend_many`] with the rotation `rot`: the rotary embedding, with the rotated
    /// queries times a scale where given (Llama 4's position-dependent scale, ministral3: multiplied
    /// after the rotary embedding as mlx-lm does), or none (q and k rotated by the projection's kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_many_rotated(
        &self,
        q: Array,
        k: Array,
        v: Array,
        masks: &Masks,
        caches: LayerCaches,
        sinks: Option<&Array>,
        rot: Rotation,
    ) -> Result<Array> {
        let (q_scale, roped) = match rot {
            Rotation::Rope(s) => (s, false),
            Rotation::Done => (None, true),
        };
        // the scale of batch row `row` (all rows: None)
        let scaled = |q: Array, row: Option<usize>| -> Result<Array> {
            match (q_scale, row) {
                (None, _) => Ok(q),
                (Some(s), Some(i)) if s.dim(0) > 1 => mx::multiply(&q, &mx::slice_axis(s, 0, i as i32, i as i32 + 1)?),
                (Some(s), _) => mx::multiply(&q, s),
            }
        };
        let l = q.dim(2);
        let (caches, masks) = match (caches, masks) {
            (LayerCaches::Batch(kv, layer), Masks::Batch(mask, window)) => {
                // every row's keys in one stacked buffer: the same few ops for any batch size
                let (q, k) = if roped {
                    (q, k)
                } else {
                    (
                        scaled(self.rope.forward_rows(&q, kv.offsets())?, None)?,
                        self.rope.forward_rows(&k, kv.offsets())?,
                    )
                };
                let kernel = sinks.is_none() && super::decode_attn::takes(&q, &k, &v, kv.offsets());
                let (kb, vb) = kv.append(layer, &k, &v)?;
                if kernel {
                    // the buffers with the rows' positions: no views, no mask
                    if let Some(o) = super::decode_attn::attention(&q, &kb, &vb, kv.offsets(), self.scale, *window)? {
                        return Ok(o);
                    }
                }
                let (kk, vv) = kv.view(&kb, &vb)?;
                return super::sdpa::attention(&q, &kk, &vv, self.scale, AttnMask::Array(mask), sinks);
            }
            (LayerCaches::Rows(c), Masks::Rows(m)) => (c, m),
            _ => return Err(crate::error::Error::Invalid("attention: masks and caches of different kinds".into())),
        };
        let mut caches = caches;
        if caches.len() == 1 {
            if roped {
                return self.attend_roped(q, k, v, &masks[0], caches[0], sinks);
            }
            if q_scale.is_none() {
                return self.attend(q, k, v, &masks[0], caches[0], sinks);
            }
            let o = caches[0].offset();
            let q = scaled(self.rope.forward(&q, o)?, None)?;
            let k = self.rope.forward(&k, o)?;
            return self.attend_roped(q, k, v, &masks[0], caches[0], sinks);
        }
        let n = caches.len() as i32;
        let offsets: Vec<i32> = caches.iter().map(|c| c.offset()).collect();
        // one token per row (a decode step): the rotary embedding for all rows at once
        let (q, k, roped) = if roped {
            (q, k, true)
        } else if l == 1 {
            (scaled(self.rope.forward_rows(&q, &offsets)?, None)?, self.rope.forward_rows(&k, &offsets)?, true)
        } else {
            (q, k, false)
        };
        let (qs, ks, vs) = (mx::split(&q, n, 0)?, mx::split(&k, n, 0)?, mx::split(&v, n, 0)?);
        if roped && rows_attention_applies(&q, sinks, masks) {
            // float32 on the CPU: every row's cache updated, then one op attends for all rows
            let fetched: Vec<Fetched> =
                caches.iter_mut().zip(ks).zip(vs).map(|((c, k), v)| c.update_and_fetch(k, v)).collect::<Result<_>>()?;
            if let Some(o) = rows_op(&q, &fetched, self.scale)? {
                return Ok(o);
            }
            let outs: Vec<Array> = qs
                .iter()
                .zip(&fetched)
                .zip(masks)
                .map(|((q, f), m)| attend_fetched(q, f, self.scale, m, sinks))
                .collect::<Result<_>>()?;
            let refs: Vec<&Array> = outs.iter().collect();
            return mx::concatenate(&refs, 0);
        }
        let mut outs = Vec::with_capacity(caches.len());
        for (i, (((cache, mask), (q, k)), v)) in
            caches.iter_mut().zip(masks).zip(qs.into_iter().zip(ks)).zip(vs).enumerate()
        {
            let (q, k) = if roped {
                (q, k)
            } else {
                let o = cache.offset();
                (scaled(self.rope.forward(&q, o)?, Some(i))?, self.rope.forward(&k, o)?)
            };
            outs.push(self.attend_roped(q, k, v, mask, cache, sinks)?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        mx::concatenate(&refs, 0)
    }

    /// The q, k and v projections as one linear ([`Qkv::Fused`]) when [`Linear::concat`] can
    /// stack them (else unchanged): the decode step then builds one matmul, one reshape, one
    /// transpose and one split where it built three matmuls, reshapes and transposes.
    pub fn fuse(mut self) -> Result<Attention> {
        self.qkv = match self.qkv {
            Qkv::Separate { q, k, v } => match Linear::concat(vec![q, k, v])? {
                Ok(f) => Qkv::Fused(f),
                Err(parts) => {
                    let mut it = parts.into_iter();
                    match (it.next(), it.next(), it.next()) {
                        (Some(q), Some(k), Some(v)) => Qkv::Separate { q, k, v },
                        _ => return Err(crate::Error::Invalid("fusing q/k/v lost a projection".into())),
                    }
                }
            },
            fused => fused,
        };
        Ok(self)
    }

    /// q, k, v as `[B, heads, L, head_dim]` (before the rotary embedding).
    pub(crate) fn project(&self, x: &Array) -> Result<(Array, Array, Array)> {
        let sh = x.shape();
        let (b, l) = (sh[0], sh[1]);
        let perm = [0, 2, 1, 3];
        let (q_out, kv_out) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        let separate = match &self.qkv {
            Qkv::Separate { q, k, v } => Some((q.forward(x)?, k.forward(x)?, v.forward(x)?)),
            // long inputs (prefill) through the fused weight's parts: separate outputs
            Qkv::Fused(f) if b * l > FUSED_MAX_ROWS => {
                let mut p = f.forward_parts(x, &[q_out, kv_out, kv_out])?.into_iter();
                match (p.next(), p.next(), p.next()) {
                    (Some(q), Some(k), Some(v)) => Some((q, k, v)),
                    _ => return Err(crate::Error::Mlx("the fused q/k/v did not give three parts".into())),
                }
            }
            Qkv::Fused(_) => None,
        };
        if let Some((q, k, v)) = separate {
            let heads = |t: Array, n: i32| -> Result<Array> { mx::reshape(&t, &[b, l, n, -1]) };
            let mut q = heads(q, self.n_heads)?;
            let mut k = heads(k, self.n_kv_heads)?;
            let v = heads(v, self.n_kv_heads)?;
            if let Some(n) = &self.qk_norm {
                q = n.q.forward(&q)?;
                k = n.k.forward(&k)?;
            }
            return Ok((
                mx::transpose_axes(&q, &perm)?,
                mx::transpose_axes(&k, &perm)?,
                mx::transpose_axes(&v, &perm)?,
            ));
        }
        let Qkv::Fused(f) = &self.qkv else {
            return Err(crate::Error::Invalid("q/k/v neither separate nor fused".into()));
        };
        // [B, L, heads + 2 kv_heads, head_dim] → [B, all heads, L, head_dim], split by head
        // (one token: the transpose moves a length-1 axis, a reshape alone gives it)
        let all = self.n_heads + 2 * self.n_kv_heads;
        let y = if l == 1 {
            let heads = [b, all, 1, self.head_dim];
            match f.qmv_into(x, Epilogue::Plain, Some(&heads))? {
                Some(y) => y,
                None => mx::reshape(&f.forward(x)?, &heads)?,
            }
        } else {
            mx::transpose_axes(&mx::reshape(&f.forward(x)?, &[b, l, all, self.head_dim])?, &perm)?
        };
        let mut parts = mx::split_sections(&y, &[self.n_heads, self.n_heads + self.n_kv_heads], 1)?.into_iter();
        let (Some(mut q), Some(mut k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(crate::Error::Mlx("the split of the fused q/k/v did not give three parts".into()));
        };
        // the per-head norm normalises each head's last axis: the same values in this layout
        if let Some(n) = &self.qk_norm {
            q = n.q.forward(&q)?;
            k = n.k.forward(&k)?;
        }
        Ok((q, k, v))
    }

    /// Rotary embedding at the cache's offset, cache update, attention: `[B, heads, L, head_dim]`.
    fn attend(
        &self,
        q: Array,
        k: Array,
        v: Array,
        mask: &Mask,
        cache: &mut LayerCache,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        let offset = cache.offset();
        let q = self.rope.forward(&q, offset)?;
        let k = self.rope.forward(&k, offset)?;
        self.attend_roped(q, k, v, mask, cache, sinks)
    }

    /// Cache update and attention for q, k already rotated.
    fn attend_roped(
        &self,
        q: Array,
        k: Array,
        v: Array,
        mask: &Mask,
        cache: &mut LayerCache,
        sinks: Option<&Array>,
    ) -> Result<Array> {
        // one sequence's decode step on CUDA: the kernel over the cache's buffers at the step's position
        if let LayerCache::Full(kv) = cache {
            let pos = [kv.offset];
            if matches!(mask, Mask::None) && sinks.is_none() && super::decode_attn::takes(&q, &k, &v, &pos) {
                let (kb, vb) = kv.append(&k, &v)?;
                if let Some(o) = super::decode_attn::attention(&q, &kb, &vb, &pos, self.scale, None)? {
                    return Ok(o);
                }
                let (kk, vv) = kv.view(&kb, &vb)?;
                return attend_fetched(&q, &Fetched::Dense(kk, vv), self.scale, mask, sinks);
            }
        }
        let fetched = cache.update_and_fetch(k, v)?;
        // one sequence's decode step on the CPU: the rows op too (MLX's attention of one query makes
        // two BLAS products per head, each waking OpenBLAS's threads, which then spin beside the host
        // kernels' threads)
        if q.dim(0) == 1 && q.dim(2) == 1 && rows_attention_applies(&q, sinks, std::slice::from_ref(mask)) {
            if let Some(o) = rows_op(&q, std::slice::from_ref(&fetched), self.scale)? {
                return Ok(o);
            }
        }
        attend_fetched(&q, &fetched, self.scale, mask, sinks)
    }

    /// The heads `[B, heads, L, head_dim]` back to `[B, L, hidden]` through the output projection.
    pub(crate) fn output(&self, out: &Array, b: i32, l: i32) -> Result<Array> {
        self.o_proj.forward(&Self::merge_heads(out, b, l)?)
    }

    /// [`Attention::output`] plus `res` ([`Linear::forward_add`]).
    pub(crate) fn output_add(&self, out: &Array, b: i32, l: i32, res: &Array) -> Result<Array> {
        // one token: the heads `[B, heads, 1, head_dim]` are already the projection's rows in order
        if l == 1 {
            if let Some(y) = self.o_proj.qmv_into(out, Epilogue::Residual(res), Some(&res.shape()))? {
                return Ok(y);
            }
        }
        self.o_proj.forward_add(&Self::merge_heads(out, b, l)?, res)
    }

    fn merge_heads(out: &Array, b: i32, l: i32) -> Result<Array> {
        // one token: [B, heads, 1, head_dim] has [B, 1, heads, head_dim]'s order, a reshape alone
        let out = if l == 1 { out.clone() } else { mx::transpose_axes(out, &[0, 2, 1, 3])? };
        mx::reshape(&out, &[b, l, -1])
    }
}

/// Attention of `q` `[B, heads, L, head_dim]` (rotated) over what a cache returned (mlx-lm's
/// `scaled_dot_product_attention`: [`super::sdpa::attention`], or the quantized path for a quantized cache),
/// with per-head attention sinks `[heads]` (gpt_oss) when given.
pub fn attend_fetched(q: &Array, fetched: &Fetched, scale: f32, mask: &Mask, sinks: Option<&Array>) -> Result<Array> {
    match fetched {
        Fetched::Dense(k, v) => super::sdpa::attention_masked(q, k, v, scale, mask, sinks),
        // mlx-lm refuses the same ("Quantized SDPA does not support attention sinks")
        Fetched::Quant { .. } if sinks.is_some() => {
            Err(crate::Error::Unsupported("a quantized KV cache (kv_bits) with attention sinks (gpt_oss)".into()))
        }
        Fetched::Quant { k, v, q: spec } => quantized_sdpa(q, k, v, scale, mask, *spec),
    }
}

/// Whether [`quantized_sdpa`] dequantizes the cache for `rows` float32 queries: on the CPU, from
/// [`dequant_rows`] rows on (a prefill chunk), the keys and values dequantized to float32 (exact: the
/// cache's scales and biases are float32 there) and MLX's BLAS-backed matmul instead of its CPU
/// quantized matmul — the same values up to float32 summation order, at one layer's float32 keys and
/// values of transient memory (`plan.rs` counts it); a 3000-token prompt into an 8-bit cache
/// prefilled ~3× faster (bench/RESULTS.md). Decode steps keep the quantized matmul (it reads a
/// quarter of the bytes). bfloat16 queries keep MLX's path too (mlx-lm's rounding, which the parity
/// tests compare with bit for bit).
fn dequant_kv(q: &Array, rows: i32, spec: QuantSpec) -> bool {
    backend().dequant_float32()
        && q.dtype() == Dtype::Float32
        && usize::try_from(rows).is_ok_and(|r| r >= dequant_rows(spec.bits))
}

/// mlx-lm's quantized_scaled_dot_product_attention.
fn quantized_sdpa(
    q: &Array,
    k: &[Array; 3],
    v: &[Array; 3],
    scale: f32,
    mask: &Mask,
    spec: QuantSpec,
) -> Result<Array> {
    let sh = q.shape();
    let (b, nq, l, d) = (sh[0], sh[1], sh[2], sh[3]);
    let nkv = k[0].dim(-3);
    let rep = nq / nkv;
    let mut q = mx::multiply(q, &mx::scalar_as(scale as f64, q.dtype())?)?;
    // the cache's keys and values as float32 arrays (`dequant_kv`), or their packed triples
    let deq = |t: &[Array; 3]| -> Result<Array> {
        let a = mx::dequantize(&t[0], &t[1], Some(&t[2]), spec.group_size, spec.bits, spec.mode)?;
        if a.dtype() == Dtype::Float32 {
            Ok(a)
        } else {
            mx::astype(&a, Dtype::Float32)
        }
    };
    let (k, v): (Vec<Array>, Vec<Array>) =
        if dequant_kv(&q, l, spec) { (vec![deq(k)?], vec![deq(v)?]) } else { (k.to_vec(), v.to_vec()) };
    let (kk, vv): (Vec<Array>, Vec<Array>) = if rep > 1 {
        q = mx::reshape(&q, &[b, nkv, rep, l, d])?;
        (
            k.iter().map(|a| mx::expand_dims(a, -3)).collect::<Result<_>>()?,
            v.iter().map(|a| mx::expand_dims(a, -3)).collect::<Result<_>>()?,
        )
    } else {
        (k, v)
    };
    let mut scores = match kk.as_slice() {
        [kd] => mx::matmul(&q, &mx::swapaxes(kd, -1, -2)?)?,
        _ => mx::quantized_matmul(&q, &kk[0], &kk[1], Some(&kk[2]), true, spec.group_size, spec.bits, spec.mode)?,
    };
    match mask {
        Mask::None => {}
        Mask::Causal => {
            let sh = scores.shape();
            let (ql, kl) = (sh[sh.len() - 2], sh[sh.len() - 1]);
            let qi = mx::arange((kl - ql) as f64, kl as f64, 1.0, Dtype::Int32)?;
            let ki = mx::arange(0.0, kl as f64, 1.0, Dtype::Int32)?;
            let m = mx::greater_equal(&mx::expand_dims(&qi, 1)?, &mx::expand_dims(&ki, 0)?)?;
            scores = mask_fill(&scores, &m)?;
        }
        Mask::Array(m) => scores = mask_fill(&scores, m)?,
    }
    let probs = mx::softmax(&scores, &[-1], true)?;
    let out = match vv.as_slice() {
        [vd] => mx::matmul(&probs, vd)?,
        _ => mx::quantized_matmul(&probs, &vv[0], &vv[1], Some(&vv[2]), false, spec.group_size, spec.bits, spec.mode)?,
    };
    if rep > 1 {
        mx::reshape(&out, &[b, nq, l, d])
    } else {
        Ok(out)
    }
}

fn mask_fill(scores: &Array, m: &Array) -> Result<Array> {
    if m.dtype() == Dtype::Bool {
        let min = mx::scalar_as(finfo_min(scores.dtype()), scores.dtype())?;
        mx::where_(m, scores, &min)
    } else {
        mx::add(scores, m)
    }
}

/// The most negative finite value of a float dtype.
pub fn finfo_min(d: Dtype) -> f64 {
    match d {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => -3.3895313892515355e38,
        Dtype::Float64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

/// Gated MLP: `down(act(gate(x)) * up(x))`.
pub struct Mlp {
    pub gate_up: GateUp,
    pub down: Linear,
    pub act: Activation,
}

/// The gate and up projections of an [`Mlp`].
pub enum GateUp {
    Separate {
        gate: Linear,
        up: Linear,
    },
    /// One linear whose output is the gate's, then up's ([`Mlp::fuse`]).
    Fused(Linear),
}

#[derive(Clone, Copy)]
pub enum Activation {
    Silu,
    /// `gelu_approx(gate) * up` with the GELU compiled alone (mlx-lm's Gemma 3: `nn.gelu_approx(g) * x`)
    GeluApprox,
    /// the same compiled as one function (mlx-lm's Gemma 4 `geglu`): on a GPU one fused kernel,
    /// whose rounding differs from the GELU kernel followed by a multiply
    Geglu,
}

impl Mlp {
    /// gate and up `[inter, hidden]`, down `[hidden, inter]`.
    pub fn load(ws: &mut Weights, prefix: &str, bias: bool, act: Activation, hidden: i32, inter: i32) -> Result<Mlp> {
        Ok(Mlp {
            gate_up: GateUp::Separate {
                gate: Linear::load(ws, &format!("{prefix}.gate_proj"), bias, inter, hidden)?,
                up: Linear::load(ws, &format!("{prefix}.up_proj"), bias, inter, hidden)?,
            },
            down: Linear::load(ws, &format!("{prefix}.down_proj"), bias, hidden, inter)?,
            act,
        })
    }

    /// The gate and up projections as one linear ([`GateUp::Fused`]) when [`Linear::concat`]
    /// can stack them (else unchanged): one matmul and one split where there were two matmuls.
    pub fn fuse(mut self) -> Result<Mlp> {
        self.gate_up = match self.gate_up {
            GateUp::Separate { gate, up } => match Linear::concat(vec![gate, up])? {
                Ok(f) => GateUp::Fused(f),
                Err(parts) => {
                    let mut it = parts.into_iter();
                    match (it.next(), it.next()) {
                        (Some(gate), Some(up)) => GateUp::Separate { gate, up },
                        _ => return Err(crate::Error::Invalid("fusing gate/up lost a projection".into())),
                    }
                }
            },
            fused => fused,
        };
        Ok(self)
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.down.forward(&self.activated(x)?)
    }

    /// `res + forward(x)`, the residual added by the down projection ([`Linear::forward_add`]).
    pub fn forward_add(&self, x: &Array, res: &Array) -> Result<Array> {
        self.down.forward_add(&self.activated(x)?, res)
    }

    /// `h + forward(norm(h))`, a pre-norm block's MLP with its residual: in a decode step on CUDA
    /// the norm in the fused gate/up kernel's prologue (with its SwiGLU epilogue); elsewhere the norm
    /// first.
    pub fn forward_normed_add(&self, h: &Array, norm: &RmsNorm) -> Result<Array> {
        if let (GateUp::Fused(f), Activation::Silu) = (&self.gate_up, &self.act) {
            if let Some(a) = f.qmv_normed_into(h, Some(norm), Epilogue::SwiGlu, None)? {
                return self.down.forward_add(&a, h);
            }
        }
        self.forward_add(&norm.forward(h)?, h)
    }

    /// The activation of the gate and up projections: the down projection's input.
    fn activated(&self, x: &Array) -> Result<Array> {
        let (g, u) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused(f) if x.size() / (x.dim(-1).max(1) as usize) > FUSED_MAX_ROWS as usize => {
                // long inputs (prefill) through the fused weight's parts: separate outputs
                let inter = f.out_rows()? / 2;
                let mut p = f.forward_parts(x, &[inter, inter])?.into_iter();
                match (p.next(), p.next()) {
                    (Some(g), Some(u)) => (g, u),
                    _ => return Err(crate::Error::Mlx("the fused gate/up did not give two parts".into())),
                }
            }
            GateUp::Fused(f) => {
                // CUDA's quantized matvec: the product and the SwiGLU in one kernel
                if matches!(self.act, Activation::Silu) {
                    if let Some(y) = f.qmv_into(x, Epilogue::SwiGlu, None)? {
                        return Ok(y);
                    }
                }
                let y = f.forward(x)?;
                let rows = y.size() / (y.dim(-1).max(1) as usize);
                if matches!(self.act, Activation::Silu) && rows <= COMPILED_NORM_MAX_ROWS {
                    return compiled_as(&SPLIT_SWIGLU, split_swiglu, &[&y], false);
                }
                let mut parts = mx::split(&y, 2, -1)?.into_iter();
                let (Some(g), Some(u)) = (parts.next(), parts.next()) else {
                    return Err(crate::Error::Mlx("the split of the fused gate/up did not give two parts".into()));
                };
                (g, u)
            }
        };
        match self.act {
            Activation::Silu => compiled(&SWIGLU, swiglu, &[&g, &u]),
            Activation::GeluApprox => geglu(&g, &u),
            Activation::Geglu => geglu_fused(&g, &u),
        }
    }
}

type CompiledSlot = std::sync::OnceLock<Option<std::sync::Mutex<mx::Compiled>>>;
static SWIGLU: CompiledSlot = std::sync::OnceLock::new();
static GELU_APPROX: CompiledSlot = std::sync::OnceLock::new();
static GELU: CompiledSlot = std::sync::OnceLock::new();
static GEGLU: CompiledSlot = std::sync::OnceLock::new();
static SOFTCAP: CompiledSlot = std::sync::OnceLock::new();

static SPLIT_SWIGLU: CompiledSlot = std::sync::OnceLock::new();

/// [`swiglu`] of the two halves of a fused gate/up output `[..., 2 inter]`: the split inside the
/// compiled function, one op to build where the split and the activation were two. Traced per
/// input shape (the halves' bounds are the traced shape's), so for decode-sized inputs only
/// ([`COMPILED_NORM_MAX_ROWS`] rows, as the compiled norm).
fn split_swiglu(a: &[Array]) -> Result<Vec<Array>> {
    let y = &a[0];
    let w = y.dim(-1) / 2;
    let ax = y.ndim() as i32 - 1;
    swiglu(&[mx::slice_axis(y, ax, 0, w)?, mx::slice_axis(y, ax, w, 2 * w)?])
}

/// `silu(gate) * up`, as mlx-lm's compiled `swiglu`.
fn swiglu(a: &[Array]) -> Result<Vec<Array>> {
    let g = &a[0];
    Ok(vec![mx::multiply(&mx::multiply(g, &mx::sigmoid(g)?)?, &a[1])?])
}

/// Run `f` through MLX's compiler (shapeless, like mlx-lm's `@mx.compile(shapeless=True)`
/// activations: one fused kernel on a GPU); falls back to the plain ops if compilation fails.
fn compiled(slot: &'static CompiledSlot, f: fn(&[Array]) -> Result<Vec<Array>>, args: &[&Array]) -> Result<Array> {
    compiled_as(slot, f, args, true)
}

/// [`compiled`], traced once per input shape unless `shapeless`.
fn compiled_as(
    slot: &'static CompiledSlot,
    f: fn(&[Array]) -> Result<Vec<Array>>,
    args: &[&Array],
    shapeless: bool,
) -> Result<Array> {
    let c = slot.get_or_init(|| mx::Compiled::new(f, shapeless).ok().map(std::sync::Mutex::new));
    let out = match c {
        Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).call(args)?,
        None => f(&args.iter().map(|a| (*a).clone()).collect::<Vec<_>>())?,
    };
    out.into_iter().next().ok_or_else(|| crate::Error::Mlx("compiled activation returned nothing".into()))
}

/// `gelu_approx(gate) * up` (the GELU activation compiled, as mlx.nn.gelu_approx is).
pub fn geglu(gate: &Array, up: &Array) -> Result<Array> {
    mx::multiply(&gelu_approx_compiled(gate)?, up)
}

/// `gelu_approx(x)` compiled alone, as `mlx.nn.gelu_approx` (a `@mx.compile(shapeless=True)` function).
pub fn gelu_approx_compiled(x: &Array) -> Result<Array> {
    compiled(&GELU_APPROX, |a| Ok(vec![gelu_approx(&a[0])?]), &[x])
}

/// `x (1 + erf(x / √2)) / 2` compiled alone, as `mlx.nn.gelu` (a `@mx.compile(shapeless=True)`
/// function).
pub fn gelu_compiled(x: &Array) -> Result<Array> {
    compiled(
        &GELU,
        |a| {
            let x = &a[0];
            let c = |v: f64| mx::scalar_as(v, x.dtype());
            let e = mx::erf(&mx::divide(x, &c(std::f64::consts::SQRT_2)?)?)?;
            Ok(vec![mx::divide(&mx::multiply(x, &mx::add(&c(1.0)?, &e)?)?, &c(2.0)?)?])
        },
        &[x],
    )
}

/// `gelu_approx(gate) * up` compiled as one function (mlx-lm's Gemma 4 `geglu`).
pub fn geglu_fused(gate: &Array, up: &Array) -> Result<Array> {
    compiled(&GEGLU, |a| Ok(vec![mx::multiply(&gelu_approx(&a[0])?, &a[1])?]), &[gate, up])
}

/// `tanh(x / cap) * cap` compiled as one function (mlx-lm's `logit_softcap`); `cap` a scalar array
/// of `x`'s dtype.
pub fn logit_softcap(x: &Array, cap: f32) -> Result<Array> {
    let c = mx::scalar_as(cap as f64, x.dtype())?;
    compiled(&SOFTCAP, |a| Ok(vec![mx::multiply(&mx::tanh(&mx::divide(&a[0], &a[1])?)?, &a[1])?]), &[x, &c])
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, as mlx.nn.gelu_approx.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    let dt = x.dtype();
    let c = |v: f64| mx::scalar_as(v, dt);
    let x3 = mx::power(x, &c(3.0)?)?;
    let inner =
        mx::multiply(&c((2.0 / std::f64::consts::PI).sqrt())?, &mx::add(x, &mx::multiply(&c(0.044715)?, &x3)?)?)?;
    let t = mx::add(&c(1.0)?, &mx::tanh(&inner)?)?;
    mx::multiply(&mx::multiply(&c(0.5)?, x)?, &t)
}

/// A layer's feed-forward part, as its [`super::FfnKind`] says.
pub enum Ffn {
    Dense(Mlp),
    Moe(Box<SparseMoe>),
}

impl Ffn {
    /// A SwiGLU MLP of width `inter` (the kind's own width when it gives one), or a sparse MoE
    /// with qwen3_moe's softmax router ([`MoeSpec::QWEN3`]).
    pub fn load(
        ws: &mut Weights,
        prefix: &str,
        bias: bool,
        kind: super::FfnKind,
        hidden: i32,
        inter: i32,
    ) -> Result<Ffn> {
        Ffn::load_with(ws, prefix, bias, kind, hidden, inter, &MoeSpec::QWEN3)
    }

    /// [`Ffn::load`] with a MoE of `spec`'s router and names.
    pub fn load_with(
        ws: &mut Weights,
        prefix: &str,
        bias: bool,
        kind: super::FfnKind,
        hidden: i32,
        inter: i32,
        spec: &MoeSpec,
    ) -> Result<Ffn> {
        Ok(match kind {
            super::FfnKind::Dense { intermediate } => {
                let inter = if intermediate > 0 { intermediate } else { inter };
                Ffn::Dense(Mlp::load(ws, prefix, bias, Activation::Silu, hidden, inter)?)
            }
            super::FfnKind::Moe { .. } => Ffn::Moe(Box::new(SparseMoe::load_spec(ws, prefix, kind, hidden, spec)?)),
        })
    }

    /// A dense FFN's gate and up projections fused ([`Mlp::fuse`]); a MoE unchanged.
    pub fn fuse(self) -> Result<Ffn> {
        Ok(match self {
            Ffn::Dense(m) => Ffn::Dense(m.fuse()?),
            moe => moe,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }

    /// `res + forward(x)` ([`Mlp::forward_add`] for a dense FFN).
    pub fn forward_add(&self, x: &Array, res: &Array) -> Result<Array> {
        match self {
            Ffn::Dense(m) => m.forward_add(x, res),
            Ffn::Moe(m) => mx::add(res, &m.forward(x)?),
        }
    }

    /// `h + forward(norm(h))` ([`Mlp::forward_normed_add`] for a dense FFN).
    pub fn forward_normed_add(&self, h: &Array, norm: &RmsNorm) -> Result<Array> {
        match self {
            Ffn::Dense(m) => m.forward_normed_add(h, norm),
            Ffn::Moe(m) => mx::add(h, &m.forward(&norm.forward(h)?)?),
        }
    }
}

/// How many rows (tokens × their experts) a step's routed product has at most to read each expert's
/// matrix in place on the CPU ([`host_half_gather`]): a decode step of up to 8
/// sequences with 8 experts each; more go through float32 tiles and the BLAS, as a prefill chunk's do.
const GATHER_IN_PLACE_ROWS: usize = 64;

/// `x @ W[idx]^T` for the routed experts of a 16-bit mixture on the CPU backend through the host op
/// ([`mx::host_half_gather_matmul`]): `x` `[..., 1, in]` broadcast against `idx` `[...]`, the result
/// `[..., 1, out]` of x's type (a prompt's rows grouped by expert, a decode step's each on a thread), the sums in
/// float32 rounded once. MLX's CPU `gather_mm` has only float32 (mlx-lm cannot run such a model on a
/// CPU), so this runs whatever [`CPU_HALF_ENV`] says. None elsewhere (a GPU, other dtypes or shapes, a
/// libmlxc without the op: MLX's op then, which says what it lacks).
fn host_half_gather(x: &Array, w: &Array, idx: &Array) -> Result<Option<Array>> {
    if on_gpu()
        || !matches!(w.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        || w.ndim() != 3
        || !(x.dtype() == w.dtype() || x.dtype() == Dtype::Float32)
        || x.ndim() < 2
        || x.dim(-2) != 1
        || x.dim(-1) != w.dim(2)
        || !matches!(idx.dtype(), Dtype::Int32 | Dtype::Uint32)
    {
        return Ok(None);
    }
    // the batch: x's leading axes broadcast against idx's (mlx-lm's SwitchGLU: x [B, L, 1, 1, in]
    // against [B, L, k]; sorted: [n, 1, in] against [n])
    let xs = x.shape();
    let lead = &xs[..xs.len() - 2];
    let is = idx.shape();
    let rank = lead.len().max(is.len());
    let pad = |s: &[i32]| -> Vec<i32> { std::iter::repeat_n(1, rank - s.len()).chain(s.iter().copied()).collect() };
    let (a, b) = (pad(lead), pad(&is));
    let mut batch = Vec::with_capacity(rank);
    for (p, q) in a.iter().zip(&b) {
        match (p, q) {
            _ if p == q => batch.push(*p),
            (1, _) => batch.push(*q),
            (_, 1) => batch.push(*p),
            _ => return Ok(None), // not broadcastable: MLX's op says why
        }
    }
    let n: i32 = batch.iter().product();
    let (cols, rows) = (w.dim(2), w.dim(1));
    let mut xshape = batch.clone();
    xshape.extend([1, cols]);
    let xr = mx::reshape(&mx::broadcast_to(x, &xshape)?, &[n, cols])?;
    let ir = mx::reshape(&mx::broadcast_to(idx, &batch)?, &[n])?;
    let Some(y) = mx::host_half_gather_matmul(&xr, w, &ir, n as usize > GATHER_IN_PLACE_ROWS)? else {
        return Ok(None);
    };
    let mut yshape = batch;
    yshape.extend([1, rows]);
    mx::reshape(&y, &yshape).map(Some)
}

/// One projection of every expert: `[experts, out, in]`, dense or MLX-quantized (mlx-lm's
/// `SwitchLinear` / `QuantizedSwitchLinear`, without bias).
pub enum SwitchLinear {
    /// The weight and its `[experts, in, out]` view (no copy).
    Dense {
        w: Array,
        wt: Array,
    },
    Quant {
        w: Array,
        scales: Array,
        biases: Option<Array>,
        q: QuantSpec,
    },
}

impl SwitchLinear {
    pub fn load(ws: &mut Weights, prefix: &str, experts: i32, out: i32, inp: i32) -> Result<SwitchLinear> {
        Ok(match ws.take_experts(prefix, experts, out, inp)? {
            Matrix::Dense(w) => SwitchLinear::Dense { wt: mx::swapaxes(&w, -1, -2)?, w },
            Matrix::Quant { w, scales, biases, q } => SwitchLinear::Quant { w, scales, biases, q },
        })
    }

    /// `x @ W[idx]^T`: `x` `[..., 1, in]` against the experts `idx` selects.
    pub fn forward(&self, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
        match self {
            SwitchLinear::Dense { w, wt } => match host_half_gather(x, w, idx)? {
                Some(y) => Ok(y),
                None => mx::gather_mm(x, wt, None, Some(idx), sorted),
            },
            SwitchLinear::Quant { w, scales, biases, q } => mx::gather_qmm(
                x,
                w,
                scales,
                biases.as_ref(),
                None,
                Some(idx),
                true,
                q.group_size,
                q.bits,
                q.mode,
                sorted,
            ),
        }
    }

    pub fn nbytes(&self) -> usize {
        match self {
            SwitchLinear::Dense { w, .. } => w.nbytes(),
            SwitchLinear::Quant { w, scales, biases, .. } => {
                w.nbytes() + scales.nbytes() + biases.as_ref().map_or(0, Array::nbytes)
            }
        }
    }
}

/// The routed experts of one layer, behind an [`ExpertStore`]: resident stacked arrays, or streamed
/// from the safetensors files when the weights were opened for streaming (`Weights::stream_experts`).
pub struct Experts {
    pub store: ExpertStore,
    pub count: i32,
}

impl Experts {
    /// `{prefix}.{gate,up,down}_proj` of `count` experts, each `[inter, hidden]` / `[hidden, inter]`.
    pub fn load(ws: &mut Weights, prefix: &str, count: i32, hidden: i32, inter: i32) -> Result<Experts> {
        let store = match ws.streaming() {
            Some(ctx) => ExpertStore::Streamed(StreamedExperts::load(ws, ctx, prefix, count, hidden, inter)?),
            None => ExpertStore::Resident {
                gate: SwitchLinear::load(ws, &format!("{prefix}.gate_proj"), count, inter, hidden)?,
                up: SwitchLinear::load(ws, &format!("{prefix}.up_proj"), count, inter, hidden)?,
                down: SwitchLinear::load(ws, &format!("{prefix}.down_proj"), count, hidden, inter)?,
            },
        };
        Ok(Experts { store, count })
    }

    /// mlx-lm's `SwitchGLU`: `x` `[..., hidden]`, `indices` `[..., k]` → `[..., k, hidden]`, each
    /// token through each of its k experts' SwiGLU. Streamed: the indices are evaluated, the
    /// distinct experts fetched (cache or files) into a compact stack, the indices remapped into it.
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        self.forward_with(x, indices, ExpertAct::Swiglu, None)
    }

    /// [`Experts::forward`] with the activation `act` and, when given, each projection's
    /// per-expert bias added after it (mlx-lm's `SwitchLinear(bias=True)`). Streamed: the indices
    /// are evaluated, the distinct experts fetched (cache or files) into a compact stack, the
    /// indices (and the biases) remapped into it.
    pub fn forward_with(&self, x: &Array, indices: &Array, act: ExpertAct, bias: Option<&ExpertBias>) -> Result<Array> {
        self.forward_ahead(x, indices, act, bias, None)
    }

    /// [`Experts::forward_with`]; streamed and prefetching, `probe` (the hidden state this layer's
    /// router read) goes through the next streamed layer's router (its registered
    /// [`super::experts::Predictor`]), evaluated with this layer's indices, and the experts it
    /// picks are read while this layer computes.
    pub fn forward_ahead(
        &self,
        x: &Array,
        indices: &Array,
        act: ExpertAct,
        bias: Option<&ExpertBias>,
        probe: Option<&Array>,
    ) -> Result<Array> {
        match &self.store {
            ExpertStore::Resident { gate, up, down } => switch_glu(gate, up, down, x, indices, act, bias),
            ExpertStore::Streamed(s) => {
                let next = match (probe, s.next_predictor()) {
                    (Some(h), Some(f)) => {
                        let p = f(h)?;
                        mx::eval(&[indices, &p])?;
                        Some(p.to_vec::<i32>()?)
                    }
                    _ => None,
                };
                let ids = indices.to_vec::<i32>()?;
                let mut slot = vec![u32::MAX; self.count as usize];
                let mut uniq: Vec<u32> = Vec::new();
                let mut local = Vec::with_capacity(ids.len());
                for &e in &ids {
                    let su = usize::try_from(e).ok().filter(|&u| u < slot.len()).ok_or_else(|| {
                        crate::Error::Invalid(format!("the router chose expert {e}, outside 0..{}", self.count))
                    })?;
                    if slot[su] == u32::MAX {
                        slot[su] = uniq.len() as u32;
                        uniq.push(e as u32);
                    }
                    local.push(slot[su]);
                }
                s.count_tokens((x.size() / x.dim(-1).max(1) as usize) as u64);
                let [gate, up, down] = s.fetch(&uniq, next.as_deref())?;
                let idx = Array::from_slice(&local, &indices.shape())?;
                let compact = match bias {
                    Some(b) => {
                        let sel = Array::from_slice(&uniq, &[uniq.len() as i32])?;
                        Some(ExpertBias {
                            gate: mx::take(&b.gate, &sel, 0)?,
                            up: mx::take(&b.up, &sel, 0)?,
                            down: mx::take(&b.down, &sel, 0)?,
                        })
                    }
                    None => None,
                };
                switch_glu(&gate, &up, &down, x, &idx, act, compact.as_ref())
            }
        }
    }

    /// Bytes of the resident expert weights (0 when streamed: the cache holds what is in memory).
    pub fn nbytes(&self) -> usize {
        match &self.store {
            ExpertStore::Resident { gate, up, down } => gate.nbytes() + up.nbytes() + down.nbytes(),
            ExpertStore::Streamed(_) => 0,
        }
    }
}

/// The SwitchGLU over stacked experts: from 64 (token, expert) pairs on, the pairs are sorted by
/// expert first (as mlx-lm does) so each expert's weights are read once.
fn switch_glu(
    gate: &SwitchLinear,
    up: &SwitchLinear,
    down: &SwitchLinear,
    x: &Array,
    indices: &Array,
    act: ExpertAct,
    bias: Option<&ExpertBias>,
) -> Result<Array> {
    let ish = indices.shape();
    let k = *ish.last().unwrap_or(&1);
    let x = mx::expand_dims(&mx::expand_dims(x, -2)?, -3)?; // [..., 1, 1, hidden]
    let do_sort = indices.size() >= 64;
    let (x, idx, inv) = if do_sort {
        let flat = mx::flatten(indices, 0, -1)?;
        let order = mx::argsort(&flat, 0)?;
        let inv = mx::argsort(&order, 0)?;
        let xs = mx::flatten(&x, 0, -3)?; // [tokens, 1, hidden]
        let kk = mx::scalar_as(k as f64, order.dtype())?;
        let rows = mx::floor_divide(&order, &kk)?;
        (mx::take(&xs, &rows, 0)?, mx::take(&flat, &order, 0)?, Some(inv))
    } else {
        (x, indices.clone(), None)
    };
    let biased = |y: Array, b: Option<&Array>| -> Result<Array> {
        match b {
            Some(b) => mx::add(&y, &mx::expand_dims(&mx::take(b, &idx, 0)?, -2)?),
            None => Ok(y),
        }
    };
    let u = biased(up.forward(&x, &idx, do_sort)?, bias.map(|b| &b.up))?;
    let g = biased(gate.forward(&x, &idx, do_sort)?, bias.map(|b| &b.gate))?;
    let h = match act {
        ExpertAct::Swiglu => compiled(&SWIGLU, swiglu, &[&g, &u])?,
        ExpertAct::SwigluOai => compiled(&SWIGLU_OAI, swiglu_oai, &[&g, &u])?,
        ExpertAct::Geglu => geglu_fused(&g, &u)?,
    };
    let mut y = biased(down.forward(&h, &idx, do_sort)?, bias.map(|b| &b.down))?;
    if let Some(inv) = inv {
        y = mx::take(&y, &inv, 0)?; // [tokens*k, 1, hidden]
        let mut shape = ish.clone();
        shape.extend([1, y.dim(-1)]);
        y = mx::reshape(&y, &shape)?;
    }
    mx::squeeze(&y, &[-2])
}

/// The activation between a routed expert's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertAct {
    /// `silu(gate) * up` (mlx-lm's `SwiGLU`).
    Swiglu,
    /// gpt-oss's clamped variant (mlx-lm's `SwigluOAI()`: alpha 1.702, limit 7).
    SwigluOai,
    /// `gelu_approx(gate) * up` (Gemma 4's experts).
    Geglu,
}

static SWIGLU_OAI: CompiledSlot = std::sync::OnceLock::new();

/// mlx-lm's `swiglu_oai(gate, up)` with its default alpha 1.702 and limit 7: the gate clipped from
/// above, `up` into [-7, 7], `(up + 1) * gate * sigmoid(1.702 gate)`.
fn swiglu_oai(a: &[Array]) -> Result<Vec<Array>> {
    let (g, x) = (&a[0], &a[1]);
    let c = |v: f64, d: Dtype| mx::scalar_as(v, d);
    let g = mx::minimum(g, &c(7.0, g.dtype())?)?;
    let x = mx::clip(x, Some(&c(-7.0, x.dtype())?), Some(&c(7.0, x.dtype())?))?;
    let glu = mx::multiply(&g, &mx::sigmoid(&mx::multiply(&c(1.702, g.dtype())?, &g)?)?)?;
    Ok(vec![mx::multiply(&mx::add(&x, &c(1.0, x.dtype())?)?, &glu)?])
}

/// Per-expert biases of the three projections (`[experts, out]` each), added after each.
pub struct ExpertBias {
    pub gate: Array,
    pub up: Array,
    pub down: Array,
}

/// How a MoE router turns its logits into k experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// qwen3_moe: softmax over every expert (in float32), the k largest, renormalised to sum to
    /// one when the layer's `norm_topk_prob`.
    Softmax,
    /// mixtral: the k largest logits (`argpartition(-logits, k-1)[..., :k]`), a softmax over them.
    TopKSoftmax,
    /// gpt_oss: the k largest logits as its `mlx_topk` takes them (`argpartition(logits, -k)[..., -k:]`),
    /// a softmax over them.
    TopKSoftmaxTail,
    /// glm4_moe / deepseek_v3 (`noaux_tc`): sigmoid scores (float32); for the choice only, the
    /// `e_score_correction_bias` added and, with `n_group` > 1, every group but the `topk_group`
    /// best (by the sum of their two best scores) zeroed; the k best experts weighted by their
    /// sigmoid scores, renormalised when `norm_topk_prob` (and k > 1), times `scaling`.
    GroupedSigmoid { n_group: i32, topk_group: i32, scaling: f32 },
    /// mistral4 (`mistral4_expert_select`): softmax scores (float32), with `n_group` > 1 every
    /// group but the `topk_group` best (by the sum of their two best scores) zeroed for the choice;
    /// the k best experts weighted by their softmax scores, divided by their sum (+ 1e-20) when
    /// `norm_topk_prob`, times `scaling`.
    GroupedSoftmax { n_group: i32, topk_group: i32, scaling: f32 },
}

/// Where a MoE block's parts are and how it routes: `{prefix}.{router_name}` the router,
/// `{prefix}.{experts_name}.{gate,up,down}_proj` the stacked experts, `{prefix}.shared_experts`
/// the always-on experts (a SwiGLU MLP `shared` × the expert width wide).
#[derive(Clone, Copy, Debug)]
pub struct MoeSpec {
    pub router: Router,
    pub router_name: &'static str,
    pub router_bias: bool,
    pub experts_name: &'static str,
    pub expert_bias: bool,
    pub act: ExpertAct,
}

impl MoeSpec {
    /// qwen3_moe's (and mixtral's names, with [`Router::TopKSoftmax`]).
    pub const QWEN3: MoeSpec = MoeSpec {
        router: Router::Softmax,
        router_name: "gate",
        router_bias: false,
        experts_name: "switch_mlp",
        expert_bias: false,
        act: ExpertAct::Swiglu,
    };
}

/// The `k` experts of `scores` `[..., experts]` (float32) a grouped router chooses: with
/// `n_group` above 1 every group but the `topk_group` best (by the sum of their two best scores) zeroed first
/// (mlx-lm's `group_expert_select` / `mistral4_expert_select`); `argpartition(-s, k-1)[..., :k]`.
fn grouped_top_k(scores: &Array, n_group: i32, topk_group: i32, k: i32) -> Result<Array> {
    let mut s = scores.clone();
    let e = s.dim(-1);
    if n_group > 1 {
        let sh = s.shape();
        let mut grouped = sh[..sh.len() - 1].to_vec();
        grouped.extend([n_group, e / n_group]);
        s = mx::reshape(&s, &grouped)?;
        let group_scores = mx::sum(&mx::topk(&s, 2, -1)?, &[-1], true)?;
        let drop = n_group - topk_group;
        if drop > 0 {
            let idx = mx::slice_axis(&mx::argpartition(&group_scores, drop - 1, -2)?, -2, 0, drop)?;
            s = mx::put_along_axis(&s, &idx, &mx::scalar_as(0.0, Dtype::Float32)?, -2)?;
        }
        s = mx::reshape(&s, &sh)?;
    }
    mx::slice_axis(&mx::argpartition(&mx::negative(&s)?, k - 1, -1)?, -1, 0, k)
}

/// A sparse MoE block: a router picks `top_k` of the routed experts per token and weights their
/// outputs ([`Router`]); shared experts, when present, are added for every token.
pub struct SparseMoe {
    /// Shared with the predictor a streamed layer registers ([`Experts::forward_ahead`]).
    pub router: std::sync::Arc<Linear>,
    pub experts: Experts,
    pub top_k: i32,
    pub norm_topk_prob: bool,
    pub routing: Router,
    /// [`Router::GroupedSigmoid`]'s `e_score_correction_bias` `[experts]`.
    pub score_bias: Option<Array>,
    pub expert_bias: Option<ExpertBias>,
    pub act: ExpertAct,
    pub shared: Option<Mlp>,
}

impl SparseMoe {
    /// `{prefix}.gate` (the router, `[experts, hidden]`) and `{prefix}.switch_mlp.*`, qwen3_moe's
    /// softmax router.
    pub fn load(
        ws: &mut Weights,
        prefix: &str,
        experts: i32,
        top_k: i32,
        inter: i32,
        hidden: i32,
    ) -> Result<SparseMoe> {
        let kind = super::FfnKind::Moe { experts, top_k, intermediate: inter, shared: 0, norm_topk_prob: false };
        SparseMoe::load_spec(ws, prefix, kind, hidden, &MoeSpec::QWEN3)
    }

    /// The MoE block of `kind` (a [`super::FfnKind::Moe`]) at `prefix`, laid out and routed as
    /// `spec` says; every tensor's shape checked against the kind.
    pub fn load_spec(
        ws: &mut Weights,
        prefix: &str,
        kind: super::FfnKind,
        hidden: i32,
        spec: &MoeSpec,
    ) -> Result<SparseMoe> {
        use crate::Error;
        let super::FfnKind::Moe { experts, top_k, intermediate, shared, norm_topk_prob } = kind else {
            return Err(Error::Invalid(format!("{prefix}: not a MoE layer")));
        };
        if !(1..=experts).contains(&top_k) {
            return Err(Error::ModelLoad(format!("config.json: num_experts_per_tok {top_k} is not in 1..={experts}")));
        }
        let rname = format!("{prefix}.{}", spec.router_name);
        let score_bias = match spec.router {
            Router::GroupedSigmoid { n_group, topk_group, .. } | Router::GroupedSoftmax { n_group, topk_group, .. } => {
                if n_group < 1 || experts % n_group != 0 {
                    return Err(Error::ModelLoad(format!(
                        "config.json: n_group {n_group} does not divide the {experts} routed experts"
                    )));
                }
                if !(1..=n_group).contains(&topk_group) {
                    return Err(Error::ModelLoad(format!(
                        "config.json: topk_group {topk_group} is not in 1..={n_group} (n_group)"
                    )));
                }
                let per = experts / n_group;
                if n_group > 1 && per < 2 {
                    return Err(Error::ModelLoad(format!(
                        "config.json: n_group {n_group} leaves {per} expert per group (a group is scored by its best two)"
                    )));
                }
                if top_k > topk_group * per {
                    return Err(Error::ModelLoad(format!(
                        "config.json: num_experts_per_tok {top_k} exceeds the {} experts of topk_group {topk_group} groups",
                        topk_group * per
                    )));
                }
                match spec.router {
                    Router::GroupedSigmoid { .. } => {
                        Some(ws.take_shaped(&format!("{rname}.e_score_correction_bias"), &[experts])?)
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        let router = std::sync::Arc::new(Linear::load(ws, &rname, spec.router_bias, experts, hidden)?);
        let ename = format!("{prefix}.{}", spec.experts_name);
        let expert_bias = if spec.expert_bias {
            let b = |ws: &mut Weights, p: &str, out: i32| ws.take_shaped(&format!("{ename}.{p}.bias"), &[experts, out]);
            Some(ExpertBias {
                gate: b(ws, "gate_proj", intermediate)?,
                up: b(ws, "up_proj", intermediate)?,
                down: b(ws, "down_proj", hidden)?,
            })
        } else {
            None
        };
        let count = experts;
        let experts = Experts::load(ws, &ename, experts, hidden, intermediate)?;
        if let ExpertStore::Streamed(s) = &experts.store {
            // the layer before applies this router to its own MoE input (the indices do not
            // depend on norm_topk_prob nor the scaling: the scores are never evaluated)
            let (r, sb, routing) = (router.clone(), score_bias.clone(), spec.router);
            s.set_predictor(std::sync::Arc::new(move |x: &Array| {
                Ok(route(&r, routing, count, top_k, false, sb.as_ref(), x)?.0)
            }));
        }
        let shared = if shared > 0 {
            Some(Mlp::load(
                ws,
                &format!("{prefix}.shared_experts"),
                false,
                Activation::Silu,
                hidden,
                intermediate * shared,
            )?)
        } else {
            None
        };
        Ok(SparseMoe {
            router,
            experts,
            top_k,
            norm_topk_prob,
            routing: spec.router,
            score_bias,
            expert_bias,
            act: spec.act,
            shared,
        })
    }

    /// The experts each token goes to `[..., k]` and their weights `[..., k]`.
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        route(
            &self.router,
            self.routing,
            self.experts.count,
            self.top_k,
            self.norm_topk_prob,
            self.score_bias.as_ref(),
            x,
        )
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (inds, scores) = self.route(x)?;
        let y = self.experts.forward_ahead(x, &inds, self.act, self.expert_bias.as_ref(), Some(x))?;
        let dt = y.dtype();
        let y = mx::sum(&mx::multiply(&y, &mx::expand_dims(&scores, -1)?)?, &[-2], false)?;
        let y = if y.dtype() == dt { y } else { mx::astype(&y, dt)? };
        match &self.shared {
            Some(m) => mx::add(&y, &m.forward(x)?),
            None => Ok(y),
        }
    }
}

/// A MoE router's choice for `x`: the experts `[..., k]` of `e` and their weights `[..., k]`
/// ([`Router`]; `score_bias` the grouped router's correction bias).
fn route(
    router: &Linear,
    routing: Router,
    e: i32,
    k: i32,
    norm_topk_prob: bool,
    score_bias: Option<&Array>,
    x: &Array,
) -> Result<(Array, Array)> {
    let logits = router.forward(x)?;
    match routing {
        Router::Softmax => {
            let gates = mx::softmax(&logits, &[-1], true)?;
            let inds = mx::slice_axis(&mx::argpartition(&gates, e - k, -1)?, -1, e - k, e)?;
            let mut scores = mx::take_along_axis(&gates, &inds, -1)?;
            if norm_topk_prob {
                scores = mx::divide(&scores, &mx::sum(&scores, &[-1], true)?)?;
            }
            Ok((inds, scores))
        }
        Router::TopKSoftmax => {
            let inds = mx::slice_axis(&mx::argpartition(&mx::negative(&logits)?, k - 1, -1)?, -1, 0, k)?;
            let scores = mx::softmax(&mx::take_along_axis(&logits, &inds, -1)?, &[-1], true)?;
            Ok((inds, scores))
        }
        Router::TopKSoftmaxTail => {
            let inds = mx::slice_axis(&mx::argpartition(&logits, e - k, -1)?, -1, e - k, e)?;
            let scores = mx::softmax(&mx::take_along_axis(&logits, &inds, -1)?, &[-1], true)?;
            Ok((inds, scores))
        }
        Router::GroupedSigmoid { n_group, topk_group, scaling } => {
            let orig = mx::sigmoid(&mx::astype(&logits, Dtype::Float32)?)?;
            let bias = score_bias.ok_or_else(|| crate::Error::Invalid("grouped router without its bias".into()))?;
            let inds = grouped_top_k(&mx::add(&orig, bias)?, n_group, topk_group, k)?;
            let mut scores = mx::take_along_axis(&orig, &inds, -1)?;
            if k > 1 && norm_topk_prob {
                scores = mx::divide(&scores, &mx::sum(&scores, &[-1], true)?)?;
            }
            Ok((inds, mx::multiply(&scores, &mx::scalar_as(scaling as f64, Dtype::Float32)?)?))
        }
        Router::GroupedSoftmax { n_group, topk_group, scaling } => {
            let orig = mx::softmax(&mx::astype(&logits, Dtype::Float32)?, &[-1], false)?;
            let inds = grouped_top_k(&orig, n_group, topk_group, k)?;
            let mut scores = mx::take_along_axis(&orig, &inds, -1)?;
            if norm_topk_prob {
                let sum = mx::add(&mx::sum(&scores, &[-1], true)?, &mx::scalar_as(1e-20, Dtype::Float32)?)?;
                scores = mx::divide(&scores, &sum)?;
            }
            Ok((inds, mx::multiply(&scores, &mx::scalar_as(scaling as f64, Dtype::Float32)?)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(shape: &[i32], seed: u64) -> Array {
        mx::random_normal(shape, Dtype::Float32, &mx::random_key(seed).unwrap()).unwrap()
    }

    fn dense(out: i32, inp: i32, bias: bool, seed: u64) -> Linear {
        let w = rnd(&[out, inp], seed);
        Linear::Dense { wt: mx::transpose(&w).unwrap(), w, b: bias.then(|| rnd(&[out], seed + 100)), host: None }
    }

    fn quant(out: i32, inp: i32, bias: bool, bits: i32, seed: u64) -> Linear {
        let (w, scales, biases) = mx::quantize(&rnd(&[out, inp], seed), 64, bits).unwrap();
        Linear::Quant {
            w,
            scales,
            biases: Some(biases),
            b: bias.then(|| rnd(&[out], seed + 100)),
            q: QuantSpec::affine(64, bits),
        }
    }

    /// The parts' outputs side by side (the oracle) against the concatenated linear's output, for
    /// dense and quantized parts, with and without biases: equal to float32 rounding.
    #[test]
    fn concatenated_linears_give_their_parts_outputs() {
        let x = rnd(&[2, 3, 128], 7);
        type Make = fn(i32, u64) -> Linear;
        let cases: [(&str, Make); 4] = [
            ("dense", |o, s| dense(o, 128, false, s)),
            ("dense+bias", |o, s| dense(o, 128, true, s)),
            ("q4", |o, s| quant(o, 128, false, 4, s)),
            ("q8+bias", |o, s| quant(o, 128, true, 8, s)),
        ];
        for (name, make) in cases {
            let parts: Vec<Linear> = [64, 32, 32].iter().enumerate().map(|(i, &o)| make(o, i as u64)).collect();
            let outs: Vec<Array> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
            let want = mx::concatenate(&outs.iter().collect::<Vec<_>>(), -1).unwrap().to_vec::<f32>().unwrap();
            let fused = Linear::concat(parts).unwrap().unwrap_or_else(|_| panic!("{name}: not stacked"));
            // part by part (the long-input path): each part's own output
            for (i, (p, want)) in fused.forward_parts(&x, &[64, 32, 32]).unwrap().iter().zip(&outs).enumerate() {
                let (p, want) = (p.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                let diff = p.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                // float32 rounding: the BLAS may block a slice of the fused weight otherwise than the
                // part's own matrix (1.3e-5 with OpenBLAS's AMD Zen kernels)
                assert!(p.len() == want.len() && diff < 1e-4, "{name} part {i}: {diff}");
            }
            let got = fused.forward(&x).unwrap();
            assert_eq!(got.shape(), vec![2, 3, 128], "{name}");
            let got = got.to_vec::<f32>().unwrap();
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-4, "{name}: {diff}");
        }
    }

    /// `forward_add(x, res)` is `res + forward(x)`: for dense and quantized linears, with and without
    /// biases, one decode row and a prefill chunk (bit for bit: on the CPU the same two ops run).
    #[test]
    fn forward_add_is_the_residual_plus_the_product() {
        let cases = [
            ("dense", dense(96, 128, false, 1)),
            ("dense+bias", dense(96, 128, true, 2)),
            ("q4", quant(96, 128, false, 4, 3)),
            ("q8+bias", quant(96, 128, true, 8, 4)),
        ];
        for (name, lin) in &cases {
            for shape in [[1, 1, 128], [2, 5, 128]] {
                let x = rnd(&shape, 11);
                let res = rnd(&[shape[0], shape[1], 96], 12);
                let got = lin.forward_add(&x, &res).unwrap();
                let want = mx::add(&res, &lin.forward(&x).unwrap()).unwrap();
                assert_eq!(got.shape(), want.shape(), "{name} {shape:?}");
                assert_eq!(got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap(), "{name} {shape:?}");
            }
        }
    }

    /// Parts that differ in form come back unchanged, in order.
    #[test]
    fn unlike_linears_are_not_concatenated() {
        let sets: Vec<(&str, Vec<Linear>)> = vec![
            ("dense and quantized", vec![dense(64, 128, false, 1), quant(32, 128, false, 4, 2)]),
            ("4 and 8 bits", vec![quant(64, 128, false, 4, 1), quant(32, 128, false, 8, 2)]),
            ("a bias on one only", vec![dense(64, 128, true, 1), dense(32, 128, false, 2)]),
            ("other input widths", vec![dense(64, 128, false, 1), dense(32, 64, false, 2)]),
        ];
        for (name, parts) in sets {
            let rows: Vec<i32> = parts
                .iter()
                .map(|p| match p {
                    Linear::Dense { w, .. } | Linear::Quant { w, .. } => w.dim(0),
                    Linear::Lora(_) => -1,
                })
                .collect();
            let back = Linear::concat(parts).unwrap().err().unwrap_or_else(|| panic!("{name}: stacked"));
            let back_rows: Vec<i32> = back
                .iter()
                .map(|p| match p {
                    Linear::Dense { w, .. } | Linear::Quant { w, .. } => w.dim(0),
                    Linear::Lora(_) => -1,
                })
                .collect();
            assert_eq!(back_rows, rows, "{name}");
        }
    }

    /// One token's rotary embedding, compiled, against the same formula as separate ops and
    /// against MLX's own rope (whose CPU fallback it is): bit for bit, at several positions, for a
    /// full and a partial rotation, a decode row and a batch of rows.
    #[test]
    fn compiled_rope_is_bit_identical() {
        for (dims, shape) in [(64, [1, 4, 1, 64]), (32, [3, 2, 1, 64])] {
            let rope = Rope::from_config(dims, 10000.0, false, None).unwrap();
            let x = rnd(&shape, dims as u64);
            for offset in [0, 5, 300] {
                let (cos, sin) = rope.table(offset + 1, Dtype::Float32).unwrap();
                let c = mx::slice_axis(&cos, 2, offset, offset + 1).unwrap();
                let s = mx::slice_axis(&sin, 2, offset, offset + 1).unwrap();
                let plain = rotate(dims, &x, &c, &s).unwrap().to_vec::<f32>().unwrap();
                let mlx = rope.mlx_rope(&x, offset).unwrap().to_vec::<f32>().unwrap();
                // twice: the first call traces, the second reuses the compiled function
                for _ in 0..2 {
                    let got = rope.forward(&x, offset).unwrap().to_vec::<f32>().unwrap();
                    assert!(got.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()), "{dims} {offset}");
                    assert!(got.iter().zip(&mlx).all(|(a, b)| a.to_bits() == b.to_bits()), "{dims} {offset} mlx");
                }
            }
        }
    }

    #[test]
    fn compiled_rms_norm_is_bit_identical() {
        for (shape, eps) in [(vec![1, 1, 640], 1e-6f32), (vec![2, 3, 4, 256], 1e-5), (vec![5, 64], 1e-6)] {
            let n: usize = shape.iter().map(|&d| d as usize).product();
            let dim = *shape.last().unwrap() as usize;
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 / 97.0 - 5.0) * 1.37).collect();
            let w: Vec<f32> = (0..dim).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
            let (x, w) = (Array::from_slice(&x, &shape).unwrap(), Array::from_slice(&w, &[dim as i32]).unwrap());
            let plain = mx::rms_norm(&x, Some(&w), eps).unwrap().to_vec::<f32>().unwrap();
            // twice: the first call traces, the second reuses the compiled function
            for _ in 0..2 {
                let got = compiled_rms_norm(&x, &w, eps).unwrap().to_vec::<f32>().unwrap();
                assert!(got.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()), "{shape:?}");
            }
        }
    }
}
