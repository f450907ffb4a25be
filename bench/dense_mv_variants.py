"""The engine's dense (bf16) matvec kernel (`SOURCE_DENSE` of crates/mlxrs-core/src/models/qmv.rs)
against MLX's `x @ w.T`, in variants, and a read-only kernel as the bandwidth ceiling (issue #11: 8B bf16
decode at >= 85% of the copy bound). Needs only MLX's CUDA bundle on the GPU machine:

    . bench/device_site.sh; python3 bench/dense_mv_variants.py [--layers 32] [--reps 5] [--out v.json]

Each variant is the engine's text with other `#define`s ahead of its header: how a lane loads W (the
engine's non-caching load with a 256-byte L2 fetch, or a plain load), how many loop steps are in
flight (`MLXRS_DENSE_UNROLL`) and output rows a warp (R). First each is checked against float32
products (max |diff| / max |y|, one row and four; with the RMSNorm prologue against `rms_norm(x) @ w.T`),
then timed over the decode step's matrices of an 8B (or 1B) model, every layer its own weights (so the
50 MB L2 does not serve them), one launch per matrix as a decode step makes them: GB/s of weights read,
medians of `--reps`. Wall time includes MLX's host cost per launch (larger for custom kernels), so
`--profile` under Nsight Compute gives each kernel's own GPU time (and, on the q/k/v shape, the engine's
fused q/k/v kernel with the norm and rotary epilogue, its positions made from host data or on the GPU:
`ROPE`):

    ncu --kernel-name regex:'mlxrs_mv|gemv|gemm' --metrics gpu__time_duration.sum --clock-control none \
        --csv --log-file /tmp/d.csv python3 bench/dense_mv_variants.py --profile --reps 3
    python3 bench/dense_mv_variants.py --report /tmp/d.csv --reps 3 --out d.json
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time

import mlx.core as mx
from qmv_variants import QMV_RS, _kernel_of

TEXT = QMV_RS.read_text()
HEADER = _kernel_of(TEXT, "HEADER")
SOURCE = _kernel_of(TEXT, "NORM_PROLOGUE") + _kernel_of(TEXT, "NORM_STAGE") + _kernel_of(TEXT, "SOURCE_DENSE")

STREAM = "#define MLXRS_LDW(p) mlxrs_ld_stream(p)\n"  # ld.global.nc.L1::no_allocate.L2::256B
U8 = "#define MLXRS_DENSE_UNROLL 8\n"
VARIANTS = {  # name: (defines, rows a warp)
    "engine": (U8, 1),  # the engine's plain and residual products (qmv.rs DENSE_ROWS_PER_WARP)
    "r2": ("", 2),  # the engine's SwiGLU and rotary products (two rows a warp, 4 steps)
    "stream": (STREAM + U8, 1),
    "r1_u4": ("", 1),
    "r1_u16": ("#define MLXRS_DENSE_UNROLL 16\n", 1),
    "r4_u2": ("#define MLXRS_DENSE_UNROLL 2\n", 4),
    # the paired products (SwiGLU, rotary: two rows a warp) with 8 steps in flight: no faster (an H100,
    # bench/RESULTS-gpu.md 2026-12-07)
    "r2_u8": (U8, 2),
}
# profiled besides the variants: the engine's kernels with the RMSNorm prologue (its cost)
NORMED = ["engine_norm", "r2_norm", "r2_u8_norm"]
# and the engine's fused q/k/v kernel itself (norm prologue, rotary epilogue, q/k/v as three outputs) on
# the q/k/v shape only, its positions input made two ways: from host data for each launch (the engine's
# way: MLX puts it in managed memory) or on the GPU by arange. In the 8B step this kernel takes ~34-36 us
# against ~19 for r2_norm alone (bench/RESULTS-gpu.md): which of the epilogue and the positions it is.
TRIG = "const float c_ = cos(th_), s_ = sin(th_);"
ROPE = {  # name: (positions from the host, traditional pairs, the header's trigonometry replaced by)
    "rope_norm_hostpos": (True, False, None),  # the engine's reference (MLXRS_CUDA_ROPE_TABLE=0)
    # 8 loop steps in flight ("U8": the trigonometry line is kept, MLXRS_DENSE_UNROLL 8 goes ahead of the
    # header)
    "rope_norm_hostpos_u8": (True, False, "U8"),
    "rope_norm_devpos_u8": (False, False, "U8"),
    "rope_norm_devpos": (False, False, None),  # the engine's default (a view of the table)
    # sincosf's fast intrinsic (not MLX's precise cos/sin: checked, not for the engine as is)
    "rope_norm_devpos_fasttrig": (False, False, "float s_, c_; __sincosf(th_, &s_, &c_);"),
    # the precise sincosf (one range reduction for both; no stack frame, where cos and sin have 32 bytes)
    "rope_norm_devpos_sincosf": (False, False, "float s_, c_; sincosf(th_, &s_, &c_);"),
    # no trigonometry at all (c = 1, s = theta * 1e-30: the product and the stores alone; not checked)
    "rope_norm_devpos_notrig": (False, False, "const float c_ = 1.f, s_ = th_ * 1e-30f;"),
    # adjacent rows a warp (rows 2j, 2j + 1: MLX's traditional rope) instead of j, j + head_dim/2
    "rope_norm_devpos_trad": (False, True, None),
}
ROPE_HEADS = (32, 8, 128)  # an 8B model's q heads, kv heads, head_dim (the qkv shape's 6144 rows)
ROPE_BASE = 500000.0

# A read of every byte once, nothing else: the ceiling a matvec could reach
READ_SOURCE = """
    const size_t n = (size_t)N / 16;
    const uint4* p = reinterpret_cast<const uint4*>(w);
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = MLXRS_LDW(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) y[0] = 1;
"""

KERNELS: dict[tuple[str, bool], object] = {}


def kernel(name: str, norm: bool):  # noqa: ANN201
    key = (name, norm)
    if key not in KERNELS:
        defines = VARIANTS[name][0] + ("#define MLXRS_NORM\n" if norm else "")
        KERNELS[key] = mx.fast.cuda_kernel(
            name=f"mlxrs_mv_{name}{'_norm' if norm else ''}",
            input_names=["x", "w"] + (["nw"] if norm else []),
            output_names=["y"],
            source=SOURCE,
            header=defines + HEADER,
        )
    return KERNELS[key]


def f32_bits(f: float) -> int:
    """A float32's bits as an int (float template arguments: the kernels read them with __int_as_float)."""
    return struct.unpack("<i", struct.pack("<f", f))[0]


