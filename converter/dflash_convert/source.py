"""Lazy, validated tensor sources: safetensors (single or sharded) and, on request, PyTorch pickles.

The safetensors header is parsed here, strictly, before any tensor is read:
header length, JSON, dtypes, shapes, offsets in range, no overlap, no hole,
data length. Tensors are then read row-chunk by row-chunk with plain file
reads, so the memory held at any time is one chunk, not the checkpoint.
bfloat16 is read as uint16 and widened to float32 with a shift: no torch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConversionError

# safetensors dtype -> (numpy dtype used to read it, bytes per element)
SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
}

# a header larger than this is refused (the safetensors library uses 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024

# elements per chunk when streaming a tensor (a few MB: cache friendly, and memory stays flat)
DEFAULT_CHUNK_ELEMS = 2 * 1024 * 1024

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32: the value is exact."""
    return np.left_shift(u16, 16, dtype=np.uint32).view(np.float32)


def row_split(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor viewed as 2-D over its last dimension (1-D = one row)."""
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, cols


def rows_per_chunk(cols: int, chunk_elems: int) -> int:
    return max(1, chunk_elems // max(cols, 1))


@dataclass
class TensorRef:
    """One tensor to read: where it lives and how to read its rows as float32.

    ``rows(start, stop)`` returns float32 of shape (stop - start, cols) for the
    tensor viewed as 2-D over its last dimension. ``raw_rows`` returns the
    stored bytes of the same rows (a uint8 array), for an exact copy when
    the output type equals the stored type. ``dtype`` is the stored type name
    (``BF16``, ``F16``, ``F32`` or a ggml type name for GGUF sources).
    """

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    rows: Callable[[int, int], np.ndarray]
    raw_rows: Callable[[int, int], np.ndarray] | None = None

    @property
    def nrows_ncols(self) -> tuple[int, int]:
        return row_split(self.shape)

    @property
    def n_elements(self) -> int:
        r, c = self.nrows_ncols
        return r * c

    def iter_rows(self, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> Iterator[tuple[int, np.ndarray]]:
        nrows, ncols = self.nrows_ncols
        step = rows_per_chunk(ncols, chunk_elems)
        for start in range(0, nrows, step):
            stop = min(nrows, start + step)
            yield start, self.rows(start, stop)

    def read(self) -> np.ndarray:
        """The whole tensor as float32 in its torch shape (tests and small tensors)."""
        nrows, _ = self.nrows_ncols
        return self.rows(0, nrows).reshape(self.shape)


@dataclass(frozen=True)
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte


class SafetensorsFile:
    """A strictly validated safetensors file; tensors are read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, _Entry] = {}
        self.metadata: dict[str, str] = {}
        self._parse()

    def _fail(self, what: str) -> ConversionError:
        return ConversionError(f"{self.path}: malformed safetensors: {what}")

    def _parse(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(f"file is {size} bytes, shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n == 0:
                    raise self._fail("header length is 0")
                if n > MAX_HEADER_BYTES:
                    raise self._fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
                if 8 + n > size:
                    raise self._fail(f"header length {n} runs past the end of the {size}-byte file")
                header_bytes = f.read(n)
        except OSError as exc:
            raise ConversionError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"header is not valid UTF-8 JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, expected an object")

        data_start = 8 + n
        data_len = size - data_start
        spans: list[tuple[int, int, str]] = []
        for key, info in header.items():
            if key == "__metadata__":
                if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                    raise self._fail("'__metadata__' must map strings to strings")
                self.metadata = dict(info or {})
                continue
            if not isinstance(info, dict):
                raise self._fail(f"tensor '{key}': entry is not an object")
            dtype = info.get("dtype")
            shape = info.get("shape")
            offsets = info.get("data_offsets")
            if not isinstance(dtype, str):
                raise self._fail(f"tensor '{key}': missing or non-string 'dtype'")
            if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
            ):
                raise self._fail(f"tensor '{key}': 'shape' must be a list of non-negative integers, found {shape!r}")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            ):
                raise self._fail(f"tensor '{key}': 'data_offsets' must be two integers, found {offsets!r}")
            b, e = offsets
            if b < 0 or e < b:
                raise self._fail(f"tensor '{key}': invalid data_offsets [{b}, {e}]")
            if e > data_len:
                raise self._fail(
                    f"tensor '{key}': data_offsets [{b}, {e}] out of range "
                    f"(the data section is {data_len} bytes; file truncated?)"
                )
            if dtype not in SAFETENSORS_DTYPES:
                raise ConversionError(
                    f"{self.path}: tensor '{key}' has dtype {dtype}, expected one of {', '.join(SAFETENSORS_DTYPES)}"
                )
            itemsize = SAFETENSORS_DTYPES[dtype].itemsize
            n_el = 1
            for s in shape:
                n_el *= s
            if e - b != n_el * itemsize:
                raise self._fail(
                    f"tensor '{key}': data_offsets [{b}, {e}] hold {e - b} bytes, "
                    f"but {dtype} {tuple(shape)} needs {n_el * itemsize}"
                )
            spans.append((b, e, key))
            self.entries[key] = _Entry(key, dtype, tuple(shape), data_start + b, data_start + e)

        # offsets must tile the data section: sorted, no overlap, no hole, nothing left over
        spans.sort()
        pos = 0
        prev = None
        for b, e, key in spans:
            if b < pos:
                raise self._fail(f"tensors '{prev}' and '{key}' overlap (byte {b} < {pos})")
            if b > pos:
                raise self._fail(f"hole in the data section before tensor '{key}' (bytes {pos}..{b})")
            pos = e
            prev = key
        if pos != data_len:
            raise self._fail(
                f"data section is {data_len} bytes but the tensors cover {pos} (trailing or missing bytes)"
            )

    def keys(self) -> list[str]:
        return list(self.entries)

    def ref(self, key: str, as_key: str | None = None) -> TensorRef:
        e = self.entries[key]
        np_dtype = SAFETENSORS_DTYPES[e.dtype]
        rows_total, cols = row_split(e.shape)
        row_bytes = cols * np_dtype.itemsize
        path = self.path

        def read_raw(start: int, stop: int) -> np.ndarray:
            if not 0 <= start <= stop <= rows_total:
                raise IndexError(f"rows {start}:{stop} of {rows_total}")
            count = (stop - start) * row_bytes
            with open(path, "rb") as f:
                f.seek(e.begin + start * row_bytes)
                buf = np.fromfile(f, dtype=np.uint8, count=count)
            if buf.size != count:
                raise ConversionError(f"{path}: tensor '{key}' is truncated (read {buf.size} of {count} bytes)")
            return buf.reshape(stop - start, row_bytes)

        def read_rows(start: int, stop: int) -> np.ndarray:
            raw = read_raw(start, stop).view(np_dtype).reshape(stop - start, cols)
            if e.dtype == "BF16":
                return bf16_to_f32(raw)
            return raw.astype(np.float32, copy=False)

        return TensorRef(as_key or key, path, e.dtype, e.shape, read_rows, read_raw)


