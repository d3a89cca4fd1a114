"""Speculative sampling is exact: what it emits follows the target's distribution.

1. The rejection step alone (`_core.speculative_sample_histogram`: d ~ q, then
   accept with min(1, p/q), else sample normalize(max(p - q, 0))): chi-square
   and total variation against p on small vocabularies, with numpy-simulated
   wrong samplers as negative controls (the same bounds must reject them), and
   the accept rate against sum(min(p, q)).
2. `_core.target_distribution`: temperature / top-k / typical / top-p / min-p against a
   numpy implementation, and against libllama's own sampler chain built the way
   llama-cpp-python builds it (top_k, typical, top_p, min_p, temp);
   `_core.mirostat_step` against libllama's Mirostat v1 / v2 samplers row after row;
   `_core.shape_logits` (logit bias, repeat / frequency / presence penalties)
   against libllama's logit-bias and penalties samplers.
3. End to end on the bundled pair at T = 1: the 2nd and 3rd generated tokens
   (produced by verification / the bonus draw) of many seeded speculative runs
   against plain decoding (two-sample chi-square) and against the exact marginal
   computed from the target's logits (one-sample), for draft_q "logits" and "selector";
   with penalties, the 2nd token against the penalized marginal; likewise with typical_p
   and Mirostat (whose mu is also replayed over the emitted tokens, and whose 1st token
   is checked against llama_cpp.Llama's own draws).

scipy is not needed: chi-square critical values come from the Wilson-Hilferty
approximation (conservative for small df).
"""

from __future__ import annotations

import collections
import ctypes
import time
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest

from dflash_gguf import _core

N_DRAWS = 200_000
ALPHA = 1e-6  # per chi-square test; the tests are seeded, so this only guards against unlucky seeds
TV_BOUND = 0.01  # a correct sampler on <= 16 tokens with 2e5 draws has TV ~ 3e-3


def chi2_crit(df: int, alpha: float = ALPHA) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty (slightly high for df <= 2: conservative)."""
    if df <= 0:
        return float("inf")
    z = NormalDist().inv_cdf(1.0 - alpha)
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


def chi2_one_sample(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of counts against probs, bins with expected < min_expected pooled; (stat, df)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= min_expected
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any() and exp[~big].sum() > 0:
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    o, e = np.array(obs_b, float), np.array(exp_b, float)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def chi2_two_sample(a: np.ndarray, b: np.ndarray, min_count: int = 10) -> tuple[float, int]:
    """Two-sample chi-square homogeneity statistic; bins with a + b < min_count pooled; (stat, df)."""
    na, nb = a.sum(), b.sum()
    big = (a + b) >= min_count
    aa, bb = list(a[big]), list(b[big])
    if (~big).any() and (a[~big].sum() + b[~big].sum()) > 0:
        aa.append(a[~big].sum())
        bb.append(b[~big].sum())
    x, y = np.array(aa, float), np.array(bb, float)
    k1, k2 = np.sqrt(nb / na), np.sqrt(na / nb)
    return float(((k1 * x - k2 * y) ** 2 / (x + y)).sum()), len(x) - 1


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


# --------------------------------------------------------------------------- #
# 1. the rejection step
# --------------------------------------------------------------------------- #


def _norm(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


V = 12
_r = np.random.default_rng(42)
_base = _norm(_r.dirichlet(np.ones(V)))
CASES: dict[str, tuple[np.ndarray, np.ndarray]] = {
    "equal": (_base, _base.copy()),
    "disjoint": (
        _norm(np.r_[_r.dirichlet(np.ones(6)), np.zeros(6)]),
        _norm(np.r_[np.zeros(6), _r.dirichlet(np.ones(6))]),
    ),
    "overlapping": (
        _norm([0.30, 0.22, 0.15, 0.10, 0.08, 0.06, 0.05, 0.04, 0, 0, 0, 0]),
        _norm([0.02, 0.05, 0.30, 0.03, 0.20, 0.01, 0.04, 0.05, 0.10, 0.10, 0.05, 0.05]),
    ),
    "one_hot_p": (_norm(np.eye(V)[4]), _norm(_r.dirichlet(np.ones(V)))),
    "one_hot_q": (_norm(_r.dirichlet(np.ones(V))), _norm(np.eye(V)[4])),
    "q_sharper": (_norm(np.exp(np.linspace(1.0, 0.0, V))), _norm(np.exp(np.linspace(4.0, 0.0, V)))),
    "p_sharper": (_norm(np.exp(np.linspace(4.0, 0.0, V))), _norm(np.exp(np.linspace(1.0, 0.0, V)))),
}


# exact output distributions of samplers given p, q (float64)
def out_correct(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p.astype(np.float64)


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def out_residual_from_p(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Wrong: on rejection sample from p instead of max(p - q, 0)."""
    p, q = p.astype(np.float64), q.astype(np.float64)
    acc = np.minimum(p, q)
    return acc + (1.0 - acc.sum()) * p


