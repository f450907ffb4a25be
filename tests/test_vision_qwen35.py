"""Image (and video-frame) input for Qwen3.5, against mlx-vlm 0.7.10 on the same tiny random model
(tests/tinymodels.py `make_qwen3_5_vision`: 8×8 patches two frames deep, merged 2×2, an 8×8 learned
position grid interpolated to each image, 4 to 32 image tokens an image; the text model with Gated
DeltaNet layers and interleaved M-RoPE): the processor's pixel values (smart resize, Pillow bicubic,
rescale and normalize; the patches in the tower's order), the tower's merged features, the prompt's
expansion, the M-RoPE positions (logits, and 32 greedy tokens whose positions run behind their
indices) with one and with two images; bad configs refused naming the field."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from test_vision import features_match, image_logits, one_image_matches, run_vlm, sized_image_ids
from media_util import copy_model, encoding_peaks, random_pngs
from tinymodels import make_qwen3_5_vision

N_TOKENS = 32
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|im_start|>user\nDescribe {IMG} please.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\nFirst {IMG} then {IMG} compare them.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_qwen3_5_vision()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """A gradient with noise (70×90: 64×96 after resizing, 24 tokens), a tall one (130×50: 16×6
    patches), a tiny one (grown to the minimum), a large one (shrunk to the maximum), one already on
    the grid (64×64: not resized), a JPEG and another 70×90 one."""
    from PIL import Image

    d = tmp_path_factory.mktemp("images35")
    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[0:70, 0:90]
    a = np.stack([(xx * 2.8) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (70, 90))], -1).astype(np.uint8)
    out = {k: d / f"{k}.png" for k in ("a", "tall", "tiny", "large", "square", "other")}
    Image.fromarray(a).save(out["a"])
    Image.fromarray(rng.integers(0, 256, (130, 50, 3), dtype=np.uint8)).save(out["tall"])
    Image.fromarray(rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)).save(out["tiny"])
    Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8)).save(out["large"])
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(out["square"])
    Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(out["other"])
    out["jpg"] = d / "c.jpg"
    Image.fromarray(rng.integers(0, 256, (100, 120, 3), dtype=np.uint8)).save(out["jpg"], quality=85)
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
            "images": [str(images["tall"]), str(images["large"])],
            "max_tokens": N_TOKENS,
            "prefill_step_size": 16,
        }
    )


def _patches(pixels: np.ndarray, h: int, w: int, p: int = 8, t: int = 2, m: int = 2) -> np.ndarray:
    """mlx-vlm's patch flattening of one image `[3, H, W]` (processing_qwen3_vl.py `_process_one`)."""
    x = np.repeat(pixels.reshape(3, h, w)[None, None], t, axis=1)
    x = x.reshape(1, 1, t, 3, h // p // m, m, p, w // p // m, m, p).transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape((h // p) * (w // p), 3 * t * p * p)


def test_vision_info(session):
    v = session.vision
    assert v["marker"] == IMG and v["sized"] is True and v["tokens_per_image"] is None
    assert v["max_tokens_per_image"] == 32 and v["image_token"] == "<|image_pad|>"


@pytest.mark.parametrize("name", ["a", "tall", "tiny", "large", "square"])
def test_pixel_values_match_the_processor(session, model_dir, images, name):
    """PNG: smart resize (the area between the processor's bounds, sides on the 16-pixel grid),
    Pillow's bicubic resampling, the float32 rescale and normalization reproduced: the patches in
    the processor's order within 1e-5."""
    ref = run_vlm({"model": str(model_dir), "prompt": IMG, "images": [str(images[name])], "max_tokens": 1})
    ((_, gh, gw),) = ref["grid_thw"]
    ours = np.array(session.pixel_values(images[name]), dtype=np.float32)
    assert ours.size == 3 * gh * 8 * gw * 8
    theirs = np.array(ref["patches"], dtype=np.float32)
    assert float(np.max(np.abs(_patches(ours, gh * 8, gw * 8) - theirs))) <= 1e-5
    assert sized_image_ids(session, IMG, [images[name]]) == ref["input_ids"]


def test_image_token_counts_match_the_processor_over_sizes(session):
    """The count of image tokens of an image of each size is mlx-vlm's `smart_resize`'s (with the
    tiny model's bounds), over a sweep of sizes; an aspect ratio past 200 is refused as it is."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import _smart_resize_image

    sizes = [(h, w) for h in (1, 3, 8, 15, 16, 24, 40, 56, 100, 333, 1000) for w in (1, 5, 16, 24, 63, 90, 257, 800)]
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    ours = [session._s.expand_image_markers(IMG, 1, [hw]).count("<|image_pad|>") for hw in sizes]
    theirs = []
    for h, w in sizes:
        th, tw = _smart_resize_image(h, w, factor=16, min_pixels=4 * 256, max_pixels=32 * 256)
        theirs.append((th // 8) * (tw // 8) // 4)
    assert ours == theirs
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="aspect ratio"):
        session._s.expand_image_markers(IMG, 1, [(1, 300)])


def test_jpeg_pixel_values_within_decoder_rounding(session, model_dir, images):
    """JPEG: the decoders round differently (see test_vision.py); normalized by 0.5, a level is
    2/255; bicubic resampling amplifies the differences. Measured on this noise image (the worst
    case): at most 16 levels, 0.4 of a level on average; the bounds leave a little room."""
    ref = run_vlm({"model": str(model_dir), "prompt": IMG, "images": [str(images["jpg"])], "max_tokens": 1})
    ((_, gh, gw),) = ref["grid_thw"]
    ours = _patches(np.array(session.pixel_values(images["jpg"]), dtype=np.float32), gh * 8, gw * 8)
    diff = np.abs(ours - np.array(ref["patches"], dtype=np.float32))
    assert float(diff.max()) <= 2 * 18 / 255 + 1e-6, float(diff.max())
    assert float(diff.mean()) <= 2 * 0.6 / 255, float(diff.mean())


def test_tower_features_match(session, images, oracle_two):
    """The merged features of two images of other shapes (16×6 and 8×12 merged blocks), concatenated: float32
    rounding apart (1e-4 relative to their scale, as for Gemma 3 and 4)."""
    features_match(session, [images["tall"], images["large"]], oracle_two)


def test_one_image_greedy_tokens_and_logits(session, images, oracle_one):
    ids = sized_image_ids(session, ONE, [images["a"]])
    one_image_matches(session, ONE, ids, images["a"], images["other"], oracle_one)


def test_two_images_greedy_tokens_chunked_prefill(model_dir, images, oracle_two):
    # chunks of 16 tokens: the image-token runs (and their M-RoPE positions) straddle chunk
    # boundaries; the decode positions run (24 + 24) - (16 + 12) behind the token indices
    with mlxrs.Session(model_dir, prefill_step_size=16) as s:
        ids = sized_image_ids(s, TWO, [images["tall"], images["large"]])
        assert ids == oracle_two["input_ids"]
        out = s.generate(
            TWO, images=[images["tall"], images["large"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        again = s.generate(
            TWO, images=[images["tall"], images["large"]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0
        )
        ours = image_logits(s, ids, [images["tall"], images["large"]])
        text = s.generate("plain text after images", max_tokens=8, ignore_eos=True, temperature=0.0)
    assert out.tokens == oracle_two["tokens"]
    assert again.tokens == out.tokens
    ref = np.array(oracle_two["logits"], dtype=np.float32)
    assert float(np.max(np.abs(ours - ref))) <= 1e-4
    # a text-only request after them: the ordinary rotary positions again (mlx-lm's tokens)
    with mlxrs.Session(model_dir) as fresh:
        assert (
            fresh.generate("plain text after images", max_tokens=8, ignore_eos=True, temperature=0.0).tokens
            == text.tokens
        )


def test_chat_content_parts_and_batch(session, images):
    """Session.chat with an image part renders the template's vision block where the part is and
    expands it by the image's size; a batch with a text-only row decodes each as alone."""
    import base64

    data = images["tall"].read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    out = session.chat(msgs, max_tokens=8, temperature=0.0, ignore_eos=True)
    text = session.apply_chat_template([{"role": "user", "content": f"What is this?\n{IMG}"}])
    ids = session.tokenize(session._s.expand_image_markers(text, 1, session._s.image_sizes([(data, "x")])))
    assert ids.count(session.vision["image_token_id"]) == len(session.image_features([data])) // 256
    ref = session.generate(ids, images=[data], max_tokens=8, temperature=0.0, ignore_eos=True)
    assert out.tokens == ref.tokens and out.usage.prompt_tokens == len(ids)
    alone = session.generate("plain text", max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = session.generate_batch([msgs, "plain text", msgs], max_tokens=8, temperature=0.0, ignore_eos=True)
    assert batch[0].tokens == batch[2].tokens == out.tokens
    assert batch[1].tokens == alone.tokens


def test_expansion_needs_the_sizes_and_the_right_count(session, images):
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="expand by the images' sizes"):
        session._s.expand_image_markers(IMG, 1)
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=re.escape("1 image marker(s) (<|image_pad|>) for 2")):
        session._s.expand_image_markers(IMG, 2, [(10, 10), (10, 10)])
    ids = sized_image_ids(session, ONE, [images["a"]])
    n = ids.count(session.vision["image_token_id"])
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=f"the prompt has {n} image tokens for 1 image"):
        session.generate(ids, images=[images["tiny"]], max_tokens=2)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("vision_config.patch_size", 16, "patch_size 8 differs from config.json's vision_config (16)"),
        ("vision_config.num_heads", 3, "vision_config.hidden_size 64 over num_heads 3"),
        (
            "vision_config.out_hidden_size",
            128,
            "vision_config.out_hidden_size 128 differs from the text model's hidden_size 256",
        ),
        ("vision_config.num_position_embeddings", 60, "vision_config.num_position_embeddings 60 is not a square"),
        ("vision_config.deepstack_visual_indexes", [1], "deepstack_visual_indexes"),
        ("vision_config.hidden_size", 96, "model.visual.patch_embed.proj.weight"),
        ("vision_config.depth", "two", 'vision_config.depth = "two" is not an integer'),
        ("image_token_id", 7, "config.json: image_token_id = 7 but the tokenizer's image <|image_pad|>"),
        ("text_config.rope_parameters.mrope_section", [2, 3], "rope_parameters.mrope_section"),
    ],
)
def test_a_bad_vision_config_is_refused_naming_the_field(model_dir, tmp_path, field, value, needle):
    d = copy_model(model_dir, tmp_path, field, value)
    with pytest.raises(mlxrs.errors.MlxrsError, match=re.escape(needle)):
        mlxrs.Session(d)


