"""The verify timer behind scripts/bench_draft.py and `dflash bench --scale` (bindings/dflash_gguf/bench/verify_timing.py).

It must time what a speculative loop of one draft length pays: libllama reuses a decode's graph only
when the decode before it had the same shape, so a single context alternating block sizes would add a
graph rebuild to every timed verify, which the loop does not pay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinycode import inflated_hybrid, inflated_moe

from dflash_gguf.bench.verify_timing import FLASH_ATTN_OFF, Verifier, load_model


@pytest.fixture(scope="module")
def target(tinycode: Path):
    llc, model = load_model(tinycode / "target-f16.gguf")
    yield llc, model
    llc.llama_model_free(model)


def test_alternating_block_sizes_reuse_each_sizes_graph(target) -> None:
    llc, model = target
    v = Verifier(llc, model, context=40, max_block=8, n_threads=1, flash_attn=FLASH_ATTN_OFF, feature_layers=[1])
    try:
        sizes, rounds = (1, 4, 8), 5
        for _ in range(rounds):
            for b in sizes:
                assert v.verify(b) > 0
        assert v.features
        # every decode but each size's first reuses its graph
        assert v.graphs_reused() == len(sizes) * (rounds - 1)
    finally:
        v.close()


def test_each_size_decodes_after_the_prefilled_prefix(target) -> None:
    """Logits of a timed verify equal a decode of the same block after the same prefix in a fresh context."""
    llc, model = target
    context, block = 40, 4
    v = Verifier(llc, model, context=context, max_block=8, n_threads=1, flash_attn=FLASH_ATTN_OFF)
    ref = Verifier(llc, model, context=context, max_block=8, n_threads=1, flash_attn=FLASH_ATTN_OFF)
    try:
        v.verify(1)
        v.verify(block)
        ctx = v.ctxs[block]
        ours = np.ctypeslib.as_array(llc.llama_get_logits(ctx), shape=(block, v.n_vocab)).copy()
        # the reference: the prefix decoded again from the same token ids (in the context's batch size), then the block
        assert llc.llama_memory_seq_rm(llc.llama_get_memory(ref._context(block)), 0, 0, -1)
        ids = np.random.default_rng(0).integers(2, v.n_vocab, size=context).tolist()
        for start in range(0, context, block):
            ref._decode(ref.ctxs[block], ids[start : start + block], start)
        ref.verify(block)
        theirs = np.ctypeslib.as_array(llc.llama_get_logits(ref.ctxs[block]), shape=(block, v.n_vocab))
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
        # a block decoded with no prefix differs: the comparison can fail
        llc.llama_memory_seq_rm(llc.llama_get_memory(ref.ctxs[block]), 0, 0, -1)
        ref._decode(ref.ctxs[block], np.random.default_rng(block).integers(2, v.n_vocab, size=block).tolist(), 0)
        alone = np.ctypeslib.as_array(llc.llama_get_logits(ref.ctxs[block]), shape=(1, v.n_vocab))[0]
        assert np.abs(alone - ours[-1]).max() > 1e-2
    finally:
        v.close()
        ref.close()


def test_a_hybrid_target_verifies_from_the_prefix_every_time() -> None:
    """A recurrent state cannot drop every token of the decode just timed (libllama's snapshots keep one): the
    timer restores the prefilled sequence, so each verify of a Qwen3.5 hybrid starts from the same state."""
    _, pair = inflated_hybrid()
    llc, model = load_model(pair.targets["f16"])
    v = Verifier(llc, model, context=40, max_block=8, n_threads=1, flash_attn=FLASH_ATTN_OFF)
    try:
        assert v.recurrent
        rows = []
        for b in (4, 1, 4, 4):
            assert v.verify(b) > 0
            if b == 4:
                rows.append(np.ctypeslib.as_array(llc.llama_get_logits(v.ctxs[4]), shape=(4, v.n_vocab)).copy())
        for later in rows[1:]:
            np.testing.assert_array_equal(later, rows[0])
    finally:
        v.close()
        llc.llama_model_free(model)


def test_a_moe_target_verifies_tokens_that_text_can_hold() -> None:
    """A MoE's verify costs the experts its tokens are routed to, which depends on the tokens: the timed
    decodes take tokens text can hold, never an inflated target's padding (zero embeddings, which would all
    be routed alike), so the inflated MoE's vocabulary of 4096 yields only tinycode's 2048 ids."""
    _, pair = inflated_moe()
    llc, model = load_model(pair.targets["f16"])
    v = Verifier(llc, model, context=40, max_block=8, n_threads=1, flash_attn=FLASH_ATTN_OFF)
    try:
        assert v.n_vocab == 4096 and 0 < len(v.tokens) <= 2048 and v.tokens.max() < 2048
        assert v.verify(8) > 0
    finally:
        v.close()
        llc.llama_model_free(model)
