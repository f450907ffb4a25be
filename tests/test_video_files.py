"""Video files for Qwen3.5 (mlxrs.video: decoded with OpenCV in Python, sampled as mlx-vlm 0.7.10's
`load_video` samples them, the frames handed to Rust losslessly), against mlx-vlm on the same tiny
random model and the same files (its `prepare_inputs`: `load_video` + the processor, then
`generate_step`): the sampled frames and their times, the prompt's expansion (timestamps from the
source's frame indices and rate), 32 greedy tokens through `Session.generate` and the OpenAI SDK;
two videos in one prompt; video parts everywhere images go (chat content parts, `astream`,
`generate_batch`, the Responses API) equal to `generate`; bad files a 400 naming the part, the
server serving on; without the decoder a 400 naming the extra.

The files are written here with OpenCV's own encoder: MJPG in AVI (what every OpenCV build writes)."""

from __future__ import annotations

import asyncio
import base64
import io
import sys
from pathlib import Path

import numpy as np
import openai
import pytest

import mlxrs
from server_util import Server
from test_vision import run_vlm
from tinymodels import make_qwen3_5_vision

cv2 = pytest.importorskip("cv2")

N_TOKENS = 32
VID = "<|vision_start|><|video_pad|><|vision_end|>"
ONE = f"<|im_start|>user\nWhat happens in {VID}?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\nFirst {VID} then {VID}: what changed?<|im_end|>\n<|im_start|>assistant\n"
NAME = "qwen3_5-vision-f32"


def _write(path: Path, frames: int, fps: float, h: int, w: int, seed: int) -> Path:
    """An MJPG AVI of `frames` frames of a moving gradient with noise."""
    rng = np.random.default_rng(seed)
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert out.isOpened()
    yy, xx = np.mgrid[0:h, 0:w]
    for i in range(frames):
        f = np.stack([(xx * 2.8 + 20 * i) % 256, (yy * 3.6 + 7 * i) % 256, rng.integers(0, 256, (h, w))], -1)
        out.write(f.astype(np.uint8))
    out.release()
    return path


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_qwen3_5_vision()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """`a`: 23 frames at 10 fps, 90×60 (4 frames sampled at 2 fps: indices 0, 7, 15, 22, whose
    times are not the processor's evenly spaced ones); `b`: 40 frames at 25 fps, 64×48 (1.6 s: 2 frames,
    the model's minimum); `long`: 90 frames at 5 fps (16 frames, the maximum)."""
    d = tmp_path_factory.mktemp("videos")
    return {
        "a": _write(d / "a.avi", 23, 10.0, 60, 90, 1),
        "b": _write(d / "b.avi", 40, 25.0, 48, 64, 2),
        "long": _write(d / "long.avi", 90, 5.0, 32, 48, 3),
    }


@pytest.fixture(scope="module")
def session(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def oracle_a(model_dir, files):
    return run_vlm(
        {"model": str(model_dir), "prompt": ONE, "images": [], "video_files": [str(files["a"])], "max_tokens": N_TOKENS}
    )


def _data_url(p: Path, mt: str = "video/x-msvideo") -> str:
    return f"data:{mt};base64," + base64.b64encode(p.read_bytes()).decode()


def test_sampled_frames_and_times_equal_load_video(session, model_dir, files):
    """The frames mlxrs samples of each file are load_video's, pixel for pixel, at its times (the
    source frame index over the source fps), for the fps-bound, min-bound and max-bound counts."""
    from PIL import Image

    ref = run_vlm(
        {
            "model": str(model_dir),
            "prompt": f"{VID}{VID}{VID}",
            "images": [],
            "video_files": [str(files[k]) for k in ("a", "b", "long")],
            "max_tokens": 1,
        }
    )
    for k, theirs, times in zip(("a", "b", "long"), ref["video_frames"], ref["frame_times"]):
        frames, ours_times = session.video_frames(files[k])
        theirs = np.array(theirs, dtype=np.uint8)
        assert len(frames) == theirs.shape[0], k
        ours = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).transpose(2, 0, 1) for b in frames])
        assert np.array_equal(ours, theirs), k
        assert ours_times == pytest.approx(times, abs=1e-9), k
    assert [len(session.video_frames(files[k])[0]) for k in ("a", "b", "long")] == [4, 2, 16]


