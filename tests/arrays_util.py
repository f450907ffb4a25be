"""numpy <-> native array bridge for the tests (and bench/check_gdn_kernel.py): raw arrays through
`mlxrs._native._array_roundtrip` and `mlxrs._native._op`, the op dispatch the test build has (the
`testing` cargo feature of crates/mlxrs-py; the wheel has no `_op`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mlxrs import _native

_NP_TO_MLX = {
    np.dtype("bool"): "bool",
    np.dtype("uint8"): "uint8",
    np.dtype("uint16"): "uint16",
    np.dtype("uint32"): "uint32",
    np.dtype("uint64"): "uint64",
    np.dtype("int8"): "int8",
    np.dtype("int16"): "int16",
    np.dtype("int32"): "int32",
    np.dtype("int64"): "int64",
    np.dtype("float16"): "float16",
    np.dtype("float32"): "float32",
    np.dtype("float64"): "float64",
}


def to_raw(a: np.ndarray, dtype: str | None = None) -> tuple[bytes, list[int], str]:
    """A numpy array as (bytes, shape, mlx dtype name). `dtype="bfloat16"` takes uint16 bit patterns."""
    a = np.ascontiguousarray(a).reshape(np.shape(a))  # ascontiguousarray makes 0-d arrays 1-d
    name = dtype or _NP_TO_MLX[a.dtype]
    return a.tobytes(), list(a.shape), name


def from_raw(raw: tuple[bytes, list[int], str]) -> np.ndarray:
    data, shape, name = raw
    if name == "bfloat16":  # widen bf16 bit patterns to float32
        bits = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype=np.dtype(name)).reshape(shape).copy()


def roundtrip(a: np.ndarray, dtype: str | None = None) -> np.ndarray:
    return from_raw(_native._array_roundtrip(*to_raw(a, dtype)))


def native_op() -> Any:
    """`mlxrs._native._op`, or a clear error when the extension was built without it."""
    f = getattr(_native, "_op", None)
    if f is None:
        raise RuntimeError(
            "mlxrs._native has no _op: build the extension with the testing feature "
            "(scripts/setup.sh does: maturin develop --release --features testing)"
        )
    return f


def op(name: str, *inputs: np.ndarray, **params: Any) -> list[np.ndarray]:
    outs = native_op()(name, [to_raw(x) for x in inputs], json.dumps(params))
    return [from_raw(o) for o in outs]


def np_gated_delta(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token (float64): per value head h (key head h // (Hv / Hk)),
    S = g S; S += beta (v - S k) k^T; y = S q."""
    b, t, hk, _ = q.shape
    hv = v.shape[2]
    s = state.astype(np.float64).copy()
    y = np.zeros(v.shape, np.float64)
    for i in range(t):
        for h in range(hv):
            kh, qh = k[:, i, h // (hv // hk)].astype(np.float64), q[:, i, h // (hv // hk)].astype(np.float64)
            s[:, h] *= g[:, i, h, None, None]
            kv = np.einsum("bvd,bd->bv", s[:, h], kh)
            delta = (v[:, i, h] - kv) * beta[:, i, h, None]
            s[:, h] += delta[:, :, None] * kh[:, None, :]
            y[:, i, h] = np.einsum("bvd,bd->bv", s[:, h], qh)
    return y, s
