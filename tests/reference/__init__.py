"""PyTorch references for tests: the Qwen3 target and the DFlash 1/2 drafter.

See dflash_ref.py (DraftReference, DraftCache, DraftOutput) and qwen3_ref.py (Qwen3Reference).
"""

from __future__ import annotations

from .dflash_ref import DraftCache, DraftConfig, DraftOutput, DraftReference, default_target_layer_ids
from .qwen3_ref import Qwen3Output, Qwen3Reference

__all__ = [
    "DraftCache",
    "DraftConfig",
    "DraftOutput",
    "DraftReference",
    "Qwen3Output",
    "Qwen3Reference",
    "default_target_layer_ids",
]
