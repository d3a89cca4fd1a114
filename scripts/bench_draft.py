#!/usr/bin/env python3
"""Draft-step latency of the tinycode drafter vs the target's verify latency, same block size.

    .venv/bin/python scripts/bench_draft.py [--device cpu] [--n-threads 2] [--blocks 8,16]
                                            [--context 256] [--reps 200] [--outtype f16]
                                            [--compare-types f16,bf16,q8_0,q4_0,q4_0:portable]

One draft step = our Drafter.draft() of one block [anchor, MASK x (B-1)] over a draft cache
of --context injected rows (tokens only, no details). One verify step = libllama's
llama_decode of B tokens with logits for every row on the tinycode target
(examples/tinycode/target-f16.gguf) after a --context-token prefill, then
llama_memory_seq_rm back to the prefix (outside the timed region); each block size decodes in a
libllama context of its own, so its graph is reused as in a loop of one draft length (a single
context alternating sizes would rebuild its graph on every decode, making verifies slower and the
drafter's ratio look better than it is). On a GPU the verify
time includes llama_synchronize. The target is timed with flash attention off and with
libllama's default (auto, which turns it on): on a CPU, FA makes this tiny target's
multi-token decode several times slower, so the ratio uses the faster of the two, so as
not to flatter the drafter. Measurements are interleaved (draft B1, verify B1,
draft B2, verify B2, ...) so both sides see the same machine load; the table shows
medians (and p10/p90) over --reps. Goal (reported, not asserted): a draft step
<= 25% of a verify step.

The bundled drafter has block_size 8; block 16 uses a temp copy of its checkpoint with
block_size edited to 16 (the weights do not depend on the block size), converted like
the original. Nothing is written outside a temp directory.

A second table times the steps the speculative loop really runs with the first block size: a draft of
k tokens is the short block [anchor, MASK x k] (as llama.cpp drafts), verified by a decode of k + 1
tokens (flash attention as our runtime sets it: off on the CPU, libllama's choice on a GPU).

With --compare-types, a third table times those short-block drafts for each listed drafter type
(the same checkpoint converted to each), interleaved with each other, so the types compare on the
same machine load: which type drafts fastest depends on the CPU (AVX512-BF16, VNNI, repacking).
A type written TYPE:portable is that drafter built as DFLASH_PORTABLE_GRAPH=1 builds it (the graph every
backend runs, without the CPU's one-op convs), to time the two graphs side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import TINY

GOAL = 0.25


def make_drafter_gguf(tmp: Path, block: int, outtype: str, target: Path) -> Path:
    from dflash_convert.convert import Options, convert

    src = TINY / "drafter-dflash2"
    cfg = json.loads((src / "config.json").read_text())
    if cfg["dflash_config"]["block_size"] != block:
        dst = tmp / f"drafter-b{block}"
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "config.json":
                (dst / f.name).symlink_to(f.resolve())
        cfg["block_size"] = block
        cfg["dflash_config"]["block_size"] = block
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
        src = dst
    out = tmp / f"drafter-b{block}-{outtype}.gguf"
    convert(Options(draft_dir=src, target=target, outfile=out, outtype=outtype, force=True, progress=False))
    return out


def cell(r: dict) -> str:
    """A spread() of milliseconds as the tables show it: median [p10, p90]."""
    return f"{r['median']:8.3f} [{r['p10']:7.3f}, {r['p90']:7.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        default="cpu",
        help="Drafter device: cpu, auto, or a ggml device name (e.g. CUDA0); anything but cpu also offloads the target",
    )
    ap.add_argument("--n-threads", type=int, default=2, help="CPU threads for both (default 2)")
    ap.add_argument("--blocks", default="8,16", help="block sizes (default 8,16)")
    ap.add_argument("--context", type=int, default=256, help="committed context length (default 256)")
    ap.add_argument("--reps", type=int, default=200, help="timed repetitions per measurement (default 200)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--outtype", default="f16", help="drafter GGUF type (default f16)")
    ap.add_argument(
        "--compare-types",
        default="",
        help="comma list of drafter types whose short-block drafts "
        "are timed side by side (e.g. f16,bf16,q8_0,q4_0); TYPE:portable = that type's drafter "
        "with the graph every backend runs",
    )
    ap.add_argument("--target", type=Path, default=TINY / "target-f16.gguf")
    ap.add_argument(
        "--flash-attn",
        choices=("both", "off", "auto", "on"),
        default="both",
        help="the target's flash attention: 'both' times off and auto (libllama's default) "
        "and takes the faster as the baseline (default)",
    )
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    gpu = args.device.lower() != "cpu"

    import dflash_gguf
    from dflash_gguf.bench import spread
    from dflash_gguf.bench.verify_timing import (
        FLASH_ATTN_AUTO,
        FLASH_ATTN_OFF,
        FLASH_ATTN_ON,
        Verifier,
        load_model,
        runtime_flash_attn,
    )

    with tempfile.TemporaryDirectory(prefix="bench_draft_") as tmpd:
        tmp = Path(tmpd)
        # the target first, as our runtime does (with the CUDA build, libllama's model load can segfault in
        # llama_model::print_info, its std::ostream calls served by libggml-cuda.so: docs/reliability.md)
        llc, model = load_model(args.target, n_gpu_layers=999 if gpu else 0)
        drafters = {}
        rng = np.random.default_rng(1)
        for b in blocks:
            path = make_drafter_gguf(tmp, b, args.outtype, args.target)
            d = dflash_gguf.Drafter(
                str(path),
                str(args.target),
                device=args.device,
                n_threads=args.n_threads,
                n_ctx=(args.context + 2 * b + 255) // 256 * 256,
            )
            assert d.hparams["block_size"] == b
            width = d.hparams["target_hidden"] * len(d.hparams["target_layers"])
            features = rng.standard_normal((args.context, width)).astype(np.float32)
            d.inject(features, np.arange(args.context, dtype=np.int32))
            drafters[b] = d
        typed = {}  # --compare-types: the first block size's drafter in each type, fed the same rows
        ggufs: dict[str, Path] = {}
        for t in [t for t in args.compare_types.split(",") if t]:
            outtype, _, variant = t.partition(":")
            if variant not in ("", "portable"):
                ap.error(f"--compare-types {t}: the only variant is TYPE:portable")
            if variant:
                os.environ["DFLASH_PORTABLE_GRAPH"] = "1"  # read when the Drafter is made
            if outtype not in ggufs:
                ggufs[outtype] = make_drafter_gguf(tmp, blocks[0], outtype, args.target)
            d = dflash_gguf.Drafter(
                str(ggufs[outtype]),
                str(args.target),
                device=args.device,
                n_threads=args.n_threads,
                n_ctx=(args.context + 2 * blocks[0] + 255) // 256 * 256,
            )
            os.environ.pop("DFLASH_PORTABLE_GRAPH", None)
            d.inject(features, np.arange(args.context, dtype=np.int32))
            typed[t] = d
        dev_name = drafters[blocks[0]].device
        fa_modes = {"off": FLASH_ATTN_OFF, "auto": FLASH_ATTN_AUTO, "on": FLASH_ATTN_ON}
        modes = list(fa_modes) if args.flash_attn == "both" else [args.flash_attn]
        modes = [m for m in modes if m != "on"] if args.flash_attn == "both" else modes
        verifiers = {m: Verifier(llc, model, args.context, max(blocks), args.n_threads, fa_modes[m]) for m in modes}

        def draft_once(b: int) -> float:
            t0 = time.perf_counter()
            drafters[b].draft(200, args.context)
            return time.perf_counter() - t0

        def short_once(k: int, d: Any = None) -> float:
            d = drafters[blocks[0]] if d is None else d
            t0 = time.perf_counter()
            d.draft(200, args.context, k, short_block=True)
            return time.perf_counter() - t0

        loop_ks = range(1, blocks[0])
        runtime_mode = {v: k for k, v in fa_modes.items()}[runtime_flash_attn(999 if gpu else 0)]
        loop_verifier = verifiers[runtime_mode if runtime_mode in verifiers else modes[0]]
        for _ in range(args.warmup):
            for b in blocks:
                draft_once(b)
                for v in verifiers.values():
                    v.verify(b)
            for k in loop_ks:
                short_once(k)
                for d in typed.values():
                    short_once(k, d)
        counters0 = {b: dict(drafters[b].counters) for b in blocks}
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.reps):
            for b in blocks:
                times.setdefault(("draft", b), []).append(draft_once(b))
                for m, v in verifiers.items():
                    times.setdefault((m, b), []).append(v.verify(b))
            for k in loop_ks:
                times.setdefault(("short", k), []).append(short_once(k))
                times.setdefault(("loop verify", k), []).append(loop_verifier.verify(k + 1))
                for t, d in typed.items():
                    times.setdefault((t, k), []).append(short_once(k, d))
        for v in verifiers.values():
            v.close()
        llc.llama_model_free(model)

        print(
            f"drafter: examples/tinycode/drafter-dflash2 ({args.outtype}) on {dev_name}, n_threads {args.n_threads}; "
            f"target: {args.target.name} via libllama llama_decode ({'GPU offload' if gpu else 'CPU'}), "
            f"all logits; context {args.context}; {args.reps} interleaved reps; ms (median [p10, p90])"
        )
        vcols = "".join(f" | {'verify, FA ' + m:<26}" for m in modes)
        print(f"{'block':>5} | {'draft step':<26}{vcols} | draft/verify (best) | goal <= {GOAL:.0%}")
        ok = True
        for b in blocks:
            dr = spread([1e3 * x for x in times[("draft", b)]])
            line = f"{b:>5} | {cell(dr)}"
            best = None
            for m in modes:
                vr = spread([1e3 * x for x in times[(m, b)]])
                best = vr["median"] if best is None else min(best, vr["median"])
                line += f" | {cell(vr)}"
            ratio = dr["median"] / best
            met = ratio <= GOAL
            ok &= met
            line += f" | {ratio:19.1%} | {'met' if met else 'NOT met'}"
            print(line)
        if len(modes) > 1:
            for b in blocks:
                ratios = ", ".join(
                    f"fa={m}: {statistics.median(times[('draft', b)]) / statistics.median(times[(m, b)]):.1%}"
                    for m in modes
                )
                print(f"B={b}: draft/verify per flash-attention setting: {ratios}")
        print(
            f"\nthe loop's steps (block {blocks[0]}): draft of k tokens (short block) vs verify of k + 1 tokens; "
            "ms (median [p10, p90])"
        )
        print(f"{'k':>5} | {'draft, short block':<26} | {'verify k + 1':<26} | draft/verify")
        for k in loop_ks:
            dr = spread([1e3 * x for x in times[("short", k)]])
            vr = spread([1e3 * x for x in times[("loop verify", k)]])
            print(f"{k:>5} | {cell(dr)} | {cell(vr)} | {dr['median'] / vr['median']:12.1%}")
        if typed:
            print(
                f"\nshort-block drafts of k tokens (block {blocks[0]}) per drafter type, interleaved; "
                "ms (median [p10, p90]); threads = the count the drafter picked for its steps"
            )
            print(f"{'k':>5} | " + " | ".join(f"{t:<26}" for t in typed) + " | verify k + 1 (median)")
            for k in loop_ks:
                cells = " | ".join(cell(spread([1e3 * x for x in times[(t, k)]])) for t in typed)
                print(f"{k:>5} | {cells} | {1e3 * statistics.median(times[('loop verify', k)]):8.3f}")
            print("threads: " + ", ".join(f"{t} {d.counters.get('draft_threads')}" for t, d in typed.items()))
        for b in blocks:
            c0, c1 = counters0[b], drafters[b].counters
            print(
                f"B={b}: drafter counters after the timed reps {c1} "
                f"(sched_reallocs during timing: {c1['sched_reallocs'] - c0['sched_reallocs']})"
            )
        print(
            "goal met for every block (against the faster verify)"
            if ok
            else "goal NOT met for every block (against the faster verify)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
