"""numpy <-> native array bridge used by tests and diagnostics."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import _native

_NP_TO_MLX = {
    np.dtype("bool"): "bool", np.dtype("uint8"): "uint8", np.dtype("uint16"): "uint16",
    np.dtype("uint32"): "uint32", np.dtype("uint64"): "uint64", np.dtype("int8"): "int8",
    np.dtype("int16"): "int16", np.dtype("int32"): "int32", np.dtype("int64"): "int64",
    np.dtype("float16"): "float16", np.dtype("float32"): "float32", np.dtype("float64"): "float64",
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


def op(name: str, *inputs: np.ndarray, **params: Any) -> list[np.ndarray]:
    outs = _native._op(name, [to_raw(x) for x in inputs], json.dumps(params))
    return [from_raw(o) for o in outs]
