"""Constrained decoding (llguidance) through Session: a random-weight model writes garbage unless
constrained, so every output here that parses and validates (with `jsonschema`, `re`, an independent
oracle) was made so by the mask. MLXRS_CONSTRAINED_SAMPLES sets how many samples each schema gets
(default 20: 200 in all)."""

from __future__ import annotations

import asyncio
import json
import os
import re

import jsonschema
import pytest

import mlxrs
from mlxrs.errors import InvalidArgumentError
from tinymodels import make_model

SAMPLES = int(os.environ.get("MLXRS_CONSTRAINED_SAMPLES", "20"))

_P = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}

SCHEMAS = {
    "nested": {
        "type": "object",
        "additionalProperties": False,
        "required": ["user"],
        "properties": {
            "user": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id", "name"],
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "name": {"type": "string", "minLength": 1, "maxLength": 8},
                },
            }
        },
    },
    "enum_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "bounded_numbers": {
        "type": "object",
        "additionalProperties": False,
        "required": ["x", "n"],
        "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},  # decimals: a random model never stops its digits
            "n": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
        },
    },
    "optional": {
        "type": "object",
        "additionalProperties": False,
        "required": ["a"],
        "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 5}, "c": {"type": "null"}},
    },
    "any_of": {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}, {"type": "null"}]
    },
    "const_enum": {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "level"],
        "properties": {"kind": {"const": "point"}, "level": {"enum": [1, 2, 3, "max"]}},
    },
    "object_array": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["k", "v"],
            "properties": {"k": {"type": "string", "maxLength": 3}, "v": {"type": "boolean"}},
        },
    },
    "refs": {
        "$defs": {"P": _P},
        "type": "object",
        "additionalProperties": False,
        "required": ["a", "b"],
        "properties": {
            "a": {"$ref": "#/$defs/P"},
            "b": {"type": "array", "items": {"$ref": "#/$defs/P"}, "maxItems": 2},
        },
    },
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "one_of": {
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["t", "n"],
                "properties": {"t": {"const": "a"}, "n": {"type": "integer", "minimum": 0, "maximum": 5}},
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["t", "s"],
                "properties": {"t": {"const": "b"}, "s": {"type": "string", "maxLength": 3}},
            },
        ]
    },
}

PROMPTS = ["hello", "the weather", "a b c", "list things", "x", "json please", "one two", "what"]


@pytest.fixture(scope="module")
def session():
    with mlxrs.Session(make_model("qwen3-float32", "qwen3")) as s:
        yield s


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_outputs_follow_the_schema(session, name):
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator.check_schema(schema)
    outs = session.generate_batch(_prompts(SAMPLES), json_schema=schema, temperature=1.0, max_tokens=96)
    for c in outs:
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_unconstrained_outputs_are_not_json(session):
    """The oracle can fail: without the mask the same model and prompts do not write JSON."""
    outs = session.generate_batch(_prompts(8), temperature=1.0, max_tokens=32, seed=0)
    parsed = 0
    for c in outs:
        try:
            json.loads(c.text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0, [c.text for c in outs]


def test_regex_and_lark(session):
    for c in session.generate_batch(_prompts(8), regex=r"[0-9]{3}-[a-z]{2}(!|\?)", temperature=1.0, max_tokens=32):
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}(!|\?)", c.text), c.text
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{1,6}/'
    for c in session.generate_batch(_prompts(8), grammar=lark, temperature=1.0, max_tokens=32):
        assert c.finish_reason == "stop" and re.fullmatch(r"(yes|no) because [a-z]{1,6}", c.text), c.text


def test_json_object_and_a_pydantic_model(session):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        label: str = pydantic.Field(max_length=4)
        x: int = pydantic.Field(ge=0, le=50)
        tags: list[bool] = pydantic.Field(max_length=2)

    c = session.generate("hi", json_schema=Point, temperature=1.0, max_tokens=64, seed=3)
    Point.model_validate_json(c.text)
    for c in session.generate_batch(_prompts(4), json_object=True, temperature=0.0, max_tokens=64):
        if c.finish_reason == "stop":  # any object: it may not end within the budget
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.text.startswith("{")


def test_every_entry_point_constrains(session):
    schema = SCHEMAS["const_enum"]
    one = session.generate("hi", json_schema=schema, max_tokens=40)
    streamed = list(session.stream("hi", json_schema=schema, max_tokens=40))
    assert "".join(ch.text for ch in streamed) == one.text and streamed[-1].finish_reason == "stop"

    async def run():
        return "".join([ch.text async for ch in session.astream("hi", json_schema=schema, max_tokens=40)])

    assert asyncio.run(run()) == one.text
    jsonschema.validate(json.loads(one.text), schema)


def test_constrained_rows_leave_the_others_alone(session):
    """A batch mixing constrained rows with greedy ones: the greedy rows' text is what they write alone."""
    alone = [session.generate(p, max_tokens=12).text for p in PROMPTS[:3]]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(8) as ex:
        free = [ex.submit(session.generate, p, max_tokens=12) for p in PROMPTS[:3]]
        tied = [
            ex.submit(session.generate, p, json_schema=SCHEMAS["nested"], temperature=1.0, max_tokens=64)
            for p in PROMPTS[3:7]
        ]
        assert [f.result().text for f in free] == alone
        for f in tied:
            jsonschema.validate(json.loads(f.result().text), SCHEMAS["nested"])


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"json_schema": {"type": "objectx"}}, "json_schema"),
        ({"regex": "([a-z"}, "regex"),
        ({"grammar": "start: ???"}, "grammar"),
    ],
)
def test_a_bad_grammar_is_refused_at_submission(session, kw, name):
    for call in (
        lambda: session.generate("hi", **kw),
        lambda: session.generate_batch(["hi"], **kw),
        lambda: session.stream("hi", **kw).__next__(),
    ):
        with pytest.raises(InvalidArgumentError, match=f"^{name}: "):
            call()


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"json_schema": {"type": "object"}, "regex": "a"}, InvalidArgumentError),
        ({"json_object": True, "grammar": 'start: "a"'}, InvalidArgumentError),
        ({"json_schema": "{}"}, TypeError),
        ({"regex": 3}, TypeError),
        ({"grammar": ""}, InvalidArgumentError),
        ({"json_object": "yes"}, TypeError),
    ],
)
def test_constraint_options_are_checked(session, kw, exc):
    with pytest.raises(exc):
        session.generate("hi", max_tokens=4, **kw)