def test_a_video_file_gives_mlx_vlms_prompt_and_32_greedy_tokens(session, files, oracle_a):
    """The expansion (one timestamped vision block per temporal group, the timestamps from the
    source's frame times) and 32 greedy tokens equal mlx-vlm's; the file as a path, as bytes and as
    a data URL are the same video."""
    ids = session._prepare(ONE, None, None, None, None, files["a"])[0]
    assert ids == oracle_a["input_ids"]
    # the second group's time is (1.5 + 2.2) / 2 (frames 15 and 22 at 10 fps), not (1.0 + 1.5) / 2
    assert "<1.9 seconds>" in session.detokenize(ids) and "<1.2 seconds>" not in session.detokenize(ids)
    out = session.generate(ONE, video=files["a"], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert out.tokens == oracle_a["tokens"]
    assert out.usage.prompt_tokens == len(oracle_a["input_ids"])
    for src in (files["a"].read_bytes(), _data_url(files["a"])):
        again = session.generate(ONE, video=src, max_tokens=8, ignore_eos=True, temperature=0.0)
        assert again.tokens == oracle_a["tokens"][:8]


def _rendered(session, *parts: str) -> str:
    """The chat template's text of one user message whose content parts are `parts` (text, or VID
    for a video part), joined by newlines as mlxrs joins content parts: the prompt mlx-vlm gets."""
    return session.apply_chat_template([{"role": "user", "content": "\n".join(parts)}])


def test_two_videos_in_one_prompt_equal_mlx_vlm(session, model_dir, files):
    """Two video files in one conversation (each its own size, frame count and times), and two
    videos given as their frames: the prompt and 32 greedy tokens equal mlx-vlm's."""
    ref = run_vlm(
        {
            "model": str(model_dir),
            "prompt": _rendered(session, "First", VID, "then", VID),
            "images": [],
            "video_files": [str(files["a"]), str(files["b"])],
            "max_tokens": N_TOKENS,
        }
    )
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First"},
                {"type": "video", "video": str(files["a"])},
                {"type": "text", "text": "then"},
                {"type": "video_url", "video_url": {"url": _data_url(files["b"])}},
            ],
        }
    ]
    assert session._prepare(msgs, None, None, None)[0] == ref["input_ids"]
    out = session.generate(msgs, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert out.tokens == ref["tokens"]
    assert out.usage.prompt_tokens == len(ref["input_ids"])
    # frames lists: mlx-vlm times them evenly at the processor's fps, as mlxrs does
    fa, fb = _frames_dir(session, files["a"]), _frames_dir(session, files["b"])
    ref2 = run_vlm(
        {
            "model": str(model_dir),
            "prompt": _rendered(session, VID, VID),
            "images": [],
            "videos": [[str(p) for p in fa], [str(p) for p in fb]],
            "max_tokens": N_TOKENS,
        }
    )
    two = [{"role": "user", "content": [{"type": "video", "video": fa}, {"type": "video", "video": fb}]}]
    assert session._prepare(two, None, None, None)[0] == ref2["input_ids"]
    assert session.generate(two, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0).tokens == ref2["tokens"]


def _frames_dir(session, f: Path) -> list[Path]:
    """A video file's sampled frames written as PNG files beside it."""
    frames, _ = session.video_frames(f)
    d = f.parent / (f.stem + "-frames")
    d.mkdir(exist_ok=True)
    out = []
    for i, b in enumerate(frames):
        out.append(d / f"{i}.png")
        out[-1].write_bytes(b)
    return out


def test_video_parts_everywhere_images_go(session, files):
    """A video file in a conversation's content part (chat, generate_batch, astream) and as
    `video=` (stream, astream) gives the tokens `generate` gives for the same input."""
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What happens?"}, {"type": "video", "video": str(files["a"])}],
        }
    ]
    ref = session.generate(msgs, max_tokens=12, ignore_eos=True, temperature=0.0)
    assert ref.usage.prompt_tokens > 90
    chat = session.chat(msgs, max_tokens=12, temperature=0.0)
    assert chat.text == session.generate(msgs, max_tokens=12, temperature=0.0).text
    batch = session.generate_batch([msgs, "plain text"], max_tokens=12, ignore_eos=True, temperature=0.0)
    assert batch[0].tokens == ref.tokens and batch[0].usage.prompt_tokens == ref.usage.prompt_tokens
    bare = [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, {"type": "video"}]}]
    streamed = [
        c.token
        for c in session.stream(bare, video=files["a"], max_tokens=12, ignore_eos=True, temperature=0.0)
        if c.token is not None
    ]
    assert streamed == ref.tokens

    async def go(prompt, **kw) -> list[int]:
        return [
            c.token
            async for c in session.astream(prompt, max_tokens=12, ignore_eos=True, temperature=0.0, **kw)
            if c.token is not None
        ]

    assert asyncio.run(go(msgs)) == ref.tokens
    assert asyncio.run(go(bare, video=files["a"])) == ref.tokens
    one = session.generate(ONE, video=files["a"], max_tokens=12, ignore_eos=True, temperature=0.0)
    assert asyncio.run(go(ONE, video=str(files["a"]))) == one.tokens


