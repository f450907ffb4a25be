"""Chat-template adaptation: what a model's chat template cannot render is rewritten into what it
can, instead of failing (or silently dropping it).

What the template can do is probed once, at startup, by rendering small conversations with marker
strings (`probe`); `adapt` then rewrites each request's messages:
- several system messages (a `developer` message is one) → merged into the first system turn,
  when the template renders only one;
- a system message on a template without a system role → put at the start of the first user turn;
- a conversation of only a system message, when the template would lose its text → a user turn;
- `tool` messages, when the template has no tool role → a user turn starting with ``[tool result``;
- an assistant's `tool_calls`, when the template does not render them → JSON text in its content;
- consecutive user (or assistant) messages, when the template insists that roles alternate → one
  message, their texts joined by a blank line;
- `tools`, when the template ignores them (the prompt is the same with and without) → their
  definitions in the system prompt with a generic JSON call format (as llama.cpp's "generic"
  tool format), which the output parser (events.py) reads back into tool calls:
  ``{"tool_call": {"name": …, "arguments": {…}}}`` or ``{"tool_calls": [{…}, …]}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

Render = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], str]

GENERIC_TOOLS_PROMPT = """You can call the following tools. Their definitions (JSON Schema):
{tools}

To call a tool, reply with only this JSON object and nothing else:
{{"tool_call": {{"name": "<tool name>", "arguments": {{<the arguments as a JSON object>}}}}}}
To call several tools at once, reply with {{"tool_calls": [{{"name": …, "arguments": {{…}}}}, …]}}.
A tool's result comes back in a message that starts with "[tool result". When no tool is needed, \
answer normally."""


@dataclass(frozen=True)
class Caps:
    """What a chat template renders (True: passed to it as is)."""

    system: bool = True
    multi_system: bool = True
    system_only: bool = True
    tool_role: bool = True
    tool_calls: bool = True
    tools: bool = True
    alternation: bool = True  # two user messages in a row render

    def adapted(self) -> list[str]:
        """The names of what is rewritten for this template (for the log)."""
        return [k for k, v in vars(self).items() if not v]


def _renders(
    render: Render, msgs: list[dict[str, Any]], *markers: str, tools: list[dict[str, Any]] | None = None
) -> bool:
    try:
        out = render(msgs, tools)
    except Exception:
        return False
    return all(m in out for m in markers)


# a call id of 9 alphanumerics: Mistral's templates refuse any other
_CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "probe_fn_q7", "arguments": {"k": "ARGS_Q7"}}}
_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_q7", "description": "DESC_Q7", "parameters": {"type": "object", "properties": {}}},
}


def probe(render: Render) -> Caps:
    """The capabilities of the template behind `render(messages, tools)`."""
    u = {"role": "user", "content": "USER_Q7"}
    system = _renders(render, [{"role": "system", "content": "SYS_Q7"}, u], "SYS_Q7")
    multi = _renders(
        render,
        [
            {"role": "system", "content": "SYS1_Q7"},
            {"role": "system", "content": "SYS2_Q7"},
            u,
            {"role": "assistant", "content": "A_Q7"},
            {"role": "system", "content": "SYS3_Q7"},
            {"role": "user", "content": "U2_Q7"},
        ],
        "SYS1_Q7",
        "SYS2_Q7",
        "SYS3_Q7",
    )
    only = _renders(render, [{"role": "system", "content": "ONLY_Q7"}], "ONLY_Q7")
    calls = _renders(render, [u, {"role": "assistant", "content": "", "tool_calls": [_CALL]}], "probe_fn_q7")
    result = {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "probe_fn_q7", "content": "RESULT_Q7"}
    tool_role = _renders(
        render, [u, {"role": "assistant", "content": "", "tool_calls": [_CALL]}, result], "RESULT_Q7"
    ) or _renders(render, [u, {"role": "assistant", "content": "A_Q7"}, result], "RESULT_Q7")
    alternation = _renders(render, [u, {"role": "user", "content": "U2_Q7"}], "USER_Q7", "U2_Q7")
    try:
        tools = render([u], [_TOOL]) != render([u], None)
    except Exception:
        tools = False
    return Caps(
        system=system,
        multi_system=multi,
        system_only=only,
        tool_role=tool_role,
        tool_calls=calls,
        tools=tools,
        alternation=alternation,
    )


