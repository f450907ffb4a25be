/* mlxrs's own additions to libmlxc (not mlx-c's): entry points for what MLX 0.32 adds and mlx-c
   v0.5.0's C API does not reach, written the way mlx-c writes its functions (result through the
   first pointer, 0 on success, 1 after reporting the exception through mlx-c's error handler).
   Compiled into libmlxc by native/CMakeLists.txt, so they share mlx-c's private handle helpers. */
#include "mlx/c/error.h"
#include "mlx/c/private/mlx.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

/* y = x · Wᵀ (float32, x [n, cols], W [rows, cols], y [n, rows], all row-major) computed by the
   caller's kernel: mlxrs's host matmul (crates/mlxrs-core/src/handle/f32mm.rs). */
typedef void (*mlxrs_host_matmul_kernel)(
    const float* w,
    size_t rows,
    size_t cols,
    const float* x,
    size_t n,
    float* y);

/* y = x · dequant(W)ᵀ for W in blocks along its rows (int8 q [rows, cols], float32 s and b — b null
   for none — [rows, cols / group]: dequant(W)[r, k] = s[r, k/group] · q[r, k] + b[r, k/group]), x
   [n, cols] and y [n, rows] float32, all row-major: mlxrs's kernel (crates/mlxrs-core/src/handle/blocks.rs),
   called with these fields (crates/mlxrs-sys's HostBlocksArgs, field for field). */
struct mlxrs_host_blocks_args {
  const int8_t* q;
  const float* s;
  const float* b;
  size_t rows;
  size_t cols;
  size_t group;
  const float* x;
  size_t n;
  float* y;
};
typedef void (*mlxrs_host_blocks_kernel)(const mlxrs_host_blocks_args* args);

/* y = x · dequant(W)ᵀ for W as MLX's affine quantization packs it (uint32 words w [rows, cols · bits
   / 32] of 4- or 8-bit values, value k of a row in bits bits · (k mod 32/bits) of word k · bits / 32;
   s and b [rows, cols / group] of type sdtype: 0 float32, 1 bfloat16, 2 float16), x [n, cols] and
   y [n, rows] float32, all row-major: mlxrs's kernel (crates/mlxrs-core/src/handle/packed.rs), called
   with these fields (crates/mlxrs-sys's HostPackedArgs, field for field). */
struct mlxrs_host_packed_args {
  const uint32_t* w;
  const void* s;
  const void* b;
  int sdtype;
  int bits;
  size_t rows;
  size_t cols;
  size_t group;
  const float* x;
  size_t n;
  float* y;
};
typedef void (*mlxrs_host_packed_kernel)(const mlxrs_host_packed_args* args);

/* y = x · Wᵀ for W in 16-bit floats (u16 w [rows, cols], wdtype 0 bfloat16, 1 float16), x [n, cols]
   and y [n, rows] float32 — or both of W's type where x16 (the product rounded once) — all row-major;
   gemm 1: through the BLAS (prefill), 0: W read in place (a decode step's rows): mlxrs's kernel (crates/mlxrs-core/src/handle/half.rs),
   called with these fields (crates/mlxrs-sys's HostHalfArgs, field for field). */
struct mlxrs_host_half_args {
  const uint16_t* w;
  int wdtype;
  size_t rows;
  size_t cols;
  const void* x;
  size_t n;
  void* y;
  int gemm;
  int x16;
};
typedef void (*mlxrs_host_half_kernel)(const mlxrs_host_half_args* args);

/* y[i] = x[i] · W[idx[i]]ᵀ row by row, for the experts of a mixture in 16-bit floats (u16 w [experts,
   rows, cols], wdtype 0 bfloat16, 1 float16), x [n, cols] and y [n, rows] float32 — or both of W's type
   where x16 (each product rounded once) — and idx [n] uint32 (an index past the experts gives a NaN
   row), all row-major; gemm 1: through the BLAS (prefill), 0: W read in place: mlxrs's kernel (crates/mlxrs-core/src/handle/half.rs), called with these fields
   (crates/mlxrs-sys's HostHalfGatherArgs, field for field). */
struct mlxrs_host_half_gather_args {
  const uint16_t* w;
  int wdtype;
  size_t experts;
  size_t rows;
  size_t cols;
  const void* x;
  const uint32_t* idx;
  size_t n;
  void* y;
  int gemm;
  int x16;
};
typedef void (*mlxrs_host_half_gather_kernel)(const mlxrs_host_half_gather_args* args);

/* softmax(scale · q kᵀ (+ causal mask)) v for 16-bit floats (dtype 0 bfloat16, 1 float16), rounded
   where MLX's CPU fallback of fast::scaled_dot_product_attention rounds (the scaled queries, the
   scores, the probabilities, the output): q [b, heads, lq, d], k [b, kv_heads, lk, d], v [b, kv_heads,
   lk, dv], out [b, heads, lq, dv], all row-major; causal: query i sees keys up to lk - lq + i; mask
   (null for none): a boolean [lq, lk], query i sees key j where mask[i, j] (MLX's `where`).
   mlxrs's kernel (crates/mlxrs-core/src/handle/half.rs), called with these fields (crates/mlxrs-sys's
   HostHalfAttnArgs, field for field). */
