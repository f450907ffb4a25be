//! A quantized matrix-vector product of our own on CUDA (MLX's affine 4- and 8-bit layout), for the
//! one to four rows of a decode step. One warp per two output rows, 16-byte reads, float32 sums; 4-bit
//! values decoded by moving each nibble into a float's mantissa (1.5 integer ops a value, see SOURCE).
//! Nsight Compute on the H200 (bench/RESULTS-gpu.md, `bench/device_qmv_variants.sh`): an 8B 4-bit decode
//! step's matvecs take 2.37 ms of GPU time (MLX 0.32's kernel reads these weights at ~870 GB/s, this one
//! at 1.2–2.3 TB/s by shape); 8B 4-bit decode through it: 229 tokens/s (runs of 199 and 259) against
//! 154 through MLX's kernel and 148 for mlx-lm in the same process. `MLXRS_CUDA_QMV=1` turns it on,
//! `0` off (MLX's kernel, the reference); read per request ([`refresh`], called by the engine beside
//! `layers::refresh_dequant_rows`).
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, CudaKernel, Dtype, QuantMode, TemplateArg};
use crate::weights::QuantSpec;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// `0`: MLX's quantized matvec always.
pub const ENV: &str = "MLXRS_CUDA_QMV";

/// Output rows per warp (the kernel's `R`).
const ROWS_PER_WARP: i32 = 2;
/// Up to how many rows of x (the kernel's `M`, unrolled).
pub const MAX_ROWS: usize = 4;

static SWITCH: AtomicU8 = AtomicU8::new(UNREAD);
const UNREAD: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// Whether the kernel runs when [`ENV`] is unset: on (measured on the H200, bench/RESULTS-gpu.md:
/// 8B 4-bit decode 221 against 152 tokens/s through MLX's kernel, 8-bit 215 against 179, 1B 4-bit
/// 421 against 427, alternating in one process).
const DEFAULT_ON: bool = true;

