//! The op surface LLM inference needs. Every op runs on the thread's current stream
//! (see [`with_stream`](super::with_stream)) and returns MLX's error text on failure.
use super::array::{Array, Dtype};
use super::check;
use super::runtime::{current_stream as s, init};
use crate::error::{Error, Result};
use mlxrs_sys as sys;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::os::raw::c_int;
use std::path::Path;

/// MLX ops built through this module since the process started (every thread; an op that returns
/// several arrays, a compiled function and a custom kernel count once each). The engine's decode
/// step is host-bound at batch 1 (~5–7.6 µs per op on an H200), so ops per step is the number to
/// cut: `bench/ops_per_step.py` reads it through `mlxrs._native._op_count`.
static OPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The ops built so far ([`OPS`]): the difference over a decode step is that step's op count.
pub fn op_count() -> u64 {
    OPS.load(std::sync::atomic::Ordering::Relaxed)
}

#[inline]
pub(crate) fn count_op() {
    OPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// An op's single result (counted in [`OPS`]).
#[inline]
fn out1(f: impl FnOnce(*mut sys::mlx_array) -> c_int) -> Result<Array> {
    count_op();
    get1(f)
}

/// One array out of an mlx-c getter (not an op).
#[inline]
fn get1(f: impl FnOnce(*mut sys::mlx_array) -> c_int) -> Result<Array> {
    let mut r = Array::empty_raw();
    let rc = f(&mut r);
    let a = Array::from_raw(r);
    check(rc)?;
    Ok(a)
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Invalid(format!("string contains NUL: {s:?}")))
}

fn opt_int(v: Option<i32>) -> sys::mlx_optional_int {
    sys::mlx_optional_int { value: v.unwrap_or(0), has_value: v.is_some() }
}

fn null() -> sys::mlx_array {
    sys::mlx_array::null()
}

fn raw_or_null(a: Option<&Array>) -> sys::mlx_array {
    a.map(|a| a.0).unwrap_or_else(null)
}

/// An owned mlx_vector_array (input or output of vector ops).
pub(crate) struct VecArray(pub(crate) sys::mlx_vector_array);

impl VecArray {
    pub(crate) fn new(arrays: &[&Array]) -> VecArray {
        let raws: Vec<sys::mlx_array> = arrays.iter().map(|a| a.0).collect();
        VecArray(unsafe { sys::mlx_vector_array_new_data(raws.as_ptr(), raws.len()) })
    }
    fn empty() -> VecArray {
        VecArray(unsafe { sys::mlx_vector_array_new() })
    }
    pub(crate) fn to_vec(&self) -> Result<Vec<Array>> {
        let n = unsafe { sys::mlx_vector_array_size(self.0) };
        (0..n).map(|i| get1(|r| unsafe { sys::mlx_vector_array_get(r, self.0, i) })).collect()
    }
}

impl Drop for VecArray {
    fn drop(&mut self) {
        unsafe { sys::mlx_vector_array_free(self.0) };
    }
}

macro_rules! unary {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        #[doc = concat!("Elementwise `", stringify!($name), "`.")]
        pub fn $name(a: &Array) -> Result<Array> { out1(|r| unsafe { sys::$f(r, a.0, s()) }) }
    )*};
}
macro_rules! binary {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        #[doc = concat!("Broadcasting `", stringify!($name), "`.")]
        pub fn $name(a: &Array, b: &Array) -> Result<Array> { out1(|r| unsafe { sys::$f(r, a.0, b.0, s()) }) }
    )*};
}

unary!(exp => mlx_exp, log => mlx_log, log1p => mlx_log1p, sqrt => mlx_sqrt, rsqrt => mlx_rsqrt,
       negative => mlx_negative, abs => mlx_abs, sigmoid => mlx_sigmoid, tanh => mlx_tanh, erf => mlx_erf,
       square => mlx_square, sin => mlx_sin, cos => mlx_cos, floor => mlx_floor, ceil => mlx_ceil,
       logical_not => mlx_logical_not, isnan => mlx_isnan, isinf => mlx_isinf, stop_gradient => mlx_stop_gradient,
       copy => mlx_copy, transpose => mlx_transpose);
