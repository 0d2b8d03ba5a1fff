"""What the offline tree search hands back: summaries, the bank, plots, the report, the CLI.

:func:`summarise` turns the checkpointed stage results of a :class:`~entmtp_hf.search.TreeSearch`
into one :class:`SearchResult` (per-tree biased / simulated / unbiased accept lengths, tokens/s,
the chosen trees, the sweep winners); :func:`write_outputs` writes the bank folder, two PNG
plots, ``report.md`` and ``result.json`` from it. Everything here is plain data in, files out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...demo import DEMO_HEADS
from ...trees.bank import TopologyBank, default_thresholds
from .search import (
    RANKINGS,
    REFERENCE,
    RETRIEVAL_RUNS,
    RULES,
    SCORINGS,
    TAU_GRID,
    TIMED_SIZES,
    VANILLA,
    Choice,
    FrontierPoint,
    SearchConfig,
    Trajectory,
    _atomic_json,
    choose_trees,
    heads_fingerprint,
    median,
    simulate_canonical,
    table_accept,
    value_costs,
    value_sets,
)
from ..profile import interpolate_cost
from .replay import accept_table, foresight_rate, walk_rate
from ...drafting.retrieval import RetrievalConfig
from ...scheduling.features import FEATURES
from ...trees.tree import MC_SIM_7B_63, Tree

if TYPE_CHECKING:
    from .search import TreeSearch

PLOTS = ("acceptance_frontier.png", "throughput_frontier.png")
#: a scheduler becomes a bank's default policy only if it beat the static tree by this much in
#: the sweep, and by CONFIRM_MARGIN on held-out prompts (``TreeSearch.confirm``)
SWEEP_MARGIN = 1.05
CONFIRM_MARGIN = 1.02


# ============================================================================ summaries
def _pooled_accept(runs: dict) -> float | None:
    """Tokens per step over all prompts of a label (None when no step was taken)."""
    lengths = [a for r in runs.values() for a in r["accept_lengths"]]
    return sum(lengths) / len(lengths) if lengths else None


Speed = Callable[[dict], "float | None"]


def measured_speed(run: dict) -> float | None:
    """Tokens/s of one timed run (prefill included)."""
    return run["new_tokens"] / run["seconds"] if run["seconds"] > 0 and run["new_tokens"] > 0 else None


def modelled_speed(run: dict, costs: dict[int, float]) -> float | None:
    """Decoded tokens per one-token forward: the run's tokens over its verification work
    Σ_steps c(N_step), scaled by the run's own share of time outside those forwards.

    For greedy decoding tokens and tree sizes do not depend on timing, so the machine's
    noise enters only through that share (a few percent of a step), not through the work.
    None for runs without EntMTP statistics (plain decoding)."""
    sizes, forward, decode = run.get("tree_sizes"), run.get("forward_seconds"), run.get("decode_seconds")
    if not sizes or not forward or decode is None:
        return None
    work = sum(interpolate_cost(costs, n) for n in sizes)
    return sum(run["accept_lengths"]) / (work * (1.0 + max(decode - forward, 0.0) / forward))


def ranking_speed(costs: dict[int, float] | None) -> Speed:
    """The speed trees and schedulers are ranked by: modelled with forward costs, else measured."""
    return (lambda run: modelled_speed(run, costs)) if costs is not None else measured_speed


def _speeds(runs: dict, speed: Speed) -> dict[str, float]:
    return {p: v for p, r in runs.items() if (v := speed(r)) is not None}


def _median_modelled(runs: dict, costs: dict[int, float] | None) -> float | None:
    """Median modelled speed over a label's prompts (None without forward costs)."""
    return median(list(_speeds(runs, ranking_speed(costs)).values())) if costs is not None else None


def _tps(runs: dict) -> list[float]:
    return list(_speeds(runs, measured_speed).values())


def _paired_ratio(runs: dict, ref: dict, speed: Speed = measured_speed) -> float:
    """Median over prompts of speed(``runs``) / speed(``ref``) on the same prompt."""
    a, b = _speeds(runs, speed), _speeds(ref, speed)
    return median([a[p] / b[p] for p in a if p in b and b[p] > 0])


def inversions(rows: Sequence[dict], a: str, b: str) -> list[tuple[int, int]]:
    """Pairs of trees (node counts) that key ``a`` and key ``b`` rank strictly the opposite way."""
    rows = [r for r in rows if _finite(r.get(a)) and _finite(r.get(b))]
    return [(x["num_nodes"], y["num_nodes"]) for i, x in enumerate(rows) for y in rows[i + 1 :]
            if (x[a] - y[a]) * (x[b] - y[b]) < 0]  # fmt: skip


