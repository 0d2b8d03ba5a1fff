"""The search's two plots: the acceptance frontier (τ by tree size) and the throughput frontier."""

from __future__ import annotations

from pathlib import Path

from .. import pyplot
from .result import SearchResult, finite, nodes_text

PLOTS = ("acceptance_frontier.png", "throughput_frontier.png")


def plot_acceptance(result: SearchResult, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    nodes = [r["num_nodes"] for r in result.frontier]
    ax.plot(nodes, [r["biased"] for r in result.frontier], "-", label="biased (all step starts), all prompts")
    if any(r["simulated"] is not None for r in result.frontier):
        ax.plot(nodes, [r["simulated"] for r in result.frontier], "--", label="canonical, simulated, all prompts")
    rows = [r for r in result.timed.values() if r["unbiased"] is not None]
    xs = [r["num_nodes"] for r in rows]
    ax.plot(xs, [r["unbiased"] for r in rows], "o", label="canonical generate (unbiased), timed prompts")
    if any(r["biased_timed"] is not None for r in rows):
        ax.plot(xs, [r["biased_timed"] for r in rows], "x", color="C0", label="biased, timed prompts")
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="tree nodes (root included)",
        ylabel="mean accept length τ (tokens/step)",
        title=f"Greedy acceptance frontier: {result.task}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(result: SearchResult, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = [result.timed[lab] for lab in result.labels]
    xs, ys = [r["num_nodes"] for r in rows], [r["tokens_per_s"] for r in rows]
    ax.plot(xs, ys, "o", color="0.5", label="timed frontier trees")
    ax.plot([xs[i] for i in result.choice.hull], [ys[i] for i in result.choice.hull], "-", label="upper hull")
    c = result.choice
    for idx, name, marker in ((c.conservative, "T−", "v"), (c.aggressive, "T+", "^"), (c.static, "EntMTP*", "*")):
        ax.plot(xs[idx], ys[idx], marker, markersize=12, label=f"{name} ({nodes_text(xs[idx])})")
    if finite(result.vanilla_tokens_per_s):
        ax.axhline(result.vanilla_tokens_per_s, ls=":", color="k", label="plain decoding")
    if result.reference and finite(result.reference["tokens_per_s"]):
        ax.plot(64, result.reference["tokens_per_s"], "s", label="mc_sim_7b_63")
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="tree nodes (root included)",
        ylabel="tokens/s (median over prompts)",
        title=f"Throughput frontier: {result.task}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