binary!(add => mlx_add, subtract => mlx_subtract, multiply => mlx_multiply, divide => mlx_divide,
        maximum => mlx_maximum, minimum => mlx_minimum, power => mlx_power, matmul => mlx_matmul,
        floor_divide => mlx_floor_divide, remainder => mlx_remainder, greater => mlx_greater,
        greater_equal => mlx_greater_equal, less => mlx_less, less_equal => mlx_less_equal, equal => mlx_equal,
        not_equal => mlx_not_equal, logical_and => mlx_logical_and, logical_or => mlx_logical_or,
        logaddexp => mlx_logaddexp);

/// A scalar of `dtype` (MLX's C API has no weakly typed scalars: match the other operand's dtype).
/// The value is converted straight to `dtype` (integers keep every digit; no float32 detour).
pub fn scalar_as(v: f64, dtype: Dtype) -> Result<Array> {
    use half::{bf16, f16};
    match dtype {
        Dtype::Bool => Array::scalar(v != 0.0),
        Dtype::Uint8 => Array::scalar(v as u8),
        Dtype::Uint16 => Array::scalar(v as u16),
        Dtype::Uint32 => Array::scalar(v as u32),
        Dtype::Uint64 => Array::scalar(v as u64),
        Dtype::Int8 => Array::scalar(v as i8),
        Dtype::Int16 => Array::scalar(v as i16),
        Dtype::Int32 => Array::scalar(v as i32),
        Dtype::Int64 => Array::scalar(v as i64),
        Dtype::Float16 => Array::scalar(f16::from_f64(v)),
        Dtype::Bfloat16 => Array::scalar(bf16::from_f64(v)),
        Dtype::Float32 => Array::scalar(v as f32),
        Dtype::Float64 => Array::scalar(v),
        Dtype::Complex64 => astype(&Array::scalar(v as f32)?, dtype),
    }
}

/// `c * beta + (a @ b) * alpha`.
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_addmm(r, c.0, a.0, b.0, alpha, beta, s()) })
}

pub fn where_(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_where(r, cond.0, x.0, y.0, s()) })
}

pub fn clip(a: &Array, lo: Option<&Array>, hi: Option<&Array>) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_clip(r, a.0, raw_or_null(lo), raw_or_null(hi), s()) })
}

pub fn astype(a: &Array, dtype: Dtype) -> Result<Array> {
    // MLX returns `a` itself for its own dtype: no call, no op counted
    if a.dtype() == dtype {
        return Ok(a.clone());
    }
    out1(|r| unsafe { sys::mlx_astype(r, a.0, dtype.raw(), s()) })
}

/// FP8 (e4m3) codes stored as uint8 (how MLX loads a safetensors `F8_E4M3` tensor) as `dtype`
/// values (MLX's `from_fp8`).
pub fn from_fp8(a: &Array, dtype: Dtype) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_from_fp8(r, a.0, dtype.raw(), s()) })
}

/// Reinterpret the bytes of `a` as `dtype`.
pub fn view(a: &Array, dtype: Dtype) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_view(r, a.0, dtype.raw(), s()) })
}

/// A row-contiguous version of `a` (a no-op when it already is).
pub fn contiguous(a: &Array) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_contiguous(r, a.0, false, s()) })
}

// ---- creation ----

pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    init()?;
    out1(|r| unsafe { sys::mlx_zeros(r, shape.as_ptr(), shape.len(), dtype.raw(), s()) })
}

pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
    init()?;
    out1(|r| unsafe { sys::mlx_ones(r, shape.as_ptr(), shape.len(), dtype.raw(), s()) })
}

pub fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_full(r, shape.as_ptr(), shape.len(), value.0, dtype.raw(), s()) })
}

pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    init()?;
    out1(|r| unsafe { sys::mlx_arange(r, start, stop, step, dtype.raw(), s()) })
}

// ---- shape ----

pub fn reshape(a: &Array, shape: &[i32]) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_reshape(r, a.0, shape.as_ptr(), shape.len(), s()) })
}

pub fn transpose_axes(a: &Array, axes: &[i32]) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_transpose_axes(r, a.0, axes.as_ptr(), axes.len(), s()) })
}

pub fn swapaxes(a: &Array, a1: i32, a2: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_swapaxes(r, a.0, a1, a2, s()) })
}

pub fn expand_dims(a: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_expand_dims(r, a.0, axis, s()) })
}

pub fn squeeze(a: &Array, axes: &[i32]) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_squeeze_axes(r, a.0, axes.as_ptr(), axes.len(), s()) })
}

pub fn flatten(a: &Array, start: i32, end: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_flatten(r, a.0, start, end, s()) })
}

pub fn broadcast_to(a: &Array, shape: &[i32]) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_broadcast_to(r, a.0, shape.as_ptr(), shape.len(), s()) })
}

pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let v = VecArray::new(arrays);
    out1(|r| unsafe { sys::mlx_concatenate_axis(r, v.0, axis, s()) })
}

pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let v = VecArray::new(arrays);
    out1(|r| unsafe { sys::mlx_stack_axis(r, v.0, axis, s()) })
}

/// Split into `parts` equal pieces along `axis`.
pub fn split(a: &Array, parts: i32, axis: i32) -> Result<Vec<Array>> {
    let mut v = VecArray::empty();
    count_op();
    check(unsafe { sys::mlx_split(&mut v.0, a.0, parts, axis, s()) })?;
    v.to_vec()
}

/// Split along `axis` before each of `indices` (one op with `indices.len() + 1` outputs).
pub fn split_sections(a: &Array, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
    let mut v = VecArray::empty();
    count_op();
    check(unsafe { sys::mlx_split_sections(&mut v.0, a.0, indices.as_ptr(), indices.len(), axis, s()) })?;
    v.to_vec()
}

pub fn repeat(a: &Array, repeats: i32, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_repeat_axis(r, a.0, repeats, axis, s()) })
}

pub fn pad(a: &Array, axes: &[i32], low: &[i32], high: &[i32], value: &Array) -> Result<Array> {
    let mode = c"constant";
    out1(|r| unsafe {
        sys::mlx_pad(
            r,
            a.0,
            axes.as_ptr(),
            axes.len(),
            low.as_ptr(),
            low.len(),
            high.as_ptr(),
            high.len(),
            value.0,
            mode.as_ptr(),
            s(),
        )
    })
}

// ---- indexing ----

/// `a[start:stop:strides]` over every axis.
pub fn slice(a: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    out1(|r| unsafe {
        sys::mlx_slice(
            r,
            a.0,
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            s(),
        )
    })
}

/// `a[..., lo:hi, ...]` on one axis.
pub fn slice_axis(a: &Array, axis: i32, lo: i32, hi: i32) -> Result<Array> {
    let shape = a.shape();
    let nd = shape.len() as i32;
    let ax = if axis < 0 { axis + nd } else { axis };
    if !(0..nd).contains(&ax) {
        return Err(Error::Invalid(format!("slice_axis: axis {axis} is out of range for an array of {nd} dimensions")));
    }
    let ax = ax as usize;
    let mut start = vec![0; shape.len()];
    let mut stop = shape.clone();
    start[ax] = lo;
    stop[ax] = hi;
    slice(a, &start, &stop, &vec![1; shape.len()])
}

/// `src` with `update` written into `src[start:stop:strides]`.
pub fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    out1(|r| unsafe {
        sys::mlx_slice_update(
            r,
            src.0,
            update.0,
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            s(),
        )
    })
}

pub fn take(a: &Array, indices: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_take_axis(r, a.0, indices.0, axis, s()) })
}

