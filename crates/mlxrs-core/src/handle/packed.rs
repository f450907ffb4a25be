//! A host CPU kernel beside MLX for MLX's own affine quantization: `y = x · dequant(W)ᵀ` for W as MLX
//! stores a 4-bit or 8-bit quantized matrix — unsigned values packed little-endian into `uint32`
//! words (`[rows, cols · bits / 32]`: value `k` of a row in bits `bits · (k mod 32/bits)` of word
//! `k · bits / 32`), one scale and one bias per `group` values along the row, float32, bfloat16 or
//! float16: `dequant(W)[r, k] = s[r, k / group] · q[r, k] + b[r, k / group]`.
//!
//! MLX's CPU quantized matmul is far below memory bandwidth (an 8-bit model decoded at a fraction of
//! the float32 one's speed); this one streams the packed words once per call over the cores, reading
//! the model's own bytes (no copy, no second format in memory). It is [`super::blocks`]'s kernel with
//! unsigned values read in place: 8-bit values widen byte by byte; a byte of 4-bit values holds
//! values `2j` (low nibble) and `2j + 1` (high), so x is split once per call into its even and odd
//! values per chunk of two vectors ([`deinterleave`]) and each byte's nibbles meet their own halves —
//! the products are the same, summed in another order.
//!
//! The AVX-512 and AVX2 copies hold their accumulators in vector registers; the generic copy is the
//! reference and what other CPUs run. [`host_packed_matmul`] builds the product as one op of MLX's
//! graph (native/mlxrs_ext.cpp `HostPackedMatmul`).
use super::host::{add_bias, detect, over_rows, sum_lanes, walk_rows, Isa, QuantRows, LANES, ROW_GROUP};
use crate::error::{Error, Result};

/// Values of a group are a multiple of this: two AVX-512 registers of 4-bit values (one of bytes).
pub const PACKED_GROUP_STEP: usize = 32;

/// The scales' and biases' element type, as MLX stores them beside the packed values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleType {
    F32,
    Bf16,
    F16,
}

impl ScaleType {
    /// The code native/mlxrs_ext.cpp passes (`mlxrs_host_packed_args.sdtype`).
    fn from_code(c: i32) -> Option<ScaleType> {
        match c {
            0 => Some(ScaleType::F32),
            1 => Some(ScaleType::Bf16),
            2 => Some(ScaleType::F16),
            _ => None,
        }
    }
}

/// Scales (or biases) borrowed as MLX stores them.
#[derive(Clone, Copy)]
pub enum Scales<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl Scales<'_> {
    fn len(&self) -> usize {
        match self {
            Scales::F32(s) => s.len(),
            Scales::Bf16(s) | Scales::F16(s) => s.len(),
        }
    }

    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F32(s) => s[i],
            Scales::Bf16(s) => half::bf16::from_bits(s[i]).to_f32(),
            Scales::F16(s) => half::f16::from_bits(s[i]).to_f32(),
        }
    }
}

/// A `[rows, cols]` matrix as MLX's affine quantization packs it, borrowed.
#[derive(Clone, Copy)]
pub struct PackedRef<'a> {
    pub w: &'a [u32],
    pub s: Scales<'a>,
    pub b: Scales<'a>,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub bits: usize,
}

