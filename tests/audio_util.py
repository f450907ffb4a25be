"""WAV files for the audio tests, written byte by byte (PCM 8/16/24/32-bit, float32)."""

from __future__ import annotations

import struct

import numpy as np


def wav_bytes(
    samples: np.ndarray, rate: int, bits: int = 16, fmt: str = "int", claim_frames: int | None = None
) -> bytes:
    """A WAV file of `samples` (`[frames, channels]` floats in [-1, 1]) as `bits`-bit PCM
    (`fmt="int"`) or float32 (`fmt="float"`); `claim_frames` makes the header lie about the length."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    frames, ch = x.shape
    if fmt == "float":
        data = x.astype("<f4").tobytes()
        tag, bits = 3, 32
    elif bits == 8:
        data = np.clip(np.round(x * 127 + 128), 0, 255).astype(np.uint8).tobytes()
        tag = 1
    else:
        top = 2 ** (bits - 1)
        v = np.clip(np.round(x * (top - 1)), -top, top - 1).astype(np.int64).ravel()
        data = (
            b"".join(int(s).to_bytes(bits // 8, "little", signed=True) for s in v)
            if bits == 24
            else v.astype(f"<i{bits // 8}").tobytes()
        )
        tag = 1
    align = ch * bits // 8
    n = len(data) if claim_frames is None else claim_frames * align
    fmt_chunk = b"fmt " + struct.pack("<IHHIIHH", 16, tag, ch, rate, rate * align, align, bits)
    return (
        b"RIFF"
        + struct.pack("<I", 4 + len(fmt_chunk) + 8 + n)
        + b"WAVE"
        + fmt_chunk
        + b"data"
        + struct.pack("<I", n)
        + data
    )


def tone(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A few sines plus noise, `[frames, channels]`, within [-0.9, 0.9]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    cols = []
    for c in range(channels):
        f = rng.uniform(100, 3000, 3)
        y = sum(np.sin(2 * np.pi * fi * t + c) for fi in f) / 4 + rng.normal(0, 0.05, t.size)
        cols.append(np.clip(y, -0.9, 0.9))
    return np.stack(cols, axis=1)
