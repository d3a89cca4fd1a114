"""A fast, strict reader of a GGUF file's header: metadata and tensor infos (no tensor data).

gguf-py's GGUFReader builds a numpy view per metadata item, which takes
seconds (and hundreds of MB) on a 150k-token vocabulary; this reads the same
header with plain ``struct``/``numpy.frombuffer`` in a fraction of that, and
leaves tensor data on disk (read it by offset).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ConversionError

T = GGUFValueType

_SCALAR: dict[GGUFValueType, tuple[str, int]] = {
    T.UINT8: ("<B", 1),
    T.INT8: ("<b", 1),
    T.UINT16: ("<H", 2),
    T.INT16: ("<h", 2),
    T.UINT32: ("<I", 4),
    T.INT32: ("<i", 4),
    T.FLOAT32: ("<f", 4),
    T.BOOL: ("<?", 1),
    T.UINT64: ("<Q", 8),
    T.INT64: ("<q", 8),
    T.FLOAT64: ("<d", 8),
}
_NP: dict[GGUFValueType, str] = {
    T.UINT8: "<u1",
    T.INT8: "<i1",
    T.UINT16: "<u2",
    T.INT16: "<i2",
    T.UINT32: "<u4",
    T.INT32: "<i4",
    T.FLOAT32: "<f4",
    T.BOOL: "<u1",
    T.UINT64: "<u8",
    T.INT64: "<i8",
    T.FLOAT64: "<f8",
}
MAX_STRING = 1 << 30
MAX_ITEMS = 1 << 32


@dataclass(frozen=True)
class Field:
    key: str
    value: Any  # int/float/bool, bytes for a string, list for an array
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None

    def text(self) -> str:
        assert isinstance(self.value, bytes)
        return self.value.decode("utf-8", "replace")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order (fastest first)
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset of the data
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order (slowest first)."""
        return tuple(reversed(self.ne))


@dataclass
class GGUFHeader:
    path: Path
    version: int
    fields: dict[str, Field]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int


class _Buf:
    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f = f
        self.path = path
        self.size = size

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise ConversionError(f"{self.path}: not a valid GGUF file (header truncated)")
        return b

    def unpack(self, fmt: str, n: int) -> Any:
        return struct.unpack(fmt, self.read(n))[0]

    def string(self) -> bytes:
        n = self.unpack("<Q", 8)
        if n > MAX_STRING or self.f.tell() + n > self.size:
            raise ConversionError(f"{self.path}: not a valid GGUF file (string of {n} bytes)")
        return self.read(n)


def _value(buf: _Buf, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
    if vtype in _SCALAR:
        fmt, n = _SCALAR[vtype]
        return buf.unpack(fmt, n), None
    if vtype == T.STRING:
        return buf.string(), None
    if vtype == T.ARRAY:
        sub = GGUFValueType(buf.unpack("<I", 4))
        count = buf.unpack("<Q", 8)
        if count > MAX_ITEMS:
            raise ConversionError(f"{buf.path}: not a valid GGUF file (array of {count} items)")
        if sub in _NP:
            width = np.dtype(_NP[sub]).itemsize
            arr = np.frombuffer(buf.read(count * width), dtype=_NP[sub])
            items = arr.astype(bool).tolist() if sub == T.BOOL else arr.tolist()
            return items, sub
        if sub == T.STRING:
            out = []
            read, unpack = buf.f.read, struct.unpack
            for _ in range(count):
                head = read(8)
                if len(head) != 8:
                    raise ConversionError(f"{buf.path}: not a valid GGUF file (header truncated)")
                (n,) = unpack("<Q", head)
                if n > MAX_STRING:
                    raise ConversionError(f"{buf.path}: not a valid GGUF file (string of {n} bytes)")
                s = read(n)
                if len(s) != n:
                    raise ConversionError(f"{buf.path}: not a valid GGUF file (header truncated)")
                out.append(s)
            return out, sub
        raise ConversionError(f"{buf.path}: unsupported GGUF array element type {sub.name}")
    raise ConversionError(f"{buf.path}: unsupported GGUF value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    try:
        size = path.stat().st_size
        f = open(path, "rb", buffering=1 << 20)
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with f:
        buf = _Buf(f, path, size)
        if f.read(4) != b"GGUF":
            raise ConversionError(f"{path}: not a GGUF file (bad magic)")
        version = buf.unpack("<I", 4)
        if version not in (2, 3):
            raise ConversionError(f"{path}: unsupported GGUF version {version}")
        n_tensors = buf.unpack("<Q", 8)
        n_kv = buf.unpack("<Q", 8)
        if n_tensors > MAX_ITEMS or n_kv > MAX_ITEMS:
            raise ConversionError(f"{path}: not a valid GGUF file (counts {n_tensors}, {n_kv})")
        fields: dict[str, Field] = {}
        try:
            for _ in range(n_kv):
                key = buf.string().decode("utf-8")
                vtype = GGUFValueType(buf.unpack("<I", 4))
                value, sub = _value(buf, vtype)
                fields[key] = Field(key, value, vtype, sub)
            infos = []
            for _ in range(n_tensors):
                name = buf.string().decode("utf-8")
                n_dims = buf.unpack("<I", 4)
                if n_dims > 4:
                    raise ConversionError(f"{path}: tensor '{name}' has {n_dims} dimensions")
                ne = tuple(struct.unpack(f"<{n_dims}Q", buf.read(8 * n_dims)))
                qtype = GGMLQuantizationType(buf.unpack("<I", 4))
                offset = buf.unpack("<Q", 8)
                infos.append((name, ne, qtype, offset))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{path}: not a valid GGUF file ({exc})") from None
        alignment = 32
        if "general.alignment" in fields:
            alignment = int(fields["general.alignment"].value)
        pos = f.tell()
        data_offset = pos + (-pos % alignment)
    tensors: dict[str, TensorInfo] = {}
    for name, ne, qtype, offset in infos:
        block, tsize = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in ne:
            n *= d
        nbytes = n // block * tsize
        start = data_offset + offset
        if start + nbytes > size:
            raise ConversionError(f"{path}: tensor '{name}' data runs past the end of the file")
        tensors[name] = TensorInfo(name, ne, qtype, start, nbytes)
    return GGUFHeader(path, version, fields, tensors, alignment, data_offset)