pub fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_take_along_axis(r, a.0, indices.0, axis, s()) })
}

pub fn put_along_axis(a: &Array, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_put_along_axis(r, a.0, indices.0, values.0, axis, s()) })
}

/// numpy-style advanced gather: `indices[i]` indexes `axes[i]`; slices of `slice_sizes` are taken.
pub fn gather(a: &Array, indices: &[&Array], axes: &[i32], slice_sizes: &[i32]) -> Result<Array> {
    let v = VecArray::new(indices);
    out1(|r| unsafe {
        sys::mlx_gather(r, a.0, v.0, axes.as_ptr(), axes.len(), slice_sizes.as_ptr(), slice_sizes.len(), s())
    })
}

// ---- reductions ----

macro_rules! reduce {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "` over `axes`.")]
        pub fn $name(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
            out1(|r| unsafe { sys::$f(r, a.0, axes.as_ptr(), axes.len(), keepdims, s()) })
        }
    )*};
}
reduce!(sum => mlx_sum_axes, mean => mlx_mean_axes, max => mlx_max_axes, min => mlx_min_axes,
        logsumexp => mlx_logsumexp_axes);

pub fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_argmax_axis(r, a.0, axis, keepdims, s()) })
}

pub fn argmin(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_argmin_axis(r, a.0, axis, keepdims, s()) })
}

/// Softmax over `axes`, computed in float32 for low-precision inputs (`precise`).
pub fn softmax(a: &Array, axes: &[i32], precise: bool) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_softmax_axes(r, a.0, axes.as_ptr(), axes.len(), precise, s()) })
}

pub fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_cumsum(r, a.0, axis, reverse, inclusive, s()) })
}

pub fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_argpartition_axis(r, a.0, kth, axis, s()) })
}

pub fn partition(a: &Array, kth: i32, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_partition_axis(r, a.0, kth, axis, s()) })
}

/// The `k` largest values along `axis` (unordered).
pub fn topk(a: &Array, k: i32, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_topk_axis(r, a.0, k, axis, s()) })
}

pub fn sort(a: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_sort_axis(r, a.0, axis, s()) })
}

pub fn argsort(a: &Array, axis: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_argsort_axis(r, a.0, axis, s()) })
}

pub fn tril(a: &Array, k: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_tril(r, a.0, k, s()) })
}

pub fn triu(a: &Array, k: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_triu(r, a.0, k, s()) })
}

// ---- quantization ----

/// An MLX quantization mode (`mlx.core.quantize`'s `mode`): affine keeps a float scale and bias
/// per group; the microscaling modes keep one 8-bit scale per group (e8m0 for mxfp4/mxfp8, e4m3
/// for nvfp4) and no bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QuantMode {
    #[default]
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

impl QuantMode {
    pub const ALL: [QuantMode; 4] = [QuantMode::Affine, QuantMode::Mxfp4, QuantMode::Mxfp8, QuantMode::Nvfp4];

    /// The name MLX and mlx-lm's config.json use.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }

    pub fn parse(name: &str) -> Option<QuantMode> {
        QuantMode::ALL.into_iter().find(|m| m.name() == name)
    }

    fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            QuantMode::Affine => c"affine",
            QuantMode::Mxfp4 => c"mxfp4",
            QuantMode::Mxfp8 => c"mxfp8",
            QuantMode::Nvfp4 => c"nvfp4",
        }
    }

    /// Whether groups carry a bias (affine only).
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }

    /// MLX's (group size, bits) when left out (mlx-lm's `defaults_for_mode`).
    pub fn defaults(self) -> (i32, i32) {
        match self {
            QuantMode::Affine => (64, 4),
            QuantMode::Mxfp4 => (32, 4),
            QuantMode::Mxfp8 => (32, 8),
            QuantMode::Nvfp4 => (16, 4),
        }
    }

    /// The (group sizes, bits) MLX 0.32.4 accepts in this mode.
    pub fn allowed(self) -> (&'static [i32], &'static [i32]) {
        match self {
            QuantMode::Affine => (&[32, 64, 128], &[2, 3, 4, 5, 6, 8]),
            QuantMode::Mxfp4 => (&[32], &[4]),
            QuantMode::Mxfp8 => (&[32], &[8]),
            QuantMode::Nvfp4 => (&[16], &[4]),
        }
    }
}

