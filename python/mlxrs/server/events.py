"""From generated text to semantic events: content, reasoning and tool calls.

One incremental parser, fed the engine's text pieces as they arrive, used by both protocols (the
OpenAI and Anthropic translators consume its events; neither re-parses the other's output), so
streaming and non-streaming responses carry the same result.

Recognised:
- reasoning: ``<think>…</think>`` (or ``[THINK]…[/THINK]``, or Gemma 4's
  ``<|channel>thought…<channel|>``, when the chat template uses those) at
  the start of the output, or from the first token when the rendered prompt already opened it;
- tool calls, only when the request offered tools:
  - Hermes/Qwen ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (and Qwen3-Coder's /
    Qwen3.5's ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``, and
    GLM-4.5/4.6/4.7's ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``;
    their text values are typed by the tool's JSON schema),
  - DeepSeek-V3/V3.1 ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…``,
  - Kimi-K2 ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{…}…``,
  - MiniMax-M2 ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>…``
    (values typed by the schema),
  - Llama 3 bare JSON ``{"name": …, "parameters": {…}}`` (also after ``<|python_tag|>``, several
    separated by ``;``, or a JSON list) at the start of the output,
  - Mistral ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` and ``[TOOL_CALLS]name[ARGS]{…}``,
  - Gemma ```` ```tool_code\\nname(key=value, …)\\n``` ```` blocks, and Gemma's bare JSON (the
    Llama form, ``{"name": …, "parameters": …}``),
  - Gemma 4 ``<|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>`` (bare keys, ``<|"|>``
    string delimiters; a ``<|tool_response>`` right after the calls is the turn's end, not content),
  - the generic format the server asks for when a chat template ignores `tools` (server/adapt.py):
    ``{"tool_call": {"name": …, "arguments": {…}}}`` or ``{"tool_calls": [{…}, …]}``, bare JSON;
  - any of the bare-JSON forms in a ```` ```json ```` fence at the start of the output.
gpt-oss's harmony format (chosen by `output_format_for` from the chat template) is parsed by its own
machine: ``<|channel|>analysis<|message|>…<|end|>`` is reasoning, ``final`` is content, and a message
to ``functions.NAME`` (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>``,
or with ``to=`` in the header before the channel) is a tool call; its message framing (headers,
``<|end|>``, ``<|start|>``) is structure, not content.
Bare JSON must name one of the offered tools to count as a call. Text that does not parse as a
call comes back as content, unchanged: nothing the model wrote is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass
class Content:
    text: str


@dataclass
class Reasoning:
    text: str


Event = Union[Content, Reasoning, ToolCall]

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
GEMMA_OPEN, FENCE = "```tool_code", "```"
JSON_FENCE = "```json"  # a bare-JSON call in a Markdown fence, at the start of the output
PYTHON_TAG = "<|python_tag|>"
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_STR = "<|tool_call>", "<tool_call|>", '<|"|>'
GEMMA4_RESPONSE = "<|tool_response>"

THINK_MARKERS = {
    "<think>": ("<think>", "</think>"),
    "[THINK]": ("[THINK]", "[/THINK]"),
    "<|channel>": ("<|channel>thought", "<channel|>"),
}


def think_markers_for(template: str | None) -> tuple[str, str]:
    """The reasoning markers a chat template uses (``<think>`` unless it speaks ``[THINK]`` or
    Gemma 4's ``<|channel>thought``)."""
    if template and "<think>" not in template:
        if "[THINK]" in template:
            return THINK_MARKERS["[THINK]"]
        if "<|channel>" in template and "<channel|>" in template:
            return THINK_MARKERS["<|channel>"]
    return THINK_MARKERS["<think>"]


def _json_end(s: str, start: int = 0) -> int | None | bool:
    """Where the JSON object/array starting at s[start] ends (exclusive): an int; None while it
    is still incomplete; False when s[start] does not open one."""
    if start >= len(s) or s[start] not in "{[":
        return False
    depth, in_str, esc = 0, False, False
    for i in range(start, len(s)):
        c = s[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _args_text(args: Any) -> str | None:
    """Arguments as JSON object text, or None when they are not an object."""
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _call_from_obj(obj: Any, known: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        fn = obj.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return _call_from_obj(fn, known)
        return None
    if known is not None and name not in known:
        return None
    if "arguments" in obj:
        args = _args_text(obj["arguments"])
    elif "parameters" in obj:
        args = _args_text(obj["parameters"])
    else:
        args = "{}"
    if args is None:
        return None
    return ToolCall(name, args)


def _calls_from_json(value: Any, known: set[str] | None) -> list[ToolCall] | None:
    if isinstance(value, dict) and len(value) == 1:  # the generic format (server/adapt.py)
        if isinstance(value.get("tool_call"), dict):
            value = value["tool_call"]
        elif isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = [_call_from_obj(o, known) for o in items]
    if any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


Schemas = dict[str, dict[str, Any]]  # tool name → its parameters' `properties`


def schemas_of(tools: Iterable[dict[str, Any]] | None) -> Schemas:
    """The `properties` of each OpenAI-style tool's parameters, by tool name (for typing the text
    values of the XML-style formats)."""
    out: Schemas = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (``type``, a list of types, ``enum`` values,
    ``anyOf``/``oneOf``/``allOf``); empty when it says nothing."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    t = schema.get("type")
    for x in t if isinstance(t, list) else [t]:
        if isinstance(x, str):
            types.add(x.strip().lower())
    for v in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.add(
            "null"
            if v is None
            else "boolean"
            if isinstance(v, bool)
            else "integer"
            if isinstance(v, int)
            else "number"
            if isinstance(v, float)
            else "string"
            if isinstance(v, str)
            else "array"
            if isinstance(v, list)
            else "object"
        )
    for k in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(k), list):
            for c in schema[k]:
                types |= _schema_types(c)
    return types


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text value as the JSON value its schema types it as (as mlx-lm's qwen3_coder,
    glm47 and minimax_m2 parsers do): a string parameter keeps its text; integer, number, boolean,
    object and array parameters are converted (most specific type first); a value that converts to
    none of its types, or one without a schema, is JSON when it parses as JSON, else text."""
    types = _schema_types(schema)
    if types == {"string"}:
        return raw
    v = raw.strip()
    if v.lower() == "null":
        return None
    for t in ("integer", "number", "boolean", "object", "array"):
        if t not in types:
            continue
        if t in ("integer", "number"):
            try:
                f = float(v)
            except ValueError:
                continue
            if not math.isfinite(f):  # NaN and infinities are no JSON numbers
                continue
            if f == int(f) and (t == "integer" or not any(c in v for c in ".eE")):
                return int(f)
            if t == "number":
                return f
        elif t == "boolean":
            if v.lower() in ("true", "false"):
                return v.lower() == "true"
        else:
            try:
                value = json.loads(v, strict=False)
            except ValueError:
                try:
                    value = ast.literal_eval(v)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
            if isinstance(value, dict if t == "object" else list):
                return value
    if "string" in types:
        return raw
    return _json_or_text(v)


def _call(name: str, args: dict[str, Any]) -> ToolCall | None:
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except (TypeError, ValueError):
        return None


def _strip_one_newline(v: str) -> str:
    """The value between tags without the one newline the templates put on each side."""
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


_FUNC_RE = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)
_GLM_NAME = re.compile(r"\s*([A-Za-z0-9_.:\-]+)\s*")
_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def _qwen_xml_calls(b: str, schemas: Schemas) -> list[ToolCall] | None:
    calls = []
    pos = 0
    for m in _FUNC_RE.finditer(b):
        if b[pos : m.start()].strip():
            return None
        props = schemas.get(m.group(1), {})
        args: dict[str, Any] = {}
        inner = 0
        for p in _PARAM_RE.finditer(m.group(2)):
            if m.group(2)[inner : p.start()].strip():
                return None
            args[p.group(1)] = typed_value(_strip_one_newline(p.group(2)), props.get(p.group(1)))
            inner = p.end()
        if m.group(2)[inner:].strip():
            return None
        c = _call(m.group(1), args)
        if c is None:
            return None
        calls.append(c)
        pos = m.end()
    return calls if calls and not b[pos:].strip() else None


def _glm_call(b: str, schemas: Schemas) -> list[ToolCall] | None:
    """GLM-4.5/4.6/4.7: ``NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs."""
    m = _GLM_NAME.match(b)
    if not m:
        return None
    name, pos = m.group(1), m.end()
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    while pos < len(b):
        a = _GLM_ARG.match(b, pos)
        if not a:
            return None
        args[a.group(1).strip()] = typed_value(a.group(2).strip(), props.get(a.group(1).strip()))
        pos = a.end()
    c = _call(name, args)
    return [c] if c else None


def parse_hermes_body(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
    """The inside of a ``<tool_call>…</tool_call>``: JSON, Qwen3-Coder's XML form, or GLM's."""
    b = body.strip()
    if b.startswith("<function="):
        return _qwen_xml_calls(b, schemas or {})
    if b[:1] not in ("{", "["):
        return _glm_call(b, schemas or {})
    try:
        value = json.loads(b)
    except ValueError:
        return None
    return _calls_from_json(value, None)


DEEPSEEK_OPEN, DEEPSEEK_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DEEPSEEK_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>\s*", re.S)
_DEEPSEEK_V3 = re.compile(r"([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_deepseek_calls(body: str) -> list[ToolCall] | None:
    """Inside DeepSeek's calls section: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>``
    (V3.1), or V3's ``…begin｜>function<｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>``."""
    calls, pos = [], 0
    while body[pos:].strip():
        m = _DEEPSEEK_CALL.match(body, pos)
        if not m:
            return None
        name, rest = m.group(1).strip(), m.group(2)
        if name == "function" and (v3 := _DEEPSEEK_V3.match(rest.strip())):
            name, rest = v3.group(1), v3.group(2)
        args = _args_text(rest)
        if not name or args is None:
            return None
        calls.append(ToolCall(name, args))
        pos = m.end()
    return calls or None


KIMI_OPEN, KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^\s<]+?)(?::\d+)?\s*"
    r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
    re.S,
)


