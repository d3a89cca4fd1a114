#!/usr/bin/env python3
"""What a GBNF grammar costs per generated token: ours vs llama_cpp.Llama, side by side in one run.

A grammar that allows every text (`root ::= [^\\x00]*`) changes no token, so the difference to the same
run without a grammar is the grammar's own cost. llama-cpp-python's sampler chain runs the grammar over
the whole vocabulary at every token; our greedy decoding checks the chosen token first and runs the
whole vocabulary only when the grammar rejects it.

A second table samples (T 0.8, top-k 40, top-p 0.95, min-p 0.05: llama-cpp-python's defaults) under a
grammar that rejects many tokens (lowercase code text): ours asks the grammar about the most likely
tokens one by one (the distribution is that of the top-k it allows), against the same loop masking the
whole vocabulary at every row (`grammar_full_pass`, same seeds, same tokens), and llama_cpp.Llama.

    .venv/bin/python scripts/bench_grammar.py [--prompts 10] [-n 64] [--rounds 2]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench_common import TINY, pair_parser


def main() -> None:
    ap = pair_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=10, help="first N bench prompts")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import llama_cpp
    from llama_cpp import LlamaGrammar

    from dflash_gguf import SpeculativeLlama
    from dflash_gguf.bench import load_prompts

    texts = [p["text"] for p in load_prompts(TINY / "prompts.jsonl", limit=a.prompts)]
    everything = LlamaGrammar.from_string("root ::= [^\\x00]*", verbose=False)
    theirs = llama_cpp.Llama(a.target, n_ctx=512, n_threads=a.threads, verbose=False)
    ours = SpeculativeLlama(a.target, a.draft, n_ctx=512, n_threads=a.threads, n_max=3)

    def ms_per_token(llm: Callable[..., Any], grammar: Any) -> float:
        t, n = time.perf_counter(), 0
        for text in texts:
            n += llm(text, max_tokens=a.n_predict, temperature=0, grammar=grammar)["usage"]["completion_tokens"]
        return (time.perf_counter() - t) / n * 1e3

    for llm in (theirs, ours):  # warm-up, not timed (graphs, ours' draft-length calibration)
        llm(texts[0], max_tokens=a.n_predict, temperature=0, grammar=everything)
    print(f"{len(texts)} prompts x {a.n_predict} tokens, greedy, n_vocab {ours.n_vocab()}; ms per token")
    for r in range(a.rounds):
        for name, llm in (("llama_cpp.Llama", theirs), ("ours (n_max 3)", ours)):
            plain, constrained = ms_per_token(llm, None), ms_per_token(llm, everything)
            print(
                f"round {r}  {name:16s} no grammar {plain:.3f}  allow-all grammar {constrained:.3f}  "
                f"grammar cost {constrained - plain:+.3f}"
            )

    code = 'root ::= [a-z \\n().=_:,"]+'
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    core, prompts = ours._spec, [ours.tokenize(t, add_bos=False) for t in texts]

    def ours_ms_per_token(full_pass: bool) -> tuple[float, float]:
        t, n, sample_ms = time.perf_counter(), 0, 0.0
        for seed, prompt in enumerate(prompts):
            out = [core.start(prompt, grammar=code, grammar_full_pass=full_pass, seed=seed, **sampling)]
            while len(out) < a.n_predict and ours.token_eos() not in out:  # the grammar may end it
                out += core.step()[0]
            n += len(out)
            sample_ms += core.stats["sample_ms"]
        return (time.perf_counter() - t) / n * 1e3, sample_ms / n

    def theirs_ms_per_token() -> float:
        t, n = time.perf_counter(), 0
        for seed, text in enumerate(texts):
            n += theirs(
                text,
                max_tokens=a.n_predict,
                grammar=LlamaGrammar.from_string(code, verbose=False),
                seed=seed,
                **sampling,
            )["usage"]["completion_tokens"]
        return (time.perf_counter() - t) / n * 1e3

    print(f"\nsampled under {code} (T 0.8, top-k 40, top-p 0.95, min-p 0.05); ms per token (ours: of which sampling)")
    for r in range(a.rounds):
        (full, full_s), (short, short_s) = ours_ms_per_token(True), ours_ms_per_token(False)
        print(
            f"round {r}  ours whole-vocabulary masking {full:.3f} ({full_s:.3f})  most likely first {short:.3f} "
            f"({short_s:.3f})  llama_cpp.Llama {theirs_ms_per_token():.3f}"
        )


if __name__ == "__main__":
    main()
