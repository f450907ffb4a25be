"""bench/bench_llamacpp.py's parser of `llama-bench -o json` (the benchmark itself never runs in the
suite: it builds llama.cpp)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_llamacpp.py"


def load() -> object:
    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def record(n_prompt: int, n_gen: int, ts: float) -> dict[str, object]:
    # the fields llama-bench's JSON printer writes for one test (tools/llama-bench/llama-bench.cpp)
    return {
        "build_commit": "unknown",
        "build_number": 0,
        "cpu_info": "x",
        "gpu_info": "",
        "backends": "CPU",
        "model_type": "gemma3 270M Q4_K - Medium",
        "n_threads": 2,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "avg_ns": int(1e9 * max(n_prompt, n_gen) / ts),
        "avg_ts": ts,
        "stddev_ts": 0.0,
        "samples_ts": [ts],
    }


def test_parse_llama_bench_picks_the_prefill_and_decode_records() -> None:
    m = load()
    rng = random.Random(7)
    for _ in range(20):
        p, n = rng.randrange(1, 4096), rng.randrange(1, 512)
        pp, tg = rng.uniform(1, 5000), rng.uniform(1, 500)
        recs = [record(p, 0, pp), record(0, n, tg)]
        rng.shuffle(recs)
        # llama-bench may print log lines before the JSON list on stdout
        out = "main: some log line\n" + json.dumps(recs, indent=2)
        assert m.parse_llama_bench(out, p, n) == {"prefill_tps": pp, "decode_tps": tg}


def test_parse_llama_bench_names_what_is_missing() -> None:
    m = load()
    with pytest.raises(ValueError, match="no JSON list"):
        m.parse_llama_bench("error: failed to load model", 64, 64)
    with pytest.raises(ValueError, match="pp64 / tg64"):
        m.parse_llama_bench(json.dumps([record(64, 0, 100.0), record(0, 32, 10.0)]), 64, 64)