def parse_kimi_calls(body: str) -> list[ToolCall] | None:
    """Inside Kimi-K2's calls section: ``<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{…}<|tool_call_end|>``, one or more."""
    calls, pos = [], 0
    while body[pos:].strip():
        m = _KIMI_CALL.match(body, pos)
        if not m:
            return None
        args = _args_text(m.group(2))
        if args is None:
            return None
        calls.append(ToolCall(m.group(1), args))
        pos = m.end()
    return calls or None


MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_MINIMAX_INVOKE = re.compile(r"\s*<invoke name=(\"[^\"]*\"|'[^']*'|[^>\s]+)\s*>(.*?)</invoke>\s*", re.S)
_MINIMAX_PARAM = re.compile(r"\s*<parameter name=(\"[^\"]*\"|'[^']*'|[^>\s]+)\s*>(.*?)</parameter>\s*", re.S)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def parse_minimax_calls(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
    """Inside ``<minimax:tool_call>…</minimax:tool_call>``: ``<invoke name="NAME">`` blocks of
    ``<parameter name="K">V</parameter>``; values typed by the tool's schema."""
    calls, pos = [], 0
    while body[pos:].strip():
        m = _MINIMAX_INVOKE.match(body, pos)
        if not m:
            return None
        name, inner = _unquote(m.group(1)), m.group(2)
        props = (schemas or {}).get(name, {})
        args: dict[str, Any] = {}
        ip = 0
        while inner[ip:].strip():
            p = _MINIMAX_PARAM.match(inner, ip)
            if not p:
                return None
            k = _unquote(p.group(1))
            args[k] = typed_value(_strip_one_newline(p.group(2).strip()), props.get(k, {"type": "string"}))
            ip = p.end()
        c = _call(name, args) if name else None
        if c is None:
            return None
        calls.append(c)
        pos = m.end()
    return calls or None


def parse_python_calls(body: str) -> list[ToolCall] | None:
    """Gemma's ``tool_code``: Python calls with keyword arguments whose values are literals."""
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except (SyntaxError, ValueError):
        return None
    calls = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
            return None
        call = stmt.value
        if isinstance(call.func, ast.Name):
            name = call.func.id
        elif isinstance(call.func, ast.Attribute):
            name = call.func.attr
        else:
            return None
        if call.args:
            return None
        args = {}
        for kw in call.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, SyntaxError, TypeError):
                return None
        try:
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):
            return None
    return calls or None


