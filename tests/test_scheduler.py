"""The engine's scheduler, against its own single-sequence runs (which test_parity.py holds to
mlx-lm): batched prefill (prompts admitted together share prefill passes) and batched decoding give
each sequence the greedy tokens it gets alone, for every architecture and cache kind (parting only at
a near-tie, `same_or_parting_at_a_tie`); a prompt-prefix cache hit gives exactly the cold run's tokens; a
cancelled sequence leaves the others untouched; a cancel during a long prefill ends within a chunk;
close() cancels promptly; the queue refuses past its bound."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

import mlxrs
from mlxrs.errors import BusyError
from tinymodels import make_model

TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Rust and Python meet in the middle, one token at a time."
)
N = 40


def prompts(s: mlxrs.Session) -> list[list[int]]:
    """8 prompts of mixed lengths (3 to ~70 tokens): every row of a batch at its own offset."""
    ids = s.tokenize(TEXT)
    lengths = [3, 70, 11, 25, 5, 48, 17, 33]
    return [(ids * 3)[i : i + n] for i, n in enumerate(lengths)]


def same_or_parting_at_a_tie(alone: mlxrs.Completion, batch: mlxrs.Completion, what: str, tol: float) -> None:
    """The batched run's greedy tokens are alone's, each at a log-probability within `tol` of alone's;
    or they part at a step where alone's own top log-probabilities hold the batched token within `tol`
    of alone's choice (a near-tie), after which the two sequences differ. On Linux CPU a float32 row
    decoded alone goes through BLAS gemv and a batch through sgemm, which sum in another order, so
    rows agree to the last bits only, not bit for bit (a quantized KV cache turns those bits into a
    rounding step now and then: hence its larger `tol`); a row mixed up with another's state is off by
    far more than a tie."""
    assert alone.logprobs is not None and batch.logprobs is not None
    for j, (a, b) in enumerate(zip(alone.logprobs, batch.logprobs)):
        if a.id != b.id:
            top = dict(a.top)
            assert b.id in top and top[a.id] - top[b.id] <= tol, f"{what}: tokens part at {j}, not at a tie: {a} {b}"
            return
        assert a.logprob is not None and b.logprob is not None
        assert abs(a.logprob - b.logprob) <= tol, f"{what}: token {j}'s log-probability {b.logprob} vs {a.logprob}"
    assert len(batch.tokens) == len(alone.tokens), what


CASES = [
    ("llama", {"stack": 1}),  # MLXRS_BATCH_KV=1: the stacked KV (the default on GPUs only)
    ("llama", {}),
    ("qwen2", {"stack": 1}),
    ("qwen3", {"stack": 1}),
    ("gemma3_text", {}),  # window 16, pattern 2: every prompt and generation runs past the window
    ("llama", {"kv_bits": 8}),
    ("qwen3", {"kv_bits": 4}),
    ("qwen3_moe", {"stack": 1}),  # routed experts per row: a batch row must not change another's
    ("qwen3_moe", {}),
    ("gemma4_text", {}),  # KV-shared layers reading a rotating and a growing cache, per row
    ("gemma4_text_moe", {"kv_bits": 8}),  # ... reading a quantized cache
    ("gemma4_text_full", {"stack": 1}),  # every layer global: the stacked KV, KV-shared layers included
    # linear-attention layers: never stacked (a recurrent state per row, batched per step)
    ("qwen3_5", {"stack": 1}),
    ("qwen3_next", {}),
    ("qwen3_5_moe", {}),
    ("mixtral", {"stack": 1}),
    ("mixtral", {}),
    ("glm4_moe", {"stack": 1}),
    ("glm4_moe", {}),
    ("gpt_oss", {}),  # window 16 every other layer, attention sinks, biased experts
    ("deepseek_v3", {"stack": 1}),  # the stacked KV holding MLA's latents and rope keys
    ("deepseek_v3", {}),
    ("deepseek_v32", {"stack": 1}),  # the indexer (top 16 positions): per-row attention even when asked to stack
    ("glm_moe_dsa", {}),
    ("mistral4", {"stack": 1}),  # the stacked KV with Llama 4's query scale at every row's own position
    ("mistral4", {}),
    ("mistral3", {}),  # the same text model through its multimodal wrapper
    ("ministral3", {"stack": 1}),  # Llama 4's query scale at every row's own position over the stacked KV
    ("ministral3", {}),  # ... and over per-row caches
]
RECURRENT = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


@pytest.mark.parametrize(
    "arch,opts", CASES, ids=[f"{a}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'plain'}" for a, o in CASES]
)
def test_batch_equals_alone(arch, opts, monkeypatch):
    opts = dict(opts)
    if "stack" in opts:
        monkeypatch.setenv("MLXRS_BATCH_KV", str(opts.pop("stack")))
    monkeypatch.delenv("MLXRS_BATCH_PREFILL", raising=False)
    # a quantized KV cache: rows share a prefill pass only where their chunks end as they would
    # alone (a chunk attends over the earlier chunks' quantized keys): chunks of 16, the longer
    # prompts share them
    step = {"prefill_step_size": 16} if "kv_bits" in opts else {}
    d = make_model(f"{arch}-float32", arch)
    with mlxrs.Session(d, prompt_cache_bytes=0, prefill_batch_tokens=2048, **step, **opts) as s:
        ps = prompts(s)
        greedy = dict(max_tokens=N, ignore_eos=True, temperature=0.0, top_logprobs=3)
        alone = [s.generate(p, **greedy) for p in ps]
        batch = s.generate_batch(ps, **greedy)
        info = s.info
    tol = 5e-2 if "kv_bits" in opts else 1e-3  # measured: 3.2e-2 and 1.6e-5 at most (float32 weights)
    for i, (a, b) in enumerate(zip(alone, batch)):
        same_or_parting_at_a_tie(a, b, f"prompt {i} ({len(ps[i])} tokens)", tol)
        assert b.finish_reason == "length" and b.usage.completion_tokens == N
    # which attention ran: the stacked KV exactly where asked for and every layer keeps a full cache
    sliding = arch in ("gemma3_text", "gemma4_text", "gemma4_text_moe", "gpt_oss")
    unstackable = ("deepseek_v32", "glm_moe_dsa")  # the indexer's choice depends on a row's own length
    stacked = (
        not sliding and arch not in RECURRENT + unstackable and not opts and os.environ.get("MLXRS_BATCH_KV") == "1"
    )
    assert info["decode_steps"] > 0
    # the decode steps' host time, by phase: each measured, none more than the wall time of the run
    host = info["decode_host_seconds"]
    assert set(host) == {"build", "submit", "read"} and all(0 < v < 600 for v in host.values()), host
    assert (info["stacked_decode_steps"] > N // 2) if stacked else (info["stacked_decode_steps"] == 0)
    # the 8 prompts were admitted together and prefilled in shared passes
    assert info["prefill_max_rows"] >= (5 if step else 7), info
    assert info["prefill_rows"] > info["prefill_steps"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_join_and_leave_a_running_batch(arch, monkeypatch):
    """Sequences finishing at different steps leave holes in the stacked KV, later ones join into
    them (and past them), holes get compacted: every sequence still gets exactly its tokens alone."""
    monkeypatch.setenv("MLXRS_BATCH_KV", "1")
    d = make_model(f"{arch}-float32", arch)
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ps = prompts(s) + [p[::-1] for p in prompts(s)][:6]
        lengths = [6, 40, 3, 22, 9, 31, 14, 27, 5, 18, 36, 8, 12, 25]
        alone = [s.generate(p, max_tokens=n, ignore_eos=True).tokens for p, n in zip(ps, lengths)]

        def start(i: int) -> Any:
            return s._s.start(ps[i], mlxrs.session._params(dict(max_tokens=lengths[i], ignore_eos=True)))

        first = [start(i) for i in range(8)]
        got: dict[int, list[int]] = {}
        # drain the shortest two, then add the rest while the others run
        for i in (2, 0):
            got[i] = mlxrs.session._collect(iter(first[i]), False).tokens
        late = {i: start(i) for i in range(8, len(ps))}
        for i, st in [(i, first[i]) for i in range(8) if i not in got] + list(late.items()):
            got[i] = mlxrs.session._collect(iter(st), False).tokens
        info = s.info
    for i, a in enumerate(alone):
        assert got[i] == a, f"sequence {i}: tokens differ from alone"
    assert info["stacked_decode_steps"] > 0


def test_batch_with_mixed_lengths_and_sampling(tmp_path):
    """Rows with their own max_tokens, stop strings and (seeded) sampling: each as alone."""
    d = make_model("qwen3-float32", "qwen3")
    kinds = [
        dict(max_tokens=5),
        dict(max_tokens=31, temperature=0.8, seed=7),
        dict(max_tokens=17, top_k=5, temperature=1.0, seed=3),
        dict(max_tokens=0),
        dict(max_tokens=23, repetition_penalty=1.3),
    ]
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ps = prompts(s)[: len(kinds)]
        alone = [s.generate(p, ignore_eos=True, **k) for p, k in zip(ps, kinds)]
        streams = [s._s.start(p, mlxrs.session._params(dict(ignore_eos=True, **k))) for p, k in zip(ps, kinds)]
        together = [mlxrs.session._collect(iter(st), False) for st in streams]
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason


# deepseek_v3: the cached latents and rope keys; deepseek_v32: the indexer's keys beside them;
# mistral4: a prefill after a hit attends with its concatenated rope over the cached latents
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "deepseek_v32", "mistral4", "ministral3"])
def test_prefix_cache_hit_gives_the_cold_tokens(arch):
    d = make_model(f"{arch}-float32", arch)
    with mlxrs.Session(d, prompt_cache_bytes=0) as cold, mlxrs.Session(d) as warm:
        ids = cold.tokenize(TEXT)
        first = ids[:40]
        longer = ids[:40] + ids[5:30]  # extends the first prompt
        diverging = ids[:25] + ids[50:60]  # shares 25 tokens with it
        for p in (first, longer, diverging, longer):
            want = cold.generate(p, max_tokens=N, ignore_eos=True)
            got = warm.generate(p, max_tokens=N, ignore_eos=True)
            assert got.tokens == want.tokens
        assert got.usage.cached_tokens == len(longer) - 1  # the last one: the whole prompt but one token
        info = warm.info["prompt_cache"]
        assert info["hits"] >= 3 and info["cached_tokens"] >= 40 + 25 and info["bytes"] > 0


def test_multi_turn_chat_hits_the_cache(tmp_path):
    """A conversation resent with one more turn reuses the previous turn's KV (prompt and reply)."""
    from chat_templates import TEMPLATES, chat_model

    d = chat_model(make_model("qwen3-float32", "qwen3"), tmp_path / "qwen3-chat", TEMPLATES["qwen3"], bos=False)
    with mlxrs.Session(d) as s, mlxrs.Session(d, prompt_cache_bytes=0) as cold:
        msgs = [{"role": "user", "content": "Tell me about foxes."}]
        for turn in range(3):
            r = s.chat(msgs, max_tokens=12)
            ref = cold.chat(msgs, max_tokens=12)
            assert r.tokens == ref.tokens
            if turn:
                # everything before the new user turn came from the cache
                assert r.usage.cached_tokens > 0.6 * r.usage.prompt_tokens, r.usage
            msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"And then {turn}?"}]


