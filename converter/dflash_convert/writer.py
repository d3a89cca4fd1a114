"""Streaming GGUF writing (tensor by tensor, chunk by chunk) and read-back verification."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from .errors import ConversionError
from .metadata import ARCH
from .quantize import RangeError, check_close, decode_rows, encode_rows, keeps_f32, nbytes
from .source import DEFAULT_CHUNK_ELEMS, TensorRef, row_split, rows_per_chunk
from .target import KV
from .tensor_map import Kind

Q = GGMLQuantizationType


@dataclass
class PlannedTensor:
    """One tensor of the output: where it comes from, its GGUF name, shape and type."""

    source_name: str  # checkpoint key, or "target:<name>" for --embed-target-head
    gguf: str
    shape: tuple[int, ...]  # torch order; GGUF ne is the reverse
    kind: Kind
    src: TensorRef
    qtype: Q  # the type this converter writes
    reason: str

    @property
    def nbytes(self) -> int:
        return nbytes(self.qtype, self.shape)

    @property
    def passthrough(self) -> bool:
        """The stored bytes can be copied as they are (same type in and out)."""
        return self.src.raw_rows is not None and self.src.dtype == self.qtype.name


ProgressFn = Callable[[PlannedTensor, int], None]  # (tensor, bytes just written)


def write_gguf(
    path: Path,
    kvs: Iterable[KV],
    tensors: list[PlannedTensor],
    *,
    on_progress: ProgressFn | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> None:
    """Write a GGUF file at ``path`` (which should be a temporary name), streaming tensor data."""
    w = GGUFWriter(path, ARCH)
    for kv in kvs:
        w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    for t in tensors:
        w.add_tensor_info(t.gguf, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        for t in tensors:
            w.write_padding(fout, fout.tell())
            written = 0
            nrows, ncols = row_split(t.shape)
            step = rows_per_chunk(ncols, chunk_elems)
            for start in range(0, nrows, step):
                stop = min(nrows, start + step)
                if t.passthrough:
                    assert t.src.raw_rows is not None
                    raw = t.src.raw_rows(start, stop)
                else:
                    try:
                        raw = encode_rows(t.src.rows(start, stop), t.qtype)
                    except RangeError as exc:
                        raise ConversionError(f"{t.src.file}: tensor '{t.source_name}': {exc}") from None
                fout.write(memoryview(np.ascontiguousarray(raw)).cast("B"))
                written += raw.nbytes
                if on_progress is not None:
                    on_progress(t, raw.nbytes)
            if written != t.nbytes:
                raise ConversionError(
                    f"{path}: tensor '{t.gguf}' wrote {written} bytes, expected {t.nbytes}"
                )
            w.write_padding(fout, written)
        fout.flush()
    finally:
        w.close()


# ----------------------------------------------------------------------------
# read-back verification
# ----------------------------------------------------------------------------

def _kv_value(field) -> tuple[object, GGUFValueType, GGUFValueType | None]:  # type: ignore[no-untyped-def]
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        sub = GGUFValueType(field.types[-1])
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[-1]), vtype, None
    return field.parts[-1].tolist()[0], vtype, None


def _same_value(a: object, b: object, vtype: GGUFValueType, sub: GGUFValueType | None) -> bool:
    if vtype == GGUFValueType.FLOAT32:
        return np.float32(a) == np.float32(b)  # type: ignore[arg-type]
    if vtype == GGUFValueType.ARRAY and sub == GGUFValueType.FLOAT32:
        return np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if vtype == GGUFValueType.STRING and isinstance(b, str):
        b = b.encode("utf-8")
    if vtype == GGUFValueType.ARRAY and sub == GGUFValueType.STRING:
        b = [x.encode("utf-8") if isinstance(x, str) else x for x in b]  # type: ignore[union-attr]
        return list(a) == list(b)  # type: ignore[call-overload]
    if vtype == GGUFValueType.ARRAY:
        return list(a) == list(b)  # type: ignore[call-overload]
    return a == b


def verify_gguf(
    path: Path,
    kvs: list[KV],
    tensors: list[PlannedTensor],
    *,
    libllama_types: bool = False,
    check_kv_types: bool = True,
    display_path: Path | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    on_progress: ProgressFn | None = None,
) -> dict[str, Q]:
    """Read ``path`` back and check every key, tensor name, shape, type and value.

    Values are exact for F32/F16/BF16 and within a per-block quantization
    tolerance otherwise. With ``libllama_types`` the types are libllama's
    choice (K-quant mixes): any type is accepted except that norms, 1-D
    tensors and conv bases must still be F32. Returns the stored type of
    every tensor.
    """
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"{path}: written file cannot be read back ({exc})") from None

    def fail(msg: str) -> ConversionError:
        return ConversionError(f"{display_path or path}: read-back check failed: {msg}")

    arch_field = reader.fields.get("general.architecture")
    if arch_field is None or bytes(arch_field.parts[-1]) != ARCH.encode():
        raise fail("general.architecture is not 'dflash'")
    for kv in kvs:
        f = reader.fields.get(kv.key)
        if f is None:
            raise fail(f"key '{kv.key}' is missing")
        value, vtype, sub = _kv_value(f)
        if check_kv_types and (vtype != kv.vtype or (kv.sub_type is not None and sub != kv.sub_type)):
            raise fail(f"key '{kv.key}' has type {vtype.name}/{sub}, expected {kv.vtype.name}/{kv.sub_type}")
        if not _same_value(value, kv.value, kv.vtype, kv.sub_type):
            raise fail(f"key '{kv.key}' has a different value than written")

    stored = {t.name: t for t in reader.tensors}
    want = {t.gguf: t for t in tensors}
    missing = sorted(set(want) - set(stored))
    extra = sorted(set(stored) - set(want))
    if missing:
        raise fail(f"tensor '{missing[0]}' is missing")
    if extra:
        raise fail(f"unexpected tensor '{extra[0]}'")

    types: dict[str, Q] = {}
    with open(path, "rb") as fh:
        for t in tensors:
            rt = stored[t.gguf]
            shape = tuple(int(s) for s in reversed(rt.shape.tolist()))
            qtype = Q(rt.tensor_type)
            types[t.gguf] = qtype
            if shape != t.shape:
                raise fail(f"tensor '{t.gguf}' has shape {shape}, expected {t.shape}")
            if libllama_types:
                if keeps_f32(t.kind, t.shape) and qtype != Q.F32:
                    raise fail(f"tensor '{t.gguf}' must stay F32, libllama wrote {qtype.name}")
            elif qtype != t.qtype:
                raise fail(f"tensor '{t.gguf}' has type {qtype.name}, expected {t.qtype.name}")
            if int(rt.n_bytes) != nbytes(qtype, t.shape):
                raise fail(f"tensor '{t.gguf}' holds {int(rt.n_bytes)} bytes, expected {nbytes(qtype, t.shape)}")
            nrows, ncols = row_split(t.shape)
            row_bytes = nbytes(qtype, (ncols,))
            step = rows_per_chunk(ncols, chunk_elems)
            base = int(rt.data_offset)
            for start in range(0, nrows, step):
                stop = min(nrows, start + step)
                count = (stop - start) * row_bytes
                fh.seek(base + start * row_bytes)
                raw = np.fromfile(fh, dtype=np.uint8, count=count)
                if raw.size != count:
                    raise fail(f"tensor '{t.gguf}' data is truncated")
                raw = raw.reshape(stop - start, row_bytes)
                if t.passthrough and qtype == t.qtype and t.src.raw_rows is not None:
                    if not np.array_equal(raw, t.src.raw_rows(start, stop)):
                        raise fail(f"tensor '{t.gguf}' rows {start}..{stop} differ from '{t.source_name}'")
                else:
                    src = t.src.rows(start, stop)
                    got = decode_rows(raw, qtype, ncols)
                    why = check_close(src, got, qtype)
                    if why is not None:
                        raise fail(f"tensor '{t.gguf}' (from '{t.source_name}', rows {start}..{stop}): {why}")
                if on_progress is not None:
                    on_progress(t, count)
    del reader
    return types
