//! Attention dispatch: MLX's fused `scaled_dot_product_attention`, or the same product written out
//! in ops (MLX's own fallback, op for op) for a prompt whose shape the CUDA backend has not seen.
//!
//! Why: MLX 0.32's CUDA attention sends a prompt (more than one query) to cuDNN, which builds an
//! execution graph per distinct (query, key, value, mask) shape and caches it (`sdpa_cache`, LRU of
//! 256). A first-seen shape pays the build — ~40–60 ms on an H200 — and a prompt that extends a
//! prefix-cache hit has a new (new tokens, cached + new tokens) shape every time: an agent's turn
//! spent 74 ms in the engine for ~470 new tokens against 21 ms with cuDNN switched off
//! (bench/RESULTS-gpu.md). Switching cuDNN off altogether costs long cold prompts 3×, so the choice is
//! made per call: on CUDA a prompt shape whose score matrix is small enough runs the written-out
//! product (no graph to build, the same values as MLX's fallback) until it has been evaluated once —
//! for every layer of the forward pass that first meets it, since MLX builds the whole pass's graph
//! before running it ([`mx::eval_epoch`] tells the two apart); a shape evaluated before — a chunked
//! prefill's full chunks, a repeated prompt length — goes to MLX and so to cuDNN, whose graph is then
//! built once and reused. Decode (one query) always goes to MLX (its one-query kernel).
//! `MLXRS_SDPA_NEW_SHAPES` (`docs/configuration.md`): `auto` (this), `fused` (always MLX's choice),
//! `unfused` (every call without sinks written out, on any backend: the check that both paths agree).
use crate::cache::Mask;
use crate::error::Result;
use crate::handle::{self as mx, Array, AttnMask, Dtype};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The environment variable choosing the dispatch ([`Mode`]).
pub const NEW_SHAPES_ENV: &str = "MLXRS_SDPA_NEW_SHAPES";

/// Up to how many attention scores (batch × query heads × queries × keys) a first-seen prompt shape
/// is written out: 2^27 (256 MB of bfloat16 scores, the largest transient this path adds). Past it the
/// product itself outweighs a graph build (a cold 7000-token prompt: 109 ms more written out, one
/// build ~50 ms), so MLX (cuDNN) takes it.
pub const UNFUSED_MAX_SCORES: u64 = 1 << 27;

/// How many distinct prompt shapes are remembered (MLX keeps 256 graphs; more shapes than this are
/// forgotten all at once, costing at most one written-out call each).
const SEEN_CAP: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// First-seen prompt shapes written out on CUDA; everything else to MLX.
    Auto,
    /// Always MLX's fused call.
    Fused,
    /// Every call without sinks written out, on any backend.
    Unfused,
}

/// The dispatch now ([`NEW_SHAPES_ENV`], read at each call so a test can switch it).
pub fn mode() -> Mode {
    match std::env::var(NEW_SHAPES_ENV).as_deref().map(str::trim) {
        Ok("fused") | Ok("0") => Mode::Fused,
        Ok("unfused") => Mode::Unfused,
        _ => Mode::Auto,
    }
}

fn cuda() -> bool {
    static CUDA: OnceLock<bool> = OnceLock::new();
    *CUDA.get_or_init(mx::cuda_is_available)
}

/// What MLX keys a cuDNN graph by, as far as the caller sees it (shapes, dtype, mask kind and shape;
/// MLX adds the keys' strides, which follow from the cache's capacity).
#[derive(Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    dtype: Dtype,
    q: Vec<i32>,
    k: Vec<i32>,
    v: Vec<i32>,
    mask: (u8, Vec<i32>),
}

/// Each shape seen, with the evaluation epoch ([`mx::eval_epoch`]) when it was first seen.
fn seen() -> &'static Mutex<HashMap<ShapeKey, u64>> {
    static SEEN: OnceLock<Mutex<HashMap<ShapeKey, u64>>> = OnceLock::new();
    SEEN.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether MLX 0.32's CUDA backend would send this call to cuDNN as a prompt
