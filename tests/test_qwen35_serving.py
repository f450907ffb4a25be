"""Qwen3.5 (Gated DeltaNet linear attention, a recurrent cache) through the rest of mlxrs: the
stream API and a real `python -m mlxrs serve` process give mlx-lm 0.32.2's greedy tokens, for
concurrent requests of mixed lengths (batched decode over per-row recurrent states) and for a chat
turn that extends the previous one (served from the prompt-prefix cache)."""
from __future__ import annotations

import concurrent.futures

import openai

import mlxrs
from server_util import Server
from tinymodels import make_model

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
N = 20


def _ref(oracle, d, ids: list[int], *, eos: bool = False) -> list[int]:
    """mlx-lm's greedy tokens (with `eos`: up to its end-of-sequence token, id 0, as a server stops)."""
    toks = oracle({"model": str(d), "prompt": ids, "max_tokens": N, "kv_bits": None, "max_kv_size": None,
                   "prefill_step_size": 2048})["tokens"]
    return toks[:toks.index(0)] if eos and 0 in toks else toks


def test_stream_gives_mlxlm_tokens(oracle):
    d = make_model("qwen3_5-float32", "qwen3_5")
    with mlxrs.Session(d, prefill_step_size=16) as s:
        ids = s.tokenize(TEXT * 2)
        got = [c.token for c in s.stream(ids, max_tokens=N, ignore_eos=True, temperature=0.0) if c.token is not None and c.token >= 0]
    assert got == _ref(oracle, d, ids)


def test_one_and_two_token_prompts(oracle):
    """A prompt with nothing to prefill: the first decode step starts the recurrent state from zero."""
    d = make_model("qwen3_5-float32", "qwen3_5")
    with mlxrs.Session(d) as s:
        for ids in ([5], [7, 300]):
            got = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0)
            assert got.tokens == _ref(oracle, d, ids)


def test_server_concurrent_and_second_turn(oracle):
    d = make_model("qwen3_5-float32", "qwen3_5")
    with mlxrs.Session(d) as s:
        prompts = [s.tokenize(TEXT * k)[: 7 + 13 * k] for k in (1, 2, 3, 4)]
        refs = [_ref(oracle, d, p, eos=True) for p in prompts]
        want = [s.detokenize(r) for r in refs]
        turn2 = prompts[1] + refs[1] + s.tokenize(" And then?")
        want2 = s.detokenize(_ref(oracle, d, turn2, eos=True))
    with Server(d, "--max-concurrency", "4") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(p: list[int]) -> str:
            r = c.completions.create(model="m", prompt=p, max_tokens=N, temperature=0)
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(complete, prompts))
        assert got == want
        r = c.completions.create(model="m", prompt=turn2, max_tokens=N, temperature=0)
        assert r.choices[0].text == want2
        # the first turn's prompt and all but the last of its reply came from the prefix cache
        assert r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == len(prompts[1]) + len(refs[1]) - 1, r.usage
