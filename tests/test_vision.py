"""Image input for Gemma 3, against mlx-vlm 0.7.10 on the same tiny random model (a SigLIP tower of
112×112 images in 14×14 patches, 16 image tokens; tests/tinymodels.py): the processor's pixel
values, the tower's projected embeddings, the prompt's image-token expansion and 32 greedy tokens
with one and with two images; bad media refused naming the part; a model without a vision tower
refuses images."""

from __future__ import annotations

import io
import re
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlxrs
from oracle_server import ORACLE
from media_util import copy_model, encoding_peaks, random_pngs, set_config_field
from tinymodels import make_gemma3_vision, make_model

N_TOKENS = 32
ONE = "Describe <start_of_image> please."
TWO = "First <start_of_image> then <start_of_image> compare them."


def run_vlm(job: dict[str, Any]) -> dict[str, Any]:
    """mlx-vlm's answer to tests/oracle_mlxvlm.py's job, from the session's oracle process."""
    return ORACLE.vlm(job)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_gemma3_vision()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """Test images: a gradient with noise (smaller than the tower's input: upscaled), a larger
    noisy one (downscaled, both axes differently), a JPEG and an RGBA PNG."""
    from PIL import Image

    d = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:70, 0:90]
    a = np.stack([(xx * 2.8) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (70, 90))], -1).astype(np.uint8)
    b = rng.integers(0, 256, (230, 170, 3), dtype=np.uint8)
    rgba = np.concatenate([a, rng.integers(0, 256, (70, 90, 1), dtype=np.uint8)], -1)
    out = {
        "a": d / "a.png",
        "b": d / "b.png",
        "jpg": d / "c.jpg",
        "rgba": d / "d.png",
        "wide": d / "e.png",
        "tallish": d / "f.png",
    }
    Image.fromarray(a).save(out["a"])
    Image.fromarray(b).save(out["b"])
    # Pillow 13's pass order: b (230x170, height shrinking 118 > 2 x 58) vertical first; these two
    # horizontal first, one wider than tall, one taller than wide on the rule's other side
    Image.fromarray(rng.integers(0, 256, (170, 260, 3), dtype=np.uint8)).save(out["wide"])
    Image.fromarray(rng.integers(0, 256, (200, 170, 3), dtype=np.uint8)).save(out["tallish"])
    Image.fromarray(b).resize((300, 200)).save(out["jpg"], quality=85)
    Image.fromarray(rgba, "RGBA").save(out["rgba"])
    return out


