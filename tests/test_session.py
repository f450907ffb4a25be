"""`mlxrs.Session` on tiny random-weight models, against independent oracles: the `tokenizers`
library (encode/decode straight from tokenizer.json), transformers (chat templates) and numpy
(log-probabilities from `Session.logits`). Covers generate/stream/chat agreement, stop strings,
stop tokens, max_tokens, EOS, multibyte UTF-8 streaming, seeding, concurrency and the GIL, close(),
and logprobs."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

import mlxrs
from mlxrs.errors import InvalidArgumentError
from chat_templates import TEMPLATES, chat_model, gemma4_template
from tinymodels import make_model

PROMPT = "The quick brown fox jumps over the lazy dog."
N = 40


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return make_model("llama-float32", "llama")


@pytest.fixture(scope="module")
def bos_dir() -> Path:
    return make_model("llama-bos", "llama", bos=True)


@pytest.fixture(scope="module")
def session(model_dir):
    with mlxrs.Session(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def hf(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


# -- tokenize / detokenize ---------------------------------------------------------------------------
TEXTS = [
    "",
    "Hello",
    PROMPT,
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "Über naïve café — 東京 and 北京, emoji 🙂🚀.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nhi<|im_end|>",
    "unseen: Ω≈ç√∫ 😀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.mark.parametrize("add_special", [True, False])
@pytest.mark.parametrize("which", ["plain", "bos"])
def test_tokenize_matches_tokenizers(which, add_special, model_dir, bos_dir):
    d = model_dir if which == "plain" else bos_dir
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    with mlxrs.Session(d) as s:
        for text in TEXTS:
            ids = s.tokenize(text, add_special_tokens=add_special)
            assert ids == tok.encode(text, add_special_tokens=add_special).ids, text
            if which == "bos" and add_special:
                assert ids[0] == tok.token_to_id("<s>")
            # round trip through both decoders
            assert s.detokenize(ids) == decode(tok, ids)
            assert s.detokenize(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


def test_detokenize_arbitrary_ids_matches_tokenizers(session, hf):
    rng = np.random.default_rng(0)
    vocab = session.info["vocab_size"]
    for _ in range(50):
        ids = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
        assert session.detokenize(ids) == decode(hf, ids)
        assert session.detokenize(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_detokenize_rejects_ids_outside_the_vocabulary(session):
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        session.detokenize([1, 2, 10_000])
    with pytest.raises(InvalidArgumentError):
        session.detokenize([-1])


def test_string_prompt_uses_the_tokenizers_bos_rule(bos_dir):
    tok = Tokenizer.from_file(str(bos_dir / "tokenizer.json"))
    with mlxrs.Session(bos_dir) as s:
        c = s.generate(PROMPT, max_tokens=1, ignore_eos=True)
        assert c.usage.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=True).ids)
        assert s.encode_prompt(PROMPT) == tok.encode(PROMPT).ids
        assert s.encode_prompt([5, 6, 7]) == [5, 6, 7]


# -- generate / stream / chat ------------------------------------------------------------------------
def _stream(s: mlxrs.Session, prompt: Any, **kw: Any) -> tuple[list[mlxrs.Chunk], mlxrs.Chunk]:
    chunks = list(s.stream(prompt, **kw))
    final = chunks[-1]
    assert final.finish_reason is not None and final.token is None and final.usage is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    return chunks[:-1], final


@pytest.fixture(scope="module")
def greedy(session):
    """The greedy continuation of PROMPT (ignore_eos), as a Completion and as stream chunks."""
    c = session.generate(PROMPT, max_tokens=N, ignore_eos=True)
    chunks, final = _stream(session, PROMPT, max_tokens=N, ignore_eos=True)
    return c, chunks, final


def test_generate_and_stream_agree(greedy, hf):
    c, chunks, final = greedy
    assert c.finish_reason == final.finish_reason == "length"
    assert len(c.tokens) == N
    assert [ch.token for ch in chunks if ch.token is not None] == c.tokens
    assert "".join(ch.text for ch in chunks) == c.text
    assert c.text == decode(hf, c.tokens)
    # the same prompt twice: the second run reuses the first's KV (all but the last prompt token)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (c.usage.prompt_tokens, N)
    assert final.usage.cached_tokens == c.usage.prompt_tokens - 1
    assert c.usage.completion_tokens == N and c.usage.total_tokens == c.usage.prompt_tokens + N
    t = c.timings
    assert t.prompt_seconds > 0 and t.generation_seconds > 0 and t.generation_tps > 0 and t.peak_memory > 0
    assert c.logprobs is None and c.stop_string is None


def test_string_messages_and_ids_prompts_agree(session, hf):
    ids = hf.encode(PROMPT).ids
    a = session.generate(PROMPT, max_tokens=8, ignore_eos=True)
    b = session.generate(ids, max_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens and a.usage.prompt_tokens == len(ids)


def test_chat_agrees_with_generate_and_with_transformers_prompt(session, model_dir):
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ref_ids = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True
    )
    ref_ids = list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)
    chat = session.chat(msgs, max_tokens=12)
    gen = session.generate(msgs, max_tokens=12)
    by_ids = session.generate(ref_ids, max_tokens=12)
    assert session.encode_prompt(msgs) == ref_ids
    assert chat.tokens == gen.tokens == by_ids.tokens
    assert chat.text == gen.text == by_ids.text
    assert chat.usage.prompt_tokens == len(ref_ids)
    # the chat stream yields the same tokens
    chunks, final = _stream(session, msgs, max_tokens=12)
    assert [c.token for c in chunks if c.token is not None] == chat.tokens
    assert final.finish_reason == chat.finish_reason


def test_closing_a_stream_early_cancels_it(session, greedy):
    before = session.info["cancelled"]
    it = session.stream(PROMPT, max_tokens=100_000, ignore_eos=True)
    next(it)
    it.close()
    t0 = time.perf_counter()
    c = session.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert time.perf_counter() - t0 < 30
    assert c.tokens == greedy[0].tokens
    assert session.info["cancelled"] == before + 1


# -- stop strings, stop tokens, max_tokens, EOS --------------------------------------------------------
def _boundary_stops(chunks: list[mlxrs.Chunk]) -> list[str]:
    """Stop strings that span a boundary between two streamed pieces of the greedy text."""
    out = []
    pieces = [c.text for c in chunks]
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 1 and len(b) >= 1 and "\ufffd" not in a + b:
            out.append(a[-2:] + b[:2])
    return out


def test_stop_string_split_across_tokens(session, greedy, hf):
    c_full, chunks, _ = greedy
    full = c_full.text
    stops = _boundary_stops(chunks)
    assert len(stops) >= 3
    for stop in stops[:: max(1, len(stops) // 5)]:
        idx = full.find(stop)
        assert idx >= 0
        c = session.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=stop)
        assert c.finish_reason == "stop" and c.stop_string == stop
        assert c.text == full[:idx], (stop, c.text, full)
        # generation ends on the token that completes the stop string
        n = next(k for k in range(1, N + 1) if stop in decode(hf, c_full.tokens[:k]))
        assert c.tokens == c_full.tokens[:n]
        # the stream never emits any part of the stop string
        sc, final = _stream(session, PROMPT, max_tokens=N, ignore_eos=True, stop=[stop])
        assert "".join(x.text for x in sc) == full[:idx]
        assert final.finish_reason == "stop"


def test_stop_strings_first_match_wins_and_absent_stops_are_harmless(session, greedy):
    full = greedy[0].text
    stops = _boundary_stops(greedy[1])
    early, late = stops[0], stops[-1]
    c = session.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=["\x00never\x00", late, early])
    first = min(full.find(early), full.find(late))
    assert c.text == full[:first]
    c = session.generate(PROMPT, max_tokens=N, ignore_eos=True, stop=["\x00never\x00"])
    assert c.text == full and c.finish_reason == "length" and c.stop_string is None


def test_stop_token_ids(session, greedy, hf):
    toks = greedy[0].tokens
    j = len(toks) // 2
    t = toks[j]
    first = toks.index(t)
    c = session.generate(PROMPT, max_tokens=N, ignore_eos=True, stop_token_ids=[t])
    assert c.finish_reason == "stop"
    assert c.tokens == toks[:first]  # the stop token itself is not part of the output
    assert c.text == decode(hf, toks[:first])
    assert c.usage.completion_tokens == first + 1  # but it was generated


@pytest.mark.parametrize("n", [0, 1, 5, 17])
def test_max_tokens(session, greedy, n):
    c = session.generate(PROMPT, max_tokens=n, ignore_eos=True)
    assert c.finish_reason == "length"
    assert c.tokens == greedy[0].tokens[:n]
    assert len(c.tokens) == c.usage.completion_tokens == n


def test_eos_stops(session):
    eos = session.info["eos_token_ids"]
    assert eos, "the tiny model declares an EOS id"
    e = eos[0]
    c = session.generate(PROMPT, max_tokens=10, logit_bias={e: 100.0})
    assert c.finish_reason == "stop" and c.tokens == [] and c.text == ""
    assert c.usage.completion_tokens == 1
    # ignore_eos keeps going through it
    c = session.generate(PROMPT, max_tokens=4, logit_bias={e: 100.0}, ignore_eos=True)
    assert c.finish_reason == "length" and c.tokens == [e] * 4


def test_eos_from_generation_config(tmp_path, model_dir, greedy):
    # an EOS id declared only in generation_config.json ends generation too
    toks = greedy[0].tokens
    t = toks[N // 2]
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, t]}))
    with mlxrs.Session(d) as s:
        assert t in s.info["eos_token_ids"] and 0 in s.info["eos_token_ids"]
        c = s.generate(PROMPT, max_tokens=N)
        assert c.finish_reason == "stop" and c.tokens == toks[: toks.index(t)]
        c = s.generate(PROMPT, max_tokens=N, ignore_eos=True)
        assert c.tokens == toks


# -- multibyte UTF-8 ------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _byte_ids(hf: Tokenizer, text: str) -> list[int]:
    table = _bytes_to_unicode()
    ids = [hf.token_to_id(table[b]) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


def _forced_cycle(ids: list[int]) -> dict[str, Any]:
    """Sampling options under which greedy decoding emits `ids` in order, cyclically: a huge bias
    ranks them, and a repetition penalty over the last len(ids)-1 tokens rules out all but the
    next one."""
    assert len(set(ids)) == len(ids)
    bias = {t: 400.0 - 20.0 * i for i, t in enumerate(ids)}
    return dict(logit_bias=bias, repetition_penalty=1000.0, repetition_context_size=len(ids) - 1, ignore_eos=True)


@pytest.mark.parametrize("text", ["東🙂", "é北😀", "ж€𝔘"])
def test_multibyte_characters_split_over_byte_tokens_stream_intact(session, hf, text):
    ids = _byte_ids(hf, text)
    n = 3 * len(ids)
    chunks, final = _stream(session, PROMPT, max_tokens=n, **_forced_cycle(ids))
    toks = [c.token for c in chunks if c.token is not None]
    assert toks == ids * 3
    for c in chunks:
        assert isinstance(c.text, str)
        c.text.encode("utf-8")  # valid UTF-8, no lone surrogates
        assert "\ufffd" not in c.text
    joined = "".join(c.text for c in chunks)
    assert joined == text * 3 == decode(hf, toks)
    # pieces are emitted as soon as a character is complete, never before
    assert [c.text for c in chunks if c.text] == [ch for ch in text * 3]
    g = session.generate(PROMPT, max_tokens=n, **_forced_cycle(ids))
    assert g.text == joined and g.tokens == toks


def test_generation_ending_inside_a_character(session, hf):
    ids = _byte_ids(hf, "東🙂")
    for n in (1, 2, 4, 5, 6):  # stops in the middle of a 3- or 4-byte character
        c = session.generate(PROMPT, max_tokens=n, **_forced_cycle(ids))
        assert c.tokens == (ids * 2)[:n]
        assert c.text == decode(hf, c.tokens)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_byte_soup_streams_like_a_full_decode(session, hf, seed):
    # sampled uniformly among the bytes of several multibyte characters: valid and invalid
    # sequences mixed; the stream must equal a one-shot decode of the same ids
    ids = _byte_ids(hf, "東🙂é")
    chunks, _ = _stream(
        session, PROMPT, max_tokens=60, temperature=1.0, seed=seed, ignore_eos=True, logit_bias={t: 200.0 for t in ids}
    )
    toks = [c.token for c in chunks if c.token is not None]
    assert set(toks) <= set(ids) and len(toks) == 60
    assert "".join(c.text for c in chunks) == decode(hf, toks)


def test_stop_string_made_of_multibyte_characters(session, hf):
    ids = _byte_ids(hf, "東🙂")
    c = session.generate(PROMPT, max_tokens=21, stop="🙂東", **_forced_cycle(ids))
    assert c.finish_reason == "stop" and c.text == "東"
    assert c.tokens == (ids * 2)[: len(ids) + 3]


# -- seeds ----------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(session):
    kw = dict(max_tokens=32, ignore_eos=True, temperature=1.0)
    a = session.generate(PROMPT, seed=42, **kw)
    b = session.generate(PROMPT, seed=42, **kw)
    c = session.generate(PROMPT, seed=43, **kw)
    assert a.tokens == b.tokens and a.text == b.text
    assert a.tokens != c.tokens
    s1, _ = _stream(session, PROMPT, seed=42, **kw)
    assert [x.token for x in s1 if x.token is not None] == a.tokens
    # top_p / top_k / min_p sampling is seeded as well
    kw2 = dict(kw, top_p=0.9, top_k=20, min_p=0.02)
    assert session.generate(PROMPT, seed=7, **kw2).tokens == session.generate(PROMPT, seed=7, **kw2).tokens


# -- threads ----------------------------------------------------------------------------------------------
def test_concurrent_generate_from_four_threads(session):
    prompts = [PROMPT, "Paris is the capital of", "def add(a, b):", "Numbers 0123456789 and"]
    expected = [session.generate(p, max_tokens=24, ignore_eos=True).tokens for p in prompts]
    results: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for r in range(3):
                if r == 1:
                    toks = [
                        c.token
                        for c in session.stream(prompts[i], max_tokens=24, ignore_eos=True)
                        if c.token is not None
                    ]
                else:
                    toks = session.generate(prompts[i], max_tokens=24, ignore_eos=True).tokens
                results[(i, r)] = toks
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 12
    for (i, _), toks in results.items():
        assert toks == expected[i]


def test_stream_releases_the_gil(model_dir):
    # One sequence at a time (max_concurrency=1): occupy the engine with a long generation, then ask
    # for another, which waits in the engine's queue, in native code, for its first event. A ticker
    # thread must keep running all that time.
    session = mlxrs.Session(model_dir, max_concurrency=1)
    started = threading.Event()
    done = threading.Event()

    def blocker() -> None:
        for _ in session.stream(PROMPT, max_tokens=600, ignore_eos=True):
            started.set()
        done.set()

    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    b = threading.Thread(target=blocker)
    b.start()
    assert started.wait(60)
    tk = threading.Thread(target=ticker)
    tk.start()
    try:
        t0 = time.perf_counter()
        it = session.stream(PROMPT, max_tokens=1, ignore_eos=True)
        first = next(it)
        t1 = time.perf_counter()
        list(it)
    finally:
        stop.set()
        tk.join()
        b.join()
        session.close()
    assert first.token is not None and done.is_set()
    wait = t1 - t0
    assert wait > 0.1, f"the blocking generation was too short to test anything ({wait:.3f}s)"
    inside = [t for t in ticks if t0 < t < t1]
    gaps = np.diff([t0, *inside, t1])
    assert len(inside) >= 10 and gaps.max() < wait / 3, (wait, len(inside), gaps.max())


# -- lifecycle --------------------------------------------------------------------------------------------
def test_close_and_context_manager(model_dir):
    with mlxrs.Session(model_dir) as s:
        assert not s.closed
        assert len(s.generate(PROMPT, max_tokens=2, ignore_eos=True).tokens) == 2
    assert s.closed
    for call in (
        lambda: s.generate(PROMPT, max_tokens=2),
        lambda: list(s.stream(PROMPT, max_tokens=2)),
        lambda: s.tokenize("x"),
        lambda: s.detokenize([1]),
        lambda: s.logits([1, 2]),
        lambda: s.apply_chat_template([{"role": "user", "content": "x"}]),
        lambda: s.chat([{"role": "user", "content": "x"}]),
    ):
        with pytest.raises(InvalidArgumentError, match="closed"):
            call()
    assert s.info["engine"] == {"state": "closed", "error": None}  # info still answers, and says so
    s.close()  # closing twice is harmless
    s2 = mlxrs.Session(model_dir)
    s2.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        s2.generate(PROMPT)


# -- logprobs -----------------------------------------------------------------------------------------------
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_logprobs_and_top_logprobs(session):
    ids = session.tokenize(PROMPT)
    c = session.generate(ids, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
    assert c.logprobs is not None and len(c.logprobs) == 6
    for i, lp in enumerate(c.logprobs):
        ref = _log_softmax(np.array(session.logits(ids + c.tokens[:i]), dtype=np.float32))
        tol = 1e-4 if i == 0 else 1e-3
        assert lp.id == c.tokens[i] == int(np.argmax(ref))
        assert lp.logprob == pytest.approx(ref[lp.id], abs=tol)
        assert len(lp.top) == 5
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert lp.top[0][0] == lp.id and lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)
        want = np.argsort(-ref)[:5]
        assert [t for t, _ in lp.top] == want.tolist()
        np.testing.assert_allclose(vals, ref[want], atol=tol)
    # logprobs alone: the chosen token's value, no alternatives; streamed chunks carry the same
    d = session.generate(ids, max_tokens=6, ignore_eos=True, logprobs=True)
    assert [x.top for x in d.logprobs] == [[]] * 6
    np.testing.assert_allclose([x.logprob for x in d.logprobs], [x.logprob for x in c.logprobs], atol=1e-6)
    chunks, _ = _stream(session, ids, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    toks = [x for x in chunks if x.token is not None]
    np.testing.assert_allclose([x.logprob for x in toks], [x.logprob for x in c.logprobs], atol=1e-6)
    assert all(len(x.top_logprobs) == 2 for x in toks)


def test_sampled_token_logprob(session):
    ids = session.tokenize(PROMPT)
    c = session.generate(ids, max_tokens=1, ignore_eos=True, temperature=1.0, seed=11, logprobs=True)
    ref = _log_softmax(np.array(session.logits(ids), dtype=np.float32))
    assert c.logprobs[0].logprob == pytest.approx(ref[c.tokens[0]], abs=1e-4)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def test_logprobs_are_float32_for_a_bfloat16_model():
    """Reported log-probabilities come from the float32 log-softmax of the (processed) logits, whatever
    the weights' dtype. logit_bias brings the two best tokens within a fraction of a nat of each other,
    so that their log-probabilities are not bfloat16 numbers (checked: bfloat16 would be off)."""
    with mlxrs.Session(make_model("qwen3-bfloat16", "qwen3", dtype="bfloat16"), prompt_cache_bytes=0) as s:
        ids = s.tokenize(PROMPT)
        x = np.array(s.logits(ids), dtype=np.float32)
        t1, t2 = (int(t) for t in np.argsort(-x)[:2])
        bias = {t2: float(x[t1] - x[t2]) + 0.37}
        # the processors (here the bias) run in the model's dtype, as in mlx-lm; the log-softmax in float32
        ref = _log_softmax(_bf16(x + np.array([bias.get(i, 0.0) for i in range(len(x))], dtype=np.float32)))
        assert np.abs(_bf16(ref[[t1, t2]]) - ref[[t1, t2]]).max() > 1e-4  # the test can tell
        for kw in ({}, {"temperature": 1.0, "seed": 5}):
            lp = s.generate(
                ids, max_tokens=1, ignore_eos=True, logprobs=True, top_logprobs=2, logit_bias=bias, **kw
            ).logprobs[0]
            assert lp.logprob == pytest.approx(ref[lp.id], abs=2e-5)
            assert [t for t, _ in lp.top] == [t2, t1]
            np.testing.assert_allclose([v for _, v in lp.top], ref[[t2, t1]], atol=2e-5)


# -- chat templates against transformers ----------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather — in °C or °F",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 東京"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "description": "The time", "parameters": {"type": "object", "properties": {}}},
    },
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello there!"}],
    "system_multi": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 東京 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  What is 2+2?  "},
    ],
    "tool_round": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    "thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "bad_roles": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}

# a probe of the variables transformers defines: tools is None when absent, None-valued message
# keys are dropped, special tokens, add_generation_prompt, template kwargs
PROBE = (
    "{{ bos_token }}|{{ eos_token }}|tools defined={{ tools is defined }} none={{ tools is none }}|"
    "{% for m in messages %}{{ m.role }}:{{ 'content' in m }}:{{ m | length }};{% endfor %}|"
    "{{ add_generation_prompt }}|{{ custom | default('no custom') }}"
)
ALL_TEMPLATES = {**TEMPLATES, "probe": PROBE, "gemma4": gemma4_template()}  # gemma4: llama.cpp's real one


@pytest.fixture(scope="module")
def template_models(tmp_path_factory, model_dir, bos_dir):
    """name -> (Session, transformers tokenizer) for each template, with and without a BOS token."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("templates")
    out = {}
    for name, tmpl in ALL_TEMPLATES.items():
        for bos in (False, True):
            d = chat_model(
                bos_dir if bos else model_dir, root / f"{name}-{bos}", tmpl, bos=bos, as_jinja_file=(name == "qwen3")
            )
            out[(name, bos)] = (mlxrs.Session(d), AutoTokenizer.from_pretrained(str(d)))
    yield out
    for s, _ in out.values():
        s.close()


