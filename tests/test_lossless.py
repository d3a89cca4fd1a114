"""Greedy speculative decoding is lossless: token for token what the target alone decodes.

The reference is plain libllama greedy decoding through llama_cpp.Llama (one
token per decode). Batched verification and one-token decoding round
differently, so where the target's two best logits are within EPS the two may
legitimately pick different tokens: at every divergence the reference's top-2
margin must be below EPS and our token one of those two; the reference is then
re-run from prompt + ours[:i + 1], so identity is asserted wherever the margin
exceeds EPS. Near-ties and acceptance figures are printed (pytest -s) and
written to $TMPDIR/dflash-gguf-tests/lossless_*.json.

Also: prompt-prefix reuse and KV rollback keep outputs exact and deterministic.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import (  # noqa: E402
    N_CTX,
    TARGET,
    THREADS,
    GreedyReference,
    compare_greedy,
    drafter_gguf,
    prompts,
    random_drafter_gguf,
    record,
    sliding_drafter_gguf,
)

from dflash_gguf import SpeculativeLlama  # noqa: E402

EPS = 1e-2  # top-2 logit margin below which a divergence counts as a near-tie
N_NEW = 128  # tokens per prompt
MAX_TIES = 5  # more near-ties than this over 20 prompts would mean a systematic numeric drift


@pytest.fixture(scope="module")
def ref() -> GreedyReference:
    return GreedyReference(TARGET, n_ctx=N_CTX, n_threads=THREADS)


@pytest.fixture(scope="module")
def ptoks(ref: GreedyReference) -> list[list[int]]:
    return [ref.tokenize(p["text"]) for p in prompts()]


def _spec(draft: str) -> SpeculativeLlama:
    # a fixed n_max: its draft lengths depend on acceptance only, so seeded sampling repeats token for token
    # (n_max="auto" also weighs measured timings, which differ from run to run)
    return SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, n_max=7)


@pytest.fixture(scope="module")
def spec_bundled() -> SpeculativeLlama:
    return _spec(str(drafter_gguf("f32")))


@pytest.fixture(scope="module")
def spec_random() -> SpeculativeLlama:
    return _spec(str(random_drafter_gguf()))


def _run_all(
    spec: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]], label: str, plain: bool = False
) -> dict[str, Any]:
    problems: list[str] = []
    ties = []
    steps = plain_steps = drafted = accepted = emitted = 0
    per_prompt_mal = []
    by_length: list[int] = []
    for p, toks in zip(prompts(), ptoks):
        ours = list(spec.generate_tokens(toks, max_tokens=N_NEW, temperature=0.0, plain=plain))
        s = spec.stats
        steps += s.steps
        plain_steps += s.plain_steps
        drafted += s.drafted
        accepted += s.accepted
        emitted += s.completion_tokens
        per_prompt_mal.append(s.mean_accepted_length)
        by_length = [a + b for a, b in zip(by_length or [0] * len(s.steps_by_length), s.steps_by_length)]
        pr, tv = compare_greedy(ref, toks, ours, N_NEW, EPS, name=p["id"])
        problems += pr
        ties += tv
    drafted_steps = steps - plain_steps
    summary = {
        "variant": label,
        "prompts": len(ptoks),
        "tokens": emitted,
        "steps": steps,
        "plain_steps": plain_steps,
        "steps_by_length": by_length,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + drafted_steps) / drafted_steps if drafted_steps else 1.0,
        "mean_accepted_length_per_prompt_mean": float(np.mean(per_prompt_mal)),
        "near_ties": [asdict(t) for t in ties],
        "problems": problems,
    }
    record(f"lossless_{label}", summary)
    margins = ", ".join(f"{t.prompt}@{t.index}: {t.margin:.5f}" for t in ties) or "none"
    print(
        f"\n[lossless {label}] {emitted} tokens, {steps} target passes ({plain_steps} plain), "
        f"mean accepted length {summary['mean_accepted_length']:.2f}, "
        f"acceptance {accepted}/{drafted}; near-ties {len(ties)} ({margins})"
    )
    return summary


@pytest.mark.parametrize("n_max", [7, 3, 1])
def test_greedy_lossless_bundled(
    spec_bundled: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]], n_max: int
) -> None:
    spec_bundled.n_max = n_max
    assert spec_bundled.n_max == n_max
    try:
        s = _run_all(spec_bundled, ref, ptoks, f"bundled_f32_nmax{n_max}")
    finally:
        spec_bundled.n_max = 0
    assert not s["problems"], "\n".join(s["problems"])
    assert len(s["near_ties"]) <= MAX_TIES
    assert all(t["margin"] < EPS for t in s["near_ties"])
    assert s["plain_steps"] == 0 or s["acceptance_rate"] > 0.3
    # a trained drafter is accepted; each target pass drafts exactly n_max tokens, but for the last ones of a
    # generation, which draft no further than its end: with r tokens still wanted a step drafts r - 1, and r
    # falls at each step, so a generation's steps fall short by at most (n_max - 1) + ... + 1 drafts
    drafted_steps = s["steps"] - s["plain_steps"]
    # every step counted once under the length it drafted (0: plain), never past n_max; only a
    # generation's last steps draft fewer than n_max, at most one per length below it
    by_length = s["steps_by_length"]
    assert sum(by_length) == s["steps"] and by_length[0] == s["plain_steps"], by_length
    assert sum(k * n for k, n in enumerate(by_length)) == s["drafted"], by_length
    assert sum(by_length[n_max + 1 :]) == 0 and sum(by_length[1:n_max]) <= s["prompts"] * (n_max - 1), by_length
    short = s["prompts"] * n_max * (n_max - 1) // 2
    assert n_max * drafted_steps - short <= s["drafted"] <= n_max * drafted_steps
    assert s["mean_accepted_length"] > 1.0 + 0.35 * n_max, s["mean_accepted_length"]


def test_greedy_lossless_auto_draft_length(
    spec_bundled: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]]
) -> None:
    """n_max="auto": the loop picks each step's draft length from measured costs; output stays exact."""
    spec_bundled.n_max = "auto"
    assert spec_bundled.n_max == "auto"
    try:
        s = _run_all(spec_bundled, ref, ptoks[:8], "bundled_f32_auto")
        ctl = spec_bundled._spec.controller
    finally:
        spec_bundled.n_max = 7
    assert not s["problems"], "\n".join(s["problems"])
    assert all(t["margin"] < EPS for t in s["near_ties"])
    # the controller measured costs for plain decoding and for at least one draft length
    assert len(ctl["acceptance"]) == 7 and all(0.0 <= a <= 1.0 for a in ctl["acceptance"])
    assert all(c > 0.0 for c in ctl["expected_step_ms"]), ctl