def out_accept_q_over_p(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Wrong: accept with min(1, q/p) (ratio inverted)."""
    p, q = p.astype(np.float64), q.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, np.minimum(1.0, q / np.where(p > 0, p, 1.0)), 0.0)
    acc = q * a
    return acc + (1.0 - acc.sum()) * _residual(p, q)


def out_always_accept(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Wrong: no verification at all (emit the draft)."""
    return q.astype(np.float64)


WRONG = {
    "residual_from_p": out_residual_from_p,
    "accept_q_over_p": out_accept_q_over_p,
    "always_accept": out_always_accept,
}


def simulate(p: np.ndarray, q: np.ndarray, rule: str, n: int, seed: int) -> np.ndarray:
    """A numpy speculative sampler (correct or one of the wrong rules); returns counts."""
    rng = np.random.default_rng(seed)
    p, q = p.astype(np.float64), q.astype(np.float64)
    p, q = p / p.sum(), q / q.sum()
    d = rng.choice(len(q), size=n, p=q)
    u = rng.random(n)
    if rule == "accept_q_over_p":
        ratio = np.where(p[d] > 0, q[d] / np.where(p[d] > 0, p[d], 1.0), 0.0)
    elif rule == "always_accept":
        ratio = np.ones(n)
    else:
        ratio = p[d] / q[d]
    accepted = u < ratio
    resid = p if rule == "residual_from_p" else _residual(p, q)
    out = np.where(accepted, d, rng.choice(len(p), size=n, p=resid))
    return np.bincount(out, minlength=len(p))


def exactness_failures(counts: np.ndarray, p: np.ndarray) -> list[str]:
    """The acceptance criteria for 'counts follow p'; empty when they hold."""
    p = p.astype(np.float64)
    p = p / p.sum()
    fails = []
    if counts[p == 0].sum() != 0:
        fails.append(f"{int(counts[p == 0].sum())} draws on tokens p gives zero mass")
    emp = counts / counts.sum()
    if tv(emp, p) >= TV_BOUND:
        fails.append(f"TV {tv(emp, p):.4f} >= {TV_BOUND}")
    support = p > 0
    if support.sum() > 1:
        stat, df = chi2_one_sample(counts[support], p[support])
        if stat > chi2_crit(df):
            fails.append(f"chi-square {stat:.1f} > {chi2_crit(df):.1f} (df {df})")
    return fails


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_step_is_exact(case: str) -> None:
    p, q = CASES[case]
    counts, n_acc = _core.speculative_sample_histogram(p, q, N_DRAWS, 1000 + len(case))
    counts = np.asarray(counts)
    assert counts.sum() == N_DRAWS
    fails = exactness_failures(counts, p)
    assert not fails, f"{case}: {fails}"

    # accept rate = sum(min(p, q)) (binomial, 5 sigma)
    a = float(np.minimum(p.astype(np.float64), q).sum())
    sigma = np.sqrt(max(a * (1 - a), 1e-12) / N_DRAWS)
    assert abs(n_acc / N_DRAWS - a) < 5 * sigma + 1e-6, (case, n_acc / N_DRAWS, a)

    # positive control: the numpy sampler of the same rule passes the same criteria
    assert not exactness_failures(simulate(p, q, "correct", N_DRAWS, 7), p)

    from tinycode import record

    pp = p.astype(np.float64) / p.sum()
    stat, df = chi2_one_sample(counts[pp > 0], pp[pp > 0]) if (pp > 0).sum() > 1 else (0.0, 0)
    record(
        f"rejection_{case}",
        {
            "draws": N_DRAWS,
            "tv": tv(counts / N_DRAWS, pp),
            "tv_bound": TV_BOUND,
            "chi2": stat,
            "df": df,
            "chi2_crit": chi2_crit(df),
            "accept_rate": n_acc / N_DRAWS,
            "sum_min_pq": a,
            "wrong_rule_tv_from_p": {k: tv(law(p, q), pp) for k, law in WRONG.items()},
        },
    )


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_samplers_are_rejected(case: str) -> None:
    """Negative controls: every wrong rule that changes the output distribution by
    more than 2 x TV_BOUND fails the criteria test_rejection_step_is_exact applies."""
    p, q = CASES[case]
    caught = []
    for name, law in WRONG.items():
        bias = tv(law(p, q), out_correct(p, q))
        if bias < 2 * TV_BOUND:
            continue  # this rule happens to be (nearly) right for this p, q
        fails = exactness_failures(simulate(p, q, name, N_DRAWS, 11), p)
        assert fails, f"{case}: the wrong rule {name} (TV {bias:.3f} from p) passed the criteria"
        caught.append(name)
    if case in ("overlapping", "q_sharper", "p_sharper"):
        assert set(caught) >= {"residual_from_p", "accept_q_over_p"}, caught


def test_rejection_step_details() -> None:
    # one-hot p: the emitted token is always p's token
    p, q = CASES["one_hot_p"]
    counts, _ = _core.speculative_sample_histogram(p, q, 10_000, 3)
    assert np.asarray(counts)[4] == 10_000
    # equal p and q: everything is accepted
    p, q = CASES["equal"]
    _, n_acc = _core.speculative_sample_histogram(p, q, 10_000, 3)
    assert n_acc == 10_000
    # disjoint supports: nothing is
    p, q = CASES["disjoint"]
    _, n_acc = _core.speculative_sample_histogram(p, q, 10_000, 3)
    assert n_acc == 0
    # the same seed gives the same histogram
    p, q = CASES["overlapping"]
    a = _core.speculative_sample_histogram(p, q, 5_000, 9)
    b = _core.speculative_sample_histogram(p, q, 5_000, 9)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    with pytest.raises(ValueError):
        _core.speculative_sample_histogram(p, q[:5], 10, 0)
    with pytest.raises(ValueError):
        _core.speculative_sample_histogram(np.zeros(V, np.float32), q, 10, 0)


def test_is_argmax_is_greedy_decodings_choice() -> None:
    """The greedy verify accepts a row's drafted token when is_argmax says so: it must agree with argmax
    (the first of the largest logits) for every token, ties and -inf rows included."""
    rng = np.random.default_rng(7)
    rows = [rng.normal(0, 3, 151_936).astype(np.float32) for _ in range(3)]
    coarse = np.round(rng.normal(0, 1, 4_099), 0).astype(np.float32)  # many ties, the max among them
    masked = np.full(1_000, -np.inf, np.float32)
    masked[[3, 500, 999]] = 2.0  # a grammar-masked row: three allowed tokens tied
    rows += [coarse, masked, np.zeros(17, np.float32)]
    for row in rows:
        best = int(np.argmax(row))
        ties = np.flatnonzero(row == row[best])
        probe = {0, best, len(row) - 1, *ties.tolist(), *rng.integers(0, len(row), 50).tolist()}
        for token in sorted(probe):
            assert _core.is_argmax(row, token) == (token == best), (token, best, len(ties))
        assert not _core.is_argmax(row, -1) and not _core.is_argmax(row, len(row))


# --------------------------------------------------------------------------- #
# 2. target_distribution
# --------------------------------------------------------------------------- #


def np_llama_chain(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """llama.cpp's / llama-cpp-python's chain: top_k, top_p, min_p on the raw logits, then temperature."""
    lg = logits.astype(np.float64)
    order = np.argsort(-lg, kind="stable")
    if 0 < top_k < len(lg):
        order = order[:top_k]
    kept = lg[order]
    if top_p < 1.0:
        pr = np.exp(kept - kept.max())
        pr /= pr.sum()
        cum = np.cumsum(pr)
        n = int(np.searchsorted(cum, top_p) + 1)  # first index with cum >= top_p, inclusive
        order, kept = order[:n], kept[:n]
    if min_p > 0.0:
        keep = kept >= kept.max() + np.log(min_p)
        keep[0] = True
        order, kept = order[keep], kept[keep]
    pr = np.exp((kept - kept.max()) / temperature)
    out = np.zeros(len(lg))
    out[order] = pr / pr.sum()
    return out


def run_libllama_chain(
    logits: np.ndarray, samplers: list[Any], accepted: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Apply a libllama sampler chain of `samplers` (which it then owns) to `logits`, after it accepted
    `accepted`; returns the surviving ids and their logits."""
    from llama_cpp import llama_cpp as llc

    n = len(logits)
    arr = (llc.llama_token_data * n)()
    for i in range(n):
        arr[i].id, arr[i].logit, arr[i].p = i, float(logits[i]), 0.0
    cur = llc.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)
    chain = llc.llama_sampler_chain_init(llc.llama_sampler_chain_default_params())
    try:
        for smpl in samplers:
            llc.llama_sampler_chain_add(chain, smpl)
        for t in accepted:
            llc.llama_sampler_accept(chain, t)
        llc.llama_sampler_apply(chain, ctypes.byref(cur))
        ids = np.array([cur.data[i].id for i in range(cur.size)])
        lg = np.array([cur.data[i].logit for i in range(cur.size)], np.float64)
    finally:
        llc.llama_sampler_free(chain)
    return ids, lg


def libllama_chain(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution libllama's sampler chain samples from, built as llama_cpp.Llama._init_sampler does."""
    from llama_cpp import llama_cpp as llc

    ids, lg = run_libllama_chain(
        logits,
        [
            llc.llama_sampler_init_top_k(top_k),
            llc.llama_sampler_init_typical(1.0, 1),
            llc.llama_sampler_init_top_p(top_p, 1),
            llc.llama_sampler_init_min_p(min_p, 1),
            llc.llama_sampler_init_temp(temperature),
        ],
    )
    pr = np.exp(lg - lg.max())
    out = np.zeros(len(logits))
    out[ids] = pr / pr.sum()
    return out


_lr = np.random.default_rng(5)
LOGITS = [
    (2.0 * _lr.standard_normal(64)).astype(np.float32),
    (0.5 * _lr.standard_normal(300)).astype(np.float32),
    np.sort(3.0 * _lr.standard_normal(40)).astype(np.float32)[::-1].copy(),
]
# parameter sets on which the order of temperature vs the top-p / min-p cuts does not matter
ORDER_FREE = [
    (1.0, 0, 1.0, 0.0),
    (0.5, 0, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (0.7, 10, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.1),
    (1.0, 0, 1.0, 0.5),
    (1.0, 20, 0.9, 0.05),
    (1.0, 1, 0.9, 0.05),
    (0.3, 1, 1.0, 0.0),
    (1.0, 0, 1e-6, 0.0),
    (1.0, 0, 0.0, 0.0),  # top_p 0: the most likely token alone
    (1.0, 5, 0.0, 0.0),
]
# llama-cpp-python's create_completion defaults and other T != 1 with a top-p / min-p cut
ORDER_SENSITIVE = [
    (0.8, 40, 0.95, 0.05),
    (0.5, 0, 0.9, 0.0),
    (2.0, 0, 1.0, 0.1),
    (0.2, 0, 1.0, 0.05),
    (1.5, 0, 0.8, 0.0),
]


@pytest.mark.parametrize("params", ORDER_FREE, ids=str)
def test_target_distribution_shapes(params: tuple[float, int, float, float]) -> None:
    T, k, top_p, min_p = params
    for lg in LOGITS:
        ours = np.asarray(_core.target_distribution(lg, T, k, top_p, min_p), np.float64)
        assert abs(ours.sum() - 1.0) < 1e-5
        np.testing.assert_allclose(ours, np_llama_chain(lg, T, k, top_p, min_p), atol=2e-6, rtol=1e-4)
        np.testing.assert_allclose(ours, libllama_chain(lg, T, k, top_p, min_p), atol=2e-6, rtol=1e-4)
        support = ours > 0
        if k > 0:
            assert support.sum() <= k
            assert set(np.nonzero(support)[0]) <= set(np.argsort(-lg, kind="stable")[:k])
        if top_p < 1.0 and k == 0 and min_p == 0.0:
            # the smallest set of most probable tokens whose mass reaches top_p
            full = np.exp(lg.astype(np.float64) - lg.max())
            full /= full.sum()
            kept = np.sort(full[support])[::-1]
            assert kept.sum() >= top_p - 1e-6
            assert kept[:-1].sum() < top_p + 1e-6
        if min_p > 0.0 and T == 1.0:
            assert ours[support].min() >= min_p * ours.max() * (1 - 1e-5)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0], ids=["flat", "mid", "peaked"])
def test_top_p_over_a_large_vocabulary(scale: float) -> None:
    """Top-p without top-k finds its nucleus by selection, not by sorting the vocabulary: on a Qwen-sized
    vocabulary, from flat (a nucleus of ~140k tokens) to peaked, with many ties (broken by id), the
    same tokens and probabilities as the sorted reference."""
    rng = np.random.default_rng(11)
    lg = (scale * rng.standard_normal(151936)).astype(np.float32)
    tied = (np.round(lg * 4) / 4).astype(np.float32)  # a few dozen distinct values
    for logits in (lg, tied):
        for top_p, min_p in ((0.95, 0.0), (0.5, 0.0), (0.9, 0.05), (1e-6, 0.0)):
            ours = np.asarray(_core.target_distribution(logits, 0.8, 0, top_p, min_p), np.float64)
            ref = np_llama_chain(logits, 0.8, 0, top_p, min_p)
            assert np.array_equal(ours > 0, ref > 0), (top_p, min_p, (ours > 0).sum(), (ref > 0).sum())
            np.testing.assert_allclose(ours, ref, atol=1e-9, rtol=1e-4)


def test_temperature_sharpens_and_flattens() -> None:
    lg = LOGITS[0]
    ent = []
    for T in (0.25, 0.5, 1.0, 2.0, 4.0):
        pr = np.asarray(_core.target_distribution(lg, T), np.float64)
        nz = pr[pr > 0]
        ent.append(float(-(nz * np.log(nz)).sum()))
        z = lg.astype(np.float64) / T
        ref = np.exp(z - z.max())
        np.testing.assert_allclose(pr, ref / ref.sum(), atol=2e-6, rtol=1e-4)
    assert all(a < b for a, b in zip(ent, ent[1:])), ent
    with pytest.raises(ValueError):
        _core.target_distribution(lg, 0.0)


@pytest.mark.parametrize("params", ORDER_SENSITIVE, ids=str)
def test_target_distribution_matches_llama_chain_when_temperature_is_not_one(
    params: tuple[float, int, float, float],
) -> None:
    T, k, top_p, min_p = params
    for lg in LOGITS:
        ref = libllama_chain(lg, T, k, top_p, min_p)
        np.testing.assert_allclose(np_llama_chain(lg, T, k, top_p, min_p), ref, atol=2e-6, rtol=1e-4)
        ours = np.asarray(_core.target_distribution(lg, T, k, top_p, min_p), np.float64)
        np.testing.assert_allclose(ours, ref, atol=2e-6, rtol=1e-4)


def libllama_shaped(
    logits: np.ndarray,
    generated: list[int],
    repeat: float,
    freq: float,
    present: float,
    last_n: int,
    bias: dict[int, float],
) -> np.ndarray:
    """The logits after libllama's logit-bias and penalties samplers, the penalties having accepted `generated`."""
    from llama_cpp import llama_cpp as llc

    n = len(logits)
    samplers = []
    if bias:
        lb = (llc.llama_logit_bias * len(bias))(*[llc.llama_logit_bias(token=t, bias=b) for t, b in bias.items()])
        samplers.append(llc.llama_sampler_init_logit_bias(n, len(bias), lb))
    samplers.append(llc.llama_sampler_init_penalties(n, last_n, repeat, freq, present))
    ids, lg = run_libllama_chain(logits, samplers, generated)
    out = np.empty(n, np.float32)
    out[ids] = lg
    return out


# (repeat, frequency, presence, last_n, bias): last_n below the history's length drops its old tokens
PENALTIES = [
    (1.3, 0.0, 0.0, 64, {}),
    (1.0, 0.4, 0.0, 64, {}),
    (1.0, 0.0, 0.7, 64, {}),
    (1.5, 0.2, 0.3, 8, {}),
    (0.8, -0.1, 0.2, 3, {}),
    (1.0, 0.0, 0.0, 64, {3: 2.5, 7: -4.0, 11: -float("inf")}),
    (1.2, 0.1, 0.1, 0, {5: 1.0}),
    (1.3, 0.5, 0.5, 64, {2: 1.5, 9: -0.5}),
]


@pytest.mark.parametrize("params", PENALTIES, ids=str)
def test_shaped_logits_match_llama_samplers(params: tuple) -> None:
    """logit_bias and repeat / frequency / presence penalties as libllama's own samplers apply them, including
    the sign rule (a negative logit is multiplied by the repeat penalty) and the window's eviction."""
    repeat, freq, present, last_n, bias = params
    rng = np.random.default_rng(11)
    for trial in range(4):
        lg = (3.0 * rng.standard_normal(40)).astype(np.float32)
        generated = [int(t) for t in rng.integers(0, 16, size=int(rng.integers(1, 100)))]
        ours = np.asarray(_core.shape_logits(lg, generated, repeat, freq, present, last_n, bias))
        np.testing.assert_array_equal(
            ours,
            libllama_shaped(lg, generated, repeat, freq, present, last_n, bias),
            err_msg=f"trial {trial}, {len(generated)} generated",
        )
        if repeat != 1.0 or freq or present or bias:
            assert not np.array_equal(ours, lg)  # the case shapes something


# (temperature, top_k, top_p, min_p, typical_p): typical alone over a whole vocabulary (its quickselect),
# after top-k, before top-p (which then orders what typical left), with llama-cpp-python's defaults
TYPICAL = [
    (1.0, 0, 1.0, 0.0, 0.9),
    (1.0, 0, 1.0, 0.0, 0.3),
    (0.8, 40, 0.95, 0.05, 0.5),
    (1.0, 0, 0.9, 0.0, 0.7),
    (1.3, 100, 1.0, 0.0, 0.2),
    (1.0, 0, 0.5, 0.1, 0.95),
    (0.7, 0, 1.0, 0.0, 1e-6),
    (1.0, 0, 1.0, 0.0, 0.0),  # typical_p 0: the most typical token alone
]


@pytest.mark.parametrize("params", TYPICAL, ids=str)
def test_typical_p_is_libllama_s(params: tuple[float, int, float, float, float]) -> None:
    """Locally typical sampling in llama-cpp-python's chain (top-k, typical, top-p, min-p, temperature):
    the tokens whose surprise is nearest the entropy, not the most likely ones."""
    from llama_cpp import llama_cpp as llc

    T, k, top_p, min_p, typical = params
    rng = np.random.default_rng(3)
    moved = 0.0
    for trial in range(6):
        V = int(rng.integers(30, 5000))
        lg = (rng.uniform(0.3, 3.0) * rng.standard_normal(V)).astype(np.float32)
        ours = np.asarray(_core.target_distribution(lg, T, k, top_p, min_p, typical), np.float64)
        ids, kept = run_libllama_chain(
            lg,
            [
                llc.llama_sampler_init_top_k(k),
                llc.llama_sampler_init_typical(typical, 1),
                llc.llama_sampler_init_top_p(top_p, 1),
                llc.llama_sampler_init_min_p(min_p, 1),
                llc.llama_sampler_init_temp(T),
            ],
        )
        theirs = np.zeros(V)
        theirs[ids] = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
        # libllama sums the typical mass in float: a token at the boundary may fall either way
        assert len(set(np.nonzero(ours)[0]) ^ set(ids.tolist())) <= 1, (trial, V)
        assert tv(ours, theirs) < 1e-4, (trial, V, tv(ours, theirs))
        moved = max(moved, tv(ours, np.asarray(_core.target_distribution(lg, T, k, top_p, min_p), np.float64)))
    assert moved > 1e-3  # the cut changes something


def libllama_mirostat_steps(
    rows: list[np.ndarray], mode: int, tau: float, eta: float, seed: int
) -> list[tuple[set[int], int]]:
    """llama.cpp's Mirostat sampler applied to `rows` in turn (its mu moving with each token it draws):
    per row, the tokens it kept and the one it drew."""
    from llama_cpp import llama_cpp as llc

    V = len(rows[0])
    smpl = (
        llc.llama_sampler_init_mirostat(V, seed, tau, eta, 100)
        if mode == 1
        else llc.llama_sampler_init_mirostat_v2(seed, tau, eta)
    )
    out = []
    try:
        for lg in rows:
            arr = (llc.llama_token_data * V)()
            for i in range(V):
                arr[i].id, arr[i].logit, arr[i].p = i, float(lg[i]), 0.0
            cur = llc.llama_token_data_array(data=arr, size=V, selected=-1, sorted=False)
            llc.llama_sampler_apply(smpl, ctypes.byref(cur))
            out.append(({cur.data[i].id for i in range(cur.size)}, cur.data[cur.selected].id))
    finally:
        llc.llama_sampler_free(smpl)
    return out


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_is_libllama_s(mode: int) -> None:
    """Mirostat v1 / v2 as libllama's samplers: at each of 8 rows in turn the same tokens kept (our mu
    following the tokens libllama drew) and the softmax of their logits; mu moves (the kept sets change
    size from row to row with the same logits), so a wrong update would show from the second row on."""
    rng = np.random.default_rng(mode)
    sizes = []
    for trial in range(6):
        V = int(rng.integers(200, 4000))
        base = (rng.uniform(0.5, 3.0) * rng.standard_normal(V)).astype(np.float32)
        rows = [base] * 4 + [(base + rng.standard_normal(V)).astype(np.float32) for _ in range(4)]
        tau, eta = float(rng.uniform(1.0, 6.0)), float(rng.uniform(0.3, 1.5))
        mu = 2.0 * tau
        for r, (kept, drawn) in enumerate(libllama_mirostat_steps(rows, mode, tau, eta, seed=trial)):
            ours, mu = _core.mirostat_step(rows[r], mode, tau, eta, mu, drawn)
            ours = np.asarray(ours, np.float64)
            assert set(np.nonzero(ours)[0]) == kept, (trial, r, len(kept), int((ours > 0).sum()))
            lk = rows[r][sorted(kept)].astype(np.float64)
            np.testing.assert_allclose(
                ours[sorted(kept)], np.exp(lk - lk.max()) / np.exp(lk - lk.max()).sum(), rtol=1e-4, atol=1e-7
            )
            sizes.append(len(kept))
    assert len(set(sizes[:4])) > 1 or len(set(sizes)) > 4  # mu moved the cut


# --------------------------------------------------------------------------- #
# 3. end to end on the bundled pair
# --------------------------------------------------------------------------- #

E2E_PROMPT = 7  # bench prompt with a spread next-token distribution and drafts that are often accepted
E2E_RUNS = 1500  # per arm
E2E_ALPHA = 1e-4
STOP = -1  # the generation ended (end-of-generation token) before this position


@pytest.fixture(scope="module")
def e2e() -> dict:
    pytest.importorskip("llama_cpp")
    from tinycode import N_CTX, TARGET, THREADS, GreedyReference, drafter_gguf, prompts

    from dflash_gguf import SpeculativeLlama

    draft = str(drafter_gguf("f32"))
    # a fixed n_max: these tests are about the drafted path's rejection sampling, and "auto" rightly decodes
    # plainly where drafting does not pay (at T = 1 on a 2-core AMD EPYC: 0 drafted steps, nothing tested)
    specs = {
        q: SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, draft_q=q, n_max=3)
        for q in ("logits", "selector")
    }
    ref = GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS)
    toks = ref.tokenize(prompts()[E2E_PROMPT]["text"])
    return {"specs": specs, "ref": ref, "toks": toks, "cache": {}}


