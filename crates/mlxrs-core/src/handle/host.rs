//! What the host CPU kernels beside MLX share ([`super::blocks`], [`super::packed`], [`super::half`],
//! [`super::f32mm`]):
//! which x86 instruction set to compile a kernel's copy for, the walk that splits W's rows over
//! threads and hands back `[n, rows]` outputs, and the quantized kernels' row walk, bias term and x86
//! block ([`QuantRows`], [`x86_quant_block`]).

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
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
    }
    Isa::Generic
}

/// The `[n, rows]` row-major outputs of `kernel` over W's `rows` into `out` (`n · rows` values: the
/// caller's buffer, MLX's output for the ops), on up to `threads` threads, each a contiguous range of
/// W's rows in multiples of `group` (the calling thread takes the first): `kernel(r0, r1, y)` fills
/// `y[(r - r0) * n + i]` for W's rows `r0..r1` and x's rows `i < n`.
pub(super) fn over_rows<K>(rows: usize, n: usize, threads: usize, group: usize, out: &mut [f32], kernel: K)
where
    K: Fn(usize, usize, &mut [f32]) + Sync,
{
    assert_eq!(out.len(), n * rows, "over_rows: an output of {} values for [{n}, {rows}]", out.len());
    if n == 0 || rows == 0 {
        return;
    }
    // [rows, n] while computing (each thread owns a range of W's rows), transposed at the end
    let mut t = if n == 1 { Vec::new() } else { vec![0f32; n * rows] };
    let target: &mut [f32] = if n == 1 { &mut *out } else { &mut t };
    let threads = threads.clamp(1, rows.div_ceil(group));
    let per = rows.div_ceil(threads).div_ceil(group) * group;
    // each part's slice of the output, filled by the part that takes it
    par_chunks_mut(target, per * n, &|start, y| {
        let r0 = start / n;
        kernel(r0, r0 + y.len() / n, y);
    });
    if n > 1 {
        for r in 0..rows {
            for i in 0..n {
                out[i * rows + r] = t[r * n + i];
            }
        }
    }
}

/// `f(start, chunk)` for each `chunk`-long run of `data` (the last may be shorter; `start` its first
/// index), one run a part of a [`split`].
pub(super) fn par_chunks_mut<T: Send>(data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let chunk = chunk.max(1);
    // each run, taken once by the part that fills it
    let parts: Vec<std::sync::Mutex<Option<&mut [T]>>> =
        data.chunks_mut(chunk).map(|c| std::sync::Mutex::new(Some(c))).collect();
    split(parts.len(), &|i| {
        if let Some(c) = parts[i].lock().unwrap_or_else(|e| e.into_inner()).take() {
            f(i * chunk, c);
        }
    });
}

/// A graph kernel's output `run(threads, y)` straight into MLX's output `y`, on [`host_threads`]
/// threads. A panic must not unwind into MLX's C++ (it would abort the process): the only one possible
/// is the OS refusing a thread, and then the kernel runs again on this thread alone (every output is
/// written from the inputs alone); an error leaves `nan`, never unwritten memory.
pub(super) fn into_mlx_output<T: Copy>(y: &mut [T], nan: T, run: impl Fn(usize, &mut [T]) -> crate::error::Result<()>) {
    let threads = host_threads();
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(threads, &mut *y)))
        .unwrap_or_else(|_| run(1, &mut *y));
    if done.is_err() {
        y.fill(nan);
    }
}

/// W's rows a quantized kernel's thread takes at a time are multiples of this (four rows interleaved
/// per pass).
pub(super) const ROW_GROUP: usize = 4;

/// How far ahead of the rows being read (in W's rows) the quantized kernels' x86 copies ask for W's
/// next lines: the hardware prefetcher alone left the blocks kernel at ~10 GB/s on 2 threads (four
/// interleaved row streams); 16 rows ahead 14.7, 48 rows 16.7, 128 rows 15.6 GB/s (262144 × 640,
/// crates/mlxrs-core/examples/blocks_timing.rs).
pub(super) const PREFETCH_ROWS: usize = 48;

