"""Video files in prompts: decoded to frames in Python with OpenCV (the `mlxrs[video]` extra:
`opencv-python-headless`, or any `cv2`), sampled as mlx-vlm 0.7.10's `load_video` samples them
(the video processor's fps, min_frames and max_frames; frame counts multiples of 2), each frame
handed to the Rust side losslessly (PNG) where it is preprocessed as a video given as frames is.
Why OpenCV and not PyAV: docs/design/video.md.

Untrusted input: the file's size is checked before anything decodes it (`max_bytes`), the header's
frame size against `max_pixels` and every decoded frame against the header's size; at most
`max_frames` frames are read (one seek each), and their pixels together at most `max_total_pixels`
(from the header, before any is read); the whole decoding has a wall-clock limit
(`DEFAULT_DECODE_SECONDS`, `MLXRS_VIDEO_DECODE_SECONDS`); a file OpenCV cannot open, whose header
counts no frames, of which a sampled frame does not decode (truncated, or a header that claims more
frames than the file has), or that decodes too slowly is an `InvalidArgumentError` naming the part.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import InvalidArgumentError

#: The extra that brings the decoder.
VIDEO_EXTRA = "mlxrs[video]"
#: Encoded bytes a video file may have.
DEFAULT_MAX_VIDEO_BYTES = 100 << 20
#: Pixels a video frame may have (8K UHD).
DEFAULT_MAX_FRAME_PIXELS = 7680 * 4320
#: mlx-vlm's `DEFAULT_VIDEO_SAMPLING.frame_factor`: sampled frame counts are multiples of it.
FRAME_FACTOR = 2
#: Seconds OpenCV may wait to open a file or read a frame (FFmpeg's own timeouts).
DECODE_TIMEOUT_MS = 10_000
#: Decoded pixels all of a video's sampled frames may have together (768 frames of 720p), checked
#: from the header before any frame is read: the frames are held until the prompt is encoded.
DEFAULT_MAX_VIDEO_PIXELS = 768 * 1280 * 720
#: Seconds the decoding of one video file may take in all (checked before each sampled frame; a
#: frame already being read still has FFmpeg's own DECODE_TIMEOUT_MS). `MLXRS_VIDEO_DECODE_SECONDS`
#: overrides it.
DEFAULT_DECODE_SECONDS = 60.0

# OpenCV's FFmpeg backend is not safe to drive from several threads at once
_lock = threading.Lock()


@dataclass(frozen=True)
class Sampling:
    """How a video file is sampled to frames (mlx-vlm's `VideoSampling`): `fps` frames a second of
    video, at least `min_frames` and at most `max_frames`, a multiple of `frame_factor`."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = FRAME_FACTOR

    @classmethod
    def of(cls, vision: Mapping[str, Any] | None) -> "Sampling":
        """The sampling a model's video processor asks for (`Session.vision`'s video_fps,
        video_min_frames, video_max_frames), mlx-vlm's defaults for what it leaves out."""
        v = vision or {}
        d = cls()
        return cls(
            float(v.get("video_fps") or d.fps),
            int(v.get("video_min_frames") or d.min_frames),
            int(v.get("video_max_frames") or d.max_frames),
        )


@dataclass
class Video:
    """One video of a prompt: its frames (each encoded bytes and its name in errors), the frames'
    times in seconds (None: a list of frames, evenly at the processor's fps) and where it was in
    the request."""

    frames: list[tuple[bytes, str]]
    times: list[float] | None
    where: str


def _err(where: str, msg: str) -> InvalidArgumentError:
    e = InvalidArgumentError(f"{where}: {msg}")
    e.param = where  # type: ignore[attr-defined]
    return e


def _cv2(where: str) -> Any:
    try:
        import cv2
    except ImportError:
        raise _err(
            where,
            f"a video file needs the video decoder: pip install '{VIDEO_EXTRA}' (OpenCV); "
            "or send the video as a list of its frames (images)",
        ) from None
    return cv2


def available() -> bool:
    """Whether video files can be decoded here (OpenCV importable)."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        return False
    return True


def sample_indices(total: int, video_fps: float, s: Sampling) -> list[int]:
    """The frame indices mlx-vlm's `load_video` reads of a `total`-frame video at `video_fps`:
    `total / video_fps * fps` frames, clamped to [min_frames, min(max_frames, total)] (each bound
    rounded to a multiple of frame_factor, inwards), floored to a multiple of it, evenly spaced
    (numpy's linspace, rounded half to even). ValueError when no count fits."""
    import numpy as np

    ff = s.frame_factor
    lo = math.ceil(s.min_frames / ff) * ff
    hi = math.floor(min(s.max_frames, total) / ff) * ff
    n = min(max(total / video_fps * s.fps, lo), hi, total)
    n = math.floor(n / ff) * ff
    if not ff <= n <= total:
        raise ValueError(f"a {total}-frame video cannot be sampled to a multiple of {ff} frames (at least {lo})")
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def decode(
    data: bytes,
    where: str,
    sampling: Sampling,
    *,
    max_pixels: int = DEFAULT_MAX_FRAME_PIXELS,
    max_total_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
    seconds: float | None = None,
) -> Video:
    """A video file's sampled frames, each PNG-encoded (lossless), and their times (source frame
    index / source fps, as mlx-vlm's processor times them). `InvalidArgumentError` naming `where`
    for what cannot be decoded or is over the limits: `max_pixels` a frame, `max_total_pixels` the
    sampled frames together, `seconds` of decoding (None: `decode_seconds()`)."""
    cv2 = _cv2(where)
    if not data:
        raise _err(where, "the video file is empty")
    limit = decode_seconds() if seconds is None else seconds
    deadline = Limits(max_pixels, max_total_pixels, limit, time.monotonic() + limit)
    fd, path = tempfile.mkstemp(prefix="mlxrs-video-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with _lock:
            try:
                return _decode_path(cv2, path, where, sampling, deadline)
            except cv2.error as e:  # OpenCV's own failures on a bad stream: the caller's error
                raise _err(where, f"the video does not decode: {str(e).strip()[:200]}") from None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def decode_seconds() -> float:
    """The wall-clock limit on decoding one video file: `MLXRS_VIDEO_DECODE_SECONDS` (a positive
    number) or `DEFAULT_DECODE_SECONDS`; a bad value is a ValueError naming the variable."""
    raw = os.environ.get("MLXRS_VIDEO_DECODE_SECONDS", "").strip()
    if not raw:
        return DEFAULT_DECODE_SECONDS
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"MLXRS_VIDEO_DECODE_SECONDS={raw!r} is not a positive number of seconds")
    return v


@dataclass(frozen=True)
class Limits:
    """One decoding's limits: pixels a frame, pixels all sampled frames, and its deadline
    (`time.monotonic()`) with the seconds it stands for."""

    max_pixels: int
    max_total_pixels: int
    seconds: float
    deadline: float

    def check_time(self, where: str, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise _err(where, f"decoding the video took longer than the limit of {self.seconds:g} s ({what})")


def _decode_path(cv2: Any, path: str, where: str, s: Sampling, lim: Limits) -> Video:
    max_pixels = lim.max_pixels
    params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, DECODE_TIMEOUT_MS, cv2.CAP_PROP_READ_TIMEOUT_MSEC, DECODE_TIMEOUT_MS]
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, params)
    try:
        lim.check_time(where, "opening the file")
        if not cap.isOpened():
            raise _err(where, "not a video file OpenCV can decode (a truncated, corrupt or unsupported container)")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 1.0)
        w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if total <= 0:
            raise _err(where, "the video's header counts no frames (a truncated, corrupt or streaming-only file)")
        if not math.isfinite(fps) or fps <= 0:
            raise _err(where, f"the video's frame rate {fps} is not a positive number")
        if w <= 0 or h <= 0 or w * h > max_pixels:
            raise _err(where, f"the video's frames are {w}x{h} pixels; at most {max_pixels} pixels are accepted")
        try:
            indices = sample_indices(total, fps, s)
        except ValueError as e:
            raise _err(where, str(e)) from None
        if len(indices) * w * h > lim.max_total_pixels:
            raise _err(
                where,
                f"{len(indices)} sampled frames of {w}x{h} pixels are more than the limit of "
                f"{lim.max_total_pixels} pixels a video",
            )
        frames: list[tuple[bytes, str]] = []
        for k, idx in enumerate(indices):
            lim.check_time(where, f"{k} of {len(indices)} sampled frames read")
            cap.set(cv2.CAP_PROP_POS_FRAMES, idx)
            ok, frame = cap.read()
            if not ok:  # (mlx-vlm goes on with the frames read so far; a partial video is refused here)
                raise _err(where, f"frame {idx} of the header's {total} does not decode (a truncated or corrupt file)")
            if frame is None or frame.ndim != 3 or frame.shape[0] * frame.shape[1] > max_pixels:
                raise _err(where, f"frame {idx} does not decode to an image of at most {max_pixels} pixels")
            ok, png = cv2.imencode(".png", frame, [cv2.IMWRITE_PNG_COMPRESSION, 1])
            if not ok:
                raise _err(where, f"frame {idx} cannot be re-encoded")
            frames.append((png.tobytes(), f"{where}.frames[{k}] (frame {idx})"))
        return Video(frames, [i / fps for i in indices], where)
    finally:
        cap.release()


def is_frames(v: Any) -> bool:
    """Whether a video source is a list of frames (not one file)."""
    return isinstance(v, (list, tuple))


def frame_refs(frames: Sequence[Any], where: str) -> list[tuple[Any, str]]:
    """(source, name) of each frame of a video given as its frames."""
    return [(os.fspath(f) if isinstance(f, os.PathLike) else f, f"{where}[{k}]") for k, f in enumerate(frames)]