def test_greedy_lossless_sliding_window_drafter(ref: GreedyReference, ptoks: list[list[int]]) -> None:
    """A drafter with causal sliding-window layers (window 16, shorter than every prompt) drafts from a context
    its sliding layers see only the end of; the output stays exact and its drafts are still accepted."""
    with _spec(str(sliding_drafter_gguf(16))) as spec:
        s = _run_all(spec, ref, ptoks[:8], "sliding_window_drafter")
    assert not s["problems"], "\n".join(s["problems"])
    assert all(t["margin"] < EPS for t in s["near_ties"])
    assert s["mean_accepted_length"] > 2.0, s["mean_accepted_length"]


def test_regenerated_long_reply_drafts_as_the_first(ptoks: list[list[int]]) -> None:
    """A reply longer than the sliding drafter's rings' slack, then the same prompt again (a regenerated
    reply): the rollback to the prompt's end would leave the rings without its window's rows; the copy of
    them kept at the prompt's end is put back, so the second reply is drafted exactly as the first (the same
    accepted tokens at every position), not from a window the rollback emptied."""
    spec = SpeculativeLlama(str(TARGET), str(sliding_drafter_gguf(16)), n_ctx=1024, n_threads=THREADS, n_max=7)
    assert spec._spec.draft_counters["rings_restored"] == 0
    no_eos = {t: -float("inf") for t in spec._spec.eog_tokens}
    prompt = ptoks[3]
    runs = []
    for _ in range(2):
        tokens = list(spec.generate_tokens(prompt, max_tokens=500, logit_bias=no_eos))
        runs.append((tokens, spec.stats.accepted, spec.stats.steps, spec.stats.per_position_acceptance))
    assert len(runs[0][0]) == 500
    assert spec.stats.reused_prompt_tokens == len(prompt) - 1
    assert spec._spec.draft_counters["rings_restored"] == 1
    assert runs[1] == runs[0], (runs[0][1:], runs[1][1:])


