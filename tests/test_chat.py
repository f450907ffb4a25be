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

from scriptedmodel import THINK_ANSWER, make_scripted_model
from server_util import Server, free_port
from tinymodels import make_model

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


def spawn(*args: str) -> "pexpect.spawn":
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    cmd = chat_cmd(*args)
    # Ctrl-C reaches the child even when this test runs with SIGINT ignored (a background job of a
    # non-interactive shell), which the child would inherit
    return pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=120, dimensions=(40, 200),
                         preexec_fn=_default_sigint)


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
        model="x", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=60)
    r = subprocess.run(chat_cmd("--port", str(talker.port), "--temperature", "0", "--max-tokens", "60"),
                       input=(question + "\n").encode(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert want.choices[0].message.content
    assert r.stdout.decode() == want.choices[0].message.content + "\n"  # bytes: the text has \r in it
    assert b"attached to" in r.stderr


def test_pipe_starts_a_server_when_none_answers():
    """No server on --port: one is started in-process; the reasoning is left out of a piped answer."""
    model = make_scripted_model()
    r = subprocess.run(chat_cmd(str(model), "--port", str(free_port()), "--temperature", "0"),
                       input="hi", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == THINK_ANSWER + "\n"
    assert "loading the model" in r.stderr


def test_pipe_respects_the_api_key(talker_dir):
    with Server(talker_dir, "--api-key", "sekrit") as s:
        ok = subprocess.run(chat_cmd("--port", str(s.port), "--api-key", "sekrit", "--max-tokens", "5"),
                            input="hi", capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
        bad = subprocess.run(chat_cmd("--port", str(s.port), "--api-key", "wrong", "--max-tokens", "5"),
                             input="hi", capture_output=True, text=True, timeout=120)
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
        child.expect(r"\[(\d+) tokens, [\d.]+ tok/s · context (\d+)/(\d+) · prefix cache (\d+)/(\d+) prompt tokens",
                     timeout=300)
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
    want = c.chat.completions.create(model="x", messages=[{"role": "user", "content": q2}], temperature=0,
                                     max_tokens=2000)
    # the cancelled question was dropped; the second answer is the API's own
    assert saved["messages"] == [{"role": "user", "content": q2},
                                 {"role": "assistant", "content": want.choices[0].message.content}]
    assert n_tokens == want.usage.completion_tokens and used == want.usage.total_tokens
    # what /save wrote is a request the OpenAI SDK sends back as is
    again = c.chat.completions.create(**saved, max_tokens=3, temperature=0)
    assert again.choices[0].message.role == "assistant"
    assert again.usage.prompt_tokens > want.usage.prompt_tokens


def test_terminal_load_system_reset_and_reasoning(tmp_path):
    """Reasoning shows (dimmed) before the answer; /load and /system shape the next request."""
    model = make_scripted_model()
    conv = tmp_path / "in.json"
    conv.write_text(json.dumps({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hello"},
                                                           {"role": "assistant", "content": "hi there"}]}))
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
    assert json.loads((tmp_path / "empty.json").read_text())["messages"] == [{"role": "system",
                                                                               "content": "short answers"}]
