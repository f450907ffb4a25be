//! A host CPU kernel beside MLX: `y = x · Wᵀ` for a float32 matrix W `[rows, cols]` and 2 to
//! [`SMALL_MAX_ROWS`] float32 rows x: a batched decode step of a few sequences (or a short prompt) on
//! the CPU backend.
//!
//! Why: MLX's CPU backend sends such a product to the BLAS's `sgemm`, whose per-call setup (packing W
//! into panels) costs as much for 2 rows as for 32, and whose kernels reached about a third of this
//! CPU's peak at 16 rows (a 16-row step's profile: two thirds of sgemm's time is that packing).
//! [`host_matmul`] builds the product as one op of MLX's graph (native/mlxrs_ext.cpp `HostMatmul`,
//! run in order on MLX's CPU stream, which calls back into this kernel): nothing is evaluated at the
//! call and the step's other ops stay queued around it; [`small_matmul`] alone is the older path (x
//! evaluated, the product computed on the caller's thread) for a libmlxc without that op.
//!
//! This kernel reads W straight from MLX's buffer, four of its rows at a time
//! (they stay in cache while every row of x passes over them), and computes register blocks of 4 rows
//! of x × 4 rows of W (AVX-512: 16 accumulators of 16 lanes; AVX2: 2 × 4 of 8 lanes) with fused
//! multiply-adds, over the cores. Its first version (one x row against four W rows, compiler-vectorized)
//! lost to `sgemm` from 6–8 rows on (16 rows 3.87 against 2.06 ms on the quiet machine); the register
//! blocks are in explicit intrinsics because the compiler left the nested accumulator arrays scalar.
//! Timings: `cargo test --release -p mlxrs-core f32mm::bench -- --ignored --nocapture` (a 4096 × 1024 W,
//! MLX's matmul against this kernel on 2 threads and on 1; bench/RESULTS.md). The sums run in another
//! order than the BLAS's, so results equal `sgemm`'s up to float32 rounding. `unsafe` here: the copies
//! for the x86 instruction sets the CPU reports at run time, reading through pointers after one bounds
//! check per block.
use super::host::{detect, over_rows, sum_lanes, Isa};
use crate::error::{Error, Result};

/// The most rows of x this kernel takes as an op of MLX's graph ([`host_matmul`]: a decode step's rows;
/// more: MLX's matmul).
/// Decode steps of the 88M float32 model (`python bench/cpu_step.py --rows 8,16,32`, bench/RESULTS.md,
/// 2026-12-01 evening; the per-row attention op on in both): 8 rows 31 against 53 ms with sgemm, 16
/// rows 47 against 66, 32 rows 95–99 against 107–110. Alone the kernel is about as fast as sgemm at 32
/// rows (arithmetic-bound there); in a step it also saves sgemm's packing and its idle threads' spinning.
pub const GRAPH_MAX_ROWS: usize = 32;

/// The most rows of x this kernel takes where it must evaluate x first and return here (a libmlxc
/// without [`host_matmul`]'s op). In a batched decode step on the quiet 2-core machine
/// (bench/RESULTS.md) that path was 1.3–1.75× faster than `sgemm`'s at 4 rows, 1.05–1.1× at 8,
/// 1.13–1.2× at 12, and no faster at 16 (0.92× serving 16 streams), though alone the product is faster
/// up to 24 rows: it paid for evaluating x, and OpenBLAS's idle threads spun beside it.
pub const SMALL_MAX_ROWS: usize = 12;

/// W's rows handed to one thread at a time are multiples of this (4 rows interleaved per pass).
const ROW_GROUP: usize = 4;

