//! The CPU blocks kernel's speed (`mlxrs_core::handle::BlocksRef::matvec`, crates/mlxrs-core/src/handle/
//! blocks.rs) on the real Gemma 3 270M's shapes: its 262144 × 640 Q8_0 head and a Q4_K-shaped body
//! matrix (groups of 32 with biases), one and two threads, and a small matrix that stays in cache (the
//! kernel's compute rate). Prints ms per product and GB/s of blocks read (bench/RESULTS.md).
//!
//!     cargo run -p mlxrs-core --profile fasttest --example blocks_timing
use mlxrs_core::handle::BlocksRef;

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
            let mut best = f64::MAX;
            let reps = if rows < 1024 { 1000 } else { 1 };
            for _ in 0..10 {
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    m.matvec_into(&x, threads, &mut y).expect("x is one row of cols");
                    std::hint::black_box(&y);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "[{rows} x {cols}] groups {group} bias {bias}, {threads} threads: {:.2} ms, {:.1} GB/s",
                best * 1e3,
                bytes / best / 1e9
            );
        }
    }
}
