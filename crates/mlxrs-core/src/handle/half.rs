//! A host CPU kernel beside MLX for 16-bit float weights: `y = x · Wᵀ` for W `[rows, cols]` in
//! bfloat16 or float16 (a Hugging Face checkpoint as most are published), x and y float32.
//!
//! Why: MLX's CPU matmul of half-precision matrices has no BLAS behind it (`simd_gemm<bfloat16,
//! float>`): a bfloat16 model prefilled at 25 tokens/s where its float32 copy did 519 and decoded at
//! 11 against 50–56 (bench/RESULTS.md, 2026-12-07). Casting W to float32 in the graph before MLX's
//! matmul was 13× faster, but MLX allocates each op's output when it queues the op, ahead of the CPU
//! thread that computes it, so several float32 copies of weights were alive at once (a 1000-token
//! prefill of a 185 MB model peaked 273 → 492 MB). This op converts W inside its own task instead:
//!
//! - a decode step's rows (one position each, up to [`SMALL_ROWS`]): W read in place, 2 bytes a weight, by the x86
//!   block the quantized kernels share ([`super::host::x86_quant_block`]: a row's 16 values widened
//!   to float32 per step) over the cores;
//! - anything else (prefill chunks, larger batches): W converted to float32 one tile of [`TILE_BYTES`] at a time and
//!   multiplied by the BLAS's `sgemm` ([`mlxrs_sys::cblas_sgemm`]) straight into the output — the
//!   transient is one tile, whatever the matrix.
//!
//! The products are exact (a 16-bit float widens exactly) summed in float32 in another order than
//! MLX's; the caller rounds them once to the activations' dtype, as MLX's matmul rounds its float
//! accumulators. [`host_half_matmul`] builds the product as one op of MLX's graph
//! (native/mlxrs_ext.cpp `HostHalfMatmul`).
use super::host::{
    detect, into_mlx_output, over_rows, par_chunks_mut, sum_lanes, walk_rows, Isa, QuantRows, LANES, ROW_GROUP,
};
use crate::error::{Error, Result};

/// Up to how many rows of a decode step the kernel reads W in place (decode steps of up to this many
/// sequences); more go through float32 tiles and `sgemm`, as prefill chunks of any length do (so that a
/// chunk's sums do not depend on how many rows its pass holds: `sgemm` gives a row the same sums at any
/// count, and a quantized KV cache can round a last-bit difference into another level).
pub const SMALL_ROWS: usize = 8;

/// Bytes of one float32 tile of W for longer inputs (a few MB: large enough for `sgemm` to run at
/// speed, small against any model).
pub const TILE_BYTES: usize = 4 << 20;

/// The 16-bit float type of W.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfType {
    Bf16,
    F16,
}

impl HalfType {
    /// The code native/mlxrs_ext.cpp passes (`mlxrs_host_half_args.wdtype`).
    fn from_code(c: i32) -> Option<HalfType> {
        match c {
            0 => Some(HalfType::Bf16),
            1 => Some(HalfType::F16),
            _ => None,
        }
    }

    #[inline(always)]
    fn to_f32(self, b: u16) -> f32 {
        match self {
            HalfType::Bf16 => f32::from_bits((b as u32) << 16),
            HalfType::F16 => half::f16::from_bits(b).to_f32(),
        }
    }

    /// `x` rounded to this type (to nearest, ties to even, as MLX converts), as float32.
    #[inline(always)]
    fn round(self, x: f32) -> f32 {
        self.to_f32(self.bits(x))
    }

    /// `x` rounded to this type, as its bits.
    #[inline(always)]
    fn bits(self, x: f32) -> u16 {
        match self {
            HalfType::Bf16 => half::bf16::from_f32(x).to_bits(),
            HalfType::F16 => half::f16::from_f32(x).to_bits(),
        }
    }

    /// `src` widened into `dst` (equal lengths).
    fn widen(self, src: &[u16], dst: &mut [f32]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        match self {
            HalfType::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = f32::from_bits((*s as u32) << 16);
                }
            }
            HalfType::F16 => src.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst),
        }
    }
}

/// A `[rows, cols]` matrix of 16-bit floats, borrowed.
#[derive(Clone, Copy)]
pub struct HalfRef<'a> {
    pub w: &'a [u16],
    pub t: HalfType,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> HalfRef<'a> {
    /// Checks the extents: `rows · cols` values.
    pub fn new(w: &'a [u16], t: HalfType, rows: usize, cols: usize) -> Result<HalfRef<'a>> {
        if cols == 0 || rows.checked_mul(cols) != Some(w.len()) {
            return Err(Error::Invalid(format!(
                "a [{rows}, {cols}] matrix needs {} values, not {}",
                rows * cols,
                w.len()
            )));
        }
        Ok(HalfRef { w, t, rows, cols })
    }

    /// Row `r` as float32.
    pub fn row(&self, r: usize) -> Vec<f32> {
        self.w[r * self.cols..(r + 1) * self.cols].iter().map(|b| self.t.to_f32(*b)).collect()
    }

    /// `x · Wᵀ` for `x` `[n, cols]` row-major into `y` `[n, rows]` row-major, on up to `threads`
    /// threads: through float32 tiles and the BLAS where `gemm`, else (and where the process has no
    /// `cblas_sgemm`) in place.
    pub fn matmul_into(&self, x: &[f32], threads: usize, y: &mut [f32], gemm: bool) -> Result<()> {
        if !x.len().is_multiple_of(self.cols) || y.len() != x.len() / self.cols * self.rows {
            return Err(Error::Invalid(format!(
                "{} input values are not rows of {}, or {} outputs not theirs",
                x.len(),
                self.cols,
                y.len()
            )));
        }
        let n = x.len() / self.cols;
        match mlxrs_sys::cblas_sgemm() {
            Some(f) if gemm => self.tiles(f, x, n, threads, y),
            _ => self.rows_with(detect(), x, threads, y),
        }
        Ok(())
    }

    fn rows_with(&self, isa: Isa, x: &[f32], threads: usize, out: &mut [f32]) {
        let (cols, t) = (self.cols, self.t);
        let n = x.len() / cols;
        over_rows(self.rows, n, threads, ROW_GROUP, out, |r0, r1, y| {
            let part = HalfRef { w: &self.w[r0 * cols..r1 * cols], t, rows: r1 - r0, cols };
            run(isa, &part, x, n, y)
        });
    }

    /// W's rows a tile at a time: widened to float32 (over the threads), then `y[:, tile] = x ·
    /// tileᵀ` by `sgemm` into the output's columns.
    fn tiles(&self, gemm: mlxrs_sys::Sgemm, x: &[f32], n: usize, threads: usize, y: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        // BLAS sizes are C ints: a product too large for them goes through the in-place kernel
        let fits = |v: usize| i32::try_from(v).is_ok();
        if !(fits(n) && fits(rows) && fits(cols)) {
            return self.rows_with(detect(), x, threads, y);
        }
        let tile = (TILE_BYTES / (4 * cols)).clamp(1, rows);
        let mut buf = vec![0f32; tile * cols];
        let mut r0 = 0;
        while r0 < rows {
            let t = tile.min(rows - r0);
            let src = &self.w[r0 * cols..(r0 + t) * cols];
            rows_par(&mut buf[..t * cols], cols, threads, &|j, row| self.t.widen(&src[j * cols..(j + 1) * cols], row));
            // SAFETY: row-major x [n, cols] (lda cols), the tile [t, cols] (ldb cols, transposed), and
            // the output's columns r0..r0 + t of [n, rows] (ldc rows): every extent inside its buffer
            unsafe {
                gemm(
                    101,
                    111,
                    112,
                    n as i32,
                    t as i32,
                    cols as i32,
                    1.0,
                    x.as_ptr(),
                    cols as i32,
                    buf.as_ptr(),
                    cols as i32,
                    0.0,
                    y.as_mut_ptr().add(r0),
                    rows as i32,
                )
            };
            r0 += t;
        }
    }
}

