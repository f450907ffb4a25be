//! What the host CPU kernels beside MLX share ([`super::q8`], [`super::f32mm`]): which x86 instruction
//! set to compile a kernel's copy for, and the walk that splits W's rows over threads and hands back
//! `[n, rows]` outputs.

/// The widest instruction set a kernel's copy is compiled for, as the CPU reports it at run time.
#[derive(Clone, Copy)]
pub(super) enum Isa {
    Generic,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// Threads mlxrs's own CPU loops beside MLX (the host kernels, GGUF dequantization) spread their work
/// over: the cores, at most 8.
pub fn host_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
}

pub(super) fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Generic
}

/// The `[n, rows]` row-major outputs of `kernel` over W's `rows`, on up to `threads` threads, each a
/// contiguous range of W's rows in multiples of `group` (the calling thread takes the first):
/// `kernel(r0, r1, y)` fills `y[(r - r0) * n + i]` for W's rows `r0..r1` and x's rows `i < n`.
pub(super) fn over_rows<K>(rows: usize, n: usize, threads: usize, group: usize, kernel: K) -> Vec<f32>
where
    K: Fn(usize, usize, &mut [f32]) + Sync,
{
    let mut out = vec![0f32; n * rows];
    if n == 0 || rows == 0 {
        return out;
    }
    // [rows, n] while computing (each thread owns a range of W's rows), transposed at the end
    let mut t = if n == 1 { Vec::new() } else { vec![0f32; n * rows] };
    let target: &mut [f32] = if n == 1 { &mut out } else { &mut t };
    let threads = threads.clamp(1, rows.div_ceil(group));
    let per = rows.div_ceil(threads).div_ceil(group) * group;
    let kernel = &kernel;
    std::thread::scope(|s| {
        let mut chunks = target.chunks_mut(per * n).enumerate();
        let first = chunks.next();
        for (ci, y) in chunks {
            let r0 = ci * per;
            let r1 = r0 + y.len() / n;
            s.spawn(move || kernel(r0, r1, y));
        }
        if let Some((_, y)) = first {
            kernel(0, y.len() / n, y);
        }
    });
    if n > 1 {
        for r in 0..rows {
            for i in 0..n {
                out[i * rows + r] = t[r * n + i];
            }
        }
    }
    out
}

/// Lanes of the kernels' per-row accumulators (one AVX-512 register, two AVX2 ones).
pub(super) const LANES: usize = 16;

/// An accumulator's `L` lanes (a power of two) summed pairwise: 16 → 8 → 4 → 2 → 1.
#[inline(always)]
pub(super) fn sum_lanes<const L: usize>(v: &[f32; L]) -> f32 {
    let mut v = *v;
    let mut width = L;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            v[j] += v[j + width];
        }
    }
    v[0]
}
