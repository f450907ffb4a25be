"""Each tool-call format the server parses, end to end: a scripted model (tests/scriptedmodel.py)
writes the same call in the Hermes, Llama 3, Mistral, Gemma or Gemma 4 format, and both SDKs get it back as a
structured call; without tools, the same output is plain content, unchanged."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from scriptedmodel import TOOL_SCRIPTS, WEATHER_TOOL, make_scripted_model
from server_util import Server

HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {"name": "get_weather", "description": "Current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


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
    parts = list(c.chat.completions.create(model=name, messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK,
                                           stream=True))
    calls = [t for p in parts if p.choices for t in (p.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert not any(p.choices[0].delta.content for p in parts if p.choices)
    plain = c.chat.completions.create(model=name, messages=HI, extra_body=NO_THINK)
    assert plain.choices[0].message.content == "".join(TOOL_SCRIPTS[fmt])  # no tools offered: text as written


def test_anthropic_tool_use(fmt_server):
    fmt, name, s = fmt_server
    m = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60).messages.create(
        model=name, max_tokens=50, messages=HI, tools=[TOOL], thinking={"type": "disabled"})
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})], fmt
    assert m.stop_reason == "tool_use"
