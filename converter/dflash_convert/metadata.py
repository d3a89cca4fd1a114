"""The GGUF metadata of a dflash drafter (shared/GGUF-DFLASH.md section 3)."""

from __future__ import annotations

from gguf import GGUFValueType as T

from .config import DraftConfig
from .quantize import OutType
from .target import KV, TargetInfo

ARCH = "dflash"
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


def _k(name: str) -> str:
    return f"{ARCH}.{name}"


def build_metadata(cfg: DraftConfig, target: TargetInfo, out: OutType, *, mask_embedding: bool = False) -> list[KV]:
    """Every key the drafter GGUF carries, in writing order (general.architecture is added by the writer)."""
    kv: list[KV] = []

    def add(key: str, value: object, vtype: T, sub: T | None = None) -> None:
        kv.append(KV(key, value, vtype, sub))

    add("general.type", b"model", T.STRING)
    add("general.name", (cfg.name or cfg.path.parent.name or "dflash drafter").encode("utf-8"), T.STRING)
    add("general.file_type", int(out.file_type), T.UINT32)
    if out.name not in ("f32", "f16", "bf16"):
        add("general.quantization_version", QUANTIZATION_VERSION, T.UINT32)

    # backbone
    add(_k("context_length"), cfg.max_position_embeddings, T.UINT32)
    add(_k("embedding_length"), cfg.hidden_size, T.UINT32)
    add(_k("block_count"), cfg.num_layers, T.UINT32)
    add(_k("feed_forward_length"), cfg.intermediate_size, T.UINT32)
    add(_k("attention.head_count"), cfg.num_heads, T.UINT32)
    add(_k("attention.head_count_kv"), cfg.num_kv_heads, T.UINT32)
    add(_k("attention.key_length"), cfg.head_dim, T.UINT32)
    add(_k("attention.value_length"), cfg.head_dim, T.UINT32)
    add(_k("attention.layer_norm_rms_epsilon"), cfg.rms_norm_eps, T.FLOAT32)
    add(_k("rope.freq_base"), cfg.rope_theta, T.FLOAT32)
    if cfg.rope_dimension_count is not None:
        add(_k("rope.dimension_count"), cfg.rope_dimension_count, T.UINT32)
    rs = cfg.rope_scaling
    if rs is not None:
        add(_k("rope.scaling.type"), rs.type.encode(), T.STRING)
        add(_k("rope.scaling.factor"), rs.factor, T.FLOAT32)
        if rs.original_context_length is not None:
            add(_k("rope.scaling.original_context_length"), rs.original_context_length, T.UINT32)
        if rs.attn_factor is not None:
            add(_k("rope.scaling.attn_factor"), rs.attn_factor, T.FLOAT32)
        if rs.beta_fast is not None:
            add(_k("rope.scaling.yarn_beta_fast"), rs.beta_fast, T.FLOAT32)
        if rs.beta_slow is not None:
            add(_k("rope.scaling.yarn_beta_slow"), rs.beta_slow, T.FLOAT32)
    if target.rope_sections:
        # an M-RoPE target's drafter ropes on the temporal section alone (upstream writes these degenerate
        # sections and then builds the M-RoPE variant; for text positions it is NeoX RoPE)
        add(_k("rope.dimension_sections"), [cfg.head_dim // 2, 0, 0, 0], T.ARRAY, T.INT32)
    if cfg.hidden_act != "silu":
        add(_k("hidden_activation"), cfg.hidden_act.encode(), T.STRING)

    # dflash
    add(_k("block_size"), cfg.block_size, T.UINT32)
    # upstream reads the *input* of target layer j = HF hidden_states[j]; HF ids name outputs: +1
    add(_k("target_layers"), [i + 1 for i in cfg.target_layer_ids], T.ARRAY, T.INT32)
    if cfg.is_dflash2:
        add(_k("conv_kernel_size"), cfg.conv_kernel_size, T.UINT32)
        add(_k("conv_group_size"), cfg.conv_group_size, T.UINT32)
        add(_k("selector_rank"), cfg.selector_rank, T.UINT32)
        add(_k("selector_top_k"), cfg.selector_top_k, T.UINT32)

    # optional scales / attention variants
    if cfg.output_multiplier is not None:
        add(_k("logit_scale"), cfg.output_multiplier, T.FLOAT32)
    if cfg.final_logit_softcapping is not None:
        add(_k("final_logit_softcapping"), cfg.final_logit_softcapping, T.FLOAT32)
    if cfg.input_embedding_scale is not None:
        add(_k("embedding_scale"), cfg.input_embedding_scale, T.FLOAT32)
    if cfg.attention_value_scale is not None:
        add(_k("attention.value_scale"), cfg.attention_value_scale, T.FLOAT32)
    if mask_embedding:
        add(_k("mask_embedding"), True, T.BOOL)
    if cfg.causal is not None:
        add(_k("attention.causal"), cfg.causal, T.BOOL)
    if cfg.causal_layers is not None:
        # ours only: llama.cpp's dflash runs every layer non-causal unless attention.causal is true
        add(_k("attention.causal_layers"), list(cfg.causal_layers), T.ARRAY, T.BOOL)
    if cfg.sliding_window is not None and cfg.sliding_window_pattern is not None:
        add(_k("attention.sliding_window"), cfg.sliding_window, T.UINT32)
        add(_k("attention.sliding_window_pattern"), list(cfg.sliding_window_pattern), T.ARRAY, T.BOOL)

    # tokenizer: every tokenizer.ggml.* key of the target, then the mask token id
    for t in target.tokenizer_kvs:
        if t.key == MASK_TOKEN_KEY:
            continue
        if t.vtype == T.ARRAY and len(t.value) == 0:
            continue  # GGUF cannot hold an empty array through gguf-py; nothing to copy
        kv.append(t)
    add(MASK_TOKEN_KEY, cfg.mask_token_id, T.UINT32)
    return kv
