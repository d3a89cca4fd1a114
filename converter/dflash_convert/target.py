"""What the converter needs from the target GGUF: sizes, tokenizer keys, and (optionally) its head."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from .errors import ConversionError
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


def _field_value(f: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    vtype = GGUFValueType(f.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(f.types[-1])
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data], vtype, sub
        if sub == GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        return [f.parts[i].tolist()[0] for i in f.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(f.parts[-1]), vtype, None
    return f.parts[-1].tolist()[0], vtype, None


def _scalar(reader: GGUFReader, key: str, path: Path) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise ConversionError(f"{path}: target GGUF has no '{key}'")
    value, vtype, _ = _field_value(f)
    if vtype == GGUFValueType.ARRAY:
        raise ConversionError(f"{path}: target GGUF key '{key}' is an array, expected a scalar")
    return value.decode("utf-8") if isinstance(value, bytes) else value


def load_target(path: Path, *, want_head: bool = False) -> TargetInfo:
    """Read the target GGUF's metadata (and, for --embed-target-head, find its embedding and LM head)."""
    if not path.is_file():
        raise ConversionError(f"{path}: target GGUF not found")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - GGUFReader raises ValueError and friends
        raise ConversionError(f"{path}: cannot read the target GGUF ({exc})") from None

    arch = _scalar(reader, "general.architecture", path)
    if not isinstance(arch, str):
        raise ConversionError(f"{path}: 'general.architecture' is not a string")
    if arch == "dflash":
        raise ConversionError(f"{path}: this is a dflash drafter, not a target model (pass the target's GGUF)")
    n_layer = int(_scalar(reader, f"{arch}.block_count", path))
    hidden = int(_scalar(reader, f"{arch}.embedding_length", path))

    tokens = reader.fields.get(f"{TOKENIZER_PREFIX}tokens")
    if tokens is None:
        raise ConversionError(f"{path}: target GGUF has no 'tokenizer.ggml.tokens' (the drafter needs its tokenizer)")
    vocab = len(tokens.data)

    kvs: list[KV] = []
    for key, f in reader.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        try:
            value, vtype, sub = _field_value(f)
        except ValueError as exc:
            raise ConversionError(f"{path}: cannot copy '{key}': {exc}") from None
        kvs.append(KV(key, value, vtype, sub))

    info = TargetInfo(path, arch, n_layer, hidden, vocab, kvs)
    if want_head:
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ConversionError(f"{path}: --embed-target-head: the target has no 'token_embd.weight'")
        info.head_tensors["token_embd.weight"] = _gguf_ref(path, tensors["token_embd.weight"])
        if "output.weight" in tensors:
            info.head_tensors["output.weight"] = _gguf_ref(path, tensors["output.weight"])
    return info


def _gguf_ref(path: Path, t: Any) -> TensorRef:
    """A TensorRef over a GGUF tensor: rows are dequantized to float32 chunk by chunk."""
    qtype = GGMLQuantizationType(t.tensor_type)
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ne -> torch order
    nrows, ncols = row_split(shape)
    data = t.data  # memmap view, numpy shape (rows, ...) in torch order (bytes for quantized types)
    flat = data.reshape(nrows, -1)

    def raw_rows(start: int, stop: int) -> np.ndarray:
        return np.ascontiguousarray(flat[start:stop]).view(np.uint8).reshape(stop - start, -1)

    def rows(start: int, stop: int) -> np.ndarray:
        chunk = np.ascontiguousarray(flat[start:stop])
        if qtype == GGMLQuantizationType.F32:
            return chunk.astype(np.float32, copy=False).reshape(stop - start, ncols)
        if qtype == GGMLQuantizationType.F16:
            return chunk.astype(np.float32).reshape(stop - start, ncols)
        if qtype == GGMLQuantizationType.BF16:
            return bf16_to_f32(chunk.view(np.uint16)).reshape(stop - start, ncols)
        return dequantize(chunk.view(np.uint8), qtype).astype(np.float32, copy=False).reshape(stop - start, ncols)

    return TensorRef(t.name, path, qtype.name, shape, rows, raw_rows)
