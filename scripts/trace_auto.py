#!/usr/bin/env python3
"""What n_max="auto" did, step by step, in `dflash bench`'s pattern (per prompt: plain decoding, then ours).

    .venv/bin/python scripts/trace_auto.py [--target T.gguf] [--draft D.gguf] [--prompts FILE.jsonl]
                                           [-n 128] [--rounds 2] [--threads 2] [-ngl 0] [--n-max auto]
                                           [--draft-vocab V.json] [--steps] [--json OUT]

Per prompt it prints plain decoding's ms/token (`ar`, the bench's baseline on the same object), ours in
auto mode, their ratio, how many steps drafted, and what the drafted steps cost against decoding
their tokens plainly at ar's speed ("lost": positive = drafting lost time on this prompt); then the
controller's view after the prompt: its plain-step cost estimate (`c0`, to set against ar) and the
expected cost of a drafted step of k = 1..cap. `--steps` adds every step as `ms/k:accepted` (k 0 = a
plain step) with the plain estimate after it, `--json` writes all of it. What to look for: a plain
estimate that stays high after a slow phase of a few steps, and drafting runs begun again one plain step
after the estimates ended them (tests/test_draft_length.py replays both). `--n-max 3` traces a fixed
length the same way, to set auto's steps beside it (the controller's figures then hold only that
length's cost: nothing else is timed).

Reading the controller after every step adds a little Python time between steps (the loop's own
timings, which the controller sees, are taken in C++ and do not include it).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench_common import TINY, pair_parser


def main() -> int:
    ap = pair_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(TINY / "prompts.jsonl"))
    ap.add_argument("-n", type=int, default=128, help="tokens per prompt (default 128)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="target layers on the GPU (default 0)")
    ap.add_argument("--n-max", default="auto", help="'auto' (default) or a fixed draft length, to compare")
    ap.add_argument("--draft-vocab", type=Path, help="a drafting vocabulary (`dflash draft-vocab`'s file)")
    ap.add_argument("--steps", action="store_true", help="print every step")
    ap.add_argument("--json", type=Path, help="write the trace here")
    args = ap.parse_args()

    from dflash_gguf.bench import load_prompts, three_way
    from dflash_gguf.bench.options import BenchError, parse_n_max

    try:
        n_max = parse_n_max(args.n_max)
    except BenchError as e:
        ap.error(str(e))
    if len(n_max) != 1:
        ap.error("--n-max takes one value")
    from dflash_gguf.speculative import SpeculativeLlama

    llm = SpeculativeLlama(
        args.target,
        args.draft,
        n_ctx=2048,
        n_threads=args.threads,
        n_max=n_max[0],
        n_gpu_layers=args.n_gpu_layers,
        draft_vocab=args.draft_vocab,
    )
    prompts = load_prompts(args.prompts, None)
    token_lists = [llm.tokenize(p["text"].encode(), add_bos=False, special=False) for p in prompts]
    sampling = {"n_predict": args.n, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
    spec = llm._spec
    trace, ratios = [], []
    for rnd in range(args.rounds):
        for i, toks in enumerate(token_lists):
            ar_ms = 1e3 / three_way.run_ours(llm, toks, plain=True, **sampling)["tok_s"]
            three_way.fresh_prefill(llm, toks)
            spec.start(toks, seed=0)
            n, steps = 1, []
            before = spec.stats
            while n < args.n:
                t0 = time.perf_counter()
                tokens, full = spec.step()
                ms = (time.perf_counter() - t0) * 1e3
                after = spec.stats
                k = after["drafted"] - before["drafted"]
                steps.append(
                    {
                        "ms": ms,
                        "k": k,
                        "accepted": after["accepted"] - before["accepted"],
                        "tokens": len(tokens),
                        "c0": spec.controller["expected_step_ms"][0],
                    }
                )
                before = after
                n += len(tokens)
                if full:
                    break
            drafted = [s for s in steps if s["k"] > 0]
            lost = sum(s["ms"] - s["tokens"] * ar_ms for s in drafted)
            ours_ms = sum(s["ms"] for s in steps) / n
            ratios.append(ar_ms / ours_ms)
            view = spec.controller
            trace.append(
                {
                    "round": rnd,
                    "prompt": prompts[i]["id"],
                    "ar_ms_per_token": ar_ms,
                    "ours_ms_per_token": ours_ms,
                    "steps": steps,
                    "controller": view,
                }
            )
            print(
                f"round {rnd} {prompts[i]['id']:>10}: ar {ar_ms:.3f} ours {ours_ms:.3f} ms/token = "
                f"{ar_ms / ours_ms:.2f}x; {len(drafted)}/{len(steps)} steps drafted, lost {lost:+.1f} ms; "
                f"c0 {view['expected_step_ms'][0]:.3f}, drafted k=1.. "
                + " ".join(f"{c:.2f}" for c in view["expected_step_ms"][1:]),
                flush=True,
            )
            if args.steps:
                print("   " + " ".join(f"{s['ms']:.2f}/{s['k']}:{s['accepted']}|{s['c0']:.2f}" for s in steps))
    print(f"median over prompts of ar / ours: {statistics.median(ratios):.3f}x")
    if args.json:
        args.json.write_text(json.dumps(trace))
        print(f"wrote {args.json}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
