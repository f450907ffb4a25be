"""The Anthropic surface of a real `python -m mlxrs serve` process, driven by the official
`anthropic` SDK (and raw SSE where the exact event sequence matters).

The scripted model (tests/scriptedmodel.py) answers with a <think> block and a greeting when
thinking is on (the template's default), and with a Qwen-style <tool_call> when thinking is off
(`thinking: {"type": "disabled"}` → the template's enable_thinking=False)."""

from __future__ import annotations

import anthropic
import pytest

import mlxrs
from scriptedmodel import THINK_ANSWER, THINK_TEXT, WEATHER_TOOL
from server_util import Server, sse_events

MODEL = "scripted-qwen3"
HI = [{"role": "user", "content": "hi"}]
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(scripted_server):
    return scripted_server


@pytest.fixture(scope="module")
def local(scripted_dir):
    with mlxrs.Session(scripted_dir) as s:
        yield s


def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_message_with_thinking(server, local):
    m = client(server).messages.create(model=MODEL, max_tokens=100, messages=HI)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THINK_TEXT and m.content[1].text == THINK_ANSWER
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(local.encode_prompt(HI))
    assert m.usage.output_tokens == 5


def test_stream_event_sequence_raw(server):
    """The exact Messages SSE sequence, ping included."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST",
        "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 100, "stream": True, "messages": HI}),
        {"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
    )
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(r.read().decode())
    names = [e for e, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(d["type"] == e for e, d in events)
    data = [d for _, d in events]
    assert data[0]["message"]["content"] == [] and data[0]["message"]["usage"]["input_tokens"] > 0
    assert data[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert data[3]["delta"] == {"type": "thinking_delta", "thinking": THINK_TEXT} and data[3]["index"] == 0
    assert data[5]["content_block"] == {"type": "text", "text": ""} and data[5]["index"] == 1
    assert data[6]["delta"] == {"type": "text_delta", "text": THINK_ANSWER}
    assert data[8]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[8]["usage"]["output_tokens"] == 5


def test_sdk_stream_accumulates(server):
    with client(server).messages.stream(model=MODEL, max_tokens=100, messages=HI) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THINK_TEXT and final.content[1].text == THINK_ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5


def test_tool_use(server):
    m = client(server).messages.create(model=MODEL, max_tokens=100, messages=HI, tools=[TOOL], thinking=OFF)
    assert m.stop_reason == "tool_use"
    (b,) = m.content
    assert b.type == "tool_use" and b.name == "get_weather" and b.input == {"city": "Paris"}
    assert b.id.startswith("toolu_")


def test_tool_use_streamed(server):
    with client(server).messages.stream(model=MODEL, max_tokens=100, messages=HI, tools=[TOOL], thinking=OFF) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"]
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_tool_round_trip(server, local):
    c = client(server)
    first = c.messages.create(model=MODEL, max_tokens=100, messages=HI, tools=[TOOL], thinking=OFF)
    call = first.content[0]
    history = HI + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "21 degrees, sunny"}],
                }
            ],
        },
    ]
    m = c.messages.create(model=MODEL, max_tokens=100, messages=history, tools=[TOOL])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    rendered = local.apply_chat_template(
        [
            HI[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "21 degrees, sunny"},
        ],
        tools=[WEATHER_TOOL],
    )
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in rendered
    n_prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens  # the earlier turn came from the cache
    assert n_prompt == len(local._s.encode_rendered(rendered)) and m.usage.cache_read_input_tokens > 0
    assert c.messages.count_tokens(model=MODEL, messages=history, tools=[TOOL]).input_tokens == n_prompt


def test_system_string_and_blocks(server, local):
    c = client(server)
    expected = len(local.encode_prompt([{"role": "system", "content": "Be brief."}] + HI))
    assert c.messages.count_tokens(model=MODEL, system="Be brief.", messages=HI).input_tokens == expected
    assert (
        c.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}], messages=HI).input_tokens
        == expected
    )
    m = c.messages.create(model=MODEL, max_tokens=50, system=[{"type": "text", "text": "Be brief."}], messages=HI)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == expected


def test_stop_reasons(server):
    c = client(server)
    m = c.messages.create(model=MODEL, max_tokens=100, messages=HI, stop_sequences=["How"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "How"
    assert m.content[-1].text == "Hello! "
    m = c.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    assert [b.type for b in m.content] == ["thinking"]


@pytest.mark.parametrize(
    "block, named",
    [
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}, "'image'"),
        ({"type": "document", "source": {"type": "file", "file_id": "file_123"}}, "'file' source"),
        (
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
            "'base64' source",
        ),
        ({"type": "video", "source": {"type": "url", "url": "https://example.com/v.mp4"}}, "'video'"),
        ({"type": "audio", "source": {"type": "base64", "media_type": "audio/wav", "data": "UklGRg=="}}, "'audio'"),
    ],
)
def test_unsupported_content_is_a_400_naming_the_block(server, block, named):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, block]}],
        )
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    msg = e.value.body["error"]["message"]
    assert msg.startswith("messages[0].content[1]") and named in msg


def test_image_inside_tool_result_is_not_dropped(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(
            model=MODEL,
            max_tokens=10,
            tools=[TOOL],
            messages=HI
            + [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "a screenshot:"},
                                {
                                    "type": "image",
                                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                                },
                            ],
                        }
                    ],
                },
            ],
        )
    assert "messages[2].content[0].content[1]" in e.value.body["error"]["message"]


def test_plain_text_document_is_read(server, local):
    m = client(server).messages.count_tokens(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}],
            }
        ],
    )
    assert m.input_tokens == len(local.encode_prompt(HI))


def test_errors_in_anthropic_envelope(server):
    c = client(server)
    # any model name is answered (404 only with --strict-model-names: test_server_errors.py)
    assert c.messages.create(model="claude-opus-4", max_tokens=1, messages=HI).model == MODEL
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "system", "content": "x"}])
    assert "messages[0].role" in e.value.body["error"]["message"]
    status, body = server.post("/v1/messages", {"model": MODEL, "messages": HI})
    assert (
        status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
    )
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(
            model=MODEL, max_tokens=10, messages=HI, tools=[{"type": "web_search_20250305", "name": "web_search"}]
        )


def test_models_list_in_anthropic_shape(server):
    page = client(server).models.list()
    assert [m.id for m in page.data] == [MODEL] and page.data[0].type == "model"