def _histograms(
    spec, toks: list[int], plain: bool, runs: int, seed0: int, temperature: float = 1.0, **options: float
) -> dict:
    pos = {1: collections.Counter(), 2: collections.Counter()}
    acc = steps = 0
    t0 = time.perf_counter()
    for s in range(runs):
        out = (
            list(
                spec.generate_tokens(
                    toks,
                    max_tokens=3,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    min_p=0.0,
                    seed=seed0 + s,
                    plain=plain,
                    **options,
                )
            )
            + [STOP] * 3
        )
        pos[1][out[1]] += 1
        pos[2][out[2]] += 1
        acc += spec.stats.accepted
        steps += spec.stats.steps - spec.stats.plain_steps
    return {"pos": pos, "accepted_per_step": acc / max(steps, 1), "seconds": time.perf_counter() - t0}


def _exact_second_token(
    ref, toks: list[int], temperatures: tuple[float, ...], vocab: int, typical_p: float = 1.0, **penalties: float
) -> list[np.ndarray]:
    """P(2nd generated token) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), per temperature, the
    penalties (if any) seeing t1 at the second; index vocab = STOP (the first token was the end of generation)."""
    from tinycode import EOS

    def dist(lg: np.ndarray, T: float, generated: list[int]) -> np.ndarray:
        shaped = _core.shape_logits(lg, generated, **penalties)
        return np.asarray(_core.target_distribution(shaped, T, typical_p=typical_p), np.float64)

    lg1 = ref.logits_after(toks)
    p1_hot = np.maximum.reduce([dist(lg1, T, []) for T in temperatures])
    cands = [int(t) for t in np.nonzero(p1_hot > 1e-5)[0] if t != EOS]
    lg2 = ref.next_logits(toks, cands)
    outs = []
    for T in temperatures:
        p1 = dist(lg1, T, [])
        out = np.zeros(vocab + 1)
        out[vocab] = p1[EOS]
        for t1, lg in zip(cands, lg2):
            out[:vocab] += p1[t1] * dist(lg, T, [t1])
        outs.append(out / out.sum())  # the < 1e-5 tail of t1 is spread proportionally (negligible)
    return outs


