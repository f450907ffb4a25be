"""The long-lived oracle process (tests/oracle_server.py) answers as a fresh mlx-lm process would:
the same tokens and logits as tests/oracle_mlxlm.py run alone, a rewritten checkpoint reloaded, and
a failing or crashing job fails alone with its stderr shown, the next job served."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest

from oracle_server import HERE, Oracle, blas_env
from tinymodels import make_model

JOB = {"prompt": list(range(3, 40)), "max_tokens": 24, "prefill_step_size": 16}


def fresh(job: dict) -> dict:
    """tests/oracle_mlxlm.py in a process of its own, as every parity job ran before the shared one."""
    p = subprocess.run(
        [sys.executable, str(HERE / "oracle_mlxlm.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=blas_env(),
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout)


@pytest.fixture
def own():
    o = Oracle()
    yield o
    o.close()


def test_answers_as_a_fresh_process_and_reloads_a_rewritten_model(own, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(make_model("qwen3-float32", "qwen3"), d)
    job = {"model": str(d), **JOB}
    first = own(job)
    assert own(job) == first == fresh(job)  # the second answer from the loaded model
    assert len(first["tokens"]) == 24
    # the same directory with other weights: reloaded, not served from the loaded model
    w = mx.load(str(d / "model.safetensors"))
    mx.save_safetensors(str(d / "model.safetensors"), {k: v * 1.5 for k, v in w.items()}, metadata={"format": "mlx"})
    second = own(job)
    assert second == fresh(job) and second["logits"] != first["logits"]
    assert own.starts == 1


def test_a_failing_job_fails_alone(own):
    d = make_model("qwen3-float32", "qwen3")
    with pytest.raises(AssertionError, match=r"(?s)mlx-lm oracle failed:.*Traceback.*max_tokens"):
        own({"model": str(d), "prompt": [1, 2, 3]})  # no max_tokens
    pid = own.proc.pid
    assert own({"model": str(d), **JOB})["tokens"] == fresh({"model": str(d), **JOB})["tokens"]
    assert own.proc.pid == pid and own.starts == 1


def test_a_crash_fails_that_job_with_its_stderr_and_the_next_job_restarts(own):
    d = make_model("qwen3-float32", "qwen3")
    own({"model": str(d), **JOB})
    proc = own.proc

    def kill() -> None:
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)

    t = threading.Thread(target=kill)
    t.start()
    with pytest.raises(AssertionError, match=r"mlx-lm oracle failed: its process died \(exit -9\)"):
        own({"model": str(d), "prompt": list(range(3, 40)), "max_tokens": 100000})
    t.join()
    assert own.proc is None
    assert own({"model": str(d), **JOB})["tokens"] == fresh({"model": str(d), **JOB})["tokens"]
    assert own.starts == 2
