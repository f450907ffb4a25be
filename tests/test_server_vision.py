"""Images through a real `python -m mlxrs serve` of the tiny Gemma 3 multimodal model, driven by the
official `openai` and `anthropic` SDKs: an image in an OpenAI message, in an Anthropic message and
inside an Anthropic tool_result reaches the model (the prompt token count includes the image tokens;
the answer equals the library's for the same input, and changes with the image); bad media is a 400
naming the part and the server keeps serving; local paths and remote URLs are refused unless allowed."""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
import pytest

import mlxrs
from server_util import Server
from test_vision import huge_png_header
from tinymodels import make_gemma3_vision

MODEL = "gemma3-vision-f32"
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def data_url(b: bytes, mt: str = "image/png") -> str:
    return f"data:{mt};base64," + base64.b64encode(b).decode()


@pytest.fixture(scope="module")
def model_dir():
    return make_gemma3_vision()


@pytest.fixture(scope="module")
def server(model_dir):
    with Server(model_dir, "--max-image-pixels", "4000000") as s:
        yield s


@pytest.fixture(scope="module")
def local(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


def oa(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def an(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_openai_image_reaches_the_model(server, local):
    img = _png(1)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": data_url(img)}},
            ],
        }
    ]
    r = oa(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    ref = local.chat(msgs, max_tokens=12, temperature=0.0)
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.prompt_tokens > 16  # the image's 16 tokens and its markers are counted
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.tokens)
    other = oa(server).chat.completions.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(_png(2))}},
                ],
            }
        ],
    )
    assert other.choices[0].message.content != r.choices[0].message.content


def _png_block(img: bytes) -> dict:
    """An Anthropic base64 image block of PNG bytes."""
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(img).decode()},
    }


def _anthropic_image_and_library(client, model: str, lib, img: bytes, max_tokens: int):
    """A "Describe it." message with one base64 PNG image block through the Anthropic SDK, and the
    same message through `Session.chat` (greedy): (the SDK's message, the library's completion)."""
    m = client.messages.create(
        model=model,
        max_tokens=max_tokens,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe it."}, _png_block(img)]}],
    )
    ref = lib.chat(
        [{"role": "user", "content": [{"type": "text", "text": "Describe it."}, {"type": "image", "image": img}]}],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    return m, ref


def test_anthropic_image_block_reaches_the_model(server, local):
    m, ref = _anthropic_image_and_library(an(server), MODEL, local, _png(4), 12)
    assert m.usage.input_tokens == ref.usage.prompt_tokens
    assert "".join(b.text for b in m.content if b.type == "text") == ref.text
    assert m.usage.output_tokens == len(ref.tokens)


def _tool_turn(inner: list[dict]) -> list[dict]:
    return [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": inner}]},
    ]


def test_image_inside_anthropic_tool_result_reaches_the_model(server, local):
    c = an(server)
    text = {"type": "text", "text": "a screenshot:"}

    with_img = c.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        tools=[TOOL],
        messages=_tool_turn([text, _png_block(_png(5))]),
    )
    other = c.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        tools=[TOOL],
        messages=_tool_turn([text, _png_block(_png(6))]),
    )
    plain = c.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        tools=[TOOL],
        messages=_tool_turn([text, {"type": "text", "text": "x"}]),
    )
    # the image's tokens are in the prompt: exactly what replacing "x" by its expanded marker adds
    expanded = local._s.expand_image_markers("a screenshot:\n<start_of_image>", 1)
    delta = len(local.tokenize(expanded)) - len(local.tokenize("a screenshot:\nx"))
    assert with_img.usage.input_tokens - plain.usage.input_tokens == delta
    assert with_img.usage.input_tokens == other.usage.input_tokens
    # and the answer is the library's for the same conversation (the server's translation of the
    # tool turn, adapted to this template, rendered, the marker expanded): same prompt, same tokens
    from mlxrs.server import adapt

    msgs = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_1",
            "name": "get_weather",
            "content": "a screenshot:\n<start_of_image>",
        },
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": TOOL["name"], "parameters": TOOL["input_schema"], "description": TOOL["description"]},
        }
    ]
    caps = adapt.probe(lambda m, t: local.apply_chat_template(m, tools=t))
    msgs, tools = adapt.adapt(caps, msgs, tools)
    text = local._s.expand_image_markers(local.apply_chat_template(msgs, tools=tools), 1)
    ids = list(local._s.encode_rendered(text))
    assert with_img.usage.input_tokens == len(ids)
    ref = local.generate(ids, images=[_png(5)], max_tokens=12, temperature=0.0)
    assert "".join(b.text for b in with_img.content if b.type == "text") == ref.text