impl<'a> PackedRef<'a> {
    /// Checks the extents: 4 or 8 bits, `cols` whole groups, `group` a multiple of
    /// [`PACKED_GROUP_STEP`], `rows · cols · bits / 32` words and `rows · cols / group` scales and biases.
    pub fn new(
        w: &'a [u32],
        s: Scales<'a>,
        b: Scales<'a>,
        rows: usize,
        cols: usize,
        group: usize,
        bits: usize,
    ) -> Result<PackedRef<'a>> {
        if !matches!(bits, 4 | 8)
            || group == 0
            || !group.is_multiple_of(PACKED_GROUP_STEP)
            || cols == 0
            || !cols.is_multiple_of(group)
        {
            return Err(Error::Invalid(format!(
                "the packed kernel takes 4 or 8 bits in groups of a multiple of {PACKED_GROUP_STEP} values over whole \
                 groups of columns, not {bits} bits in groups of {group} over {cols} columns"
            )));
        }
        let groups = rows * (cols / group);
        if rows.checked_mul(cols).map(|v| v * bits / 32) != Some(w.len()) || s.len() != groups || b.len() != groups {
            return Err(Error::Invalid(format!(
                "a [{rows}, {cols}] {bits}-bit matrix in groups of {group} needs {} words and {groups} scales and \
                 biases, not {}, {} and {}",
                rows * cols * bits / 32,
                w.len(),
                s.len(),
                b.len()
            )));
        }
        Ok(PackedRef { w, s, b, rows, cols, group, bits })
    }

    /// The value `k` of row `r`, unsigned.
    fn value(&self, r: usize, k: usize) -> u32 {
        let per = 32 / self.bits;
        let word = self.w[(r * self.cols + k) / per];
        (word >> (self.bits * (k % per))) & ((1 << self.bits) - 1)
    }

    /// Row `r` dequantized: `s · q + b` in float32, value by value.
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let ng = self.cols / self.group;
        (0..self.cols)
            .map(|k| {
                let g = r * ng + k / self.group;
                self.value(r, k) as f32 * self.s.get(g) + self.b.get(g)
            })
            .collect()
    }

    /// `x · dequant(W)ᵀ` for `x` `[n, cols]` row-major into `y` `[n, rows]` row-major, on up to
    /// `threads` threads (each a contiguous range of W's rows). Equal to the float32 product with the
    /// dequantized matrix up to float32 rounding and summation order.
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
        let (cols, group, bits) = (self.cols, self.group, self.bits);
        let n = x.len() / cols;
        let ng = cols / group;
        // each x row's group sums, for the bias term: Σ_g b[r, g] · Σ_{k ∈ g} x[i, k]
        let xs: Vec<f32> = x.chunks_exact(group).map(|c| c.iter().sum()).collect();
        // 4-bit: x's even and odd values per chunk of two of the copy's vectors
        let xd = match (bits, isa) {
            (4, Isa::Generic) => Vec::new(),
            #[cfg(target_arch = "x86_64")]
            (4, Isa::Avx2) => deinterleave(x, 8),
            #[cfg(target_arch = "x86_64")]
            (4, Isa::Avx512) => deinterleave(x, 16),
            _ => Vec::new(),
        };
        let words = cols * bits / 32;
        over_rows(self.rows, n, threads, ROW_GROUP, out, |r0, r1, y| {
            let part = PackedRef {
                w: &self.w[r0 * words..r1 * words],
                s: slice_scales(self.s, r0 * ng, r1 * ng),
                b: slice_scales(self.b, r0 * ng, r1 * ng),
                rows: r1 - r0,
                cols,
                group,
                bits,
            };
            let xv = if xd.is_empty() { x } else { &xd };
            run(isa, &part, xv, &xs, n, y)
        });
    }
}

fn slice_scales(s: Scales<'_>, a: usize, b: usize) -> Scales<'_> {
    match s {
        Scales::F32(v) => Scales::F32(&v[a..b]),
        Scales::Bf16(v) => Scales::Bf16(&v[a..b]),
        Scales::F16(v) => Scales::F16(&v[a..b]),
    }
}

/// x with each chunk of `2 · lanes` values as its `lanes` even values, then its `lanes` odd ones:
/// the order a vector of `lanes` bytes of 4-bit values widens to (low nibbles, then high nibbles).
fn deinterleave(x: &[f32], lanes: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(2 * lanes).zip(out.chunks_exact_mut(2 * lanes)) {
        for j in 0..lanes {
            dst[j] = src[2 * j];
            dst[lanes + j] = src[2 * j + 1];
        }
    }
    out
}

impl QuantRows for PackedRef<'_> {
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
        self.bits
    }
    fn bytes(&self) -> *const u8 {
        self.w.as_ptr() as *const u8
    }
    #[inline(always)]
    fn scale(&self, i: usize) -> f32 {
        self.s.get(i)
    }
}

/// `y[r * n + i] = Σ_k x[i, k] · dequant(W)[r, k]` for the rows `r` of `w` (one thread's range).
fn run(isa: Isa, w: &PackedRef, x: &[f32], xs: &[f32], n: usize, y: &mut [f32]) {
    match isa {
        Isa::Generic => rows_generic(w, x, n, y),
        // SAFETY: `detect` found these instruction sets on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { rows_avx2(w, x, n, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { rows_avx512(w, x, n, y) },
    }
    let ng = w.cols / w.group;
    add_bias(w.rows, ng, xs, n, y, |r, out| {
        for (g, o) in out.iter_mut().enumerate() {
            *o = w.b.get(r * ng + g);
        }
    });
}

