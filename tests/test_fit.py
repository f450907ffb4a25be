"""`mlxrs fit` and the memory planner behind it (crates/mlxrs-core/src/plan.rs):

- its estimate against the MEASURED peak memory of real loads and generations (MLX's peak memory
  counter over one generation, `Completion.timings.peak_memory`) of test models large enough that
  weights, KV cache and prefill activations dominate fixed overheads, at several context lengths
  and with a quantized KV cache: within 15%;
- the `--json` MemoryPlan schema (schemaVersion 1), the readable report and `--skus`;
- the server's memory admission honouring the planner's maxSafeContext at the boundary.

The planner's `totalBytes` also holds `reserveBytes` (the Python process, the MLX runtime, the
tokenizer), which MLX's allocator does not count; the comparison with MLX's peak is of the rest,
weights + KV + transient. The reserve is checked separately against the resident set size of a
process that loads and generates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxrs import _native
from cli_util import run_cli
from server_util import Server
from tinymodels import FIT_MODELS, make_fit_model, make_model

TOLERANCE = 0.15
SCHEMA_KEYS = {
    "schemaVersion",
    "strategy",
    "fits",
    "contextTokens",
    "maxSafeContext",
    "weightsBytes",
    "kvBytes",
    "transientBytes",
    "reserveBytes",
    "totalBytes",
    "usableBytes",
    "predictedDecodeTps",
    "allocatorLimitBytes",
}

MODELS = FIT_MODELS  # tests/tinymodels.py

# (model, prompt tokens, kv bits); the calibration table of TRANSIENT_SLACK (bench/RESULTS-fit.md) lists these
# and more (bfloat16 prompts of 2048+ tokens take minutes on the CPU)
CASES = [
    ("fit-llama-f32", 512, None),
    ("fit-llama-f32", 2048, None),
    ("fit-llama-f32", 4000, None),
    ("fit-llama-f32", 3000, 8),
    ("fit-llama-f32", 3000, 4),
    ("fit-gemma3-f32", 1000, None),
    ("fit-gemma3-f32", 4000, None),
    ("fit-qwen3-bf16", 512, None),
    ("fit-qwen3-bf16", 1000, None),
]
GENERATED = 2


model = make_fit_model


def plan(
    d: Path | str, ctx: int | None = None, kv_bits: int | None = None, budget: str | None = None, **kw: Any
) -> dict[str, Any]:
    return dict(json.loads(_native.plan(str(d), ctx, kv_bits, budget, **kw)))


def cli_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m mlxrs ARGS` as a process (the entry point's smoke test; the others run in-process)."""
    return subprocess.run([sys.executable, "-m", "mlxrs", *args], capture_output=True, text=True, timeout=300)


cli = run_cli


MEASURE = """
import json, random, resource, sys
import mlxrs
d, n, kv = sys.argv[1], int(sys.argv[2]), (None if sys.argv[3] == "none" else int(sys.argv[3]))
s = mlxrs.Session(d, kv_bits=kv)
ids = [random.Random(n).randrange(10, int(sys.argv[4])) for _ in range(n)]
c = s.generate(ids, max_tokens=int(sys.argv[5]), temperature=0)
assert c.usage.completion_tokens == int(sys.argv[5])
def peak_rss():
    # Linux: this process image's high-water mark (ru_maxrss survives exec, so it would count the
    # pytest worker this process was forked from); macOS: ru_maxrss, in bytes there
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024
print(json.dumps({"peak": c.timings.peak_memory, "rss": peak_rss()}))
"""


def measure(d: Path, n: int, kv_bits: int | None, vocab: int) -> dict[str, int]:
    """MLX's peak memory over one generation of GENERATED tokens after n random prompt tokens, and the
    process's peak resident set, in a fresh process: a session keeps its last KV cache until the next
    generation replaces it, which a second measurement in the same session would count."""
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, str(d), str(n), str(kv_bits or "none"), str(vocab), str(GENERATED)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


