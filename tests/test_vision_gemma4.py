"""Image input for Gemma 4, against mlx-vlm 0.7.10 on the same tiny random model (tests/tinymodels.py
`make_gemma4_vision`: 8×8 patches pooled 2×2, at most 16 image tokens an image, clipped linears,
standardized features; the text model with per-layer inputs and KV sharing): the processor's
aspect-ratio-preserving pixel values (each image at its own size), the tower's projected
embeddings, the prompt's expansion (a count of image tokens per image), the last-position logits
and 32 greedy tokens with one and with two images of different sizes; bad media and configs refused
naming the part or the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from test_vision import BAD_MEDIA, features_match, image_logits, one_image_matches, run_vlm, sized_image_ids
from media_util import copy_model, encoding_peaks, random_pngs
from tinymodels import make_gemma4_vision

N_TOKENS = 32
ONE = "Describe <|image|> please."
TWO = "First <|image|> then <|image|> compare them."


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_gemma4_vision()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """A gradient with noise (70×90: 48×64 after resizing, 12 tokens), a tall noisy one (230×170:
    64×48), a wide one (40×200: one block high), a square one already at the budget (64×64: not
    resized), a JPEG, an RGBA PNG (a's pixels), and another 70×90 one."""
    from PIL import Image

    d = tmp_path_factory.mktemp("images4")
    rng = np.random.default_rng(11)
    yy, xx = np.mgrid[0:70, 0:90]
    a = np.stack([(xx * 2.8) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (70, 90))], -1).astype(np.uint8)
    out = {k: d / f"{k}.png" for k in ("a", "tall", "wide", "square", "rgba", "other", "strip")}
    out["jpg"] = d / "c.jpg"
    Image.fromarray(a).save(out["a"])
    Image.fromarray(rng.integers(0, 256, (230, 170, 3), dtype=np.uint8)).save(out["tall"])
    Image.fromarray(rng.integers(0, 256, (40, 200, 3), dtype=np.uint8)).save(out["wide"])
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(out["square"])
    Image.fromarray(np.concatenate([a, rng.integers(0, 256, (70, 90, 1), dtype=np.uint8)], -1), "RGBA").save(
        out["rgba"]
    )
    Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(out["other"])
    # so thin that the budget's height rounds to 0 blocks: one block high, capped in width
    Image.fromarray(rng.integers(0, 256, (6, 300, 3), dtype=np.uint8)).save(out["strip"])
    Image.fromarray(rng.integers(0, 256, (120, 100, 3), dtype=np.uint8)).save(out["jpg"], quality=85)
    # stored 40 high × 110 wide with EXIF orientation 6 (rotate 90°): 110 × 40 once applied, so
    # the image's size must be read with its orientation before the prompt is expanded
    exif = Image.Exif()
    exif[0x0112] = 6
    out["rotated"] = d / "r.jpg"
    Image.fromarray(rng.integers(0, 256, (40, 110, 3), dtype=np.uint8)).save(out["rotated"], quality=90, exif=exif)
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
            "images": [str(images["tall"]), str(images["wide"])],
            "max_tokens": N_TOKENS,
            "prefill_step_size": 16,
        }
    )


def test_vision_info(session):
    v = session.vision
    assert v["marker"] == "<|image|>" and v["sized"] is True and v["tokens_per_image"] is None
    assert v["max_tokens_per_image"] == 16 and v["image_size"] is None


@pytest.mark.parametrize("name", ["a", "tall", "wide", "square", "rgba", "strip"])
def test_pixel_values_match_the_processor(session, model_dir, images, name):
    """PNG: the aspect-ratio-preserving size, Pillow's bicubic resampling and the float32 rescale
    reproduced: equal pixel values (the tolerance asked: 1e-5), each image at its own size."""
    ref = run_vlm({"model": str(model_dir), "prompt": "<|image|>", "images": [str(images[name])], "max_tokens": 1})
    ours = np.array(session.pixel_values(images[name]), dtype=np.float32)
    theirs = np.array(ref["pixel_values"][0], dtype=np.float32)
    c, h, w = ref["pixel_shapes"][0]
    assert ours.shape == theirs.shape == (c * h * w,)
    assert float(np.max(np.abs(ours - theirs))) <= 1e-5
    # the prompt: boi, one image token per pooled block, eoi
    assert sized_image_ids(session, "<|image|>", [images[name]]) == ref["input_ids"]