/// The generic copy: per row and group the products of the unpacked values with x in [`LANES`]
/// lanes, times the group's scale into the row's lanes; the lanes summed at the end.
fn rows_generic(w: &PackedRef, x: &[f32], n: usize, y: &mut [f32]) {
    let (cols, group) = (w.cols, w.group);
    let ng = cols / group;
    for r in 0..w.rows {
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [0f32; LANES];
            for blk in 0..ng {
                let mut p = [0f32; LANES];
                for c in (blk * group..(blk + 1) * group).step_by(LANES) {
                    for j in 0..LANES {
                        p[j] += w.value(r, c + j) as f32 * xi[c + j];
                    }
                }
                let s = w.s.get(r * ng + blk);
                for j in 0..LANES {
                    acc[j] += s * p[j];
                }
            }
            y[r * n + i] = sum_lanes(&acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_avx512(w: &PackedRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX-512
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        match (r4, w.bits) {
            (true, 8) => block8_avx512::<ROW_GROUP>(w, x, n, r, y),
            (false, 8) => block8_avx512::<1>(w, x, n, r, y),
            (true, _) => block4_avx512::<ROW_GROUP>(w, x, n, r, y),
            (false, _) => block4_avx512::<1>(w, x, n, r, y),
        }
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_avx2(w: &PackedRef, x: &[f32], n: usize, y: &mut [f32]) {
    // SAFETY (each call): this function runs only where `detect` found AVX2 and FMA
    walk_rows(w, x, n, y, |r4, r, y| unsafe {
        match (r4, w.bits) {
            (true, 8) => block8_avx2::<ROW_GROUP>(w, x, n, r, y),
            (false, 8) => block8_avx2::<1>(w, x, n, r, y),
            (true, _) => block4_avx2::<ROW_GROUP>(w, x, n, r, y),
            (false, _) => block4_avx2::<1>(w, x, n, r, y),
        }
    })
}

super::host::x86_quant_block!(
    avx512,
    block8_avx512,
    PackedRef,
    16,
    |xp, c| {
        // SAFETY: 16 values of x's row
        unsafe { _mm512_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 16 bytes of the row
        let v = unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(q as *const __m128i))) };
        *acc = _mm512_fmadd_ps(v, xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx512,
    block4_avx512,
    PackedRef,
    32,
    |xp, c| {
        // SAFETY: 32 values of x's row (deinterleaved: evens, then odds)
        unsafe { (_mm512_loadu_ps(xp.add(c)), _mm512_loadu_ps(xp.add(c + 16))) }
    },
    |q, xv, acc| {
        // SAFETY: 16 bytes (32 values) of the row
        let b = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(q as *const __m128i)) };
        let lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
        let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(b));
        *acc = _mm512_fmadd_ps(lo, xv.0, *acc);
        *acc = _mm512_fmadd_ps(hi, xv.1, *acc);
    }
);
super::host::x86_quant_block!(
    avx2,
    block8_avx2,
    PackedRef,
    8,
    |xp, c| {
        // SAFETY: 8 values of x's row
        unsafe { _mm256_loadu_ps(xp.add(c)) }
    },
    |q, xv, acc| {
        // SAFETY: 8 bytes of the row
        let v = unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i))) };
        *acc = _mm256_fmadd_ps(v, xv, *acc);
    }
);
super::host::x86_quant_block!(
    avx2,
    block4_avx2,
    PackedRef,
    16,
    |xp, c| {
        // SAFETY: 16 values of x's row (deinterleaved: evens, then odds)
        unsafe { (_mm256_loadu_ps(xp.add(c)), _mm256_loadu_ps(xp.add(c + 8))) }
    },
    |q, xv, acc| {
        // SAFETY: 8 bytes (16 values) of the row
        let b = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i)) };
        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
        *acc = _mm256_fmadd_ps(lo, xv.0, *acc);
        *acc = _mm256_fmadd_ps(hi, xv.1, *acc);
    }
);

