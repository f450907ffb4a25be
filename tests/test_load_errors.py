"""Loading a broken model directory raises the right `mlxrs.errors` class with a message that
names the problem and what to do, and the process keeps running."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

import mlxrs
from mlxrs.errors import InvalidArgumentError, MlxrsError, ModelLoadError, UnsupportedModelError
from tinymodels import make_model


@pytest.fixture(scope="module")
def good() -> Path:
    return make_model("llama-float32", "llama")


def broken(tmp_path: Path, good: Path, mutate: Callable[[Path], object]) -> Path:
    d = tmp_path / "model"
    shutil.copytree(good, d)
    mutate(d)
    return d


def edit_config(**changes: object) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))

    return f


def edit_weights(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        import mlx.core as mx

        w = dict(mx.load(str(d / "model.safetensors")))
        fn(w)
        mx.save_safetensors(str(d / "model.safetensors"), w)

    return f


def load_error(d: Path, cls: type[Exception] = ModelLoadError, **kw: object) -> str:
    with pytest.raises(cls) as ei:
        mlxrs.Session(d, **kw)
    assert isinstance(ei.value, MlxrsError)
    return str(ei.value)


def test_missing_directory(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in msg and "does not exist" in msg


def test_missing_config(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "config.json").unlink())
    msg = load_error(d)
    assert "config.json" in msg
    assert "needs config.json, *.safetensors and tokenizer.json" in msg  # what a model directory must hold


def test_bad_json_in_config(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "config.json").write_text('{"model_type": "llama",'))
    msg = load_error(d)
    assert str(d / "config.json") in msg and "invalid JSON" in msg and "line 1" in msg


def test_config_without_model_type(tmp_path, good):
    msg = load_error(broken(tmp_path, good, edit_config(model_type=None)))
    assert "model_type" in msg


def test_config_missing_a_field(tmp_path, good):
    msg = load_error(broken(tmp_path, good, edit_config(hidden_size=None)))
    assert "config.json" in msg and "hidden_size" in msg


def test_missing_tokenizer(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "tokenizer.json").unlink())
    msg = load_error(d)
    assert "tokenizer.json" in msg and "add it to the model directory" in msg


def test_bad_tokenizer_config(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "tokenizer_config.json").write_text("{nope"))
    msg = load_error(d)
    assert "tokenizer_config.json" in msg and "invalid JSON" in msg


def test_missing_weights(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "model.safetensors").unlink())
    msg = load_error(d)
    assert "no *.safetensors weights" in msg and str(d) in msg


def test_missing_shard(tmp_path, good):
    def shard(d: Path) -> None:
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(
            json.dumps(
                {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
            )
        )

    msg = load_error(broken(tmp_path, good, shard))
    assert "model-00002-of-00002.safetensors" in msg and "re-download" in msg


def test_truncated_weights(tmp_path, good):
    def truncate(d: Path) -> None:
        p = d / "model.safetensors"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    msg = load_error(broken(tmp_path, good, truncate))
    assert "model.safetensors" in msg and "truncated" in msg and "re-download" in msg


def test_corrupt_weights(tmp_path, good):
    d = broken(tmp_path, good, lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64))
    msg = load_error(d)
    assert "model.safetensors" in msg and "re-download" in msg


def test_unsupported_model_type(tmp_path, good):
    msg = load_error(broken(tmp_path, good, edit_config(model_type="gpt2")), UnsupportedModelError)
    assert '"gpt2"' in msg
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        assert arch in msg
    assert issubclass(UnsupportedModelError, ModelLoadError)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_missing_weight_tensor(tmp_path, good, name):
    msg = load_error(broken(tmp_path, good, edit_weights(lambda w: w.pop(name))))
    assert name in msg and "re-download or re-convert" in msg


def test_mistral_is_loaded_as_llama(tmp_path, good):
    d = broken(tmp_path, good, edit_config(model_type="mistral"))
    with mlxrs.Session(d) as s, mlxrs.Session(good) as ref:
        assert (
            s.generate("Paris is", max_tokens=8, ignore_eos=True).tokens
            == ref.generate("Paris is", max_tokens=8, ignore_eos=True).tokens
        )


@pytest.mark.parametrize("kw", [dict(kv_bits=5), dict(max_kv_size=2), dict(prefill_step_size=0)])
def test_invalid_session_options(good, kw):
    msg = load_error(good, InvalidArgumentError, **kw)
    assert next(iter(kw)) in msg


def test_the_process_keeps_running_after_load_errors(tmp_path, good):
    for i, mutate in enumerate(
        [
            lambda d: (d / "config.json").unlink(),
            edit_config(model_type="gpt2"),
            edit_weights(lambda w: w.pop("model.norm.weight")),
        ]
    ):
        d = tmp_path / str(i)
        shutil.copytree(good, d)
        mutate(d)
        with pytest.raises(ModelLoadError):
            mlxrs.Session(d)
    with mlxrs.Session(good) as s:
        c = s.generate("still alive", max_tokens=4, ignore_eos=True)
        assert len(c.tokens) == 4 and c.finish_reason == "length"