/// A quantized matrix as the x86 copies of [`x86_quant_block`] read it: `rows` rows of `cols` values
/// of `bits` bits each, row-major in one run of bytes, one scale per `group` values.
pub(super) trait QuantRows {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn group(&self) -> usize;
    /// Bits a value takes in a row's bytes.
    fn bits(&self) -> usize;
    /// The first row's first byte.
    fn bytes(&self) -> *const u8;
    /// Scale `i` (row `i / (cols / group)`, group `i % (cols / group)`) as float32.
    fn scale(&self, i: usize) -> f32;
}

/// W's rows [`ROW_GROUP`] at a time (`block(true, r, y)`), then one at a time (`block(false, r, y)`),
/// after checking what the x86 copies read through raw pointers beyond W's own extents (which its
/// constructor checked): x's `n` rows and y's `rows · n` values.
#[inline(always)]
pub(super) fn walk_rows<W: QuantRows>(
    w: &W,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    mut block: impl FnMut(bool, usize, &mut [f32]),
) {
    assert!(x.len() >= n * w.cols() && y.len() >= w.rows() * n, "quantized kernel out of range");
    let mut r = 0;
    while r + ROW_GROUP <= w.rows() {
        block(true, r, y);
        r += ROW_GROUP;
    }
    while r < w.rows() {
        block(false, r, y);
        r += 1;
    }
}

/// Adds each row's bias term to the products in `y` (`[rows, n]`): `Σ_g b[r, g] · xs[i, g]`, `xs`
/// holding each x row's `ng` group sums (`Σ_{k ∈ g} x[i, k]`) and `row_bias(r, b)` writing row r's `ng`
/// biases into `b` (as float32: a contiguous run the sums vectorize over).
pub(super) fn add_bias(
    rows: usize,
    ng: usize,
    xs: &[f32],
    n: usize,
    y: &mut [f32],
    row_bias: impl Fn(usize, &mut [f32]),
) {
    let mut br = vec![0f32; ng];
    for r in 0..rows {
        row_bias(r, &mut br);
        for i in 0..n {
            let xi = &xs[i * ng..(i + 1) * ng];
            y[r * n + i] += br.iter().zip(xi).map(|(a, c)| a * c).sum::<f32>();
        }
    }
}

