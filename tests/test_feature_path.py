"""The off-by-one guard for target features.

`dflash.target_layers` = HF `target_layer_ids` + 1 are the layer ids whose *input* libllama
extracts (`llama_set_embeddings_layer_inp` / `llama_get_embeddings_layer_inp`). The input
of target layer j is HF `hidden_states[j]`, so for lid = target_layer_id + 1 libllama must
return HF `hidden_states[target_layer_id + 1]` — and clearly *not* `hidden_states[target_layer_id]`.
An off-by-one here raises no error and only costs acceptance; this test catches it.

Run against the bundled tinycode target (target-f16.gguf vs the bf16 safetensors in float32).
"""

from __future__ import annotations

import ctypes
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from reference.dflash_ref import DraftReference
from reference.qwen3_ref import Qwen3Reference

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
from llama_cpp import llama_cpp as llc  # noqa: E402  (the ctypes layer)

# llama-cpp-python routes libllama's log through this logger; without a level it prints
# every line of model loading and graph reservation
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

# The models are tiny: one thread is fastest, and on a shared 2-core box torch's default
# thread pool thrashes (a 90-token target forward: 30 ms with 1 thread, ~300 ms with 2 under load).
torch.set_num_threads(1)

TINY = Path(__file__).resolve().parent.parent / "examples" / "tinycode"
GOLDEN = json.loads((TINY / "golden_dflash2.json").read_text())
DRAFT_CFG = json.loads((TINY / "drafter-dflash2" / "config.json").read_text())
TARGET_LAYER_IDS: list[int] = DRAFT_CFG["dflash_config"]["target_layer_ids"]  # [1, 3]

# F16 GGUF weights vs bf16->f32 safetensors: measured ~1e-3 relative (see REL_* below).
REL_MATCH = 2e-3  # relative Frobenius error allowed for the right layer (measured 1.4e-4..1.7e-4)
REL_MISMATCH = 0.1  # the neighbouring layer must be at least this far off (measured 0.29..0.53)


# --------------------------------------------------------------------------- #
# the layer-input functions: C++ linkage in libllama, not in llama_cpp's bindings
# --------------------------------------------------------------------------- #

# Itanium C++ ABI names: P13llama_context = llama_context *, j = uint32_t, b = bool.
_SET_MANGLED = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_MANGLED = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"


def _lib_path() -> Path | None:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libllama.so", "libllama.dylib"):
        if (lib_dir / name).exists():
            return lib_dir / name
    return None


def _symbol(lib: ctypes.CDLL, plain: str, mangled: str) -> Any:
    for name in (plain, mangled):
        try:
            return getattr(lib, name)
        except AttributeError:
            pass
    # not the ABI we expected: look the name up in the dynamic symbol table
    path = _lib_path()
    if path is not None:
        try:
            syms = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
        except OSError:
            syms = ""
        for line in syms.splitlines():
            name = line.split()[-1]
            if plain in name:
                return getattr(lib, name)
    raise AttributeError(f"libllama exports no {plain} (tried {mangled})")


_lib = llc._lib
set_layer_inp = _symbol(_lib, "llama_set_embeddings_layer_inp", _SET_MANGLED)
set_layer_inp.argtypes = [llc.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool]
set_layer_inp.restype = None
get_layer_inp = _symbol(_lib, "llama_get_embeddings_layer_inp", _GET_MANGLED)
get_layer_inp.argtypes = [llc.llama_context_p_ctypes, ctypes.c_uint32]
get_layer_inp.restype = ctypes.POINTER(ctypes.c_float)


