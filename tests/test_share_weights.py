"""SpeculativeLlama.share_weights: another decoder on loaded weights, with a context, draft cache and draft-length
controller of its own. `dflash bench` runs its n_max configurations so: a Q4_K_M target repacks into memory of
its own per load, so three separate loads of a real model need three times its memory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import (  # noqa: E402
    N_CTX,
    TARGET,
    THREADS,
    GreedyReference,
    compare_greedy,
    drafter_gguf,
    inflated_hybrid,
    inflated_moe,
    prompts,
)

from dflash_gguf import DFlashError, SpeculativeLlama  # noqa: E402

N_NEW = 40
EPS = 1e-2


def _decode(spec: SpeculativeLlama, toks: list[list[int]], **kw: float) -> list[tuple[list[int], int, int]]:
    """(output, drafted, accepted) per prompt; greedy unless kw says otherwise."""
    out = []
    for prompt in toks:
        tokens = list(spec.generate_tokens(prompt, max_tokens=N_NEW, **({"temperature": 0.0} | kw)))
        out.append((tokens, spec.stats.drafted, spec.stats.accepted))
    return out


def test_a_shared_decoder_drafts_and_decodes_as_a_fresh_load() -> None:
    draft = str(drafter_gguf("f32"))
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, sampler="rejection")
    first = SpeculativeLlama(str(TARGET), draft, n_max=3, draft_q="selector", **kw)  # type: ignore[arg-type]
    toks = [first.tokenize(p["text"], add_special=False) for p in prompts()[:4]]
    shared = first.share_weights(n_max=5)
    fresh = SpeculativeLlama(str(TARGET), draft, n_max=5, draft_q="selector", **kw)  # type: ignore[arg-type]
    assert (shared.n_max, first.n_max) == (5, 3)
    assert shared.n_ctx() == first.n_ctx() and shared.sampler == "rejection"
    # the same drafts and acceptances, greedy and sampled: the weights carry over, and so do the sampler and
    # draft_q (the rejection step's q, which decides which sampled drafts are kept)
    sampled = {"temperature": 0.9, "seed": 7}
    assert _decode(shared, toks) == _decode(fresh, toks)
    assert _decode(shared, toks, **sampled) == _decode(fresh, toks, **sampled)
    by_logits = first.share_weights(n_max=5, draft_q="logits")
    assert _decode(by_logits, toks, **sampled) != _decode(fresh, toks, **sampled)
    assert sum(acc for _, _, acc in _decode(shared, toks)) > 0
    # their caches are their own: the first decodes its own prompts in between, and both still agree with plain
    plain = [list(first.generate_tokens(t, max_tokens=N_NEW, temperature=0.0, plain=True)) for t in toks]
    assert [o for o, _, _ in _decode(first, toks)] == plain
    first.close()  # the weights stay while the shared ones hold them
    assert [o for o, _, _ in _decode(shared, toks)] == plain
    with pytest.raises(DFlashError, match="closed"):
        first.share_weights()
    with pytest.raises(ValueError, match="n_max must be 'auto' or an int"):
        shared.share_weights(n_max="longest")


def test_a_shared_hybrid_rolls_back_by_snapshots_for_its_own_n_max() -> None:
    """A recurrent target's context keeps libllama's snapshots for the drafts one verify holds: a decoder shared
    at a longer n_max gets a context with as many (it would otherwise restore checkpoints after rejections)."""
    _, pair = inflated_hybrid()
    target = str(pair.targets["f16"])
    ref = GreedyReference(target, n_ctx=N_CTX, n_threads=THREADS)
    first = SpeculativeLlama(target, str(pair.draft), n_ctx=N_CTX, n_threads=THREADS, n_max=1)
    shared = first.share_weights(n_max=7)
    assert shared._spec.target_memory == "recurrent-snapshots"
    problems = []
    for i, p in enumerate(prompts()[:4]):
        prompt = ref.tokenize(p["text"])
        out = list(shared.generate_tokens(prompt, max_tokens=N_NEW, temperature=0.0))
        problems += compare_greedy(ref, prompt, out, N_NEW, EPS, f"prompt {i}")[0]
    assert not problems, problems
    counters = shared._spec.rollback_counters
    assert counters["snapshot"] > 0 and counters["restored"] == 0, counters
    assert first._spec.rollback_counters["snapshot"] == 0  # nothing of the shared one's reached the first


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_shared_weights_are_held_once() -> None:
    """The Q4_K_M target of the small MoE (107 MB) repacks into memory of its own per load: a second load adds
    about its size besides its context and caches, a share those only."""
    _, pair = inflated_moe()
    target, draft = pair.targets["q4_k_m"], str(pair.draft)
    weights = target.stat().st_size + Path(draft).stat().st_size
    kw = dict(n_ctx=N_CTX, n_threads=THREADS, n_max=3)
    first = SpeculativeLlama(str(target), draft, **kw)  # type: ignore[arg-type]
    before = _rss_bytes()
    shared = [first.share_weights(n_max=2), first.share_weights(n_max="auto")]
    grown_by_shares = _rss_bytes() - before
    second = SpeculativeLlama(str(target), draft, **kw)  # type: ignore[arg-type]
    grown_by_load = _rss_bytes() - before - grown_by_shares
    # a load costs the weights more than a share does (each has a context and caches of its own besides)
    assert grown_by_load - grown_by_shares / 2 > 0.6 * weights, (grown_by_load, grown_by_shares, weights)
    for spec in (first, second, *shared):
        spec.close()


def test_an_adopted_target_is_not_shared() -> None:
    llm = llama_cpp.Llama(str(TARGET), n_ctx=N_CTX, n_threads=THREADS, verbose=False)
    adopted = SpeculativeLlama.from_llama(llm, str(drafter_gguf("f32")), n_max=3)
    with pytest.raises(DFlashError, match="adopted target's model belongs to its llama_cpp.Llama"):
        adopted.share_weights()
    prompt = llm.tokenize(b"def main(", add_bos=False)
    assert list(adopted.generate_tokens(prompt, max_tokens=8, temperature=0.0)) == list(
        adopted.generate_tokens(prompt, max_tokens=8, temperature=0.0, plain=True)
    )


def test_decoders_sharing_weights_run_in_parallel_threads() -> None:
    draft = str(drafter_gguf("f32"))
    first = SpeculativeLlama(str(TARGET), draft, n_ctx=N_CTX, n_threads=THREADS, n_max=3)
    decoders = [first, first.share_weights(n_max=2), first.share_weights(n_max="auto")]
    toks = [first.tokenize(p["text"], add_special=False) for p in prompts()[:6]]
    plain = [list(first.generate_tokens(t, max_tokens=N_NEW, temperature=0.0, plain=True)) for t in toks]
    results: dict[int, list[list[int]]] = {}

    def run(k: int) -> None:
        results[k] = [o for o, _, _ in _decode(decoders[k], toks)]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(decoders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results.get(k) for k in range(len(decoders))] == [plain] * len(decoders)
