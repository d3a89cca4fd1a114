"""The PyTorch references are right: the drafter against examples/tinycode/golden_dflash2.json
(an independent implementation's numbers), the target against llama.cpp's greedy decode.

A set of deliberately broken variants (off-by-one target layers, GPT-J rope, no conv, ...)
must *fail* the same golden comparison: that is what shows the tolerances mean something.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reference import dflash_ref
from reference.dflash_ref import DraftReference
from reference.qwen3_ref import Qwen3Reference

# The models are tiny: one thread is fastest, and on a shared 2-core box torch's default
# thread pool thrashes (a 90-token target forward: 30 ms with 1 thread, ~300 ms with 2 under load).
torch.set_num_threads(1)

TINY = Path(__file__).resolve().parent.parent / "examples" / "tinycode"
GOLDEN = json.loads((TINY / "golden_dflash2.json").read_text())

# Golden values are printed with 6 decimals; a float32 re-computation of the same
# model lands within ~3e-6 of them (measured). 1e-4 leaves 30x room for summation
# order, and is still 100x below what any broken variant below produces.
ATOL_LOGIT = 1e-4  # top-k logits and selector scores (magnitudes ~1..15)
ATOL_HIDDEN = 1e-4  # context features g_p and h_final values (magnitudes ~0.1..5)


@pytest.fixture(scope="module")
def target() -> Qwen3Reference:
    return Qwen3Reference.from_hf_dir(TINY / "target")


@pytest.fixture(scope="module")
def drafter() -> DraftReference:
    return DraftReference.from_hf_dir(TINY / "drafter-dflash2", TINY / "target")


@pytest.fixture(scope="module")
def target_runs(target: Qwen3Reference) -> dict[str, Any]:
    """Target forward on each golden prompt (hidden states + logits), computed once."""
    return {case["prompt_id"]: target.forward(case["prompt_ids"]) for case in GOLDEN["cases"]}


def golden_errors(
    ref: DraftReference, hidden_states: Any, case: dict[str, Any], layer_offset: int = 1
) -> dict[str, Any]:
    """Run inject + one block for a golden case; return max abs errors and exact-match flags."""
    feats = torch.cat([hidden_states[i + layer_offset] for i in ref.cfg.target_layer_ids], dim=-1)
    n = len(case["prompt_ids"])
    cache = ref.inject(feats, range(n))
    out = ref.draft(cache, case["anchor"], case["block_start"])
    err: dict[str, Any] = {
        "g_first": (cache.g[0, :8] - torch.tensor(case["context_features_pos0_first8"])).abs().max().item(),
        "g_last": (cache.g[-1, :8] - torch.tensor(case["context_features_last_first8"])).abs().max().item(),
        "h_row0": (out.h_final[0, :8] - torch.tensor(case["row0_hidden_first8"])).abs().max().item(),
        "topk_ids": True,
        "topk_logits": 0.0,
        "scores": 0.0,
        "h_rows": 0.0,
        "walk": out.walk.tolist() == case["walk"],
        "argmax": out.argmax.tolist() == case["argmax"],
    }
    assert out.candidates is not None
    for r in case["rows"]:
        t = r["row"]
        err["topk_ids"] &= out.candidates[t - 1].tolist() == r["topk_ids"]
        err["topk_logits"] = max(
            err["topk_logits"], (out.cand_logits[t - 1] - torch.tensor(r["topk_logits"])).abs().max().item()
        )
        try:
            s = out.scores_given(t, r["selector_predecessor"])
            e = (s - torch.tensor(r["selector_scores"])).abs().max().item()
        except ValueError:  # the golden's predecessor is not among our candidates
            e = float("inf")
        err["scores"] = max(err["scores"], e)
        err["h_rows"] = max(err["h_rows"], (out.h_final[t, :8] - torch.tensor(r["hidden_first8"])).abs().max().item())
    return err


def matches(err: dict[str, Any]) -> bool:
    return (
        err["topk_ids"]
        and err["walk"]
        and err["argmax"]
        and err["topk_logits"] <= ATOL_LOGIT
        and err["scores"] <= ATOL_LOGIT
        and max(err["g_first"], err["g_last"], err["h_row0"], err["h_rows"]) <= ATOL_HIDDEN
    )


# --------------------------------------------------------------------------- #
# the golden
# --------------------------------------------------------------------------- #


def test_golden_meta_matches_drafter_config(drafter: DraftReference) -> None:
    meta = GOLDEN["meta"]
    assert drafter.cfg.version == 2
    assert drafter.block_size == meta["block_size"] == 8
    assert drafter.cfg.mask_token_id == meta["mask_token_id"]
    assert list(drafter.cfg.target_layer_ids) == meta["target_layer_ids"] == [1, 3]
    assert drafter.cfg.target_layers == (2, 4)
    assert drafter.cfg.selector_top_k == meta["selector_top_k"]
    assert drafter.target_hidden == drafter.cfg.hidden_size == 256


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt_id"])
def test_draft_matches_golden(case: dict[str, Any], drafter: DraftReference, target_runs: dict[str, Any]) -> None:
    run = target_runs[case["prompt_id"]]
    # the anchor is the target's greedy token after the prompt
    assert case["block_start"] == len(case["prompt_ids"])
    assert int(run.logits[-1].argmax()) == case["anchor"]
    err = golden_errors(drafter, run.hidden_states, case)
    print(case["prompt_id"], err)
    assert err["topk_ids"] and err["walk"] and err["argmax"], err
    assert err["topk_logits"] <= ATOL_LOGIT, err
    assert err["scores"] <= ATOL_LOGIT, err
    assert err["g_first"] <= ATOL_HIDDEN and err["g_last"] <= ATOL_HIDDEN, err
    assert err["h_row0"] <= ATOL_HIDDEN and err["h_rows"] <= ATOL_HIDDEN, err


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt_id"])
def test_golden_acceptance_against_target(case: dict[str, Any], target: Qwen3Reference) -> None:
    """target_greedy_after_anchor is the target's own greedy continuation, and accepted_* the
    common prefix of the drafts with it."""
    greedy = target.generate_greedy(case["prompt_ids"] + [case["anchor"]], len(case["walk"]))
    assert greedy == case["target_greedy_after_anchor"]

    def prefix(d: list[int]) -> int:
        n = 0
        while n < len(d) and d[n] == greedy[n]:
            n += 1
        return n

    assert prefix(case["walk"]) == case["accepted_walk"]
    assert prefix(case["argmax"]) == case["accepted_argmax"]


def test_float64_agrees_with_float32(drafter: DraftReference, target_runs: dict[str, Any]) -> None:
    case = GOLDEN["cases"][0]
    ref64 = DraftReference.from_hf_dir(TINY / "drafter-dflash2", TINY / "target", dtype=torch.float64)
    feats = drafter.features_from_hidden_states(target_runs[case["prompt_id"]].hidden_states)
    n = len(case["prompt_ids"])
    o32 = drafter.draft(drafter.inject(feats, range(n)), case["anchor"], n)
    o64 = ref64.draft(ref64.inject(feats.double(), range(n)), case["anchor"], n)
    assert torch.equal(o32.walk, o64.walk) and torch.equal(o32.candidates, o64.candidates)
    assert (o32.logits.double() - o64.logits).abs().max().item() < 1e-4
    assert (o32.scores.double() - o64.scores).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- #
# broken variants must fail the golden comparison
# --------------------------------------------------------------------------- #


def _rope_gptj(x: torch.Tensor, positions: torch.Tensor, theta: float, n_rot: int | None = None) -> torch.Tensor:
    """Interleaved (GPT-J / "normal" ggml) rope: pairs (2i, 2i+1). Wrong for Qwen3."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d // 2, dtype=torch.float64) * 2.0 / d))
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cos(ang).to(x.dtype)[:, None], torch.sin(ang).to(x.dtype)[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _conv_next_row(y: torch.Tensor, wk: torch.Tensor, side: int) -> torch.Tensor:
    """Tap 1 reads row t+1 instead of t-1."""
    out = wk[:, side, 0] * y
    out[:-1] += wk[:-1, side, 1] * y[1:]
    return out


def _kernel_group_interleaved(self: DraftReference, h: torch.Tensor, prefix: str) -> torch.Tensor:
    """Channel ch uses group ch % G instead of ch // group_size."""
    c = self.cfg
    G = c.hidden_size // c.conv_group_size
    coef = (h @ self.w[prefix + "kernel_projection.weight"].T).view(h.shape[0], 2, c.conv_kernel_size, G)
    return self.w[prefix + "base_kernel"][None] + coef.repeat(1, 1, 1, c.conv_group_size)


def _kernel_tap_side_swapped(self: DraftReference, h: torch.Tensor, prefix: str) -> torch.Tensor:
    """kernel_projection read as [tap][side][group] instead of [side][tap][group]."""
    c = self.cfg
    G = c.hidden_size // c.conv_group_size
    coef = (h @ self.w[prefix + "kernel_projection.weight"].T).view(h.shape[0], c.conv_kernel_size, 2, G)
    coef = coef.transpose(1, 2).repeat_interleave(c.conv_group_size, dim=-1)
    return self.w[prefix + "base_kernel"][None] + coef


def _base_only_kernel(self: DraftReference, h: torch.Tensor, prefix: str) -> torch.Tensor:
    """The conv's base kernel alone, without the dynamic per-row part."""
    return self.w[prefix + "base_kernel"][None].expand(h.shape[0], -1, -1, -1)


def _features_without_hidden_norm(self: DraftReference, f: Any) -> torch.Tensor:
    return torch.as_tensor(f, dtype=self.dtype) @ self.w["fc.weight"].T


_real_draft = DraftReference.draft


def _draft_one_position_early(self: DraftReference, cache: Any, anchor: int, position: int) -> Any:
    return _real_draft(self, cache, anchor, position - 1)


def apply_mutant(name: str, mp: pytest.MonkeyPatch, ref: DraftReference) -> dict[str, Any]:
    """Break `ref` (or the code it runs) one way; return extra kwargs for golden_errors."""
    if name == "target_layer_off_by_one":  # features from hidden_states[id] instead of [id + 1]
        return {"layer_offset": 0}
    if name == "rope_gptj_interleaved":
        mp.setattr(dflash_ref, "rope_neox", _rope_gptj)
    elif name == "no_conv":
        mp.setattr(DraftReference, "_conv", staticmethod(lambda y, wk, side: y))
    elif name == "conv_base_only":
        mp.setattr(DraftReference, "_conv_kernel", _base_only_kernel)
    elif name == "conv_tap_reads_next_row":
        mp.setattr(DraftReference, "_conv", staticmethod(_conv_next_row))
    elif name == "conv_group_interleaved":
        mp.setattr(DraftReference, "_conv_kernel", _kernel_group_interleaved)
    elif name == "conv_tap_side_swapped":
        mp.setattr(DraftReference, "_conv_kernel", _kernel_tap_side_swapped)
    elif name == "block_causal_mask":
        causal = (True,) * ref.cfg.num_hidden_layers
        mp.setattr(ref, "cfg", dataclasses.replace(ref.cfg, causal_layers=causal))
    elif name == "no_hidden_norm":
        mp.setattr(DraftReference, "context_features", _features_without_hidden_norm)
    elif name == "block_position_minus_one":
        mp.setattr(DraftReference, "draft", _draft_one_position_early)
    elif name == "no_selector_gate":
        gate = "candidate_selector.hidden_projection.weight"
        mp.setitem(ref.w, gate, torch.zeros_like(ref.w[gate]))
    else:
        raise KeyError(name)
    return {}


MUTANTS = [
    "target_layer_off_by_one",
    "rope_gptj_interleaved",
    "no_conv",
    "conv_base_only",
    "conv_tap_reads_next_row",
    "conv_group_interleaved",
    "conv_tap_side_swapped",
    "block_causal_mask",
    "no_hidden_norm",
    "block_position_minus_one",
    "no_selector_gate",
]


@pytest.mark.parametrize("name", MUTANTS)
def test_broken_variant_fails_golden(name: str, monkeypatch: pytest.MonkeyPatch, target_runs: dict[str, Any]) -> None:
    ref = DraftReference.from_hf_dir(TINY / "drafter-dflash2", TINY / "target")
    kwargs = apply_mutant(name, monkeypatch, ref)
    case = GOLDEN["cases"][0]
    err = golden_errors(ref, target_runs[case["prompt_id"]].hidden_states, case, **kwargs)
    print(name, err)
    assert not matches(err), f"{name} should not reproduce the golden: {err}"


# --------------------------------------------------------------------------- #
# reference internals, against the spec's formulas written out longhand
# --------------------------------------------------------------------------- #


def test_conv_matches_spec_formula(drafter: DraftReference) -> None:
    """w[t,side,tap,ch] = base[side,tap,ch] + c[t,side,tap,ch // gs]; conv(y)[t] = sum_tap w * y[t-tap]."""
    g = torch.Generator().manual_seed(0)
    c = drafter.cfg
    B, H, K, gs = c.block_size, c.hidden_size, c.conv_kernel_size, c.conv_group_size
    h = torch.randn(B, H, generator=g)
    y = torch.randn(B, H, generator=g)
    prefix = "layers.1.mlp_conv."
    wk = drafter._conv_kernel(h, prefix)
    proj = drafter.w[prefix + "kernel_projection.weight"]
    base = drafter.w[prefix + "base_kernel"]
    for side in (0, 1):
        got = drafter._conv(y, wk, side)
        for t in (0, 1, B - 1):
            cvec = proj @ h[t]  # 2*K*G values: [side][tap][group]
            want = torch.zeros(H)
            for tap in range(K):
                if t - tap < 0:
                    continue
                for ch in (0, 15, 16, H - 1):
                    wv = base[side, tap, ch] + cvec[(side * K + tap) * (H // gs) + ch // gs]
                    want[ch] += wv * y[t - tap, ch]
            for ch in (0, 15, 16, H - 1):
                assert abs(got[t, ch].item() - want[ch].item()) < 1e-4, (side, t, ch)


def test_selector_layout_and_q(drafter: DraftReference, target_runs: dict[str, Any]) -> None:
    case = GOLDEN["cases"][1]
    feats = drafter.features_from_hidden_states(target_runs[case["prompt_id"]].hidden_states)
    n = len(case["prompt_ids"])
    out = drafter.draft(drafter.inject(feats, range(n)), case["anchor"], n)
    B, k = drafter.block_size, drafter.cfg.selector_top_k
    assert out.candidates.shape == (B - 1, k) and out.scores.shape == (B - 1, k, k)
    # row 1: the anchor's scores repeated for every predecessor slot
    assert torch.equal(out.scores[0], out.scores[0, :1].expand(k, k))
    # candidates are the top-k of each row's logits, by logit descending
    assert torch.all(out.cand_logits[:, :-1] >= out.cand_logits[:, 1:])
    assert torch.equal(out.cand_logits, out.logits[1:].gather(1, out.candidates))
    # S_t(a, b) longhand for one row / pair
    P = drafter.w["candidate_selector.predecessor_codebook"]
    N = drafter.w["candidate_selector.successor_codebook"]
    Wg = drafter.w["candidate_selector.hidden_projection.weight"]
    t, i, j = 3, 2, 5
    a, b = int(out.candidates[t - 2, i]), int(out.candidates[t - 1, j])
    s = out.logits[t, b] + (P[a] * (Wg @ out.h_final[t]) * N[b]).sum()
    assert abs(out.scores[t - 1, i, j].item() - s.item()) < 1e-4
    # walk: b_t = argmax_b S_t(b_{t-1}, b); q_t = softmax of that row
    prev = case["anchor"]
    for t in range(1, B):
        s = out.scores_given(t, prev)
        assert int(out.walk[t - 1]) == int(out.candidates[t - 1, int(s.argmax())])
        assert torch.allclose(out.q_probs[t - 1], torch.softmax(s, -1))
        prev = int(out.walk[t - 1])
    assert torch.equal(out.q_ids, out.candidates)
    dense = out.q_dense()
    assert dense.shape == (B - 1, drafter.vocab_size)
    assert torch.allclose(dense.sum(-1), torch.ones(B - 1))
    assert torch.allclose(dense.gather(1, out.q_ids), out.q_probs)
    assert torch.equal(out.draft, out.walk)


def test_cache_append_truncate(drafter: DraftReference, target_runs: dict[str, Any]) -> None:
    case = GOLDEN["cases"][2]
    feats = drafter.features_from_hidden_states(target_runs[case["prompt_id"]].hidden_states)
    n = len(case["prompt_ids"])
    whole = drafter.inject(feats, range(n))
    parts = drafter.inject(feats[:40], range(40))
    drafter.inject(feats[40:], range(40, n), parts)
    assert len(parts) == len(whole) == n
    for a, b in zip(whole.k + whole.v, parts.k + parts.v):
        assert torch.allclose(a, b, atol=1e-6)
    o1 = drafter.draft(whole, case["anchor"], n)
    # rollback: inject garbage rows, truncate them away, draft again
    drafter.inject(torch.randn(5, feats.shape[1]), range(n, n + 5), parts)
    parts.truncate(n)
    o2 = drafter.draft(parts, case["anchor"], n)
    assert torch.allclose(o1.logits, o2.logits, atol=1e-5)
    assert torch.equal(o1.walk, o2.walk)


def _dflash1_from(drafter_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["dflash_config"].pop(key)
    from reference.qwen3_ref import load_safetensors_dir

    tensors = {
        k: v for k, v in load_safetensors_dir(drafter_dir).items() if "conv" not in k and "candidate_selector" not in k
    }
    return cfg, tensors


def test_dflash1_path(drafter: DraftReference, target: Qwen3Reference, target_runs: dict[str, Any]) -> None:
    """DFlash 1 (the same weights minus conv and selector): no conv, argmax draft, softmax q."""
    cfg, tensors = _dflash1_from(TINY / "drafter-dflash2")
    ref1 = DraftReference(cfg, tensors, target.embed, target.lm_head)
    assert ref1.cfg.version == 1
    case = GOLDEN["cases"][0]
    feats = ref1.features_from_hidden_states(target_runs[case["prompt_id"]].hidden_states)
    n = len(case["prompt_ids"])
    out1 = ref1.draft(ref1.inject(feats, range(n)), case["anchor"], n)
    assert out1.candidates is None and out1.scores is None and out1.walk is None
    assert torch.equal(out1.draft, out1.logits[1:].argmax(-1))
    assert torch.allclose(out1.q_dense(), torch.softmax(out1.logits[1:], -1))
    # the same blocks through DFlash 2 with the conv made the identity (base tap0 = 1,
    # tap1 = 0, zero projection) must give the DFlash 1 numbers
    ident = dict(tensors)
    for name, t in drafter.w.items():
        if name.endswith("base_kernel"):
            base = torch.zeros_like(t)
            base[:, 0] = 1.0
            ident[name] = base
        elif name.endswith("kernel_projection.weight"):
            ident[name] = torch.zeros_like(t)
        elif name.startswith("candidate_selector"):
            ident[name] = t
    cfg2 = json.loads((TINY / "drafter-dflash2" / "config.json").read_text())
    ref2 = DraftReference(cfg2, ident, target.embed, target.lm_head)
    out2 = ref2.draft(ref2.inject(feats, range(n)), case["anchor"], n)
    assert torch.allclose(out1.logits, out2.logits, atol=1e-5)
    # and the real conv changes the numbers (it is not a no-op on this checkpoint)
    out_real = drafter.draft(drafter.inject(feats, range(n)), case["anchor"], n)
    assert (out_real.logits - out1.logits).abs().max().item() > 0.5


def test_scales_softcap_causal(drafter: DraftReference, target: Qwen3Reference, target_runs: dict[str, Any]) -> None:
    case = GOLDEN["cases"][0]
    n = len(case["prompt_ids"])
    feats = drafter.features_from_hidden_states(target_runs[case["prompt_id"]].hidden_states)
    base = drafter.draft(drafter.inject(feats, range(n)), case["anchor"], n)
    cfg = json.loads((TINY / "drafter-dflash2" / "config.json").read_text())

    def variant(**dflash_extra: Any) -> Any:
        c = json.loads(json.dumps(cfg))
        c["dflash_config"].update(dflash_extra)
        r = DraftReference(c, drafter.w, target.embed, target.lm_head)
        return r, r.draft(r.inject(feats, range(n)), case["anchor"], n)

    _, o = variant(output_multiplier=0.5, final_logit_softcapping=3.0)
    assert torch.allclose(o.logits, 3.0 * torch.tanh(base.logits * 0.5 / 3.0), atol=1e-5)
    assert torch.equal(o.candidates, base.candidates)  # monotone: same top-k order
    _, o = variant(input_embedding_scale=2.0)
    assert not torch.allclose(o.logits, base.logits, atol=1e-3)
    _, o = variant(attention_value_scale=1.0)
    assert torch.allclose(o.logits, base.logits, atol=1e-6)
    _, o = variant(attention_value_scale=0.5)
    assert not torch.allclose(o.logits, base.logits, atol=1e-3)
    # causal: row 0 sees only itself among block rows; the conv only looks back, so row 0's
    # result equals a 1-row block's, and rows differ from the bidirectional run
    r, oc = variant(causal=True)
    r1 = DraftReference(json.loads(json.dumps(cfg)), drafter.w, target.embed, target.lm_head)
    r1.cfg = dataclasses.replace(r.cfg, block_size=1)
    o1 = r1.draft(r1.inject(feats, range(n)), case["anchor"], n)
    assert torch.allclose(oc.logits[0], o1.logits[0], atol=1e-5)
    assert not torch.allclose(oc.logits[0], base.logits[0], atol=1e-3)


def test_numpy_tensors_and_model_prefix(drafter: DraftReference, target: Qwen3Reference) -> None:
    """HF tensors as numpy (bf16 as raw uint16 bits) with a `model.` prefix load to the same model."""
    from reference.qwen3_ref import load_safetensors_dir

    # bf16 as numpy readers hold it (the converter widens it by hand): raw uint16 bits
    raw = {
        k: v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy()
        for k, v in load_safetensors_dir(TINY / "drafter-dflash2").items()
    }
    assert any(a.dtype == np.uint16 for a in raw.values())
    cfg = json.loads((TINY / "drafter-dflash2" / "config.json").read_text())
    ref = DraftReference(cfg, {"model." + k: v for k, v in raw.items()}, target.embed.numpy(), target.lm_head.numpy())
    assert ref.w.keys() == drafter.w.keys()
    for k in ref.w:
        assert torch.equal(ref.w[k], drafter.w[k]), k


@pytest.mark.parametrize("version", [1, 2])
def test_factory_checkpoints_load_and_draft(tmp_path: Path, version: int) -> None:
    """The reference takes what tests/factories.make_checkpoint writes (sharded, `model.` prefix,
    derived target_layer_ids, a target wider than the drafter's fc input split) and drafts."""
    from factories import make_checkpoint
    from reference.qwen3_ref import load_safetensors_dir

    hidden, vocab, th = 64, 512, 48
    stored = make_checkpoint(
        tmp_path,
        version=version,
        hidden=hidden,
        vocab=vocab,
        target_hidden=th,
        shards=2,
        prefix="model.",
        target_layer_ids=None,
        n_target_layers=8,
        n_layers=3,
    )
    cfg = json.loads((tmp_path / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) / 8
    ref = DraftReference(cfg, load_safetensors_dir(tmp_path), embed, lm_head)
    assert ref.cfg.version == version
    assert ref.cfg.target_layer_ids == (1, 3, 5)  # round(1 + i * (8 - 4) / 2)
    assert ref.target_hidden == th
    for k, v in stored.items():
        assert torch.equal(ref.w[k], torch.from_numpy(v)), k
    cache = ref.inject(torch.randn(10, 3 * th, generator=g), range(10))
    out = ref.draft(cache, anchor=5, position=10)
    B = ref.block_size
    assert out.logits.shape == (B, vocab) and out.h_final.shape == (B, hidden)
    assert out.draft.shape == (B - 1,)
    if version == 2:
        k = ref.cfg.selector_top_k
        assert out.scores.shape == (B - 1, k, k) and out.q_probs.shape == (B - 1, k)
        assert torch.allclose(out.q_probs.sum(-1), torch.ones(B - 1))
    else:
        assert out.scores is None and torch.equal(out.draft, out.argmax)


def test_default_target_layer_ids() -> None:
    from reference import default_target_layer_ids

    assert default_target_layer_ids(6, 1) == [3]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(6, 2) == [1, 3]  # the tinycode drafter's choice


# --------------------------------------------------------------------------- #
# the target reference against llama.cpp
# --------------------------------------------------------------------------- #


def _llama_greedy(llm: Any, prompt: list[int], n_new: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n_new):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def test_target_greedy_matches_llama_cpp(target: Qwen3Reference) -> None:
    """qwen3_ref's greedy continuation == llama.cpp's on target-f16.gguf (16 tokens, 3 prompts)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    prompts = [json.loads(line) for line in (TINY / "prompts.jsonl").read_text().splitlines()[:3]]
    n_new = 16
    # the torch side first: ggml's worker threads spin after each decode and would starve it
    vocab = llama_cpp.Llama(model_path=str(TINY / "target-f16.gguf"), vocab_only=True, verbose=False)
    prompt_ids = [vocab.tokenize(p["text"].encode(), add_bos=False, special=False) for p in prompts]
    del vocab
    ours = [target.generate_greedy(ids, n_new) for ids in prompt_ids]
    llm = llama_cpp.Llama(
        model_path=str(TINY / "target-f16.gguf"), n_ctx=256, n_batch=256, n_threads=1, logits_all=True, verbose=False
    )
    for p, ids, mine in zip(prompts, prompt_ids, ours):
        theirs = _llama_greedy(llm, ids, n_new)
        assert mine == theirs, (p["id"], mine, theirs)
    # and the golden prompts' anchors
    for case in GOLDEN["cases"]:
        assert _llama_greedy(llm, case["prompt_ids"], 1) == [case["anchor"]]