impl QuantRows for HalfRef<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    /// One group a row: the x86 block's per-group scale is 1.
    fn group(&self) -> usize {
        self.cols
    }
    fn bits(&self) -> usize {
        16
    }
    fn bytes(&self) -> *const u8 {
        self.w.as_ptr() as *const u8
    }
    #[inline(always)]
    fn scale(&self, _i: usize) -> f32 {
        1.0
    }
}

/// Values an x86 copy's step takes: the copy runs where a row is whole steps.
#[cfg(target_arch = "x86_64")]
fn step_of(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 16,
        _ => 8,
    }
}

/// `y[r * n + i] = Σ_k x[i, k] · W[r, k]` for the rows `r` of `w` (one thread's range).
fn run(isa: Isa, w: &HalfRef, x: &[f32], n: usize, y: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if !w.cols.is_multiple_of(step_of(isa)) => rows_generic(w, x, n, y),
        Isa::Generic => rows_generic(w, x, n, y),
        // SAFETY: `detect` found these instruction sets on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { rows_avx2(w, x, n, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rows_avx512(w, x, n, y) },
    }
}

/// The generic copy: per row the products with x in [`LANES`] lanes (then the tail), summed pairwise.
fn rows_generic(w: &HalfRef, x: &[f32], n: usize, y: &mut [f32]) {
    let cols = w.cols;
    let full = cols / LANES * LANES;
    for r in 0..w.rows {
        let wr = &w.w[r * cols..(r + 1) * cols];
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [0f32; LANES];
            for c in (0..full).step_by(LANES) {
                for j in 0..LANES {
                    acc[j] += w.t.to_f32(wr[c + j]) * xi[c + j];
                }
            }
            let tail: f32 = (full..cols).map(|c| w.t.to_f32(wr[c]) * xi[c]).sum();
            y[r * n + i] = sum_lanes(&acc) + tail;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_avx512(w: &HalfRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX-512
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        match (r4, w.t) {
            (true, HalfType::Bf16) => bf16_avx512::<ROW_GROUP>(w, x, n, r, y),
            (false, HalfType::Bf16) => bf16_avx512::<1>(w, x, n, r, y),
            (true, HalfType::F16) => f16_avx512::<ROW_GROUP>(w, x, n, r, y),
            (false, HalfType::F16) => f16_avx512::<1>(w, x, n, r, y),
        }
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_avx2(w: &HalfRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX2, FMA and F16C
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        match (r4, w.t) {
            (true, HalfType::Bf16) => bf16_avx2::<ROW_GROUP>(w, x, n, r, y),
            (false, HalfType::Bf16) => bf16_avx2::<1>(w, x, n, r, y),
            (true, HalfType::F16) => f16_avx2::<ROW_GROUP>(w, x, n, r, y),
            (false, HalfType::F16) => f16_avx2::<1>(w, x, n, r, y),
        }
    })
}

super::host::x86_quant_block!(
    avx512,
    bf16_avx512,
    HalfRef,
    16,
    |xp, c| {
        // SAFETY: 16 values of x's row
        unsafe { _mm512_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 16 values (32 bytes) of the row; a bfloat16 is a float32's upper half
        let h = unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(q as *const __m256i)) };
        *acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(h)), xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx512,
    f16_avx512,
    HalfRef,
    16,
    |xp, c| {
        // SAFETY: 16 values of x's row
        unsafe { _mm512_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 16 values (32 bytes) of the row
        let v = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(q as *const __m256i)) };
        *acc = _mm512_fmadd_ps(v, xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx2,
    bf16_avx2,
    HalfRef,
    8,
    |xp, c| {
        // SAFETY: 8 values of x's row
        unsafe { _mm256_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 8 values (16 bytes) of the row
        let h = unsafe { _mm256_cvtepu16_epi32(_mm_loadu_si128(q as *const __m128i)) };
        *acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)), xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx2,
    f16_avx2,
    HalfRef,
    8,
    |xp, c| {
        // SAFETY: 8 values of x's row
        unsafe { _mm256_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 8 values (16 bytes) of the row
        let v = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(q as *const __m128i)) };
        *acc = _mm256_fmadd_ps(v, xv, *acc);
    }
);

/// Bytes of one pass's float32 scores in [`HalfAttention::run`]: the query rows of a pass are as many
/// as fit (a bounded transient whatever the prompt and context).
pub const ATTN_SCRATCH_BYTES: usize = 16 << 20;

/// `f(src, dst)` over matching runs of two equal-length slices: on up to `threads` threads for long
/// ones (a prefill chunk's activations), on this thread for short ones (a decode step's, where waking
/// the workers costs more than the copy).
fn convert_par<A: Sync, B: Send>(threads: usize, src: &[A], dst: &mut [B], f: impl Fn(&[A], &mut [B]) + Sync) {
    const PAR_MIN: usize = 1 << 16;
    if src.len() < PAR_MIN || threads <= 1 {
        return f(src, dst);
    }
    par_chunks_mut(dst, src.len().div_ceil(threads), &|start, d| f(&src[start..start + d.len()], d));
}