/// (`supports_sdpa_cudnn` in mlx/backend/cuda/scaled_dot_product_attention.cpp, less the
/// one-query case).
fn cudnn_prompt(q: &Array, k: &Array, v: &Array, mask: &AttnMask<'_>) -> bool {
    let (lq, lk) = (q.dim(2), k.dim(2));
    let dims_ok = |d: i32| d % 8 == 0 && d <= 128;
    lq > 1
        && matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        && dims_ok(q.dim(-1))
        && dims_ok(v.dim(-1))
        && !(matches!(mask, AttnMask::Causal) && lq > lk)
}

/// Whether this call is written out ([`Mode`]); remembers its shape when it is.
fn write_out(q: &Array, k: &Array, v: &Array, mask: &AttnMask<'_>, sinks: Option<&Array>) -> bool {
    if sinks.is_some() || q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.dtype() != q.dtype() {
        return false;
    }
    match mode() {
        Mode::Fused => false,
        Mode::Unfused => true,
        Mode::Auto => cuda() && cudnn_prompt(q, k, v, mask) && first_seen(q, k, v, mask),
    }
}

/// True while a shape small enough to write out has not been evaluated yet: from its first call until
/// the next evaluation, so every layer of the forward pass that first meets it (the graph is built
/// for all of them before it runs) is written out; false after that, and for larger shapes.
fn first_seen(q: &Array, k: &Array, v: &Array, mask: &AttnMask<'_>) -> bool {
    let scores = [q.dim(0), q.dim(1), q.dim(2), k.dim(2)].iter().map(|&d| d.max(0) as u64).product::<u64>();
    if scores > UNFUSED_MAX_SCORES {
        return false;
    }
    let mask = match mask {
        AttnMask::None => (0, Vec::new()),
        AttnMask::Causal => (1, Vec::new()),
        AttnMask::Array(a) => (2, a.shape()),
    };
    let key = ShapeKey { dtype: q.dtype(), q: q.shape(), k: k.shape(), v: v.shape(), mask };
    let now = mx::eval_epoch();
    let mut seen = seen().lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() >= SEEN_CAP {
        seen.clear();
    }
    *seen.entry(key).or_insert(now) == now
}

/// `softmax(scale · q kᵀ + mask) v` for q `[B, heads, Lq, D]`, k and v `[B, kv_heads, Lk, D]`: MLX's
/// fused call, or written out ([`write_out`]). Every attention of the models goes through here.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttnMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    if write_out(q, k, v, &mask, sinks) {
        return unfused(q, k, v, scale, &mask);
    }
    if let Some(out) = cpu_half_prompt(q, k, v, scale, &mask, sinks)? {
        return Ok(out);
    }
    mx::scaled_dot_product_attention(q, k, v, scale, mask, sinks)
}

/// A prompt's attention (more than one query) over 16-bit floats on the CPU through the host op
/// ([`mx::host_half_attention`]: MLX's fallback's rounding points, each product an exact float32 sum
/// through the BLAS, a bounded transient) where MLX's half-precision CPU matmul would run it:
/// `layers::cpu_half`, no sinks, no mask, the causal one or a boolean `[Lq, Lk]` one (a sliding
/// window's). None elsewhere (decode steps keep MLX's:
/// one query, and the op would widen the whole cache per step).
fn cpu_half_prompt(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &AttnMask<'_>,
    sinks: Option<&Array>,
) -> Result<Option<Array>> {
    let (causal, marr) = match mask {
        AttnMask::None => (false, None),
        AttnMask::Causal => (true, None),
        // a boolean [Lq, Lk] (a sliding window's, cache.rs `causal_mask`), or one with leading axes of 1
        AttnMask::Array(m)
            if m.dtype() == Dtype::Bool
                && m.ndim() >= 2
                && m.shape()[..m.ndim() - 2].iter().all(|&d| d == 1)
                && m.dim(-2) == q.dim(2)
                && m.dim(-1) == k.dim(2) =>
        {
            (false, Some(if m.ndim() == 2 { (*m).clone() } else { mx::reshape(m, &[m.dim(-2), m.dim(-1)])? }))
        }
        AttnMask::Array(_) => return Ok(None),
    };
    if sinks.is_some()
        || q.ndim() != 4
        || q.dim(2) < 2
        || !matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        || k.dtype() != q.dtype()
        || v.dtype() != q.dtype()
        || !super::layers::cpu_half()
    {
        return Ok(None);
    }
    mx::host_half_attention(q, k, v, marr.as_ref(), scale, causal)
}