/// Read [`ENV`] again (the engine does per request): `0` off, `1` on, unset [`DEFAULT_ON`].
pub fn refresh() {
    let on = match std::env::var(ENV).as_deref().map(str::trim) {
        Ok("0") => false,
        Ok("1") => true,
        _ => DEFAULT_ON,
    };
    SWITCH.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

fn enabled() -> bool {
    if SWITCH.load(Ordering::Relaxed) == UNREAD {
        refresh();
    }
    if SWITCH.load(Ordering::Relaxed) != ON {
        return false;
    }
    static CUDA: OnceLock<bool> = OnceLock::new();
    *CUDA.get_or_init(|| crate::plan::Backend::detect() == crate::plan::Backend::Cuda && mx::cuda_is_available())
}

/// 1 to [`MAX_ROWS`] rows of 16-bit x, affine 4- or 8-bit weights with biases, whose 16-byte reads stay
/// inside one group and whose rows are whole 16-byte reads.
pub fn fits(x: &Array, w: &Array, biases: Option<&Array>, q: QuantSpec) -> bool {
    let k = x.dim(-1);
    let rows = x.size() / (k.max(1) as usize);
    let per_read = 4 * 32 / q.bits.max(1); // values in one 16-byte read
    (1..=MAX_ROWS).contains(&rows)
        && q.mode == QuantMode::Affine
        && (q.bits == 4 || q.bits == 8)
        && biases.is_some()
        && matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        && q.group_size % per_read == 0
        && k % q.group_size == 0
        && k % per_read == 0
        && w.ndim() == 2
        && w.dim(1) * (32 / q.bits) == k
}

/// `x · Wᵀ` for MLX-quantized W (`w [N, K·bits/32]` uint32, `scales`/`biases` `[N, K/group]`), x
/// `[..., K]`, plus `res` where given (a decode step's residual after the output or down projection,
/// added in the same kernel and rounded once): the result `[..., N]` in x's dtype where the kernel
/// takes it (CUDA, the switch on, a product it [`fits`], a residual of the result's shape and x's
/// dtype); None elsewhere.
pub fn qmv(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    q: QuantSpec,
    res: Option<&Array>,
) -> Result<Option<Array>> {
    let n = w.dim(0);
    // the result in x's leading shape directly (the kernel writes it flat): no reshape op after it
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("x has an axis") = n;
    if res.is_some_and(|r| r.dtype() != x.dtype() || r.shape() != shape) {
        return Ok(None);
    }
    let Some(biases) = biases.filter(|_| fits(x, w, biases, q) && enabled()) else { return Ok(None) };
    type Slot = OnceLock<std::result::Result<CudaKernel, String>>;
    static KERNEL: Slot = OnceLock::new();
    static KERNEL_RES: Slot = OnceLock::new();
    let (slot, name, inputs, header): (&Slot, &str, &[&str], &str) = match res {
        None => (&KERNEL, "mlxrs_qmv", &["x", "w", "scales", "biases"], ""),
        Some(_) => (
            &KERNEL_RES,
            "mlxrs_qmv_res",
            &["x", "w", "scales", "biases", "res"],
            "#define MLXRS_RES(i) static_cast<float>(res[i])\n",
        ),
    };
    let kern = slot
        .get_or_init(|| CudaKernel::new(name, inputs, &["y"], SOURCE, header, true).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let k = x.dim(-1);
    let m = (x.size() / k as usize) as i32;
    let warps = (n + ROWS_PER_WARP - 1) / ROWS_PER_WARP;
    let template = [
        ("T", TemplateArg::Dtype(x.dtype())),
        ("M", TemplateArg::Int(m)),
        ("K", TemplateArg::Int(k)),
        ("N", TemplateArg::Int(n)),
        ("GS", TemplateArg::Int(q.group_size)),
        ("BITS", TemplateArg::Int(q.bits)),
        ("R", TemplateArg::Int(ROWS_PER_WARP)),
    ];
    let mut args = vec![x, w, scales, biases];
    args.extend(res);
    let mut out = kern.apply(&args, &[(&shape, x.dtype())], (warps * 32, 1, 1), (256, 1, 1), &template)?;
    out.pop().map(Some).ok_or_else(|| Error::Mlx("qmv kernel: no output".into()))
}

/// `y[m, n] = Σ_k x[m, k] · (scale[n, g] · q[n, k] + bias[n, g])`, g = k / GS (MLX's affine mode);
/// bench/qmv_kernel_dev.py and bench/qmv_variants.py read this text from here to check and time it on
/// the device.
const SOURCE: &str = r#"
    // MLXRS_RES(i): what is added to output i (the residual `res` where given; nothing otherwise)
#ifndef MLXRS_RES
#define MLXRS_RES(i) 0.f
#endif
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
    const unsigned row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (row0 >= (unsigned)N) return;
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    const uint4* wbase = reinterpret_cast<const uint4*>(w);
    #pragma unroll 2
    for (int i = lane; i < WPR / 4; i += 32) {
        const int k0 = i * VPU4;
        uint4 q[R];
        float s[R], b[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned row = min(row0 + r, (unsigned)N - 1u);
            q[r] = wbase[(size_t)row * (WPR / 4) + i];
            s[r] = static_cast<float>(scales[(size_t)row * NG + k0 / GS]);
            b[r] = static_cast<float>(biases[(size_t)row * NG + k0 / GS]);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xv4 = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
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
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && row0 + r < (unsigned)N) {
                const size_t i = (size_t)m * N + row0 + r;
                y[i] = static_cast<T>(v + MLXRS_RES(i));
            }
        }
    }
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(shape: &[i32], dtype: Dtype) -> Array {
        mx::zeros(shape, dtype).unwrap()
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
        // a residual of another shape or dtype than the product's is never fused (any backend)
        for res in
            [arr(&[1, 1, 255], Dtype::Bfloat16), arr(&[1, 256], Dtype::Bfloat16), arr(&[1, 1, 256], Dtype::Float16)]
        {
            assert!(qmv(&x, &w4, &b, Some(&b), q4, Some(&res)).unwrap().is_none(), "{:?}", res.shape());
        }
        // on the CPU the kernel is never taken
        if crate::plan::Backend::detect() == crate::plan::Backend::Cpu {
            assert!(qmv(&x, &w4, &b, Some(&b), q4, None).unwrap().is_none());
            assert!(qmv(&x, &w4, &b, Some(&b), q4, Some(&arr(&[1, 1, 256], Dtype::Bfloat16))).unwrap().is_none());
        }
    }
}
