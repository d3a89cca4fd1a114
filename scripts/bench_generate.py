#!/usr/bin/env python3
"""Speculative decoding vs plain decoding of the same target, side by side.

Both run the same C++ loop in one process (plain = the target alone, one token
per llama_decode, no drafting), interleaved prompt by prompt so that machine
drift hits both alike; the first prompt is a warm-up and not counted.

    python scripts/bench_generate.py --draft out/tinycode-dflash2-f32.gguf
    python scripts/bench_generate.py --draft D.gguf --n-gpu-layers 99 --temp 1.0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash_gguf import SpeculativeLlama

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples" / "tinycode"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(EX / "target-f16.gguf"))
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default=str(EX / "prompts.jsonl"))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--n-max", default="auto", help='"auto" or an int (0 = block_size - 1)')
    ap.add_argument("--draft-q", default="logits", choices=["logits", "selector"])
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-fallback", action="store_true")
    ap.add_argument("--json", help="write per-prompt figures here")
    a = ap.parse_args()

    llm = SpeculativeLlama(a.target, a.draft, n_ctx=512, n_gpu_layers=a.n_gpu_layers, n_threads=a.threads,
                           n_max=a.n_max if a.n_max == "auto" else int(a.n_max), draft_q=a.draft_q, device=a.device, fallback=not a.no_fallback)
    prompts = [json.loads(line) for line in open(a.prompts)]
    rows = []
    identical = 0
    for i, p in enumerate([prompts[0]] + prompts):  # prompts[0] twice: the first is the warm-up
        toks = llm.tokenize(p["text"], add_special=False, parse_special=False)
        row: dict = {"id": p["id"]}
        outs = {}
        for mode in ("plain", "spec"):
            t0 = time.perf_counter()
            out = outs[mode] = list(llm.generate_tokens(toks, max_tokens=a.n, temperature=a.temp, seed=i, plain=mode == "plain"))
            s = llm.stats
            row[mode] = {"tokens": len(out), "decode_s": s.decode_ms / 1e3, "tok_s": s.tokens_per_second,
                         "wall_s": time.perf_counter() - t0}
            if mode == "spec":
                row[mode].update(steps=s.steps, plain_steps=s.plain_steps, drafted=s.drafted, accepted=s.accepted,
                                 draft_ms=s.draft_ms, verify_ms=s.verify_ms, inject_ms=s.inject_ms,
                                 mean_accepted_length=s.mean_accepted_length)
        if i > 0:
            rows.append(row)
            identical += outs["plain"] == outs["spec"]

    plain_tps = [r["plain"]["tok_s"] for r in rows]
    spec_tps = [r["spec"]["tok_s"] for r in rows]
    ratios = [s / p for s, p in zip(spec_tps, plain_tps)]
    drafted_steps = sum(r["spec"]["steps"] - r["spec"]["plain_steps"] for r in rows)
    accepted = sum(r["spec"]["accepted"] for r in rows)
    steps = sum(r["spec"]["steps"] for r in rows)
    print(f"target {a.target}  draft {a.draft}  device {llm._spec.draft_device}  n_gpu_layers {a.n_gpu_layers}")
    print(f"{len(rows)} prompts x {a.n} tokens, temperature {a.temp}, n_max {llm.n_max}, draft_q {a.draft_q}")
    print(f"plain decoding      median {statistics.median(plain_tps):8.1f} tok/s")
    print(f"speculative (ours)  median {statistics.median(spec_tps):8.1f} tok/s   "
          f"speedup median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})")
    if drafted_steps:
        print(f"mean accepted length {(accepted + drafted_steps) / drafted_steps:.2f} (bonus included) over "
              f"{drafted_steps} drafted steps; {steps - drafted_steps} fallback plain steps")
        d = sum(r["spec"]["draft_ms"] for r in rows) / drafted_steps
        v = sum(r["spec"]["verify_ms"] for r in rows) / steps
        inj = sum(r["spec"]["inject_ms"] for r in rows) / drafted_steps
        print(f"per step: draft {d:.3f} ms, verify {v:.3f} ms, inject {inj:.3f} ms; "
              f"plain decode {1e3 / statistics.median(plain_tps):.3f} ms/token")
    if a.temp == 0:
        print(f"greedy output identical to plain decoding on {identical}/{len(rows)} prompts")
    print(f"drafter counters: {llm._spec.draft_counters}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