def test_cancel_one_leaves_the_others_unchanged():
    d = make_model("qwen2-float32", "qwen2")
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ps = prompts(s)[:4]
        alone = [s.generate(p, max_tokens=N, ignore_eos=True).tokens for p in ps]
        streams = [s._s.start(p, mlxrs.session._params(dict(max_tokens=N, ignore_eos=True))) for p in ps]
        got: list[list[int]] = [[] for _ in ps]
        ends: list[str | None] = [None] * len(ps)
        live = set(range(len(ps)))
        while live:
            for i in sorted(live):
                ev = next(streams[i])
                if ev["type"] == "token" and ev["id"] >= 0:
                    got[i].append(ev["id"])
                    if i == 1 and len(got[i]) == 5:
                        streams[i].cancel()
                elif ev["type"] == "done":
                    ends[i] = ev["finish_reason"]
                    live.discard(i)
    assert ends[1] == "cancelled" and 5 <= len(got[1]) < N and got[1] == alone[1][: len(got[1])]
    for i in (0, 2, 3):
        assert ends[i] == "length" and got[i] == alone[i]
    assert s.closed


def test_cancel_during_a_long_prefill_ends_within_a_chunk():
    d = make_model("llama-float32", "llama")
    with mlxrs.Session(d, prefill_step_size=16, prompt_cache_bytes=0) as s:
        ids = (s.tokenize(TEXT) * 40)[:1500]  # ~94 chunks of 16
        st = s._s.start(ids, mlxrs.session._params(dict(max_tokens=4)))
        progress = []
        for ev in st:
            if ev["type"] == "progress":
                progress.append(ev["done"])
                if len(progress) == 3:
                    st.cancel()
            elif ev["type"] == "done":
                assert ev["finish_reason"] == "cancelled"
                break
        # the cancel is seen before the next chunk or the one after (the engine may be inside one)
        assert len(progress) <= 5 and progress[-1] < len(ids) // 2, progress


