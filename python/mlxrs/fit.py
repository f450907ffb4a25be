"""`mlxrs fit`: will a model and a context fit this machine (or a known GPU / Mac)?

The numbers come from the memory planner in the Rust core (crates/mlxrs-core/src/plan.rs, through
`_native.plan` and `_native.model_facts`), the same one the server's memory admission uses: weights
bytes from the safetensors headers (no tensor is loaded), KV bytes from the config, the calibrated
prefill transient, a fixed reserve, and the budget.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import _native
from .registry import human_bytes, table

GIB = 1 << 30


@dataclass(frozen=True)
class Sku:
    name: str
    kind: str  # "apple" (unified memory, Metal) | "nvidia" (GPU memory, CUDA)
    memory_gib: float
    bandwidth_gbs: float  # memory bandwidth, GB/s (decimal), the vendor's figure

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def backend(self) -> str:
        return "metal" if self.kind == "apple" else "cuda"


def _apple(chip: str, sizes: tuple[int, ...], bw: float) -> list[Sku]:
    return [Sku(f"{chip} {gb}GB", "apple", gb, bw) for gb in sizes]


# Apple Silicon: every unified-memory size Apple sold for each chip, and its memory bandwidth.
# Apple's "GB" of unified memory is GiB (`sysctl hw.memsize` of a 16GB Mac is 17179869184).
# Sources: Apple's technical specifications pages (support.apple.com/specs: MacBook Air, MacBook Pro,
# Mac mini, iMac, Mac Studio and Mac Pro of each generation) and the chip announcements in Apple
# Newsroom (M1 2020-11-10, M1 Pro/Max 2021-10-18, M1 Ultra 2022-03-08, M2 2022-06-06, M2 Pro/Max
# 2023-01-17, M2 Ultra 2023-06-05, M3 family 2023-10-30, M4 2024-05-07, M4 Pro/Max 2024-10-30,
# M3 Ultra 2025-03-05). Where a chip comes in two bins, the memory sizes go with the bin that offers them:
# M3 Max 14-core CPU (300 GB/s) with 36 or 96GB, 16-core (400 GB/s) with 48, 64 or 128GB; M4 Max 14-core
# (410 GB/s) with 36GB, 16-core (546 GB/s) with 48, 64 or 128GB.
APPLE_SKUS: tuple[Sku, ...] = tuple(
    _apple("M1", (8, 16), 68.25)
    + _apple("M1 Pro", (16, 32), 200)
    + _apple("M1 Max", (32, 64), 400)
    + _apple("M1 Ultra", (64, 128), 800)
    + _apple("M2", (8, 16, 24), 100)
    + _apple("M2 Pro", (16, 32), 200)
    + _apple("M2 Max", (32, 64, 96), 400)
    + _apple("M2 Ultra", (64, 128, 192), 800)
    + _apple("M3", (8, 16, 24), 100)
    + _apple("M3 Pro", (18, 36), 150)
    + _apple("M3 Max", (36, 96), 300)
    + _apple("M3 Max", (48, 64, 128), 400)
    + _apple("M3 Ultra", (96, 256, 512), 819)
    + _apple("M4", (16, 24, 32), 120)
    + _apple("M4 Pro", (24, 48, 64), 273)
    + _apple("M4 Max", (36,), 410)
    + _apple("M4 Max", (48, 64, 128), 546)
)

# NVIDIA GPUs common for local and hosted inference: memory (GiB, as the vendor sells it; the driver
# reports a few hundred MiB less, which the budget's 25% margin absorbs) and bandwidth (GB/s).
# Sources: NVIDIA's product pages and datasheets — GeForce RTX 3060/3090 (nvidia.com "GeForce RTX
# 30 Series" specs), RTX 4060 Ti/4080/4090 ("RTX 40 Series" specs), RTX 5090 ("RTX 50 Series" specs),
# T4 (T4 datasheet: 16 GB GDDR6, 320 GB/s), A10 (24 GB, 600 GB/s), L4 (L4 datasheet: 24 GB,
# 300 GB/s), L40S (48 GB, 864 GB/s), A100 (A100 datasheet: 40 GB HBM2 1555 GB/s; 80 GB HBM2e
# 2039 GB/s SXM), H100 (H100 datasheet: 80 GB, SXM 3.35 TB/s, PCIe 2.0 TB/s), H200 (H200 product
# page: 141 GB HBM3e, 4.8 TB/s), RTX 6000 Ada (48 GB, 960 GB/s).
NVIDIA_SKUS: tuple[Sku, ...] = (
    Sku("RTX 3060 12GB", "nvidia", 12, 360),
    Sku("RTX 4060 Ti 16GB", "nvidia", 16, 288),
    Sku("RTX 4080 16GB", "nvidia", 16, 717),
    Sku("RTX 3090 24GB", "nvidia", 24, 936),
    Sku("RTX 4090 24GB", "nvidia", 24, 1008),
    Sku("RTX 5090 32GB", "nvidia", 32, 1792),
    Sku("RTX 6000 Ada 48GB", "nvidia", 48, 960),
    Sku("T4 16GB", "nvidia", 16, 320),
    Sku("L4 24GB", "nvidia", 24, 300),
    Sku("A10 24GB", "nvidia", 24, 600),
    Sku("L40S 48GB", "nvidia", 48, 864),
    Sku("A100 40GB", "nvidia", 40, 1555),
    Sku("A100 80GB", "nvidia", 80, 2039),
    Sku("H100 80GB PCIe", "nvidia", 80, 2000),
    Sku("H100 80GB SXM", "nvidia", 80, 3350),
    # nvidia-smi on the H200 test machine: 143771 MiB (bench/RESULTS-fit.md)
    Sku("H200 141GB", "nvidia", 143771 / 1024, 4800),
)

SKUS: tuple[Sku, ...] = APPLE_SKUS + NVIDIA_SKUS


def _budget_is_bytes(budget: str | None) -> bool:
    if budget is None:
        return False
    try:
        f = float(budget)
    except ValueError:
        return True
    return not 0 < f <= 1


def plan(
    model: str | os.PathLike[str],
    ctx: int | None = None,
    kv_bits: int | None = None,
    budget: str | None = None,
    device_bytes: int | None = None,
    fused_attention: bool | None = None,
    backend: str | None = None,
    stream_experts: bool = False,
    expert_cache_bytes: int | None = None,
    expert_prefetch: bool | None = None,
    adapters: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """The MemoryPlan (schemaVersion 1) for a model directory or .gguf file. A mixture-of-experts
    model that does not fit, or `stream_experts`, gets the `streamed-experts` strategy. `adapters`:
    LoRA adapter directories served with it; their tensors count as weights."""
    return dict(
        json.loads(
            _native.plan(
                str(model),
                ctx,
                kv_bits,
                budget,
                device_bytes=device_bytes,
                fused_attention=fused_attention,
                backend=backend,
                stream_experts=stream_experts,
                expert_cache_bytes=expert_cache_bytes,
                expert_prefetch=expert_prefetch,
                adapter_bytes=adapter_bytes(adapters),
            )
        )
    )


def adapter_bytes(adapters: Sequence[str | os.PathLike[str]]) -> int:
    """Bytes of the tensors of LoRA adapter directories (their adapters.safetensors, header aside:
    what loading them keeps resident). A fused adapter replaces base weights: counted anyway, the
    safe side."""
    total = 0
    for d in adapters:
        f = os.path.join(os.fspath(d), "adapters.safetensors")
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                header = int.from_bytes(fh.read(8), "little")
            total += max(0, os.path.getsize(f) - 8 - header)
    return total


def sku_plans(
    model: str | os.PathLike[str], ctx: int | None = None, kv_bits: int | None = None, budget: str | None = None
) -> list[dict[str, Any]]:
    """One plan per SKU. A fraction budget applies to each SKU's memory; a byte budget is capped
    at it. Each is planned for its backend (Metal on Macs, CUDA on NVIDIA GPUs): attention as MLX
    0.30.6 runs it there (fused on Metal; on CUDA fused for 16-bit models, materialized scores for
    float32 ones) and three decoder layers' prefill activations alive at once (bench/RESULTS-fit.md)."""
    out = []
    for s in SKUS:
        b = budget
        if _budget_is_bytes(budget):
            probe = plan(model, ctx, kv_bits, budget, s.memory_bytes, backend=s.backend)
            if probe["usableBytes"] > s.memory_bytes:
                b = str(s.memory_bytes)
        p = plan(model, ctx, kv_bits, b, s.memory_bytes, backend=s.backend)
        # the bandwidth roofline: each decoded token reads the weights and the KV cache once
        read = p["weightsBytes"] + p["kvBytes"]
        ceiling = s.bandwidth_gbs * 1e9 / read if read else None
        out.append(
            {
                "sku": s.name,
                "kind": s.kind,
                "memoryBytes": s.memory_bytes,
                "bandwidthGBs": s.bandwidth_gbs,
                "decodeTpsCeiling": ceiling,
                "plan": p,
            }
        )
    return out


