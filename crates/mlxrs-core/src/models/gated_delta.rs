//! The gated delta rule's fast path on a GPU (mlx-lm's `models/gated_delta.py`): the whole
//! recurrence of a chunk in one kernel instead of one small graph per token
//! ([`super::qwen3_next::gated_delta_ops`], the reference, which every other case runs).
//!
//! mlx-lm 0.32.2 has its kernel for Metal only (`mx.fast.metal_kernel`; on CUDA it runs the ops).
//! This is the same kernel for MLX's CUDA backend (`mx.fast.cuda_kernel`, mlx-c's
//! `mlx_fast_cuda_kernel_*`), line for line mlx-lm's generic one (`_make_gated_delta_kernel`,
//! scalar gates, no mask): one 32-thread warp per (row, value head, value dim), each lane holding
//! `Dk / 32` float32 state elements; per token the state decays by `g`, `kv_mem = S k` and `y = S q`
//! are warp sums (a butterfly over lanes xor 1, 2, 4, 8, 16, the order of mlx-lm's explicit-tree
//! comparator), `S += k (beta (v - kv_mem))`. Inputs in q's dtype, the state float32, `y` in q's
//! dtype — as the reference. Value heads share key heads `Hv / Hk` to one, as the reference's repeat.
//!
//! When: [`path`] — `MLXRS_GDN_KERNEL=0` turns it off; otherwise the default device must be a GPU of
//! MLX's CUDA backend and `Dk` a multiple of 32 (mlx-lm's condition for its kernel).
//! `bench/check_gdn_kernel.py` compares the two on a GPU; the batched engine and the prefix cache
//! see the same state arrays either way.
//!
//! **Metal** ([`metal_kernel`], UNVERIFIED): mlx-lm's generic Metal kernel (`_make_gated_delta_kernel`,
//! scalar gates, no mask; `simd_sum` reductions; `T` passed as an input) through mlx-c's
//! `mlx_fast_metal_kernel_*`. It has never run: no Metal machine was available. The reference stays
//! the default on Metal; `MLXRS_GDN_KERNEL=metal` opts in on a Metal GPU (for checking it there
//! against the reference, e.g. with `bench/check_gdn_kernel.py`'s comparisons).
use crate::error::{Error, Result};
use crate::handle::{self as mx, Array, CudaKernel, Dtype, MetalKernel, TemplateArg};
use std::sync::OnceLock;

/// Which implementation of the recurrence runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The per-token ops ([`super::qwen3_next::gated_delta_ops`]).
    Reference,
    /// The CUDA kernel ([`kernel`]).
    CudaKernel,
    /// mlx-lm's Metal kernel ([`metal_kernel`]): unverified, only when asked for.
    MetalKernel,
}

/// The choice for key head dim `dk` given the switch (`MLXRS_GDN_KERNEL`: "0" off, "metal" the
/// unverified Metal kernel on a Metal GPU, anything else or unset: the CUDA kernel where it can run),
/// whether the default device is a GPU and whether MLX's CUDA backend is loaded (a GPU without it
/// is Metal).
pub fn choose(switch: Option<&str>, gpu: bool, cuda: bool, dk: i32) -> Path {
    let s = switch.map(str::trim);
    if s == Some("0") || !gpu || dk < 32 || dk % 32 != 0 {
        Path::Reference
    } else if cuda {
        Path::CudaKernel
    } else if s == Some("metal") {
        Path::MetalKernel
    } else {
        Path::Reference
    }
}

/// [`choose`] for this process now (the switch read at each call, so a test can flip it).
pub fn path(dk: i32) -> Path {
    static CUDA: OnceLock<bool> = OnceLock::new();
    let gpu = mx::default_device().is_ok_and(|d| d.kind() == mx::DeviceKind::Gpu);
    let cuda = gpu && *CUDA.get_or_init(mx::cuda_is_available);
    choose(std::env::var("MLXRS_GDN_KERNEL").ok().as_deref(), gpu, cuda, dk)
}

