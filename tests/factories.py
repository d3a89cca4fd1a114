"""Tiny random DFlash / DFlash2 checkpoints and tiny random Qwen3 target GGUFs, for tests.

Shared by the converter tests, the C++ loader tests and the numerics reference.

    from factories import make_checkpoint, make_target_gguf

    target = make_target_gguf(tmp / "target.gguf")                 # vocab 512, hidden 64, 4 layers
    src = make_checkpoint(tmp / "drafter", version=2)              # matches that target by default
    # src: {hf_key (no "model." prefix): float32 array exactly as stored (after bf16/f16 rounding)}

A drafter runs on its target's token embedding and LM head, so its
``hidden`` must equal the target's hidden size (upstream llama.cpp also sizes
fc's input as n_target_layers x drafter hidden). DFlash2 also needs
``hidden % conv_group == 0`` and ``hidden >= top_k * (top_k + 1)``.
The bundled tinycode target (examples/tinycode/target-f16.gguf) has vocab
2048, hidden 256, 6 layers: use ``make_checkpoint(..., hidden=256, vocab=2048,
n_target_layers=6, target_layer_ids=(1, 3))`` for a drafter that fits it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pytest

DTYPES = ("bf16", "f16", "f32")

# make_checkpoint overrides for drafter configurations the published checkpoints use beyond the default
# (on its 2 layers), each with the hparams our loader must report for it. Causality follows z-lab's
# reference: config.is_causal if set, else sliding_attention layers are causal, full_attention layers not.
S, F = "sliding_attention", "full_attention"
DRAFTER_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # z-lab's Qwen3.5 / 3.6 drafters: every layer but the last slides and is causal (no is_causal key)
    "swa_causal_layers": (
        {"config_overrides": {"use_sliding_window": True, "sliding_window": 12, "layer_types": [S, F]}},
        {"sliding_window": 12, "sliding_window_layers": [True, False], "causal": False, "causal_layers": [True, False]},
    ),
    # the DFlash 2 release: every layer slides, is_causal false
    "swa_not_causal": (
        {
            "config_overrides": {
                "use_sliding_window": True,
                "sliding_window": 12,
                "layer_types": [S, S],
                "is_causal": False,
            }
        },
        {"sliding_window": 12, "sliding_window_layers": [True, True], "causal": False, "causal_layers": []},
    ),
    # ModelOpt's exports: every layer slides (dflash_config.use_swa); a window narrower than the block, which
    # hides block rows from each other both ways
    "swa_use_swa": (
        {"dflash_overrides": {"use_swa": True, "swa_window_size": 5}},
        {"sliding_window": 5, "sliding_window_layers": [True, True], "causal": False},
    ),
    # sliding_attention layer types without use_sliding_window: no window (transformers drops it), all causal
    "causal": ({"config_overrides": {"layer_types": [S, S]}}, {"sliding_window": 0, "causal": True}),
    # GELU MLPs (HF hidden_act), exact and tanh-approximated
    "gelu": ({"config_overrides": {"hidden_act": "gelu"}}, {"hidden_activation": "gelu"}),
    "gelu_pytorch_tanh": (
        {"config_overrides": {"hidden_act": "gelu_pytorch_tanh"}},
        {"hidden_activation": "gelu_pytorch_tanh"},
    ),
}


# ----------------------------------------------------------------------------
# numeric helpers
# ----------------------------------------------------------------------------


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (round half to even), returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return round_to_bf16(x)
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "f32":
        return x.astype(np.float32)
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


# ----------------------------------------------------------------------------
# DFlash checkpoints
# ----------------------------------------------------------------------------


def checkpoint_shapes(
    *,
    version: int,
    hidden: int,
    n_layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ff: int,
    vocab: int,
    n_target_layers_used: int,
    target_hidden: int,
    rank: int,
    conv_kernel: int,
    conv_group: int,
) -> dict[str, tuple[int, ...]]:
    """HF key (no prefix) -> torch shape, as in shared/GGUF-DFLASH.md section 2."""
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, n_target_layers_used * target_hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    if version == 2:
        shapes["candidate_selector.predecessor_codebook"] = (vocab, rank)
        shapes["candidate_selector.successor_codebook"] = (vocab, rank)
        shapes["candidate_selector.hidden_projection.weight"] = (rank, hidden)
    groups = hidden // conv_group if conv_group else 0
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (ff, hidden),
                p + "mlp.up_proj.weight": (ff, hidden),
                p + "mlp.down_proj.weight": (hidden, ff),
            }
        )
        if version == 2:
            shapes.update(
                {
                    p + "attention_conv.base_kernel": (2, conv_kernel, hidden),
                    p + "attention_conv.kernel_projection.weight": (2 * conv_kernel * groups, hidden),
                    p + "mlp_conv.base_kernel": (2, conv_kernel, hidden),
                    p + "mlp_conv.kernel_projection.weight": (2 * conv_kernel * groups, hidden),
                }
            )
    return shapes


def _random_tensor(rng: np.random.Generator, key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if key.endswith("base_kernel"):
        base = np.zeros(shape, np.float32)
        base[:, 0, :] = 1.0  # identity-like init, as the real drafter
        return base + 0.05 * rng.standard_normal(shape).astype(np.float32)
    if "codebook" in key:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    scale = 1.0 / np.sqrt(shape[-1])
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def make_checkpoint(
    path: Path | str,
    *,
    version: int = 2,
    hidden: int = 64,
    n_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ff: int = 128,
    vocab: int = 512,
    n_target_layers: int = 4,
    target_layer_ids: Sequence[int] | None = (1, 2),
    target_hidden: int | None = None,
    block_size: int = 8,
    top_k: int = 4,
    rank: int = 8,
    conv_kernel: int = 2,
    conv_group: int = 16,
    mask_token_id: int = 1,
    dtype: str = "bf16",
    shards: int = 1,
    prefix: str = "",
    seed: int = 0,
    extra: Mapping[str, np.ndarray | None] | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    dflash_overrides: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write a random DFlash (version=1) or DFlash2 (version=2) drafter directory at ``path``.

    Writes ``config.json`` and ``model.safetensors`` (``shards == 1``) or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    (``shards > 1``), with every key prefixed by ``prefix`` ("" or "model.").

    Arguments:
        target_layer_ids: written to dflash_config; None leaves them out (the
            converter then derives them from num_target_layers and n_layers).
        target_hidden: the target's hidden size, for fc's input width
            (len(target_layer_ids) x target_hidden); defaults to ``hidden``.
        dtype: "bf16", "f16" or "f32" storage.
        extra: tensors added (or replacing a generated one) by HF key without
            prefix; a value of None drops that key.
        config_overrides / dflash_overrides: merged into config.json /
            its dflash_config; a value of None removes the key.

    Returns {HF key without prefix: float32 array}: the values exactly as
    stored (after bf16/f16 rounding), in torch shape order.
    """
    import torch  # the safetensors writer for bf16 needs torch tensors
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    n_used = len(target_layer_ids) if target_layer_ids is not None else _derived_count(n_target_layers, n_layers)
    shapes = checkpoint_shapes(
        version=version,
        hidden=hidden,
        n_layers=n_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ff=ff,
        vocab=vocab,
        n_target_layers_used=n_used,
        target_hidden=target_hidden if target_hidden is not None else hidden,
        rank=rank,
        conv_kernel=conv_kernel,
        conv_group=conv_group,
    )
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {k: round_to(_random_tensor(rng, k, s), dtype) for k, s in shapes.items()}
    for k, v in (extra or {}).items():
        if v is None:
            tensors.pop(k, None)
        else:
            tensors[k] = round_to(np.asarray(v, dtype=np.float32), dtype)

    dflash_config: dict[str, Any] = {"block_size": block_size, "mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    if version == 2:
        dflash_config.update(
            {
                "conv_kernel_size": conv_kernel,
                "conv_group_size": conv_group,
                "selector_rank": rank,
                "selector_top_k": top_k,
            }
        )
    _merge(dflash_config, dflash_overrides)
    config: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": ff,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "num_target_layers": n_target_layers,
        "block_size": block_size,
        "dflash_config": dflash_config,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype],
    }
    _merge(config, config_overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2))

    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    stored = {prefix + k: torch.from_numpy(v.copy()).to(torch_dtype).contiguous() for k, v in tensors.items()}
    keys = list(stored)
    if shards <= 1:
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        parts = [keys[i::shards] for i in range(shards)]
        weight_map: dict[str, str] = {}
        total = 0
        for i, part in enumerate(parts):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: stored[k] for k in part}, str(path / name), metadata={"format": "pt"})
            for k in part:
                weight_map[k] = name
                total += stored[k].numel() * stored[k].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return tensors


