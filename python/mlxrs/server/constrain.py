"""Constrained decoding in the HTTP APIs: OpenAI `response_format`, Anthropic `output_config.format`,
forced tool calls (`tool_choice` required / named, Anthropic any / tool) and the `mlxrs` extension
field (`{"mlxrs": {"grammar": …}}` or `{"mlxrs": {"regex": …}}`). Each returns the engine options
(`json_schema`, `json_object`, `regex` or `grammar`, see `Session.generate`); a grammar that does
not compile is refused by the engine at submission (a 400 naming the option)."""

from __future__ import annotations

from typing import Any

from .common import bad, type_name
from .errors import ApiError


def _schema(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad(param, f"expected a JSON Schema object, got {type_name(v)}")
    return v


def openai_response_format(body: dict[str, Any]) -> dict[str, Any]:
    """`response_format`: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    rf = body.get("response_format")
    if rf is None:
        return {}
    if not isinstance(rf, dict):
        raise bad("response_format", f"expected an object, got {type_name(rf)}")
    t = rf.get("type")
    if t in (None, "text"):
        return {}
    if t == "json_object":
        return {"json_object": True}
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("response_format.json_schema", 'expected {"name": …, "schema": {…}, "strict": true}')
        if "schema" not in js:  # OpenAI: no schema means any JSON object
            return {"json_object": True}
        return {"json_schema": _schema(js["schema"], "response_format.json_schema.schema")}
    raise bad("response_format.type", f'expected "text", "json_object" or "json_schema", got {t!r}')


def anthropic_output_config(body: dict[str, Any]) -> dict[str, Any]:
    """`output_config.format` {type: json_schema, schema} (what `messages.parse(output_format=…)` sends)."""
    oc = body.get("output_config")
    if oc is None:
        return {}
    if not isinstance(oc, dict):
        raise bad("output_config", f"expected an object, got {type_name(oc)}")
    fmt = oc.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format", 'expected {"type": "json_schema", "schema": {…}}')
    return {"json_schema": _schema(fmt.get("schema"), "output_config.format.schema")}


def extension(body: dict[str, Any]) -> dict[str, Any]:
    """`mlxrs: {"grammar": "<Lark>"}` or `mlxrs: {"regex": "…"}` (an mlxrs extension)."""
    ext = body.get("mlxrs")
    if ext is None:
        return {}
    if not isinstance(ext, dict):
        raise bad("mlxrs", f"expected an object, got {type_name(ext)}")
    out: dict[str, Any] = {}
    for k, v in ext.items():
        if k not in ("grammar", "regex"):
            raise bad(f"mlxrs.{k}", 'unknown option (expected "grammar" or "regex")')
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise bad(f"mlxrs.{k}", f"expected a non-empty string, got {type_name(v)}")
        out[k] = v
    return out


def tool_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON of one call of `name` (None: any of `tools`): {"name": …, "arguments": {…}}, with the
    arguments following the tool's parameters schema. The output parser reads such an object as a
    tool call for every model (events.OutputParser: a JSON object at the start of the output)."""
    options = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def combine(**parts: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The request's constraint and the field that asked for it. At most one per request: two (a
    response format and a forced tool call, say) is a 400."""
    found = [(k, v) for k, v in parts.items() if v]
    if len(found) > 1:
        raise bad(found[1][0], f"only one constraint per request ({' and '.join(k for k, _ in found)} were given)")
    return found[0][1] if found else {}, found[0][0] if found else None


def naming(e: ApiError, param: str | None) -> ApiError:
    """The engine's refusal of a grammar ("json_schema: …") as a 400 naming the request's field."""
    if param and e.status == 400 and e.message.split(":", 1)[0] in ("json_schema", "json_object", "regex", "grammar"):
        return bad(param, e.message)
    return e