/// One x86 copy of a quantized kernel for a matrix type `$m` implementing [`QuantRows`]: W's rows
/// `r..r + R` against every row of x; per group the products of each row in a vector (R in
/// registers), times the group's scale into the row's accumulator; the lanes summed pairwise at the
/// end. A step takes `$values` values of a row (`$values · bits / 8` bytes): `$x` loads the step's
/// values of x once for the R rows (`$xp` x's row, `$c` the step's first column in it) and `$step`
/// adds row k's products into `*$acc` (`$q` the step's first byte of the row, `$xv` what `$x` loaded).
/// `avx512` and `avx2` name the instruction set (its features, lanes and intrinsics).
macro_rules! x86_quant_block {
    (avx512, $name:ident, $m:ty, $values:expr, |$xp:ident, $c:ident| $x:block, |$q:ident, $xv:ident, $acc:ident| $step:block) => {
        super::host::x86_quant_block!(
            $name,
            $m,
            "avx512f,avx512bw,avx512vl,avx2,fma",
            16,
            $values,
            _mm512_setzero_ps,
            _mm512_fmadd_ps,
            _mm512_set1_ps,
            _mm512_storeu_ps,
            |$xp, $c| $x,
            |$q, $xv, $acc| $step
        );
    };
    (avx2, $name:ident, $m:ty, $values:expr, |$xp:ident, $c:ident| $x:block, |$q:ident, $xv:ident, $acc:ident| $step:block) => {
        super::host::x86_quant_block!(
            $name,
            $m,
            "avx2,fma,f16c",
            8,
            $values,
            _mm256_setzero_ps,
            _mm256_fmadd_ps,
            _mm256_set1_ps,
            _mm256_storeu_ps,
            |$xp, $c| $x,
            |$q, $xv, $acc| $step
        );
    };
    ($name:ident, $m:ty, $feat:literal, $lanes:literal, $values:expr, $zero:ident, $fma:ident, $set1:ident,
     $store:ident, |$xp:ident, $c:ident| $x:block, |$q:ident, $xv:ident, $acc:ident| $step:block) => {
        /// W's rows `r..r + R` against every row of x ([`super::host::x86_quant_block`]).
        ///
        /// # Safety
        /// The CPU has the instruction set of `$feat`; `r + R <= w.rows()`, x holds `n` rows (as the
        /// step reads them) and y `w.rows() · n` values (checked by [`super::host::walk_rows`]).
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const R: usize>(w: &$m, x: &[f32], n: usize, r: usize, y: &mut [f32]) {
            use super::host::{QuantRows as _, PREFETCH_ROWS};
            #[allow(unused_imports)]
            use std::arch::x86_64::*;
            let (cols, group, bits) = (w.cols(), w.group(), w.bits());
            let ng = cols / group;
            let row_bytes = cols * bits / 8;
            let (wp, xp0) = (w.bytes(), x.as_ptr());
            for i in 0..n {
                // SAFETY: i < n rows of x
                let $xp = unsafe { xp0.add(i * cols) };
                let mut acc = [$zero(); R];
                for blk in 0..ng {
                    let mut p = [$zero(); R];
                    for h in 0..group / $values {
                        let $c = blk * group + h * $values;
                        // once per 64 bytes of the rows' columns, on the first x row
                        let fetch = i == 0 && ($c * bits / 8) % 64 < $values * bits / 8;
                        let $xv = $x;
                        for k in 0..R {
                            let off = (r + k) * row_bytes + $c * bits / 8;
                            if fetch {
                                // the rows PREFETCH_ROWS ahead (a hint: an address past W faults nothing)
                                _mm_prefetch(
                                    wp.wrapping_add(off + PREFETCH_ROWS * row_bytes) as *const i8,
                                    _MM_HINT_T0,
                                );
                            }
                            // SAFETY: row r + k < rows, the step's bytes inside the row
                            let $q = unsafe { wp.add(off) };
                            let $acc = &mut p[k];
                            $step
                        }
                    }
                    for k in 0..R {
                        let s = $set1(w.scale((r + k) * ng + blk));
                        acc[k] = $fma(s, p[k], acc[k]);
                    }
                }
                for k in 0..R {
                    let mut lanes = [0f32; $lanes];
                    // SAFETY: `lanes` holds one vector
                    unsafe { $store(lanes.as_mut_ptr(), acc[k]) };
                    y[(r + k) * n + i] = super::host::sum_lanes(&lanes);
                }
            }
        }
    };
}
pub(super) use x86_quant_block;

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

/// `part(0)` … `part(count - 1)`, each once, `part(0)` on the calling thread and the others on the
/// parked workers of [`Workers`] (started once per process, `host_threads() - 1` of them); returns when
/// every part has. While another thread holds the workers (two kernels at once), or where the OS gave
/// none, the parts run on threads of their own (spawned and joined here), as they all did before: a
/// spawn and join costs 50 µs on a 2-core VM, ~40 kernel calls a decode step.
pub(super) fn split(count: usize, part: &(dyn Fn(usize) + Sync)) {
    if count <= 1 {
        if count == 1 {
            part(0);
        }
        return;
    }
    let pool = std::env::var("MLXRS_HOST_POOL").as_deref() != Ok("0");
    // a forked child has the pool's state but not its threads
    if let Some(w) = Workers::get().filter(|w| pool && count <= w.n + 1 && w.pid == std::process::id()) {
        if w.run(count, part) {
            return;
        }
    }
    std::thread::scope(|s| {
        for ci in 1..count {
            s.spawn(move || part(ci));
        }
        part(0);
    });
}

