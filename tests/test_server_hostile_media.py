"""Hostile media through a real `python -m mlxrs serve` of the tiny Qwen3.5 vision model (images and
video files) and the tiny Gemma 4 audio model: files built to hang or exhaust the server — a
highly compressible PNG of more pixels than the limit, JPEG / GIF / WebP headers claiming huge
canvases, a GIF of many frames, video containers whose headers claim absurd frame counts or frame
rates, a video whose decoding outlasts the wall-clock limit, a WAV whose header claims gigabytes —
each answered within a bounded time (every request has a client timeout, and the elapsed time is
asserted) with a 400 naming the part, or served when it is within the limits; the server answers
a plain prompt after each."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import openai
import pytest

from audio_util import tone, wav_bytes
from server_util import Server
from tinymodels import make_gemma4_audio, make_qwen3_5_vision

VISION = "qwen3_5-vision-f32"
AUDIO = "gemma4-audio-f32"
#: Seconds any one hostile request may take, all of it (decoding included).
BOUND = 20.0


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(w: int = 9000, h: int = 6000) -> bytes:
    """A real PNG of w×h black pixels (54M, more than the 50M limit): ~160 MB decoded, ~160 kB encoded."""
    z = zlib.compressobj(9)
    row = bytes(1 + 3 * w)  # filter byte 0 and black pixels
    body = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _pil(fmt: str, frames: int = 1, size: tuple[int, int] = (64, 48), **kw: object) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(frames)
    ims = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    if frames > 1:
        ims[0].save(buf, fmt, save_all=True, append_images=ims[1:], **kw)
    else:
        ims[0].save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg_claiming(w: int, h: int) -> bytes:
    """A small JPEG whose SOF0 header is patched to claim w×h pixels."""
    b = bytearray(_pil("JPEG"))
    i = b.find(b"\xff\xc0")
    struct.pack_into(">HH", b, i + 5, h, w)
    return bytes(b)


def gif_claiming(w: int, h: int, frames: int = 50) -> bytes:
    """An animated GIF of `frames` frames whose logical screen is patched to claim w×h pixels."""
    b = bytearray(_pil("GIF", frames, duration=10, loop=0))
    struct.pack_into("<HH", b, 6, w, h)
    return bytes(b)


def webp_claiming(w: int, h: int) -> bytes:
    """An animated WebP (with its VP8X header) whose canvas is patched to claim w×h pixels."""
    b = bytearray(_pil("WEBP", 3, duration=10, lossless=True))
    i = b.find(b"VP8X")
    assert i > 0
    b[i + 12 : i + 15] = (w - 1).to_bytes(3, "little")
    b[i + 15 : i + 18] = (h - 1).to_bytes(3, "little")
    return bytes(b)


IMAGES = {
    "png bomb": (png_bomb, "9000x6000"),
    "jpeg header": (lambda: jpeg_claiming(60000, 60000), "60000x60000"),
    "gif screen": (lambda: gif_claiming(40000, 40000), "40000x40000"),
    "webp canvas": (lambda: webp_claiming(16000, 16000), "16000x16000"),
}


@pytest.fixture(scope="module")
def vision_server():
    with Server(make_qwen3_5_vision()) as s:
        yield s


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", timeout=BOUND * 2, max_retries=0)


def _part(kind: str, data: bytes, mime: str) -> dict[str, object]:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": kind, kind: {"url": url}}


def _refused(s: Server, part: dict[str, object], needle: str, model: str = VISION) -> None:
    """The request with `part` is a 400 naming it (and `needle`) within BOUND seconds; the server
    then answers a plain prompt."""
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        _client(s).chat.completions.create(
            model=model,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, part]}],
        )
    took = time.monotonic() - t0
    assert took < BOUND, took
    assert "messages[0].content[1]" in e.value.message and needle in e.value.message, e.value.message
    r = _client(s).chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("case", list(IMAGES))
def test_hostile_images_are_a_400_before_decoding(vision_server, case):
    make, needle = IMAGES[case]
    data = make()
    assert len(data) < 1 << 20  # small on the wire, all of them
    mime = {"png": "image/png", "jpe": "image/jpeg", "gif": "image/gif", "web": "image/webp"}[case[:3]]
    _refused(vision_server, _part("image_url", data, mime), needle)


def test_a_gif_of_many_frames_is_served_from_its_first(vision_server):
    """A 300-frame GIF within the limits is served in bounded time (the first frame is the image)."""
    data = _pil("GIF", 300, size=(96, 64), duration=10, loop=0)
    t0 = time.monotonic()
    r = _client(vision_server).chat.completions.create(
        model=VISION,
        max_tokens=2,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"}, _part("image_url", data, "image/gif")]}
        ],
    )
    assert time.monotonic() - t0 < BOUND and r.usage.prompt_tokens > 10


def _avi(path: Path, frames: int = 10) -> bytes:
    cv2 = pytest.importorskip("cv2")
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (48, 32))
    for i in range(frames):
        out.write(np.full((32, 48, 3), i * 20 % 256, np.uint8))
    out.release()
    return path.read_bytes()


def avi_claiming(path: Path, length: int, scale: int | None = None, rate: int | None = None) -> bytes:
    """A 10-frame MJPG AVI whose stream header claims `length` frames (and scale/rate: fps = rate / scale)."""
    b = bytearray(_avi(path))
    j = b.find(b"strh") + 8
    struct.pack_into("<I", b, j + 32, length)
    if scale is not None and rate is not None:
        struct.pack_into("<II", b, j + 20, scale, rate)
    return bytes(b)


VIDEOS = {
    "2^31 frames": lambda p: avi_claiming(p, 2**31 - 1),
    "2^31 frames at 2^31 fps": lambda p: avi_claiming(p, 2**31 - 1, 1, 2**31 - 1),
    "2^31 frames at 1/2^31 fps": lambda p: avi_claiming(p, 2**31 - 1, 2**31 - 1, 1),
    "truncated": lambda p: _avi(p, 40)[:2000],
}


@pytest.mark.parametrize("case", list(VIDEOS))
def test_videos_with_lying_headers_are_a_400(vision_server, tmp_path, case):
    pytest.importorskip("cv2")
    data = VIDEOS[case](tmp_path / "v.avi")
    needle = "not a video file" if case == "truncated" else "does not decode (a truncated or corrupt file)"
    _refused(vision_server, _part("video_url", data, "video/x-msvideo"), needle)


def test_video_decoding_has_a_wall_clock_limit(tmp_path):
    """A video whose decoding outlasts MLXRS_VIDEO_DECODE_SECONDS (here set below any decode) is a
    400 naming the part and the limit; the server keeps serving. A bad value stops `serve` at
    start (exit 2) naming the variable."""
    pytest.importorskip("cv2")
    data = _avi(tmp_path / "v.avi")
    with Server(make_qwen3_5_vision(), env={"MLXRS_VIDEO_DECODE_SECONDS": "0.000001"}) as s:
        _refused(s, _part("video_url", data, "video/x-msvideo"), "took longer than the limit of 1e-06 s")
    bad = Server(make_qwen3_5_vision(), env={"MLXRS_VIDEO_DECODE_SECONDS": "soon"}, wait=False)
    try:
        assert bad.proc.wait(timeout=120) == 2
        assert "MLXRS_VIDEO_DECODE_SECONDS='soon' is not a positive number" in bad.stderr()
    finally:
        bad.stop()


def test_video_frames_together_are_limited_before_reading(tmp_path):
    """The sampled frames' pixels together are checked against max_total_pixels from the header,
    before any frame is read."""
    pytest.importorskip("cv2")
    import mlxrs
    from mlxrs import video as vid

    data = _avi(tmp_path / "v.avi")
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"^v: 4 sampled frames of 48x32 pixels are more"):
        vid.decode(data, "v", vid.Sampling(min_frames=4, max_frames=8), max_total_pixels=4 * 48 * 32 - 1)
    assert len(vid.decode(data, "v", vid.Sampling(min_frames=4, max_frames=8), max_total_pixels=4 * 48 * 32).frames)


def test_a_wav_claiming_gigabytes_is_a_400():
    """A WAV whose header claims 2 GB of samples (a billion 16-bit frames) is refused from the
    header, naming the part, before anything is allocated for it."""
    with Server(make_gemma4_audio()) as s:
        data = wav_bytes(tone(0.5, 16000), 16000, claim_frames=1_000_000_000)
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
        _refused(s, part, "longer than the limit of 30 s", AUDIO)


class _Hostile:
    """A local HTTP server (a thread of this process) serving: /ok.png a small PNG (in 1000-byte
    writes); /liar a
    Content-Length of 1 GB (then a few bytes and a hang); /endless bytes without a length, past any
    limit; /trickle a byte every 0.3 s, for ever."""

    def __init__(self) -> None:
        import http.server
        import threading

        png = _pil("PNG", size=(96, 64))

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    if self.path == "/ok.png":  # in small writes: the fetch must read them all
                        self.send_header("Content-Length", str(len(png)))
                        self.end_headers()
                        for i in range(0, len(png), 1000):
                            self.wfile.write(png[i : i + 1000])
                            self.wfile.flush()
                            time.sleep(0.01)
                    elif self.path == "/liar":
                        self.send_header("Content-Length", str(1 << 30))
                        self.end_headers()
                        self.wfile.write(png[:100])
                        time.sleep(30)
                    elif self.path == "/endless":
                        self.end_headers()
                        for _ in range(10_000):
                            self.wfile.write(bytes(64 << 10))
                    elif self.path == "/trickle":
                        self.end_headers()
                        for _ in range(200):
                            self.wfile.write(b"\x89")
                            self.wfile.flush()
                            time.sleep(0.3)
                except OSError:  # the client gave up: what these are for
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.mark.parametrize(
    "path, needle",
    [
        ("/liar", "more than the limit of 1048576 bytes"),
        ("/endless", "more than the limit of 1048576 bytes"),
        ("/trickle", "failed: TimeoutError"),
    ],
)
def test_remote_media_is_size_and_time_limited(remote_server, path, needle):
    """With --allow-remote-media, an http URL that claims a gigabyte, one that never ends and one
    that trickles a byte at a time are each a 400 naming the part within the fetch timeout (2 s
    here) and the byte limit; a good URL is fetched and reaches the model, through an OpenAI
    image_url part and an Anthropic url image block alike."""
    s, origin = remote_server
    _refused(s, {"type": "image_url", "image_url": {"url": origin.url + path}}, needle)
    r = _client(s).chat.completions.create(
        model=VISION,
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": origin.url + "/ok.png"}},
                ],
            }
        ],
    )
    assert r.usage.prompt_tokens > 10
    # the same image as an Anthropic url source block: the same prompt
    import anthropic

    a = anthropic.Anthropic(base_url=s.url, api_key="unused", timeout=BOUND * 2, max_retries=0)
    m = a.messages.create(
        model=VISION,
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image", "source": {"type": "url", "url": origin.url + "/ok.png"}},
                ],
            }
        ],
    )
    assert m.usage.input_tokens == r.usage.prompt_tokens


@pytest.fixture(scope="module")
def remote_server():
    origin = _Hostile()
    try:
        args = ("--allow-remote-media", "--media-fetch-timeout", "2", "--max-image-bytes", str(1 << 20))
        with Server(make_qwen3_5_vision(), *args) as s:
            yield s, origin
    finally:
        origin.close()
