"""FP8 checkpoints (`quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}`,
e4m3 weights stored as safetensors `F8_E4M3` with a float32 `*_scale_inv` per 128×128 block, per
tensor or per expert): dequantized to bfloat16 at load as mlx-lm 0.32.2's sanitize does for
deepseek_v3 (and deepseek_v32 / glm_moe_dsa), mistral4 and ministral3. The checkpoints here are the
tiny float32 models of tests/tinymodels.py with every projection written as real e4m3 bytes
(mx.to_fp8) and its scales; greedy tokens identical to mlx-lm loading the same files, and the
planner counting the bfloat16 weights the engine holds. mlx-lm 0.32.2's ministral3 multiplies the
raw e4m3 codes (uint8) by their scale without decoding them, so its oracle there is mlx-lm on the
same weights decoded by MLX (mx.from_fp8) and written as bfloat16."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlxrs
from mlxrs import _native
from mlxrs.errors import MlxrsError
from tinymodels import make_model

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."
N = 48


def _quantizable(name: str, ndim: int) -> bool:
    """The projections FP8 releases store in e4m3 (not embeddings, norms, routers or the head)."""
    return ndim >= 2 and (
        name.endswith("_proj.weight") or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")
    )


def _block_fp8(w: Any, br: int, bc: int) -> tuple[Any, Any]:
    """e4m3 codes of a 2-D float32 `w` and its float32 scales, one per br × bc block (edges padded)."""
    import mlx.core as mx

    m, n = w.shape
    rb, cb = -(-m // br), -(-n // bc)
    p = mx.pad(w, ((0, rb * br - m), (0, cb * bc - n))).reshape(rb, br, cb, bc)
    scale = mx.maximum(mx.abs(p).max(axis=(1, 3)), 1e-12) / 448.0
    codes = mx.to_fp8(p / scale[:, None, :, None]).reshape(rb * br, cb * bc)[:m, :n]
    return codes, scale


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off, blobs = 0, []
    for k, (dt, shape, b) in tensors.items():
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def fp8_checkpoint(
    src: Path,
    dst: Path,
    *,
    scales: str = "block",
    block: tuple[int, int] = (128, 128),
    config_block: list[int] | None = None,
    drop: str | None = None,
) -> Path:
    """`src` (a float32 tiny model) as an FP8 checkpoint in `dst`: `scales` "block" (one per `block` of a
    2-D weight, one per expert for a stacked 3-D one) or "tensor" (one per tensor, with a static
    activation_scale beside it as Mistral ships); `config_block` the weight_block_size config.json
    claims (default: `block`); `drop` a tensor to leave out."""
    import mlx.core as mx

    dst.mkdir(parents=True)
    w = mx.load(str(src / "model.safetensors"))
    out: dict[str, tuple[str, list[int], bytes]] = {}
    f32 = lambda a: ("F32", list(a.shape), np.array(a.astype(mx.float32)).tobytes())  # noqa: E731
    for k, v in sorted(w.items()):
        if not _quantizable(k, v.ndim):
            out[k] = f32(v)
            continue
        if scales == "block" and v.ndim == 2:
            codes, s = _block_fp8(v, *block)
        else:  # per tensor, or per expert for a stacked [E, out, in]
            axes = tuple(range(v.ndim)) if scales == "tensor" else tuple(range(1, v.ndim))
            s = mx.maximum(mx.abs(v).max(axis=axes, keepdims=scales != "tensor"), 1e-12) / 448.0
            codes = mx.to_fp8(v / s)
        mx.eval(codes, s)
        out[k] = ("F8_E4M3", list(v.shape), np.array(codes).tobytes())
        out[f"{k}_scale_inv"] = f32(s)
        if scales == "tensor":
            out[k.removesuffix("weight") + "activation_scale"] = f32(mx.array(1.0))
    if drop:
        del out[drop]
    _write_safetensors(dst / "model.safetensors", out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": config_block or list(block),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    return dst


def decoded_copy(fp8: Path, dst: Path) -> Path:
    """The FP8 checkpoint's weights decoded by MLX (from_fp8 × scale, in bfloat16), written as a plain
    checkpoint: an oracle for what dequantization must give, independent of mlxrs."""
    import mlx.core as mx

    w = mx.load(str(fp8 / "model.safetensors"))
    br, bc = json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    out = {}
    for k, v in w.items():
        if k.endswith("_scale_inv") or k.endswith("activation_scale"):
            continue
        s = w.get(f"{k}_scale_inv")
        if s is None:
            out[k] = v
            continue
        x = mx.from_fp8(v, dtype=mx.bfloat16)
        if s.ndim == 2 and v.ndim == 2 and s.shape != v.shape and s.size > 1:  # one scale per block
            s = mx.repeat(mx.repeat(s, br, axis=0), bc, axis=1)[: v.shape[0], : v.shape[1]]
        out[k] = (x * s).astype(mx.bfloat16)
    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8 / f, dst / f)
    return dst


def _tokens(d: Path) -> tuple[list[int], list[int]]:
    with mlxrs.Session(d) as s:
        ids = s.tokenize(TEXT)
        return ids, s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens


# (tiny model, scales): deepseek_v3's blocks (a 160-row kv_a projection padded to 256) over
# per-expert tensors before they are stacked; mistral4's blocks over 2-D weights and one scale per
# expert over its fused [experts, 2 × width, hidden] tensors; deepseek_v32 and glm_moe_dsa as
# deepseek_v3, with their indexer's projections
CASES = [("deepseek_v3", "block"), ("deepseek_v32", "block"), ("glm_moe_dsa", "block"), ("mistral4", "block")]


@pytest.mark.parametrize("arch,scales", CASES)
def test_fp8_checkpoint_gives_mlxlm_tokens(oracle, tmp_path, arch, scales):
    d = fp8_checkpoint(make_model(f"{arch}-float32", arch), tmp_path / "fp8", scales=scales)
    ids, got = _tokens(d)
    ref = oracle.generate(d, ids, N)
    assert got == ref["tokens"]
    # the planner counts what the loaded model holds: the e4m3 weights as bfloat16, no scales (the
    # weights of the same checkpoint decoded by MLX and written as bfloat16)
    plan = json.loads(_native.plan(str(d), 64))
    want = json.loads(_native.plan(str(decoded_copy(d, tmp_path / "decoded")), 64))["weightsBytes"]
    assert plan["weightsBytes"] == want


@pytest.mark.parametrize("arch", ["ministral3", "mistral3_ministral3"])
def test_ministral3_fp8_per_tensor_scales(oracle, tmp_path, arch):
    """Mistral's FP8 layout (one scale per tensor, static activation scales): mlxrs's tokens are
    mlx-lm's on the same weights decoded by MLX."""
    d = fp8_checkpoint(make_model(f"{arch}-float32", arch), tmp_path / "fp8", scales="tensor")
    ref_dir = decoded_copy(d, tmp_path / "decoded")
    ids, got = _tokens(d)
    ref = oracle.generate(ref_dir, ids, N)
    assert got == ref["tokens"]


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(tmp_path):
    src = make_model("deepseek_v3-float32", "deepseek_v3")
    name = "model.layers.0.self_attn.o_proj.weight"
    # scales for blocks of 64 in a checkpoint that says 128
    d = fp8_checkpoint(src, tmp_path / "block", block=(64, 64), config_block=[128, 128])
    with pytest.raises(MlxrsError, match=r"weight model\.layers\.\d+\.\S+_scale_inv has shape \[\d+, \d+\] but"):
        mlxrs.Session(d)
    d = fp8_checkpoint(src, tmp_path / "noscale", drop=f"{name}_scale_inv")
    with pytest.raises(MlxrsError, match=f"weight {name} is FP8 .* no {name}_scale_inv"):
        mlxrs.Session(d)
    d = fp8_checkpoint(src, tmp_path / "nocodes", drop=name)
    with pytest.raises(MlxrsError, match=f"weight {name}_scale_inv has no {name}"):
        mlxrs.Session(d)


def test_fp8_of_an_architecture_mlxlm_does_not_dequantize_is_refused(tmp_path):
    """qwen3's mlx-lm file does not dequantize FP8: its FP8 checkpoint is refused naming a weight,
    not run on the raw e4m3 bytes."""
    d = fp8_checkpoint(make_model("qwen3-float32", "qwen3"), tmp_path / "fp8")
    with pytest.raises(
        MlxrsError, match=r"weight model\.layers\.0\.\S+: an FP8 checkpoint of model_type \"qwen3\", which neither"
    ):
        mlxrs.Session(d)