/// Calls of [`parallel_for`] so far (the tests check the primitives reach it).
#[cfg(test)]
pub(crate) static PARALLEL_FOR_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`split`] for native/mlxrs_ext.cpp's CPU primitives (registered at load through
/// `mlxrs_set_parallel_for`): `body` over ranges of `0..items` at least `grain` long, one per part, on
/// the same threads as mlxrs's host kernels. The body (C++) catches its own exceptions and may run a
/// range again (it writes each output once, from its inputs alone): if the OS refuses the fallback's
/// threads, every range runs again on this thread, rather than unwinding into MLX.
pub(super) unsafe extern "C" fn parallel_for(
    items: i64,
    grain: i64,
    body: mlxrs_sys::RangeBody,
    ctx: *mut std::ffi::c_void,
) {
    struct Ctx(*mut std::ffi::c_void);
    // SAFETY: the C++ caller's context is read by every range at once, as its body expects
    unsafe impl Sync for Ctx {}
    impl Ctx {
        fn get(&self) -> *mut std::ffi::c_void {
            self.0
        }
    }
    #[cfg(test)]
    PARALLEL_FOR_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ctx = Ctx(ctx);
    let items = usize::try_from(items).unwrap_or(0);
    let grain = usize::try_from(grain).unwrap_or(1).max(1);
    let parts = host_threads().min(items / grain).max(1);
    let per = items.div_ceil(parts);
    let run = |p: usize| {
        let (a, b) = (p * per, ((p + 1) * per).min(items));
        if a < b {
            // SAFETY: the caller's body and context, called with a range inside 0..items
            unsafe { body(ctx.get(), a as i64, b as i64) };
        }
    };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| split(parts, &run))).is_err() {
        (0..parts).for_each(run);
    }
}

/// Threads parked between host kernel calls (a futex wait, no spinning: MLX's thread and the engine's
/// run beside them), handed one split at a time.
struct Workers {
    n: usize,
    /// the process that started the threads
    pid: u32,
    busy: std::sync::atomic::AtomicBool,
    state: std::sync::Mutex<Job>,
    wake: std::sync::Condvar,
    done: std::sync::Condvar,
}

struct Job {
    epoch: u64,
    /// the split in progress; its borrow outlives the job: [`Workers::run`] clears it before returning
    part: Option<&'static (dyn Fn(usize) + Sync)>,
    count: usize,
    pending: usize,
    panicked: bool,
}

impl Workers {
    fn get() -> Option<&'static Workers> {
        static WORKERS: std::sync::OnceLock<Option<&'static Workers>> = std::sync::OnceLock::new();
        *WORKERS.get_or_init(|| {
            let n = host_threads().saturating_sub(1);
            if n == 0 {
                return None;
            }
            let w: &'static Workers = Box::leak(Box::new(Workers {
                n,
                pid: std::process::id(),
                busy: std::sync::atomic::AtomicBool::new(false),
                state: std::sync::Mutex::new(Job { epoch: 0, part: None, count: 0, pending: 0, panicked: false }),
                wake: std::sync::Condvar::new(),
                done: std::sync::Condvar::new(),
            }));
            for i in 0..n {
                let spawned = std::thread::Builder::new()
                    .name(format!("mlxrs-host-{i}"))
                    .stack_size(256 << 10)
                    .spawn(move || w.work(i + 1));
                if spawned.is_err() {
                    // a worker that never started would leave a split waiting for it forever
                    return None;
                }
            }
            Some(w)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Job> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Worker `index`'s loop: each new job's part `index`, if the job has one.
    fn work(&self, index: usize) {
        let mut seen = 0;
        let mut job = self.lock();
        loop {
            while job.epoch == seen {
                job = self.wake.wait(job).unwrap_or_else(|e| e.into_inner());
            }
            seen = job.epoch;
            if index >= job.count {
                continue;
            }
            let Some(part) = job.part else { continue };
            drop(job);
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| part(index))).is_ok();
            job = self.lock();
            job.panicked |= !ok;
            job.pending -= 1;
            if job.pending == 0 {
                self.done.notify_one();
            }
        }
    }

    /// The split on the workers; false (nothing run) while another thread's split holds them.
    fn run(&self, count: usize, part: &(dyn Fn(usize) + Sync)) -> bool {
        use std::sync::atomic::Ordering;
        if self.busy.swap(true, Ordering::Acquire) {
            return false;
        }
        // SAFETY: the workers call `part` only while `job.part` holds it, and this function clears it
        // after every worker's call has returned (`pending` back at 0), before `part`'s borrow ends,
        // also when a part panics (caught on both sides, then re-raised here)
        let part_static: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(part) };
        {
            let mut job = self.lock();
            job.epoch += 1;
            job.part = Some(part_static);
            job.count = count;
            job.pending = count - 1;
            job.panicked = false;
        }
        self.wake.notify_all();
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| part(0)));
        let panicked = {
            let mut job = self.lock();
            while job.pending > 0 {
                job = self.done.wait(job).unwrap_or_else(|e| e.into_inner());
            }
            job.part = None;
            job.panicked
        };
        self.busy.store(false, Ordering::Release);
        if let Err(e) = mine {
            std::panic::resume_unwind(e);
        }
        assert!(!panicked, "a host kernel's part panicked on a worker thread");
        true
    }
}