/// Affine quantization of `w` along its last axis: (packed weights, scales, biases).
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
    match quantize_mode(w, group_size, bits, QuantMode::Affine)? {
        (q, sc, Some(b)) => Ok((q, sc, b)),
        _ => Err(Error::Mlx("affine quantize returned no biases".into())),
    }
}

/// Quantization of `w` along its last axis in `mode`: (packed weights, scales, biases — affine only).
pub fn quantize_mode(w: &Array, group_size: i32, bits: i32, mode: QuantMode) -> Result<(Array, Array, Option<Array>)> {
    let mut v = VecArray::empty();
    count_op();
    check(unsafe {
        sys::mlx_quantize(
            &mut v.0,
            w.0,
            opt_int(Some(group_size)),
            opt_int(Some(bits)),
            mode.c_name().as_ptr(),
            raw_or_null(None),
            s(),
        )
    })?;
    let mut parts = v.to_vec()?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(q), Some(sc), b) if b.is_some() == mode.has_biases() => Ok((q, sc, b)),
        _ => Err(Error::Mlx(format!("quantize ({}) returned an unexpected number of arrays", mode.name()))),
    }
}

pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
) -> Result<Array> {
    let dt = sys::mlx_optional_dtype::default();
    out1(|r| unsafe {
        sys::mlx_dequantize(
            r,
            w.0,
            scales.0,
            raw_or_null(biases),
            opt_int(Some(group_size)),
            opt_int(Some(bits)),
            mode.c_name().as_ptr(),
            raw_or_null(None),
            dt,
            s(),
        )
    })
}

#[allow(clippy::too_many_arguments)]
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
) -> Result<Array> {
    out1(|r| unsafe {
        sys::mlx_quantized_matmul(
            r,
            x.0,
            w.0,
            scales.0,
            raw_or_null(biases),
            transpose,
            opt_int(Some(group_size)),
            opt_int(Some(bits)),
            mode.c_name().as_ptr(),
            s(),
        )
    })
}

/// Batched matmul with per-row expert selection (MoE): `a[lhs] @ b[rhs]`.
pub fn gather_mm(a: &Array, b: &Array, lhs: Option<&Array>, rhs: Option<&Array>, sorted: bool) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_gather_mm(r, a.0, b.0, raw_or_null(lhs), raw_or_null(rhs), sorted, s()) })
}

#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    lhs: Option<&Array>,
    rhs: Option<&Array>,
    transpose: bool,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
    sorted: bool,
) -> Result<Array> {
    out1(|r| unsafe {
        sys::mlx_gather_qmm(
            r,
            x.0,
            w.0,
            scales.0,
            raw_or_null(biases),
            raw_or_null(lhs),
            raw_or_null(rhs),
            transpose,
            opt_int(Some(group_size)),
            opt_int(Some(bits)),
            mode.c_name().as_ptr(),
            raw_or_null(None),
            sorted,
            s(),
        )
    })
}

/// 1-D convolution of `x` `[B, L, C_in]` with `w` `[C_out, K, C_in / groups]` (channels last).
pub fn conv1d(x: &Array, w: &Array, stride: i32, padding: i32, dilation: i32, groups: i32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_conv1d(r, x.0, w.0, stride, padding, dilation, groups, s()) })
}

/// 2-D convolution of `x` `[B, H, W, C_in]` with `w` `[C_out, kH, kW, C_in / groups]` (channels last).
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &Array,
    w: &Array,
    stride_h: i32,
    stride_w: i32,
    pad_h: i32,
    pad_w: i32,
    dil_h: i32,
    dil_w: i32,
    groups: i32,
) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_conv2d(r, x.0, w.0, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups, s()) })
}

