"""llama-server's slot files (--slot-save-path; POST /slots/{id}?action=save|restore): a slot's context
written to a file of the server's directory and read back, so that a conversation survives a restart or
makes room for others. Ours hold the target's sequence state and the drafter's cache (SpeculativeState),
in a file format of our own: a header, the tokens, then the two blobs."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..state import SpeculativeState

MAGIC = b"DFLASH-SLOT\x01"
_HEADER = struct.Struct("<12sIQQ")  # magic, tokens, target bytes, draft bytes


def valid_filename(name: object) -> bool:
    """A plain file name inside the directory (llama-server's fs_validate_filename, in spirit): no path."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode()) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\x00")
    )


def write_slot(path: Path, state: SpeculativeState) -> int:
    """Writes `state` to `path` (whole or not at all: a temporary file renamed); the bytes written."""
    tokens = np.asarray(state.input_ids, dtype="<i4").tobytes()
    data = _HEADER.pack(MAGIC, state.n_tokens, len(state.target), len(state.draft)) + tokens
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.write(state.target)
        f.write(state.draft)
    os.replace(tmp, path)
    return len(data) + len(state.target) + len(state.draft)


def read_slot(path: Path) -> tuple[SpeculativeState, int]:
    """The state in a slot file and its size; ValueError naming the file when it is not one."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path.name}: cannot read it ({e.strerror})") from None
    if len(data) < _HEADER.size or not data.startswith(MAGIC):
        raise ValueError(f"{path.name}: not a slot file of dflash serve")
    _, n, n_target, n_draft = _HEADER.unpack_from(data)
    if len(data) != _HEADER.size + 4 * n + n_target + n_draft:
        raise ValueError(f"{path.name}: truncated or padded slot file")
    at = _HEADER.size + 4 * n
    tokens = np.frombuffer(data, dtype="<i4", count=n, offset=_HEADER.size).astype(np.intc)
    return SpeculativeState(tokens, data[at : at + n_target], data[at + n_target :]), len(data)