@dataclass
class SearchResult:
    """Every figure of one task's search, JSON-ready through :meth:`to_dict`."""

    task: str
    settings: dict
    frontier: list[dict]  # num_nodes, tree, biased, simulated
    timed: dict[str, dict]  # label -> tree, num_nodes, biased, simulated, unbiased, tokens_per_s, speedup, modelled
    labels: list[str]  # timed frontier labels, smallest first (bank order)
    choice: Choice
    vanilla_tokens_per_s: float
    reference: dict | None
    elapsed: dict[str, float]
    sweep: dict[str, dict] = field(default_factory=dict)  # label -> tokens_per_s, vs_static, measured_vs_static
    winners: dict[str, Any] = field(default_factory=dict)
    costs: dict[int, float] | None = None  # c(N) of the modelled ranking; None = ranked by measured tokens/s
    confirmation: dict[str, Any] = field(default_factory=dict)  # label, vs_static, prompts (held-out check)
    headroom: dict[str, Any] = field(default_factory=dict)  # what a scheduler with foresight would reach

    def with_headroom(self, trajectories: Sequence[Trajectory]) -> "SearchResult":
        """The rate (tokens per unit of work, no retrieval) of the best static timed tree and of
        per-step switching among the timed trees with every accept length known in advance
        (:func:`~entmtp_hf.replay.foresight_rate`): the most any scheduler could win here."""
        trees = [self.timed[lab]["tree"] for lab in self.labels]
        costs = [interpolate_cost(self.costs, t.num_nodes) for t in trees]
        tables = [accept_table(t, trees) for t in trajectories if t.tuples]
        if not tables:
            return self
        rates = [a / w for a, w in (walk_rate(tables, costs, lambda i, j, k=k: k) for k in range(len(trees)))]
        best = max(range(len(trees)), key=rates.__getitem__)
        foresight = foresight_rate(tables, costs)
        self.headroom = {"trees": [t.num_nodes for t in trees], "best_static_nodes": trees[best].num_nodes,
                         "best_static_rate": rates[best], "foresight_rate": foresight,
                         "foresight_vs_static": foresight / rates[best], "prompts": len(tables)}  # fmt: skip
        return self

    def with_sweep(self, runs: dict) -> "SearchResult":
        """Add the sweep's figures and pick the hysteresis and ladder winners: the median ratio
        to static per prompt, modelled (with :attr:`costs`) or measured."""
        static = runs.get("static", {})
        speed = ranking_speed(self.costs)
        self.sweep = {
            lab: {"tokens_per_s": median(_tps(r)),
                  "vs_static": _paired_ratio(r, static, speed) if lab != "static" else 1.0,
                  "measured_vs_static": _paired_ratio(r, static) if lab != "static" else 1.0}
            for lab, r in runs.items()
        }  # fmt: skip
        tried = [lab for lab in RETRIEVAL_RUNS if lab in self.sweep and _finite(self.sweep[lab]["vs_static"])]
        if tried:
            best = max(tried, key=lambda lab: self.sweep[lab]["vs_static"])
            self.winners["retrieval"] = {"label": best, "config": asdict(RETRIEVAL_RUNS[best]), **self.sweep[best]}
        self._pick_switching_winners()
        sets = value_sets({lab: row["tree"] for lab, row in self.timed.items()}, self.choice, self.labels)
        cands = [lab for lab in sets if lab in self.sweep and _finite(self.sweep[lab]["vs_static"])]
        if cands:
            best = max(cands, key=lambda lab: self.sweep[lab]["vs_static"])
            self.winners["value"] = {"label": best, "trees": [t.choices for t in sets[best]],
                                     "costs": value_costs(sets[best], self.costs), **self.sweep[best]}  # fmt: skip
        return self

    def with_replay(self, runs: dict[str, dict], prompts: int) -> "SearchResult":
        """Add the replayed hysteresis and ladder runs (``runs``: label -> accept lengths and
        tree sizes over every calibration prompt, ``static`` the reference with the same
        retrieval setting) and pick those winners from them: the ratio to static of tokens per
        unit of verification work, Σ accept / Σ c(N). The replayed reference is listed as
        ``static (replayed)``."""

        def rate(run: dict) -> float:
            return sum(run["accept_lengths"]) / sum(interpolate_cost(self.costs, n) for n in run["tree_sizes"])

        ref = rate(runs["static"])
        for lab, run in runs.items():
            row = "static (replayed)" if lab == "static" else lab
            self.sweep[row] = {"tokens_per_s": None, "vs_static": rate(run) / ref, "measured_vs_static": None,
                               "tokens_per_step": sum(run["accept_lengths"]) / len(run["accept_lengths"]),
                               "replayed": prompts}  # fmt: skip
        self._pick_switching_winners()
        return self

    def _pick_switching_winners(self) -> None:
        """The hysteresis and ladder settings with the best ratio to static."""
        for kind in ("hysteresis", "ladder"):
            cands = [lab for lab, v in self.sweep.items() if lab.startswith(kind + ":") and _finite(v["vs_static"])]
            if cands:
                best = max(cands, key=lambda lab: self.sweep[lab]["vs_static"])
                _, feature, values, *pair = best.split(":")
                self.winners[kind] = {"label": best, "feature": feature,
                                      "values": [float(v) for v in values.split(",")], **self.sweep[best]}  # fmt: skip
                if pair:
                    self.winners[kind]["trees"] = [int(i) for i in pair[0].split("-")]

    def retrieval_default(self) -> RetrievalConfig | None:
        """The bank's retrieval setting: the sweep's faster retrieval run where it made the
        static tree faster by ``SWEEP_MARGIN``, else off."""
        won = self.winners.get("retrieval", {})
        return RetrievalConfig(**won["config"]) if won.get("vs_static", 0.0) >= SWEEP_MARGIN else None

    def _sweep_speeds(self) -> dict[str, float]:
        """Each scheduler kind's sweep ratio to static, where it clears ``SWEEP_MARGIN``."""
        return {k: v["vs_static"] for k, v in self.winners.items()
                if k != "retrieval" and v["vs_static"] >= SWEEP_MARGIN}  # fmt: skip

    def scheduler_candidate(self) -> str | None:
        """The sweep label of the scheduler that would become the default policy, if any."""
        speeds = self._sweep_speeds()
        return self.winners[max(speeds, key=lambda k: speeds[k])]["label"] if speeds else None

    def with_confirmation(self, runs: dict) -> "SearchResult":
        """Record the candidate's ratio to static on the held-out prompts (``runs``: static + it)."""
        label = next((lab for lab in runs if lab != "static"), None)
        if label is not None:
            ratio = _paired_ratio(runs[label], runs["static"], ranking_speed(self.costs))
            self.confirmation = {"label": label, "vs_static": ratio, "prompts": len(runs[label]),
                                 "measured_vs_static": _paired_ratio(runs[label], runs["static"])}  # fmt: skip
        return self

    def bank_trees(self) -> tuple[list[Tree], list[int]]:
        """The bank's trees, smallest first: the timed frontier trees plus the value winner's
        trees that are not among them (each after the frontier tree of its size); and where
        each timed tree went (``labels`` index -> bank index)."""
        timed = [self.timed[lab]["tree"] for lab in self.labels]
        extra = [t for t in map(Tree.from_choices, self.winners.get("value", {}).get("trees", [])) if t not in timed]
        trees = timed + extra
        order = sorted(range(len(trees)), key=lambda i: (trees[i].num_nodes, i))
        position = {old: new for new, old in enumerate(order)}
        return [trees[i] for i in order], [position[i] for i in range(len(timed))]

    @property
    def ranking_changed(self) -> bool:
        """Whether debiasing reorders any two timed trees (biased τ vs measured τ, strict inversions)."""
        return bool(inversions(list(self.timed.values()), "biased", "unbiased"))

    @property
    def ranking_changed_simulated(self) -> bool | None:
        """The same over every frontier tree, with the simulated canonical τ (greedy rank tuples only)."""
        if any(r["simulated"] is None for r in self.frontier):
            return None
        return bool(inversions(self.frontier, "biased", "simulated"))

    def scheduler_defaults(self) -> dict[str, Any]:
        """The bank's scheduler block (tree indices into :meth:`bank_trees`): EntMTP*, the
        winning hysteresis pair and τ, the ladder with its thresholds, the value policy's trees
        and costs, and as default policy the fastest of the four against static,
        where a scheduler must beat static by ``SWEEP_MARGIN`` (the sweep's few prompts are noisy
        and its winner is the best of many tries) and then by ``CONFIRM_MARGIN`` on held-out
        prompts (when the search had any left); retrieval branches are on by default when they
        made the static tree faster by the same margin (the faster of appended and replacing)."""
        c = self.choice
        hyst, lad = self.winners.get("hysteresis"), self.winners.get("ladder")
        low, high = hyst["trees"] if hyst and "trees" in hyst else (c.conservative, c.aggressive)
        tau = hyst["values"][0] if hyst else 0.01
        ladder = c.ladder
        thresholds = lad["values"] if lad else list(default_thresholds(len(ladder) - 1, tau))
        speed = {"static": 1.0, **self._sweep_speeds()}
        held_out = self.confirmation
        if held_out and held_out["vs_static"] < CONFIRM_MARGIN:
            speed = {"static": 1.0}  # the sweep's winner did not hold up on prompts it was not picked on
        retrieval = self.retrieval_default()
        retrieval = asdict(retrieval) if retrieval is not None else None
        trees, at = self.bank_trees()
        value = self.winners.get("value")
        return {"static": at[c.static], "conservative": at[low], "aggressive": at[high], "tau_on": tau, "tau_off": tau,
                "ladder": [at[i] for i in ladder], "thresholds": thresholds,
                "policy": max(speed, key=lambda k: speed[k]),
                "feature": hyst["feature"] if hyst else "best_path_value",
                "ladder_feature": lad["feature"] if lad else "best_path_value", "retrieval": retrieval,
                "value": [trees.index(Tree.from_choices(t)) for t in value["trees"]] if value else [],
                "value_costs": value["costs"] if value else []}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        timed = {lab: {k: (v.choices if isinstance(v, Tree) else v) for k, v in row.items()}
                 for lab, row in self.timed.items()}  # fmt: skip
        plain = ("task", "settings", "frontier", "labels", "vanilla_tokens_per_s", "reference", "elapsed", "sweep",
                 "winners", "confirmation", "headroom")  # fmt: skip
        costs = {str(n): c for n, c in self.costs.items()} if self.costs is not None else None
        return {**{k: getattr(self, k) for k in plain}, "timed": timed, "choice": asdict(self.choice), "costs": costs,
                "ranking_changed": self.ranking_changed, "ranking_changed_simulated": self.ranking_changed_simulated,
                "scheduler": self.scheduler_defaults()}  # fmt: skip