def _counts(c: collections.Counter, vocab: int) -> np.ndarray:
    v = np.zeros(vocab + 1)
    for tok, n in c.items():
        v[vocab if tok == STOP else tok] += n
    return v


@pytest.mark.parametrize("draft_q", ["logits", "selector"])
def test_sampled_tokens_follow_the_target(e2e: dict, draft_q: str) -> None:
    from tinycode import record

    spec = e2e["specs"][draft_q]
    vocab = spec._spec.n_vocab
    cache = e2e["cache"]
    if "plain" not in cache:  # plain decoding of the same target; draft_q plays no part
        cache["plain"] = _histograms(spec, e2e["toks"], True, E2E_RUNS, 10_000_000)
    if "exact" not in cache:
        cache["exact"], cache["exact_T085"] = _exact_second_token(e2e["ref"], e2e["toks"], (1.0, 0.85), vocab)
    plain = cache["plain"]
    ours = _histograms(spec, e2e["toks"], False, E2E_RUNS, 20_000_000)
    # the verification path is exercised both ways: drafts are accepted and rejected
    assert 0.2 < ours["accepted_per_step"] < 5.0, ours["accepted_per_step"]

    report = {
        "draft_q": draft_q,
        "runs": E2E_RUNS,
        "accepted_per_step": ours["accepted_per_step"],
        "seconds": ours["seconds"],
        "plain_seconds": plain["seconds"],
    }
    for k in (1, 2):
        a, b = _counts(ours["pos"][k], vocab), _counts(plain["pos"][k], vocab)
        stat, df = chi2_two_sample(a, b)
        report[f"token{k + 1}_two_sample"] = {"chi2": stat, "df": df, "crit": chi2_crit(df, E2E_ALPHA)}
        assert stat < chi2_crit(df, E2E_ALPHA), (k + 1, stat, df)

    exact = cache["exact"]
    a = _counts(ours["pos"][1], vocab)
    stat, df = chi2_one_sample(a, exact)
    report["token2_vs_exact"] = {"chi2": stat, "df": df, "crit": chi2_crit(df, E2E_ALPHA)}
    assert stat < chi2_crit(df, E2E_ALPHA), (stat, df)
    stat_p, df_p = chi2_one_sample(_counts(plain["pos"][1], vocab), exact)
    assert stat_p < chi2_crit(df_p, E2E_ALPHA), (stat_p, df_p)
    # power: the same histogram rejects the marginal of a slightly different temperature
    stat_w, df_w = chi2_one_sample(a, cache["exact_T085"])
    report["token2_vs_exact_T0.85"] = {"chi2": stat_w, "df": df_w}
    assert stat_w > chi2_crit(df_w, E2E_ALPHA), (stat_w, df_w)
    record(f"sampling_e2e_{draft_q}", report)
    print(f"\n[sampling e2e {draft_q}] {report}")


