"""`python -m mlxrs chat`: the terminal client, driven through a pseudo-terminal (pexpect) against a
real `python -m mlxrs serve` process, its answers checked against the official `openai` SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
import pytest

from scriptedmodel import ANSWER_SCRIPT, THINK_ANSWER, WEATHER_TOOL, make_scripted_model
from server_util import Server, free_port
from test_server_vision import _png, data_url
from tinymodels import make_gemma3_vision, make_model

pexpect = pytest.importorskip("pexpect")


@pytest.fixture(scope="module")
def talker_dir():
    """A random model that talks for long at temperature 0 (~1158 tokens, then EOS)."""
    return make_model("llama-float32", "llama")


@pytest.fixture(scope="module")
def talker(talker_dir):
    with Server(talker_dir) as s:
        yield s


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlxrs", "chat", *args]


def spawn(*args: str, env: dict[str, str] | None = None) -> "pexpect.spawn":
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm", **(env or {})}
    cmd = chat_cmd(*args)
    # Ctrl-C reaches the child even when this test runs with SIGINT ignored (a background job of a
    # non-interactive shell), which the child would inherit
    return pexpect.spawn(
        cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=120, dimensions=(40, 200), preexec_fn=_default_sigint
    )


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# prompt_toolkit draws "> " with cursor moves; it turns bracketed paste on each time it waits for input
PROMPT = "\x1b[?2004h"


def say(child, line: str | None) -> None:
    """Type `line` (None: Ctrl-D) once the prompt is up: what is typed before prompt_toolkit reads
    meets the terminal's cooked mode (where a Ctrl-D is lost)."""
    child.expect_exact(PROMPT)
    if line is None:
        child.sendeof()
    else:
        child.sendline(line)


