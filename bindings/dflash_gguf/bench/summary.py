"""A bench run's summaries: spreads, pooled acceptance per position, the table, the JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs),
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "min": min(xs),
        "max": max(xs),
        "mean": statistics.fmean(xs),
    }


def pooled_acceptance(runs: Sequence[dict[str, Any]]) -> list[float] | None:
    """Conditional acceptance per draft position pooled over runs: accepted[i] / reached[i]."""
    return _pooled(runs)[0]


def pooled_reached(runs: Sequence[dict[str, Any]]) -> list[int] | None:
    """How many verify steps reached each draft position (all earlier drafts accepted), pooled."""
    return _pooled(runs)[1]


def _pooled(runs: Sequence[dict[str, Any]]) -> tuple[list[float] | None, list[int] | None]:
    reached: list[int] = []
    accepted: list[int] = []
    have = False
    for r in runs:
        if "pos_reached" in r and "pos_accepted" in r:
            have = True
            for i, (re_, ac) in enumerate(zip(r["pos_reached"], r["pos_accepted"])):
                if i >= len(reached):
                    reached.append(0)
                    accepted.append(0)
                reached[i] += re_
                accepted[i] += ac
    if have:
        # trailing positions nobody reached say nothing
        while reached and reached[-1] == 0:
            reached.pop()
            accepted.pop()
        return [a / r if r else 0.0 for a, r in zip(accepted, reached)], reached
    lists = [r["per_position_acceptance"] for r in runs if r.get("per_position_acceptance")]
    if not lists:
        return None, None
    n = max(len(x) for x in lists)
    return [statistics.fmean([x[i] for x in lists if i < len(x)]) for i in range(n)], None


def summarize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    systems = list(dict.fromkeys(r["system"] for r in cfg["runs"]))
    for system in systems:
        runs = [r for r in cfg["runs"] if r["system"] == system]
        s: dict[str, Any] = {
            "runs": len(runs),
            "tokens": sum(r["tokens"] for r in runs),
            "tok_s": spread([r["tok_s"] for r in runs]),
            "speedup_vs_ar": spread([r["speedup_vs_ar"] for r in runs]),
            "prefill_ms": spread([r["prefill_ms"] for r in runs]),
        }
        if "same_as_ar" in runs[0]:
            s["same_as_ar"] = sum(bool(r["same_as_ar"]) for r in runs)
        if system in ("ours", "upstream"):
            drafted = sum(r.get("drafted", 0) for r in runs)
            accepted = sum(r.get("accepted", 0) for r in runs)
            s["drafted"], s["accepted"] = drafted, accepted
            if all(r.get("steps") is not None for r in runs):
                if system == "ours":
                    steps = sum(r["steps"] - r["plain_steps"] for r in runs)
                else:
                    steps = sum(r["steps"] for r in runs)
                s["steps"] = steps
                s["mean_accepted_length"] = (accepted + steps) / steps if steps else 1.0
                s["mean_accepted_length_source"] = "(accepted + steps) / steps"
            else:
                n = s["tokens"]
                s["mean_accepted_length"] = n / max(n - accepted, 1)
                s["mean_accepted_length_source"] = "estimate: tokens / (tokens - accepted)"
            s["per_position_acceptance"], s["per_position_reached"] = _pooled(runs)
        if all("draft_ms_per_step" in r for r in runs):  # upstream: from its log (upstream.py)
            s["draft_ms_per_step"] = spread([r["draft_ms_per_step"] for r in runs])
        if system == "ours":
            s["verify_ms_per_step"] = spread([r["verify_ms_per_step"] for r in runs])
            s["plain_steps"] = sum(r["plain_steps"] for r in runs)
            if all("steps_by_length" in r for r in runs):  # what auto mode drafted: [k] steps of k ([0] plain)
                s["steps_by_length"] = [sum(col) for col in zip(*(r["steps_by_length"] for r in runs))]
            for key in ("sample_ms_per_step", "rest_ms_per_step"):
                if all(key in r for r in runs):
                    s[key] = spread([r[key] for r in runs])
            if all("limit_vs_ar" in r for r in runs):
                s["limit_vs_ar"] = spread([r["limit_vs_ar"] for r in runs])
                s["share_of_limit"] = spread(
                    [r["speedup_vs_ar"] / r["limit_vs_ar"] for r in runs if r["limit_vs_ar"] > 0]
                )
        if system == "ar":
            s["ms_per_token"] = 1e3 / s["tok_s"]["median"] if s["tok_s"]["median"] > 0 else float("nan")
        out[system] = s
    paired = paired_ratio(cfg["runs"], "ours", "upstream")
    if paired is not None:
        out["ours"]["vs_upstream"] = paired
    return out


def paired_ratio(runs: Sequence[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    """a's decode tok/s over b's on the same prompt and round (run next to each other, so drift on the
    machine cancels as it does not between two medians of ratios to ar): the spread, and in how many
    of the pairs a was faster. None without a pair."""
    return _paired([r for r in runs if r["system"] == a], [r for r in runs if r["system"] == b])


def _paired(a_runs: Sequence[dict[str, Any]], b_runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    b_tok_s = {(r["prompt_index"], r["round"]): r["tok_s"] for r in b_runs}
    ratios = [
        r["tok_s"] / b_tok_s[(r["prompt_index"], r["round"])]
        for r in a_runs
        if b_tok_s.get((r["prompt_index"], r["round"]), 0) > 0
    ]
    if not ratios:
        return None
    return {**spread(ratios), "faster": sum(x > 1 for x in ratios), "pairs": len(ratios)}


def compare_auto_with_fixed(configs: Sequence[dict[str, Any]]) -> None:
    """Into the summary of an `auto` configuration: ours' tok/s under auto over ours' at each fixed n_max,
    paired by prompt run (the configurations run side by side), as `vs_n_max` {n_max: paired ratio}."""
    for c in configs:
        if c["n_max"] != "auto" or "ours" not in c["summary"]:
            continue
        fixed = [f for f in configs if f["n_max"] != "auto" and f.get("draft_vocab") == c.get("draft_vocab")]
        mine = [r for r in c["runs"] if r["system"] == "ours"]
        vs = {str(f["n_max"]): _paired(mine, [r for r in f["runs"] if r["system"] == "ours"]) for f in fixed}
        vs = {k: v for k, v in vs.items() if v is not None}
        if vs:
            c["summary"]["ours"]["vs_n_max"] = vs


def compare_with_full_vocab(configs: Sequence[dict[str, Any]]) -> None:
    """Into the summary of a configuration with a drafting vocabulary: ours' tok/s over ours' with the whole
    vocabulary at the same n_max, paired by prompt run, as `vs_full_vocab`."""
    for c in configs:
        if not c.get("draft_vocab") or "ours" not in c["summary"]:
            continue
        full = [f for f in configs if f["n_max"] == c["n_max"] and not f.get("draft_vocab")]
        if full:
            ours = [r for r in c["runs"] if r["system"] == "ours"]
            paired = _paired(ours, [r for r in full[0]["runs"] if r["system"] == "ours"])
            if paired is not None:
                c["summary"]["ours"]["vs_full_vocab"] = paired


def _vocab_label(cfg: dict[str, Any]) -> str:
    if not cfg.get("draft_vocab"):
        return ""
    return f"; drafting vocabulary {Path(cfg['draft_vocab']).name}, {cfg['draft_vocab_size']} tokens"


# --- the table -----------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"target {m['target']}  draft {m['draft']}",
        f"{m['n_prompts']} prompts x {m['repeat']} round(s), {m['n_predict']} tokens, temperature {m['temperature']}, "
        f"threads {m['threads']}, n_gpu_layers {m['n_gpu_layers']}, seed {m['seed']}",
    ]
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    for cfg in result["configs"]:
        up = f", upstream --spec-draft-n-max {cfg['n_max_upstream']}" if "n_max_upstream" in cfg else ""
        lines.append("")
        lines.append(
            f"n_max {cfg['n_max']} (ours: {cfg['n_max_ours']}{up}; block size {cfg['block_size']}, "
            f"draft device {cfg.get('draft_device')}{_vocab_label(cfg)})"
        )
        for note in cfg.get("notes", []):
            lines.append(f"note: {note}")
        hdr = (
            f"{'system':<12}{'decode tok/s':>13}{'p10-p90':>17}{'speedup':>9}{'p10-p90':>13}"
            f"{'acc.len':>9}{'draft ms':>10}{'verify ms':>11}{'prefill ms':>12}"
        )
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for system, s in cfg["summary"].items():
            t, sp, pf = s["tok_s"], s["speedup_vs_ar"], s["prefill_ms"]
            acc = f"{s['mean_accepted_length']:.2f}" if "mean_accepted_length" in s else "1"
            if s.get("mean_accepted_length_source", "").startswith("estimate"):
                acc += "~"
            dms = f"{s['draft_ms_per_step']['median']:.3f}" if "draft_ms_per_step" in s else "-"
            vms = f"{s['verify_ms_per_step']['median']:.3f}" if "verify_ms_per_step" in s else "-"
            speed = "1 (base)" if system == "ar" else f"{sp['median']:.2f}x"
            sspread = "" if system == "ar" else f"{sp['p10']:.2f}-{sp['p90']:.2f}"
            lines.append(
                f"{system:<12}{t['median']:>13.1f}{t['p10']:>8.1f}-{t['p90']:<8.1f}{speed:>9}"
                f"{sspread:>13}{acc:>9}{dms:>10}{vms:>11}{pf['median']:>12.2f}"
            )
        for system in ("ours", "upstream"):
            s = cfg["summary"].get(system)
            if not s:
                continue
            ppa = s.get("per_position_acceptance")
            if ppa:
                txt = " ".join(f"{x:.2f}" for x in ppa)
            elif system == "upstream":
                txt = "not exposed by the server"
            else:
                txt = "none (no drafted step)"
            extra = ""
            if system == "ours" and s.get("plain_steps"):
                extra = f"; {s['plain_steps']} fallback plain steps"
            if system == "ours" and cfg.get("n_max") == "auto" and s.get("steps_by_length"):
                extra += "; steps by draft length " + ", ".join(
                    f"{k}: {n}" for k, n in enumerate(s["steps_by_length"]) if n
                )
            lines.append(
                f"{system} per-position conditional acceptance: {txt}  "
                f"({s['accepted']}/{s['drafted']} drafts accepted{extra})"
            )
            if system == "ours" and "vs_upstream" in s:
                v = s["vs_upstream"]
                lines.append(
                    f"ours / upstream decode tok/s, paired by prompt run: {v['median']:.2f}x "
                    f"(p10-p90 {v['p10']:.2f}-{v['p90']:.2f}), ours faster in {v['faster']} of {v['pairs']}"
                )
            if "vs_full_vocab" in s:
                v = s["vs_full_vocab"]
                lines.append(
                    f"ours / ours with the whole vocabulary, decode tok/s paired by prompt run: {v['median']:.2f}x "
                    f"(p10-p90 {v['p10']:.2f}-{v['p90']:.2f}), faster in {v['faster']} of {v['pairs']}"
                )
            for k, v in s.get("vs_n_max", {}).items():
                lines.append(
                    f"ours under auto / ours at n_max {k}, decode tok/s paired by prompt run: {v['median']:.2f}x "
                    f"(p10-p90 {v['p10']:.2f}-{v['p90']:.2f}), auto faster in {v['faster']} of {v['pairs']}"
                )
            if system == "ours" and "limit_vs_ar" in s:
                outside = ""
                if "rest_ms_per_step" in s:
                    outside = (
                        f"; per step besides them: picking the target's tokens "
                        f"{s['sample_ms_per_step']['median']:.3f} ms, the rest {s['rest_ms_per_step']['median']:.3f} ms"
                    )
                lines.append(
                    f"ours vs the limit of its own measured costs (draft + verify + inject, no loop "
                    f"overhead): limit {s['limit_vs_ar']['median']:.2f}x, measured "
                    f"{s['speedup_vs_ar']['median']:.2f}x = {s['share_of_limit']['median']:.0%} of it{outside}"
                )
        same = {k: v for k, v in cfg["summary"].items() if "same_as_ar" in v and k != "ar"}
        if same:
            lines.append(
                "greedy output identical to ar: "
                + ", ".join(f"{k} {v['same_as_ar']}/{v['runs']}" for k, v in same.items())
            )
    lines.append("")
    lines.append(
        "decode tok/s excludes prefill; speedup = median over prompts of (tok/s / ar tok/s on the same "
        "prompt and round); acc.len = tokens per target verify pass, bonus token included "
        "(~ = estimated); draft/verify ms = per step, medians over prompts (upstream's draft ms: the "
        "drafting time llama-server logs, without its injection of the verified rows, which ours' includes)"
    )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=_json_default))


def _json_default(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)
