//! A host CPU kernel beside MLX: `y = x · dequant(W)ᵀ` for an 8-bit block-quantized matrix W as a
//! GGUF's Q8_0 stores it (blocks of [`Q8_BLOCK`] int8 values along a row, one scale each:
//! `dequant(W)[r, k] = d[r, k / 32] · q[r, k]`) and a few float32 rows `x`. MLX's own CPU quantized
//! matmul is far below memory bandwidth (bench/RESULTS.md); this one streams W once per call over
//! the cores. The kernel is safe Rust the compiler vectorizes; the only `unsafe` here calls the
//! copy compiled for the widest x86 instruction set the CPU reports at run time.
use super::host::{detect, over_rows, sum_lanes, Isa, LANES};
use crate::error::{Error, Result};

/// Values per Q8_0 block (one scale each).
pub const Q8_BLOCK: usize = 32;

/// A `[rows, cols]` matrix in Q8_0 blocks: `q` row-major int8, `d` one float32 scale per block
/// (`[rows, cols / 32]`, the file's float16 scales widened, exactly).
pub struct Q8Matrix {
    q: Vec<i8>,
    d: Vec<f32>,
    rows: usize,
    cols: usize,
}

/// Output rows handed to one thread at a time are multiples of this (4 rows interleaved per pass).
const ROW_GROUP: usize = 4;

impl Q8Matrix {
    /// `q` holds `rows · cols` values, `d` `rows · cols / 32` scales; `cols` a multiple of 32.
    pub fn new(q: Vec<i8>, d: Vec<f32>, rows: usize, cols: usize) -> Result<Q8Matrix> {
        if cols == 0 || !cols.is_multiple_of(Q8_BLOCK) {
            return Err(Error::Invalid(format!(
                "a Q8_0 matrix needs columns in whole blocks of {Q8_BLOCK}, not {cols}"
            )));
        }
        if rows.checked_mul(cols) != Some(q.len()) || rows * (cols / Q8_BLOCK) != d.len() {
            return Err(Error::Invalid(format!(
                "a [{rows}, {cols}] Q8_0 matrix needs {} values and {} scales, not {} and {}",
                rows * cols,
                rows * cols / Q8_BLOCK,
                q.len(),
                d.len()
            )));
        }
        Ok(Q8Matrix { q, d, rows, cols })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (values and scales).
    pub fn nbytes(&self) -> usize {
        self.q.len() + 4 * self.d.len()
    }

    /// Row `r` dequantized (the file's values as float32).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let nb = self.cols / Q8_BLOCK;
        (0..self.cols).map(|k| self.d[r * nb + k / Q8_BLOCK] * self.q[r * self.cols + k] as f32).collect()
    }

    /// `x · dequant(W)ᵀ` for `x` `[n, cols]` row-major: `[n, rows]` row-major, computed on up to
    /// `threads` threads (each a contiguous range of W's rows). Equal to the float32 product with the
    /// dequantized matrix up to float32 rounding and summation order.
    pub fn matvec(&self, x: &[f32], threads: usize) -> Result<Vec<f32>> {
        if !x.len().is_multiple_of(self.cols) {
            return Err(Error::Invalid(format!("{} input values are not rows of {}", x.len(), self.cols)));
        }
        let n = x.len() / self.cols;
        let isa = detect();
        let (q, d, cols) = (&self.q[..], &self.d[..], self.cols);
        let nb = cols / Q8_BLOCK;
        Ok(over_rows(self.rows, n, threads, ROW_GROUP, |r0, r1, y| {
            run(isa, &q[r0 * cols..r1 * cols], &d[r0 * nb..r1 * nb], cols, x, n, y)
        }))
    }
}

