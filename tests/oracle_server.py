"""One long-lived oracle process for the whole test session: mlx-lm (tests/oracle_mlxlm.py) and
mlx-vlm (tests/oracle_mlxvlm.py) answering many jobs, each model loaded once, in a process of its
own (given the same BLAS as mlxrs through LD_PRELOAD), started by the client below (`Oracle`;
`ORACLE` is the session's, conftest.py's `oracle` fixture).

Protocol, JSON lines: a request {"kind": "mlxlm" | "mlxvlm", "job": {...}} on stdin; one reply
{"ok": true, "result": {...}} or {"ok": false, "error": traceback} on the stdout it was started
with; whatever the libraries print goes to stderr (fd 1 is pointed there), a file the client
reads a failed job's part of. A loaded model is reused only while its files are unchanged (name,
size and mtime of every file of the model and adapter directories); each job makes its own caches,
as a fresh process would. A job that raises fails alone; a crash (or a timeout) fails the job
that was running, showing its stderr, and the next job starts a new process.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEEP = 8  # loaded models kept (least recently used evicted)
KEEP_BYTES = 64 << 20  # a larger model (the real Gemma 3 270M) is dropped when a job asks for another


def blas_env() -> dict[str, str]:
    """Environment for an oracle subprocess that runs MLX under the same BLAS mlxrs loaded (its gemv
    router, libmlxrs_blas, ahead of the BLAS, as mlxrs loads them)."""
    import mlxrs

    env = dict(os.environ)
    info = mlxrs.runtime_info()
    libs = [p for p in (info.get("blas_gemv"), info.get("blas")) if p] if info.get("blas") else []
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


NAMES = {"mlxlm": "mlx-lm", "mlxvlm": "mlx-vlm"}


def mlxlm_job(
    model: str | Path,
    prompt: list[int],
    max_tokens: int,
    *,
    kv_bits: int | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 2048,
    adapter_path: str | Path | None = None,
    exact_quantized_matmul: bool = False,
) -> dict[str, Any]:
    """tests/oracle_mlxlm.py's job, every field spelled out (the tests' defaults written once: mlx-lm's
    plain KV cache, its 2048-token prefill chunks, no adapter): mlx-lm's greedy tokens for `prompt` and
    its last-position logits."""
    return {
        "model": str(model),
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "kv_bits": kv_bits,
        "max_kv_size": max_kv_size,
        "prefill_step_size": prefill_step_size,
        "adapter_path": str(adapter_path) if adapter_path else None,
        "exact_quantized_matmul": exact_quantized_matmul,
    }


class Oracle:
    """The client: starts the oracle process on the first job, sends jobs one at a time (a lock),
    restarts it after a crash. `oracle(job)` runs an mlx-lm job, `oracle.vlm(job)` an mlx-vlm one."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()
        self.errpath: Path | None = None
        self.jobs = 0
        self.starts = 0

    def __call__(self, job: dict[str, Any]) -> dict[str, Any]:
        return self.request("mlxlm", job)

    def generate(self, model: str | Path, prompt: list[int], max_tokens: int, **opts: Any) -> dict[str, Any]:
        """mlx-lm's answer to [`mlxlm_job`](model, prompt, max_tokens, **opts): {"tokens", "logits"}."""
        return self(mlxlm_job(model, prompt, max_tokens, **opts))

    def vlm(self, job: dict[str, Any]) -> dict[str, Any]:
        return self.request("mlxvlm", job)

    def _start(self) -> subprocess.Popen[str]:
        if self.errpath is not None:  # the previous process's (its failure has been reported)
            self.errpath.unlink(missing_ok=True)
        fd, name = tempfile.mkstemp(prefix="mlxrs-oracle-", suffix=".stderr")
        self.errpath = Path(name)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "oracle_server.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                text=True,
                env=blas_env(),
            )
        finally:
            os.close(fd)
        self.starts += 1
        if self.starts == 1:
            atexit.register(self.close)
        return self.proc

    def _stderr_since(self, offset: int) -> str:
        assert self.errpath is not None
        with open(self.errpath, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")[-4000:]

    def request(self, kind: str, job: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
            assert proc.stdin is not None and proc.stdout is not None and self.errpath is not None
            offset = self.errpath.stat().st_size
            self.jobs += 1
            done = False
            try:
                try:
                    proc.stdin.write(json.dumps({"kind": kind, "job": job}) + "\n")
                    proc.stdin.flush()
                except OSError as e:  # it died between jobs
                    raise AssertionError(
                        f"{NAMES[kind]} oracle failed: its process is gone ({e}, exit "
                        f"{proc.wait()}):\n{self._stderr_since(offset)}"
                    ) from None
                with selectors.DefaultSelector() as sel:
                    sel.register(proc.stdout, selectors.EVENT_READ)
                    if not sel.select(self.timeout):
                        raise AssertionError(
                            f"{NAMES[kind]} oracle: no answer in {self.timeout:.0f} s (killed):\n"
                            f"{self._stderr_since(offset)}"
                        )
                line = proc.stdout.readline()
                if not line.endswith("\n"):
                    code = proc.wait()
                    raise AssertionError(
                        f"{NAMES[kind]} oracle failed: its process died (exit {code}):\n{self._stderr_since(offset)}"
                    )
                reply = json.loads(line)
                done = True
            finally:
                if not done:  # crashed, timed out or interrupted mid-job: the next job starts afresh
                    self._stop()
            if not reply["ok"]:
                raise AssertionError(f"{NAMES[kind]} oracle failed:\n{reply['error']}\n{self._stderr_since(offset)}")
            return reply["result"]

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    def close(self) -> None:
        """Ends the process (its stdin closed: it exits when the current job is done)."""
        with self.lock:
            proc = self.proc
            if proc is not None and proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
                t0 = time.monotonic()
                while proc.poll() is None and time.monotonic() - t0 < 10:
                    time.sleep(0.05)
            self._stop()
            if self.errpath is not None:
                self.errpath.unlink(missing_ok=True)
                self.errpath = None


ORACLE = Oracle()  # the session's one oracle (conftest.py's `oracle` fixture)


def _fingerprint(d: str | None) -> tuple:
    if not d:
        return ()
    p = Path(d)
    if not p.exists():  # not a local path: mlx-lm's load says what it is
        return ()
    files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
    return tuple((q.name, q.stat().st_size, q.stat().st_mtime_ns) for q in files)


def _nbytes(key: tuple) -> int:
    return sum(f[1] for f in key[3])


def main() -> None:
    # the protocol keeps the original stdout; anything printed (by mlx-lm, transformers) goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import mlx.core as mx

    import oracle_mlxlm
    import oracle_mlxvlm

    kinds = {"mlxlm": oracle_mlxlm, "mlxvlm": oracle_mlxvlm}
    loaded: OrderedDict[tuple, Any] = OrderedDict()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            mod, job = kinds[req["kind"]], req["job"]
            key = (
                req["kind"],
                job["model"],
                job.get("adapter_path"),
                _fingerprint(job["model"]),
                _fingerprint(job.get("adapter_path")),
            )
            model = loaded.pop(key, None)
            for k in [k for k in loaded if _nbytes(k) > KEEP_BYTES]:  # a large model only while it is asked for
                del loaded[k]
            if model is None:
                model = mod.load(job)
            result = mod.run(model, job)
            loaded[key] = model
            while len(loaded) > KEEP:
                loaded.popitem(last=False)
            del model
            reply = {"ok": True, "result": result}
        except Exception:  # the job fails, the process lives on for the next
            reply = {"ok": False, "error": traceback.format_exc()}
        mx.clear_cache()
        sys.stderr.flush()
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