def test_image_token_counts_match_the_processor_over_sizes(session):
    """The count of image tokens of an image of each size (the aspect-ratio-preserving target, its
    degenerate thin cases included) is mlx-vlm's processor's, over a sweep of sizes."""
    from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    sizes = [
        (h, w) for h in (1, 3, 7, 16, 17, 31, 64, 65, 100, 333, 1000, 4000) for w in (1, 5, 16, 63, 64, 90, 257, 2048)
    ]
    ours = [session._s.expand_image_markers("<|image|>", 1, [hw]).count("<|image|>") for hw in sizes]
    theirs = []
    for h, w in sizes:
        th, tw = get_aspect_ratio_preserving_size(h, w, 8, 16 * 4, 2)
        theirs.append((th // 8) * (tw // 8) // 4)
    assert ours == theirs


def test_exif_orientation_counts_in_the_size(session, model_dir, images):
    ref = run_vlm({"model": str(model_dir), "prompt": "<|image|>", "images": [str(images["rotated"])], "max_tokens": 1})
    assert session._s.image_sizes([(images["rotated"].read_bytes(), "r")]) == [(110, 40)]
    assert sized_image_ids(session, "<|image|>", [images["rotated"]]) == ref["input_ids"]
    assert len(session.pixel_values(images["rotated"])) == int(np.prod(ref["pixel_shapes"][0]))


def test_jpeg_pixel_values_within_decoder_rounding(session, model_dir, images):
    """JPEG: the decoders round differently (see test_vision.py); no normalization here, so a level
    is 1/255. Bicubic resampling (its weights' absolute values sum past 1) amplifies the decoders'
    differences more than Gemma 3's bilinear: measured on this noise image (the worst case), at most
    10 levels, 0.44 of a level on average; the bounds leave a little room."""
    ref = run_vlm({"model": str(model_dir), "prompt": "<|image|>", "images": [str(images["jpg"])], "max_tokens": 1})
    ours = np.array(session.pixel_values(images["jpg"]), dtype=np.float32)
    theirs = np.array(ref["pixel_values"][0], dtype=np.float32)
    assert ours.shape == theirs.shape
    diff = np.abs(ours - theirs)
    assert float(diff.max()) <= 12 / 255 + 1e-6, float(diff.max())
    assert float(diff.mean()) <= 0.6 / 255, float(diff.mean())


def test_tower_embeddings_match(session, images, oracle_two):
    """The projected embeddings of two images of different sizes (16 + 5 tokens), concatenated:
    float32 rounding apart (1e-4 relative to their scale, as for Gemma 3)."""
    features_match(session, [images["tall"], images["wide"]], oracle_two)


def test_one_image_greedy_tokens_and_logits(session, images, oracle_one):
    ids = sized_image_ids(session, ONE, [images["a"]])
    one_image_matches(session, ONE, ids, images["a"], images["other"], oracle_one)


def test_two_images_greedy_tokens_chunked_prefill(model_dir, images, oracle_two):
    # chunks of 16 tokens: the image-token runs straddle chunk boundaries, and so do the per-layer
    # inputs carried beside the merged embeddings
    with mlxrs.Session(model_dir, prefill_step_size=16) as s:
        ids = sized_image_ids(s, TWO, [images["tall"], images["wide"]])
        assert ids == oracle_two["input_ids"]
        out = s.generate(
            TWO, images=[images["tall"], images["wide"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        again = s.generate(
            TWO, images=[images["tall"], images["wide"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        ours = image_logits(s, ids, [images["tall"], images["wide"]])
        # swapped images: other sizes, so other prompt ids
        swapped = s.generate(
            TWO, images=[images["wide"], images["tall"]], max_tokens=4, ignore_eos=True, temperature=0.0
        )
    assert out.tokens == oracle_two["tokens"]
    assert again.tokens == out.tokens
    ref = np.array(oracle_two["logits"], dtype=np.float32)
    assert float(np.max(np.abs(ours - ref))) <= 1e-4
    assert swapped.usage.prompt_tokens == out.usage.prompt_tokens == len(ids)


def test_chat_content_parts(session, images):
    """Session.chat with an image part renders Gemma 4's image marker where the part is and expands
    it by the image's size; a string prompt without markers takes its images first."""
    import base64

    data = images["tall"].read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    out = session.chat(msgs, max_tokens=8, temperature=0.0)
    text = session.apply_chat_template([{"role": "user", "content": "What is this?\n<|image|>"}])
    ids = session.tokenize(session._s.expand_image_markers(text, 1, session._s.image_sizes([(data, "x")])))
    # as many image tokens as the tower makes features of the image
    assert (
        ids.count(session.vision["image_token_id"])
        == len(session.image_features([data])) // session.info["hidden_size"]
    )
    ref = session.generate(ids, images=[data], max_tokens=8, temperature=0.0)
    assert out.tokens == ref.tokens and out.usage.prompt_tokens == len(ids)
    first = session.generate("hello", images=[data], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert first.usage.prompt_tokens == len(sized_image_ids(session, "<|image|>hello", [images["tall"]]))


def test_expansion_needs_the_sizes_and_the_right_count(session, images):
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="expand by the images' sizes"):
        session._s.expand_image_markers("<|image|>", 1)
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=re.escape("1 image marker(s) (<|image|>) for 2")):
        session._s.expand_image_markers("<|image|>", 2, [(10, 10), (10, 10)])
    # ids whose image tokens do not match the images' sizes are refused before anything runs
    ids = sized_image_ids(session, ONE, [images["a"]])
    n = ids.count(session.vision["image_token_id"])
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=f"the prompt has {n} image tokens for 1 image"):
        session.generate(ids, images=[images["wide"]], max_tokens=2)


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_refused_naming_the_part(session, case):
    make, needle = BAD_MEDIA[case]
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="images\\[0\\]") as e:
        session.generate("look", images=[make()], max_tokens=2)
    assert needle in str(e.value)
    assert len(session.generate("ok", max_tokens=2, temperature=0.0, ignore_eos=True).tokens) == 2


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("vision_config.head_dim", 18, "vision_config.head_dim 18 is not a multiple of 4"),
        ("vision_config.patch_size", 16, "patch_size 8 differs from config.json's vision_config.patch_size 16"),
        ("vision_config.position_embedding_size", 16, "allows images 32 patches wide"),
        ("vision_config.hidden_size", 96, "model.vision_tower.patch_embedder.input_proj.weight"),
        ("vision_config.model_type", "siglip_vision_model", "not a Gemma 4 vision tower"),
        ("image_token_id", 7, "image_token_id is 7"),
    ],
)
def test_a_bad_vision_config_is_refused_naming_the_field(model_dir, tmp_path, field, value, needle):
    d = copy_model(model_dir, tmp_path, field, value)
    with pytest.raises(mlxrs.errors.MlxrsError, match=re.escape(needle)):
        mlxrs.Session(d)


def test_bidirectional_vision_attention_is_refused_for_images(model_dir, tmp_path, images):
    """mlx-vlm attends bidirectionally within each image with use_bidirectional_attention =
    "vision"; mlxrs does not implement it: the model loads and serves text, images are refused."""
    d = copy_model(model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    (d / "config.json").write_text(json.dumps(cfg))
    with mlxrs.Session(d) as s:
        assert len(s.generate("ok", max_tokens=2, ignore_eos=True).tokens) == 2
        with pytest.raises(mlxrs.errors.MlxrsError, match="use_bidirectional_attention"):
            s.generate("look", images=[images["a"]], max_tokens=2)


def test_batch_and_async_take_images(session, images):
    import asyncio

    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": images["wide"].read_bytes()}, {"type": "text", "text": "and?"}],
        }
    ]
    one = session.chat(msgs, max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = session.generate_batch([msgs, "plain text", msgs], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert batch[0].tokens == batch[2].tokens == one.tokens
    assert batch[0].usage.prompt_tokens == one.usage.prompt_tokens

    async def run() -> list[int]:
        return [
            c.token
            async for c in session.astream(msgs, max_tokens=6, temperature=0.0, ignore_eos=True)
            if c.token is not None
        ]

    assert asyncio.run(run()) == one.tokens


def test_bfloat16_two_images(images):
    """The same model in bfloat16 (the tower's float32 norms, rotary tables and pooling cast as
    mlx-vlm casts them): the features equal to bfloat16 rounding, logits within the bf16 parity
    tolerance (2e-2), 32 identical greedy tokens, prefill in chunks of 16."""
    d = make_gemma4_vision("gemma4-vision-bf16", dtype="bfloat16")
    imgs = [images["tall"], images["a"]]
    ref = run_vlm(
        {
            "model": str(d),
            "prompt": TWO,
            "images": [str(p) for p in imgs],
            "max_tokens": N_TOKENS,
            "prefill_step_size": 16,
        }
    )
    with mlxrs.Session(d, prefill_step_size=16) as s:
        feats = np.array(s.image_features(imgs), dtype=np.float32)
        theirs = np.array(ref["features"], dtype=np.float32)
        assert feats.shape == theirs.shape
        assert float(np.max(np.abs(feats - theirs))) <= 2**-7 * float(np.max(np.abs(theirs)))
        ids = sized_image_ids(s, TWO, imgs)
        assert ids == ref["input_ids"]
        logits = image_logits(s, ids, imgs)
        out = s.generate(TWO, images=imgs, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32)))) <= 2e-2
    assert out.tokens == ref["tokens"]


def test_mlx_vlm_4bit_checkpoint(images):
    """A checkpoint mlx-vlm converted (4-bit language model, its own weight names): the same
    features, logits within the fp32 tolerance, 32 identical greedy tokens."""
    from tinymodels import make_gemma4_vision_q4

    d = make_gemma4_vision_q4()
    ref = run_vlm({"model": str(d), "prompt": ONE, "images": [str(images["a"])], "max_tokens": N_TOKENS})
    with mlxrs.Session(d) as s:
        feats = np.array(s.image_features([images["a"]]), dtype=np.float32)
        theirs = np.array(ref["features"], dtype=np.float32)
        assert float(np.max(np.abs(feats - theirs))) <= 1e-4 * float(np.max(np.abs(theirs)))
        ids = sized_image_ids(s, ONE, [images["a"]])
        assert ids == ref["input_ids"]
        logits = image_logits(s, ids, [images["a"]])
        out = s.generate(ONE, images=[images["a"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32)))) <= 1e-4
    assert out.tokens == ref["tokens"]


