//! Ops by name, for the test suite (through `mlxrs._native._op`): each is checked against numpy
//! (or mlx.core where numpy has no equivalent). Safe code only; it enumerates the handles' surface:
//! every public op of `mlxrs_core::handle` is reachable from here. Built only with the `testing`
//! feature (the test build: scripts/setup.sh), never into the wheel.
//!
//! Conventions (the Python side passes `params` as JSON):
//! - inputs are consumed in the order the op's Rust signature takes them; an op's optional array
//!   arguments are present only when named in the `"opt"` list param (e.g. `"opt": ["biases"]`), and
//!   then they take the next input in signature order;
//! - `"cast_inputs": "<dtype>"` converts every floating-point input to that dtype first (how the
//!   tests reach bfloat16, which numpy has no type for);
//! - an input left over after the op took its arguments is an error (it catches mismatched tests).
#![forbid(unsafe_code)]

use mlxrs_core::handle::*;
use mlxrs_core::{Error, Result};
use serde_json::Value;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Typed access to the JSON parameters of one op.
struct Params<'a> {
    op: &'a str,
    p: &'a Value,
}

impl Params<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.p.get(k).filter(|v| !v.is_null())
    }
    fn bad(&self, k: &str, want: &str) -> Error {
        Error::Invalid(format!("{}: parameter {k:?} must be {want}, got {}", self.op, self.p[k]))
    }
    fn i64_opt(&self, k: &str) -> Result<Option<i64>> {
        self.get(k).map(|v| v.as_i64().ok_or_else(|| self.bad(k, "an integer"))).transpose()
    }
    fn i32_opt(&self, k: &str) -> Result<Option<i32>> {
        self.i64_opt(k)?.map(|v| i32::try_from(v).map_err(|_| self.bad(k, "a 32-bit integer"))).transpose()
    }
    fn i32(&self, k: &str, d: i32) -> Result<i32> {
        Ok(self.i32_opt(k)?.unwrap_or(d))
    }
    fn req_i32(&self, k: &str) -> Result<i32> {
        self.i32_opt(k)?.ok_or_else(|| self.bad(k, "given"))
    }
    fn u64(&self, k: &str) -> Result<u64> {
        self.get(k).and_then(Value::as_u64).ok_or_else(|| self.bad(k, "a non-negative integer"))
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        self.get(k).map(|v| v.as_f64().ok_or_else(|| self.bad(k, "a number"))).transpose()
    }
    fn f64(&self, k: &str, d: f64) -> Result<f64> {
        Ok(self.f64_opt(k)?.unwrap_or(d))
    }
    fn f32(&self, k: &str, d: f32) -> Result<f32> {
        Ok(self.f64_opt(k)?.map(|v| v as f32).unwrap_or(d))
    }
    fn bool(&self, k: &str, d: bool) -> Result<bool> {
        self.get(k).map(|v| v.as_bool().ok_or_else(|| self.bad(k, "a boolean"))).transpose().map(|v| v.unwrap_or(d))
    }
    fn str_opt(&self, k: &str) -> Result<Option<&str>> {
        self.get(k).map(|v| v.as_str().ok_or_else(|| self.bad(k, "a string"))).transpose()
    }
    fn vec_opt(&self, k: &str) -> Result<Option<Vec<i32>>> {
        let Some(v) = self.get(k) else { return Ok(None) };
        let arr = v.as_array().ok_or_else(|| self.bad(k, "a list of integers"))?;
        arr.iter()
            .map(|x| {
                x.as_i64().and_then(|x| i32::try_from(x).ok()).ok_or_else(|| self.bad(k, "a list of 32-bit integers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    fn vec(&self, k: &str) -> Result<Vec<i32>> {
        self.vec_opt(k)?.ok_or_else(|| self.bad(k, "given"))
    }
    fn dtype_opt(&self, k: &str) -> Result<Option<Dtype>> {
        self.str_opt(k)?
            .map(|n| Dtype::from_name(n).ok_or_else(|| Error::Invalid(format!("{}: unknown dtype {n:?}", self.op))))
            .transpose()
    }
    fn dtype(&self, k: &str, d: Dtype) -> Result<Dtype> {
        Ok(self.dtype_opt(k)?.unwrap_or(d))
    }
    fn strings(&self, k: &str) -> Result<Vec<String>> {
        let Some(v) = self.get(k) else { return Ok(Vec::new()) };
        v.as_array()
            .and_then(|a| a.iter().map(|s| s.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.bad(k, "a list of strings"))
    }
    fn string_map(&self, k: &str) -> Result<BTreeMap<String, String>> {
        let Some(v) = self.get(k) else { return Ok(BTreeMap::new()) };
        v.as_object()
            .and_then(|m| m.iter().map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string()))).collect::<Option<_>>())
            .ok_or_else(|| self.bad(k, "an object of strings"))
    }
    fn path(&self, k: &str) -> Result<PathBuf> {
        self.str_opt(k)?.map(PathBuf::from).ok_or_else(|| self.bad(k, "a path"))
    }
}

/// The inputs of one op, taken in signature order.
struct Inputs<'a> {
    op: &'a str,
    x: &'a [Array],
    next: Cell<usize>,
    opt: Vec<String>,
}