def _derived_count(n_target_layers: int, n_layers: int) -> int:
    return 1 if n_layers == 1 else n_layers


def _merge(dst: dict[str, Any], overrides: Mapping[str, Any] | None) -> None:
    for k, v in (overrides or {}).items():
        if v is None:
            dst.pop(k, None)
        else:
            dst[k] = v


# ----------------------------------------------------------------------------
# tiny Qwen3 target GGUF
# ----------------------------------------------------------------------------


def make_target_gguf(
    path: Path | str,
    *,
    vocab: int = 512,
    hidden: int = 64,
    n_layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ff: int = 128,
    context_length: int = 4096,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: str = "f32",
    tied_embeddings: bool = False,
) -> dict[str, np.ndarray]:
    """Write a tiny random Qwen3 target GGUF (arch ``qwen3``) that libllama loads and runs.

    Tokenizer: GPT-2 byte-level BPE (``tokenizer.ggml.model = "gpt2"``,
    ``tokenizer.ggml.pre = "gpt-2"``), ids 0 (<|endoftext|>, bos = eos = pad)
    and 1 (<|mask|>) CONTROL, then the 256 byte tokens and 2-letter merges.
    ``dtype`` "f32" or "f16" for the 2-D weights (norms stay F32).
    Returns {GGUF tensor name: float32 array (torch order)} as stored.
    """
    from gguf import GGMLQuantizationType, GGUFWriter

    from dflash_gguf.bench.synthetic import add_qwen3_header

    path = Path(path)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3")
    add_qwen3_header(
        w,
        name="tiny random qwen3 target",
        hidden=hidden,
        n_layers=n_layers,
        ff=ff,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        vocab=vocab,
        context_length=context_length,
        file_type=1 if dtype == "f16" else 0,
    )

    def mat(shape: tuple[int, ...]) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out: dict[str, np.ndarray] = {"token_embd.weight": mat((vocab, hidden))}
    for i in range(n_layers):
        p = f"blk.{i}."
        out.update(
            {
                p + "attn_norm.weight": norm(hidden),
                p + "attn_q.weight": mat((heads * head_dim, hidden)),
                p + "attn_k.weight": mat((kv_heads * head_dim, hidden)),
                p + "attn_v.weight": mat((kv_heads * head_dim, hidden)),
                p + "attn_output.weight": mat((hidden, heads * head_dim)),
                p + "attn_q_norm.weight": norm(head_dim),
                p + "attn_k_norm.weight": norm(head_dim),
                p + "ffn_norm.weight": norm(hidden),
                p + "ffn_gate.weight": mat((ff, hidden)),
                p + "ffn_up.weight": mat((ff, hidden)),
                p + "ffn_down.weight": mat((hidden, ff)),
            }
        )
    out["output_norm.weight"] = norm(hidden)
    if not tied_embeddings:
        out["output.weight"] = mat((vocab, hidden))

    stored: dict[str, np.ndarray] = {}
    for name, arr in out.items():
        if dtype == "f16" and arr.ndim == 2:
            w.add_tensor(name, arr.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
            stored[name] = arr.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, arr)
            stored[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# ----------------------------------------------------------------------------
# reading a GGUF back (independently of the converter's own read-back check)
# ----------------------------------------------------------------------------


class GGUFTensor:
    """One tensor of a GGUF file: type name, torch-order shape, stored bytes, float32 values."""

    def __init__(self, t: Any) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        self.type = GGMLQuantizationType(t.tensor_type)
        self.shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        data = np.array(t.data)  # copy out of the memmap
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        self.raw = data.view(np.uint8).reshape(rows, -1)
        if self.type.name in ("F32", "F16"):
            self.values = data.astype(np.float32).reshape(self.shape)
        else:
            self.values = dequantize(self.raw, self.type).astype(np.float32).reshape(self.shape)


def gguf_tensors(path: Path | str) -> dict[str, GGUFTensor]:
    from gguf import GGUFReader

    reader = GGUFReader(Path(path), "r")
    return {t.name: GGUFTensor(t) for t in reader.tensors}


def gguf_kv(path: Path | str) -> dict[str, tuple[Any, str, str | None]]:
    """{key: (value, type name, array element type name or None)}; strings as str, arrays as lists."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(Path(path), "r")
    out: dict[str, tuple[Any, str, str | None]] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
        out[key] = (f.contents(), vtype.name, sub.name if sub is not None else None)
    return out


def run_convert_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Runs dflash-convert in process; (exit code, stdout, stderr)."""
    import pytest

    from dflash_convert import cli

    with pytest.raises(SystemExit) as exc:
        cli.main.main(args=args, prog_name="dflash-convert")
    captured = capsys.readouterr()
    code = exc.value.code
    return (0 if code is None else int(code)), captured.out, captured.err
