"""What the media tests share: random PNG images, MLX's peak memory over one encoding, and copies of a
model with one config field changed (the refusal tests)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def copy_model(model_dir: Path, tmp_path: Path, field: str | None = None, value: Any = None) -> Path:
    """A copy of `model_dir` in `tmp_path / "m"`; with `field` (dotted, e.g. `vision_config.depth`) set to
    `value` in its config.json."""
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    if field is not None:
        set_config_field(d, field, value)
    return d


def set_config_field(d: Path, field: str, value: Any) -> None:
    """Set the dotted `field` of `d`'s config.json to `value`."""
    cfg = json.loads((d / "config.json").read_text())
    node = cfg
    *path, key = field.split(".")
    for k in path:
        node = node[k]
    node[key] = value
    (d / "config.json").write_text(json.dumps(cfg))


def random_pngs(count: int, size: tuple[int, int], seed: int = 10) -> list[bytes]:
    """`count` PNG files of random pixels, `size` (height, width), seeds `seed`, `seed + 1`, …"""
    from PIL import Image

    out = []
    for k in range(count):
        b = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed + k).integers(0, 256, (*size, 3), dtype=np.uint8)).save(b, "PNG")
        out.append(b.getvalue())
    return out


PEAKS_SCRIPT = r"""
import gc, json, sys, time
import mlxrs
from mlxrs import _native
d, method, groups = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
REPEATS = 6


def settled():
    # what a finished encoding retained is freed on MLX's executor after the result is back: wait
    # until the active bytes stop moving (under load that took long enough to halve a peak's rise)
    last, still = _native.memory_counters()["active"], 0
    for _ in range(1000):
        time.sleep(0.005)
        now = _native.memory_counters()["active"]
        still = still + 1 if now == last else 0
        if still == 20:  # 100 ms without a change
            return
        last = now


out = []
with mlxrs.Session(d) as s:
    encode = getattr(s, method)
    for g, paths in enumerate(groups):
        items = [open(p, "rb").read() for p in paths]
        encode(items[:1])
        rises = []
        for _ in range(REPEATS if g == 0 else 1):
            gc.collect()
            settled()
            before = _native.memory_counters(reset_peak=True)
            result = encode(items)
            rises.append(_native.memory_counters()["peak"] - before["active"])
        out.append([len(result), max(rises)])
        del result
print(json.dumps(out))
"""


def encoding_peaks(model: Path, method: str, groups: list[list[bytes]]) -> list[tuple[int, int]]:
    """For each group of media items (encoded files), in turn in one session of `model`:
    `len(session.<method>(items))` and the bytes MLX's peak rose above what was active before it,
    after a warm-up (kernels, the allocator, whatever the session makes on its first encoding) on the
    group's first item alone (the items are encoded one after another, each at the same size, so
    one of them warms what all of them use); for the first group (the one a lower bound is
    checked on) the largest of six encodings, since MLX's executor
    frees a finished op's buffers on its own thread, so that one run's peak can miss what another
    reaches (a tiny tower's one image: 0.46 to 0.61 MB over 20 runs, 0.61 the most common; in a
    CI run under load all of three came out at 0.37). Measured in a fresh process: MLX's counters are the
    process's, and in a test worker another test's session or in-process server can free memory
    during the measurement (an in-process figure came out 14 MB low now and then)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for g, items in enumerate(groups):
            paths.append([])
            for i, data in enumerate(items):
                p = Path(tmp) / f"{g}-{i}"
                p.write_bytes(data)
                paths[-1].append(str(p))
        r = subprocess.run(
            [sys.executable, "-c", PEAKS_SCRIPT, str(model), method, json.dumps(paths)],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert r.returncode == 0, r.stderr
    return [(int(n), int(peak)) for n, peak in json.loads(r.stdout.strip().splitlines()[-1])]
