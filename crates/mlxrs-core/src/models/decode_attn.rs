//! A decode step's attention in one CUDA kernel that reads the KV cache's buffers directly: row `b`'s
//! query (one token) over keys `lo..=pos[b]` of slot `b` of the buffers `[slots, kv_heads, capacity,
//! head_dim]`, where `pos[b]` is the position the step wrote its key at (the step's positions array,
//! the one the fused q/k/v + rotary kernel already took: [`super::qmv::step_positions`]) and `lo` is
//! `pos[b] + 1 - window` for a sliding window (else 0).
//!
//! What it replaces, per layer: MLX's `scaled_dot_product_attention` over two slices of the buffers
//! (the cache's views of its filled part: two ops of host work each step and layer — a 1B decode step
//! on an H100 waits on the host, ~8 µs an op), and for the stacked KV of a batch also the boolean
//! mask of each row's length, which MLX 0.32's CUDA backend turns into an additive one (one more op a
//! layer) and attends through cuDNN, with an execution graph built for every new key count — every
//! step of a batch in a server. The kernel's arithmetic is MLX's one-pass vector kernel's (float32
//! scores of the query scaled by `scale · log2 e`, a running max and sum in base 2 per warp, the
//! warps' parts combined at the end), with its own work split: a block of 32 warps per (head, row),
//! warp `w` taking keys `lo + w, lo + w + 32, …`. Up to [`MAX_KEYS`] keys a row where the step has
//! fewer than [`WIDE_BLOCKS`] (head, row) blocks (MLX's own split at 1024 keys: beyond it MLX's
//! two-pass kernel spreads a query over more blocks, which a GPU of 132 multiprocessors needs when
//! one row's 32 heads are all the work); any length where it has that many (a batch: the blocks fill
//! the GPU already, and MLX's path there would be the mask through cuDNN).
//!
//! `MLXRS_CUDA_DECODE_ATTN=0` keeps MLX's ops (the reference path), read per request ([`refresh`]).
//! `bench/attn_check.py` compares the kernel with MLX's attention on the device.
use crate::error::{Error, Result};
use crate::handle::{Array, CudaKernel, Dtype, TemplateArg};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// `0`: a decode step's attention through MLX's `scaled_dot_product_attention` over the cache's views
/// (the reference).
pub const ENV: &str = "MLXRS_CUDA_DECODE_ATTN";

/// The most keys a row attends over in the kernel when the step has fewer than [`WIDE_BLOCKS`]
/// (head, row) blocks (MLX's one-pass limit).
pub const MAX_KEYS: i32 = 1024;

/// (head, row) blocks from which the kernel takes any number of keys.
pub const WIDE_BLOCKS: i32 = 256;

/// Whether `positions` (one a row, `heads` query heads) are in the kernel's reach ([`MAX_KEYS`],
/// [`WIDE_BLOCKS`]).
fn in_reach(positions: &[i32], heads: i32) -> bool {
    let wide = positions.len() as i64 * heads as i64 >= WIDE_BLOCKS as i64;
    positions.iter().all(|&p| p >= 0 && (wide || p < MAX_KEYS))
}

static ON: AtomicBool = AtomicBool::new(true);

/// Read [`ENV`] again (the engine does per request, beside `qmv::refresh`).
pub fn refresh() {
    ON.store(!std::env::var(ENV).is_ok_and(|v| v.trim() == "0"), Ordering::Relaxed);
}

/// Threads a block: 32 warps.
const THREADS: i32 = 1024;