_GEMMA4_CALL = re.compile(r"call:([\w-]+)\{")
_GEMMA4_KEY = re.compile(r"(?<=[{,])(\w+):")


def _gemma4_args(text: str) -> Any:
    """Gemma 4's argument object (bare keys, ``<|"|>`` strings) as a Python value, as mlx-lm's
    ``tool_parsers/gemma4.py`` converts it: strings set aside, keys after ``{`` or ``,`` quoted,
    the strings put back JSON-escaped."""
    strings: list[str] = []

    def keep(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    text = re.sub(r'<\|"\|>(.*?)<\|"\|>', keep, text, flags=re.S)
    text = _GEMMA4_KEY.sub(r'"\1":', text)
    for i, v in enumerate(strings):
        text = text.replace(f"\x00{i}\x00", json.dumps(v))
    return json.loads(text)


def parse_gemma4_calls(body: str) -> list[ToolCall] | None:
    """The inside of ``<|tool_call>…<tool_call|>``: one or more ``call:name{…}`` (braces balanced,
    braces inside ``<|"|>`` strings ignored), nothing else but whitespace; None when it is not."""
    calls, pos = [], 0
    while True:
        rest = body[pos:]
        if not rest.strip():
            break
        m = _GEMMA4_CALL.match(rest.lstrip())
        if not m:
            return None
        start = pos + (len(rest) - len(rest.lstrip())) + m.end() - 1  # at the "{"
        depth, i = 0, start
        while i < len(body):
            if body.startswith(GEMMA4_STR, i):
                j = body.find(GEMMA4_STR, i + len(GEMMA4_STR))
                if j < 0:
                    return None
                i = j + len(GEMMA4_STR)
                continue
            c = body[i]
            depth += c == "{"
            depth -= c == "}"
            i += 1
            if depth == 0:
                break
        if depth:
            return None
        try:
            args = _args_text(_gemma4_args(body[start:i]))
        except ValueError:
            return None
        if args is None:
            return None
        calls.append(ToolCall(m.group(1), args))
        pos = i
    return calls or None


_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_\-]+\s*)?\[ARGS\]")
_NAME_PART = re.compile(r"\s*[A-Za-z0-9_.\-]*\s*")