// ---- fast kernels ----

pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_fast_rms_norm(r, x.0, raw_or_null(weight), eps, s()) })
}

pub fn layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_fast_layer_norm(r, x.0, raw_or_null(weight), raw_or_null(bias), eps, s()) })
}

/// Rotary embedding over the last `dims` features of `x` (shape [..., L, D]) starting at `offset`;
/// `base` or explicit `freqs`.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: Option<f32>,
    scale: f32,
    offset: i32,
    freqs: Option<&Array>,
) -> Result<Array> {
    let b = sys::mlx_optional_float { value: base.unwrap_or(0.0), has_value: base.is_some() };
    out1(|r| unsafe { sys::mlx_fast_rope(r, x.0, dims, traditional, b, scale, offset, raw_or_null(freqs), s()) })
}

/// [`rope`] with one offset per batch row: `offsets` int32 `[B]` for `x` `[B, ..., L, D]`.
pub fn rope_rows(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: Option<f32>,
    scale: f32,
    offsets: &Array,
    freqs: Option<&Array>,
) -> Result<Array> {
    let b = sys::mlx_optional_float { value: base.unwrap_or(0.0), has_value: base.is_some() };
    out1(|r| unsafe {
        sys::mlx_fast_rope_dynamic(r, x.0, dims, traditional, b, scale, offsets.0, raw_or_null(freqs), s())
    })
}

/// One decode step's attention (float32, bfloat16 or float16, the CPU stream) for rows that each have their own keys and
/// values: `q` `[B, heads, 1, D]` (rotated), `kv` the rows' `(keys, values)` `[1, kv_heads, L_b, D]`
/// (views of their caches), every key of a row seen (one query per row: the causal mask hides
/// nothing). One op of the graph (native/mlxrs_ext.cpp `RowsDecodeAttention`, the (row, head) pairs
/// over the cores) where MLX's path builds a few ops and a BLAS call per row and kv head. None where
/// the loaded libmlxc lacks it.
pub fn rows_decode_attention(q: &Array, kv: &[(&Array, &Array)], scale: f32) -> Result<Option<Array>> {
    let Some(f) = sys::extra().mlxrs_rows_decode_attention else { return Ok(None) };
    let flat: Vec<&Array> = kv.iter().flat_map(|(k, v)| [*k, *v]).collect();
    let vec = VecArray::new(&flat);
    // SAFETY: mlx-c's calling convention; the entry point checks shapes and dtypes
    out1(|r| unsafe { f(r, q.0, vec.0, scale, s()) }).map(Some)
}

/// Attention mask for [`scaled_dot_product_attention`].
pub enum AttnMask<'a> {
    None,
    Causal,
    Array(&'a Array),
}

pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttnMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, arr): (&CStr, sys::mlx_array) = match mask {
        AttnMask::None => (c"", null()),
        AttnMask::Causal => (c"causal", null()),
        AttnMask::Array(a) => (c"array", a.0),
    };
    out1(|r| unsafe {
        sys::mlx_fast_scaled_dot_product_attention(r, q.0, k.0, v.0, scale, mode.as_ptr(), arr, raw_or_null(sinks), s())
    })
}

// ---- random (explicit keys) ----

/// A PRNG key from a seed.
pub fn random_key(seed: u64) -> Result<Array> {
    init()?;
    out1(|r| unsafe { sys::mlx_random_key(r, seed) })
}

pub fn random_split(key: &Array) -> Result<(Array, Array)> {
    let mut a = Array::empty_raw();
    let mut b = Array::empty_raw();
    let rc = unsafe { sys::mlx_random_split(&mut a, &mut b, key.0, s()) };
    let (a, b) = (Array::from_raw(a), Array::from_raw(b));
    check(rc)?;
    Ok((a, b))
}

