"""Timing the target's verify pass in libllama: one llama_decode of B tokens after a fixed prefix.

Shared by `dflash bench --scale` and scripts/bench_draft.py. Uses llama-cpp-python's ctypes API
directly (no Python decoding loop in the timed region):

    llc, model = load_model("target.gguf", n_gpu_layers=0)
    v = Verifier(llc, model, context=512, max_block=16, n_threads=2, flash_attn=FLASH_ATTN_OFF)
    seconds = v.verify(8)          # decode 8 tokens at positions 512..519, logits for every row
    v.close(); llc.llama_model_free(model)
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# libllama's llama_context_params.flash_attn_type
FLASH_ATTN_AUTO, FLASH_ATTN_OFF, FLASH_ATTN_ON = -1, 0, 1

# llama_set_embeddings_layer_inp is exported with C++ linkage (llama.cpp's uninstalled llama-ext.h,
# shared/GGUF-DFLASH.md section 6): ctypes finds it only by its mangled name
_SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"

_quiet_callback: Any = None  # libllama keeps the pointer: the callback must outlive every later log


def runtime_flash_attn(n_gpu_layers: int) -> int:
    """The flash_attn_type our runtime gives the target's context (dflash::target_flash_attn)."""
    from .._core import target_flash_attn

    return target_flash_attn(n_gpu_layers)


def load_model(path: str | Path, n_gpu_layers: int = 0, quiet: bool = True) -> tuple[Any, Any]:
    """(llama_cpp.llama_cpp module, llama_model *) for `path`; libllama's log silenced if `quiet`."""
    global _quiet_callback
    import llama_cpp  # noqa: F401  (loads libllama)
    from llama_cpp import llama_cpp as llc

    if quiet and _quiet_callback is None:

        @llc.llama_log_callback
        def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            pass

        _quiet_callback = _quiet
        llc.llama_log_set(_quiet, ctypes.c_void_p(0))
    llc.llama_backend_init()
    mp = llc.llama_model_default_params()
    mp.n_gpu_layers = n_gpu_layers
    overrides = place_weights_as_runtime(mp, path, n_gpu_layers)
    model = llc.llama_model_load_from_file(str(path).encode(), mp)
    del overrides  # libllama reads them during the load only
    if not model:
        raise RuntimeError(f"{path}: libllama could not load the model")
    return llc, model


class _TensorBuftOverride(ctypes.Structure):
    # llama_model_tensor_buft_override (llama-cpp-python declares the field a void pointer)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def place_weights_as_runtime(mp: Any, path: str | Path, n_gpu_layers: int) -> Any:
    """Give `mp` the weight placement our runtime's target gets (dflash::target_weight_placement): on an AMX CPU
    a quantized target's weights go to ggml's repacked layouts by name, not to AMX's, where libllama 0.3.36
    crashes. Returns the overrides array, which must stay alive until the load returns."""
    from .._core import target_weight_placement

    mp.use_extra_bufts, placed = target_weight_placement(str(path), n_gpu_layers)
    if not placed:
        return None
    overrides = (_TensorBuftOverride * (len(placed) + 1))()
    for i, (pattern, _name, buft) in enumerate(placed):
        overrides[i] = _TensorBuftOverride(pattern.encode(), buft)
    mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    return overrides


