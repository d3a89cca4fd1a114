"""The inflated pairs of `dflash bench --scale` (bindings/dflash_gguf/bench/inflate.py) at the smallest size, 0.6B,
a small Qwen3.5 hybrid (Gated DeltaNet layers, gated attention over a partly rotated wide head) built the way
the 2.8B-hybrid size is, and small MoEs (Qwen3 MoE, Qwen3.5 MoE) built the way 4.5B-moe and 7B-hybrid-moe are.

The inflated target must compute the tinycode target's function: the same greedy text on the bundled
prompts (near-ties reported), the same logits over the real vocabulary, and every padded token's logit
far below. The inflated drafter must be accepted as often as the bundled one (within 5%).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from tinycode import (
    EOS,
    TARGET,
    THREADS,
    GreedyReference,
    drafter_gguf,
    inflated_hybrid,
    inflated_hybrid_moe,
    inflated_moe,
    prompts,
    record,
)

from dflash_gguf import SpeculativeLlama
from dflash_gguf.bench.inflate import SIZES, Inflation, ScaleSize, ensure_pair, load_source

SIZE = SIZES["0.6B"]
N_TOKENS = 24
REAL_VOCAB = 2048


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return ensure_pair(SIZE, tmp_path_factory.mktemp("inflated"), target_types=("f16", "q8_0", "q4_k_m"))


_SMALL = {"hybrid": inflated_hybrid, "moe": inflated_moe, "hybrid-moe": inflated_hybrid_moe}


@pytest.fixture(params=["dense", "hybrid", "moe", "hybrid-moe"])
def sized_pair(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """(the size, its inflated pair)"""
    return _SMALL[request.param]() if request.param in _SMALL else (SIZE, request.getfixturevalue("dense_pair"))


@pytest.fixture(scope="module")
def reference() -> GreedyReference:
    return GreedyReference(TARGET)


def _greedy_with_logits(ref: GreedyReference, prefix: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    llm = ref.llm
    llm.reset()
    llm.eval(list(prefix))
    tokens, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        tokens.append(int(np.argmax(row)))
        if tokens[-1] == EOS:
            break
        llm.eval([tokens[-1]])
    return tokens, logits


def test_f16_target_computes_tinycodes_function(sized_pair, reference: GreedyReference) -> None:  # type: ignore[no-untyped-def]
    from gguf import GGUFReader

    size, pair = sized_pair
    inflated = GreedyReference(pair.targets["f16"])
    assert inflated.llm.n_vocab() == size.vocab
    arch = GGUFReader(pair.targets["f16"]).fields["general.architecture"].contents()
    assert arch == size.arch
    near_ties, worst_diff, top_pad = [], 0.0, -np.inf
    identical = 0
    for p in prompts():
        toks = reference.tokenize(p["text"])
        assert inflated.tokenize(p["text"]) == toks, "the padded vocabulary tokenizes as tinycode's"
        ref = reference.greedy(toks, N_TOKENS)
        got, logits = _greedy_with_logits(inflated, toks, N_TOKENS)
        for i, row in enumerate(logits):
            top_pad = max(top_pad, float(row[REAL_VOCAB:].max()))
        if got == ref.tokens:
            identical += 1
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b)
            near_ties.append({"prompt": p["id"], "index": i, "margin": ref.margins[i]})
            assert ref.margins[i] < 1e-2, f"{p['id']}: differs at {i}, tinycode's margin {ref.margins[i]}"
        same = min(len(got), len(ref.tokens))
        if same:
            want = reference.logits_after(toks + ref.tokens[: same - 1])
            worst_diff = max(worst_diff, float(np.abs(logits[same - 1][:REAL_VOCAB] - want).max()))
    record(
        f"inflate_f16_{size.arch}",
        {
            "identical": identical,
            "near_ties": near_ties,
            "max_real_logit_diff": worst_diff,
            "max_padded_logit": top_pad,
        },
    )
    assert identical >= len(prompts()) - 2, near_ties
    assert worst_diff < 2e-2, "the real logits are tinycode's up to F16 rounding"
    assert top_pad < -1e3, "a padded token can never win or enter the drafter's top-k"


def _same_prefix(reference: GreedyReference, target: GreedyReference) -> tuple[int, float]:
    """Greedy tokens of `target` that agree with tinycode's before the first difference (10 prompts), and
    the highest padded-token logit seen."""
    same, top_pad = 0, -np.inf
    for p in prompts()[:10]:
        toks = reference.tokenize(p["text"])
        ref = reference.greedy(toks, N_TOKENS).tokens
        got, logits = _greedy_with_logits(target, toks, N_TOKENS)
        top_pad = max(
            top_pad, max(float(row[REAL_VOCAB:].max()) if len(row) > REAL_VOCAB else -np.inf for row in logits)
        )
        same += next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return same, top_pad


@pytest.mark.parametrize(
    "which,ftype",
    [("dense", "q8_0"), ("dense", "q4_k_m"), ("hybrid", "q4_k_m"), ("moe", "q4_k_m"), ("hybrid-moe", "q4_k_m")],
)
def test_quantized_targets_keep_the_text(
    request: pytest.FixtureRequest,
    reference: GreedyReference,
    tmp_path: Path,
    which: str,
    ftype: str,
) -> None:
    """Quantized, the inflated target is not bit-for-bit tinycode's quantized the same way (its blocks
    group other values), so it is held to that: its greedy text agrees with tinycode's F16 text about as
    long as tinycode's own quantization does, and padded tokens stay out."""
    from dflash_convert.quantize import llama_quantize, parse_outtype

    pair = _SMALL[which]()[1] if which in _SMALL else request.getfixturevalue("dense_pair")
    llama_quantize(TARGET, tmp_path / f"tinycode-{ftype}.gguf", parse_outtype(ftype))
    baseline, _ = _same_prefix(reference, GreedyReference(tmp_path / f"tinycode-{ftype}.gguf"))
    same, top_pad = _same_prefix(reference, GreedyReference(pair.targets[ftype]))
    record(
        f"inflate_{which}_{ftype}",
        {
            "same_prefix_tokens": same,
            "tinycode_quantized_same_prefix_tokens": baseline,
            "tokens": 10 * N_TOKENS,
            "max_padded_logit": top_pad,
        },
    )
    assert same >= 0.7 * baseline, (same, baseline)
    assert top_pad < -1e3


