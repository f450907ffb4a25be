"""Narrow a GPU parity difference down: one architecture's tiny model, then copies of it cut to
fewer layers and/or with config fields changed (the indexer off, …), each against mlx-lm on the same
weights, printing the last-position logits' largest difference and where greedy tokens first part.

    python bench/device_variants.py glm_moe_dsa float32 '{}' '{"layers": 1}' '{"config": {"index_topk": 4096}}'
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from device_parity import N, TEXT, oracle  # noqa: E402


def variant(base: Path, over: dict, tag: str) -> Path:
    """A copy of `base` with only its first `over["layers"]` layers and `over["config"]` merged in."""
    import mlx.core as mx

    d = base.parent / f"{base.name}-var-{tag}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(over.get("config", {}))
    if "layers" in over:
        n = over["layers"]
        cfg["num_hidden_layers"] = n
        w = mx.load(str(d / "model.safetensors"))
        keep = {k: v for k, v in w.items() if not ((m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= n)}
        mx.save_safetensors(str(d / "model.safetensors"), keep, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def main() -> int:
    import numpy as np

    import mlxrs
    from tinymodels import make_model

    arch, dtype = sys.argv[1], sys.argv[2]
    for spec in sys.argv[3:]:
        over = json.loads(spec)
        base = make_model(f"{arch}-{dtype}", arch, dtype=dtype)
        d = variant(base, over, hashlib.sha1(spec.encode()).hexdigest()[:8]) if over else base
        with mlxrs.Session(d) as s:
            ids = s.tokenize(TEXT)
            ours = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens
            lg = np.array(s.logits(ids), dtype=np.float32)
        ref = oracle(d, ids)
        diff = float(np.max(np.abs(lg - np.array(ref["logits"], dtype=np.float32))))
        first = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"])) if a != b), None)
        print(
            json.dumps({"arch": arch, "dtype": dtype, "over": over, "logits_max_diff": diff, "first_diff": first}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
