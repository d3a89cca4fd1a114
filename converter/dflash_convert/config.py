"""Parse and validate a DFlash / DFlash2 ``config.json`` into a frozen DraftConfig.

Only checks that need nothing but the config live here; the checks against the
target GGUF and the tensors are in :mod:`dflash_convert.validate`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConversionError

# architectures[0] -> DFlash version
ARCHITECTURES: dict[str, int] = {
    "DFlashDraftModel": 1,
    "DFlash2DraftModel": 2,
    # Meta's Muse Glimmer assistant (a DFlash drafter of its own format): its dflash settings (block_size,
    # mask_token_id, target_layer_ids) sit at the top level of config.json, which may leave out vocab_size
    # (the target's); its attention is bidirectional and slides wherever layer_types says (its config class
    # keeps sliding_window without use_sliding_window); fc and hidden_norm are named encoder.fc and
    # encoder.output_norm_enc (tensor_map.ALIASES)
    "MuseGlimmerAssistantModel": 1,
}
ASSISTANT = "MuseGlimmerAssistantModel"

# hidden activations upstream's dflash loader accepts (dflash.hidden_activation)
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")

# rope scaling types we can express in GGUF (dflash.rope.scaling.type)
ROPE_SCALING_TYPES = ("linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    type: str  # "linear" | "yarn"
    factor: float
    original_context_length: int | None = None
    attn_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None


@dataclass(frozen=True)
class DraftConfig:
    """Everything the converter needs from ``config.json``, validated."""

    path: Path
    version: int  # 1 = DFlashDraftModel, 2 = DFlash2DraftModel
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int | None  # None: the target's (Muse Glimmer's assistant leaves it out)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_layer_ids_derived: bool  # True when computed from the default formula
    num_target_layers: int | None
    hidden_act: str = "silu"
    partial_rotary_factor: float | None = None
    rope_scaling: RopeScaling | None = None
    # DFlash 2 only (None for DFlash 1)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # optional scales and attention variants
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    attention_value_scale: float | None = None
    causal: bool | None = None
    causal_layers: tuple[bool, ...] | None = None  # per layer, when only some are causal
    sliding_window: int | None = None
    sliding_window_pattern: tuple[bool, ...] | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_dflash2(self) -> bool:
        return self.version == 2

    @property
    def n_target_layers_used(self) -> int:
        return len(self.target_layer_ids)

    @property
    def conv_groups(self) -> int:
        """G = hidden / conv_group_size (DFlash 2)."""
        assert self.conv_group_size is not None
        return self.hidden_size // self.conv_group_size

    @property
    def rope_dimension_count(self) -> int | None:
        if self.partial_rotary_factor is None:
            return None
        return int(self.head_dim * self.partial_rotary_factor)


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The DFlash default when ``target_layer_ids`` is absent.

    d = 1 gives [n // 2]; else round(1 + i * (n - 4) / (d - 1)) for i in 0..d-1.
    """
    n, d = n_target_layers, n_draft_layers
    if d == 1:
        return [n // 2]
    return [int(round(1 + i * (n - 4) / (d - 1))) for i in range(d)]


class _Fields:
    """Typed getters over a JSON object that raise ConversionError naming the key."""

    def __init__(self, data: dict[str, Any], where: str, prefix: str = "") -> None:
        self.data = data
        self.where = where
        self.prefix = prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def int(self, key: str, *, default: int | None = None, minimum: int | None = 1) -> int:
        if not self.has(key):
            if default is not None:
                return default
            raise ConversionError(f"{self.where}: missing required key '{self._name(key)}' (an integer)")
        value = self.data[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer())
        ):
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be an integer, found {value!r}")
        value = int(value)
        if minimum is not None and value < minimum:
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be >= {minimum}, found {value}")
        return value

    def opt_int(self, key: str, *, minimum: int | None = 1) -> int | None:
        return self.int(key, minimum=minimum) if self.has(key) else None

    def float(self, key: str, *, default: float | None = None, positive: bool = False) -> float:
        if not self.has(key):
            if default is not None:
                return default
            raise ConversionError(f"{self.where}: missing required key '{self._name(key)}' (a number)")
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be a finite number, found {value!r}")
        if positive and value <= 0:
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be > 0, found {value!r}")
        return float(value)

    def opt_float(self, key: str, *, positive: bool = False) -> float | None:
        return self.float(key, positive=positive) if self.has(key) else None

    def bool(self, key: str) -> bool | None:
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, bool):
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be true or false, found {value!r}")
        return value

    def obj(self, key: str) -> dict[str, Any] | None:
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, dict):
            raise ConversionError(f"{self.where}: '{self._name(key)}' must be an object, found {type(value).__name__}")
        return value


