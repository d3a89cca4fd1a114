"""The `dflash bench --plot` figure: per-position acceptance and tokens/s per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"ar": "#7f7f7f", "ours": "#1f77b4", "upstream": "#ff7f0e", "upstream-ar": "#bcbd22"}
LABELS = {"upstream-ar": "upstream\n(no draft)"}
FEW = 20  # positions reached by fewer verify steps are drawn hollow
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def plot(result: dict[str, Any], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = result["meta"]
    configs = result["configs"]
    n_bars = sum(len(c["summary"]) for c in configs)
    fig, (ax_acc, ax_tps) = plt.subplots(
        1, 2, figsize=(max(13.0, 7.0 + 1.1 * n_bars), 5.8), gridspec_kw={"width_ratios": [1, max(1.15, 0.3 * n_bars)]}
    )

    # left: conditional acceptance per draft position
    missing: list[str] = []
    any_few = False
    for ci, cfg in enumerate(configs):
        for system in ("ours", "upstream"):
            s = cfg["summary"].get(system)
            if not s:
                continue
            tag = f"{system}" + (f", n_max {cfg['n_max']}" if len(configs) > 1 else "")
            ppa = s.get("per_position_acceptance")
            if not ppa:
                missing.append(tag)
                continue
            xs = list(range(1, len(ppa) + 1))
            marker = MARKERS[ci % len(MARKERS)]
            ax_acc.plot(
                xs,
                ppa,
                color=COLORS[system],
                marker=marker,
                linestyle="-" if system == "ours" else "--",
                linewidth=2,
                markersize=7,
                label=f"{tag}: acc. length {s['mean_accepted_length']:.2f}",
            )
            reached = s.get("per_position_reached") or []
            few = [(x, y) for x, y, n in zip(xs, ppa, reached) if n < FEW]
            if few:  # hollow: too few samples to read much into
                ax_acc.scatter(
                    [x for x, _ in few],
                    [y for _, y in few],
                    s=40,
                    marker=marker,
                    color="white",
                    edgecolors=COLORS[system],
                    zorder=4,
                    linewidths=1.5,
                )
                any_few = True
    if any_few:
        ax_acc.plot([], [], "o", color="white", markeredgecolor="black", label=f"hollow: reached by < {FEW} steps")
    for tag in missing:
        ax_acc.plot([], [], " ", label=f"{tag}: per-position figures not exposed")
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("P(accept | all earlier accepted)")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.xaxis.get_major_locator().set_params(integer=True)
    ax_acc.grid(True, alpha=0.3)
    ax_acc.set_title("Per-position conditional acceptance")
    ax_acc.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)

    # right: decode tok/s per system (median bar, p10-p90 whisker, one dot per prompt run)
    labels, positions, k = [], [], 0.0
    ymax = 0.0
    for ci, cfg in enumerate(configs):
        for system, s in cfg["summary"].items():
            runs = [r["tok_s"] for r in cfg["runs"] if r["system"] == system]
            t = s["tok_s"]
            ax_tps.bar(
                k,
                t["median"],
                width=0.7,
                color=COLORS.get(system, "#999999"),
                alpha=0.85,
                edgecolor="black",
                linewidth=0.6,
            )
            ax_tps.errorbar(
                k,
                t["median"],
                yerr=[[t["median"] - t["p10"]], [t["p90"] - t["median"]]],
                color="black",
                capsize=5,
                linewidth=1.2,
            )
            jitter = [k + 0.25 * ((i % 7) / 6 - 0.5) for i in range(len(runs))]
            ax_tps.scatter(jitter, runs, s=10, color="black", alpha=0.45, zorder=3)
            ymax = max(ymax, t["p90"], max(runs))
            note = "baseline" if system == "ar" else f"{s['speedup_vs_ar']['median']:.2f}x"
            if "mean_accepted_length" in s:
                note += f"\nacc {s['mean_accepted_length']:.2f}"
            ax_tps.annotate(
                note,
                (k, max(t["median"], t["p90"], max(runs))),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
                fontweight="bold",
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8),
            )
            name = LABELS.get(system, system)
            labels.append(name if len(configs) == 1 else f"{name}\nn_max {cfg['n_max']}")
            positions.append(k)
            k += 1
        k += 0.6
    ax_tps.set_xticks(positions, labels, fontsize=9)
    ax_tps.set_ylabel("decode tokens/s (prefill excluded)")
    ax_tps.set_ylim(0, ymax * 1.25 if ymax > 0 else 1)
    ax_tps.grid(True, axis="y", alpha=0.3)
    ax_tps.set_title(
        "Decode speed: median, p10-p90, one dot per prompt run\n(label: speedup vs ar, median of per-prompt ratios)",
        fontsize=10,
    )

    fig.suptitle(
        f"{Path(meta['target']).name} + {Path(meta['draft']).name}: {meta['n_prompts']} prompts x {meta['repeat']}"
        f" round(s), {meta['n_predict']} tokens, temperature {meta['temperature']}, {meta['threads']} threads, "
        f"n_gpu_layers {meta['n_gpu_layers']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out, dpi=110)
    plt.close(fig)


__all__ = ["plot"]