BAD = {
    "truncated PNG": lambda: data_url(_png(1)[:60]),
    "truncated JPEG": lambda: data_url(_jpeg()[:300], "image/jpeg"),
    "50k x 50k header": lambda: data_url(huge_png_header()),
    "unsupported data": lambda: data_url(b"BM" + bytes(100), "image/bmp"),
    "not base64": lambda: "data:image/png;base64,@@@not-base64@@@",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_media_is_a_400_naming_the_part(server, case):
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": BAD[case]()}},
                    ],
                }
            ],
        )
    assert e.value.status_code == 400
    assert "messages[0].content[1]" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e2:
        an(server).messages.create(
            model=MODEL,
            max_tokens=4,
            messages=_tool_turn([{"type": "image", "source": {"type": "url", "url": BAD[case]()}}]),
        )
    assert "messages[2].content[0].content[0]" in e2.value.body["error"]["message"]
    # still serving
    r = oa(server).chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1


def test_a_header_over_the_pixel_limit_is_refused_before_decoding(server):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (2000, 2100)).save(buf, "PNG")  # 4.2 megapixels, --max-image-pixels 4000000
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}}]}
            ],
        )
    assert "2000x2100 pixels; at most 4000000" in e.value.message


def test_paths_and_remote_urls_need_their_flags(server, tmp_path):
    p = tmp_path / "x.png"
    p.write_bytes(_png(1))
    for url, flag in [
        (str(p), "--allow-local-media"),
        ("file://" + str(p), "--allow-local-media"),
        ("http://127.0.0.1:9/x.png", "--allow-remote-media"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            oa(server).chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            )
        assert flag in e.value.message and "messages[0].content[0]" in e.value.message


def test_local_paths_with_the_flag(model_dir, local, tmp_path):
    p = tmp_path / "x.png"
    img = _png(8)
    p.write_bytes(img)
    with Server(model_dir, "--allow-local-media") as s:
        r = oa(s).chat.completions.create(
            model=MODEL,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(p)}}]}],
        )
    ref = local.chat([{"role": "user", "content": [{"type": "image", "image": img}]}], max_tokens=8, temperature=0.0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.usage.prompt_tokens


def test_audio_is_refused_naming_the_modality(server):
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
                }
            ],
        )
    assert "messages[0].content[0]" in e.value.message and "audio" in e.value.message


def test_models_card_says_the_model_takes_images(server, local):
    """`/v1/models` tells clients (the chat page) whether images can be sent: from the model's info."""
    card = oa(server).models.list().data[0]
    assert local.vision is not None
    assert card.id == MODEL and card.model_extra["input_modalities"] == ["text", "image"]
    assert oa(server).models.retrieve(MODEL).model_extra["input_modalities"] == ["text", "image"]


def test_responses_input_image_reaches_the_model(server, local):
    """/v1/responses: an `input_image` part is the chat path's image_url part — the answer equals the
    chat completion's for the same image and question (the oracle: the chat endpoint, itself checked
    against the library above)."""
    img = data_url(_png(3))
    r = oa(server).responses.create(
        model=MODEL,
        max_output_tokens=12,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": img},
                ],
            }
        ],
    )
    c = oa(server).chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": img}},
                ],
            }
        ],
    )
    assert r.usage.input_tokens == c.usage.prompt_tokens > 16
    assert r.output_text == c.choices[0].message.content


def test_responses_errors_name_the_input_item(server):
    """What the chat path refuses inside an input item is named as the Responses request names it."""
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).responses.create(
            model=MODEL,
            max_output_tokens=4,
            instructions="be brief",
            input=[
                {"role": "user", "content": "first"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": BAD["truncated PNG"]()},
                    ],
                },
            ],
        )
    assert e.value.body["param"] == "input[1].content[1]", e.value.body
    assert "messages[" not in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).responses.create(
            model=MODEL,
            max_output_tokens=4,
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}],
        )
    assert e.value.body["param"] == "input[0].content[0].image_url"
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).responses.create(
            model=MODEL,
            max_output_tokens=4,
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_image", "image_url": "data:image/png;base64,@@@"}],
                },
            ],
        )
    assert e.value.body["param"].startswith("input[1].output"), e.value.body


@pytest.fixture(scope="module")
def gemma4_dir():
    from tinymodels import make_gemma4_vision

    return make_gemma4_vision()


