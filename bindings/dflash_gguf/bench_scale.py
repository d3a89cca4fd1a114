"""`dflash bench --scale`: what a draft step and a verify step cost at realistic model sizes.

The bundled tinycode pair is so small that fixed overheads dominate its steps. This bench takes
random-weight Qwen3 targets shaped like Qwen3-0.6B and Qwen3-1.7B with matching 5-layer DFlash2
drafters (made and cached by :mod:`.scale_models`) and times, interleaved and repeated:

- draft:  our ``Drafter.draft()`` of k tokens as the speculative loop runs it (the short block
  [anchor, MASK x k]) after ``context`` injected rows;
- verify: the target's ``llama_decode`` of k+1 tokens (k = 1..B-1 drafted), logits for every row,
  the drafter's feature layers extracted, after a ``context``-token prefill (rolled back after each);
- plain:  the same for 1 token: one step of plain decoding.

From the medians: c(k) = t_draft / t_verify(k), and the speedup those costs imply at a mean
accepted length tau (bonus token included), S(k) = min(tau, k+1) * t_plain / (t_draft + t_verify(k)).
S is implied by measured costs, not measured end to end: the weights are random.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._core import default_cpu_threads
from .bench import BenchError, spread
from .scale_models import (
    SIZES,
    ScaleSize,
    default_scale_dir,
    drafter_tensor_shapes,
    ensure_models,
    format_count,
    n_params,
    target_tensor_shapes,
)


@dataclass(frozen=True)
class Tau:
    """A mean accepted length (bonus token included) measured somewhere, and at how many drafts."""

    value: float
    k: int
    source: str


TAUS = (
    Tau(3.84, 7, "bundled tinycode pair, greedy, n_max 7 (README, measured)"),
    Tau(4.8, 15, "DFlash blog, low end (block 16)"),
    Tau(6.0, 15, "DFlash blog, high end (block 16)"),
)


def parse_sizes(text: str) -> list[ScaleSize]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in SIZES]
    if bad or not names:
        raise BenchError(f"--scale-sizes: unknown size {', '.join(bad) or repr(text)} (expected a comma list of "
                         f"{', '.join(SIZES)})")
    return [SIZES[n] for n in names]


# --- measuring ---------------------------------------------------------------------------------


def implied_speedup(tau: float, k: int, t_draft: float, t_verify: float, t_plain: float) -> float:
    """Tokens per step (tau, at most the k+1 a step can yield) over the step's cost in plain steps."""
    return min(tau, k + 1) * t_plain / (t_draft + t_verify)