def test_penalized_sampling_follows_the_penalized_target(e2e: dict) -> None:
    """At T = 1 with a repeat and a (negative: repeating pays) presence penalty: the 2nd token (verified with
    the 1st in the penalty window) follows the penalized marginal, and this histogram rejects the unpenalized
    one (a penalty against repeating the 1st token moves the 2nd too little to tell with these runs)."""
    from tinycode import record

    pen = dict(repeat_penalty=1.5, presence_penalty=-5.0)
    spec = e2e["specs"]["logits"]
    vocab = spec._spec.n_vocab
    ours = _histograms(spec, e2e["toks"], False, E2E_RUNS, 30_000_000, **pen)
    assert 0.2 < ours["accepted_per_step"] < 5.0, ours["accepted_per_step"]
    a = _counts(ours["pos"][1], vocab)
    (exact,) = _exact_second_token(e2e["ref"], e2e["toks"], (1.0,), vocab, **pen)
    stat, df = chi2_one_sample(a, exact)
    assert stat < chi2_crit(df, E2E_ALPHA), (stat, df)
    unpenalized = e2e["cache"].get("exact")
    if unpenalized is None:
        (unpenalized,) = _exact_second_token(e2e["ref"], e2e["toks"], (1.0,), vocab)
    stat_w, df_w = chi2_one_sample(a, unpenalized)
    assert stat_w > chi2_crit(df_w, E2E_ALPHA), (stat_w, df_w)
    record(
        "sampling_e2e_penalties",
        {
            "penalties": pen,
            "runs": E2E_RUNS,
            "chi2": stat,
            "df": df,
            "chi2_vs_unpenalized": stat_w,
            "accepted_per_step": ours["accepted_per_step"],
        },
    )