/// `y[r * n + i] = Σ_k x[i, k] · d[r, k/32] · q[r, k]` for the rows `r` of this range.
fn run(isa: Isa, q: &[i8], d: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    match isa {
        Isa::Generic => rows_generic(q, d, cols, x, n, y),
        // SAFETY: `detect` found these instruction sets on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { rows_avx2(q, d, cols, x, n, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rows_avx512(q, d, cols, x, n, y) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_avx2(q: &[i8], d: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    rows(q, d, cols, x, n, y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_avx512(q: &[i8], d: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    rows(q, d, cols, x, n, y)
}

fn rows_generic(q: &[i8], d: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    rows(q, d, cols, x, n, y)
}

/// The kernel: four of W's rows at a time against each row of `x`, per block the 32 products in
/// 16 lanes, then times the block's scale into the row's lanes; the lanes summed at the row's end.
#[inline(always)]
fn rows(q: &[i8], d: &[f32], cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    let nb = cols / Q8_BLOCK;
    let nrows = y.len() / n;
    let mut r = 0;
    while r < nrows {
        let g = ROW_GROUP.min(nrows - r);
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [[0f32; LANES]; ROW_GROUP];
            for b in 0..nb {
                let xb: &[f32; Q8_BLOCK] = xi[b * Q8_BLOCK..(b + 1) * Q8_BLOCK].try_into().expect("block");
                for (k, a) in acc.iter_mut().enumerate().take(g) {
                    let row = r + k;
                    let qb: &[i8; Q8_BLOCK] =
                        q[row * cols + b * Q8_BLOCK..row * cols + (b + 1) * Q8_BLOCK].try_into().expect("block");
                    let s = d[row * nb + b];
                    let mut p = [0f32; LANES];
                    for j in 0..LANES {
                        p[j] = qb[j] as f32 * xb[j] + qb[j + LANES] as f32 * xb[j + LANES];
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random stream (no RNG crate needed).
    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    fn random(rows: usize, cols: usize, n: usize, seed: u64) -> (Q8Matrix, Vec<f32>) {
        let mut s = seed;
        let q: Vec<i8> =
            (0..rows * cols).map(|_| (lcg(&mut s) % 255) as i32 as i8).map(|v| v.wrapping_sub(127)).collect();
        let d: Vec<f32> = (0..rows * cols / Q8_BLOCK)
            .map(|_| half::f16::from_f32((lcg(&mut s) % 1000) as f32 / 1e5 - 0.004).to_f32())
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0).collect();
        (Q8Matrix::new(q, d, rows, cols).unwrap(), x)
    }

    /// The naive reference: dequantize W whole, then a float64 dot per output.
    fn naive(m: &Q8Matrix, x: &[f32]) -> Vec<f64> {
        let n = x.len() / m.cols();
        let w: Vec<Vec<f32>> = (0..m.rows()).map(|r| m.dequant_row(r)).collect();
        let mut out = vec![0f64; n * m.rows()];
        for i in 0..n {
            for (r, wr) in w.iter().enumerate() {
                out[i * m.rows() + r] =
                    wr.iter().zip(&x[i * m.cols()..(i + 1) * m.cols()]).map(|(a, b)| *a as f64 * *b as f64).sum();
            }
        }
        out
    }

    #[test]
    fn matvec_equals_dequantize_then_matmul() {
        // odd row counts (not a multiple of the 4-row group, nor of the thread split), 1..3 input rows
        for (rows, cols, n, threads) in
            [(37, 64, 1, 2), (101, 640, 1, 3), (9, 32, 3, 2), (1, 96, 2, 4), (64, 128, 1, 1)]
        {
            let (m, x) = random(rows, cols, n, (rows * cols + n) as u64);
            let got = m.matvec(&x, threads).unwrap();
            let want = naive(&m, &x);
            assert_eq!(got.len(), want.len());
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                // float32 accumulation of `cols` terms against a float64 reference
                let bound = 1e-5 * (cols as f64).sqrt() * want.iter().map(|v| v.abs()).fold(1.0, f64::max);
                assert!((*g as f64 - w).abs() <= bound, "[{rows}x{cols}, n {n}] output {k}: {g} vs {w}");
            }
            // the generic copy (what a CPU without AVX2 runs) agrees with the dispatched one
            let mut y = vec![0f32; n * rows];
            rows_generic(&m.q, &m.d, cols, &x, n, &mut y);
            for r in 0..rows {
                for i in 0..n {
                    assert!((y[r * n + i] - got[i * rows + r]).abs() <= 1e-4 * got[i * rows + r].abs().max(1.0));
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(Q8Matrix::new(vec![0; 40], vec![0.0; 1], 1, 40).is_err());
        assert!(Q8Matrix::new(vec![0; 64], vec![0.0; 1], 1, 64).is_err());
        let m = Q8Matrix::new(vec![1; 64], vec![1.0; 2], 2, 32).unwrap();
        assert!(m.matvec(&[0.0; 31], 1).is_err());
        assert_eq!(m.matvec(&[1.0; 32], 2).unwrap(), vec![32.0, 32.0]);
    }
}