/// What the host kernels' tests share: a pseudo-random stream, the float64 reference product, and the
/// instruction sets this CPU can run.
#[cfg(test)]
pub(super) mod testing {
    use super::{detect, Isa};

    /// A deterministic pseudo-random stream (no RNG crate needed).
    pub fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    /// The naive reference of `x · Wᵀ` (`[n, rows]`): each of W's `rows` rows dequantized whole
    /// (`row(r)`), then a float64 dot per output.
    pub fn naive(rows: usize, cols: usize, x: &[f32], row: impl Fn(usize) -> Vec<f32>) -> Vec<f64> {
        let n = x.len() / cols;
        let w: Vec<Vec<f32>> = (0..rows).map(row).collect();
        let mut out = vec![0f64; n * rows];
        for i in 0..n {
            for (r, wr) in w.iter().enumerate() {
                out[i * rows + r] =
                    wr.iter().zip(&x[i * cols..(i + 1) * cols]).map(|(a, b)| *a as f64 * *b as f64).sum();
            }
        }
        out
    }

    /// Every copy this CPU can run, by name: the generic one and the x86 ones it has.
    pub fn isas() -> Vec<(&'static str, Isa)> {
        let mut isas = vec![("generic", Isa::Generic)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                isas.push(("avx2", Isa::Avx2));
            }
            if matches!(detect(), Isa::Avx512) {
                isas.push(("avx512", Isa::Avx512));
            }
        }
        isas
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Every part runs exactly once, on the parked workers and on the fallback threads alike, from
    /// several threads at once (one holds the workers, the others fall back), and the outputs of
    /// `over_rows` equal a plain loop's.
    #[test]
    fn split_runs_every_part_once_from_many_threads() {
        let max = host_threads() + 2; // counts past the workers take the spawning path
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        let count = 1 + (round + t) % max;
                        let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
                        split(count, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "count {count}");
                    }
                });
            }
        });
        let (rows, n) = (37, 3);
        let mut got = vec![0f32; rows * n];
        over_rows(rows, n, 4, 4, &mut got, |r0, r1, y| {
            for r in r0..r1 {
                for i in 0..n {
                    y[(r - r0) * n + i] = (r * 10 + i) as f32;
                }
            }
        });
        let want: Vec<f32> = (0..n).flat_map(|i| (0..rows).map(move |r| (r * 10 + i) as f32)).collect();
        assert_eq!(got, want);
    }

    /// A part that panics, on the caller's thread or on a worker, re-raises on the caller once every
    /// part has returned, and the workers serve the next split.
    #[test]
    fn split_reraises_a_part_panic_and_recovers() {
        for bad in [0, 1] {
            let r = std::panic::catch_unwind(|| {
                split(2, &|i| {
                    if i == bad {
                        panic!("part {i}: the panic this test raises on purpose");
                    }
                })
            });
            assert!(r.is_err(), "part {bad}'s panic must reach the caller");
            let hits = AtomicUsize::new(0);
            split(2, &|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 2);
        }
    }
}