pub fn random_uniform(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    let lo = scalar_as(0.0, dtype)?;
    let hi = scalar_as(1.0, dtype)?;
    out1(|r| unsafe { sys::mlx_random_uniform(r, lo.0, hi.0, shape.as_ptr(), shape.len(), dtype.raw(), key.0, s()) })
}

pub fn random_normal(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_random_normal(r, shape.as_ptr(), shape.len(), dtype.raw(), 0.0, 1.0, key.0, s()) })
}

pub fn random_gumbel(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_random_gumbel(r, shape.as_ptr(), shape.len(), dtype.raw(), key.0, s()) })
}

/// Sample from unnormalised log-probabilities along `axis`; `key` None uses MLX's global PRNG.
pub fn random_categorical(logits: &Array, axis: i32, key: Option<&Array>) -> Result<Array> {
    out1(|r| unsafe { sys::mlx_random_categorical(r, logits.0, axis, raw_or_null(key), s()) })
}

/// Seed MLX's global PRNG.
pub fn random_seed(seed: u64) -> Result<()> {
    init()?;
    unsafe { sys::mlx_random_seed(seed) };
    Ok(())
}

// ---- safetensors ----

/// Load every tensor of a safetensors file (lazily: data is read on evaluation) and its metadata.
pub fn load_safetensors(path: &Path) -> Result<(BTreeMap<String, Array>, BTreeMap<String, String>)> {
    init()?;
    let p = cstr(&path.to_string_lossy())?;
    // the default CPU stream: loading is I/O (a new stream per call would leave a CPU worker thread
    // behind each time)
    let cpu_stream = super::runtime::Stream(unsafe { sys::mlx_default_cpu_stream_new() });
    unsafe {
        let mut arrays = sys::mlx_map_string_to_array_new();
        let mut meta = sys::mlx_map_string_to_string_new();
        let rc = sys::mlx_load_safetensors(&mut arrays, &mut meta, p.as_ptr(), cpu_stream.raw());
        let result = check(rc).map(|()| {
            let mut out = BTreeMap::new();
            let it = sys::mlx_map_string_to_array_iterator_new(arrays);
            loop {
                let mut key: *const std::os::raw::c_char = std::ptr::null();
                let mut val = sys::mlx_array_new();
                if sys::mlx_map_string_to_array_iterator_next(&mut key, &mut val, it) != 0 || key.is_null() {
                    sys::mlx_array_free(val);
                    break;
                }
                out.insert(CStr::from_ptr(key).to_string_lossy().into_owned(), Array::from_raw(val));
            }
            sys::mlx_map_string_to_array_iterator_free(it);
            let mut md = BTreeMap::new();
            let it = sys::mlx_map_string_to_string_iterator_new(meta);
            loop {
                let mut key: *const std::os::raw::c_char = std::ptr::null();
                let mut val: *const std::os::raw::c_char = std::ptr::null();
                if sys::mlx_map_string_to_string_iterator_next(&mut key, &mut val, it) != 0 || key.is_null() {
                    break;
                }
                let v = if val.is_null() { String::new() } else { CStr::from_ptr(val).to_string_lossy().into_owned() };
                md.insert(CStr::from_ptr(key).to_string_lossy().into_owned(), v);
            }
            sys::mlx_map_string_to_string_iterator_free(it);
            (out, md)
        });
        sys::mlx_map_string_to_array_free(arrays);
        sys::mlx_map_string_to_string_free(meta);
        result
    }
}

/// Save tensors (and string metadata) as a safetensors file.
pub fn save_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    init()?;
    let p = cstr(&path.to_string_lossy())?;
    let keys: Vec<(CString, &Array)> = tensors.iter().map(|(k, v)| Ok((cstr(k)?, v))).collect::<Result<_>>()?;
    let meta: Vec<(CString, CString)> =
        metadata.iter().map(|(k, v)| Ok((cstr(k)?, cstr(v)?))).collect::<Result<_>>()?;
    unsafe {
        let map = sys::mlx_map_string_to_array_new();
        for (k, v) in &keys {
            sys::mlx_map_string_to_array_insert(map, k.as_ptr(), v.0);
        }
        let md = sys::mlx_map_string_to_string_new();
        for (k, v) in &meta {
            sys::mlx_map_string_to_string_insert(md, k.as_ptr(), v.as_ptr());
        }
        let rc = sys::mlx_save_safetensors(p.as_ptr(), map, md);
        sys::mlx_map_string_to_array_free(map);
        sys::mlx_map_string_to_string_free(md);
        check(rc)
    }
}

