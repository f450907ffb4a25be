"""Units of the server that need no server: the reasoning/tool-call parser (every supported format,
fed whole and piece by piece), request-side conversions, and the memory planner (`_native.plan`)."""

from __future__ import annotations

import json

import pytest

from mlxrs.server.events import Content, OutputParser, Reasoning, ToolCall, parse_all, think_markers_for

TOOLS = ["get_weather", "search"]
CALL = ("get_weather", {"city": "Paris"})


def run(text: str, step: int, **kw):
    p = OutputParser(**kw)
    out = []
    for i in range(0, len(text), step):
        out += p.feed(text[i : i + step])
    out += p.finish()
    merged: list = []
    for e in out:  # the same kind of adjacent pieces, joined (streaming splits them arbitrarily)
        if merged and not isinstance(e, ToolCall) and type(merged[-1]) is type(e):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return [
        ("call", e.name, json.loads(e.arguments)) if isinstance(e, ToolCall) else (type(e).__name__.lower(), e.text)
        for e in merged
    ]


def check(text: str, expected: list, **kw) -> None:
    for step in (1, 2, 3, 7, 10_000):
        assert run(text, step, **kw) == expected, f"step {step}"


def call(name: str, args: dict) -> tuple:
    return ("call", name, args)


# -- reasoning -------------------------------------------------------------------------------------
def test_think_block_is_reasoning():
    check("<think>\nLet me think.\n</think>\n\nHello!", [("reasoning", "Let me think."), ("content", "Hello!")])


def test_reasoning_opened_by_the_prompt():
    check(
        "Still thinking\n</think>\n\nanswer",
        [("reasoning", "Still thinking"), ("content", "answer")],
        in_reasoning=True,
    )


def test_unterminated_reasoning_stays_reasoning():
    check("<think>cut off by max_tokens", [("reasoning", "cut off by max_tokens")])


def test_think_only_at_the_start():
    check("Say <think> literally", [("content", "Say <think> literally")])


def test_mistral_think_markers():
    assert think_markers_for("{{ '[THINK]' }}") == ("[THINK]", "[/THINK]")
    assert think_markers_for("{{ '<think>' }}") == ("<think>", "</think>")
    check("[THINK]hmm[/THINK]ok", [("reasoning", "hmm"), ("content", "ok")], think=("[THINK]", "[/THINK]"))


def test_no_reasoning_markers_is_plain_text():
    check("Hello there", [("content", "Hello there")])
    check("", [])


# -- Hermes / Qwen ---------------------------------------------------------------------------------
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_call():
    check(HERMES, [call(*CALL)], tools=TOOLS)


def test_hermes_two_calls_with_text_before():
    two = (
        "Let me check.\n"
        + HERMES
        + "\n"
        + '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
    )
    check(two, [("content", "Let me check.\n"), call(*CALL), call("search", {"q": "x"})], tools=TOOLS)


def test_hermes_after_reasoning():
    check("<think>need weather</think>\n\n" + HERMES, [("reasoning", "need weather"), call(*CALL)], tools=TOOLS)


def test_hermes_invalid_json_stays_content():
    text = "Sure. <tool_call>{not json}</tool_call> done"
    check(text, [("content", text)], tools=TOOLS)


def test_hermes_unterminated_but_complete_json_is_a_call():
    check('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [call(*CALL)], tools=TOOLS)


def test_hermes_truncated_stays_content():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    check(text, [("content", text)], tools=TOOLS)


def test_tool_markup_without_tools_is_content():
    check(HERMES, [("content", HERMES)])


def test_qwen3_coder_xml_call():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    check(text, [call(*CALL)], tools=TOOLS)


# -- Llama 3 ---------------------------------------------------------------------------------------
def test_llama_json_call():
    check('{"name": "get_weather", "parameters": {"city": "Paris"}}', [call(*CALL)], tools=TOOLS)


def test_llama_python_tag_and_several_calls():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "parameters": {}}'
    )
    check(text, [call(*CALL), call("search", {})], tools=TOOLS)


def test_llama_json_list():
    check('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', [call(*CALL)], tools=TOOLS)


def test_json_that_is_not_a_call_is_content():
    check('{"answer": 42}', [("content", '{"answer": 42}')], tools=TOOLS)
    check(
        '{"name": "unknown_tool", "parameters": {}}',
        [("content", '{"name": "unknown_tool", "parameters": {}}')],
        tools=TOOLS,
    )
    check("[1, 2, 3] is a list", [("content", "[1, 2, 3] is a list")], tools=TOOLS)