def generic_call_text(calls: Sequence[dict[str, Any]]) -> str:
    """An assistant's tool calls in the generic format (what the model is asked to write)."""
    items = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})} for c in calls]
    obj = {"tool_call": items[0]} if len(items) == 1 else {"tool_calls": items}
    return json.dumps(obj, ensure_ascii=False)


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    defs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return GENERIC_TOOLS_PROMPT.format(tools=defs)


def _tool_result_text(m: dict[str, Any]) -> str:
    who = ", ".join(x for x in (m.get("name"), m.get("tool_call_id")) if x)
    return f"[tool result{' for ' + who if who else ''}]\n{m.get('content') or ''}"


def _joined(a: Any, b: Any) -> Any:
    """Two messages' contents as one: texts joined by a blank line; content-part lists concatenated."""
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}" if a and b else a or b
    parts = [x if not isinstance(x, str) else {"type": "text", "text": x} for x in (a, b) if x]
    return [p for x in parts for p in (x if isinstance(x, list) else [x])]


def _merge_runs(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user or assistant messages (without tool calls) as one message each."""
    out: list[dict[str, Any]] = []
    for m in msgs:
        prev = out[-1] if out else None
        if (
            prev is not None
            and m["role"] == prev["role"]
            and m["role"] in ("user", "assistant")
            and not m.get("tool_calls")
            and not prev.get("tool_calls")
        ):
            out[-1] = {**prev, "content": _joined(prev.get("content") or "", m.get("content") or "")}
        else:
            out.append(m)
    return out


def adapt(
    caps: Caps, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) the template can render without losing anything."""
    msgs = [dict(m) for m in messages]
    for m in msgs:  # a tool-calling turn's null content as the empty text templates expect (Qwen's split it)
        if m["role"] == "assistant" and m.get("content") is None:
            m["content"] = ""
    if tools and not caps.tools:
        lead = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
        msgs.insert(lead, {"role": "system", "content": tools_prompt(tools)})  # after the caller's system
        tools = None
        caps = Caps(**{**vars(caps), "tool_calls": False, "tool_role": False})  # one format throughout
    if not caps.tool_calls:
        for m in msgs:
            calls = m.pop("tool_calls", None) if m["role"] == "assistant" else None
            if calls:
                text = m.get("content") or ""
                m["content"] = (text + "\n" if text else "") + generic_call_text(calls)
    if not caps.tool_role:
        out: list[dict[str, Any]] = []
        for m in msgs:
            if m["role"] == "tool":
                m = {"role": "user", "content": _tool_result_text(m)}
            if m["role"] == "user" and out and out[-1]["role"] == "user":  # roles keep alternating
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
            else:
                out.append(m)
        msgs = out
    systems = [m for m in msgs if m["role"] == "system"]
    if systems and (not caps.multi_system and (len(systems) > 1 or msgs[0]["role"] != "system")):
        merged = {"role": "system", "content": "\n\n".join(str(m.get("content") or "") for m in systems)}
        msgs = [merged] + [m for m in msgs if m["role"] != "system"]
    if systems and not caps.system:
        text = "\n\n".join(str(m.get("content") or "") for m in systems)
        rest = [m for m in msgs if m["role"] != "system"]
        if rest and rest[0]["role"] == "user":
            rest[0] = {**rest[0], "content": f"{text}\n\n{rest[0]['content']}"}
        else:
            rest.insert(0, {"role": "user", "content": text})
        msgs = rest
    if not caps.alternation:
        msgs = _merge_runs(msgs)
    if msgs and all(m["role"] == "system" for m in msgs) and not caps.system_only:
        msgs = [{"role": "user", "content": "\n\n".join(str(m.get("content") or "") for m in msgs)}]
    return msgs, tools
