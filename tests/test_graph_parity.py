"""Our C++ draft graph (dflash_gguf.Drafter) against the PyTorch reference of the spec.

- Random DFlash 1 / DFlash 2 drafters (f32 weights), block sizes 4 / 8 / 16, drafting over
  an empty cache and over 5 and 37 injected context rows: every block row's logits agree
  to NMSE <= 1e-6, the same top-k candidates, selector scores within 1e-4, the same walk
  and the same per-row argmax.
  Also: 300 context rows (chunked injection), a drafter carrying the target head
  (--embed-target-head, no target GGUF).
- f16 / q8_0 weights: the logits NMSE against the f32 reference stays bounded.
- The bundled trained pair (examples/tinycode): features from the PyTorch target for the
  golden prompts, our Drafter walks the golden walk (f32, and still with f16 / q8_0 weights).
- Rollback: inject, draft, truncate, inject other rows == a fresh drafter fed the result.
- Counters: graphs are reserved once for the worst case, so no reallocation while
  drafting; one split on the CPU; one graph per draft step.

The drafters are converted with the converter's library entry point (what dflash-convert
runs) against a tiny random f32 Qwen3 target GGUF (vocab 512, hidden 64) that supplies
the token embedding and LM head; the reference uses the same f32 arrays.

DFLASH_TEST_DEVICE=<ggml device> runs it all on that device (CI: Vulkan0 on lavapipe, through
scripts/vulkan_check.sh), with the bounds of f16 arithmetic (see NMSE_F32 below).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from factories import DRAFTER_VARIANTS, make_checkpoint, make_target_gguf
from reference.dflash_ref import DraftOutput, DraftReference
from reference.qwen3_ref import Qwen3Reference

dflash_gguf = pytest.importorskip("dflash_gguf", reason="the dflash_gguf extension is not built")
from dflash_convert.convert import Options, convert  # noqa: E402

logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
torch.set_num_threads(1)

TINY = Path(__file__).resolve().parent.parent / "examples" / "tinycode"
# the ggml device under test: the CPU in CI; scripts/gpu_check.sh runs the same file with CUDA0
DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")

VOCAB, HIDDEN, N_TARGET_LAYERS = 512, 64, 4
BLOCKS = (2, 4, 8, 16, 32)  # the issue asks for 4/8/16; 2 and 32 are the format's limits
CONTEXTS = (0, 5, 37)

# Off the CPU, ggml's backends may multiply f32 tensors in lower precision (ggml-cuda in TF32, ggml-vulkan
# with f16 activations where the device has f16), so there the bounds are f16 arithmetic's: the f32 logits
# NMSE was at most 2.9e-4 on Vulkan (scripts/vulkan_check.sh), 1.6e-6 on CUDA; a wrong graph is far off
# (a misread position: 3e-3 to 0.95).
ON_CPU = DEVICE.lower() == "cpu"
NMSE_F32 = 1e-6 if ON_CPU else 1e-3  # on the CPU: the brief's bound for f32 weights
SCORE_TOL = 1e-4 if ON_CPU else 3e-2  # selector scores, relative to max(1, |score|) (Vulkan: up to 1.2e-2)
TIE = 1e-4 if ON_CPU else 1e-2  # logits closer than this times the largest |logit| may swap order


def assert_same_logits(got: Any, want: Any, atol: float) -> None:
    """Two runs of one graph function with different row counts: equal within `atol` on the CPU; elsewhere
    another row count may pick another matmul kernel (cuBLAS in TF32 on CUDA: 3.5e-3 apart at logits of
    ~1, 0.03 at ~5), so within f16 arithmetic's bound."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    if ON_CPU:
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    else:
        assert row_nmse(got, want).max() <= NMSE_F32