@pytest.mark.parametrize("off", ["env", "option"])
def test_batched_prefill_switches_off(off, monkeypatch):
    """MLXRS_BATCH_PREFILL=0 or prefill_batch_tokens=0: one prompt per prefill pass, the same tokens."""
    d = make_model("llama-float32", "llama")
    with mlxrs.Session(d, prompt_cache_bytes=0, prefill_batch_tokens=2048) as s:
        ps = prompts(s)
        on = s.generate_batch(ps, max_tokens=8, ignore_eos=True)
        assert s.info["prefill_max_rows"] >= 2
    if off == "env":
        monkeypatch.setenv("MLXRS_BATCH_PREFILL", "0")
    kw = {"prefill_batch_tokens": 0} if off == "option" else {}
    with mlxrs.Session(d, prompt_cache_bytes=0, **kw) as s:
        got = s.generate_batch(ps, max_tokens=8, ignore_eos=True)
        info = s.info
    assert [r.tokens for r in got] == [r.tokens for r in on]
    assert info["prefill_max_rows"] == 1 and info["prefill_rows"] == info["prefill_steps"] == len(ps)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_prefill_batch_tokens_is_checked(bad):
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        mlxrs.Session(make_model("llama-float32", "llama"), prefill_batch_tokens=bad)


def test_cancel_during_a_batched_prefill_leaves_the_others_unchanged():
    d = make_model("qwen3-float32", "qwen3")
    with mlxrs.Session(d, prefill_step_size=8, prefill_batch_tokens=2048, prompt_cache_bytes=0) as s:
        ids = s.tokenize(TEXT) * 12
        ps = [ids[i : i + 300 + 16 * i] for i in range(5)]  # ~40 chunks of 8 each
        alone = [s.generate(p, max_tokens=6, ignore_eos=True).tokens for p in ps]
        params = mlxrs.session._params(dict(max_tokens=6, ignore_eos=True))
        hold = s._s.hold()  # admitted together
        streams = [s._s.start(p, params) for p in ps]
        hold.release()
        progress = []
        for ev in streams[2]:
            if ev["type"] == "progress" and ev["done"] > 0:
                progress.append(ev["done"])
                streams[2].cancel()
            elif ev["type"] == "token" and ev["id"] >= 0:
                pytest.fail("the cancelled prompt produced a token")
            elif ev["type"] == "done":
                assert ev["finish_reason"] == "cancelled"
                break
        assert progress and progress[0] < len(ps[2]) // 2, progress
        got = [mlxrs.session._collect(iter(st), False) for i, st in enumerate(streams) if i != 2]
        info = s.info
    assert [g.tokens for g in got] == [a for i, a in enumerate(alone) if i != 2]
    assert info["prefill_max_rows"] >= 4 and info["cancelled"] == 1


