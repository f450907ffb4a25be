"""OpenAI embeddings: POST /v1/embeddings, from the served (generative) model itself.

An embedding is the model's final normed hidden states (what its LM head reads) mean-pooled over the
input's tokens and L2-normalised (Session.embed): usable for similarity between texts, but a
generative model is no trained embedding model — expect weaker retrieval than a dedicated one.
"""

from __future__ import annotations

import base64
import functools
import sys
from array import array
from typing import Any

from aiohttp import web

from .app import STATE, ServerState, read_json
from .common import bad, opt_str, type_name

MAX_INPUTS = 2048


async def _ids(state: ServerState, item: Any, where: str) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise bad(where, "must not be an empty string")
        return await state.tokenize(item, param=where)
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        if any(not 0 <= t < state.vocab for t in item):
            raise bad(where, f"token ids must be inside the vocabulary (0..{state.vocab - 1})")
        return list(item)
    raise bad(where, f"expected a non-empty string or array of token ids, got {type_name(item)}")


def _b64(vec: list[float]) -> str:
    a = array("f", vec)
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    state.check_model(body.get("model"))
    fmt = opt_str(body, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f'expected "float" or "base64", got {fmt!r}')
    if body.get("dimensions") is not None:
        raise bad(
            "dimensions",
            f"is not supported: the embeddings have the model's hidden size ({state.info.get('hidden_size', '?')})",
        )
    inp = body.get("input")
    one = isinstance(inp, str) or (isinstance(inp, list) and bool(inp) and all(isinstance(t, int) for t in inp))
    items = [inp] if one else inp
    if not isinstance(items, list) or not items:
        raise bad("input", "expected a string, an array of strings, an array of token ids, or an array of those")
    if len(items) > MAX_INPUTS:
        raise bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
    data, n_tokens = [], 0
    for i, item in enumerate(items):
        where = "input" if one else f"input[{i}]"
        ids = await _ids(state, item, where)
        if len(ids) > state.context_tokens:
            raise state.over_ceiling(str(len(ids)), where)
        n_tokens += len(ids)
        vec = await state._blocking(functools.partial(_embed, state, ids))
        data.append({"object": "embedding", "index": i, "embedding": _b64(vec) if fmt == "base64" else vec})
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": state.model_id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/embeddings", embeddings)
    r.add_post("/embeddings", embeddings)


def _embed(state: ServerState, ids: list[int]) -> list[float]:
    return list(state.session._s.embed(ids))
