"""Develop and check the quantized matvec CUDA kernel (issue #11) against MLX's own `quantized_matmul`.

Runs on the GPU test machine with only the MLX CUDA bundle (no mlxrs needed):

    PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/site/mlx/lib python3 bench/qmv_kernel_dev.py
    PYTHONPATH=... python3 bench/qmv_kernel_dev.py --step 64    # host vs step time of a decode-shaped step

For each bit width and each 8B-shaped matrix, the kernel's output is compared with
`mx.quantized_matmul` on the same packed weights (max |diff| relative to max |y|), then a whole 8B-shaped
layer stack of distinct matrices (so the L2 cache does not serve them) is timed through both, and the
bytes read per second are printed.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from qmv_variants import engine_header, engine_source

HEADER = engine_header()


# y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]), g = k / GS (MLX's affine mode);
# template T, M, K, N, GS, BITS, R (output rows per warp)
SOURCE = engine_source()  # the engine's kernel (crates/mlxrs-core/src/models/qmv.rs), one copy

try:  # CUDA only (the step mode's other variants also run on a CPU, to check the script)
    KERNEL = mx.fast.cuda_kernel(
        name="mlxrs_qmv", input_names=["x", "w", "scales", "biases"], output_names=["y"], source=SOURCE, header=HEADER
    )
except RuntimeError:
    KERNEL = None


ROWS = 2


def qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, gs: int) -> mx.array:
    m, k = x.shape
    n = w.shape[0]
    warps = (n + ROWS - 1) // ROWS
    return KERNEL(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("M", m), ("K", k), ("N", n), ("GS", gs), ("BITS", bits), ("R", ROWS)],
        grid=(warps * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )[0]


DENSE_SOURCE = """
    const unsigned lane = threadIdx.x & 31u;
    const unsigned row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (row0 >= (unsigned)N) return;
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    const uint4* wb = reinterpret_cast<const uint4*>(w);
    const uint4* xb = reinterpret_cast<const uint4*>(x);
    #pragma unroll 4
    for (int i = lane; i < K / 8; i += 32) {
        uint4 wv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = wb[(size_t)min(row0 + r, (unsigned)N - 1u) * (K / 8) + i];
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4 xr = xb[(size_t)m * (K / 8) + i];
            const T* xe = reinterpret_cast<const T*>(&xr);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const T* we = reinterpret_cast<const T*>(&wv[r]);
                #pragma unroll
                for (int t = 0; t < 8; ++t) acc[r][m] = fmaf(static_cast<float>(xe[t]), static_cast<float>(we[t]), acc[r][m]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && row0 + r < (unsigned)N) y[(size_t)m * N + row0 + r] = static_cast<T>(v);
        }
