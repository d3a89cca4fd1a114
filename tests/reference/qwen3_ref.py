"""A minimal PyTorch Qwen3 causal LM forward (the reference target).

Written for tests: no transformers, no KV cache, one sequence at a time.

    model = Qwen3Reference.from_hf_dir("examples/tinycode/target")
    out = model.forward([281, 888, 37])     # token ids
    out.logits          # [n, vocab]
    out.hidden_states   # tuple of n_layer + 1 tensors, each [n, hidden]
    model.generate_greedy(prompt_ids, 16)   # list of 16 new token ids

`hidden_states` follows Hugging Face: `hidden_states[0]` is the token
embedding, `hidden_states[i + 1]` the output of layer i (the residual stream
after its MLP) for i < n_layer - 1, and the last entry, `hidden_states[n_layer]`,
is the *final-normed* output of the last layer (HF applies `model.norm` before
recording it). `layer_outputs` holds the raw residual stream after each layer,
without that final norm, for anyone who needs it.

Numerics: weights are widened to float32 (or float64 if asked); RMSNorm and
RoPE follow Qwen3 (q_norm/k_norm per head before NeoX rotate-half RoPE,
absolute positions, GQA, attention scale 1/sqrt(head_dim), SwiGLU MLP).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Qwen3Config",
    "Qwen3Output",
    "Qwen3Reference",
    "attention",
    "load_safetensors_dir",
    "rms_norm",
    "rope_neox",
    "rope_theta_of",
    "to_tensor",
]


# --------------------------------------------------------------------------- #
# shared numerics (also used by dflash_ref)
# --------------------------------------------------------------------------- #


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float, n_rot: int | None = None) -> torch.Tensor:
    """NeoX (rotate-half) RoPE at absolute positions.

    x: [n, heads, head_dim]; positions: [n] integers. The first `n_rot` dims
    (default: all) are rotated: pairs (i, i + n_rot/2) by angle
    pos * theta^(-2i/n_rot); the remaining dims pass through.
    """
    head_dim = x.shape[-1]
    n_rot = head_dim if n_rot is None else n_rot
    if n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"rope: n_rot={n_rot} must be even and <= head_dim={head_dim}")
    half = n_rot // 2
    # angles in float64, then cast: as exact as the compute dtype allows
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / n_rot))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [n, half]
    cos = torch.cos(ang).to(x.dtype)[:, None, :]  # [n, 1, half]
    sin = torch.sin(ang).to(x.dtype)[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:n_rot]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if n_rot < head_dim:
        out = torch.cat([out, x[..., n_rot:]], dim=-1)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with GQA.

    q: [nq, H, d]; k, v: [nk, H_kv, d]; mask: [nq, nk] bool (True = may attend)
    or None. Query head h reads KV head h // (H / H_kv). Scale 1/sqrt(d).
    Returns [nq, H * d].
    """
    n_head, n_kv = q.shape[1], k.shape[1]
    if n_head % n_kv:
        raise ValueError(f"attention: {n_head} heads not a multiple of {n_kv} kv heads")
    rep = n_head // n_kv
    k = k.repeat_interleave(rep, dim=1)  # [nk, H, d]
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.reshape(q.shape[0], -1)


