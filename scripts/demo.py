"""`make demo`: one prompt decoded greedily twice, plainly and speculatively, and the two compared.

    .venv/bin/python scripts/demo.py --target examples/tinycode/target-f16.gguf \
        --draft out/tinycode-dflash2-q4_0.gguf [-n 128] [--prompt-id bench-04] [--n-max 0] [--threads 0]

Prints the prompt and its continuation, then both decode speeds, the speculative run's mean accepted
length, and whether the two runs gave the same tokens. Exit status 1 when they did not (greedy
speculative decoding must reproduce the target's own greedy decoding token for token), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "examples" / "tinycode" / "prompts.jsonl"

# bench-04 (distutils/cygwinccompiler.py, a held-out file): the bundled target continues it with two new
# functions (docstrings, `if` tests, `return os.path.join(...)`), i.e. code. The greedy continuations of 11
# of the 20 prompts fall into one line or a few characters repeated (bench-00: `}` and 120 lines of `#`),
# text that is easy to draft and says little about drafting code.
DEFAULT_PROMPT = "bench-04"
WARMUP_TOKENS = 16


@dataclass
class Run:
    """One greedy generation: its tokens and the figures of it."""

    tokens: list[int]
    tokens_per_second: float
    steps: int  # target decode passes after the prefill
    drafting_steps: int
    drafted: int
    accepted: int
    mean_accepted_length: float


def load_prompt(path: Path, prompt_id: str) -> dict:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            p = json.loads(line)
            if p["id"] == prompt_id:
                return p
    raise ValueError(f"{path}: no prompt with id {prompt_id!r}")


def generate(llm, tokens: list[int], n: int, plain: bool) -> Run:
    out = list(llm.generate_tokens(tokens, max_tokens=n, temperature=0.0, plain=plain))
    s = llm.stats
    return Run(
        out, s.tokens_per_second, s.steps, s.steps - s.plain_steps, s.drafted, s.accepted, s.mean_accepted_length
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token lists differ (the shorter one's length if one is a prefix of
    the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(plain: Run, spec: Run, text_of: Callable[[list[int]], str]) -> tuple[list[str], bool]:
    """The comparison's lines, and whether the two runs gave the same tokens."""
    w = max(len(f"{r.tokens_per_second:.1f}") for r in (plain, spec))
    passes = len(str(max(plain.steps, spec.steps)))
    drafting = "" if spec.drafting_steps == spec.steps else f" ({spec.drafting_steps} of them drafting)"
    if spec.drafting_steps:
        acceptance = (
            f"mean accepted length {spec.mean_accepted_length:.2f} ({spec.accepted}/{spec.drafted} "
            f"drafted tokens accepted)"
        )
    else:
        acceptance = "no drafted tokens to accept"
    lines = [
        f"plain        {plain.tokens_per_second:{w}.1f} tok/s  {plain.steps:{passes}} target passes after the prefill",
        f"speculative  {spec.tokens_per_second:{w}.1f} tok/s  {spec.steps:{passes}} target passes{drafting}, "
        f"{acceptance}",
    ]
    if plain.tokens_per_second > 0:
        lines.append(
            f"speculative / plain decode speed: {spec.tokens_per_second / plain.tokens_per_second:.2f}x "
            f"(one timed run each, after a warm-up; it varies from run to run on a busy machine)"
        )
    at = first_difference(plain.tokens, spec.tokens)
    if at is None:
        lines.append(f"outputs identical: yes ({len(plain.tokens)} tokens)")
        return lines, True
    lines.append(f"outputs identical: NO, they differ from token {at} on")
    lines.append(f"  plain:       {text_of(plain.tokens[at:])!r}")
    lines.append(f"  speculative: {text_of(spec.tokens[at:])!r}")
    return lines, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", "-m", required=True, help="Target model GGUF.")
    ap.add_argument("--draft", "-d", required=True, help="DFlash drafter GGUF.")
    ap.add_argument("--prompts", default=str(PROMPTS), help="Prompts JSONL (id, file, line, text) [%(default)s].")
    ap.add_argument("--prompt-id", default=DEFAULT_PROMPT, help="Which prompt [%(default)s].")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="Tokens to generate [%(default)s].")
    ap.add_argument(
        "--n-max",
        default="0",
        help='Drafted tokens verified per pass: an int (0 = block size - 1) or "auto" [%(default)s].',
    )
    ap.add_argument("--threads", "-t", type=int, default=0, help="CPU threads (0 = the physical cores) [%(default)s].")
    ap.add_argument("--ctx-size", "-c", type=int, default=1024, help="Context size [%(default)s].")
    args = ap.parse_args(argv)
    if args.n_predict < 1:
        ap.error("-n must be >= 1")
    n_max: int | str = int(args.n_max) if args.n_max.isdigit() else args.n_max
    try:
        prompt = load_prompt(Path(args.prompts), args.prompt_id)
    except (OSError, ValueError) as e:
        ap.error(str(e))

    from dflash_gguf import SpeculativeLlama

    try:
        llm = SpeculativeLlama(args.target, args.draft, n_ctx=args.ctx_size, n_threads=args.threads, n_max=n_max)
    except (ValueError, RuntimeError) as e:  # a missing or unfit file, a bad --n-max
        ap.error(str(e))
    with llm:
        tokens = llm.tokenize(prompt["text"].encode("utf-8"), add_bos=False)

        def text_of(ids: list[int]) -> str:
            return llm.detokenize(ids).decode("utf-8", "replace")

        for plain in (True, False):  # so that neither timed run pays a first run's costs
            generate(llm, tokens, WARMUP_TOKENS, plain)
        plain_run = generate(llm, tokens, args.n_predict, plain=True)
        spec_run = generate(llm, tokens, args.n_predict, plain=False)
        lines, same = report(plain_run, spec_run, text_of)
        n_max_used = llm.n_max
        texts = {name: text_of(run.tokens) for name, run in (("plain", plain_run), ("speculative", spec_run))}

    print(f"== prompt {prompt['id']} ({prompt.get('file', '?')}, line {prompt.get('line', '?')}; {len(tokens)} tokens)")
    print(prompt["text"], end="" if prompt["text"].endswith("\n") else "\n")
    if same:
        print(f"== its greedy continuation, {len(spec_run.tokens)} tokens (the same from both runs)")
        print(texts["speculative"])
    else:
        for name, run in (("plain", plain_run), ("speculative", spec_run)):
            print(f"== its greedy continuation, {len(run.tokens)} tokens, {name}")
            print(texts[name])
    print(
        f"== plain vs speculative greedy decoding ({Path(args.target).name} + {Path(args.draft).name}, "
        f"n_max {n_max_used})"
    )
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