def _render(fn, *args, **kw) -> str:
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return f"ERROR {e}"


@pytest.mark.parametrize("bos", [False, True], ids=["nobos", "bos"])
@pytest.mark.parametrize("name", list(ALL_TEMPLATES))
def test_apply_chat_template_matches_transformers(template_models, name, bos):
    s, tok = template_models[(name, bos)]
    compared = errors = 0
    for conv_name, conv in CONVERSATIONS.items():
        for agp in (True, False):
            for tools in (None, TOOLS):
                for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True, "custom": "X"}):
                    ref = _render(
                        tok.apply_chat_template, conv, tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs
                    )
                    ours = _render(s.apply_chat_template, conv, tools=tools, add_generation_prompt=agp, **kwargs)
                    where = f"{name} {conv_name} agp={agp} tools={tools is not None} {kwargs}"
                    if ref.startswith("ERROR"):
                        # transformers raised (raise_exception): so must we, with the template's message
                        assert ours.startswith("ERROR"), where
                        assert ref[len("ERROR ") :] in ours, (where, ref, ours)
                        with pytest.raises(InvalidArgumentError):
                            s.apply_chat_template(conv, tools=tools, add_generation_prompt=agp, **kwargs)
                        errors += 1
                        continue
                    assert ours == ref, where
                    compared += 1
                    if agp:
                        # and the prompt ids equal transformers' tokenized chat (no doubled BOS)
                        ids = tok.apply_chat_template(
                            conv, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
                        )
                        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                        assert s.encode_prompt(conv, tools=tools, template_kwargs=kwargs) == ids, where
    assert compared >= 20
    if name == "gemma":
        assert errors > 0  # bad_roles raised


