"""The search's figures: per-tree accept lengths and speeds, the chosen trees, the sweep winners.

:func:`summarise` joins the checkpointed stage results into one :class:`SearchResult`;
its ``with_*`` methods add the sweep, the replayed schedulers, the held-out confirmation and
the headroom, and :meth:`SearchResult.scheduler_defaults` is what the bank stores. Plain data
in, plain data out: the outputs (:mod:`.outputs`) and the report are written from it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ...banks.bank import default_thresholds
from ...costs.table import interpolate
from ...trees.retrieval import RetrievalConfig
from ...trees.tree import MC_SIM_7B_63, Tree
from .choose import Choice, choose_trees, value_costs, value_sets
from .config import REFERENCE, RETRIEVAL_RUNS, VANILLA, SearchConfig
from .frontier import FrontierPoint
from .replay import accept_table, foresight_rate, walk_rate
from .trajectories import Trajectory, simulate_canonical, table_accept

#: a scheduler becomes a bank's default policy only if it beat the static tree by this much in
#: the sweep, and by CONFIRM_MARGIN on held-out prompts (``TreeSearch.confirm``)
SWEEP_MARGIN = 1.05
CONFIRM_MARGIN = 1.02


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def nodes_text(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


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
    work = sum(interpolate(costs, n) for n in sizes)
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
    rows = [r for r in rows if finite(r.get(a)) and finite(r.get(b))]
    return [
        (x["num_nodes"], y["num_nodes"])
        for i, x in enumerate(rows)
        for y in rows[i + 1 :]
        if (x[a] - y[a]) * (x[b] - y[b]) < 0
    ]


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
        (:func:`~entmtp_hf.tools.search.replay.foresight_rate`): the most any scheduler could win here."""
        trees = [self.timed[lab]["tree"] for lab in self.labels]
        costs = [interpolate(self.costs, t.num_nodes) for t in trees]
        tables = [accept_table(t, trees) for t in trajectories if t.tuples]
        if not tables:
            return self
        rates = [a / w for a, w in (walk_rate(tables, costs, lambda i, j, k=k: k) for k in range(len(trees)))]
        best = max(range(len(trees)), key=rates.__getitem__)
        foresight = foresight_rate(tables, costs)
        self.headroom = {
            "trees": [t.num_nodes for t in trees],
            "best_static_nodes": trees[best].num_nodes,
            "best_static_rate": rates[best],
            "foresight_rate": foresight,
            "foresight_vs_static": foresight / rates[best],
            "prompts": len(tables),
        }
        return self

    def with_sweep(self, runs: dict) -> "SearchResult":
        """Add the sweep's figures and pick the hysteresis and ladder winners: the median ratio
        to static per prompt, modelled (with :attr:`costs`) or measured."""
        static = runs.get("static", {})
        speed = ranking_speed(self.costs)
        self.sweep = {
            lab: {
                "tokens_per_s": median(_tps(r)),
                "vs_static": _paired_ratio(r, static, speed) if lab != "static" else 1.0,
                "measured_vs_static": _paired_ratio(r, static) if lab != "static" else 1.0,
            }
            for lab, r in runs.items()
        }
        tried = [lab for lab in RETRIEVAL_RUNS if lab in self.sweep and finite(self.sweep[lab]["vs_static"])]
        if tried:
            best = max(tried, key=lambda lab: self.sweep[lab]["vs_static"])
            self.winners["retrieval"] = {"label": best, "config": asdict(RETRIEVAL_RUNS[best]), **self.sweep[best]}
        self._pick_switching_winners()
        sets = value_sets({lab: row["tree"] for lab, row in self.timed.items()}, self.choice, self.labels)
        cands = [lab for lab in sets if lab in self.sweep and finite(self.sweep[lab]["vs_static"])]
        if cands:
            best = max(cands, key=lambda lab: self.sweep[lab]["vs_static"])
            self.winners["value"] = {
                "label": best,
                "trees": [t.choices for t in sets[best]],
                "costs": value_costs(sets[best], self.costs),
                **self.sweep[best],
            }
        return self

    def with_replay(self, runs: dict[str, dict], prompts: int) -> "SearchResult":
        """Add the replayed hysteresis and ladder runs (``runs``: label -> accept lengths and
        tree sizes over every calibration prompt, ``static`` the reference with the same
        retrieval setting) and pick those winners from them: the ratio to static of tokens per
        unit of verification work, Σ accept / Σ c(N). The replayed reference is listed as
        ``static (replayed)``."""

        def rate(run: dict) -> float:
            return sum(run["accept_lengths"]) / sum(interpolate(self.costs, n) for n in run["tree_sizes"])

        ref = rate(runs["static"])
        for lab, run in runs.items():
            row = "static (replayed)" if lab == "static" else lab
            self.sweep[row] = {
                "tokens_per_s": None,
                "vs_static": rate(run) / ref,
                "measured_vs_static": None,
                "tokens_per_step": sum(run["accept_lengths"]) / len(run["accept_lengths"]),
                "replayed": prompts,
            }
        self._pick_switching_winners()
        return self

    def _pick_switching_winners(self) -> None:
        """The hysteresis and ladder settings with the best ratio to static."""
        for kind in ("hysteresis", "ladder"):
            cands = [lab for lab, v in self.sweep.items() if lab.startswith(kind + ":") and finite(v["vs_static"])]
            if cands:
                best = max(cands, key=lambda lab: self.sweep[lab]["vs_static"])
                _, feature, values, *pair = best.split(":")
                self.winners[kind] = {
                    "label": best,
                    "feature": feature,
                    "values": [float(v) for v in values.split(",")],
                    **self.sweep[best],
                }
                if pair:
                    self.winners[kind]["trees"] = [int(i) for i in pair[0].split("-")]

    def retrieval_default(self) -> RetrievalConfig | None:
        """The bank's retrieval setting: the sweep's faster retrieval run where it made the
        static tree faster by ``SWEEP_MARGIN``, else off."""
        won = self.winners.get("retrieval", {})
        return RetrievalConfig(**won["config"]) if won.get("vs_static", 0.0) >= SWEEP_MARGIN else None

    def _sweep_speeds(self) -> dict[str, float]:
        """Each scheduler kind's sweep ratio to static, where it clears ``SWEEP_MARGIN``."""
        return {
            k: v["vs_static"] for k, v in self.winners.items() if k != "retrieval" and v["vs_static"] >= SWEEP_MARGIN
        }

    def scheduler_candidate(self) -> str | None:
        """The sweep label of the scheduler that would become the default policy, if any."""
        speeds = self._sweep_speeds()
        return self.winners[max(speeds, key=lambda k: speeds[k])]["label"] if speeds else None

    def with_confirmation(self, runs: dict) -> "SearchResult":
        """Record the candidate's ratio to static on the held-out prompts (``runs``: static + it)."""
        label = next((lab for lab in runs if lab != "static"), None)
        if label is not None:
            ratio = _paired_ratio(runs[label], runs["static"], ranking_speed(self.costs))
            self.confirmation = {
                "label": label,
                "vs_static": ratio,
                "prompts": len(runs[label]),
                "measured_vs_static": _paired_ratio(runs[label], runs["static"]),
            }
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
        return {
            "static": at[c.static],
            "conservative": at[low],
            "aggressive": at[high],
            "tau_on": tau,
            "tau_off": tau,
            "ladder": [at[i] for i in ladder],
            "thresholds": thresholds,
            "policy": max(speed, key=lambda k: speed[k]),
            "feature": hyst["feature"] if hyst else "best_path_value",
            "ladder_feature": lad["feature"] if lad else "best_path_value",
            "retrieval": retrieval,
            "value": [trees.index(Tree.from_choices(t)) for t in value["trees"]] if value else [],
            "value_costs": value["costs"] if value else [],
        }

    def to_dict(self) -> dict[str, Any]:
        timed = {
            lab: {k: (v.choices if isinstance(v, Tree) else v) for k, v in row.items()}
            for lab, row in self.timed.items()
        }
        plain = (
            "task",
            "settings",
            "frontier",
            "labels",
            "vanilla_tokens_per_s",
            "reference",
            "elapsed",
            "sweep",
            "winners",
            "confirmation",
            "headroom",
        )
        costs = {str(n): c for n, c in self.costs.items()} if self.costs is not None else None
        return {
            **{k: getattr(self, k) for k in plain},
            "timed": timed,
            "choice": asdict(self.choice),
            "costs": costs,
            "ranking_changed": self.ranking_changed,
            "ranking_changed_simulated": self.ranking_changed_simulated,
            "scheduler": self.scheduler_defaults(),
        }