static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products the op of [`host_packed_matmul`] has computed in this process (tests and
/// benchmarks check the path ran).
pub fn packed_matmul_calls() -> u64 {
    CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The kernel MLX's CPU thread calls for [`host_packed_matmul`]'s op (native/mlxrs_ext.cpp
/// `HostPackedMatmul`).
///
/// # Safety
/// `args` points at a [`mlxrs_sys::HostPackedArgs`] whose `w` points at `rows · cols · bits / 32`
/// words, `s` and `b` at `rows · cols / group` values of the type `sdtype` names, `x` at `n · cols` and
/// `y` at `n · rows` float32 values, `y` not overlapping the others: the primitive passes its inputs'
/// and its fresh output's buffers after checking their shapes.
unsafe extern "C" fn graph_kernel(args: *const mlxrs_sys::HostPackedArgs) {
    // SAFETY: the caller's contract
    let mlxrs_sys::HostPackedArgs { w, s, b, sdtype, bits, rows, cols, group, x, n, y } =
        unsafe { std::ptr::read(args) };
    CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if rows == 0 || cols == 0 || n == 0 || group == 0 {
        return;
    }
    // SAFETY: y holds n · rows values (the caller's contract)
    let y = unsafe { std::slice::from_raw_parts_mut(y, n * rows) };
    let (Some(st), Ok(bits)) = (ScaleType::from_code(sdtype), usize::try_from(bits)) else {
        y.fill(f32::NAN);
        return;
    };
    let groups = rows * (cols / group);
    let scales = |p: *const std::ffi::c_void| -> Scales<'_> {
        // SAFETY: `groups` values of type `st` (the caller's contract)
        unsafe {
            match st {
                ScaleType::F32 => Scales::F32(std::slice::from_raw_parts(p as *const f32, groups)),
                ScaleType::Bf16 => Scales::Bf16(std::slice::from_raw_parts(p as *const u16, groups)),
                ScaleType::F16 => Scales::F16(std::slice::from_raw_parts(p as *const u16, groups)),
            }
        }
    };
    // SAFETY: the extents above (the caller's contract)
    let (wv, x) =
        unsafe { (std::slice::from_raw_parts(w, rows * cols * bits / 32), std::slice::from_raw_parts(x, n * cols)) };
    let Ok(m) = PackedRef::new(wv, scales(s), scales(b), rows, cols, group, bits) else {
        // the shapes were checked when the op was built: unreachable, but never leave y unwritten
        y.fill(f32::NAN);
        return;
    };
    super::host::into_mlx_output(y, f32::NAN, |threads, y| m.matvec_into(x, threads, y));
}

/// `x · dequant(W)ᵀ` for float32 `x [..., cols]` and W as MLX's affine quantization stores it (`w`
/// uint32 `[rows, cols · bits / 32]`, `scales` and `biases` `[rows, cols / group]` float32, bfloat16 or
/// float16, bits 4 or 8, group a multiple of 32) as one op of MLX's graph on the current stream (a CPU
/// stream), computed by [`PackedRef::matvec_into`] when MLX evaluates it. None where the loaded libmlxc
/// lacks the entry point (one not built by native/).
pub fn host_packed_matmul(
    x: &super::Array,
    w: &super::Array,
    scales: &super::Array,
    biases: &super::Array,
    bits: i32,
) -> Result<Option<super::Array>> {
    let Some(f) = mlxrs_sys::extra().mlxrs_host_packed_matmul else { return Ok(None) };
    super::ops::count_op();
    let mut r = super::Array::empty_raw();
    // SAFETY: mlx-c's calling convention (handles in, the result through the pointer); the kernel's
    // contract is kept by the primitive (shapes and dtypes checked, inputs made row-contiguous, a
    // fresh output)
    let rc = unsafe { f(&mut r, x.0, w.0, scales.0, biases.0, bits, graph_kernel, super::runtime::current_stream()) };
    let a = super::Array::from_raw(r);
    super::check(rc)?;
    Ok(Some(a))
}

#[cfg(test)]
mod tests {
    use super::super::host::testing::{isas, lcg};
    use super::*;

    /// Random packed words, bfloat16-exact scales and biases (as f32 and as bf16 bits), and x.
    fn random(
        rows: usize,
        cols: usize,
        group: usize,
        bits: usize,
        n: usize,
        seed: u64,
    ) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut s = seed;
        let w: Vec<u32> = (0..rows * cols * bits / 32).map(|_| lcg(&mut s) ^ (lcg(&mut s) << 16)).collect();
        let ng = rows * cols / group;
        let mut v = || half::bf16::from_f32((lcg(&mut s) % 1000) as f32 / 1e5 - 0.004).to_f32();
        let sc: Vec<f32> = (0..ng).map(|_| v()).collect();
        let bi: Vec<f32> = (0..ng).map(|_| v() * -8.0).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0).collect();
        (w, sc, bi, x)
    }

    fn naive(m: &PackedRef, x: &[f32]) -> Vec<f64> {
        super::super::host::testing::naive(m.rows, m.cols, x, |r| m.dequant_row(r))
    }

    /// MLX's packing, value by value: value k of a row in bits `bits · (k mod 32/bits)` of its word.
    #[test]
    fn values_are_read_as_mlx_packs_them() {
        let w = [0x7654_3210u32, 0xfedc_ba98];
        let (s, b) = ([1f32; 1], [0f32; 1]);
        let m = PackedRef::new(&w, Scales::F32(&s), Scales::F32(&b), 1, 32, 32, 4);
        assert!(m.is_err(), "32 4-bit values need 4 words");
        let w4: Vec<u32> = [w[0], w[1], w[0], w[1]].to_vec();
        let m = PackedRef::new(&w4, Scales::F32(&s), Scales::F32(&b), 1, 32, 32, 4).unwrap();
        assert_eq!((0..16).map(|k| m.value(0, k)).collect::<Vec<_>>(), (0..16).collect::<Vec<_>>());
        let w8: Vec<u32> = (0..8u32)
            .map(|i| u32::from_le_bytes([4 * i as u8, 4 * i as u8 + 1, 4 * i as u8 + 2, 4 * i as u8 + 3]))
            .collect();
        let m = PackedRef::new(&w8, Scales::F32(&s), Scales::F32(&b), 1, 32, 32, 8).unwrap();
        assert_eq!((0..32).map(|k| m.value(0, k)).collect::<Vec<_>>(), (0..32).collect::<Vec<_>>());
        assert_eq!(m.dequant_row(0)[5], 5.0);
    }

    #[test]
    fn matvec_equals_dequantize_then_matmul() {
        for (rows, cols, group, bits, n, threads) in [
            (37, 64, 32, 4, 1, 2),
            (101, 640, 64, 4, 1, 3),
            (9, 128, 32, 8, 3, 2),
            (1, 96, 32, 8, 2, 4),
            (64, 256, 128, 4, 1, 1),
            (7, 256, 64, 8, 5, 2),
            (13, 512, 64, 4, 8, 2),
        ] {
            let (w, s, b, x) = random(rows, cols, group, bits, n, (rows * cols + n + group + bits) as u64);
            let sb: Vec<u16> = s.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let bb: Vec<u16> = b.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let sh: Vec<u16> = s.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
            let bh: Vec<u16> = b.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
            let f32m = PackedRef::new(&w, Scales::F32(&s), Scales::F32(&b), rows, cols, group, bits).unwrap();
            let want = naive(&f32m, &x);
            let scale = want.iter().map(|v| v.abs()).fold(1.0, f64::max);
            let bound = 1e-5 * (cols as f64).sqrt() * scale;
            for (sname, m) in [
                ("f32", f32m),
                ("bf16", PackedRef::new(&w, Scales::Bf16(&sb), Scales::Bf16(&bb), rows, cols, group, bits).unwrap()),
                ("f16", PackedRef::new(&w, Scales::F16(&sh), Scales::F16(&bh), rows, cols, group, bits).unwrap()),
            ] {
                // f16 rounds the (bfloat16-exact) scales: its own reference
                let want = if sname == "f16" { naive(&m, &x) } else { want.clone() };
                for (name, isa) in isas() {
                    let mut got = vec![0f32; want.len()];
                    m.matvec_with(isa, &x, threads, &mut got);
                    for (k, (g, wv)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (*g as f64 - wv).abs() <= bound,
                            "{name}/{sname} [{rows}x{cols}/{group}, {bits} bits, n {n}] output {k}: {g} vs {wv}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let w = vec![0u32; 16];
        let s = [1f32; 4];
        let f = |w: &[u32], s: &[f32], rows, cols, group, bits| {
            PackedRef::new(w, Scales::F32(s), Scales::F32(s), rows, cols, group, bits).is_err()
        };
        assert!(f(&w[..12], &s[..2], 1, 128, 64, 3), "3 bits");
        assert!(f(&w, &s[..1], 1, 64, 64, 16), "16 bits");
        assert!(f(&w, &s, 1, 128, 16, 4), "groups of 16");
        assert!(f(&w[..15], &s[..2], 1, 128, 64, 4), "too few words");
        assert!(f(&w, &s[..1], 1, 128, 64, 4), "too few scales");
        assert!(!f(&w[..8], &s[..2], 1, 64, 32, 4));
        let m = PackedRef::new(&w[..8], Scales::F32(&s[..2]), Scales::F32(&s[..2]), 1, 64, 32, 4).unwrap();
        let mut y = [0f32; 1];
        assert!(m.matvec_into(&[0.0; 63], 1, &mut y).is_err());
        m.matvec_into(&[1.0; 64], 2, &mut y).unwrap();
        assert_eq!(y[0], 64.0, "values 0, scale 1, bias 1 over 64 ones");
    }

    /// The kernel as an op of MLX's graph ([`host_packed_matmul`]) against MLX's own
    /// `quantized_matmul` of the same packed weights (MLX's `quantize` of a random matrix), on a CPU
    /// stream: 1 to 8 rows with batch axes, x as a transposed view, 4 and 8 bits, groups of 32, 64 and
    /// 128, float32 and bfloat16 scales; bad inputs refused.
    #[test]
    fn graph_op_equals_mlx_quantized_matmul() {
        use crate::handle as mx;
        let cpu = mx::Stream::new(&mx::Device::new(mx::DeviceKind::Cpu, 0).unwrap()).unwrap();
        mx::with_stream(&cpu, || {
            for (n, rows, cols, group, bits, dt) in [
                (1, 37, 64, 32, 4, mx::Dtype::Float32),
                (3, 300, 640, 64, 4, mx::Dtype::Bfloat16),
                (8, 64, 256, 128, 8, mx::Dtype::Float32),
                (2, 96, 512, 64, 8, mx::Dtype::Bfloat16),
                (1, 24, 128, 32, 4, mx::Dtype::Float16),
            ] {
                let key = mx::random_key((rows + cols + bits) as u64).unwrap();
                let wf = mx::astype(&mx::random_normal(&[rows, cols], mx::Dtype::Float32, &key).unwrap(), dt).unwrap();
                let (wq, s, b) = mx::quantize(&wf, group, bits).unwrap();
                let key = mx::random_key(n as u64).unwrap();
                let x = mx::random_normal(&[1, n, cols], mx::Dtype::Float32, &key).unwrap();
                let xt =
                    mx::swapaxes(&mx::random_normal(&[1, cols, n], mx::Dtype::Float32, &key).unwrap(), 1, 2).unwrap();
                for x in [x, xt] {
                    let ours = host_packed_matmul(&x, &wq, &s, &b, bits)
                        .unwrap()
                        .expect("the libmlxc built by native/ has the op");
                    assert_eq!(ours.shape(), vec![1, n, rows]);
                    // MLX's reference in float32: its dequantization with the scales and biases
                    // in float32 (exact: no rounding of the values to the scales' type), then matmul
                    let f = |a: &mx::Array| mx::astype(a, mx::Dtype::Float32).unwrap();
                    let wd = mx::dequantize(&wq, &f(&s), Some(&f(&b)), group, bits, mx::QuantMode::Affine).unwrap();
                    let theirs = mx::matmul(&x, &mx::transpose(&wd).unwrap()).unwrap();
                    let max_abs = |a: &mx::Array| {
                        mx::max(&mx::reshape(&mx::abs(a).unwrap(), &[-1]).unwrap(), &[0], false)
                            .unwrap()
                            .item_f32()
                            .unwrap()
                    };
                    let d = max_abs(&mx::subtract(&ours, &theirs).unwrap());
                    assert!(
                        d <= 1e-5 * max_abs(&theirs).max(1.0),
                        "[{n} x {cols}] · {bits}-bit [{rows} x {cols}/{group}]ᵀ {dt:?}: {d}"
                    );
                }
            }
            let key = mx::random_key(7).unwrap();
            let wf = mx::random_normal(&[8, 64], mx::Dtype::Float32, &key).unwrap();
            let (wq, s, b) = mx::quantize(&wf, 32, 4).unwrap();
            let x = mx::random_normal(&[1, 64], mx::Dtype::Float32, &key).unwrap();
            assert!(host_packed_matmul(&x, &wq, &s, &b, 8).is_err(), "bits that do not fit the words are refused");
            let xb = mx::astype(&x, mx::Dtype::Bfloat16).unwrap();
            assert!(host_packed_matmul(&xb, &wq, &s, &b, 4).is_err(), "bfloat16 x is refused");
            let x32 = mx::random_normal(&[1, 32], mx::Dtype::Float32, &key).unwrap();
            assert!(host_packed_matmul(&x32, &wq, &s, &b, 4).is_err(), "x of another width is refused");
            let (w3, s3, b3) = mx::quantize(&wf, 32, 3).unwrap();
            assert!(host_packed_matmul(&x, &w3, &s3, &b3, 3).is_err(), "3 bits are refused");
        });
    }
}