def _facts(model: str | os.PathLike[str], kv_bits: int | None) -> dict[str, Any]:
    return dict(json.loads(_native.model_facts(str(model), kv_bits)))


def _kv_line(f: dict[str, Any], kv_bits: int | None) -> str:
    per_layer = float(f["kv_bytes_per_token_layer"])
    sliding = [w for w in f["sliding"] if w is not None]
    # the layers with a growing KV of their own (not sliding, shared-KV or linear-attention layers)
    kv_elems = f.get("kv_elems") or [1] * len(f["sliding"])
    full = sum(1 for w, e in zip(f["sliding"], kv_elems) if w is None and e > 0)
    dtype = f"{kv_bits}-bit" if kv_bits else {4: "float32", 2: "16-bit"}.get(int(f["act_bytes"]), f"{f['act_bytes']} B")
    elems = max(f.get("kv_elems") or [0])
    if elems and elems != f["num_kv_heads"] * f["head_dim"] * 2:  # latent attention: latent + rope key
        s = f"{human_bytes(int(per_layer * full))}/token: {full} layers × {elems} cached elements × {dtype}"
    else:
        s = (
            f"{human_bytes(int(per_layer * full))}/token: {full} layers × {f['num_kv_heads']} KV heads × "
            f"{f['head_dim']} × K,V × {dtype}"
        )
    if sliding:
        s += f"; {len(sliding)} sliding-window layers capped at {max(sliding)} tokens"
    if f.get("state_bytes"):
        s += f"; + {human_bytes(int(f['state_bytes']))} of linear-attention state per sequence"
    return s


