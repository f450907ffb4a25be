"""The sampler on fixed logits, against numpy references that follow mlx-lm's definitions
(mlx_lm/sample_utils.py): exact support of top_p / min_p / top_k and their combination in mlx-lm's
order, draw frequencies against the reference distribution (chi-square), seeding, greedy,
logit_bias, parameter validation; and the logits processors (repetition, presence and frequency
penalties, logit_bias) through a Session on a tiny model, against numpy applied to
`Session.logits`."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

import mlxrs
from mlxrs import _native
from mlxrs.errors import InvalidArgumentError
from tinymodels import make_model

V = 64
# moderately peaked logits: a few dominant tokens and a long tail, every value distinct
LOGITS = (np.random.default_rng(20240611).normal(0.0, 2.0, V)).astype(np.float32)
NEG_INF = -np.inf


def native(logits: np.ndarray, draws: int = 0, **params: Any) -> tuple[np.ndarray, np.ndarray]:
    if "logit_bias" in params:
        params["logit_bias"] = {str(k): float(v) for k, v in params["logit_bias"].items()}
    filtered, out = _native._sample([float(x) for x in logits], json.dumps(params), draws)
    return np.array(filtered, dtype=np.float64), np.array(out, dtype=np.int64)


# -- numpy references (float64), written after mlx-lm's sample_utils ------------------------------
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def ref_top_p(lp: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the tokens whose cumulative probability, sorted ascending, exceeds 1 - top_p."""
    order = np.argsort(lp, kind="stable")
    cum = np.empty_like(lp)
    cum[order] = np.cumsum(np.exp(lp[order]))
    return np.where(cum > 1.0 - top_p, lp, NEG_INF)


def ref_min_p(lp: np.ndarray, min_p: float, min_keep: int = 1) -> np.ndarray:
    """Keep logprob >= max + log(min_p); the `min_keep` most likely tokens are always kept."""
    order = np.argsort(-lp, kind="stable")
    keep = lp >= np.max(lp) + math.log(min_p)
    keep[order[:min_keep]] = True
    return np.where(keep, lp, NEG_INF)