"""

try:
    DENSE = mx.fast.cuda_kernel(name="mlxrs_gemv_dev", input_names=["x", "w"], output_names=["y"], source=DENSE_SOURCE)
except RuntimeError:
    DENSE = None


def gemv(x: mx.array, w: mx.array, rows: int) -> mx.array:
    m, k = x.shape
    n = w.shape[0]
    warps = (n + rows - 1) // rows
    return DENSE(
        inputs=[x, w],
        template=[("T", x.dtype), ("M", m), ("K", k), ("N", n), ("R", rows)],
        grid=(warps * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )[0]


def dense_bench(reps: int) -> None:
    """bf16 weights: our gemv against `x @ w.T` on 8 x (32768 x 8192) bf16 (4.3 GB), and its error."""
    w = (mx.random.normal((4096, 4096)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    exact = x.astype(mx.float32) @ w.astype(mx.float32).T
    sc = mx.abs(exact).max().item()
    for rows in (1, 2, 4):
        d = mx.abs(gemv(x, w, rows).astype(mx.float32) - exact).max().item() / sc
        print(
            f"dense check rows={rows}: ours {d:.2e}  mlx {mx.abs((x @ w.T).astype(mx.float32) - exact).max().item() / sc:.2e}"
        )
    mats = [mx.random.normal((32768, 8192)).astype(mx.bfloat16) for _ in range(8)]
    mx.eval(mats)
    nbytes = sum(m.nbytes for m in mats)
    for m in (1, 2, 4):
        x = mx.random.normal((m, 8192)).astype(mx.bfloat16)
        fs = {f"ours r{r}": (lambda r=r: mx.eval([gemv(x, w, r) for w in mats])) for r in (1, 2, 4)}
        fs["mlx"] = lambda: mx.eval([x @ w.T for w in mats])
        times: dict[str, list[float]] = {k: [] for k in fs}
        for f in fs.values():
            f()
        for _ in range(reps):
            for name, f in fs.items():
                mx.synchronize()
                t = time.perf_counter()
                f()
                mx.synchronize()
                times[name].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"dense m={m}: " + "  ".join(f"{k} {nbytes / v / 1e9:.0f} GB/s" for k, v in med.items()), flush=True)


# An 8B decode step's matmuls as mlxrs fuses them: q/k/v (6144 rows), o, gate/up (28672), down.
STEP_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def step_split(bits: int, layers: int, steps: int, out: dict) -> None:
    """Host time against step time for a decode-shaped chain (32 layers of 8B shapes, rms norms,
    residual adds, SwiGLU, a 128256-row head, the argmax feeding the next step's embedding), its
    matmuls through MLX's quantized kernel, through ours (`mx.fast.cuda_kernel`), or replaced by a
    trivial op of the same output shape (the host's floor with no matmul work on the GPU). Host time =
    building the step and `mx.async_eval` returning (MLX encodes and launches on the calling thread);
    step time = the average over a pipelined loop as mlx-lm's (step n+1 built while n runs)."""

    def qparams(n: int, k: int) -> tuple[mx.array, mx.array, mx.array]:
        w = mx.random.randint(0, 2**31 - 1, (n, k * bits // 32)).astype(mx.uint32)
        s = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
        b = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
        return w, s, b

    mats = [[qparams(n, k) for n, k in STEP_SHAPES] for _ in range(layers)]
    head = qparams(128256, 4096)
    emb = (mx.random.normal((128256, 4096)) * 0.02).astype(mx.bfloat16)
    norm = mx.ones((4096,), dtype=mx.bfloat16)
    ones = {n: mx.ones((1, n), dtype=mx.bfloat16) for n, _ in STEP_SHAPES + [(128256, 0)]}
    mx.eval(mats, head, emb, norm, ones)

    def mm(kind: str, x: mx.array, p: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        w, s, b = p
        if kind == "mlx":
            return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)
        if kind == "ours":
            return qmv(x, w, s, b, bits, 64)
        return x[:, :1] * ones[w.shape[0]]

    def step(kind: str, tok: mx.array) -> mx.array:
        x = emb[tok]
        for qkv, o, gu, d in mats:
            h = mx.fast.rms_norm(x, norm, 1e-5)
            a = mm(kind, h, qkv)[:, :4096]
            x = x + mm(kind, a, o)
            h = mx.fast.rms_norm(x, norm, 1e-5)
            g, u = mx.split(mm(kind, h, gu), 2, axis=-1)
            x = x + mm(kind, nn_silu(g) * u, d)
        logits = mm(kind, mx.fast.rms_norm(x, norm, 1e-5), head)
        return mx.argmax(logits, axis=-1)

    for kind in ("mlx", "ours", "none") if KERNEL is not None else ("mlx", "none"):
        tok = mx.array([1])
        for _ in range(3):  # warm-up (kernel compilation)
            tok = step(kind, tok)
            mx.eval(tok)
        host = []
        mx.synchronize()
        t0 = time.perf_counter()
        nxt = step(kind, tok)
        mx.async_eval(nxt)
        for _ in range(steps):
            t = time.perf_counter()
            after = step(kind, nxt)
            mx.async_eval(after)
            host.append(time.perf_counter() - t)
            nxt.item()
            nxt = after
        nxt.item()
        total = (time.perf_counter() - t0) / (steps + 1)
        h = sorted(host)[len(host) // 2]
        row = dict(kind=kind, bits=bits, host_ms=h * 1e3, step_ms=total * 1e3, tok_s=1 / total)
        out.setdefault("step", []).append(row)
        print(
            f"step bits={bits} {kind}: host {h * 1e3:.2f} ms (build + async_eval), step {total * 1e3:.2f} ms"
            f" = {1 / total:.0f} tok/s",
            flush=True,
        )


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


SHAPES_8B = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--big", action="store_true", help="few large matrices (kernel bandwidth, not op overhead)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--overhead", action="store_true", help="time a chain of tiny ops per op")
    ap.add_argument("--dense", action="store_true", help="bf16 gemv kernel vs x @ w.T only")
    ap.add_argument("--rows", type=int, default=2, help="output rows per warp")
    ap.add_argument("--step", type=int, default=0, help="host vs step time of N decode-shaped steps, then stop")
    a = ap.parse_args()
    global ROWS
    ROWS = a.rows
    mx.random.seed(0)
    if a.dense:
        dense_bench(a.reps)
        return
    if a.step:
        res_step: dict = {}
        for bits in (4, 8):
            step_split(bits, a.layers, a.step, res_step)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res_step, f, indent=1)
        return
    res: dict = {"check": [], "speed": []}
    if a.overhead:
        for n_ops in (64, 256):
            xs = mx.ones((1, 64))
            for _ in range(3):
                mx.synchronize()
                t = time.perf_counter()
                y = xs
                for _ in range(n_ops):
                    y = y * 1.0001
                mx.eval(y)
                mx.synchronize()
                dt = time.perf_counter() - t
            print(f"overhead: {n_ops} dependent tiny ops {dt * 1e3:.2f} ms = {dt / n_ops * 1e6:.1f} us/op", flush=True)
            t = time.perf_counter()
            ys = [xs * float(i) for i in range(n_ops)]
            mx.eval(ys)
            mx.synchronize()
            dt = time.perf_counter() - t
            print(
                f"overhead: {n_ops} independent tiny ops {dt * 1e3:.2f} ms = {dt / n_ops * 1e6:.1f} us/op", flush=True
            )
    shapes = [(65536, 8192)] * 4 if a.big else SHAPES_8B
    layers = 1 if a.big else a.layers
    for bits in () if a.no_check else (4, 8):
        for m in (1, 2, 4, 8):
            for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]:
                w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                wq, s, b = mx.quantize(w, group_size=64, bits=bits)
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits)
                out = qmv(x, wq, s, b, bits, 64)
                # float32 reference of the same dequantized weights: which of the two is closer
                exact = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(mx.float32).T
                scale = mx.abs(exact).max().item()
                d_ours = (mx.abs(out.astype(mx.float32) - exact).max().item()) / scale
                d_mlx = (mx.abs(ref.astype(mx.float32) - exact).max().item()) / scale
                res["check"].append(dict(bits=bits, m=m, n=n, k=k, ours_vs_f32=d_ours, mlx_vs_f32=d_mlx))
                print(f"check bits={bits} m={m} {n}x{k}: ours {d_ours:.2e}  mlx {d_mlx:.2e}", flush=True)
    for bits in (4, 8):
        mats = []
        for _ in range(layers):
            for n, k in shapes:
                w = mx.random.randint(0, 2**31 - 1, (n, k * bits // 32)).astype(mx.uint32)
                s = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
                b = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
                mats.append((w, s, b))
            mx.eval(mats[-len(shapes) :])
        nbytes = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b in mats)
        for m in (1, 4, 8):
            xs = {kk: mx.random.normal((m, kk)).astype(mx.bfloat16) for kk in {k for _, k in shapes}}
            mx.eval(list(xs.values()))

            def run_ours() -> None:
                mx.eval([qmv(xs[w.shape[1] * 32 // bits], w, s, b, bits, 64) for w, s, b in mats])

            def run_mlx() -> None:
                mx.eval(
                    [
                        mx.quantized_matmul(
                            xs[w.shape[1] * 32 // bits], w, s, b, transpose=True, group_size=64, bits=bits
                        )
                        for w, s, b in mats
                    ]
                )

            times: dict[str, list[float]] = {"ours": [], "mlx": []}
            for f in (run_ours, run_mlx):
                f()
            for _ in range(a.reps):
                for name, f in (("ours", run_ours), ("mlx", run_mlx)):
                    mx.synchronize()
                    t = time.perf_counter()
                    f()
                    mx.synchronize()
                    times[name].append(time.perf_counter() - t)
            med = {kk: sorted(v)[len(v) // 2] for kk, v in times.items()}
            row = dict(
                bits=bits,
                m=m,
                gbytes=nbytes / 1e9,
                ours_s=med["ours"],
                mlx_s=med["mlx"],
                ours_gbs=nbytes / med["ours"] / 1e9,
                mlx_gbs=nbytes / med["mlx"] / 1e9,
            )
            res["speed"].append(row)
            print(
                f"speed bits={bits} m={m}: {nbytes / 1e9:.2f} GB  ours {row['ours_gbs']:.0f} GB/s  "
                f"mlx {row['mlx_gbs']:.0f} GB/s  ratio {med['mlx'] / med['ours']:.2f}x",
                flush=True,
            )
        mats.clear()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
