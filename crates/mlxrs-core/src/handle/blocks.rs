//! A host CPU kernel beside MLX: `y = x · dequant(W)ᵀ` for a matrix W stored in blocks along its
//! rows — int8 values `q [rows, cols]`, one float32 scale per `group` values and, for formats with a
//! minimum, one float32 bias: `dequant(W)[r, k] = s[r, k / group] · q[r, k] + b[r, k / group]`.
//! A GGUF's Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K blocks are exactly this (groups of 32, 16 for
//! Q6_K; [`crate::gguf::dequant::blocks`]), so an f32 import decodes on the CPU from 1–1.5 bytes a
//! weight instead of 4 at the same values (bench/RESULTS.md). MLX's own CPU quantized matmul is far
//! below memory bandwidth; this one streams W once per call over the cores.
//!
//! The AVX-512 and AVX2 copies hold their accumulators in vector registers (explicit intrinsics: the
//! compiler kept the generic copy's nested accumulator arrays in memory, at half the bandwidth); the
//! generic copy is the reference and what other CPUs run. [`host_blocks_matmul`] builds the product as
//! one op of MLX's graph (native/mlxrs_ext.cpp `HostBlocksMatmul`).
use super::host::{add_bias, detect, over_rows, sum_lanes, walk_rows, Isa, QuantRows, LANES, ROW_GROUP};
use crate::error::{Error, Result};

/// Values of a group are a multiple of this (one AVX-512 register of int8 widened to float32).
pub const GROUP_STEP: usize = 16;

/// A `[rows, cols]` matrix in blocks, borrowed: `q` row-major int8, `s` (and `b` if any)
/// `[rows, cols / group]` float32.
#[derive(Clone, Copy)]
pub struct BlocksRef<'a> {
    pub q: &'a [i8],
    pub s: &'a [f32],
    pub b: Option<&'a [f32]>,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
}

impl<'a> BlocksRef<'a> {
    /// Checks the extents: `cols` whole groups, `group` a multiple of [`GROUP_STEP`].
    pub fn new(
        q: &'a [i8],
        s: &'a [f32],
        b: Option<&'a [f32]>,
        rows: usize,
        cols: usize,
        group: usize,
    ) -> Result<BlocksRef<'a>> {
        if group == 0 || !group.is_multiple_of(GROUP_STEP) || cols == 0 || !cols.is_multiple_of(group) {
            return Err(Error::Invalid(format!(
                "a blocked matrix needs groups of a multiple of {GROUP_STEP} values and columns in whole groups, \
                 not groups of {group} over {cols} columns"
            )));
        }
        let groups = rows * (cols / group);
        if rows.checked_mul(cols) != Some(q.len()) || s.len() != groups || b.is_some_and(|b| b.len() != groups) {
            return Err(Error::Invalid(format!(
                "a [{rows}, {cols}] matrix in groups of {group} needs {} values and {groups} scales (and biases), \
                 not {}, {} and {:?}",
                rows * cols,
                q.len(),
                s.len(),
                b.map(|b| b.len())
            )));
        }
        Ok(BlocksRef { q, s, b, rows, cols, group })
    }

    /// Row `r` dequantized: `s · q + b` in float32, value by value.
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let ng = self.cols / self.group;
        (0..self.cols)
            .map(|k| {
                let g = r * ng + k / self.group;
                self.q[r * self.cols + k] as f32 * self.s[g] + self.b.map_or(0.0, |b| b[g])
            })
            .collect()
    }

    /// `x · dequant(W)ᵀ` for `x` `[n, cols]` row-major: `[n, rows]` row-major, on up to `threads`
    /// threads (each a contiguous range of W's rows). Equal to the float32 product with the
    /// dequantized matrix up to float32 rounding and summation order.
    pub fn matvec(&self, x: &[f32], threads: usize) -> Result<Vec<f32>> {
        let mut y = vec![0f32; x.len() / self.cols * self.rows];
        self.matvec_into(x, threads, &mut y)?;
        Ok(y)
    }

    /// [`BlocksRef::matvec`] into `y` (`[n, rows]`).
    pub fn matvec_into(&self, x: &[f32], threads: usize, y: &mut [f32]) -> Result<()> {
        if !x.len().is_multiple_of(self.cols) || y.len() != x.len() / self.cols * self.rows {
            return Err(Error::Invalid(format!(
                "{} input values are not rows of {}, or {} outputs not theirs",
                x.len(),
                self.cols,
                y.len()
            )));
        }
        self.matvec_with(detect(), x, threads, y);
        Ok(())
    }

    fn matvec_with(&self, isa: Isa, x: &[f32], threads: usize, out: &mut [f32]) {
        let n = x.len() / self.cols;
        let (cols, group) = (self.cols, self.group);
        let ng = cols / group;
        // each x row's group sums, for the bias term: Σ_g b[r, g] · Σ_{k ∈ g} x[i, k]
        let xs: Vec<f32> = match self.b {
            Some(_) => x.chunks_exact(group).map(|c| c.iter().sum()).collect(),
            None => Vec::new(),
        };
        over_rows(self.rows, n, threads, ROW_GROUP, out, |r0, r1, y| {
            let part = BlocksRef {
                q: &self.q[r0 * cols..r1 * cols],
                s: &self.s[r0 * ng..r1 * ng],
                b: self.b.map(|b| &b[r0 * ng..r1 * ng]),
                rows: r1 - r0,
                cols,
                group,
            };
            run(isa, &part, x, &xs, n, y)
        });
    }
}