/// mlx-lm's `_make_gated_delta_kernel(has_mask=False, vectorized=False)` in CUDA.
const SOURCE: &str = r#"
    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state_in, state_out: [B, Hv, Dv, Dk]
    const int T = q_shape[1];
    const int n = blockIdx.z;
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;
    const int dk_idx = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    if (dv_idx >= Dv) {
      return;  // a whole warp: its lanes share dv_idx
    }

    auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
    auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;
    auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv;
    auto y_ = y + b_idx * T * Hv * Dv + hv_idx * Dv;
    auto i_state = state_in + (n * Dv + dv_idx) * Dk;
    auto o_state = state_out + (n * Dv + dv_idx) * Dk;

    float state[n_per_t];
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = static_cast<float>(i_state[n_per_t * dk_idx + i]);
    }
    auto g_ = g + b_idx * T * Hv;
    auto beta_ = beta + b_idx * T * Hv;

    for (int t = 0; t < T; ++t) {
      const float gt = static_cast<float>(g_[hv_idx]);
      float kv_mem = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        const int s_idx = n_per_t * dk_idx + i;
        state[i] = state[i] * gt;
        kv_mem += state[i] * static_cast<float>(k_[s_idx]);
      }
      for (int o = 1; o < 32; o <<= 1) {
        kv_mem += __shfl_xor_sync(0xffffffffu, kv_mem, o);
      }
      const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
      float out = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        const int s_idx = n_per_t * dk_idx + i;
        state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
        out += state[i] * static_cast<float>(q_[s_idx]);
      }
      for (int o = 1; o < 32; o <<= 1) {
        out += __shfl_xor_sync(0xffffffffu, out, o);
      }
      if (dk_idx == 0) {
        y_[dv_idx] = static_cast<InT>(out);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv;
      beta_ += Hv;
    }
    for (int i = 0; i < n_per_t; ++i) {
      o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
    }
"#;

/// The recurrence in one CUDA kernel: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g and beta
/// `[B, T, Hv]` (read as float32), state `[B, Hv, Dv, Dk]` (float32) → y `[B, T, Hv, Dv]` (q's dtype) and
/// the new state — [`super::qwen3_next::gated_delta_ops`]'s contract. Shapes are checked here; the
/// kernel itself needs MLX's CUDA backend (MLX refuses it elsewhere).
pub fn kernel(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &Array) -> Result<Array2> {
    static KERNEL: OnceLock<std::result::Result<CudaKernel, String>> = OnceLock::new();
    let (b, t, hk, dk, hv, dv) = check_shapes(q, k, v, g, beta, state)?;
    let kern = KERNEL
        .get_or_init(|| {
            let inputs = ["q", "k", "v", "g", "beta", "state_in"];
            CudaKernel::new("mlxrs_gated_delta_step", &inputs, &["y", "state_out"], SOURCE, "", true)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let (in_t, st_t) = (q.dtype(), state.dtype());
    let template = template_args(in_t, st_t, [dk, dv, hk, hv]);
    let mut out = kern.apply(
        &[q, k, v, g, beta, state],
        &[(&[b, t, hv, dv], in_t), (&[b, hv, dv, dk], st_t)],
        (32, dv, b * hv),
        (32, 4, 1),
        &template,
    )?;
    let (Some(st), Some(y)) = (out.pop(), out.pop()) else {
        return Err(Error::Mlx("gated delta kernel: fewer than two outputs".into()));
    };
    Ok((y, st))
}

/// mlx-lm 0.32.2's `_make_gated_delta_kernel(has_mask=False, vectorized=False)` Metal source.
const METAL_SOURCE: &str = r#"
        auto n = thread_position_in_grid.z;
        auto b_idx = n / Hv;
        auto hv_idx = n % Hv;
        auto hk_idx = hv_idx / (Hv / Hk);
        constexpr int n_per_t = Dk / 32;

        // q, k: [B, T, Hk, Dk]
        auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
        auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;

        // v, y: [B, T, Hv, Dv]
        auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv;
        y += b_idx * T * Hv * Dv + hv_idx * Dv;

        auto dk_idx = thread_position_in_threadgroup.x;
        auto dv_idx = thread_position_in_grid.y;

        // state_in, state_out: [B, Hv, Dv, Dk]
        auto i_state = state_in + (n * Dv + dv_idx) * Dk;
        auto o_state = state_out + (n * Dv + dv_idx) * Dk;

        float state[n_per_t];
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          state[i] = static_cast<float>(i_state[s_idx]);
        }

        // g: [B, T, Hv]
        auto g_ = g + b_idx * T * Hv;
        auto beta_ = beta + b_idx * T * Hv;

        for (int t = 0; t < T; ++t) {
          if (true) {
            float kv_mem = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] * g_[hv_idx];
              kv_mem += state[i] * k_[s_idx];
            }
            kv_mem = simd_sum(kv_mem);

            auto delta = (v_[dv_idx] - kv_mem) * beta_[hv_idx];

            float out = 0.0f;
            for (int i = 0; i < n_per_t; ++i) {
              auto s_idx = n_per_t * dk_idx + i;
              state[i] = state[i] + k_[s_idx] * delta;
              out += state[i] * q_[s_idx];
            }
            out = simd_sum(out);
            if (thread_index_in_simdgroup == 0) {
              y[dv_idx] = static_cast<InT>(out);
            }
          } else {
            y[dv_idx] = static_cast<InT>(0);
          }
          // Increment data pointers to next time step
          q_ += Hk * Dk;
          k_ += Hk * Dk;
          v_ += Hv * Dv;
          y += Hv * Dv;
          g_ += Hv;
          beta_ += Hv;
        }
        for (int i = 0; i < n_per_t; ++i) {
          auto s_idx = n_per_t * dk_idx + i;
          o_state[s_idx] = static_cast<StT>(state[i]);
        }