@pytest.mark.parametrize("name,n,kv_bits", CASES, ids=[f"{m}-{n}-kv{b}" for m, n, b in CASES])
def test_plan_matches_measured_peak(name: str, n: int, kv_bits: int | None) -> None:
    peak = measure(model(name), n, kv_bits, MODELS[name][2]["vocab"])["peak"]
    p = plan(model(name), n + GENERATED, kv_bits)
    est = p["weightsBytes"] + p["kvBytes"] + p["transientBytes"]
    ratio = est / peak
    print(
        f"{name} n={n} kv={kv_bits}: measured {peak / 1e6:.1f} MB, planned {est / 1e6:.1f} MB "
        f"(weights {p['weightsBytes'] / 1e6:.1f}, kv {p['kvBytes'] / 1e6:.1f}, "
        f"transient {p['transientBytes'] / 1e6:.1f}), ratio {ratio:.3f}"
    )
    assert abs(ratio - 1) <= TOLERANCE, (peak, est, p)
    # the weights term is exact: the safetensors headers give what the load allocates
    assert p["weightsBytes"] <= peak


def test_reserve_covers_the_rest_of_the_process() -> None:
    """The resident set of a process that loads a model and generates stays within the plan's total
    (weights + KV + transient + reserve), and what it holds beyond MLX's peak within the reserve."""
    d = model("fit-llama-f32")
    n = 2048
    m = measure(d, n, None, MODELS["fit-llama-f32"][2]["vocab"])
    p = plan(d, n + GENERATED)
    print(f"rss {m['rss'] / 1e6:.1f} MB, MLX peak {m['peak'] / 1e6:.1f} MB, plan total {p['totalBytes'] / 1e6:.1f} MB")
    assert m["rss"] <= p["totalBytes"], (m, p)
    assert m["rss"] - m["peak"] <= p["reserveBytes"], (m, p)


# ---- the CLI ------------------------------------------------------------------------------------


def test_json_is_the_memoryplan_schema() -> None:
    d = model("fit-llama-f32")
    r = cli_process("fit", str(d), "--ctx", "3000", "--json", "--memory-budget", "2G")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert set(p) == SCHEMA_KEYS
    assert p["schemaVersion"] == 1 and p["strategy"] == "generic-kv"
    assert isinstance(p["fits"], bool)
    assert p["predictedDecodeTps"] is None or isinstance(p["predictedDecodeTps"], float)
    for k in SCHEMA_KEYS - {"schemaVersion", "strategy", "fits", "predictedDecodeTps"}:
        assert isinstance(p[k], int) and p[k] >= 0, k
    assert p["contextTokens"] == 3000 and p["usableBytes"] == 2 << 30
    assert p["totalBytes"] == p["weightsBytes"] + p["kvBytes"] + p["transientBytes"] + p["reserveBytes"]
    assert p["fits"] == (p["totalBytes"] <= p["usableBytes"])
    assert p["allocatorLimitBytes"] <= p["usableBytes"]
    # 8 layers × 8 KV heads × 128 × 2 × float32, in steps of 256 tokens
    assert p["kvBytes"] == 8 * 8 * 128 * 2 * 4 * 3072
    assert p == plan(d, 3000, None, "2G")  # the CLI is the planner


def test_max_safe_context_is_the_boundary() -> None:
    d = model("fit-llama-f32")
    budget = str(900 << 20)
    p = json.loads(cli("fit", str(d), "--json", "--memory-budget", budget).stdout)
    m = p["maxSafeContext"]
    assert 0 < m < p["contextTokens"] and not p["fits"]
    assert plan(d, m, None, budget)["fits"] and not plan(d, m + 1, None, budget)["fits"]
    # a quantized KV cache buys a longer context in the same budget
    assert plan(d, None, 8, budget)["maxSafeContext"] > m
    assert plan(d, None, 4, budget)["maxSafeContext"] > plan(d, None, 8, budget)["maxSafeContext"]
    # a fraction budget is of the device memory
    dev, _ = _native.device_memory()
    assert plan(d, 1000, None, "0.5")["usableBytes"] == int(dev * 0.5)
    assert plan(d, 1000)["usableBytes"] == int(dev * 0.75)


