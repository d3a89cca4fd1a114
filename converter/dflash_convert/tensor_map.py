"""THE mapping table: Hugging Face DFlash / DFlash2 key -> GGUF tensor name and shape.

Shapes are torch shapes (row-major, slowest dimension first). ggml lists
dimensions fastest first, so the GGUF ``ne`` is the reverse of the torch shape
and the bytes are identical: no tensor needs a transpose or any other
reshaping (shared/GGUF-DFLASH.md section 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .config import DraftConfig


class Kind(Enum):
    """What a tensor is, for the quantization policy."""

    MATRIX = "matrix"  # a 2-D projection: may be quantized
    NORM = "norm"  # an RMSNorm weight: always F32
    CONV_BASE = "conv_base"  # a DFlash2 conv base kernel (3-D, tiny): always F32
    CODEBOOK = "codebook"  # a selector codebook (vocab, R): read with get_rows; may be quantized
    EMBEDDING = "embedding"  # token embedding / LM head: may be quantized


@dataclass(frozen=True)
class Dims:
    """The sizes a shape can depend on."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    fc_in: int  # number of target layers x target hidden size
    conv_kernel: int  # K (DFlash2)
    conv_proj: int  # 2 * K * G (DFlash2)
    rank: int  # selector rank R (DFlash2)

    @staticmethod
    def of(cfg: DraftConfig, target_hidden: int) -> Dims:
        k = cfg.conv_kernel_size or 0
        g = cfg.conv_groups if cfg.is_dflash2 else 0
        return Dims(
            hidden=cfg.hidden_size,
            n_heads=cfg.num_heads,
            n_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            ff=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            fc_in=cfg.n_target_layers_used * target_hidden,
            conv_kernel=k,
            conv_proj=2 * k * g,
            rank=cfg.selector_rank or 0,
        )


ShapeFn = Callable[[Dims], tuple[int, ...]]


@dataclass(frozen=True)
class MapEntry:
    hf: str  # HF key, "{i}" = draft layer index; no "model." prefix
    gguf: str  # GGUF tensor name, "{i}" = draft layer index
    shape: ShapeFn  # expected torch shape
    kind: Kind
    versions: frozenset[int]  # DFlash versions that have this tensor
    required: bool = True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


_V12 = frozenset({1, 2})
_V2 = frozenset({2})

