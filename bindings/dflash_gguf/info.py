"""Human and JSON descriptions of a drafter GGUF, read through the C++ loader."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ._core import sliding_ring_rows


def summarize(info: dict[str, Any]) -> dict[str, Any]:
    """The facts `dflash info` shows, as one JSON-ready dict."""
    hp = info["hparams"]
    by_type: Counter[str] = Counter(t["type"] for t in info["tensors"])
    bytes_by_type: Counter[str] = Counter()
    for t in info["tensors"]:
        bytes_by_type[t["type"]] += t["nbytes"]
    out: dict[str, Any] = {
        "path": info["path"],
        "dflash_version": hp["version"],
        "block_size": hp["block_size"],
        "target_layers": hp["target_layers"],
        "mask_token_id": hp["mask_token_id"],
        "n_layer": hp["n_layer"],
        "n_embd": hp["n_embd"],
        "n_head": hp["n_head"],
        "n_head_kv": hp["n_head_kv"],
        "head_dim": hp["head_dim"],
        "n_ff": hp["n_ff"],
        "n_vocab": hp["n_vocab"],
        "target_hidden": hp["target_hidden"],
        "rms_eps": hp["rms_eps"],
        "rope_freq_base": hp["rope_freq_base"],
        "rope_sections": hp["rope_sections"],
        "context_length": hp["context_length"],
        "embeds_target_head": bool(info["has_token_embd"] and info["has_output"]),
        "mask_embedding": bool(info["mask_embedding"]),
        "tensor_count": len(info["tensors"]),
        "tensors_by_type": dict(sorted(by_type.items())),
        "bytes_by_type": dict(sorted(bytes_by_type.items())),
        "tensor_bytes": sum(t["nbytes"] for t in info["tensors"]),
        "file_size": info["file_size"],
    }
    # the draft context cache, K and V in F16 (the runtime's default), so that the memory a context length
    # costs can be planned before loading: per context row of the layers that hold every row, and, at the
    # training context, a ring of its last positions in each sliding-window layer
    layer_row = 2 * hp["n_head_kv"] * hp["head_dim"] * 2
    ring = sliding_ring_rows(hp["sliding_window"], hp["block_size"], hp["context_length"])
    ring_layers = sum(hp["sliding_window_layers"]) if ring else 0
    out["cache_bytes_per_row"] = (hp["n_layer"] - ring_layers) * layer_row
    if ring:
        out["cache_ring"] = {"rows": ring, "bytes": ring_layers * ring * layer_row}
    if hp["version"] == 2:
        out["conv"] = {"kernel_size": hp["conv_kernel_size"], "group_size": hp["conv_group_size"]}
        out["selector"] = {"rank": hp["selector_rank"], "top_k": hp["selector_top_k"]}
    scales = {
        k: hp[k]
        for k in ("logit_scale", "final_logit_softcapping", "embedding_scale", "attention_value_scale")
        if hp[k]
    }
    if scales:
        out["scales"] = scales
    if hp["causal"]:
        out["causal"] = True
    elif any(hp["causal_layers"]):
        out["causal_layers"] = hp["causal_layers"]
    if hp["hidden_activation"] != "silu":
        out["hidden_activation"] = hp["hidden_activation"]
    if hp["sliding_window"]:
        out["sliding_window"] = {"window": hp["sliding_window"], "layers": hp["sliding_window_layers"]}
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_text(s: dict[str, Any]) -> str:
    lines = [
        f"file            {s['path']} ({_mib(s['file_size'])})",
        f"DFlash version  {s['dflash_version']}",
        f"block size      {s['block_size']}",
        f"target layers   {s['target_layers']} (layer inputs; = HF target_layer_ids + 1)",
        f"mask token      {s['mask_token_id']}",
        f"layers          {s['n_layer']}",
        f"hidden          {s['n_embd']}  heads {s['n_head']}  kv heads {s['n_head_kv']}  "
        f"head dim {s['head_dim']}  ff {s['n_ff']}",
        f"target hidden   {s['target_hidden']}  vocab {s['n_vocab'] or '(from target)'}",
        f"rope base       {s['rope_freq_base']:g}  rms eps {s['rms_eps']:g}"
        + (f"  M-RoPE sections {s['rope_sections']} (temporal only)" if s["rope_sections"] else ""),
    ]
    if "conv" in s:
        lines.append(f"conv            kernel {s['conv']['kernel_size']}  group size {s['conv']['group_size']}")
        lines.append(f"selector        rank {s['selector']['rank']}  top-k {s['selector']['top_k']}")
    if "hidden_activation" in s:
        lines.append(f"MLP activation  {s['hidden_activation']}")
    if s.get("causal"):
        lines.append("causal          every layer: a block row attends to the rows before it, not after")
    elif "causal_layers" in s:
        causal = [i for i, on in enumerate(s["causal_layers"]) if on]
        lines.append(f"causal          layers {causal}: a block row attends to the rows before it, not after")
    if "sliding_window" in s:
        sw = s["sliding_window"]
        slid = [i for i, on in enumerate(sw["layers"]) if on]
        lines.append(f"sliding window  {sw['window']} positions in layers {slid}, the others attend to everything")
    if "scales" in s:
        lines.append("scales          " + "  ".join(f"{k} {v:g}" for k, v in s["scales"].items()))
    lines.append(
        f"target head     {'embedded in the drafter' if s['embeds_target_head'] else 'shared from the target GGUF'}"
        + ("  (token_embd: the target's with its own mask row)" if s["mask_embedding"] else "")
    )
    types = "  ".join(f"{t}: {n} ({_mib(s['bytes_by_type'][t])})" for t, n in s["tensors_by_type"].items())
    lines.append(f"tensors         {s['tensor_count']}  ({types})")
    lines.append(f"total size      {_mib(s['tensor_bytes'])} of tensor data")
    row, ctx, ring = s["cache_bytes_per_row"], s["context_length"], s.get("cache_ring")
    rings = f" + a ring of {ring['rows']} rows per sliding layer ({_mib(ring['bytes'])})" if ring else ""
    total = row * ctx + (ring["bytes"] if ring else 0)
    lines.append(
        f"draft cache     {row / 1024:.2f} KiB per context row (K and V in F16){rings}: {_mib(total)} for {ctx} rows"
    )
    if ring:  # Drafter.keep_rings_at: so that a rollback to one of the last prompts' ends gets them back
        lines.append(
            f"                and up to 3 copies of the rings ({_mib(ring['bytes'])} each) in host memory,"
            " of the last prompts' ends"
        )
    return "\n".join(lines)
