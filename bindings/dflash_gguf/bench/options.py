"""The bench's options: systems, n_max values, prompt files; the errors a user can fix."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("ar", "ours", "upstream", "upstream-ar")
DEFAULT_SYSTEMS = ("ar", "ours", "upstream")

NMax = int | str  # an int >= 0 (0 = block_size - 1) or "auto"


class BenchError(RuntimeError):
    """A problem the user can fix (missing binary, bad option); printed without a traceback."""


def parse_draft_vocab(value: str | None) -> list[str | None]:
    """'none,V.json' -> [None, 'V.json'] (none = the whole vocabulary); each file must exist."""
    out: list[str | None] = []
    for v in (value or "none").split(","):
        v = v.strip()
        if v.lower() == "none":
            out.append(None)
        elif not Path(v).is_file():
            raise BenchError(f"--draft-vocab: {v} is not a file")
        else:
            out.append(v)
    if len(set(out)) != len(out):
        raise BenchError(f"--draft-vocab: {value!r} names a vocabulary twice")
    return out


def parse_n_max(value: str | int | Sequence[Any]) -> list[NMax]:
    """'7' -> [7]; '3,7,15' -> [3, 7, 15]; 'auto' -> ['auto']; '0' = block_size - 1."""
    if isinstance(value, int):
        items: list[Any] = [value]
    elif isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    else:
        items = list(value)
    out: list[NMax] = []
    for v in items:
        if isinstance(v, str) and v.lower() == "auto":
            out.append("auto")
            continue
        try:
            k = int(v)
        except (TypeError, ValueError):
            raise BenchError(f"--n-max: {v!r} is neither an int nor 'auto'") from None
        if k < 0:
            raise BenchError(f"--n-max: {k} < 0 (0 = block_size - 1)")
        out.append(k)
    if not out:
        raise BenchError("--n-max: no value given")
    return out


def parse_systems(value: str | Sequence[str]) -> list[str]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    items = [v for v in items if v]
    bad = [v for v in items if v not in SYSTEMS]
    if bad:
        raise BenchError(f"--systems: unknown {', '.join(bad)} (choose from {', '.join(SYSTEMS)})")
    if not items:
        raise BenchError("--systems: none given")
    # the ar baseline always runs: speedups are ratios to it
    ordered = ["ar"] + [s for s in SYSTEMS if s in items and s != "ar"]
    return ordered


def placement_flags(override_tensor: Sequence[str] = (), cpu_moe: bool = False, n_cpu_moe: int = 0) -> list[str]:
    """llama-server's flags for where the target's weights go (ours gets the same values)."""
    flags = [a for ot in override_tensor for a in ("-ot", ot)] + ["--cpu-moe"] * cpu_moe
    return flags + ["--n-cpu-moe", str(n_cpu_moe)] * (n_cpu_moe > 0)


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, str]]:
    """JSONL with a "text" (or "prompt") field per line; "id" optional."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{path}:{i + 1}: not JSON ({e})") from None
            if isinstance(obj, str):
                obj = {"text": obj}
            text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise BenchError(f'{path}:{i + 1}: no "text" field')
            prompts.append({"id": str(obj.get("id", f"prompt-{len(prompts)}")), "text": text})
    if limit is not None and limit > 0:
        prompts = prompts[:limit]
    if not prompts:
        raise BenchError(f"{path}: no prompts")
    return prompts


@dataclass
class BenchOptions:
    target: str
    draft: str
    prompts: str
    n_predict: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    n_max: list[NMax] = field(default_factory=lambda: [0])
    repeat: int = 1
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    threads: int = 0
    seed: int = 0
    n_ctx: int = 2048
    n_gpu_layers: int = 0
    device: str = "auto"
    draft_q: str = "logits"
    limit: int | None = None
    server_binary: str | None = None
    server_args: list[str] = field(default_factory=list)
    # where the target's weights go, for ours and llama-server alike (llama-server's -ot, --cpu-moe, --n-cpu-moe)
    override_tensor: list[str] = field(default_factory=list)
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    # sliding-window layers keep every position, for ours and llama-server alike (llama-server's --swa-full)
    swa_full: bool = False
    # ours' drafting vocabularies (draft_vocab.py), each run at every n_max; None: the whole vocabulary
    draft_vocab: list[str | None] = field(default_factory=lambda: [None])
    progress: bool = True
