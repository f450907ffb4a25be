"""Media in prompts: where an image comes from (bytes, a data URL, base64, a local path, an
http(s) URL), under a policy (local files and remote URLs are each off unless allowed, sizes and
time limited), and content parts turned into the prompt text's image markers.

Decoding and preprocessing of images and audio happen in Rust (`mlxrs._native`); this module only
gets the bytes. Audio (WAV) is taken by models with an audio tower (Gemma 4). Video (Qwen3.5) is
taken as a list of its frames, or as a video file decoded to frames in Python (`mlxrs.video`, the
`mlxrs[video]` extra); `parts_text` turns video parts into the video marker when given a list for
them, and refuses them naming the part otherwise.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import InvalidArgumentError

#: Encoded bytes and decoded pixels an image may have (mirrors the Rust defaults).
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_FETCH_TIMEOUT = 10.0
#: Encoded bytes an audio clip may have (mirrors the Rust default; 30 s at most decoded).
DEFAULT_MAX_AUDIO_BYTES = 50 << 20

#: Content part types that carry an image (OpenAI chat, OpenAI Responses, Hugging Face / Anthropic).
IMAGE_PARTS = ("image_url", "input_image", "image")
#: Content part types that carry audio or video, with the modality's name.
AV_PARTS = {"input_audio": "audio", "audio_url": "audio", "audio": "audio", "video_url": "video", "video": "video"}


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how large they may be."""

    allow_local: bool = False
    allow_remote: bool = False
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    timeout: float = DEFAULT_FETCH_TIMEOUT

    def params(self) -> dict[str, int]:
        """The limits the native decoder applies."""
        return {"max_image_bytes": self.max_bytes, "max_image_pixels": self.max_pixels}


@dataclass
class ImageRef:
    """One image of a prompt: its source (bytes, or a URL / path / base64 string) and where in
    the request it was (named in errors)."""

    source: bytes | str
    where: str


def _err(where: str, msg: str) -> InvalidArgumentError:
    e = InvalidArgumentError(f"{where}: {msg}")
    e.param = where  # type: ignore[attr-defined]
    return e


def image_source(part: Mapping[str, Any], where: str) -> bytes | str:
    """The source of an image content part: OpenAI `{"type": "image_url", "image_url": {"url"}}`,
    Responses `{"type": "input_image", "image_url": "..."}`, Anthropic `{"type": "image", "source":
    {"type": "base64", "data"} | {"type": "url", "url"}}`, or `{"type": "image", "image" | "url" |
    "path": ...}` (Hugging Face's message form, bytes allowed)."""
    t = part.get("type")
    if t in ("image_url", "input_image"):
        v = part.get("image_url")
        if isinstance(v, Mapping):
            v = v.get("url")
        if not isinstance(v, str) or not v:
            raise _err(where, f"an {t} part needs a URL (image_url.url)")
        return v
    src = part.get("source")
    if isinstance(src, Mapping):
        st = src.get("type")
        if st == "base64":
            data = src.get("data")
            if not isinstance(data, str):
                raise _err(where, "a base64 image source needs a string `data`")
            return "data:" + str(src.get("media_type") or "image/*") + ";base64," + data
        if st == "url":
            url = src.get("url")
            if not isinstance(url, str):
                raise _err(where, "a url image source needs a string `url`")
            return url
        raise _err(where, f"image source type {st!r} is not supported (base64 or url)")
    for k in ("image", "url", "path"):
        v = part.get(k)
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, (str, os.PathLike)):
            return os.fspath(v)
    raise _err(where, "an image part needs a source (image_url, source, image, url or path)")


