"""Every op of the core's surface (crates/mlxrs-core/src/handle/ops.rs), run through
`arrays_util.op` (mlxrs._native._op, the test build's op dispatch: crates/mlxrs-py/src/dispatch.rs)
and checked against numpy on the same inputs. mlx.core is the reference only
where numpy has no equivalent (the quantization kernels); rope, attention and the norms are written
out in numpy here."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest

import arrays_util
from arrays_util import np_gated_delta, op
from mlxrs import _native
from mlxrs.errors import InvalidArgumentError, MlxError

ROOT = Path(__file__).resolve().parents[1]
DISPATCH_RS = ROOT / "crates" / "mlxrs-py" / "src" / "dispatch.rs"


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(*shape: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return rng(seed).standard_normal(shape).astype(dtype)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32 (what MLX's astype does)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def out_dtypes(name: str, *inputs: np.ndarray, **params: Any) -> list[str]:
    """The MLX dtype names of an op's outputs (from_raw widens bfloat16, so ask the raw layer)."""
    raws = _native._op(name, [arrays_util.to_raw(x) for x in inputs], json.dumps(params))
    return [r[2] for r in raws]


def one(name: str, *inputs: np.ndarray, **params: Any) -> np.ndarray:
    outs = op(name, *inputs, **params)
    assert len(outs) == 1, f"{name} returned {len(outs)} outputs"
    return outs[0]


# tolerance by the dtype the op ran in
TOL = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}


def in_dtype(x: np.ndarray, dtype: str) -> tuple[np.ndarray, dict[str, Any], np.ndarray]:
    """(what to pass, extra params, the exact values the op sees as float32) for running in `dtype`."""
    if dtype == "float32":
        return x.astype(np.float32), {}, x.astype(np.float32)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h, {}, h.astype(np.float32)
    return x.astype(np.float32), {"cast_inputs": "bfloat16"}, bf16_round(x.astype(np.float32))


def erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


# ---------------------------------------------------------------------------------------------
# coverage: every op dispatch.rs knows is exercised here


def test_every_dispatch_op_is_tested() -> None:
    src = DISPATCH_RS.read_text()
    block = re.search(r"pub const OPS: &\[&str\] = &\[(.*?)\];", src, re.S)
    assert block, "OPS table not found in dispatch.rs"
    names = re.findall(r'"([a-z_0-9]+)"', re.sub(r"//[^\n]*", "", block.group(1)))
    assert len(names) > 90
    me = Path(__file__).read_text()
    missing = [n for n in names if f'"{n}"' not in me]
    assert not missing, f"ops with no test: {missing}"


# ---------------------------------------------------------------------------------------------
# round trips through the data path


@pytest.mark.parametrize(
    "dtype",
    [
        np.float32,
        np.float16,
        np.float64,
        np.int32,
        np.int64,
        np.uint8,
        np.int8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.int16,
        np.bool_,
    ],
)
def test_roundtrip_numpy_dtypes(dtype: Any) -> None:
    x = (randn(3, 5, seed=1) * 50).astype(dtype)
    y = arrays_util.roundtrip(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)


def test_roundtrip_float32_specials() -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.4e38], dtype=np.float32)
    y = arrays_util.roundtrip(x)
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


def test_roundtrip_float16_bit_exact() -> None:
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    x = bits.view(np.float16)
    y = arrays_util.roundtrip(x)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y.view(np.uint16), bits)


def test_roundtrip_bfloat16_bit_exact() -> None:
    bits = np.arange(0, 1 << 16, 5, dtype=np.uint16)
    raw = _native._array_roundtrip(bits.tobytes(), [bits.size], "bfloat16")
    assert raw[2] == "bfloat16" and raw[1] == [bits.size]
    np.testing.assert_array_equal(np.frombuffer(raw[0], dtype=np.uint16), bits)
    widened = arrays_util.roundtrip(bits, "bfloat16")
    np.testing.assert_array_equal(widened.view(np.uint32), bits.astype(np.uint32) << 16)


def test_roundtrip_scalar_and_empty() -> None:
    # 0-d goes through the raw layer (np.ascontiguousarray in arrays_util.to_raw makes it 1-d)
    data, shape, name = _native._array_roundtrip(np.float32(2.5).tobytes(), [], "float32")
    assert shape == [] and name == "float32"
    assert np.frombuffer(data, np.float32).tolist() == [2.5]
    e = np.zeros((0, 3), dtype=np.float32)
    assert arrays_util.roundtrip(e).shape == (0, 3)


def test_roundtrip_rejects_bad_length() -> None:
    with pytest.raises(InvalidArgumentError, match="bytes"):
        _native._array_roundtrip(b"\0" * 7, [2], "float32")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        _native._array_roundtrip(b"\0" * 8, [2], "float99")


# ---------------------------------------------------------------------------------------------
# elementwise

POS = "pos"
UNARY: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str | None]] = {
    "exp": (np.exp, None),
    "log": (np.log, POS),
    "log1p": (np.log1p, POS),
    "sqrt": (np.sqrt, POS),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), POS),
    "negative": (np.negative, None),
    "abs": (np.abs, None),
    "sigmoid": (lambda x: 1.0 / (1.0 + np.exp(-x)), None),
    "tanh": (np.tanh, None),
    "erf": (erf, None),
    "square": (np.square, None),
    "sin": (np.sin, None),
    "cos": (np.cos, None),
    "floor": (np.floor, None),
    "ceil": (np.ceil, None),
    "stop_gradient": (lambda x: x, None),
    "copy": (lambda x: x, None),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name: str, dtype: str) -> None:
    ref, domain = UNARY[name]
    x = randn(4, 7, seed=2) * 2
    if domain == POS:
        x = np.abs(x) + 0.1
    xin, extra, seen = in_dtype(x, dtype)
    out = one(name, xin, **extra)
    assert out.shape == x.shape
    assert out_dtypes(name, xin, **extra) == [dtype]
    want = ref(seen.astype(np.float64))
    if name in ("floor", "ceil"):  # exact in any dtype
        np.testing.assert_array_equal(out.astype(np.float64), want)
    else:
        np.testing.assert_allclose(out.astype(np.float64), want, **TOL[dtype])


def test_unary_predicates() -> None:
    x = np.array([0.0, np.nan, np.inf, -np.inf, 1.5, -2.0], dtype=np.float32)
    np.testing.assert_array_equal(one("isnan", x), np.isnan(x))
    np.testing.assert_array_equal(one("isinf", x), np.isinf(x))
    b = np.array([True, False, True])
    np.testing.assert_array_equal(one("logical_not", b), np.logical_not(b))
    assert out_dtypes("isnan", x) == ["bool"]


BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "floor_divide": np.floor_divide,
    "remainder": np.remainder,
}
COMPARE = {
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcasting(name: str, dtype: str) -> None:
    a = randn(3, 4, seed=3) * 3
    b = randn(4, seed=4) * 3
    if name == "power":
        a = np.abs(a) + 0.5
        b = np.clip(b, -2, 2)
    if name in ("divide", "floor_divide", "remainder"):
        b = np.where(np.abs(b) < 0.5, 0.75, b).astype(np.float32)
    ain, extra, aseen = in_dtype(a, dtype)
    bin_, _, bseen = in_dtype(b, dtype)
    out = one(name, ain, bin_, **extra)
    assert out.shape == (3, 4)
    want = BINARY[name](aseen.astype(np.float64), bseen.astype(np.float64))
    if name == "remainder" and dtype != "float32":
        # MLX 0.30.6's CPU remainder in float16/bfloat16 does not always land in numpy's range (it
        # can be off by one divisor, e.g. 1.921 % 1.123 -> -0.325); it is still congruent mod b
        # and is exactly what mlx.core computes
        k = (out.astype(np.float64) - want) / bseen
        np.testing.assert_allclose(k, np.round(k), atol=2e-2)
        assert np.all(np.abs(out) <= np.abs(bseen) * (1 + 1e-2))
        ref = mx.remainder(mx.array(aseen).astype(getattr(mx, dtype)), mx.array(bseen).astype(getattr(mx, dtype)))
        np.testing.assert_array_equal(out, np.array(ref.astype(mx.float32)))
        return
    np.testing.assert_allclose(out.astype(np.float64), want, **TOL[dtype])


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "maximum", "minimum", "remainder"])
def test_binary_int32(name: str) -> None:
    a = rng(5).integers(-50, 50, (5, 6)).astype(np.int32)
    b = rng(6).integers(1, 9, (5, 6)).astype(np.int32) * np.where(rng(7).random((5, 6)) < 0.5, -1, 1).astype(np.int32)
    out = one(name, a, b)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, BINARY[name](a, b))


def test_floor_divide_int32_nonnegative() -> None:
    # numpy floors; for non-negative operands that is plain integer division in MLX too
    a = rng(8).integers(0, 100, 20).astype(np.int32)
    b = rng(9).integers(1, 9, 20).astype(np.int32)
    np.testing.assert_array_equal(one("floor_divide", a, b), np.floor_divide(a, b))


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_comparisons(name: str) -> None:
    a = rng(10).integers(-3, 3, (4, 5)).astype(np.float32)
    b = rng(11).integers(-3, 3, (5,)).astype(np.float32)
    out = one(name, a, b)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, COMPARE[name](a, b))


@pytest.mark.parametrize("name,ref", [("logical_and", np.logical_and), ("logical_or", np.logical_or)])
def test_logical(name: str, ref: Any) -> None:
    a = rng(12).random((3, 4)) < 0.5
    b = rng(13).random((4,)) < 0.5
    np.testing.assert_array_equal(one(name, a, b), ref(a, b))


def test_matmul_shapes_and_batch() -> None:
    a = randn(2, 3, 5, seed=14)
    b = randn(5, 4, seed=15)
    np.testing.assert_allclose(one("matmul", a, b), a @ b, rtol=1e-5, atol=1e-5)
    v = randn(5, seed=16)
    np.testing.assert_allclose(one("matmul", a, v), a @ v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_matmul_dtypes(dtype: str) -> None:
    a = randn(8, 16, seed=17)
    b = randn(16, 8, seed=18)
    ain, extra, aseen = in_dtype(a, dtype)
    bin_, _, bseen = in_dtype(b, dtype)
    out = one("matmul", ain, bin_, **extra)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1.5e-1}[dtype]
    np.testing.assert_allclose(out, aseen.astype(np.float64) @ bseen, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "dtype,value,want",
    [
        ("int32", 16777217, np.int32(16777217)),  # 2**24 + 1: not representable in float32
        ("int64", 2**40 + 3, np.int64(2**40 + 3)),
        ("uint8", 255, np.uint8(255)),
        ("float32", 0.1, np.float32(0.1)),
        ("float16", 0.1, np.float16(0.1)),
        ("bool", 1, np.bool_(True)),
        ("bool", 0, np.bool_(False)),
    ],
)
def test_scalar_as(dtype: str, value: float, want: Any) -> None:
    out = one("scalar_as", value=value, dtype=dtype)
    assert out.shape == () and out.dtype == np.asarray(want).dtype
    assert out == want


def test_scalar_as_bfloat16() -> None:
    out = one("scalar_as", value=0.1, dtype="bfloat16")
    assert out_dtypes("scalar_as", value=0.1, dtype="bfloat16") == ["bfloat16"]
    assert out == bf16_round(np.array(0.1, np.float32))


def test_addmm() -> None:
    c = randn(3, 4, seed=19)
    a = randn(3, 5, seed=20)
    b = randn(5, 4, seed=21)
    out = one("addmm", c, a, b, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(out, 2.0 * c + 0.5 * (a @ b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one("addmm", c, a, b), c + a @ b, rtol=1e-5, atol=1e-5)


def test_where() -> None:
    cond = rng(22).random((3, 4)) < 0.5
    x = randn(3, 4, seed=23)
    y = randn(4, seed=24)
    np.testing.assert_array_equal(one("where", cond, x, y), np.where(cond, x, y))


def test_clip() -> None:
    a = randn(5, 6, seed=25) * 3
    lo = np.array(-1.0, np.float32)
    hi = np.full((6,), 0.5, np.float32)
    np.testing.assert_array_equal(one("clip", a, lo, hi, opt=["lo", "hi"]), np.clip(a, lo, hi))
    np.testing.assert_array_equal(one("clip", a, lo, opt=["lo"]), np.maximum(a, lo))
    np.testing.assert_array_equal(one("clip", a, hi, opt=["hi"]), np.minimum(a, hi))


def test_astype() -> None:
    x = randn(4, 6, seed=26) * 100
    np.testing.assert_array_equal(one("astype", x, dtype="int32"), x.astype(np.int32))
    np.testing.assert_array_equal(one("astype", x, dtype="float16"), x.astype(np.float16))
    np.testing.assert_array_equal(one("astype", x, dtype="bfloat16"), bf16_round(x))
    assert out_dtypes("astype", x, dtype="bfloat16") == ["bfloat16"]
    np.testing.assert_array_equal(one("astype", x, dtype="bool"), x.astype(bool))
    i = rng(27).integers(-1000, 1000, 10).astype(np.int32)
    np.testing.assert_array_equal(one("astype", i, dtype="float32"), i.astype(np.float32))
    np.testing.assert_array_equal(one("astype", i, dtype="int8"), i.astype(np.int8))


def test_view() -> None:
    x = randn(3, 4, seed=28)
    np.testing.assert_array_equal(one("view", x, dtype="uint32"), x.view(np.uint32))
    np.testing.assert_array_equal(one("view", x, dtype="int32"), x.view(np.int32))
    h = x.astype(np.float16)
    np.testing.assert_array_equal(one("view", h, dtype="uint16"), h.view(np.uint16))
    # a narrower view multiplies the last axis
    np.testing.assert_array_equal(one("view", x, dtype="uint8"), x.view(np.uint8))


def test_contiguous() -> None:
    x = randn(2, 3, 4, seed=29)
    np.testing.assert_array_equal(one("contiguous", x), x)
    np.testing.assert_array_equal(one("contiguous", x, axes=[2, 0, 1]), np.ascontiguousarray(x.transpose(2, 0, 1)))


# ---------------------------------------------------------------------------------------------
# creation


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "uint8", "bool"])
def test_zeros_ones(dtype: str) -> None:
    z = one("zeros", shape=[2, 3], dtype=dtype)
    o = one("ones", shape=[4], dtype=dtype)
    np.testing.assert_array_equal(z, np.zeros((2, 3), dtype=dtype))
    np.testing.assert_array_equal(o, np.ones((4,), dtype=dtype))
    assert z.dtype == np.dtype(dtype) and o.dtype == np.dtype(dtype)