def test_earlier_turn_regenerated_drafts_as_the_first(ptoks: list[list[int]]) -> None:
    """A chat's first turn, a second turn on top of it, then the first turn's reply regenerated: the rollback
    goes back past the second prompt's end to the first's, and the copy of the rings kept there (not
    replaced by the second prompt's) is put back, so the regenerated reply drafts exactly as the first."""
    spec = SpeculativeLlama(str(TARGET), str(sliding_drafter_gguf(16)), n_ctx=1024, n_threads=THREADS, n_max=7)
    no_eos = {t: -float("inf") for t in spec._spec.eog_tokens}
    first = ptoks[3]

    def reply(prompt: list[int]) -> tuple[list[int], int, int, list[float]]:
        tokens = list(spec.generate_tokens(prompt, max_tokens=300, logit_bias=no_eos))
        return tokens, spec.stats.accepted, spec.stats.steps, spec.stats.per_position_acceptance

    turn1 = reply(first)
    reply(first + turn1[0] + ptoks[5])
    assert spec._spec.draft_counters["rings_restored"] == 0
    again = reply(first)
    assert spec.stats.reused_prompt_tokens == len(first) - 1
    assert spec._spec.draft_counters["rings_restored"] == 1
    assert again == turn1, (turn1[1:], again[1:])


def test_greedy_lossless_random_drafter(
    spec_random: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]]
) -> None:
    """An untrained drafter: almost nothing is accepted, the fallback decodes plainly, output still exact."""
    s = _run_all(spec_random, ref, ptoks, "random_drafter")
    assert not s["problems"], "\n".join(s["problems"])
    assert len(s["near_ties"]) <= MAX_TIES
    assert s["acceptance_rate"] < 0.1, s["acceptance_rate"]
    assert s["plain_steps"] > s["steps"] // 2, (s["plain_steps"], s["steps"])  # the fallback kicked in


def test_auto_stops_drafting_an_untrained_drafter(ref: GreedyReference, ptoks: list[list[int]]) -> None:
    """n_max="auto" with a drafter that is never right, from a fresh start: the controller soon decodes
    plainly and its probes thin out (the interval doubles while they fail, and carries over to the next
    prompt), so almost no step pays for a draft; output stays exact."""
    spec = SpeculativeLlama(str(TARGET), str(random_drafter_gguf()), n_ctx=N_CTX, n_threads=THREADS, n_max="auto")
    s = _run_all(spec, ref, ptoks, "random_drafter_auto")
    assert not s["problems"], "\n".join(s["problems"])
    drafted_steps = s["steps"] - s["plain_steps"]
    # 20 prompts x N_NEW tokens: a probe every 16 plain steps (no back-off) would draft ~6% of the steps
    print(f"auto, untrained drafter: {drafted_steps} drafted of {s['steps']} steps")
    assert 1 <= drafted_steps <= 0.02 * s["steps"], (drafted_steps, s["steps"])


def test_auto_calibrates_its_costs_once_before_the_first_prefill(ref: GreedyReference, ptoks: list[list[int]]) -> None:
    """n_max="auto" times a plain decode and every draft length on placeholder tokens before its first
    prefill, then clears that state: the first request starts with every choice priced (rather than
    exploring each draft length inside it, 4-5 steps apiece) and decodes as plain decoding does. Only
    once per object; a fixed n_max does not; baseline (plain=True) runs leave the controller as it was
    (they must neither fade its acceptance evidence nor re-time plain steps)."""
    spec = SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max="auto")
    first = list(spec.generate_tokens(ptoks[0], max_tokens=1))
    assert spec.stats.calibration_ms > 0.0
    ctl = spec._spec.controller
    assert all(c > 0.0 for c in ctl["expected_step_ms"]), ctl  # every k priced ...
    assert ctl["acceptance"] == [0.5] * 7, ctl  # ... before a single draft (the prior)
    out = list(spec.generate_tokens(ptoks[1], max_tokens=N_NEW))
    assert spec.stats.calibration_ms == 0.0
    _check(ref, ptoks[1], out, N_NEW, "after_calibration")
    _check(ref, ptoks[0], first, 1, "calibration_then_prefill")

    before = spec._spec.controller
    list(spec.generate_tokens(ptoks[2], max_tokens=N_NEW, plain=True))
    assert spec._spec.controller == before

    fixed = SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=3)
    list(fixed.generate_tokens(ptoks[0], max_tokens=1))
    assert fixed.stats.calibration_ms == 0.0


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_greedy_lossless_quantized_drafter(outtype: str, ref: GreedyReference, ptoks: list[list[int]]) -> None:
    """The drafter's own type changes acceptance, never the output (first 8 prompts)."""
    spec = _spec(str(drafter_gguf(outtype)))
    s = _run_all(spec, ref, ptoks[:8], f"bundled_{outtype}")
    assert not s["problems"], "\n".join(s["problems"])
    assert s["mean_accepted_length"] > 2.0, s["mean_accepted_length"]


