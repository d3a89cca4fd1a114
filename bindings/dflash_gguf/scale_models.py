"""Random-weight Qwen3 targets and matching DFlash2 drafters for `dflash bench --scale`.

A target is written straight as a GGUF (arch qwen3, F16 matrices, F32 norms, a synthetic
byte-level vocabulary: the bench feeds token ids); its drafter as a random HF DFlash2 checkpoint
converted by dflash-convert, so the converter stays the one authority on the drafter's GGUF.
Both are cached in a folder under names that carry a hash of the configuration:

    target, draft = ensure_models(SIZES["2B"], default_scale_dir(), log=print)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

GENERATOR_VERSION = 1  # part of every cached file's name: bump it when the generated files change
MASK_TOKEN_ID = 1  # "<|mask|>" in the synthetic vocabulary


@dataclass(frozen=True)
class ScaleSize:
    """A Qwen3 target shape and its DFlash2 drafter (same hidden size, heads and FFN width)."""

    name: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    vocab: int = 151936
    rope_theta: float = 1e6
    tied_embeddings: bool = True  # as Qwen3-0.6B and -1.7B
    draft_layers: int = 5
    block_size: int = 16
    conv_kernel: int = 2
    conv_group: int = 16
    selector_rank: int = 64
    selector_top_k: int = 8
    target_layer_ids: tuple[int, ...] | None = None  # HF ids; None = the DFlash default spread

    def layer_ids(self) -> list[int]:
        from dflash_convert.config import default_target_layer_ids

        ids = list(self.target_layer_ids or default_target_layer_ids(self.n_layers, self.draft_layers))
        if not ids or any(not 0 <= i < self.n_layers for i in ids):
            raise ValueError(f"size {self.name}: target_layer_ids {ids} must lie in 0..{self.n_layers - 1}")
        return ids

    def key(self) -> str:
        """Short hash of everything that shapes the generated files."""
        blob = json.dumps([GENERATOR_VERSION, asdict(self) | {"name": ""}], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


SIZES = {
    "0.5B": ScaleSize("0.5B", hidden=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ff=3072),
    "2B": ScaleSize("2B", hidden=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ff=6144),
}


def default_scale_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-gguf" / "scale"

# --- random weights ---------------------------------------------------------------------------


def random_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random F16 of magnitude in [2^-6, 2^-5) (std ~0.024) with random sign, built from random bits:
    ~20x faster than normal samples, always finite. The values do not change the timings."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= 0x83FF  # keep sign and mantissa
    bits |= (15 - 6) << 10  # exponent 2^-6
    return bits.view(np.float16)


def target_tensor_shapes(s: ScaleSize) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch shape of a Qwen3 target (libllama's arch qwen3)."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}
    for i in range(s.n_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (s.hidden,), p + "attn_q.weight": (q, s.hidden),
            p + "attn_k.weight": (kv, s.hidden), p + "attn_v.weight": (kv, s.hidden),
            p + "attn_output.weight": (s.hidden, q), p + "attn_q_norm.weight": (s.head_dim,),
            p + "attn_k_norm.weight": (s.head_dim,), p + "ffn_norm.weight": (s.hidden,),
            p + "ffn_gate.weight": (s.ff, s.hidden), p + "ffn_up.weight": (s.ff, s.hidden),
            p + "ffn_down.weight": (s.hidden, s.ff),
        })
    shapes["output_norm.weight"] = (s.hidden,)
    if not s.tied_embeddings:
        shapes["output.weight"] = (s.vocab, s.hidden)
    return shapes


def n_params(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def synthetic_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a GPT-2 byte-level BPE libllama accepts: <|endoftext|> and <|mask|>
    (CONTROL), the 256 byte tokens, two-letter merges, then UNUSED filler up to n_vocab.
    The bench feeds token ids, so the text side only has to load."""
    control, normal, unused = 3, 1, 5  # llama_token_type
    if n_vocab < 258:
        raise ValueError(f"vocab {n_vocab}: needs >= 258 tokens (2 control + 256 bytes)")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))  # GPT-2 maps the other bytes above U+00FF
    byte_chars = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    tokens, types = ["<|endoftext|>", "<|mask|>", *byte_chars], [control, control] + [normal] * 256
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    merges = [f"{a} {b}" for a in letters for b in letters][: n_vocab - len(tokens)]
    tokens += [m.replace(" ", "") for m in merges]
    types += [normal] * len(merges)
    types += [unused] * (n_vocab - len(tokens))
    tokens += [f"<|unused{i}|>" for i in range(len(tokens), n_vocab)]
    return tokens, types, merges


def add_tokenizer(w: Any, n_vocab: int) -> None:
    """The synthetic GPT-2 vocabulary's keys (bos = eos = pad = <|endoftext|>, no BOS added)."""
    tokens, types, merges = synthetic_vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # libllama 0.3.36 rejects "gpt2" here
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)