class Target:
    """A libllama context on target-f16.gguf with layer-input extraction for `lids`."""

    def __init__(self, model: Any, lids: list[int], n_batch: int, n_ctx: int = 256):
        cparams = llc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = 2
        cparams.n_threads_batch = 2
        self.ctx = llc.llama_init_from_model(model, cparams)
        assert self.ctx, "llama_init_from_model failed"
        self.n_embd = llc.llama_model_n_embd(model)
        self.n_batch = n_batch
        self.lids = list(lids)
        for lid in self.lids:
            set_layer_inp(self.ctx, lid, True)

    def close(self) -> None:
        if self.ctx:
            llc.llama_free(self.ctx)
            self.ctx = None

    def prefill(self, ids: list[int]) -> dict[int, np.ndarray]:
        """Decode `ids` from position 0 in n_batch chunks; return {lid: [n, n_embd]} features."""
        llc.llama_memory_clear(llc.llama_get_memory(self.ctx), True)
        feats: dict[int, list[np.ndarray]] = {lid: [] for lid in self.lids}
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            n = len(chunk)
            batch = llc.llama_batch_init(n, 0, 1)
            try:
                for i, tok in enumerate(chunk):
                    batch.token[i] = tok
                    batch.pos[i] = start + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1 if start + i == len(ids) - 1 else 0
                batch.n_tokens = n
                rc = llc.llama_decode(self.ctx, batch)
            finally:
                llc.llama_batch_free(batch)
            # llama_get_embeddings_layer_inp aborts the process after a failed decode: check first
            assert rc == 0, f"llama_decode returned {rc}"
            for lid in self.lids:
                ptr = get_layer_inp(self.ctx, lid)
                assert ptr, f"no layer-input buffer for lid {lid}"
                feats[lid].append(np.ctypeslib.as_array(ptr, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy())
        return {lid: np.concatenate(v) for lid, v in feats.items()}


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    llc.llama_backend_init()
    mparams = llc.llama_model_default_params()
    m = llc.llama_model_load_from_file(str(TINY / "target-f16.gguf").encode(), mparams)
    assert m, "could not load target-f16.gguf"
    yield m
    llc.llama_model_free(m)


@pytest.fixture(scope="module")
def n_layer(model: Any) -> int:
    return int(llc.llama_model_n_layer(model))


@pytest.fixture(scope="module")
def target_ref() -> Qwen3Reference:
    return Qwen3Reference.from_hf_dir(TINY / "target")


@pytest.fixture(scope="module")
def llama_feats(model: Any, n_layer: int) -> dict[str, dict[int, np.ndarray]]:
    """libllama layer inputs for every layer 0..n_layer-1, one whole-prompt decode per golden case."""
    t = Target(model, list(range(n_layer)), n_batch=128)
    try:
        return {c["prompt_id"]: t.prefill(c["prompt_ids"]) for c in GOLDEN["cases"]}
    finally:
        t.close()


@pytest.fixture(scope="module")
def hf_hidden(target_ref: Qwen3Reference) -> dict[str, tuple[torch.Tensor, ...]]:
    return {c["prompt_id"]: target_ref.forward(c["prompt_ids"]).hidden_states for c in GOLDEN["cases"]}


@pytest.fixture(scope="module")
def drafter() -> DraftReference:
    return DraftReference.from_hf_dir(TINY / "drafter-dflash2", TINY / "target")


def rel_err(a: np.ndarray, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole [n, n_embd] matrix."""
    bn = b.double().numpy()
    return float(np.linalg.norm(a.astype(np.float64) - bn) / np.linalg.norm(bn))


def max_rel_err(a: np.ndarray, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    bn = b.double().numpy()
    return float(np.abs(a.astype(np.float64) - bn).max() / np.abs(bn).max())


# --------------------------------------------------------------------------- #


def test_mangled_names_are_the_exported_ones() -> None:
    path = _lib_path()
    if path is None:
        pytest.skip("libllama not found next to llama_cpp (custom LLAMA_CPP_LIB_PATH build)")
    try:
        syms = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
    except OSError:
        pytest.skip("nm (binutils) is not available to list libllama's symbols")
    names = {line.split()[-1] for line in syms.splitlines() if "layer_inp" in line}
    assert {_SET_MANGLED, _GET_MANGLED} <= names, names


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt_id"])
def test_target_layer_features_are_hf_hidden_states_id_plus_one(
    case: dict[str, Any], llama_feats: Any, hf_hidden: Any
) -> None:
    feats, hs = llama_feats[case["prompt_id"]], hf_hidden[case["prompt_id"]]
    n = len(case["prompt_ids"])
    for tid in TARGET_LAYER_IDS:
        lid = tid + 1  # dflash.target_layers
        got = feats[lid]
        assert got.shape == (n, hs[0].shape[1])
        right = rel_err(got, hs[tid + 1])
        wrong_below = rel_err(got, hs[tid])
        wrong_above = rel_err(got, hs[tid + 2])
        max_rel = max_rel_err(got, hs[tid + 1])
        print(
            f"{case['prompt_id']} lid={lid}: rel vs hs[{tid + 1}] {right:.2e} (max-rel {max_rel:.2e}), "
            f"vs hs[{tid}] {wrong_below:.3f}, vs hs[{tid + 2}] {wrong_above:.3f}"
        )
        assert right < REL_MATCH, (lid, right)
        assert max_rel < 2 * REL_MATCH, (lid, max_rel)
        # the off-by-one guard: the neighbouring hidden states are far away
        assert wrong_below > REL_MISMATCH and wrong_above > REL_MISMATCH, (lid, wrong_below, wrong_above)


def test_every_layer_input_is_hidden_states_lid(llama_feats: Any, hf_hidden: Any, n_layer: int) -> None:
    """lid 0 = the token embeddings, lid j = the output of layer j-1 (HF hidden_states[j]), all j < n_layer."""
    case = GOLDEN["cases"][0]
    feats, hs = llama_feats[case["prompt_id"]], hf_hidden[case["prompt_id"]]
    for lid in range(n_layer):
        errs = [rel_err(feats[lid], hs[j]) for j in range(n_layer)]
        assert int(np.argmin(errs)) == lid, (lid, errs)
        assert errs[lid] < REL_MATCH, (lid, errs)


def test_chunked_prefill_gives_the_same_features(model: Any, llama_feats: Any) -> None:
    """A prompt decoded in n_batch = 32 chunks yields the rows in order, same as one decode."""
    lids = [i + 1 for i in TARGET_LAYER_IDS]
    t = Target(model, lids, n_batch=32)
    try:
        case = GOLDEN["cases"][1]
        chunked = t.prefill(case["prompt_ids"])
    finally:
        t.close()
    for lid in lids:
        whole = llama_feats[case["prompt_id"]][lid]
        assert chunked[lid].shape == whole.shape
        # same weights, different batch split: agreement to f32 accumulation-order noise
        assert np.abs(chunked[lid] - whole).max() <= 1e-3 * np.abs(whole).max(), lid


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt_id"])
def test_libllama_features_drive_the_reference_to_the_golden_draft(
    case: dict[str, Any], llama_feats: Any, drafter: DraftReference
) -> None:
    """End to end: libllama's layer inputs for dflash.target_layers, injected into the reference
    drafter, give the golden's draft (the path the C++ speculator takes)."""
    ref = drafter
    feats = np.concatenate([llama_feats[case["prompt_id"]][i + 1] for i in TARGET_LAYER_IDS], axis=1)
    n = len(case["prompt_ids"])
    out = ref.draft(ref.inject(feats, range(n)), case["anchor"], n)
    assert out.walk.tolist() == case["walk"]
    assert out.argmax.tolist() == case["argmax"]
    err = max((out.cand_logits[r["row"] - 1] - torch.tensor(r["topk_logits"])).abs().max().item() for r in case["rows"])
    print(case["prompt_id"], "top-k logit max abs err with libllama features:", err)
    assert err < 0.05
