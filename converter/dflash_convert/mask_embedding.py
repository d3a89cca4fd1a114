"""A drafter's own trained vector for its mask token (`mask_embedding.pt`, MiMo-style drafters).

Such a drafter reads the target's token embedding except at the mask token, which the target never
trained. The GGUF then carries `token_embd` = the target's embedding with that row replaced and `output`
= the target's LM head (kept apart from the patched table), as upstream's converter writes it; the
loader uses a drafter's own embedding and head whenever it carries both.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from .config import DraftConfig
from .errors import ConversionError
from .source import TensorRef

MASK_FILE = "mask_embedding.pt"


def load_mask_embedding(draft_dir: Path, cfg: DraftConfig) -> np.ndarray | None:
    """The mask token's vector from `mask_embedding.pt` ({"mask_token_id": int, "embedding": (hidden,)}),
    checked against the config; None without the file. Read with torch.load(weights_only=True): a
    dictionary of tensors and numbers, no code."""
    path = draft_dir / MASK_FILE
    if not path.is_file():
        return None
    try:
        import torch
    except ImportError as e:
        raise ConversionError(f"{path}: reading it needs PyTorch (pip install torch)") from e
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise ConversionError(f"{path}: not a loadable weights-only PyTorch file ({e})") from e
    if not isinstance(data, dict) or "mask_token_id" not in data or "embedding" not in data:
        raise ConversionError(f"{path}: expected a dict with 'mask_token_id' and 'embedding'")
    mask_id = int(data["mask_token_id"])
    if mask_id != cfg.mask_token_id:
        raise ConversionError(
            f"{path}: mask_token_id {mask_id} does not match dflash_config.mask_token_id {cfg.mask_token_id}"
        )
    if cfg.vocab_size is not None and not 0 <= mask_id < cfg.vocab_size:
        raise ConversionError(f"{path}: mask_token_id {mask_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    emb = data["embedding"]
    shape = tuple(emb.shape) if hasattr(emb, "shape") else None
    if shape != (cfg.hidden_size,):
        raise ConversionError(f"{path}: 'embedding' has shape {shape}, expected ({cfg.hidden_size},)")
    vec = emb.detach().to(torch.float32).numpy()
    if not np.isfinite(vec).all():
        raise ConversionError(f"{path}: 'embedding' holds non-finite values")
    return vec


def with_mask_row(embedding: TensorRef, mask_id: int, vec: np.ndarray) -> TensorRef:
    """The target's embedding with row `mask_id` replaced (read as float32: the copy is re-encoded)."""

    def rows(start: int, stop: int) -> np.ndarray:
        out = embedding.rows(start, stop)
        if start <= mask_id < stop:  # a copy only of the chunk holding the row (others may be the file's view)
            out = np.array(out, dtype=np.float32, copy=True)
            out[mask_id - start] = vec
        return out

    return replace(embedding, key=f"{embedding.key}+{MASK_FILE}", rows=rows, raw_rows=None)
