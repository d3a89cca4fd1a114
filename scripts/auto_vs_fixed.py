#!/usr/bin/env python3
"""n_max="auto" against fixed draft lengths, interleaved prompt run by prompt run in one process.

    .venv/bin/python scripts/auto_vs_fixed.py [--target T.gguf] [--draft D.gguf] [--prompts FILE.jsonl]
                                              [--limit 3] [-n 32] [--rounds 3] [--threads 2]
                                              [--n-max 2,3,auto] [--json OUT]

`dflash bench` runs one n_max after the other, each with plain decoding beside it, so its speedups are
fair within an n_max but minutes apart between them: where the machine's speed drifts (a shared VM's
memory bandwidth moved a plain F16 step by up to 40% within one `--scale` run), comparing auto with the
best fixed length there compares two phases of the machine as much as two controllers. Here every length
has a model of its own (the mapped file's pages are shared) and, for each prompt run, plain decoding and every length
decode it one after the other, in an order rotated per run, each as a ratio to that run's plain tok/s;
each model warms up on the first prompt, as the bench's do. Prints the median ratio per length and
auto's over the best fixed one.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench_common import TINY, greedy_prompt_runs, n_max_values, pair_parser


def main() -> int:
    ap = pair_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(TINY / "prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=3, help="the first N prompts (default 3, as --scale; 0 = all)")
    ap.add_argument("-n", type=int, default=32, help="tokens per prompt (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-max", default="2,3,auto", help="comma list with 'auto' and at least one length")
    ap.add_argument("--json", type=Path, help="write every ratio here")
    args = ap.parse_args()

    from dflash_gguf.bench import three_way

    lengths = n_max_values(ap, args.n_max)
    fixed = [k for k in lengths if k != "auto"]
    if "auto" not in lengths or not fixed:
        ap.error("--n-max needs 'auto' and at least one fixed length")
    from dflash_gguf.speculative import SpeculativeLlama

    systems = ["ar", *lengths]
    llms = {
        s: SpeculativeLlama(
            args.target, args.draft, n_ctx=2048, n_threads=args.threads, n_max=fixed[0] if s == "ar" else s
        )
        for s in systems
    }
    prompts, token_lists, sampling = greedy_prompt_runs(llms["ar"], args.prompts, args.limit or None, args.n)

    def tok_s(s: object, toks: list[int]) -> float:
        return three_way.run_ours(llms[s], toks, plain=s == "ar", **sampling)["tok_s"]

    for s in systems:  # warm-up, not counted
        tok_s(s, token_lists[0])
    ratios: dict[str, list[float]] = {str(s): [] for s in lengths}
    runs = []
    for rnd in range(args.rounds):
        for i, toks in enumerate(token_lists):
            turn = rnd * len(token_lists) + i
            order = systems[turn % len(systems) :] + systems[: turn % len(systems)]
            speed = {s: tok_s(s, toks) for s in order}
            row = {str(s): speed[s] / speed["ar"] for s in lengths}
            for s, r in row.items():
                ratios[s].append(r)
            runs.append({"round": rnd, "prompt": prompts[i].get("id", i), "ar_tok_s": speed["ar"], "ratios": row})
            cells = "  ".join(f"{s} {r:.2f}x" for s, r in row.items())
            print(f"round {rnd} {runs[-1]['prompt']:>10}: ar {speed['ar']:.2f} tok/s  {cells}", flush=True)
    med = {s: statistics.median(v) for s, v in ratios.items()}
    best = max(fixed, key=lambda k: med[str(k)])
    print("median: " + "  ".join(f"{s} {m:.3f}x" for s, m in med.items()))
    print(f"auto / best fixed (n_max {best}): {med['auto'] / med[str(best)]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"medians": med, "best_fixed": best, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