struct mlxrs_host_half_attn_args {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  const bool* mask;
  int dtype;
  int causal;
  float scale;
  size_t b;
  size_t heads;
  size_t kv_heads;
  size_t lq;
  size_t lk;
  size_t d;
  size_t dv;
};
typedef void (*mlxrs_host_half_attn_kernel)(const mlxrs_host_half_attn_args* args);

/* Runs body(ctx, begin, end) over ranges covering [0, items) (each at least `grain` long, but for
   the last) on the caller's thread and the caller's workers, returning when all have; body must not
   throw. mlxrs passes its host kernels' parked threads (crates/mlxrs-core/src/handle/host.rs) through
   mlxrs_set_parallel_for, so the CPU primitives here and mlxrs's own kernels share one pool and one
   thread count; until then a primitive spawns threads of its own. */
typedef void (*mlxrs_range_body)(void* ctx, int64_t begin, int64_t end);
typedef void (*mlxrs_parallel_for)(int64_t items, int64_t grain, mlxrs_range_body body, void* ctx);

namespace {

using namespace mlx::core;

std::atomic<mlxrs_parallel_for> g_parallel_for{nullptr};

/* work(i0, i1) over [0, items) through the registered pool, else on up to 8 threads of our own. */
template <typename F>
void parallel_ranges(int items, int grain, F& work) {
  if (auto pf = g_parallel_for.load(std::memory_order_acquire)) {
    bool failed = false;
    struct Ctx {
      F* work;
      bool* failed;
    } ctx{&work, &failed};
    pf(items, grain,
       [](void* c, int64_t i0, int64_t i1) {
         auto* x = static_cast<Ctx*>(c);
         try {
           (*x->work)((int)i0, (int)i1);
         } catch (...) {
           *x->failed = true; // never unwind through the pool's (Rust) frames
         }
       },
       &ctx);
    if (failed) {
      throw std::runtime_error("[mlxrs] a CPU primitive's range failed");
    }
    return;
  }
  int threads = (int)std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()), 8u);
  threads = std::max(1, std::min(threads, items / grain));
  const int per = (items + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; t++) {
    const int i0 = t * per, i1 = std::min(items, i0 + per);
    if (i0 < i1) {
      try {
        pool.emplace_back([&work, i0, i1] { work(i0, i1); });
      } catch (const std::system_error&) {
        work(i0, i1); // no thread to be had: this range on this thread
      }
    }
  }
  work(0, std::min(items, per));
  for (auto& t : pool) {
    t.join();
  }
}

/* A host kernel as a node of MLX's graph on the CPU stream: it runs in order with the other CPU ops of
   the step (no evaluation of its inputs first, no return to the caller's thread per op). The output is
   allocated and every input and the output registered with the stream's encoder here; a derived class
   says only what to run over the inputs' and the output's buffers (`task`) and what makes two of its
   ops the same (`key`: a kernel pointer and one parameter). */
class HostPrimitive : public UnaryPrimitive {
 public:
  HostPrimitive(Stream stream, const char* name, const char* entry)
      : UnaryPrimitive(stream), name_(name), entry_(entry) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (auto& a : inputs) {
      encoder.set_input_array(a);
    }
    encoder.set_output_array(out);
    encoder.dispatch(task(inputs, out));
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error(std::string("[") + entry_ + "] runs on the CPU stream only");
  }

  const char* name() const override {
    return name_;
  }

  bool is_equivalent(const Primitive& other) const override {
    const auto* o = dynamic_cast<const HostPrimitive*>(&other);
    return o != nullptr && std::strcmp(name_, o->name_) == 0 && key() == o->key();
  }

 protected:
  virtual std::function<void()> task(const std::vector<array>& inputs, array& out) const = 0;
  virtual std::pair<const void*, double> key() const = 0;

 private:
  const char* name_;
  const char* entry_;
};

/* The float32 host matmul: inputs x and W. */
class HostMatmul : public HostPrimitive {
 public:
  HostMatmul(Stream stream, mlxrs_host_matmul_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostMatmul", "mlxrs_host_matmul"), kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    size_t rows = w.shape(0), cols = w.shape(1), n = x.size() / cols;
    return [kernel = kernel_, wp = w.data<float>(), xp = x.data<float>(), yp = out.data<float>(), rows, cols, n]() {
      kernel(wp, rows, cols, xp, n, yp);
    };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), 0.0};
  }

 private:
  mlxrs_host_matmul_kernel kernel_;
};