def test_gemma4_images_through_both_protocols(gemma4_dir):
    """Gemma 4 (its count of image tokens depends on each image's size): an OpenAI image_url part
    and an Anthropic image block (also inside a tool_result) reach the model with the library's
    prompt and answer for the same input; images of other sizes count other tokens; a truncated
    image is a 400 naming the part, from its header, and the server keeps serving."""
    from PIL import Image

    def png(h: int, w: int, seed: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    square, wide = png(60, 60, 1), png(30, 150, 2)
    name = "gemma4-vision-f32"
    with Server(gemma4_dir) as s, mlxrs.Session(gemma4_dir) as lib:

        def chat(img: bytes) -> tuple[openai.types.chat.ChatCompletion, mlxrs.GenerationResult]:
            parts = [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": data_url(img)}},
            ]
            r = oa(s).chat.completions.create(
                model=name, messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0
            )
            return r, lib.chat([{"role": "user", "content": parts}], max_tokens=10, temperature=0.0)

        (r1, ref1), (r2, ref2) = chat(square), chat(wide)
        for r, ref in ((r1, ref1), (r2, ref2)):
            assert r.usage.prompt_tokens == ref.usage.prompt_tokens
            assert r.choices[0].message.content == ref.text

        def count(img: bytes) -> int:
            return lib._s.expand_image_markers("<|image|>", 1, lib._s.image_sizes([(img, "x")])).count("<|image|>")

        assert count(square) != count(wide)
        assert r1.usage.prompt_tokens - r2.usage.prompt_tokens == count(square) - count(wide)
        m, ref = _anthropic_image_and_library(an(s), name, lib, wide, 10)
        block = _png_block(wide)
        assert m.usage.input_tokens == ref.usage.prompt_tokens
        assert "".join(b.text for b in m.content if b.type == "text") == ref.text
        in_tool = an(s).messages.create(model=name, max_tokens=4, tools=[TOOL], messages=_tool_turn([block]))
        plain = an(s).messages.create(
            model=name, max_tokens=4, tools=[TOOL], messages=_tool_turn([{"type": "text", "text": "x"}])
        )
        expanded = lib._s.expand_image_markers("<|image|>", 1, lib._s.image_sizes([(wide, "x")]))
        assert in_tool.usage.input_tokens - plain.usage.input_tokens == len(lib.tokenize(expanded)) - len(
            lib.tokenize("x")
        )
        with pytest.raises(openai.BadRequestError) as e:
            oa(s).chat.completions.create(
                model=name,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n")}},
                        ],
                    }
                ],
            )
        assert "messages[0].content[1]" in e.value.message
        r = oa(s).chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens >= 1


def test_qwen35_images_and_video_frames_through_the_openai_sdk(tmp_path):
    """Qwen3.5 (its tower takes images and videos as frames): `/v1/models` lists image and video;
    an image_url part and a video_url part holding the video's frames (data URLs) reach the model
    with the library's prompt and answer for the same input (the library itself checked against
    mlx-vlm in test_vision_qwen35.py); a remote video file URL without --allow-remote-media is a
    400 naming the part and the flag; images and a video together are a 400."""
    from PIL import Image

    from tinymodels import make_qwen3_5_vision

    d = make_qwen3_5_vision()
    name = "qwen3_5-vision-f32"

    def png(h: int, w: int, seed: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    img = png(70, 90, 1)
    frames = [png(48, 64, 10 + i) for i in range(3)]
    with Server(d) as s, mlxrs.Session(d) as lib:
        card = oa(s).models.retrieve(name)
        assert card.model_extra["input_modalities"] == ["text", "image", "video"]
        parts = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(img)}},
        ]
        r = oa(s).chat.completions.create(
            model=name, messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0
        )
        ref = lib.chat([{"role": "user", "content": parts}], max_tokens=10, temperature=0.0)
        assert r.usage.prompt_tokens == ref.usage.prompt_tokens > 24
        assert r.choices[0].message.content == ref.text
        vparts = [
            {"type": "text", "text": "What happens?"},
            {"type": "video_url", "video_url": {"url": [data_url(f) for f in frames]}},
        ]
        r = oa(s).chat.completions.create(
            model=name, messages=[{"role": "user", "content": vparts}], max_tokens=10, temperature=0
        )
        ref = lib.generate(
            [{"role": "user", "content": [vparts[0], {"type": "video"}]}], video=frames, max_tokens=10, temperature=0.0
        )
        assert r.usage.prompt_tokens == ref.usage.prompt_tokens
        assert r.choices[0].message.content == ref.text
        with pytest.raises(openai.BadRequestError) as e:
            oa(s).chat.completions.create(
                model=name,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}],
                    }
                ],
            )
        assert "messages[0].content[0]" in e.value.message and "--allow-remote-media" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            oa(s).chat.completions.create(
                model=name, max_tokens=4, messages=[{"role": "user", "content": [parts[1], vparts[1]]}]
            )
        assert "images or videos, not both" in e.value.message


def test_video_to_a_model_without_video_names_model_and_modality(server):
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": [data_url(_png(1))]}}]}],
        )
    assert e.value.status_code == 400
    assert "messages[0].content[0]" in e.value.message and "video" in e.value.message and MODEL in e.value.message