impl<'a> Inputs<'a> {
    /// The next required input.
    fn req(&self) -> Result<&'a Array> {
        let i = self.next.get();
        let a = self.x.get(i).ok_or_else(|| Error::Invalid(format!("{}: missing input {i}", self.op)))?;
        self.next.set(i + 1);
        Ok(a)
    }
    /// The next input if `key` is listed in `"opt"`, else None.
    fn opt(&self, key: &str) -> Result<Option<&'a Array>> {
        if self.opt.iter().any(|k| k == key) {
            self.req().map(Some)
        } else {
            Ok(None)
        }
    }
    /// Every input not yet taken.
    fn rest(&self) -> Vec<&'a Array> {
        let i = self.next.get();
        self.next.set(self.x.len());
        self.x[i.min(self.x.len())..].iter().collect()
    }
    fn done(&self) -> Result<()> {
        let used = self.next.get();
        if used < self.x.len() {
            return Err(Error::Invalid(format!(
                "{}: {} input(s) given but the op takes {used} (optional inputs must be listed in \"opt\")",
                self.op,
                self.x.len()
            )));
        }
        Ok(())
    }
}

fn unary_fn(name: &str) -> Option<fn(&Array) -> Result<Array>> {
    Some(match name {
        "exp" => exp,
        "log" => log,
        "log1p" => log1p,
        "sqrt" => sqrt,
        "rsqrt" => rsqrt,
        "negative" => negative,
        "abs" => abs,
        "sigmoid" => sigmoid,
        "tanh" => tanh,
        "erf" => erf,
        "square" => square,
        "sin" => sin,
        "cos" => cos,
        "floor" => floor,
        "ceil" => ceil,
        "logical_not" => logical_not,
        "isnan" => isnan,
        "isinf" => isinf,
        "stop_gradient" => stop_gradient,
        "copy" => copy,
        _ => return None,
    })
}

fn binary_fn(name: &str) -> Option<fn(&Array, &Array) -> Result<Array>> {
    Some(match name {
        "add" => add,
        "subtract" => subtract,
        "multiply" => multiply,
        "divide" => divide,
        "maximum" => maximum,
        "minimum" => minimum,
        "power" => power,
        "matmul" => matmul,
        "floor_divide" => floor_divide,
        "remainder" => remainder,
        "greater" => greater,
        "greater_equal" => greater_equal,
        "less" => less,
        "less_equal" => less_equal,
        "equal" => equal,
        "not_equal" => not_equal,
        "logical_and" => logical_and,
        "logical_or" => logical_or,
        _ => return None,
    })
}

type ReduceFn = fn(&Array, &[i32], bool) -> Result<Array>;

fn reduce_fn(name: &str) -> Option<ReduceFn> {
    Some(match name {
        "sum" => sum,
        "mean" => mean,
        "max" => max,
        "min" => min,
        "logsumexp" => logsumexp,
        _ => return None,
    })
}

