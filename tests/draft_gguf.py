"""A tiny, complete drafter GGUF (arch "dflash") written straight with gguf-py.

Used by the loader and `dflash info` tests. Independent of the converter, so a
converter bug cannot hide a loader bug (and vice versa). Follows
shared/GGUF-DFLASH.md sections 2-3:

    from draft_gguf import write_draft_gguf, typed
    tensors = write_draft_gguf(tmp / "d.gguf", version=2)          # valid DFlash2
    write_draft_gguf(p, key_overrides={"dflash.block_size": 0})    # same GGUF type (u32), new value
    write_draft_gguf(p, key_overrides={"dflash.block_size": typed(GGUFValueType.STRING, "8")})
    write_draft_gguf(p, drop_keys=["dflash.target_layers"], drop_tensors=["fc.weight"])
    write_draft_gguf(p, tensor_overrides={"output_norm.weight": np.ones(64, np.float16)})

numpy shapes are torch shapes: ggml's ne is the reverse (fc.weight numpy
(n_embd, n_tl * target_hidden) is ggml ne {n_tl * target_hidden, n_embd}).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFValueType, GGUFWriter

ARCH = "dflash"

__all__ = ["ARCH", "GGUFValueType", "Typed", "typed", "draft_tensor_shapes", "write_draft_gguf"]


class Typed(NamedTuple):
    """A metadata value with an explicit GGUF type (sub_type: element type of an array)."""

    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


def typed(vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None = None) -> Typed:
    return Typed(vtype, value, sub_type)


_INT_TYPES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


def draft_tensor_shapes(
    *,
    version: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    target_hidden: int,
    n_target_layers: int,
    rank: int,
    conv_kernel: int,
    conv_group: int,
) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy (= torch) shape, section 2 of the contract."""
    E = n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (E, n_target_layers * target_hidden),
        "enc.output_norm.weight": (E,),
    }
    n_groups = E // conv_group if conv_group else 0
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (E,)
        shapes[p + "attn_q.weight"] = (n_head * head_dim, E)
        shapes[p + "attn_k.weight"] = (n_head_kv * head_dim, E)
        shapes[p + "attn_v.weight"] = (n_head_kv * head_dim, E)
        shapes[p + "attn_output.weight"] = (E, n_head * head_dim)
        shapes[p + "attn_q_norm.weight"] = (head_dim,)
        shapes[p + "attn_k_norm.weight"] = (head_dim,)
        shapes[p + "ffn_norm.weight"] = (E,)
        shapes[p + "ffn_gate.weight"] = (n_ff, E)
        shapes[p + "ffn_up.weight"] = (n_ff, E)
        shapes[p + "ffn_down.weight"] = (E, n_ff)
        if version == 2:
            shapes[p + "attn_conv_base"] = (2, conv_kernel, E)
            shapes[p + "attn_conv_proj.weight"] = (2 * conv_kernel * n_groups, E)
            shapes[p + "ffn_conv_base"] = (2, conv_kernel, E)
            shapes[p + "ffn_conv_proj.weight"] = (2 * conv_kernel * n_groups, E)
    if version == 2:
        shapes["selector_predecessor.weight"] = (n_vocab, rank)
        shapes["selector_successor.weight"] = (n_vocab, rank)
        shapes["selector_hidden.weight"] = (rank, E)
    # last, so the file ends exactly at the end of an aligned F32 tensor (no padding)
    shapes["output_norm.weight"] = (E,)
    return shapes