def test_a_missing_tower_tensor_is_refused_naming_it(model_dir, tmp_path):
    import mlx.core as mx

    d = copy_model(model_dir, tmp_path)
    w = mx.load(str(d / "model.safetensors"))
    del w["model.visual.blocks.1.attn.qkv.bias"]
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(mlxrs.errors.MlxrsError, match=re.escape("model.visual.blocks.1.attn.qkv.bias")):
        mlxrs.Session(d)


def test_a_text_only_conversion_takes_no_images(model_dir, tmp_path, images):
    """The vision config without the tower's weights (what a text-only conversion keeps): the model
    serves text with the same tokens, and refuses images naming the model."""
    import mlx.core as mx

    d = copy_model(model_dir, tmp_path)
    w = {k: v for k, v in mx.load(str(d / "model.safetensors")).items() if not k.startswith("model.visual.")}
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    with mlxrs.Session(d) as s, mlxrs.Session(model_dir) as full:
        assert s.vision is None
        assert (
            s.generate("hello", max_tokens=6, ignore_eos=True, temperature=0.0).tokens
            == full.generate("hello", max_tokens=6, ignore_eos=True, temperature=0.0).tokens
        )
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match="has no vision tower"):
            s.generate("look", images=[images["a"]], max_tokens=2)


VID = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> list[Path]:
    """Five 60×90 frames of a moving gradient with noise (an odd count: the last frame repeats to
    fill the second frame of the third temporal group); resized to 64×96 under the video bounds."""
    from PIL import Image

    d = tmp_path_factory.mktemp("frames35")
    rng = np.random.default_rng(9)
    yy, xx = np.mgrid[0:60, 0:90]
    out = []
    for i in range(5):
        f = np.stack([(xx * 2.8 + 20 * i) % 256, (yy * 3.6) % 256, rng.integers(0, 256, (60, 90))], -1).astype(np.uint8)
        out.append(d / f"f{i}.png")
        Image.fromarray(f).save(out[-1])
    return out