def to_tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """numpy array / torch tensor / nested list -> torch tensor of `dtype` (a copy for numpy)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(dtype)
    arr = np.asarray(a)
    if arr.dtype == np.uint16 and dtype.is_floating_point:
        # raw bfloat16 bits, as numpy readers of safetensors return them
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.array(arr)).to(dtype)


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF dir (`model.safetensors` or the shards of its index), as stored."""
    from safetensors.torch import load_file

    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return dict(load_file(str(single)))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(str(path / shard)))
        return out
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def rope_theta_of(cfg: Mapping[str, Any]) -> float:
    """rope_theta from a config: top-level `rope_theta` or `rope_parameters.rope_theta`.

    Only plain RoPE is supported: a `rope_scaling` / non-default `rope_type` raises.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for block in (params, scaling):
        rtype = block.get("rope_type", block.get("type", "default"))
        if rtype not in (None, "default"):
            raise NotImplementedError(f"rope_type {rtype!r}: the reference implements plain RoPE only")
    if "rope_theta" in cfg and cfg["rope_theta"] is not None:
        return float(cfg["rope_theta"])
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def n_rot_of(cfg: Mapping[str, Any], head_dim: int) -> int:
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    return int(head_dim * float(factor))


# --------------------------------------------------------------------------- #
# Qwen3
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    n_rot: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Qwen3Config:
        n_head = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
        if cfg.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention is not implemented in the reference")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_head,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(cfg),
            n_rot=n_rot_of(cfg, head_dim),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


@dataclass
class Qwen3Output:
    logits: torch.Tensor  # [n, vocab]
    hidden_states: tuple[torch.Tensor, ...]  # n_layer + 1 entries, HF convention (see module doc)
    layer_outputs: tuple[torch.Tensor, ...]  # n_layer entries: raw residual after each layer


class Qwen3Reference:
    """Qwen3ForCausalLM forward from a config dict and HF-named tensors.

    `tensors` keys: `model.embed_tokens.weight`, `model.layers.{i}....`,
    `model.norm.weight`, `lm_head.weight` (the `model.` prefix is optional;
    `lm_head.weight` may be absent with tied embeddings).
    """

    def __init__(self, config: Mapping[str, Any], tensors: Mapping[str, Any], dtype: torch.dtype = torch.float32):
        self.cfg = Qwen3Config.from_dict(config)
        self.dtype = dtype
        w: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            key = name[len("model.") :] if name.startswith("model.") else name
            w[key] = to_tensor(t, dtype)
        if "lm_head.weight" not in w:
            if not self.cfg.tie_word_embeddings:
                raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
            w["lm_head.weight"] = w["embed_tokens.weight"]
        self.w = w

    @classmethod
    def from_hf_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3Reference:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        return cls(config, load_safetensors_dir(path), dtype=dtype)

    @property
    def embed(self) -> torch.Tensor:
        return self.w["embed_tokens.weight"]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.w["lm_head.weight"]

    @torch.no_grad()
    def forward(self, ids: Sequence[int] | torch.Tensor, positions: Iterable[int] | None = None) -> Qwen3Output:
        """Causal forward of one sequence. ids: [n]; positions default 0..n-1."""
        c, w = self.cfg, self.w
        ids_t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long)
        n = ids_t.shape[0]
        pos = torch.arange(n) if positions is None else torch.as_tensor(list(positions), dtype=torch.long)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        x = w["embed_tokens.weight"][ids_t]
        hidden: list[torch.Tensor] = [x]
        outs: list[torch.Tensor] = []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_attention_heads, c.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            q = rope_neox(rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps), pos, c.rope_theta, c.n_rot)
            k = rope_neox(rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps), pos, c.rope_theta, c.n_rot)
            x = x + attention(q, k, v, mask) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
            outs.append(x)
            hidden.append(x)
        x_final = rms_norm(x, w["norm.weight"], c.rms_norm_eps)
        hidden[-1] = x_final  # HF records the last hidden state after the final norm
        logits = x_final @ w["lm_head.weight"].T
        return Qwen3Output(logits=logits, hidden_states=tuple(hidden), layer_outputs=tuple(outs))

    __call__ = forward

    @torch.no_grad()
    def generate_greedy(self, prompt_ids: Sequence[int], n_new: int) -> list[int]:
        """Greedy continuation (argmax of the full logits each step), recomputing the whole sequence."""
        seq = list(prompt_ids)
        new: list[int] = []
        for _ in range(n_new):
            tok = int(self.forward(seq).logits[-1].argmax())
            seq.append(tok)
            new.append(tok)
        return new
