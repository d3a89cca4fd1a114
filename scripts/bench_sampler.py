"""Sampled acceptance of the two exact samplers, side by side on the bundled tinycode pair.

rejection  exact rejection sampling with the drafter's q (more accepted; the draws follow the drafts)
gumbel     every draw keyed by (seed, position), draft and target coupled through the same Gumbel noise
           (a seed fixes the text, whatever the draft lengths)

  .venv/bin/python scripts/bench_sampler.py [--temps 0.8,1.0] [--n-max 3] [-n 96] [--seeds 3]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench_common import TINY, converted_drafter, pair_parser


def main() -> None:
    ap = pair_parser(__doc__)  # the bundled pair; its drafter is converted where --draft points when missing
    ap.add_argument("--temps", default="0.8,1.0")
    ap.add_argument("--n-max", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--draft-q", default="logits", choices=["logits", "selector"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    from dflash_gguf import SpeculativeLlama

    draft = converted_drafter(TINY / "drafter-dflash2", Path(args.target), Path(args.draft))
    prompts = [json.loads(line)["text"] for line in (TINY / "prompts.jsonl").read_text().splitlines()]
    specs = {
        s: SpeculativeLlama(
            args.target,
            str(draft),
            n_ctx=1024,
            n_threads=args.threads,
            n_max=args.n_max,
            fallback=False,
            draft_q=args.draft_q,
            sampler=s,
        )
        for s in ("rejection", "gumbel")
    }
    print(
        f"{len(prompts)} prompts x {args.seeds} seeds, {args.n_predict} tokens, n_max {args.n_max}, "
        f"draft q {args.draft_q}; mean accepted length = tokens per target pass, bonus included"
    )
    print(f"{'T':>5}{'rejection':>11}{'gumbel':>9}{'ratio':>8}")
    for temp in (float(t) for t in args.temps.split(",")):
        acc: dict[str, list[float]] = {s: [] for s in specs}
        for seed in range(args.seeds):
            for text in prompts:
                for name, spec in specs.items():
                    toks = spec.tokenize(text.encode(), add_bos=False)
                    list(spec.generate_tokens(toks, max_tokens=args.n_predict, temperature=temp, seed=seed))
                    acc[name].append(spec.stats.mean_accepted_length)
        r, g = statistics.mean(acc["rejection"]), statistics.mean(acc["gumbel"])
        print(f"{temp:>5.2f}{r:>11.3f}{g:>9.3f}{g / r:>7.2f}x")


if __name__ == "__main__":
    main()