def test_audio_and_video_parts_are_refused(session):
    """This model has no audio tower (tests/test_audio_gemma4.py has one): audio (and video) parts
    are refused naming the part, as for every model without the tower."""
    for part, kind in [
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "video"),
    ]:
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match=rf"messages\[0\].content\[0\]: {kind} input"):
            session.chat([{"role": "user", "content": [part]}], max_tokens=2)


# a mid-sized tower: 16×16 patches pooled 3×3, at most 128 image tokens (1152 patches), 256 wide,
# 4 heads of 64, a 1024-wide MLP
MID_VISION = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 512,
    "default_output_length": 128,
}


@pytest.mark.parametrize(
    "name, overrides, max_tokens, size, dtype",
    [
        # (height, width) of an image the processor keeps at max_soft_tokens exactly
        ("gemma4-vision-f32", None, 16, (64, 64), "float32"),
        pytest.param("gemma4-vision-mid-f32", MID_VISION, 128, (384, 768), "float32", marks=pytest.mark.slow),
        pytest.param("gemma4-vision-mid-bf16", MID_VISION, 128, (384, 768), "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_the_plan_counts_encoding_one_image_at_the_largest_size(name, overrides, max_tokens, size, dtype):
    """The memory plan's mediaTransientBytes for Gemma 4's tower (plan.rs via
    vision::gemma4::encode_transient_bytes, from the tower's sizes and max_soft_tokens) is at least
    MLX's peak over encoding one image of max_soft_tokens tokens (CPU) and within 2× of it, for the
    tiny tower and a mid-sized one (float32 and bfloat16); it is part of transientBytes, and `fit`
    shows it."""

    from mlxrs import fit

    d = make_gemma4_vision(name, dtype=dtype, vision_overrides=overrides, max_soft_tokens=max_tokens)
    p = fit.plan(d, 512)
    formula = p["mediaTransientBytes"]
    assert p["transientBytes"] > formula > 0 and "audioTransientBytes" not in p
    # several images in one prompt are encoded one after another: still within the one image's
    (feats, peak), (feats4, four) = encoding_peaks(
        d, "image_features", [random_pngs(1, size, seed=3), random_pngs(4, size)]
    )
    hidden = json.loads((d / "config.json").read_text())["text_config"]["hidden_size"]
    assert feats == max_tokens * hidden and peak > 0
    assert peak <= formula <= 2 * peak, (name, peak, formula)
    assert "of encoding one image at the largest size" in fit.describe(d, name, p, None, None)
    assert feats4 == 4 * max_tokens * hidden
    assert four <= formula, (name, four, formula)