def test_full() -> None:
    v = np.array(2.5, np.float32)
    np.testing.assert_array_equal(one("full", v, shape=[2, 3]), np.full((2, 3), 2.5, np.float32))
    out = one("full", v, shape=[3], dtype="int32")
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.full((3,), 2, np.int32))
    row = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(one("full", row, shape=[2, 3]), np.broadcast_to(row, (2, 3)))


@pytest.mark.parametrize(
    "start,stop,step,dtype",
    [
        (0, 10, 1, "int32"),
        (2, 11, 3, "int32"),
        (0.0, 1.0, 0.125, "float32"),
        (5, -5, -2, "float32"),
        (0, 7, 1, "float16"),
    ],
)
def test_arange(start: float, stop: float, step: float, dtype: str) -> None:
    out = one("arange", start=start, stop=stop, step=step, dtype=dtype)
    np.testing.assert_array_equal(out, np.arange(start, stop, step).astype(dtype))
    assert out.dtype == np.dtype(dtype)


# ---------------------------------------------------------------------------------------------
# shape


def test_reshape_transpose_swapaxes() -> None:
    x = randn(2, 3, 4, seed=30)
    np.testing.assert_array_equal(one("reshape", x, shape=[4, -1]), x.reshape(4, -1))
    np.testing.assert_array_equal(one("transpose", x), x.transpose())
    np.testing.assert_array_equal(one("transpose", x, axes=[1, 2, 0]), x.transpose(1, 2, 0))
    np.testing.assert_array_equal(one("swapaxes", x, axis1=0, axis2=2), np.swapaxes(x, 0, 2))


def test_expand_squeeze_flatten_broadcast() -> None:
    x = randn(2, 1, 4, 1, seed=31)
    np.testing.assert_array_equal(one("expand_dims", x, axis=-1), np.expand_dims(x, -1))
    np.testing.assert_array_equal(one("expand_dims", x, axis=0), np.expand_dims(x, 0))
    np.testing.assert_array_equal(one("squeeze", x, axes=[1, 3]), x.squeeze((1, 3)))
    np.testing.assert_array_equal(one("squeeze", x, axes=[-1]), x.squeeze(-1))
    y = randn(2, 3, 4, 5, seed=32)
    np.testing.assert_array_equal(one("flatten", y), y.reshape(-1))
    np.testing.assert_array_equal(one("flatten", y, start_axis=1, end_axis=2), y.reshape(2, 12, 5))
    r = randn(3, 1, seed=33)
    np.testing.assert_array_equal(one("broadcast_to", r, shape=[2, 3, 4]), np.broadcast_to(r, (2, 3, 4)))


def test_concatenate_stack_split() -> None:
    a, b, c = randn(2, 3, seed=34), randn(2, 1, seed=35), randn(2, 2, seed=36)
    np.testing.assert_array_equal(one("concatenate", a, b, c, axis=1), np.concatenate([a, b, c], axis=1))
    d, e = randn(2, 3, seed=37), randn(2, 3, seed=38)
    np.testing.assert_array_equal(one("stack", a, d, e), np.stack([a, d, e]))
    np.testing.assert_array_equal(one("stack", a, d, axis=-1), np.stack([a, d], axis=-1))
    x = randn(4, 6, seed=39)
    parts = op("split", x, parts=3, axis=1)
    assert len(parts) == 3
    for got, want in zip(parts, np.split(x, 3, axis=1)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(MlxError):
        op("split", x, parts=4, axis=1)  # 6 does not split into 4 equal parts


def test_repeat() -> None:
    x = randn(2, 3, seed=40)
    np.testing.assert_array_equal(one("repeat", x, repeats=3, axis=1), np.repeat(x, 3, axis=1))
    np.testing.assert_array_equal(one("repeat", x, repeats=2, axis=0), np.repeat(x, 2, axis=0))


def test_pad() -> None:
    x = randn(2, 3, seed=41)
    want = np.pad(x, ((1, 2), (0, 3)), constant_values=0)
    np.testing.assert_array_equal(one("pad", x, low=[1, 0], high=[2, 3]), want)
    want = np.pad(x, ((0, 0), (2, 1)), constant_values=-7.5)
    np.testing.assert_array_equal(one("pad", x, axes=[1], low=[2], high=[1], value=-7.5), want)
    v = np.array(4.0, np.float32)
    np.testing.assert_array_equal(
        one("pad", x, v, axes=[0], low=[1], high=[0], opt=["value"]), np.pad(x, ((1, 0), (0, 0)), constant_values=4.0)
    )


# ---------------------------------------------------------------------------------------------
# indexing


def test_slice() -> None:
    x = randn(5, 6, 7, seed=42)
    np.testing.assert_array_equal(one("slice", x, start=[1, 0, 2], stop=[4, 6, 7]), x[1:4, 0:6, 2:7])
    np.testing.assert_array_equal(
        one("slice", x, start=[0, 1, 0], stop=[5, 6, 7], strides=[2, 2, 3]), x[0:5:2, 1:6:2, 0:7:3]
    )
    np.testing.assert_array_equal(one("slice_axis", x, axis=-1, start=2, stop=5), x[..., 2:5])
    np.testing.assert_array_equal(one("slice_axis", x, axis=0, start=3, stop=5), x[3:5])
    with pytest.raises(InvalidArgumentError, match="axis"):
        op("slice_axis", x, axis=3, start=0, stop=1)


def test_slice_update() -> None:
    x = randn(4, 5, seed=43)
    u = randn(2, 3, seed=44)
    want = x.copy()
    want[1:3, 2:5] = u
    np.testing.assert_array_equal(one("slice_update", x, u, start=[1, 2], stop=[3, 5]), want)
    u2 = randn(2, 5, seed=45)
    want = x.copy()
    want[0:4:2, :] = u2
    np.testing.assert_array_equal(one("slice_update", x, u2, start=[0, 0], stop=[4, 5], strides=[2, 1]), want)
    # the source is not modified in place
    np.testing.assert_array_equal(x, randn(4, 5, seed=43))


def test_take_and_along_axis() -> None:
    x = randn(4, 5, seed=46)
    idx = np.array([3, 0, 3, 1], np.int32)
    np.testing.assert_array_equal(one("take", x, idx, axis=0), np.take(x, idx, axis=0))
    np.testing.assert_array_equal(one("take", x, idx, axis=1), np.take(x, idx, axis=1))
    idx2 = np.argsort(x, axis=1).astype(np.int32)
    np.testing.assert_array_equal(one("take_along_axis", x, idx2, axis=1), np.take_along_axis(x, idx2, axis=1))
    put_idx = np.array([[0], [2], [4], [1]], np.int32)
    vals = randn(4, 1, seed=47)
    want = x.copy()
    np.put_along_axis(want, put_idx, vals, axis=1)
    np.testing.assert_array_equal(one("put_along_axis", x, put_idx, vals, axis=1), want)


def test_gather() -> None:
    x = randn(5, 6, 7, seed=48)
    i0 = np.array([4, 0, 2], np.int32)
    i2 = np.array([6, 1, 1], np.int32)
    out = one("gather", x, i0, i2, axes=[0, 2], slice_sizes=[1, 6, 1])
    want = np.stack([x[a, :, c] for a, c in zip(i0, i2)]).reshape(3, 1, 6, 1)
    np.testing.assert_array_equal(out, want)
    # one index array, slices of two rows
    out = one("gather", x, np.array([1, 3], np.int32), axes=[0], slice_sizes=[2, 6, 7])
    np.testing.assert_array_equal(out, np.stack([x[1:3], x[3:5]]))


# ---------------------------------------------------------------------------------------------
# reductions and friends

REDUCE = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
    "logsumexp": lambda x, axis, keepdims: np.log(np.sum(np.exp(x), axis=axis, keepdims=keepdims)),
}


