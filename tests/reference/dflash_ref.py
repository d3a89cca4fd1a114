"""PyTorch reference of the DFlash 1 / DFlash 2 drafter (shared/GGUF-DFLASH.md section 4).

Written from the spec, for tests: the C++ ggml draft graph must compute these
numbers. float32 by default (float64 on request).

Usage
-----

    ref = DraftReference.from_hf_dir("examples/tinycode/drafter-dflash2",
                                     "examples/tinycode/target")
    # or DraftReference(config_dict, hf_tensors, embed, lm_head, dtype=torch.float32)

    feats = ref.features_from_hidden_states(target_out.hidden_states)  # [n, n_tl * target_hidden]
    cache = ref.inject(feats, positions=range(n))       # new DraftCache
    ref.inject(more_feats, more_positions, cache)        # appends in place
    cache.truncate(n_keep)

    out = ref.draft(cache, anchor=a, position=n)         # block [a, MASK x (B-1)] at n .. n+B-1
    out.draft                                            # [B-1] the drafted tokens (walk or argmax)

DraftOutput fields (B = block size, k = selector_top_k, R = selector_rank);
"row t" is block row t (row 0 = the anchor); per-row arrays over rows
1..B-1 are indexed by t - 1:

    tokens    [B]         block input ids [a, MASK, ...]
    positions [B]         n .. n+B-1
    x         [B, hidden] residual stream after the last layer (before output_norm)
    h_final   [B, hidden] output_norm(x)
    logits    [B, vocab]  W_out h_final, times logit_scale, then softcapped
    argmax    [B-1]       argmax of logits rows 1..B-1 (the DFlash 1 draft)
  DFlash 2 only (None for DFlash 1):
    candidates [B-1, k]   top-k token ids of logits row t, by logit descending
    cand_logits [B-1, k]  logits[t, candidates[t-1]] (the unary scores U_t)
    gate      [B-1, R]    W_sel_hidden h_final_t
    scores    [B-1, k, k] scores[t-1, i, j] = S_t(pred_i, candidates[t-1, j]),
                          predecessor-major. Row t >= 2: pred_i = candidates[t-2, i].
                          Row 1: the only predecessor is the anchor, and
                          scores[0, i, :] = S_1(anchor, .) for every i (the
                          anchor's row repeated k times, as upstream packs it).
    walk_index [B-1]      j_t: index of the walked token within candidates[t-1]
    walk      [B-1]       b_t = candidates[t-1, j_t] (the DFlash 2 draft)
    q_ids     [B-1, k]    = candidates: the support of q_t
    q_probs   [B-1, k]    softmax over j of S_t(b_{t-1}, candidates[t-1, j])
                          (b_0 = the anchor), i.e. q_t of the greedy walk at T = 1.

Spec details implemented here: RMSNorm with rms_norm_eps everywhere; NeoX RoPE
at absolute positions on q and k after q_norm/k_norm; the MLP gate's
activation is `hidden_act` (silu, gelu, gelu_pytorch_tanh); GQA; attention scale
1/sqrt(head_dim); the block attends over [cached context K/V ; block K/V]
with no mask (in a causal layer only keys at positions <= q; in a
sliding-window layer only keys less than sliding_window positions from q,
on both sides in a non-causal one); o_proj output times
attention_value_scale; embeddings times input_embedding_scale; logits times
output_multiplier, then softcap s * tanh(logits / s). The DFlash 2 dynamic
conv is block-local: c = W_proj h viewed [side][tap][group],
w[t, side, tap, ch] = base[side, tap, ch] + c[t, side, tap, ch // group_size],
conv(y)[t] = sum_{tap < min(K, B)} w[t, side, tap] * y[t - tap], zero before row 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .qwen3_ref import attention, load_safetensors_dir, n_rot_of, rms_norm, rope_neox, rope_theta_of, to_tensor

__all__ = ["DraftConfig", "DraftCache", "DraftOutput", "DraftReference", "default_target_layer_ids"]

# HF's ACT2FN for the hidden_act values drafters use
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """Spec section 1: d = 1 -> [n // 2]; else round(1 + i * (n - 4) / (d - 1))."""
    n, d = n_target_layers, n_draft_layers
    if d == 1:
        return [n // 2]
    return [int(round(1 + i * (n - 4) / (d - 1))) for i in range(d)]


@dataclass(frozen=True)
class DraftConfig:
    version: int  # 1 = DFlash, 2 = DFlash 2
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    n_rot: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    logit_scale: float | None = None
    softcap: float | None = None
    embedding_scale: float | None = None
    value_scale: float | None = None
    # per layer: the block attends only to its earlier rows (z-lab's reference: config.is_causal, else
    # sliding_attention layers are causal and full_attention layers are not)
    causal_layers: tuple[bool, ...] = ()
    # sliding-window attention: in layer i with sliding_layers[i], a query at position q sees keys at
    # positions > q - sliding_window (transformers' sliding-window mask; flash-attn's window_size (W-1, W-1))
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    # the MLP gate's activation (HF hidden_act): "silu", "gelu" (exact, erf) or "gelu_pytorch_tanh"
    hidden_act: str = "silu"

    @property
    def target_layers(self) -> tuple[int, ...]:
        """GGUF `dflash.target_layers` = target_layer_ids + 1 (libllama layer-input ids)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], version: int | None = None) -> DraftConfig:
        dc = dict(cfg.get("dflash_config") or {})
        if version is None:
            archs = list(cfg.get("architectures") or [])
            if "DFlash2DraftModel" in archs:
                version = 2
            elif "DFlashDraftModel" in archs:
                version = 1
            else:
                version = 2 if "selector_top_k" in dc else 1
        n_head = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
        n_layers = int(cfg["num_hidden_layers"])
        tl = dc.get("target_layer_ids")
        if tl is None:
            tl = default_target_layer_ids(int(cfg["num_target_layers"]), n_layers)
        # dflash_config.use_swa slides every layer (ModelOpt, vLLM); else HF's use_sliding_window + layer_types
        # (z-lab's drafters: sliding_attention layers get config.sliding_window, which transformers keeps only
        # with use_sliding_window)
        types = tuple(t == "sliding_attention" for t in cfg.get("layer_types") or ["full_attention"] * n_layers)
        window, sliding = None, ()
        if dc.get("use_swa"):
            window = int(dc.get("swa_window_size") or cfg["sliding_window"])
            sliding = (True,) * n_layers
        elif cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            window, sliding = int(cfg["sliding_window"]), types
        causal = cfg.get("is_causal", dc.get("causal"))
        causal_layers = types if causal is None else (bool(causal),) * n_layers
        block_size = dc.get("block_size", cfg.get("block_size"))
        if block_size is None:
            raise KeyError("config: no dflash_config.block_size / block_size")

        def opt(key: str) -> float | None:
            v = dc.get(key, cfg.get(key))
            return None if v is None else float(v)

        c = cls(
            version=int(version),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_head,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(cfg),
            n_rot=n_rot_of(cfg, head_dim),
            block_size=int(block_size),
            mask_token_id=int(dc["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in tl),
            conv_kernel_size=int(dc.get("conv_kernel_size", 0)),
            conv_group_size=int(dc.get("conv_group_size", 0)),
            selector_rank=int(dc.get("selector_rank", 0)),
            selector_top_k=int(dc.get("selector_top_k", 0)),
            logit_scale=opt("output_multiplier"),
            softcap=opt("final_logit_softcapping"),
            embedding_scale=opt("input_embedding_scale"),
            value_scale=opt("attention_value_scale"),
            causal_layers=causal_layers,
            sliding_window=window,
            sliding_layers=sliding,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )
        if c.version == 2:
            if min(c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) <= 0:
                raise ValueError(
                    "DFlash 2 config needs conv_kernel_size, conv_group_size, selector_rank, selector_top_k > 0"
                )
            if c.hidden_size % c.conv_group_size:
                raise ValueError(f"hidden {c.hidden_size} not a multiple of conv_group_size {c.conv_group_size}")
        return c


@dataclass
class DraftCache:
    """Context K/V of every draft layer, one row per injected target position.

    k[l], v[l]: [n, kv_heads, head_dim] (k after k_norm + RoPE at its position);
    positions: [n]; g: [n, hidden] the injected context features
    hidden_norm(fc f_p), kept for inspection.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    positions: torch.Tensor
    g: torch.Tensor

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def append(self, other: DraftCache) -> DraftCache:
        self.k = [torch.cat([a, b]) for a, b in zip(self.k, other.k)]
        self.v = [torch.cat([a, b]) for a, b in zip(self.v, other.v)]
        self.positions = torch.cat([self.positions, other.positions])
        self.g = torch.cat([self.g, other.g])
        return self

    def truncate(self, n: int) -> DraftCache:
        """Keep the first n rows."""
        self.k = [t[:n] for t in self.k]
        self.v = [t[:n] for t in self.v]
        self.positions = self.positions[:n]
        self.g = self.g[:n]
        return self


@dataclass
class DraftOutput:
    tokens: torch.Tensor
    positions: torch.Tensor
    x: torch.Tensor
    h_final: torch.Tensor
    logits: torch.Tensor
    argmax: torch.Tensor
    candidates: torch.Tensor | None = None
    cand_logits: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    walk_index: torch.Tensor | None = None
    walk: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    layer_inputs: list[torch.Tensor] = field(default_factory=list)  # x entering each layer, [B, hidden]

    @property
    def draft(self) -> torch.Tensor:
        """[B-1] drafted tokens: the selector walk (DFlash 2) or per-row argmax (DFlash 1)."""
        return self.walk if self.walk is not None else self.argmax

    def scores_given(self, row: int, predecessor: int) -> torch.Tensor:
        """S_row(predecessor, candidates[row-1]) -> [k]; the predecessor must be the
        anchor (row 1) or one of candidates[row-2] (row >= 2)."""
        assert self.scores is not None and self.candidates is not None, "DFlash 2 only"
        if row == 1:
            if predecessor != int(self.tokens[0]):
                raise ValueError(f"row 1's predecessor is the anchor {int(self.tokens[0])}, not {predecessor}")
            return self.scores[0, 0]
        idx = (self.candidates[row - 2] == predecessor).nonzero()
        if idx.numel() == 0:
            raise ValueError(f"{predecessor} is not a candidate of row {row - 1}")
        return self.scores[row - 1, int(idx[0, 0])]

    def q_dense(self, temperature: float = 1.0) -> torch.Tensor:
        """[B-1, vocab] q of the greedy draft on the full vocabulary: DFlash 2 the softmax of
        the walked row's selector scores / T scattered onto the candidates (0 elsewhere),
        DFlash 1 the softmax of the row's logits / T."""
        if self.scores is None:
            return torch.softmax(self.logits[1:] / temperature, dim=-1)
        assert self.q_ids is not None and self.walk_index is not None
        rows = []
        prev = torch.zeros((), dtype=torch.long)
        for t in range(self.q_ids.shape[0]):
            s = self.scores[t, 0 if t == 0 else int(prev)]
            rows.append(torch.softmax(s / temperature, dim=-1))
            prev = self.walk_index[t]
        probs = torch.stack(rows)
        dense = torch.zeros_like(self.logits[1:])
        return dense.scatter(1, self.q_ids, probs)


class DraftReference:
    """The drafter, from an HF config dict and HF-named tensors.

    tensors: the drafter's HF tensors (numpy or torch, bf16 as torch.bfloat16 or
    raw uint16 bits; keys with or without `model.`). embed: the target's token
    embedding [vocab, hidden]; lm_head: the target's LM head [vocab, hidden].
    If embed / lm_head is None, the drafter's own `embed_tokens.weight` /
    `lm_head.weight` is used.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        tensors: Mapping[str, Any],
        embed: Any = None,
        lm_head: Any = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.cfg = DraftConfig.from_dict(config)
        self.dtype = dtype
        w: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            key = name[len("model.") :] if name.startswith("model.") else name
            w[key] = to_tensor(t, dtype)
        self.w = w
        if embed is None:
            embed = w.get("embed_tokens.weight")
        if lm_head is None:
            lm_head = w.get("lm_head.weight")
        if embed is None or lm_head is None:
            raise KeyError("the drafter needs the target's token embedding and LM head")
        self.embed = to_tensor(embed, dtype)
        self.lm_head = to_tensor(lm_head, dtype)
        c = self.cfg
        if self.embed.shape[1] != c.hidden_size or self.lm_head.shape[1] != c.hidden_size:
            raise ValueError(
                f"embedding {tuple(self.embed.shape)} / lm_head {tuple(self.lm_head.shape)} "
                f"width must equal the drafter hidden {c.hidden_size}"
            )
        fc_in = self.w["fc.weight"].shape[1]
        n_tl = len(c.target_layer_ids)
        if fc_in % n_tl:
            raise ValueError(f"fc.weight input {fc_in} is not a multiple of {n_tl} target layers")
        self.target_hidden = fc_in // n_tl
        self.vocab_size = int(self.lm_head.shape[0])

    @classmethod
    def from_hf_dir(
        cls, draft_dir: str | Path, target_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
    ) -> DraftReference:
        """Drafter HF dir + (optionally) the target HF dir that supplies embed_tokens and lm_head."""
        draft_dir = Path(draft_dir)
        config = json.loads((draft_dir / "config.json").read_text())
        tensors = load_safetensors_dir(draft_dir)
        embed = lm_head = None
        if target_dir is not None:
            target_dir = Path(target_dir)
            tcfg = json.loads((target_dir / "config.json").read_text())
            tt = load_safetensors_dir(target_dir)
            embed = tt.get("model.embed_tokens.weight", tt.get("embed_tokens.weight"))
            lm_head = tt.get("lm_head.weight")
            if lm_head is None and tcfg.get("tie_word_embeddings"):
                lm_head = embed
        return cls(config, tensors, embed, lm_head, dtype=dtype)

    # ------------------------------------------------------------------ #

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def features_from_hidden_states(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """HF target hidden_states -> f [n, n_tl * target_hidden]: cat of hidden_states[id + 1]."""
        return torch.cat([hidden_states[i + 1].to(self.dtype) for i in self.cfg.target_layer_ids], dim=-1)

    def context_features(self, features: Any) -> torch.Tensor:
        """g = hidden_norm(fc f): [n, hidden]."""
        f = to_tensor(features, self.dtype)
        return rms_norm(f @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.cfg.rms_norm_eps)

    def new_cache(self) -> DraftCache:
        c = self.cfg
        empty = torch.zeros(0, c.num_key_value_heads, c.head_dim, dtype=self.dtype)
        return DraftCache(
            k=[empty.clone() for _ in range(c.num_hidden_layers)],
            v=[empty.clone() for _ in range(c.num_hidden_layers)],
            positions=torch.zeros(0, dtype=torch.long),
            g=torch.zeros(0, c.hidden_size, dtype=self.dtype),
        )

    @torch.no_grad()
    def inject(self, features: Any, positions: Iterable[int], cache: DraftCache | None = None) -> DraftCache:
        """Context injection of target features at `positions`.

        features: [n, n_tl * target_hidden]; for each draft layer l:
        K = rope(k_norm(W_k g), p), V = W_v g with g = hidden_norm(fc f).
        Appends to `cache` in place (returned), or to a new cache.
        """
        c, w = self.cfg, self.w
        f = to_tensor(features, self.dtype)
        if f.dim() != 2 or f.shape[1] != self.target_hidden * len(c.target_layer_ids):
            raise ValueError(f"features {tuple(f.shape)}: expected [n, {self.target_hidden * len(c.target_layer_ids)}]")
        pos = torch.as_tensor(list(positions), dtype=torch.long)
        if pos.shape[0] != f.shape[0]:
            raise ValueError(f"{f.shape[0]} feature rows but {pos.shape[0]} positions")
        g = self.context_features(f)
        n = g.shape[0]
        ks, vs = [], []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            k = (g @ w[p + "k_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            k = rope_neox(rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps), pos, c.rope_theta, c.n_rot)
            v = (g @ w[p + "v_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            ks.append(k)
            vs.append(v)
        new = DraftCache(k=ks, v=vs, positions=pos, g=g)
        return new if cache is None else cache.append(new)

    # ------------------------------------------------------------------ #

    def _conv_kernel(self, h: torch.Tensor, prefix: str) -> torch.Tensor:
        """c = W_proj h -> w [B, 2, K, hidden] = base + c broadcast over each group."""
        c = self.cfg
        K, gs = c.conv_kernel_size, c.conv_group_size
        G = c.hidden_size // gs
        coef = (h @ self.w[prefix + "kernel_projection.weight"].T).view(h.shape[0], 2, K, G)
        coef = coef.repeat_interleave(gs, dim=-1)  # channel ch uses group ch // gs
        return self.w[prefix + "base_kernel"][None] + coef  # [B, 2, K, hidden]

    @staticmethod
    def _conv(y: torch.Tensor, wk: torch.Tensor, side: int) -> torch.Tensor:
        """conv(y)[t] = sum_{tap < min(K, B)} wk[t, side, tap] * y[t - tap], y[<0] = 0."""
        B, K = y.shape[0], wk.shape[2]
        out = torch.zeros_like(y)
        for tap in range(min(K, B)):
            out[tap:] += wk[tap:, side, tap] * y[: B - tap]
        return out

    @torch.no_grad()
    def draft(self, cache: DraftCache, anchor: int, position: int) -> DraftOutput:
        """One block [anchor, MASK x (B-1)] at positions position .. position+B-1."""
        c, w = self.cfg, self.w
        B = c.block_size
        tokens = torch.tensor([int(anchor)] + [c.mask_token_id] * (B - 1), dtype=torch.long)
        pos = torch.arange(position, position + B, dtype=torch.long)
        # which keys each block row sees, per layer
        key_pos = torch.cat([cache.positions.to(torch.long), pos])
        ahead = key_pos[None, :] - pos[:, None]  # key position - query position, [B, n_ctx + B]
        masks = []
        for i in range(c.num_hidden_layers):
            causal = c.causal_layers[i]
            visible = ahead <= 0 if causal else torch.ones_like(ahead, dtype=torch.bool)
            if c.sliding_window is not None and c.sliding_layers[i]:
                visible = visible & (-ahead < c.sliding_window)
                if not causal:
                    visible = visible & (ahead < c.sliding_window)
            masks.append(visible)
        x = self.embed[tokens]
        if c.embedding_scale is not None:
            x = x * c.embedding_scale
        layer_inputs = []
        for i in range(c.num_hidden_layers):
            layer_inputs.append(x)
            p = f"layers.{i}."
            a = p + "self_attn."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            if c.version == 2:
                wk = self._conv_kernel(h, p + "attention_conv.")
                h = self._conv(h, wk, 0)
            q = (h @ w[a + "q_proj.weight"].T).view(B, c.num_attention_heads, c.head_dim)
            k = (h @ w[a + "k_proj.weight"].T).view(B, c.num_key_value_heads, c.head_dim)
            v = (h @ w[a + "v_proj.weight"].T).view(B, c.num_key_value_heads, c.head_dim)
            q = rope_neox(rms_norm(q, w[a + "q_norm.weight"], c.rms_norm_eps), pos, c.rope_theta, c.n_rot)
            k = rope_neox(rms_norm(k, w[a + "k_norm.weight"], c.rms_norm_eps), pos, c.rope_theta, c.n_rot)
            o = attention(q, torch.cat([cache.k[i], k]), torch.cat([cache.v[i], v]), masks[i])
            o = o @ w[a + "o_proj.weight"].T
            if c.value_scale is not None:
                o = o * c.value_scale
            if c.version == 2:
                o = self._conv(o, wk, 1)
            x = x + o
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            if c.version == 2:
                wk = self._conv_kernel(h, p + "mlp_conv.")
                h = self._conv(h, wk, 0)
            m = ACTIVATIONS[c.hidden_act](h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            m = m @ w[p + "mlp.down_proj.weight"].T
            if c.version == 2:
                m = self._conv(m, wk, 1)
            x = x + m
        h_final = rms_norm(x, w["norm.weight"], c.rms_norm_eps)
        logits = h_final @ self.lm_head.T
        if c.logit_scale is not None:
            logits = logits * c.logit_scale
        if c.softcap is not None:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        out = DraftOutput(
            tokens=tokens,
            positions=pos,
            x=x,
            h_final=h_final,
            logits=logits,
            argmax=logits[1:].argmax(dim=-1),
            layer_inputs=layer_inputs,
        )
        if c.version == 2:
            self._select(out)
        return out

    def _select(self, out: DraftOutput) -> None:
        """The DFlash 2 selector and greedy walk over rows 1..B-1."""
        c, w = self.cfg, self.w
        k = c.selector_top_k
        P = w["candidate_selector.predecessor_codebook"]  # [vocab, R]
        N = w["candidate_selector.successor_codebook"]  # [vocab, R]
        rows = out.logits[1:]  # [B-1, vocab]
        cand_logits, cand = torch.topk(rows, k, dim=-1, largest=True, sorted=True)
        gate = out.h_final[1:] @ w["candidate_selector.hidden_projection.weight"].T  # [B-1, R]
        preds = torch.cat([out.tokens[:1].repeat(k)[None], cand[:-1]])  # [B-1, k]; row 1: anchor x k
        # S[t, i, j] = U[t, j] + sum_r P[pred_i, r] gate[t, r] N[cand_j, r]
        scores = cand_logits[:, None, :] + torch.einsum("tir,tr,tjr->tij", P[preds], gate, N[cand])
        walk_index = torch.empty(rows.shape[0], dtype=torch.long)
        q_probs = torch.empty_like(cand_logits)
        prev = 0  # row 1: any predecessor index reads the anchor's row
        for t in range(rows.shape[0]):
            s = scores[t, prev]
            walk_index[t] = int(s.argmax())
            q_probs[t] = torch.softmax(s, dim=-1)
            prev = int(walk_index[t])
        out.candidates = cand
        out.cand_logits = cand_logits
        out.gate = gate
        out.scores = scores
        out.walk_index = walk_index
        out.walk = cand.gather(1, walk_index[:, None])[:, 0]
        out.q_ids = cand
        out.q_probs = q_probs