class TensorSource:
    """All tensors of a drafter directory, keyed by their name in the checkpoint."""

    def __init__(self, refs: dict[str, TensorRef], files: list[Path], kind: str) -> None:
        self.refs = refs
        self.files = files
        self.kind = kind  # "safetensors" | "pickle"

    def keys(self) -> list[str]:
        return list(self.refs)

    def __getitem__(self, key: str) -> TensorRef:
        return self.refs[key]

    def __contains__(self, key: str) -> bool:
        return key in self.refs


def open_source(draft_dir: Path, *, allow_pickle: bool = False) -> TensorSource:
    """Find and validate the weights of a drafter directory (no tensor data is read)."""
    if not draft_dir.is_dir():
        raise ConversionError(f"{draft_dir}: not a directory")
    single = draft_dir / "model.safetensors"
    index = draft_dir / "model.safetensors.index.json"
    if single.is_file():
        return _from_safetensors([single])
    if index.is_file():
        return _from_index(index)
    found = sorted(p for p in draft_dir.glob("*.safetensors") if p.is_file())
    if found:
        return _from_safetensors(found)
    pickles = sorted(p for p in draft_dir.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        if not allow_pickle:
            raise ConversionError(
                f"{pickles[0]}: refusing to unpickle a PyTorch checkpoint "
                f"({', '.join(p.name for p in pickles)}); convert it to safetensors, "
                "or pass --allow-pickle (loads with torch.load(weights_only=True))"
            )
        return _from_pickles(pickles)
    raise ConversionError(
        f"{draft_dir}: no weights found (expected model.safetensors, model.safetensors.index.json or *.safetensors)"
    )


def _from_safetensors(paths: list[Path]) -> TensorSource:
    refs: dict[str, TensorRef] = {}
    owner: dict[str, Path] = {}
    for p in paths:
        st = SafetensorsFile(p)
        for k in st.keys():
            if k in refs:
                raise ConversionError(f"{p}: tensor '{k}' is also in {owner[k]}")
            refs[k] = st.ref(k)
            owner[k] = p
    return TensorSource(refs, paths, "safetensors")


def _from_index(index: Path) -> TensorSource:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{index}: not valid JSON ({exc})") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(wmap, dict)
        or not wmap
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items())
    ):
        raise ConversionError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
    shard_names = sorted(set(wmap.values()))
    shards: dict[str, SafetensorsFile] = {}
    for name in shard_names:
        p = index.parent / name
        if Path(name).name != name:
            raise ConversionError(f"{index}: shard '{name}' is not a plain file name in the same folder")
        if not p.is_file():
            raise ConversionError(f"{index}: shard '{name}' listed in weight_map does not exist")
        shards[name] = SafetensorsFile(p)
    refs: dict[str, TensorRef] = {}
    for key, name in wmap.items():
        st = shards[name]
        if key not in st.entries:
            raise ConversionError(f"{st.path}: tensor '{key}' listed in {index.name} is not in this shard")
        refs[key] = st.ref(key)
    for name, st in shards.items():
        for key in st.keys():
            if wmap.get(key) != name:
                raise ConversionError(f"{st.path}: tensor '{key}' is not listed for this shard in {index.name}")
    return TensorSource(refs, [index] + [s.path for s in shards.values()], "safetensors")


