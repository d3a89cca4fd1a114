"""Saved contexts: llama_cpp.Llama's save_state / load_state / set_cache for the speculative pair.

A state holds what the target's K/V cache and the drafter's context cache hold for a token prefix, so a
later prompt that continues it prefills only the rest. It quacks like llama_cpp.LlamaState where
llama_cpp's caches look (`input_ids`, `llama_state_size`), so `llama_cpp.LlamaRAMCache` and
`LlamaDiskCache` (which pickles it) hold it as they hold theirs.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from ._core import DFlashError


@dataclass(frozen=True)
class SpeculativeState:
    input_ids: np.ndarray  # the tokens whose K/V the state holds (positions 0..n-1)
    target: bytes  # libllama's serialised sequence (llama_state_seq_get_data)
    draft: bytes  # the drafter's context cache: K/V of the same rows

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def llama_state_size(self) -> int:
        """Bytes held (what llama_cpp's caches count against their capacity)."""
        return len(self.target) + len(self.draft) + self.input_ids.nbytes


def cached_state_for(cache: Any, prompt: list[int], held: Sequence[int]) -> SpeculativeState | None:
    """The cache's state sharing the longest prefix with the prompt, when it shares more than what the
    context holds already (llama_cpp.Llama's rule); None otherwise."""
    try:
        state = cache[prompt]
    except KeyError:
        return None
    if not isinstance(state, SpeculativeState):
        raise TypeError(
            f"the cache holds a {type(state).__name__}, not a SpeculativeState (a cache shared with "
            "a llama_cpp.Llama?); give each its own"
        )
    shared = llama_cpp.Llama.longest_token_prefix  # the measure llama_cpp's caches use
    return state if shared(state.input_ids.tolist(), prompt) > shared(held, prompt) else None


class StateMixin:
    """SpeculativeLlama's save_state, load_state, reset and set_cache, on its context."""

    def save_state(self) -> SpeculativeState:
        """What the context holds now (the target's K/V and the drafter's, for `state.input_ids`): a
        later generation whose prompt continues those tokens, after load_state, prefills only the rest."""
        with self._idle():
            self._take_context_from_llama()
            try:
                return self._save_state()
            finally:
                self._give_context_to_llama()

    def load_state(self, state: SpeculativeState) -> None:
        """Make the context hold what save_state saved (from this object, or another one over the same
        target and drafter files and a context at least as long). A state that does not fit raises
        DFlashError and leaves an empty context."""
        if not isinstance(state, SpeculativeState):
            raise TypeError(f"load_state takes a SpeculativeState (from save_state), got {type(state).__name__}")
        with self._idle():
            try:
                self._load_state(state)
            finally:
                self._give_context_to_llama()

    def reset(self) -> None:
        """llama_cpp.Llama.reset: forget what the context holds (the next prompt is prefilled whole)."""
        with self._idle():
            self._spec.keep_cached_prefix([])
            self._give_context_to_llama()

    def set_cache(self, cache: Any) -> None:
        """llama_cpp.Llama.set_cache: with a cache (`llama_cpp.LlamaRAMCache(capacity_bytes)`,
        `LlamaDiskCache`, or None to stop), each generation starts from the saved state sharing the longest
        prefix with its prompt when that beats what the context holds, and leaves its own state there
        (keyed by the tokens it holds: a chat's next turn finds it). Saving copies the whole context."""
        self.cache = cache

    def _load_cached(self, prompt: list[int]) -> None:
        state = cached_state_for(self.cache, prompt, self._spec.cached_tokens)
        if state is None:
            return
        try:
            self._load_state(state)
        except DFlashError as e:  # a cache entry that does not fit is a miss: the prompt is prefilled whole
            warnings.warn(f"set_cache: a cached state was not usable ({e}); prefilling instead", stacklevel=4)

    def _save_state(self) -> SpeculativeState:
        tokens, target, draft = self._spec.save_state()
        return SpeculativeState(np.asarray(tokens, dtype=np.intc), target, draft)

    def _load_state(self, state: SpeculativeState) -> None:
        self._spec.load_state(state.input_ids.tolist(), state.target, state.draft)
