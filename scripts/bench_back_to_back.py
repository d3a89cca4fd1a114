#!/usr/bin/env python3
"""Speculative vs plain decoding, each prompt's two runs back to back on one Speculator.

`dflash bench` measures each n_max as its own configuration, each with its own plain baseline,
minutes apart; on a shared machine that moves a configuration's ratio by +-5%. Here every
speculative run directly follows a plain run of the same prompt on the same object (whose
draft-length controller does not see plain runs), and the figure is the mean of the per-run
ratios, so close choices (a drafter that about ties with plain decoding) can be told apart.

    .venv/bin/python scripts/bench_back_to_back.py --draft out/tinycode-dflash2-f16.gguf --n-max 2,3,auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash_gguf._core import Speculator

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TINY / "target-f16.gguf"))
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default=str(TINY / "prompts.jsonl"))
    ap.add_argument("--n-max", default="2,3,auto", help="comma list of ints and auto")
    ap.add_argument("-n", type=int, default=128, help="tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    texts = [json.loads(line)["text"] for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    for n_max in a.n_max.split(","):
        auto = n_max == "auto"
        sp = Speculator(a.target, a.draft, n_ctx=512, n_threads=a.threads, adaptive=auto,
                        n_max=0 if auto else int(n_max))
        prompts = [sp.tokenize(t.encode("utf-8"), False, False) for t in texts]

        def run(tokens: list[int], plain: bool) -> float:
            sp.start([(tokens[0] + 1) % sp.n_vocab])  # a fresh prefill each time, as the bench does
            sp.start(tokens)
            step = sp.step_plain if plain else sp.step
            n, t0 = 1, time.perf_counter()
            while n < a.n:
                out, _ = step()
                n += len(out)
            return n / (time.perf_counter() - t0)

        run(prompts[0], True)  # warm-up (and, in auto mode, the calibration)
        run(prompts[0], False)
        ratios = []
        for _ in range(a.rounds):
            for p in prompts:
                plain = run(p, True)
                ratios.append(run(p, False) / plain)
        print(f"n_max {n_max}: speculative / plain tok/s, mean of {len(ratios)} back-to-back pairs "
              f"{statistics.mean(ratios):.3f} (median {statistics.median(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