impl QuantRows for BlocksRef<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn group(&self) -> usize {
        self.group
    }
    fn bits(&self) -> usize {
        8
    }
    fn bytes(&self) -> *const u8 {
        self.q.as_ptr() as *const u8
    }
    #[inline(always)]
    fn scale(&self, i: usize) -> f32 {
        self.s[i]
    }
}

/// `y[r * n + i] = Σ_k x[i, k] · dequant(W)[r, k]` for the rows `r` of `w` (one thread's range).
fn run(isa: Isa, w: &BlocksRef, x: &[f32], xs: &[f32], n: usize, y: &mut [f32]) {
    match isa {
        Isa::Generic => rows_generic(w, x, n, y),
        // SAFETY: `detect` found these instruction sets on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { rows_avx2(w, x, n, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rows_avx512(w, x, n, y) },
    }
    if let Some(b) = w.b {
        let ng = w.cols / w.group;
        add_bias(w.rows, ng, xs, n, y, |r, out| out.copy_from_slice(&b[r * ng..(r + 1) * ng]));
    }
}

/// The generic copy: four of W's rows at a time against each row of `x`; per group the products in
/// [`LANES`] lanes, then times the group's scale into the row's lanes; the lanes summed at the end.
fn rows_generic(w: &BlocksRef, x: &[f32], n: usize, y: &mut [f32]) {
    let (cols, group) = (w.cols, w.group);
    let ng = cols / group;
    let mut r = 0;
    while r < w.rows {
        let g = ROW_GROUP.min(w.rows - r);
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [[0f32; LANES]; ROW_GROUP];
            for blk in 0..ng {
                for (k, a) in acc.iter_mut().enumerate().take(g) {
                    let row = r + k;
                    let mut p = [0f32; LANES];
                    for h in 0..group / LANES {
                        let c = blk * group + h * LANES;
                        let qb = &w.q[row * cols + c..row * cols + c + LANES];
                        for j in 0..LANES {
                            p[j] += qb[j] as f32 * xi[c + j];
                        }
                    }
                    let s = w.s[row * ng + blk];
                    for j in 0..LANES {
                        a[j] += s * p[j];
                    }
                }
            }
            for (k, a) in acc.iter().enumerate().take(g) {
                y[(r + k) * n + i] = sum_lanes(a);
            }
        }
        r += g;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_avx512(w: &BlocksRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX-512
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        if r4 {
            block_avx512::<ROW_GROUP>(w, x, n, r, y)
        } else {
            block_avx512::<1>(w, x, n, r, y)
        }
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_avx2(w: &BlocksRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX2 and FMA
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        if r4 {
            block_avx2::<ROW_GROUP>(w, x, n, r, y)
        } else {
            block_avx2::<1>(w, x, n, r, y)
        }
    })
}

super::host::x86_quant_block!(
    avx512,
    block_avx512,
    BlocksRef,
    16,
    |xp, c| {
        // SAFETY: 16 values of x's row
        unsafe { _mm512_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 16 values (bytes) of the row
        let v = unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q as *const __m128i))) };
        *acc = _mm512_fmadd_ps(v, xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx2,
    block_avx2,
    BlocksRef,
    8,
    |xp, c| {
        // SAFETY: 8 values of x's row
        unsafe { _mm256_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 8 values (bytes) of the row
        let v = unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q as *const __m128i))) };
        *acc = _mm256_fmadd_ps(v, xv, *acc);
    }
);

