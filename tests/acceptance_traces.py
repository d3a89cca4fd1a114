"""What the bundled drafter would get accepted at every point of the bench's greedy runs.

For each of the 20 prompts: the target's greedy continuation (libllama), the target features of
prompt + continuation (the PyTorch reference target: hidden_states[l + 1] for l in
target_layer_ids), and for every position p of the continuation and every draft length k the
number of drafted tokens the target accepts when the loop drafts k tokens (a short block, as the
loop drafts) from the anchor at p over the context rows before p. Greedy acceptance is a function
of (p, k) alone, so a simulated loop that picks any k at any step replays what the real loop
would accept: the content drift between prompts (one perfectly predictable, others not) that an
i.i.d. acceptance model hides.

    traces = record(drafter_path)   # list of int arrays [n_positions, cap]; [p, k - 1] = accepted
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tinycode import TARGET, TINY, GreedyReference, prompt_tokens

CAP = 7


def record(drafter: Path, n_tokens: int = 128, cap: int = CAP) -> list[np.ndarray]:
    import torch
    from reference.qwen3_ref import Qwen3Reference

    import dflash_gguf

    torch.set_num_threads(1)
    ref = GreedyReference()
    target = Qwen3Reference.from_hf_dir(TINY / "target")
    d = dflash_gguf.Drafter(str(drafter), str(TARGET), n_threads=1, n_ctx=512)
    layers = d.hparams["target_layers"]  # libllama's ids: HF target_layer_ids + 1
    traces = []
    for prompt in prompt_tokens(ref.tokenize):
        cont = ref.greedy(prompt, n_tokens + cap).tokens
        seq = list(prompt) + list(cont)
        with torch.no_grad():
            hs = target.forward(seq).hidden_states
        feats = torch.cat([hs[lid] for lid in layers], dim=-1).numpy().astype(np.float32)
        traces.append(_accepted(d, feats, seq, len(prompt), n_tokens, cap))
    return traces


def _accepted(d: object, feats: np.ndarray, seq: Sequence[int], n_prompt: int, n_tokens: int, cap: int) -> np.ndarray:
    # the anchor at p is the last accepted token (no features yet); the cache holds rows 0..p-1
    n_pos = min(n_tokens, len(seq) - n_prompt)
    out = np.zeros((n_pos, cap), np.int32)
    d.reset()  # type: ignore[attr-defined]
    d.inject(feats[:n_prompt], np.arange(n_prompt, dtype=np.int32))  # type: ignore[attr-defined]
    for i in range(n_pos):
        p = n_prompt + i
        if i:
            d.inject(feats[p - 1 : p], np.array([p - 1], np.int32))  # type: ignore[attr-defined]
        for k in range(1, cap + 1):
            drafted = d.draft(seq[p], p, k, short_block=True)  # type: ignore[attr-defined]
            truth = seq[p + 1 : p + 1 + k]
            j = 0
            while j < min(k, len(truth)) and drafted[j] == truth[j]:
                j += 1
            out[i, k - 1] = j
    return out