@pytest.fixture(scope="module")
def server(model_dir):
    with Server(model_dir) as s:
        yield s


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused")


def test_a_video_file_through_the_openai_sdk_and_responses(server, session, model_dir, files):
    """A video file as a data URL in a `video_url` part: through chat completions and the
    Responses API the model answers mlx-vlm's greedy tokens for the same file and prompt, the
    prompt counting the video's tokens."""
    ref = run_vlm(
        {
            "model": str(model_dir),
            "prompt": _rendered(session, "What happens?", VID),
            "images": [],
            "video_files": [str(files["a"])],
            "max_tokens": N_TOKENS,
        }
    )
    part = {"type": "video_url", "video_url": {"url": _data_url(files["a"])}}
    r = _client(server).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What happens?"}, part]}],
        max_tokens=N_TOKENS,
        temperature=0,
    )
    assert r.usage.prompt_tokens == len(ref["input_ids"])
    n = r.usage.completion_tokens
    assert n == N_TOKENS or r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == session.detokenize(ref["tokens"][:n], skip_special_tokens=True)
    resp = _client(server).responses.create(
        model=NAME,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What happens?"}, part]}],
        max_output_tokens=N_TOKENS,
        temperature=0,
    )
    assert resp.usage.input_tokens == len(ref["input_ids"])
    assert resp.output_text == r.choices[0].message.content


def test_a_local_video_path_needs_its_flag(server, model_dir, files):
    """A video file's local path: a 400 naming the flag without --allow-local-media; with it, the
    same prompt as the file sent as a data URL."""
    part = {"type": "video_url", "video_url": {"url": str(files["b"])}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What happens?"}, part]}]
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model=NAME, max_tokens=2, messages=msgs)
    assert "messages[0].content[1]" in e.value.message and "--allow-local-media" in e.value.message
    with Server(model_dir, "--allow-local-media") as s:
        r = _client(s).chat.completions.create(model=NAME, max_tokens=4, temperature=0, messages=msgs)
    data = {"type": "video_url", "video_url": {"url": _data_url(files["b"])}}
    ref = _client(server).chat.completions.create(
        model=NAME,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What happens?"}, data]}],
    )
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens > 20
    assert r.choices[0].message.content == ref.choices[0].message.content