# fmt: off
TABLE: tuple[MapEntry, ...] = (
    # context fusion: fc maps the concatenated target-layer features (n_tl * target_hidden) to hidden
    MapEntry("fc.weight", "fc.weight",
             lambda d: (d.hidden, d.fc_in), Kind.MATRIX, _V12),
    # RMSNorm applied to fc's output ("hidden_norm"); upstream calls it the encoder output norm
    MapEntry("hidden_norm.weight", "enc.output_norm.weight",
             lambda d: (d.hidden,), Kind.NORM, _V12),
    # final RMSNorm before the (target's) LM head
    MapEntry("norm.weight", "output_norm.weight",
             lambda d: (d.hidden,), Kind.NORM, _V12),
    # per layer: pre-attention RMSNorm
    MapEntry("layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight",
             lambda d: (d.hidden,), Kind.NORM, _V12),
    # per layer: query projection (heads * head_dim, hidden)
    MapEntry("layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight",
             lambda d: (d.n_heads * d.head_dim, d.hidden), Kind.MATRIX, _V12),
    # per layer: key projection (kv_heads * head_dim, hidden); also applied to injected context features
    MapEntry("layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight",
             lambda d: (d.n_kv_heads * d.head_dim, d.hidden), Kind.MATRIX, _V12),
    # per layer: value projection (kv_heads * head_dim, hidden)
    MapEntry("layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight",
             lambda d: (d.n_kv_heads * d.head_dim, d.hidden), Kind.MATRIX, _V12),
    # per layer: attention output projection (hidden, heads * head_dim)
    MapEntry("layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight",
             lambda d: (d.hidden, d.n_heads * d.head_dim), Kind.MATRIX, _V12),
    # per layer: Qwen3 per-head RMSNorm on q (head_dim,)
    MapEntry("layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight",
             lambda d: (d.head_dim,), Kind.NORM, _V12),
    # per layer: Qwen3 per-head RMSNorm on k (head_dim,)
    MapEntry("layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight",
             lambda d: (d.head_dim,), Kind.NORM, _V12),
    # per layer: pre-MLP RMSNorm
    MapEntry("layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight",
             lambda d: (d.hidden,), Kind.NORM, _V12),
    # per layer: SwiGLU gate projection (ff, hidden)
    MapEntry("layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight",
             lambda d: (d.ff, d.hidden), Kind.MATRIX, _V12),
    # per layer: SwiGLU up projection (ff, hidden)
    MapEntry("layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight",
             lambda d: (d.ff, d.hidden), Kind.MATRIX, _V12),
    # per layer: SwiGLU down projection (hidden, ff)
    MapEntry("layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight",
             lambda d: (d.hidden, d.ff), Kind.MATRIX, _V12),
    # DFlash2, per layer: attention-side block conv base kernel (side, tap, channel); no ".weight" upstream
    MapEntry("layers.{i}.attention_conv.base_kernel", "blk.{i}.attn_conv_base",
             lambda d: (2, d.conv_kernel, d.hidden), Kind.CONV_BASE, _V2),
    # DFlash2, per layer: attention-side per-row kernel projection (2*K*G, hidden), read as (side, tap, group)
    MapEntry("layers.{i}.attention_conv.kernel_projection.weight", "blk.{i}.attn_conv_proj.weight",
             lambda d: (d.conv_proj, d.hidden), Kind.MATRIX, _V2),
    # DFlash2, per layer: MLP-side block conv base kernel (side, tap, channel)
    MapEntry("layers.{i}.mlp_conv.base_kernel", "blk.{i}.ffn_conv_base",
             lambda d: (2, d.conv_kernel, d.hidden), Kind.CONV_BASE, _V2),
    # DFlash2, per layer: MLP-side per-row kernel projection (2*K*G, hidden)
    MapEntry("layers.{i}.mlp_conv.kernel_projection.weight", "blk.{i}.ffn_conv_proj.weight",
             lambda d: (d.conv_proj, d.hidden), Kind.MATRIX, _V2),
    # DFlash2 selector: predecessor codebook P (vocab, R), one row per previous token
    MapEntry("candidate_selector.predecessor_codebook", "selector_predecessor.weight",
             lambda d: (d.vocab, d.rank), Kind.CODEBOOK, _V2),
    # DFlash2 selector: successor codebook N (vocab, R), one row per candidate token
    MapEntry("candidate_selector.successor_codebook", "selector_successor.weight",
             lambda d: (d.vocab, d.rank), Kind.CODEBOOK, _V2),
    # DFlash2 selector: gate from the final hidden state (R, hidden)
    MapEntry("candidate_selector.hidden_projection.weight", "selector_hidden.weight",
             lambda d: (d.rank, d.hidden), Kind.MATRIX, _V2),
    # optional: a few exports carry the target's token embedding (vocab, hidden)
    MapEntry("embed_tokens.weight", "token_embd.weight",
             lambda d: (d.vocab, d.hidden), Kind.EMBEDDING, _V12, required=False),
    # optional: ... and the target's LM head (vocab, hidden)
    MapEntry("lm_head.weight", "output.weight",
             lambda d: (d.vocab, d.hidden), Kind.EMBEDDING, _V12, required=False),
)
# fmt: on

PREFIX = "model."

# the GGUF names of the target tensors --embed-target-head copies
TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor, resolved for a config."""

    hf: str
    gguf: str
    shape: tuple[int, ...]
    kind: Kind
    required: bool
    layer: int | None


def expected_tensors(cfg: DraftConfig, target_hidden: int) -> list[TensorSpec]:
    """Every tensor a checkpoint of this config may have, in GGUF writing order."""
    dims = Dims.of(cfg, target_hidden)
    out: list[TensorSpec] = []
    for e in TABLE:
        if cfg.version not in e.versions or e.per_layer:
            continue
        out.append(TensorSpec(e.hf, e.gguf, e.shape(dims), e.kind, e.required, None))
    for i in range(cfg.num_layers):
        for e in TABLE:
            if cfg.version not in e.versions or not e.per_layer:
                continue
            out.append(TensorSpec(e.hf.format(i=i), e.gguf.format(i=i), e.shape(dims), e.kind, e.required, i))
    return out


_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


# other names of TABLE's keys
ALIASES = {
    # Muse Glimmer's assistant: fc
    "encoder.fc.weight": "fc.weight",
    # Muse Glimmer's assistant: hidden_norm
    "encoder.output_norm_enc.weight": "hidden_norm.weight",
}


def table_key(key: str) -> str:
    """The TABLE key of a checkpoint key: HF keys may or may not carry a ``model.`` prefix, and some
    exports name a tensor otherwise (ALIASES)."""
    key = key[len(PREFIX) :] if key.startswith(PREFIX) else key
    return ALIASES.get(key, key)


def describe_unknown(key: str, cfg: DraftConfig) -> str:
    """A hint for a key the table does not know."""
    m = _LAYER_RE.match(key)
    if m and int(m.group(1)) >= cfg.num_layers:
        return f"layer {m.group(1)} >= num_hidden_layers {cfg.num_layers}"
    for e in TABLE:
        pattern = re.escape(e.hf).replace(r"\{i\}", r"\d+")
        if re.fullmatch(pattern, key) and cfg.version not in e.versions:
            return f"a DFlash{max(e.versions)} tensor in a DFlash{cfg.version} ({cfg.architecture}) checkpoint"
    return "not in the DFlash tensor table"
