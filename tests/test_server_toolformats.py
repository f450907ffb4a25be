"""Each tool-call format the server parses, end to end: a scripted model (tests/scriptedmodel.py)
writes the same call in the Hermes, Llama 3, Mistral, Gemma, Gemma 4, Qwen3-Coder XML, GLM, DeepSeek,
Kimi-K2 or MiniMax-M2 format, and both SDKs get it back as a structured call; without tools, the same
output is plain content, unchanged. gpt-oss's harmony format is served with the real gpt-oss chat
template (the server picks the format from it), through the OpenAI chat, Responses and Anthropic APIs."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from scriptedmodel import (
    HARMONY_REASONING,
    HARMONY_SCRIPT,
    HARMONY_TRIGGER,
    TOOL_SCRIPTS,
    WEATHER_TOOL,
    make_scripted_model,
)
from server_util import Server

HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module", params=sorted(TOOL_SCRIPTS))
def fmt_server(request):
    fmt = request.param
    name = "scripted-qwen3" if fmt == "hermes" else f"scripted-{fmt}"
    d = make_scripted_model(name, TOOL_SCRIPTS[fmt])
    with Server(d) as s:
        yield fmt, name, s


def test_openai_tool_calls(fmt_server):
    fmt, name, s = fmt_server
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=name, messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK)
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"}), fmt
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    parts = list(
        c.chat.completions.create(model=name, messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK, stream=True)
    )
    calls = [t for p in parts if p.choices for t in (p.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert not any(p.choices[0].delta.content for p in parts if p.choices)
    plain = c.chat.completions.create(model=name, messages=HI, extra_body=NO_THINK)
    assert plain.choices[0].message.content == "".join(TOOL_SCRIPTS[fmt])  # no tools offered: text as written


def test_anthropic_tool_use(fmt_server):
    fmt, name, s = fmt_server
    m = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60).messages.create(
        model=name, max_tokens=50, messages=HI, tools=[TOOL], thinking={"type": "disabled"}
    )
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})], fmt
    assert m.stop_reason == "tool_use"


# -- values typed by the tool's schema (Qwen3-Coder XML) --------------------------------------------
TYPED_SCRIPT = [
    "<tool_call>",
    "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n",
    "</tool_call>",
]
TYPED_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}},
}


@pytest.fixture(scope="module")
def typed_server():
    with Server(make_scripted_model("scripted-qwen3-coder-typed", TYPED_SCRIPT)) as s:
        yield s


def test_xml_values_typed_by_the_schema(typed_server):
    """The zip stays a string and the days become an integer, as mlx-lm's qwen3_coder parser reads
    the same text with the same tool; through both SDKs."""
    from mlx_lm.tool_parsers import qwen3_coder

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": TYPED_PARAMS}}
    ref = qwen3_coder.parse_tool_call(TYPED_SCRIPT[1], [tool])["arguments"]
    assert ref == {"city": "Paris", "zip": "75001", "days": 3}
    s = typed_server
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="m", messages=HI, tools=[tool], extra_body=NO_THINK)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == ref
    m = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60).messages.create(
        model="m",
        max_tokens=80,
        messages=HI,
        thinking={"type": "disabled"},
        tools=[{"name": "get_weather", "input_schema": TYPED_PARAMS}],
    )
    assert [(b.type, b.input) for b in m.content] == [("tool_use", ref)]


# -- gpt-oss harmony -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_server():
    from chat_templates import llama_cpp_template

    d = make_scripted_model(
        "scripted-harmony", HARMONY_SCRIPT, template=llama_cpp_template("openai-gpt-oss-120b"), trigger=HARMONY_TRIGGER
    )
    with Server(d) as s:
        yield s


def test_harmony_openai(harmony_server):
    s = harmony_server
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="m", messages=HI, tools=[WEATHER_TOOL])
    msg = r.choices[0].message
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert msg.model_extra["reasoning_content"] == HARMONY_REASONING and not msg.content
    assert r.choices[0].finish_reason == "tool_calls"
    parts = list(c.chat.completions.create(model="m", messages=HI, tools=[WEATHER_TOOL], stream=True))
    deltas = [p.choices[0].delta for p in parts if p.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == HARMONY_REASONING
    assert not any(d.content for d in deltas)
    # no tools offered: the call is text as written (the analysis channel is still reasoning)
    plain = c.chat.completions.create(model="m", messages=HI).choices[0].message
    assert plain.content == "".join(HARMONY_SCRIPT[3:5]) and plain.model_extra["reasoning_content"] == HARMONY_REASONING


def test_harmony_responses(harmony_server):
    c = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_TOOL["function"]["parameters"],
    }  # the gpt-oss template needs a description
    r = c.responses.create(model="m", input="hi", tools=[tool])
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert any(o.type == "reasoning" for o in r.output)


def test_harmony_anthropic(harmony_server):
    cl = anthropic.Anthropic(base_url=harmony_server.url, api_key="x", max_retries=0, timeout=60)
    m = cl.messages.create(model="m", max_tokens=80, messages=HI, tools=[TOOL])
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == HARMONY_REASONING
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"}) and m.stop_reason == "tool_use"
    with cl.messages.stream(model="m", max_tokens=80, messages=HI, tools=[TOOL]) as st:
        final = st.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        ("thinking", None),
        ("tool_use", {"city": "Paris"}),
    ]