/* The host matmul for a matrix in blocks: inputs x, q, s and (when it has them) b. */
class HostBlocksMatmul : public HostPrimitive {
 public:
  HostBlocksMatmul(Stream stream, mlxrs_host_blocks_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostBlocksMatmul", "mlxrs_host_blocks_matmul"), kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& x = inputs[0];
    const array& q = inputs[1];
    const array& s = inputs[2];
    size_t rows = q.shape(0), cols = q.shape(1), n = x.size() / cols;
    const mlxrs_host_blocks_args args{
        q.data<int8_t>(),
        s.data<float>(),
        inputs.size() > 3 ? inputs[3].data<float>() : nullptr,
        rows,
        cols,
        cols / s.shape(1),
        x.data<float>(),
        n,
        out.data<float>()};
    return [kernel = kernel_, args]() { kernel(&args); };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), 0.0};
  }

 private:
  mlxrs_host_blocks_kernel kernel_;
};

/* The host matmul for MLX's packed affine weights: inputs x, w, s and b. */
class HostPackedMatmul : public HostPrimitive {
 public:
  HostPackedMatmul(Stream stream, int bits, mlxrs_host_packed_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostPackedMatmul", "mlxrs_host_packed_matmul"), bits_(bits), kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    const array& s = inputs[2];
    size_t rows = w.shape(0), cols = (size_t)w.shape(1) * 32 / bits_, n = x.size() / cols;
    const int sdtype = s.dtype() == float32 ? 0 : s.dtype() == bfloat16 ? 1 : 2;
    const mlxrs_host_packed_args args{
        w.data<uint32_t>(),
        s.data<void>(),
        inputs[3].data<void>(),
        sdtype,
        bits_,
        rows,
        cols,
        cols / s.shape(1),
        x.data<float>(),
        n,
        out.data<float>()};
    return [kernel = kernel_, args]() { kernel(&args); };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), (double)bits_};
  }

 private:
  int bits_;
  mlxrs_host_packed_kernel kernel_;
};

/* The host matmul for a matrix of 16-bit floats: inputs x and w. */
class HostHalfMatmul : public HostPrimitive {
 public:
  HostHalfMatmul(Stream stream, bool gemm, mlxrs_host_half_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostHalfMatmul", "mlxrs_host_half_matmul"), gemm_(gemm), kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    size_t rows = w.shape(0), cols = w.shape(1), n = x.size() / cols;
    const mlxrs_host_half_args args{
        w.data<uint16_t>(),
        w.dtype() == bfloat16 ? 0 : 1,
        rows,
        cols,
        x.data<void>(),
        n,
        out.data<void>(),
        gemm_ ? 1 : 0,
        x.dtype() == float32 ? 0 : 1};
    return [kernel = kernel_, args]() { kernel(&args); };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), gemm_ ? 1.0 : 0.0};
  }

 private:
  bool gemm_;
  mlxrs_host_half_kernel kernel_;
};

/* The host gather matmul for experts of 16-bit floats: inputs x, w, idx. */
class HostHalfGatherMatmul : public HostPrimitive {
 public:
  HostHalfGatherMatmul(Stream stream, bool gemm, mlxrs_host_half_gather_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostHalfGatherMatmul", "mlxrs_host_half_gather_matmul"),
        gemm_(gemm),
        kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    const array& idx = inputs[2];
    const mlxrs_host_half_gather_args args{
        w.data<uint16_t>(),
        w.dtype() == bfloat16 ? 0 : 1,
        static_cast<size_t>(w.shape(0)),
        static_cast<size_t>(w.shape(1)),
        static_cast<size_t>(w.shape(2)),
        x.data<void>(),
        idx.data<uint32_t>(),
        static_cast<size_t>(x.shape(0)),
        out.data<void>(),
        gemm_ ? 1 : 0,
        x.dtype() == float32 ? 0 : 1};
    return [kernel = kernel_, args]() { kernel(&args); };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), gemm_ ? 1.0 : 0.0};
  }

 private:
  bool gemm_;
  mlxrs_host_half_gather_kernel kernel_;
};

/* The host attention for 16-bit floats: inputs q, k, v. */
class HostHalfAttention : public HostPrimitive {
 public:
  HostHalfAttention(Stream stream, float scale, bool causal, mlxrs_host_half_attn_kernel kernel)
      : HostPrimitive(stream, "MlxrsHostHalfAttention", "mlxrs_host_half_attention"),
        scale_(scale),
        causal_(causal),
        kernel_(kernel) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& q = inputs[0];
    const array& k = inputs[1];
    const array& v = inputs[2];
    const mlxrs_host_half_attn_args args{
        q.data<uint16_t>(),
        k.data<uint16_t>(),
        v.data<uint16_t>(),
        out.data<uint16_t>(),
        inputs.size() > 3 ? inputs[3].data<bool>() : nullptr,
        q.dtype() == bfloat16 ? 0 : 1,
        causal_ ? 1 : 0,
        scale_,
        (size_t)q.shape(0),
        (size_t)q.shape(1),
        (size_t)k.shape(1),
        (size_t)q.shape(2),
        (size_t)k.shape(2),
        (size_t)q.shape(3),
        (size_t)v.shape(3)};
    return [kernel = kernel_, args]() { kernel(&args); };
  }
  std::pair<const void*, double> key() const override {
    return {reinterpret_cast<const void*>(kernel_), (double)scale_ * (causal_ ? 1.0 : -1.0)};
  }

 private:
  float scale_;
  bool causal_;
  mlxrs_host_half_attn_kernel kernel_;
};