def test_video_frames_match_mlx_vlm(model_dir, frames):
    """A video given as its frames: the video processor's size (smart resize over all frames),
    pixel values in the processor's patch order (the last frame repeated to the temporal patch),
    the tower's features (attention within each temporal group), the timestamped expansion (one
    vision block per group), the logits and 32 greedy tokens (each group's M-RoPE grid), prefill in
    chunks of 16."""
    prompt = f"<|im_start|>user\nWhat happens in {VID}?<|im_end|>\n<|im_start|>assistant\n"
    ref = run_vlm(
        {
            "model": str(model_dir),
            "prompt": prompt,
            "images": [],
            "video": [str(f) for f in frames],
            "max_tokens": N_TOKENS,
            "prefill_step_size": 16,
        }
    )
    ((gt, gh, gw),) = ref["grid_thw"]
    assert (gt, gh, gw) == (3, 8, 12)
    with mlxrs.Session(model_dir, prefill_step_size=16) as s:
        px, n, h, w = s.video_pixel_values(frames)
        assert (n, h, w) == (5, gh * 8, gw * 8)
        x = np.array(px, dtype=np.float32).reshape(n, 3, h, w)
        x = np.concatenate([x, x[-1:]], 0).reshape(1, gt, 2, 3, gh // 2, 2, 8, gw // 2, 2, 8)
        x = x.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, 3 * 2 * 8 * 8)
        assert float(np.max(np.abs(x - np.array(ref["patches"], dtype=np.float32)))) <= 1e-5
        feats = np.array(s.video_features(frames), dtype=np.float32)
        theirs = np.array(ref["features"], dtype=np.float32)
        assert feats.shape == theirs.shape
        assert float(np.max(np.abs(feats - theirs))) <= 1e-4 * float(np.max(np.abs(theirs)))
        ids = s._prepare(prompt, None, None, None, None, frames)[0]
        assert ids == ref["input_ids"]
        logits = np.array(s._s.logits(ids, video=[f.read_bytes() for f in frames]), dtype=np.float32)
        assert float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32)))) <= 1e-4
        out = s.generate(prompt, video=frames, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        assert out.tokens == ref["tokens"]
        # the same video as a conversation's video part
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What happens in "}, {"type": "video"}]}]
        chat = s.generate(msgs, video=frames, max_tokens=4, ignore_eos=True, temperature=0.0)
        assert chat.usage.prompt_tokens == len(s._prepare(msgs, None, None, None, None, frames)[0])


def test_video_is_refused_where_it_cannot_go(session, frames, images, tmp_path):
    from PIL import Image

    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="images or videos, not both"):
        session.generate("x", images=[images["a"]], video=frames, max_tokens=2)
    # a still image is no video file: one frame cannot be sampled to two
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"^video: "):
        session.generate("x", video=str(frames[0]), max_tokens=2)
    odd = tmp_path / "odd.png"
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(odd)
    with pytest.raises(
        mlxrs.errors.InvalidArgumentError, match=r"video\[2\]: a 40x40 frame in a video of 90x60 frames"
    ):
        session.generate("x", video=[frames[0], frames[1], odd], max_tokens=2)
    small = tmp_path / "small.png"
    Image.fromarray(np.zeros((8, 40, 3), dtype=np.uint8)).save(small)
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="at least 16 pixels"):
        session.generate("x", video=[small], max_tokens=2)