def assert_same_scores(got: Any, want: Any, atol: float) -> None:
    """Selector scores of two runs of one graph function: within `atol` on the CPU, elsewhere within
    SCORE_TOL (relative to max(1, |score|)) for the same reason as assert_same_logits."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    bound = atol if ON_CPU else SCORE_TOL * np.maximum(1.0, np.abs(want))
    assert np.all(np.abs(got - want) <= bound), float(np.abs(got - want).max())


def short_block_shapes(block: int) -> int:
    """The graph shapes short blocks of 1..block-1 drafted tokens use: exact rows on the CPU (it pays for
    every row), padded to 2, 3, 4, 6, 8, 12, 16 rows elsewhere."""
    if ON_CPU:
        return block - 1
    return len({min(next(r for r in (2, 3, 4, 6, 8, 12, 16, 24) if r >= n + 1), block) for n in range(1, block)})


# Quantized weights vs the f32 reference: bounds from measurement (the figures are printed).
# Random drafters, measured worst row NMSE: f16 2.4e-6 (v1) / 4.4e-5 (v2); q8_0 2.1e-3 (v1) /
# 1.8e-2 (v2; up to 3.9e-2 with other inputs).
# The random DFlash2 is ill-conditioned (its random dynamic conv amplifies errors): a reference
# fed the dequantized q8_0 weights is itself 2e-2 from the f32 one, and ggml's q8_0 matmul
# also quantizes the activations. The trained tinycode drafter is far better behaved
# (f16 ~1e-7, q8_0 ~1e-4 against our f32 run; see test_bundled_quantized).
NMSE_QUANT = {("f16", 1): 1e-5, ("f16", 2): 2e-4, ("q8_0", 1): 1e-2, ("q8_0", 2): 1e-1}
NMSE_BUNDLED = {"f16": 1e-6, "q8_0": 1e-3}

WORST: dict[str, float] = {}  # label -> worst NMSE seen, printed at the end of the module


def row_nmse(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """NMSE of every block row: [B]."""
    a64, b64 = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return ((a64 - b64) ** 2).sum(axis=1) / (b64**2).sum(axis=1)


def note(label: str, value: float) -> None:
    WORST[label] = max(WORST.get(label, 0.0), value)


@pytest.fixture(scope="module", autouse=True)
def _report() -> Any:
    yield
    if WORST:
        print("\nworst NMSE per configuration:")
        for k in sorted(WORST):
            print(f"  {k:40s} {WORST[k]:.3e}")


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graph_parity")


@pytest.fixture(scope="module")
def target(work: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = work / "target.gguf"
    tensors = make_target_gguf(path, vocab=VOCAB, hidden=HIDDEN, n_layers=N_TARGET_LAYERS, seed=11, dtype="f32")
    return path, tensors


class Case:
    """One random drafter: its HF dir, reference and converted GGUFs (made on demand)."""

    def __init__(
        self,
        work: Path,
        target: tuple[Path, dict[str, np.ndarray]],
        version: int,
        block: int,
        conv_kernel: int = 2,
        conv_group: int = 16,
        name: str = "",
        config_overrides: dict[str, Any] | None = None,
        dflash_overrides: dict[str, Any] | None = None,
    ):
        self.version, self.block = version, block
        self.dir = work / f"v{version}_b{block}" if conv_kernel == 2 else work / f"v{version}_b{block}_k{conv_kernel}"
        if name:
            self.dir = self.dir.with_name(f"{self.dir.name}_{name}")
        self.target_path, tt = target
        self.tensors = make_checkpoint(
            self.dir,
            version=version,
            hidden=HIDDEN,
            vocab=VOCAB,
            n_target_layers=N_TARGET_LAYERS,
            target_layer_ids=(1, 2),
            block_size=block,
            top_k=4,
            rank=8,
            dtype="f32",
            seed=100 + 10 * version + block,
            conv_kernel=conv_kernel,
            conv_group=conv_group,
            config_overrides=config_overrides,
            dflash_overrides=dflash_overrides,
        )
        self.config = json.loads((self.dir / "config.json").read_text())
        self.ref = DraftReference(self.config, self.tensors, tt["token_embd.weight"], tt["output.weight"])
        self.width = self.ref.target_hidden * len(self.ref.cfg.target_layer_ids)
        self._gguf: dict[tuple[str, bool], Path] = {}

    def gguf(self, outtype: str, embed_head: bool = False) -> Path:
        key = (outtype, embed_head)
        if key not in self._gguf:
            out = self.dir.parent / f"{self.dir.name}-{outtype}{'-head' if embed_head else ''}.gguf"
            convert(
                Options(
                    draft_dir=self.dir,
                    target=self.target_path,
                    outfile=out,
                    outtype=outtype,
                    embed_target_head=embed_head,
                    force=True,
                    progress=False,
                )
            )
            self._gguf[key] = out
        return self._gguf[key]

    def drafter(
        self,
        outtype: str = "f32",
        embed_head: bool = False,
        n_ctx: int = 256,
        n_threads: int = 1,
        kv_type: str = "f32",
        draft_vocab: list[int] | None = None,
        swa_full: bool = False,
    ) -> Any:
        """Our Drafter of this checkpoint; its cache in F32 unless asked (the reference's arithmetic)."""
        target = "" if embed_head else str(self.target_path)
        return dflash_gguf.Drafter(
            str(self.gguf(outtype, embed_head)),
            target,
            device=DEVICE,
            n_threads=n_threads,
            n_ctx=n_ctx,
            kv_type=kv_type,
            draft_vocab=draft_vocab or [],
            swa_full=swa_full,
        )


_CASES: dict[tuple[int, int], Case] = {}


@pytest.fixture(scope="module")
def case(work: Path, target: tuple[Path, dict[str, np.ndarray]]) -> Any:
    def get(version: int, block: int) -> Case:
        if (version, block) not in _CASES:
            _CASES[(version, block)] = Case(work, target, version, block)
        return _CASES[(version, block)]

    yield get
    _CASES.clear()


def features(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def run_both(c: Case, d: Any, n_ctx_rows: int, anchor: int, seed: int = 0) -> tuple[dict[str, Any], DraftOutput]:
    """Inject n_ctx_rows random feature rows at 0.. into both, draft at position n_ctx_rows."""
    feats = features(n_ctx_rows, c.width, seed)
    pos = np.arange(n_ctx_rows, dtype=np.int32)
    d.reset()
    if n_ctx_rows:
        d.inject(feats, pos)
    assert d.n_cached == n_ctx_rows
    cache = c.ref.inject(feats, pos.tolist())
    ours = d.draft(anchor, n_ctx_rows, details=True)
    ref = c.ref.draft(cache, anchor, n_ctx_rows)
    return ours, ref


# --------------------------------------------------------------------------- #
# comparisons
# --------------------------------------------------------------------------- #


def _margin(values: np.ndarray) -> float:
    """Gap between the best and second best value of a row."""
    s = np.sort(np.asarray(values, np.float64))[::-1]
    return float(s[0] - s[1]) if s.size > 1 else float("inf")


def check_f32_draft(
    c: Case, d: Any, version: int, n_ctx_rows: int, anchor: int, seed: int
) -> tuple[dict[str, Any], DraftOutput, float]:
    """One draft of ours and the reference's at f32: per-row logits NMSE within NMSE_F32, the same argmax
    and (DFlash 2) selector but where logits nearly tie. Returns both and the worst row's NMSE."""
    ours, ref = run_both(c, d, n_ctx_rows, anchor=anchor, seed=seed)
    logits = np.asarray(ours["logits"])
    assert logits.shape == tuple(ref.logits.shape)
    e = row_nmse(logits, ref.logits.numpy())
    assert e.max() <= NMSE_F32, f"ctx {n_ctx_rows}: per-row logits NMSE {e}"
    tie = TIE * float(np.abs(ref.logits.numpy()).max())
    check_argmax(ours, ref, tie)
    if version == 2:
        check_selector(ours, ref, tie)
    return ours, ref, float(e.max())


def check_argmax(ours: dict[str, Any], ref: DraftOutput, tie: float) -> None:
    logits = ref.logits.double().numpy()
    ref_argmax = logits.argmax(axis=1)  # rows 0..B-1 (ref.argmax covers rows 1..)
    assert np.array_equal(ref_argmax[1:], ref.argmax.numpy())
    got = np.asarray(ours["argmax"])
    for t in range(logits.shape[0]):
        if got[t] != ref_argmax[t]:
            assert _margin(logits[t]) < tie, f"row {t}: argmax {got[t]} != reference {ref_argmax[t]}"


def check_selector(ours: dict[str, Any], ref: DraftOutput, tie: float) -> None:
    """Candidates (same set; same order where the reference has no near-tie), scores, walk."""
    k = ref.candidates.shape[1]
    cand_ref = ref.candidates.numpy()
    cand = np.asarray(ours["candidates"])
    scores_ref = ref.scores.double().numpy()
    scores = np.asarray(ours["scores"], np.float64)
    logits_ref = ref.logits.double().numpy()
    anchor = int(ref.tokens[0])
    assert cand.shape == cand_ref.shape and scores.shape == scores_ref.shape
    rows_ok = []
    for t in range(cand_ref.shape[0]):
        row = np.sort(logits_ref[t + 1])[::-1]
        boundary_tie = row[k - 1] - row[k] < tie  # the k-th and (k+1)-th logits nearly equal
        internal_tie = np.any(np.diff(row[:k]) > -tie)
        if not boundary_tie:
            assert sorted(cand[t].tolist()) == sorted(cand_ref[t].tolist()), f"row {t + 1}: candidates differ"
        if not boundary_tie and not internal_tie:
            assert cand[t].tolist() == cand_ref[t].tolist(), f"row {t + 1}: candidate order differs"
        rows_ok.append(not boundary_tie)
    # scores keyed by (predecessor id, successor id), so that near-tie reorderings do not matter
    for t in range(cand_ref.shape[0]):
        if not rows_ok[t] or (t > 0 and not rows_ok[t - 1]):
            continue
        pred = [anchor] * k if t == 0 else cand[t - 1].tolist()
        pred_ref = [anchor] * k if t == 0 else cand_ref[t - 1].tolist()
        ref_map = {(pred_ref[i], int(cand_ref[t, j])): scores_ref[t, i, j] for i in range(k) for j in range(k)}
        for i in range(k):
            for j in range(k):
                want = ref_map[(pred[i], int(cand[t, j]))]
                got = scores[t, i, j]
                assert abs(got - want) <= SCORE_TOL * max(1.0, abs(want)), (
                    f"row {t + 1}: score({pred[i]}, {cand[t, j]}) = {got} vs reference {want}"
                )
    # the walk: identical until the first decision the reference itself nearly ties
    walk_ref = ref.walk.numpy()
    walk = np.asarray(ours["tokens"])
    assert len(walk) == len(walk_ref)
    prev = 0
    for t in range(len(walk_ref)):
        s = scores_ref[t, prev]
        if _margin(s) < tie:
            break
        assert walk[t] == walk_ref[t], f"walk row {t + 1}: {walk[t]} != reference {walk_ref[t]}"
        assert int(ours["walk_index"][t]) == int(ref.walk_index[t])
        prev = int(ref.walk_index[t])


# --------------------------------------------------------------------------- #
# f32 parity
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("version", (1, 2))
def test_f32_parity(case: Any, version: int, block: int) -> None:
    c: Case = case(version, block)
    d = c.drafter("f32")
    assert d.hparams["block_size"] == block and d.hparams["version"] == version
    worst = 0.0
    for i, n_ctx_rows in enumerate(CONTEXTS):
        ours, _, e = check_f32_draft(c, d, version, n_ctx_rows, anchor=7 + 31 * i, seed=1000 + i)
        worst = max(worst, e)
        if version == 2:
            q = np.asarray(ours["walk_q"])
            np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-5)
        else:
            assert "candidates" not in ours
            assert ours["tokens"] == np.asarray(ours["argmax"])[1:].tolist()  # DFlash 1: each row's argmax
    note(f"f32 v{version} B{block}", worst)
    print(f"f32 DFlash{version} B={block}: worst row NMSE {worst:.3e} over contexts {CONTEXTS}")


@pytest.mark.parametrize("embed_head", (False, True))
@pytest.mark.parametrize("version", (1, 2))
def test_drafting_vocabulary_parity(case: Any, version: int, embed_head: bool) -> None:
    """With a drafting vocabulary (half the tokens, in random order) the logits of its tokens are the
    reference's and the others -inf; the argmax and (DFlash 2) the candidates are the reference's best
    among the subset."""
    c: Case = case(version, 8)
    subset = [int(t) for t in np.random.default_rng(11).permutation(VOCAB)[: VOCAB // 2]]
    d = c.drafter("f32", embed_head=embed_head, draft_vocab=subset)
    assert d.draft_vocab_size == len(subset)
    ours, ref = run_both(c, d, 37, anchor=99, seed=7)  # the anchor may lie outside the subset
    outside = np.setdiff1d(np.arange(VOCAB), subset)
    logits = np.asarray(ours["logits"])
    assert np.isneginf(logits[:, outside]).all()
    e = row_nmse(logits[:, subset], ref.logits.numpy()[:, subset])
    assert e.max() <= NMSE_F32
    masked = ref.logits.double().numpy()
    masked[:, outside] = -np.inf
    tie = TIE * float(np.abs(ref.logits.numpy()).max())
    got = np.asarray(ours["argmax"])
    for t in range(masked.shape[0]):
        if got[t] != masked[t].argmax():
            assert _margin(masked[t][subset]) < tie, f"row {t}: argmax {got[t]} != {masked[t].argmax()}"
    if version == 2:
        cand = np.asarray(ours["candidates"])
        k = cand.shape[1]
        for t in range(cand.shape[0]):
            row = masked[t + 1]
            best = np.argsort(-row, kind="stable")[:k]
            top = np.sort(row[subset])[::-1]
            if top[k - 1] - top[k] >= tie:
                assert sorted(cand[t].tolist()) == sorted(best.tolist()), f"row {t + 1}: candidates differ"


@pytest.mark.parametrize("version", (1, 2))
def test_f16_cache_bounded(case: Any, version: int) -> None:
    """The default draft cache holds K/V in F16 (as llama.cpp's): bounded against the f32 reference, the same
    drafts but where logits nearly tie."""
    c: Case = case(version, 8)
    path = str(c.gguf("f32"))
    d = dflash_gguf.Drafter(path, str(c.target_path), device=DEVICE, n_threads=1, n_ctx=256)
    with pytest.raises(ValueError, match='kv_type must be "f16" or "f32", got "q8_0"'):
        dflash_gguf.Drafter(path, str(c.target_path), device=DEVICE, n_ctx=256, kv_type="q8_0")
    worst = 0.0
    for i, n_ctx_rows in enumerate(CONTEXTS):
        ours, ref = run_both(c, d, n_ctx_rows, anchor=7 + 31 * i, seed=1000 + i)
        e = row_nmse(np.asarray(ours["logits"]), ref.logits.numpy())
        worst = max(worst, float(e.max()))
        tie = 1e-2 * float(np.abs(ref.logits.numpy()).max())
        check_argmax(ours, ref, tie)
    note(f"f32 weights, f16 cache v{version} B8", worst)
    print(f"f32 weights, F16 cache, DFlash{version} B=8: worst row NMSE {worst:.3e}")
    assert 0.0 < worst <= 1e-4  # above 0: the cache is F16 (measured up to ~2e-6)


@pytest.mark.parametrize("version", (1, 2))
def test_long_context_parity(case: Any, version: int) -> None:
    """300 context rows: injection is chunked (256 rows per graph), the block sees all of them."""
    c: Case = case(version, 16)
    d = c.drafter("f32", n_ctx=512)
    ours, ref = run_both(c, d, 300, anchor=42, seed=300)
    e = float(row_nmse(np.asarray(ours["logits"]), ref.logits.numpy()).max())
    note(f"f32 v{version} B16 ctx300", e)
    print(f"f32 DFlash{version} B=16 over 300 context rows: worst row NMSE {e:.3e}")
    assert e <= NMSE_F32
    tie = TIE * float(np.abs(ref.logits.numpy()).max())
    check_argmax(ours, ref, tie)
    if version == 2:
        check_selector(ours, ref, tie)
    # n < B-1 drafts a prefix of the same block
    assert d.draft(42, 300, n=3) == list(ours["tokens"])[:3]


def test_embedded_head_parity(case: Any) -> None:
    """--embed-target-head: the drafter runs without a target GGUF, same numbers."""
    c: Case = case(2, 8)
    d = c.drafter("f32", embed_head=True)
    ours, ref = run_both(c, d, 37, anchor=99, seed=7)
    e = float(row_nmse(np.asarray(ours["logits"]), ref.logits.numpy()).max())
    note("f32 v2 B8 embedded head", e)
    print(f"f32 DFlash2 B=8 embedded target head: worst row NMSE {e:.3e}")
    assert e <= NMSE_F32
    check_selector(ours, ref, TIE * float(np.abs(ref.logits.numpy()).max()))


def without(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json as make_checkpoint writes it without the variant's overrides."""
    top = overrides.get("config_overrides", {})
    dflash = overrides.get("dflash_overrides", {})
    base = {k: v for k, v in config.items() if k not in top}
    base["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k not in dflash}
    return base


# factories.DRAFTER_VARIANTS: sliding windows shorter than the 37-row context, GELU MLPs
@pytest.mark.parametrize("version", (1, 2))
@pytest.mark.parametrize("variant", sorted(DRAFTER_VARIANTS))
def test_variant_parity(work: Path, target: tuple[Path, dict[str, np.ndarray]], variant: str, version: int) -> None:
    overrides, hparams = DRAFTER_VARIANTS[variant]
    c = Case(work, target, version, 8, name=variant, **overrides)
    d = c.drafter("f32", n_ctx=512)
    assert {k: d.hparams[k] for k in hparams} == hparams
    worst = 0.0
    for i, n_ctx_rows in enumerate(CONTEXTS):
        ours, _, e = check_f32_draft(c, d, version, n_ctx_rows, anchor=11 + 29 * i, seed=3000 + i)
        worst = max(worst, e)
    # the variant changes the numbers: the same weights without it draft other logits
    base = DraftReference(without(c.config, overrides), c.tensors, c.ref.embed, c.ref.lm_head)
    feats = features(37, c.width, 3000 + len(CONTEXTS) - 1)
    plain = base.draft(base.inject(feats, range(37)), 11 + 29 * (len(CONTEXTS) - 1), 37)
    apart = float(row_nmse(np.asarray(ours["logits"]), plain.logits.numpy()).max())
    assert apart > 1e-3
    if hparams.get("sliding_window"):
        # the sliding layers' rows are rings of 320 here (window + block + 256, rounded up to 64 rows): at
        # 450 rows of context they have wrapped
        assert d.ring_rows == 320
        _, _, e = check_f32_draft(c, d, version, 450, anchor=77, seed=3100)
        worst = max(worst, e)
        # with swa_full those layers keep every row and, past a window's length of context, attend to the
        # window's rows only: from (graph window - its unit - B - sliding_window + 2 = 238 or 245) rounded
        # down to 64 rows
        whole = c.drafter("f32", n_ctx=512, swa_full=True)
        assert whole.ring_rows == 0
        _, _, e = check_f32_draft(c, whole, version, 300, anchor=77, seed=3100)
        assert whole.counters["swa_first_last"] == 192, whole.counters
        worst = max(worst, e)
    note(f"f32 v{version} B8 {variant}", worst)
    print(f"f32 DFlash{version} B=8 {variant}: worst row NMSE {worst:.3e}; without it {apart:.3e}")


def check_ring_draft(c: Case, d: Any, n: int, context: np.ndarray, anchor: int) -> None:
    """d's draft at n cached rows is the reference's over context[:n] (which sees every row)."""
    ref = c.ref.draft(c.ref.inject(context[:n], list(range(n))), anchor, n)
    ours = d.draft(anchor, n, details=True)
    e = row_nmse(np.asarray(ours["logits"]), ref.logits.numpy())
    assert e.max() <= NMSE_F32, f"{n} rows: per-row logits NMSE {e}"
    check_argmax(ours, ref, TIE * float(np.abs(ref.logits.numpy()).max()))


@pytest.mark.parametrize("variant", ("swa_causal_layers", "swa_not_causal"))
def test_sliding_layers_rings(work: Path, target: tuple[Path, dict[str, np.ndarray]], variant: str) -> None:
    """The sliding layers' rings (320 rows here) against the reference holding every row, through what the
    loop does: a prompt injected in chunks, then steps whose accepted rows the next draft writes, across the
    rings' wrap; a rollback within their slack, new rows after it; one far deeper, after which drafting goes
    on and, once the window has only new rows, drafts the reference's again; the cache saved and loaded
    into another drafter. A sliding layer whose ring held the wrong position's row, or kept a row rolled
    back, would attend to other keys than the reference's. Memory: only the full layers hold every row."""
    overrides, _ = DRAFTER_VARIANTS[variant]
    c = Case(work, target, 2, 8, name=variant, **overrides)
    d = c.drafter("f32", n_ctx=1024)
    assert d.ring_rows == 320
    swa = d.hparams["sliding_window_layers"]
    width = d.hparams["n_head_kv"] * d.hparams["head_dim"]
    rows = sum(321 if s else 1025 for s in swa)
    assert d.cache_bytes - 2 * 4 * width * rows in range(0, 4096), (d.cache_bytes, rows)

    feats = features(800, c.width, 4000)

    def check(n: int, context: np.ndarray, anchor: int) -> None:
        check_ring_draft(c, d, n, context, anchor)

    d.inject(feats[:300], np.arange(300, dtype=np.int32))
    n = 300
    for step in range(9):  # accepted rows pending, written by the next draft: 300 .. 336, across 320
        d.inject(feats[n : n + 4], np.arange(n, n + 4, dtype=np.int32))
        n += 4
        check(n, feats, anchor=5 + step)
    d.truncate(250)  # 86 rows back: within the slack, the window keeps every row
    fresh = features(800, c.width, 4001)
    context = np.concatenate([feats[:250], fresh[250:]])
    d.inject(context[250:290], np.arange(250, 290, dtype=np.int32))
    check(290, context, anchor=17)

    d.inject(context[290:700], np.arange(290, 700, dtype=np.int32))
    check(700, context, anchor=19)
    saved, other = d.save_cache(), c.drafter("f32", n_ctx=1024)
    other.load_cache(saved, 700)
    assert other.n_cached == 700
    a, b = d.draft(23, 700, details=True), other.draft(23, 700, details=True)
    np.testing.assert_array_equal(np.asarray(a["logits"]), np.asarray(b["logits"]))
    with pytest.raises(dflash_gguf.DFlashError, match="saved draft cache has .* bytes"):
        other.load_cache(saved[:-4], 700)

    d.truncate(100)  # 600 back: the rings no longer hold the rows before 100
    d.inject(fresh[100:104], np.arange(100, 104, dtype=np.int32))
    assert np.isfinite(np.asarray(d.draft(29, 104, details=True)["logits"])).all()
    context = np.concatenate([context[:100], fresh[100:]])
    d.inject(context[104:160], np.arange(104, 160, dtype=np.int32))
    check(160, context, anchor=31)  # the window (12 rows) holds only rows written since


def test_sliding_layers_rings_restore_a_prompt(work: Path, target: tuple[Path, dict[str, np.ndarray]]) -> None:
    """A rollback to a prompt's end after a reply longer than the rings' slack (a regenerated reply): the copy
    keep_rings_at kept gives the rings their window back, so the first draft after it is the reference's; a
    copy whose rows were rolled back and written again with other rows is not put back."""
    c = Case(work, target, 2, 8, name="swa_causal_layers", **DRAFTER_VARIANTS["swa_causal_layers"][0])
    d = c.drafter("f32", n_ctx=1024)
    assert d.ring_rows == 320
    feats, fresh = features(800, c.width, 4010), features(800, c.width, 4011)

    d.inject(feats[:290], np.arange(290, dtype=np.int32))
    d.keep_rings_at(300)  # the prompt's end: kept once its rows are written
    d.inject(feats[290:700], np.arange(290, 700, dtype=np.int32))
    d.truncate(300)  # 400 back: the rings had written over 300's window
    assert d.counters["rings_restored"] == 1
    context = np.concatenate([feats[:300], fresh[300:]])
    d.inject(context[300:302], np.arange(300, 302, dtype=np.int32))
    check_ring_draft(c, d, 302, context, anchor=7)

    d.inject(context[302:700], np.arange(302, 700, dtype=np.int32))
    d.truncate(280)  # before the prompt's end: its copy holds the rows before 280 too
    assert d.counters["rings_restored"] == 2
    context = np.concatenate([feats[:280], fresh[280:]])
    d.inject(context[280:302], np.arange(280, 302, dtype=np.int32))
    check_ring_draft(c, d, 302, context, anchor=9)

    d.inject(context[302:700], np.arange(302, 700, dtype=np.int32))
    d.truncate(290)  # the copy's rows from 280 on are of the rows rolled back: it is not put back
    assert d.counters["rings_restored"] == 2


def test_sliding_layers_rings_restore_an_earlier_prompt(work: Path, target: tuple[Path, dict[str, np.ndarray]]) -> None:
    """A rollback to the end of the prompt two turns back (an edited earlier message): of the copies kept at
    the last three prompts' ends, the one reaching furthest back is put back; the latest alone (positions
    from 480 on) or the one before (from 180 on) would leave the window before 100 empty."""
    c = Case(work, target, 2, 8, name="swa_causal_layers", **DRAFTER_VARIANTS["swa_causal_layers"][0])
    d = c.drafter("f32", n_ctx=1024)
    feats, fresh = features(1000, c.width, 4020), features(1000, c.width, 4021)
    done = 0
    for end in (100, 500, 800, 1000):
        d.inject(feats[done:end], np.arange(done, end, dtype=np.int32))
        if end < 1000:  # a prompt's end; the last rows are a reply
            d.keep_rings_at(end)
        done = end
    d.truncate(100)
    assert d.counters["rings_restored"] == 1
    context = np.concatenate([feats[:100], fresh[100:]])
    d.inject(context[100:102], np.arange(100, 102, dtype=np.int32))
    check_ring_draft(c, d, 102, context, anchor=11)


# --------------------------------------------------------------------------- #
# quantized weights
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("outtype", ("f16", "q8_0"))
@pytest.mark.parametrize("version", (1, 2))
def test_quantized_bounded(case: Any, version: int, outtype: str) -> None:
    c: Case = case(version, 8)
    d = c.drafter(outtype)
    worst = 0.0
    agree = total = 0
    for i, n_ctx_rows in enumerate(CONTEXTS):
        ours, ref = run_both(c, d, n_ctx_rows, anchor=5 + 17 * i, seed=2000 + i)
        e = row_nmse(np.asarray(ours["logits"]), ref.logits.numpy())
        worst = max(worst, float(e.max()))
        agree += int((np.asarray(ours["argmax"])[1:] == ref.argmax.numpy()).sum())
        total += ref.argmax.numel()
    note(f"{outtype} v{version} B8", worst)
    print(f"{outtype} DFlash{version} B=8: worst row NMSE {worst:.3e}, argmax agreement {agree}/{total}")
    assert worst <= max(NMSE_QUANT[(outtype, version)], NMSE_F32)


# --------------------------------------------------------------------------- #
# the bundled trained pair
# --------------------------------------------------------------------------- #


GOLDEN = json.loads((TINY / "golden_dflash2.json").read_text())


@pytest.fixture(scope="module")
def tiny_gguf(work: Path) -> Any:
    made: dict[tuple[str, bool], Path] = {}

    def get(outtype: str, embed_head: bool = False) -> Path:
        if (outtype, embed_head) not in made:
            out = work / f"tinycode-drafter-{outtype}{'-head' if embed_head else ''}.gguf"
            convert(
                Options(
                    draft_dir=TINY / "drafter-dflash2",
                    target=TINY / "target-f16.gguf",
                    outfile=out,
                    outtype=outtype,
                    force=True,
                    progress=False,
                    embed_target_head=embed_head,
                )
            )
            made[outtype, embed_head] = out
        return made[outtype, embed_head]

    return get


@pytest.fixture(scope="module")
def golden_features() -> dict[str, np.ndarray]:
    """Per golden case: the PyTorch target's hidden_states[l + 1] for l in target_layer_ids, concatenated."""
    tl = GOLDEN["meta"]["target_layer_ids"]
    target = Qwen3Reference.from_hf_dir(TINY / "target")
    out = {}
    for c in GOLDEN["cases"]:
        hs = target.forward(c["prompt_ids"]).hidden_states
        out[c["prompt_id"]] = torch.cat([hs[i + 1] for i in tl], dim=-1).numpy().astype(np.float32)
    return out


def tiny_drafter(path: Path) -> Any:
    target = str(TINY / "target-f16.gguf")
    return dflash_gguf.Drafter(str(path), target, device=DEVICE, n_threads=1, n_ctx=512, kv_type="f32")


def draft_case(d: Any, c: dict[str, Any], feats: np.ndarray) -> dict[str, Any]:
    n = feats.shape[0]
    assert n == c["block_start"]
    d.reset()
    d.inject(feats, np.arange(n, dtype=np.int32))
    return d.draft(c["anchor"], n, details=True)


def test_bundled_golden_walk(tiny_gguf: Any, golden_features: dict[str, np.ndarray]) -> None:
    d = tiny_drafter(tiny_gguf("f32"))
    for c in GOLDEN["cases"]:
        out = draft_case(d, c, golden_features[c["prompt_id"]])
        walk = list(out["tokens"])
        print(f"{c['prompt_id']}: walk {walk} golden {c['walk']}")
        assert walk == c["walk"], c["prompt_id"]
        assert np.asarray(out["argmax"])[1:].tolist() == c["argmax"], c["prompt_id"]
        cand = np.asarray(out["candidates"])
        logits = np.asarray(out["logits"])
        for r in c["rows"]:
            t = r["row"]
            assert sorted(cand[t - 1].tolist()) == sorted(r["topk_ids"]), (c["prompt_id"], t)
            # f16 target head here vs the golden's bf16 head in f32
            np.testing.assert_allclose(logits[t, r["topk_ids"]], r["topk_logits"], atol=5e-3, rtol=1e-3)
            j = cand[t - 1].tolist().index(r["walk_choice"])
            assert int(out["walk_index"][t - 1]) == j


@pytest.mark.parametrize("outtype", ("f16", "q8_0"))
def test_bundled_quantized(tiny_gguf: Any, golden_features: dict[str, np.ndarray], outtype: str) -> None:
    """The trained drafter quantized: logits NMSE against our own f32 run, and still the golden walk."""
    d32 = tiny_drafter(tiny_gguf("f32"))
    dq = tiny_drafter(tiny_gguf(outtype))
    worst = 0.0
    for c in GOLDEN["cases"]:
        f = golden_features[c["prompt_id"]]
        want = draft_case(d32, c, f)
        got = draft_case(dq, c, f)
        worst = max(worst, float(row_nmse(np.asarray(got["logits"]), np.asarray(want["logits"])).max()))
        assert list(got["tokens"]) == c["walk"], (outtype, c["prompt_id"])
    note(f"tinycode {outtype} vs f32", worst)
    print(f"tinycode drafter {outtype} vs f32: worst row NMSE {worst:.3e}")
    assert worst <= max(NMSE_BUNDLED[outtype], NMSE_F32)


def skip_without_x86_repack() -> None:
    if DEVICE.lower() != "cpu":
        pytest.skip("repacked layouts are the CPU's")
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or "avx2" not in cpuinfo.read_text(errors="replace").split():
        pytest.skip("asserts ggml's x86 Q4_0 repack, which needs AVX2 (read from Linux's /proc/cpuinfo)")


def test_bundled_repacked(tiny_gguf: Any, golden_features: dict[str, np.ndarray]) -> None:
    """On the CPU a Q4_0 drafter's matmul weights go to ggml's repacked layout (AVX2 / ARM kernels):
    every one of them, the same draft as the plain layout; F16 weights have no such layout."""
    skip_without_x86_repack()
    path, target = str(tiny_gguf("q4_0")), str(TINY / "target-f16.gguf")
    packed = dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, kv_type="f32")
    plain = dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, repack=False, kv_type="f32")
    assert packed.repacked_weights == 1 + 9 * 2  # fc and, per layer, q k v o gate up down and both conv projections
    assert plain.repacked_weights == 0
    assert tiny_drafter(tiny_gguf("f16")).repacked_weights == 0
    for c in GOLDEN["cases"]:
        f = golden_features[c["prompt_id"]]
        a, b = draft_case(packed, c, f), draft_case(plain, c, f)
        assert a["tokens"] == b["tokens"], c["prompt_id"]
        assert np.array_equal(np.asarray(a["candidates"]), np.asarray(b["candidates"])), c["prompt_id"]
        assert float(row_nmse(np.asarray(a["logits"]), np.asarray(b["logits"])).max()) <= 1e-8


def assert_same_draft(a: dict[str, Any], b: dict[str, Any], k: int, where: Any) -> None:
    """Two short-block drafts of k tokens with details: the same tokens, candidates and logits."""
    assert a["tokens"] == b["tokens"], where
    assert np.array_equal(np.asarray(a["candidates"]), np.asarray(b["candidates"])), where
    assert np.asarray(a["logits"]).shape == np.asarray(b["logits"]).shape == (k, 2048), where
    assert float(row_nmse(np.asarray(a["logits"]), np.asarray(b["logits"])).max()) <= 1e-8, where


def profiled_drafts(path: str, target: str, ks: tuple[int, ...], **env: str) -> str:
    """DFLASH_PROFILE=1's per-op table (stderr) of a fresh CPU drafter's short-block drafts of each of ks
    tokens over 4 zero context rows, with env set: matmuls appear as 'MUL_MAT TYPE ROWSxCOLSxN'."""
    code = (
        "import sys, numpy as np, dflash_gguf\n"
        "d = dflash_gguf.Drafter(sys.argv[1], sys.argv[2], device='cpu', n_threads=1, n_ctx=64)\n"
        "d.inject(np.zeros((4, d.hparams['target_hidden'] * len(d.hparams['target_layers'])), np.float32), "
        "np.arange(4, dtype=np.int32))\n"
        f"for k in {ks!r}: d.draft(1, 4, k, short_block=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, path, target],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DFLASH_PROFILE": "1", **env},
    )
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_repacked_head_pads_left_over_rows(
    tiny_gguf: Any, golden_features: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ggml's repacked CPU kernels multiply 4 rows at a time and the rest one by one, each a pass over the
    whole LM head, so a repacked head's rows left over after multiples of 4 run padded to the next multiple
    from a count timed at load (head_pad_from; DFLASH_HEAD_PAD_FROM sets it): whatever it is, drafts of 1-7
    tokens are the plain layout's, and the profile shows the head's rows padded as it says."""
    skip_without_x86_repack()
    path, target = str(tiny_gguf("q4_0", embed_head=True)), str(TINY / "target-f16.gguf")
    plain = dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, repack=False, kv_type="f32")
    assert plain.head_pad_from == 4  # nothing to pad for
    timed = dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, kv_type="f32")
    assert timed.repacked_weights == 2 + 9 * 2  # the head too
    assert 1 <= timed.head_pad_from <= 4
    c = GOLDEN["cases"][0]
    f = golden_features[c["prompt_id"]]
    n = f.shape[0]
    plain.inject(f, np.arange(n, dtype=np.int32))
    want = [plain.draft(c["anchor"], n, k, details=True, all_rows=False, short_block=True) for k in range(1, 8)]
    for pad_from in (1, 2, 3):
        monkeypatch.setenv("DFLASH_HEAD_PAD_FROM", str(pad_from))
        packed = dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, kv_type="f32")
        assert packed.head_pad_from == pad_from
        packed.inject(f, np.arange(n, dtype=np.int32))
        for k, b in zip(range(1, 8), want):
            a = packed.draft(c["anchor"], n, k, details=True, all_rows=False, short_block=True)
            assert_same_draft(a, b, k, (pad_from, k))
    monkeypatch.delenv("DFLASH_HEAD_PAD_FROM")
    profile = profiled_drafts(path, target, (1, 2, 3, 5), DFLASH_HEAD_PAD_FROM="2")
    head = [line.split()[2] for line in profile.splitlines() if "x2048x" in line and "MUL_MAT q4_0" in line]
    assert sorted(head) == ["256x2048x1", "256x2048x4", "256x2048x5"], profile  # 2 and 3 rows both run as 4


def test_repacked_layers_pad_short_block_rows(
    tiny_gguf: Any, golden_features: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the layers' weights repacked, a short block's rows left over after multiples of 4 run padded
    to the next multiple from a count timed at load (block_pad_from; DFLASH_BLOCK_PAD_FROM sets it). The
    padding rows are masked out of attention and come after every real row, so drafts of 1-7 tokens, with
    pending context rows written by the block graph itself, are the plain layout's; the profile shows the
    layers' rows padded as it says."""
    skip_without_x86_repack()
    path, target = str(tiny_gguf("q4_0")), str(TINY / "target-f16.gguf")

    def drafter(repack: bool = True) -> Any:
        return dflash_gguf.Drafter(path, target, device="cpu", n_threads=1, n_ctx=512, repack=repack, kv_type="f32")

    c = GOLDEN["cases"][0]
    f = golden_features[c["prompt_id"]]
    n = f.shape[0]

    def drafts(d: Any) -> list[dict[str, Any]]:
        out = []
        for k in range(1, 8):
            d.truncate(n - 3)
            d.inject(f[n - 3 :], np.arange(n - 3, n, dtype=np.int32))  # 3 rows pending
            out.append(d.draft(c["anchor"], n, k, details=True, all_rows=False, short_block=True))
        return out

    plain = drafter(repack=False)
    assert plain.block_pad_from == 4  # nothing to pad for
    assert 1 <= drafter().block_pad_from <= 4
    plain.inject(f[: n - 3], np.arange(n - 3, dtype=np.int32))
    want = drafts(plain)
    for pad_from in (1, 2, 3):
        monkeypatch.setenv("DFLASH_BLOCK_PAD_FROM", str(pad_from))
        packed = drafter()
        assert packed.block_pad_from == pad_from
        packed.inject(f[: n - 3], np.arange(n - 3, dtype=np.int32))
        for k, (a, b) in enumerate(zip(drafts(packed), want), start=1):
            assert_same_draft(a, b, k, (pad_from, k))
    monkeypatch.delenv("DFLASH_BLOCK_PAD_FROM")
    profile = profiled_drafts(path, target, (1, 2, 5, 6), DFLASH_BLOCK_PAD_FROM="3")
    ffn_up = f"{plain.hparams['n_embd']}x{plain.hparams['n_ff']}x"
    rows = sorted(
        int(w.rsplit("x", 1)[1]) for line in profile.splitlines() for w in line.split() if w.startswith(ffn_up)
    )
    assert rows == [2, 4, 6, 8], profile  # drafts of 1, 2, 5, 6: 3 and 7 block rows run as 4 and 8


def test_repacking_prints_nothing(tiny_gguf: Any) -> None:
    """ggml logs each weight it repacks at debug level and its default logger prints every level: a
    Drafter opened without llama_cpp's logger must not fill stderr with them."""
    skip_without_x86_repack()
    code = (
        "import sys, dflash_gguf; d = dflash_gguf.Drafter(sys.argv[1], sys.argv[2], device='cpu', n_threads=1); "
        "print(d.repacked_weights)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_gguf("q4_0")), str(TINY / "target-f16.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 19
    assert "repack" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- #
# rollback and counters
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("version", (1, 2))
def test_head_rows_of_a_short_draft(case: Any, version: int) -> None:
    """A draft of n tokens runs the LM head and the selector only for block rows 1..h, h = n rounded up
    to a power of two (the costliest matmul at a real vocabulary): the same logits, candidates, scores
    and walk as the full block's rows; a length seen before reuses its graph."""
    c: Case = case(version, 8)
    d = c.drafter("f32")
    d.inject(features(37, c.width, 5), np.arange(37, dtype=np.int32))
    full = d.draft(11, 37, details=True)
    assert full["first_row"] == 0 and np.asarray(full["logits"]).shape[0] == 8
    for n, h in ((1, 1), (3, 4), (5, 7), (7, 7)):
        fast = d.draft(11, 37, n, details=True, all_rows=False)
        assert fast["first_row"] == 1
        logits = np.asarray(fast["logits"])
        assert logits.shape == (h, VOCAB)
        assert_same_logits(logits, np.asarray(full["logits"])[1 : h + 1], atol=1e-5)
        assert list(fast["argmax"]) == list(np.asarray(full["argmax"])[1 : h + 1])
        assert list(fast["tokens"]) == list(full["tokens"])[:n]
        assert d.draft(11, 37, n) == list(full["tokens"])[:n]  # the loop's path: tokens only
        if version == 2:
            assert np.array_equal(fast["candidates"], np.asarray(full["candidates"])[:h])
            assert_same_scores(fast["scores"], np.asarray(full["scores"])[:h], atol=1e-4)
            assert np.array_equal(fast["walk_index"], np.asarray(full["walk_index"])[:h])
    built = d.counters["graphs_built"]
    for n in (1, 3, 5, 7, 2, 4, 6):  # every bucket exists already: nothing is built
        d.draft(11, 37, n)
    assert d.counters["graphs_built"] == built + 1  # n = 2: the one bucket not drafted above
    allocs = d.counters["graph_allocs"]
    for n in (1, 7, 3, 2, 5, 1):  # each shape keeps its own allocation: alternating places nothing
        d.draft(11, 37, n)
    assert d.counters["graph_allocs"] == allocs
    assert d.counters["shapes"] == 5  # the full block and four head-row buckets
    # more shapes than are kept (the short blocks of 1..7 and the full block): the least recently used go,
    # and come back the same
    short = {n: d.draft(11, 37, n, short_block=True) for n in range(1, 8)}
    assert d.counters["shapes"] == short_block_shapes(8) + 1
    assert all(d.draft(11, 37, n, short_block=True) == short[n] for n in range(1, 8))


def test_every_draft_length_of_a_block_of_16_keeps_its_graph(case: Any) -> None:
    """A block of 16 has fifteen short-block shapes on the CPU (2..16 rows), seven elsewhere (2, 3, 4, 6, 8,
    12 and 16 rows): a loop or a bench going through every draft length builds each once (with one fewer
    kept, each pass would evict the shape it needs next, rebuilding and re-reserving a graph per step),
    and a shape evicted later keeps its thread
    count (a rebuilt shape that timed its steps again would alternate one and two threads, and some draft
    lengths would run far slower than the others)."""
    c = case(2, 16)
    d = c.drafter("f32", n_threads=2)
    d.inject(features(37, c.width, 5), np.arange(37, dtype=np.int32))
    for n in range(1, 16):
        d.draft(11, 37, n, short_block=True)
    built, held = d.counters["graphs_built"], d.counters["compute_bytes"]
    for n in range(1, 16):
        d.draft(11, 37, n, short_block=True)
    assert d.counters["graphs_built"] == built
    assert d.counters["shapes"] == short_block_shapes(16) + 1  # and the full block reserved at load
    assert d.counters["compute_bytes"] == held > 0
    if DEVICE.upper() != "CPU":
        return
    for _ in range(40):  # the one-row draft's graph times one and two threads until one is clearly faster
        d.draft(11, 37, 1, short_block=True)
        if d.counters["draft_threads"]:
            break
    chosen = d.counters["draft_threads"]
    assert chosen in (1, 2)
    for n in range(2, 16):
        d.draft(11, 37, n, short_block=True)
    for n in (1, 2, 3, 5, 9):  # five full-block head buckets: the least recently used shapes go, the 2-row one first
        d.draft(11, 37, n)
    built = d.counters["graphs_built"]
    d.draft(11, 37, 1, short_block=True)
    assert d.counters["graphs_built"] == built + 1  # rebuilt ...
    assert d.counters["draft_threads"] == chosen  # ... with the count it had settled on


@pytest.mark.parametrize("version", (1, 2))
def test_short_block_is_the_smaller_block(case: Any, version: int) -> None:
    """short_block (what the speculative loop drafts with, as llama.cpp's draft-dflash does) computes
    the block [anchor, MASK x n] only: exactly the reference's draft with block size n + 1 (the weights
    do not depend on the block size), which differs from the full block's first rows. Off the CPU its
    graph pads the rows up to 2, 3, 4, 6, 8, ... rows; the padding must not show."""
    c: Case = case(version, 8)
    d = c.drafter("f32")
    feats = features(37, c.width, 7)
    d.inject(feats, np.arange(37, dtype=np.int32))
    full = d.draft(13, 37, details=True)
    for n in (1, 2, 3, 4, 6):  # off the CPU 4 and 6 run in graphs of 6 and 8 rows: padding must change nothing
        # the last 4 rows arrive as a speculative step's do (pending: the block graph writes them itself,
        # or, when they outnumber the short block's rows as at n = 1, the inject graph first)
        d.truncate(33)
        d.inject(feats[33:], np.arange(33, 37, dtype=np.int32))
        cfg = json.loads(json.dumps(c.config))
        cfg["block_size"] = cfg["dflash_config"]["block_size"] = n + 1
        ref_small = DraftReference(cfg, c.tensors, c.ref.embed, c.ref.lm_head)
        ref = ref_small.draft(ref_small.inject(feats, list(range(37))), 13, 37)
        ours = d.draft(13, 37, n, details=True, all_rows=False, short_block=True)
        assert ours["first_row"] == 1
        logits = np.asarray(ours["logits"])
        assert logits.shape == (n, VOCAB)
        e = row_nmse(logits, ref.logits.numpy()[1:])
        assert e.max() <= NMSE_F32, f"n = {n}: per-row logits NMSE {e}"
        note(f"f32 v{version} short block", float(e.max()))
        tie = TIE * float(np.abs(ref.logits.numpy()).max())
        if version == 2:
            check_selector(ours, ref, tie)
        else:
            assert ours["tokens"] == ref.argmax.tolist()
        if not any(c.ref.cfg.causal_layers):
            gap = float(np.abs(logits - np.asarray(full["logits"])[1 : n + 1]).max())
            assert gap > 1e-3, f"n = {n}: the short block equals the full block's rows (gap {gap})"


def test_draft_threads_are_picked_and_change_nothing(case: Any) -> None:
    """On the CPU the first draft steps alternate between n_threads and one thread, then keep the
    faster; the draft itself does not depend on the thread count it ran with."""
    if DEVICE.lower() != "cpu":
        pytest.skip("the thread count is picked for the CPU device only")
    c: Case = case(2, 8)
    path = str(c.gguf("f32"))
    d = dflash_gguf.Drafter(path, str(c.target_path), device="cpu", n_threads=2, n_ctx=256)
    d.inject(features(37, c.width, 9), np.arange(37, dtype=np.int32))
    first = d.draft(5, 37, 3, details=True, all_rows=False, short_block=True)
    assert d.counters["draft_threads"] == 0  # still timing
    for _ in range(20):
        again = d.draft(5, 37, 3, details=True, all_rows=False, short_block=True)
        assert np.array_equal(np.asarray(again["logits"]), np.asarray(first["logits"]))
        assert again["tokens"] == first["tokens"]
    assert d.counters["draft_threads"] in (1, 2)
    one = dflash_gguf.Drafter(path, str(c.target_path), device="cpu", n_threads=1, n_ctx=256)
    one.inject(features(37, c.width, 9), np.arange(37, dtype=np.int32))
    assert one.draft(5, 37, 3, short_block=True) == first["tokens"]
    assert one.counters["draft_threads"] == 1


def test_cpu_conv_op_equals_the_portable_graph(
    case: Any, work: Path, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU each DFlash2 conv is one custom op (cpu_conv.h); DFLASH_PORTABLE_GRAPH=1 builds the
    graph other backends run. Both give the same floats, at any thread split, and a 3-tap conv with
    8-channel groups matches the reference too."""
    if DEVICE.lower() != "cpu":
        pytest.skip("the custom conv op is the CPU backend's")
    taps3 = Case(work, target, 2, 8, conv_kernel=3, conv_group=8)
    ours, ref = run_both(taps3, taps3.drafter("f32"), 37, anchor=11, seed=3)
    assert row_nmse(np.asarray(ours["logits"]), ref.logits.numpy()).max() <= NMSE_F32
    check_selector(ours, ref, TIE * float(np.abs(ref.logits.numpy()).max()))

    def drafts(c: Case, portable: bool, n_threads: int) -> list[dict[str, Any]]:
        if portable:
            monkeypatch.setenv("DFLASH_PORTABLE_GRAPH", "1")  # read when the Drafter is made
        d = dflash_gguf.Drafter(str(c.gguf("f32")), str(c.target_path), device="cpu", n_threads=n_threads, n_ctx=256)
        monkeypatch.delenv("DFLASH_PORTABLE_GRAPH", raising=False)
        d.inject(features(37, c.width, 9), np.arange(37, dtype=np.int32))
        out = [d.draft(5, 37, details=True)]  # every row of the block
        out += [d.draft(5, 37, n, details=True, all_rows=False, short_block=True) for n in (1, 3) if n < c.block]
        return out

    for c in (case(2, 2), case(2, 8), case(2, 32), taps3):
        want = drafts(c, True, 1)
        for n_threads in (1, 3):  # 3 threads split 4 (or 8) groups unevenly
            for got, w in zip(drafts(c, False, n_threads), want):
                for key in ("logits", "candidates", "scores", "walk_q"):
                    assert np.array_equal(np.asarray(got[key]), np.asarray(w[key])), (c.dir.name, n_threads, key)
                assert got["tokens"] == w["tokens"]


@pytest.mark.parametrize("version", (1, 2))
def test_rollback_equals_fresh(case: Any, version: int) -> None:
    c: Case = case(version, 8)
    a = features(20, c.width, 31)
    b = features(10, c.width, 32)
    d = c.drafter("f32")
    d.inject(a, np.arange(20, dtype=np.int32))
    first = d.draft(3, 20, details=True)
    d.truncate(10)
    assert d.n_cached == 10
    d.inject(b, np.arange(10, 20, dtype=np.int32))
    assert d.n_cached == 20
    rolled = d.draft(3, 20, details=True)

    fresh = c.drafter("f32")
    fresh.inject(np.concatenate([a[:10], b]), np.arange(20, dtype=np.int32))
    want = fresh.draft(3, 20, details=True)

    diff = float(np.abs(np.asarray(rolled["logits"]) - np.asarray(want["logits"])).max())
    changed = float(np.abs(np.asarray(first["logits"]) - np.asarray(want["logits"])).max())
    print(f"rollback DFlash{version}: logits max |rolled - fresh| = {diff:.3e} (vs before rollback {changed:.3e})")
    assert rolled["tokens"] == want["tokens"]
    assert np.array_equal(rolled["argmax"], want["argmax"])
    assert_same_logits(rolled["logits"], want["logits"], atol=1e-6)
    assert changed > 1e-3, "the new rows did not change the draft: the test proves nothing"
    if version == 2:
        assert np.array_equal(rolled["candidates"], want["candidates"])
        assert_same_scores(rolled["scores"], want["scores"], atol=1e-6)


def test_counters_reserved_once(case: Any) -> None:
    """Buffers are reserved once for the worst case; the block graph is built only when its attention
    window (whole units of cache rows) changes, and a draft step within the same window reuses it."""
    c: Case = case(2, 8)
    n_ctx = 600  # > one inject chunk (256 rows): chunked injection and a block over a nearly full cache
    d = c.drafter("f32", n_ctx=n_ctx)
    d.inject(features(3, c.width, 1), np.arange(3, dtype=np.int32))
    d.draft(1, 3)
    base = dict(d.counters)
    assert base["n_splits_last"] == 1, base
    per_step, windows = [], []
    n = 3
    for i, rows in enumerate((1, 7, 40, 300, 200, n_ctx - 8 - 551)):
        d.inject(features(rows, c.width, 50 + i), np.arange(n, n + rows, dtype=np.int32))
        n += rows
        before = d.counters["graphs_built"]
        d.draft(2 + i, n)
        per_step.append(d.counters["graphs_built"] - before)
        windows.append(d.counters["window_last"])
        assert n + 8 <= windows[-1] <= n_ctx
        assert d.counters["n_splits_last"] == 1
        before = d.counters["graphs_built"]
        d.draft(3 + i, n)  # the same window again: nothing is built
        assert d.counters["graphs_built"] == before
    assert d.n_cached == n_ctx - 8  # the block over the last free rows: the reserved worst case
    d.truncate(5)
    d.draft(9, 5, details=True)
    after = dict(d.counters)
    print(f"counters: warm-up {base}, after {after}; graphs built per draft step {per_step}, windows {windows}")
    assert after["sched_reallocs"] == base["sched_reallocs"], (base, after)
    assert after["n_splits_last"] == 1
    changed = [int(w != p) for p, w in zip([base["window_last"]] + windows, windows)]
    assert per_step == changed, (per_step, windows)
