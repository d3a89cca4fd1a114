"""Output types, the per-tensor type policy, and the quantizers.

Policy: norms, 1-D tensors and the DFlash2 conv base kernels stay F32 for
every output type. Other tensors take the output type, except where a row is
not a whole number of quantization blocks (then F16). F16/BF16/Q8_0/Q4_0/Q5_0
are made here with ``gguf.quants``; the K-quant mixes (Q4_K_M, Q5_K_M, Q6_K)
are made by libllama's own ``llama_model_quantize`` (through llama-cpp-python)
from an intermediate F32 GGUF.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize, quantize

from .errors import ConversionError
from .tensor_map import Kind

Q = GGMLQuantizationType


@dataclass(frozen=True)
class OutType:
    name: str  # lower case, as the user writes it and as {ftype} expands
    file_type: LlamaFileType
    base: Q  # the type of a quantizable tensor (for K mixes: the mix's main type)
    kquant: bool  # made by libllama's llama_model_quantize


OUT_TYPES: dict[str, OutType] = {
    t.name: t
    for t in (
        OutType("f32", LlamaFileType.ALL_F32, Q.F32, False),
        OutType("f16", LlamaFileType.MOSTLY_F16, Q.F16, False),
        OutType("bf16", LlamaFileType.MOSTLY_BF16, Q.BF16, False),
        OutType("q8_0", LlamaFileType.MOSTLY_Q8_0, Q.Q8_0, False),
        OutType("q4_0", LlamaFileType.MOSTLY_Q4_0, Q.Q4_0, False),
        OutType("q5_0", LlamaFileType.MOSTLY_Q5_0, Q.Q5_0, False),
        OutType("q4_k_m", LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K, True),
        OutType("q5_k_m", LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K, True),
        OutType("q6_k", LlamaFileType.MOSTLY_Q6_K, Q.Q6_K, True),
    )
}

# names llama-quantize also accepts for the same mixes
_ALIASES = {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def parse_outtype(name: str) -> OutType:
    """Case-insensitive, like llama-quantize's type names."""
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in OUT_TYPES:
        raise ConversionError(f"--outtype: unknown type '{name}' (expected one of {', '.join(OUT_TYPES)})")
    return OUT_TYPES[key]


def keeps_f32(kind: Kind, shape: tuple[int, ...]) -> bool:
    """Norms, 1-D tensors and conv base kernels are always written as F32."""
    return kind in (Kind.NORM, Kind.CONV_BASE) or len(shape) < 2


def choose_type(out: OutType, kind: Kind, shape: tuple[int, ...]) -> tuple[Q, str]:
    """The GGUF type written by *this* converter for one tensor, and why.

    For K-quant outputs this is the type of the intermediate file (F32); the
    final type is libllama's choice, read back after quantizing.
    """
    if keeps_f32(kind, shape):
        return Q.F32, "kept F32 (norm / 1-D / conv base)"
    if out.kquant:
        return Q.F32, f"F32 intermediate, {out.name.upper()} chosen by libllama"
    block, _ = GGML_QUANT_SIZES[out.base]
    if shape[-1] % block != 0:
        return Q.F16, f"F16 fallback: row of {shape[-1]} is not a multiple of {out.base.name}'s block {block}"
    return out.base, out.base.name


