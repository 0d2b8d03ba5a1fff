"""The benchmark's plots: tokens/s per method and task, and accept-length histograms."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from .. import pyplot
from .summary import ran_methods, values


def make_plots(results: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """``tokens_per_s.png`` and ``accept_lengths.png`` in ``out_dir``."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks, methods, recs = list(results["prompts"]), ran_methods(results), results["records"]
    paths = {}

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks) * max(len(methods), 1) / 3), 4))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        meds, lo, hi = [], [], []
        for t in tasks:
            xs = sorted(values([r for r in recs if r["task"] == t and r["method"] == m], "tokens_per_s"))
            med = statistics.median(xs) if xs else 0.0
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [med, med, med]
            meds.append(med), lo.append(med - q[0]), hi.append(q[2] - med)
        xpos = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        ax.bar(xpos, meds, width, yerr=[lo, hi], capsize=2, label=m)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("tokens/s (median, IQR)")
    ax.set_title(f"tokens/s per method and task ({results['settings']['mode']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths["tokens/s per method and task"] = out_dir / "tokens_per_s.png"
    fig.savefig(paths["tokens/s per method and task"], dpi=120)
    plt.close(fig)

    tree_methods = [m for m in methods if any(r.get("accept_lengths") for r in recs if r["method"] == m)]
    if tree_methods:
        fig, axes = plt.subplots(
            len(tasks),
            len(tree_methods),
            squeeze=False,
            sharex=True,
            figsize=(2.4 * len(tree_methods), 1.9 * len(tasks)),
        )
        top = max(max(r["accept_lengths"] or [1]) for r in recs if r.get("accept_lengths"))
        for i, t in enumerate(tasks):
            for j, m in enumerate(tree_methods):
                ax = axes[i][j]
                xs = [a for r in recs if r["task"] == t and r["method"] == m for a in (r.get("accept_lengths") or [])]
                if xs:
                    ax.hist(xs, bins=[b + 0.5 for b in range(top + 1)], density=True, color=f"C{j}")
                    ax.set_title(f"{m}: τ={statistics.fmean(xs):.2f}", fontsize=8)
                if j == 0:
                    ax.set_ylabel(t, fontsize=8)
                ax.set_xticks(range(1, top + 1))
                if i == len(tasks) - 1:
                    ax.set_xlabel("accept length", fontsize=8)
        fig.tight_layout()
        paths["accept-length histograms"] = out_dir / "accept_lengths.png"
        fig.savefig(paths["accept-length histograms"], dpi=110)
        plt.close(fig)
    return paths