/// [`attention`] with the cache's mask kind.
pub fn attention_masked(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask,
    sinks: Option<&Array>,
) -> Result<Array> {
    let m = match mask {
        Mask::None => AttnMask::None,
        Mask::Causal => AttnMask::Causal,
        Mask::Array(a) => AttnMask::Array(a),
    };
    attention(q, k, v, scale, m, sinks)
}

/// The product written out as MLX 0.32's `fast::scaled_dot_product_attention` fallback writes it (no
/// sinks): scaled queries, grouped-query heads as an extra axis, scores in the inputs' dtype, the mask
/// (causal from the bottom right, boolean by `where`, additive in the inputs' dtype), a precise
/// softmax, the values.
pub fn unfused(q: &Array, k: &Array, v: &Array, scale: f32, mask: &AttnMask<'_>) -> Result<Array> {
    let dtype = q.dtype();
    let (b, nq, lq, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let nkv = k.dim(1);
    let rep = nq / nkv.max(1);
    let mut q = mx::multiply(&mx::scalar_as(scale as f64, dtype)?, q)?;
    let (k, v) = if rep > 1 {
        q = mx::reshape(&q, &[b, nkv, rep, lq, d])?;
        (mx::expand_dims(k, 2)?, mx::expand_dims(v, 2)?)
    } else {
        (k.clone(), v.clone())
    };
    let mut scores = mx::matmul(&q, &mx::swapaxes(&k, -1, -2)?)?;
    let lk = k.dim(-2);
    let fill = |scores: &Array, m: &Array| -> Result<Array> {
        if m.dtype() == Dtype::Bool {
            mx::where_(m, scores, &mx::scalar_as(super::layers::finfo_min(scores.dtype()), scores.dtype())?)
        } else {
            let m = if m.dtype() == scores.dtype() { m.clone() } else { mx::astype(m, scores.dtype())? };
            mx::add(scores, &m)
        }
    };
    match mask {
        AttnMask::None => {}
        AttnMask::Causal => {
            let off = (lk - lq) as f64;
            let qi = mx::expand_dims(&mx::arange(off, off + lq as f64, 1.0, Dtype::Int32)?, 1)?;
            let ki = mx::expand_dims(&mx::arange(0.0, lk as f64, 1.0, Dtype::Int32)?, 0)?;
            scores = fill(&scores, &mx::greater_equal(&qi, &ki)?)?;
        }
        AttnMask::Array(m) => {
            // broadcastable to [B, heads, Lq, Lk]; with grouped heads one more axis
            let m = if rep > 1 && m.ndim() >= 3 {
                if m.dim(-3) == 1 {
                    mx::expand_dims(m, -3)?
                } else {
                    let mut sh = m.shape();
                    let at = sh.len() - 3;
                    sh.splice(at..at + 1, [nkv, rep]);
                    mx::reshape(m, &sh)?
                }
            } else {
                (*m).clone()
            };
            scores = fill(&scores, &m)?;
        }
    }
    let probs = mx::softmax(&scores, &[-1], true)?;
    let out = mx::matmul(&probs, &v)?;
    if rep > 1 {
        mx::reshape(&out, &[b, nq, lq, v.dim(-1)])
    } else {
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
        let key = mx::random_key(seed).unwrap();
        let a = mx::random_normal(shape, Dtype::Float32, &key).unwrap();
        mx::astype(&a, dtype).unwrap()
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        let d = mx::abs(
            &mx::subtract(&mx::astype(a, Dtype::Float32).unwrap(), &mx::astype(b, Dtype::Float32).unwrap()).unwrap(),
        )
        .unwrap();
        mx::max(&mx::reshape(&d, &[-1]).unwrap(), &[0], false).unwrap().item_f32().unwrap()
    }

    /// The written-out product against MLX's fused call (on the CPU, MLX's fallback): grouped and
    /// plain heads, every mask kind, a prompt extending a cache (Lq < Lk), float32 and bfloat16.
    #[test]
    fn written_out_equals_mlx() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for (nq, nkv) in [(4, 4), (8, 2)] {
                for (lq, lk) in [(1, 9), (5, 5), (7, 19)] {
                    let q = rand(&[2, nq, lq, 16], dtype, 1);
                    let k = rand(&[2, nkv, lk, 16], dtype, 2);
                    let v = rand(&[2, nkv, lk, 16], dtype, 3);
                    let key = mx::random_key(4).unwrap();
                    let boolm = mx::greater(
                        &mx::random_normal(&[2, 1, lq, lk], Dtype::Float32, &key).unwrap(),
                        &mx::scalar_as(-0.5, Dtype::Float32).unwrap(),
                    )
                    .unwrap();
                    // every query keeps its last key (no all-masked row)
                    let last = mx::greater_equal(
                        &mx::arange(0.0, lk as f64, 1.0, Dtype::Int32).unwrap(),
                        &mx::scalar_as((lk - 1) as f64, Dtype::Int32).unwrap(),
                    )
                    .unwrap();
                    let boolm = mx::logical_or(&boolm, &last).unwrap();
                    let addm = mx::astype(&rand(&[1, nq, lq, lk], Dtype::Float32, 5), dtype).unwrap();
                    let masks: [AttnMask<'_>; 4] =
                        [AttnMask::None, AttnMask::Causal, AttnMask::Array(&boolm), AttnMask::Array(&addm)];
                    for m in masks {
                        let what = format!("{dtype:?} heads {nq}/{nkv} L {lq}/{lk} mask {}", mask_name(&m));
                        let ours = unfused(&q, &k, &v, 0.25, &m).unwrap();
                        let theirs = mx::scaled_dot_product_attention(&q, &k, &v, 0.25, m, None).unwrap();
                        assert_eq!(ours.shape(), theirs.shape(), "{what}");
                        // on the CPU MLX runs this very fallback: bit for bit; a GPU's fused kernels round differently
                        let gpu = mx::cuda_is_available() || mx::metal_is_available();
                        let tol = match (gpu, dtype) {
                            (false, _) => 0.0,
                            (true, Dtype::Float32) => 1e-5,
                            (true, _) => 3e-2,
                        };
                        let diff = max_abs_diff(&ours, &theirs);
                        assert!(diff <= tol, "{what}: max |Δ| {diff}");
                    }
                }
            }
        }
    }

    /// One decode step's attention for rows with caches of their own, as one op
    /// (`mx::rows_decode_attention`), against MLX's attention of each row alone, on a CPU stream:
    /// rows of 1 to 300 keys, grouped and plain heads, head sizes that are and are not a multiple of
    /// the kernel's 8 partial sums, keys and values as views of larger cache buffers (as a cache
    /// returns them) and as transposed views (a last axis that is not contiguous); float32, and
    /// bfloat16 and float16 (MLX's rounding points, float32 sums in another order: within a few
    /// rounding steps, most outputs equal).
    #[test]
    fn rows_decode_attention_equals_mlx_per_row() {
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            for (dt, nq, nkv, d) in [
                (Dtype::Float32, 4, 4, 16),
                (Dtype::Float32, 8, 2, 20),
                (Dtype::Float32, 6, 3, 64),
                (Dtype::Bfloat16, 8, 2, 20),
                (Dtype::Bfloat16, 6, 3, 64),
                (Dtype::Float16, 8, 2, 20),
            ] {
                let lens = [1, 9, 300, 37];
                let q = rand(&[lens.len() as i32, nq, 1, d], dt, 7);
                let mut kv = Vec::new();
                for (i, &l) in lens.iter().enumerate() {
                    let seed = 100 + 2 * i as u64;
                    let (k, v) = if i == 3 {
                        // [1, kv, D, L] transposed to [1, kv, L, D]: the last axis strided
                        let kt = rand(&[1, nkv, d, l], dt, seed);
                        let vt = rand(&[1, nkv, d, l], dt, seed + 1);
                        (mx::swapaxes(&kt, 2, 3).unwrap(), mx::swapaxes(&vt, 2, 3).unwrap())
                    } else {
                        // the first l positions of a buffer of 512 (a cache's capacity)
                        let kb = rand(&[1, nkv, 512, d], dt, seed);
                        let vb = rand(&[1, nkv, 512, d], dt, seed + 1);
                        (mx::slice_axis(&kb, 2, 0, l).unwrap(), mx::slice_axis(&vb, 2, 0, l).unwrap())
                    };
                    kv.push((k, v));
                }
                let pairs: Vec<(&Array, &Array)> = kv.iter().map(|(k, v)| (k, v)).collect();
                let pool_calls = mx::PARALLEL_FOR_CALLS.load(std::sync::atomic::Ordering::Relaxed);
                let ours = mx::rows_decode_attention(&q, &pairs, 0.125)
                    .unwrap()
                    .expect("the libmlxc built by native/ has the op");
                ours.eval().unwrap();
                assert!(
                    mx::PARALLEL_FOR_CALLS.load(std::sync::atomic::Ordering::Relaxed) > pool_calls,
                    "the op splits its rows over mlxrs's pool"
                );
                assert_eq!(ours.shape(), q.shape());
                assert_eq!(ours.dtype(), dt);
                let (mut equal, mut total) = (0, 0);
                for (b, (k, v)) in kv.iter().enumerate() {
                    let qb = mx::slice_axis(&q, 0, b as i32, b as i32 + 1).unwrap();
                    let theirs = mx::scaled_dot_product_attention(&qb, k, v, 0.125, AttnMask::None, None).unwrap();
                    let mine = mx::slice_axis(&ours, 0, b as i32, b as i32 + 1).unwrap();
                    let diff = max_abs_diff(&mine, &theirs);
                    // outputs are averages of values of magnitude ~1: a bfloat16 step is 2^-8..2^-7, a
                    // float16 step 2^-11..2^-10
                    let tol = match dt {
                        Dtype::Float32 => 2e-6,
                        Dtype::Float16 => 4.0 * 2f32.powi(-10),
                        _ => 4.0 * 2f32.powi(-7),
                    };
                    assert!(diff <= tol, "{dt:?} heads {nq}/{nkv} D {d} row {b} (L {}): max |Δ| {diff}", lens[b]);
                    let f = |a: &Array| mx::astype(a, Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    let (m, t) = (f(&mine), f(&theirs));
                    equal += m.iter().zip(&t).filter(|(a, b)| a == b).count();
                    total += m.len();
                }
                if dt != Dtype::Float32 {
                    assert!(equal * 2 >= total, "only {equal} of {total} {dt:?} outputs equal MLX's");
                }
            }
            // shapes it does not take are refused with MLX's error, not computed
            let q = rand(&[2, 4, 1, 16], Dtype::Float32, 1);
            let k = rand(&[1, 4, 5, 16], Dtype::Float32, 2);
            assert!(mx::rows_decode_attention(&q, &[(&k, &k)], 0.25).is_err(), "one row's keys for two rows");
            let k8 = rand(&[1, 4, 5, 8], Dtype::Float32, 3);
            assert!(mx::rows_decode_attention(&q, &[(&k, &k), (&k8, &k8)], 0.25).is_err(), "another head size");
            let qb = rand(&[2, 4, 1, 16], Dtype::Bfloat16, 4);
            assert!(mx::rows_decode_attention(&qb, &[(&k, &k), (&k, &k)], 0.25).is_err(), "keys of another type");
            let qh = rand(&[2, 4, 1, 16], Dtype::Float16, 4);
            let kb = rand(&[1, 4, 5, 16], Dtype::Bfloat16, 2);
            assert!(
                mx::rows_decode_attention(&qh, &[(&kb, &kb), (&kb, &kb)], 0.25).is_err(),
                "keys of another 16-bit type"
            );
        });
    }

    fn mask_name(m: &AttnMask<'_>) -> &'static str {
        match m {
            AttnMask::None => "none",
            AttnMask::Causal => "causal",
            AttnMask::Array(a) if a.dtype() == Dtype::Bool => "bool",
            AttnMask::Array(_) => "additive",
        }
    }

    /// A shape is written out until the first evaluation after it was first seen (every layer of
    /// the pass that meets it), not after; a too-large one never; decode and float32 are never cuDNN
    /// prompts.
    #[test]
    fn first_seen_then_mlx() {
        let q = rand(&[1, 4, 37, 16], Dtype::Bfloat16, 11);
        let k = rand(&[1, 2, 301, 16], Dtype::Bfloat16, 12);
        assert!(cudnn_prompt(&q, &k, &k, &AttnMask::Causal));
        // two layers of one pass: both written out (other tests evaluate concurrently and move the
        // epoch: a fresh shape per try until one pass sees no evaluation between its layers)
        let same_pass = (0..50).any(|i| {
            let k = mx::zeros(&[1, 2, 400 + i, 16], Dtype::Bfloat16).unwrap();
            let e = mx::eval_epoch();
            let (a, b) = (first_seen(&q, &k, &k, &AttnMask::Causal), first_seen(&q, &k, &k, &AttnMask::Causal));
            assert!(a, "a new shape is written out");
            mx::eval_epoch() == e && b
        });
        assert!(same_pass, "the second layer of a pass was not written out");
        assert!(first_seen(&q, &k, &k, &AttnMask::Causal));
        mx::eval(&[&q]).unwrap();
        assert!(!first_seen(&q, &k, &k, &AttnMask::Causal), "a shape evaluated before goes to MLX");
        // another mask kind, another shape
        assert!(first_seen(&q, &k, &k, &AttnMask::None));
        mx::eval(&[&q]).unwrap();
        let one = rand(&[1, 4, 1, 16], Dtype::Bfloat16, 13);
        assert!(!cudnn_prompt(&one, &k, &k, &AttnMask::None));
        let f32q = rand(&[1, 4, 37, 16], Dtype::Float32, 14);
        assert!(!cudnn_prompt(&f32q, &k, &k, &AttnMask::Causal));
        let wide = rand(&[1, 4, 37, 136], Dtype::Bfloat16, 15);
        assert!(!cudnn_prompt(&wide, &wide, &wide, &AttnMask::None));
        // causal with more queries than keys: not cuDNN
        let short = rand(&[1, 2, 30, 16], Dtype::Bfloat16, 16);
        assert!(!cudnn_prompt(&q, &short, &short, &AttnMask::Causal));
        // 2^27 scores and more: MLX's
        let big_q = mx::zeros(&[1, 32, 4096, 16], Dtype::Bfloat16).unwrap();
        let big_k = mx::zeros(&[1, 8, 1025, 16], Dtype::Bfloat16).unwrap();
        assert!(!first_seen(&big_q, &big_k, &big_k, &AttnMask::Causal));
    }

    /// The attention op's time for a 16-row step of fit-llama-f32's shape (8 heads of 128) over
    /// 64–512 keys a row, views of 1024-slot buffers, against MLX's attention per row (not a check:
    /// run by hand, `cargo test --release -p mlxrs-core rows_attention_time -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn rows_attention_time() {
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            let (rows, heads, d) = (16, 8, 128);
            for len in [64, 256, 512] {
                let q = rand(&[rows, heads, 1, d], Dtype::Float32, 7);
                let kv: Vec<(Array, Array)> = (0..rows)
                    .map(|i| {
                        let kb = rand(&[1, heads, 1024, d], Dtype::Float32, 100 + i as u64);
                        let vb = rand(&[1, heads, 1024, d], Dtype::Float32, 300 + i as u64);
                        (mx::slice_axis(&kb, 2, 0, len).unwrap(), mx::slice_axis(&vb, 2, 0, len).unwrap())
                    })
                    .collect();
                let pairs: Vec<(&Array, &Array)> = kv.iter().map(|(k, v)| (k, v)).collect();
                let mut all: Vec<&Array> = kv.iter().flat_map(|(k, v)| [k, v]).collect();
                all.push(&q);
                mx::eval(&all).unwrap();
                let reps = 20;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    mx::rows_decode_attention(&q, &pairs, 0.088).unwrap().unwrap().eval().unwrap();
                }
                let ours = t.elapsed().as_secs_f64() / reps as f64;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    let outs: Vec<Array> = kv
                        .iter()
                        .enumerate()
                        .map(|(b, (k, v))| {
                            let qb = mx::slice_axis(&q, 0, b as i32, b as i32 + 1).unwrap();
                            mx::scaled_dot_product_attention(&qb, k, v, 0.088, AttnMask::None, None).unwrap()
                        })
                        .collect();
                    mx::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
                }
                let mlx = t.elapsed().as_secs_f64() / reps as f64;
                eprintln!("{rows} rows x {len} keys: op {:.3} ms, MLX per row {:.3} ms", ours * 1e3, mlx * 1e3);
            }
        });
    }
}