/// The kernel MLX's CPU thread calls for [`host_blocks_matmul`]'s op (native/mlxrs_ext.cpp
/// `HostBlocksMatmul`).
///
/// # Safety
/// `args` points at a [`mlxrs_sys::HostBlocksArgs`] whose `q` points at `rows · cols` int8 values, `s`
/// (and `b` unless null) at `rows · cols / group` float32 values, `x` at `n · cols` and `y` at `n ·
/// rows` float32 values, `y` not overlapping the others: the primitive passes its inputs' and its
/// fresh output's buffers after checking their shapes.
unsafe extern "C" fn graph_kernel(args: *const mlxrs_sys::HostBlocksArgs) {
    // SAFETY: the caller's contract
    let mlxrs_sys::HostBlocksArgs { q, s, b, rows, cols, group, x, n, y } = unsafe { std::ptr::read(args) };
    if rows == 0 || cols == 0 || n == 0 || group == 0 {
        return;
    }
    let groups = rows * (cols / group);
    // SAFETY: the extents above (the caller's contract)
    let (q, s, b, x, y) = unsafe {
        (
            std::slice::from_raw_parts(q, rows * cols),
            std::slice::from_raw_parts(s, groups),
            (!b.is_null()).then(|| std::slice::from_raw_parts(b, groups)),
            std::slice::from_raw_parts(x, n * cols),
            std::slice::from_raw_parts_mut(y, n * rows),
        )
    };
    let Ok(w) = BlocksRef::new(q, s, b, rows, cols, group) else {
        // the shapes were checked when the op was built: unreachable, but never leave y unwritten
        y.fill(f32::NAN);
        return;
    };
    super::host::into_mlx_output(y, f32::NAN, |threads, y| w.matvec_into(x, threads, y));
}