pub(crate) const SOURCE: &str = r#"
    // one block a (head, row): the row's query over keys lo..=pos[row] of its slot
    const int h = blockIdx.x, b = blockIdx.y;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    constexpr int PER = D / 32;
    const int H = q_shape[1], KVH = k_shape[1], CAP = k_shape[2];
    const int kvh = h / (H / KVH);
    const int end = pos[b] + 1;
    const int lo = WINDOW > 0 ? max(0, end - WINDOW) : 0;
    const float qs = __int_as_float(SCALE_BITS) * 1.4426950408889634f;
    const T* qp = q + ((size_t)b * H + h) * D + lane * PER;
    float qv[PER], acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) { qv[i] = qs * static_cast<float>(qp[i]); acc[i] = 0.f; }
    const size_t base = ((size_t)b * KVH + kvh) * (size_t)CAP * D + lane * PER;
    float m = -3.402823466e38f, s = 0.f;
    for (int j = lo + w; j < end; j += 32) {
        const T* kp = k + base + (size_t)j * D;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) dot += qv[i] * static_cast<float>(kp[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float nm = fmaxf(m, dot), f = exp2f(m - nm), e = exp2f(dot - nm);
        m = nm;
        s = s * f + e;
        const T* vp = v + base + (size_t)j * D;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * f + e * static_cast<float>(vp[i]);
    }
    __shared__ float wmax[32], wsum[32];
    __shared__ float part[32][D];
    if (lane == 0) { wmax[w] = m; wsum[w] = s; }
    __syncthreads();
    // the block's max and sum; each warp's part rescaled to the block's max
    float gm = wmax[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
    float tot = wsum[lane] * exp2f(wmax[lane] - gm);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
    const float f = exp2f(m - gm);
#pragma unroll
    for (int i = 0; i < PER; ++i) part[w][lane * PER + i] = acc[i] * f;
    __syncthreads();
    const float inv = tot == 0.f ? 0.f : __frcp_rn(tot);
    T* op = out + ((size_t)b * H + h) * D;
    for (int t = threadIdx.x; t < D; t += blockDim.x) {
        float r = 0.f;
#pragma unroll
        for (int u = 0; u < 32; ++u) r += part[u][t];
        op[t] = static_cast<T>(r * inv);
    }
"#;

/// Why [`attention`] declines `q, k, v` (None: it takes them) — the shapes and types alone.
fn unsuitable(q: &Array, k: &Array, v: &Array, rows: usize) -> Option<&'static str> {
    let dtype = q.dtype();
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) || k.dtype() != dtype || v.dtype() != dtype {
        return Some("dtype");
    }
    if q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.dim(2) != 1 {
        return Some("not one query a row");
    }
    let d = q.dim(3);
    if d % 32 != 0 || !(32..=256).contains(&d) || k.dim(3) != d || v.dim(3) != d {
        return Some("head size");
    }
    let (h, kvh) = (q.dim(1), k.dim(1));
    if kvh <= 0 || h % kvh != 0 || v.dim(1) != kvh || v.dim(2) != k.dim(2) || v.dim(0) != k.dim(0) {
        return Some("heads");
    }
    if q.dim(0) as usize != rows || k.dim(0) < q.dim(0) {
        return Some("rows");
    }
    None
}

/// Whether [`attention`] takes a step's queries `q` with its new keys and values `k`, `v` (`[B,
/// kv_heads, 1, head_dim]`) at `positions`: asked before the cache is written, so that the caller
/// writes it once, for the path it takes (the buffers then are at least `positions[b] + 1` long).
pub fn takes(q: &Array, k: &Array, v: &Array, positions: &[i32]) -> bool {
    ON.load(Ordering::Relaxed)
        && crate::plan::Backend::cuda()
        && unsuitable(q, k, v, positions.len()).is_none()
        && in_reach(positions, q.dim(1))
}