def test_anthropic_video_block_names_the_openai_endpoint(server, files):
    import json
    import urllib.error
    import urllib.request

    body = {
        "model": NAME,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "video", "source": {"type": "base64", "data": "AAAA"}}]}],
    }
    req = urllib.request.Request(
        f"{server.url}/v1/messages",
        json.dumps(body).encode(),
        {"content-type": "application/json", "anthropic-version": "2023-06-01"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    msg = json.loads(e.value.read())["error"]["message"]
    assert "messages[0].content[0]" in msg and "/v1/chat/completions" in msg and "video_url" in msg


@pytest.mark.parametrize(
    "case, needle",
    [
        ("truncated", "not a video file OpenCV can decode"),
        ("cut", "does not decode (a truncated or corrupt file)"),
        ("garbage", "not a video file OpenCV can decode"),
        ("png", "counts no frames"),
        ("empty", "empty"),
    ],
)
def test_bad_video_files_are_a_400_naming_the_part(server, files, case, needle):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    data = {
        "truncated": files["a"].read_bytes()[:3000],
        "cut": files["a"].read_bytes()[: len(files["a"].read_bytes()) * 6 // 10],
        "garbage": bytes(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8)),
        "png": buf.getvalue(),
        "empty": b"",
    }[case]
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(
            model=NAME,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x"}, {"type": "video_url", "video_url": {"url": url}}],
                }
            ],
        )
    assert "messages[0].content[1]" in e.value.message and needle in e.value.message, e.value.message
    r = _client(server).chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1


def test_limits_before_decoding(files):
    """The byte limit applies before anything decodes; a frame over the pixel limit is refused
    from the header; a file's sampled frames never pass max_frames."""
    from mlxrs import media
    from mlxrs import video as vid

    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"^v: the data is more than the limit of 1000 bytes"):
        media.load_sync(media.ImageRef(_data_url(files["a"]), "v"), media.MediaPolicy(max_bytes=1000))
    with pytest.raises(
        mlxrs.errors.InvalidArgumentError, match=r"^v: the video's frames are 90x60 pixels; at most 1000"
    ):
        vid.decode(files["a"].read_bytes(), "v", vid.Sampling(), max_pixels=1000)
    long = vid.decode(files["long"].read_bytes(), "v", vid.Sampling(fps=30.0, min_frames=2, max_frames=6))
    assert len(long.frames) == 6


def test_without_the_decoder_a_video_file_is_a_400_naming_the_extra(model_dir, files, tmp_path, monkeypatch):
    """No cv2: a video file part is a 400 saying which extra to install (the library raises the
    same); a video as a list of frames still works."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "cv2.py").write_text("raise ImportError('no OpenCV here')\n")
    with Server(model_dir, env={"PYTHONPATH": f"{shim}:{':'.join(sys.path)}"}) as s:
        with pytest.raises(openai.BadRequestError) as e:
            _client(s).chat.completions.create(
                model=NAME,
                max_tokens=2,
                messages=[
                    {"role": "user", "content": [{"type": "video_url", "video_url": {"url": _data_url(files["a"])}}]}
                ],
            )
        assert "messages[0].content[0]" in e.value.message and "mlxrs[video]" in e.value.message
        from PIL import Image

        frames = []
        for i in range(2):
            buf = io.BytesIO()
            Image.fromarray(np.full((48, 64, 3), 40 * i, dtype=np.uint8)).save(buf, "PNG")
            frames.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        r = _client(s).chat.completions.create(
            model=NAME,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": frames}}]}],
        )
        assert r.usage.prompt_tokens > 10
    monkeypatch.setitem(sys.modules, "cv2", None)
    with mlxrs.Session(model_dir) as lib, pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"mlxrs\[video\]"):
        lib.generate(ONE, video=files["a"], max_tokens=2)
