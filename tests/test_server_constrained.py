"""Constrained decoding over HTTP with the official SDKs against a random-weight model (garbage
unless constrained): OpenAI `chat.completions.parse` / `response_format`, Anthropic
`messages.parse(output_format=…)` / `output_config`, forced tool calls in both (`tool_choice`
required / named, any / tool) whose arguments validate against the tool's schema (`jsonschema`),
the `mlxrs` grammar extension, and 400s naming the field of a grammar that does not compile."""

from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from server_util import Server

M = "qwen3-float32"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
CLOCK = {
    "type": "object",
    "additionalProperties": False,
    "required": ["tz"],
    "properties": {"tz": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
}
OA_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
AN_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}, {"name": "get_time", "input_schema": CLOCK}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=30)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    vaccinated: bool


class Owner(pydantic.BaseModel):
    pets: list[Pet] = pydantic.Field(max_length=2)
    city: str | None = pydantic.Field(max_length=5)


class Light(pydantic.BaseModel):
    color: Literal["red", "green"]
    on: bool
    mode: Literal[1, 2, 3]


class Panel(pydantic.BaseModel):
    """For Anthropic's SDK, which moves bounds (lengths, minimum/maximum) into descriptions: a random
    model's unbounded strings and integers would not end; enums, booleans and nesting do."""

    main: Light
    backup: Light | None


@pytest.fixture(scope="module")
def server(qwen3_server):
    return qwen3_server


def oa(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def an(s: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)


def test_openai_parse_with_a_pydantic_model(server):
    for seed in range(4):
        r = oa(server).chat.completions.parse(
            model=M, messages=HI, response_format=Owner, temperature=1.0, seed=seed, max_tokens=160
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Owner)
        assert Owner.model_validate_json(msg.content) == msg.parsed


def test_openai_response_format_json_object_and_text(server):
    c = oa(server)
    r = c.chat.completions.create(model=M, messages=HI, response_format={"type": "json_object"}, max_tokens=64)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    plain = c.chat.completions.create(model=M, messages=HI, response_format={"type": "text"}, max_tokens=16)
    free = c.chat.completions.create(model=M, messages=HI, max_tokens=16)
    assert plain.choices[0].message.content == free.choices[0].message.content


def test_openai_streamed_json_schema(server):
    schema = Pet.model_json_schema()
    parts = list(
        oa(server).chat.completions.create(
            model=M,
            messages=HI,
            stream=True,
            max_tokens=96,
            temperature=1.0,
            seed=5,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
        )
    )
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    jsonschema.validate(json.loads(text), schema)


def test_anthropic_parse_with_a_pydantic_model(server):
    for seed in range(3):
        m = an(server).messages.parse(
            model=M,
            max_tokens=160,
            messages=HI,
            output_format=Panel,
            extra_body={"temperature": 1.0, "top_k": 50 + seed},
        )
        assert m.stop_reason == "end_turn"
        assert isinstance(m.parsed_output, Panel)
        assert Panel.model_validate_json(m.content[0].text) == m.parsed_output


def test_anthropic_output_config_schema(server):
    m = an(server).messages.create(
        model=M,
        max_tokens=96,
        messages=HI,
        extra_body={"temperature": 1.0, "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}},
    )
    jsonschema.validate(json.loads(m.content[0].text), WEATHER)


@pytest.mark.parametrize("choice", ["required", "get_time", "get_weather"])
def test_openai_forced_tool_call(server, choice):
    tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for seed in range(3):
        r = oa(server).chat.completions.create(
            model=M, messages=HI, tools=OA_TOOLS, tool_choice=tc, seed=seed, temperature=1.0, max_tokens=64
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert choice == "required" or call.function.name == choice
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_openai_auto_tool_choice_is_not_forced(server):
    r = oa(server).chat.completions.create(model=M, messages=HI, tools=OA_TOOLS, max_tokens=16)
    assert not r.choices[0].message.tool_calls  # the random model writes text


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "get_time"}]
)
def test_anthropic_forced_tool_use(server, choice):
    m = an(server).messages.create(
        model=M, max_tokens=64, messages=HI, tools=AN_TOOLS, tool_choice=choice, extra_body={"temperature": 1.0}
    )
    (b,) = m.content
    assert b.type == "tool_use" and m.stop_reason == "tool_use"
    assert choice["type"] == "any" or b.name == choice["name"]
    jsonschema.validate(b.input, SCHEMAS[b.name])


def test_grammar_extension_in_both_protocols(server):
    r = oa(server).chat.completions.create(
        model=M, messages=HI, max_tokens=32, temperature=1.0, extra_body={"mlxrs": {"regex": "[0-9]{2}:[0-9]{2}"}}
    )
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", r.choices[0].message.content)
    m = an(server).messages.create(
        model=M,
        max_tokens=32,
        messages=HI,
        extra_body={"temperature": 1.0, "mlxrs": {"grammar": 'start: "yes" | "no"'}},
    )
    assert m.content[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"mlxrs": {"grammar": "start: ???"}}, "mlxrs"),
        ("/v1/chat/completions", {"mlxrs": {"regex": "a", "grammar": 'start: "a"', "x": 1}}, "mlxrs.x"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "tools": OA_TOOLS, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/messages",
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "objectx"}}}},
            "output_config",
        ),
        ("/v1/messages", {"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(server, path, body, param):
    base = {"model": M, "messages": HI, "max_tokens": 8}
    status, r = server.post(path, {**base, **body})
    assert status == 400, r
    msg = r["error"]["message"]
    assert msg.startswith(param + ":"), msg
    if path.startswith("/v1/chat"):
        assert r["error"]["param"] == param