def _mistral_name_pending(s: str) -> bool:
    """True while `s` may still become ``name[ARGS]`` / ``name[CALL_ID]id[ARGS]``."""
    tail = s[_NAME_PART.match(s).end() :]  # type: ignore[union-attr]
    if not tail or "[ARGS]".startswith(tail) or "[CALL_ID]".startswith(tail):
        return True
    if tail.startswith("[CALL_ID]"):
        rest = tail[len("[CALL_ID]") :]
        rest = rest[_NAME_PART.match(rest).end() :]  # type: ignore[union-attr]
        return not rest or "[ARGS]".startswith(rest)
    return False


def _partial_suffix(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


# the tagged tool-call formats: opener → (closer, parse(body, schemas))
BLOCKS: dict[str, tuple[str, Any]] = {
    TOOL_OPEN: (TOOL_CLOSE, parse_hermes_body),
    GEMMA_OPEN: (FENCE, lambda b, _s: parse_python_calls(b)),
    GEMMA4_OPEN: (GEMMA4_CLOSE, lambda b, _s: parse_gemma4_calls(b)),
    DEEPSEEK_OPEN: (DEEPSEEK_CLOSE, lambda b, _s: parse_deepseek_calls(b)),
    KIMI_OPEN: (KIMI_CLOSE, lambda b, _s: parse_kimi_calls(b)),
    MINIMAX_OPEN: (MINIMAX_CLOSE, parse_minimax_calls),
}

# gpt-oss's harmony format
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a message's end (consumed)
H_NEXT = (H_START, H_CHANNEL)  # the next message's header, its end unwritten
_H_HEADER = re.compile(
    r"\s*(?:<\|start\|>)?\s*(?:assistant)?\s*(?:to=([^\s<]+)\s*)?"
    r"(?:<\|channel\|>\s*(\w+))?\s*(?:to=([^\s<]+)\s*)?(?:<\|constrain\|>\s*[\w/.-]+|json)?\s*"
)
_H_PREFIXES = (H_START, H_CHANNEL, "assistant", "to=")
H_HEADER_MAX = 256  # a header's length at most (role, recipient, channel, constraint)


def output_format_for(template: str | None) -> str | None:
    """The output format a chat template implies that needs its own parser: ``"harmony"``
    (gpt-oss: ``<|channel|>``…``<|message|>``), else None (the general parser)."""
    if template and H_CHANNEL in template and H_MESSAGE in template:
        return "harmony"
    return None


class OutputParser:
    """Incremental: ``feed(text)`` returns the events that text completes; ``finish()`` flushes."""

    def __init__(
        self,
        *,
        tools: Iterable[str] | None = None,
        think: tuple[str, str] | None = THINK_MARKERS["<think>"],
        in_reasoning: bool = False,
        schemas: Schemas | None = None,
        harmony: bool = False,
    ) -> None:
        self.known = set(tools) if tools is not None else None
        self.schemas = schemas or {}
        self.tools = tools is not None
        self.think = think
        self.buf = ""
        self.state = "reasoning" if (in_reasoning and think) else "start"
        self.reasoning_started = self.state == "reasoning"
        self.reasoning_done = False
        self.strip_lead = self.state == "reasoning"  # drop the newline after the opener
        self.calls: list[ToolCall] = []
        self.after_json = False
        self.after_gemma4 = False
        self.openers = [*BLOCKS, MISTRAL] if self.tools else []
        self.block = TOOL_OPEN  # the opener of the tagged block being read (state "block")
        self.harmony = harmony
        if harmony:  # gpt-oss: channels, not think markers (_harmony)
            self.think = None
            self.state = "h_header"
            self.h_kind = ""  # the message being read: "reasoning", "content" or a call's name
            self.h_raw = ""  # the message's header as written (content again if it is no call)

    # -- public ------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return _merge(out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self.state == "h_body" and self.h_kind.startswith("call:") and self.h_raw:
            out.append(Content(self.h_raw))  # a harmony call's header, its body never written
            self.h_raw = ""
        if self.buf:
            if self.state == "reasoning":
                out.append(Reasoning(self.buf))
            elif self.state != "after":
                out.append(Content(self.buf))
            self.buf = ""
        return _merge(out)

    # -- the machine -------------------------------------------------------------------------
    def _emit_call(self, out: list[Event], calls: list[ToolCall]) -> None:
        self.calls.extend(calls)
        out.extend(calls)

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be decided; True when progress was made."""
        if not self.buf:
            return False
        st = self.state
        if st == "after":
            # between and after tool calls: whitespace is not content
            s = self.buf.lstrip()
            if self.after_json:  # Llama 3 separates several calls with ";"
                s = s.lstrip("; \t\r\n")
            if self.after_gemma4:  # Gemma 4 ends its calls by waiting for the response
                if s.startswith(GEMMA4_RESPONSE):
                    s = s[len(GEMMA4_RESPONSE) :].lstrip()
                elif s and GEMMA4_RESPONSE.startswith(s) and not final:
                    self.buf = s
                    return False
            self.buf = s
            if not s:
                return False
            self.after_gemma4 = False
            self.after_json = False
            self.state = "start"
            return True
        # every other state has its method: start, text, reasoning, block, mistral, h_header, h_body,
        # json, fenced
        step: Callable[[list[Event], bool], bool] = getattr(self, f"_{st}")
        return step(out, final)

    def _start(self, out: list[Event], final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            if final:
                if not self.reasoning_done:
                    out.append(Content(self.buf))
                self.buf = ""
            return False
        if self.think and not self.reasoning_started:
            op = self.think[0]
            if s.startswith(op):
                self.buf = s[len(op) :]
                self.state = "reasoning"
                self.reasoning_started = True
                self.strip_lead = True
                return True
            if op.startswith(s) and not final:
                return False
        if self.tools:
            if not final and any(m.startswith(s) and len(s) < len(m) for m in (PYTHON_TAG, *self.openers)):
                return False
            if not final and JSON_FENCE.startswith(s) and len(s) < len(JSON_FENCE):
                return False
            if s.startswith(JSON_FENCE):
                self.buf = s[len(JSON_FENCE) :]
                self.state = "fenced"
                return True
            json_start = s.startswith(PYTHON_TAG) or s[0] == "{"
            if s[0] == "[" and not s.startswith(MISTRAL):
                rest = s[1:].lstrip()
                if not rest and not final:
                    return False
                json_start = rest.startswith("{")
            if json_start:
                self.buf = s[len(PYTHON_TAG) :].lstrip() if s.startswith(PYTHON_TAG) else s
                self.state = "json"
                return True
        # plain text: after reasoning, the separating whitespace is dropped
        if self.reasoning_done:
            self.buf = s
        self.state = "text"
        return True

    def _text(self, out: list[Event], final: bool) -> bool:
        buf = self.buf
        best = None
        for m in self.openers:
            i = buf.find(m)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, m)
        if best is not None:
            i, m = best
            if i:
                out.append(Content(buf[:i]))
            self.buf = buf[i + len(m) :]
            self.state = "mistral" if m == MISTRAL else "block"
            self.block = m
            return True
        keep = 0 if final else _partial_suffix(buf, self.openers)
        emit = buf[: len(buf) - keep]
        if emit:
            out.append(Content(emit))
            self.buf = buf[len(emit) :]
        return False

    def _reasoning(self, out: list[Event], final: bool) -> bool:
        assert self.think
        close = self.think[1]
        if self.strip_lead:
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
                self.strip_lead = False
            elif self.buf:
                self.strip_lead = False
        i = self.buf.find(close)
        if i >= 0:
            text = self.buf[:i].rstrip("\n")
            if text:
                out.append(Reasoning(text))
            self.buf = self.buf[i + len(close) :]
            self.state = "start"
            self.reasoning_done = True
            return True
        if final:
            if self.buf:
                out.append(Reasoning(self.buf))
            self.buf = ""
            return False
        keep = _partial_suffix(self.buf, [close])
        body = self.buf[: len(self.buf) - keep]
        held = len(body) - len(body.rstrip("\n"))  # trailing newlines may precede the closer
        emit = body[: len(body) - held]
        if emit:
            out.append(Reasoning(emit))
            self.buf = self.buf[len(emit) :]
        return False

    def _block(self, out: list[Event], final: bool) -> bool:
        """A tagged block (BLOCKS): calls when its body parses, else content as written."""
        opener = self.block
        close, parse = BLOCKS[opener]
        i = self.buf.find(close)
        if i < 0 and not final:
            return False
        body = self.buf[:i] if i >= 0 else self.buf
        calls = parse(body, self.schemas)
        if opener == TOOL_OPEN and calls and body.strip()[:1] not in ("{", "[", "<"):  # GLM's form
            if i < 0:
                calls = None  # it has no end of its own: cut off, its last value may be too
            elif self.known is not None and any(c.name not in self.known for c in calls):
                calls = None  # a bare word in the tags names no offered tool: not a call
        self._end_block(out, calls, opener, body, close, i)
        self.after_gemma4 = bool(calls) and opener == GEMMA4_OPEN
        return True

    def _end_block(
        self, out: list[Event], calls: list[ToolCall] | None, opener: str, body: str, close: str, i: int
    ) -> None:
        """A delimited block parsed (`body`, closed at `i` by `close`, or cut off where `i` < 0): its calls,
        or the block as text when it held none; the buffer then starts after it."""
        if calls:
            self._emit_call(out, calls)
        else:
            out.append(Content(opener + body + (close if i >= 0 else "")))
        self.buf = self.buf[i + len(close) :] if i >= 0 else ""
        self.state = "after" if calls else "text"

    def _mistral(self, out: list[Event], final: bool) -> bool:
        s = self.buf.lstrip()
        raw = MISTRAL + self.buf
        if not s:
            if final:
                out.append(Content(raw))
                self.buf = ""
            return False
        if s[0] == "[":
            end = _json_end(s)
            if end is None and not final:
                return False
            calls = None
            if isinstance(end, int) and end:
                try:
                    calls = _calls_from_json(json.loads(s[:end]), None)
                except ValueError:
                    calls = None
            if calls:
                self._emit_call(out, calls)
                self.buf = s[end:]
                self.state = "after"
            else:
                out.append(Content(raw))
                self.buf = ""
                self.state = "text"
            return True
        m = _MISTRAL_NAME.match(s)
        if not m:
            if _mistral_name_pending(s) and not final:
                return False
            out.append(Content(MISTRAL))
            self.state = "text"
            return True
        rest = s[m.end() :].lstrip()
        end = _json_end(rest)
        if (end is None or not rest) and not final:
            return False
        args = None
        if isinstance(end, int) and end:
            try:
                args = _args_text(json.loads(rest[:end]))
            except ValueError:
                args = None
        if args is None:
            out.append(Content(MISTRAL))
            self.state = "text"
            return True
        self._emit_call(out, [ToolCall(m.group(1), args)])
        self.buf = rest[end:]
        # the next call repeats the marker
        self.state = "after"
        return True

    def _fenced(self, out: list[Event], final: bool) -> bool:
        """After ```json at the start: a call when the fenced text is one, else the text as is."""
        i = self.buf.find(FENCE)
        if i < 0 and not final:
            return False
        body = self.buf[:i] if i >= 0 else self.buf
        try:
            calls = _calls_from_json(json.loads(body), self.known)
        except ValueError:
            calls = None
        self._end_block(out, calls, JSON_FENCE, body, FENCE, i)
        return True

    def _json(self, out: list[Event], final: bool) -> bool:
        s = self.buf
        end = _json_end(s)
        if end is None and not final:
            return False
        calls = None
        if isinstance(end, int) and end:
            try:
                calls = _calls_from_json(json.loads(s[:end]), self.known)
            except ValueError:
                calls = None
        if not calls:
            self.state = "text"
            if end is False:
                return True
            out.append(Content(s[: end if isinstance(end, int) else len(s)]))
            self.buf = s[end:] if isinstance(end, int) else ""
            return True
        self._emit_call(out, calls)
        self.buf = s[end:]
        self.after_json = True
        self.state = "after"
        return True

    # -- harmony (gpt-oss) ----------------------------------------------------------------------
    def _h_header(self, out: list[Event], final: bool) -> bool:
        """A message's header up to ``<|message|>``: its channel and recipient decide what the
        message is (analysis: reasoning; to=functions.NAME: a call; else content)."""
        # decided by what has arrived alone, so that streamed and whole agree: a header starts like
        # one, and its <|message|> comes within H_HEADER_MAX characters, before any message end
        t = self.buf.lstrip()
        header_like = any(p.startswith(t) or t.startswith(p) for p in _H_PREFIXES)
        found = [(j, mk) for mk in (H_MESSAGE, *H_ENDS) if 0 <= (j := self.buf.find(mk)) < H_HEADER_MAX]
        i, first = min(found) if found else (-1, "")
        if (
            not header_like
            or (found and first != H_MESSAGE)
            or (not found and len(self.buf) >= H_HEADER_MAX + len(H_MESSAGE))
        ):
            self._h_not_header(out)
            return True
        if not found:
            if final:  # no header: what is left is content as written
                if t:
                    out.append(Content(self.buf))
                self.buf = ""
            return False
        head = self.buf[:i]
        m = _H_HEADER.fullmatch(head)
        raw = head + H_MESSAGE
        self.buf = self.buf[i + len(H_MESSAGE) :]
        self.state = "h_body"
        self.h_raw = ""
        recipient = m and (m.group(1) or m.group(3))
        fn = recipient[len("functions.") :] if recipient and recipient.startswith("functions.") else ""
        if not m or (recipient and not (self.tools and fn)):  # no header, or no offered function's
            out.append(Content(raw))
            self.h_kind = "content"
        elif recipient:
            self.h_kind = "call:" + fn
            self.h_raw = raw
        else:
            self.h_kind = "reasoning" if m.group(2) == "analysis" else "content"
        return True

    def _h_not_header(self, out: list[Event]) -> None:
        """Text where a header should be: content up to the next message (its leading token
        consumed, so the machine moves on)."""
        self.h_kind, self.h_raw = "content", ""
        self.state = "h_body"
        lead = next((m for m in H_NEXT if self.buf.startswith(m)), None)
        if lead:
            out.append(Content(lead))
            self.buf = self.buf[len(lead) :]

    def _h_body(self, out: list[Event], final: bool) -> bool:
        ends = [(j, t) for t in (*H_ENDS, *H_NEXT) if (j := self.buf.find(t)) >= 0]
        kind = self.h_kind
        if not ends and not final:
            if kind.startswith("call:"):
                return False
            keep = _partial_suffix(self.buf, (*H_ENDS, *H_NEXT))
            emit = self.buf[: len(self.buf) - keep]
            if emit:
                out.append(Reasoning(emit) if kind == "reasoning" else Content(emit))
                self.buf = self.buf[len(emit) :]
            return False
        j, term = min(ends) if ends else (len(self.buf), "")
        body = self.buf[:j]
        self.buf = self.buf[j + len(term) :] if term in H_ENDS else self.buf[j:]
        self.state = "h_header"
        if kind.startswith("call:"):
            args = _args_text(body.strip()) if body.strip() else None
            if args is not None:
                self._emit_call(out, [ToolCall(kind[5:], args)])
            else:
                out.append(Content(self.h_raw + body + (term if term in H_ENDS else "")))
        elif body:
            out.append(Reasoning(body) if kind == "reasoning" else Content(body))
        return True


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent pieces of the same kind as one event."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, ToolCall):
            out.append(e)
            continue
        if not e.text:
            continue
        if out and type(out[-1]) is type(e) and not isinstance(e, ToolCall):
            prev = out[-1]
            out[-1] = type(e)(prev.text + e.text)
        else:
            out.append(e)
    return out


def parse_all(text: str, **kw: Any) -> list[Event]:
    """Parse a whole output at once (the same result as feeding it piece by piece)."""
    p = OutputParser(**kw)
    return _merge(p.feed(text) + p.finish())