/* A row's keys and values for RowsDecodeAttention: [1, kv_heads, len, D] views (float32, or 16-bit
   float bits), strides in elements. */
struct AttnRow {
  const void* k;
  const void* v;
  int64_t ks1, ks2, ks3, vs1, vs2, vs3;
  int len;
};

/* bfloat16 bits as float32 (exact). */
static inline float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/* f rounded to bfloat16 (to nearest, ties to even, as MLX converts), as bits. */
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return (uint16_t)((u >> 16) | 0x40u); // NaN stays NaN
  }
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16, as float32. */
static inline float bf16_round(float f) {
  return bf16_value(bf16_bits(f));
}

/* Built for AVX-512 and AVX2 with FMA besides the baseline where GCC can pick at load time (an ifunc:
   Linux on x86-64): the baseline build (SSE2) ran a 16-row, 256-key layer at ~18 GB/s. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define MLXRS_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define MLXRS_CLONES
#endif

/* (row, head) pairs i0..i1 of RowsDecodeAttention: scores, softmax and values. */
MLXRS_CLONES static void attend_range(const AttnRow* rows, const float* qp, float* op, int H, int D,
                                      int kvh, float scale, int i0, int i1) {
  const int rep = H / kvh;
  std::vector<float> qs(D), acc(D), p;
  for (int i = i0; i < i1; i++) {
    const int b = i / H, h = i % H;
    const AttnRow& r = rows[b];
    const float* qi = qp + (size_t)i * D;
    for (int d = 0; d < D; d++) {
      qs[d] = qi[d] * scale;
    }
    const float* kb = static_cast<const float*>(r.k) + (h / rep) * r.ks1;
    const float* vb = static_cast<const float*>(r.v) + (h / rep) * r.vs1;
    p.resize(r.len);
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < r.len; j++) {
      const float* kj = kb + j * r.ks2;
      float s = 0.0f;
      if (r.ks3 == 1) {
        // eight partial sums (vectorizable without reassociating one sum), then in order
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        const int full = D / 8 * 8;
        for (int d = 0; d < full; d += 8) {
          for (int u = 0; u < 8; u++) {
            part[u] += qs[d + u] * kj[d + u];
          }
        }
        for (int u = 0; u < 8; u++) {
          s += part[u];
        }
        for (int d = full; d < D; d++) {
          s += qs[d] * kj[d];
        }
      } else {
        for (int d = 0; d < D; d++) {
          s += qs[d] * kj[d * r.ks3];
        }
      }
      p[j] = s;
      m = std::max(m, s);
    }
    float sum = 0.0f;
    for (int j = 0; j < r.len; j++) {
      p[j] = std::exp(p[j] - m);
      sum += p[j];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < r.len; j++) {
      const float* vj = vb + j * r.vs2;
      const float w = p[j];
      if (r.vs3 == 1) {
        for (int d = 0; d < D; d++) {
          acc[d] += w * vj[d];
        }
      } else {
        for (int d = 0; d < D; d++) {
          acc[d] += w * vj[d * r.vs3];
        }
      }
    }
    float* oi = op + (size_t)i * D;
    const float inv = r.len > 0 ? 1.0f / sum : 0.0f;
    for (int d = 0; d < D; d++) {
      oi[d] = acc[d] * inv;
    }
  }
}

/* A 16-bit float's bits as float32 (exact), and a float32 rounded to it as MLX converts (bfloat16: to
   nearest, ties to even; float16: MLX's own float16_t). */
template <bool BF16>
static inline __attribute__((always_inline)) float half_value(uint16_t b) {
  if constexpr (BF16) {
    return bf16_value(b);
  } else {
    float16_t h;
    std::memcpy(&h, &b, sizeof b);
    return static_cast<float>(h);
  }
}

template <bool BF16>
static inline __attribute__((always_inline)) uint16_t half_bits(float f) {
  if constexpr (BF16) {
    return bf16_bits(f);
  } else {
    const float16_t h(f);
    uint16_t b;
    std::memcpy(&b, &h, sizeof b);
    return b;
  }
}

/* attend_range for 16-bit rows (bfloat16 or float16), rounded where MLX's CPU fallback of
   fast::scaled_dot_product_attention rounds a 16-bit attention (the scale and the scaled queries, each
   score, each probability of a float32 softmax, each output): the products exact float32 sums in
   another order than MLX's half-precision matmul. Inlined into each instruction set's copy below. */
