"""POST /v1/responses (the OpenAI Responses API) of a real `python -m mlxrs serve` process, driven by
the official `openai` SDK; the scripted model (tests/scriptedmodel.py) thinks then answers with
thinking on, and calls get_weather with thinking off."""

from __future__ import annotations

import json

import openai
import pytest

from mlxrs.server.responses import Store, response_format
from scriptedmodel import THINK_ANSWER, THINK_TEXT
from server_util import openai_client, sse_events

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(scripted_server):
    return scripted_server


client = openai_client


def test_create_with_string_input(server):
    r = client(server).responses.create(model="gpt-4o-mini", input="hi", instructions="Be kind.")
    assert r.object == "response" and r.status == "completed" and r.model == "scripted-qwen3"
    assert r.output_text == THINK_ANSWER
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINK_TEXT
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be kind."


def test_instructions_and_message_items_are_rendered(server):
    c = client(server)
    a = c.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=1)
    b = c.responses.create(model="gpt-4o-mini", input="hi", instructions="Be kind and brief.", max_output_tokens=1)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    d = c.responses.create(model="gpt-4o-mini", input=items, max_output_tokens=1)
    assert b.usage.input_tokens > a.usage.input_tokens and d.usage.input_tokens == a.usage.input_tokens
    assert a.status == "incomplete" and a.incomplete_details.reason == "max_output_tokens"
    assert a.usage.output_tokens == 1


def test_stream_event_sequence(server):
    with client(server).responses.stream(model="gpt-4o-mini", input="hi") as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    msg = types.index("response.content_part.added")
    assert types[msg - 1] == "response.output_item.added"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == THINK_ANSWER == final.output_text
    tail = [t for t in types if t.startswith("response.output_text.done") or t.endswith(".done")]
    assert tail[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINK_TEXT


def test_function_call_round_trip(server):
    c = client(server)
    q = "What is the weather in Paris?"
    r = c.responses.create(model="gpt-4o-mini", input=q, tools=[WEATHER], extra_body=NO_THINK)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].call_id
    out = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    # continued from the stored response …
    follow = c.responses.create(
        model="gpt-4o-mini",
        previous_response_id=r.id,
        input=[out],
        tools=[WEATHER],
        extra_body=NO_THINK,
        max_output_tokens=1,
    )
    # … or with the whole conversation sent again: the same prompt
    items = [
        {"role": "user", "content": q},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        out,
    ]
    again = c.responses.create(
        model="gpt-4o-mini", input=items, tools=[WEATHER], extra_body=NO_THINK, max_output_tokens=1
    )
    assert follow.usage.input_tokens == again.usage.input_tokens > r.usage.input_tokens
    assert follow.previous_response_id == r.id


def test_function_call_streamed(server):
    raw = server.request(
        "POST",
        "/v1/responses",
        json.dumps({"model": "x", "input": "weather?", "tools": [WEATHER], "stream": True, **NO_THINK}),
    )[1]
    evs = [d for _, d in sse_events(raw)]
    types = [e["type"] for e in evs]
    i = types.index("response.function_call_arguments.delta")
    assert types[i - 1] == "response.output_item.added" and evs[i - 1]["item"]["type"] == "function_call"
    assert types[i + 1 : i + 3] == ["response.function_call_arguments.done", "response.output_item.done"]
    done = evs[i + 2]["item"]
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    assert types[-1] == "response.completed"
    assert evs[-1]["response"]["output"][-1]["call_id"] == done["call_id"]


def test_unknown_previous_response_and_unsupported_tools(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="m", input="hi", previous_response_id="resp_nothere")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    assert "tools[0]" in e.value.message and "web_search" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input=[{"type": "item_reference", "id": "x"}])
    assert "input[0].type" in e.value.message


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}}
    assert response_format(body) == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert response_format({"text": {"format": {"type": "json_object"}}}) == {"type": "json_object"}
    assert response_format({"text": {"format": {"type": "text"}}}) is None and response_format({}) is None


def test_store_keeps_the_most_recent():
    s = Store(size=2)
    s.put("a", [])
    s.put("b", [])
    assert s.get("a") == []  # a is now the most recently used
    s.put("c", [])
    assert s.get("b") is None and s.get("a") == [] and s.get("c") == []


def test_errors_name_the_responses_parameters(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="hi", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="hi", temperature=5)
    assert e.value.body["param"] == "temperature"
    # text.format goes to the chat path as response_format; what it refuses is named text.format
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="hi", text={"format": {"type": "xml"}})
    assert e.value.body["param"].startswith("text.format") and "response_format" not in e.value.message


def test_responses_parse_with_a_pydantic_model(server):
    """`text.format` reaches the chat path's constrained decoding: the SDK's parse helper gets its model."""
    from typing import Literal

    import pydantic

    class Verdict(pydantic.BaseModel):
        label: Literal["yes", "no", "maybe"]
        sure: bool

    r = client(server).responses.parse(
        model="gpt-4o-mini", input="is it raining?", text_format=Verdict, max_output_tokens=48, extra_body=NO_THINK
    )
    assert isinstance(r.output_parsed, Verdict)
    assert Verdict.model_validate_json(r.output_text) == r.output_parsed