def test_mlx_vlm_4bit_checkpoint(images):
    """A checkpoint mlx-vlm converted (4-bit language model, `vision_tower.*` names, the patch
    embedding channels-last): the same features, logits within the fp32 tolerance, 32 identical
    greedy tokens."""
    from tinymodels import make_qwen3_5_vision_q4

    d = make_qwen3_5_vision_q4()
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


def test_bfloat16_two_images(images):
    """The same model in bfloat16 (the tower's rotary tables in float32 then cast, as mlx-vlm does):
    32 identical greedy tokens, prefill in chunks of 16. The features and logits differ by bfloat16
    rounding of the patch embedding: mlx-vlm runs it as a Conv3d, mlxrs as the equivalent matmul
    (no conv3d binding), and in bfloat16 the two round differently (measured on this model's
    patches: one bf16 step at most, 1.2e-3 on average at a scale of 3.6; the matmul is the closer
    of the two to float32). Through the tower that is at most 0.012 (0.8% of the features' scale)
    and 0.039 on the logits; the bounds, 2^-6 relative and 5e-2, leave a little room."""
    d = make_qwen3_5_vision("qwen3_5-vision-bf16", dtype="bfloat16")
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
        assert float(np.max(np.abs(feats - theirs))) <= 2**-6 * float(np.max(np.abs(theirs)))
        ids = sized_image_ids(s, TWO, imgs)
        assert ids == ref["input_ids"]
        logits = image_logits(s, ids, imgs)
        out = s.generate(TWO, images=imgs, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32)))) <= 5e-2
    assert out.tokens == ref["tokens"]