def _acceptance(target: Path | str, draft: Path | str) -> tuple[float, int]:
    llm = SpeculativeLlama(str(target), str(draft), n_ctx=512, n_threads=THREADS, n_max=7)
    accepted = steps = 0
    for p in prompts():
        toks = llm.tokenize(p["text"], add_special=False, parse_special=False)
        list(llm.generate_tokens(toks, max_tokens=N_TOKENS, temperature=0.0))
        s = llm.stats
        accepted, steps = accepted + s.accepted, steps + s.steps - s.plain_steps
    llm.close()
    return (accepted + steps) / steps


def test_inflated_drafter_is_accepted_as_the_bundled_one(sized_pair) -> None:  # type: ignore[no-untyped-def]
    size, pair = sized_pair
    bundled = _acceptance(TARGET, drafter_gguf("q4_0"))
    inflated = _acceptance(pair.targets["f16"], pair.draft)
    record(f"inflate_acceptance_{size.arch}", {"bundled": bundled, "inflated": inflated})
    assert abs(inflated / bundled - 1) <= 0.05, (inflated, bundled)


def test_sizes_that_cannot_hold_the_pair_are_refused() -> None:
    src = load_source()
    with pytest.raises(ValueError, match=r"size bad: hidden 200 must be a multiple of 16 above 256.*ff 512"):
        Inflation(src, ScaleSize("bad", hidden=200, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ff=512))
    with pytest.raises(ValueError, match=r"7 layers cannot hold the 6 real ones"):
        Inflation(src, ScaleSize("bad", hidden=512, n_layers=7, n_heads=16, n_kv_heads=8, head_dim=128, ff=1024))
    assert Inflation(src, SIZE).real_layers == [0, 7, 8, 19, 20, 21]
    # the hybrid's real layers sit on attention layers, the real feature layers' outputs reach the new feature
    # layers [8, 22] through added layers only, and the last layer (it writes d*) is an added one
    hybrid = SIZES["2.8B-hybrid"]
    assert Inflation(src, hybrid).real_layers == [3, 7, 11, 19, 23, 27]
    assert hybrid.layer_ids()[1::2] == [8, 22] and hybrid.is_attention(hybrid.n_layers - 1)
    with pytest.raises(ValueError, match=r"rotary dimensions 32 must be 256 or 64"):
        Inflation(src, dataclasses.replace(hybrid, n_rot=32))
    with pytest.raises(ValueError, match=r"12 layers cannot hold the 6 real ones"):
        Inflation(src, dataclasses.replace(hybrid, n_layers=12))
    # a MoE's shared and routed experts together hold tinycode's 768-wide FFN
    with pytest.raises(ValueError, match=r"expert_ff 512 \+ shared_ff 128 must be >= 768"):
        Inflation(src, dataclasses.replace(SIZES["7B-hybrid-moe"], shared_ff=128))
    with pytest.raises(ValueError, match=r"expert_ff 512 \+ shared_ff 0 must be >= 768"):
        Inflation(src, dataclasses.replace(SIZES["4.5B-moe"], expert_ff=512))


@pytest.mark.parametrize("build", [inflated_moe, inflated_hybrid_moe], ids=["moe", "hybrid-moe"])
def test_every_moe_layer_routes_tokens_apart(build) -> None:  # type: ignore[no-untyped-def]
    """A verified block costs a MoE the experts its tokens pick, so the router must see each token's hidden
    state in every layer: an added layer with a zero FFN norm would send every token to the same experts.
    Token embeddings (hidden states as the first layer sees them) routed through each layer's FFN norm and
    router pick different experts for different tokens."""
    from gguf import GGUFReader

    size, pair = build()
    norm = "post_attention_norm" if size.hybrid else "ffn_norm"  # the norm before the FFN
    tensors = {
        t.name: np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        for t in GGUFReader(pair.targets["f16"]).tensors
        if t.name == "token_embd.weight" or norm in t.name or "ffn_gate_inp" in t.name
    }
    x = tensors["token_embd.weight"][np.random.default_rng(0).choice(REAL_VOCAB, 64, replace=False)]
    x = x / np.sqrt((x**2).mean(axis=1, keepdims=True))
    for i in range(size.n_layers):
        logits = (x * tensors[f"blk.{i}.{norm}.weight"]) @ tensors[f"blk.{i}.ffn_gate_inp.weight"].T
        picks = {tuple(sorted(row)) for row in np.argsort(-logits, axis=1)[:, : size.n_experts_used]}
        assert len(picks) >= 16, f"layer {i}: 64 tokens pick {len(picks)} expert sets"