def test_llama_json_only_at_the_start():
    text = 'Here: {"name": "get_weather", "parameters": {"city": "Paris"}}'
    check(text, [("content", text)], tools=TOOLS)


# -- Mistral ---------------------------------------------------------------------------------------
def test_mistral_v3_list():
    check(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "search", "arguments": {}}]',
        [call(*CALL), call("search", {})],
        tools=TOOLS,
    )


def test_mistral_v11_name_args():
    check(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{}',
        [call(*CALL), call("search", {})],
        tools=TOOLS,
    )
    check('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', [call(*CALL)], tools=TOOLS)


def test_mistral_garbage_stays_content():
    check("[TOOL_CALLS] not a call", [("content", "[TOOL_CALLS] not a call")], tools=TOOLS)
    check('[TOOL_CALLS][{"name": 5}]', [("content", '[TOOL_CALLS][{"name": 5}]')], tools=TOOLS)


# -- Gemma -----------------------------------------------------------------------------------------
def test_gemma_tool_code():
    check(
        'I will look it up.\n```tool_code\nget_weather(city="Paris")\n```',
        [("content", "I will look it up.\n"), call(*CALL)],
        tools=TOOLS,
    )


def test_gemma_tool_code_that_is_not_a_call_stays_content():
    for body in ("import os", "get_weather('Paris')", "get_weather(city=open('x'))"):
        text = f"```tool_code\n{body}\n```"
        check(text, [("content", text)], tools=TOOLS)


def test_gemma_bare_json():
    check('{"name": "get_weather", "parameters": {"city": "Paris"}}\n', [call(*CALL)], tools=TOOLS)


def test_call_ids_are_unique():
    evs = parse_all(HERMES + HERMES, tools=TOOLS)
    ids = [e.id for e in evs if isinstance(e, ToolCall)]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_event_types():
    evs = parse_all("<think>a</think>b", tools=None)
    assert [type(e) for e in evs] == [Reasoning, Content]


# -- the planner -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir():
    from tinymodels import make_model

    return make_model("qwen3-float32", "qwen3")


def plan(d, *a, **kw):
    from mlxrs import _native

    return json.loads(_native.plan(str(d), *a, **kw))


def test_plan_schema(model_dir):
    p = plan(model_dir, 1000)
    assert list(p) == [
        "schemaVersion",
        "strategy",
        "fits",
        "contextTokens",
        "maxSafeContext",
        "weightsBytes",
        "kvBytes",
        "transientBytes",
        "reserveBytes",
        "totalBytes",
        "usableBytes",
        "predictedDecodeTps",
        "allocatorLimitBytes",
    ]
    assert p["schemaVersion"] == 1 and p["strategy"] == "generic-kv" and p["fits"] is True
    assert p["contextTokens"] == 1000 and p["maxSafeContext"] == 4096  # the model's own limit
    assert p["weightsBytes"] == sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) - _headers(model_dir)
    # 2 layers × 2 KV heads × 64 × (K, V) × 4 bytes, in growth steps of 256 tokens
    assert p["kvBytes"] == 2 * 2 * 64 * 2 * 4 * 1024
    assert p["totalBytes"] == p["weightsBytes"] + p["kvBytes"] + p["transientBytes"] + p["reserveBytes"]
    assert p["predictedDecodeTps"] is None


def _headers(d) -> int:
    n = 0
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n += 8 + int.from_bytes(fh.read(8), "little")
    return n


def test_plan_kv_quant_and_budget(model_dir):
    full = plan(model_dir, 1024)
    q8 = plan(model_dir, 1024, 8)
    q4 = plan(model_dir, 1024, 4)
    # bits/8 per element plus a float32 scale and bias per group of 64
    assert q8["kvBytes"] == int(full["kvBytes"] / 4 * (1 + 8 / 64))
    assert q4["kvBytes"] == int(full["kvBytes"] / 4 * (0.5 + 8 / 64))
    b = plan(model_dir, 64, None, None)["totalBytes"]
    p = plan(model_dir, None, None, str(b))
    assert p["usableBytes"] == b and p["maxSafeContext"] == 64 and p["fits"] is False
    assert plan(model_dir, None, None, "1000")["maxSafeContext"] == 0
    half = plan(model_dir, None, None, "0.5", 64, 2048, 10**10, False)
    assert half["usableBytes"] == 5 * 10**9
    default = plan(model_dir, None, None, None, 64, 2048, 10**10, False)
    assert default["usableBytes"] == 7_500_000_000