def test_readable_report() -> None:
    d = model("fit-llama-f32")
    r = cli("fit", str(d), "--ctx", "4096", "--memory-budget", "900M")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    p = plan(d, 4096, None, "900M")
    for label in (
        "model",
        "context",
        "weights",
        "KV cache",
        "transient",
        "reserve",
        "total",
        "budget",
        "max context",
        "verdict",
    ):
        assert any(line.startswith(label) for line in out.splitlines()), (label, out)
    assert "64.00 KiB/token: 8 layers × 8 KV heads × 128 × K,V × float32" in out
    assert f"does not fit at 4096 tokens — up to {p['maxSafeContext']} tokens do" in out
    r = cli("fit", str(d), "--ctx", "1000", "--kv-quant", "4")
    assert "fits: 1000 tokens" in r.stdout and "× 4-bit" in r.stdout
    r = cli("fit", str(model("fit-gemma3-f32")), "--ctx", "1000")
    assert "3 sliding-window layers capped at 16 tokens" in r.stdout
    r = cli("fit", str(d), "--memory-budget", "100M")
    assert "does not fit: the weights and the reserve alone exceed the budget" in r.stdout
    r = cli("fit", str(d), "--memory-budget", "lots")
    assert r.returncode == 1 and r.stderr.startswith('error: memory budget "lots"')


