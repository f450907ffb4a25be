"""Clients work unmodified (issue #14): their own default model names, no max_tokens, tool loops
on chat templates without tool support (the real Gemma 3 270M), --chat-template; driven by the
official `openai` and `anthropic` SDKs against a real `python -m mlxrs serve` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

import mlxrs
from mlxrs.errors import MlxrsError
from mlxrs.server import adapt
from mlxrs.server.events import Content, OutputParser, ToolCall, parse_all
from server_util import Server
from tinymodels import make_model

# the SDKs warn that claude-sonnet-4-5 is deprecated: a client default all the same
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HI = [{"role": "user", "content": "hi"}]
TINY = "qwen3-float32"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": WEATHER["function"]["parameters"],
}


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def anth(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_dir():
    return make_model(TINY, "qwen3")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    with Server(tiny_dir, "--alias", "my-alias", "--alias", "other-alias", "--max-tokens", "5") as s:
        yield s


# -- model names ---------------------------------------------------------------------------------
def test_client_default_model_names_are_answered(tiny):
    c = oai(tiny)
    r = c.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=2)
    assert r.model == TINY and r.usage.completion_tokens >= 1
    r = c.completions.create(model="gpt-3.5-turbo-instruct", prompt="hello", max_tokens=2)
    assert r.model == TINY
    m = anth(tiny).messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HI)
    assert m.model == TINY
    n = anth(tiny).messages.count_tokens(model="claude-sonnet-4-5", messages=HI)
    assert n.input_tokens > 0


def test_aliases_are_listed(tiny):
    c = oai(tiny)
    assert [m.id for m in c.models.list()] == [TINY, "my-alias", "other-alias"]
    assert c.models.retrieve("my-alias").id == "my-alias"
    assert c.models.retrieve("gpt-4o-mini").id == TINY
    assert [m.id for m in anth(tiny).models.list()] == [TINY, "my-alias", "other-alias"]


CUSTOM_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def strict(tiny_dir, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    tpl.write_text(CUSTOM_TEMPLATE)
    with Server(tiny_dir, "--strict-model-names", "--alias", "my-alias", "--chat-template", str(tpl)) as s:
        yield s


def test_strict_model_names_answer_404(strict):
    with pytest.raises(openai.NotFoundError) as e:
        oai(strict).chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and TINY in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        anth(strict).messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=HI)
    assert oai(strict).chat.completions.create(model="my-alias", messages=HI, max_tokens=1).model == TINY
    assert oai(strict).chat.completions.create(model=TINY, messages=HI, max_tokens=1).model == TINY


def test_chat_template_flag_replaces_the_models_template(strict, tiny, tiny_dir):
    text = "the quick brown fox jumps over the lazy dog"
    with mlxrs.Session(tiny_dir) as s:
        plain = len(s.tokenize(text, add_special_tokens=False))
        own = len(s.encode_prompt([{"role": "user", "content": text}]))
    assert own > plain  # the model's template adds role markers
    r = oai(strict).chat.completions.create(model=TINY, messages=[{"role": "user", "content": text}], max_tokens=1)
    assert r.usage.prompt_tokens == plain
    r = oai(tiny).chat.completions.create(model=TINY, messages=[{"role": "user", "content": text}], max_tokens=1)
    assert r.usage.prompt_tokens == own


def test_session_chat_template_source_or_file(tiny_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("<<{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}>>")
    for t in (f, str(f), f.read_text()):
        with mlxrs.Session(tiny_dir, chat_template=t) as s:
            assert s.apply_chat_template(HI) == "<<user:hi;>>"
    with pytest.raises(ValueError, match="chat_template"):
        mlxrs.Session(tiny_dir, chat_template=str(tmp_path / "missing.jinja"))


# -- length ----------------------------------------------------------------------------------------
def test_server_max_tokens_default(tiny):
    c = oai(tiny)
    r = c.chat.completions.create(model=TINY, messages=HI, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = c.chat.completions.create(model=TINY, messages=HI, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    # streamed: the same default
    chunks = list(
        c.chat.completions.create(
            model=TINY, messages=HI, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_max_tokens_flag_must_be_positive(tiny_dir):
    p = subprocess.run(
        [sys.executable, "-m", "mlxrs", "serve", str(tiny_dir), "--max-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--max-tokens" in p.stderr


# -- template adaptation ---------------------------------------------------------------------------
def test_generic_tool_format_is_parsed():
    [c] = parse_all('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', tools=["get_weather"])
    assert isinstance(c, ToolCall) and c.name == "get_weather" and c.arguments == '{"city": "Paris"}'
    calls = parse_all(
        '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]}', tools=["a", "b"]
    )
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
    # a name that is not offered stays text; without tools, JSON is text
    text = '{"tool_call": {"name": "other", "arguments": {}}}'
    assert parse_all(text, tools=["a"]) == [Content(text)]
    assert parse_all(text) == [Content(text)]
    # in a ```json fence at the start (what small models often write), also fed piece by piece
    fenced = '```json\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}\n```'
    for feed in ([fenced], list(fenced)):
        p = OutputParser(tools=["get_weather"])
        events = [e for piece in feed for e in p.feed(piece)] + p.finish()
        assert [(e.name, e.arguments) for e in events] == [("get_weather", '{"city": "Paris"}')]
    other = '```json\n{"a": 1}\n```\nThat is the object.'
    assert parse_all(other, tools=["get_weather"]) == [Content(other)]


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf, monkeypatch_module_home):
    with mlxrs.Session(gemma_gguf) as s:  # the cached import (tests/.models/mlxrs-home)
        return Path(s.model_path)


@pytest.fixture(scope="module")
def monkeypatch_module_home():
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXRS_HOME", str(Path(__file__).resolve().parent / ".models" / "mlxrs-home"))
    yield
    mp.undo()


def test_gemma_template_is_adapted(gemma_dir):
    with mlxrs.Session(gemma_dir) as s:
        caps = adapt.probe(lambda m, t: s.apply_chat_template(m, tools=t))
        assert not caps.tools and not caps.tool_role and not caps.multi_system and not caps.system_only
        msgs = [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "DEVELOPER NOTE"},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny, 21 C"},
        ]
        with pytest.raises(MlxrsError):
            s.apply_chat_template(msgs, tools=[WEATHER])  # as is, the template refuses it
        m, t = adapt.adapt(caps, msgs, [WEATHER])
        out = s.apply_chat_template(m, tools=t)
        for part in (
            "Be brief.",
            "DEVELOPER NOTE",
            '"name": "get_weather"',
            "The current weather in a city.",
            '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
            "[tool result for get_weather, c1]\nsunny, 21 C",
        ):
            assert part in out, part
        assert out.endswith("<start_of_turn>model\n")
        m, t = adapt.adapt(caps, [{"role": "system", "content": "SYSTEM ONLY TEXT"}], None)
        assert "SYSTEM ONLY TEXT" in s.apply_chat_template(m, tools=t)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    with Server(gemma_dir) as s:
        yield s


def _prompt_tokens(c: openai.OpenAI, messages, **kw) -> int:
    r = c.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=1, **kw)
    return r.usage.prompt_tokens


def test_gemma_tool_loop_openai(gemma):
    c = oai(gemma)
    assert _prompt_tokens(c, HI, tools=[WEATHER]) > _prompt_tokens(c, HI)  # tools are rendered
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def loop(result: str, extra: list) -> list:
        return [
            {"role": "system", "content": "Be brief."},
            *extra,
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]

    base = _prompt_tokens(c, loop("sunny", []), tools=[WEATHER])
    assert _prompt_tokens(c, loop("sunny and warm, 21 degrees, light wind", []), tools=[WEATHER]) > base
    dev = [{"role": "developer", "content": "Answer in French, with the temperature."}]
    assert _prompt_tokens(c, loop("sunny", dev), tools=[WEATHER]) > base
    second = [{"role": "system", "content": "A second system message with more words."}]
    assert _prompt_tokens(c, loop("sunny", second), tools=[WEATHER]) > base
    # a system-only conversation keeps its text
    assert _prompt_tokens(
        c, [{"role": "system", "content": "You are a pirate. Say arr, matey, and more."}]
    ) > _prompt_tokens(c, [{"role": "system", "content": "Hi"}])
    r = c.chat.completions.create(model="gpt-4o-mini", messages=loop("sunny", dev), tools=[WEATHER], max_tokens=4)
    assert r.model == gemma_model_id(gemma)


def gemma_model_id(server: Server) -> str:
    return oai(server).models.list().data[0].id


def test_gemma_tool_loop_anthropic(gemma):
    c = anth(gemma)

    def msgs(result: str) -> list:
        return [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": result},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ]

    def count(**kw) -> int:
        return c.messages.count_tokens(model="claude-sonnet-4-5", **kw).input_tokens

    assert count(messages=HI, tools=[WEATHER_ANTHROPIC]) > count(messages=HI)
    base = count(messages=msgs("sunny"), tools=[WEATHER_ANTHROPIC], system="Be brief.")
    assert (
        count(messages=msgs("sunny and warm, 21 degrees, light wind"), tools=[WEATHER_ANTHROPIC], system="Be brief.")
        > base
    )
    m = c.messages.create(
        model="claude-sonnet-4-5", max_tokens=4, messages=msgs("sunny"), tools=[WEATHER_ANTHROPIC], system="Be brief."
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == base
    assert m.model == gemma_model_id(gemma)


def test_probe_leaves_capable_templates_alone(tiny_dir):
    """Templates with tool support (tests/chat_templates.py) are passed requests as they are; Gemma's
    (Hugging Face's, like the embedded one) has every adaptation."""
    from chat_templates import TEMPLATES

    for name, source in TEMPLATES.items():
        with mlxrs.Session(tiny_dir, chat_template=source) as s:
            caps = adapt.probe(lambda m, t: s.apply_chat_template(m, tools=t))
        want = (
            ["multi_system", "system_only", "tool_role", "tool_calls", "tools", "alternation"]
            if name == "gemma"
            else []
        )
        assert caps.adapted() == want, name
    plain = adapt.Caps()
    msgs = [
        {"role": "system", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "system", "content": "c"},
        {"role": "tool", "tool_call_id": "x", "content": "d"},
    ]
    assert adapt.adapt(plain, msgs, [WEATHER]) == (msgs, [WEATHER])