def summarise(
    search: "TreeSearch", trajectories: Sequence[Trajectory], points: Sequence[FrontierPoint], runs: dict,
    costs: dict[int, float] | None = None,
) -> SearchResult:
    """Join the frontier with the canonical runs and choose EntMTP*, T- and T+.

    ``biased`` / ``simulated`` use every calibration prompt; ``biased_timed`` /
    ``simulated_timed`` only the timed prompts, the basis of the measured ``unbiased`` τ.
    With ``costs`` (c(N) per size) the trees are ranked by ``modelled`` speed (tokens per
    one-token forward, :func:`modelled_speed`), else by measured tokens/s.
    """
    greedy_table = search.cfg.scoring == "rank_tuple"
    timed_trajectories = [trajectories[i] for i in search.timing_indices()]

    def simulated(tree: Tree, trajs: Sequence[Trajectory] = trajectories) -> float | None:
        if not greedy_table:
            return None
        lengths = [a for t in trajs for a in simulate_canonical(t, tree)]
        return sum(lengths) / len(lengths) if lengths else None

    def biased_timed(tree: Tree) -> float | None:
        return table_accept(timed_trajectories, tree) if greedy_table else None

    frontier = [{"num_nodes": p.num_nodes, "tree": p.tree.choices, "biased": p.accept, "simulated": simulated(p.tree)}
                for p in points]  # fmt: skip
    vanilla = runs.get(VANILLA, {})
    timed: dict[str, dict] = {}
    for i in search.timed_indices(points):
        lab = f"frontier-{points[i].num_nodes}"
        r = runs.get(lab, {})
        timed[lab] = {"tree": points[i].tree, "num_nodes": points[i].num_nodes, "biased": points[i].accept,
                      "simulated": frontier[i]["simulated"], "biased_timed": biased_timed(points[i].tree),
                      "simulated_timed": simulated(points[i].tree, timed_trajectories), "unbiased": _pooled_accept(r),
                      "tokens_per_s": median(_tps(r)), "speedup": _paired_ratio(r, vanilla),
                      "modelled": _median_modelled(r, costs)}  # fmt: skip
    labels = list(timed)
    rank_key = "modelled" if costs is not None else "tokens_per_s"
    tree_costs = [interpolate_cost(costs, timed[lab]["num_nodes"]) for lab in labels] if costs is not None else None
    choice = choose_trees([timed[lab]["num_nodes"] for lab in labels], [timed[lab][rank_key] for lab in labels],
                          tree_costs)  # fmt: skip
    reference = None
    if REFERENCE in runs:
        r = runs[REFERENCE]
        reference = {"num_nodes": len(MC_SIM_7B_63) + 1, "unbiased": _pooled_accept(r), "tokens_per_s": median(_tps(r)),
                     "speedup": _paired_ratio(r, vanilla), "simulated": simulated(Tree.from_choices(MC_SIM_7B_63)),
                     "modelled": _median_modelled(r, costs)}  # fmt: skip
    return SearchResult(
        task=search.task, settings=search.cfg.to_dict(), frontier=frontier, timed=timed, labels=labels,
        choice=choice, vanilla_tokens_per_s=median(_tps(vanilla)), reference=reference, elapsed=dict(search.elapsed),
        costs=costs,
    )  # fmt: skip


