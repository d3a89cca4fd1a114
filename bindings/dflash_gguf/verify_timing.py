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
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# libllama's llama_context_params.flash_attn_type
FLASH_ATTN_AUTO, FLASH_ATTN_OFF, FLASH_ATTN_ON = -1, 0, 1

# llama_set_embeddings_layer_inp is exported with C++ linkage (llama.cpp's uninstalled llama-ext.h,
# shared/GGUF-DFLASH.md section 6): ctypes finds it only by its mangled name
_SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"

_quiet_callback: Any = None  # libllama keeps the pointer: the callback must outlive every later log


def runtime_flash_attn(n_gpu_layers: int) -> int:
    """What our runtime uses (cpp/src/target.cpp): off on the CPU, where it slows multi-token
    decodes of small models; libllama's choice when layers are offloaded."""
    return FLASH_ATTN_OFF if n_gpu_layers == 0 else FLASH_ATTN_AUTO


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
    model = llc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"{path}: libllama could not load the model")
    return llc, model


class Verifier:
    """The target in libllama: prefill `context` random tokens once, then time B-token decodes.

    flash_attn: llama_context_params.flash_attn_type (FLASH_ATTN_*). feature_layers: layer ids
    whose inputs libllama extracts on every decode, as our speculative loop asks for the
    drafter's features (dflash.target_layers); left off if this libllama lacks the function.
    """

    def __init__(self, llc: Any, model: Any, context: int, max_block: int, n_threads: int, flash_attn: int,
                 feature_layers: Sequence[int] = ()) -> None:
        self.llc = llc
        cp = llc.llama_context_default_params()
        cp.n_ctx = (context + max_block + 255) // 256 * 256
        cp.n_batch = cp.n_ubatch = max(256, max_block)
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = flash_attn
        cp.no_perf = True
        self.ctx = llc.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"libllama could not create the target context (n_ctx {cp.n_ctx})")
        self.mem = llc.llama_get_memory(self.ctx)
        self.n_vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model))
        self.context = context
        self.batches: dict[int, Any] = {}
        self.features = self._enable_features(feature_layers)
        ids = np.random.default_rng(0).integers(2, self.n_vocab, size=context).tolist()
        for start in range(0, context, cp.n_batch):
            self._decode(ids[start : start + cp.n_batch], start, all_logits=False)

    def _enable_features(self, layers: Sequence[int]) -> bool:
        if not layers:
            return False
        try:
            fn = getattr(self.llc._lib, _SET_LAYER_INP)
        except AttributeError:
            return False
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
        fn.restype = None
        for lid in layers:
            fn(self.ctx, lid, True)
        return True

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

    def _decode(self, ids: list[int], pos0: int, all_logits: bool) -> None:
        b = self._make_batch(ids, pos0, all_logits)
        try:
            rc = self.llc.llama_decode(self.ctx, b)
        finally:
            self.llc.llama_batch_free(b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(ids)} tokens at position {pos0} returned {rc}")

    def verify(self, block: int) -> float:
        """Seconds for one llama_decode of `block` tokens at positions context.., all logits (+ sync);
        the cache is rolled back to `context` tokens afterwards, outside the timed region."""
        llc = self.llc
        b = self.batches.get(block)
        if b is None:
            ids = np.random.default_rng(block).integers(2, self.n_vocab, size=block).tolist()
            b = self.batches[block] = self._make_batch(ids, self.context, all_logits=True)
        t0 = time.perf_counter()
        rc = llc.llama_decode(self.ctx, b)
        llc.llama_synchronize(self.ctx)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode of {block} tokens at position {self.context} returned {rc}")
        llc.llama_memory_seq_rm(self.mem, 0, self.context, -1)
        return dt

    def close(self) -> None:
        for b in self.batches.values():
            self.llc.llama_batch_free(b)
        self.batches.clear()
        if self.ctx:
            self.llc.llama_free(self.ctx)
            self.ctx = None


__all__ = ["FLASH_ATTN_AUTO", "FLASH_ATTN_OFF", "FLASH_ATTN_ON", "Verifier", "load_model", "runtime_flash_attn"]