static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products [`small_matmul`] has computed in this process (tests and benchmarks check the
/// path ran).
pub fn small_matmul_calls() -> u64 {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `x · Wᵀ` for `w` `[rows, cols]` and `x` `[n, cols]`, both row-major: `[n, rows]` row-major, on up to
/// `threads` threads (each a contiguous range of W's rows).
pub fn small_matmul(w: &[f32], rows: usize, cols: usize, x: &[f32], threads: usize) -> Result<Vec<f32>> {
    let mut y = vec![0f32; x.len().checked_div(cols).unwrap_or(0) * rows];
    small_matmul_into(w, rows, cols, x, threads, &mut y)?;
    Ok(y)
}

/// [`small_matmul`] into `y` (`[n, rows]`).
fn small_matmul_into(w: &[f32], rows: usize, cols: usize, x: &[f32], threads: usize, y: &mut [f32]) -> Result<()> {
    if cols == 0 || w.len() != rows * cols || !x.len().is_multiple_of(cols) || y.len() != x.len() / cols * rows {
        return Err(Error::Invalid(format!(
            "small_matmul: W of {} values is not [{rows}, {cols}], or {} input values are not rows of {cols}, or \
             {} outputs not theirs",
            w.len(),
            x.len(),
            y.len()
        )));
    }
    let n = x.len() / cols;
    if n > 0 && rows > 0 {
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let isa = detect();
    over_rows(rows, n, threads, ROW_GROUP, y, |r0, r1, y| run(isa, &w[r0 * cols..r1 * cols], cols, x, n, y));
    Ok(())
}

/// The kernel MLX's CPU thread calls for [`host_matmul`]'s op (native/mlxrs_ext.cpp `HostMatmul`).
///
/// # Safety
/// `w` points at `rows · cols`, `x` at `n · cols` and `y` at `n · rows` float32 values, `y` not
/// overlapping the others: the primitive passes its inputs' and its fresh output's buffers.
unsafe extern "C" fn graph_kernel(w: *const f32, rows: usize, cols: usize, x: *const f32, n: usize, y: *mut f32) {
    if rows == 0 || cols == 0 || n == 0 {
        return;
    }
    // SAFETY: the extents above (the caller's contract)
    let (w, x, y) = unsafe {
        (
            std::slice::from_raw_parts(w, rows * cols),
            std::slice::from_raw_parts(x, n * cols),
            std::slice::from_raw_parts_mut(y, n * rows),
        )
    };
    let threads = super::host::host_threads();
    // straight into MLX's output. A panic must not unwind into MLX's C++ (it would abort the process):
    // the only one possible here is the OS refusing a thread, and then the product runs again on this
    // thread alone (every output is written from the inputs alone)
    let done =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| small_matmul_into(w, rows, cols, x, threads, y)))
            .unwrap_or_else(|_| small_matmul_into(w, rows, cols, x, 1, y));
    if done.is_err() {
        // the shapes were checked when the op was built: unreachable, but never leave y unwritten
        y.fill(f32::NAN);
    }
}

/// `x · Wᵀ` (float32 `x [..., cols]`, `w [rows, cols]`) as one op of MLX's graph on the current stream
/// (a CPU stream), computed by [`small_matmul`] when MLX evaluates it: no evaluation of x here, nothing
/// returns to this thread. None where the loaded libmlxc lacks the entry point (one not built by
/// native/).
pub fn host_matmul(x: &super::Array, w: &super::Array) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_matmul else { return Ok(None) };
    super::ops::count_op();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention (handles in, result through the pointer); the kernel's
    // contract is kept by the primitive (its inputs made row-contiguous, a fresh output)
    let rc = unsafe { f(&mut r, x.0, w.0, graph_kernel, super::runtime::current_stream()) };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

/// `y[r * n + i] = Σ_k x[i, k] · w[r, k]` for the rows `r` of this range.
fn run(isa: Isa, w: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    match isa {
        Isa::Generic => rows_generic(w, cols, x, n, y),
        // SAFETY: `detect` found these instruction sets on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { rows_avx2(w, cols, x, n, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rows_avx512(w, cols, x, n, y) },
    }
}

// The x86 copies hold their register block in explicit vector registers (the compiler did not
// vectorize the nested accumulator arrays of the generic copy below): MR rows of x against NR = 4
// rows of W, each pair's products in one register. AVX-512 (32 registers of 16 lanes): 4 × 4
// accumulators plus the 4 + 1 loads; AVX2 (16 registers of 8 lanes): 2 × 4 plus 2 + 1.
/// `$f::<$mr, NR>(args)` for the block's `$nr` rows of W (NR = 4, 3, 2 or 1).
macro_rules! by_nr {
    ($f:ident, $mr:literal, $nr:expr, $($a:expr),*) => {
        match $nr {
            4 => $f::<$mr, 4>($($a),*),
            3 => $f::<$mr, 3>($($a),*),
            2 => $f::<$mr, 2>($($a),*),
            _ => $f::<$mr, 1>($($a),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_avx2(w: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each arm): this function runs only where `detect` found AVX2 and FMA
    walk::<2>(w, cols, x, n, y, |mr, nr, b, y| match mr {
        2 => unsafe { by_nr!(block_avx2, 2, nr, b, y) },
        _ => unsafe { by_nr!(block_avx2, 1, nr, b, y) },
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn rows_avx512(w: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each arm): this function runs only where `detect` found AVX-512F
    walk::<4>(w, cols, x, n, y, |mr, nr, b, y| match mr {
        4 => unsafe { by_nr!(block_avx512, 4, nr, b, y) },
        3 => unsafe { by_nr!(block_avx512, 3, nr, b, y) },
        2 => unsafe { by_nr!(block_avx512, 2, nr, b, y) },
        _ => unsafe { by_nr!(block_avx512, 1, nr, b, y) },
    })
}

macro_rules! x86_block {
    ($name:ident, $feat:literal, $lanes:literal, $vec:ident, $zero:ident, $load:ident, $fma:ident, $store:ident) => {
        /// x's rows `i0..i0 + MR` against W's rows `r0..r0 + NR`: `MR · NR` vector accumulators, each
        /// pair's lanes summed pairwise at the end, then the columns past the last whole vector added
        /// in order.
        ///
        /// # Safety
        /// The CPU has the instruction set of `$feat`.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const MR: usize, const NR: usize>(b: &Block, y: &mut [f32]) {
            use std::arch::x86_64::*;
            let Block { w, cols, x, n, r0, i0 } = *b;
            // the block's rows inside W (this thread's range), x and y: the reads below go through raw
            // pointers
            assert!(
                (r0 + NR) * cols <= w.len() && (i0 + MR) * cols <= x.len() && i0 + MR <= n && (r0 + NR) * n <= y.len(),
                "f32mm block out of range"
            );
            let full = cols / $lanes * $lanes;
            let (wp, xp) = (w.as_ptr(), x.as_ptr());
            let mut acc = [[$zero(); NR]; MR];
            let mut xb = [$zero(); MR];
            let mut c = 0;
            while c < full {
                for m in 0..MR {
                    // SAFETY: c + lanes <= cols and i0 + MR <= x's rows (asserted above)
                    xb[m] = unsafe { $load(xp.add((i0 + m) * cols + c)) };
                }
                for k in 0..NR {
                    // SAFETY: c + lanes <= cols and r0 + NR <= W's rows (asserted above)
                    let wb: $vec = unsafe { $load(wp.add((r0 + k) * cols + c)) };
                    for m in 0..MR {
                        acc[m][k] = $fma(wb, xb[m], acc[m][k]);
                    }
                }
                c += $lanes;
            }
            let mut lanes = [[[0f32; $lanes]; NR]; MR];
            for m in 0..MR {
                for k in 0..NR {
                    // SAFETY: `lanes[m][k]` holds one vector
                    unsafe { $store(lanes[m][k].as_mut_ptr(), acc[m][k]) };
                }
            }
            b.finish(&lanes, full, y);
        }
    };
}
x86_block!(block_avx512, "avx512f", 16, __m512, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_storeu_ps);
x86_block!(block_avx2, "avx2,fma", 8, __m256, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_storeu_ps);

fn rows_generic(w: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    walk::<2>(w, cols, x, n, y, |mr, nr, b, y| match mr {
        2 => by_nr!(block, 2, nr, b, y),
        _ => by_nr!(block, 1, nr, b, y),
    })
}

/// The walk: W's rows [`ROW_GROUP`] at a time (they stay in cache while every row of x passes over
/// them), x's rows `MR` at a time; `block(mr, nr, b, y)` computes the [`Block`] `b`: x's rows
/// `b.i0..b.i0 + mr` against W's rows `b.r0..b.r0 + nr` (smaller blocks at the edges).
#[inline(always)]
fn walk<const MR: usize>(
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    mut block: impl FnMut(usize, usize, &Block, &mut [f32]),
) {
    let nrows = y.len() / n;
    let mut r0 = 0;
    while r0 < nrows {
        let g = ROW_GROUP.min(nrows - r0);
        let mut i0 = 0;
        while i0 < n {
            let m = MR.min(n - i0);
            block(m, g, &Block { w, cols, x, n, r0, i0 }, y);
            i0 += m;
        }
        r0 += g;
    }
}

/// What one register block reads: this thread's rows of W and all `n` rows of x (`cols` wide), the
/// block starting at W's row `r0` and x's row `i0`.
struct Block<'a> {
    w: &'a [f32],
    cols: usize,
    x: &'a [f32],
    n: usize,
    r0: usize,
    i0: usize,
}

impl Block<'_> {
    /// The block's `MR · NR` outputs into y (`[rows, n]`): each pair's `L` accumulator lanes summed
    /// pairwise, then the columns from `full` (past the last whole vector) added in order.
    #[inline(always)]
    fn finish<const L: usize, const MR: usize, const NR: usize>(
        &self,
        acc: &[[[f32; L]; NR]; MR],
        full: usize,
        y: &mut [f32],
    ) {
        let Block { w, cols, x, n, r0, i0 } = *self;
        for (m, acc_m) in acc.iter().enumerate() {
            for (k, lanes) in acc_m.iter().enumerate() {
                let mut v = sum_lanes(lanes);
                for cc in full..cols {
                    v += w[(r0 + k) * cols + cc] * x[(i0 + m) * cols + cc];
                }
                y[(r0 + k) * n + i0 + m] = v;
            }
        }
    }
}

/// The portable block (CPUs without AVX2): as the x86 copies, in plain arrays of 8 lanes.
#[inline(always)]
fn block<const MR: usize, const NR: usize>(b: &Block, y: &mut [f32]) {
    const L: usize = 8;
    let Block { w, cols, x, r0, i0, .. } = *b;
    let mut acc = [[[0f32; L]; NR]; MR];
    let full = cols / L * L;
    let mut c = 0;
    while c < full {
        for k in 0..NR {
            let wb: &[f32; L] = w[(r0 + k) * cols + c..][..L].try_into().expect("lanes");
            for m in 0..MR {
                let xb: &[f32; L] = x[(i0 + m) * cols + c..][..L].try_into().expect("lanes");
                for j in 0..L {
                    acc[m][k][j] += wb[j] * xb[j];
                }
            }
        }
        c += L;
    }
    b.finish(&acc, full, y);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) % 2001) as f32 / 1000.0 - 1.0
    }

    /// Against float64 dot products: odd row counts (not a multiple of the 4-row group nor of the
    /// thread split), columns not a multiple of the 16 lanes, 1 to 32 input rows, 1 to 3 threads; the
    /// generic copy (what a CPU without AVX2 runs) agrees too.
    #[test]
    fn equals_float64_products() {
        for (rows, cols, n, threads) in
            [(37, 64, 2, 2), (101, 200, 16, 3), (9, 33, 3, 2), (1, 96, 32, 4), (64, 1024, 5, 1)]
        {
            let mut s = (rows * cols + n) as u64;
            let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| lcg(&mut s)).collect();
            let got = small_matmul(&w, rows, cols, &x, threads).unwrap();
            let mut generic = vec![0f32; n * rows];
            rows_generic(&w, cols, &x, n, &mut generic);
            for i in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols).map(|k| w[r * cols + k] as f64 * x[i * cols + k] as f64).sum::<f64>();
                    let g = got[i * rows + r] as f64;
                    let bound = 1e-6 * cols as f64;
                    assert!((g - want).abs() <= bound, "[{rows}x{cols}, n {n}] ({i}, {r}): {g} vs {want}");
                    assert!((generic[r * n + i] as f64 - want).abs() <= bound, "generic ({i}, {r})");
                }
            }
        }
    }

    /// The kernel as an op of MLX's graph ([`host_matmul`]) against MLX's matmul, on a CPU stream: 2 to
    /// 32 rows, x with batch axes and x as a transposed view (made contiguous by the op), W of
    /// columns not a multiple of the lanes; lazily built (nothing evaluated until the result is).
    #[test]
    fn graph_op_equals_mlx_matmul() {
        use crate::handle as mx;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            let key = mx::random_key(3).unwrap();
            for (n, rows, cols) in [(2, 37, 64), (5, 300, 200), (16, 64, 1024), (32, 9, 33)] {
                let w = mx::random_normal(&[rows, cols], mx::Dtype::Float32, &key).unwrap();
                let x =
                    mx::random_normal(&[1, n, cols], mx::Dtype::Float32, &mx::random_key(n as u64).unwrap()).unwrap();
                let xt = mx::swapaxes(
                    &mx::random_normal(&[1, cols, n], mx::Dtype::Float32, &mx::random_key(9).unwrap()).unwrap(),
                    1,
                    2,
                )
                .unwrap();
                for x in [x, xt] {
                    let before = small_matmul_calls();
                    let ours = host_matmul(&x, &w).unwrap().expect("the libmlxc built by native/ has the op");
                    assert_eq!(ours.shape(), vec![1, n, rows]);
                    let theirs = mx::matmul(&x, &mx::transpose(&w).unwrap()).unwrap();
                    let d = mx::max(
                        &mx::reshape(&mx::abs(&mx::subtract(&ours, &theirs).unwrap()).unwrap(), &[-1]).unwrap(),
                        &[0],
                        false,
                    )
                    .unwrap()
                    .item_f32()
                    .unwrap();
                    assert!(small_matmul_calls() > before, "evaluated through the host kernel");
                    assert!(d <= 1e-6 * cols as f32 * 4.0, "[{n} x {cols}] · [{rows} x {cols}]ᵀ: max |Δ| {d}");
                }
            }
            let w16 = mx::astype(&mx::random_normal(&[8, 16], mx::Dtype::Float32, &key).unwrap(), mx::Dtype::Bfloat16)
                .unwrap();
            let x = mx::random_normal(&[2, 16], mx::Dtype::Float32, &key).unwrap();
            assert!(host_matmul(&x, &w16).is_err(), "a bfloat16 W is refused");
        });
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(small_matmul(&[0.0; 10], 3, 4, &[0.0; 4], 1).is_err());
        assert!(small_matmul(&[0.0; 12], 3, 4, &[0.0; 5], 1).is_err());
        assert_eq!(small_matmul(&[1.0; 8], 2, 4, &[1.0; 8], 2).unwrap(), vec![4.0; 4]);
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    /// The timings in the module's comment (not a check: run by hand, on a quiet machine).
    #[test]
    #[ignore]
    fn time_against_mlx() {
        let (rows, cols) = (4096usize, 1024usize);
        for n in [2usize, 3, 4, 6, 8, 16, 24, 32] {
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
            let x: Vec<f32> = (0..n * cols).map(|i| ((i % 13) as f32 - 6.0) / 13.0).collect();
            let wa = crate::handle::Array::from_slice(&w, &[rows as i32, cols as i32]).unwrap();
            let xa = crate::handle::Array::from_slice(&x, &[n as i32, cols as i32]).unwrap();
            let wt = crate::handle::transpose(&wa).unwrap();
            wa.eval().unwrap();
            let t = std::time::Instant::now();
            for _ in 0..20 {
                crate::handle::matmul(&xa, &wt).unwrap().eval().unwrap();
            }
            let mlx = t.elapsed().as_secs_f64() / 20.0;
            let t = std::time::Instant::now();
            for _ in 0..20 {
                small_matmul(&w, rows, cols, &x, 2).unwrap();
            }
            let ours = t.elapsed().as_secs_f64() / 20.0;
            let t = std::time::Instant::now();
            for _ in 0..20 {
                small_matmul(&w, rows, cols, &x, 1).unwrap();
            }
            let one = t.elapsed().as_secs_f64() / 20.0;
            eprintln!("n {n}: mlx {:.2} ms, ours {:.2} ms (1 thread {:.2} ms)", mlx * 1e3, ours * 1e3, one * 1e3);
        }
    }
}