template <bool BF16>
static inline __attribute__((always_inline)) void attend_range_half(const AttnRow* rows, const uint16_t* qp,
                                                                    uint16_t* op, int H, int D, int kvh, float scale,
                                                                    int i0, int i1) {
  const int rep = H / kvh;
  const float sc = half_value<BF16>(half_bits<BF16>(scale));
  std::vector<float> qs(D), acc(D), p;
  for (int i = i0; i < i1; i++) {
    const int b = i / H, h = i % H;
    const AttnRow& r = rows[b];
    const uint16_t* qi = qp + (size_t)i * D;
    for (int d = 0; d < D; d++) {
      qs[d] = half_value<BF16>(half_bits<BF16>(sc * half_value<BF16>(qi[d])));
    }
    const uint16_t* kb = static_cast<const uint16_t*>(r.k) + (h / rep) * r.ks1;
    const uint16_t* vb = static_cast<const uint16_t*>(r.v) + (h / rep) * r.vs1;
    p.resize(r.len);
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < r.len; j++) {
      const uint16_t* kj = kb + j * r.ks2;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const int full = D / 8 * 8;
      for (int d = 0; d < full; d += 8) {
        for (int u = 0; u < 8; u++) {
          part[u] += qs[d + u] * half_value<BF16>(kj[(d + u) * r.ks3]);
        }
      }
      float s = 0.0f;
      for (int u = 0; u < 8; u++) {
        s += part[u];
      }
      for (int d = full; d < D; d++) {
        s += qs[d] * half_value<BF16>(kj[d * r.ks3]);
      }
      p[j] = half_value<BF16>(half_bits<BF16>(s));
      m = std::max(m, p[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < r.len; j++) {
      p[j] = std::exp(p[j] - m);
      sum += p[j];
    }
    const float inv = r.len > 0 ? 1.0f / sum : 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < r.len; j++) {
      const uint16_t* vj = vb + j * r.vs2;
      const float w = half_value<BF16>(half_bits<BF16>(p[j] * inv));
      for (int d = 0; d < D; d++) {
        acc[d] += w * half_value<BF16>(vj[d * r.vs3]);
      }
    }
    uint16_t* oi = op + (size_t)i * D;
    for (int d = 0; d < D; d++) {
      oi[d] = half_bits<BF16>(acc[d]);
    }
  }
}

MLXRS_CLONES static void attend_range_bf16(const AttnRow* rows, const uint16_t* qp, uint16_t* op, int H, int D,
                                           int kvh, float scale, int i0, int i1) {
  attend_range_half<true>(rows, qp, op, H, D, kvh, scale, i0, i1);
}

MLXRS_CLONES static void attend_range_f16(const AttnRow* rows, const uint16_t* qp, uint16_t* op, int H, int D,
                                          int kvh, float scale, int i0, int i1) {
  attend_range_half<false>(rows, qp, op, H, D, kvh, scale, i0, i1);
}

/* One decode step's attention for rows that each have their own cache: queries [B, heads, 1, D]
   and, per row b, keys and values [1, kv_heads, L_b, D] (views of the row's cache buffer: any
   strides but a unit last one). softmax(scale · q kᵀ) v over exactly the row's keys (a single query
   sees every key: no mask), grouped-query heads sharing their kv head. The rows' (row, head) pairs
   are spread over the cores; MLX's own path makes a BLAS call per row and kv head, plus a few
   ops per row. */
class RowsDecodeAttention : public HostPrimitive {
 public:
  RowsDecodeAttention(Stream stream, float scale)
      : HostPrimitive(stream, "MlxrsRowsDecodeAttention", "mlxrs_rows_decode_attention"), scale_(scale) {}

 protected:
  std::function<void()> task(const std::vector<array>& inputs, array& out) const override {
    const array& q = inputs[0];
    const int B = q.shape(0), H = q.shape(1), D = q.shape(3);
    std::vector<AttnRow> rows(B);
    int kvh = 1;
    for (int b = 0; b < B; b++) {
      const array& k = inputs[1 + 2 * b];
      const array& v = inputs[2 + 2 * b];
      kvh = k.shape(1);
      rows[b] = AttnRow{k.data<void>(), v.data<void>(), k.strides(1), k.strides(2),
                    k.strides(3), v.strides(1), v.strides(2), v.strides(3), k.shape(2)};
    }
    if (q.dtype() == bfloat16 || q.dtype() == float16) {
      return [rows = std::move(rows), qp = q.data<uint16_t>(), op = out.data<uint16_t>(), B, H, D, kvh,
              scale = scale_, bf16 = q.dtype() == bfloat16]() {
        const int items = B * H;
        auto work = [&](int i0, int i1) {
          if (bf16) {
            attend_range_bf16(rows.data(), qp, op, H, D, kvh, scale, i0, i1);
          } else {
            attend_range_f16(rows.data(), qp, op, H, D, kvh, scale, i0, i1);
          }
        };
        parallel_ranges(items, 8, work);
      };
    }
    return [rows = std::move(rows), qp = q.data<float>(), op = out.data<float>(), B, H, D, kvh,
            scale = scale_]() {
      const int items = B * H;
      auto work = [&](int i0, int i1) {
        attend_range(rows.data(), qp, op, H, D, kvh, scale, i0, i1);
      };
      parallel_ranges(items, 8, work);
    };
  }
  std::pair<const void*, double> key() const override {
    return {nullptr, (double)scale_};
  }