@pytest.mark.parametrize(
    "name, overrides, max_tokens",
    [
        ("qwen3_5-vision-f32", None, 32),
        # a mid-sized tower: 1024 patches at the largest size, 256 wide, 4 heads, a 1024-wide MLP
        ("qwen3_5-vision-mid-f32", {"hidden_size": 256, "intermediate_size": 1024, "depth": 3}, 256),
    ],
)
def test_the_plan_counts_encoding_one_image_at_the_largest_size(name, overrides, max_tokens):
    """The memory plan's mediaTransientBytes (plan.rs, from the tower's sizes and the processor's
    max_pixels) is at least MLX's peak over encoding one image at the largest size (CPU), and within
    2× of it; it is part of transientBytes, and `fit` shows it."""
    from PIL import Image

    from mlxrs import fit

    d = make_qwen3_5_vision(name, vision_overrides=overrides, max_image_tokens=max_tokens)
    p = fit.plan(d, 512)
    formula = p["mediaTransientBytes"]
    assert p["transientBytes"] > formula > 0
    big = Image.fromarray(np.random.default_rng(3).integers(0, 256, (900, 1300, 3), dtype=np.uint8))
    buf = io.BytesIO()
    big.save(buf, "PNG")
    with mlxrs.Session(d) as s:
        assert s.vision["max_tokens_per_image"] == max_tokens
    # four images in one prompt go through the tower one at a time: within one image's figure
    (feats, peak), (_, peak4) = encoding_peaks(d, "image_features", [[buf.getvalue()], random_pngs(4, (900, 1300))])
    assert feats % max_tokens == 0 and peak > 0
    assert peak <= formula <= 2 * peak, (name, peak, formula)
    assert peak4 <= formula, (name, peak4, formula)
    assert "of encoding one image at the largest size" in fit.describe(d, name, p, None, None)
