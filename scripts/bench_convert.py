#!/usr/bin/env python3
"""Benchmark dflash-convert on a synthetic ~1 GB bf16 DFlash2 checkpoint.

    .venv/bin/python scripts/bench_convert.py [--size-gb 1.0] [--workdir DIR] [--outtypes f16,q8_0] [--keep]

Writes a sharded bf16 DFlash2 checkpoint (random values, streamed to disk
tensor by tensor) and a metadata-only target GGUF (tokenizer + sizes), then
runs the dflash-convert CLI once per output type in a child process and
prints wall time, MB/s and the child's peak RSS (VmHWM), with
the goals: peak RSS < 2 x the largest tensor + 300 MB; f16 at >= 200 MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6


def layer_shapes(
    i: int, h: int, heads: int, kv: int, hd: int, ff: int, proj: int, k: int
) -> dict[str, tuple[int, ...]]:
    p = f"layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (heads * hd, h),
        p + "self_attn.k_proj.weight": (kv * hd, h),
        p + "self_attn.v_proj.weight": (kv * hd, h),
        p + "self_attn.o_proj.weight": (h, heads * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (ff, h),
        p + "mlp.up_proj.weight": (ff, h),
        p + "mlp.down_proj.weight": (h, ff),
        p + "attention_conv.base_kernel": (2, k, h),
        p + "attention_conv.kernel_projection.weight": (proj, h),
        p + "mlp_conv.base_kernel": (2, k, h),
        p + "mlp_conv.kernel_projection.weight": (proj, h),
    }


def random_bf16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite bf16 bit patterns with magnitudes in [2^-7, 2^-1): fits F16 and every quant type."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    sign = bits & 0x8000
    exponent = (120 + (bits >> 7) % 7).astype(np.uint16) << 7
    mantissa = bits & 0x7F
    return (sign | exponent | mantissa).astype(np.uint16)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> int:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for shape in shapes.values():
            f.write(random_bf16(rng, int(np.prod(shape))).tobytes())
    return offset


def make_bench_checkpoint(root: Path, size_gb: float, seed: int = 0) -> dict[str, object]:
    h, heads, kv, hd, ff = 2048, 16, 4, 128, 6144
    vocab, rank, top_k, k, group = 65536, 128, 8, 2, 64
    n_tl, n_target = 4, 36
    proj = 2 * k * (h // group)
    per_layer = sum(int(np.prod(s)) for s in layer_shapes(0, h, heads, kv, hd, ff, proj, k).values()) * 2
    fixed = (h * n_tl * h + 2 * vocab * rank + rank * h + 2 * h) * 2
    n_layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))

    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, n_tl * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
        "candidate_selector.hidden_projection.weight": (rank, h),
    }
    for i in range(n_layers):
        shapes.update(layer_shapes(i, h, heads, kv, hd, ff, proj, k))

    draft = root / "drafter"
    draft.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(shapes)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map: dict[str, str] = {}
    total = 0
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        total += write_safetensors(draft / fname, {n: shapes[n] for n in part}, rng)
        weight_map.update({n: fname for n in part})
    (draft / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": ff,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "vocab_size": vocab,
        "num_target_layers": n_target,
        "block_size": 16,
        "dflash_config": {
            "block_size": 16,
            "mask_token_id": 1,
            "target_layer_ids": [1, 9, 17, 25],
            "conv_kernel_size": k,
            "conv_group_size": group,
            "selector_rank": rank,
            "selector_top_k": top_k,
        },
    }
    (draft / "config.json").write_text(json.dumps(config, indent=1))

    # a metadata-only target GGUF: sizes + a byte-level BPE tokenizer of the same vocabulary
    from gguf import GGUFWriter

    from dflash_gguf.bench.synthetic import add_tokenizer

    target = root / "target-meta.gguf"
    w = GGUFWriter(target, "qwen3")
    w.add_block_count(n_target)
    w.add_embedding_length(h)
    add_tokenizer(w, vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    largest = max(int(np.prod(s)) for s in shapes.values())
    return {
        "draft": draft,
        "target": target,
        "bytes": total,
        "n_layers": n_layers,
        "n_tensors": len(shapes),
        "largest_elems": largest,
    }


CHILD = """
import atexit, os, sys
def _report():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    with open(os.environ["DFLASH_BENCH_RSS"], "w") as out:
        out.write(hwm.split()[1])
atexit.register(_report)
sys.argv[0] = "dflash-convert"
from dflash_convert.cli import main
main()
"""


def run_convert(draft: Path, target: Path, out: Path, outtype: str) -> tuple[float, int, int]:
    """Run the CLI in a child; its peak RSS is VmHWM of its own address space (read at exit).

    (ru_maxrss from wait4 is not used: after fork it starts from the parent's RSS,
    and this parent has just generated the checkpoint.)
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "converter"), env.get("PYTHONPATH")]))
    rss_file = out.with_suffix(".rss")
    env["DFLASH_BENCH_RSS"] = str(rss_file)
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        str(draft),
        "--target",
        str(target),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        "--force",
        "--no-progress",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dflash-convert failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    peak = int(rss_file.read_text()) * 1024  # kB
    rss_file.unlink()
    return wall, peak, out.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--outtypes", default="f16,q8_0")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()

    root = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        info = make_bench_checkpoint(root, args.size_gb)
        largest_bf16 = info["largest_elems"] * 2  # type: ignore[operator]
        print(
            f"checkpoint: {info['bytes'] / MB:.0f} MB bf16, {info['n_tensors']} tensors, "
            f"{info['n_layers']} layers, largest tensor {largest_bf16 / MB:.1f} MB bf16 "
            f"({largest_bf16 * 2 / MB:.1f} MB as f32); made in {time.perf_counter() - t0:.1f} s"
        )
        print(
            f"{'outtype':<8} {'wall s':>8} {'in MB/s':>9} {'out MB':>8} {'out MB/s':>9} {'peak RSS MB':>12} {'RSS goal MB':>12}"
        )
        for outtype in args.outtypes.split(","):
            out = root / f"bench-{outtype}.gguf"
            # drop the checkpoint's page cache influence as far as we can: one warm read is fine
            wall, peak, size = run_convert(info["draft"], info["target"], out, outtype)  # type: ignore[arg-type]
            goal = 2 * largest_bf16 + 300 * MB
            print(
                f"{outtype:<8} {wall:>8.2f} {info['bytes'] / MB / wall:>9.0f} {size / MB:>8.0f} "  # type: ignore[operator]
                f"{size / MB / wall:>9.0f} {peak / MB:>12.0f} {goal / MB:>12.0f}"
                f"  {'ok' if peak < goal else 'OVER'}"
            )
            if not args.keep:
                out.unlink(missing_ok=True)
        print(
            "goals: peak RSS < 2 x largest tensor (bf16 bytes) + 300 MB; f16 output >= 200 MB/s "
            "(wall time includes the read-back verification)"
        )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