 private:
  float scale_;
};

/* Runs body (which sets *res) the way mlx-c's functions do: 0 on success, 1 after reporting the
   exception through mlx-c's error handler. */
template <typename F>
int guarded(F&& body) {
  try {
    body();
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

/* *res = x · (a matrix of `rows` rows)ᵀ computed by prim: x's shape with its last axis `rows`, float32,
   over `inputs` made row-contiguous on st (a contiguous array is shared, not copied). */
void set_host_product(
    mlx_array* res,
    const array& x,
    int rows,
    std::shared_ptr<Primitive> prim,
    const std::vector<array>& inputs,
    const Stream& st,
    Dtype dtype = float32) {
  std::vector<array> cont;
  for (const auto& a : inputs) {
    cont.push_back(contiguous(a, false, st));
  }
  Shape shape = x.shape();
  shape.back() = rows;
  mlx_array_set_(*res, array(std::move(shape), dtype, std::move(prim), std::move(cont)));
}

} // namespace

extern "C" {

/* The pool the CPU primitives here split their work over (nullptr: threads of their own). */
void mlxrs_set_parallel_for(mlxrs_parallel_for f) {
  g_parallel_for.store(f, std::memory_order_release);
}

/* fast::scaled_dot_product_attention with MLX 0.32's force_fused: true asks for the fused kernel
   even where MLX would materialize the scores (long prompts), trading speed for peak memory. */
int mlxrs_fast_scaled_dot_product_attention_fused(
    mlx_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array values,
    float scale,
    const char* mask_mode,
    const mlx_array mask_arr /* may be null */,
    const mlx_array sinks /* may be null */,
    bool force_fused,
    const mlx_stream s) {
  return guarded([&] {
    mlx_array_set_(
        *res,
        mlx::core::fast::scaled_dot_product_attention(
            mlx_array_get_(queries),
            mlx_array_get_(keys),
            mlx_array_get_(values),
            scale,
            std::string(mask_mode),
            (mask_arr.ctx ? std::make_optional(mlx_array_get_(mask_arr))
                          : std::nullopt),
            (sinks.ctx ? std::make_optional(mlx_array_get_(sinks))
                       : std::nullopt),
            force_fused,
            mlx_stream_get_(s)));
  });
}

/* fast::gated_delta_update (MLX 0.32): the gated DeltaNet recurrence of Qwen3.5/Qwen3-Next in one
   kernel where the backend has one; res gets [output, final state]. */
int mlxrs_fast_gated_delta_update(
    mlx_vector_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array values,
    const mlx_array gates,
    const mlx_array beta,
    const mlx_array initial_state /* may be null */,
    const mlx_array mask /* may be null */,
    const mlx_stream s) {
  return guarded([&] {
    mlx_vector_array_set_(
        *res,
        mlx::core::fast::gated_delta_update(
            mlx_array_get_(queries),
            mlx_array_get_(keys),
            mlx_array_get_(values),
            mlx_array_get_(gates),
            mlx_array_get_(beta),
            (initial_state.ctx
                 ? std::make_optional(mlx_array_get_(initial_state))
                 : std::nullopt),
            (mask.ctx ? std::make_optional(mlx_array_get_(mask))
                      : std::nullopt),
            mlx_stream_get_(s)));
  });
}

/* x · Wᵀ through `kernel` as one op of the graph on stream s (a CPU stream): x [..., cols] and
   W [rows, cols] float32 (made row-contiguous here; a contiguous array is shared, not copied),
   the result [..., rows]. */
int mlxrs_host_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    mlxrs_host_matmul_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& xa = mlx_array_get_(x);
    const array& wa = mlx_array_get_(w);
    if (kernel == nullptr || xa.dtype() != float32 || wa.dtype() != float32 ||
        wa.ndim() != 2 || xa.ndim() < 1 || xa.shape(-1) != wa.shape(1) ||
        st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_matmul] needs float32 x [..., k] and W [n, k] on a CPU stream");
    }
    set_host_product(res, xa, wa.shape(0), std::make_shared<HostMatmul>(st, kernel), {xa, wa}, st);
  });
}

/* x · dequant(W)ᵀ through `kernel` as one op of the graph on stream s (a CPU stream): x [..., cols]
   float32, q [rows, cols] int8, scales (and biases, unless an empty handle) [rows, cols / group]
   float32 with group a multiple of 16; the result [..., rows]. */