def add_qwen3_header(w: Any, *, name: str, hidden: int, n_layers: int, ff: int, heads: int, kv_heads: int,
                     head_dim: int, rope_theta: float, vocab: int, context_length: int, file_type: int) -> None:
    """Every key but the tensors that libllama needs to load a qwen3 target (a gguf.GGUFWriter)."""
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_theta)
    add_tokenizer(w, vocab)


def write_target_gguf(path: Path, s: ScaleSize, seed: int = 0) -> None:
    """A random Qwen3 target: F16 matrices, F32 norms of 1, synthetic vocabulary."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3")
    add_qwen3_header(w, name=f"dflash-gguf random qwen3 {s.name} ({s.key()})", hidden=s.hidden,
                     n_layers=s.n_layers, ff=s.ff, heads=s.n_heads, kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                     rope_theta=s.rope_theta, vocab=s.vocab, context_length=40960, file_type=1)  # mostly F16
    shapes = target_tensor_shapes(s)
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    for name, shape in shapes.items():
        is_norm = len(shape) == 1
        dtype = np.dtype(np.float32 if is_norm else np.float16)
        w.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize, raw_dtype=F32 if is_norm else F16)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape in shapes.items():  # one tensor in memory at a time
            w.write_tensor_data(np.ones(shape, np.float32) if len(shape) == 1 else random_f16(rng, shape))
    finally:
        w.close()


def drafter_config(s: ScaleSize) -> dict[str, Any]:
    """config.json of a DFlash2 drafter for this target (shared/GGUF-DFLASH.md section 1)."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": s.hidden,
        "num_hidden_layers": s.draft_layers, "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "intermediate_size": s.ff,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": s.rope_theta,
        "max_position_embeddings": 40960, "vocab_size": s.vocab, "tie_word_embeddings": False,
        "num_target_layers": s.n_layers, "block_size": s.block_size, "torch_dtype": "float16",
        "dflash_config": {
            "block_size": s.block_size, "mask_token_id": MASK_TOKEN_ID, "target_layer_ids": s.layer_ids(),
            "conv_kernel_size": s.conv_kernel, "conv_group_size": s.conv_group,
            "selector_rank": s.selector_rank, "selector_top_k": s.selector_top_k,
        },
    }


def drafter_tensor_shapes(s: ScaleSize) -> dict[str, tuple[int, ...]]:
    """HF key -> torch shape, from the converter's own table (the one authority on names and shapes)."""
    from dflash_convert.config import parse_config
    from dflash_convert.tensor_map import expected_tensors

    cfg = parse_config(drafter_config(s), Path(f"<scale drafter {s.name}>/config.json"))
    return {t.hf: t.shape for t in expected_tensors(cfg, s.hidden) if t.required}


def write_drafter_gguf(path: Path, s: ScaleSize, target: Path, seed: int = 1) -> None:
    """A random HF DFlash2 checkpoint in a temp folder, converted to an F16 GGUF by dflash-convert
    (which writes `path` atomically and reads it back)."""
    from dflash_convert.convert import Options, convert
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for key, shape in drafter_tensor_shapes(s).items():
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            tensors[key] = np.ones(shape, np.float16)
        elif key.endswith("base_kernel"):  # identity-like, as a trained drafter's
            base = np.zeros(shape, np.float16)
            base[:, 0, :] = 1
            tensors[key] = base
        else:
            tensors[key] = random_f16(rng, shape)
    with tempfile.TemporaryDirectory(prefix=".ckpt-", dir=path.parent) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(drafter_config(s), indent=1))
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        convert(Options(draft_dir=Path(tmp), target=target, outfile=path, outtype="f16", force=True,
                        progress=False))


def ensure_models(s: ScaleSize, folder: Path, log: Callable[[str], None]) -> tuple[Path, Path]:
    """(target, drafter) GGUF paths for `s` in `folder`, generated unless files of the same key exist.
    The key (a hash of the size's full config and the generator version) is in each file's name;
    files appear only complete (temp file + rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{s.name}-{s.key()}"
    target, draft = folder / f"{stem}-qwen3-f16.gguf", folder / f"{stem}-dflash2-f16.gguf"
    if not target.is_file():
        log(f"[scale] writing {target} ({format_count(n_params(target_tensor_shapes(s)))} params) ...")
        t0 = time.perf_counter()
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            write_target_gguf(Path(tmp_name), s)
            os.chmod(tmp_name, 0o644)  # mkstemp makes it private
            os.replace(tmp_name, target)
        finally:
            Path(tmp_name).unlink(missing_ok=True)
        log(f"[scale] ... {time.perf_counter() - t0:.1f} s")
    if not draft.is_file():
        n = format_count(n_params(drafter_tensor_shapes(s)))
        log(f"[scale] writing {draft} ({n} params + the target's head) ...")
        t0 = time.perf_counter()
        write_drafter_gguf(draft, s, target)
        log(f"[scale] ... {time.perf_counter() - t0:.1f} s")
    return target, draft


__all__ = ["SIZES", "ScaleSize", "default_scale_dir", "drafter_tensor_shapes", "ensure_models", "format_count",
           "n_params", "synthetic_vocab", "target_tensor_shapes"]