@pytest.mark.parametrize("name", sorted(REDUCE))
@pytest.mark.parametrize("axes,keepdims", [(None, False), ([1], False), ([0, 2], True), ([-1], True)])
def test_reductions(name: str, axes: list[int] | None, keepdims: bool) -> None:
    x = randn(3, 4, 5, seed=49)
    params: dict[str, Any] = {"keepdims": keepdims}
    if axes is not None:
        params["axes"] = axes
    out = one(name, x, **params)
    want = REDUCE[name](x.astype(np.float64), axis=None if axes is None else tuple(axes), keepdims=keepdims)
    assert out.shape == np.shape(want)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_logsumexp_is_stable() -> None:
    x = np.array([[1000.0, 1000.0], [-1000.0, -1001.0]], np.float32)
    want = np.array([1000 + math.log(2), -1000 + math.log1p(math.exp(-1))])
    np.testing.assert_allclose(one("logsumexp", x, axes=[1]), want, rtol=1e-6)


def test_argmax_argmin() -> None:
    x = rng(50).permutation(60).reshape(3, 4, 5).astype(np.float32)
    for axis in (0, 1, -1):
        np.testing.assert_array_equal(one("argmax", x, axis=axis), np.argmax(x, axis=axis))
        np.testing.assert_array_equal(one("argmin", x, axis=axis), np.argmin(x, axis=axis))
    out = one("argmax", x, axis=1, keepdims=True)
    np.testing.assert_array_equal(out, np.argmax(x, axis=1, keepdims=True))
    assert out_dtypes("argmax", x) == ["uint32"]


