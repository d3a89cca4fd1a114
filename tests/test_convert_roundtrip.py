"""Round trips: tiny random DFlash1/DFlash2 checkpoints -> GGUF, for every output type.

Every GGUF tensor is compared with its source independently of the converter's
own read-back check, and libllama (llama-cpp-python 0.3.36) must load every
file as arch ``dflash``.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from factories import gguf_kv, gguf_tensors, make_checkpoint, make_target_gguf, round_to_bf16
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from dflash_convert import Options, convert

OUTTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q5_k_m", "q6_k"]

# the contract's table (shared/GGUF-DFLASH.md section 2), written out independently of the converter's
HF_TO_GGUF = [
    (r"fc\.weight", "fc.weight"),
    (r"hidden_norm\.weight", "enc.output_norm.weight"),
    (r"norm\.weight", "output_norm.weight"),
    (r"layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.weight", r"blk.\1.attn_q.weight"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.weight", r"blk.\1.attn_k.weight"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.weight", r"blk.\1.attn_v.weight"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"layers\.(\d+)\.self_attn\.q_norm\.weight", r"blk.\1.attn_q_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.k_norm\.weight", r"blk.\1.attn_k_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (r"layers\.(\d+)\.mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (r"layers\.(\d+)\.mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
    (r"layers\.(\d+)\.attention_conv\.base_kernel", r"blk.\1.attn_conv_base"),
    (r"layers\.(\d+)\.attention_conv\.kernel_projection\.weight", r"blk.\1.attn_conv_proj.weight"),
    (r"layers\.(\d+)\.mlp_conv\.base_kernel", r"blk.\1.ffn_conv_base"),
    (r"layers\.(\d+)\.mlp_conv\.kernel_projection\.weight", r"blk.\1.ffn_conv_proj.weight"),
    (r"candidate_selector\.predecessor_codebook", "selector_predecessor.weight"),
    (r"candidate_selector\.successor_codebook", "selector_successor.weight"),
    (r"candidate_selector\.hidden_projection\.weight", "selector_hidden.weight"),
    (r"embed_tokens\.weight", "token_embd.weight"),
    (r"lm_head\.weight", "output.weight"),
]


def gguf_name(hf: str) -> str:
    for pattern, repl in HF_TO_GGUF:
        if re.fullmatch(pattern, hf):
            return re.sub(pattern, repl, hf)
    raise AssertionError(f"no mapping for {hf}")


def stays_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith("_conv_base") or "norm" in name


# small target (hidden 64): K-quant rows fall back to 32-blocks; "wide" (hidden 256, the
# bundled tinycode target) makes libllama use real K-quant blocks
VARIANTS: dict[str, dict[str, Any]] = {
    "v1-bf16-single": dict(version=1, dtype="bf16", shards=1, prefix=""),
    "v1-f32-sharded-prefix": dict(version=1, dtype="f32", shards=2, prefix="model."),
    "v2-bf16-sharded-prefix": dict(version=2, dtype="bf16", shards=3, prefix="model."),
    "v2-f32-single": dict(version=2, dtype="f32", shards=1, prefix=""),
    "v2-f16-single-prefix": dict(version=2, dtype="f16", shards=1, prefix="model.", seed=3),
    "v2-bf16-wide": dict(
        version=2,
        dtype="bf16",
        hidden=256,
        n_layers=1,
        heads=4,
        kv_heads=2,
        head_dim=64,
        ff=512,
        vocab=2048,
        n_target_layers=6,
        target_layer_ids=(1, 3),
        rank=256,
        top_k=8,
        seed=7,
    ),
}


class Workspace:
    """Checkpoints, targets and converted files, made once per session."""

    def __init__(self, root: Path, tinycode: Path) -> None:
        self.root = root
        self.tinycode = tinycode
        self._sources: dict[str, dict[str, np.ndarray]] = {}
        self._outputs: dict[tuple[str, str], Path] = {}
        self._small_target: Path | None = None

    def target_for(self, variant: str) -> Path:
        if VARIANTS[variant].get("hidden") == 256:
            return self.tinycode / "target-f16.gguf"
        if self._small_target is None:
            self._small_target = self.root / "target-small.gguf"
            make_target_gguf(self._small_target)
        return self._small_target

    def source(self, variant: str) -> tuple[Path, dict[str, np.ndarray]]:
        path = self.root / variant
        if variant not in self._sources:
            self._sources[variant] = make_checkpoint(path, **VARIANTS[variant])
        return path, self._sources[variant]

    def output(self, variant: str, outtype: str) -> Path:
        key = (variant, outtype)
        if key not in self._outputs:
            path, _ = self.source(variant)
            out = self.root / f"{variant}-{outtype}.gguf"
            convert(
                Options(draft_dir=path, target=self.target_for(variant), outfile=out, outtype=outtype, progress=False)
            )
            self._outputs[key] = out
        return self._outputs[key]


@pytest.fixture(scope="session")
def ws(tmp_path_factory: pytest.TempPathFactory, tinycode: Path) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("convert-roundtrip"), tinycode)


# relative RMS error allowed per stored quantized type (random normal data)
REL_RMSE = {
    Q.Q8_0: 0.01,
    Q.Q6_K: 0.03,
    Q.Q5_K: 0.06,
    Q.Q5_0: 0.06,
    Q.Q5_1: 0.06,
    Q.Q4_K: 0.12,
    Q.Q4_0: 0.12,
    Q.Q4_1: 0.12,
    Q.Q3_K: 0.25,
    Q.Q2_K: 0.5,
}
KQUANT_MAIN = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K}
PLAIN = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q5_0": Q.Q5_0}


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip(ws: Workspace, variant: str, outtype: str) -> None:
    _, src = ws.source(variant)
    out = ws.output(variant, outtype)
    tensors = gguf_tensors(out)

    expected = {gguf_name(k): v for k, v in src.items()}
    assert set(tensors) == set(expected)

    seen_types = set()
    for name, want in expected.items():
        t = tensors[name]
        assert t.shape == want.shape, name  # ggml ne is the reverse of the torch shape: same bytes
        seen_types.add(t.type)
        if stays_f32(name, want.shape):
            assert t.type == Q.F32, f"{name} must stay F32, is {t.type.name}"
            np.testing.assert_array_equal(t.values, want, err_msg=name)
            continue
        rows2d = want.reshape(-1, want.shape[-1])
        if outtype in PLAIN:
            qtype = PLAIN[outtype]
            if want.shape[-1] % 32 != 0 and qtype not in (Q.F32, Q.F16, Q.BF16):
                qtype = Q.F16  # documented fallback for rows that are not whole blocks
            assert t.type == qtype, f"{name}: {t.type.name} != {qtype.name}"
            if qtype == Q.F32:
                np.testing.assert_array_equal(t.values, want, err_msg=name)
            elif qtype == Q.F16:
                np.testing.assert_array_equal(t.values, want.astype(np.float16).astype(np.float32), err_msg=name)
            elif qtype == Q.BF16:
                np.testing.assert_array_equal(t.values, round_to_bf16(want), err_msg=name)
            else:
                # gguf.quants is deterministic: the stored blocks must be exactly its quantization
                ref = quantize(rows2d, qtype).view(np.uint8).reshape(rows2d.shape[0], -1)
                np.testing.assert_array_equal(t.raw, ref, err_msg=name)
        else:
            # libllama's quantizer picks the per-tensor types of the mix; the values must be close
            assert t.type not in (Q.F32,), f"{name} was not quantized"
            err = np.linalg.norm(t.values - want) / np.linalg.norm(want)
            tol = REL_RMSE.get(t.type, 1e-3)
            assert err < tol, f"{name} ({t.type.name}): relative error {err:.4f} >= {tol}"
    if outtype in KQUANT_MAIN and VARIANTS[variant].get("hidden") == 256:
        assert KQUANT_MAIN[outtype] in seen_types, (
            f"no {KQUANT_MAIN[outtype].name} tensor in {sorted(t.name for t in seen_types)}"
        )


@pytest.mark.parametrize("variant", ["v1-bf16-single", "v2-bf16-sharded-prefix"])
def test_metadata(ws: Workspace, variant: str) -> None:
    out = ws.output(variant, "f16")
    kv = gguf_kv(out)
    cfg = VARIANTS[variant]
    target = gguf_kv(ws.target_for(variant))
    ids = list(cfg.get("target_layer_ids", (1, 2)))

    assert kv["general.architecture"][0] == "dflash"
    assert kv["dflash.target_layers"] == ([i + 1 for i in ids], "ARRAY", "INT32")
    assert kv["dflash.block_size"] == (8, "UINT32", None)
    assert kv["dflash.embedding_length"][0] == cfg.get("hidden", 64)
    assert kv["dflash.block_count"][0] == cfg.get("n_layers", 2)
    assert kv["dflash.attention.head_count"][0] == 4
    assert kv["dflash.attention.head_count_kv"][0] == 2
    assert kv["dflash.attention.key_length"][0] == 16
    assert kv["dflash.feed_forward_length"][0] == 128
    assert kv["dflash.context_length"][0] == 4096
    assert kv["dflash.rope.freq_base"] == (10000.0, "FLOAT32", None)
    assert kv["dflash.attention.layer_norm_rms_epsilon"][0] == pytest.approx(1e-6)
    assert kv["tokenizer.ggml.mask_token_id"] == (1, "UINT32", None)
    # every tokenizer key of the target, unchanged
    for key, value in target.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.mask_token_id":
            assert kv[key] == value, key
    dflash2_keys = (
        "dflash.conv_kernel_size",
        "dflash.conv_group_size",
        "dflash.selector_rank",
        "dflash.selector_top_k",
    )
    if cfg["version"] == 2:
        assert [kv[k] for k in dflash2_keys] == [
            (2, "UINT32", None),
            (16, "UINT32", None),
            (8, "UINT32", None),
            (4, "UINT32", None),
        ]
    else:
        assert not any(k in kv for k in dflash2_keys)


@pytest.fixture(scope="session")
def libllama() -> Any:
    llama_cpp = pytest.importorskip("llama_cpp")

    @llama_cpp.llama_log_callback
    def quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pass

    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    yield llama_cpp
    from llama_cpp import _logger

    llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    quiet  # noqa: B018 - keep the callback alive until the default is back


def load_with_libllama(llama_cpp: Any, path: Path) -> dict[str, Any]:
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"libllama could not load {path}"
    try:
        buf = ctypes.create_string_buffer(256)

        def meta(key: str) -> str:
            n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
            return buf.value.decode() if n >= 0 else ""

        vocab = llama_cpp.llama_model_get_vocab(model)
        return {
            "arch": meta("general.architecture"),
            "block_size": meta("dflash.block_size"),
            "n_embd": llama_cpp.llama_model_n_embd(model),
            "n_layer": llama_cpp.llama_model_n_layer(model),
            "n_vocab": llama_cpp.llama_vocab_n_tokens(vocab),
            "mask": llama_cpp.llama_vocab_mask(vocab) if hasattr(llama_cpp, "llama_vocab_mask") else 1,
        }
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("variant", ["v1-bf16-single", "v2-bf16-sharded-prefix", "v2-bf16-wide"])
def test_libllama_loads(ws: Workspace, libllama: Any, variant: str, outtype: str) -> None:
    info = load_with_libllama(libllama, ws.output(variant, outtype))
    cfg = VARIANTS[variant]
    assert info["arch"] == "dflash"
    assert info["block_size"] == "8"
    assert info["n_embd"] == cfg.get("hidden", 64)
    assert info["n_layer"] == cfg.get("n_layers", 2)
    assert info["n_vocab"] == cfg.get("vocab", 512)
    assert info["mask"] == 1


def test_bundled_drafter_converts_and_loads(tinycode: Path, tmp_path: Path, libllama: Any) -> None:
    for outtype in ("f16", "q4_k_m"):
        out = tmp_path / f"tinycode-{outtype}.gguf"
        convert(
            Options(
                draft_dir=tinycode / "drafter-dflash2",
                target=tinycode / "target-f16.gguf",
                outfile=out,
                outtype=outtype,
                progress=False,
            )
        )
        info = load_with_libllama(libllama, out)
        assert (info["arch"], info["n_embd"], info["n_layer"], info["n_vocab"]) == ("dflash", 256, 2, 2048)
        kv = gguf_kv(out)
        assert kv["dflash.target_layers"][0] == [2, 4]  # HF target_layer_ids [1, 3] + 1
        assert kv["dflash.selector_top_k"][0] == 8
