"""Audio input for Gemma 4, against mlx-vlm 0.7.10 on the same tiny random model (tests/tinymodels.py
`make_gemma4_audio`: the vision model plus a 2-block conformer with clipped linears, chunked local
attention with left and right context, an output projection): the log-mel features of a WAV
clip, the prompt's expansion (ceil(ms / 40) audio tokens), the encoder's projected embeddings, the
last-position logits and 32 greedy tokens for a prompt with one clip — a 44.1 kHz stereo one and
a 16 kHz 24-bit one with one token more than encoder frames (mlx-vlm's scatter wraps round); a
model without an audio tower and bad WAVs refused naming the part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mlxrs
from audio_util import tone, wav_bytes
from test_vision import run_vlm
from media_util import copy_model, encoding_peaks
from tinymodels import make_gemma4_audio, make_gemma4_vision

N_TOKENS = 32
PROMPT = "Listen to <|audio|> and answer."
CLIPS = {
    # 1.3 s of 44.1 kHz stereo 16-bit: downmixed, resampled (kaiser_best), 33 tokens for 33 frames
    "stereo44k": lambda: wav_bytes(tone(1.3, 44100, 2, seed=5), 44100, 16),
    # 16001 samples at 16 kHz, 24-bit: 26 audio tokens for 25 encoder frames
    "wrap16k": lambda: wav_bytes(tone(16001 / 16000, 16000, 1, seed=6), 16000, 24),
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_gemma4_audio()


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("audio4")
    out = {}
    for k, make in CLIPS.items():
        out[k] = d / f"{k}.wav"
        out[k].write_bytes(make())
    return out


@pytest.fixture(scope="module")
def session(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(model_dir, clips):
    return {
        k: run_vlm({"model": str(model_dir), "prompt": PROMPT, "images": [], "audio": [str(p)], "max_tokens": N_TOKENS})
        for k, p in clips.items()
    }


def test_audio_info(session):
    a = session.audio
    assert a["marker"] == "<|audio|>" and a["boa_token"] == "<|audio>" and a["eoa_token"] == "<audio|>"
    assert a["max_tokens_per_clip"] == 750 and a["ms_per_token"] == 40 and a["sampling_rate"] == 16000


@pytest.mark.parametrize("name", list(CLIPS))
def test_mel_features_and_prompt_match_the_processor(session, clips, oracle, name):
    """The processor's log-mel features and mask, and the expanded prompt's ids. The features are
    within 1e-5 of the extractor's but where numpy's float32 cos puts an ulp into the Hann window
    (tests/test_audio.py shows 1e-5 against the exactly rounded window): within 2e-5 here."""
    ref = oracle[name]
    (clip,) = session.audio_clips([clips[name]])
    feats, mask = clip.features()
    theirs = np.array(ref["mel"][0], dtype=np.float32)
    assert clip.frames * 128 == theirs.size
    assert float(np.max(np.abs(np.array(feats, dtype=np.float32) - theirs))) <= 2e-5
    assert list(mask) == [bool(m) for m in ref["mel_mask"][0]]
    ids = session.tokenize(session._s.expand_audio_markers(PROMPT, [clip.tokens]))
    assert ids == ref["input_ids"]
    assert ids.count(session.audio["audio_token_id"]) == clip.tokens


@pytest.mark.parametrize("name", list(CLIPS))
def test_encoder_embeddings_match(session, clips, oracle, name):
    """The encoder's projected embeddings at each audio token: mlx-vlm's frames in order (wrapping
    round when the clip has more tokens than frames), within the vision tolerance (1e-4 relative)."""
    ref = np.array(oracle[name]["audio_features"][0], dtype=np.float32)  # [frames, hidden]
    (clip,) = session.audio_clips([clips[name]])
    ours = np.array(session._s.audio_features([clip]), dtype=np.float32).reshape(clip.tokens, -1)
    theirs = ref[np.arange(clip.tokens) % ref.shape[0]]
    assert ours.shape == theirs.shape
    assert float(np.max(np.abs(ours - theirs))) <= 1e-4 * float(np.max(np.abs(theirs)))


@pytest.mark.parametrize("name", list(CLIPS))
def test_one_clip_greedy_tokens_and_logits(session, clips, oracle, name):
    ref = oracle[name]
    out = session.generate(PROMPT, audio=[clips[name]], max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert out.tokens == ref["tokens"]
    assert out.usage.prompt_tokens == len(ref["input_ids"])
    clip_list = session.audio_clips([clips[name]])
    ours = np.array(session._s.logits(ref["input_ids"], None, clip_list), dtype=np.float32)
    theirs = np.array(ref["logits"], dtype=np.float32)
    assert float(np.max(np.abs(ours - theirs))) <= 1e-4
    # the audio reaches the model: another clip moves the logits
    other = session.audio_clips([wav_bytes(tone(1.3, 44100, 2, seed=99), 44100, 16)])
    if other[0].tokens == clip_list[0].tokens:
        moved = np.array(session._s.logits(ref["input_ids"], None, other), dtype=np.float32)
        assert float(np.max(np.abs(moved - ours))) > 1e-2


def test_two_clips_each_take_their_own_frames(session, clips):
    """Two clips in one prompt: each clip's tokens get its own encoder frames (mlx-vlm's batched
    scatter would hand the second clip's tokens the first's padded frames; not copied), and the
    prompt holds both runs in order."""
    a, b = session.audio_clips([clips["stereo44k"], clips["wrap16k"]])
    both = np.array(session._s.audio_features([a, b]), dtype=np.float32)
    one = np.array(session._s.audio_features([a]), dtype=np.float32)
    two = np.array(session._s.audio_features([b]), dtype=np.float32)
    np.testing.assert_array_equal(both, np.concatenate([one, two]))
    out = session.generate(
        "First <|audio|> then <|audio|>.",
        audio=[clips["stereo44k"], clips["wrap16k"]],
        max_tokens=4,
        ignore_eos=True,
        temperature=0.0,
    )
    assert out.usage.prompt_tokens > a.tokens + b.tokens


def test_two_clips_of_one_length_equal_mlx_vlm(session, model_dir, tmp_path):
    """Two clips in one prompt, of one length (33 tokens for 33 encoder frames each, so that
    mlx-vlm's scatter of the batch's frames in order gives each clip its own frames): the prompt,
    the logits and 32 greedy tokens equal mlx-vlm's. (Clips of different lengths differ by design:
    mlx-vlm hands the second clip's tokens the first clip's padded frames, mlxrs each clip its own
    — see test_two_clips_each_take_their_own_frames.)"""
    paths = []
    for seed in (11, 12):
        paths.append(tmp_path / f"c{seed}.wav")
        paths[-1].write_bytes(wav_bytes(tone(1.3, 44100, 2, seed=seed), 44100, 16))
    prompt = "First <|audio|> then <|audio|>: which is louder?"
    ref = run_vlm(
        {
            "model": str(model_dir),
            "prompt": prompt,
            "images": [],
            "audio": [str(p) for p in paths],
            "max_tokens": N_TOKENS,
        }
    )
    clip_list = session.audio_clips(paths)
    assert [c.tokens for c in clip_list] == [33, 33]
    out = session.generate(prompt, audio=paths, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
    assert out.usage.prompt_tokens == len(ref["input_ids"])
    ours = np.array(session._s.logits(ref["input_ids"], None, clip_list), dtype=np.float32)
    assert float(np.max(np.abs(ours - np.array(ref["logits"], dtype=np.float32)))) <= 1e-4
    assert out.tokens == ref["tokens"]


def test_chat_content_part(session, clips, oracle):
    """An OpenAI `input_audio` part in a message: the same tokens as the clip in a string prompt
    rendered by the template."""
    import base64

    data = base64.b64encode(clips["stereo44k"].read_bytes()).decode()
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Listen to"},
                {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                {"type": "text", "text": "and answer."},
            ],
        }
    ]
    out = session.generate(msgs, max_tokens=8, ignore_eos=True, temperature=0.0)
    text = session.apply_chat_template([{"role": "user", "content": "Listen to\n<|audio|>\nand answer."}])
    (clip,) = session.audio_clips([clips["stereo44k"]])
    ids = list(session._s.encode_rendered(session._s.expand_audio_markers(text, [clip.tokens])))
    same = session.generate(ids, audio=[clips["stereo44k"]], max_tokens=8, ignore_eos=True, temperature=0.0)
    assert out.tokens == same.tokens
    assert out.usage.prompt_tokens == len(ids)


def test_audio_everywhere_images_go(session, clips):
    """A clip as a conversation's content part through chat, generate_batch, stream and astream,
    and as `audio=` through astream: the tokens generate gives for the same input."""
    import asyncio

    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Listen:"}, {"type": "audio", "audio": str(clips["stereo44k"])}],
        }
    ]
    opts = {"max_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    ref = session.generate(msgs, **opts)
    assert ref.usage.prompt_tokens > 33
    assert (
        session.chat(msgs, max_tokens=10, temperature=0.0).text
        == session.generate(msgs, max_tokens=10, temperature=0.0).text
    )
    batch = session.generate_batch([msgs, "text only"], **opts)
    assert batch[0].tokens == ref.tokens and batch[0].usage.prompt_tokens == ref.usage.prompt_tokens
    assert [c.token for c in session.stream(msgs, **opts) if c.token is not None] == ref.tokens

    async def go(prompt, **kw) -> list[int]:
        return [c.token async for c in session.astream(prompt, **opts, **kw) if c.token is not None]

    assert asyncio.run(go(msgs)) == ref.tokens
    one = session.generate(PROMPT, audio=[clips["stereo44k"]], **opts)
    assert asyncio.run(go(PROMPT, audio=[clips["stereo44k"]])) == one.tokens


def test_model_without_audio_tower_refuses(clips):
    with mlxrs.Session(make_gemma4_vision()) as s:
        assert s.audio is None
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match="no audio tower"):
            s.generate("hi", audio=[clips["stereo44k"]], max_tokens=2)
        msgs = [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
        ]
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"messages\[0\]\.content\[0\].*no audio tower"):
            s.generate(msgs, max_tokens=2)


@pytest.mark.parametrize(
    "data,needle",
    [
        (lambda: wav_bytes(tone(0.5, 16000), 16000, claim_frames=16000), "shorter than its header"),
        (lambda: b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, "MP3 audio is not supported"),
        (lambda: b"not audio at all" * 8, "unrecognized"),
        (lambda: wav_bytes(tone(40.0, 8000), 8000), "longer than the limit"),
    ],
)
def test_bad_wav_refused_naming_the_part(session, data, needle):
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match=r"audio\[0\]") as e:
        session.generate("hi", audio=[data()], max_tokens=2)
    assert needle in str(e.value)
    # and the session keeps serving
    assert session.generate("hi", max_tokens=2).usage.completion_tokens == 2


def test_openai_input_audio_format_other_than_wav_is_refused(session):
    msgs = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}]}]
    with pytest.raises(mlxrs.errors.InvalidArgumentError, match="mp3 audio is not supported"):
        session.generate(msgs, max_tokens=2)


def test_memory_plan_counts_the_audio_tower(model_dir):
    """The plan's weights are the checkpoint's tensors: the audio tower's and its projector's are in
    them (as the vision tower's are), exactly what the audio model adds to the vision one."""
    import mlx.core as mx

    from mlxrs import fit

    audio_bytes = sum(
        a.nbytes
        for k, a in mx.load(str(model_dir / "model.safetensors")).items()
        if k.startswith(("model.audio_tower.", "model.embed_audio."))
    )
    assert audio_bytes > 0
    with_audio = fit.plan(model_dir)["weightsBytes"]
    without = fit.plan(make_gemma4_vision())["weightsBytes"]
    assert with_audio - without == audio_bytes


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("audio_config.subsampling_conv_channels", [8], "audio_config.subsampling_conv_channels = [8] is not two"),
        (
            "audio_config.num_attention_heads",
            5,
            "audio_config.hidden_size 32 is not a multiple of num_attention_heads 5",
        ),
        ("audio_config.hidden_act", "gelu", 'audio_config.hidden_act "gelu"'),
        ("audio_config.hidden_size", 64, "model.audio_tower.subsample_conv_projection.input_proj_linear.weight"),
        ("audio_config.output_proj_dims", 40, "model.audio_tower.output_proj.bias has shape [48]"),
        ("audio_token_id", 7, "audio_token_id is 7"),
    ],
)
def test_a_bad_audio_config_is_refused_naming_the_field(model_dir, tmp_path, field, value, needle):
    import re

    d = copy_model(model_dir, tmp_path, field, value)
    with pytest.raises(mlxrs.errors.MlxrsError, match=re.escape(needle)):
        mlxrs.Session(d)


