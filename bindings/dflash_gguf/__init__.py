"""dflash-gguf: DFlash / DFlash2 speculative decoding for llama.cpp users.

The native core (`_core`) links the very libllama/libggml that `llama_cpp`
ships, so import llama_cpp first: its libraries are then already mapped.
"""

from __future__ import annotations

# isort: off
from . import _stdcxx_first  # noqa: F401  (before llama_cpp: see there)
import llama_cpp  # noqa: F401  (loads libllama/libggml before our extension)

# isort: on
from ._core import DFlashError, Drafter, inspect_draft, load_draft
from .speculative import GenerationStats, SpeculativeLlama
from .state import SpeculativeState

__all__ = [
    "DFlashError",
    "Drafter",
    "GenerationStats",
    "SpeculativeLlama",
    "SpeculativeState",
    "inspect_draft",
    "load_draft",
]
__version__ = "0.1.0"