int mlxrs_host_blocks_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array q,
    const mlx_array scales,
    const mlx_array biases,
    mlxrs_host_blocks_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& xa = mlx_array_get_(x);
    const array& qa = mlx_array_get_(q);
    const array& sa = mlx_array_get_(scales);
    const bool has_b = biases.ctx != nullptr;
    if (kernel == nullptr || xa.dtype() != float32 || qa.dtype() != int8 || sa.dtype() != float32 ||
        qa.ndim() != 2 || sa.ndim() != 2 || xa.ndim() < 1 || xa.shape(-1) != qa.shape(1) ||
        sa.shape(0) != qa.shape(0) || sa.shape(1) < 1 || qa.shape(1) % sa.shape(1) != 0 ||
        (qa.shape(1) / sa.shape(1)) % 16 != 0 || st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_blocks_matmul] needs float32 x [..., k], int8 q [n, k] and float32 scales "
          "[n, k / group] (group a multiple of 16) on a CPU stream");
    }
    std::vector<array> inputs = {xa, qa, sa};
    if (has_b) {
      const array& ba = mlx_array_get_(biases);
      if (ba.dtype() != float32 || ba.shape() != sa.shape()) {
        throw std::invalid_argument("[mlxrs_host_blocks_matmul] biases must be float32 and shaped as the scales");
      }
      inputs.push_back(ba);
    }
    set_host_product(res, xa, qa.shape(0), std::make_shared<HostBlocksMatmul>(st, kernel), inputs, st);
  });
}

/* x · dequant(W)ᵀ through `kernel` as one op of the graph on stream s (a CPU stream): x [..., cols]
   float32; w [rows, cols · bits / 32] uint32 (bits 4 or 8); scales and biases [rows, cols / group] of
   one type, float32, bfloat16 or float16, with group a multiple of 32; the result [..., rows]. */
int mlxrs_host_packed_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    const mlx_array scales,
    const mlx_array biases,
    int bits,
    mlxrs_host_packed_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& xa = mlx_array_get_(x);
    const array& wa = mlx_array_get_(w);
    const array& sa = mlx_array_get_(scales);
    const array& ba = mlx_array_get_(biases);
    const bool scale_type = sa.dtype() == float32 || sa.dtype() == bfloat16 || sa.dtype() == float16;
    const int64_t cols = (bits == 4 || bits == 8) && wa.ndim() == 2 ? (int64_t)wa.shape(1) * 32 / bits : -1;
    if (kernel == nullptr || cols <= 0 || xa.dtype() != float32 || wa.dtype() != uint32 || !scale_type ||
        ba.dtype() != sa.dtype() || ba.shape() != sa.shape() || sa.ndim() != 2 || xa.ndim() < 1 ||
        xa.shape(-1) != cols || sa.shape(0) != wa.shape(0) || sa.shape(1) < 1 || cols % sa.shape(1) != 0 ||
        (cols / sa.shape(1)) % 32 != 0 || st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_packed_matmul] needs float32 x [..., k], 4- or 8-bit uint32 words w [n, k · bits / 32] "
          "and scales and biases of one float type [n, k / group] (group a multiple of 32) on a CPU stream");
    }
    set_host_product(
        res, xa, wa.shape(0), std::make_shared<HostPackedMatmul>(st, bits, kernel), {xa, wa, sa, ba}, st);
  });
}

/* x · Wᵀ through `kernel` as one op of the graph on stream s (a CPU stream): x [..., cols] float32 or
   of W's type, W [rows, cols] bfloat16 or float16; the result [..., rows] of x's type; gemm: through
   the BLAS. */
int mlxrs_host_half_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    bool gemm,
    mlxrs_host_half_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& xa = mlx_array_get_(x);
    const array& wa = mlx_array_get_(w);
    if (kernel == nullptr || (xa.dtype() != float32 && xa.dtype() != wa.dtype()) ||
        (wa.dtype() != bfloat16 && wa.dtype() != float16) || wa.ndim() != 2 || xa.ndim() < 1 ||
        xa.shape(-1) != wa.shape(1) || st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_half_matmul] needs x [..., k] float32 or of W's type and bfloat16 or float16 W [n, k] on a CPU "
          "stream");
    }
    set_host_product(
        res, xa, wa.shape(0), std::make_shared<HostHalfMatmul>(st, gemm, kernel), {xa, wa}, st, xa.dtype());
  });
}

/* x[i] · W[idx[i]]ᵀ row by row through `kernel` as one op of the graph on stream s (a CPU stream): x
   [n, cols] float32 or of W's type, W [experts, rows, cols] bfloat16 or float16, idx [n] uint32 or
   int32 (its bits read as uint32: a negative index is past the experts); the result [n, rows] of x's
   type; gemm: through the BLAS. */
int mlxrs_host_half_gather_matmul(
    mlx_array* res,
    const mlx_array x,
    const mlx_array w,
    const mlx_array idx,
    bool gemm,
    mlxrs_host_half_gather_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& xa = mlx_array_get_(x);
    const array& wa = mlx_array_get_(w);
    const array& ia = mlx_array_get_(idx);
    if (kernel == nullptr || (xa.dtype() != float32 && xa.dtype() != wa.dtype()) ||
        (wa.dtype() != bfloat16 && wa.dtype() != float16) || wa.ndim() != 3 || xa.ndim() != 2 ||
        xa.shape(1) != wa.shape(2) || (ia.dtype() != uint32 && ia.dtype() != int32) || ia.ndim() != 1 ||
        ia.shape(0) != xa.shape(0) || st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_half_gather_matmul] needs x [n, k] float32 or of W's type, bfloat16 or float16 W [e, m, k] "
          "and int32 or uint32 idx [n] on a CPU stream");
    }
    array iu = ia.dtype() == uint32 ? ia : view(ia, uint32, st);
    set_host_product(
        res, xa, wa.shape(1), std::make_shared<HostHalfGatherMatmul>(st, gemm, kernel), {xa, wa, iu}, st, xa.dtype());
  });
}