def mv(name: str, x: mx.array, w: mx.array, nw: mx.array | None = None, eps: float = 1e-5) -> mx.array:
    m, k = x.shape
    n = w.shape[0]
    r = VARIANTS[name][1]
    template = [("T", x.dtype), ("M", m), ("K", k), ("N", n), ("R", r)]
    inputs = [x, w]
    if nw is not None:
        inputs.append(nw)
        template.append(("EPS_BITS", f32_bits(eps)))
    return kernel(name, nw is not None)(
        inputs=inputs,
        template=template,
        grid=((n + r - 1) // r * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )[0]


ROPE_KERNELS: dict[str | None, object] = {}


def mv_rope(
    x: mx.array,
    w: mx.array,
    nw: mx.array,
    pos: mx.array,
    eps: float = 1e-5,
    trad: bool = False,
    trig: str | None = None,
) -> list[mx.array]:
    """The engine's q/k/v kernel as `qmv::launch` makes it for `Kind::Rope` with a norm (two rows a warp,
    4 steps, `MLXRS_ROPE`, base rope without `freqs`): q, k, v as `[M, heads * head_dim]`; `trig` replaces
    the header's cos/sin line (ROPE's variants)."""
    if trig not in ROPE_KERNELS:
        if TRIG not in HEADER:
            raise SystemExit(f"qmv.rs's HEADER no longer has {TRIG!r}: update ROPE")
        ROPE_KERNELS[trig] = mx.fast.cuda_kernel(
            name=f"mlxrs_mv_rope_norm{len(ROPE_KERNELS)}",
            input_names=["x", "w", "pos", "nw"],
            output_names=["q_out", "k_out", "v_out"],
            source=SOURCE,
            header="#define MLXRS_ROPE\n#define MLXRS_NORM\n"
            + (U8 if trig == "U8" else "")
            + (HEADER if trig in (None, "U8") else HEADER.replace(TRIG, trig)),
        )
    m, k = x.shape
    n = w.shape[0]
    hq, hkv, hd = ROPE_HEADS
    template = [("T", x.dtype), ("M", m), ("K", k), ("N", n), ("R", 2)]
    template += [("HD", hd), ("QR", hq * hd), ("KR", hkv * hd), ("TRAD", int(trad)), ("SCALE_BITS", f32_bits(1.0))]
    template += [("LOG2B_BITS", f32_bits(math.log2(ROPE_BASE))), ("EPS_BITS", f32_bits(eps))]
    return ROPE_KERNELS[trig](  # type: ignore[operator]
        inputs=[x, w, pos, nw],
        template=template,
        grid=(n // 2 * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(m, hq * hd), (m, hkv * hd), (m, hkv * hd)],
        output_dtypes=[x.dtype] * 3,
    )


def rope_run(kind: str, x: mx.array, w: mx.array, nw: mx.array, p: int) -> list[mx.array]:
    """ROPE's variant `kind` at positions p.. for x's rows."""
    host, trad, trig = ROPE[kind]
    return mv_rope(x, w, nw, rope_positions(host, p, x.shape[0]), trad=trad, trig=trig)


def rope_positions(host: bool, p: int, m: int) -> mx.array:
    """Positions p.. for m rows: from host data, or made on the GPU (at least 3 values: past MLX's pool of
    8-byte blocks)."""
    if host:
        return mx.array(list(range(p, p + m)), dtype=mx.int32)
    return mx.arange(p, p + max(m, 3), dtype=mx.int32)


def check_rope(out: dict) -> None:
    """The rope kernel against MLX's ops: rms_norm, the product, the heads split, `fast.rope` at p."""
    hq, hkv, hd = ROPE_HEADS
    w = (mx.random.normal(((hq + 2 * hkv) * hd, 4096)) * 0.02).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((4096,))).astype(mx.bfloat16)
    for m in (1, 4):
        x = mx.random.normal((m, 4096)).astype(mx.bfloat16)
        y = mx.fast.rms_norm(x, nw, 1e-5) @ w.T
        q, kk, v = mx.split(y, [hq * hd, (hq + hkv) * hd], axis=-1)
        refs = {}
        for trad in (False, True):
            ref = []
            for t, h in ((q, hq), (kk, hkv)):
                heads = t.reshape(m, h, 1, hd)  # one token a row: rope each row at its own position
                ref.append(
                    mx.concatenate(
                        [
                            mx.fast.rope(
                                heads[i : i + 1], hd, traditional=trad, base=ROPE_BASE, scale=1.0, offset=700 + i
                            )
                            for i in range(m)
                        ]
                    ).reshape(m, h * hd)
                )
            ref.append(v)
            refs[trad] = ref
        for kind, (_, trad, trig) in ROPE.items():
            if trig is not None and "1e-30" in trig:
                continue  # no rotation: nothing to check
            got = rope_run(kind, x, w, nw, 700)
            err = max(
                (mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / mx.abs(b.astype(mx.float32)).max()).item()
                for a, b in zip(got, refs[trad])
            )
            out[f"check_{kind}_m{m}"] = err
            print(f"check {kind} m={m}: max |diff| / max |y| {err:.2e}", flush=True)


def check(out: dict) -> None:
    w = (mx.random.normal((6144, 4096)) * 0.02).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((4096,))).astype(mx.bfloat16)
    for m in (1, 4):
        x = mx.random.normal((m, 4096)).astype(mx.bfloat16)
        exact = x.astype(mx.float32) @ w.astype(mx.float32).T
        normed = mx.fast.rms_norm(x, nw, 1e-5)
        exact_n = normed.astype(mx.float32) @ w.astype(mx.float32).T
        sc, scn = mx.abs(exact).max().item(), mx.abs(exact_n).max().item()
        row = {"mlx": mx.abs((x @ w.T).astype(mx.float32) - exact).max().item() / sc}
        row["mlx_norm"] = mx.abs((normed @ w.T).astype(mx.float32) - exact_n).max().item() / scn
        for name in VARIANTS:
            row[name] = mx.abs(mv(name, x, w).astype(mx.float32) - exact).max().item() / sc
            row[name + "_norm"] = mx.abs(mv(name, x, w, nw).astype(mx.float32) - exact_n).max().item() / scn
        out[f"check_m{m}"] = row
        print(f"check m={m}: " + "  ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)
    check_rope(out)


def read_ceiling(mats: list[mx.array], reps: int) -> float:
    k = mx.fast.cuda_kernel(name="mlxrs_read", input_names=["w"], output_names=["y"], source=READ_SOURCE, header=HEADER)

    def run() -> None:
        mx.eval(
            [
                k(
                    inputs=[w],
                    template=[("N", w.nbytes)],
                    grid=(132 * 2048, 1, 1),
                    threadgroup=(256, 1, 1),
                    output_shapes=[(1,)],
                    output_dtypes=[mx.uint32],
                )[0]
                for w in mats
            ]
        )

    return timed(run, reps)


def timed(f, reps: int) -> float:  # noqa: ANN001
    f()
    ts = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        f()
        mx.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def step_bench(shape: str, layers: int, reps: int, out: dict) -> None:
    h, inter, qkv = {"8b": (4096, 14336, 6144), "1b": (2048, 8192, 3072)}[shape]
    shapes = [(qkv, h), (h, h), (2 * inter, h), (h, inter)]
    mats = [mx.random.normal((n, k)).astype(mx.bfloat16) for _ in range(layers) for n, k in shapes]
    mx.eval(mats)
    nbytes = sum(w.nbytes for w in mats)
    res: dict[str, float] = {}
    res["read_ceiling"] = nbytes / read_ceiling(mats, reps) / 1e9
    for m in (1, 4):
        xs = {k: mx.random.normal((m, k)).astype(mx.bfloat16) for k in (h, inter)}
        mx.eval(list(xs.values()))
        fs = {"mlx": lambda: mx.eval([xs[w.shape[1]] @ w.T for w in mats])}
        for name in VARIANTS:
            fs[name] = lambda name=name: mx.eval([mv(name, xs[w.shape[1]], w) for w in mats])
        for name, f in fs.items():
            res[f"{name}_m{m}"] = nbytes / timed(f, reps) / 1e9
        print(f"{shape} m={m} GB/s: " + "  ".join(f"{k} {res[f'{k}_m{m}']:.0f}" for k in fs), flush=True)
    print(f"{shape} read ceiling {res['read_ceiling']:.0f} GB/s ({nbytes / 1e9:.1f} GB)", flush=True)
    out[shape] = res


PROFILE_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


def profile_launches(reps: int) -> list[tuple[str, str]]:
    """(variant, shape) of each launch `--profile` makes, in order: each variant (MLX's `x @ w.T` first)
    over every 8B decode shape, `reps` times, each time on its own weights; then the ROPE kernels on the
    q/k/v shape."""
    return [(v, s) for v in ["mlx", *VARIANTS, *NORMED] for _ in range(reps) for s in PROFILE_SHAPES] + [
        (v, "qkv") for v in ROPE for _ in range(reps)
    ]


def profile(reps: int) -> None:
    """The launches of `profile_launches`, one product each, evaluated one at a time (for Nsight
    Compute: `ncu --kernel-name regex:'mlxrs_mv|gemv' --metrics gpu__time_duration.sum --csv`)."""
    mats = {
        s: [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(reps)] for s, shape in PROFILE_SHAPES.items()
    }
    mx.eval(mats)
    xs = {k: mx.random.normal((1, k)).astype(mx.bfloat16) for k in (4096, 14336)}
    mx.eval(list(xs.values()))
    nws = {k: mx.ones((k,), mx.bfloat16) for k in xs}
    for v in ["mlx", *VARIANTS, *NORMED]:
        for r in range(reps):
            for s in PROFILE_SHAPES:
                w = mats[s][r]
                x = xs[w.shape[1]]
                if v == "mlx":
                    mx.eval(x @ w.T)
                elif v in NORMED:
                    mx.eval(mv(v.removesuffix("_norm"), x, w, nws[w.shape[1]]))
                else:
                    mx.eval(mv(v, x, w))
    for v in ROPE:
        for r in range(reps):
            w = mats["qkv"][r]
            mx.eval(rope_run(v, xs[4096], w, nws[4096], 700 + r))


def report(log: str, reps: int, out: dict) -> None:
    """Each variant's median GPU time per shape (µs, GB/s) from the ncu log of `profile`, and one 8B
    decode step's matvecs (32 layers + the head)."""
    from gpu_profile import ncu_kernel_times

    kern = [(n, us) for n, us in ncu_kernel_times(log) if "mlxrs_mv" in n or "gemv" in n or "gemm" in n.lower()]
    want = profile_launches(reps)
    if len(kern) != len(want):
        raise SystemExit(f"{len(kern)} kernels in {log}, {len(want)} launches expected")
    times: dict[tuple[str, str], list[float]] = {}
    for (v, s), (_, us) in zip(want, kern):
        times.setdefault((v, s), []).append(us)
    for v in ["mlx", *VARIANTS, *NORMED]:
        row = {}
        for s, (n, k) in PROFILE_SHAPES.items():
            t = sorted(times[(v, s)])[reps // 2]
            row[s] = {"us": t, "GB_s": n * k * 2 / t / 1e3}
        row["step_ms"] = (sum(32 * row[s]["us"] for s in ("qkv", "o", "gate_up", "down")) + row["head"]["us"]) / 1e3
        out[v] = row
        print(
            f"{v:10}"
            + "".join(f"{s} {row[s]['us']:7.1f} us ({row[s]['GB_s']:4.0f})  " for s in PROFILE_SHAPES)
            + f"step {row['step_ms']:.3f} ms",
            flush=True,
        )
    n, k = PROFILE_SHAPES["qkv"]
    for v in ROPE:
        t = sorted(times[(v, "qkv")])[reps // 2]
        out[v] = {"qkv": {"us": t, "GB_s": n * k * 2 / t / 1e3}}
        print(f"{v:18} qkv {t:7.1f} us ({n * k * 2 / t / 1e3:4.0f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="8b,1b")
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true", help="only the checks against float32 products")
    ap.add_argument("--profile", action="store_true", help="only the launches to profile (under ncu)")
    ap.add_argument("--report", help="an ncu CSV log of --profile: GPU time per variant and shape")
    a = ap.parse_args()
    out: dict = {}
    if a.check:
        check(out)
        return
    if a.profile:
        profile(a.reps)
        return
    if a.report:
        report(a.report, a.reps, out)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        return
    check(out)
    for s in a.shapes.split(","):
        step_bench(s, a.layers if s == "8b" else 16, a.reps, out)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