class _Accepts:
    """Accept lengths read off the rank tuples: over every calibration prompt, or the timed ones."""

    def __init__(self, trajectories: Sequence[Trajectory], timing: Sequence[int], greedy_table: bool) -> None:
        self.all, self.timed = list(trajectories), [trajectories[i] for i in timing]
        self.greedy_table = greedy_table

    def simulated(self, tree: Tree, timed: bool = False) -> float | None:
        if not self.greedy_table:
            return None
        lengths = [a for t in (self.timed if timed else self.all) for a in simulate_canonical(t, tree)]
        return sum(lengths) / len(lengths) if lengths else None

    def biased_timed(self, tree: Tree) -> float | None:
        return table_accept(self.timed, tree) if self.greedy_table else None


def _run_figures(r: dict, vanilla: dict, costs: dict[int, float] | None) -> dict[str, Any]:
    """A label's measured figures: unbiased τ, median tokens/s, speed-up over plain decoding, modelled speed."""
    return {
        "unbiased": _pooled_accept(r),
        "tokens_per_s": median(_tps(r)),
        "speedup": _paired_ratio(r, vanilla),
        "modelled": _median_modelled(r, costs),
    }


def summarise(
    task: str,
    cfg: SearchConfig,
    trajectories: Sequence[Trajectory],
    points: Sequence[FrontierPoint],
    runs: dict,
    *,
    timed: Sequence[int],
    timing: Sequence[int],
    elapsed: dict[str, float],
    costs: dict[int, float] | None = None,
) -> SearchResult:
    """Join the frontier with the canonical runs and choose EntMTP*, T- and T+.

    ``timed``: the frontier indices that were timed; ``timing``: the calibration prompts they
    were timed on. ``biased`` / ``simulated`` use every calibration prompt; ``biased_timed`` /
    ``simulated_timed`` only the timed prompts, the basis of the measured ``unbiased`` τ.
    With ``costs`` (c(N) per size) the trees are ranked by ``modelled`` speed (tokens per
    one-token forward, :func:`modelled_speed`), else by measured tokens/s.
    """
    acc = _Accepts(trajectories, timing, cfg.scoring == "rank_tuple")
    frontier = [
        {"num_nodes": p.num_nodes, "tree": p.tree.choices, "biased": p.accept, "simulated": acc.simulated(p.tree)}
        for p in points
    ]
    vanilla = runs.get(VANILLA, {})
    rows: dict[str, dict] = {}
    for i in timed:
        p, lab = points[i], f"frontier-{points[i].num_nodes}"
        rows[lab] = {
            "tree": p.tree,
            "num_nodes": p.num_nodes,
            "biased": p.accept,
            "simulated": frontier[i]["simulated"],
            "biased_timed": acc.biased_timed(p.tree),
            "simulated_timed": acc.simulated(p.tree, timed=True),
            **_run_figures(runs.get(lab, {}), vanilla, costs),
        }
    labels = list(rows)
    rank_key = "modelled" if costs is not None else "tokens_per_s"
    tree_costs = [interpolate(costs, rows[lab]["num_nodes"]) for lab in labels] if costs is not None else None
    choice = choose_trees(
        [rows[lab]["num_nodes"] for lab in labels], [rows[lab][rank_key] for lab in labels], tree_costs
    )
    reference = None
    if REFERENCE in runs:
        ref = _run_figures(runs[REFERENCE], vanilla, costs)
        reference = {
            "num_nodes": len(MC_SIM_7B_63) + 1,
            "unbiased": ref["unbiased"],
            "tokens_per_s": ref["tokens_per_s"],
            "speedup": ref["speedup"],
            "simulated": acc.simulated(Tree.from_choices(MC_SIM_7B_63)),
            "modelled": ref["modelled"],
        }
    return SearchResult(
        task=task,
        settings=cfg.to_dict(),
        frontier=frontier,
        timed=rows,
        labels=labels,
        choice=choice,
        vanilla_tokens_per_s=median(_tps(vanilla)),
        reference=reference,
        elapsed=dict(elapsed),
        costs=costs,
    )