class Verifier:
    """The target in libllama: `context` random tokens prefilled once, then timed B-token decodes.

    Each block size decodes in a context of its own (the prefix copied in from the prefilled one), so
    every timed decode reuses the graph of the decode before it, as a loop of one draft length does:
    one context alternating sizes rebuilds its graph on every decode, a cost the loop does not pay
    (0.1-0.2 ms of a 1.4-2.5 ms tinycode verify in paired runs here).
    flash_attn: llama_context_params.flash_attn_type (FLASH_ATTN_*).
    feature_layers: layer ids whose inputs libllama extracts on every decode, as our speculative loop
    asks for the drafter's features (dflash.target_layers); left off if this libllama lacks the function.
    swa_full: sliding-window layers keep every position (llama_context_params.swa_full); off, as our
    runtime's target by default, they keep a window and a batch of positions.
    """

    def __init__(
        self,
        llc: Any,
        model: Any,
        context: int,
        max_block: int,
        n_threads: int,
        flash_attn: int,
        feature_layers: Sequence[int] = (),
        swa_full: bool = False,
    ) -> None:
        self.llc, self.model = llc, model
        self.swa_full = swa_full
        self.n_ctx = (context + max_block + 255) // 256 * 256
        self.n_threads, self.flash_attn, self.feature_layers = n_threads, flash_attn, tuple(feature_layers)
        vocab = llc.llama_model_get_vocab(model)
        self.n_vocab = llc.llama_vocab_n_tokens(vocab)
        # tokens text can hold: a MoE routes by content, and a vocabulary's unused or control tokens (an
        # inflated target's padding: zero embeddings) would send every token to the same experts
        unusable = llc.LLAMA_TOKEN_ATTR_UNUSED | llc.LLAMA_TOKEN_ATTR_CONTROL | llc.LLAMA_TOKEN_ATTR_UNKNOWN
        self.tokens = np.array([t for t in range(self.n_vocab) if not llc.llama_vocab_get_attr(vocab, t) & unusable])
        self.context, self.max_block = context, max_block
        # a recurrent state cannot drop all the tokens of the decode just timed (libllama's snapshots keep
        # at least one): the prefilled sequence is restored instead
        self.recurrent = bool(llc.llama_model_is_recurrent(model) or llc.llama_model_is_hybrid(model))
        self._set_layer_inp = self._feature_function() if feature_layers else None
        self.features = self._set_layer_inp is not None
        self.ctxs: dict[int, Any] = {}  # block size -> its context
        self.batches: dict[int, Any] = {}
        n_batch = max(256, max_block)
        prefill = self._new_context(n_batch)
        try:
            ids = np.random.default_rng(0).choice(self.tokens, size=context).tolist()
            for start in range(0, context, n_batch):
                self._decode(prefill, ids[start : start + n_batch], start)
            size = llc.llama_state_seq_get_size(prefill, 0)
            self.prefix = (ctypes.c_uint8 * size)()
            if llc.llama_state_seq_get_data(prefill, self.prefix, size, 0) != size:
                raise RuntimeError("libllama could not save the prefilled sequence")
        finally:
            llc.llama_free(prefill)

    def _new_context(self, n_batch: int) -> Any:
        llc = self.llc
        cp = llc.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        if self.recurrent:
            # snapshots of the last max_block tokens, as our runtime keeps them (each decode pays for them);
            # libllama aborts unless a micro-batch holds more than those tokens and one more
            cp.n_rs_seq = self.max_block
            n_batch = max(n_batch, self.max_block + 2)
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.flash_attn_type = self.flash_attn
        cp.swa_full = self.swa_full
        cp.no_perf = True
        ctx = llc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"libllama could not create the target context (n_ctx {cp.n_ctx})")
        for lid in self.feature_layers if self._set_layer_inp else ():
            self._set_layer_inp(ctx, lid, True)
        return ctx

    def _feature_function(self) -> Any:
        try:
            fn = getattr(self.llc._lib, _SET_LAYER_INP)
        except AttributeError:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
        fn.restype = None
        return fn

    def _context(self, block: int) -> Any:
        ctx = self.ctxs.get(block)
        if ctx is None:
            ctx = self.ctxs[block] = self._new_context(block)
            self._restore(ctx)
        return ctx

    def _restore(self, ctx: Any) -> None:
        size = len(self.prefix)
        if self.llc.llama_state_seq_set_data(ctx, self.prefix, size, 0) != size:
            raise RuntimeError("libllama could not restore the prefilled sequence")

    def _make_batch(self, ids: list[int], pos0: int, all_logits: bool) -> Any:
        b = self.llc.llama_batch_init(len(ids), 0, 1)
        for i, t in enumerate(ids):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if all_logits or i == len(ids) - 1 else 0
        b.n_tokens = len(ids)
        return b

    def _decode(self, ctx: Any, ids: list[int], pos0: int) -> None:
        b = self._make_batch(ids, pos0, all_logits=False)
        try:
            rc = self.llc.llama_decode(ctx, b)
        finally:
            self.llc.llama_batch_free(b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(ids)} tokens at position {pos0} returned {rc}")

    def verify(self, block: int) -> float:
        """Seconds for one llama_decode of `block` tokens at positions context.., all logits (+ sync);
        the cache is rolled back to `context` tokens afterwards, outside the timed region."""
        llc = self.llc
        ctx = self._context(block)
        b = self.batches.get(block)
        if b is None:
            ids = np.random.default_rng(block).choice(self.tokens, size=block).tolist()
            b = self.batches[block] = self._make_batch(ids, self.context, all_logits=True)
        t0 = time.perf_counter()
        rc = llc.llama_decode(ctx, b)
        llc.llama_synchronize(ctx)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode of {block} tokens at position {self.context} returned {rc}")
        if self.recurrent:
            self._restore(ctx)
        else:
            llc.llama_memory_seq_rm(llc.llama_get_memory(ctx), 0, self.context, -1)
        return dt

    def graphs_reused(self) -> int:
        """Decodes, over every context, that reused the graph of the decode before (libllama's count)."""
        return sum(self.llc.llama_perf_context(ctx).n_reused for ctx in self.ctxs.values())

    def close(self) -> None:
        for b in self.batches.values():
            self.llc.llama_batch_free(b)
        self.batches.clear()
        for ctx in self.ctxs.values():
            self.llc.llama_free(ctx)
        self.ctxs.clear()


__all__ = [
    "FLASH_ATTN_AUTO",
    "FLASH_ATTN_OFF",
    "FLASH_ATTN_ON",
    "Verifier",
    "load_model",
    "place_weights_as_runtime",
    "runtime_flash_attn",
]