/* softmax(scale · q kᵀ (+ causal mask, or a boolean mask [Lq, Lk] unless an empty handle)) v through
   `kernel` as one op of the graph on stream s (a CPU stream): q [B, heads, Lq, D], k [B, kv_heads, Lk,
   D], v [B, kv_heads, Lk, Dv] of one 16-bit float type (heads a multiple of kv_heads; causal: Lq <=
   Lk); the result [B, heads, Lq, Dv] of that type. */
int mlxrs_host_half_attention(
    mlx_array* res,
    const mlx_array q,
    const mlx_array k,
    const mlx_array v,
    const mlx_array mask,
    float scale,
    bool causal,
    mlxrs_host_half_attn_kernel kernel,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& qa = mlx_array_get_(q);
    const array& ka = mlx_array_get_(k);
    const array& va = mlx_array_get_(v);
    const auto dt = qa.dtype();
    if (kernel == nullptr || (dt != bfloat16 && dt != float16) || ka.dtype() != dt || va.dtype() != dt ||
        qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || ka.shape(0) != qa.shape(0) ||
        va.shape(0) != qa.shape(0) || va.shape(1) != ka.shape(1) || ka.shape(1) < 1 ||
        qa.shape(1) % ka.shape(1) != 0 || ka.shape(3) != qa.shape(3) || va.shape(2) != ka.shape(2) ||
        (causal && qa.shape(2) > ka.shape(2)) || st.device != Device::cpu) {
      throw std::invalid_argument(
          "[mlxrs_host_half_attention] needs q [B, heads, Lq, D], k [B, kv_heads, Lk, D] and v [B, kv_heads, Lk, Dv] "
          "of one 16-bit float type (heads a multiple of kv_heads; Lq <= Lk when causal) on a CPU stream");
    }
    std::vector<array> inputs{contiguous(qa, false, st), contiguous(ka, false, st), contiguous(va, false, st)};
    if (mask.ctx != nullptr) {
      const array& ma = mlx_array_get_(mask);
      if (causal || ma.dtype() != bool_ || ma.ndim() != 2 || ma.shape(0) != qa.shape(2) || ma.shape(1) != ka.shape(2)) {
        throw std::invalid_argument("[mlxrs_host_half_attention] a mask must be boolean [Lq, Lk] (and not with causal)");
      }
      inputs.push_back(contiguous(ma, false, st));
    }
    Shape shape = qa.shape();
    shape.back() = va.shape(3);
    mlx_array_set_(
        *res,
        array(std::move(shape), dt, std::make_shared<HostHalfAttention>(st, scale, causal, kernel), std::move(inputs)));
  });
}

/* RowsDecodeAttention: queries [B, heads, 1, D] and 2·B arrays keys_0, values_0, keys_1, ...
   ([1, kv_heads, L_b, D] each), float32 on a CPU stream; the result [B, heads, 1, D]. */
int mlxrs_rows_decode_attention(
    mlx_array* res,
    const mlx_array queries,
    const mlx_vector_array keys_values,
    float scale,
    const mlx_stream s) {
  return guarded([&] {
    auto st = mlx_stream_get_(s);
    const array& q = mlx_array_get_(queries);
    const std::vector<array>& kv = mlx_vector_array_get_(keys_values);
    if (st.device != Device::cpu || (q.dtype() != float32 && q.dtype() != bfloat16 && q.dtype() != float16) ||
        q.ndim() != 4 || q.shape(2) != 1 || (int)kv.size() != 2 * q.shape(0)) {
      throw std::invalid_argument(
          "[mlxrs_rows_decode_attention] needs float32, bfloat16 or float16 queries [B, heads, 1, D] and a key and a value array per row, on a CPU stream");
    }
    std::vector<array> inputs{contiguous(q, false, st)};
    for (size_t i = 0; i < kv.size(); i++) {
      const array& a = kv[i];
      const array& k = kv[i - i % 2];
      if (a.dtype() != q.dtype() || a.ndim() != 4 || a.shape(0) != 1 ||
          a.shape(3) != q.shape(3) || a.shape(2) != k.shape(2) ||
          a.shape(1) != kv[0].shape(1) || q.shape(1) % a.shape(1) != 0) {
        throw std::invalid_argument(
            "[mlxrs_rows_decode_attention] a row's keys or values are not [1, kv_heads, L, D] of the queries' type and D");
      }
      inputs.push_back(a);
    }
    mlx_array_set_(
        *res,
        array(
            q.shape(),
            q.dtype(),
            std::make_shared<RowsDecodeAttention>(st, scale),
            std::move(inputs)));
  });
}

} // extern "C"
