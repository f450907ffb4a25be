"""Fetch the test caches that are downloads rather than CPU work, ahead of the tests: the llama.cpp
sdist (its templates and converter) and torch for that converter, into `MLXRS_TEST_CACHE`.

`scripts/test.sh` starts this beside setup's builds (which keep the cores busy while these mostly
wait on the network), so that no pytest worker sits idle on a download. Each step is the fixture's
own code under its build lock (tests/buildlock.py): a test that asks while this runs waits for it,
and one that asks after a failure here fetches it itself; nothing is left half-made.
`MLXRS_TEST_NO_TORCH=1` leaves torch out, as it does for the tests."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_templates  # noqa: E402
import llamacpp_convert  # noqa: E402


def main() -> int:
    for what, fetch in [
        ("llama.cpp's templates", llama_templates.templates_dir),
        ("llama.cpp's converter", llamacpp_convert.source_dir),
        (f"torch {llamacpp_convert.TORCH}", llamacpp_convert.torch_dir),
    ]:
        start = time.monotonic()
        where = fetch()
        took = time.monotonic() - start
        print(f"[prefetch] {what}: {where or 'skipped (MLXRS_TEST_NO_TORCH=1)'} ({took:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
