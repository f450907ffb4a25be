#!/usr/bin/env python3
"""Mutation fuzzing of the files mlxrs loads: a valid safetensors file, a valid GGUF and a valid
config.json of a tiny model, each mutated N times (bit flips, byte edits, edits of offsets, shapes,
dtypes, sizes and metadata fields, truncation) and loaded as a user would (`mlxrs.Session`; a GGUF
through its import first). Loads run in a worker subprocess supervised by this one, so that a crash
(a signal) or a hang is counted, not fatal; the worker is restarted after the case that killed it.

Each case ends as one of:
  accepted-consistent    loaded, generated 2 tokens, and an independent check (written here, not
                         mlxrs's) agrees the file is consistent
  refused                an mlxrs.errors.MlxrsError (anything else is counted as crashed)
  crashed                the worker died by a signal or raised something not an MlxrsError
  hung                   no answer within --timeout seconds
  accepted-inconsistent  loaded although the independent check finds the file inconsistent

    python scripts/fuzz_files.py --n 2000 --seed 20261130
    python scripts/fuzz_files.py --n 20000 --kinds gguf --seed 7      # longer, one kind

Exit status 1 when any case crashed, hung or was accepted inconsistent. docs/fuzzing.md has the
latest counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(vocab=512, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, inter=128)
U64 = [0, 1, 2, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
INTS: list[Any] = [
    0,
    -1,
    1,
    2,
    3,
    7,
    31,
    32,
    33,
    63,
    64,
    65,
    127,
    128,
    511,
    512,
    513,
    1024,
    2**31 - 1,
    2**31,
    2**32 + 64,
    2**63 - 1,
    10**9,
    10**6,
    1.5,
    1e9,
    "64",
    None,
    True,
    [64],
]
ST_DTYPES = ["F32", "F16", "BF16", "F64", "U32", "I32", "U8", "I8", "BOOL", "I64", "Q4", "", "F8_E4M3"]
SIZE_KEYS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "sliding_window",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "model_type",
    "layer_types",
    "rope_scaling",
    "quantization",
]


# ---- the base files ------------------------------------------------------------------------------


def base_model() -> Path:
    from tinymodels import make_model

    return make_model("fuzz-llama-f32", "llama", **SHAPE)


def base_gguf(model: Path, work: Path) -> Path:
    from test_gguf_import_arch import write_gguf

    p = work / "base.gguf"
    if not p.exists():
        write_gguf(model, p)
    return p


# ---- mutations (deterministic from the case's seed) ------------------------------------------------


def raw_edit(data: bytes, rnd: random.Random, hot: int) -> bytes:
    """Bit flips, byte sets, 8-byte interesting values or a truncation, mostly within the first
    `hot` bytes (the header)."""
    b = bytearray(data)
    op = rnd.random()
    if op < 0.15:
        return bytes(b[: rnd.randrange(len(b))])
    for _ in range(rnd.randint(1, 4)):
        i = rnd.randrange(min(hot, len(b))) if rnd.random() < 0.85 else rnd.randrange(len(b))
        if op < 0.55:
            b[i] ^= 1 << rnd.randrange(8)
        elif op < 0.8:
            b[i] = rnd.randrange(256)
        else:
            b[i : i + 8] = rnd.choice(U64).to_bytes(8, "little")
    return bytes(b)


def mutate_safetensors(data: bytes, rnd: random.Random) -> bytes:
    (n,) = struct.unpack_from("<Q", data)
    if rnd.random() < 0.35:
        return raw_edit(data, rnd, 8 + n)
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    for _ in range(rnd.randint(1, 2)):
        names = [k for k in header if k != "__metadata__"]
        t = header[rnd.choice(names)]
        what = rnd.random()
        if what < 0.35:
            i = rnd.randrange(2)
            t["data_offsets"][i] = rnd.choice(
                [
                    *U64[:12],
                    len(body),
                    len(body) + 1,
                    t["data_offsets"][1 - i],
                    t["data_offsets"][i] + rnd.choice([-4, -1, 1, 4, 64]),
                ]
            )
        elif what < 0.65 and t["shape"]:
            i = rnd.randrange(len(t["shape"]))
            t["shape"][i] = rnd.choice(
                [0, 1, 2, t["shape"][i] * 2, t["shape"][i] // 2, t["shape"][i] + 1, 2**31, 2**32 + t["shape"][i], -1]
            )
        elif what < 0.8:
            t["dtype"] = rnd.choice(ST_DTYPES)
        elif what < 0.9:
            header.pop(rnd.choice(names), None)
        else:
            other = header.get(rnd.choice(names))
            if other is not None:
                t["data_offsets"] = list(other["data_offsets"])
    h = json.dumps(header).encode()
    length = len(h) if rnd.random() < 0.9 else rnd.choice(U64)
    return struct.pack("<Q", length) + h + body


def mutate_config(text: str, rnd: random.Random) -> str:
    if rnd.random() < 0.2:
        return raw_edit(text.encode(), rnd, len(text)).decode("utf-8", "replace")
    cfg = json.loads(text)
    for _ in range(rnd.randint(1, 3)):
        k = rnd.choice(SIZE_KEYS)
        v = rnd.choice(
            INTS
            + [
                "llama",
                "gemma3_text",
                "qwen3",
                ["sliding_attention"] * 3,
                {"type": "llama3", "factor": 0},
                {"group_size": 0, "bits": 4},
            ]
        )
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return json.dumps(cfg)


def gguf_fields(data: bytes) -> tuple[list[tuple[int, int, str]], int]:
    from test_gguf import header_fields

    return header_fields(data, per_array=2)


def mutate_gguf(data: bytes, fields: list[tuple[int, int, str]], header_end: int, rnd: random.Random) -> bytes:
    if rnd.random() < 0.4:
        return raw_edit(data, rnd, header_end)
    b = data
    for _ in range(rnd.randint(1, 2)):
        off, width, what = rnd.choice(fields)
        orig = int.from_bytes(b[off : off + width], "little")
        if width == 8:
            v = rnd.choice([*U64, orig + 1, max(orig - 1, 0), orig + 32, orig * 2, len(data)])
        elif width == 4:
            v = rnd.choice([0, 1, 2, 3, 13, 30, 31, 2**31 - 1, 2**32 - 1, orig + 1, max(orig - 1, 0), orig * 2])
        else:
            v = rnd.choice([0, 1, 2, 255, orig ^ 1])
        v &= (1 << (8 * width)) - 1
        b = b[:off] + v.to_bytes(width, "little") + b[off + width :]
    return b


# ---- independent consistency checks (not mlxrs's code) ----------------------------------------------

ST_SIZES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "U32": 4,
    "I32": 4,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "I64": 8,
    "U64": 8,
    "I16": 2,
    "U16": 2,
}


def safetensors_consistent(path: Path, reference: dict[str, Any]) -> str | None:
    """None when the file is consistent and holds what the reference file holds (names, dtypes,
    shapes); else why not."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    pairs = json.loads(raw[8 : 8 + n], object_pairs_hook=lambda kv: kv)
    if len({k for k, _ in pairs}) != len(pairs):
        return "duplicate keys"
    header = dict(pairs)
    data_len = len(raw) - 8 - n
    spans = []
    for k, t in header.items():
        if k == "__metadata__":
            continue
        t = dict(t)
        b, e = t["data_offsets"]
        if t["dtype"] not in ST_SIZES or not (0 <= b <= e <= data_len):
            return f"{k}: dtype or offsets"
        if math.prod(t["shape"]) * ST_SIZES[t["dtype"]] != e - b:
            return f"{k}: size"
        if e > b:
            spans.append((b, e))
        ref = reference.get(k)
        unused = "rotary_emb.inv_freq" in k  # dropped at load, as mlx-lm does: its shape does not matter
        if ref is not None and not unused and (list(t["shape"]) != ref["shape"] or t["dtype"] != ref["dtype"]):
            return f"{k}: shape/dtype differ from what the config implies"
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return "overlap"
    return None