# ============================================================================ environment
def hardware_string() -> str:
    """CPU model, core count and torch threads (or the GPU name)."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA), torch threads {torch.get_num_threads()}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in FsPath("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def versions() -> dict[str, str]:
    import torch
    import transformers

    from ... import __version__ as entmtp_version

    return {"entmtp_hf": entmtp_version, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}  # fmt: skip


# ============================================================================ the bank
def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def build_bank(result: SearchResult, info: dict[str, Any]) -> TopologyBank:
    """The task's bank: the timed frontier trees and the value policy's other shapes, smallest
    first, with every calibration figure."""
    trees, at = result.bank_trees()
    per_tree: list[dict] = [{} for _ in trees]
    for k, tree in enumerate(trees):
        if k not in at:
            cost = interpolate_cost(result.costs, tree.num_nodes) if result.costs else None
            per_tree[k] = {"num_nodes": tree.num_nodes, "name": f"fan-{tree.num_nodes}",
                           "source": "value policy: same size, depth 1",
                           **({"relative_forward_cost": cost} if _finite(cost) else {})}  # fmt: skip
    for i, lab in enumerate(result.labels):
        row = result.timed[lab]
        figures = {"mean_accept_length": row["unbiased"], "biased_accept_length": row["biased"],
                   "simulated_accept_length": row["simulated"], "tokens_per_s": row["tokens_per_s"],
                   "speedup_vs_plain": row["speedup"], "tokens_per_forward": row.get("modelled"),
                   "relative_forward_cost": (result.costs or {}).get(row["num_nodes"])}  # fmt: skip
        per_tree[at[i]] = {"num_nodes": row["num_nodes"], "name": lab, "source": "greedy acceptance frontier",
                           **{k: v for k, v in figures.items() if _finite(v)}}  # fmt: skip
    metadata = {
        **{k: info[k] for k in ("base_model", "heads") if info.get(k)},
        "hardware": hardware_string(),
        "created_by": "entmtp_hf.search",
        "description": f"Per-task bank from the offline tree search (task {result.task}); EntMTP* = tree "
        f"{at[result.choice.static]} ({_nodes(result.timed[result.labels[result.choice.static]]['num_nodes'])}).",
        "trees": per_tree,
        "scheduler": result.scheduler_defaults(),
        "calibration": {
            "settings": result.settings,
            "prompt_ids": info.get("prompt_ids", []),
            "heads_fingerprint": info.get("heads_fingerprint"),
            "vanilla_tokens_per_s": result.vanilla_tokens_per_s if _finite(result.vanilla_tokens_per_s) else None,
            "reference_mc_sim_7b_63": result.reference,
            "sweep": {k: {kk: vv for kk, vv in v.items() if _finite(vv)} for k, v in result.sweep.items()},
            "held_out_confirmation": result.confirmation or None,
            "ranking_changed": result.ranking_changed,
            "ranking_changed_simulated": result.ranking_changed_simulated,
            "ranked_by": "modelled tokens per one-token forward" if result.costs is not None else "measured tokens/s",
            "timed_prompt_ids": [info.get("prompt_ids", [])[i] for i in info.get("timing_indices", [])],
            "stage_seconds": {k: round(v, 1) for k, v in result.elapsed.items()},
            "versions": versions(),
        },
    }
    return TopologyBank(result.task, trees, _json_clean(metadata))


def _json_clean(value: Any) -> Any:
    """Replace NaN / inf by None so the metadata is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_clean(v) for v in value]
    return value


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


