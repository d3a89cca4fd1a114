"""Checks of a draft config and its tensors against the target, before a byte is written."""

from __future__ import annotations

from dataclasses import dataclass

from .config import DraftConfig
from .errors import ConversionError
from .source import TensorRef, TensorSource
from .target import TargetInfo
from .tensor_map import TensorSpec, describe_unknown, expected_tensors, table_key


def check_against_target(cfg: DraftConfig, target: TargetInfo) -> None:
    where = str(cfg.path)
    if cfg.vocab_size != target.vocab_size:
        raise ConversionError(
            f"{where}: drafter vocab_size {cfg.vocab_size} != target vocabulary {target.vocab_size} "
            f"(tokenizer.ggml.tokens of {target.path}); the drafter must share the target's vocabulary"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ConversionError(
            f"{where}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
            f"(0..{target.vocab_size - 1})"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.n_layer:
        raise ConversionError(
            f"{where}: num_target_layers {cfg.num_target_layers} != {target.arch}.block_count "
            f"{target.n_layer} of {target.path}; is this the drafter's target?"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.n_layer]
    if bad:
        src = "derived target_layer_ids" if cfg.target_layer_ids_derived else "dflash_config.target_layer_ids"
        raise ConversionError(
            f"{where}: {src} {list(cfg.target_layer_ids)} has ids {bad} outside the target's "
            f"{target.n_layer} layers (expected 0..{target.n_layer - 1}, {target.path})"
        )


def check_hidden(cfg: DraftConfig, target: TargetInfo) -> None:
    if cfg.hidden_size != target.hidden:
        raise ConversionError(
            f"{cfg.path}: drafter hidden_size {cfg.hidden_size} != target {target.arch}.embedding_length "
            f"{target.hidden} ({target.path}); a DFlash drafter runs on the target's token embedding and "
            "LM head, and upstream llama.cpp sizes fc's input as n_target_layers x drafter hidden"
        )


@dataclass(frozen=True)
class Matched:
    spec: TensorSpec
    ref: TensorRef
    source_key: str  # the key as stored in the checkpoint (maybe with "model.")


def match_tensors(
    cfg: DraftConfig, target: TargetInfo, source: TensorSource, *, allow_extra: bool
) -> tuple[list[Matched], list[str]]:
    """Map every checkpoint key through the table; check presence and shapes.

    Returns the matched tensors in writing order and the extra keys skipped
    (only with allow_extra).
    """
    by_name: dict[str, str] = {}
    for key in source.keys():
        name = table_key(key)
        if name in by_name:
            raise ConversionError(
                f"{source[key].file}: tensors '{by_name[name]}' and '{key}' map to the same key '{name}'"
            )
        by_name[name] = key

    specs = expected_tensors(cfg, target.hidden)
    known = {s.hf for s in specs}

    # fc first: its input width is the most informative mismatch
    fc_key = by_name.get("fc.weight")
    if fc_key is not None:
        ref = source[fc_key]
        want_in = cfg.n_target_layers_used * target.hidden
        if len(ref.shape) != 2 or ref.shape[1] != want_in:
            found = ref.shape[1] if len(ref.shape) == 2 else f"shape {ref.shape}"
            raise ConversionError(
                f"{ref.file}: tensor '{fc_key}' input width {found} != {cfg.n_target_layers_used} target layers "
                f"x target hidden {target.hidden} = {want_in}"
            )

    extra = sorted(k for n, k in by_name.items() if n not in known)
    if extra and not allow_extra:
        key = extra[0]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConversionError(
            f"{source[key].file}: unknown tensor '{key}' ({describe_unknown(table_key(key), cfg)}){more}; "
            "pass --allow-extra to skip unknown tensors"
        )

    matched: list[Matched] = []
    for spec in specs:
        key = by_name.get(spec.hf)
        if key is None:
            if spec.required:
                raise ConversionError(
                    f"{_where(source)}: missing tensor '{spec.hf}' (expected shape {spec.shape}, "
                    f"GGUF '{spec.gguf}') for {cfg.architecture}"
                )
            continue
        ref = source[key]
        if ref.shape != spec.shape:
            raise ConversionError(
                f"{ref.file}: tensor '{key}' has shape {ref.shape}, expected {spec.shape} "
                f"(from {cfg.path.name}: {_shape_hint(spec, cfg)})"
            )
        matched.append(Matched(spec, ref, key))
    return matched, extra


def _where(source: TensorSource) -> str:
    return str(source.files[0]) if len(source.files) == 1 else str(source.files[0].parent)


def _shape_hint(spec: TensorSpec, cfg: DraftConfig) -> str:
    return (
        f"hidden {cfg.hidden_size}, heads {cfg.num_heads}, kv_heads {cfg.num_kv_heads}, "
        f"head_dim {cfg.head_dim}, ff {cfg.intermediate_size}, vocab {cfg.vocab_size}"
        + (f", K {cfg.conv_kernel_size}, G {cfg.conv_groups}, rank {cfg.selector_rank}" if cfg.is_dflash2 else "")
    )