def test_enable_thinking_changes_the_prompt(template_models):
    s, _ = template_models[("qwen3", False)]
    msgs = CONVERSATIONS["single"]
    off = s.apply_chat_template(msgs, enable_thinking=False)
    on = s.apply_chat_template(msgs, enable_thinking=True)
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
    # chat() passes template kwargs through
    a = s.chat(msgs, max_tokens=3, enable_thinking=False)
    b = s.generate(s.tokenize(off, add_special_tokens=False), max_tokens=3)
    assert a.tokens == b.tokens and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_template_errors_are_clear(template_models):
    s, _ = template_models[("gemma", True)]
    with pytest.raises(InvalidArgumentError, match="Conversation roles must alternate"):
        s.chat(CONVERSATIONS["bad_roles"], max_tokens=1)


def test_model_without_chat_template(tmp_path, model_dir):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with mlxrs.Session(d) as s:
        assert s.info["has_chat_template"] is False
        with pytest.raises(InvalidArgumentError, match="no chat template"):
            s.generate([{"role": "user", "content": "hi"}], max_tokens=1)
        assert len(s.generate(PROMPT, max_tokens=2, ignore_eos=True).tokens) == 2


# -- a second session in the same process ----------------------------------------------------------
SECOND_SESSION = r"""
import json, statistics, sys
import mlxrs
d = sys.argv[1]
speeds = []
for _ in range(2):
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        for _ in range(3):  # warm-up
            s.generate([1, 2, 3, 4], max_tokens=16, ignore_eos=True)
        runs = [s.generate(list(range(5, 37)), max_tokens=96, ignore_eos=True).timings.generation_tps
                for _ in range(7)]
        speeds.append(max(runs))
print(json.dumps(speeds))
"""


def test_second_session_decodes_as_fast_as_the_first(tmp_path: Path) -> None:
    """Two sessions opened in turn in one process decode within 10% of each other (issue #11: on an
    H200 a second session ran at 35-40% of the first's speed). In a fresh process, best of seven
    each: the other tests' sessions must not be what is measured. The machine's load changes while
    it runs (the parallel test run's other worker): each process's second session is held to the
    slower of its own first session and the next process's, measured right after it under the same
    load; up to three attempts. The slowdown this guards against makes every second session slower
    than every first one, and fails them all."""
    import subprocess
    import sys

    d = make_model("llama-second-session", "llama", hidden=512, layers=4, inter=1024)

    def speeds() -> tuple[float, float]:
        r = subprocess.run([sys.executable, "-c", SECOND_SESSION, str(d)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        first, second = json.loads(r.stdout.strip().splitlines()[-1])
        return float(first), float(second)

    seen = []
    now = speeds()
    for _ in range(3):
        after = speeds()
        (first, second), next_first = now, after[0]
        seen.append((round(first, 1), round(second, 1), round(next_first, 1)))
        if second >= 0.9 * min(first, next_first):
            return
        now = after
    raise AssertionError(f"second session slower than 90% of the first in every attempt (tok/s): {seen}")