# ============================================================================ plots
def plot_acceptance(result: SearchResult, path: FsPath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set(xlabel="tree nodes (root included)", ylabel="mean accept length τ (tokens/step)",
           title=f"Greedy acceptance frontier: {result.task}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(result: SearchResult, path: FsPath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = [result.timed[lab] for lab in result.labels]
    xs, ys = [r["num_nodes"] for r in rows], [r["tokens_per_s"] for r in rows]
    ax.plot(xs, ys, "o", color="0.5", label="timed frontier trees")
    ax.plot([xs[i] for i in result.choice.hull], [ys[i] for i in result.choice.hull], "-", label="upper hull")
    c = result.choice
    for idx, name, marker in ((c.conservative, "T−", "v"), (c.aggressive, "T+", "^"), (c.static, "EntMTP*", "*")):
        ax.plot(xs[idx], ys[idx], marker, markersize=12, label=f"{name} ({_nodes(xs[idx])})")
    if _finite(result.vanilla_tokens_per_s):
        ax.axhline(result.vanilla_tokens_per_s, ls=":", color="k", label="plain decoding")
    if result.reference and _finite(result.reference["tokens_per_s"]):
        ax.plot(64, result.reference["tokens_per_s"], "s", label="mc_sim_7b_63")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tree nodes (root included)", ylabel="tokens/s (median over prompts)",
           title=f"Throughput frontier: {result.task}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ============================================================================ the report
def _f(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if _finite(value) else "–"


def _bias_table(result: SearchResult) -> list[str]:
    header = ["tree", "nodes", "biased τ (all prompts)", "biased τ", "simulated τ", "unbiased τ (generate)", "bias",
              "tokens/s", "vs plain", "c(N)", "modelled"]  # fmt: skip
    costs = result.costs or {}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    c = result.choice
    marks = {c.static: " (EntMTP*)", c.conservative: " (T−)", c.aggressive: " (T+)"}
    for k, lab in enumerate(result.labels):
        r = result.timed[lab]
        base = r["biased_timed"] if _finite(r["biased_timed"]) else r["biased"]
        bias = (base - r["unbiased"]) / r["unbiased"] if _finite(r["unbiased"]) and r["unbiased"] else None
        bias_text = f"{100 * bias:+.1f}%" if bias is not None else "–"
        lines.append(f"| {k}{marks.get(k, '')} | {r['num_nodes']} | {_f(r['biased'])} | {_f(r['biased_timed'])} | "
                     f"{_f(r['simulated_timed'])} | {_f(r['unbiased'])} | {bias_text} | {_f(r['tokens_per_s'], 2)} | "
                     f"{_f(r['speedup'], 2)}× | {_f(costs.get(r['num_nodes']), 2)} | {_f(r.get('modelled'))} |")  # fmt: skip
    if result.reference:
        r = result.reference
        lines.append(f"| mc_sim_7b_63 | 64 | – | – | – | {_f(r['unbiased'])} | – | "
                     f"{_f(r['tokens_per_s'], 2)} | {_f(r['speedup'], 2)}× | {_f(costs.get(64), 2)} | "
                     f"{_f(r.get('modelled'))} |")  # fmt: skip
    return lines


def _header(result: SearchResult, info: dict[str, Any]) -> list[str]:
    s, timed, sweep = result.settings, len(info.get("timing_indices", [])), result.settings["sweep_prompts"]
    stages = ", ".join(f"{k} {v:.0f}" for k, v in result.elapsed.items())
    return [
        f"# Tree search report: `{result.task}`", "",
        f"- base model: {info.get('base_model', '?')}; heads: {info.get('heads', '?')}",
        f"- hardware: {hardware_string()}; versions: {versions()}",
        f"- calibration: {len(info.get('prompt_ids', []))} prompts × {s['max_new_tokens']} new tokens (frontier), "
        f"the first {timed} of them timed with `generate`, the first {min(sweep, timed)} in the sweep; "
        f"scoring `{s['scoring']}`, acceptance `{s['acceptance']}`, node budget {s['budget']}",
        f"- stage wall times (s): {stages}", "",
    ]  # fmt: skip


def _frontier_section(result: SearchResult) -> list[str]:
    f, t = result.frontier, result.timed
    yes_no = {True: "yes", False: "no", None: "n/a"}
    inverted = inversions(list(t.values()), "biased", "unbiased")
    return [
        "## Frontier", "",
        f"{len(f)} trees, {f[0]['num_nodes']}..{f[-1]['num_nodes']} nodes; biased τ {_f(f[0]['biased'])} → "
        f"{_f(f[-1]['biased'])}. {len(result.labels)} of them were timed with `generate` (debias + throughput):", "",
        *_bias_table(result), "",
        "biased τ (all prompts) is the frontier's score; the other columns use the timed prompts only: biased τ "
        "averages every step start, simulated τ walks the rank tuples the way the decoder does, unbiased τ is "
        "measured with `generate`; bias = (biased − unbiased) / unbiased. c(N) = forward time for N tokens over "
        "one token; modelled = decoded tokens per one-token forward (tokens over Σ c(N) of the steps, scaled by "
        "the run's own time outside the forwards): " + (
            "the trees and schedulers were ranked by it." if result.costs is not None
            else "not computed, the trees and schedulers were ranked by measured tokens/s."), "",
        f"Frontier ranking changed by debiasing (timed trees, measured τ): **{yes_no[result.ranking_changed]}** "
        f"(inverted pairs, by nodes: {inverted or 'none'}); over all {len(f)} frontier trees (simulated τ): "
        f"**{yes_no[result.ranking_changed_simulated]}**. "
        f"Plain decoding: {_f(result.vanilla_tokens_per_s, 2)} tokens/s.",
        "",
    ]  # fmt: skip


def _choice_section(result: SearchResult) -> list[str]:
    c, t, labels = result.choice, result.timed, result.labels
    size = {k: t[labels[k]]["num_nodes"] for k in (c.static, c.conservative, c.aggressive)}
    sweep = [f"| {lab} | {_f(v['tokens_per_s'], 2)} | {_f(v.get('measured_vs_static'), 3)} | {_f(v['vs_static'], 3)} "
             f"| {_f(v.get('tokens_per_step'), 3)} |" for lab, v in result.sweep.items()]  # fmt: skip
    replayed = next((v["replayed"] for v in result.sweep.values() if v.get("replayed")), None)
    retrieval = result.retrieval_default()
    how = (f"Rows with a tokens/step figure were replayed, not timed: greedy decoding walked along the rank tuples "
           f"of all {replayed} calibration prompts (exact accept lengths, the scheduler fed the teacher-forced "
           f"features, retrieval {'`' + retrieval.mode + '`' if retrieval else 'off'} as the bank stores it), "
           f"ranked by tokens per unit of verification work (Σ accept / Σ c(N)) against the static tree replayed "
           f"the same way, `static (replayed)`.") if replayed else ""
    ranked = "modelled" if result.costs is not None else "measured"
    features = {k: v["feature"] for k, v in result.winners.items() if "feature" in v}
    _, at = result.bank_trees()  # "tree k" below is the bank's index
    return [
        "## Chosen trees", "",
        f"- EntMTP* (static optimum): tree {at[c.static]}, **{_nodes(size[c.static])}** ({size[c.static] - 1} drafted) "
        f"against mc_sim_7b_63's 63 drafted nodes; {_f(t[labels[c.static]]['tokens_per_s'], 2)} tokens/s",
        f"- T− (conservative): tree {at[c.conservative]}, {_nodes(size[c.conservative])}; "
        f"T+ (aggressive): tree {at[c.aggressive]}, {_nodes(size[c.aggressive])}",
        *(["- EntMTP* is the root-only tree: no drafted tree paid for its verification on this machine with "
           "these heads (the bank then decodes plainly through the EntMTP loop)."] if size[c.static] == 1 else []),
        f"- upper hull: {[t[labels[i]]['num_nodes'] for i in c.hull]} nodes; "
        f"Pareto set: {[t[labels[i]]['num_nodes'] for i in c.pareto]} nodes", "",
        "## Scheduler sweep", "",
        f"Median paired ratios to the static tree; the winners were picked by the {ranked} ratio.", "",
        *([how, ""] if how else []),
        "| run | tokens/s | measured vs static | ranking ratio vs static | tokens/step (replayed) |",
        "|---|---|---|---|---|", *sweep, "",
        *_headroom_lines(result),
        _confirmation_line(result),
        f"Stored defaults: {json.dumps(result.scheduler_defaults())}; features: {features}.", "",
    ]  # fmt: skip


def _headroom_lines(result: SearchResult) -> list[str]:
    h = result.headroom
    if not h:
        return []
    replayed = [v["vs_static"] for lab, v in result.sweep.items() if v.get("replayed") and lab != "static (replayed)"]
    best = f"; the best replayed scheduler above reaches {max(replayed):.3f}× its static tree" if replayed else ""
    return [f"Headroom: with every step's accept lengths known in advance, switching among the timed trees "
            f"({h['trees']} nodes) would verify {h['foresight_vs_static']:.3f}× the tokens per unit of work of the best "
            f"static one ({_nodes(h['best_static_nodes'])}; no retrieval, {h['prompts']} prompts){best}. Schedulers "
            f"see only what the decoder knows when a step starts; the gap is what a better confidence signal could "
            f"win.", ""]  # fmt: skip


def _confirmation_line(result: SearchResult) -> str:
    c = result.confirmation
    if not c:
        return "No scheduler cleared the sweep's margin (or no held-out prompt was left): nothing to confirm.\n"
    verdict = "kept as the default policy" if c["vs_static"] >= CONFIRM_MARGIN else "rejected: the default stays static"
    return (f"Held-out check of the sweep's best scheduler `{c['label']}` on {c['prompts']} calibration prompts the "
            f"sweep did not use: {_f(c['vs_static'])} vs static ({_f(c.get('measured_vs_static'))} measured); "
            f"needs {CONFIRM_MARGIN}: {verdict}.\n")


def report_markdown(result: SearchResult, info: dict[str, Any]) -> str:
    plots = ["![acceptance frontier](acceptance_frontier.png)", "", "![throughput frontier](throughput_frontier.png)"]
    return "\n".join([*_header(result, info), *_frontier_section(result), *_choice_section(result), *plots, ""])


def write_outputs(
    search: "TreeSearch", result: SearchResult, bank_dir: str | os.PathLike | None = None, plots_and_report: bool = True
) -> TopologyBank:
    """``bank/<task>.safetensors`` (+ card), the plots, ``report.md`` and ``result.json`` in the work folder."""
    info = {**search.info, "prompt_ids": search.prompt_ids, "timing_indices": search.timing_indices(),
            "heads_fingerprint": heads_fingerprint(search.heads)}  # fmt: skip
    bank = build_bank(result, info)
    bank.save_pretrained(search.dir / "bank")
    if bank_dir is not None:
        bank.save_pretrained(bank_dir)
    if not plots_and_report:
        return bank
    plot_acceptance(result, search.dir / PLOTS[0])
    plot_throughput(result, search.dir / PLOTS[1])
    (search.dir / "report.md").write_text(report_markdown(result, info), encoding="utf-8")
    _atomic_json(search.dir / "result.json", _json_clean(result.to_dict()))
    return bank


# ============================================================================ CLI
def _parse_list(text: str, kind: type) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def add_search_parser(sub: argparse._SubParsersAction) -> None:
    d = SearchConfig()
    p = sub.add_parser(
        "search",
        help="build a per-task tree bank: acceptance frontier, debias, throughput hull, scheduler sweep",
        description="Offline tree search (docs/search.md). Every stage is checkpointed in --out; rerunning the "
        "same command resumes an interrupted search.",
    )
    p.add_argument("--task", required=True,
                   help="humaneval | gsm8k | chat | a JSONL file or Hub dataset id; or several, comma-separated")
    p.add_argument("--heads", default=None, help="heads folder or Hub repo id (default: the demo heads if present)")
    p.add_argument("--random-heads", type=int, default=0, metavar="N",
                   help="use N randomly initialised Hydra heads (to time the stages before heads exist)")  # fmt: skip
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="with --random-heads: draft on the first K ids")
    p.add_argument("--model", default=None, help="base model id or folder (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True,
                   help="work folder: checkpoints, bank/, plots, report.md ('{task}' becomes the task name)")
    p.add_argument("--bank-dir", default=None, help="also save the bank into this Hub-style folder")
    p.add_argument("--restart", action="store_true", help="delete this search's checkpoints in --out first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="calibration prompts of the frontier")
    p.add_argument("--timing-prompts", type=int, default=d.timing_prompts,
                   help="how many of them (the first) are timed with generate")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--budget", type=int, default=d.budget, help="node budget B (root included)")
    p.add_argument("--max-depth", type=int, default=None, help="D (default: number of heads)")
    p.add_argument("--scoring", choices=SCORINGS, default=d.scoring)
    p.add_argument("--acceptance", choices=RULES, default=d.acceptance)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--timed-sizes", default=",".join(map(str, TIMED_SIZES)),
                   help="frontier sizes to time, comma-separated, or 'every' (with --time-every)")  # fmt: skip
    p.add_argument("--time-every", type=int, default=d.time_every, help="time every k-th frontier size")
    p.add_argument("--no-reference", action="store_true", help="do not time mc_sim_7b_63")
    p.add_argument("--sweep-prompts", type=int, default=d.sweep_prompts)
    p.add_argument("--tau-grid", default=",".join(f"{t:g}" for t in TAU_GRID))
    p.add_argument("--features", default=",".join(d.features), help=f"comma-separated, from {', '.join(FEATURES)}")
    p.add_argument("--no-ladder", action="store_true", help="skip the ladder threshold sweep")
    p.add_argument("--no-retrieval", action="store_true",
                   help="do not time retrieval branches (the bank's retrieval default stays off)")  # fmt: skip
    p.add_argument("--ranking", choices=RANKINGS, default=d.ranking,
                   help="choose trees and schedulers by modelled tokens per forward (measured forward costs x "
                   "steps; robust to a noisy machine) or by measured tokens/s")  # fmt: skip
    p.add_argument("--cost-repeats", type=int, default=d.cost_repeats, help="rounds of the forward-cost timing")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_cli)


def config_from_args(args: argparse.Namespace) -> SearchConfig:
    sizes = None if args.timed_sizes.strip() == "every" else _parse_list(args.timed_sizes, int)
    return SearchConfig(
        num_prompts=args.num_prompts, timing_prompts=args.timing_prompts, max_new_tokens=args.max_new_tokens,
        budget=args.budget, max_depth=args.max_depth, scoring=args.scoring, acceptance=args.acceptance,
        temperature=args.temperature, timed_sizes=sizes, time_every=args.time_every,
        time_reference=not args.no_reference, sweep_prompts=args.sweep_prompts,
        tau_grid=_parse_list(args.tau_grid, float), features=_parse_list(args.features, str),
        ladder=not args.no_ladder, retrieval=not args.no_retrieval, ranking=args.ranking,
        cost_repeats=args.cost_repeats, seed=args.seed,
    )  # fmt: skip




def _load_heads(args: argparse.Namespace, model) -> tuple[Any, str]:
    import torch

    from ...heads import HydraHeads, load_heads

    if args.random_heads:
        torch.manual_seed(args.seed)
        rows = min(args.draft_vocab_size, model.config.vocab_size)
        heads = HydraHeads.for_model(model, num_heads=args.random_heads, draft_vocab=torch.arange(rows))
        return heads, f"random Hydra heads ({args.random_heads} heads, draft vocab {rows}, seed {args.seed})"
    source = args.heads or (str(DEMO_HEADS) if args.model is None and DEMO_HEADS.is_dir() else None)
    if source is None:
        raise ValueError("give --heads (a folder or Hub repo id) or --random-heads N")
    name = f"entmtp-hf demo heads ({DEMO_HEADS.name})" if FsPath(source).resolve() == DEMO_HEADS else str(source)
    return load_heads(source, base_config=model.config), name


def _restart(out: FsPath) -> None:
    """Delete this search's own files in ``out`` (nothing else)."""
    from .search import TreeSearch

    if out.is_dir():
        for name in [*TreeSearch.FILES.values(), "result.json", "report.md", *PLOTS]:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "bank", ignore_errors=True)


