"""Inflated tinycode pairs: realistic Qwen3 shapes that compute exactly the bundled pair's function.

`dflash bench --scale` needs targets of a realistic size whose drafter is accepted as often as a trained
one, and no pair larger than the bundled 5.8M one exists here. So the bundled pair is inflated: every
tensor gets the shape of a Qwen3-0.6B/1.7B/4B/8B (and of a 5-layer DFlash2 drafter for it), the real
weights sit inside, and what is added cannot change the result:

- hidden: the real dimensions are 0..h-1, the rest stay zero in the residual stream (no weight writes
  them). RMSNorm over H dimensions of which h are real is the real one times sqrt(H/h) if eps is
  scaled by h/H, so every hidden norm's weight is scaled by sqrt(h/H) and eps is eps * h/H.
- heads: head_dim 64 -> 128 by interleaving: real dimension i of a half sits at 2i of the new half,
  so NeoX RoPE's frequency base^(-2(2i)/128) is the real base^(-2i/64); the other dimensions are zero.
  The attention scale 1/sqrt(128) instead of 1/8 is made up in q_norm (x sqrt 2) and the RMSNorm over
  twice the dimensions in both norms (/ sqrt 2): q_norm keeps its weights, k_norm's are / sqrt 2.
  Added query heads read added (zero) KV heads; their output columns are zero.
- FFN width: added units have zero weights. Layers: the real ones at positions that keep the drafter's
  feature layers after the same real layers; the others have zero weights (their output adds nothing).
- vocabulary: padded to 151,936 as Qwen3's, so the LM head costs what a real one does. A padded token's
  logit must stay below every real one, for greedy choices, the drafter's top-k candidates and sampling
  alike. The last layer (an added one) writes a small positive constant M = a c sum(h_i^2) ~ 1e-3 into
  the spare dimension d* = H-1 (FFN units silu(z) z + silu(-z)(-z) = z^2 over the normed real
  dimensions); the final norm weights d* by G and every padded LM-head row is -L on d* alone, so a padded
  logit is about -L G M sqrt(H) / |x|, below -1e3 for any residual norm |x| < 1e4. M is far below |x|, so
  the real logits change by a common factor 1 - O(M^2/|x|^2) (< 1e-8): argmax, top-k, the selector's
  walk (scores scale by the same factor) and probabilities are the real pair's. The drafter's final
  norm and last layer do the same.
- drafter: its 2 real layers first, 3 added ones (the last one writes d*), 5 feature layers (the DFlash
  default spread of the target's layers) of which two carry the real features, the conv kernels of the
  added channels the identity, the selector codebooks' padded rows zero.

The Qwen3.5 hybrid (`arch` qwen35, as libllama 0.3.36 loads it): tinycode's layers are the attention layers
(every `attention_every`-th), the rest Gated DeltaNet layers with zero weights (a zero input, so a zero
state: their cost and their recurrent state, which a rejected draft rolls back, are a hybrid's, their
output nothing). Its attention is gated (the query projection's gate rows zero: sigmoid(0) = 1/2, made up by
a doubled output projection) and rotates `n_rot` of each head's dimensions: with `n_rot` = the source's head
size, a source head's dimensions sit first in the head as they are (the rotated part keeps their
frequencies), the same norm and scale corrections as above for the rest. A real feature layer sits on the
last attention layer at or before its new feature layer (the added layers up to it change nothing). The
drafter keeps Qwen3's attention, of a shape of its own (`draft_heads`).

The Qwen3 MoE (`arch` qwen3moe): every expert of a layer is that layer's FFN (tinycode's is 768 wide, as a
Qwen3-30B-A3B expert is), so whichever experts a token is routed to, the top-k weights, which Qwen3 MoE
normalizes to sum to 1, give the FFN's output. The router is random (fixed seeds), so tokens are routed apart by
their hidden states and a verified block reads the experts all its tokens pick, as a real MoE's does; an added
layer's FFN norm is the plain RMSNorm, so its router sees the hidden state too (its experts are zero). How often
consecutive tokens share experts is a trained router's and is not reproduced: random routing shares the least.
The Qwen3.5 MoE hybrid (`arch` qwen35moe) is the hybrid with every layer's FFN split between a shared expert
and the routed ones, as narrow as Qwen3.5's: the shared expert holds the FFN's first `shared_ff` units (its
sigmoid gate's weights zero: 1/2, which a doubled down projection makes up), every routed expert the rest.

Left as is: rope_theta (10,000, the pair's), block size 8 (what the drafter was trained for), and one
eps for all norms, so q_norm and k_norm see eps * h/H where eps/2 would be exact (a relative change
below 1e-6 in their output). Files are cached under names with a hash of everything that shapes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

GENERATOR_VERSION = 1  # part of every cached file's name: bump it when the generated files change
TARGET_TYPES = ("f16", "q8_0", "q4_k_m")
DRAFT_TYPE = "q4_0"  # the fastest drafter type on a CPU (README)

# the spare dimension's constant and weights (module docstring): M = A * C * sum(h^2) with sum(h^2) ~ H
PAD_LOGIT_WEIGHT = -32768.0  # L, exact in F16 and every quantized type's scale
SPARE_NORM_WEIGHT = 1e4  # G, in an F32 norm
SPARE_TARGET = 2.0**-10  # M


# fields the Qwen3 sizes leave at their defaults: hashed only where set, so those sizes keep their files' names
_OPTIONAL_FIELDS = {
    "arch",
    "n_rot",
    "attention_every",
    "ssm_k_heads",
    "ssm_v_heads",
    "ssm_head_dim",
    "draft_heads",
    "n_experts",
    "n_experts_used",
    "expert_ff",
    "shared_ff",
}


@dataclass(frozen=True)
class ScaleSize:
    """A target shape and its 5-layer DFlash2 drafter (same hidden size and FFN width): a Qwen3 (`qwen3`), a
    Qwen3.5 hybrid (`qwen35`: Gated DeltaNet layers with attention every `attention_every`-th layer, gated
    attention over `n_rot` of `head_dim` dimensions, the drafter's attention of its own shape), or a Qwen3 MoE
    (`qwen3moe`: `n_experts` experts of width `expert_ff` per layer, `n_experts_used` routed per token; `ff`
    is the drafter's FFN width), or a Qwen3.5 MoE hybrid (`qwen35moe`: both, and a shared expert of width
    `shared_ff` in every layer)."""

    name: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    vocab: int = 151936
    draft_layers: int = 5
    arch: str = "qwen3"
    n_rot: int = 0  # rotated dimensions of a head; 0: all of them
    attention_every: int = 1
    ssm_k_heads: int = 0  # Gated DeltaNet key heads (and query heads), value heads, their head size
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    draft_heads: tuple[int, int, int] = (0, 0, 0)  # the drafter's query heads, KV heads, head size; 0s: the target's
    n_experts: int = 0  # qwen3moe, qwen35moe: experts per layer, routed per token, an expert's FFN width
    n_experts_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0  # qwen35moe: the shared expert's FFN width

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet layers and gated attention (Qwen3.5)."""
        return self.arch in ("qwen35", "qwen35moe")

    @property
    def moe(self) -> bool:
        return self.arch in ("qwen3moe", "qwen35moe")

    @property
    def target_ff(self) -> int:
        """The width of the dense FFN a target layer is inflated as: a MoE's shared expert takes its first
        `shared_ff` units, each routed expert the rest."""
        return self.shared_ff + self.expert_ff if self.moe else self.ff

    def layer_ids(self) -> list[int]:
        """The drafter's feature layers (HF ids): the DFlash default spread."""
        from dflash_convert.config import default_target_layer_ids

        return default_target_layer_ids(self.n_layers, self.draft_layers)

    def key(self) -> str:
        """Short hash of everything that shapes the generated files (the name aside; the optional fields only
        where set, so that the Qwen3 sizes keep the names of their files)."""
        defaults = {f.name: f.default for f in fields(self)}
        shape = {k: v for k, v in asdict(self).items() if k not in _OPTIONAL_FIELDS or v != defaults[k]}
        blob = json.dumps([GENERATOR_VERSION, shape | {"name": ""}], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.attention_every == 0

    def draft_shape(self) -> tuple[int, int, int]:
        return self.draft_heads if self.draft_heads[0] else (self.n_heads, self.n_kv_heads, self.head_dim)

    def ssm_dims(self) -> tuple[int, int]:
        """(the QKV projection's rows = the conv's channels, the value width) of a Gated DeltaNet layer."""
        value = self.ssm_v_heads * self.ssm_head_dim
        return 2 * self.ssm_k_heads * self.ssm_head_dim + value, value

    def _attention_params(self, heads: int, kv_heads: int, head_dim: int, gated: bool) -> int:
        q, kv = heads * head_dim, kv_heads * head_dim
        return self.hidden * (q * (2 if gated else 1) + 2 * kv + q)

    def target_params(self) -> int:
        attention = self._attention_params(self.n_heads, self.n_kv_heads, self.head_dim, self.hybrid)
        qkv, value = self.ssm_dims()
        delta_net = self.hidden * (qkv + 2 * value + 2 * self.ssm_v_heads)
        n_attention = sum(self.is_attention(i) for i in range(self.n_layers))
        mixers = n_attention * attention + (self.n_layers - n_attention) * delta_net
        if self.moe:  # the experts, the router, a shared expert and its gate
            ffn = (self.n_experts * (3 * self.expert_ff + 1) + 3 * self.shared_ff + (self.shared_ff > 0)) * self.hidden
        else:
            ffn = 3 * self.hidden * self.ff
        return 2 * self.vocab * self.hidden + mixers + self.n_layers * ffn

    def draft_params(self) -> int:
        """The drafter's own weights (the LM head is the target's)."""
        per_layer = self._attention_params(*self.draft_shape(), gated=False) + 3 * self.hidden * self.ff
        return self.draft_layers * per_layer + self.hidden * self.hidden * len(self.layer_ids())


# a Qwen3.5-style hybrid (3 Gated DeltaNet layers per attention layer, gated attention with 64 of 256 dimensions
# rotated, Qwen3.5's vocabulary) of 2.8B parameters; the drafter's attention as Qwen3's
_HYBRID = ScaleSize(
    "2.8B-hybrid",
    hidden=2048,
    n_layers=32,
    n_heads=8,
    n_kv_heads=2,
    head_dim=256,
    ff=6144,
    vocab=248320,
    arch="qwen35",
    n_rot=64,
    attention_every=4,
    ssm_k_heads=16,
    ssm_v_heads=16,
    ssm_head_dim=128,
    draft_heads=(16, 8, 128),
)

# shaped like Qwen3-0.6B, -1.7B, -4B, -8B (untied embeddings: the bundled pair's are untied), and the above
SIZES = {
    "0.6B": ScaleSize("0.6B", hidden=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ff=3072),
    "1.7B": ScaleSize("1.7B", hidden=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ff=6144),
    "4B": ScaleSize("4B", hidden=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ff=9728),
    "8B": ScaleSize("8B", hidden=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ff=12288),
    "2.8B-hybrid": _HYBRID,
    # Qwen3-30B-A3B's (and Qwen3-Coder-30B-A3B's) layer: hidden 2048, 32/4 heads of 128, experts of width 768
    # of which 1 in 16 is routed per token; a quarter of its depth and half of its experts (64, 4 routed), so
    # that the F16 file fits this machine's disk and memory; the drafter's FFN as the published one's
    "4.5B-moe": ScaleSize(
        "4.5B-moe",
        hidden=2048,
        n_layers=12,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ff=6144,
        arch="qwen3moe",
        n_experts=64,
        n_experts_used=4,
        expert_ff=768,
    ),
    # Qwen3.5-35B-A3B's (and Qwen3.6-35B-A3B's) layers: the 2.8B-hybrid's with 16 query and 32 value heads,
    # in every layer a shared expert and routed experts, all 512 wide; its 32 layers (theirs 40), 48 experts
    # with 6 routed (1 in 8; theirs 8 of 256), so that the F16 file fits this machine's disk and memory
    "7B-hybrid-moe": replace(
        _HYBRID,
        name="7B-hybrid-moe",
        n_heads=16,
        ssm_v_heads=32,
        arch="qwen35moe",
        n_experts=48,
        n_experts_used=6,
        expert_ff=512,
        shared_ff=512,
    ),
}


def default_scale_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-gguf" / "scale"


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


# --- the source pair ---------------------------------------------------------------------------


@dataclass
class Source:
    """The bundled pair's tensors as float32 (target by GGUF name, drafter by HF key) and shapes."""

    target: dict[str, np.ndarray]
    draft: dict[str, np.ndarray]
    draft_config: dict[str, Any]
    tokenizer: dict[str, Any]  # tokenizer.ggml.* fields of the target GGUF
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    eps: float
    rope_theta: float
    context_length: int


def tinycode_dir() -> Path:
    """The bundled pair that --scale inflates: $DFLASH_TINYCODE, else examples/tinycode of the checkout
    this package runs from (an editable install) or of the working directory (an installed wheel does
    not ship the pair)."""
    from .options import BenchError

    env = os.environ.get("DFLASH_TINYCODE")
    checkout = Path(__file__).resolve().parents[3]
    places = [Path(env)] if env else [checkout / "examples" / "tinycode", Path.cwd() / "examples" / "tinycode"]
    for p in places:
        if (p / "target-f16.gguf").is_file() and (p / "drafter-dflash2").is_dir():
            return p
    raise BenchError(
        f"the bundled tinycode pair (target-f16.gguf and drafter-dflash2/) is not in "
        f"{' or '.join(map(str, places))}: run from a dflash-gguf checkout or point $DFLASH_TINYCODE at its "
        "examples/tinycode"
    )


def load_source(folder: Path | None = None) -> Source:
    from gguf import GGUFReader

    from dflash_convert.source import open_source

    folder = folder or tinycode_dir()
    path = folder / "target-f16.gguf"
    r = GGUFReader(path)
    fields = {name: f.contents() for name, f in r.fields.items() if not name.startswith("GGUF.")}
    target = {
        t.name: np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        for t in r.tensors
    }
    cfg = json.loads((folder / "drafter-dflash2" / "config.json").read_text())
    src = open_source(folder / "drafter-dflash2")
    draft = {}
    for key, ref in src.refs.items():
        rows, _ = ref.nrows_ncols
        draft[key] = ref.rows(0, rows).reshape(ref.shape)
    a = fields["general.architecture"]
    return Source(
        target=target,
        draft=draft,
        draft_config=cfg,
        tokenizer={k: v for k, v in fields.items() if k.startswith("tokenizer.ggml.")},
        hidden=int(fields[f"{a}.embedding_length"]),
        n_layers=int(fields[f"{a}.block_count"]),
        n_heads=int(fields[f"{a}.attention.head_count"]),
        n_kv_heads=int(fields[f"{a}.attention.head_count_kv"]),
        head_dim=int(fields[f"{a}.attention.key_length"]),
        ff=int(fields[f"{a}.feed_forward_length"]),
        vocab=target["token_embd.weight"].shape[0],
        eps=float(fields[f"{a}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(fields[f"{a}.rope.freq_base"]),
        context_length=int(fields[f"{a}.context_length"]),
    )


# --- the inflation -----------------------------------------------------------------------------


@dataclass
class HeadMap:
    """Where the source's attention sits in `heads` query heads of `head_dim` dimensions over `kv_heads` KV
    heads: its query heads spread over the groups (GQA), each source dimension at `dims` of a head; a gated
    query projection (Qwen3.5) has each head's gate rows after its query rows."""

    heads: int
    kv_heads: int
    head_dim: int
    gated: bool
    dims: np.ndarray  # a source head's dimensions in a head
    scale: int  # head_dim / the source's
    q_rows: np.ndarray  # rows of the query projection
    o_cols: np.ndarray  # columns of the output projection
    kv_rows: np.ndarray  # rows of the K and V projections

    @classmethod
    def build(cls, src: Source, heads: int, kv_heads: int, head_dim: int, n_rot: int, gated: bool) -> HeadMap:
        m = head_dim // src.head_dim
        half_src, half = src.head_dim // 2, head_dim // 2
        if n_rot == src.head_dim:  # rotated dimensions first, as the source's: the frequencies match as they are
            dims = np.arange(src.head_dim)
        else:  # all rotated: NeoX pairs (i, i + half); source pair i at 2i keeps its frequency (module docstring)
            dims = np.array([(j // half_src) * half + m * (j % half_src) for j in range(src.head_dim)])
        group_src, group = src.n_heads // src.n_kv_heads, heads // kv_heads
        q_heads = [(i // group_src) * group + i % group_src for i in range(src.n_heads)]
        stride = head_dim * (2 if gated else 1)
        return cls(
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            gated=gated,
            dims=dims,
            scale=m,
            q_rows=np.concatenate([q * stride + dims for q in q_heads]),
            o_cols=np.concatenate([q * head_dim + dims for q in q_heads]),
            kv_rows=np.concatenate([k * head_dim + dims for k in range(src.n_kv_heads)]),
        )

    @staticmethod
    def problems(src: Source, what: str, heads: int, kv_heads: int, head_dim: int, n_rot: int) -> list[str]:
        out = []
        if head_dim % src.head_dim:
            out.append(f"{what}head_dim {head_dim} must be a multiple of {src.head_dim}")
        if n_rot not in (head_dim, src.head_dim):
            out.append(f"{what}rotary dimensions {n_rot} must be {head_dim} or {src.head_dim}")
        if kv_heads < src.n_kv_heads or heads // kv_heads < src.n_heads // src.n_kv_heads:
            out.append(f"{what}{heads}/{kv_heads} heads cannot hold {src.n_heads}/{src.n_kv_heads}")
        return out


class Inflation:
    """Index maps from the source's dimensions into a size's, and the inflated tensors by name."""

    def __init__(self, src: Source, s: ScaleSize) -> None:
        self.src, self.s = src, s
        h, H = src.hidden, s.hidden
        problems = []
        if H < h + 1 or H % 16:
            problems.append(f"hidden {H} must be a multiple of 16 above {h}")
        n_rot = s.n_rot or s.head_dim
        problems += HeadMap.problems(src, "", s.n_heads, s.n_kv_heads, s.head_dim, n_rot)
        dh, dkv, dd = s.draft_shape()
        problems += HeadMap.problems(src, "drafter ", dh, dkv, dd, dd)
        if s.arch not in ("qwen3", "qwen35", "qwen3moe", "qwen35moe"):
            problems.append(f"arch {s.arch!r} must be qwen3, qwen35, qwen3moe or qwen35moe")
        if s.ff < src.ff or s.ff < 2 * h:
            problems.append(f"ff {s.ff} must be >= {max(src.ff, 2 * h)}")
        if s.moe:
            if s.expert_ff < 1 or s.target_ff < src.ff or s.target_ff < 2 * h:
                problems.append(f"expert_ff {s.expert_ff} + shared_ff {s.shared_ff} must be >= {max(src.ff, 2 * h)}")
            if not 1 <= s.n_experts_used <= s.n_experts:
                problems.append(f"{s.n_experts_used} of {s.n_experts} experts routed: must be 1 to {s.n_experts}")
        if s.vocab < src.vocab:
            problems.append(f"vocab {s.vocab} must be >= {src.vocab}")
        self.slots = self._feature_slots()
        self.real_layers = self._place_layers()
        if self.real_layers is None:
            problems.append(
                f"{s.n_layers} layers cannot hold the {src.n_layers} real ones around the feature "
                f"layers {s.layer_ids()}"
            )
        if problems:
            raise ValueError(f"size {s.name}: " + "; ".join(problems))
        self.spare = H - 1
        self.norm_scale = math.sqrt(h / H)
        self.eps = src.eps * h / H
        self.target_heads = HeadMap.build(src, s.n_heads, s.n_kv_heads, s.head_dim, n_rot, s.hybrid)
        self.draft_heads = HeadMap.build(src, dh, dkv, dd, dd, gated=False)
        self.hid = np.arange(h)
        self.ffr = np.arange(src.ff)
        self.tok = np.arange(src.vocab)

    # layout

    def _place_layers(self) -> list[int] | None:
        """Positions of the real target layers, among the attention layers: each real feature layer at or
        before its new feature layer and the next real layer after it (added layers in between leave the
        residual stream as it is), the last layer an added one (it writes d*)."""
        ids_src = list(self.src.draft_config["dflash_config"]["target_layer_ids"])
        ids = self.s.layer_ids()
        slots = self.slots
        if slots is None:
            return None
        allowed = [p for p in range(self.s.n_layers - 1) if self.s.is_attention(p)]
        pos, nxt = [], 0
        for r in range(self.src.n_layers):
            after = [p for p in allowed if p >= nxt]
            if r in ids_src:
                feature = ids[slots[ids_src.index(r)]]
                at = [p for p in after if p <= feature]
                if not at:
                    return None
                pos.append(at[-1])
                nxt = feature + 1
            else:
                if not after:
                    return None
                pos.append(after[0])
                nxt = after[0] + 1
        return pos

    def _feature_slots(self) -> list[int] | None:
        """Which of the new feature layers carry the real ones: spread like the real ids among the real layers."""
        ids_src = list(self.src.draft_config["dflash_config"]["target_layer_ids"])
        n_new = len(self.s.layer_ids())
        if len(ids_src) > n_new:
            return None
        slots = [1 + 2 * i for i in range(len(ids_src))]  # [1, 3] of 5: tinycode's [1, 3] of its 6 layers
        return slots if slots[-1] < n_new else list(range(len(ids_src)))

    # helpers

    @staticmethod
    def _place(shape: tuple[int, ...], value: np.ndarray | None, *index: np.ndarray) -> np.ndarray:
        out = np.zeros(shape, np.float32)
        if value is not None:
            out[np.ix_(*index)] = value
        return out

    def hidden_norm(self, w: np.ndarray, spare: float = 0.0) -> np.ndarray:
        out = self._place((self.s.hidden,), w * self.norm_scale, self.hid)
        out[self.spare] = spare
        return out

    def _spare_writer(self, gate: str, up: str, down: str, norm: str, ff: int) -> dict[str, np.ndarray]:
        """An FFN of width `ff` whose output is M on d* (z^2 = silu(z) z + silu(-z) (-z) summed over the normed
        real dims)."""
        H, h = self.s.hidden, self.src.hidden
        a = c = math.sqrt(SPARE_TARGET / H)
        g, u, d = np.zeros((ff, H), np.float32), np.zeros((ff, H), np.float32), np.zeros((H, ff), np.float32)
        for i in range(h):
            for sign, unit in ((1.0, 2 * i), (-1.0, 2 * i + 1)):
                g[unit, i], u[unit, i] = sign, sign * a
        d[self.spare, : 2 * h] = c
        return {norm: self._place((H,), np.ones(h, np.float32), self.hid), gate: g, up: u, down: d}

    def _layer(
        self, names: dict[str, str], real: dict[str, np.ndarray] | None, last: bool, hm: HeadMap, ff: int
    ) -> dict[str, np.ndarray]:
        """One transformer layer's tensors under `names` (role -> tensor name), its FFN `ff` wide, from `real`
        (role -> source tensor) or, for an added layer, zero (the last one writes d*). A gated attention's
        gates are zero: sigmoid(0) = 1/2 on every output, which the doubled output projection makes up."""
        H = self.s.hidden
        q, kv = hm.heads * hm.head_dim, hm.kv_heads * hm.head_dim
        r = real or {}
        o = r.get("o")
        out = {
            names["attn_norm"]: self.hidden_norm(r["attn_norm"]) if real else np.zeros(H, np.float32),
            names["q"]: self._place((q * (2 if hm.gated else 1), H), r.get("q"), hm.q_rows, self.hid),
            names["k"]: self._place((kv, H), r.get("k"), hm.kv_rows, self.hid),
            names["v"]: self._place((kv, H), r.get("v"), hm.kv_rows, self.hid),
            names["o"]: self._place((H, q), None if o is None else o * (2 if hm.gated else 1), self.hid, hm.o_cols),
            names["q_norm"]: self._place((hm.head_dim,), r.get("q_norm"), hm.dims),
            names["k_norm"]: self._place(
                (hm.head_dim,), None if not real else r["k_norm"] / math.sqrt(hm.scale), hm.dims
            ),
            names["ffn_norm"]: self.hidden_norm(r["ffn_norm"]) if real else np.zeros(H, np.float32),
            names["gate"]: self._place((ff, H), r.get("gate"), self.ffr, self.hid),
            names["up"]: self._place((ff, H), r.get("up"), self.ffr, self.hid),
            names["down"]: self._place((H, ff), r.get("down"), self.hid, self.ffr),
        }
        if last:
            out.update(self._spare_writer(names["gate"], names["up"], names["down"], names["ffn_norm"], ff))
        return out

    def _experts(self, i: int, layer: dict[str, np.ndarray], real: bool) -> dict[str, np.ndarray]:
        """Layer i's FFN as a MoE: a shared expert its first units (gated by 1/2, so twice their down
        projection), every routed expert the rest, so any routing with top-k weights summing to 1 (Qwen3 MoE's)
        gives its output, and a random router, so that tokens are routed apart as a real MoE's are and a
        verified block reads the experts several tokens pick. An added layer's FFN norm is the plain RMSNorm
        (its experts are zero): with a zero norm every token would pick the same experts."""
        s, p = self.s, f"blk.{i}."
        norm = f"{p}{_attention_names(s)['ffn_norm']}.weight"
        dense = {role: layer.pop(f"{p}ffn_{role}.weight") for role in ("gate", "up", "down")}
        if not real and not layer[norm].any():
            layer[norm] = self.hidden_norm(np.ones(self.src.hidden, np.float32))
        rng = np.random.default_rng(i)
        layer[p + "ffn_gate_inp.weight"] = rng.standard_normal((s.n_experts, s.hidden)).astype(np.float32) / math.sqrt(
            self.src.hidden
        )
        shared, routed = slice(0, s.shared_ff), slice(s.shared_ff, None)
        for role, w in dense.items():
            w = w[:, routed] if role == "down" else w[routed]
            layer[f"{p}ffn_{role}_exps.weight"] = np.broadcast_to(w, (s.n_experts, *w.shape))
        if s.shared_ff:
            layer[p + "ffn_gate_inp_shexp.weight"] = np.zeros(s.hidden, np.float32)
            layer[p + "ffn_gate_shexp.weight"] = dense["gate"][shared]
            layer[p + "ffn_up_shexp.weight"] = dense["up"][shared]
            layer[p + "ffn_down_shexp.weight"] = 2 * dense["down"][:, shared]
        return layer

    # the target (GGUF names)

    def target_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """In target_shapes' order: F16 matrices, F32 vectors (and convolutions)."""
        s, t = self.s, self.src.target
        embd = self._place((s.vocab, s.hidden), t["token_embd.weight"], self.tok, self.hid)
        yield "token_embd.weight", embd.astype(np.float16)
        del embd
        for i in range(s.n_layers):
            last, real = i == s.n_layers - 1, None
            if s.is_attention(i):
                names = {role: f"blk.{i}.{name}.weight" for role, name in _attention_names(s).items()}
                if i in self.real_layers:
                    r = self.real_layers.index(i)
                    real = {role: t[f"blk.{r}.{name}.weight"] for role, name in _attention_names().items()}
                values = self._layer(names, real, last, self.target_heads, s.target_ff)
            else:
                values = self._delta_net_layer(i, last)
            if s.moe:
                values = self._experts(i, values, real is not None)
            for name in _layer_shapes(s, i):
                yield name, values[name].astype(_file_dtype(name, values[name].ndim))
        yield "output_norm.weight", self.hidden_norm(t["output_norm.weight"], SPARE_NORM_WEIGHT)
        yield "output.weight", self.lm_head(t["output.weight"]).astype(np.float16)

    def _delta_net_layer(self, i: int, last: bool) -> dict[str, np.ndarray]:
        """An added Gated DeltaNet layer: zero weights (its input is zero, so its state stays zero), a decay
        and norm that keep that state finite; the last layer's FFN writes d*."""
        shapes, p = _dense_layer_shapes(self.s, i), f"blk.{i}."
        out = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        out[p + "ssm_a"][:] = -1.0
        out[p + "ssm_dt.bias"][:] = 1.0
        out[p + "ssm_norm.weight"][:] = 1.0
        if last:
            out.update(
                self._spare_writer(
                    p + "ffn_gate.weight",
                    p + "ffn_up.weight",
                    p + "ffn_down.weight",
                    p + "post_attention_norm.weight",
                    self.s.target_ff,
                )
            )
        return out

    def lm_head(self, w: np.ndarray) -> np.ndarray:
        out = self._place((self.s.vocab, self.s.hidden), w, self.tok, self.hid)
        out[self.src.vocab :, self.spare] = PAD_LOGIT_WEIGHT
        return out

    # the drafter (HF keys)

    def draft_config(self) -> dict[str, Any]:
        s, c = self.s, dict(self.src.draft_config)
        dc = dict(c["dflash_config"])
        dc["target_layer_ids"] = s.layer_ids()
        c.update(
            hidden_size=s.hidden,
            num_hidden_layers=s.draft_layers,
            num_attention_heads=self.draft_heads.heads,
            num_key_value_heads=self.draft_heads.kv_heads,
            head_dim=self.draft_heads.head_dim,
            intermediate_size=s.ff,
            rms_norm_eps=self.eps,
            vocab_size=s.vocab,
            num_target_layers=s.n_layers,
            dflash_config=dc,
            torch_dtype="float16",
        )
        return c

    def draft_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        s, d, src = self.s, self.src.draft, self.src
        H, h = s.hidden, src.hidden
        n_feat = len(s.layer_ids())
        fc = np.zeros((H, n_feat * H), np.float32)
        for k, slot in enumerate(self.slots or []):
            fc[np.ix_(self.hid, slot * H + self.hid)] = d["fc.weight"][:, k * h : (k + 1) * h]
        yield "fc.weight", fc
        yield "hidden_norm.weight", self.hidden_norm(d["hidden_norm.weight"])
        yield "norm.weight", self.hidden_norm(d["norm.weight"], SPARE_NORM_WEIGHT)
        roles = {
            "attn_norm": "input_layernorm",
            "q": "self_attn.q_proj",
            "k": "self_attn.k_proj",
            "v": "self_attn.v_proj",
            "o": "self_attn.o_proj",
            "q_norm": "self_attn.q_norm",
            "k_norm": "self_attn.k_norm",
            "ffn_norm": "post_attention_layernorm",
            "gate": "mlp.gate_proj",
            "up": "mlp.up_proj",
            "down": "mlp.down_proj",
        }
        n_src = src.draft_config["num_hidden_layers"]
        for i in range(s.draft_layers):
            names = {role: f"layers.{i}.{name}.weight" for role, name in roles.items()}
            real = {role: d[f"layers.{i}.{name}.weight"] for role, name in roles.items()} if i < n_src else None
            yield from self._layer(names, real, i == s.draft_layers - 1, self.draft_heads, s.ff).items()
            for conv in ("attention_conv", "mlp_conv"):
                p = f"layers.{i}.{conv}."
                yield from self._conv(
                    p,
                    d.get(p + "base_kernel") if i < n_src else None,
                    d.get(p + "kernel_projection.weight") if i < n_src else None,
                )
        for book in ("predecessor_codebook", "successor_codebook"):
            w = d[f"candidate_selector.{book}"]
            yield f"candidate_selector.{book}", self._place((s.vocab, w.shape[1]), w, self.tok, np.arange(w.shape[1]))
        w = d["candidate_selector.hidden_projection.weight"]
        yield (
            "candidate_selector.hidden_projection.weight",
            self._place((w.shape[0], H), w, np.arange(w.shape[0]), self.hid),
        )

    def _conv(self, prefix: str, base: np.ndarray | None, proj: np.ndarray | None) -> Iterator[tuple[str, np.ndarray]]:
        """Added channels (and added layers) get the identity kernel and no dynamic part."""
        dc = self.src.draft_config["dflash_config"]
        K, group = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        G_src, G = self.src.hidden // group, self.s.hidden // group
        b = np.zeros((2, K, self.s.hidden), np.float32)
        b[:, 0, :] = 1.0
        if base is not None:
            b[:, :, : self.src.hidden] = base
        yield prefix + "base_kernel", b
        p = np.zeros((2 * K * G, self.s.hidden), np.float32)
        if proj is not None:
            for side in range(2):
                for tap in range(K):
                    p[side * K * G + tap * G : side * K * G + tap * G + G_src, : self.src.hidden] = proj[
                        side * K * G_src + tap * G_src : (side * K + tap + 1) * G_src
                    ]
        yield prefix + "kernel_projection.weight", p


# --- writing -----------------------------------------------------------------------------------


def _attention_names(s: ScaleSize | None = None) -> dict[str, str]:
    """role -> GGUF tensor name of an attention layer (Qwen3's; `s` a Qwen3.5: its pre-FFN norm's name)."""
    ffn_norm = "post_attention_norm" if s is not None and s.hybrid else "ffn_norm"
    return {
        "attn_norm": "attn_norm",
        "q": "attn_q",
        "k": "attn_k",
        "v": "attn_v",
        "o": "attn_output",
        "q_norm": "attn_q_norm",
        "k_norm": "attn_k_norm",
        "ffn_norm": ffn_norm,
        "gate": "ffn_gate",
        "up": "ffn_up",
        "down": "ffn_down",
    }


def _layer_shapes(s: ScaleSize, i: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch shape of target layer i, in file order: a MoE's FFN as libllama loads it, a
    router and the experts stacked (and a shared expert)."""
    out = _dense_layer_shapes(s, i)
    if s.moe:
        p, H, E, eff = f"blk.{i}.", s.hidden, s.n_experts, s.expert_ff
        for role in ("gate", "up", "down"):
            del out[f"{p}ffn_{role}.weight"]
        out[p + "ffn_gate_inp.weight"] = (E, H)
        out[p + "ffn_gate_exps.weight"] = (E, eff, H)
        out[p + "ffn_up_exps.weight"] = (E, eff, H)
        out[p + "ffn_down_exps.weight"] = (E, H, eff)
        if s.shared_ff:
            out[p + "ffn_gate_inp_shexp.weight"] = (H,)
            out[p + "ffn_gate_shexp.weight"] = (s.shared_ff, H)
            out[p + "ffn_up_shexp.weight"] = (s.shared_ff, H)
            out[p + "ffn_down_shexp.weight"] = (H, s.shared_ff)
    return out


def _dense_layer_shapes(s: ScaleSize, i: int) -> dict[str, tuple[int, ...]]:
    """Target layer i with a dense FFN (a MoE's experts' width)."""
    p, H, ff = f"blk.{i}.", s.hidden, s.target_ff
    if not s.is_attention(i):  # a Qwen3.5 Gated DeltaNet layer, as libllama's qwen35 loads it
        conv, value = s.ssm_dims()
        return {
            p + "attn_norm.weight": (H,),
            p + "ssm_a": (s.ssm_v_heads,),
            p + "ssm_conv1d.weight": (conv, 4),
            p + "ssm_dt.bias": (s.ssm_v_heads,),
            p + "ssm_alpha.weight": (s.ssm_v_heads, H),
            p + "ssm_beta.weight": (s.ssm_v_heads, H),
            p + "attn_qkv.weight": (conv, H),
            p + "attn_gate.weight": (value, H),
            p + "ssm_norm.weight": (s.ssm_head_dim,),
            p + "ssm_out.weight": (H, value),
            p + "post_attention_norm.weight": (H,),
            p + "ffn_gate.weight": (ff, H),
            p + "ffn_up.weight": (ff, H),
            p + "ffn_down.weight": (H, ff),
        }
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    shapes = {
        "attn_norm": (H,),
        "q": (q * (2 if s.hybrid else 1), H),
        "k": (kv, H),
        "v": (kv, H),
        "o": (H, q),
        "q_norm": (s.head_dim,),
        "k_norm": (s.head_dim,),
        "ffn_norm": (H,),
        "gate": (ff, H),
        "up": (ff, H),
        "down": (H, ff),
    }
    return {f"{p}{name}.weight": shapes[role] for role, name in _attention_names(s).items()}


def _file_dtype(name: str, ndim: int) -> type:
    """F32 for vectors, the Gated DeltaNet's convolution and a MoE router (as libllama's converter writes them),
    else F16."""
    f32 = ndim == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight"))
    return np.float32 if f32 else np.float16


def target_shapes(s: ScaleSize) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch shape of a target of this size, in file order."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}
    for i in range(s.n_layers):
        shapes.update(_layer_shapes(s, i))
    shapes["output_norm.weight"] = (s.hidden,)
    shapes["output.weight"] = (s.vocab, s.hidden)
    return shapes


def _add_tokenizer(w: Any, tok: dict[str, Any], vocab: int) -> None:
    """The source's tokenizer, its token list padded with UNUSED tokens (never produced by tokenizing)."""
    unused = 5  # llama_token_type
    tokens = list(tok["tokenizer.ggml.tokens"])
    known = {
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.mask_token_id",
    }
    extra = sorted(set(tok) - known)
    if extra:
        raise ValueError(f"the source target's tokenizer has keys the inflation does not carry over: {extra}")
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tokens + [f"<|unused{i}|>" for i in range(len(tokens), vocab)])
    w.add_token_types(list(tok["tokenizer.ggml.token_type"]) + [unused] * (vocab - len(tokens)))
    w.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    if "tokenizer.ggml.padding_token_id" in tok:
        w.add_pad_token_id(int(tok["tokenizer.ggml.padding_token_id"]))
    if "tokenizer.ggml.add_bos_token" in tok:
        w.add_add_bos_token(bool(tok["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.ggml.add_eos_token" in tok:
        w.add_add_eos_token(bool(tok["tokenizer.ggml.add_eos_token"]))
    if "tokenizer.ggml.mask_token_id" in tok:
        w.add_mask_token_id(int(tok["tokenizer.ggml.mask_token_id"]))


def write_target_gguf(path: Path, infl: Inflation) -> None:
    """The inflated target: F16 matrices, F32 norms, the source's tokenizer padded to the vocabulary."""
    from gguf import GGMLQuantizationType, GGUFWriter

    s, src = infl.s, infl.src
    w = GGUFWriter(path, s.arch)
    w.add_type("model")
    w.add_name(f"tinycode inflated to {s.name} {s.arch} shapes ({s.key()})")
    w.add_file_type(1)  # mostly F16
    w.add_context_length(src.context_length)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(infl.eps)
    w.add_rope_freq_base(src.rope_theta)
    if s.hybrid:
        n_rot = s.n_rot or s.head_dim
        w.add_rope_dimension_count(n_rot)
        side = round(n_rot / 2 * 11 / 32)  # Qwen3.5's M-RoPE sections [11, 11, 10] of 32 pairs (text: one position)
        w.add_rope_dimension_sections([side, side, n_rot // 2 - 2 * side, 0])
        w.add_uint32(f"{s.arch}.full_attention_interval", s.attention_every)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(s.ssm_head_dim)
        w.add_ssm_group_count(s.ssm_k_heads)
        w.add_ssm_time_step_rank(s.ssm_v_heads)
        w.add_ssm_inner_size(s.ssm_dims()[1])
    if s.moe:
        w.add_expert_count(s.n_experts)
        w.add_expert_used_count(s.n_experts_used)
        w.add_expert_feed_forward_length(s.expert_ff)
        if s.shared_ff:
            w.add_expert_shared_feed_forward_length(s.shared_ff)
    _add_tokenizer(w, src.tokenizer, s.vocab)
    shapes = target_shapes(s)
    for name, shape in shapes.items():
        dtype = np.dtype(_file_dtype(name, len(shape)))
        raw = GGMLQuantizationType.F32 if dtype == np.float32 else GGMLQuantizationType.F16
        w.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        order = iter(shapes.items())
        for name, value in infl.target_tensors():  # one layer in memory at a time
            assert next(order) == (name, value.shape), name
            w.write_tensor_data(value)
    finally:
        w.close()


def write_draft_checkpoint(folder: Path, infl: Inflation) -> None:
    """The inflated drafter as a Hugging Face DFlash2 checkpoint: F16 matrices, F32 norms and conv bases."""
    from safetensors.numpy import save_file

    (folder / "config.json").write_text(json.dumps(infl.draft_config(), indent=1))
    tensors = {
        k: v if v.ndim == 1 or k.endswith("base_kernel") else v.astype(np.float16) for k, v in infl.draft_tensors()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` then rename: a cached file exists only complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@dataclass(frozen=True)
class Pair:
    targets: dict[str, Path]  # target type -> GGUF
    draft: Path


def ensure_pair(
    s: ScaleSize,
    folder: Path,
    *,
    target_types: tuple[str, ...] = TARGET_TYPES,
    draft_type: str = DRAFT_TYPE,
    source: Path | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> Pair:
    """The inflated pair of size `s` in `folder` (generated unless files of the same key are there): the F16
    target quantized to each of `target_types` by libllama's quantizer, the drafter converted by
    dflash-convert against the F16 target."""
    from dflash_convert.convert import Options, convert
    from dflash_convert.quantize import llama_quantize, parse_outtype

    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{s.name}-{s.key()}"
    f16 = folder / f"{stem}-target-f16.gguf"
    targets = {t: folder / f"{stem}-target-{parse_outtype(t).name}.gguf" for t in target_types}
    draft = folder / f"{stem}-dflash2-{parse_outtype(draft_type).name}-head.gguf"
    missing = [p for p in (f16, *targets.values(), draft) if not p.is_file()]
    if not missing:
        return Pair(targets, draft)
    infl = Inflation(load_source(source), s)
    if not f16.is_file():
        log(f"[scale] writing {f16.name} ({format_count(s.target_params())} params) ...")
        t0 = time.perf_counter()
        _atomic(f16, lambda tmp: write_target_gguf(tmp, infl))
        log(f"[scale] ... {time.perf_counter() - t0:.0f} s")
    for t, path in targets.items():
        if not path.is_file():
            log(f"[scale] quantizing {path.name} with libllama ...")
            t0 = time.perf_counter()
            _atomic(path, lambda tmp, t=t: llama_quantize(f16, tmp, parse_outtype(t)))
            log(f"[scale] ... {time.perf_counter() - t0:.0f} s")
    if not draft.is_file():
        log(f"[scale] writing {draft.name} ({format_count(s.draft_params())} params + the target's head) ...")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".ckpt-", dir=folder) as tmp:
            write_draft_checkpoint(Path(tmp), infl)
            # the head in the drafter's type: at a real vocabulary the F16 head is most of a draft step on a CPU
            convert(
                Options(
                    draft_dir=Path(tmp),
                    target=f16,
                    outfile=draft,
                    outtype=draft_type,
                    force=True,
                    progress=False,
                    embed_target_head=True,
                )
            )  # writes atomically itself
        log(f"[scale] ... {time.perf_counter() - t0:.0f} s")
    return Pair(targets, draft)


__all__ = [
    "DRAFT_TYPE",
    "Inflation",
    "Pair",
    "SIZES",
    "ScaleSize",
    "TARGET_TYPES",
    "default_scale_dir",
    "ensure_pair",
    "format_count",
    "load_source",
    "target_shapes",
    "tinycode_dir",
]
