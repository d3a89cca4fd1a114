"""sampler="gumbel": a seed means one text. Every draw is keyed by (seed, position) and the draft is coupled
to the target's token through the same Gumbel noise, so seeded speculative sampling emits token for token
what seeded plain sampling emits: not a function of the draft lengths, earlier requests, prefix reuse or
timings (n_max="auto"); and each token is still exactly distributed as the target's sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from test_sampling import CASES, N_DRAWS, exactness_failures  # noqa: E402
from tinycode import TARGET, THREADS, drafter_gguf, prompts  # noqa: E402

from dflash_gguf import SpeculativeLlama, _core  # noqa: E402

HOT = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama_cpp.Llama's defaults


@pytest.mark.parametrize("case", list(CASES))
def test_gumbel_draws_follow_their_distribution(case: str) -> None:
    p, q = CASES[case]
    target, drafted, agreed = _core.gumbel_histogram(p, q, N_DRAWS, 5 + len(case))
    assert not exactness_failures(np.asarray(target), p), case
    assert not exactness_failures(np.asarray(drafted), q), case
    both = float(np.minimum(p / p.sum(), q / q.sum()).sum())
    assert agreed / N_DRAWS <= both + 0.01  # a coupling: never more often than the maximal one
    assert (agreed > 0) == (both > 0)


@pytest.fixture(scope="module")
def spec_factory():
    made: dict[str, SpeculativeLlama] = {}

    def make(n_max: int | str) -> SpeculativeLlama:
        key = str(n_max)
        if key not in made:
            made[key] = SpeculativeLlama(
                str(TARGET), str(drafter_gguf("q8_0")), n_ctx=1024, n_threads=THREADS, n_max=n_max, sampler="gumbel"
            )
        return made[key]

    return make


def test_a_seed_fixes_the_text_whatever_the_draft_lengths(spec_factory) -> None:
    texts = [p["text"] for p in prompts()[:4]]
    for seed in (0, 7):
        for text in texts:
            prompt = spec_factory(1).tokenize(text.encode(), add_bos=False)
            plain = list(spec_factory(1).generate_tokens(prompt, max_tokens=48, seed=seed, plain=True, **HOT))
            for n_max in (1, 3, 7, "auto"):
                spec = spec_factory(n_max)
                for _ in range(2):  # the second time from the cached prompt
                    assert list(spec.generate_tokens(prompt, max_tokens=48, seed=seed, **HOT)) == plain, (
                        seed,
                        n_max,
                        text[:20],
                    )
            assert spec_factory(3).stats.accepted > 0  # drafts were accepted and rejected along the way


def test_seeded_completions_repeat_after_other_requests(spec_factory) -> None:
    spec = spec_factory("auto")
    kw = dict(max_tokens=40, seed=123, **HOT)
    first = spec.create_completion("def parse(line):", **kw)["choices"][0]["text"]
    for text in ("import os\n", "class A:\n    def __init__(self):"):  # drafting in between moves auto's lengths
        spec.create_completion(text, max_tokens=64, seed=9, **HOT)
    assert spec.create_completion("def parse(line):", **kw)["choices"][0]["text"] == first
    other = spec.create_completion("def parse(line):", **{**kw, "seed": 124})["choices"][0]["text"]
    assert other != first


def test_rejection_sampling_stays_available() -> None:
    spec = SpeculativeLlama(
        str(TARGET), str(drafter_gguf("q8_0")), n_ctx=512, n_threads=THREADS, n_max=3, sampler="rejection"
    )
    assert spec.create_completion("x = ", max_tokens=8, seed=1, **HOT)["choices"][0]["finish_reason"]
    with pytest.raises(ValueError, match="sampler must be 'rejection' or 'gumbel'"):
        SpeculativeLlama(str(TARGET), str(drafter_gguf("q8_0")), n_ctx=512, n_threads=THREADS, sampler="other")