def info_consistent(info: dict[str, Any], tokens: list[int]) -> str | None:
    """A loaded model's shape agrees with the tiny model's weights."""
    if (
        info["hidden_size"] != SHAPE["hidden"]
        or info["head_dim"] * info["num_kv_heads"] != SHAPE["head_dim"] * SHAPE["kv_heads"]
    ):
        return f"shape {info}"
    if not (1 <= info["num_layers"] <= SHAPE["layers"]) or not (1 <= info["vocab_size"] <= SHAPE["vocab"]):
        return f"layers/vocab {info}"
    if not all(0 <= t < SHAPE["vocab"] for t in tokens):
        return f"tokens {tokens}"
    return None


def gguf_consistent(data: bytes) -> str | None:
    import gguf

    fields, header_end = gguf_fields(data)
    u32 = lambda p: struct.unpack_from("<I", data, p)[0]  # noqa: E731
    u64 = lambda p: struct.unpack_from("<Q", data, p)[0]  # noqa: E731
    dims: list[int] = []
    tensors = []
    for off, width, what in fields:
        if what == "dimension":
            dims.append(u64(off))
        elif what == "tensor type":
            ty = u32(off)
        elif what == "tensor offset":
            tensors.append((dims, ty, u64(off)))
            dims = []
    align = 32
    base = (header_end + align - 1) // align * align
    spans = []
    for d, ty, off in tensors:
        try:
            be, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ty)]
        except (ValueError, KeyError):
            continue
        if off % align or d[0] % be:
            return "alignment or blocks"
        end = base + off + math.prod(d) // be * bb
        if end > len(data):
            return "past the end"
        spans.append((off, off + math.prod(d) // be * bb))
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return "overlap"
    return None


# ---- the worker: runs cases kind/start..end, one line per case ----------------------------------------


def worker(kind: str, seed: int, start: int, end: int, work: Path) -> None:
    import mlxrs
    from mlxrs import models
    from mlxrs.errors import MlxrsError

    model = base_model()
    scratch = work / f"{kind}-case"
    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(model, scratch)
    st_bytes = (model / "model.safetensors").read_bytes()
    (n,) = struct.unpack_from("<Q", st_bytes)
    reference = {k: v for k, v in json.loads(st_bytes[8 : 8 + n]).items() if k != "__metadata__"}
    cfg_text = (model / "config.json").read_text()
    g_bytes = base_gguf(model, work).read_bytes() if kind == "gguf" else b""
    g_fields, g_end = gguf_fields(g_bytes) if kind == "gguf" else ([], 0)
    for i in range(start, end):
        rnd = random.Random(f"{seed}/{kind}/{i}")
        print(f"start {i}", flush=True)
        why: str | None = None
        path = scratch
        if kind == "safetensors":
            (scratch / "model.safetensors").write_bytes(mutate_safetensors(st_bytes, rnd) if i else st_bytes)
        elif kind == "config":
            (scratch / "config.json").write_text(mutate_config(cfg_text, rnd) if i else cfg_text)
        else:
            g = work / "case.gguf"
            mutated = mutate_gguf(g_bytes, g_fields, g_end, rnd) if i else g_bytes
            g.write_bytes(mutated)
            shutil.rmtree(work / "case-import", ignore_errors=True)
        try:
            if kind == "gguf":
                path = models.convert_gguf(work / "case.gguf", work / "case-import", dtype="f32", progress=False)
            with mlxrs.Session(path) as s:
                tokens = s.generate([1, 2, 3], max_tokens=2, ignore_eos=True).tokens
                why = info_consistent(s.info, tokens)
            if why is None and kind == "safetensors":
                why = safetensors_consistent(scratch / "model.safetensors", reference)
            if why is None and kind == "gguf":
                why = gguf_consistent(mutated)
            outcome = "accepted-consistent" if why is None else "accepted-inconsistent"
        except MlxrsError as e:
            outcome, why = "refused", str(e)[:200]
        except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
            outcome, why = "crashed", f"{type(e).__name__}: {e}"[:300]
        print("result " + json.dumps({"i": i, "outcome": outcome, "why": why}), flush=True)


# ---- the supervisor ----------------------------------------------------------------------------------


def supervise(kind: str, n: int, seed: int, timeout: float, work: Path) -> dict[str, Any]:
    counts = {k: 0 for k in ("accepted-consistent", "refused", "crashed", "hung", "accepted-inconsistent")}
    examples: dict[str, list[str]] = {}
    i = 0
    while i < n:
        err = open(work / f"{kind}-worker.err", "w+")
        p = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                kind,
                "--seed",
                str(seed),
                "--start",
                str(i),
                "--end",
                str(n),
                "--work",
                str(work),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
        )
        assert p.stdout is not None
        current = None
        deadline = time.monotonic() + timeout + 120  # the first case also builds the base files
        while True:
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                p.kill()
                p.wait()
                k = current if current is not None else i
                counts["hung"] += 1
                examples.setdefault("hung", []).append(str(k))
                i = k + 1
                break
            line = p.stdout.readline()
            if not line:  # the worker died
                rc = p.wait()
                err.seek(0)
                tail = err.read().strip().splitlines()[-1:] or [""]
                if current is not None:
                    counts["crashed"] += 1
                    examples.setdefault("crashed", []).append(f"case {current}: exit {rc} {tail[0][:200]}")
                    i = current + 1
                else:
                    i = n  # it finished (or could not start: reported below)
                    if rc != 0:
                        raise SystemExit(f"the {kind} worker could not start (exit {rc}): {tail[0]}")
                break
            if line.startswith("start "):
                current = int(line.split()[1])
                deadline = time.monotonic() + timeout
            elif line.startswith("result "):
                r = json.loads(line[7:])
                counts[r["outcome"]] += 1
                if r["outcome"] != "refused" and r["outcome"] != "accepted-consistent":
                    examples.setdefault(r["outcome"], []).append(f"case {r['i']}: {r['why']}")
                current = None
                i = r["i"] + 1
    return {"counts": counts, "problems": examples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="mutations per kind (case 0 is the unmutated file)")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--kinds", default="safetensors,gguf,config")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as hung")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--end", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.seed, a.start, a.end, Path(a.work))
        return 0
    os.environ.setdefault("MLXRS_HOME", tempfile.mkdtemp(prefix="mlxrs-fuzz-home-"))
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mlxrs-fuzz-") as tmp:
        for kind in a.kinds.split(","):
            t0 = time.monotonic()
            res = supervise(kind, a.n, a.seed, a.timeout, Path(tmp))
            c = res["counts"]
            print(
                f"{kind}: {a.n} cases in {time.monotonic() - t0:.0f} s: " + ", ".join(f"{k} {v}" for k, v in c.items()),
                flush=True,
            )
            for k, ex in res["problems"].items():
                print(f"  {k}: " + "; ".join(ex[:10]))
            bad += c["crashed"] + c["hung"] + c["accepted-inconsistent"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