def run_cli(args: argparse.Namespace) -> int:
    """Load the model and heads once, then search every task of ``--task`` (comma-separated) in turn."""
    import torch

    from ...demo.model import DEMO_NAME, load_base_model
    from ...integration import HEADS_ATTR, enable_entmtp
    from .search import TreeSearch
    from ..data.tasks import calibration_prompts

    config = config_from_args(args)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    if len(tasks) > 1 and "{task}" not in args.out:
        raise ValueError("with several tasks, --out must contain '{task}', e.g. runs/search-{task}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_base_model(args.model)
    heads, heads_name = _load_heads(args, model)
    enable_entmtp(model, heads)
    for task in tasks:
        out = FsPath(args.out.replace("{task}", FsPath(task).stem))
        if args.restart:
            _restart(out)
        prompts = calibration_prompts(task, config.num_prompts)
        search = TreeSearch(
            model, getattr(model, HEADS_ATTR), [p.render(tokenizer) for p in prompts], out, config,
            task=FsPath(task).stem if FsPath(task).exists() else task, prompt_ids=[p.prompt_id for p in prompts],
            info={"base_model": args.model or DEMO_NAME, "heads": heads_name}, progress=not args.no_progress,
        )  # fmt: skip
        result = search.run(args.bank_dir)
        seconds = json.dumps({k: round(v) for k, v in result.elapsed.items()})
        nodes = result.timed[result.labels[result.choice.static]]["num_nodes"]
        print(f"{search.task}: EntMTP* = {_nodes(nodes)}; stage seconds {seconds}; outputs in {out}", flush=True)
    return 0