def load_config(draft_dir: Path) -> DraftConfig:
    """Read ``draft_dir/config.json`` and return a validated DraftConfig."""
    path = draft_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found (a DFlash drafter directory needs config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: expected a JSON object at the top level, found {type(raw).__name__}")
    return parse_config(raw, path)


def parse_config(raw: dict[str, Any], path: Path) -> DraftConfig:
    where = str(path)
    top = _Fields(raw, where)

    # -- architecture ---------------------------------------------------------
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"{where}: 'architectures' must be a non-empty list of strings, found {archs!r}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"{where}: unknown architecture '{arch}' in 'architectures' (expected one of {', '.join(ARCHITECTURES)})"
        )
    version = ARCHITECTURES[arch]

    if arch == ASSISTANT:
        dflash, dc = raw, top
    else:
        dflash = top.obj("dflash_config")
        if dflash is None:
            raise ConversionError(f"{where}: missing required object 'dflash_config'")
        dc = _Fields(dflash, where, prefix="dflash_config.")
    dcp = dc.prefix  # where the dflash settings are, for messages

    # -- Qwen3 backbone -------------------------------------------------------
    hidden = top.int("hidden_size")
    n_layers = top.int("num_hidden_layers")
    n_heads = top.int("num_attention_heads")
    n_kv_heads = top.int("num_key_value_heads", default=n_heads)
    if n_heads % n_kv_heads != 0:
        raise ConversionError(
            f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}"
        )
    head_dim = top.int("head_dim", default=hidden // n_heads if hidden % n_heads == 0 else None)
    ff = top.int("intermediate_size")
    eps = top.float("rms_norm_eps", positive=True)
    max_pos = top.int("max_position_embeddings")
    vocab = top.int("vocab_size") if arch != ASSISTANT or top.has("vocab_size") else None

    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act not in HIDDEN_ACTS:
        raise ConversionError(
            f"{where}: 'hidden_act' {hidden_act!r} is not supported (expected one of {', '.join(HIDDEN_ACTS)})"
        )

    rope_params = top.obj("rope_parameters") or {}
    rp = _Fields(rope_params, where, prefix="rope_parameters.")
    if top.has("rope_theta"):
        rope_theta = top.float("rope_theta", positive=True)
    elif rp.has("rope_theta"):
        rope_theta = rp.float("rope_theta", positive=True)
    else:
        raise ConversionError(f"{where}: missing 'rope_theta' (or 'rope_parameters.rope_theta')")

    prf = top.opt_float("partial_rotary_factor", positive=True)
    if prf is None:
        prf = rp.opt_float("partial_rotary_factor", positive=True)
    if prf is not None:
        if prf > 1.0:
            raise ConversionError(f"{where}: 'partial_rotary_factor' must be in (0, 1], found {prf}")
        if prf == 1.0:
            prf = None

    rope_scaling = _parse_rope_scaling(raw, where)

    # -- dflash_config -----------------------------------------------------------
    block_size = dc.int("block_size", default=top.int("block_size") if top.has("block_size") else None)
    if block_size < 2:
        raise ConversionError(f"{where}: '{dcp}block_size' must be >= 2, found {block_size}")
    mask_token_id = dc.int("mask_token_id", minimum=0)
    if vocab is not None and mask_token_id >= vocab:
        raise ConversionError(
            f"{where}: '{dcp}mask_token_id' {mask_token_id} is outside the vocabulary "
            f"(vocab_size {vocab}: expected 0..{vocab - 1})"
        )

    num_target_layers = top.opt_int("num_target_layers")
    ids_raw = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    derived = False
    if ids_raw is None:
        if num_target_layers is None:
            raise ConversionError(
                f"{where}: '{dcp}target_layer_ids' is absent and so is 'num_target_layers' "
                "(needed to derive the default ids)"
            )
        ids = default_target_layer_ids(num_target_layers, n_layers)
        derived = True
    else:
        if (
            not isinstance(ids_raw, list)
            or not ids_raw
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids_raw)
        ):
            raise ConversionError(
                f"{where}: '{dcp}target_layer_ids' must be a non-empty list of integers, found {ids_raw!r}"
            )
        ids = list(ids_raw)
    for i in ids:
        if i < 0:
            raise ConversionError(f"{where}: '{dcp}target_layer_ids' contains a negative id {i}")
    if num_target_layers is not None:
        bad = [i for i in ids if i >= num_target_layers]
        if bad:
            raise ConversionError(
                f"{where}: '{dcp}target_layer_ids' {ids} has ids {bad} outside "
                f"num_target_layers {num_target_layers} (expected 0..{num_target_layers - 1})"
            )

    conv_kernel = conv_group = sel_rank = sel_top_k = None
    if version == 2:
        conv_kernel = dc.int("conv_kernel_size")
        conv_group = dc.int("conv_group_size")
        sel_rank = dc.int("selector_rank")
        sel_top_k = dc.int("selector_top_k")
        if hidden % conv_group != 0:
            raise ConversionError(
                f"{where}: DFlash2 needs hidden_size % dflash_config.conv_group_size == 0, "
                f"found hidden_size {hidden}, conv_group_size {conv_group}"
            )
        need = sel_top_k * (sel_top_k + 1)
        if hidden < need:
            raise ConversionError(
                f"{where}: DFlash2 needs hidden_size >= selector_top_k * (selector_top_k + 1) = {need} "
                f"(the selector lattice is returned in hidden-size rows), found hidden_size {hidden}"
            )
        if sel_top_k > vocab:
            raise ConversionError(f"{where}: 'dflash_config.selector_top_k' {sel_top_k} exceeds vocab_size {vocab}")

    # -- optional scales --------------------------------------------------------
    def opt_scale(key: str) -> float | None:
        if dc.has(key):
            return dc.float(key)
        if top.has(key):
            return top.float(key)
        return None

    output_multiplier = opt_scale("output_multiplier")
    softcap = opt_scale("final_logit_softcapping")
    if softcap is not None and softcap <= 0:
        softcap = None
    emb_scale = opt_scale("input_embedding_scale")
    value_scale = dc.opt_float("attention_value_scale")

    # per-layer attention types (HF layer_types): which layers slide, and, when the config does not say
    # whether attention is causal, which are: z-lab's reference makes a sliding_attention layer causal and a
    # full_attention layer not unless config.is_causal says otherwise (their Qwen3.5 / 3.6 drafters set no
    # is_causal; the DFlash 2 release sets is_causal false)
    layer_types = raw.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) != n_layers
        or any(lt not in ("sliding_attention", "full_attention") for lt in layer_types)
    ):
        raise ConversionError(
            f"{where}: 'layer_types' must list num_hidden_layers = {n_layers} entries, each "
            f"'sliding_attention' or 'full_attention' (found {layer_types!r})"
        )
    sliding_layers = tuple(lt == "sliding_attention" for lt in layer_types) if layer_types else None

    causal = top.bool("is_causal")
    if causal is None:
        causal = dc.bool("causal")
    if causal is None and arch == ASSISTANT:
        causal = False
    causal_layers: tuple[bool, ...] | None = None
    if causal is None and sliding_layers is not None and any(sliding_layers):
        if all(sliding_layers):
            causal = True
        else:
            causal_layers = sliding_layers

    # sliding window: dflash_config.use_swa makes every layer SWA; else HF's use_sliding_window (transformers
    # drops sliding_window without it) with layer_types
    use_swa = dc.bool("use_swa") or False
    window = dc.opt_int("swa_window_size") or top.opt_int("sliding_window")
    sliding_window = None
    pattern: tuple[bool, ...] | None = None
    if use_swa and window:
        sliding_window, pattern = window, tuple([True] * n_layers)
    elif (top.bool("use_sliding_window") or arch == ASSISTANT) and window:
        if sliding_layers is None:
            raise ConversionError(f"{where}: 'sliding_window' is set but 'layer_types' (which layers slide) is missing")
        sliding_window, pattern = window, sliding_layers

    name = raw.get("_name_or_path") if isinstance(raw.get("_name_or_path"), str) else ""

    return DraftConfig(
        path=path,
        version=version,
        architecture=arch,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv_heads,
        head_dim=head_dim,
        intermediate_size=ff,
        rms_norm_eps=eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids),
        target_layer_ids_derived=derived,
        num_target_layers=num_target_layers,
        hidden_act=hidden_act,
        partial_rotary_factor=prf,
        rope_scaling=rope_scaling,
        conv_kernel_size=conv_kernel,
        conv_group_size=conv_group,
        selector_rank=sel_rank,
        selector_top_k=sel_top_k,
        output_multiplier=output_multiplier,
        final_logit_softcapping=softcap,
        input_embedding_scale=emb_scale,
        attention_value_scale=value_scale,
        causal=causal,
        causal_layers=causal_layers,
        sliding_window=sliding_window,
        sliding_window_pattern=pattern,
        name=name,
        extra=raw,
    )


def _parse_rope_scaling(raw: dict[str, Any], where: str) -> RopeScaling | None:
    """HF ``rope_scaling`` (older) or ``rope_parameters`` (transformers 5)."""
    src_key = None
    scaling: dict[str, Any] | None = None
    if isinstance(raw.get("rope_scaling"), dict):
        src_key, scaling = "rope_scaling", raw["rope_scaling"]
    elif isinstance(raw.get("rope_parameters"), dict):
        src_key, scaling = "rope_parameters", raw["rope_parameters"]
    if scaling is None:
        return None
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype in (None, "default"):
        return None
    if rtype not in ROPE_SCALING_TYPES:
        raise ConversionError(
            f"{where}: '{src_key}' rope type {rtype!r} is not supported "
            f"(expected default, {', '.join(ROPE_SCALING_TYPES)})"
        )
    f = _Fields(scaling, where, prefix=f"{src_key}.")
    return RopeScaling(
        type=rtype,
        factor=f.float("factor", positive=True),
        original_context_length=f.opt_int("original_max_position_embeddings"),
        attn_factor=f.opt_float("attention_factor", positive=True),
        beta_fast=f.opt_float("beta_fast"),
        beta_slow=f.opt_float("beta_slow"),
    )