def test_a_missing_audio_tensor_or_bad_extractor_is_refused(model_dir, tmp_path):
    import json

    import mlx.core as mx

    d = copy_model(model_dir, tmp_path)
    w = dict(mx.load(str(d / "model.safetensors")))
    del w["model.audio_tower.layers.1.lconv1d.depthwise_conv1d.weight"]
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    with pytest.raises(
        mlxrs.errors.MlxrsError, match=r"model\.audio_tower\.layers\.1\.lconv1d\.depthwise_conv1d\.weight"
    ):
        mlxrs.Session(d)
    e = tmp_path / "fe"
    e.mkdir()
    d2 = copy_model(model_dir, e)
    proc = json.loads((d2 / "processor_config.json").read_text())
    proc["feature_extractor"] = {"feature_size": 80}
    (d2 / "processor_config.json").write_text(json.dumps(proc))
    with pytest.raises(mlxrs.errors.MlxrsError, match="feature_extractor.feature_size = 80"):
        mlxrs.Session(d2)


# a mid-sized encoder: hidden 256 in 4 heads, subsampling convolutions of 64 then 16 channels,
# Gemma 4's chunking (12 frames, 12 frames of left context, none right)
MID_AUDIO = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "subsampling_conv_channels": [64, 16],
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_context_right": 0,
    "output_proj_dims": 128,
}


