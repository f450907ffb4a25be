"""What the media tests share: random PNG images, and MLX's peak memory over one encoding."""

from __future__ import annotations

import gc
import io
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def random_pngs(count: int, size: tuple[int, int], seed: int = 10) -> list[bytes]:
    """`count` PNG files of random pixels, `size` (height, width), seeds `seed`, `seed + 1`, …"""
    from PIL import Image

    out = []
    for k in range(count):
        b = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed + k).integers(0, 256, (*size, 3), dtype=np.uint8)).save(b, "PNG")
        out.append(b.getvalue())
    return out


def encoding_peak(encode: Callable[[Any], T], items: list[Any]) -> tuple[T, int]:
    """`encode(items)` measured after a warm-up (kernels, the allocator, whatever the session makes
    on its first encoding) on the first item alone: the items are encoded one after another, each
    at the same size, so one of them warms what all of them use. Its result and the bytes MLX's peak
    rose above what was active before (`_native.memory_counters`)."""
    from mlxrs import _native

    encode(items[:1])
    # what an earlier test left for the garbage collector freed now, not inside the measurement (its
    # frees would lower `active` under `before`'s figure and the peak's rise with it)
    gc.collect()
    before = _native.memory_counters(reset_peak=True)
    result = encode(items)
    return result, _native.memory_counters()["peak"] - before["active"]
