"""What the converter needs from the target GGUF: sizes, tokenizer keys, and (optionally) its head."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from .errors import ConversionError
from .gguf_file import GGUFHeader, TensorInfo, read_header
from .source import TensorRef, bf16_to_f32, row_split

TOKENIZER_PREFIX = "tokenizer.ggml."


@dataclass(frozen=True)
class KV:
    """One GGUF key/value, with the types needed to write it back unchanged."""

    key: str
    value: Any  # scalar, bytes (a string), or list of those for arrays
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass
class TargetInfo:
    path: Path
    arch: str
    n_layer: int
    hidden: int
    vocab_size: int
    tokenizer_kvs: list[KV]
    head_tensors: dict[str, TensorRef] = field(default_factory=dict)  # token_embd.weight / output.weight
    rope_sections: list[int] | None = None  # {arch}.rope.dimension_sections: an M-RoPE target (Qwen3.5)


def _scalar(header: GGUFHeader, key: str, path: Path) -> Any:
    f = header.fields.get(key)
    if f is None:
        raise ConversionError(f"{path}: target GGUF has no '{key}'")
    if f.vtype == GGUFValueType.ARRAY:
        raise ConversionError(f"{path}: target GGUF key '{key}' is an array, expected a scalar")
    return f.value.decode("utf-8") if isinstance(f.value, bytes) else f.value


def load_target(path: Path, *, want_head: bool = False) -> TargetInfo:
    """Read the target GGUF's metadata (and, for --embed-target-head, find its embedding and LM head)."""
    if not path.is_file():
        raise ConversionError(f"{path}: target GGUF not found")
    header = read_header(path)

    arch = _scalar(header, "general.architecture", path)
    if not isinstance(arch, str):
        raise ConversionError(f"{path}: 'general.architecture' is not a string")
    if arch == "dflash":
        raise ConversionError(f"{path}: this is a dflash drafter, not a target model (pass the target's GGUF)")
    n_layer = int(_scalar(header, f"{arch}.block_count", path))
    hidden = int(_scalar(header, f"{arch}.embedding_length", path))

    tokens = header.fields.get(f"{TOKENIZER_PREFIX}tokens")
    if tokens is None or tokens.vtype != GGUFValueType.ARRAY:
        raise ConversionError(f"{path}: target GGUF has no 'tokenizer.ggml.tokens' (the drafter needs its tokenizer)")
    vocab = len(tokens.value)

    kvs = [
        KV(key, f.value, f.vtype, f.sub_type) for key, f in header.fields.items() if key.startswith(TOKENIZER_PREFIX)
    ]

    info = TargetInfo(path, arch, n_layer, hidden, vocab, kvs)
    sections = header.fields.get(f"{arch}.rope.dimension_sections")
    if sections is not None and sections.vtype == GGUFValueType.ARRAY and any(sections.value):
        info.rope_sections = [int(v) for v in sections.value]
    if want_head:
        tensors = header.tensors
        if "token_embd.weight" not in tensors:
            raise ConversionError(f"{path}: --embed-target-head: the target has no 'token_embd.weight'")
        info.head_tensors["token_embd.weight"] = _gguf_ref(path, tensors["token_embd.weight"])
        if "output.weight" in tensors:
            info.head_tensors["output.weight"] = _gguf_ref(path, tensors["output.weight"])
    return info


def _gguf_ref(path: Path, t: TensorInfo) -> TensorRef:
    """A TensorRef over a GGUF tensor: rows are read by offset and dequantized to float32 chunk by chunk."""
    qtype = t.qtype
    shape = t.shape
    nrows, ncols = row_split(shape)
    block, tsize = GGML_QUANT_SIZES[qtype]
    row_bytes = ncols // block * tsize

    def raw_rows(start: int, stop: int) -> np.ndarray:
        count = (stop - start) * row_bytes
        with open(path, "rb") as f:
            f.seek(t.offset + start * row_bytes)
            buf = np.fromfile(f, dtype=np.uint8, count=count)
        if buf.size != count:
            raise ConversionError(f"{path}: tensor '{t.name}' is truncated")
        return buf.reshape(stop - start, row_bytes)

    def rows(start: int, stop: int) -> np.ndarray:
        raw = raw_rows(start, stop)
        n = stop - start
        if qtype == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(n, ncols)
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(n, ncols)
        if qtype == GGMLQuantizationType.BF16:
            return bf16_to_f32(raw.view(np.uint16)).reshape(n, ncols)
        return dequantize(raw, qtype).astype(np.float32, copy=False).reshape(n, ncols)

    return TensorRef(t.name, path, qtype.name, shape, rows, raw_rows)
