"""Tool calls and reasoning in each family's own format, from its REAL chat template (llama.cpp's
`models/templates/*.jinja`, tests/llama_templates.py): transformers renders a conversation whose last
assistant turn holds reasoning and tool calls; the text the template wrote for that turn is what the
model would have generated, and mlxrs's output parser (whole and streamed one character at a time)
must give back the same reasoning, names and arguments (the round trip). Where mlx-lm 0.32.2 has a
parser for the format (`mlx_lm/tool_parsers/`) it is a second oracle, and its template-based choice
of parser is checked against the format the template is listed under here."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

import llama_templates
from mlxrs.server.events import (
    Content,
    OutputParser,
    Reasoning,
    ToolCall,
    output_format_for,
    schemas_of,
    think_markers_for,
)

REASONING = "I need the weather first."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Web search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        },
    },
]
NAMES = [t["function"]["name"] for t in TOOLS]
CALLS = [
    (
        "get_weather",
        {
            "city": "Paris",
            "zip": "75001",
            "days": 3,
            "ratio": 0.5,
            "metric": True,
            "opts": {"units": "metric"},
            "tags": ["a", "b"],
        },
    ),
    ("search", {"query": 'Paris <weather> & "news"', "limit": 2}),
]

# template → (the end-of-turn marker generation stops at, mlx-lm's parser module or None)
FAMILIES = {
    "Qwen3.5-4B": ("<|im_end|>", "qwen3_coder"),
    "Qwen3-Coder": ("<|im_end|>", "qwen3_coder"),
    "GLM-4.6": ("<|user|>", "glm47"),
    "GLM-4.7-Flash": ("<|user|>", "glm47"),
    "openai-gpt-oss-120b": ("<|call|>", None),
    "deepseek-ai-DeepSeek-V3.1": ("<｜end▁of▁sentence｜>", None),
    "moonshotai-Kimi-K2": ("<|im_end|>", "kimi_k2"),  # Kimi-K2-Thinking's template uses list.append,
    # which transformers' sandbox refuses; its tool-call format is this one
    "MiniMax-M2": ("[e~[", "minimax_m2"),
}
# mlx-lm's markers around one parser input
MLXLM_BLOCKS = {
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm47": ("<tool_call>", "</tool_call>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
}


def _render(name: str, reasoning: str = REASONING, **kw) -> tuple[str, str]:
    """(the generation prompt, the assistant turn the template writes after it)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    t = llama_templates.template(name)
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls = [
        {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(CALLS)
    ]
    turn = {
        "role": "assistant",
        "content": "",
        "reasoning_content": reasoning,
        "thinking": reasoning,
        "tool_calls": calls,
    }
    (prompt,), _ = render_jinja_template(
        conversations=[user], tools=TOOLS, chat_template=t, add_generation_prompt=True, **kw
    )
    (full,), _ = render_jinja_template(conversations=[user + [turn]], tools=TOOLS, chat_template=t, **kw)
    assert full.startswith(prompt), name
    return prompt, full[len(prompt) :]


def _parser(name: str, prompt: str) -> OutputParser:
    """As the server makes it (ServerState.parser): markers and format from the chat template."""
    t = llama_templates.template(name)
    think = think_markers_for(t)
    return OutputParser(
        tools=NAMES,
        think=think,
        in_reasoning=prompt.rstrip().endswith(think[0]),
        schemas=schemas_of(TOOLS),
        harmony=output_format_for(t) == "harmony",
    )


def _events(p: OutputParser, text: str, step: int) -> list:
    out = []
    for i in range(0, len(text), step):
        out += p.feed(text[i : i + step])
    out += p.finish()
    merged: list = []
    for e in out:
        if merged and not isinstance(e, ToolCall) and type(merged[-1]) is type(e):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return [
        ("call", e.name, json.loads(e.arguments)) if isinstance(e, ToolCall) else (type(e).__name__.lower(), e.text)
        for e in merged
    ]


def _model_text(name: str, turn: str) -> str:
    """What the model generates: the turn up to the marker generation stops at."""
    end = FAMILIES[name][0]
    return turn[: turn.index(end)] if end in turn else turn


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_template_round_trip(name):
    prompt, turn = _render(name)
    text = _model_text(name, turn)
    # gpt-oss's template writes one call per assistant message (the first)
    calls = CALLS[:1] if name == "openai-gpt-oss-120b" else CALLS
    expected = ([("reasoning", REASONING)] if REASONING in turn else []) + [("call", n, a) for n, a in calls]
    texts = [text, turn[: turn.index("<|call|>") + len("<|call|>")]] if name == "openai-gpt-oss-120b" else [text]
    for t in texts:
        for step in (1, 2, 3, 7, len(t)):
            assert _events(_parser(name, prompt), t, step) == expected, (name, step)


def test_the_templates_render_reasoning_where_they_should():
    """The round trip checks reasoning for the templates that write it back; these do."""
    for name in ("Qwen3.5-4B", "GLM-4.6", "GLM-4.7-Flash", "openai-gpt-oss-120b", "MiniMax-M2"):
        assert REASONING in _render(name)[1], name


@pytest.mark.parametrize("name", sorted(n for n, (_, m) in FAMILIES.items() if m))
def test_real_template_calls_match_mlx_lm(name):
    """mlx-lm picks the same format from the template, and its parser reads the same calls from it."""
    import importlib

    from mlx_lm.tokenizer_utils import _infer_tool_parser

    module = FAMILIES[name][1]
    t = llama_templates.template(name)
    assert _infer_tool_parser(SimpleNamespace(chat_template=t, get_vocab=dict)) == module
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{module}")
    prompt, turn = _render(name)
    text = _model_text(name, turn)
    start, end = MLXLM_BLOCKS[module]
    ref = []
    for body in re.findall(re.escape(start) + "(.*?)" + re.escape(end), text, re.S):
        r = parser.parse_tool_call(body, TOOLS)
        ref += [(c["name"], c["arguments"]) for c in (r if isinstance(r, list) else [r])]
    ours = [(e[1], e[2]) for e in _events(_parser(name, prompt), text, 1) if e[0] == "call"]
    assert ours == ref and len(ref) == len(CALLS)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_template_cut_anywhere_never_crashes(name):
    """Generation cut at any point of the calls (max_tokens): no exception, and every call that
    comes out is one of the written calls, complete — a cut-off call stays content."""
    prompt, turn = _render(name)
    text = _model_text(name, turn)
    start = text.index(REASONING) + len(REASONING) if REASONING in text else 0
    for k in range(start, len(text) + 1):
        whole = _events(_parser(name, prompt), text[:k], k or 1)
        assert whole == _events(_parser(name, prompt), text[:k], 1), (name, k)
        calls = [(e[1], e[2]) for e in whole if e[0] == "call"]
        assert calls == CALLS[: len(calls)], (name, k, calls)


def test_kimi_k2_thinking_writes_the_same_format():
    """Kimi-K2-Thinking's template (which transformers' sandbox cannot render: list.append) writes its
    calls in the Kimi-K2 format that the round trip checks, as mlx-lm reads it."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    t = llama_templates.template("Kimi-K2-Thinking")
    assert _infer_tool_parser(SimpleNamespace(chat_template=t, get_vocab=dict)) == "kimi_k2"
    assert all(m in t for m in ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
    assert think_markers_for(t) == ("<think>", "</think>")


def test_harmony_is_chosen_by_the_gpt_oss_template_only():
    assert output_format_for(llama_templates.template("openai-gpt-oss-120b")) == "harmony"
    for name in FAMILIES:
        if name != "openai-gpt-oss-120b":
            assert output_format_for(llama_templates.template(name)) is None, name
            assert think_markers_for(llama_templates.template(name)) == ("<think>", "</think>"), name


# -- hand-written variants the templates do not produce ---------------------------------------------
def _parse(text: str, **kw) -> list:
    kw.setdefault("tools", NAMES)
    kw.setdefault("schemas", schemas_of(TOOLS))
    return [_events(OutputParser(**kw), text, s) for s in (1, 3, len(text) or 1)]


def _same(text: str, expected: list, **kw) -> None:
    for got in _parse(text, **kw):
        assert got == expected


def test_harmony_final_answer_and_constrain_header():
    """gpt-oss writes the recipient after the channel too (`commentary to=functions.f <|constrain|>json`),
    and answers in the final channel."""
    h = {"harmony": True}
    _same(
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
        [("reasoning", "Think."), ("content", "Sunny.")],
        **h,
    )
    _same(
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
        [("reasoning", "Think."), ("content", "Sunny.")],
        **h,
    )
    _same(
        '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
        [("call", "search", {"query": "x"})],
        **h,
    )
    _same("Plain text, no channels.", [("content", "Plain text, no channels.")], **h)


def test_harmony_malformed_call_stays_content():
    h = {"harmony": True}
    bad = '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": '
    _same(bad, [("content", bad)], **h)
    _same(bad + "<|call|>", [("content", bad + "<|call|>")], **h)
    head = "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
    _same(head, [("content", head)], **h)
    # no tools offered: a call is text as written
    call = '<|channel|>commentary to=functions.search json<|message|>{"query": "x"}<|call|>'
    _same(call, [("content", call[: -len("<|call|>")])], harmony=True, tools=None)
    # a built-in tool's recipient (not functions.*) is no call of an offered function
    builtin = '<|channel|>commentary to=browser.search json<|message|>{"query": "x"}'
    _same(builtin, [("content", builtin)], harmony=True)


def test_xml_formats_malformed_stay_content():
    for text in (
        "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n",  # cut off
        "<tool_call>\n<function=search>\njunk<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>",  # a key without a value
        "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x</arg_value>",  # GLM, cut off
        "<tool_call>Sure, I will search.</tool_call>",
        "<tool_call>hello</tool_call>",  # a bare word that names no offered tool
        '<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">x</parameter>\n</minimax:tool_call>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>[1]"
        "<|tool_call_end|><|tool_calls_section_end|>",
    ):
        _same(text, [("content", text)])


def test_deepseek_v3_fenced_form():
    text = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"query": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    _same(text, [("call", "search", {"query": "x"})])


def test_values_typed_by_schema():
    """A string parameter keeps text that looks like a number; without a schema, JSON-looking text
    is JSON. mlx-lm's qwen3_coder parser is the oracle where the schema types the value."""
    from mlx_lm.tool_parsers import qwen3_coder

    body = (
        "<function=get_weather>\n<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n4\n</parameter>\n"
        '<parameter=metric>\nfalse\n</parameter>\n<parameter=tags>\n["x"]\n</parameter>\n</function>'
    )
    ref = qwen3_coder.parse_tool_call(body, TOOLS)
    _same(f"<tool_call>\n{body}\n</tool_call>", [("call", ref["name"], ref["arguments"])])
    assert ref["arguments"]["zip"] == "75001" and ref["arguments"]["days"] == 4
    _same(
        f"<tool_call>\n{body}\n</tool_call>",
        [("call", "get_weather", {"zip": 75001, "days": 4, "metric": False, "tags": ["x"]})],
        schemas={},
    )


def test_typed_value_edges():
    from mlxrs.server.events import typed_value

    assert typed_value("3", {"type": "string"}) == "3"
    assert typed_value("3", {"type": "integer"}) == 3 and typed_value("3.0", {"type": "integer"}) == 3
    assert typed_value("3.5", {"type": "integer"}) == 3.5  # not an integer: JSON, as written
    assert typed_value("2.5", {"type": "number"}) == 2.5 and typed_value("7", {"type": "number"}) == 7
    assert typed_value("nan", {"type": "number"}) == "nan"  # no JSON number: text
    assert typed_value("TRUE", {"type": "boolean"}) is True and typed_value("no", {"type": "boolean"}) == "no"
    assert typed_value("null", {"type": ["integer", "null"]}) is None
    assert typed_value("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 5
    assert typed_value("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "x"
    assert typed_value("b", {"enum": ["a", "b"]}) == "b" and typed_value("2", {"enum": [1, 2]}) == 2
    assert typed_value("{'a': 1}", {"type": "object"}) == {"a": 1}  # a Python literal, as mlx-lm reads it
    assert typed_value("[1", {"type": "array"}) == "[1"
    assert typed_value('{"a": 1}', None) == {"a": 1} and typed_value("Paris", None) == "Paris"


def test_events_are_typed():
    evs = OutputParser(tools=NAMES, harmony=True)
    out = (
        evs.feed("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b") + evs.finish()
    )
    assert [type(e) for e in out] == [Reasoning, Content]


@pytest.mark.parametrize("kw", [{"thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-V3.1", "Qwen3.5-4B"])
def test_round_trip_with_thinking_switched(name, kw):
    """The prompt opens `<think>` (DeepSeek thinking on) or closes it empty (Qwen3.5 thinking off):
    the calls still come back, and no reasoning is invented."""
    prompt, turn = _render(name, "" if "enable_thinking" in kw else REASONING, **kw)
    text = _model_text(name, turn)
    got = _events(_parser(name, prompt), text, 1)
    assert [e for e in got if e[0] == "call"] == [("call", n, a) for n, a in CALLS]
    assert [e for e in got if e[0] != "call"] == ([("reasoning", REASONING)] if REASONING in text else [])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_template_mutated_never_crashes(name):
    """Random damage to the real text (characters dropped, doubled or swapped in): never an exception,
    streamed one character at a time equals whole, and every call has a JSON object of arguments."""
    import random

    prompt, turn = _render(name)
    text = _model_text(name, turn)
    rng = random.Random(name)
    for _ in range(150):
        t = list(text)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(t))
            op = rng.randrange(3)
            if op == 0:
                del t[i]
            elif op == 1:
                t.insert(i, t[i])
            else:
                t[i] = rng.choice('<>|{}"\n:=x')
        s = "".join(t)
        whole = _events(_parser(name, prompt), s, len(s) or 1)
        assert whole == _events(_parser(name, prompt), s, 1), (name, s)
        assert all(isinstance(e[2], dict) for e in whole if e[0] == "call"), (name, s)
