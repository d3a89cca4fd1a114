"""Saved contexts: llama_cpp.Llama's save_state / load_state / set_cache for the speculative pair.

A state holds what the target's K/V cache and the drafter's context cache hold for a token prefix, so a
later prompt that continues it prefills only the rest. It quacks like llama_cpp.LlamaState where
llama_cpp's caches look (`input_ids`, `llama_state_size`), so `llama_cpp.LlamaRAMCache` and
`LlamaDiskCache` (which pickles it) hold it as they hold theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np


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
