"""`dflash bench --scale`: the three-way bench end to end at realistic model sizes.

The bundled tinycode pair is so small that fixed overheads dominate its steps. This bench inflates it
(:mod:`.inflate`) to Qwen3-0.6B / 1.7B / 4B / 8B shapes that compute exactly its function, so the
trained drafter's acceptance carries over, and runs `dflash bench`'s interleaved three-way comparison
(plain decoding, ours, upstream llama-server's draft-dflash; same files, same settings) on each size and
target type. Beside each measured speedup it prints the speedup implied by that run's own measured step
costs (tokens / (draft + verify + inject time) against plain decoding's tokens per second): the cost
model, with the loop's overhead left out.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .inflate import (
    DRAFT_TYPE,
    SIZES,
    TARGET_TYPES,
    ScaleSize,
    default_scale_dir,
    ensure_pair,
    format_count,
    tinycode_dir,
)
from .options import BenchError, BenchOptions, NMax, parse_n_max, placement_flags
from .three_way import run_bench

DEFAULT_SIZES = "0.6B,1.7B"
DEFAULT_N_MAX = "2,3,auto"
DEFAULT_N_PREDICT = 32
DEFAULT_LIMIT = 3


def parse_sizes(text: str) -> list[ScaleSize]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in SIZES]
    if bad or not names:
        raise BenchError(
            f"--scale-sizes: unknown size {', '.join(bad) or repr(text)} (expected a comma list of {', '.join(SIZES)})"
        )
    return [SIZES[n] for n in names]


def parse_types(text: str) -> tuple[str, ...]:
    from dflash_convert.errors import ConversionError
    from dflash_convert.quantize import parse_outtype

    try:
        types = tuple(dict.fromkeys(parse_outtype(t).name for t in text.split(",") if t.strip()))
    except ConversionError as e:
        raise BenchError(f"--scale-types: {e}") from None
    if not types:
        raise BenchError(f"--scale-types: no type in {text!r} (expected a comma list of {', '.join(TARGET_TYPES)})")
    return types


def end_to_end_row(size: str, target_type: str, draft_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration of a run_bench result as the JSON's `end_to_end` row."""
    summary = cfg["summary"]
    row: dict[str, Any] = {
        "size": size,
        "target_type": target_type,
        "draft_type": draft_type,
        "n_max": cfg["n_max"],
        "ar_tok_s": summary["ar"]["tok_s"]["median"],
        "implied_speedup": None,
        "systems": {},
    }
    for system in ("ours", "upstream"):
        s = summary.get(system)
        if s is None:
            continue
        row["systems"][system] = {
            "speedup": s["speedup_vs_ar"]["median"],
            "acc_len": s["mean_accepted_length"],
            "identical": s.get("same_as_ar"),
            "runs": s["runs"],
        }
        if "draft_ms_per_step" in s:
            row["systems"][system]["draft_ms"] = s["draft_ms_per_step"]["median"]
        if system == "ours" and "limit_vs_ar" in s:
            row["implied_speedup"] = s["limit_vs_ar"]["median"]
            row["systems"]["ours"]["verify_ms"] = s["verify_ms_per_step"]["median"]
            for key in ("sample_ms", "rest_ms"):
                if f"{key}_per_step" in s:
                    row["systems"]["ours"][key] = s[f"{key}_per_step"]["median"]
        if system == "ours" and "steps_by_length" in s:  # what auto mode chose
            row["systems"]["ours"]["steps_by_length"] = s["steps_by_length"]
        if system == "ours" and "vs_upstream" in s:
            row["systems"]["ours"]["vs_upstream"] = s["vs_upstream"]["median"]
        if system == "ours" and "vs_n_max" in s:
            row["systems"]["ours"]["vs_n_max"] = {k: v["median"] for k, v in s["vs_n_max"].items()}
    return row


