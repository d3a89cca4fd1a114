"""What rolling back a rejected draft costs on a recurrent target, side by side in one run.

The same prompts through our loop at one fixed n_max, greedy, rounds interleaved, on:
  dense       the tinycode pair (attention K/V: seq_rm)
  snapshots   the hybrid pair (examples/tinycode-hybrid) with libllama's recurrent-state snapshots
  checkpoint  the hybrid pair through an adopted llama_cpp.Llama (no snapshots: a state checkpoint before
              each verify, restored with the kept tokens re-decoded after a rejection)
plus plain decoding of each target. The two hybrid modes see the same acceptance (same target, same
drafter), so their difference per step is the cost of the rollback kind; the rollback column is the time
in checkpoint writes and restores (snapshot writes happen inside libllama's decode, in verify).

    .venv/bin/python scripts/bench_rollback.py [--n-max 3] [-n 64] [--limit 20] [--repeat 2] [-t 2]
(make hybrid first; drafters are converted to q4_0 under out/)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_common import ROOT, TINY, converted_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-max", default="3", help="an int, or auto")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n_max = args.n_max if args.n_max == "auto" else int(args.n_max)

    import llama_cpp

    from dflash_gguf import SpeculativeLlama

    hybrid = ROOT / "examples" / "tinycode-hybrid"
    if not (hybrid / "target-f16.gguf").exists():
        raise SystemExit(f"{hybrid / 'target-f16.gguf'} missing: run `make hybrid` first")
    out = ROOT / "out"
    pairs = {
        "dense": (
            TINY / "target-f16.gguf",
            converted_drafter(TINY / "drafter-dflash2", TINY / "target-f16.gguf", out / "tinycode-dflash2-q4_0.gguf"),
        ),
        "hybrid": (
            hybrid / "target-f16.gguf",
            converted_drafter(hybrid / "drafter-dflash2", hybrid / "target-f16.gguf", out / "hybrid-dflash2-q4_0.gguf"),
        ),
    }
    kw = dict(n_ctx=1024, n_threads=args.threads, n_max=n_max)
    systems = {
        "dense": SpeculativeLlama(str(pairs["dense"][0]), str(pairs["dense"][1]), **kw),
        "snapshots": SpeculativeLlama(str(pairs["hybrid"][0]), str(pairs["hybrid"][1]), **kw),
    }
    llm = llama_cpp.Llama(
        str(pairs["hybrid"][0]), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
    )
    systems["checkpoint"] = SpeculativeLlama.from_llama(llm, str(pairs["hybrid"][1]), n_max=n_max)
    prompts = [json.loads(line)["text"] for line in (TINY / "prompts.jsonl").read_text().splitlines()]
    prompts = prompts[: args.limit or None]
    rows: dict[str, dict[str, list[float]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeat):
        for text in prompts:
            for name, spec in systems.items():
                toks = spec.tokenize(text.encode(), add_bos=False)
                for plain in (True, False):
                    key = f"{name}{' plain' if plain else ''}"
                    spec.reset()  # a whole prefill each time: prefix reuse is not what is measured
                    t0 = time.perf_counter()
                    ids = list(spec.generate_tokens(toks, max_tokens=args.n_predict, plain=plain))
                    dt = time.perf_counter() - t0 - spec.stats.prefill_ms / 1e3
                    s = spec.stats
                    drafted = max(s.steps - s.plain_steps, 1)
                    r = rows.setdefault(key, {k: [] for k in ("tok_s", "acc_len", "verify_ms", "rollback_ms")})
                    r["tok_s"].append(len(ids) / dt)
                    r["acc_len"].append(s.mean_accepted_length)
                    r["verify_ms"].append(s.verify_ms / max(s.steps, 1))
                    r["rollback_ms"].append(s.rollback_ms / drafted)
                    outputs.setdefault(key, []).append(ids)
    print(
        f"{len(prompts)} prompts x {args.repeat} rounds, {args.n_predict} tokens, n_max {args.n_max}, "
        f"threads {args.threads}, greedy; medians per run"
    )
    print(f"{'system':<18}{'tok/s':>9}{'vs plain':>10}{'acc.len':>9}{'verify ms':>11}{'rollback ms':>13}")
    summary = {}
    for name in systems:
        base = (
            statistics.median(rows[f"{name} plain"]["tok_s"])
            if name != "checkpoint"
            else statistics.median(rows["snapshots plain"]["tok_s"])
        )
        for key in (f"{name} plain", name):
            r = {k: statistics.median(v) for k, v in rows[key].items()}
            r["speedup"] = r["tok_s"] / base
            summary[key] = r
            print(
                f"{key:<18}{r['tok_s']:>9.1f}{r['speedup']:>9.2f}x{r['acc_len']:>9.2f}{r['verify_ms']:>11.3f}"
                f"{r['rollback_ms']:>13.4f}"
            )
    same = {name: sum(a == b for a, b in zip(outputs[name], outputs[f"{name} plain"])) for name in systems}
    print(
        "greedy output identical to plain decoding of the same target: "
        + ", ".join(f"{name} {n}/{len(outputs[name])}" for name, n in same.items())
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