def test_plain_cpp_loop_matches_reference(
    spec_bundled: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]]
) -> None:
    """plain=True (the C++ one-token loop, no drafting) is the same decoding as llama_cpp's."""
    s = _run_all(spec_bundled, ref, ptoks, "plain_cpp", plain=True)
    assert not s["problems"], "\n".join(s["problems"])
    assert s["drafted"] == 0 and s["steps"] == s["tokens"] - s["prompts"]  # one pass per token after the first


# --------------------------------------------------------------------------- #
# prompt-prefix reuse and rollback
# --------------------------------------------------------------------------- #


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check(ref: GreedyReference, prompt: list[int], ours: list[int], n: int, name: str) -> None:
    problems, _ = compare_greedy(ref, prompt, ours, n, EPS, name=name)
    assert not problems, "\n".join(problems)


def test_prefix_reuse_matches_plain(
    spec_bundled: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]]
) -> None:
    n = 48
    a = ptoks[5]
    out_a = list(spec_bundled.generate_tokens(a, max_tokens=n))
    assert spec_bundled.stats.completion_tokens == n
    _check(ref, a, out_a, n, "A")

    # B shares a long prefix of A's prompt, then goes elsewhere
    b = a[: len(a) - 12] + ptoks[9][:20]
    out_b = list(spec_bundled.generate_tokens(b, max_tokens=n))
    assert spec_bundled.stats.reused_prompt_tokens == _lcp(a, b) > 30
    assert spec_bundled.stats.prompt_tokens == len(b)
    _check(ref, b, out_b, n, "B (shares A's prefix)")

    # C continues B's own generation: the reused prefix runs past the prompt into generated tokens
    c = b + out_b[:20]
    out_c = list(spec_bundled.generate_tokens(c, max_tokens=n))
    assert spec_bundled.stats.reused_prompt_tokens == len(c) - 1
    _check(ref, c, out_c, n, "C (continues B)")

    # D is a strict prefix of what is cached: the caches roll back
    d = a[:40]
    out_d = list(spec_bundled.generate_tokens(d, max_tokens=n))
    assert spec_bundled.stats.reused_prompt_tokens == 39
    _check(ref, d, out_d, n, "D (strict prefix)")


def test_rollback_gives_identical_outputs(spec_bundled: SpeculativeLlama, ptoks: list[list[int]]) -> None:
    """A, then an unrelated prompt, then A again: identical outputs, greedy and seeded sampling."""
    a, other = ptoks[2], ptoks[13]
    for kw in (
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 123},
    ):
        first = list(spec_bundled.generate_tokens(a, max_tokens=64, **kw))
        list(spec_bundled.generate_tokens(other, max_tokens=64, **kw))
        again = list(spec_bundled.generate_tokens(a, max_tokens=64, **kw))
        assert spec_bundled.stats.reused_prompt_tokens == _lcp(a, other)
        assert again == first, kw
        # immediately again: the whole prompt but its last token comes from the cache
        third = list(spec_bundled.generate_tokens(a, max_tokens=64, **kw))
        assert spec_bundled.stats.reused_prompt_tokens == len(a) - 1
        assert third == first, kw


def test_one_hot_sampling_is_greedy(spec_bundled: SpeculativeLlama, ptoks: list[list[int]]) -> None:
    """T > 0 with top_k = 1 (or min_p = 1) makes p one-hot: the rejection step must then
    reproduce greedy decoding exactly, whatever the seed and draft_q."""
    toks = ptoks[3]
    greedy = list(spec_bundled.generate_tokens(toks, max_tokens=96))
    for seed in (1, 2, 3):
        assert list(spec_bundled.generate_tokens(toks, max_tokens=96, temperature=1.0, top_k=1, seed=seed)) == greedy
        assert spec_bundled.stats.accepted > 0
        assert list(spec_bundled.generate_tokens(toks, max_tokens=96, temperature=0.7, min_p=1.0, seed=seed)) == greedy


def test_generation_to_a_full_context(
    spec_bundled: SpeculativeLlama, ref: GreedyReference, ptoks: list[list[int]]
) -> None:
    """max_tokens=None runs until the context is full: the last drafts are cut to fit, still exact."""
    toks = ptoks[11]
    ours = list(spec_bundled.generate_tokens(toks, max_tokens=None))
    assert spec_bundled.finish_reason == "length"
    assert len(toks) + len(ours) == N_CTX
    _check(ref, toks, ours, len(ours), "full context")
    # and the object starts over cleanly afterwards
    again = list(spec_bundled.generate_tokens(toks, max_tokens=64))
    assert again == ours[:64]