def measure(s: ScaleSize, target: Path, draft: Path, *, context: int, repeat: int, warmup: int, threads: int,
            n_gpu_layers: int, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Interleaved rounds of: draft and verify of k = 1..B-1 tokens, plain; the summary of one size.
    A draft of k tokens runs the LM head for k rows only, so its cost is measured per k too."""
    from . import Drafter
    from .speculative import draft_device_for
    from .verify_timing import Verifier, load_model, runtime_flash_attn

    ks = list(range(1, s.block_size))
    drafter = Drafter(str(draft), str(target), device=draft_device_for(device, n_gpu_layers), n_threads=threads,
                      n_ctx=(context + 2 * s.block_size + 255) // 256 * 256)
    hp, draft_device = drafter.hparams, drafter.device
    width = hp["target_hidden"] * len(hp["target_layers"])
    rng = np.random.default_rng(2)
    drafter.inject(rng.standard_normal((context, width)).astype(np.float32), np.arange(context, dtype=np.int32))
    llc, model = load_model(target, n_gpu_layers)
    verifier = None
    try:
        log(f"[scale] {s.name}: prefilling {context} tokens ...")
        verifier = Verifier(llc, model, context, s.block_size, threads, runtime_flash_attn(n_gpu_layers),
                            feature_layers=hp["target_layers"])
        anchor = 200 % s.vocab
        # on the CPU every draft length's graph times its first steps with one thread and with all of them
        # (cpp/src/thread_pick.h): let that settle first, the bench measures the steady state
        for k in ks if draft_device.upper().startswith("CPU") else ():
            for _ in range(32):
                drafter.draft(anchor, context, k, short_block=True)
                if drafter.counters["draft_threads"] != 0:
                    break
        times: dict[str, list[float]] = {"plain": [], **{f"{what}{k}": [] for k in ks for what in ("draft", "verify")}}
        t0 = time.perf_counter()
        for rnd in range(warmup + repeat):
            sample = {}
            for k in ks:
                sample[f"draft{k}"] = _timed(lambda: drafter.draft(anchor, context, k, short_block=True))
                sample[f"verify{k}"] = verifier.verify(k + 1)
            sample["plain"] = verifier.verify(1)
            if rnd >= warmup:
                for name, dt in sample.items():
                    times[name].append(1e3 * dt)
            log(f"[scale] {s.name}: round {rnd + 1}/{warmup + repeat}{' (warm-up)' if rnd < warmup else ''}, "
                f"{time.perf_counter() - t0:.0f} s")
        features = verifier.features
    finally:
        if verifier is not None:
            verifier.close()
        llc.llama_model_free(model)
        del drafter
        gc.collect()
    return summarize(s, target, draft, times, ks, features=features, draft_device=draft_device)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(s: ScaleSize, target: Path, draft: Path, times: dict[str, list[float]], ks: list[int], *,
              features: bool, draft_device: str) -> dict[str, Any]:
    t_plain = spread(times["plain"])
    per_k = []
    for k in ks:
        t_draft, t_verify = spread(times[f"draft{k}"]), spread(times[f"verify{k}"])
        per_k.append({
            "k": k, "draft_ms": t_draft, "verify_ms": t_verify, "c": t_draft["median"] / t_verify["median"],
            "speedup": {str(tau.value): implied_speedup(tau.value, k, t_draft["median"], t_verify["median"],
                                                        t_plain["median"]) for tau in TAUS},
        })
    implied = []
    for tau in TAUS:
        at = next(r for r in per_k if r["k"] == min(tau.k, ks[-1]))
        best = max(per_k, key=lambda r: r["speedup"][str(tau.value)])
        implied.append({"tau": tau.value, "source": tau.source, "k": at["k"], "speedup": at["speedup"][str(tau.value)],
                        "best_k": best["k"], "best_speedup": best["speedup"][str(tau.value)]})
    return {
        "size": asdict(s), "target": str(target), "draft": str(draft), "draft_device": draft_device,
        "target_params": n_params(target_tensor_shapes(s)), "draft_params": n_params(drafter_tensor_shapes(s)),
        "target_layer_ids": s.layer_ids(), "features_extracted": features,
        "samples_ms": times, "plain_ms": t_plain, "per_k": per_k, "implied": implied,
    }


def run_scale(sizes: list[ScaleSize], *, folder: Path | None = None, context: int = 512, repeat: int = 5,
              warmup: int = 1, threads: int = 0, n_gpu_layers: int = 0, device: str = "auto",
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict[str, Any]:
    """Generate (or reuse) every size's pair and measure it; the result is what --json writes."""
    if repeat < 1:
        raise BenchError("--repeat must be >= 1")
    if context < 1:
        raise BenchError("--scale-context must be >= 1")
    folder = folder or default_scale_dir()
    threads = threads if threads > 0 else default_cpu_threads()
    result: dict[str, Any] = {
        "meta": {"kind": "scale", "context": context, "repeat": repeat, "warmup": warmup, "threads": threads,
                 "n_gpu_layers": n_gpu_layers, "device": device, "scale_dir": str(folder),
                 "host": platform.node(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
                 "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "taus": [asdict(t) for t in TAUS],
        "notes": [
            "random weights: the costs are real, the speedups are implied by measured costs, not measured "
            "end to end; S(k) = min(tau, k+1) * t_plain / (t_draft(k) + t_verify(k))",
            "verify = llama_decode of k+1 tokens with logits for every row (+ llama_synchronize), after a "
            f"{context}-token prefill; our sampling over the logits is not included",
            "draft(k) = Drafter.draft() of k tokens as the loop runs it: the short block [anchor, MASK x k] "
            "through the layers, the LM head and the selector for its k rows",
        ],
        "sizes": [],
    }
    folder.mkdir(parents=True, exist_ok=True)
    for s in sizes:
        # F16 target + drafter GGUF + the drafter's temporary checkpoint
        need = 2 * (n_params(target_tensor_shapes(s)) + 2 * n_params(drafter_tensor_shapes(s)))
        free = shutil.disk_usage(folder).free
        if free < need and not any(folder.glob(f"{s.name}-{s.key()}-*.gguf")):
            raise BenchError(f"{folder}: {free / 1e9:.1f} GB free, the {s.name} pair needs about {need / 1e9:.1f} GB")
        target, draft = ensure_models(s, folder, log)
        result["sizes"].append(measure(s, target, draft, context=context, repeat=repeat, warmup=warmup,
                                       threads=threads, n_gpu_layers=n_gpu_layers, device=device, log=log))
    return result


def format_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    where = f"target -ngl {m['n_gpu_layers']}" if m["n_gpu_layers"] else "target on CPU"
    lines = [f"dflash bench --scale: {m['threads']} threads, {where}, context {m['context']}, "
             f"{m['repeat']} interleaved rounds; ms = median [p10, p90]"]
    taus = [t["value"] for t in result["taus"]]
    for r in result["sizes"]:
        s = r["size"]
        p = r["plain_ms"]
        lines += [
            "",
            f"{s['name']}: random Qwen3 target {format_count(r['target_params'])} params (hidden {s['hidden']}, "
            f"{s['n_layers']} layers, vocab {s['vocab']}, F16) + DFlash2 drafter {format_count(r['draft_params'])} "
            f"({s['draft_layers']} layers, block {s['block_size']}, target layers {r['target_layer_ids']}, "
            f"on {r['draft_device']})",
            f"plain decode (1 token): {_ms(p)}",
            f"{'k':>3}  {'draft k tokens':<28} {'verify k+1 tokens':<28} {'c = draft/verify':>16}  "
            + "  ".join(f"{'S @ tau ' + format(t, 'g'):>12}" for t in taus),
        ]
        for row in r["per_k"]:
            lines.append(f"{row['k']:>3}  {_ms(row['draft_ms']):<28} {_ms(row['verify_ms']):<28} {row['c']:>16.2f}  "
                         + "  ".join(f"{row['speedup'][str(t)]:>11.2f}x" for t in taus))
        for imp in r["implied"]:
            lines.append(f"implied speedup at tau {imp['tau']:g} ({imp['source']}): {imp['speedup']:.2f}x at k "
                         f"{imp['k']}; best {imp['best_speedup']:.2f}x at k {imp['best_k']}")
    lines += ["", "S = speedups implied by measured costs, not measured end to end (random weights): "
              "S(k) = min(tau, k+1) * t_plain / (t_draft(k) + t_verify(k)); tau = mean accepted length, bonus "
              "included. The best k assumes tau does not shrink at smaller k (an upper bound)."]
    return "\n".join(lines)


def _ms(x: dict[str, float]) -> str:
    return f"{x['median']:.2f} [{x['p10']:.2f}, {x['p90']:.2f}] ms"


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Written to a temp file next to `path`, then renamed: never half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


__all__ = ["TAUS", "Tau", "format_table", "implied_speedup", "parse_sizes", "run_scale", "write_json"]
