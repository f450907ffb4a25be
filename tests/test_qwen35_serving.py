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
    toks = oracle.generate(d, ids, N)["tokens"]
    return toks[: toks.index(0)] if eos and 0 in toks else toks


def test_stream_gives_mlxlm_tokens(oracle):
    d = make_model("qwen3_5-float32", "qwen3_5")
    with mlxrs.Session(d, prefill_step_size=16) as s:
        ids = s.tokenize(TEXT * 2)
        got = [
            c.token
            for c in s.stream(ids, max_tokens=N, ignore_eos=True, temperature=0.0)
            if c.token is not None and c.token >= 0
        ]
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


def _plan(d, ctx: int) -> dict:
    import json

    from mlxrs import _native

    return json.loads(_native.plan(str(d), ctx))


def test_the_plan_counts_the_recurrent_state_the_engine_holds():
    """The plan's kvBytes for a hybrid model is its full layers' KV plus one sequence's recurrent
    state (stateBytes), and equals the bytes of the cache arrays the engine keeps: every prompt-cache
    snapshot (the prompt's after its prefill, prompt and reply when the generation ends) holds exactly
    one plan's kvBytes, whatever its length within one KV growth step."""
    import json
    import time

    d = make_model("qwen3_5-float32", "qwen3_5")
    cfg = json.loads((d / "config.json").read_text())
    p = _plan(d, 40)
    full = sum(1 for i in range(cfg["num_hidden_layers"]) if (i + 1) % cfg["full_attention_interval"] == 0)
    kv = full * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 4 * 256  # float32, one step of 256 slots
    assert p["stateBytes"] > 0 and p["kvBytes"] == kv + p["stateBytes"]
    with mlxrs.Session(d, prompt_cache_bytes=1 << 30) as s:
        ids = s.tokenize(TEXT)[:30]
        s.generate(ids, max_tokens=8, ignore_eos=True, temperature=0.0)
        # the snapshot at the generation's end is taken after its last token is sent
        deadline = time.monotonic() + 10
        while (pc := s.info["prompt_cache"])["entries"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert pc["entries"] == 2, pc
    assert pc["bytes"] == 2 * p["kvBytes"], (pc, p)
    # a model without linear-attention layers has no stateBytes
    assert "stateBytes" not in _plan(make_model("qwen3-float32", "qwen3"), 40)


def test_a_budget_for_n_sequences_admits_n():
    """The scheduler admits against the plan's per-sequence bytes (KV and recurrent state): a KV budget
    of exactly N sequences' kvBytes runs N at once, one byte less N - 1, the others waiting."""
    import time

    d = make_model("qwen3_5-float32", "qwen3_5")
    n, prompt_len, max_tokens = 3, 20, 1000
    need = _plan(d, prompt_len + max_tokens)["kvBytes"]  # what one sequence is admitted against
    for budget, running in ((n * need, n), (n * need - 1, n - 1)):
        with mlxrs.Session(d, kv_budget_bytes=budget, max_concurrency=n + 1, prompt_cache_bytes=0) as s:
            ids = s.tokenize(TEXT * 2)[:prompt_len]
            opts = s._start_params(ids, {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
            streams = [s._s.start(ids, opts, None, None) for _ in range(n + 1)]
            try:
                for st in streams[:running]:  # the admitted ones decode
                    assert next(ev for ev in st if ev["type"] == "token")
                time.sleep(0.2)  # the engine publishes its counts after each iteration
                info = s.info
                assert (info["running"], info["waiting"]) == (running, n + 1 - running), (budget, info)
            finally:
                for st in streams:
                    st.cancel()
