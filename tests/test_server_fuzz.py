"""Fuzzing both HTTP protocols with hypothesis: random and mutated JSON bodies for
/v1/chat/completions, /v1/completions and /v1/messages never get a 5xx, and every answer is
either a well-formed success or the protocol's error envelope.

Short by default (CI); run longer with MLXRS_FUZZ_EXAMPLES, e.g.
    MLXRS_FUZZ_EXAMPLES=5000 python -m pytest -q tests/test_server_fuzz.py
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_util import InProcess, sse_events

EXAMPLES = int(os.environ.get("MLXRS_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# raw JSON text Python's json.dumps would not write, swapped in for these placeholder strings
RAW = {
    "\x00nan": "NaN",
    "\x00inf": "-Infinity",
    "\x00big": "1" + "0" * 400,
    "\x00e999": "1e999",
    "\x00sur": '"\\udc00x"',
    "\x00deep": "[" * 80 + "]" * 80,
    "\x00huge": "123456789012345678901234567890",
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(sorted(RAW))
)
junk = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["type", "text", "name", "role", "content", "\x00sur"]), c, max_size=4
        )
    ),
    max_leaves=12,
)
small_int = st.integers(-3, 4)
text_ = st.text(max_size=20)


def maybe(s):
    """A valid-looking value or junk."""
    return st.one_of(s, junk)


oa_part = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "image_url", "refusal", "input_text"]))},
    optional={"text": maybe(text_), "refusal": maybe(text_)},
)
oa_call = st.fixed_dictionaries(
    {
        "id": maybe(text_),
        "type": st.just("function"),
        "function": maybe(
            st.fixed_dictionaries(
                {
                    "name": maybe(text_),
                    "arguments": maybe(
                        st.sampled_from(
                            [
                                '{"a": 1}',
                                '{"a": NaN}',
                                "not json",
                                '{"a": ' + "[" * 70 + "]" * 70 + "}",
                                "{}",
                                '"\\ud800"',
                            ]
                        )
                    ),
                }
            )
        ),
    }
)
oa_message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={
        "content": maybe(text_ | st.lists(oa_part, max_size=3)),
        "tool_calls": maybe(st.lists(oa_call, max_size=2)),
        "tool_call_id": maybe(text_),
        "name": maybe(text_),
    },
)
oa_tool = maybe(
    st.fixed_dictionaries(
        {
            "type": maybe(st.just("function")),
            "function": maybe(
                st.fixed_dictionaries(
                    {"name": maybe(text_)}, optional={"parameters": junk, "description": maybe(text_)}
                )
            ),
        }
    )
)
SAMPLING = {
    "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0, 1)),
    "top_k": maybe(small_int),
    "min_p": junk,
    "seed": maybe(st.integers(-(2**70), 2**70)),
    "stream": maybe(st.booleans()),
}
chat_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(oa_message, max_size=3))},
    optional={
        "model": maybe(st.just("qwen3-float32")),
        "max_tokens": maybe(small_int),
        "max_completion_tokens": small_int,
        **SAMPLING,
        "stop": maybe(text_ | st.lists(text_, max_size=3)),
        "n": junk,
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(small_int),
        "logit_bias": maybe(st.dictionaries(st.sampled_from(["1", "x", "-1"]), junk)),
        "presence_penalty": junk,
        "frequency_penalty": junk,
        "repetition_penalty": junk,
        "tools": maybe(st.lists(oa_tool, max_size=2)),
        "tool_choice": junk,
        "response_format": junk,
        "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
        "chat_template_kwargs": maybe(
            st.dictionaries(
                st.sampled_from(["enable_thinking", "add_generation_prompt", "tools", "x"]), junk, max_size=2
            )
        ),
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": maybe(text_ | st.lists(st.integers(-5, 200), max_size=5))},
    optional={
        "model": junk,
        "max_tokens": maybe(small_int),
        **SAMPLING,
        "echo": junk,
        "logprobs": maybe(small_int),
        "suffix": junk,
        "best_of": junk,
        "stop": junk,
        "logit_bias": junk,
    },
)
an_block = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document"]))},
    optional={
        "text": maybe(text_),
        "id": maybe(text_),
        "name": maybe(text_),
        "input": junk,
        "tool_use_id": maybe(text_),
        "content": junk,
        "source": junk,
        "is_error": junk,
    },
)
an_message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "assistant"]))},
    optional={"content": maybe(text_ | st.lists(an_block, max_size=3))},
)
an_tool = maybe(
    st.fixed_dictionaries({"name": maybe(text_)}, optional={"input_schema": junk, "description": junk, "type": junk})
)
messages_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(an_message, max_size=3))},
    optional={
        "model": maybe(st.just("qwen3-float32")),
        "max_tokens": maybe(small_int),
        **SAMPLING,
        "system": maybe(text_ | st.lists(an_block, max_size=2)),
        "stop_sequences": junk,
        "tools": maybe(st.lists(an_tool, max_size=2)),
        "tool_choice": junk,
        "thinking": junk,
        "metadata": junk,
    },
)


def encode(body) -> bytes:
    text = json.dumps(body, ensure_ascii=True)
    for k, v in RAW.items():
        text = text.replace(json.dumps(k), v)
    return text.encode()


@pytest.fixture(scope="module")
def app(qwen3_dir):
    """The server in this process with a short default reply (`--max-tokens 8`): a body without a
    usable max_tokens would otherwise generate up to the context's room, which takes most of the
    module's time and exercises nothing the fuzzing is for (the envelopes, the status codes)."""
    s = InProcess(qwen3_dir, default_max_tokens=8)
    yield s
    s.close()


def check(app, path: str, body) -> None:
    raw = encode(body) if not isinstance(body, bytes) else body
    status, headers, resp = app.request("POST", path, raw)
    assert status < 500, (status, resp, raw[:2000])
    anthropic = path == "/v1/messages"
    if status >= 400:
        assert headers["Content-Type"].startswith("application/json"), (status, resp)
        if anthropic:
            assert resp["type"] == "error" and set(resp["error"]) >= {"type", "message"}, resp
        else:
            assert set(resp) == {"error"} and set(resp["error"]) == {"message", "type", "param", "code"}, resp
        assert resp["error"]["message"], resp
        return
    if headers["Content-Type"].startswith("text/event-stream"):
        events = sse_events(resp)
        if anthropic:
            assert events[0][0] == "message_start" and events[-1][0] in ("message_stop", "error"), events
        else:
            assert events[-1] == (None, "[DONE]"), events
    elif anthropic:
        assert resp["type"] == "message" and resp["stop_reason"], resp
    else:
        assert resp["choices"][0]["finish_reason"], resp


@FUZZ
@given(chat_body)
def test_fuzz_chat_completions(app, body):
    check(app, "/v1/chat/completions", body)


@FUZZ
@given(completion_body)
def test_fuzz_completions(app, body):
    check(app, "/v1/completions", body)


@FUZZ
@given(messages_body)
def test_fuzz_messages(app, body):
    check(app, "/v1/messages", body)


@FUZZ
@given(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]), junk | st.binary(max_size=64))
def test_fuzz_any_body(app, path, body):
    check(app, path, body)
