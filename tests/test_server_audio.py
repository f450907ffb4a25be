"""Audio through a real `python -m mlxrs serve` of the tiny Gemma 4 model with an audio tower
(tests/tinymodels.py `make_gemma4_audio`), driven by the official `openai` and `anthropic` SDKs: an
OpenAI `input_audio` part on /v1/chat/completions and on /v1/responses reaches the model (the
prompt token count includes the audio tokens; the tokens equal mlx-vlm 0.7.10's for the same clip
and prompt); /v1/models lists "audio"; bad WAVs, other formats and Anthropic audio blocks are 400s
naming the part, and the server keeps serving; a model without an audio tower refuses audio."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

import mlxrs
from audio_util import tone, wav_bytes
from server_util import Server
from test_vision import run_vlm
from tinymodels import make_gemma4_audio, make_gemma4_vision

MODEL = "gemma4-audio-f32"
N = 32


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


@pytest.fixture(scope="module")
def model_dir():
    return make_gemma4_audio()


@pytest.fixture(scope="module")
def server(model_dir):
    with Server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    p = tmp_path_factory.mktemp("srv_audio") / "a.wav"
    p.write_bytes(wav_bytes(tone(1.3, 44100, 2, seed=5), 44100, 16))
    return p


def oa(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _msgs(data: bytes, fmt: str = "wav") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Listen to"},
                {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}},
                {"type": "text", "text": "and answer."},
            ],
        }
    ]


def test_models_list_audio(server):
    card = oa(server).models.list().data[0]
    assert "audio" in card.model_extra["input_modalities"]


def test_openai_input_audio_matches_mlx_vlm(server, model_dir, clip):
    """The clip in an OpenAI message: the prompt as the template renders it, the tokens mlx-vlm's for
    that prompt (its processor expanding the same audio marker) and the usage counting the audio."""
    with mlxrs.Session(model_dir) as s:
        text = s.apply_chat_template(
            [{"role": "user", "content": "Listen to\n<|audio|>\nand answer."}], add_generation_prompt=True
        )
    ref = run_vlm({"model": str(model_dir), "prompt": text, "images": [], "audio": [str(clip)], "max_tokens": N})
    r = oa(server).chat.completions.create(
        model=MODEL, messages=_msgs(clip.read_bytes()), max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(ref["input_ids"])
    assert r.usage.prompt_tokens > 33  # the clip's 33 audio tokens are counted
    with mlxrs.Session(model_dir) as s:
        out = s.generate(ref["input_ids"], audio=[clip], max_tokens=N, ignore_eos=True, temperature=0.0)
    assert out.tokens == ref["tokens"]
    assert r.choices[0].message.content == out.text


def test_responses_input_audio(server, clip):
    inp = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Listen to"},
                {"type": "input_audio", "input_audio": {"data": b64(clip.read_bytes()), "format": "wav"}},
                {"type": "input_text", "text": "and answer."},
            ],
        }
    ]
    r = oa(server).responses.create(model=MODEL, input=inp, max_output_tokens=8, temperature=0)
    c = oa(server).chat.completions.create(model=MODEL, messages=_msgs(clip.read_bytes()), max_tokens=8, temperature=0)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content


@pytest.mark.parametrize(
    "data,fmt,needle",
    [
        (lambda: wav_bytes(tone(0.5, 16000), 16000, claim_frames=16000), "wav", "shorter than its header"),
        (lambda: b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, "wav", "MP3 audio is not supported"),
        (lambda: b"\x00" * 64, "mp3", "mp3 audio is not supported"),
        (lambda: b"RIFF\x10\x00\x00\x00WAVEfmt ", "wav", "not a valid WAV"),
    ],
)
def test_bad_audio_is_a_400_naming_the_part(server, data, fmt, needle):
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(model=MODEL, messages=_msgs(data(), fmt), max_tokens=2)
    assert "messages[0].content[1]" in str(e.value) and needle in str(e.value)
    # the server still answers: two tokens, or fewer where the random model samples its end token
    r = oa(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    c = r.choices[0]
    assert (c.finish_reason, r.usage.completion_tokens) == ("length", 2) or (
        c.finish_reason == "stop" and 1 <= r.usage.completion_tokens <= 2
    ), (c.finish_reason, r.usage)


def test_anthropic_audio_block_names_the_openai_endpoint(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
            ],
        )
    assert "/v1/chat/completions" in str(e.value) and "input_audio" in str(e.value)


def test_model_without_audio_tower_refuses_audio(clip):
    with Server(make_gemma4_vision()) as s:
        card = oa(s).models.list().data[0]
        assert "audio" not in card.model_extra["input_modalities"]
        with pytest.raises(openai.BadRequestError) as e:
            oa(s).chat.completions.create(model="gemma4-vision-f32", messages=_msgs(clip.read_bytes()), max_tokens=2)
        assert "no audio tower" in str(e.value) and "gemma4-vision-f32" in str(e.value)