def _exact_mirostat(ref, toks: list[int], vocab: int, mode: int, tau: float, eta: float) -> tuple[np.ndarray, ...]:
    """Mirostat's exact distributions of the 1st generated token and (mu moved by the 1st) of the 2nd; index
    vocab of the 2nd = STOP."""
    from tinycode import EOS

    lg1, mu0 = ref.logits_after(toks), 2.0 * tau
    p1 = np.asarray(_core.mirostat_step(lg1, mode, tau, eta, mu0, 0)[0], np.float64)
    cands = [int(t) for t in np.nonzero(p1)[0] if t != EOS]
    p2 = np.zeros(vocab + 1)
    p2[vocab] = p1[EOS]
    for t1, lg in zip(cands, ref.next_logits(toks, cands)):
        mu1 = _core.mirostat_step(lg1, mode, tau, eta, mu0, t1)[1]
        p2[:vocab] += p1[t1] * np.asarray(_core.mirostat_step(lg, mode, tau, eta, mu1, 0)[0], np.float64)
    return p1, p2


# a tau and eta per version that keep 5-8 tokens for the 1st token and move mu enough to tell
MIROSTAT = {
    1: {"mirostat_mode": 1, "mirostat_tau": 3.5, "mirostat_eta": 2.0},
    2: {"mirostat_mode": 2, "mirostat_tau": 4.0, "mirostat_eta": 2.0},
}


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_sampling_follows_the_target(e2e: dict, mode: int) -> None:
    """Mirostat through the speculative loop: the 2nd token (verified, or drawn after a rejection, with mu
    moved by the 1st) follows the exact Mirostat marginal, and this histogram rejects the marginal of a mu
    that does not move. At temperature 0.5, which llama_cpp.Llama's Mirostat chain ignores: the 1st tokens
    llama_cpp.Llama itself samples follow the same exact distribution (and reject the one at T = 0.5)."""
    from tinycode import record

    opts = MIROSTAT[mode]
    spec, ref, toks = e2e["specs"]["logits"], e2e["ref"], e2e["toks"]
    vocab = spec._spec.n_vocab
    ours = _histograms(spec, toks, False, E2E_RUNS, 40_000_000 + mode, temperature=0.5, **opts)
    assert 0.2 < ours["accepted_per_step"] < 5.0, ours["accepted_per_step"]
    tau, eta = opts["mirostat_tau"], opts["mirostat_eta"]
    p1, p2 = _exact_mirostat(ref, toks, vocab, mode, tau, eta)
    a = _counts(ours["pos"][1], vocab)
    stat, df = chi2_one_sample(a, p2)
    assert stat < chi2_crit(df, E2E_ALPHA), (stat, df)
    _, frozen = _exact_mirostat(ref, toks, vocab, mode, tau, 0.0)
    stat_w, df_w = chi2_one_sample(a, frozen)
    assert stat_w > chi2_crit(df_w, E2E_ALPHA), (stat_w, df_w)

    runs = 1500  # llama_cpp.Llama.sample: the chain create_completion builds, a fresh one (mu = 2 tau) per call
    lg1 = ref.logits_after(toks)
    theirs = np.zeros(vocab)
    for s in range(runs):
        ref.llm.set_seed(50_000 + s)
        theirs[ref.llm.sample(temp=0.5, top_k=0, top_p=1.0, min_p=0.0, **opts)] += 1
    stat_l, df_l = chi2_one_sample(theirs, p1)
    assert stat_l < chi2_crit(df_l, E2E_ALPHA), (stat_l, df_l)
    cooled = np.asarray(_core.mirostat_step(lg1 / 0.5, mode, tau, eta, 2 * tau, 0)[0], np.float64)
    outside = int(theirs[cooled == 0].sum())  # draws that T = 0.5 (as llama.cpp's own tools chain it) rules out
    stat_c, df_c = chi2_one_sample(theirs, cooled)
    assert outside > 0 or stat_c > chi2_crit(df_c, E2E_ALPHA), (outside, stat_c, df_c)
    record(
        f"sampling_e2e_mirostat{mode}",
        {
            "options": opts,
            "runs": E2E_RUNS,
            "chi2": stat,
            "df": df,
            "chi2_vs_frozen_mu": stat_w,
            "llama_cpp_runs": runs,
            "llama_cpp_chi2": stat_l,
            "llama_cpp_chi2_vs_T0.5": stat_c,
            "llama_cpp_draws_outside_T0.5": outside,
            "accepted_per_step": ours["accepted_per_step"],
            "seconds": ours["seconds"],
        },
    )


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_mu_follows_every_emitted_token(e2e: dict, mode: int) -> None:
    """After 12 speculative steps (drafts accepted and rejected), the loop's mu is the one Mirostat reaches
    over the tokens it emitted, replayed one by one on the target's logits (a mu that skipped the verified
    tokens, or moved on a rejected draft instead of the emitted token, ends elsewhere)."""
    opts = MIROSTAT[mode]
    spec, ref, toks = e2e["specs"]["logits"], e2e["ref"], e2e["toks"]
    core = spec._spec
    tau, eta = opts["mirostat_tau"], opts["mirostat_eta"]
    n_max, adaptive = core.n_max, core.adaptive
    core.set_n_max(3, False)
    try:
        emitted = [core.start(toks, temperature=1.0, seed=7, **opts)]
        for _ in range(12):
            emitted += core.step()[0]
        st = core.stats
    finally:
        core.set_n_max(n_max, adaptive)
    assert 0 < st["accepted"] < st["drafted"], st
    mu = 2.0 * tau
    for i, t in enumerate(emitted):
        _, mu = _core.mirostat_step(ref.logits_after(toks + emitted[:i]), mode, tau, eta, mu, t)
    # libllama's batched verify and one-token decodes round the logits differently: mu by ~1e-4 per token
    assert abs(core.mirostat_mu - mu) < 0.02, (core.mirostat_mu, mu, len(emitted))
    assert abs(mu - 2.0 * tau) > 0.5  # mu moved


