"""Saved contexts on the bundled tinycode pair: save_state / load_state / set_cache as llama_cpp.Llama's.

A restored state must hold what a prefill would have put there, in the target (the output shows it)
and in the draft cache (the output cannot show it: verification keeps the output exact whatever the
drafts; the drafts, hence the accepted counts, do).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from tinycode import TARGET, THREADS, drafter_gguf, mismatched_drafter_gguf, prompts  # noqa: E402

from dflash_gguf import DFlashError, SpeculativeLlama, SpeculativeState  # noqa: E402

GREEDY = {"temperature": 0.0}


def _pair(n_ctx: int = 1024) -> SpeculativeLlama:
    # a fixed draft length: the drafts of two runs then depend on the draft cache alone
    return SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=n_ctx, n_threads=THREADS, n_max=7)


def _run(llm: SpeculativeLlama, prompt: str, n: int = 48) -> tuple[str, int, int, int]:
    text = llm.create_completion(prompt, max_tokens=n, **GREEDY)["choices"][0]["text"]
    s = llm.stats
    return text, s.accepted, s.drafted, s.reused_prompt_tokens


def test_a_loaded_state_is_a_prefilled_context() -> None:
    p0, p1 = prompts()[1]["text"], prompts()[3]["text"]
    n0 = len(_pair().tokenize(p0, special=True))
    with _pair() as a, _pair() as b:
        fresh = _run(a, p0)
        assert fresh[3] == 0 and fresh[1] > 0
        state = a.save_state()
        assert state.n_tokens >= n0 + 47 and state.input_ids[:n0].tolist() == a.tokenize(p0, special=True)
        _run(a, p1)  # the context now holds another prompt
        a.load_state(state)
        again = _run(a, p0)
        assert again[:3] == fresh[:3] and again[3] == n0 - 1  # only the last prompt token decoded again
        # another object, through pickle (llama_cpp.LlamaDiskCache stores states so)
        b.load_state(pickle.loads(pickle.dumps(state)))
        assert _run(b, p0) == again
        # a prompt that continues the state's tokens reuses all of them
        longer = p0 + fresh[0] + "\n"
        b.load_state(state)
        _, _, _, reused = _run(b, longer, 8)
        assert reused >= n0 + 40
        b.reset()  # as llama_cpp.Llama.reset: nothing reused after
        assert b.save_state().n_tokens == 0 and _run(b, p0) == fresh


def test_set_cache_takes_the_longest_cached_prefix() -> None:
    p0, p1 = prompts()[1]["text"], prompts()[5]["text"]
    with _pair() as plain, _pair() as cached:
        first = _run(plain, p0)
        cache = llama_cpp.LlamaRAMCache(capacity_bytes=1 << 30)
        cached.set_cache(cache)
        assert _run(cached, p0) == first
        _run(cached, p1)
        assert len(cache.cache_state) == 2
        # back to the first prompt: its state comes from the cache, drafts and all
        assert _run(cached, p0)[:3] == first[:3] and cached.stats.reused_prompt_tokens > 0
        # a chat's next turn: the prompt continues the last completion
        turn = p0 + first[0] + "\n"
        _run(cached, p1)
        _, _, _, reused = _run(cached, turn, 8)
        assert reused >= len(cached.tokenize(p0, special=True)) + 40
        cached.set_cache(None)
        _run(cached, p1)
        assert len(cache.cache_state) == 3  # no longer saved to
        # an entry that does not fit (a disk cache from another build, say) is a miss, not an error
        key = next(k for k in cache.cache_state if list(k[:5]) == cached.tokenize(p0, special=True)[:5])
        cache.cache_state[key] = replace(cache.cache_state[key], draft=b"")
        cached.set_cache(cache)
        with pytest.warns(UserWarning, match="not usable.*draft cache has 0 bytes"):
            assert _run(cached, p0) == (*first[:3], 0)


def test_a_state_that_does_not_fit_is_refused_and_nothing_breaks() -> None:
    p0 = prompts()[2]["text"]
    with _pair() as a:
        expected = _run(a, p0, 200)
        state = a.save_state()
        assert state.n_tokens > 256
        with _pair(n_ctx=256) as small:
            with pytest.raises(DFlashError, match="n_ctx|context"):
                small.load_state(state)
            assert small.create_completion("x = 1", max_tokens=4, **GREEDY)["choices"][0]["finish_reason"]
        with pytest.raises(DFlashError, match="draft cache has"):
            a.load_state(replace(state, draft=state.draft[:-4]))
        with pytest.raises(DFlashError, match="positions"):
            a.load_state(replace(state, input_ids=state.input_ids[:-1]))
        with pytest.raises(TypeError, match="SpeculativeState"):
            a.load_state(object())  # type: ignore[arg-type]
        assert _run(a, p0, 200) == (*expected[:3], 0)  # the failed loads left an empty context
        other = mismatched_drafter_gguf("hidden")
        with SpeculativeLlama(str(other.parent / "target.gguf"), str(other), n_ctx=1024, n_threads=THREADS) as o:
            with pytest.raises(DFlashError, match="another model"):
                o.load_state(state)
        # llama_cpp.Llama's own states in the cache (one cache given to both)
        shared = llama_cpp.LlamaRAMCache()
        shared[state.input_ids.tolist()] = SimpleNamespace(input_ids=state.input_ids, llama_state_size=1)
        a.set_cache(shared)
        with pytest.raises(TypeError, match="SpeculativeState"):
            _run(a, p0)
        a.set_cache(None)
        assert isinstance(state, SpeculativeState) and _run(a, p0, 200)[:3] == expected[:3]


def test_an_adopted_llama_sees_the_loaded_state() -> None:
    """from_llama shares the target context: after load_state the Llama's record says what it holds, so
    the Llama continues those tokens' K/V and its text stays its own."""
    p0 = prompts()[1]["text"]
    own = llama_cpp.Llama(str(TARGET), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    fresh_llama = own.create_completion(p0, max_tokens=24, **GREEDY)["choices"][0]["text"]
    adopted = SpeculativeLlama.from_llama(own, draft=str(drafter_gguf("f32")), n_max=7)
    with _pair() as a:
        fresh = _run(a, p0)
        state = a.save_state()
    adopted.load_state(state)
    assert own.n_tokens == state.n_tokens and own.input_ids[: own.n_tokens].tolist() == state.input_ids.tolist()
    assert own.create_completion(p0, max_tokens=24, **GREEDY)["choices"][0]["text"] == fresh_llama
    adopted.load_state(state)
    assert _run(adopted, p0) == (*fresh[:3], len(own.tokenize(p0.encode(), special=True)) - 1)
    saved = adopted.save_state()
    assert saved.input_ids.tolist() == own.input_ids[: own.n_tokens].tolist()
    adopted.close()
    own.close()
