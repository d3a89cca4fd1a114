"""The adaptive draft-length controller (n_max="auto") driven by a simulated loop.

Each simulated step asks the controller for k, draws how many of the k drafted tokens the target
accepts (independent per-position acceptance, as measured on the bundled pair), charges the cost
model's time for it (with a shared machine's skewed noise: a few % jitter and now and then a
preempted step several times slower, and with the slow first step of every new shape that real
backends show: allocation, CUDA graph warm-up) and reports back. The cost profiles are the ones
measured on the bundled pair: a GPU, where verifying 8 tokens costs little more than one, and
a 2-core CPU, where drafting about breaks even (a little below plain decoding at every k).
The controller sees only what the real loop shows it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

dflash_gguf = pytest.importorskip("dflash_gguf", reason="the dflash_gguf extension is not built")
from dflash_gguf._core import DraftLengthController  # noqa: E402

ACCEPT = [0.76, 0.76, 0.76, 0.83, 0.76, 0.87, 0.82]  # bundled pair, greedy, per position (README)
Costs = dict[str, float | Callable[[int], float]]
GPU: Costs = {"plain": 0.23, "draft": lambda k: 0.30, "verify": lambda k: 0.33 + 0.012 * k}  # H200, ms
# 2 cores, short blocks (dflash bench, n_max 2..4): draft 0.70 / 0.79 / 0.92 ms, verify 1.0 / 1.17 / 1.6
CPU: Costs = {"plain": 0.65, "draft": lambda k: 0.40 + 0.10 * k, "verify": lambda k: 0.62 + 0.19 * k}
CHEAP_DRAFT: Costs = {"plain": 0.70, "draft": lambda k: 0.30, "verify": lambda k: 0.75 + 0.10 * k}
# a drafter too slow to pay at any k (plain decoding ~20% ahead)
SLOW_DRAFT: Costs = {"plain": 0.60, "draft": lambda k: 0.90 + 0.10 * k, "verify": lambda k: 0.62 + 0.19 * k}
# 2 cores, the bundled drafter at q4_0 (dflash bench, n_max 2..4): draft 0.49 / 0.50 / 0.76 ms, verify
# 0.87 / 1.04 / 1.45 ms, plain 0.60: drafting 3 pays ~10%
CPU_Q4: Costs = {"plain": 0.60, "draft": lambda k: [0.45, 0.49, 0.50, 0.76][min(k, 4) - 1] + 0.1 * max(0, k - 4),
                 "verify": lambda k: 0.62 + 0.14 * k + 0.05 * max(0, k - 3) ** 2}
# libllama rebuilds its graph when the batch shape changes: a plain step after a drafted one costs
# 0.72-0.74 ms against 0.59-0.61 after a plain one (the bundled target, 2 cores); a drafted step
# after a plain one ~0.13 ms more likewise
SWITCH = 0.13
# a drafter idle for 60 plain steps drafts its next steps this much slower (ms; measured at q4_0:
# 0.86, 0.71, 0.61, 0.55 ms, then 0.48); scaled down for shorter idle runs
COLD_DRAFTER = [0.38, 0.23, 0.13, 0.07]


JITTER, SPIKE_P, SPIKE = 0.08, 0.03, 4.0
NOISE_MEAN = float(np.exp(JITTER**2 / 2)) * (1.0 + SPIKE_P * (SPIKE - 1.0))  # what the noise costs on average


def expected_rate(costs: Costs, k: int) -> float:
    """Tokens per ms of always verifying k drafts (k = 0: plain decoding), under the same noise."""
    if k == 0:
        return 1.0 / (costs["plain"] * NOISE_MEAN)  # type: ignore[operator]
    e, run = 1.0, 1.0
    for a in ACCEPT[:k]:
        run *= a
        e += run
    return e / ((costs["draft"](k) + costs["verify"](k)) * NOISE_MEAN)  # type: ignore[operator]


def simulate(costs: Costs, seed: int, mode: str = "auto", n_max: int = 0, n_seq: int = 20,
             n_tokens: int = 128, warmup_factor: float = 5.0, switch: float = 0.0,
             tell_steady: bool = True) -> tuple[float, float, list[int]]:
    """(tokens per ms, share of drafted steps, the k chosen at every step). A step whose target batch
    shape differs from the step before (a sequence starts with a prefill) costs `switch` ms more; the
    loop tells the controller whether the shape repeated unless tell_steady is off."""
    rng = np.random.default_rng(seed)
    c = DraftLengthController(7, mode, n_max)
    seen: set[int] = set()
    total_ms, tokens, drafted, chosen = 0.0, 0, 0, []
    for _ in range(n_seq):
        c.reset_acceptance()
        n, prev, plain_run, cold = 0, -1, 0, []
        while n < n_tokens:
            k = c.choose()
            chosen.append(k)
            steady, prev = k == prev, k
            extra = 0.0 if steady else switch
            slow = warmup_factor if k not in seen else 1.0  # the first step of each shape
            seen.add(k)
            noise = lambda: rng.lognormal(0.0, JITTER) * (SPIKE if rng.random() < SPIKE_P else 1.0)  # noqa: E731
            if k == 0:
                ms = costs["plain"] * noise() * slow + extra  # type: ignore[operator]
                c.observe_plain(ms, steady or not tell_steady)
                total_ms += ms
                n += 1
                plain_run += 1
                continue
            if switch and plain_run:  # an idle drafter's first steps are slower
                cold = [x * min(1.0, plain_run / 60) for x in COLD_DRAFTER]
            plain_run = 0
            drafted += 1
            j = 0
            while j < k and rng.random() < ACCEPT[j]:
                j += 1
            d_ms = costs["draft"](k) * noise() * slow + (cold.pop(0) if cold else 0.0)  # type: ignore[operator]
            v_ms = costs["verify"](k) * noise() * slow + extra  # type: ignore[operator]
            c.observe_draft(k, j, d_ms, v_ms, steady or not tell_steady)
            total_ms += d_ms + v_ms
            n += j + 1
        tokens += n
    return tokens / total_ms, drafted / len(chosen), chosen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name,costs", [("gpu", GPU), ("cpu", CPU), ("cpu_q4", CPU_Q4), ("cheap_draft", CHEAP_DRAFT),
                                        ("slow_draft", SLOW_DRAFT)])
def test_auto_close_to_the_best_fixed_length(name: str, costs: Costs, seed: int) -> None:
    """Close to the best fixed choice (plain decoding included) for each cost profile, with what the
    real loop shows a controller: the first step of every shape 5x slower (what kept an earlier
    controller from ever drafting on the GPU: it believed the first, slow measurements), libllama's
    graph rebuild at every change of batch shape and an idle drafter's slow first steps (a controller
    that timed those stayed in whichever regime it started in: the bench's auto run at q4_0 ran 1.00x
    plain, mostly plain steps, while n_max 3 ran 1.08x; timing every step here: 0.81 of the best on
    the GPU profile, seed 2). Where one side is clearly ahead (10%), auto mode mostly does that; near
    a tie (the CPU profile: plain 5% ahead) either will do. The real loop shows these effects more
    than this simulation: the bench is the measure."""
    rate, drafted, _ = simulate(costs, seed, switch=SWITCH)
    rates = [expected_rate(costs, k) for k in range(8)]
    best_k = max(range(8), key=lambda k: rates[k])
    best, best_drafting = rates[best_k], max(rates[1:])
    print(f"{name} seed {seed}: auto {rate:.3f} tok/ms ({drafted:.0%} of steps drafted), "
          f"best fixed k={best_k} {best:.3f} tok/ms: {rate / best:.2f}")
    assert rate >= 0.85 * best, (rate, best_k, best)
    if rates[0] > 1.1 * best_drafting:
        assert drafted <= 0.15, drafted  # it stops drafting where drafting cannot pay
    elif best_drafting > 1.1 * rates[0]:
        assert drafted >= 0.5, drafted


def test_fixed_mode_repeats_whatever_came_before() -> None:
    """Fixed mode decides on acceptance alone and forgets it per sequence: the same acceptance
    outcomes give the same draft lengths whatever the timings and the history."""
    a = DraftLengthController(7, "fixed", 7)
    b = DraftLengthController(7, "fixed", 7)
    b.observe_plain(5.0)
    for _ in range(30):  # a history b has and a has not
        b.observe_draft(7, 0, 9.0, 9.0)
    b.reset_acceptance()
    rng = np.random.default_rng(3)
    for _ in range(300):
        ka, kb = a.choose(), b.choose()
        assert ka == kb
        if ka:
            j = int(rng.integers(0, ka + 1))
            a.observe_draft(ka, j, 1.0, 1.0)
            b.observe_draft(kb, j, 50.0 * rng.random(), 50.0 * rng.random())


def test_bad_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        DraftLengthController(7, "fast")



def test_a_dip_in_acceptance_is_not_remembered_for_good() -> None:
    """Drafts that paid, then a run of rejections (auto turns to plain decoding), then content on which
    drafting pays again: plain steps add no evidence, so the controller must come back to drafting on
    its own (the bound on acceptance widens while it waits), not only through 2-step probes, which
    back off to one per 256 steps."""
    def cost(k: int) -> tuple[float, float]:
        return 0.45 + 0.05 * k, 0.62 + 0.14 * k  # draft, verify ms (plain 0.60: CPU_Q4-like)

    c = DraftLengthController(3, "auto")
    for _ in range(4):
        c.observe_plain(0.60)
    for k in (1, 2, 3):  # drafts that pay, every cost measured
        for _ in range(15):
            c.observe_draft(k, k, *cost(k))
    for _ in range(60):  # the dip: nothing accepted
        c.observe_draft(3, 0, *cost(3))
    assert c.choose() == 0
    chosen = []
    for _ in range(600):  # drafting pays again: 2 of every 3 drafts accepted
        k = c.choose()
        chosen.append(k)
        if k == 0:
            c.observe_plain(0.60)
        else:
            c.observe_draft(k, min(k, 2), *cost(k))
    drafted = sum(k > 0 for k in chosen[300:]) / 300
    assert drafted >= 0.5, "".join(map(str, chosen))
