#!/usr/bin/env python3
"""What repetition penalties cost the speculative loop: mean accepted length and speed vs plain decoding.

    .venv/bin/python scripts/bench_penalties.py [--draft out/tinycode-dflash2-q4_0.gguf] [--n-max 3]
                                                [--penalties 1.0,1.1,1.3] [--threads 2]

For each repeat_penalty, every bundled prompt is decoded greedily by the target alone (plain=True)
and by the speculative loop, back to back; the outputs must be identical (asserted), and the table
shows the mean accepted length and the median per-prompt speed ratio. The drafter was trained
without a penalty, so the more the penalty moves the target away from its unpenalized choice,
the fewer drafts are accepted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tinycode"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TINY / "target-f16.gguf"))
    ap.add_argument("--draft", default=str(ROOT / "out" / "tinycode-dflash2-q4_0.gguf"))
    ap.add_argument("--n-max", default="3")
    ap.add_argument("--penalties", default="1.0,1.1,1.3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    a = ap.parse_args()

    from dflash_gguf import SpeculativeLlama

    n_max = a.n_max if a.n_max == "auto" else int(a.n_max)
    llm = SpeculativeLlama(a.target, a.draft, n_ctx=2048, n_threads=a.threads, n_max=n_max)
    texts = [json.loads(line)["text"] for line in (TINY / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [llm.tokenize(t, add_special=False, parse_special=False) for t in texts]
    print(f"{Path(a.draft).name}, n_max {a.n_max}, {len(prompts)} prompts x {a.n_predict} tokens, greedy")
    print("repeat_penalty | mean accepted length | speed vs plain (median) | identical to plain")
    for rp in (float(x) for x in a.penalties.split(",")):
        accepted = drafted_steps = 0
        ratios = []
        for toks in prompts:
            plain = list(llm.generate_tokens(toks, max_tokens=a.n_predict, repeat_penalty=rp, plain=True))
            plain_tok_s = llm.stats.tokens_per_second
            ours = list(llm.generate_tokens(toks, max_tokens=a.n_predict, repeat_penalty=rp))
            assert ours == plain, f"repeat_penalty {rp}: the loop's output differs from plain decoding"
            s = llm.stats
            accepted += s.accepted
            drafted_steps += s.steps - s.plain_steps
            ratios.append(s.tokens_per_second / plain_tok_s)
        mal = (accepted + drafted_steps) / drafted_steps if drafted_steps else 1.0
        print(f"{rp:14.2f} | {mal:20.2f} | {statistics.median(ratios):22.2f}x | {len(prompts)}/{len(prompts)}")


if __name__ == "__main__":
    main()