def describe(model_path: Path, label: str, p: dict[str, Any], kv_bits: int | None, budget: str | None) -> str:
    """The readable report of one plan."""
    f = _facts(model_path, kv_bits)
    dev_bytes, dev_source = _native.device_memory()
    if budget is None:
        bsrc = f"0.75 × device memory ({human_bytes(dev_bytes)}, {dev_source})"
    elif _budget_is_bytes(budget):
        bsrc = f"--memory-budget {budget}"
    else:
        bsrc = f"--memory-budget {budget} × device memory ({human_bytes(dev_bytes)}, {dev_source})"
    model_ctx = f.get("max_position_embeddings")
    rows = [
        ["model", f"{label} ({f['model_type']}, {f['num_layers']} layers)"],
        ["context", f"{p['contextTokens']} tokens" + (f" (model maximum {model_ctx})" if model_ctx else "")],
        [
            "weights",
            f"{human_bytes(p['weightsBytes'])}  ("
            + (
                f"GGUF header, as its {_native.default_import_dtype()} import"
                if model_path.suffix.lower() == ".gguf"
                else "safetensors headers"
            )
            + ")",
        ],
        ["KV cache", f"{human_bytes(p['kvBytes'])}  ({_kv_line(f, kv_bits)})"],
        [
            "transient",
            f"{human_bytes(p['transientBytes'])}  (prefill activations, calibrated"
            + (
                f"; with {human_bytes(p['mediaTransientBytes'])} of encoding one image at the largest size"
                if p.get("mediaTransientBytes")
                else ""
            )
            + (
                f"; {human_bytes(p['audioTransientBytes'])} of encoding one audio clip of the longest length"
                + (" (the larger counts)" if p.get("mediaTransientBytes") else "")
                if p.get("audioTransientBytes")
                else ""
            )
            + ")",
        ],
        ["reserve", f"{human_bytes(p['reserveBytes'])}  (runtime, tokenizer, allocator slack)"],
        *(
            [
                [
                    "experts",
                    f"streamed from the files ({human_bytes(p['streamedExpertBytes'])}); expert cache "
                    f"{human_bytes(p['expertCacheBytes'])} ({100 * p['expertCacheFraction']:.0f}% of the experts, "
                    "counted in weights"
                    + (
                        f"; at least {human_bytes(p['expertCacheFloorBytes'])}, one token's routed experts: "
                        "the context gives way"
                        if p.get("expertCacheFloorBytes")
                        else ""
                    )
                    + f"); predicted {human_bytes(int(p['predictedExpertBytesPerToken']))} read per token "
                    "(uniform routing)",
                ]
            ]
            if p["strategy"] == "streamed-experts"
            else []
        ),
        ["total", human_bytes(p["totalBytes"])],
        ["budget", f"{human_bytes(p['usableBytes'])}  ({bsrc})"],
        ["max context", f"{p['maxSafeContext']} tokens fit the budget"],
    ]
    if p["fits"] and p["strategy"] == "streamed-experts":
        verdict = (
            f"fits with the experts streamed from disk: {p['contextTokens']} tokens need "
            f"{human_bytes(p['totalBytes'])} of {human_bytes(p['usableBytes'])} (all weights: "
            f"{human_bytes(p['weightsBytes'] - p['expertCacheBytes'] + p['streamedExpertBytes'])})"
        )
    elif p["fits"]:
        verdict = (
            f"fits: {p['contextTokens']} tokens need {human_bytes(p['totalBytes'])} of {human_bytes(p['usableBytes'])}"
        )
    elif p["maxSafeContext"] > 0:
        verdict = (
            f"does not fit at {p['contextTokens']} tokens — up to {p['maxSafeContext']} tokens do"
            + (
                f" beside the expert cache's floor of {human_bytes(p['expertCacheFloorBytes'])}"
                if p.get("expertCacheFloorBytes")
                else ""
            )
            + ("" if kv_bits == 4 else "; --kv-quant 4|8 gives a longer context in the same memory")
        )
    else:
        verdict = (
            "does not fit: the weights and the reserve alone exceed the budget — pick a smaller "
            "or quantized model, or raise --memory-budget"
        )
    rows.append(["verdict", verdict])
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def describe_skus(label: str, plans: list[dict[str, Any]]) -> str:
    rows = []
    for r in plans:
        p = r["plan"]
        rows.append(
            [
                r["sku"],
                f"{r['memoryBytes'] / GIB:.0f} GiB",
                human_bytes(p["usableBytes"]),
                "yes" if p["fits"] else "no",
                str(p["maxSafeContext"]),
                f"{r['decodeTpsCeiling']:.0f}" if r["decodeTpsCeiling"] else "-",
            ]
        )
    ctx = plans[0]["plan"]["contextTokens"] if plans else 0
    head = f"{label}: weights {human_bytes(plans[0]['plan']['weightsBytes']) if plans else '-'}, context {ctx} tokens"
    return (
        head
        + "\n"
        + table(rows, ["SKU", "MEMORY", "BUDGET", f"FITS@{ctx}", "MAX CONTEXT", "TOK/S≤"])
        + "\nTOK/S≤: memory bandwidth ÷ (weights + KV), an upper bound on decode speed, not a measurement"
    )