def test_close_cancels_running_generations_promptly():
    d = make_model("llama-float32", "llama")
    s = mlxrs.Session(d, prompt_cache_bytes=0)
    ends: list[str] = []

    def run() -> None:
        for ch in s.stream(TEXT, max_tokens=100000, ignore_eos=True):
            if ch.finish_reason:
                ends.append(ch.finish_reason)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    s.close()
    t.join(10)
    assert not t.is_alive() and ends == ["cancelled"]
    assert time.perf_counter() - t0 < 5


def test_queue_bound_refuses_with_busy():
    d = make_model("llama-float32", "llama")
    with mlxrs.Session(d, max_concurrency=1, max_queue=1, prompt_cache_bytes=0) as s:
        a = s._s.start([1, 2, 3], mlxrs.session._params(dict(max_tokens=2000, ignore_eos=True)))
        b = s._s.start([1, 2, 3], mlxrs.session._params(dict(max_tokens=5, ignore_eos=True)))
        with pytest.raises(BusyError):
            s._s.start([1, 2, 3], mlxrs.session._params(dict(max_tokens=5)))
        a.cancel()
        assert [e for e in b][-1]["finish_reason"] == "length"
        info = s.info
        assert info["rejected"] == 1
    assert info["requests"] == info["served"] + info["cancelled"] + info["rejected"] + info["failed"] + info["inflight"]


def test_astream_runs_concurrently_on_one_loop():
    d = make_model("llama-float32", "llama")
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ps = prompts(s)[:4]
        alone = [s.generate(p, max_tokens=N, ignore_eos=True).tokens for p in ps]

        async def one(p: list[int]) -> list[int]:
            return [c.token async for c in s.astream(p, max_tokens=N, ignore_eos=True) if c.token is not None]

        async def main() -> list[list[int]]:
            return await asyncio.gather(*(one(p) for p in ps))

        assert asyncio.run(main()) == alone