def ref_top_k(lp: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest."""
    order = np.argsort(-lp, kind="stable")
    out = np.full_like(lp, NEG_INF)
    out[order[:k]] = lp[order[:k]]
    return out


def ref_filter(
    lp: np.ndarray,
    *,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    min_tokens_to_keep: int = 1,
    order: str = "pmk",
) -> np.ndarray:
    """mlx-lm's make_sampler chain: top_p, then min_p, then top_k (`order` reorders, for controls)."""
    steps = {
        "p": lambda x: ref_top_p(x, top_p) if 0.0 < top_p < 1.0 else x,
        "m": lambda x: ref_min_p(x, min_p, min_tokens_to_keep) if min_p != 0.0 else x,
        "k": lambda x: ref_top_k(x, top_k) if 0 < top_k < len(x) else x,
    }
    for s in order:
        lp = steps[s](lp)
    return lp


def support(x: np.ndarray) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.isfinite(x))}


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for P, then Q = 1 - P
        term = s = 1.0 / a
        n = a
        for _ in range(10000):
            n += 1
            term *= z / n
            s += term
            if abs(term) < abs(s) * 1e-15:
                break
        return max(0.0, 1.0 - s * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction for Q (modified Lentz)
    tiny = 1e-300
    b = z + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi2_test(draws: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed draw counts against `probs`, pooling cells expected below 5."""
    n = len(draws)
    counts = np.bincount(draws, minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token outside the support was drawn"
    exp = probs * n
    order = np.argsort(-exp)
    cells_o, cells_e = [], []
    acc_o = acc_e = 0.0
    for i in order:
        if exp[i] == 0:
            continue
        acc_o += counts[i]
        acc_e += exp[i]
        if acc_e >= 5:
            cells_o.append(acc_o)
            cells_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # fold the remainder into the last cell
        cells_o[-1] += acc_o
        cells_e[-1] += acc_e
    o, e = np.array(cells_o), np.array(cells_e)
    if len(o) < 2:
        return 1.0
    stat = float(np.sum((o - e) ** 2 / e))
    return chi2_sf(stat, len(o) - 1)


def test_chi2_sf_reference_values():
    # textbook critical values
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(2.0, 4) == pytest.approx(math.exp(-1) * 2, abs=1e-12)  # Q(2,1) = e^-1 (1 + 1)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, abs=1e-6)


# -- the filtered log-probabilities: exact support ---------------------------------------------------
LP = log_softmax(LOGITS)


def _margin_top_p(lp: np.ndarray, top_p: float) -> float:
    order = np.argsort(lp)
    cum = np.cumsum(np.exp(lp[order]))
    return float(np.min(np.abs(cum - (1.0 - top_p))))


def test_unfiltered_logprobs_are_log_softmax():
    f, _ = native(LOGITS, temperature=1.0, seed=0)
    np.testing.assert_allclose(f, LP, atol=2e-5)


@pytest.mark.parametrize("k", [1, 2, 5, 17, 63])
def test_top_k_support(k):
    f, _ = native(LOGITS, temperature=1.0, top_k=k, seed=0)
    expected = set(np.argsort(-LP)[:k].tolist())
    assert support(f) == expected
    kept = sorted(expected)
    np.testing.assert_allclose(f[kept], LP[kept], atol=2e-5)
    assert support(ref_top_k(LP, k)) == expected


def test_top_k_at_or_above_vocab_keeps_everything():
    for k in (V, V + 10):
        f, _ = native(LOGITS, temperature=1.0, top_k=k, seed=0)
        assert support(f) == set(range(V))


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_support(top_p):
    assert _margin_top_p(LP, top_p) > 1e-5, "test logits too close to the threshold to be stable"
    f, _ = native(LOGITS, temperature=1.0, top_p=top_p, seed=0)
    # definition: sorted ascending, keep the tokens whose cumulative probability exceeds 1 - top_p
    order = np.argsort(LP)
    cum = np.cumsum(np.exp(LP[order]))
    expected = {int(order[i]) for i in range(V) if cum[i] > 1.0 - top_p}
    assert support(f) == expected
    assert support(ref_top_p(LP, top_p)) == expected
    # the kept set is the smallest most-likely prefix with mass >= top_p
    desc = np.argsort(-LP)
    n = len(expected)
    assert set(desc[:n].tolist()) == expected
    assert np.exp(LP[desc[:n]]).sum() >= top_p > np.exp(LP[desc[: n - 1]]).sum()
    np.testing.assert_allclose(f[sorted(expected)], LP[sorted(expected)], atol=2e-5)


@pytest.mark.parametrize("top_p", [0.0, 1.0])
def test_top_p_zero_or_one_disables(top_p):
    f, _ = native(LOGITS, temperature=1.0, top_p=top_p, seed=0)
    assert support(f) == set(range(V))


@pytest.mark.parametrize("min_p,keep", [(0.01, 1), (0.1, 1), (0.5, 1), (1.0, 1), (0.5, 4), (0.9, 10)])
def test_min_p_support(min_p, keep):
    thresh = LP.max() + math.log(min_p)
    others = np.delete(LP, np.argmax(LP))
    assert np.min(np.abs(others - thresh)) > 1e-5, "test logits too close to the threshold to be stable"
    f, _ = native(LOGITS, temperature=1.0, min_p=min_p, min_tokens_to_keep=keep, seed=0)
    expected = {i for i in range(V) if LP[i] >= thresh} | set(np.argsort(-LP)[:keep].tolist())
    assert support(f) == expected
    assert support(ref_min_p(LP, min_p, keep)) == expected
    if keep > 1:  # the min_tokens_to_keep floor is what decides these cases
        assert len({i for i in range(V) if LP[i] >= thresh}) < keep == len(expected)
    np.testing.assert_allclose(f[sorted(expected)], LP[sorted(expected)], atol=2e-5)


COMBOS = [
    dict(top_p=0.9, top_k=3),
    dict(top_p=0.95, min_p=0.05),
    dict(min_p=0.02, top_k=4),
    dict(top_p=0.97, min_p=0.03, top_k=6),
    dict(top_p=0.6, min_p=0.2, top_k=20),
]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_combined_filters_in_mlx_lm_order(combo):
    f, _ = native(LOGITS, temperature=1.0, seed=0, **combo)
    expected = ref_filter(LP, **combo)
    assert support(f) == support(expected)
    np.testing.assert_allclose(f[sorted(support(f))], expected[sorted(support(f))], atol=2e-5)


def test_filter_order_is_observable():
    # Filters act on unnormalized logprobs, so their order changes the support; the combinations
    # above include cases where any other order would give a different answer.
    differs = 0
    for combo in COMBOS:
        ours = support(ref_filter(LP, **combo))
        others = {support(ref_filter(LP, **combo, order=o)) == ours for o in ("pkm", "mpk", "mkp", "kpm", "kmp")}
        differs += False in others
    assert differs >= 3


# -- draws: greedy, seeding, frequencies -------------------------------------------------------------
def test_temperature_zero_is_argmax_whatever_the_filters():
    for params in ({}, {"top_k": 5}, {"top_p": 0.5, "min_p": 0.1}, {"seed": 3}):
        _, d = native(LOGITS, draws=20, temperature=0.0, **params)
        assert (d == int(np.argmax(LOGITS))).all()
    # the default temperature is 0
    _, d = native(LOGITS, draws=5)
    assert (d == int(np.argmax(LOGITS))).all()


def test_same_seed_reproduces_and_different_seeds_differ():
    params = dict(temperature=1.0, top_p=0.95, seed=1234)
    _, a = native(LOGITS, draws=300, **params)
    _, b = native(LOGITS, draws=300, **params)
    assert np.array_equal(a, b)
    _, c = native(LOGITS, draws=300, **{**params, "seed": 1235})
    assert not np.array_equal(a, c)
    # a sequence from one sampler is not one draw repeated
    assert len(set(a.tolist())) > 3
    # without a seed, two runs differ
    _, u1 = native(LOGITS, draws=300, temperature=1.0)
    _, u2 = native(LOGITS, draws=300, temperature=1.0)
    assert not np.array_equal(u1, u2)


DIST_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=8),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.8, min_p=0.03),
    dict(temperature=1.2, top_p=0.97, min_p=0.01, top_k=12),
]
N_DRAWS = 4000
P_MIN = (
    1e-4  # seeded, so deterministic here; still safe where MLX draws differently. A wrong distribution gives p < 1e-10
)


def _reference_probs(case: dict[str, Any]) -> np.ndarray:
    filt = ref_filter(LP, **{k: v for k, v in case.items() if k != "temperature"})
    z = filt / case["temperature"]
    z = z - np.max(z)
    p = np.where(np.isfinite(z), np.exp(z), 0.0)
    return p / p.sum()


@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [7, 2024])
def test_draw_frequencies_match_reference_distribution(case, seed):
    _, d = native(LOGITS, draws=N_DRAWS, seed=seed, **case)
    probs = _reference_probs(case)
    assert set(d.tolist()) <= support(np.where(probs > 0, 0.0, NEG_INF))
    p = chi2_test(d, probs)
    assert p > P_MIN, f"chi-square p = {p:.3g} for {case}"


def test_chi_square_detects_a_wrong_distribution():
    # the same draws tested against the unfiltered or untempered distribution must fail clearly
    _, d = native(LOGITS, draws=N_DRAWS, seed=7, temperature=1.0, top_k=8)
    assert chi2_test(d, _reference_probs(dict(temperature=1.0, top_k=8))) > P_MIN
    wrong = _reference_probs(dict(temperature=1.0, top_k=12))
    assert chi2_test(d, wrong) < 1e-10
    _, d2 = native(LOGITS, draws=N_DRAWS, seed=7, temperature=0.6)
    assert chi2_test(d2, _reference_probs(dict(temperature=1.0))) < 1e-10


# -- logit_bias on fixed logits ----------------------------------------------------------------------
def test_logit_bias_is_added_before_the_softmax():
    bias = {3: 2.5, 10: -4.0, int(np.argmax(LOGITS)): -1.0, 63: 0.75}
    f, _ = native(LOGITS, temperature=1.0, logit_bias=bias, seed=0)
    biased = LOGITS.astype(np.float64).copy()
    for k, v in bias.items():
        biased[k] += v
    np.testing.assert_allclose(f, log_softmax(biased), atol=2e-5)


def test_logit_bias_forces_and_bans_tokens():
    low = int(np.argmin(LOGITS))
    _, d = native(LOGITS, draws=50, temperature=1.0, seed=1, logit_bias={low: 100.0})
    assert (d == low).all()
    top = int(np.argmax(LOGITS))
    second = int(np.argsort(-LOGITS)[1])
    _, g = native(LOGITS, draws=3, temperature=0.0, logit_bias={top: -100.0})
    assert (g == second).all()
    # a banned token never appears in sampled draws either
    _, s = native(LOGITS, draws=2000, temperature=1.0, seed=2, logit_bias={top: -100.0})
    assert top not in set(s.tolist())


# -- validation ----------------------------------------------------------------------------------------
BAD = [
    dict(temperature=-0.5),
    dict(top_p=1.5),
    dict(top_p=-0.1),
    dict(min_p=1.2),
    dict(min_p=-0.1),
    dict(top_k=-1),
    dict(min_tokens_to_keep=0),
    dict(repetition_penalty=-1.0),
    dict(logit_bias={V: 1.0}),
    dict(logit_bias={-1: 1.0}),
    dict(logit_bias={"x": 1.0}),
]


@pytest.mark.parametrize("params", BAD, ids=lambda p: json.dumps(p))
def test_invalid_parameters_raise(params):
    with pytest.raises(InvalidArgumentError):
        native(LOGITS, draws=1, **params)


# -- logits processors through a Session -------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    d = make_model("llama-float32", "llama")
    with mlxrs.Session(d) as s:
        yield s


PROMPT = "The quick brown fox jumps over"


def _simulate(
    s: mlxrs.Session,
    prompt: list[int],
    n: int,
    *,
    bias: dict[int, float] | None = None,
    rep: float | None = None,
    rep_ctx: int = 20,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> tuple[list[int], list[float]]:
    """Greedy decoding in numpy on top of Session.logits: bias, then the repetition penalty
    (mlx-lm: negative logits multiplied, positive divided, over the last `rep_ctx` generated
    tokens), then presence/frequency (OpenAI: minus presence once, minus frequency per
    occurrence, over the generated tokens)."""
    out: list[int] = []
    lps: list[float] = []
    for _ in range(n):
        x = np.array(s.logits(prompt + out), dtype=np.float64)
        for k, v in (bias or {}).items():
            x[k] += v
        if rep is not None:
            for t in set(out[-rep_ctx:]):
                x[t] = x[t] * rep if x[t] < 0 else x[t] / rep
        if out:
            counts = np.bincount(out, minlength=len(x)).astype(np.float64)
            x -= presence * (counts > 0) + frequency * counts
        lp = log_softmax(x)
        t = int(np.argmax(lp))
        out.append(t)
        lps.append(float(lp[t]))
    return out, lps


def _check_against_simulation(s, ids, n, gen_kwargs, sim_kwargs):
    c = s.generate(ids, max_tokens=n, ignore_eos=True, logprobs=True, **gen_kwargs)
    want, want_lp = _simulate(s, ids, n, **sim_kwargs)
    assert c.tokens == want
    got_lp = [t.logprob for t in c.logprobs]
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-3)
    return c


N_PEN = 24


def test_greedy_matches_the_plain_simulation(session):
    ids = session.tokenize(PROMPT)
    c = _check_against_simulation(session, ids, N_PEN, {}, {})
    # the tiny model repeats itself greedily, so the penalties below have something to act on
    assert len(set(c.tokens)) < len(c.tokens)


@pytest.mark.parametrize("penalty,ctx", [(1.5, 20), (3.0, 9), (0.5, 6)])
def test_repetition_penalty(session, penalty, ctx):
    ids = session.tokenize(PROMPT)
    c = _check_against_simulation(
        session,
        ids,
        N_PEN,
        dict(repetition_penalty=penalty, repetition_context_size=ctx),
        dict(rep=penalty, rep_ctx=ctx),
    )
    plain = session.generate(ids, max_tokens=N_PEN, ignore_eos=True)
    assert c.tokens != plain.tokens  # the penalty changed the outcome


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.8), (0.7, 0.5), (-0.5, 0.0)])
def test_presence_and_frequency_penalties(session, presence, frequency):
    ids = session.tokenize(PROMPT)
    c = _check_against_simulation(
        session,
        ids,
        N_PEN,
        dict(presence_penalty=presence, frequency_penalty=frequency),
        dict(presence=presence, frequency=frequency),
    )
    plain = session.generate(ids, max_tokens=N_PEN, ignore_eos=True)
    assert c.tokens != plain.tokens


def test_bias_and_penalties_together(session):
    ids = session.tokenize(PROMPT)
    first = session.generate(ids, max_tokens=1, ignore_eos=True).tokens[0]
    bias = {first: -3.0, 7: 4.0, 100: 2.0}
    _check_against_simulation(
        session,
        ids,
        N_PEN,
        dict(
            logit_bias=bias,
            repetition_penalty=1.3,
            repetition_context_size=8,
            presence_penalty=0.4,
            frequency_penalty=0.3,
        ),
        dict(bias=bias, rep=1.3, rep_ctx=8, presence=0.4, frequency=0.3),
    )


def test_logit_bias_through_a_session(session):
    ids = session.tokenize(PROMPT)
    c = session.generate(ids, max_tokens=6, ignore_eos=True, temperature=1.0, seed=5, logit_bias={200: 100.0})
    assert c.tokens == [200] * 6


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=-1.0),
        dict(top_p=2.0),
        dict(top_k=-3),
        dict(min_p=1.5),
        dict(logit_bias={10_000: 1.0}),
        dict(max_tokens=-1),
        dict(frequency_penalty=float("inf")),
        dict(temperature=float("nan")),
        dict(no_such_option=1),
    ],
    ids=lambda p: next(iter(p)),
)
def test_invalid_parameters_raise_through_a_session(session, params):
    with pytest.raises(InvalidArgumentError):
        session.generate(PROMPT, **params)
    # the session keeps working
    assert len(session.generate(PROMPT, max_tokens=2, ignore_eos=True).tokens) == 2
