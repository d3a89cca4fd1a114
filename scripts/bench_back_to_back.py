#!/usr/bin/env python3
"""Speculative vs plain decoding, each prompt's two runs back to back on one object.

`dflash bench` measures each n_max as its own configuration, each with its own plain baseline,
minutes apart; on a shared machine that moves a configuration's ratio by +-5%. Here every
speculative run directly follows a plain run (plain=True) of the same prompt with the same
settings on the same SpeculativeLlama (whose draft-length controller does not see plain runs);
the outputs must be identical (asserted, greedy), and the table gives the mean and median of the
per-run speed ratios and the mean accepted length, per n_max and per repeat_penalty (the drafter
was trained without a penalty, so the more the penalty moves the target away from its
unpenalized choice, the fewer drafts are accepted). --sampling adds sampled runs (the same seed for
both runs of a prompt; their texts then differ, so nothing is asserted): T = 1 alone, llama_cpp.Llama's
completion defaults, locally typical sampling and Mirostat v1 / v2.

    .venv/bin/python scripts/bench_back_to_back.py --draft out/tinycode-dflash2-f16.gguf --n-max 2,3,auto
    .venv/bin/python scripts/bench_back_to_back.py --n-max 3 --penalties 1.0,1.1,1.3 --rounds 1
    .venv/bin/python scripts/bench_back_to_back.py --n-max auto --sampling greedy,t1,mirostat2
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench_common import TINY, pair_parser

MIN_TOKENS = 16
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},
    "defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},  # llama_cpp.Llama's
    "typical": {"temperature": 1.0, "typical_p": 0.9},
    "mirostat1": {"temperature": 1.0, "mirostat_mode": 1},
    "mirostat2": {"temperature": 1.0, "mirostat_mode": 2},
}


def main() -> None:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", default=str(TINY / "prompts.jsonl"))
    ap.add_argument("--n-max", default="2,3,auto", help="comma list of ints and auto")
    ap.add_argument("--penalties", default="1.0", help="comma list of repeat_penalty values")
    ap.add_argument("--sampling", default="greedy", help=f"comma list of {', '.join(SAMPLING)}")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.bench import load_prompts

    texts = [p["text"] for p in load_prompts(a.prompts)]
    print(f"{Path(a.draft).name}, {len(texts)} prompts x {a.n_predict} tokens x {a.rounds} rounds")
    print("n_max | sampling  | repeat_penalty | speculative / plain tok/s: mean (median) | mean accepted length")
    for n_max in a.n_max.split(","):
        llm = SpeculativeLlama(
            a.target, a.draft, n_ctx=2048, n_threads=a.threads, n_max=n_max if n_max == "auto" else int(n_max)
        )
        prompts = [llm.tokenize(t, add_special=False, parse_special=False) for t in texts]
        for name, rp in ((n, float(x)) for n in a.sampling.split(",") for x in a.penalties.split(",")):
            sampling = SAMPLING[name]

            def run(toks: list[int], plain: bool, seed: int, llm=llm, rp=rp, sampling=sampling) -> list[int]:
                return list(
                    llm.generate_tokens(
                        toks, max_tokens=a.n_predict, repeat_penalty=rp, plain=plain, seed=seed, **sampling
                    )
                )

            run(prompts[0], True, 0)  # warm-up (and, in auto mode, the calibration)
            run(prompts[0], False, 0)
            ratios, accepted, drafted_steps, short = [], 0, 0, 0
            for r in range(a.rounds):
                for i, toks in enumerate(prompts):
                    plain = run(toks, True, r * len(prompts) + i)
                    plain_tok_s = llm.stats.tokens_per_second
                    ours = run(toks, False, r * len(prompts) + i)
                    assert name != "greedy" or ours == plain, (
                        f"n_max {n_max}, repeat_penalty {rp}: output differs from plain decoding"
                    )
                    s = llm.stats
                    if min(len(plain), len(ours)) < MIN_TOKENS:  # a sampled end of text: no speed to compare
                        short += 1
                        continue
                    ratios.append(s.tokens_per_second / plain_tok_s)
                    accepted += s.accepted
                    drafted_steps += s.steps - s.plain_steps
            mal = (accepted + drafted_steps) / drafted_steps if drafted_steps else 1.0
            print(
                f"{n_max:>5} | {name:9} | {rp:14.2f} | {statistics.mean(ratios):.3f}x ({statistics.median(ratios):.3f}x)"
                f"{'':19} | {mal:.2f}" + (f" (left out: {short} runs under {MIN_TOKENS} tokens)" if short else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