/// `x · dequant(W)ᵀ` (float32 `x [..., cols]`; W as int8 `q [rows, cols]`, float32 `scales` and
/// optional `biases` `[rows, cols / group]`) as one op of MLX's graph on the current stream (a CPU
/// stream), computed by [`BlocksRef::matvec`] when MLX evaluates it. None where the loaded libmlxc
/// lacks the entry point (one not built by native/).
pub fn host_blocks_matmul(
    x: &super::Array,
    q: &super::Array,
    scales: &super::Array,
    biases: Option<&super::Array>,
) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_blocks_matmul else { return Ok(None) };
    super::ops::count_op();
    let none = super::Array::empty_raw();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention (handles in, an empty handle for no biases, the result
    // through the pointer); the kernel's contract is kept by the primitive (shapes and dtypes checked,
    // inputs made row-contiguous, a fresh output)
    let rc = unsafe {
        f(&mut r, x.0, q.0, scales.0, biases.map_or(none, |b| b.0), graph_kernel, super::runtime::current_stream())
    };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

#[cfg(test)]
mod tests {
    use super::super::host::testing::{isas, lcg};
    use super::*;

    type Parts = (Vec<i8>, Vec<f32>, Option<Vec<f32>>, Vec<f32>);

    fn random(rows: usize, cols: usize, group: usize, bias: bool, n: usize, seed: u64) -> Parts {
        let mut s = seed;
        let q: Vec<i8> =
            (0..rows * cols).map(|_| (lcg(&mut s) % 255) as i32 as i8).map(|v| v.wrapping_sub(127)).collect();
        let ng = rows * cols / group;
        let mut scale = || half::f16::from_f32((lcg(&mut s) % 1000) as f32 / 1e5 - 0.004).to_f32();
        let d: Vec<f32> = (0..ng).map(|_| scale()).collect();
        let b: Option<Vec<f32>> = bias.then(|| (0..ng).map(|_| scale() * 8.0).collect());
        let x: Vec<f32> = (0..n * cols).map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0).collect();
        (q, d, b, x)
    }

    fn naive(m: &BlocksRef, x: &[f32]) -> Vec<f64> {
        super::super::host::testing::naive(m.rows, m.cols, x, |r| m.dequant_row(r))
    }

    #[test]
    fn matvec_equals_dequantize_then_matmul() {
        // odd row counts (not a multiple of the 4-row group, nor of the thread split), 1..3 input rows,
        // groups of 16 (Q6_K) and 32, with and without biases
        for (rows, cols, group, bias, n, threads) in [
            (37, 64, 32, false, 1, 2),
            (101, 640, 32, true, 1, 3),
            (9, 32, 16, true, 3, 2),
            (1, 96, 32, false, 2, 4),
            (64, 128, 16, false, 1, 1),
            (7, 256, 64, true, 5, 2),
        ] {
            let (q, d, b, x) = random(rows, cols, group, bias, n, (rows * cols + n + group) as u64);
            let m = BlocksRef::new(&q, &d, b.as_deref(), rows, cols, group).unwrap();
            let want = naive(&m, &x);
            let scale = want.iter().map(|v| v.abs()).fold(1.0, f64::max);
            // float32 accumulation of `cols` terms against a float64 reference
            let bound = 1e-5 * (cols as f64).sqrt() * scale;
            for (name, isa) in isas() {
                let mut got = vec![0f32; want.len()];
                m.matvec_with(isa, &x, threads, &mut got);
                assert_eq!(got.len(), want.len());
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - w).abs() <= bound,
                        "{name} [{rows}x{cols}/{group}, bias {bias}, n {n}] output {k}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let q = vec![1i8; 64];
        assert!(BlocksRef::new(&q[..40], &[0.0], None, 1, 40, 32).is_err(), "columns not whole groups");
        assert!(BlocksRef::new(&q, &[0.0], None, 1, 64, 32).is_err(), "too few scales");
        assert!(BlocksRef::new(&q, &[0.0; 8], None, 1, 64, 8).is_err(), "groups not of 16s");
        assert!(BlocksRef::new(&q, &[0.0; 2], Some(&[0.0]), 1, 64, 32).is_err(), "too few biases");
        let m = BlocksRef::new(&q, &[1.0; 2], None, 2, 32, 32).unwrap();
        assert!(m.matvec(&[0.0; 31], 1).is_err());
        assert_eq!(m.matvec(&[1.0; 32], 2).unwrap(), vec![32.0, 32.0]);
        let m = BlocksRef::new(&q, &[1.0; 4], Some(&[0.5; 4]), 2, 32, 16).unwrap();
        assert_eq!(m.matvec(&[1.0; 32], 2).unwrap(), vec![48.0, 48.0]);
    }

    /// The kernel as an op of MLX's graph ([`host_blocks_matmul`]) against MLX's matmul with the
    /// dequantized matrix, on a CPU stream: 1 to 8 rows with batch axes, x as a transposed view (made
    /// contiguous by the op), groups of 16 and 32, with and without biases; bad shapes refused.
    #[test]
    fn graph_op_equals_mlx_matmul() {
        use crate::handle as mx;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            for (n, rows, cols, group, bias) in
                [(1, 37, 64, 32, false), (3, 300, 640, 16, true), (8, 64, 256, 32, true)]
            {
                let (q, d, b, _) = random(rows, cols, group, bias, 1, (rows + cols) as u64);
                let m = BlocksRef::new(&q, &d, b.as_deref(), rows, cols, group).unwrap();
                let deq: Vec<f32> = (0..rows).flat_map(|r| m.dequant_row(r)).collect();
                let (ri, ci, gi) = (rows as i32, cols as i32, (cols / group) as i32);
                let qa = mx::Array::from_slice(&q, &[ri, ci]).unwrap();
                let sa = mx::Array::from_slice(&d, &[ri, gi]).unwrap();
                let ba = b.as_ref().map(|b| mx::Array::from_slice(b, &[ri, gi]).unwrap());
                let w = mx::Array::from_slice(&deq, &[ri, ci]).unwrap();
                let key = mx::random_key(n as u64).unwrap();
                let x = mx::random_normal(&[1, n, ci], mx::Dtype::Float32, &key).unwrap();
                let xt =
                    mx::swapaxes(&mx::random_normal(&[1, ci, n], mx::Dtype::Float32, &key).unwrap(), 1, 2).unwrap();
                for x in [x, xt] {
                    let ours = host_blocks_matmul(&x, &qa, &sa, ba.as_ref())
                        .unwrap()
                        .expect("the libmlxc built by native/ has the op");
                    assert_eq!(ours.shape(), vec![1, n, ri]);
                    let theirs = mx::matmul(&x, &mx::transpose(&w).unwrap()).unwrap();
                    let scale = mx::max(&mx::reshape(&mx::abs(&theirs).unwrap(), &[-1]).unwrap(), &[0], false)
                        .unwrap()
                        .item_f32()
                        .unwrap();
                    let diff = mx::subtract(&ours, &theirs).unwrap();
                    let d = mx::max(&mx::reshape(&mx::abs(&diff).unwrap(), &[-1]).unwrap(), &[0], false)
                        .unwrap()
                        .item_f32()
                        .unwrap();
                    assert!(d <= 1e-5 * scale.max(1.0), "[{n} x {cols}] · [{rows} x {cols}/{group}]ᵀ: max |Δ| {d}");
                }
            }
            let q = mx::Array::from_slice(&[0i8; 64], &[2, 32]).unwrap();
            let s = mx::Array::from_slice(&[1f32; 2], &[2, 1]).unwrap();
            let x = mx::Array::from_slice(&[1f32; 32], &[1, 32]).unwrap();
            let s8 = mx::Array::from_slice(&[1f32; 8], &[2, 4]).unwrap();
            assert!(host_blocks_matmul(&x, &q, &s8, None).is_err(), "groups of 8 are refused");
            let x31 = mx::Array::from_slice(&[1f32; 31], &[1, 31]).unwrap();
            assert!(host_blocks_matmul(&x31, &q, &s, None).is_err(), "x of another width is refused");
            let b1 = mx::Array::from_slice(&[1f32; 1], &[1, 1]).unwrap();
            assert!(host_blocks_matmul(&x, &q, &s, Some(&b1)).is_err(), "biases of another shape are refused");
            let qf = mx::astype(&q, mx::Dtype::Float32).unwrap();
            assert!(host_blocks_matmul(&x, &qf, &s, None).is_err(), "float values are refused");
        });
    }
}