/// The bytes [`HalfAttention::run`] allocates for `heads` query heads over `kv_heads` of `lq` queries
/// and `lk` keys of widths `d` and `dv`: one kv head's keys and values in float32, and a pass's queries,
/// scores and outputs (a pass: as many query positions as keep its scores within
/// [`ATTN_SCRATCH_BYTES`]). The memory planner counts this where the op replaces MLX's attention.
pub fn attention_scratch_bytes(heads: u64, kv_heads: u64, lq: u64, lk: u64, d: u64, dv: u64) -> u64 {
    let rep = (heads / kv_heads.max(1)).max(1);
    let blk = (ATTN_SCRATCH_BYTES as u64 / (4 * lk.max(1) * rep)).clamp(1, lq.max(1));
    4 * (rep * blk * (lk + d + dv) + lk * (d + dv))
}

/// `f(i, row)` for each `len`-long row of `data`, over up to `threads` threads (contiguous runs).
fn rows_par(data: &mut [f32], len: usize, threads: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let len = len.max(1);
    let rows = data.len() / len;
    if rows == 0 {
        return;
    }
    let per = rows.div_ceil(threads.clamp(1, rows));
    par_chunks_mut(data, per * len, &|start, chunk| {
        for (j, row) in chunk.chunks_mut(len).enumerate() {
            f(start / len + j, row);
        }
    });
}

/// Attention over 16-bit floats as MLX's CPU fallback of `fast::scaled_dot_product_attention` computes
/// it (mlxrs's `models/sdpa.rs` `unfused` writes the same ops out), rounded at the same points —
/// queries times the scale (itself rounded to the type), the scores, the probabilities (a precise
/// softmax: float32 inside), the output — with each product an exact float32 sum through the BLAS,
/// in another order than MLX's half-precision matmul. The transient is one kv head's keys and values
/// in float32 and [`ATTN_SCRATCH_BYTES`] of scores.
pub struct HalfAttention<'a> {
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub t: HalfType,
    pub causal: bool,
    /// `[lq, lk]`: query i sees key j where true (MLX's boolean mask); None for none (or `causal`)
    pub mask: Option<&'a [bool]>,
    pub scale: f32,
    /// batch, query heads, kv heads, queries, keys, key width, value width
    pub dims: [usize; 7],
}

impl HalfAttention<'_> {
    /// Checks the extents against `dims`.
    fn check(&self, out: usize) -> Result<()> {
        let [b, h, kvh, lq, lk, d, dv] = self.dims;
        let ok = kvh > 0
            && h.is_multiple_of(kvh)
            && (!self.causal || lq <= lk)
            && !(self.causal && self.mask.is_some())
            && self.mask.is_none_or(|m| m.len() == lq * lk)
            && self.q.len() == b * h * lq * d
            && self.k.len() == b * kvh * lk * d
            && self.v.len() == b * kvh * lk * dv
            && out == b * h * lq * dv;
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid(format!("attention extents do not match {:?}", self.dims)))
        }
    }

    /// The output `[b, heads, lq, dv]` (bits of the type) on up to `threads` threads.
    pub fn run(&self, gemm: mlxrs_sys::Sgemm, threads: usize, out: &mut [u16]) -> Result<()> {
        self.check(out.len())?;
        let [b, h, kvh, lq, lk, d, dv] = self.dims;
        if b * h * lq == 0 {
            return Ok(());
        }
        let fits = |v: usize| i32::try_from(v).is_ok();
        if !(fits(lk * d.max(dv)) && fits(h * lq * lk.max(d).max(dv))) {
            return Err(Error::Invalid(format!("attention too large for the BLAS: {:?}", self.dims)));
        }
        let (t, rep) = (self.t, h / kvh);
        let sc = t.round(self.scale);
        // query positions of a pass: its rep heads' rows of scores within the scratch
        let blk = (ATTN_SCRATCH_BYTES / (4 * lk.max(1) * rep)).clamp(1, lq);
        let (mut kf, mut vf) = (vec![0f32; lk * d], vec![0f32; lk * dv]);
        let (mut qf, mut s, mut o) =
            (vec![0f32; rep * blk * d], vec![0f32; rep * blk * lk], vec![0f32; rep * blk * dv]);
        for bi in 0..b {
            for g in 0..kvh {
                let kb = &self.k[(bi * kvh + g) * lk * d..][..lk * d];
                let vb = &self.v[(bi * kvh + g) * lk * dv..][..lk * dv];
                rows_par(&mut kf, d, threads, &|j, row| t.widen(&kb[j * d..(j + 1) * d], row));
                rows_par(&mut vf, dv, threads, &|j, row| t.widen(&vb[j * dv..(j + 1) * dv], row));
                let mut q0 = 0;
                while q0 < lq {
                    let nb = blk.min(lq - q0);
                    let rows = rep * nb;
                    // row r * nb + i: query head g * rep + r at position q0 + i (its index in q and out,
                    // in rows of d and dv)
                    let at = |row: usize| (bi * h + g * rep + row / nb) * lq + q0 + row % nb;
                    rows_par(&mut qf[..rows * d], d, threads, &|row, dst| {
                        let src = &self.q[at(row) * d..][..d];
                        for (x, q) in dst.iter_mut().zip(src) {
                            *x = t.round(sc * t.to_f32(*q));
                        }
                    });
                    // SAFETY: qf [rows, d], kf [lk, d] (transposed), s [rows, lk]: every extent in its buffer
                    unsafe {
                        gemm(
                            101,
                            111,
                            112,
                            rows as i32,
                            lk as i32,
                            d as i32,
                            1.0,
                            qf.as_ptr(),
                            d as i32,
                            kf.as_ptr(),
                            d as i32,
                            0.0,
                            s.as_mut_ptr(),
                            lk as i32,
                        )
                    };
                    let (causal, mask) = (self.causal, self.mask);
                    rows_par(&mut s[..rows * lk], lk, threads, &|row, sr| {
                        let qi = q0 + row % nb;
                        // keys this query sees: causal from the bottom right, or the mask's row, as MLX's
                        let seen = if causal { lk - lq + qi + 1 } else { lk };
                        let mrow = mask.map(|m| &m[qi * lk..(qi + 1) * lk]);
                        let sees = |j: usize| j < seen && mrow.is_none_or(|m| m[j]);
                        let mut m = f32::NEG_INFINITY;
                        for (j, x) in sr.iter_mut().enumerate() {
                            if sees(j) {
                                *x = t.round(*x);
                                m = m.max(*x);
                            }
                        }
                        if m == f32::NEG_INFINITY {
                            // every key masked: MLX's softmax of equal (lowest) scores is uniform
                            sr.fill(t.round(1.0 / lk as f32));
                            return;
                        }
                        let mut sum = 0f32;
                        for (j, x) in sr.iter_mut().enumerate() {
                            if sees(j) {
                                *x = (*x - m).exp();
                                sum += *x;
                            }
                        }
                        let inv = 1.0 / sum;
                        for (j, x) in sr.iter_mut().enumerate() {
                            *x = if sees(j) { t.round(*x * inv) } else { 0.0 };
                        }
                    });
                    // SAFETY: s [rows, lk], vf [lk, dv], o [rows, dv]
                    unsafe {
                        gemm(
                            101,
                            111,
                            111,
                            rows as i32,
                            dv as i32,
                            lk as i32,
                            1.0,
                            s.as_ptr(),
                            lk as i32,
                            vf.as_ptr(),
                            dv as i32,
                            0.0,
                            o.as_mut_ptr(),
                            dv as i32,
                        )
                    };
                    for row in 0..rows {
                        let y0 = at(row) * dv;
                        for (y, x) in out[y0..y0 + dv].iter_mut().zip(&o[row * dv..(row + 1) * dv]) {
                            *y = t.bits(*x);
                        }
                    }
                    q0 += nb;
                }
            }
        }
        Ok(())
    }
}