/// `softmax(scale · q kᵀ) v` of `q` `[B, heads, 1, head_dim]` over keys `lo..=positions[b]` of slot `b`
/// of the buffers `k`, `v` `[slots ≥ B, kv_heads, capacity, head_dim]` (`lo` as the module says):
/// `[B, heads, 1, head_dim]` of q's dtype, where the kernel runs (CUDA, [`ENV`] not `0`, the shapes
/// above, every position inside the buffer and in reach: [`MAX_KEYS`], [`WIDE_BLOCKS`]); None elsewhere.
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    positions: &[i32],
    scale: f32,
    window: Option<i32>,
) -> Result<Option<Array>> {
    // the buffers pass `takes`'s checks as the new keys do (they differ only in length)
    let cap = k.dim(2);
    if !takes(q, k, v, positions) || positions.iter().any(|&p| p >= cap) || window.is_some_and(|w| w <= 0) {
        return Ok(None);
    }
    static KERNEL: OnceLock<std::result::Result<CudaKernel, String>> = OnceLock::new();
    let kern = KERNEL
        .get_or_init(|| {
            CudaKernel::new("mlxrs_decode_attn", &["q", "k", "v", "pos"], &["out"], SOURCE, "", true)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let pos = super::qmv::step_positions(positions)?;
    let (b, h, d) = (q.dim(0), q.dim(1), q.dim(3));
    let template = [
        ("T", TemplateArg::Dtype(q.dtype())),
        ("D", TemplateArg::Int(d)),
        ("WINDOW", TemplateArg::Int(window.unwrap_or(0))),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
    ];
    let shape = [b, h, 1, d];
    let mut out =
        kern.apply(&[q, k, v, &pos], &[(&shape, q.dtype())], (h * THREADS, b, 1), (THREADS, 1, 1), &template)?;
    Ok(out.pop())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle as mx;

    fn zeros(shape: &[i32], d: Dtype) -> Array {
        mx::zeros(shape, d).unwrap()
    }

    /// Off CUDA the kernel never runs: the engine keeps MLX's ops (the parity suite's path).
    #[test]
    fn off_cuda_it_declines() {
        if crate::plan::Backend::cuda() {
            return; // (on CUDA bench/attn_check.py compares it with MLX's attention)
        }
        let (q, kv) = (zeros(&[1, 4, 1, 64], Dtype::Float32), zeros(&[1, 2, 256, 64], Dtype::Float32));
        assert!(attention(&q, &kv, &kv, &[3], 0.125, None).unwrap().is_none());
    }

    /// The shapes it takes and the ones it leaves to MLX.
    #[test]
    fn shapes_it_takes() {
        let f = Dtype::Bfloat16;
        let q = zeros(&[2, 8, 1, 128], f);
        let kv = zeros(&[4, 2, 264, 128], f);
        assert_eq!(unsuitable(&q, &kv, &kv, 2), None);
        assert_eq!(unsuitable(&q, &kv, &kv, 3), Some("rows"));
        assert_eq!(unsuitable(&zeros(&[2, 8, 2, 128], f), &kv, &kv, 2), Some("not one query a row"));
        assert_eq!(
            unsuitable(&zeros(&[2, 8, 1, 80], f), &zeros(&[4, 2, 8, 80], f), &zeros(&[4, 2, 8, 80], f), 2),
            Some("head size")
        );
        assert_eq!(
            unsuitable(&zeros(&[2, 6, 1, 128], f), &zeros(&[4, 4, 8, 128], f), &zeros(&[4, 4, 8, 128], f), 2),
            Some("heads")
        );
        assert_eq!(unsuitable(&q, &zeros(&[1, 2, 8, 128], f), &zeros(&[1, 2, 8, 128], f), 2), Some("rows"));
        assert_eq!(unsuitable(&q, &zeros(&[4, 2, 8, 128], Dtype::Float32), &kv, 2), Some("dtype"));
    }

    /// One row's 32 heads: up to 1024 keys; 8 rows of 32 heads (256 blocks): any length.
    #[test]
    fn long_rows_only_in_a_wide_step() {
        assert!(in_reach(&[1023], 32) && !in_reach(&[1024], 32));
        assert!(!in_reach(&[5, 4000], 32));
        assert!(in_reach(&[5, 4000, 7, 9, 100, 20000, 3, 1], 32));
        assert!(!in_reach(&[5, -1, 7, 9, 100, 2, 3, 1], 32));
    }

    #[test]
    fn the_kernel_text_is_compacted() {
        let short = crate::handle::kernel::compact(SOURCE);
        assert!(short.contains("__shfl_xor_sync") && !short.contains("//"));
    }
}
