"""Request-side helpers both protocols share: strict JSON, typed field checks, sampling options."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .errors import ApiError

INT32_MAX = 2**31 - 1


MAX_DEPTH = 64  # nesting levels a request body (or a tool call's `arguments`) may have
NAMED_DEPTH = 8  # errors name the value's path down to this many levels


class _Bad:
    """A value the JSON decoder refused in place, so that the walk can name where it is."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _const(name: str) -> _Bad:
    return _Bad(f"{name} is not valid JSON (numbers must be finite)")


def _float(text: str) -> float | _Bad:
    f = float(text)
    return f if math.isfinite(f) else _Bad(f"the number {text} is out of range")


def _int(text: str) -> int | _Bad:
    i = int(text)
    try:
        float(i)
    except OverflowError:
        return _Bad(f"the number {text[:20]}… is out of range")
    return i


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(text: str) -> Any:
    """`text` decoded with out-of-place values (NaN, Infinity, numbers beyond float range) left
    as markers for `check_json`; ValueError for what is not JSON at all."""
    try:
        return json.loads(text, parse_constant=_const, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None


def check_json(value: Any, where: str = "", *, surrogates: bool = True, depth: int = 1) -> None:
    """400, naming the parameter, for the first value no engine or template can take: NaN or
    Infinity, a number beyond float range, a lone UTF-16 surrogate (from a `\\ud800` escape) in a
    string or key, nesting deeper than MAX_DEPTH. `depth`: the level `value` is at in the body."""
    # the path names values down to NAMED_DEPTH levels; below that, the value there ("…" added)
    stack: list[tuple[str, Any, int]] = [(where, value, depth)]
    while stack:
        path, v, depth = stack.pop()
        shown = path if depth <= NAMED_DEPTH else path + "…"
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise _at(shown, f"is nested more than {MAX_DEPTH} levels deep")
            deeper = depth >= NAMED_DEPTH
            if isinstance(v, dict):
                for k, x in v.items():
                    if surrogates and _SURROGATE.search(k):
                        raise _at(
                            shown, f"the key {ascii(k)} contains a lone UTF-16 surrogate: text must be valid Unicode"
                        )
                    stack.append((path if deeper else f"{path}.{k}" if path else k, x, depth + 1))
            else:
                stack.extend((path if deeper else f"{path}[{i}]", x, depth + 1) for i, x in enumerate(v))
        elif isinstance(v, _Bad):
            raise _at(shown, v.why)
        elif surrogates and isinstance(v, str) and _SURROGATE.search(v):
            raise _at(
                shown,
                "contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair): "
                "text must be valid Unicode",
            )


def _at(path: str, msg: str) -> ApiError:
    return ApiError(400, f"{path}: {msg}" if path else f"request body: {msg}", param=path or None)


def loads_strict(raw: bytes) -> Any:
    """A request body as JSON the engine can take (see check_json): 400 for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not UTF-8: {e}") from None
    try:
        value = parse_json(text)
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    # a lone surrogate can only come from a \\uD800-\\uDFFF escape: look for strings only then
    check_json(value, surrogates=bool(_SURROGATE_ESCAPE.search(text)))
    return value


def type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def bad(param: str, msg: str) -> ApiError:
    return ApiError(400, f"{param}: {msg}", param=param)


def message_objects(msgs: Any) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(index, param path, message) of each element of a request's `messages`, checked to be a
    non-empty array of objects (a 400 naming the field or the element otherwise): how both protocols
    walk their messages."""
    if not isinstance(msgs, list):
        raise bad("messages", f"expected an array, got {type_name(msgs)}" if msgs is not None else "is required")
    if not msgs:
        raise bad("messages", "must contain at least one message")
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(w, f"expected a message object, got {type_name(m)}")
        yield i, w, m


def content_parts(content: list[Any], where: str, noun: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(type, part, its param path) of each element of a content array, each checked to be an object
    with a string `type` (a 400 naming the element otherwise): how both protocols walk their content
    parts (OpenAI) and blocks (Anthropic). `noun` names an element in the messages."""
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(pw, f"expected a {noun} object, got {type_name(part)}")
        t = part.get("type")
        if not isinstance(t, str):
            raise bad(pw, f"a {noun} needs a string `type`, got {type_name(t)}")
        yield t, part, pw


def opt_number(
    body: Mapping[str, Any], key: str, lo: float | None = None, hi: float | None = None, *, param: str | None = None
) -> float | None:
    v = body.get(key)
    p = param or key
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(p, f"expected a number, got {type_name(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise bad(p, "must be a finite number")
    if lo is not None and f < lo or hi is not None and f > hi:
        raise bad(
            p,
            f"must be in [{lo}, {hi}], got {v}"
            if lo is not None and hi is not None
            else f"must be >= {lo}, got {v}"
            if lo is not None
            else f"must be <= {hi}, got {v}",
        )
    return f


def opt_int(
    body: Mapping[str, Any], key: str, lo: int | None = None, hi: int | None = None, *, param: str | None = None
) -> int | None:
    v = body.get(key)
    p = param or key
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(p, f"expected an integer, got {type_name(v)}")
    if lo is not None and v < lo:
        raise bad(p, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(p, f"must be <= {hi}, got {v}")
    return v


def opt_bool(body: Mapping[str, Any], key: str, *, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(param or key, f"expected a boolean, got {type_name(v)}")
    return v


def opt_str(body: Mapping[str, Any], key: str, *, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(param or key, f"expected a string, got {type_name(v)}")
    return v


def opt_object(body: Mapping[str, Any], key: str, *, param: str | None = None) -> dict[str, Any] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(param or key, f"expected an object, got {type_name(v)}")
    return v


def stop_list(v: Any, param: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(param, "expected a string or an array of strings")
    if len(v) > 16:
        raise bad(param, f"at most 16 stop sequences, got {len(v)}")
    if any(not s for s in v):
        raise bad(param, "stop sequences must not be empty")
    return list(v)


@dataclass
class Sampling:
    """Engine options (the keys `mlxrs.Session` takes), checked."""

    opts: dict[str, Any] = field(default_factory=dict)

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self.opts[key] = value


def common_sampling(
    body: Mapping[str, Any], *, temperature_max: float, defaults: Mapping[str, Any], vocab: int
) -> Sampling:
    """temperature, top_p, top_k, min_p, seed (both protocols); defaults from generation_config."""
    s = Sampling()
    t = opt_number(body, "temperature", 0.0, temperature_max)
    s.set("temperature", t if t is not None else defaults.get("temperature", 1.0))
    top_p = opt_number(body, "top_p", 0.0, 1.0)
    s.set("top_p", top_p if top_p is not None else defaults.get("top_p"))
    top_k = opt_int(body, "top_k", -1, INT32_MAX)
    if top_k is None:
        top_k = defaults.get("top_k")
    if top_k is not None:
        s.set("top_k", max(0, min(int(top_k), vocab)))  # -1 or 0: off; above the vocabulary: all
    min_p = opt_number(body, "min_p", 0.0, 1.0)
    s.set("min_p", min_p if min_p is not None else defaults.get("min_p"))
    seed = opt_int(body, "seed", -(2**63), 2**64 - 1)
    if seed is not None:
        s.set("seed", seed % 2**64)
    return s


def logit_bias(v: Any, vocab: int) -> dict[str, float] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", f"expected an object mapping token ids to numbers, got {type_name(v)}")
    out: dict[str, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad("logit_bias", f"key {k!r} is not a token id") from None
        if not 0 <= tid < vocab:
            raise bad("logit_bias", f"token id {tid} is outside the vocabulary (0..{vocab - 1})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise bad("logit_bias", f"the bias of token {tid} must be a number")
        if not -100 <= b <= 100:
            raise bad("logit_bias", f"the bias of token {tid} must be in [-100, 100], got {b}")
        out[str(tid)] = float(b)
    return out