def np_softmax(x: np.ndarray, axis: int | tuple[int, ...] = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_softmax(dtype: str) -> None:
    x = randn(3, 10, seed=51) * 4
    xin, extra, seen = in_dtype(x, dtype)
    out = one("softmax", xin, **extra)
    np.testing.assert_allclose(out, np_softmax(seen.astype(np.float64)), **TOL[dtype])
    out = one("softmax", xin, precise=True, **extra)
    np.testing.assert_allclose(out, np_softmax(seen.astype(np.float64)), **TOL[dtype])
    out = one("softmax", xin, axes=[0, 1], **extra)
    np.testing.assert_allclose(out, np_softmax(seen.astype(np.float64), axis=(0, 1)), **TOL[dtype])


def test_cumsum() -> None:
    x = randn(3, 6, seed=52)
    np.testing.assert_allclose(one("cumsum", x, axis=1), np.cumsum(x, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one("cumsum", x, axis=0), np.cumsum(x, axis=0), rtol=1e-5, atol=1e-6)
    rev = np.flip(np.cumsum(np.flip(x, 1), axis=1), 1)
    np.testing.assert_allclose(one("cumsum", x, axis=1, reverse=True), rev, rtol=1e-5, atol=1e-6)
    excl = np.cumsum(x, axis=1) - x
    np.testing.assert_allclose(one("cumsum", x, axis=1, inclusive=False), excl, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kth", [0, 3, 9])
def test_partition_argpartition(kth: int) -> None:
    x = rng(53).permutation(40).reshape(4, 10).astype(np.float32)
    part = one("partition", x, kth=kth)
    sx = np.sort(x, axis=-1)
    np.testing.assert_array_equal(part[:, kth], sx[:, kth])
    assert np.all(part[:, :kth] <= part[:, kth : kth + 1]) and np.all(part[:, kth + 1 :] >= part[:, kth : kth + 1])
    np.testing.assert_array_equal(np.sort(part, axis=-1), sx)  # a permutation of each row
    idx = one("argpartition", x, kth=kth)
    np.testing.assert_array_equal(np.sort(idx, axis=-1), np.tile(np.arange(10), (4, 1)))
    vals = np.take_along_axis(x, idx.astype(np.int64), axis=-1)
    np.testing.assert_array_equal(vals[:, kth], sx[:, kth])
    assert np.all(vals[:, :kth] <= vals[:, kth : kth + 1]) and np.all(vals[:, kth + 1 :] >= vals[:, kth : kth + 1])
    part0 = one("partition", x, kth=1, axis=0)
    np.testing.assert_array_equal(part0[1], np.sort(x, axis=0)[1])


def test_topk() -> None:
    x = randn(3, 20, seed=54)
    for k in (1, 5, 20):
        out = one("topk", x, k=k)
        assert out.shape == (3, k)
        np.testing.assert_array_equal(np.sort(out, axis=-1), np.sort(x, axis=-1)[:, -k:])
    out = one("topk", x, k=2, axis=0)
    np.testing.assert_array_equal(np.sort(out, axis=0), np.sort(x, axis=0)[-2:])


def test_sort_argsort() -> None:
    x = randn(4, 9, seed=55)
    np.testing.assert_array_equal(one("sort", x), np.sort(x, axis=-1))
    np.testing.assert_array_equal(one("sort", x, axis=0), np.sort(x, axis=0))
    np.testing.assert_array_equal(one("argsort", x), np.argsort(x, axis=-1))
    np.testing.assert_array_equal(one("argsort", x, axis=0), np.argsort(x, axis=0))


@pytest.mark.parametrize("k", [-1, 0, 2])
def test_tril_triu(k: int) -> None:
    x = randn(5, 6, seed=56)
    np.testing.assert_array_equal(one("tril", x, k=k), np.tril(x, k))
    np.testing.assert_array_equal(one("triu", x, k=k), np.triu(x, k))


# ---------------------------------------------------------------------------------------------
# quantization (mlx.core is the reference for the packed layout)


def mx_np(a: Any) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_matches_mlx_and_roundtrips(bits: int, group_size: int) -> None:
    w = randn(16, 256, seed=57)
    q, s, b = op("quantize", w, group_size=group_size, bits=bits)
    mq, ms, mb = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    assert q.dtype == np.uint32 and q.shape == (16, 256 * bits // 32)
    assert s.shape == b.shape == (16, 256 // group_size)
    np.testing.assert_array_equal(q, mx_np(mq))
    np.testing.assert_allclose(s, mx_np(ms), rtol=1e-6)
    np.testing.assert_allclose(b, mx_np(mb), rtol=1e-6, atol=1e-7)
    deq = one("dequantize", q, s, b, opt=["biases"], group_size=group_size, bits=bits)
    np.testing.assert_allclose(
        deq, mx_np(mx.dequantize(mq, ms, mb, group_size=group_size, bits=bits)), rtol=1e-6, atol=1e-6
    )
    # dequantize(quantize(w)) ≈ w: MLX snaps the group's larger-magnitude edge onto the grid (the
    # scale is negative when that edge is the minimum), so an element can be up to one step off;
    # on average it is about a quarter step
    step = np.repeat(np.abs(s), group_size, axis=1)
    err = np.abs(deq - w) / step
    assert err.max() <= 1 + 1e-3, err.max()
    assert err.mean() < 0.3, err.mean()
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert rel < {2: 0.6, 4: 0.12, 8: 0.008}[bits], rel
    # and the affine reconstruction is what the packed codes say: code * scale + bias
    codes = np.stack(
        [(q[:, i // (32 // bits)] >> (bits * (i % (32 // bits)))) & ((1 << bits) - 1) for i in range(256)], axis=1
    ).astype(np.float32)
    np.testing.assert_allclose(
        deq, codes * np.repeat(s, group_size, axis=1) + np.repeat(b, group_size, axis=1), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("transpose", [True, False])
def test_quantized_matmul(transpose: bool) -> None:
    gs, bits = 64, 4
    # transpose: w is [N, K] (x @ w.T); else w is [K, N] (x @ w); either way quantized along its last axis
    w = randn(96, 128, seed=58) if transpose else randn(64, 128, seed=58)
    x = randn(5, 128 if transpose else 64, seed=59)
    q, s, b = op("quantize", w, group_size=gs, bits=bits)
    out = one("quantized_matmul", x, q, s, b, opt=["biases"], transpose=transpose, group_size=gs, bits=bits)
    ref = mx.quantized_matmul(
        mx.array(x), mx.array(q), mx.array(s), mx.array(b), transpose=transpose, group_size=gs, bits=bits
    )
    np.testing.assert_allclose(out, mx_np(ref), rtol=1e-5, atol=1e-4)
    deq = one("dequantize", q, s, b, opt=["biases"], group_size=gs, bits=bits)
    want = x @ (deq.T if transpose else deq)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


def test_gather_mm() -> None:
    a = randn(3, 4, 6, seed=60)  # 3 "experts" of lhs
    b = randn(5, 6, 2, seed=61)  # 5 of rhs
    lhs = np.array([2, 0, 1, 1], np.uint32)
    rhs = np.array([4, 4, 0, 3], np.uint32)
    out = one("gather_mm", a, b, lhs, rhs, opt=["lhs_indices", "rhs_indices"])
    want = np.stack([a[i] @ b[j] for i, j in zip(lhs, rhs)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # rhs only (the MoE case), sorted
    x = randn(4, 1, 6, seed=62)
    srt = np.array([0, 1, 1, 3], np.uint32)
    out = one("gather_mm", x, b, srt, opt=["rhs_indices"], sorted_indices=True)
    want = np.stack([x[i] @ b[j] for i, j in enumerate(srt)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_gather_qmm() -> None:
    gs, bits = 32, 4
    experts = randn(4, 16, 64, seed=63)  # [E, N, K]
    q, s, b = op("quantize", experts, group_size=gs, bits=bits)
    x = randn(6, 1, 64, seed=64)
    rhs = np.array([3, 0, 0, 2, 1, 3], np.uint32)
    out = one("gather_qmm", x, q, s, b, rhs, opt=["biases", "rhs_indices"], transpose=True, group_size=gs, bits=bits)
    ref = mx.gather_qmm(
        mx.array(x),
        mx.array(q),
        mx.array(s),
        mx.array(b),
        rhs_indices=mx.array(rhs),
        transpose=True,
        group_size=gs,
        bits=bits,
    )
    np.testing.assert_allclose(out, mx_np(ref), rtol=1e-5, atol=1e-4)
    deq = one("dequantize", q, s, b, opt=["biases"], group_size=gs, bits=bits)
    want = np.stack([x[i] @ deq[e].T for i, e in enumerate(rhs)])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)
    srt = np.sort(rhs)
    out = one(
        "gather_qmm", x, q, s, b, srt, opt=["biases", "rhs_indices"], group_size=gs, bits=bits, sorted_indices=True
    )
    want = np.stack([x[i] @ deq[e].T for i, e in enumerate(srt)])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# fast kernels, against numpy


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rms_norm(dtype: str) -> None:
    x = randn(2, 3, 32, seed=65) * 3
    w = randn(32, seed=66)
    xin, extra, xs = in_dtype(x, dtype)
    win, _, ws = in_dtype(w, dtype)
    out = one("rms_norm", xin, win, opt=["weight"], eps=1e-5, **extra)
    want = xs / np.sqrt(np.mean(xs.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * ws
    np.testing.assert_allclose(out, want, **TOL[dtype])
    out = one("rms_norm", xin, eps=1e-3, **extra)
    want = xs / np.sqrt(np.mean(xs.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layer_norm(dtype: str) -> None:
    x = randn(4, 48, seed=67) * 2 + 1
    w, b = randn(48, seed=68), randn(48, seed=69)
    xin, extra, xs = in_dtype(x, dtype)
    win, _, ws = in_dtype(w, dtype)
    bin_, _, bs = in_dtype(b, dtype)
    xs64 = xs.astype(np.float64)
    norm = (xs64 - xs64.mean(-1, keepdims=True)) / np.sqrt(xs64.var(-1, keepdims=True) + 1e-5)
    tol = TOL[dtype] if dtype == "float32" else {"rtol": 3 * TOL[dtype]["rtol"], "atol": 3 * TOL[dtype]["atol"]}
    np.testing.assert_allclose(
        one("layer_norm", xin, win, bin_, opt=["weight", "bias"], **extra), norm * ws + bs, **tol
    )
    np.testing.assert_allclose(one("layer_norm", xin, win, opt=["weight"], **extra), norm * ws, **tol)
    np.testing.assert_allclose(one("layer_norm", xin, bin_, opt=["bias"], **extra), norm + bs, **tol)
    np.testing.assert_allclose(one("layer_norm", xin, **extra), norm, **tol)


def np_rope(
    x: np.ndarray,
    dims: int,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int,
    freqs: np.ndarray | None = None,
) -> np.ndarray:
    """Rotary embedding over the last `dims` features; positions run along axis -2."""
    x = x.astype(np.float64)
    L = x.shape[-2]
    inv = 1.0 / freqs if freqs is not None else base ** (-np.arange(0, dims, 2) / dims)
    pos = (np.arange(L) + offset) * scale
    theta = pos[:, None] * inv[None, :]  # [L, dims/2]
    cos, sin = np.cos(theta), np.sin(theta)
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
    else:
        h = dims // 2
        x1, x2 = rot[..., :h], rot[..., h:]
        out = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return np.concatenate([out, rest], axis=-1)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,offset,scale", [(16, 0, 1.0), (16, 7, 1.0), (8, 3, 0.5)])
def test_rope(traditional: bool, dims: int, offset: int, scale: float) -> None:
    x = randn(2, 3, 5, 16, seed=70)
    out = one("rope", x, dims=dims, traditional=traditional, base=10000.0, scale=scale, offset=offset)
    np.testing.assert_allclose(out, np_rope(x, dims, traditional, 10000.0, scale, offset), rtol=1e-4, atol=1e-4)


def test_rope_freqs_and_dtypes() -> None:
    x = randn(1, 2, 6, 16, seed=71)
    freqs = (500000.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32) * np.linspace(1, 4, 8).astype(np.float32)
    out = one("rope", x, freqs, opt=["freqs"], dims=16, offset=2)
    np.testing.assert_allclose(out, np_rope(x, 16, False, None, 1.0, 2, freqs.astype(np.float64)), rtol=1e-4, atol=1e-4)
    for dtype in ("float16", "bfloat16"):
        xin, extra, xs = in_dtype(x, dtype)
        out = one("rope", xin, dims=16, offset=5, **extra)
        tol = 2 * TOL[dtype]["atol"]
        np.testing.assert_allclose(out, np_rope(xs, 16, False, 10000.0, 1.0, 5), rtol=tol, atol=tol)


def np_sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    mask: str | np.ndarray | None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k = np.repeat(k, hq // hk, axis=1)
    v = np.repeat(v, hq // hk, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * scale
    L, S = s.shape[-2:]
    if isinstance(mask, str):
        keep = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
        s = np.where(keep, s, -np.inf)
    elif mask is not None and mask.dtype == np.bool_:
        s = np.where(mask, s, -np.inf)
    elif mask is not None:
        s = s + mask
    if sinks is not None:
        sink = np.broadcast_to(sinks.astype(np.float64)[None, :, None, None], s.shape[:-1] + (1,))
        s = np.concatenate([sink, s], axis=-1)
        return (np_softmax(s)[..., 1:]) @ v
    return np_softmax(s) @ v


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("heads,L,S", [((4, 4), 6, 6), ((4, 2), 3, 9), ((6, 1), 1, 5)])
def test_scaled_dot_product_attention(mask: str, heads: tuple[int, int], L: int, S: int) -> None:
    hq, hk = heads
    D = 16
    q, k, v = randn(2, hq, L, D, seed=72), randn(2, hk, S, D, seed=73), randn(2, hk, S, D, seed=74)
    scale = D**-0.5
    if mask == "none":
        out = one("scaled_dot_product_attention", q, k, v)  # default scale is D^-1/2
        want = np_sdpa(q, k, v, scale, None)
    elif mask == "causal":
        out = one("scaled_dot_product_attention", q, k, v, mask="causal", scale=scale)
        want = np_sdpa(q, k, v, scale, "causal")
    elif mask == "bool":
        m = rng(75).random((L, S)) < 0.7
        m[:, 0] = True  # no fully masked rows
        out = one("scaled_dot_product_attention", q, k, v, m, mask="array", scale=scale)
        want = np_sdpa(q, k, v, scale, m)
    else:
        m = (rng(76).standard_normal((1, hq, L, S)) * 2).astype(np.float32)
        out = one("scaled_dot_product_attention", q, k, v, m, mask="array", scale=scale)
        want = np_sdpa(q, k, v, scale, m)
    assert out.shape == (2, hq, L, D)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_sdpa_sinks_scale_and_low_precision() -> None:
    q, k, v = randn(1, 4, 3, 8, seed=77), randn(1, 2, 5, 8, seed=78), randn(1, 2, 5, 8, seed=79)
    sinks = randn(4, seed=80)
    out = one("scaled_dot_product_attention", q, k, v, sinks, mask="causal", opt=["sinks"], scale=0.3)
    np.testing.assert_allclose(out, np_sdpa(q, k, v, 0.3, "causal", sinks), rtol=1e-4, atol=1e-4)
    for dtype in ("float16", "bfloat16"):
        (qi, extra, qs), (ki, _, ks), (vi, _, vs) = (in_dtype(a, dtype) for a in (q, k, v))
        out = one("scaled_dot_product_attention", qi, ki, vi, mask="causal", **extra)
        tol = 2 * TOL[dtype]["atol"]
        np.testing.assert_allclose(out, np_sdpa(qs, ks, vs, 8**-0.5, "causal"), rtol=tol, atol=tol)


@pytest.mark.parametrize("t", [1, 5])
def test_gated_delta_ops_and_the_kernel_on_cpu(t: int) -> None:
    """The reference recurrence against numpy (2 key heads shared by 4 value heads, a carried
    state); the CUDA kernel's shape checks name what is wrong, and MLX refuses the kernel itself
    off a GPU (bench/check_gdn_kernel.py compares the two paths on one)."""
    b, hk, hv, dk, dv = 2, 2, 4, 32, 16
    q, k = randn(b, t, hk, dk, seed=90) * 0.2, randn(b, t, hk, dk, seed=91) * 0.2
    v = randn(b, t, hv, dv, seed=92)
    g = rng(93).uniform(0.5, 1.0, (b, t, hv)).astype(np.float32)
    beta = rng(94).uniform(0.0, 1.0, (b, t, hv)).astype(np.float32)
    state = randn(b, hv, dv, dk, seed=95) * 0.1
    y, s = op("gated_delta_ops", q, k, v, g, beta, state)
    wy, ws = np_gated_delta(q, k, v, g, beta, state)
    np.testing.assert_allclose(y, wy, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s, ws, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidArgumentError, match="key head dim 16 is not a multiple of 32"):
        op("gated_delta_kernel", q[..., :16], k[..., :16], v, g, beta, state[..., :16])
    with pytest.raises(InvalidArgumentError, match=r"state \[2, 4, 16, 16\] is not \[2, 4, 16, 32\]"):
        op("gated_delta_kernel", q, k, v, g, beta, state[..., :16])
    if mx.default_device() == mx.cpu:
        with pytest.raises(MlxError, match="No CUDA back-end|Only supports the GPU"):
            op("gated_delta_kernel", q, k, v, g, beta, state)


# ---------------------------------------------------------------------------------------------
# random (explicit keys)


def key(seed: int) -> np.ndarray:
    return one("random_key", seed=seed)


def test_random_key_and_split() -> None:
    k1, k1b, k2 = key(1), key(1), key(2)
    assert k1.dtype == np.uint32 and k1.shape == (2,)
    np.testing.assert_array_equal(k1, k1b)
    assert not np.array_equal(k1, k2)
    a, b = op("random_split", k1)
    a2, b2 = op("random_split", k1)
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(b, b2)
    assert a.shape == b.shape == (2,)
    assert not np.array_equal(a, b) and not np.array_equal(a, k1) and not np.array_equal(b, k1)
    # the same as mlx.core's own key derivation
    np.testing.assert_array_equal(k1, np.array(mx.random.key(1)))
    ma, mb = mx.random.split(mx.random.key(1))
    np.testing.assert_array_equal(a, np.array(ma))
    np.testing.assert_array_equal(b, np.array(mb))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_random_uniform(dtype: str) -> None:
    k = key(7)
    u = one("random_uniform", k, shape=[200, 100], dtype=dtype)
    assert out_dtypes("random_uniform", k, shape=[2], dtype=dtype) == [dtype]
    np.testing.assert_array_equal(u, one("random_uniform", k, shape=[200, 100], dtype=dtype))
    other = one("random_uniform", key(8), shape=[200, 100], dtype=dtype)
    assert not np.array_equal(u, other)
    assert u.shape == (200, 100)
    assert np.all(u >= 0) and np.all(u < 1)
    n = u.size
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n) + (4e-3 if dtype != "float32" else 0)
    assert abs(u.var() - 1 / 12) < 5e-3
    # roughly flat: each tenth of [0,1) holds about a tenth of the draws
    hist, _ = np.histogram(u.astype(np.float64), bins=10, range=(0, 1))
    assert np.all(np.abs(hist / n - 0.1) < 0.01)


def test_random_normal() -> None:
    k = key(9)
    x = one("random_normal", k, shape=[100000])
    np.testing.assert_array_equal(x, one("random_normal", k, shape=[100000]))
    assert not np.array_equal(x, one("random_normal", key(10), shape=[100000]))
    assert abs(x.mean()) < 5 / math.sqrt(x.size)
    assert abs(x.std() - 1) < 0.01
    # the tails: P(|x| > 2) ≈ 0.0455
    assert abs(np.mean(np.abs(x) > 2) - 0.0455) < 0.003
    h = one("random_normal", k, shape=[10], dtype="float16")
    assert h.dtype == np.float16


def test_random_gumbel() -> None:
    k = key(11)
    g = one("random_gumbel", k, shape=[100000])
    np.testing.assert_array_equal(g, one("random_gumbel", k, shape=[100000]))
    assert not np.array_equal(g, one("random_gumbel", key(12), shape=[100000]))
    euler_gamma = 0.5772156649
    assert abs(g.mean() - euler_gamma) < 0.02
    assert abs(g.std() - math.pi / math.sqrt(6)) < 0.02


def test_random_categorical_frequencies() -> None:
    logits = np.array([1.0, 0.0, -1.0, 2.0, 0.5], np.float32)
    p = np_softmax(logits.astype(np.float64))
    n = 40000
    k = key(13)
    draws = one("random_categorical", np.broadcast_to(logits, (n, 5)).copy(), k, opt=["key"])
    assert draws.shape == (n,) and draws.dtype == np.uint32
    np.testing.assert_array_equal(
        draws, one("random_categorical", np.broadcast_to(logits, (n, 5)).copy(), k, opt=["key"])
    )
    other = one("random_categorical", np.broadcast_to(logits, (n, 5)).copy(), key(14), opt=["key"])
    assert not np.array_equal(draws, other)
    counts = np.bincount(draws, minlength=5)
    assert counts.sum() == n
    # Pearson chi-square with 4 degrees of freedom: 99.99th percentile is 23.51
    chi2 = float(np.sum((counts - n * p) ** 2 / (n * p)))
    assert chi2 < 23.51, (counts / n, p)
    # axis 0: one draw per column
    cols = one(
        "random_categorical", np.log(np.array([[0.999, 1e-6], [1e-6, 0.999]], np.float32)), k, opt=["key"], axis=0
    )
    np.testing.assert_array_equal(cols, [0, 1])


def test_random_seed_makes_global_draws_repeatable() -> None:
    logits = np.zeros((2000, 8), np.float32)
    assert op("random_seed", seed=42) == []
    a = one("random_categorical", logits)
    op("random_seed", seed=42)
    b = one("random_categorical", logits)
    op("random_seed", seed=43)
    c = one("random_categorical", logits)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) == set(range(8))


# ---------------------------------------------------------------------------------------------
# evaluation, compile, safetensors


def test_eval_and_async_eval() -> None:
    a, b = randn(3, 3, seed=81), randn(4, seed=82)
    for name in ("eval", "async_eval"):
        outs = op(name, a, b)
        assert len(outs) == 2
        np.testing.assert_array_equal(outs[0], a)
        np.testing.assert_array_equal(outs[1], b)


def test_compiled_function() -> None:
    x, y = randn(4, 5, seed=83), randn(5, seed=84)
    np.testing.assert_allclose(one("compiled", x, y, fn="x*y+x"), x * y + x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(one("compiled", x, y, fn="exp(x)-y", calls=3), np.exp(x) - y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(one("compiled", x, x, fn="x*y+x", shapeless=True, calls=2), x * x + x, rtol=1e-6)
    h = x.astype(np.float16)
    out = one("compiled", h, h)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, h.astype(np.float32) ** 2 + h, rtol=2e-3, atol=2e-3)


def test_compiled_function_error_is_mlxs_own() -> None:
    a, b = randn(2, 3, seed=85), randn(4, 5, seed=86)
    with pytest.raises(ValueError) as ref:
        mx.matmul(mx.array(a), mx.array(b))
    with pytest.raises(MlxError) as err:
        op("compiled", a, b, fn="x@y")
    assert str(ref.value).rstrip(".") in str(err.value)
    np.testing.assert_allclose(one("compiled", a, a.T, fn="x@y"), a @ a.T, rtol=1e-5, atol=1e-5)


def test_safetensors_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "rt.safetensors"
    tensors = {
        "f32": randn(3, 4, seed=87),
        "f16": randn(5, seed=88).astype(np.float16),
        "i32": rng(89).integers(-9, 9, (2, 2, 2)).astype(np.int32),
        "u8": rng(90).integers(0, 255, (7,)).astype(np.uint8),
    }
    names = list(tensors)
    outs = op("safetensors_roundtrip", *tensors.values(), path=str(path), names=names, metadata={"format": "mlx"})
    for n, got in zip(names, outs):
        assert got.dtype == tensors[n].dtype
        np.testing.assert_array_equal(got, tensors[n])
    # the file is a real safetensors file: mlx.core reads it with the metadata
    loaded, meta = mx.load(str(path), return_metadata=True)
    assert meta == {"format": "mlx"}
    for n in names:
        np.testing.assert_array_equal(np.array(loaded[n]), tensors[n])
    # and so does a plain reader of the format
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + hlen])
    assert header["__metadata__"] == {"format": "mlx"}
    lo, hi = header["f32"]["data_offsets"]
    np.testing.assert_array_equal(
        np.frombuffer(raw[8 + hlen + lo : 8 + hlen + hi], np.float32).reshape(3, 4), tensors["f32"]
    )


def test_safetensors_bfloat16_and_foreign_file(tmp_path: Path) -> None:
    x = randn(4, 8, seed=91)
    path = tmp_path / "bf16.safetensors"
    outs = op("safetensors_roundtrip", x, path=str(path), cast_inputs="bfloat16", names=["w"])
    np.testing.assert_array_equal(outs[0], bf16_round(x))
    assert mx.load(str(path))["w"].dtype == mx.bfloat16
    # a file written by mlx.core, loaded by mlxrs (tensors in name order, then the metadata)
    foreign = tmp_path / "mx.safetensors"
    mx.save_safetensors(str(foreign), {"b": mx.array(x), "a": mx.arange(5)}, metadata={"k": "v", "n": "1"})
    a, b, meta = op("load_safetensors", path=str(foreign), with_metadata=True)
    np.testing.assert_array_equal(a, np.arange(5))
    np.testing.assert_array_equal(b, x)
    assert json.loads(meta.tobytes()) == {"k": "v", "n": "1"}
    # save then load as two steps
    p2 = tmp_path / "two.safetensors"
    assert op("save_safetensors", x, x[0], path=str(p2)) == []
    t0, t1 = op("load_safetensors", path=str(p2))
    np.testing.assert_array_equal(t0, x)
    np.testing.assert_array_equal(t1, x[0])


def test_safetensors_missing_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(MlxError) as err:
        op("load_safetensors", path=str(missing))
    assert "nope.safetensors" in str(err.value)


def test_repeated_loads_leave_no_threads_behind(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    x = randn(8, seed=92)
    op("safetensors_roundtrip", x, path=str(path))
    task = Path("/proc/self/task")
    before = len(os.listdir(task)) if task.is_dir() else 0
    for _ in range(12):
        np.testing.assert_array_equal(op("safetensors_roundtrip", x, path=str(path))[0], x)
    after = len(os.listdir(task)) if task.is_dir() else 0
    assert after - before < 4, f"{after - before} threads appeared over 12 loads"


# ---------------------------------------------------------------------------------------------
# errors: MLX's own text, and the process keeps going


def test_matmul_shape_error_is_mlx_error_and_recoverable() -> None:
    a, b = randn(2, 3, seed=93), randn(4, 5, seed=94)
    with pytest.raises(ValueError) as ref:
        mx.matmul(mx.array(a), mx.array(b))
    mlx_text = str(ref.value)
    assert "matmul" in mlx_text
    with pytest.raises(MlxError) as err:
        op("matmul", a, b)
    text = str(err.value)
    assert "[matmul]" in text and "shape" in text
    assert mlx_text.rstrip(".") in text  # MLX's own message, not a paraphrase
    assert not isinstance(err.value, InvalidArgumentError)
    # the next call works, repeatedly, and errors stay independent of one another
    np.testing.assert_allclose(one("matmul", a, a.T), a @ a.T, rtol=1e-5, atol=1e-5)
    for _ in range(3):
        with pytest.raises(MlxError, match="matmul"):
            op("matmul", a, b)
        np.testing.assert_array_equal(one("add", a, a), a + a)
    with pytest.raises(MlxError, match=r"\[broadcast_shapes\]|broadcast"):
        op("add", a, b)


def test_bad_requests_are_invalid_argument_errors() -> None:
    x = randn(2, 2)
    with pytest.raises(InvalidArgumentError, match="unknown op"):
        op("no_such_op", x)
    with pytest.raises(InvalidArgumentError, match="missing input"):
        op("add", x)
    with pytest.raises(InvalidArgumentError, match="input"):
        op("exp", x, x)  # a leftover input is reported
    with pytest.raises(InvalidArgumentError, match="shape"):
        op("reshape", x, shape="2x2")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        op("astype", x, dtype="float99")
    np.testing.assert_allclose(one("exp", x), np.exp(x), rtol=1e-6)


def test_process_survives_errors_in_a_subprocess() -> None:
    import subprocess

    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import numpy as np\n"
        "from arrays_util import op\n"
        "from mlxrs.errors import MlxError\n"
        "for i in range(20):\n"
        "    try:\n"
        "        op('matmul', np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))\n"
        "    except MlxError:\n"
        "        pass\n"
        "print(op('matmul', np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))[0].sum())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "12.0"