"#;

/// The recurrence in mlx-lm's Metal kernel ([`METAL_SOURCE`], UNVERIFIED: never run here), with
/// [`kernel`]'s contract and shape checks; its launch as mlx-lm's (`grid (32, Dv, B·Hv)`,
/// threadgroups `(32, 4, 1)`, `T` an input). MLX refuses it without its Metal backend.
pub fn metal_kernel(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &Array) -> Result<Array2> {
    static KERNEL: OnceLock<std::result::Result<MetalKernel, String>> = OnceLock::new();
    let (b, t, hk, dk, hv, dv) = check_shapes(q, k, v, g, beta, state)?;
    let kern = KERNEL
        .get_or_init(|| {
            let inputs = ["q", "k", "v", "g", "beta", "state_in", "T"];
            MetalKernel::new("gated_delta_step", &inputs, &["y", "state_out"], METAL_SOURCE, "", true)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Mlx(e.clone()))?;
    let (in_t, st_t) = (q.dtype(), state.dtype());
    let template = template_args(in_t, st_t, [dk, dv, hk, hv]);
    let t_arr = Array::scalar(t)?;
    let mut out = kern.apply(
        &[q, k, v, g, beta, state, &t_arr],
        &[(&[b, t, hv, dv], in_t), (&[b, hv, dv, dk], st_t)],
        (32, dv, b * hv),
        (32, 4, 1),
        &template,
    )?;
    let (Some(st), Some(y)) = (out.pop(), out.pop()) else {
        return Err(Error::Mlx("gated delta Metal kernel: fewer than two outputs".into()));
    };
    Ok((y, st))
}

/// `(y, state)`.
pub type Array2 = (Array, Array);

/// Both kernels' compile-time constants: the inputs' and the state's dtypes, then Dk, Dv, Hk, Hv.
fn template_args(in_t: Dtype, st_t: Dtype, [dk, dv, hk, hv]: [i32; 4]) -> [(&'static str, TemplateArg); 6] {
    [
        ("InT", TemplateArg::Dtype(in_t)),
        ("StT", TemplateArg::Dtype(st_t)),
        ("Dk", TemplateArg::Int(dk)),
        ("Dv", TemplateArg::Int(dv)),
        ("Hk", TemplateArg::Int(hk)),
        ("Hv", TemplateArg::Int(hv)),
    ]
}

/// [`kernel`]'s and [`metal_kernel`]'s shape checks: `(B, T, Hk, Dk, Hv, Dv)`.
fn check_shapes(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(i32, i32, i32, i32, i32, i32)> {
    let [b, t, hk, dk] = dims4(q, "q")?;
    let [vb, vt, hv, dv] = dims4(v, "v")?;
    let bad = |what: String| Err(Error::Invalid(format!("gated delta kernel: {what}")));
    if k.shape() != q.shape() {
        return bad(format!("k {:?} is not q's shape {:?}", k.shape(), q.shape()));
    }
    if (vb, vt) != (b, t) || hk == 0 || hv % hk != 0 {
        return bad(format!("v {:?} does not fit q {:?} (value heads a multiple of key heads)", v.shape(), q.shape()));
    }
    for (name, a) in [("g", g), ("beta", beta)] {
        if a.shape() != [b, t, hv] {
            return bad(format!("{name} {:?} is not [{b}, {t}, {hv}]", a.shape()));
        }
    }
    if state.shape() != [b, hv, dv, dk] {
        return bad(format!("state {:?} is not [{b}, {hv}, {dv}, {dk}]", state.shape()));
    }
    if dk < 32 || dk % 32 != 0 {
        return bad(format!("key head dim {dk} is not a multiple of 32"));
    }
    Ok((b, t, hk, dk, hv, dv))
}

fn dims4(a: &Array, name: &str) -> Result<[i32; 4]> {
    <[i32; 4]>::try_from(a.shape().as_slice())
        .map_err(|_| Error::Invalid(format!("gated delta kernel: {name} {:?} is not 4-dimensional", a.shape())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel only where it can run: a CUDA GPU, the switch not "0", Dk a multiple of 32.
    #[test]
    fn the_kernel_is_chosen_only_on_a_cuda_gpu() {
        assert_eq!(choose(None, true, true, 128), Path::CudaKernel);
        assert_eq!(choose(Some("1"), true, true, 32), Path::CudaKernel);
        assert_eq!(choose(Some("0"), true, true, 128), Path::Reference);
        assert_eq!(choose(None, false, false, 128), Path::Reference); // the CPU
        assert_eq!(choose(None, true, false, 128), Path::Reference); // Metal
        assert_eq!(choose(None, true, true, 16), Path::Reference);
        assert_eq!(choose(None, true, true, 48), Path::Reference);
        // the unverified Metal kernel: only asked for, only on a Metal GPU
        assert_eq!(choose(Some("metal"), true, false, 128), Path::MetalKernel);
        assert_eq!(choose(Some(" metal "), true, false, 64), Path::MetalKernel);
        assert_eq!(choose(Some("metal"), true, false, 48), Path::Reference);
        assert_eq!(choose(Some("metal"), false, false, 128), Path::Reference); // the CPU
        assert_eq!(choose(Some("metal"), true, true, 128), Path::CudaKernel); // CUDA has its own
        assert_eq!(choose(Some("1"), true, false, 128), Path::Reference);
    }

    /// The Metal kernel checks its shapes, and MLX without its Metal backend refuses it (an error,
    /// not a crash): all that can be tested of it here.
    #[test]
    fn the_metal_kernel_is_refused_off_metal() {
        mx::init().expect("the MLX runtime");
        if mx::metal_is_available() {
            return; // a Mac: compare it there (see the module doc)
        }
        let z = |shape: &[i32]| mx::zeros(shape, mx::Dtype::Float32).unwrap();
        let (q, v, g, s) = (z(&[1, 3, 2, 32]), z(&[1, 3, 4, 16]), z(&[1, 3, 4]), z(&[1, 4, 16, 32]));
        let err = |r: Result<Array2>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(metal_kernel(&q, &q, &v, &g, &g, &z(&[1, 4, 16, 16])))
            .contains("state [1, 4, 16, 16] is not [1, 4, 16, 32]"));
        let e = err(metal_kernel(&q, &q, &v, &g, &g, &s).and_then(|(y, st)| {
            mx::eval(&[&y, &st])?;
            Ok((y, st))
        }));
        assert!(!e.is_empty(), "MLX ran a Metal kernel without Metal");
    }

    /// On this CPU-only machine the process picks the reference, whatever the switch.
    #[test]
    fn a_cpu_process_runs_the_reference() {
        mx::init().expect("the MLX runtime (a device to ask about)");
        if mx::default_device().is_ok_and(|d| d.kind() == mx::DeviceKind::Gpu) {
            return; // a GPU machine: bench/check_gdn_kernel.py covers it
        }
        assert_eq!(path(128), Path::Reference);
    }
}