/// Every op name [`dispatch`] accepts (the test below checks each is known, tests/test_ops.py that
/// each is exercised).
#[cfg(test)]
pub const OPS: &[&str] = &[
    // unary
    "exp",
    "log",
    "log1p",
    "sqrt",
    "rsqrt",
    "negative",
    "abs",
    "sigmoid",
    "tanh",
    "erf",
    "square",
    "sin",
    "cos",
    "floor",
    "ceil",
    "logical_not",
    "isnan",
    "isinf",
    "stop_gradient",
    "copy",
    // binary
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "power",
    "matmul",
    "floor_divide",
    "remainder",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "equal",
    "not_equal",
    "logical_and",
    "logical_or",
    // misc elementwise
    "scalar_as",
    "addmm",
    "where",
    "clip",
    "astype",
    "view",
    "contiguous",
    // creation
    "zeros",
    "ones",
    "full",
    "arange",
    // shape
    "reshape",
    "transpose",
    "swapaxes",
    "expand_dims",
    "squeeze",
    "flatten",
    "broadcast_to",
    "concatenate",
    "stack",
    "split",
    "repeat",
    "pad",
    // indexing
    "slice",
    "slice_axis",
    "slice_update",
    "take",
    "take_along_axis",
    "put_along_axis",
    "gather",
    // reductions and friends
    "sum",
    "mean",
    "max",
    "min",
    "logsumexp",
    "argmax",
    "argmin",
    "softmax",
    "cumsum",
    "argpartition",
    "partition",
    "topk",
    "sort",
    "argsort",
    "tril",
    "triu",
    // quantization
    "quantize",
    "dequantize",
    "quantized_matmul",
    "gather_mm",
    "gather_qmm",
    // fast kernels
    "rms_norm",
    "layer_norm",
    "rope",
    "scaled_dot_product_attention",
    "gated_delta_ops",
    "gated_delta_kernel",
    // random
    "random_key",
    "random_split",
    "random_uniform",
    "random_normal",
    "random_gumbel",
    "random_categorical",
    "random_seed",
    // evaluation, compile, io
    "eval",
    "async_eval",
    "compiled",
    "save_safetensors",
    "load_safetensors",
    "safetensors_roundtrip",
];

type ArrayFn = fn(&[Array]) -> Result<Vec<Array>>;

/// The functions `"compiled"` can trace, by the expression they compute over inputs `x`, `y`.
fn compiled_fn(expr: &str) -> Option<ArrayFn> {
    fn two(xs: &[Array]) -> Result<(&Array, &Array)> {
        match xs {
            [x, y] => Ok((x, y)),
            _ => Err(Error::Invalid(format!("compiled function takes 2 inputs, got {}", xs.len()))),
        }
    }
    Some(match expr {
        "x*y+x" => |xs| {
            let (x, y) = two(xs)?;
            Ok(vec![add(&multiply(x, y)?, x)?])
        },
        "exp(x)-y" => |xs| {
            let (x, y) = two(xs)?;
            Ok(vec![subtract(&exp(x)?, y)?])
        },
        "x@y" => |xs| {
            let (x, y) = two(xs)?;
            Ok(vec![matmul(x, y)?])
        },
        _ => return None,
    })
}

/// Apply op `name` to `x` with JSON parameters `p` (see the module docs for the conventions).
pub fn dispatch(name: &str, x: &[Array], p: &Value) -> Result<Vec<Array>> {
    if !p.is_object() && !p.is_null() {
        return Err(Error::Invalid(format!("{name}: params must be a JSON object")));
    }
    let p = Params { op: name, p };
    let cast: Vec<Array>;
    let x = match p.dtype_opt("cast_inputs")? {
        Some(dt) => {
            cast = x
                .iter()
                .map(|a| if a.dtype().is_float() { astype(a, dt) } else { Ok(a.clone()) })
                .collect::<Result<_>>()?;
            &cast[..]
        }
        None => x,
    };
    let inp = Inputs { op: name, x, next: Cell::new(0), opt: p.strings("opt")? };
    match run(name, &inp, &p) {
        Ok(out) => inp.done().map(|()| out),
        // MLX failing on arguments the test did not mean to pass: the leftover is the real story
        Err(Error::Mlx(msg)) => inp.done().and(Err(Error::Mlx(msg))),
        Err(e) => Err(e),
    }
}

fn all_axes(a: &Array) -> Vec<i32> {
    (0..a.ndim() as i32).collect()
}