def test_plan_sliding_window_layers_are_capped():
    from tinymodels import make_model

    d = make_model("gemma3_text-float32", "gemma3_text")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["sliding_window"] == 16 and cfg["sliding_window_pattern"] == 2
    p = plan(d, 1024)
    per = cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 4  # one layer, one token, float32
    assert p["kvBytes"] == per * (1024 + 16)  # one global layer at 1024, one sliding layer at its window


def test_plan_rejects_bad_budgets(model_dir):
    from mlxrs.errors import InvalidArgumentError

    for bad in ("abc", "-1", "0", "1.5", "12X"):
        with pytest.raises(InvalidArgumentError, match="memory budget"):
            plan(model_dir, None, None, bad)
    with pytest.raises(InvalidArgumentError, match="kv_bits"):
        plan(model_dir, None, 5)


PEAK_SCRIPT = """
import json, random, sys
import mlxrs
rng = random.Random(0)
ids = [rng.randrange(5, 500) for _ in range(int(sys.argv[2]))]
with mlxrs.Session(sys.argv[1]) as s:
    print(s.generate(ids, max_tokens=2, temperature=0).timings.peak_memory)
"""


@pytest.mark.parametrize("n", [1000, 2049])
def test_plan_against_measured_peak(model_dir, n):
    """The estimate bounds MLX's measured peak from above, and not by much (CPU). Measured in a fresh
    process: MLX's peak is process-wide, and whatever other tests' sessions still hold would count."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(model_dir), str(n)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1])
    p = plan(model_dir, n + 2, None, None, 64, 2048, 10**12, False)
    est = p["weightsBytes"] + p["kvBytes"] + p["transientBytes"]
    assert peak <= est <= peak * 1.3, (n, peak, est)


# -- Gemma 4 ---------------------------------------------------------------------------------------
GEMMA4_THINK = ("<|channel>thought", "<channel|>")
GEMMA4_BODIES = [
    'call:get_weather{city:<|"|>Paris<|"|>}',
    'call:search{query:<|"|>a {braced}, "quoted" text<|"|>,limit:5,exact:false,tags:[<|"|>x<|"|>,2.5]}',
    'call:get_weather{city:<|"|>Paris<|"|>,opts:{units:<|"|>metric<|"|>,days:[1,2]}}',
    "call:search{}",
]


@pytest.mark.parametrize("body", GEMMA4_BODIES)
def test_gemma4_tool_call_matches_mlx_lm(body):
    """mlx-lm 0.32.2's gemma4 tool parser is the oracle for the arguments; whole and streamed."""
    from mlx_lm.tool_parsers import gemma4

    ref = gemma4.parse_tool_call(body)
    text = f"Checking.{gemma4.tool_call_start}{body}{gemma4.tool_call_end}"
    check(text, [("content", "Checking."), call(ref["name"], ref["arguments"])], tools=TOOLS)


def test_gemma4_two_calls_then_the_response_marker():
    from mlx_lm.tool_parsers import gemma4

    a, b = GEMMA4_BODIES[0], GEMMA4_BODIES[1]
    ra, rb = gemma4.parse_tool_call(a), gemma4.parse_tool_call(b)
    text = f"<|tool_call>{a}<tool_call|><|tool_call>{b}<tool_call|><|tool_response>"
    check(text, [call(ra["name"], ra["arguments"]), call(rb["name"], rb["arguments"])], tools=TOOLS)


def test_gemma4_malformed_call_stays_content():
    for body in ('call:get_weather{city:<|"|>Paris}', "get_weather(city='Paris')", "call:x{a:1} trailing"):
        text = f"<|tool_call>{body}<tool_call|>"
        check(text, [("content", text)], tools=TOOLS)
    text = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    check(text, [("content", text)])  # no tools offered: text as written


def test_gemma4_thinking_channel():
    check(
        "<|channel>thought\nFirst, the weather.\n<channel|>It is sunny.",
        [("reasoning", "First, the weather."), ("content", "It is sunny.")],
        think=GEMMA4_THINK,
    )
    check(
        '<|channel>thought\nhmm\n<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        [("reasoning", "hmm"), call(*CALL)],
        think=GEMMA4_THINK,
        tools=TOOLS,
    )


def test_gemma4_markers_come_from_its_chat_template():
    from chat_templates import gemma4_template

    assert think_markers_for(gemma4_template()) == GEMMA4_THINK