@pytest.fixture(scope="module")
def session(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def oracle_one(model_dir, images):
    return run_vlm({"model": str(model_dir), "prompt": ONE, "images": [str(images["a"])], "max_tokens": N_TOKENS})


@pytest.fixture(scope="module")
def oracle_two(model_dir, images):
    return run_vlm(
        {
            "model": str(model_dir),
            "prompt": TWO,
            "images": [str(images["b"]), str(images["a"])],
            "max_tokens": N_TOKENS,
            "prefill_step_size": 16,
        }
    )


@pytest.mark.parametrize("name", ["a", "b", "rgba", "wide", "tallish"])
def test_pixel_values_match_the_processor(session, model_dir, images, name):
    """PNG (lossless): Pillow's resampling reproduced bit for bit, so the pixel values are equal
    up to float32 rounding (the tolerance asked: 1e-5)."""
    ref = run_vlm(
        {"model": str(model_dir), "prompt": "<start_of_image>", "images": [str(images[name])], "max_tokens": 1}
    )
    ours = np.array(session.pixel_values(images[name]), dtype=np.float32)
    theirs = np.array(ref["pixel_values"][0], dtype=np.float32)
    assert ours.shape == theirs.shape == (3 * 112 * 112,)
    assert float(np.max(np.abs(ours - theirs))) <= 1e-5


def test_jpeg_pixel_values_within_decoder_rounding(session, model_dir, images):
    """JPEG: the image crate's decoder (zune-jpeg) and Pillow's libjpeg-turbo round the IDCT and
    the chroma upsampling differently (a few levels of 255 on this noise image, the worst case for a
    JPEG decoder; each level is 2/255 ≈ 0.0078 after normalisation). Measured: at most 5 levels,
    under half a level on average; the bounds below leave a little room."""
    ref = run_vlm(
        {"model": str(model_dir), "prompt": "<start_of_image>", "images": [str(images["jpg"])], "max_tokens": 1}
    )
    ours = np.array(session.pixel_values(images["jpg"]), dtype=np.float32)
    theirs = np.array(ref["pixel_values"][0], dtype=np.float32)
    diff = np.abs(ours - theirs)
    assert float(diff.max()) <= 6 * 2 / 255 + 1e-6, float(diff.max())
    assert float(diff.mean()) <= 0.5 * 2 / 255, float(diff.mean())


def test_tower_embeddings_match(session, images, oracle_two):
    """The projected embeddings of two images (values up to ~25): float32 rounding apart (the
    tolerance of the fp32 logits parity, 1e-4, relative to their scale)."""
    assert features_match(session, [images["b"], images["a"]], oracle_two).shape == (2 * 16 * 128,)


def _ids(session, prompt: str, n: int) -> list[int]:
    return session.tokenize(session._s.expand_image_markers(prompt, n))


def image_logits(session, ids: list[int], imgs: list[Path]) -> np.ndarray:
    """Last-position logits of `ids` with the images' embeddings (the towers' tests share it)."""
    return np.array(session._s.logits(ids, [p.read_bytes() for p in imgs]), dtype=np.float32)


def sized_image_ids(session, prompt: str, imgs: list[Path]) -> list[int]:
    """`prompt`'s ids with its image markers expanded for the images' sizes (variable-resolution towers)."""
    sizes = session._s.image_sizes([(p.read_bytes(), str(p)) for p in imgs])
    return session.tokenize(session._s.expand_image_markers(prompt, len(imgs), sizes))


def features_match(session, imgs: list[Path], oracle: dict) -> np.ndarray:
    """The towers' output for `imgs` against mlx-vlm's (the towers' tests share it): float32 rounding
    apart (1e-4 relative to their scale). Ours, for further checks."""
    ours = np.array(session.image_features(imgs), dtype=np.float32)
    theirs = np.array(oracle["features"], dtype=np.float32)
    assert ours.shape == theirs.shape
    assert float(np.max(np.abs(ours - theirs))) <= 1e-4 * float(np.max(np.abs(theirs)))
    return ours


def one_image_matches(session, prompt: str, ids: list[int], image: Path, other: Path, oracle: dict) -> None:
    """One image against mlx-vlm's answer (the towers' tests share it): the prompt's ids and token count,
    the greedy tokens, and the whole last-position distribution within 1e-4 — which `other`, an image
    of the same size, moves (greedy tokens of a random tiny model say little alone)."""
    assert ids == oracle["input_ids"]
    out = session.generate(prompt, images=[image], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert out.tokens == oracle["tokens"]
    assert out.usage.prompt_tokens == len(oracle["input_ids"])
    ours = image_logits(session, ids, [image])
    ref = np.array(oracle["logits"], dtype=np.float32)
    assert float(np.max(np.abs(ours - ref))) <= 1e-4
    moved = image_logits(session, ids, [other])
    assert float(np.max(np.abs(moved - ours))) > 100 * 1e-4


def test_one_image_greedy_tokens_and_logits(session, images, oracle_one):
    one_image_matches(session, ONE, _ids(session, ONE, 1), images["a"], images["b"], oracle_one)


def test_two_images_greedy_tokens_chunked_prefill(model_dir, images, oracle_two):
    # prefill in chunks of 16 tokens: the image-token runs straddle chunk boundaries
    with mlxrs.Session(model_dir, prefill_step_size=16) as s:
        assert _ids(s, TWO, 2) == oracle_two["input_ids"]
        out = s.generate(TWO, images=[images["b"], images["a"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        # twice: the second must not reuse the first's cached prefix (its image tokens are the same ids)
        swapped = s.generate(
            TWO, images=[images["a"], images["b"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        again = s.generate(
            TWO, images=[images["b"], images["a"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        assert s.info["prompt_cache"]["hits"] == 0
        ids = _ids(s, TWO, 2)
        ours = image_logits(s, ids, [images["b"], images["a"]])
        swapped_logits = image_logits(s, ids, [images["a"], images["b"]])
    assert out.tokens == oracle_two["tokens"]
    assert again.tokens == out.tokens
    ref = np.array(oracle_two["logits"], dtype=np.float32)
    assert float(np.max(np.abs(ours - ref))) <= 1e-4
    # the images' order matters, and a media request reused no prefix (prompt_cache hits 0 above)
    assert float(np.max(np.abs(swapped_logits - ours))) > 100 * 1e-4
    assert len(swapped.tokens) == N_TOKENS


def test_chat_content_parts_and_images_first(session, images):
    """Session.chat with content parts renders the model's image marker where the part is; a
    string prompt without markers takes its images first."""
    data = images["a"].read_bytes()
    import base64

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    out = session.chat(msgs, max_tokens=8, temperature=0.0)
    text = session.apply_chat_template([{"role": "user", "content": "What is this?\n<start_of_image>"}])
    ids = session.tokenize(session._s.expand_image_markers(text, 1))
    ref = session.generate(ids, images=[data], max_tokens=8, temperature=0.0)
    assert out.tokens == ref.tokens and out.usage.prompt_tokens == len(ids)
    first = session.generate("hello", images=[data], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert first.usage.prompt_tokens == len(_ids(session, "<start_of_image>hello", 1))


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def huge_png_header() -> bytes:
    """A PNG whose header says 50000×50000 pixels (its IHDR CRC fixed up), and no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    # a few bytes of pixel data: decoding all of it would take 7.5 GB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")


BAD_MEDIA = {
    "truncated PNG": (lambda: _png()[:40], "images[0]"),
    "truncated JPEG": (lambda: _jpeg()[:300], "images[0]"),
    "50k x 50k header": (huge_png_header, "50000x50000"),
    "unsupported data": (lambda: b"GIF87a-not-really" + bytes(64), "images[0]"),
    "plain text": (lambda: b"this is not an image at all", "not an image"),
}


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_refused_naming_the_part(session, case):
    make, needle = BAD_MEDIA[case]
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="images\\[0\\]") as e:
        session.generate("look", images=[make()], max_tokens=2)
    assert needle in str(e.value)
    # the session keeps serving
    assert len(session.generate("ok", max_tokens=2, temperature=0.0, ignore_eos=True).tokens) == 2


def test_a_text_model_refuses_images():
    d = make_model("gemma3_text-float32", "gemma3_text")
    with mlxrs.Session(d) as s:
        assert s.vision is None
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match="gemma3_text-float32 has no vision tower"):
            s.generate("look", images=[_png()], max_tokens=2)
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"messages\[0\].content\[0\].*no vision tower"):
            s.chat([{"role": "user", "content": [{"type": "image", "image": _png()}]}], max_tokens=2)


def test_audio_and_video_parts_are_refused(session):
    for part, kind in [
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "video"),
    ]:
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match=rf"messages\[0\].content\[0\]: {kind} input"):
            session.chat([{"role": "user", "content": [part]}], max_tokens=2)


def test_batch_and_async_take_images_and_encode_prompt_refuses_them(session, images):
    import asyncio

    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": images["a"].read_bytes()}, {"type": "text", "text": "and?"}],
        }
    ]
    one = session.chat(msgs, max_tokens=6, temperature=0.0)
    batch = session.generate_batch([msgs, "plain text"], max_tokens=6, temperature=0.0)
    assert batch[0].tokens == one.tokens and batch[0].usage.prompt_tokens == one.usage.prompt_tokens

    async def run() -> list[int]:
        return [c.token async for c in session.astream(msgs, max_tokens=6, temperature=0.0) if c.token is not None]

    assert asyncio.run(run()) == one.tokens
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"messages\[0\].content\[0\]"):
        session.encode_prompt(msgs)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("mm_tokens_per_image", 15, "image_seq_length 16 differs from config.json's mm_tokens_per_image 15"),
        ("vision_config.patch_size", 15, "image_size 112 is not a multiple of patch_size 15"),
        ("vision_config.hidden_size", 96, "vision_tower.vision_model.embeddings.patch_embedding.weight"),
        ("image_token_index", 7, "image_token_index is 7"),
    ],
)
def test_a_bad_vision_config_is_refused_naming_the_field(model_dir, tmp_path, field, value, needle):
    d = copy_model(model_dir, tmp_path, field, value)
    if field == "mm_tokens_per_image":
        set_config_field(d, f"text_config.{field}", value)
    with pytest.raises(mlxrs.errors.MlxrsError, match=re.escape(needle)):
        mlxrs.Session(d)


@pytest.mark.parametrize("where", ["extra_special_tokens", "top level"])
def test_a_marker_the_vocabulary_lacks_is_refused_naming_it(model_dir, tmp_path, where):
    """The processor asks the tokenizer for its markers (tokenizer_config.json's named special tokens:
    a top-level entry, string or added-token object, before `extra_special_tokens`)."""
    d = copy_model(model_dir, tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    if where == "top level":
        tc["eoi_token"] = {"content": "<no_such_marker>", "special": True}
    else:
        tc["extra_special_tokens"]["eoi_token"] = "<no_such_marker>"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(
        mlxrs.errors.MlxrsError, match=re.escape('has no token "<no_such_marker>" (Gemma 3\'s image markers)')
    ):
        mlxrs.Session(d)


@pytest.mark.parametrize(
    "kw",
    [{}, {"name": "gemma3-vision-mid-f32", "image_size": 448, "mm_tokens": 64}],  # 64 and 1024 patches
)
def test_the_plan_counts_encoding_one_image(kw):
    """The memory plan's mediaTransientBytes for Gemma 3's SigLIP tower (plan.rs, from the tower's
    sizes) is at least MLX's peak over encoding one image (CPU) and within 2× of it, for the tiny
    tower and a mid-sized one; it is part of transientBytes."""

    from mlxrs import fit

    d = make_gemma3_vision(**kw)
    p = fit.plan(d, 512)
    formula = p["mediaTransientBytes"]
    assert p["transientBytes"] > formula > 0
    # four images in one prompt go through the tower one at a time: within one image's figure
    (_, peak), (_, peak4) = encoding_peaks(
        d, "image_features", [random_pngs(1, (300, 500), seed=3), random_pngs(4, (300, 500))]
    )
    assert 0 < peak <= formula <= 2 * peak, (d.name, peak, formula)
    assert peak4 <= formula, (d.name, peak4, formula)
