"""The OpenAI surface of a real `python -m mlxrs serve` process, driven by the official `openai` SDK.

Reasoning and tool calls come from a real model through the real engine: tests/scriptedmodel.py
builds a tiny model whose weights make it say a scripted answer (see its docstring), chosen by how
the chat prompt ends (thinking on → a <think> block and an answer; thinking off → a Qwen-style
<tool_call>) or by logit_bias. Plain generation (completions, seeds, logprobs) uses a random tiny
model."""

from __future__ import annotations

import json

import openai
import pytest

import mlxrs
from scriptedmodel import ANSWER_SCRIPT, ANSWER_TEXT, THINK_ANSWER, THINK_TEXT, WEATHER_TOOL, token_id
from server_util import openai_client

HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def scripted(scripted_server):
    return scripted_server


@pytest.fixture(scope="module")
def plain(qwen3_server):
    return qwen3_server


client = openai_client


@pytest.fixture(scope="module")
def local(scripted_dir):
    with mlxrs.Session(scripted_dir) as s:
        yield s


def test_first_line_names_the_model(scripted, scripted_dir):
    assert scripted.stdout().splitlines()[0] == f"mlxrs serve: scripted-qwen3 ({scripted_dir.resolve()})"


def test_models_and_health(scripted):
    c = client(scripted)
    ids = [m.id for m in c.models.list()]
    assert ids == ["scripted-qwen3"]
    assert c.models.retrieve("scripted-qwen3").id == "scripted-qwen3"
    assert c.models.retrieve("nope").id == "scripted-qwen3"  # any name (404 only with --strict-model-names)
    status, body = scripted.get("/health")
    assert status == 200 and body["model"] == "scripted-qwen3"


def test_chat_reasoning_separated(scripted, local):
    r = client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI)
    ch = r.choices[0]
    assert ch.message.content == THINK_ANSWER
    assert ch.message.model_extra["reasoning_content"] == THINK_TEXT
    assert ch.finish_reason == "stop" and ch.message.tool_calls is None
    assert r.usage.prompt_tokens == len(local.encode_prompt(HI)) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.model == "scripted-qwen3" and r.object == "chat.completion"


def test_chat_stream_reasoning_then_content_and_usage(scripted):
    chunks = list(
        client(scripted).chat.completions.create(
            model="scripted-qwen3", messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    kinds, reasoning, content = [], "", ""
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            kinds.append("reasoning")
        if d.content:
            content += d.content
            kinds.append("content")
    assert reasoning == THINK_TEXT and content == THINK_ANSWER
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_stream_and_non_stream_agree(scripted):
    c = client(scripted)
    a = c.chat.completions.create(model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK)
    parts = list(
        c.chat.completions.create(
            model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK, stream=True
        )
    )
    calls = [tc for p in parts if p.choices for tc in (p.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in a.choices[0].message.tool_calls
    ]


def test_tool_call_parsed(scripted):
    r = client(scripted).chat.completions.create(
        model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], tool_choice="auto", extra_body=NO_THINK
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_tool_call_streamed(scripted):
    parts = list(
        client(scripted).chat.completions.create(
            model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK, stream=True
        )
    )
    deltas = [p.choices[0].delta for p in parts if p.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert not any(d.content for d in deltas)  # the markup is not leaked as text
    assert parts[-1].choices[0].finish_reason == "tool_calls"


def test_tool_markup_without_tools_is_content(scripted):
    r = client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI, extra_body=NO_THINK)
    assert r.choices[0].message.content.startswith("<tool_call>") and r.choices[0].message.tool_calls is None
    r = client(scripted).chat.completions.create(
        model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], tool_choice="none", extra_body=NO_THINK
    )
    assert r.choices[0].message.tool_calls is None and "get_weather" in r.choices[0].message.content


def test_tool_round_trip(scripted, local):
    """The assistant's call and the tool's result go back through the template: the prompt the
    server counted is the one the template renders for that conversation."""
    c = client(scripted)
    first = c.chat.completions.create(model="scripted-qwen3", messages=HI, tools=[WEATHER_TOOL], extra_body=NO_THINK)
    tc = first.choices[0].message.tool_calls[0]
    history = HI + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    r = c.chat.completions.create(
        model="scripted-qwen3",
        messages=history,
        tools=[WEATHER_TOOL],
        logit_bias={str(token_id(local_dir(local), ANSWER_SCRIPT[0])): 100},
    )
    assert r.choices[0].message.content == ANSWER_TEXT and r.choices[0].finish_reason == "stop"
    expected = local.apply_chat_template(
        [
            HI[0],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": tc.id,
                "name": "get_weather",
                "content": '{"temperature": 21, "sky": "sunny"}',
            },
        ],
        tools=[WEATHER_TOOL],
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in expected
    assert '<tool_response>\n{"temperature": 21' in expected
    assert r.usage.prompt_tokens == len(local._s.encode_rendered(expected))


def local_dir(local: mlxrs.Session):
    from pathlib import Path

    return Path(local.model_path)


def test_logit_bias_steers_the_model(scripted, scripted_dir):
    r = client(scripted).chat.completions.create(
        model="scripted-qwen3", messages=HI, logit_bias={str(token_id(scripted_dir, ANSWER_SCRIPT[0])): 100}
    )
    assert r.choices[0].message.content == ANSWER_TEXT
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_stop_string(scripted):
    r = client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI, stop=["How"])
    assert r.choices[0].message.content == "Hello! " and r.choices[0].finish_reason == "stop"


def test_max_tokens_length(scripted):
    for key in ("max_tokens", "max_completion_tokens"):
        r = client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI, **{key: 2})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
        assert r.choices[0].message.model_extra["reasoning_content"].startswith("The user")


