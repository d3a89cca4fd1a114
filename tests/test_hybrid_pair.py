"""The tinycode pair on a Qwen3.5 hybrid target (examples/tinycode-hybrid, made by scripts/make_hybrid_pair.py).

The hybrid computes the tinycode target's function through Gated DeltaNet layers that add nothing, so:
its greedy output is the tinycode target's, the trained drafter's acceptance carries over, and our loop on
it (libllama's recurrent snapshots, or the checkpoint path for an adopted llama_cpp.Llama) stays lossless
with real partial acceptances.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers builds the hybrid target")

from tinycode import (  # noqa: E402
    ROOT,
    TARGET,
    GreedyReference,
    _workdir,
    compare_greedy,
    convert,
    drafter_gguf,
    prompts,
    record,
    sliding_drafter_gguf,
)

from dflash_gguf import SpeculativeLlama  # noqa: E402

HYBRID = ROOT / "examples" / "tinycode-hybrid"
N_NEW = 48
N_PROMPTS = 10
EPS = 1e-2  # F16 targets (as tests/test_lossless.py)


@pytest.fixture(scope="module")
def hybrid_target() -> Path:
    target = HYBRID / "target-f16.gguf"
    if not target.exists():
        res = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_hybrid_pair.py")], capture_output=True, text=True
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return target


@pytest.fixture(scope="module")
def hybrid_drafter(hybrid_target: Path) -> Path:
    return convert(HYBRID / "drafter-dflash2", hybrid_target, _workdir() / "hybrid-drafter-f32.gguf", "f32")


@pytest.fixture(scope="module")
def hybrid_ref(hybrid_target: Path) -> GreedyReference:
    return GreedyReference(hybrid_target, n_ctx=512, n_threads=1)


@pytest.fixture(scope="module")
def ptoks(hybrid_ref: GreedyReference) -> list[list[int]]:
    return [hybrid_ref.tokenize(p["text"]) for p in prompts()[:N_PROMPTS]]


def test_the_hybrid_target_decodes_what_tinycode_decodes(hybrid_ref: GreedyReference, ptoks: list[list[int]]) -> None:
    dense = GreedyReference(TARGET, n_ctx=512, n_threads=1)
    problems, ties = [], []
    for i, prompt in enumerate(ptoks):
        theirs = hybrid_ref.greedy(prompt, N_NEW).tokens
        p, t = compare_greedy(dense, prompt, theirs, len(theirs), EPS, f"prompt {i}")
        problems += p
        ties += t
    record("hybrid_vs_tinycode", {"near_ties": [vars(t) for t in ties]})
    assert not problems, problems


def _run(spec: SpeculativeLlama, ptoks: list[list[int]]) -> tuple[list[list[int]], float]:
    outs, accepted, steps = [], 0, 0
    for prompt in ptoks:
        outs.append(list(spec.generate_tokens(prompt, max_tokens=N_NEW)))
        s = spec.stats
        accepted += s.accepted
        steps += s.steps - s.plain_steps
    return outs, (accepted + steps) / max(steps, 1)


@pytest.mark.parametrize("adopted", [False, True], ids=["snapshots", "checkpoint"])
def test_our_loop_on_the_hybrid_is_lossless_and_accepts_as_on_tinycode(
    hybrid_target: Path, hybrid_drafter: Path, hybrid_ref: GreedyReference, ptoks: list[list[int]], adopted: bool
) -> None:
    if adopted:  # a llama_cpp.Llama's context has no snapshots: every rejected verify restores a checkpoint
        import llama_cpp

        llm = llama_cpp.Llama(str(hybrid_target), n_ctx=512, n_threads=1, verbose=False)
        spec = SpeculativeLlama.from_llama(llm, str(hybrid_drafter), n_max=3)
    else:
        spec = SpeculativeLlama(str(hybrid_target), str(hybrid_drafter), n_ctx=512, n_threads=1, n_max=3)
    assert spec._spec.target_memory == ("recurrent-checkpoint" if adopted else "recurrent-snapshots")
    ours, acc_hybrid = _run(spec, ptoks)
    problems = []
    for i, (prompt, out) in enumerate(zip(ptoks, ours)):
        problems += compare_greedy(hybrid_ref, prompt, out, N_NEW, EPS, f"prompt {i}")[0]
    assert not problems, problems
    dense = SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=512, n_threads=1, n_max=3)
    _, acc_dense = _run(dense, ptoks)
    record(
        f"hybrid_acceptance_{'checkpoint' if adopted else 'snapshots'}",
        {"hybrid": acc_hybrid, "tinycode": acc_dense, "rollback": spec._spec.rollback_counters},
    )
    assert acc_hybrid > 1.5  # real partial acceptances, not the random drafters' ~1
    assert abs(acc_hybrid - acc_dense) <= 0.05 * acc_dense, (acc_hybrid, acc_dense)
    kind = "restored" if adopted else "snapshot"
    assert spec._spec.rollback_counters[kind] > 0


def test_a_conversation_sharing_a_system_prompt_drafts_as_in_a_fresh_process(
    hybrid_target: Path, ptoks: list[list[int]]
) -> None:
    """A drafter with sliding layers (window 64, rings of 384 rows) on the hybrid: a first conversation whose
    prompt outgrows the rings, then one that shares only its system prompt. The recurrent target has no
    checkpoint before that prompt's end and re-decodes it from the start; the drafter's rings (and their
    copy at the first prompt's end) no longer hold its rows. The shared part goes through prefill, so the
    drafter gets them too: the reply drafts exactly as in a fresh process."""
    drafter = sliding_drafter_gguf(64, "f32", HYBRID / "drafter-dflash2", hybrid_target)

    def make() -> SpeculativeLlama:
        return SpeculativeLlama(str(hybrid_target), str(drafter), n_ctx=1024, n_threads=1, n_max=7)

    def reply(spec: SpeculativeLlama, prompt: list[int], n: int) -> tuple[list[int], int, int, list[float]]:
        no_eos = {t: -float("inf") for t in spec._spec.eog_tokens}
        tokens = list(spec.generate_tokens(prompt, max_tokens=n, logit_bias=no_eos))
        return tokens, spec.stats.accepted, spec.stats.steps, spec.stats.per_position_acceptance

    system, second = ptoks[3], ptoks[3] + ptoks[5][1:7]
    first = system + [t for p in ptoks[4:] for t in p[1:]]
    assert len(first) > len(system) + 384, len(first)
    spec = make()
    reply(spec, first, 32)
    again = reply(spec, second, 64)
    assert spec.stats.reused_prompt_tokens == 0  # the target re-decodes the system prompt: as prompt
    assert spec._spec.draft_counters["rings_restored"] == 0
    assert again == reply(make(), second, 64)