def _is_f32_only(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith("_conv_base")


def _default_keys(
    *,
    version: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    target_layers: Sequence[int],
    block_size: int,
    top_k: int,
    rank: int,
    conv_kernel: int,
    conv_group: int,
    mask_token_id: int,
) -> dict[str, Typed]:
    U32, I32, F32, STR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    p = f"{ARCH}."
    keys: dict[str, Typed] = {
        "general.architecture": Typed(STR, ARCH),
        "general.name": Typed(STR, f"tiny-dflash{version if version == 2 else ''}-test"),
        p + "context_length": Typed(U32, 4096),
        p + "embedding_length": Typed(U32, n_embd),
        p + "block_count": Typed(U32, n_layer),
        p + "feed_forward_length": Typed(U32, n_ff),
        p + "attention.head_count": Typed(U32, n_head),
        p + "attention.head_count_kv": Typed(U32, n_head_kv),
        p + "attention.key_length": Typed(U32, head_dim),
        p + "attention.value_length": Typed(U32, head_dim),
        p + "attention.layer_norm_rms_epsilon": Typed(F32, 1e-6),
        p + "rope.freq_base": Typed(F32, 1000000.0),
        p + "block_size": Typed(U32, block_size),
        p + "target_layers": Typed(GGUFValueType.ARRAY, [int(x) for x in target_layers], I32),
    }
    if version == 2:
        keys[p + "conv_kernel_size"] = Typed(U32, conv_kernel)
        keys[p + "conv_group_size"] = Typed(U32, conv_group)
        keys[p + "selector_rank"] = Typed(U32, rank)
        keys[p + "selector_top_k"] = Typed(U32, top_k)
    keys["tokenizer.ggml.model"] = Typed(STR, "gpt2")
    keys["tokenizer.ggml.tokens"] = Typed(GGUFValueType.ARRAY, [f"<t{i}>" for i in range(n_vocab)], STR)
    keys["tokenizer.ggml.mask_token_id"] = Typed(U32, mask_token_id)
    return keys


def _resolve_override(old: Typed | None, value: Any) -> Typed:
    """An override keeps the key's GGUF type when the Python value fits it; else it is inferred."""
    if isinstance(value, Typed):
        return value
    if old is not None:
        if old.vtype in _INT_TYPES and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return Typed(old.vtype, int(value))
        if old.vtype in _FLOAT_TYPES and isinstance(value, (float, int)) and not isinstance(value, bool):
            return Typed(old.vtype, float(value))
        if old.vtype == GGUFValueType.ARRAY and isinstance(value, (list, tuple)):
            return Typed(old.vtype, list(value), old.sub_type)
    if isinstance(value, (list, tuple)):
        return Typed(GGUFValueType.ARRAY, list(value))
    return Typed(GGUFValueType.get_type(value), value)


def write_draft_gguf(
    path: str | Path,
    *,
    version: int = 2,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    n_vocab: int = 256,
    target_hidden: int = 64,
    target_layers: Sequence[int] = (2, 4),
    block_size: int = 8,
    top_k: int = 4,
    rank: int = 8,
    conv_kernel: int = 2,
    conv_group: int = 16,
    mask_token_id: int = 1,
    dtype: Any = np.float32,
    seed: int = 0,
    drop_keys: Iterable[str] = (),
    key_overrides: Mapping[str, Any] | None = None,
    drop_tensors: Iterable[str] = (),
    tensor_overrides: Mapping[str, np.ndarray] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a complete, valid drafter GGUF (then apply the requested damage).

    Matrices are written in `dtype` (float32 or float16); norms and conv bases
    always F32. Returns {tensor name: array written}, in file order.
    """
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {version}")
    rng = np.random.default_rng(seed)
    shapes = draft_tensor_shapes(
        version=version,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
        target_hidden=target_hidden,
        n_target_layers=len(target_layers),
        rank=rank,
        conv_kernel=conv_kernel,
        conv_group=conv_group,
    )
    tensors: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if _is_f32_only(name):
            if name.endswith("norm.weight"):
                arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                arr = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = shape[-1]
            arr = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)
        tensors[name] = arr

    drop_t = set(drop_tensors)
    unknown = drop_t - set(tensors)
    if unknown:
        raise KeyError(f"drop_tensors names tensors the builder does not write: {sorted(unknown)}")
    for name in drop_t:
        del tensors[name]
    for name, arr in (tensor_overrides or {}).items():
        if name not in tensors:
            raise KeyError(f"tensor_overrides names a tensor the builder does not write: {name!r}")
        tensors[name] = np.ascontiguousarray(arr)
    for name, arr in (extra_tensors or {}).items():
        if name in tensors:
            raise KeyError(f"extra_tensors: {name!r} is already written")
        tensors[name] = np.ascontiguousarray(arr)

    keys = _default_keys(
        version=version,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=n_vocab,
        target_layers=target_layers,
        block_size=block_size,
        top_k=top_k,
        rank=rank,
        conv_kernel=conv_kernel,
        conv_group=conv_group,
        mask_token_id=mask_token_id,
    )
    for k, v in (key_overrides or {}).items():
        keys[k] = _resolve_override(keys.get(k), v)
    for k in drop_keys:
        if k not in keys:
            raise KeyError(f"drop_keys names a key the builder does not write: {k!r}")
        del keys[k]

    # keep `output_norm.weight` (aligned, F32) last when it is still there
    if "output_norm.weight" in tensors and not extra_tensors:
        tensors["output_norm.weight"] = tensors.pop("output_norm.weight")

    w = GGUFWriter(str(path), ARCH)
    w.kv_data[0].clear()  # the writer pre-adds general.architecture; we add (or drop) it ourselves
    for k, t in keys.items():
        w.add_key_value(k, t.value, t.vtype, sub_type=t.sub_type)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors
