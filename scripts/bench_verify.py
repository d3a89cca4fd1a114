#!/usr/bin/env python3
"""What verifying B tokens costs the target against a plain one-token step: the quantity that bounds
speculative decoding (docs/performance.md, the cost model).

    .venv/bin/python scripts/bench_verify.py TARGET.gguf [TARGET.gguf ...] [--blocks 1,2,3,4,5,8]
                                             [--threads 2] [--context 64] [--reps 7]

Each target decodes --context tokens once, then for every block size B a llama_decode of B tokens
with logits for every row and the drafter's feature layers extracted, as the speculative loop's
verify does (flash attention as our runtime sets it), each size in a context of its own so its graph
is reused; sizes interleaved round by round so machine drift hits all alike; medians. The table shows
ms per decode and the ratio to B = 1: where verifying 4 tokens costs 2x a plain step, no drafter can
make decoding more than min(tau, 4) / 2 times faster. --swa-full both times a target with
sliding-window layers (gpt-oss, gemma4) both ways in the same rounds: its sliding layers holding a window
and a batch of positions (off, our runtime's default and llama-server's) or every position (on).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", type=Path)
    ap.add_argument("--blocks", default="1,2,3,4,5,8", help="batch sizes; the first is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64, help="tokens in the cache before each decode")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("--swa-full", choices=("off", "on", "both"), default="off")
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.swa_full]

    from dflash_convert.config import default_target_layer_ids
    from dflash_gguf.bench.verify_timing import Verifier, load_model, runtime_flash_attn

    print(
        f"verify of B tokens vs B = {blocks[0]}: {args.threads} threads, context {args.context}, medians of {args.reps}"
    )
    for path in args.targets:
        llc, model = load_model(path, n_gpu_layers=args.n_gpu_layers)
        features = default_target_layer_ids(llc.llama_model_n_layer(model), 5)  # a 5-layer drafter's
        verifiers = {}
        try:
            for swa_full in settings:
                verifiers[swa_full] = Verifier(
                    llc,
                    model,
                    context=args.context,
                    max_block=max(blocks),
                    n_threads=args.threads,
                    flash_attn=runtime_flash_attn(args.n_gpu_layers),
                    feature_layers=features,
                    swa_full=swa_full,
                )
            runs = [(v, b) for v in verifiers.values() for b in blocks]
            for v, b in runs:  # each size's graph built before the timed rounds
                v.verify(b)
            ms: dict[tuple[bool, int], list[float]] = {(v.swa_full, b): [] for v, b in runs}
            for _ in range(args.reps):
                for v, b in runs:
                    ms[v.swa_full, b].append(v.verify(b) * 1e3)
        finally:
            for v in verifiers.values():
                v.close()
            llc.llama_model_free(model)
        base = statistics.median(ms[settings[0], blocks[0]])
        for swa_full in settings:
            cells = "  ".join(
                f"B{b} {statistics.median(ms[swa_full, b]):.1f} ms ({statistics.median(ms[swa_full, b]) / base:.2f}x)"
                for b in blocks
            )
            label = f" swa_full {'on' if swa_full else 'off'}" if args.swa_full == "both" else ""
            print(f"{path.name}{label}: {cells}", flush=True)


if __name__ == "__main__":
    main()