// ---- compile ----

type BoxedFn = Box<dyn Fn(&[Array]) -> Result<Vec<Array>> + Send + Sync>;

unsafe extern "C" fn closure_trampoline(
    res: *mut sys::mlx_vector_array,
    input: sys::mlx_vector_array,
    payload: *mut std::ffi::c_void,
) -> c_int {
    let f = unsafe { &*(payload as *const BoxedFn) };
    // a panic must not unwind into C++ (that aborts the process): it becomes an error like any other
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let inputs = VecArray(input);
        let args = inputs.to_vec();
        std::mem::forget(inputs); // borrowed from mlx-c
        args.and_then(|a| f(&a))
    }))
    .unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Invalid(format!("compiled function panicked: {what}")))
    });
    match out {
        Ok(outs) => {
            let refs: Vec<&Array> = outs.iter().collect();
            let v = VecArray::new(&refs);
            unsafe { sys::mlx_vector_array_set(res, v.0) };
            0
        }
        Err(e) => {
            // mlx-c replaces the failure with "mlx_closure returned a non-zero value"; keep the real
            // reason for Compiled::call to report
            CLOSURE_ERROR.with(|c| *c.borrow_mut() = Some(e.to_string()));
            1
        }
    }
}

thread_local! {
    /// Why the last compiled function failed on this thread (tracing runs on the calling thread).
    static CLOSURE_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

unsafe extern "C" fn closure_dtor(payload: *mut std::ffi::c_void) {
    drop(unsafe { Box::from_raw(payload as *mut BoxedFn) });
}

/// A function of arrays traced and fused by MLX's compiler.
pub struct Compiled(sys::mlx_closure);

// SAFETY: the payload closure is Send + Sync; mlx closures are reference-counted std::functions.
unsafe impl Send for Compiled {}

impl Compiled {
    /// Compile `f`; `shapeless` lets one trace serve inputs of any shape.
    pub fn new(
        f: impl Fn(&[Array]) -> Result<Vec<Array>> + Send + Sync + 'static,
        shapeless: bool,
    ) -> Result<Compiled> {
        init()?;
        let boxed: Box<BoxedFn> = Box::new(Box::new(f));
        let payload = Box::into_raw(boxed) as *mut std::ffi::c_void;
        unsafe {
            let cls = (sys::extra().mlx_closure_new_func_payload)(closure_trampoline, payload, Some(closure_dtor));
            let mut compiled = sys::mlx_closure_new();
            let rc = sys::mlx_compile(&mut compiled, cls, shapeless);
            sys::mlx_closure_free(cls);
            if rc != 0 {
                sys::mlx_closure_free(compiled);
            }
            check(rc)?;
            Ok(Compiled(compiled))
        }
    }

    pub fn call(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        let v = VecArray::new(inputs);
        let mut out = VecArray::empty();
        CLOSURE_ERROR.with(|c| c.borrow_mut().take());
        count_op();
        let rc = unsafe { sys::mlx_closure_apply(&mut out.0, self.0, v.0) };
        check(rc).map_err(|e| match CLOSURE_ERROR.with(|c| c.borrow_mut().take()) {
            Some(inner) => Error::Mlx(format!("{inner} (in a compiled function: {e})")),
            None => e,
        })?;
        out.to_vec()
    }
}

impl Drop for Compiled {
    fn drop(&mut self) {
        unsafe { sys::mlx_closure_free(self.0) };
    }
}
