//! The CPU blocks kernel's speed (`mlxrs_core::handle::BlocksRef::matvec`, crates/mlxrs-core/src/handle/
//! blocks.rs) on the real Gemma 3 270M's shapes: its 262144 × 640 Q8_0 head and a Q4_K-shaped body
//! matrix (groups of 32 with biases), one and two threads, and a small matrix that stays in cache (the
//! kernel's compute rate); then the packed kernel's (`PackedRef::matvec_into`, handle/packed.rs: MLX's
//! 4- and 8-bit affine words, bfloat16 scales, groups of 64) on a 1B Llama's 8192 × 2048 MLP matrix.
//! Prints ms per product and GB/s of weights read (bench/RESULTS.md).
//!
//!     cargo run -p mlxrs-core --profile fasttest --example blocks_timing
use mlxrs_core::handle::{BlocksRef, PackedRef, Scales};

/// The best of 10 rounds of `reps` calls of `f`, in seconds per call.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

fn main() {
    for (rows, cols, group, bias) in
        [(256usize, 640usize, 32usize, false), (262144, 640, 32, false), (2048 * 18 * 4, 640, 32, true)]
    {
        let q: Vec<i8> = (0..rows * cols).map(|i| (i % 251) as i8).collect();
        let ng = rows * cols / group;
        let d: Vec<f32> = (0..ng).map(|i| (i % 7) as f32 * 1e-3).collect();
        let b: Option<Vec<f32>> = bias.then(|| (0..ng).map(|i| (i % 5) as f32 * 1e-3).collect());
        let m = BlocksRef::new(&q, &d, b.as_deref(), rows, cols, group).expect("the shapes above are whole groups");
        let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1).collect();
        let bytes = (q.len() + 4 * d.len() + b.as_ref().map_or(0, |b| 4 * b.len())) as f64;
        let mut y = vec![0f32; rows];
        for threads in [1, 2] {
            let reps = if rows < 1024 { 1000 } else { 1 };
            let t = best(reps, || {
                m.matvec_into(&x, threads, &mut y).expect("x is one row of cols");
                std::hint::black_box(&y);
            });
            println!(
                "[{rows} x {cols}] groups {group} bias {bias}, {threads} threads: {:.2} ms, {:.1} GB/s",
                t * 1e3,
                bytes / t / 1e9
            );
        }
    }
    let (rows, cols, group) = (8192usize, 2048usize, 64usize);
    for bits in [4usize, 8] {
        let w: Vec<u32> = (0..rows * cols * bits / 32).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let ng = rows * cols / group;
        let s: Vec<u16> = (0..ng).map(|i| half::bf16::from_f32((i % 7) as f32 * 1e-3).to_bits()).collect();
        let b: Vec<u16> = (0..ng).map(|i| half::bf16::from_f32((i % 5) as f32 * -1e-3).to_bits()).collect();
        let m = PackedRef::new(&w, Scales::Bf16(&s), Scales::Bf16(&b), rows, cols, group, bits)
            .expect("the shapes above are whole groups");
        let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1).collect();
        let bytes = (4 * w.len() + 4 * ng) as f64;
        let mut y = vec![0f32; rows];
        for threads in [1, 2] {
            let t = best(3, || {
                m.matvec_into(&x, threads, &mut y).expect("x is one row of cols");
                std::hint::black_box(&y);
            });
            println!(
                "packed [{rows} x {cols}] {bits}-bit groups {group} bf16 scales, {threads} threads: {:.2} ms, {:.1} GB/s",
                t * 1e3,
                bytes / t / 1e9
            );
        }
    }
}
