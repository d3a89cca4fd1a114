"""What a saved context buys: a long prompt's prefill against load_state + the first token, and what
save_state costs, on the 0.6B-shaped inflated pair of `dflash bench --scale` (generated on first use
into its cache folder) or on --target/--draft.

    .venv/bin/python scripts/bench_state.py [--prompt-tokens 1000] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from bench_common import pair_parser

import dflash_gguf
from dflash_gguf.bench.inflate import SIZES, default_scale_dir, ensure_pair


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = pair_parser(__doc__)
    ap.set_defaults(target=None, draft=None)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.target is None or args.draft is None:
        pair = ensure_pair(SIZES["0.6B"], default_scale_dir(), target_types=("f16",), log=print)
        args.target, args.draft = str(pair.targets["f16"]), str(pair.draft)
    llm = dflash_gguf.SpeculativeLlama(
        args.target, args.draft, n_ctx=args.prompt_tokens + 64, n_threads=args.threads, n_max=3
    )
    prompt = np.random.default_rng(0).integers(100, 2047, args.prompt_tokens).tolist()  # real tokens
    other = prompt[:1] + [7] * 8  # a short prompt sharing only the first token: the context moves away
    for r in range(args.rounds):
        t0 = time.perf_counter()
        list(llm.generate_tokens(prompt, max_tokens=1))
        prefill = ms(t0)
        t0 = time.perf_counter()
        llm.save_state()  # the drafter still has the prompt's rows to write: that work is done here
        save_first = ms(t0)
        t0 = time.perf_counter()
        state = llm.save_state()
        save = ms(t0)
        list(llm.generate_tokens(other, max_tokens=1))
        t0 = time.perf_counter()
        llm.load_state(state)
        load = ms(t0)
        t0 = time.perf_counter()
        list(llm.generate_tokens(prompt, max_tokens=1))
        first = ms(t0)
        assert llm.stats.reused_prompt_tokens == len(prompt) - 1
        print(
            f"round {r + 1}: {len(prompt)}-token prompt: prefill + first token {prefill:.0f} ms | load_state "
            f"{load:.0f} ms + first token {first:.0f} ms = {prefill / (load + first):.1f}x faster | save_state "
            f"{save:.0f} ms ({save_first:.0f} ms right after the prefill) | state "
            f"{state.llama_state_size / 2**20:.1f} MiB (target {len(state.target) / 2**20:.1f}, draft "
            f"{len(state.draft) / 2**20:.1f})",
            flush=True,
        )
        list(llm.generate_tokens(other, max_tokens=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