@pytest.mark.parametrize(
    "name, overrides, dtype",
    [
        ("gemma4-audio-f32", None, "float32"),
        pytest.param("gemma4-audio-mid-f32", MID_AUDIO, "float32", marks=pytest.mark.slow),
        pytest.param("gemma4-audio-mid-bf16", MID_AUDIO, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_the_plan_counts_encoding_the_longest_clip(name, overrides, dtype):
    """The memory plan's audioTransientBytes (plan.rs via vision::gemma4_audio::encode_transient_bytes,
    from the encoder's sizes and the feature extractor's max_length) is at least MLX's peak over
    encoding a clip of the longest length (30 s at 16 kHz: what the extractor keeps; CPU) and within
    2× of it, for the tiny and a mid-sized encoder (float32 weights and bfloat16: the encoder
    computes in float32 either way); transientBytes holds the larger of it and
    the image's mediaTransientBytes, and `fit` shows both."""
    from mlxrs import fit

    d = make_gemma4_audio(name, dtype=dtype, audio_overrides=overrides)
    p = fit.plan(d, 512)
    formula = p["audioTransientBytes"]
    assert p["transientBytes"] > max(formula, p["mediaTransientBytes"]) > 0
    clip = wav_bytes(tone(30.0, 16000, 1, seed=8), 16000, 16)
    three = [
        clip,
        wav_bytes(tone(30.0, 16000, 1, seed=9), 16000, 16),
        wav_bytes(tone(30.0, 16000, 2, seed=10), 16000, 16),
    ]
    # three clips in one prompt are encoded one after another: still within the one clip's
    (feats, peak), (feats3, several) = encoding_peaks(d, "audio_features", [[clip], three])
    assert feats > 0 and peak > 0
    assert peak <= formula <= 2 * peak, (name, peak, formula)
    assert feats3 == 3 * feats
    assert several <= formula, (name, several, formula)
    text = fit.describe(d, name, p, None, None)
    assert "of encoding one audio clip of the longest length" in text and "of encoding one image" in text


def test_the_plan_counts_every_tower_weight():
    """`fit`'s weightsBytes for Gemma 4 with both towers is every tensor of the checkpoint — the
    language model, the vision tower and embed_vision, the audio encoder and embed_audio — as
    MLX's own loader reads them from the safetensors file."""
    import mlx.core as mx

    from mlxrs import fit

    d = make_gemma4_audio()
    tensors = mx.load(str(d / "model.safetensors"))
    parts = {"vision_tower": 0, "embed_vision": 0, "audio_tower": 0, "embed_audio": 0}
    for k, v in tensors.items():
        for part in parts:
            if f".{part}." in f".{k}":
                parts[part] += v.nbytes
    assert all(parts.values()), parts
    assert fit.plan(d, 512)["weightsBytes"] == sum(v.nbytes for v in tensors.values())