def test_chat_logprobs(scripted):
    r = client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    # the usage counts the EOS token the engine sampled; logprobs cover the tokens of the text
    assert r.usage.completion_tokens == 5 and len(lp) == 4
    assert "".join(t.token for t in lp) == f"<think>\n{THINK_TEXT}\n</think>\n\n{THINK_ANSWER}"
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert bytes(t.bytes).decode() == t.token


def test_n_greater_than_one_is_rejected(scripted):
    with pytest.raises(openai.BadRequestError) as e:
        client(scripted).chat.completions.create(model="scripted-qwen3", messages=HI, n=2)
    assert e.value.status_code == 400 and "n > 1" in e.value.message


def test_any_model_name_is_answered(scripted):
    r = client(scripted).chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2, extra_body=NO_THINK)
    assert r.model == "scripted-qwen3"


def test_image_part_rejected(scripted):
    with pytest.raises(openai.BadRequestError) as e:
        client(scripted).chat.completions.create(
            model="scripted-qwen3",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    ],
                }
            ],
        )
    assert "messages[0].content[1]" in e.value.message and "text-only" in e.value.message


# -- plain generation on a random model --------------------------------------------------------------
def test_legacy_completions(plain, qwen3_dir):
    c = client(plain)
    r = c.completions.create(model="qwen3-float32", prompt="The quick brown fox", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    with mlxrs.Session(qwen3_dir) as s:
        expected = s.generate("The quick brown fox", max_tokens=7, temperature=0)
        assert r.choices[0].text == expected.text
        assert r.usage.prompt_tokens == expected.usage.prompt_tokens
    streamed = list(
        c.completions.create(
            model="qwen3-float32",
            prompt="The quick brown fox",
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in streamed if p.choices) == r.choices[0].text
    assert streamed[-1].usage.completion_tokens == 7
    echo = c.completions.create(model="qwen3-float32", prompt="The quick", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("The quick")
    lp = c.completions.create(model="qwen3-float32", prompt="The quick", max_tokens=4, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 4 and len(lp.choices[0].logprobs.top_logprobs[0]) <= 2
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    ids = c.completions.create(model="qwen3-float32", prompt=[5, 6, 7, 8], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_seeded_sampling_is_reproducible(plain):
    c = client(plain)
    kw = dict(
        model="qwen3-float32",
        messages=HI,
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"min_p": 0.01, "top_k": 50},
    )
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_usage_counts_served_tokens(plain):
    before = plain.stats()
    r = client(plain).chat.completions.create(model="qwen3-float32", messages=HI, max_tokens=3, temperature=0)
    after = plain.stats()
    assert after["requests"]["served"] == before["requests"]["served"] + 1
    assert after["tokens"]["completion"] == before["tokens"]["completion"] + r.usage.completion_tokens
    assert after["tokens"]["prompt"] == before["tokens"]["prompt"] + r.usage.prompt_tokens
    assert after["recent"]["generation_tokens_per_second"] > 0
    assert after["context_tokens"] == 4096 and after["memory_plan"]["schemaVersion"] == 1