def _from_pickles(paths: list[Path]) -> TensorSource:
    """Only with --allow-pickle, and only ``torch.load(weights_only=True)``."""
    try:
        import torch
    except ImportError:
        raise ConversionError(f"{paths[0]}: --allow-pickle needs torch installed (pip install torch)") from None
    refs: dict[str, TensorRef] = {}
    for p in paths:
        try:
            try:
                state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                state = torch.load(p, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as exc:  # noqa: BLE001 - torch raises many types here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConversionError(f"{p}: torch.load(weights_only=True) failed: {first}") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ConversionError(f"{p}: expected a dict of tensors, found {type(state).__name__}")
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ConversionError(f"{p}: entry '{key}' is a {type(t).__name__}, not a tensor")
            if key in refs:
                raise ConversionError(f"{p}: tensor '{key}' appears in two files")
            names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
            if t.dtype not in names:
                raise ConversionError(f"{p}: tensor '{key}' has dtype {t.dtype}, expected bf16/f16/f32")
            refs[key] = _torch_ref(key, p, names[t.dtype], t)
    return TensorSource(refs, paths, "pickle")


def _torch_ref(key: str, path: Path, dtype: str, t: Any) -> TensorRef:
    shape = tuple(int(s) for s in t.shape)
    _, cols = row_split(shape)
    flat = t.reshape(-1, cols) if t.dim() > 0 else t.reshape(1, 1)

    def read_rows(start: int, stop: int) -> np.ndarray:
        return flat[start:stop].float().numpy().astype(np.float32, copy=True)

    return TensorRef(key, path, dtype, shape, read_rows, None)