def _data_url(url: str, where: str, policy: MediaPolicy) -> bytes:
    head, sep, data = url.partition(",")
    if not sep:
        raise _err(where, "a data URL needs a comma before its data")
    if not head.endswith(";base64"):
        raise _err(where, "only base64 data URLs are supported (data:image/png;base64,...)")
    if len(data) > policy.max_bytes * 4 // 3 + 4:
        raise _err(where, f"the data is more than the limit of {policy.max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _err(where, f"the data URL's base64 does not decode: {e}") from None


def _local(path: str, where: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_local:
        raise _err(where, "local file paths are not allowed (start the server with --allow-local-media)")
    p = path[len("file://") :] if path.startswith("file://") else path
    try:
        size = os.path.getsize(p)
        if size > policy.max_bytes:
            raise _err(where, f"{p} is {size} bytes, more than the limit of {policy.max_bytes} bytes")
        with open(p, "rb") as f:
            return f.read(policy.max_bytes + 1)
    except OSError as e:
        raise _err(where, f"cannot read {p}: {e.strerror or e}") from None


def is_remote(src: bytes | str) -> bool:
    return isinstance(src, str) and src.startswith(("http://", "https://"))


def load_sync(ref: ImageRef, policy: MediaPolicy) -> bytes:
    """The bytes of an image, audio clip or video file (remote URLs through urllib, when the policy
    allows them)."""
    src = ref.source
    if isinstance(src, bytes):
        return src
    if src.startswith("data:"):
        return _data_url(src, ref.where, policy)
    if is_remote(src):
        if not policy.allow_remote:
            raise _err(
                ref.where,
                "http(s) media URLs are not fetched (start the server with --allow-remote-media, "
                "or send the media as a base64 data URL)",
            )
        import urllib.request

        try:
            with urllib.request.urlopen(src, timeout=policy.timeout) as r:  # noqa: S310 (http(s) only)
                data: bytes = r.read(policy.max_bytes + 1)
        except Exception as e:
            raise _err(ref.where, f"fetching {src} failed: {e}") from None
        if len(data) > policy.max_bytes:
            raise _err(ref.where, f"the file at {src} is more than the limit of {policy.max_bytes} bytes")
        return data
    return _local(src, ref.where, policy)


async def load_async(ref: ImageRef, policy: MediaPolicy) -> bytes:
    """`load_sync`, fetching remote URLs with aiohttp (size and time limited) off nothing else."""
    if not is_remote(ref.source):
        return load_sync(ref, policy)
    if not policy.allow_remote:
        return load_sync(ref, policy)  # the refusal
    import aiohttp

    url = str(ref.source)
    try:
        timeout = aiohttp.ClientTimeout(total=policy.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
            if r.status != 200:
                raise _err(ref.where, f"fetching {url} answered HTTP {r.status}")
            if (r.content_length or 0) > policy.max_bytes:
                raise _err(ref.where, f"the file at {url} is more than the limit of {policy.max_bytes} bytes")
            # read to the end (StreamReader.read(n) returns what has arrived, up to n), refusing
            # as soon as the body passes the limit
            buf = bytearray()
            async for chunk in r.content.iter_chunked(64 << 10):
                buf += chunk
                if len(buf) > policy.max_bytes:
                    raise _err(ref.where, f"the file at {url} is more than the limit of {policy.max_bytes} bytes")
            data = bytes(buf)
    except InvalidArgumentError:
        raise
    except Exception as e:
        raise _err(ref.where, f"fetching {url} failed: {type(e).__name__}: {e}") from None
    if len(data) > policy.max_bytes:
        raise _err(ref.where, f"the file at {url} is more than the limit of {policy.max_bytes} bytes")
    return data


def audio_source(part: Mapping[str, Any], where: str) -> bytes | str:
    """The source of an audio content part: OpenAI `{"type": "input_audio", "input_audio": {"data":
    base64, "format": "wav"}}` (WAV only: another format is refused naming it), `{"type":
    "audio_url", "audio_url": {"url"}}`, or `{"type": "audio", "audio" | "url" | "path": ...}`
    (Hugging Face's message form, bytes allowed)."""
    t = part.get("type")
    if t == "input_audio":
        v = part.get("input_audio")
        if not isinstance(v, Mapping) or not isinstance(v.get("data"), str):
            raise _err(where, "an input_audio part needs input_audio.data (base64) and input_audio.format")
        fmt = str(v.get("format") or "wav").lower()
        if fmt != "wav":
            raise _err(where, f'{fmt} audio is not supported: send WAV (input_audio.format "wav")')
        return "data:audio/wav;base64," + str(v["data"])
    if t == "audio_url":
        v = part.get("audio_url")
        if isinstance(v, Mapping):
            v = v.get("url")
        if not isinstance(v, str) or not v:
            raise _err(where, "an audio_url part needs a URL (audio_url.url)")
        return v
    for k in ("audio", "url", "path"):
        v = part.get(k)
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, (str, os.PathLike)):
            return os.fspath(v)
    raise _err(where, "an audio part needs a source (input_audio, audio_url, audio, url or path)")


def no_audio(where: str, model: str, part: str = "input_audio") -> InvalidArgumentError:
    """The error for audio sent to a model without an audio tower."""
    return _err(
        where,
        f"audio input ({part!r} part) is not supported: model {model} has no audio tower and "
        "cannot take audio — send text only",
    )


def refuse_av(t: str, where: str, model: str) -> InvalidArgumentError:
    """The error for an audio or video part where it is not taken."""
    kind = AV_PARTS.get(t, t)
    if kind == "video":
        return _err(
            where,
            f"video input ({t!r} part) is not supported: model {model} cannot take video (a model "
            "whose vision tower takes video, Qwen3.5, takes video files and lists of frames)",
        )
    return _err(
        where,
        f"{kind} input ({t!r} part) is not supported: {model} cannot take {kind} (mlxrs takes "
        "text and, for models with a vision tower, images)",
    )


def video_source(part: Mapping[str, Any], where: str) -> Any:
    """The source of a video content part: `{"type": "video_url", "video_url": {"url": ...}}`
    (OpenAI-style) or `{"type": "video", "video" | "url" | "path": ...}` (Hugging Face's message
    form), the source a video file (a data URL, base64 data URL, path, http(s) URL or bytes) or a
    list of its frames (images as an image part takes them); None for a bare `{"type": "video"}`
    (the video passed beside the prompt)."""
    if part.get("type") == "video_url":
        v = part.get("video_url")
        if isinstance(v, Mapping):
            v = v.get("url")
        if isinstance(v, (str, list)) and v:
            return v
        raise _err(where, "a video_url part needs a URL or a list of frame URLs (video_url.url)")
    for k in ("video", "url", "path"):
        v = part.get(k)
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if isinstance(v, (str, os.PathLike)):
            return os.fspath(v)
        if isinstance(v, (list, tuple)):
            return list(v)
    return None


def parts_text(
    content: Any,
    marker: str | None,
    images: list[ImageRef],
    where: str,
    model: str,
    *,
    audio_marker: str | None = None,
    audio: list[ImageRef] | None = None,
    video_marker: str | None = None,
    videos: list[tuple[Any, str]] | None = None,
) -> str:
    """A message's content as prompt text: a string as is; content parts joined by newlines, each
    image part replaced by `marker` (the model's image marker) and its source appended to `images`.
    `marker` None: the model has no vision tower, and an image part is refused naming it. With
    `audio` (a list), audio parts likewise become `audio_marker` (None: the model has no audio
    tower, refused naming the part) with their sources appended to `audio`; with `videos` (a list),
    video parts become `video_marker` (None: refused naming the part) with (their source, or None
    for a bare `{"type": "video"}`, and the part's place) appended to `videos`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _err(where, f"expected a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise _err(pw, f"expected a content part object, got {type(part).__name__}")
        t = part.get("type")
        if t in ("text", "input_text"):
            v = part.get("text")
            if not isinstance(v, str):
                raise _err(pw, "a text part needs a string `text`")
            texts.append(v)
        elif t in IMAGE_PARTS:
            if marker is None:
                raise no_vision(pw, model, str(t))
            images.append(ImageRef(image_source(part, pw), pw))
            texts.append(marker)
        elif t in AV_PARTS and AV_PARTS[str(t)] == "audio" and audio is not None:
            if audio_marker is None:
                raise no_audio(pw, model, str(t))
            audio.append(ImageRef(audio_source(part, pw), pw))
            texts.append(audio_marker)
        elif t in AV_PARTS and AV_PARTS[str(t)] == "video" and videos is not None and video_marker:
            videos.append((video_source(part, pw), pw))
            texts.append(video_marker)
        elif t in AV_PARTS:
            raise refuse_av(str(t), pw, model)
        else:
            raise _err(pw, f"unknown content part type {t!r}")
    return "\n".join(texts)


def no_vision(where: str, model: str, part: str = "image") -> InvalidArgumentError:
    """The error for an image sent to a model without a vision tower."""
    return _err(
        where,
        f"image input ({part!r} part) is not supported: model {model} has no vision tower and "
        "cannot take images — send text only",
    )
