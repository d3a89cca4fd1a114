"""Streaming GGUF writing (tensor by tensor, chunk by chunk) and read-back verification."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .errors import ConversionError
from .gguf_file import read_header
from .metadata import ARCH
from .parallel import ordered_map
from .quantize import (
    RangeError,
    bf16_bits_to_f16_bits,
    check_close,
    decode_rows,
    encode_rows,
    exact_mismatch,
    keeps_f32,
    nbytes,
)
from .source import DEFAULT_CHUNK_ELEMS, TensorRef, row_split, rows_per_chunk
from .target import KV
from .tensor_map import Kind

Q = GGMLQuantizationType
EXACT_TYPES = (Q.F32, Q.F16, Q.BF16)


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
    workers: int | None = None,
) -> None:
    """Write a GGUF file at ``path`` (which should be a temporary name), streaming tensor data."""
    w = GGUFWriter(path, ARCH)
    for kv in kvs:
        w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    for t in tensors:
        w.add_tensor_info(t.gguf, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)

    def jobs() -> Iterator[tuple[int, int, int]]:
        for i, t in enumerate(tensors):
            nrows, ncols = row_split(t.shape)
            step = rows_per_chunk(ncols, chunk_elems)
            for start in range(0, nrows, step):
                yield i, start, min(nrows, start + step)

    def encode(job: tuple[int, int, int]) -> tuple[int, np.ndarray]:
        i, start, stop = job
        t = tensors[i]
        if t.passthrough:
            assert t.src.raw_rows is not None
            return i, t.src.raw_rows(start, stop)
        try:
            if t.src.dtype == "BF16" and t.qtype == Q.F16 and t.src.raw_rows is not None:
                raw = t.src.raw_rows(start, stop)
                return i, bf16_bits_to_f16_bits(raw.view(np.uint16)).view(np.uint8)
            return i, np.ascontiguousarray(encode_rows(t.src.rows(start, stop), t.qtype))
        except RangeError as exc:
            raise ConversionError(f"{t.src.file}: tensor '{t.source_name}': {exc}") from None

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        written = [0] * len(tensors)
        current = -1

        def finish(i: int) -> None:
            t = tensors[i]
            if written[i] != t.nbytes:
                raise ConversionError(f"{path}: tensor '{t.gguf}' wrote {written[i]} bytes, expected {t.nbytes}")
            w.write_padding(fout, written[i])

        for i, raw in ordered_map(encode, jobs(), workers):
            if i != current:
                if current >= 0:
                    finish(current)
                for skipped in range(current + 1, i):  # zero-size tensors have no chunks
                    w.write_padding(fout, fout.tell())
                    finish(skipped)
                w.write_padding(fout, fout.tell())
                current = i
            fout.write(memoryview(raw).cast("B"))
            written[i] += raw.nbytes
            if on_progress is not None:
                on_progress(tensors[i], raw.nbytes)
        if current >= 0:
            finish(current)
        for skipped in range(current + 1, len(tensors)):
            w.write_padding(fout, fout.tell())
            finish(skipped)
        fout.flush()
    finally:
        w.close()


# ----------------------------------------------------------------------------
# read-back verification
# ----------------------------------------------------------------------------


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
    workers: int | None = None,
    on_progress: ProgressFn | None = None,
) -> dict[str, Q]:
    """Read ``path`` back and check every key, tensor name, shape, type and value.

    Values are exact for F32/F16/BF16 and within a per-block quantization
    tolerance otherwise. With ``libllama_types`` the types are libllama's
    choice (K-quant mixes): any type is accepted except that norms, 1-D
    tensors and conv bases must still be F32. Returns the stored type of
    every tensor.
    """

    def fail(msg: str) -> ConversionError:
        return ConversionError(f"{display_path or path}: read-back check failed: {msg}")

    try:
        header = read_header(path)
    except ConversionError as exc:
        raise fail(exc.message) from None

    arch_field = header.fields.get("general.architecture")
    if arch_field is None or arch_field.value != ARCH.encode():
        raise fail("general.architecture is not 'dflash'")
    for kv in kvs:
        f = header.fields.get(kv.key)
        if f is None:
            raise fail(f"key '{kv.key}' is missing")
        if check_kv_types and (f.vtype != kv.vtype or (kv.sub_type is not None and f.sub_type != kv.sub_type)):
            raise fail(f"key '{kv.key}' has type {f.vtype.name}/{f.sub_type}, expected {kv.vtype.name}/{kv.sub_type}")
        if not _same_value(f.value, kv.value, kv.vtype, kv.sub_type):
            raise fail(f"key '{kv.key}' has a different value than written")

    stored = header.tensors
    want = {t.gguf: t for t in tensors}
    missing = sorted(set(want) - set(stored))
    extra = sorted(set(stored) - set(want))
    if missing:
        raise fail(f"tensor '{missing[0]}' is missing")
    if extra:
        raise fail(f"unexpected tensor '{extra[0]}'")

    types: dict[str, Q] = {}
    jobs: list[tuple[PlannedTensor, int, int, int, int]] = []  # tensor, start, stop, offset, count
    for t in tensors:
        rt = stored[t.gguf]
        qtype = rt.qtype
        types[t.gguf] = qtype
        if rt.shape != t.shape:
            raise fail(f"tensor '{t.gguf}' has shape {rt.shape}, expected {t.shape}")
        if libllama_types:
            if keeps_f32(t.kind, t.shape) and qtype != Q.F32:
                raise fail(f"tensor '{t.gguf}' must stay F32, libllama wrote {qtype.name}")
        elif qtype != t.qtype:
            raise fail(f"tensor '{t.gguf}' has type {qtype.name}, expected {t.qtype.name}")
        if rt.nbytes != nbytes(qtype, t.shape):
            raise fail(f"tensor '{t.gguf}' holds {rt.nbytes} bytes, expected {nbytes(qtype, t.shape)}")
        nrows, ncols = row_split(t.shape)
        row_bytes = nbytes(qtype, (ncols,))
        step = rows_per_chunk(ncols, chunk_elems)
        for start in range(0, nrows, step):
            stop = min(nrows, start + step)
            jobs.append((t, start, stop, rt.offset + start * row_bytes, (stop - start) * row_bytes))

    def check(job: tuple[PlannedTensor, int, int, int, int]) -> tuple[PlannedTensor, int, str | None]:
        t, start, stop, offset, count = job
        qtype = types[t.gguf]
        ncols = t.shape[-1] if t.shape else 1
        with open(path, "rb") as fh:
            fh.seek(offset)
            raw = np.fromfile(fh, dtype=np.uint8, count=count)
        if raw.size != count:
            return t, count, f"tensor '{t.gguf}' data is truncated"
        raw = raw.reshape(stop - start, -1)
        where = f"tensor '{t.gguf}' (from '{t.source_name}', rows {start}..{stop})"
        if t.passthrough and qtype == t.qtype and t.src.raw_rows is not None:
            if not np.array_equal(raw, t.src.raw_rows(start, stop)):
                return t, count, f"{where}: stored bytes differ from the source"
        elif qtype == Q.F16 and t.src.dtype == "BF16" and t.src.raw_rows is not None:
            # bf16 -> f16 is a pure function of 16 bits (checked against numpy on all of them
            # by the tests): compare the stored bits with it, then explain any difference
            src_bits = t.src.raw_rows(start, stop).view(np.uint16)
            if not np.array_equal(raw.view(np.uint16), bf16_bits_to_f16_bits(src_bits)):
                why = exact_mismatch(raw, t.src.rows(start, stop), qtype) or "bits differ"
                return t, count, f"{where}: {why}"
        elif qtype in EXACT_TYPES:
            # exact types: the stored values must be exactly the source converted to that type
            why = exact_mismatch(raw, t.src.rows(start, stop), qtype)
            if why is not None:
                return t, count, f"{where}: {why}"
        else:
            why = check_close(t.src.rows(start, stop), decode_rows(raw, qtype, ncols), qtype)
            if why is not None:
                return t, count, f"{where}: {why}"
        return t, count, None

    for t, count, problem in ordered_map(check, jobs, workers):
        if problem is not None:
            raise fail(problem)
        if on_progress is not None:
            on_progress(t, count)
    return types
