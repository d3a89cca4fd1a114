#!/usr/bin/env python3
"""Draft-step latency against context length: a sliding-window drafter beside the same drafter without one.

    .venv/bin/python scripts/bench_sliding_context.py [--contexts 512,4096,16384] [--window 2048]
                                                      [--threads 2] [--reps 15] [--outtype q4_0]
                                                      [--kv-type f16]

Two random DFlash2 drafters shaped like the published 5-layer ones at 1.7B (hidden 2048, 16 heads, 8 KV
heads of 128, MLP 6144, block 16), with the same weights: one attends to the whole context in every layer,
the other slides a window of --window positions in its first 4 layers as z-lab's Qwen3.6 drafters do
(the DFlash 2 release's is_causal false), its sliding layers' rows in rings of their last positions, and
the same again with swa_full (every row kept, as llama.cpp's --swa-full); then what the rings' copy at a prompt's
end costs (taken, and put back by a rollback to it). The drafter's attention reads every cached row it attends to,
so its cost grows with the context; a sliding layer attends only to the rows its window reaches, and
keeps only a ring of its last positions' rows (the memory line). Per
context, both drafters' draft steps of 3 tokens (the short block the loop runs) alternate, so they share
the machine's load; the table gives medians and the ratio. Needs the test install (tests/factories.py).
The files go to a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB, TAPS = 2048, 5, 16, 8, 128, 6144, 4096, 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--outtype", default="q4_0")
    ap.add_argument("--kv-type", default="f16", choices=("f16", "f32"), help="the draft cache's type")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    sys.path.insert(0, str(ROOT / "tests"))
    from factories import make_checkpoint, make_target_gguf

    import dflash_gguf
    from dflash_convert import Options, convert

    sliding = ["sliding_attention"] * (LAYERS - 1) + ["full_attention"]
    window = {"use_sliding_window": True, "sliding_window": args.window, "layer_types": sliding, "is_causal": False}
    # name: (checkpoint config, swa_full)
    layouts = {"whole context": ({}, False), f"window {args.window}": (window, False), "swa_full": (window, True)}
    with tempfile.TemporaryDirectory(prefix="dflash-sliding-") as tmp:
        work = Path(tmp)
        target = work / "target.gguf"
        make_target_gguf(
            target,
            vocab=VOCAB,
            hidden=HIDDEN,
            n_layers=TAPS,
            heads=HEADS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            ff=256,
            context_length=max(contexts) + 64,
        )
        drafters = {}
        for name, (config, swa_full) in layouts.items():
            src = work / name.replace(" ", "_")
            make_checkpoint(
                src,
                version=2,
                hidden=HIDDEN,
                n_layers=LAYERS,
                heads=HEADS,
                kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                ff=FF,
                vocab=VOCAB,
                n_target_layers=TAPS,
                target_layer_ids=tuple(range(TAPS)),
                block_size=16,
                top_k=8,
                rank=64,
                seed=1,
                config_overrides=config,
            )
            out = src.with_suffix(".gguf")
            convert(Options(draft_dir=src, target=target, outfile=out, outtype=args.outtype, progress=False))
            drafters[name] = dflash_gguf.Drafter(
                str(out),
                str(target),
                device="cpu",
                n_threads=args.threads,
                n_ctx=max(contexts) + 64,
                kv_type=args.kv_type,
                swa_full=swa_full,
            )

        rng = np.random.default_rng(0)
        print(
            f"draft of 3 tokens, median ms over {args.reps} ({args.threads} threads, {args.outtype}, "
            f"{args.kv_type} cache)"
        )
        print(
            f"draft cache for {max(contexts) + 64} rows: "
            + ", ".join(f"{name} {d.cache_bytes / 2**20:.1f} MiB" for name, d in drafters.items())
            + "".join(f" (rings of {d.ring_rows} rows in the sliding layers)" for d in drafters.values() if d.ring_rows)
        )
        print(f"{'context':>8}  " + "  ".join(f"{n:>14}" for n in drafters) + "  whole / window  ring / swa_full")
        for n in contexts:
            feats = rng.standard_normal((n, TAPS * HIDDEN)).astype(np.float32)
            for d in drafters.values():
                d.reset()
                d.inject(feats, np.arange(n, dtype=np.int32))
                for _ in range(3):
                    d.draft(5, n, 3, all_rows=False, short_block=True)
            times: dict[str, list[float]] = {name: [] for name in drafters}
            for _ in range(args.reps):
                for name, d in drafters.items():
                    t0 = time.perf_counter()
                    d.draft(5, n, 3, all_rows=False, short_block=True)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            med = [statistics.median(t) for t in times.values()]
            print(
                f"{n:>8}  " + "  ".join(f"{m:>14.2f}" for m in med) + f"  {med[0] / med[1]:>13.2f}x"
                f"  {med[1] / med[2]:>14.2f}x"
            )
        print_rings_copy(drafters[f"window {args.window}"], contexts, args.reps, rng)
    return 0


def print_rings_copy(d: Any, contexts: list[int], reps: int, rng: np.random.Generator) -> None:
    """What the copy of the rings kept at a prompt's end costs: taking it, and putting it back after a reply
    that wrote over the window (a regenerated reply)."""
    n, reply = contexts[0], d.ring_rows + 256
    if d.ring_rows == 0 or n + reply > max(contexts):
        return
    feats = rng.standard_normal((n + reply, TAPS * HIDDEN)).astype(np.float32)
    d.reset()
    d.inject(feats[:n], np.arange(n, dtype=np.int32))
    keep, restore = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        d.keep_rings_at(n)
        keep.append((time.perf_counter() - t0) * 1e3)
        d.inject(feats[n:], np.arange(n, n + reply, dtype=np.int32))
        t0 = time.perf_counter()
        d.truncate(n)
        restore.append((time.perf_counter() - t0) * 1e3)
    assert d.counters["rings_restored"] == reps
    print(
        f"the rings' copy at a prompt's end ({n} rows, then {reply} more): taken in "
        f"{statistics.median(keep):.2f} ms, put back in {statistics.median(restore):.2f} ms (medians)"
    )


if __name__ == "__main__":
    sys.exit(main())