def test_typical_sampling_follows_the_target(e2e: dict) -> None:
    """typical_p through the speculative loop: the 2nd token follows the exact marginal with the typical cut
    and rejects the uncut one."""
    spec = e2e["specs"]["logits"]
    vocab = spec._spec.n_vocab
    ours = _histograms(spec, e2e["toks"], False, E2E_RUNS, 60_000_000, typical_p=0.5)
    assert 0.2 < ours["accepted_per_step"] < 5.0, ours["accepted_per_step"]
    a = _counts(ours["pos"][1], vocab)
    (exact,) = _exact_second_token(e2e["ref"], e2e["toks"], (1.0,), vocab, typical_p=0.5)
    stat, df = chi2_one_sample(a, exact)
    assert stat < chi2_crit(df, E2E_ALPHA), (stat, df)
    (uncut,) = _exact_second_token(e2e["ref"], e2e["toks"], (1.0,), vocab)
    stat_w, df_w = chi2_one_sample(a, uncut)
    assert stat_w > chi2_crit(df_w, E2E_ALPHA), (stat_w, df_w)


def test_default_completion_params_sample_what_llama_cpp_samples(e2e: dict) -> None:
    """create_completion's defaults (T 0.8, top_k 40, top_p 0.95, min_p 0.05, as llama-cpp-python's) on the
    tinycode target's real next-token logits: the distribution must be the one llama_cpp.Llama samples from."""
    from tinycode import prompts

    ref = e2e["ref"]
    worst = 0.0
    for p in prompts()[:10]:
        lg = ref.logits_after(ref.tokenize(p["text"]))
        ours = np.asarray(_core.target_distribution(lg, 0.8, 40, 0.95, 0.05), np.float64)
        worst = max(worst, tv(ours, libllama_chain(lg, 0.8, 40, 0.95, 0.05)))
    assert worst < 1e-4, f"total variation up to {worst:.3f} from llama.cpp's sampling distribution"