def nbytes(qtype: Q, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    return n // block * size


class RangeError(ValueError):
    pass


def encode_rows(rows: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 rows (n, cols) -> the stored bytes of that type, as uint8 (n, row_bytes)."""
    n = rows.shape[0]
    if qtype == Q.F32:
        out = np.ascontiguousarray(rows, dtype=np.float32)
    elif qtype == Q.F16:
        try:
            with np.errstate(over="raise"):  # free in the normal case: the cast sets the overflow flag
                out = rows.astype(np.float16)
        except FloatingPointError:
            with np.errstate(over="ignore"):
                bad = np.isfinite(rows) & ~np.isfinite(rows.astype(np.float16))
            raise RangeError(
                f"value {float(rows[bad][0])!r} does not fit in F16 (max 65504); use --outtype bf16 or f32"
            ) from None
    else:
        out = quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype)
    return out.view(np.uint8).reshape(n, -1)


_BF16_TO_F16: dict[str, np.ndarray] = {}


def _bf16_to_f16_table() -> np.ndarray:
    """numpy's own bf16 -> f32 -> f16 conversion of all 65536 bf16 bit patterns (the reference)."""
    if "lut" not in _BF16_TO_F16:
        widened = np.left_shift(np.arange(1 << 16, dtype=np.uint16), 16, dtype=np.uint32).view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            _BF16_TO_F16["lut"] = widened.astype(np.float16).view(np.uint16)
    return _BF16_TO_F16["lut"]


def bf16_bits_to_f16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 -> f16 directly on the bits, identical to numpy's cast through f32 (checked on all
    65536 patterns by the tests) and about twice as fast. Raises RangeError on finite overflow.

    A bf16 with biased exponent 113..142 is a normal f16: same sign, exponent - 112, mantissa << 3,
    i.e. ((bits & 0x7fff) - 0x3800) << 3 | sign. Zeros, f16 subnormals, overflow, inf and NaN take
    the table (numpy's conversion).
    """
    mag = bits & np.uint16(0x7FFF)
    out = mag - np.uint16(0x3800)
    out <<= np.uint16(3)
    out |= bits & np.uint16(0x8000)
    special = (mag - np.uint16(0x3880)) >= np.uint16(0x0F00)  # exponent outside 113..142
    if special.any():
        idx = np.flatnonzero(special)
        m = mag.reshape(-1)[idx]
        over = (m >= 0x4780) & (m < 0x7F80)
        if over.any():
            b = bits.reshape(-1)[idx[np.argmax(over)]]
            value = float(np.left_shift(np.array([b], np.uint16), 16, dtype=np.uint32).view(np.float32)[0])
            raise RangeError(f"value {value!r} does not fit in F16 (max 65504); use --outtype bf16 or f32")
        out.reshape(-1)[idx] = _bf16_to_f16_table()[bits.reshape(-1)[idx]]
    return out


def decode_rows(raw: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    """Stored bytes (n, row_bytes) -> float32 rows (n, cols)."""
    n = raw.shape[0]
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(n, cols)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(n, cols)
    return dequantize(raw, qtype).astype(np.float32, copy=False).reshape(n, cols)


def exact_mismatch(raw: np.ndarray, src: np.ndarray, qtype: Q) -> str | None:
    """For F32/F16/BF16: None if the stored bytes are exactly ``src`` converted to ``qtype``.

    Decoding (cheap) and comparing with the source settles every value the type
    represents exactly; only the others are re-encoded and compared bit for bit.
    """
    n, cols = src.shape
    if qtype == Q.F32:
        if np.array_equal(raw.view(np.uint32).reshape(n, cols), src.view(np.uint32)):
            return None
        return check_close(src, decode_rows(raw, qtype, cols), qtype)
    bits = raw.view(np.uint16).reshape(n, cols)
    if qtype == Q.F16:
        got = bits.view(np.float16).astype(np.float32)
    elif qtype == Q.BF16:
        got = np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)
    else:
        raise ValueError(f"{qtype.name} is not an exact type")
    idx = np.flatnonzero(got != src)  # NaN != NaN: NaNs land here and are compared by bits
    if idx.size == 0:
        return None
    sub = src.reshape(-1)[idx].reshape(1, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (
            encode_rows(sub, qtype).view(np.uint16).reshape(-1)
            if qtype == Q.BF16
            else sub.astype(np.float16).view(np.uint16).reshape(-1)
        )
    have = bits.reshape(-1)[idx]
    bad = np.flatnonzero(have != want)
    if bad.size == 0:
        return None
    i = int(idx[bad[0]])
    return (
        f"{qtype.name} value differs at flat index {i}: stored bits 0x{int(have[bad[0]]):04x}, "
        f"expected 0x{int(want[bad[0]]):04x} for source {float(src.reshape(-1)[i]):.9g}"
    )


# Maximum |dequantized - source| allowed for a quantized type, as a fraction of the
# largest |source| value in the same quantization block (a loose bound: it is
# there to catch a wrong or shuffled tensor, not to grade the quantizer).
BLOCK_TOLERANCE: dict[Q, float] = {
    Q.Q8_0: 0.01,
    Q.Q6_K: 0.05,
    Q.Q5_0: 0.07,
    Q.Q5_1: 0.07,
    Q.Q5_K: 0.09,
    Q.Q4_0: 0.14,
    Q.Q4_1: 0.14,
    Q.Q4_K: 0.17,
    Q.Q3_K: 0.35,
    Q.Q2_K: 0.6,
}


def check_close(src: np.ndarray, got: np.ndarray, qtype: Q) -> str | None:
    """None if ``got`` (decoded) matches ``src`` for a stored type ``qtype``; else a reason."""
    if qtype == Q.F32:
        same = (src.view(np.uint32) == got.view(np.uint32)) | (np.isnan(src) & np.isnan(got))
        if not same.all():
            i = int(np.argmin(same.reshape(-1)))
            return f"F32 value differs at flat index {i}: {float(got.reshape(-1)[i]):.9g} != {float(src.reshape(-1)[i]):.9g}"
        return None
    if qtype in (Q.F16, Q.BF16):
        if qtype == Q.F16:
            want = src.astype(np.float16).astype(np.float32)
        else:
            want = decode_rows(quantize(src, Q.BF16).view(np.uint8).reshape(src.shape[0], -1), Q.BF16, src.shape[1])
        same = (want == got) | (np.isnan(want) & np.isnan(got))
        if not same.all():
            i = int(np.argmin(same.reshape(-1)))
            return (
                f"{qtype.name} value differs at flat index {i}: "
                f"{float(got.reshape(-1)[i]):.9g} != {float(want.reshape(-1)[i]):.9g}"
            )
        return None
    tol = BLOCK_TOLERANCE.get(qtype)
    if tol is None:
        return f"no tolerance known for {qtype.name}"
    block, _ = GGML_QUANT_SIZES[qtype]
    n, cols = src.shape
    if cols % block != 0 or not np.isfinite(got).all():
        return f"{qtype.name} data is not finite or rows do not fit its blocks"
    s = src.reshape(n, cols // block, block)
    g = got.reshape(n, cols // block, block)
    amax = np.abs(s).max(axis=2, keepdims=True)  # max |source| per quantization block
    err = np.abs(g - s)
    bad = err > amax * np.float32(tol) + np.float32(1e-6)
    if not bad.any():
        return None
    r, b, k = (int(x[0]) for x in np.nonzero(bad))
    return (
        f"{qtype.name} value at row {r}, column {b * block + k} is {float(g[r, b, k]):.6g}, "
        f"source {float(s[r, b, k]):.6g}: error {float(err[r, b, k]):.3g} exceeds {tol} x block max "
        f"{float(amax[r, b, 0]):.3g}"
    )


# ----------------------------------------------------------------------------
# libllama's quantizer (K-quant mixes)
# ----------------------------------------------------------------------------

_LOG: dict[str, object] = {}  # the one ctypes log callback (libllama keeps its pointer) and its buffer


def _capture_log(llama_cpp: object) -> list[str]:
    """Route libllama's log into a list while quantizing (it is printed only on failure)."""
    if "cb" not in _LOG:
        messages: list[str] = []

        @llama_cpp.llama_log_callback  # type: ignore[attr-defined, misc]
        def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            messages.append(text.decode("utf-8", "replace"))
            del messages[:-50]

        _LOG["cb"] = _cb
        _LOG["messages"] = messages
    messages = _LOG["messages"]  # type: ignore[assignment]
    messages.clear()  # type: ignore[attr-defined]
    llama_cpp.llama_log_set(_LOG["cb"], ctypes.c_void_p(0))  # type: ignore[attr-defined]
    return messages  # type: ignore[return-value]


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C / SIGTERM during a libllama call, held until it returns, then raised as KeyboardInterrupt.

    Raised where the signal lands, the interrupt would fire inside libllama's log callback (a ctypes
    callback: Python prints the exception and drops it, the C call carries on), and the conversion
    would finish as if never interrupted. llama_model_quantize cannot be stopped midway, so it runs out.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        raise KeyboardInterrupt


def llama_quantize(src: Path, dst: Path, out: OutType, *, nthread: int | None = None) -> None:
    """Run libllama's ``llama_model_quantize`` (llama-cpp-python's ctypes binding) src -> dst."""
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - a broken install raises many things
        raise ConversionError(
            f"--outtype {out.name}: K-quants come from libllama, but llama_cpp cannot be imported ({exc}); "
            "install llama-cpp-python==0.3.36"
        ) from None

    messages = _capture_log(llama_cpp)
    try:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = int(out.file_type)
        params.nthread = nthread if nthread is not None else (os.cpu_count() or 1)
        params.allow_requantize = False
        params.quantize_output_tensor = True
        params.only_copy = False
        params.pure = False
        with _interrupts_held():
            rc = llama_cpp.llama_model_quantize(
                str(src).encode("utf-8"), str(dst).encode("utf-8"), ctypes.byref(params)
            )
    finally:
        _restore_llama_log(llama_cpp)
    if rc != 0:
        tail = "".join(messages[-5:]).strip().replace("\n", " | ")
        raise ConversionError(f"{dst}: libllama's llama_model_quantize to {out.name.upper()} failed (rc={rc}): {tail}")


def _restore_llama_log(llama_cpp: object) -> None:
    """Put llama-cpp-python's own log callback back (it is module-level, so it stays alive)."""
    try:
        from llama_cpp import _logger  # type: ignore[attr-defined]

        cb = getattr(_logger, "llama_log_callback", None)
        if cb is not None:
            llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
