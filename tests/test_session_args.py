"""Session's generation options are checked, in one validator, by every entry point: a clear
TypeError or ValueError (InvalidArgumentError) instead of a silent default or a wrapped value."""

from __future__ import annotations

import asyncio
import json

import pytest

import mlxrs
from mlxrs.errors import ContextLengthError, InvalidArgumentError
from tinymodels import make_model


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """The tiny llama with a context of 64 tokens."""
    src = make_model("llama-float32", "llama")
    d = tmp_path_factory.mktemp("ctx64")
    for f in src.iterdir():
        if f.is_file():
            (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(
        json.dumps({**json.loads((src / "config.json").read_text()), "max_position_embeddings": 64})
    )
    with mlxrs.Session(d) as s:
        yield s


def _generate(s, **kw):
    return s.generate("hi", **kw)


def _stream(s, **kw):
    return s.stream("hi", **kw)  # raises when called, before the first chunk is asked for


def _astream(s, **kw):
    return s.astream("hi", **kw)


def _batch(s, **kw):
    return s.generate_batch(["hi", "ho"], **kw)


ENTRY_POINTS = [_generate, _stream, _astream, _batch]

BAD = [
    ({"max_tokens": 2**63}, InvalidArgumentError, "max_tokens"),
    ({"max_tokens": -1}, InvalidArgumentError, "max_tokens"),
    ({"max_tokens": 1.5}, TypeError, "max_tokens"),
    ({"max_tokens": "16"}, TypeError, "max_tokens"),
    ({"max_tokens": True}, TypeError, "max_tokens"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"temperature": -0.5}, InvalidArgumentError, "temperature"),
    ({"temperature": float("nan")}, InvalidArgumentError, "temperature"),
    ({"temperature": 10**400}, InvalidArgumentError, "temperature"),
    ({"top_p": "x"}, TypeError, "top_p"),
    ({"top_p": 1.5}, InvalidArgumentError, "top_p"),
    ({"min_p": -0.1}, InvalidArgumentError, "min_p"),
    ({"seed": -1}, InvalidArgumentError, "seed"),
    ({"seed": 2**64}, InvalidArgumentError, "seed"),
    ({"seed": 1.0}, TypeError, "seed"),
    ({"stop": 5}, TypeError, "stop"),
    ({"stop": [""]}, InvalidArgumentError, "stop"),
    ({"stop": ["a", None]}, TypeError, "stop"),
    ({"top_k": 2**40}, InvalidArgumentError, "top_k"),
    ({"top_k": -3}, InvalidArgumentError, "top_k"),
    ({"repetition_context_size": -1}, InvalidArgumentError, "repetition_context_size"),
    ({"repetition_penalty": -0.5}, InvalidArgumentError, "repetition_penalty"),
    ({"repetition_penalty": "x"}, TypeError, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, InvalidArgumentError, "logit_bias"),
    ({"logit_bias": {10**9: 1}}, InvalidArgumentError, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, InvalidArgumentError, "logit_bias"),
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias"),
    ({"stop_token_ids": [-1]}, InvalidArgumentError, "stop_token_ids"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos"),
    ({"logprobs": "yes"}, TypeError, "logprobs"),
    ({"top_logprobs": -1}, InvalidArgumentError, "top_logprobs"),
    ({"temprature": 0.5}, InvalidArgumentError, "temprature"),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize(
    "kw, exc, name", BAD, ids=[f"{next(iter(k))}={next(iter(k.values()))!r}"[:40] for k, _, _ in BAD]
)
def test_bad_option_is_refused(session, entry, kw, exc, name):
    before = session.info["requests"]
    with pytest.raises(exc, match=name):
        entry(session, **kw)
    assert session.info["requests"] == before  # refused before the engine saw anything


def test_valid_options_still_work(session):
    c = session.generate(
        "hi",
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=10**6,
        min_p=0.0,
        seed=2**64 - 1,
        stop=("zz", "yy"),
        repetition_penalty=1.1,
        repetition_context_size=0,
        logit_bias={"5": 1},
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(c.tokens) == 3 and len(c.logprobs[0].top) == 2
    assert session.generate("hi", max_tokens=0).tokens == []  # prefill only


def test_max_tokens_is_clamped_to_the_context(session):
    n_prompt = len(session.tokenize("hi"))
    for run in (
        lambda: session.generate("hi", max_tokens=10**6, ignore_eos=True).tokens,
        lambda: [c.token for c in session.stream("hi", max_tokens=10**6, ignore_eos=True) if c.token is not None],
        lambda: session.generate_batch(["hi"], max_tokens=2**62, ignore_eos=True)[0].tokens,
    ):
        assert len(run()) == 64 - n_prompt

    async def astream():
        return [c.token async for c in session.astream("hi", max_tokens=10**6, ignore_eos=True) if c.token is not None]

    assert len(asyncio.run(astream())) == 64 - n_prompt


def test_prompt_past_the_context_is_refused(session):
    with pytest.raises(ContextLengthError, match="64 tokens"):
        session.generate(list(range(1, 70)), max_tokens=1)