def run_scale(
    sizes: list[ScaleSize],
    *,
    folder: Path | None = None,
    target_types: tuple[str, ...] = TARGET_TYPES,
    n_max: str | list[NMax] = DEFAULT_N_MAX,
    n_predict: int = DEFAULT_N_PREDICT,
    limit: int | None = DEFAULT_LIMIT,
    repeat: int = 1,
    threads: int = 0,
    n_gpu_layers: int = 0,
    device: str = "auto",
    systems: list[str] | None = None,
    placement: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    progress: bool = True,
    source: Path | None = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    on_progress: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Generate (or reuse) every size's inflated pair and run the three-way bench on each target type (the
    targets' weights placed by `placement`: BenchOptions' override_tensor, cpu_moe, n_cpu_moe; llama-server
    from `server`: its server_binary, server_args); `repeat` rounds over the prompts; the result
    is what --json writes. `on_progress` gets the result so far after each target type (goals
    judged on the rows so far), so that what was measured outlives a later failure."""
    folder = folder or default_scale_dir()
    source = source or tinycode_dir()
    n_maxes = parse_n_max(n_max)
    result: dict[str, Any] = {
        "meta": {
            "kind": "scale",
            "sizes": [s.name for s in sizes],
            "target_types": list(target_types),
            "draft_type": DRAFT_TYPE,
            "n_max": n_maxes,
            "n_predict": n_predict,
            "limit": limit,
            "repeat": repeat,
            "threads": threads,
            "n_gpu_layers": n_gpu_layers,
            "device": device,
            "placement": placement or {},
            "scale_dir": str(folder),
            "host": platform.node(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "notes": [
            "inflated tinycode pairs: realistic shapes computing the bundled pair's function (bindings/dflash_gguf/"
            "bench/inflate.py); greedy; speedup = median over prompts of tok/s / plain tok/s on the same prompt",
            "implied = tokens / (draft + verify + inject ms) of our run against plain decoding: the step costs "
            "measured in that run, without the loop's overhead",
        ],
        "sizes": [],
        "end_to_end": [],
    }
    folder.mkdir(parents=True, exist_ok=True)
    for s in sizes:
        # the F16 target (the quantizer's source) and each other type; 4 bytes a drafter parameter on the way
        per_param = 2.0 + sum(_FILE_BYTES_PER_PARAM.get(t, 2.0) for t in target_types if t != "f16")
        need = per_param * s.target_params() + 4 * s.draft_params()
        free = shutil.disk_usage(folder).free
        if free < need and not any(folder.glob(f"{s.name}-{s.key()}-*.gguf")):
            raise BenchError(f"{folder}: {free / 1e9:.1f} GB free, the {s.name} pair needs about {need / 1e9:.1f} GB")
        pair = ensure_pair(s, folder, target_types=target_types, source=source, log=log)
        result["sizes"].append(
            {
                "size": asdict(s),
                "target_params": s.target_params(),
                "draft_params": s.draft_params(),
                "target_layer_ids": s.layer_ids(),
                "targets": {t: str(p) for t, p in pair.targets.items()},
                "draft": str(pair.draft),
            }
        )
        for t in target_types:
            o = BenchOptions(
                target=str(pair.targets[t]),
                draft=str(pair.draft),
                prompts=str(source / "prompts.jsonl"),
                n_predict=n_predict,
                n_max=n_maxes,
                threads=threads,
                n_gpu_layers=n_gpu_layers,
                device=device,
                limit=limit,
                repeat=repeat,
                progress=progress,
                **({"systems": systems} if systems else {}),
                **(placement or {}),
                **(server or {}),
            )
            log(f"[scale] {s.name} {t.upper()} target: {' / '.join(o.systems)} at n_max {', '.join(map(str, n_maxes))}")
            bench = run_bench(o, log)
            for cfg in bench["configs"]:
                result["end_to_end"].append(end_to_end_row(s.name, t, DRAFT_TYPE, cfg))
            result["meta"]["threads"] = bench["meta"]["threads"]
            result["notes"] += [n for n in bench["notes"] if n not in result["notes"]]
            gc.collect()
            on_progress(result | {"goals": goals(result["end_to_end"])})
    result["goals"] = goals(result["end_to_end"])
    return result


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals for this bench on a CPU, each judged on the measured rows (None: not measured)."""
    out = []

    def add(goal: str, met: bool | None, detail: str) -> None:
        out.append({"goal": goal, "met": met, "detail": detail})

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["target_type"]), []).append(r)
    both = [
        (r, r["systems"]["ours"], r["systems"]["upstream"]) for r in rows if {"ours", "upstream"} <= set(r["systems"])
    ]
    if both:
        # judged on ours' tok/s over upstream's paired by prompt run (run next to each other) where the row
        # has it: two medians of ratios to ar can order differently when a cell's prompts differ in speedup
        behind = [
            f"{r['size']} {r['target_type']} n_max {r['n_max']}: {o['speedup']:.2f}x vs {u['speedup']:.2f}x"
            + (f" (paired ours / upstream {o['vs_upstream']:.2f}x)" if "vs_upstream" in o else "")
            for r, o, u in both
            if (o["vs_upstream"] < 1.0 if "vs_upstream" in o else o["speedup"] < u["speedup"])
        ]
        add("ours ahead of upstream at every size, type and n_max", not behind, "; ".join(behind) or "all ahead")
    for t in ("f16", "q4_k_m"):
        rs = groups.get(("1.7B", t))
        if rs:
            best = max(r["systems"]["ours"]["speedup"] for r in rs if "ours" in r["systems"])
            add(f"ours >= 1.3x plain at 1.7B {t.upper()}", best >= 1.3, f"best {best:.2f}x")
    off = [
        (r, r["systems"]["ours"]["speedup"] / r["implied_speedup"])
        for r in rows
        if "ours" in r["systems"] and r["implied_speedup"]
    ]
    if off:
        worst = min(off, key=lambda x: x[1])
        where = f"worst {worst[1]:.0%} ({worst[0]['size']} {worst[0]['target_type']} n_max {worst[0]['n_max']})"
        add("measured within 10% of implied (the cost model holds)", worst[1] >= 0.90, where)
        add("ours within 5% of the limit its own measured costs allow", worst[1] >= 0.95, where)
    for (size, t), rs in groups.items():
        auto = [r for r in rs if r["n_max"] == "auto" and "ours" in r["systems"]]
        fixed = [r for r in rs if r["n_max"] != "auto" and "ours" in r["systems"]]
        if auto and fixed:
            ours = auto[0]["systems"]["ours"]
            a, b = ours["speedup"], max(r["systems"]["ours"]["speedup"] for r in fixed)
            detail = f"auto {a:.2f}x, best fixed {b:.2f}x"
            met = a >= 0.97 * b
            if ours.get("vs_n_max"):  # auto's tok/s over each length's, paired by prompt run: the best
                # fixed length is the one auto falls furthest behind
                k, v = min(ours["vs_n_max"].items(), key=lambda kv: kv[1])
                detail += f"; paired by prompt run, auto / n_max {k} {v:.2f}x"
                met = v >= 0.97
            add(f"auto within 3% of the best fixed n_max ({size} {t.upper()})", met, detail)
    return out