def test_skus() -> None:
    d = model("fit-llama-f32")
    r = cli("fit", str(d), "--ctx", "8192", "--skus", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    names = [x["sku"] for x in rows]
    for want in (
        "M1 8GB",
        "M1 Max 64GB",
        "M2 Ultra 192GB",
        "M3 Pro 18GB",
        "M3 Ultra 512GB",
        "M4 16GB",
        "M4 Pro 48GB",
        "M4 Max 128GB",
        "RTX 3090 24GB",
        "RTX 4090 24GB",
        "RTX 5090 32GB",
        "A100 40GB",
        "A100 80GB",
        "H100 80GB SXM",
        "H200 141GB",
        "L4 24GB",
        "T4 16GB",
    ):
        assert want in names, want
    for x in rows:
        p = x["plan"]
        assert set(p) == SCHEMA_KEYS and p["contextTokens"] == 8192
        assert p["usableBytes"] == int(x["memoryBytes"] * 0.75)
        assert x["decodeTpsCeiling"] == pytest.approx(x["bandwidthGBs"] * 1e9 / (p["weightsBytes"] + p["kvBytes"]))
    # each SKU is planned for its backend: Macs with Metal's fused attention, NVIDIA GPUs (this model
    # is float32) with materialized scores, both with three layers' prefill activations in flight
    for x in rows:
        want = plan(d, 8192, device_bytes=8 << 30, backend="metal" if x["kind"] == "apple" else "cuda")
        assert x["plan"]["transientBytes"] == want["transientBytes"], x["sku"]
    cpu = plan(d, 8192, device_bytes=8 << 30, backend="cpu")["transientBytes"]
    metal = plan(d, 8192, device_bytes=8 << 30, backend="metal")["transientBytes"]
    cuda = plan(d, 8192, device_bytes=8 << 30, backend="cuda")["transientBytes"]
    assert metal < cpu < cuda
    # fused_attention overrides the backend's attention, not its three layers
    fused = plan(d, 8192, device_bytes=8 << 30, backend="cuda", fused_attention=True)["transientBytes"]
    assert fused == metal
    # CUDA fuses attention for a 16-bit model
    b = model("fit-qwen3-bf16")
    assert (
        plan(b, 8192, device_bytes=8 << 30, backend="cuda")["transientBytes"]
        < plan(b, 8192, device_bytes=8 << 30, backend="cuda", fused_attention=False)["transientBytes"]
    )
    # a tiny byte budget: nothing fits anywhere; a fraction: the same share of each
    rows = json.loads(cli("fit", str(d), "--skus", "--json", "--memory-budget", "300M").stdout)
    assert all(x["plan"]["maxSafeContext"] == 0 for x in rows)
    rows = json.loads(cli("fit", str(d), "--skus", "--json", "--memory-budget", "0.5").stdout)
    assert all(x["plan"]["usableBytes"] == x["memoryBytes"] // 2 for x in rows)
    text = cli("fit", str(d), "--ctx", "8192", "--skus").stdout
    assert text.splitlines()[1].split()[:3] == ["SKU", "MEMORY", "BUDGET"] and "H200 141GB" in text


def test_gguf_is_planned_like_its_import(monkeypatch: pytest.MonkeyPatch, gemma_gguf: Path) -> None:
    """A .gguf file is planned from its header as the directory `serve` imports it into (f32 on the CPU)."""
    from mlxrs.models import cached_gguf

    models = Path(__file__).resolve().parent / ".models"
    src = gemma_gguf
    monkeypatch.setenv("MLXRS_HOME", str(models / "mlxrs-home"))  # test_gemma_real's import cache
    imported = cached_gguf(src)
    a, b = plan(src, 4096), plan(imported, 4096)
    assert a["kvBytes"] == b["kvBytes"] and a["transientBytes"] == b["transientBytes"]
    assert abs(a["weightsBytes"] - b["weightsBytes"]) <= 0.001 * b["weightsBytes"]


@pytest.mark.parametrize("backend,dtype", [("cpu", "f32"), ("cuda", "bf16"), ("metal", "bf16")])
def test_gguf_is_planned_as_the_import_of_the_planned_backend(
    monkeypatch: pytest.MonkeyPatch, gemma_gguf: Path, backend: str, dtype: str
) -> None:
    """`fit --skus` plans a .gguf for each machine as that machine's import: f32 on the CPU, bf16 on
    GPUs (the directories themselves, imported here, are the reference)."""
    from mlxrs.models import cached_gguf

    models = Path(__file__).resolve().parent / ".models"
    monkeypatch.setenv("MLXRS_HOME", str(models / "mlxrs-home"))
    imported = cached_gguf(gemma_gguf, dtype=dtype)
    a, b = plan(gemma_gguf, 4096, backend=backend), plan(imported, 4096, backend=backend)
    assert a["kvBytes"] == b["kvBytes"] and a["transientBytes"] == b["transientBytes"]
    assert abs(a["weightsBytes"] - b["weightsBytes"]) <= 0.001 * b["weightsBytes"]


# ---- the server's admission honours maxSafeContext ----------------------------------------------


def test_server_admission_honours_max_safe_context() -> None:
    d = make_model("qwen3-float32", "qwen3")
    # a budget that is not constructed from the plan: weights + reserve + 40 MiB
    facts = plan(d, 1)
    budget = str(facts["weightsBytes"] + facts["reserveBytes"] + (40 << 20))
    fit = json.loads(cli("fit", str(d), "--json", "--memory-budget", budget).stdout)
    m = fit["maxSafeContext"]
    assert 100 < m < 4096, fit
    with Server(d, "--memory-budget", budget) as s:
        st = s.stats()
        assert st["context_tokens"] == m and st["memory_plan"] == fit
        # the longest prompt that leaves one generation slot inside the ceiling is admitted...
        status, body = s.post(
            "/v1/completions", {"model": "qwen3-float32", "prompt": [7] * (m - 1), "max_tokens": 20, "temperature": 0}
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == m - 1
        assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
        # ...and one token more is rejected
        status, body = s.post("/v1/completions", {"model": "qwen3-float32", "prompt": [7] * m, "max_tokens": 1})
        assert status == 400, body
        assert body["error"]["type"] == "memory_admission" and body["error"]["code"] == "context_over_budget"


def test_latent_attention_report() -> None:
    """DeepSeek-V3's MLA: the report counts the cached latent + rope key per token and layer (from
    the config), not KV heads × head dim × K,V."""
    import json

    from tinymodels import make_model

    d = make_model("deepseek_v3-float32", "deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    elems, layers = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], cfg["num_hidden_layers"]
    r = cli("fit", str(d), "--ctx", "1000")
    assert r.returncode == 0, r.stderr
    assert f"{layers} layers × {elems} cached elements × float32" in r.stdout
    assert plan(d, 1024, None, None)["kvBytes"] == layers * 1024 * elems * 4