fn run(name: &str, x: &Inputs<'_>, p: &Params<'_>) -> Result<Vec<Array>> {
    let one = |r: Result<Array>| r.map(|v| vec![v]);
    if let Some(f) = unary_fn(name) {
        return one(f(x.req()?));
    }
    if let Some(f) = binary_fn(name) {
        let (a, b) = (x.req()?, x.req()?);
        return one(f(a, b));
    }
    if let Some(f) = reduce_fn(name) {
        let a = x.req()?;
        let axes = p.vec_opt("axes")?.unwrap_or_else(|| all_axes(a));
        return one(f(a, &axes, p.bool("keepdims", false)?));
    }
    match name {
        // ---- misc elementwise ----
        "scalar_as" => one(scalar_as(p.f64("value", 0.0)?, p.dtype("dtype", Dtype::Float32)?)),
        "addmm" => {
            let (c, a, b) = (x.req()?, x.req()?, x.req()?);
            one(addmm(c, a, b, p.f32("alpha", 1.0)?, p.f32("beta", 1.0)?))
        }
        "where" => {
            let (c, a, b) = (x.req()?, x.req()?, x.req()?);
            one(where_(c, a, b))
        }
        "clip" => {
            let a = x.req()?;
            let lo = x.opt("lo")?;
            let hi = x.opt("hi")?;
            one(clip(a, lo, hi))
        }
        "astype" => one(astype(x.req()?, p.dtype("dtype", Dtype::Float32)?)),
        "view" => one(view(x.req()?, p.dtype("dtype", Dtype::Float32)?)),
        "contiguous" => {
            // with "axes", transpose first so the input really is strided
            let a = x.req()?;
            match p.vec_opt("axes")? {
                Some(axes) => one(contiguous(&transpose_axes(a, &axes)?)),
                None => one(contiguous(a)),
            }
        }

        // ---- creation ----
        "zeros" => one(zeros(&p.vec("shape")?, p.dtype("dtype", Dtype::Float32)?)),
        "ones" => one(ones(&p.vec("shape")?, p.dtype("dtype", Dtype::Float32)?)),
        "full" => {
            let v = x.req()?;
            one(full(&p.vec("shape")?, v, p.dtype("dtype", v.dtype())?))
        }
        "arange" => one(arange(
            p.f64("start", 0.0)?,
            p.f64_opt("stop")?.ok_or_else(|| p.bad("stop", "given"))?,
            p.f64("step", 1.0)?,
            p.dtype("dtype", Dtype::Float32)?,
        )),

        // ---- shape ----
        "reshape" => one(reshape(x.req()?, &p.vec("shape")?)),
        "transpose" => {
            let a = x.req()?;
            match p.vec_opt("axes")? {
                Some(axes) => one(transpose_axes(a, &axes)),
                None => one(transpose(a)),
            }
        }
        "swapaxes" => one(swapaxes(x.req()?, p.req_i32("axis1")?, p.req_i32("axis2")?)),
        "expand_dims" => one(expand_dims(x.req()?, p.req_i32("axis")?)),
        "squeeze" => one(squeeze(x.req()?, &p.vec("axes")?)),
        "flatten" => one(flatten(x.req()?, p.i32("start_axis", 0)?, p.i32("end_axis", -1)?)),
        "broadcast_to" => one(broadcast_to(x.req()?, &p.vec("shape")?)),
        "concatenate" => one(concatenate(&x.rest(), p.i32("axis", 0)?)),
        "stack" => one(stack(&x.rest(), p.i32("axis", 0)?)),
        "split" => split(x.req()?, p.req_i32("parts")?, p.i32("axis", 0)?),
        "repeat" => one(repeat(x.req()?, p.req_i32("repeats")?, p.req_i32("axis")?)),
        "pad" => {
            let a = x.req()?;
            let value = match x.opt("value")? {
                Some(v) => v.clone(),
                None => scalar_as(p.f64("value", 0.0)?, a.dtype())?,
            };
            let axes = p.vec_opt("axes")?.unwrap_or_else(|| all_axes(a));
            one(pad(a, &axes, &p.vec("low")?, &p.vec("high")?, &value))
        }

        // ---- indexing ----
        "slice" => {
            let a = x.req()?;
            let strides = p.vec_opt("strides")?.unwrap_or_else(|| vec![1; a.ndim()]);
            one(slice(a, &p.vec("start")?, &p.vec("stop")?, &strides))
        }
        "slice_axis" => one(slice_axis(x.req()?, p.req_i32("axis")?, p.req_i32("start")?, p.req_i32("stop")?)),
        "slice_update" => {
            let (src, upd) = (x.req()?, x.req()?);
            let strides = p.vec_opt("strides")?.unwrap_or_else(|| vec![1; src.ndim()]);
            one(slice_update(src, upd, &p.vec("start")?, &p.vec("stop")?, &strides))
        }
        "take" => {
            let (a, i) = (x.req()?, x.req()?);
            one(take(a, i, p.req_i32("axis")?))
        }
        "take_along_axis" => {
            let (a, i) = (x.req()?, x.req()?);
            one(take_along_axis(a, i, p.req_i32("axis")?))
        }
        "put_along_axis" => {
            let (a, i, v) = (x.req()?, x.req()?, x.req()?);
            one(put_along_axis(a, i, v, p.req_i32("axis")?))
        }
        "gather" => {
            let a = x.req()?;
            let idx = x.rest();
            one(gather(a, &idx, &p.vec("axes")?, &p.vec("slice_sizes")?))
        }

        // ---- reductions and friends ----
        "argmax" => one(argmax(x.req()?, p.i32("axis", -1)?, p.bool("keepdims", false)?)),
        "argmin" => one(argmin(x.req()?, p.i32("axis", -1)?, p.bool("keepdims", false)?)),
        "softmax" => {
            let a = x.req()?;
            let axes = p.vec_opt("axes")?.unwrap_or_else(|| vec![-1]);
            one(softmax(a, &axes, p.bool("precise", false)?))
        }
        "cumsum" => one(cumsum(x.req()?, p.i32("axis", -1)?, p.bool("reverse", false)?, p.bool("inclusive", true)?)),
        "argpartition" => one(argpartition(x.req()?, p.req_i32("kth")?, p.i32("axis", -1)?)),
        "partition" => one(partition(x.req()?, p.req_i32("kth")?, p.i32("axis", -1)?)),
        "topk" => one(topk(x.req()?, p.req_i32("k")?, p.i32("axis", -1)?)),
        "sort" => one(sort(x.req()?, p.i32("axis", -1)?)),
        "argsort" => one(argsort(x.req()?, p.i32("axis", -1)?)),
        "tril" => one(tril(x.req()?, p.i32("k", 0)?)),
        "triu" => one(triu(x.req()?, p.i32("k", 0)?)),

        // ---- quantization ----
        "quantize" => {
            let (q, s, b) = quantize(x.req()?, p.i32("group_size", 64)?, p.i32("bits", 4)?)?;
            Ok(vec![q, s, b])
        }
        "dequantize" => {
            let (w, s) = (x.req()?, x.req()?);
            let b = x.opt("biases")?;
            one(dequantize(w, s, b, p.i32("group_size", 64)?, p.i32("bits", 4)?, QuantMode::Affine))
        }
        "quantized_matmul" => {
            let (a, w, s) = (x.req()?, x.req()?, x.req()?);
            let b = x.opt("biases")?;
            one(quantized_matmul(
                a,
                w,
                s,
                b,
                p.bool("transpose", true)?,
                p.i32("group_size", 64)?,
                p.i32("bits", 4)?,
                QuantMode::Affine,
            ))
        }
        "gather_mm" => {
            let (a, b) = (x.req()?, x.req()?);
            let lhs = x.opt("lhs_indices")?;
            let rhs = x.opt("rhs_indices")?;
            one(gather_mm(a, b, lhs, rhs, p.bool("sorted_indices", false)?))
        }
        "gather_qmm" => {
            let (a, w, s) = (x.req()?, x.req()?, x.req()?);
            let b = x.opt("biases")?;
            let lhs = x.opt("lhs_indices")?;
            let rhs = x.opt("rhs_indices")?;
            one(gather_qmm(
                a,
                w,
                s,
                b,
                lhs,
                rhs,
                p.bool("transpose", true)?,
                p.i32("group_size", 64)?,
                p.i32("bits", 4)?,
                QuantMode::Affine,
                p.bool("sorted_indices", false)?,
            ))
        }

        // ---- fast kernels ----
        "rms_norm" => {
            let a = x.req()?;
            let w = x.opt("weight")?;
            one(rms_norm(a, w, p.f32("eps", 1e-5)?))
        }
        "layer_norm" => {
            let a = x.req()?;
            let w = x.opt("weight")?;
            let b = x.opt("bias")?;
            one(layer_norm(a, w, b, p.f32("eps", 1e-5)?))
        }
        "rope" => {
            let a = x.req()?;
            let freqs = x.opt("freqs")?;
            let base = match (p.f64_opt("base")?, freqs) {
                (Some(b), _) => Some(b as f32),
                (None, Some(_)) => None,
                (None, None) => Some(10000.0),
            };
            one(rope(
                a,
                p.i32("dims", a.dim(-1))?,
                p.bool("traditional", false)?,
                base,
                p.f32("scale", 1.0)?,
                p.i32("offset", 0)?,
                freqs,
            ))
        }
        "scaled_dot_product_attention" => {
            let (q, k, v) = (x.req()?, x.req()?, x.req()?);
            let mask = match p.str_opt("mask")?.unwrap_or("none") {
                "none" => AttnMask::None,
                "causal" => AttnMask::Causal,
                "array" => AttnMask::Array(x.req()?),
                m => return Err(Error::Invalid(format!("{name}: mask must be none, causal or array, got {m:?}"))),
            };
            let sinks = x.opt("sinks")?;
            let scale = match p.f64_opt("scale")? {
                Some(s) => s as f32,
                None => 1.0 / (q.dim(-1) as f32).sqrt(),
            };
            one(scaled_dot_product_attention(q, k, v, scale, mask, sinks))
        }
        // the gated delta rule's two paths (q, k, v, g, beta, state → y, state): the reference ops
        // and the CUDA kernel (mlxrs_core::models::gated_delta), for bench/check_gdn_kernel.py
        "gated_delta_ops" | "gated_delta_kernel" => {
            let (q, k, v, g, beta, st) = (x.req()?, x.req()?, x.req()?, x.req()?, x.req()?, x.req()?);
            let (y, s) = if name == "gated_delta_ops" {
                mlxrs_core::models::qwen3_next::gated_delta_ops(q, k, v, g, beta, st.clone())?
            } else {
                mlxrs_core::models::gated_delta::kernel(q, k, v, g, beta, st)?
            };
            Ok(vec![y, s])
        }

        // ---- random ----
        "random_key" => one(random_key(p.u64("seed")?)),
        "random_split" => {
            let (a, b) = random_split(x.req()?)?;
            Ok(vec![a, b])
        }
        "random_uniform" => {
            let key = x.req()?;
            one(random_uniform(&p.vec("shape")?, p.dtype("dtype", Dtype::Float32)?, key))
        }
        "random_normal" => {
            let key = x.req()?;
            one(random_normal(&p.vec("shape")?, p.dtype("dtype", Dtype::Float32)?, key))
        }
        "random_gumbel" => {
            let key = x.req()?;
            one(random_gumbel(&p.vec("shape")?, p.dtype("dtype", Dtype::Float32)?, key))
        }
        "random_categorical" => {
            let logits = x.req()?;
            let key = x.opt("key")?;
            one(random_categorical(logits, p.i32("axis", -1)?, key))
        }
        "random_seed" => random_seed(p.u64("seed")?).map(|()| Vec::new()),

        // ---- evaluation, compile, io ----
        "eval" | "async_eval" => {
            let xs = x.rest();
            if name == "eval" {
                eval(&xs)?;
            } else {
                async_eval(&xs)?;
            }
            Ok(xs.into_iter().cloned().collect())
        }
        "compiled" => {
            let expr = p.str_opt("fn")?.unwrap_or("x*y+x");
            let f =
                compiled_fn(expr).ok_or_else(|| Error::Invalid(format!("{name}: no compiled function {expr:?}")))?;
            let c = Compiled::new(f, p.bool("shapeless", false)?)?;
            let args = x.rest();
            // calling more than once reuses the trace
            let mut out = c.call(&args)?;
            for _ in 1..p.i32("calls", 1)?.max(1) {
                out = c.call(&args)?;
            }
            Ok(out)
        }
        "save_safetensors" | "safetensors_roundtrip" => {
            let path = p.path("path")?;
            let xs = x.rest();
            let mut names = p.strings("names")?;
            if names.is_empty() {
                names = (0..xs.len()).map(|i| format!("t{i}")).collect();
            }
            if names.len() != xs.len() {
                return Err(Error::Invalid(format!("{name}: {} names for {} inputs", names.len(), xs.len())));
            }
            let tensors: BTreeMap<String, Array> = names.iter().cloned().zip(xs.into_iter().cloned()).collect();
            save_safetensors(&path, &tensors, &p.string_map("metadata")?)?;
            if name == "save_safetensors" {
                return Ok(Vec::new());
            }
            let (mut loaded, _) = load_safetensors(&path)?;
            names
                .iter()
                .map(|n| loaded.remove(n).ok_or_else(|| Error::Invalid(format!("{name}: {n} missing after load"))))
                .collect()
        }
        "load_safetensors" => {
            // tensors in name order; with "with_metadata", one more uint8 array holding the metadata as JSON
            let (tensors, meta) = load_safetensors(&p.path("path")?)?;
            let mut out: Vec<Array> = tensors.into_values().collect();
            if p.bool("with_metadata", false)? {
                let json = serde_json::to_vec(&meta).map_err(|e| Error::Invalid(e.to_string()))?;
                out.push(Array::from_slice(&json, &[json.len() as i32])?);
            }
            Ok(out)
        }
        _ => Err(Error::Invalid(format!("unknown op {name:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_op_is_known() {
        // an unknown op is reported as such; every listed one gets past the name lookup
        let none: &[Array] = &[];
        for op in OPS {
            let r = dispatch(op, none, &Value::Null);
            if let Err(Error::Invalid(msg)) = &r {
                assert!(!msg.starts_with("unknown op"), "{op}: {msg}");
            }
        }
        assert!(
            matches!(dispatch("no_such_op", none, &Value::Null), Err(Error::Invalid(m)) if m.contains("unknown op"))
        );
    }

    #[test]
    fn optional_inputs_and_leftovers() {
        let a = Array::from_slice(&[-2.0f32, 0.5, 3.0], &[3]).unwrap();
        let lo = Array::f32(-1.0).unwrap();
        let hi = Array::f32(1.0).unwrap();
        let out = dispatch("clip", &[a.clone(), lo.clone(), hi], &serde_json::json!({"opt": ["lo", "hi"]})).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![-1.0, 0.5, 1.0]);
        let out = dispatch("clip", &[a.clone(), lo.clone()], &serde_json::json!({"opt": ["lo"]})).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![-1.0, 0.5, 3.0]);
        // an optional input not declared in "opt" is a leftover, reported rather than ignored
        let err = dispatch("clip", &[a, lo], &serde_json::json!({})).unwrap_err();
        assert!(matches!(&err, Error::Invalid(m) if m.contains("opt")), "{err}");
    }

    #[test]
    fn scalar_as_keeps_every_integer_digit() {
        // 2^24 + 1 does not survive a float32 detour
        let s = scalar_as(16_777_217.0, Dtype::Int32).unwrap();
        assert_eq!(s.dtype(), Dtype::Int32);
        assert_eq!(s.item_i32().unwrap(), 16_777_217);
        let h = scalar_as(0.1, Dtype::Bfloat16).unwrap();
        assert_eq!(h.dtype(), Dtype::Bfloat16);
        assert_eq!(h.to_vec::<half::bf16>().unwrap(), vec![half::bf16::from_f64(0.1)]);
    }

    #[test]
    fn slice_axis_out_of_range_is_an_error_not_a_panic() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        assert!(matches!(slice_axis(&a, 2, 0, 1), Err(Error::Invalid(_))));
        assert!(matches!(slice_axis(&a, -3, 0, 1), Err(Error::Invalid(_))));
        assert_eq!(slice_axis(&a, -1, 1, 2).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    }

    #[test]
    fn compiled_function_failures_are_errors_with_their_reason() {
        let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        let boom = Compiled::new(|_: &[Array]| -> Result<Vec<Array>> { panic!("boom in the closure") }, false).unwrap();
        let err = boom.call(&[&x]).unwrap_err();
        assert!(err.to_string().contains("boom in the closure"), "{err}");
        let bad = Compiled::new(|xs: &[Array]| Ok(vec![matmul(&xs[0], &xs[1])?]), false).unwrap();
        let m = Array::from_slice(&[1.0f32; 6], &[2, 3]).unwrap();
        let err = bad.call(&[&m, &m]).unwrap_err();
        assert!(err.to_string().contains("[matmul]"), "{err}");
        // the process carries on, and a good compiled function still works
        let good = Compiled::new(|xs: &[Array]| Ok(vec![add(&multiply(&xs[0], &xs[1])?, &xs[0])?]), false).unwrap();
        assert_eq!(good.call(&[&x, &x]).unwrap()[0].to_vec::<f32>().unwrap(), vec![2.0, 6.0]);
    }
}