static ATTN_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many attentions the op of [`host_half_attention`] has computed in this process.
pub fn half_attention_calls() -> u64 {
    ATTN_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The kernel MLX's CPU thread calls for [`host_half_attention`]'s op (native/mlxrs_ext.cpp
/// `HostHalfAttention`).
///
/// # Safety
/// `args` points at a [`mlxrs_sys::HostHalfAttnArgs`] whose pointers hold the row-major extents its
/// dims name (the primitive passes its inputs' contiguous buffers and its fresh output's after
/// checking their shapes), the output overlapping none of the inputs.
unsafe extern "C" fn attn_kernel(args: *const mlxrs_sys::HostHalfAttnArgs) {
    // SAFETY: the caller's contract
    let a = unsafe { std::ptr::read(args) };
    ATTN_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dims = [a.b, a.heads, a.kv_heads, a.lq, a.lk, a.d, a.dv];
    let n_out = a.b * a.heads * a.lq * a.dv;
    // SAFETY: the output's extent (the caller's contract)
    let out = unsafe { std::slice::from_raw_parts_mut(a.out, n_out) };
    let (Some(t), Some(gemm)) = (HalfType::from_code(a.dtype), mlxrs_sys::cblas_sgemm()) else {
        // checked when the op was built (the type, the BLAS): unreachable, but never leave out unwritten
        out.fill(HalfType::from_code(a.dtype).unwrap_or(HalfType::Bf16).bits(f32::NAN));
        return;
    };
    // SAFETY: the inputs' extents (the caller's contract)
    let (q, k, v) = unsafe {
        (
            std::slice::from_raw_parts(a.q, a.b * a.heads * a.lq * a.d),
            std::slice::from_raw_parts(a.k, a.b * a.kv_heads * a.lk * a.d),
            std::slice::from_raw_parts(a.v, a.b * a.kv_heads * a.lk * a.dv),
        )
    };
    // SAFETY: the mask's extent, where given (the caller's contract)
    let mask = (!a.mask.is_null()).then(|| unsafe { std::slice::from_raw_parts(a.mask, a.lq * a.lk) });
    let att = HalfAttention { q, k, v, t, causal: a.causal != 0, mask, scale: a.scale, dims };
    into_mlx_output(out, t.bits(f32::NAN), |threads, out| att.run(gemm, threads, out));
}

/// `softmax(scale · q kᵀ (+ the causal mask from the bottom right, or a boolean `mask` `[Lq, Lk]`)) v`
/// for q `[B, heads, Lq, D]`, k `[B, kv_heads, Lk, D]`, v `[B, kv_heads, Lk, Dv]` of one 16-bit float
/// type, as one op of MLX's graph
/// on the current stream (a CPU stream), computed by [`HalfAttention::run`] when MLX evaluates it. None
/// where the loaded libmlxc lacks the entry point or the process has no `cblas_sgemm`.
pub fn host_half_attention(
    q: &super::Array,
    k: &super::Array,
    v: &super::Array,
    mask: Option<&super::Array>,
    scale: f32,
    causal: bool,
) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_half_attention else { return Ok(None) };
    if mlxrs_sys::cblas_sgemm().is_none() {
        return Ok(None);
    }
    super::ops::count_op();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention; the primitive checks shapes and dtypes, makes the inputs
    // row-contiguous and allocates a fresh output (the kernel's contract)
    let m = mask.map_or(mlxrs_sys::mlx_array { ctx: std::ptr::null_mut() }, |m| m.0);
    let rc = unsafe { f(&mut r, q.0, k.0, v.0, m, scale, causal, attn_kernel, super::runtime::current_stream()) };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products the op of [`host_half_matmul`] has computed in this process (tests and
/// benchmarks check the path ran).
pub fn half_matmul_calls() -> u64 {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The kernel MLX's CPU thread calls for [`host_half_matmul`]'s op (native/mlxrs_ext.cpp
/// `HostHalfMatmul`).
///
/// # Safety
/// `args` points at a [`mlxrs_sys::HostHalfArgs`] whose `w` points at `rows · cols` 16-bit values of
/// the type `wdtype` names, `x` at `n · cols` and `y` at `n · rows` values (float32, or of W's type
/// where `x16`), `y` not overlapping the others: the primitive passes its inputs' and its fresh output's buffers after checking their
/// shapes.
unsafe extern "C" fn graph_kernel(args: *const mlxrs_sys::HostHalfArgs) {
    // SAFETY: the caller's contract
    let mlxrs_sys::HostHalfArgs { w, wdtype, rows, cols, x, n, y, gemm, x16 } = unsafe { std::ptr::read(args) };
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if rows == 0 || cols == 0 || n == 0 {
        return;
    }
    // SAFETY: W's extent, x's and y's (the caller's contract)
    let wv = unsafe { std::slice::from_raw_parts(w, rows * cols) };
    let io = unsafe { HostIo::new(x, y, n * cols, n * rows, x16 != 0) };
    io.run(HalfType::from_code(wdtype), |t, x, y| match HalfRef::new(wv, t, rows, cols) {
        Ok(m) => into_mlx_output(y, f32::NAN, |threads, y| m.matmul_into(x, threads, y, gemm != 0)),
        // the shapes were checked when the op was built: unreachable, but never leave y unwritten
        Err(_) => y.fill(f32::NAN),
    });
}

/// A host kernel's x and y as MLX's primitive passes them: float32, or 16-bit floats of W's type
/// (`x16`: x widened before the product, the product rounded once into y).
struct HostIo {
    x: *const std::ffi::c_void,
    y: *mut std::ffi::c_void,
    xn: usize,
    yn: usize,
    x16: bool,
}

impl HostIo {
    /// # Safety
    /// `x` points at `xn` and `y` at `yn` values (float32, or 16-bit where `x16`), `y` overlapping
    /// nothing else, both valid while the `HostIo` is used.
    unsafe fn new(x: *const std::ffi::c_void, y: *mut std::ffi::c_void, xn: usize, yn: usize, x16: bool) -> HostIo {
        HostIo { x, y, xn, yn, x16 }
    }

    /// `product(t, x, y)` over float32 views of x and y (widened and rounded around it for 16-bit
    /// ones); y all NaN where W's type code was not one (checked when the op was built: unreachable,
    /// but never leave y unwritten).
    fn run(&self, t: Option<HalfType>, product: impl FnOnce(HalfType, &[f32], &mut [f32])) {
        if !self.x16 {
            // SAFETY: the extents given to `new`
            let (x, y) = unsafe {
                (
                    std::slice::from_raw_parts(self.x as *const f32, self.xn),
                    std::slice::from_raw_parts_mut(self.y as *mut f32, self.yn),
                )
            };
            return match t {
                Some(t) => product(t, x, y),
                None => y.fill(f32::NAN),
            };
        }
        // SAFETY: the extents given to `new`
        let (xv, y) = unsafe {
            (
                std::slice::from_raw_parts(self.x as *const u16, self.xn),
                std::slice::from_raw_parts_mut(self.y as *mut u16, self.yn),
            )
        };
        let Some(t) = t else { return y.fill(HalfType::Bf16.bits(f32::NAN)) };
        let threads = super::host::host_threads();
        let mut xf = vec![0f32; self.xn];
        convert_par(threads, xv, &mut xf, |s, d| t.widen(s, d));
        let mut yf = vec![0f32; self.yn];
        product(t, &xf, &mut yf);
        convert_par(threads, &yf, y, |s, d| {
            for (o, v) in d.iter_mut().zip(s) {
                *o = t.bits(*v);
            }
        });
    }
}

/// `x · Wᵀ` for `x [..., cols]` float32 or of W's type and W `[rows, cols]` bfloat16 or float16, out in
/// x's type (a 16-bit product rounded once from its float32 sum), as one op of MLX's graph on the current stream (a CPU stream), computed by [`HalfRef::matmul_into`] when
/// MLX evaluates it: W read in place for a decode step's rows (`x` `[B, 1, cols]`, B up to
/// [`SMALL_ROWS`]), through float32 tiles and the BLAS for anything else. None where the loaded
/// libmlxc lacks the entry point (one not built by native/).
pub fn host_half_matmul(x: &super::Array, w: &super::Array) -> Result<Option<super::Array>> {
    let cols = x.dim(-1).max(1) as usize;
    let step = x.ndim() == 3 && x.dim(1) == 1 && x.size() / cols <= SMALL_ROWS;
    host_half_matmul_as(x, w, !step)
}

/// [`host_half_matmul`] with the path given: `gemm` through the BLAS, else W in place.
pub fn host_half_matmul_as(x: &super::Array, w: &super::Array, gemm: bool) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_half_matmul else { return Ok(None) };
    super::ops::count_op();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention (handles in, the result through the pointer); the kernel's
    // contract is kept by the primitive (shapes and dtypes checked, inputs made row-contiguous, a
    // fresh output)
    let rc = unsafe { f(&mut r, x.0, w.0, gemm, graph_kernel, super::runtime::current_stream()) };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

static GATHER_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products the op of [`host_half_gather_matmul`] has computed in this process.
pub fn half_gather_calls() -> u64 {
    GATHER_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A mixture's experts: `experts` matrices of `rows × cols` 16-bit floats, one after the other.
#[derive(Clone, Copy)]
struct Experts<'a> {
    w: &'a [u16],
    t: HalfType,
    experts: usize,
    rows: usize,
    cols: usize,
}

/// `y[i] = x[i] · W[idx[i]]ᵀ` for float32 rows `x` `[n, cols]` into `y` `[n, rows]`, an index past the
/// experts a NaN row: with `gemm` (a prompt's rows) the rows of one expert together, one product per
/// expert used through float32 tiles and the BLAS; without (a decode step's) each row on its own, its
/// expert's matrix read in place, the rows spread over the workers.
fn gather_into(ex: Experts, idx: &[u32], x: &[f32], y: &mut [f32], gemm: bool) {
    let Experts { w, t, experts, rows, cols } = ex;
    if !gemm {
        // a decode step's rows: each row its expert's matrix read in place on one thread, the rows
        // spread over the workers (one wake-up an op, not one an expert: a small expert's product is
        // shorter than a wake-up)
        let row = |start: usize, yr: &mut [f32]| {
            let i = start / rows;
            let e = idx[i] as usize;
            let m = (e < experts).then(|| HalfRef::new(&w[e * rows * cols..(e + 1) * rows * cols], t, rows, cols));
            match m {
                Some(Ok(m)) if m.matmul_into(&x[i * cols..(i + 1) * cols], 1, yr, false).is_ok() => {}
                _ => yr.fill(f32::NAN),
            }
        };
        into_mlx_output(y, f32::NAN, |threads, y| {
            if threads <= 1 {
                y.chunks_mut(rows).enumerate().for_each(|(i, yr)| row(i * rows, yr));
            } else {
                par_chunks_mut(y, rows, &row);
            }
            Ok(())
        });
        return;
    }
    let n = idx.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| idx[i]); // stable: a group's rows in their order
    let mut start = 0;
    while start < n {
        let e = idx[order[start]] as usize;
        let end = start + order[start..].iter().take_while(|&&i| idx[i] as usize == e).count();
        let group = &order[start..end];
        start = end;
        if e >= experts {
            for &i in group {
                y[i * rows..(i + 1) * rows].fill(f32::NAN);
            }
            continue;
        }
        let m = match HalfRef::new(&w[e * rows * cols..(e + 1) * rows * cols], t, rows, cols) {
            Ok(m) => m,
            Err(_) => return y.fill(f32::NAN), // extents checked when the op was built: unreachable
        };
        let mut xg = Vec::with_capacity(group.len() * cols);
        for &i in group {
            xg.extend_from_slice(&x[i * cols..(i + 1) * cols]);
        }
        let mut yg = vec![0f32; group.len() * rows];
        into_mlx_output(&mut yg, f32::NAN, |threads, yg| m.matmul_into(&xg, threads, yg, gemm));
        for (k, &i) in group.iter().enumerate() {
            y[i * rows..(i + 1) * rows].copy_from_slice(&yg[k * rows..(k + 1) * rows]);
        }
    }
}

/// The kernel MLX's CPU thread calls for [`host_half_gather_matmul`]'s op (native/mlxrs_ext.cpp
/// `HostHalfGatherMatmul`).
///
/// # Safety
/// `args` points at a [`mlxrs_sys::HostHalfGatherArgs`] whose `w` points at `experts · rows · cols`
/// 16-bit values of the type `wdtype` names, `idx` at `n` indices, `x` at `n · cols` and `y` at
/// `n · rows` values (float32, or of W's type where `x16`), `y` not overlapping the others: the
/// primitive passes its inputs' and its fresh output's buffers after checking their shapes.
unsafe extern "C" fn gather_kernel(args: *const mlxrs_sys::HostHalfGatherArgs) {
    // SAFETY: the caller's contract
    let mlxrs_sys::HostHalfGatherArgs { w, wdtype, experts, rows, cols, x, idx, n, y, gemm, x16 } =
        unsafe { std::ptr::read(args) };
    GATHER_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if rows == 0 || cols == 0 || n == 0 {
        return;
    }
    // SAFETY: the extents of W, idx, x and y (the caller's contract)
    let (wv, iv) =
        unsafe { (std::slice::from_raw_parts(w, experts * rows * cols), std::slice::from_raw_parts(idx, n)) };
    let io = unsafe { HostIo::new(x, y, n * cols, n * rows, x16 != 0) };
    io.run(HalfType::from_code(wdtype), |t, x, y| {
        gather_into(Experts { w: wv, t, experts, rows, cols }, iv, x, y, gemm != 0)
    });
}

/// `x[i] · W[idx[i]]ᵀ` row by row — the product of a mixture's routed experts, MLX's `gather_mm`,
/// which MLX's CPU backend has only for float32 — for `x` `[n, cols]` float32 or of W's type, W
/// `[experts, rows, cols]` bfloat16 or float16 and `idx` `[n]` int32 or uint32, out `[n, rows]` in x's
/// type (a 16-bit product rounded once from its float32 sum), as one op of MLX's graph on the current
/// stream (a CPU stream), computed by [`HalfRef::matmul_into`] per expert used when MLX evaluates it:
/// W read in place where `gemm` is false (a decode step), through float32 tiles and the BLAS where
/// it is true. None where the loaded libmlxc lacks the entry point (one not built by native/).
pub fn host_half_gather_matmul(
    x: &super::Array,
    w: &super::Array,
    idx: &super::Array,
    gemm: bool,
) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_half_gather_matmul else { return Ok(None) };
    super::ops::count_op();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention (handles in, the result through the pointer); the kernel's
    // contract is kept by the primitive (shapes and dtypes checked, inputs made row-contiguous, a
    // fresh output)
    let rc = unsafe { f(&mut r, x.0, w.0, idx.0, gemm, gather_kernel, super::runtime::current_stream()) };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

#[cfg(test)]
mod tests {
    use super::super::host::testing::{isas, lcg, naive};
    use super::*;

    /// Random 16-bit weights (finite, |v| < 2) of `t` and x in [-1, 1).
    fn random(t: HalfType, rows: usize, cols: usize, n: usize, seed: u64) -> (Vec<u16>, Vec<f32>) {
        let mut s = seed;
        let mut unit = move || (lcg(&mut s) % 20001) as f32 / 10000.0 - 1.0;
        let w = (0..rows * cols)
            .map(|_| {
                let v = unit() * 1.5;
                match t {
                    HalfType::Bf16 => half::bf16::from_f32(v).to_bits(),
                    HalfType::F16 => half::f16::from_f32(v).to_bits(),
                }
            })
            .collect();
        let x = (0..n * cols).map(|_| unit()).collect();
        (w, x)
    }

    fn check(got: &[f32], want: &[f64], cols: usize, what: &str) {
        for (g, w) in got.iter().zip(want) {
            // float32 sums of `cols` products of magnitude ≤ 1.5
            assert!((*g as f64 - w).abs() <= 1e-5 * cols as f64, "{what}: {g} vs {w}");
        }
    }

    /// Every copy this CPU runs (and the tiles through the BLAS where loaded), for both types, rows of
    /// x from 1 to past [`SMALL_ROWS`], columns whole steps or not, against the float64 product.
    #[test]
    fn matches_the_float64_product() {
        crate::handle::init().unwrap();
        if cfg!(target_os = "linux") {
            assert!(mlxrs_sys::cblas_sgemm().is_some(), "the BLAS MLX loaded defines cblas_sgemm");
        }
        for t in [HalfType::Bf16, HalfType::F16] {
            for (rows, cols) in [(37, 64), (13, 40), (9, 7)] {
                for n in [1, 3, SMALL_ROWS, SMALL_ROWS + 1, 33] {
                    let (w, x) = random(t, rows, cols, n, (rows * cols + n) as u64);
                    let m = HalfRef::new(&w, t, rows, cols).unwrap();
                    let want = naive(rows, cols, &x, |r| m.row(r));
                    for (name, isa) in isas() {
                        let mut y = vec![0f32; n * rows];
                        m.rows_with(isa, &x, 3, &mut y);
                        check(&y, &want, cols, &format!("{t:?} {name} [{rows}, {cols}] n {n}"));
                    }
                    for gemm in [false, true] {
                        let mut y = vec![0f32; n * rows];
                        m.matmul_into(&x, 2, &mut y, gemm).unwrap();
                        check(&y, &want, cols, &format!("{t:?} matmul_into [{rows}, {cols}] n {n} gemm {gemm}"));
                    }
                }
            }
        }
        // several tiles: a matrix of more rows than one tile holds
        let (rows, cols, n) = (TILE_BYTES / (4 * 64) + 37, 64, 3);
        let (w, x) = random(HalfType::Bf16, rows, cols, n, 7);
        let m = HalfRef::new(&w, HalfType::Bf16, rows, cols).unwrap();
        let mut y = vec![0f32; n * rows];
        m.matmul_into(&x, 2, &mut y, true).unwrap();
        check(&y, &naive(rows, cols, &x, |r| m.row(r)), cols, "tiles");
        assert!(HalfRef::new(&w[1..], HalfType::Bf16, rows, cols).is_err());
        assert!(m.matmul_into(&x[1..], 2, &mut y, true).is_err());
    }

    /// The op in MLX's graph against MLX's own matmul of W cast to float32 on a CPU stream, for both
    /// types, decode and prefill shapes (x also as a transposed view); and what it refuses.
    #[test]
    fn graph_op_matches_mlx() {
        use crate::handle as mx;
        use mx::Dtype;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            let (rows, cols) = (70, 96);
            for dt in [Dtype::Bfloat16, Dtype::Float16] {
                for n in [1, 4, 40] {
                    let key = mx::random_key(n as u64).unwrap();
                    let w = mx::astype(&mx::random_normal(&[rows, cols], Dtype::Float32, &key).unwrap(), dt).unwrap();
                    // a decode step of n rows (W in place up to SMALL_ROWS), a prompt of n tokens (the BLAS),
                    // and that prompt as a transposed view
                    let x = mx::random_normal(&[n, 1, cols], Dtype::Float32, &key).unwrap();
                    let xp = mx::random_normal(&[1, n, cols], Dtype::Float32, &key).unwrap();
                    let xt =
                        mx::swapaxes(&mx::random_normal(&[1, cols, n], Dtype::Float32, &key).unwrap(), 1, 2).unwrap();
                    for x in [x, xp, xt] {
                        let before = half_matmul_calls();
                        let ours = host_half_matmul(&x, &w).unwrap().expect("the libmlxc built by native/ has the op");
                        let mut shape = x.shape();
                        shape[2] = rows;
                        assert_eq!(ours.shape(), shape);
                        let theirs =
                            mx::matmul(&x, &mx::transpose(&mx::astype(&w, Dtype::Float32).unwrap()).unwrap()).unwrap();
                        let (g, t) = (ours.to_vec::<f32>().unwrap(), theirs.to_vec::<f32>().unwrap());
                        let d = g.iter().zip(&t).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                        assert!(d < 1e-4, "{dt:?} n {n}: {d}");
                        assert!(half_matmul_calls() > before, "the op ran the kernel");
                        // x of W's type: the product rounded once to it, as MLX's matmul rounds
                        let x16 = mx::astype(&x, dt).unwrap();
                        let ours = host_half_matmul(&x16, &w).unwrap().unwrap();
                        assert_eq!(ours.dtype(), dt);
                        let theirs = mx::matmul(
                            &mx::astype(&x16, Dtype::Float32).unwrap(),
                            &mx::transpose(&mx::astype(&w, Dtype::Float32).unwrap()).unwrap(),
                        )
                        .unwrap();
                        let (g, t) = (
                            mx::astype(&ours, Dtype::Float32).unwrap().to_vec::<f32>().unwrap(),
                            theirs.to_vec::<f32>().unwrap(),
                        );
                        let step = if dt == Dtype::Bfloat16 { 2f32.powi(-8) } else { 2f32.powi(-11) };
                        for (a, b) in g.iter().zip(&t) {
                            assert!((a - b).abs() <= step * b.abs() + 1e-4, "{dt:?} n {n}: {a} vs {b}");
                        }
                    }
                }
            }
            let key = mx::random_key(7).unwrap();
            let x = mx::random_normal(&[2, cols], Dtype::Float32, &key).unwrap();
            let w32 = mx::random_normal(&[rows, cols], Dtype::Float32, &key).unwrap();
            assert!(host_half_matmul(&x, &w32).is_err(), "a float32 W is refused");
            let wb = mx::astype(&w32, Dtype::Bfloat16).unwrap();
            let xh = mx::astype(&x, Dtype::Float16).unwrap();
            assert!(host_half_matmul(&xh, &wb).is_err(), "x of a third type is refused");
            let short = mx::random_normal(&[2, cols - 1], Dtype::Float32, &key).unwrap();
            assert!(host_half_matmul(&short, &wb).is_err(), "x of another width is refused");
        })
    }

    /// The gather op against MLX's float32 `gather_mm` over the same 16-bit experts (widened: exact
    /// products) on a CPU stream: repeated and unsorted experts, both types, x float32 and of W's type,
    /// W in place and through the BLAS (the same sums either way, up to order); an index past the
    /// experts gives a NaN row; what it refuses.
    #[test]
    fn gather_op_matches_mlx_gather_mm() {
        use crate::handle as mx;
        use mx::Dtype;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            let (experts, rows, cols) = (5, 24, 72);
            let key = mx::random_key(3).unwrap();
            let idx_v: Vec<i32> = vec![3, 0, 3, 4, 1, 3, 0, 2, 2, 4, 3];
            let n = idx_v.len() as i32;
            let idx = mx::Array::from_slice(&idx_v, &[n]).unwrap();
            let x = mx::random_normal(&[n, cols], Dtype::Float32, &key).unwrap();
            for dt in [Dtype::Bfloat16, Dtype::Float16] {
                let w =
                    mx::astype(&mx::random_normal(&[experts, rows, cols], Dtype::Float32, &key).unwrap(), dt).unwrap();
                // MLX's float32 gather_mm: x [n, 1, cols] against W[idx]ᵀ
                let wt = mx::swapaxes(&mx::astype(&w, Dtype::Float32).unwrap(), 1, 2).unwrap();
                let reference = |x: &mx::Array| {
                    let x3 = mx::reshape(&mx::astype(x, Dtype::Float32).unwrap(), &[n, 1, cols]).unwrap();
                    mx::reshape(&mx::gather_mm(&x3, &wt, None, Some(&idx), false).unwrap(), &[n, rows])
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap()
                };
                for gemm in [false, true] {
                    let before = half_gather_calls();
                    let ours = host_half_gather_matmul(&x, &w, &idx, gemm).unwrap().expect("the op");
                    assert_eq!(ours.shape(), vec![n, rows]);
                    let (g, t) = (ours.to_vec::<f32>().unwrap(), reference(&x));
                    let d = g.iter().zip(&t).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(d < 1e-4, "{dt:?} gemm {gemm}: {d}");
                    assert!(half_gather_calls() > before, "the op ran the kernel");
                    // x of W's type: each product rounded once to it
                    let x16 = mx::astype(&x, dt).unwrap();
                    let ours = host_half_gather_matmul(&x16, &w, &idx, gemm).unwrap().unwrap();
                    assert_eq!(ours.dtype(), dt);
                    let g = mx::astype(&ours, Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    let t = reference(&x16);
                    let step = if dt == Dtype::Bfloat16 { 2f32.powi(-8) } else { 2f32.powi(-11) };
                    for (a, b) in g.iter().zip(&t) {
                        assert!((a - b).abs() <= step * b.abs() + 1e-4, "{dt:?} gemm {gemm}: {a} vs {b}");
                    }
                }
                // uint32 indices, one past the experts: that row NaN, the others as before
                let bad: Vec<u32> = vec![1, 9, 0];
                let iu = mx::Array::from_slice(&bad, &[3]).unwrap();
                let x3 = mx::slice(&x, &[0, 0], &[3, cols], &[1, 1]).unwrap();
                let y = host_half_gather_matmul(&x3, &w, &iu, false).unwrap().unwrap().to_vec::<f32>().unwrap();
                assert!(y[rows as usize..2 * rows as usize].iter().all(|v| v.is_nan()));
                assert!(y[..rows as usize].iter().chain(&y[2 * rows as usize..]).all(|v| v.is_finite()));
                // refused: a 2-D W, x of another width, indices of another count
                let w2 = mx::reshape(&w, &[experts * rows, cols]).unwrap();
                assert!(host_half_gather_matmul(&x, &w2, &idx, false).is_err());
                let short = mx::random_normal(&[n, cols - 1], Dtype::Float32, &key).unwrap();
                assert!(host_half_gather_matmul(&short, &w, &idx, false).is_err());
                assert!(host_half_gather_matmul(&x3, &w, &idx, false).is_err());
            }
        })
    }

    /// The op against MLX's own attention over the same 16-bit inputs (its CPU fallback: half-precision
    /// matmuls, rounded at the same points): grouped heads, causal with fewer queries than keys, no
    /// mask, a sliding window's boolean mask, both types; within a rounding step of the outputs (the
    /// sums' order differs).
    #[test]
    fn attention_op_matches_mlx() {
        use crate::handle as mx;
        use mx::Dtype;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            for (dt, b, h, kvh, lq, lk, d, causal, window) in [
                (Dtype::Bfloat16, 1, 4, 2, 16, 16, 32, true, None),
                (Dtype::Bfloat16, 2, 8, 2, 7, 40, 64, true, None),
                (Dtype::Float16, 1, 2, 2, 5, 9, 16, false, None),
                (Dtype::Bfloat16, 1, 2, 1, 3, 3, 8, false, None),
                // a sliding window of 6 as a boolean mask (cache.rs `causal_mask`)
                (Dtype::Bfloat16, 1, 4, 2, 12, 20, 32, false, Some(6)),
            ] {
                let key = mx::random_key((h * lq + lk) as u64).unwrap();
                let (k1, k2) = mx::random_split(&key).unwrap();
                let (k2, k3) = mx::random_split(&k2).unwrap();
                let r = |sh: &[i32], k: &mx::Array| {
                    mx::astype(&mx::random_normal(sh, Dtype::Float32, k).unwrap(), dt).unwrap()
                };
                let q = r(&[b, h, lq, d], &k1);
                let k = r(&[b, kvh, lk, d], &k2);
                let v = r(&[b, kvh, lk, d], &k3);
                let scale = 1.0 / (d as f32).sqrt();
                let before = half_attention_calls();
                let marr = window.map(|w| crate::cache::causal_mask(lq, lk - lq, Some(w)).unwrap());
                let ours = host_half_attention(&q, &k, &v, marr.as_ref(), scale, causal)
                    .unwrap()
                    .expect("the op and the BLAS are here");
                assert_eq!(ours.shape(), q.shape());
                assert_eq!(ours.dtype(), dt);
                let mask = match (&marr, causal) {
                    (Some(m), _) => mx::AttnMask::Array(m),
                    (None, true) => mx::AttnMask::Causal,
                    (None, false) => mx::AttnMask::None,
                };
                let theirs = mx::scaled_dot_product_attention(&q, &k, &v, scale, mask, None).unwrap();
                let f = |a: &mx::Array| mx::astype(a, Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                let (o, t) = (f(&ours), f(&theirs));
                assert!(half_attention_calls() > before, "the op ran the kernel");
                // a probability or a score one rounding step apart moves an output by a few steps of
                // its own magnitude (outputs are averages of values of magnitude ~1)
                let step = if dt == Dtype::Bfloat16 { 2f32.powi(-7) } else { 2f32.powi(-10) };
                let worst = o.iter().zip(&t).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 8.0 * step, "{dt:?} {:?}: {worst}", (b, h, kvh, lq, lk, d, causal));
                let exact = o.iter().zip(&t).filter(|(a, b)| a == b).count();
                assert!(exact * 2 >= o.len(), "{dt:?}: only {exact} of {} outputs equal MLX's", o.len());
            }
            // a mask of another shape, or with causal, is refused
            let q = mx::astype(&mx::ones(&[1, 2, 4, 8], Dtype::Float32).unwrap(), Dtype::Bfloat16).unwrap();
            let kk = mx::astype(&mx::ones(&[1, 2, 6, 8], Dtype::Float32).unwrap(), Dtype::Bfloat16).unwrap();
            let bad = crate::cache::causal_mask(3, 3, None).unwrap();
            assert!(host_half_attention(&q, &kk, &kk, Some(&bad), 1.0, false).is_err(), "a [3, 6] mask for 4 queries");
            let good = crate::cache::causal_mask(4, 2, Some(3)).unwrap();
            assert!(host_half_attention(&q, &kk, &kk, Some(&good), 1.0, true).is_err(), "a mask with causal");
            assert!(host_half_attention(&q, &kk, &kk, Some(&good), 1.0, false).is_ok());
        })
    }
}