def wait_for(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_pipe_prints_exactly_the_api_answer(talker):
    question = "Tell me a story"
    want = client(talker).chat.completions.create(
        model="x", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=60
    )
    r = subprocess.run(
        chat_cmd("--port", str(talker.port), "--temperature", "0", "--max-tokens", "60"),
        input=(question + "\n").encode(),
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert want.choices[0].message.content
    assert r.stdout.decode() == want.choices[0].message.content + "\n"  # bytes: the text has \r in it
    assert b"attached to" in r.stderr


def test_pipe_starts_a_server_when_none_answers():
    """No server on --port: one is started in-process; the reasoning is left out of a piped answer."""
    model = make_scripted_model()
    r = subprocess.run(
        chat_cmd(str(model), "--port", str(free_port()), "--temperature", "0"),
        input="hi",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == THINK_ANSWER + "\n"
    assert "loading the model" in r.stderr


def test_pipe_respects_the_api_key(talker_dir):
    with Server(talker_dir, "--api-key", "sekrit") as s:
        ok = subprocess.run(
            chat_cmd("--port", str(s.port), "--api-key", "sekrit", "--max-tokens", "5"),
            input="hi",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
        bad = subprocess.run(
            chat_cmd("--port", str(s.port), "--api-key", "wrong", "--max-tokens", "5"),
            input="hi",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "incorrect API key" in bad.stderr and bad.stdout == ""


@pytest.fixture(scope="module")
def looper(looping_server):
    """Talks until max_tokens (~1000 tokens a second here): a stream to interrupt."""
    return looping_server


def test_terminal_stream_cancel_then_ask_again_and_save(looper, tmp_path):
    talker = looper
    base = talker.stats()["requests"]
    child = spawn("--port", str(talker.port), "--temperature", "0", "--max-tokens", "2000")
    try:
        child.expect("attached to")
        child.expect("chatting with")
        # a long answer streams: text appears while the server is still generating
        say(child, "hi")
        assert wait_for(lambda: talker.stats()["requests"]["active"] >= 1)
        child.expect("two three")  # streamed text before the end
        assert talker.stats()["requests"]["active"] >= 1, "the answer had finished: nothing to cancel"
        child.sendintr()  # Ctrl-C mid-answer
        child.expect(r"\[cancelled\]")
        assert wait_for(lambda: talker.stats()["requests"]["cancelled"] == base["cancelled"] + 1), talker.stats()
        assert talker.stats()["requests"]["active"] == 0
        # the program is still there: the next question is answered in full
        q2 = "What is two plus two?"
        say(child, q2)
        child.expect(
            r"\[(\d+) tokens, [\d.]+ tok/s · context (\d+)/(\d+) · prefix cache (\d+)/(\d+) prompt tokens", timeout=300
        )
        n_tokens, used, ceiling = (int(child.match.group(i)) for i in (1, 2, 3))
        assert ceiling == talker.stats()["context_tokens"]
        out = tmp_path / "conv.json"
        say(child, f"/save {out}")
        child.expect("saved 2 messages")
        say(child, "/stats")
        child.expect(r"(\d+) cancelled")
        assert int(child.match.group(1)) == base["cancelled"] + 1
        say(child, "/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    saved = json.loads(out.read_text())
    c = client(talker)
    want = c.chat.completions.create(
        model="x", messages=[{"role": "user", "content": q2}], temperature=0, max_tokens=2000
    )
    # the cancelled question was dropped; the second answer is the API's own
    assert saved["messages"] == [
        {"role": "user", "content": q2},
        {"role": "assistant", "content": want.choices[0].message.content},
    ]
    assert n_tokens == want.usage.completion_tokens and used == want.usage.total_tokens
    # what /save wrote is a request the OpenAI SDK sends back as is
    again = c.chat.completions.create(**saved, max_tokens=3, temperature=0)
    assert again.choices[0].message.role == "assistant"
    assert again.usage.prompt_tokens > want.usage.prompt_tokens


def test_terminal_load_system_reset_and_reasoning(tmp_path):
    """Reasoning shows (dimmed) before the answer; /load and /system shape the next request."""
    model = make_scripted_model()
    conv = tmp_path / "in.json"
    conv.write_text(
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "hi there"},
                ],
            }
        )
    )
    with Server(model) as s:
        child = spawn("--port", str(s.port), "--temperature", "0")
        try:
            say(child, f"/load {conv}")
            child.expect("loaded 2 messages")
            say(child, "/model")
            child.expect(f"{model.name} at {s.url}")
            say(child, "hi")
            child.expect(r"\(thinking\) ")
            child.expect("The user greets me")
            child.expect(THINK_ANSWER.replace("?", r"\?"))
            child.expect(r"\[\d+ tokens")
            out = tmp_path / "out.json"
            say(child, "/system short answers")
            child.expect("system prompt set")
            say(child, f"/save {out}")
            child.expect("saved 4 messages")
            say(child, "/reset")
            child.expect("conversation cleared")
            say(child, f"/save {tmp_path / 'empty.json'}")
            child.expect("saved 0 messages")
            say(child, None)
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
    msgs = json.loads(out.read_text())["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == "short answers" and msgs[4]["content"] == THINK_ANSWER
    assert json.loads((tmp_path / "empty.json").read_text())["messages"] == [
        {"role": "system", "content": "short answers"}
    ]


def test_terminal_folds_reasoning_away_and_shows_it_on_request():
    model = make_scripted_model()
    with Server(model) as s:
        want = client(s).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=0)
        reasoning = want.choices[0].message.model_extra["reasoning_content"]
        child = spawn("--port", str(s.port), "--temperature", "0", env={"NO_COLOR": "1"})
        try:
            say(child, "/reasoning")
            child.expect_exact("(no reasoning in the last answer)")
            say(child, "/reasoning off")
            child.expect_exact("reasoning folded away")
            say(child, "hi")
            child.expect_exact("(thinking…)\r\n" + want.choices[0].message.content + "\r\n[")
            assert reasoning and reasoning not in child.before
            say(child, "/reasoning")  # the folded reasoning, on request
            child.expect_exact(reasoning.replace("\n", "\r\n"))
            say(child, "/reasoning on")
            child.expect_exact("reasoning shown as it streams")
            say(child, "hi")
            child.expect_exact(f"(thinking) {reasoning}\r\n{want.choices[0].message.content}\r\n[")
            say(child, "/quit")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)


# -- multi-line input -------------------------------------------------------------------------------
@pytest.mark.parametrize("editor", ["prompt_toolkit", "input"])
def test_terminal_multiline_input(talker, tmp_path, editor):
    """Esc Enter (prompt_toolkit) and a trailing backslash (both editors) start a new line; the
    message sent is the lines joined, answered as the API answers it."""
    env = {}
    if editor == "input":  # prompt_toolkit cannot be imported: the plain input() fallback
        (tmp_path / "prompt_toolkit").mkdir()
        (tmp_path / "prompt_toolkit" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    child = spawn("--port", str(talker.port), "--temperature", "0", "--max-tokens", "16", env=env)
    out = tmp_path / "conv.json"
    try:
        child.expect("chatting with")
        if editor == "prompt_toolkit":
            child.expect_exact(PROMPT)
            child.send("first line")
            child.send("\x1b\r")  # Esc Enter (what Alt-Enter sends)
            want_text = "first line\nsecond line\nthird line"
        else:
            child.expect_exact("> ")
            child.send("first line\\\r")
            child.expect_exact(". ")
            want_text = "first line\nsecond line\nthird line"
        child.send("second line\\")
        child.send("\r")
        if editor == "input":
            child.expect_exact(". ")
        child.send("third line\r")
        child.expect(r"\[\d+ tokens", timeout=300)
        if editor == "prompt_toolkit":
            say(child, f"/save {out}")
        else:
            child.expect_exact("> ")
            child.sendline(f"/save {out}")
        child.expect("saved 2 messages")
    finally:
        child.close(force=True)
    saved = json.loads(out.read_text())
    assert saved["messages"][0] == {"role": "user", "content": want_text}
    want = client(talker).chat.completions.create(
        model="x", messages=[{"role": "user", "content": want_text}], temperature=0, max_tokens=16
    )
    assert saved["messages"][1]["content"] == want.choices[0].message.content


# -- tool calls ---------------------------------------------------------------------------------------
# thinks, calls get_weather, then counts "One two three two three …" until max_tokens: the call is
# parsed (and shown) long before the answer ends
TOOL_LOOP = [
    "<think>",
    "\nI need the weather.\n",
    "</think>",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "\n</tool_call>",
    "One ",
    "two ",
    "three ",
]


@pytest.fixture(scope="module")
def tool_looper():
    model = make_scripted_model("scripted-tool-loop", tool_script=ANSWER_SCRIPT, think_script=TOOL_LOOP, loop_to=7)
    with Server(model) as s:
        yield s


def _shown(call) -> str:
    return f"tool call: {call.function.name}({call.function.arguments})"


def test_terminal_shows_tool_calls_as_parsed_and_answers_them(tool_looper, tmp_path):
    s = tool_looper
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    c = client(s)
    q = [{"role": "user", "content": "weather in Paris?"}]
    want = c.chat.completions.create(model="x", messages=q, tools=[WEATHER_TOOL], temperature=0, max_tokens=1500)
    (call,) = want.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and want.choices[0].message.content
    out1, out2 = tmp_path / "one.json", tmp_path / "two.json"
    child = spawn(
        "--port",
        str(s.port),
        "--temperature",
        "0",
        "--max-tokens",
        "1500",
        "--tools",
        str(tools),
        env={"NO_COLOR": "1"},
    )
    try:
        say(child, "/tool 21 C")
        child.expect("no tool call to answer")
        say(child, f"/image {tools}")  # a text-only model (/v1/models says so)
        child.expect_exact("scripted-tool-loop takes no images (its input: text)")
        say(child, q[0]["content"])
        # the reasoning, then the call on its own line, then the content that follows it in the stream:
        # shown as parsed (a call shown at the end of the answer would come after "One two three …";
        # a check of the server still generating here would race a fast machine)
        reasoning = want.choices[0].message.model_extra["reasoning_content"]
        child.expect_exact(f"(thinking) {reasoning}\r\n{_shown(call)}\r\nOne two three")
        child.expect(r"\[1500 tokens", timeout=300)
        say(child, f"/save {out1}")
        child.expect("saved 2 messages")
        # the tool's answer goes back; the model goes on (this one calls again)
        say(child, "/tool 21 C and sunny")
        child.expect_exact(_shown(call))
        child.expect(r"\[1500 tokens", timeout=300)
        say(child, f"/save {out2}")
        child.expect("saved 4 messages")
        say(child, "/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    one, two = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert one["tools"] == two["tools"] == [WEATHER_TOOL]
    # the assistant message is the API's own (the call's id is the server's, made per request)
    (got,) = one["messages"][1]["tool_calls"]
    assert (got["function"], one["messages"][1]["content"]) == (
        {"name": call.function.name, "arguments": call.function.arguments},
        want.choices[0].message.content,
    )
    user, asked, answer, again = two["messages"]
    assert (user, asked) == (q[0], one["messages"][1])
    assert answer == {"role": "tool", "tool_call_id": got["id"], "content": "21 C and sunny"}
    # the second turn is what the API answers to the same conversation
    want2 = c.chat.completions.create(
        model="x", messages=[user, asked, answer], tools=[WEATHER_TOOL], temperature=0, max_tokens=1500
    )
    assert [tc["function"] for tc in again["tool_calls"]] == [
        {"name": t.function.name, "arguments": t.function.arguments} for t in want2.choices[0].message.tool_calls
    ]
    assert again["content"] == want2.choices[0].message.content
    # what /save wrote (tools included) the SDK sends back as is
    assert c.chat.completions.create(**two, max_tokens=3, temperature=0).choices[0].message.role == "assistant"


# two calls in one answer (then EOS)
TWO_CALLS = [
    "<think>",
    "\nTwo cities.\n",
    "</think>",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "\n</tool_call>",
    "\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Rome"}}',
    "\n</tool_call>\n",
]


def test_terminal_answers_each_of_two_tool_calls(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    out = tmp_path / "conv.json"
    q = {"role": "user", "content": "weather in Paris and Rome?"}
    with Server(make_scripted_model("scripted-two-calls", tool_script=ANSWER_SCRIPT, think_script=TWO_CALLS)) as s:
        c = client(s)
        want = c.chat.completions.create(model="x", messages=[q], tools=[WEATHER_TOOL], temperature=0)
        first, second = want.choices[0].message.tool_calls
        child = spawn("--port", str(s.port), "--temperature", "0", "--tools", str(tools), env={"NO_COLOR": "1"})
        try:
            say(child, q["content"])
            child.expect_exact(f"\r\n{_shown(first)}\r\n{_shown(second)}\r\n[")
            say(child, "/tool sunny")
            child.expect_exact("answered get_weather; 1 more tool call(s) to answer")
            say(child, "/tool rainy")  # the last one: the model goes on
            child.expect_exact(f"\r\n{_shown(first)}\r\n{_shown(second)}\r\n[")
            say(child, f"/save {out}")
            child.expect("saved 5 messages")
            say(child, "/quit")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        user, asked, a1, a2, again = json.loads(out.read_text())["messages"]
        ids = [tc["id"] for tc in asked["tool_calls"]]
        assert user == q and len(set(ids)) == 2
        assert (a1, a2) == (
            {"role": "tool", "tool_call_id": ids[0], "content": "sunny"},
            {"role": "tool", "tool_call_id": ids[1], "content": "rainy"},
        )
        want2 = c.chat.completions.create(
            model="x", messages=[user, asked, a1, a2], tools=[WEATHER_TOOL], temperature=0
        )
        assert [tc["function"] for tc in again["tool_calls"]] == [
            {"name": t.function.name, "arguments": t.function.arguments} for t in want2.choices[0].message.tool_calls
        ]


def test_pipe_with_tools_prints_the_content_and_the_calls_on_stderr(tool_looper, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"model": "m", "messages": [], "tools": [WEATHER_TOOL]}))  # a /save file
    q = "weather in Paris?"
    want = client(tool_looper).chat.completions.create(
        model="x", messages=[{"role": "user", "content": q}], tools=[WEATHER_TOOL], temperature=0, max_tokens=20
    )
    r = subprocess.run(
        chat_cmd("--port", str(tool_looper.port), "--tools", str(tools), "--temperature", "0", "--max-tokens", "20"),
        input=q,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.choices[0].message.content + "\n"
    (call,) = want.choices[0].message.tool_calls
    assert r.stderr.endswith(_shown(call) + "\n")


def test_bad_tools_file_is_refused_naming_the_entry(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps([WEATHER_TOOL, {"type": "function", "function": {"parameters": {}}}]))
    r = subprocess.run(
        chat_cmd("--tools", str(bad), "--port", str(free_port())),
        input="hi",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and f"--tools {bad}: tools[1]: expected" in r.stderr and r.stdout == ""
    bad.write_text("{not json")
    r = subprocess.run(chat_cmd("--tools", str(bad)), input="hi", capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"--tools {bad}:" in r.stderr


# -- images ---------------------------------------------------------------------------------------------
def test_terminal_attaches_an_image(tmp_path):
    img, other = tmp_path / "noise.png", tmp_path / "notes.txt"
    img.write_bytes(_png(21))
    other.write_text("not an image")
    out = tmp_path / "conv.json"
    with Server(make_gemma3_vision()) as s:
        child = spawn("--port", str(s.port), "--temperature", "0", "--max-tokens", "12")
        try:
            say(child, f"/image {other}")
            child.expect_exact(f"{other}: not a PNG, JPEG, WebP or GIF image")
            say(child, f"/image {tmp_path / 'missing.png'}")
            child.expect_exact("cannot read")
            say(child, f"/image {img}")
            child.expect_exact("attached noise.png (1 image(s) go with the next message)")
            say(child, "What is in this picture?")
            child.expect(r"\[(\d+) tokens, [\d.]+ tok/s · context (\d+)/", timeout=300)
            n_tokens, used = int(child.match.group(1)), int(child.match.group(2))
            say(child, f"/save {out}")
            child.expect("saved 2 messages")
            say(child, "/quit")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        saved = json.loads(out.read_text())
        asked = {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(_png(21))}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
        assert saved["messages"][0] == asked
        # the answer is the API's for the same message (the image counted in the prompt)
        want = client(s).chat.completions.create(model="x", messages=[asked], temperature=0, max_tokens=12)
        assert saved["messages"][1]["content"] == want.choices[0].message.content
        assert (n_tokens, used) == (want.usage.completion_tokens, want.usage.total_tokens)