# a target file's bytes per parameter, by type (blocks' scales included; F16 and BF16 2)
_FILE_BYTES_PER_PARAM = {"q8_0": 1.07, "q4_k_m": 0.62}

_ARCH_NAMES = {"qwen3": "Qwen3", "qwen35": "Qwen3.5 hybrid", "qwen3moe": "Qwen3 MoE", "qwen35moe": "Qwen3.5 MoE hybrid"}


def format_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    where = f"target -ngl {m['n_gpu_layers']}" if m["n_gpu_layers"] else "target on CPU"
    where += "".join(" " + flag for flag in placement_flags(**m.get("placement", {})))
    lines = [
        f"dflash bench --scale: inflated tinycode pairs, {m['threads']} threads, {where}, greedy, "
        f"{m['limit'] or 'all'} prompts x {m['n_predict']} tokens"
        + (f" x {m['repeat']} rounds" if m.get("repeat", 1) > 1 else "")
        + f", drafter {m['draft_type']}"
    ]
    for s in result["sizes"]:
        z = s["size"]
        experts = (
            f"{z['n_experts']} experts x {z['expert_ff']}, {z['n_experts_used']} routed, " if z.get("n_experts") else ""
        )
        lines.append(
            f"  {z['name']}: {_ARCH_NAMES.get(z.get('arch', 'qwen3'), z.get('arch'))} shape "
            f"{format_count(s['target_params'])} params (hidden {z['hidden']}, {z['n_layers']} layers, {experts}vocab "
            f"{z['vocab']}) + DFlash2 drafter {format_count(s['draft_params'])} "
            f"({z['draft_layers']} layers, target layers {s['target_layer_ids']})"
        )
    w = max([5] + [len(r["size"]) for r in result["end_to_end"]])
    head = (
        f"{'size':<{w}} {'target':<7} {'n_max':>5} {'ar tok/s':>9}  {'ours':>6} {'implied':>8} {'acc':>5} "
        f"{'same':>5} {'draft':>6}  {'upstream':>8} {'acc':>5} {'same':>5} {'draft':>6}  {'ours/up':>7}"
    )
    lines += ["", head, "-" * len(head)]

    def ms(s: dict[str, Any]) -> str:
        return f"{s['draft_ms']:>6.1f}" if "draft_ms" in s else f"{'-':>6}"

    for r in result["end_to_end"]:
        o, u = r["systems"].get("ours"), r["systems"].get("upstream")
        ours = (
            f"{o['speedup']:>5.2f}x {r['implied_speedup']:>7.2f}x {o['acc_len']:>5.2f} "
            f"{o['identical']:>2}/{o['runs']:<2} {ms(o)}"
            if o
            else f"{'-':>6} {'-':>8} {'-':>5} {'-':>5} {'-':>6}"
        )
        up = (
            f"{u['speedup']:>7.2f}x {u['acc_len']:>5.2f} {u['identical']:>2}/{u['runs']:<2} {ms(u)}"
            if u
            else f"{'-':>8} {'-':>5} {'-':>5} {'-':>6}"
        )
        paired = f"{o['vs_upstream']:>6.2f}x" if o and "vs_upstream" in o else f"{'-':>7}"
        lines.append(
            f"{r['size']:<{w}} {r['target_type'].upper():<7} {str(r['n_max']):>5} {r['ar_tok_s']:>9.2f}  {ours}  {up}"
            f"  {paired}"
        )
    lines += [
        "",
        "speedup = median over prompts of tok/s / plain (ar) tok/s on the same prompt; implied = what "
        "ours' own measured draft + verify + inject times allow (no loop overhead); acc = mean accepted "
        "length (bonus token included); same = greedy outputs identical to ar; draft = ms per drafted "
        "step (upstream's: the drafting time llama-server logs, without its injection of the verified rows, "
        "which ours' includes); ours/up = median over prompt runs of "
        "ours' tok/s over upstream's on the same prompt, run next to each other.",
    ]
    if result.get("goals"):
        lines += ["", "goals:"]
        lines += [f"  [{'met' if g['met'] else 'NOT met'}] {g['goal']}: {g['detail']}" for g in result["goals"]]
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Written to a temp file next to `path`, then renamed: never half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


__all__ = ["end_to_end_row", "format_table", "goals", "parse_sizes", "parse_types", "run_scale", "write_json"]
