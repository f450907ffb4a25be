//! The greedy token of a decode step in one CUDA kernel: `argmax(logits - logsumexp(logits))` as mlx-lm
//! (and the engine's reference path) computes it with three MLX ops — `logsumexp`, `subtract`,
//! `argmax` — each a one-block-a-row reduction over the vocabulary (on an H100 an 8B step spends
//! 24 + 14.5 + 6 µs in them, bench/RESULTS-gpu.md), plus the host's work for three ops. The kernel
//! rounds every value where MLX does: the log-sum-exp in float32 (the max, then the sum of
//! `exp(x - max)`) written as the logits' dtype, each `x - lse` in that dtype, and the first index of
//! the largest (MLX's argmax keeps the first of equal values). Used only where nothing else reads the
//! log-probabilities (no logprobs asked, no logit processors, no constraint) and on CUDA;
//! `MLXRS_CUDA_GREEDY=0` turns it off (the reference ops), read per request ([`refresh`]).
use crate::error::{Error, Result};
use crate::handle::{Array, CudaKernel, Dtype, TemplateArg};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// `0`: the greedy token through MLX's logsumexp, subtract and argmax (the reference).
pub const ENV: &str = "MLXRS_CUDA_GREEDY";

static ON: AtomicBool = AtomicBool::new(true);

/// Read [`ENV`] again (the engine does per request, beside `qmv::refresh`).
pub fn refresh() {
    ON.store(!std::env::var(ENV).is_ok_and(|v| v.trim() == "0"), Ordering::Relaxed);
}

/// Threads a block (one block a row).
const THREADS: i32 = 1024;

const SOURCE: &str = r#"
    // one block a row of V logits: MLX's argmax(x - logsumexp(x)) with MLX's roundings
    const T* row = logits + (size_t)blockIdx.x * V;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nwarps = blockDim.x >> 5;
    __shared__ float redf[32];
    __shared__ int redi[32];
    const float ninf = __int_as_float(0xff800000);
    // every value of the row, 8 at a time with 16-byte reads where the row allows it
    const bool vec = sizeof(T) == 2 && V % 8 == 0;
#define MLXRS_EACH(BODY) \
    if (vec) { \
        for (int j = tid; j < V / 8; j += blockDim.x) { \
            const uint4 raw_ = reinterpret_cast<const uint4*>(row)[j]; \
            const T* e_ = reinterpret_cast<const T*>(&raw_); \
            _Pragma("unroll") \
            for (int u_ = 0; u_ < 8; ++u_) { const int i = 8 * j + u_; const T x = e_[u_]; (void)i; BODY; } \
        } \
    } else { \
        for (int i = tid; i < V; i += blockDim.x) { const T x = row[i]; BODY; } \
    }
    // 1. the max
    float m = ninf;
    MLXRS_EACH(m = fmaxf(m, static_cast<float>(x)))
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) redf[wid] = m;
    __syncthreads();
    m = ninf;
    for (int w = 0; w < nwarps; ++w) m = fmaxf(m, redf[w]);
    __syncthreads();
    // 2. the sum of exp(x - max), then the log-sum-exp written as T (MLX: max where the max is infinite)
    float s = 0.f;
    MLXRS_EACH(s += expf(static_cast<float>(x) - m))
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) redf[wid] = s;
    __syncthreads();
    s = 0.f;
    for (int w = 0; w < nwarps; ++w) s += redf[w];
    const T lse = isinf(m) ? static_cast<T>(m) : static_cast<T>(logf(s) + m);
    // 3. the largest x - lse (as T: rounding keeps the order, so it is the max's) and its first index
    const T top = static_cast<T>(m) - lse;
    int first = V;
    MLXRS_EACH(if (i < first && x - lse == top) first = i)
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    if (lane == 0) redi[wid] = first;
    __syncthreads();
    if (tid == 0) {
        for (int w = 0; w < nwarps; ++w) first = min(first, redi[w]);
        y[blockIdx.x] = first < V ? first : 0;
    }
#undef MLXRS_EACH
"#;

/// The greedy token of each row of `logits` (`[rows, V]` or `[V]`, float32, bfloat16 or float16,
/// row-contiguous) as int32 `[rows]`, where the kernel runs (CUDA, [`ENV`] not `0`); None elsewhere.
pub fn greedy(logits: &Array) -> Result<Option<Array>> {
    if !ON.load(Ordering::Relaxed) || !crate::plan::Backend::cuda() {
        return Ok(None);
    }
    let dtype = logits.dtype();
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) || !matches!(logits.ndim(), 1 | 2) {
        return Ok(None);
    }
    let v = logits.dim(-1);
    let rows = if logits.ndim() == 2 { logits.dim(0) } else { 1 };
    if v <= 0 || rows <= 0 {
        return Ok(None);
    }
    static KERNEL: OnceLock<std::result::Result<CudaKernel, String>> = OnceLock::new();
    let kern = KERNEL
        .get_or_init(|| {
            CudaKernel::new("mlxrs_greedy", &["logits"], &["y"], SOURCE, "", true).map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let template = [("T", TemplateArg::Dtype(dtype)), ("V", TemplateArg::Int(v))];
    let mut out =
        kern.apply(&[logits], &[(&[rows], Dtype::Int32)], (rows * THREADS, 1, 1), (THREADS, 1, 1), &template)?;
    Ok(out.pop())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off CUDA the kernel never runs: the engine keeps MLX's ops (the parity suite's path).
    #[test]
    fn off_cuda_it_declines() {
        if crate::plan::Backend::cuda() {
            return; // (on CUDA bench/greedy_check.py compares it with MLX's ops)
        }
        let l = Array::from_slice(&[0.5f32, 2.0, 1.0], &[1, 3]).unwrap();
        assert!(greedy(&l).unwrap().is_none());
    }

    #[test]
    fn the_kernel_text_is_compacted() {
        let short = crate::handle::kernel::compact(SOURCE);
        assert!(short.contains("MLXRS_EACH") && !short.contains("//"));
    }
}
