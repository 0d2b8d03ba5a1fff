"""Offline tree search: from a model, its draft heads and a task to a calibrated bank.

Stages (DESIGN §1, "Offline: building a per-task tree bank"), each checkpointed as JSON in
the work folder so an interrupted search resumes where it stopped:

1. ``trajectories`` - one greedy generation per calibration prompt, then one teacher-forced
   pass of the heads along prompt + output: the rank tuple of every step start
   (:mod:`.trajectories`).
2. ``frontier`` - Algorithm 1, the greedy acceptance frontier (:mod:`.frontier`), its
   candidates scored by the rank tuples or by joint self-rollouts (:mod:`.rollout`).
3. ``rollouts`` - debias + throughput: each timed frontier tree (plain decoding and
   mc_sim_7b_63 too) runs ``generate`` on the first ``timing_prompts`` calibration prompts,
   interleaved, after one untimed warm-up each. The runs give the unbiased (canonical)
   accept length and tokens/s (median over prompts). For greedy decoding the rank tuples
   also give every frontier tree's canonical accept length exactly.
4. ``costs`` - c(N), the forward time for N tokens over one token, for every timed size
   (interleaved medians). With ``ranking="modelled"`` (the default) trees and schedulers are
   ranked by decoded tokens per one-token forward: a run's tokens over Σ c(N) of its steps,
   scaled by its own share of time outside the forwards. Single-run wall times on a shared
   machine vary by far more than the differences between trees; this ranking only lets that
   noise in through the small overhead share. ``ranking="measured"`` ranks by wall-clock tokens/s.
5. ``sweep`` - EntMTP* = the throughput-maximal tree; T- / T+ = the fastest smaller / larger
   timed tree (:mod:`.choose`); hysteresis (every pair of the three) × τ × feature and ladder
   thresholds are scored against the static tree: replayed along the rank tuples of every
   calibration prompt (:mod:`.replay`, greedy with the modelled ranking), else timed on the
   sweep prompts like the retrieval runs and the value policy.
6. ``outputs`` - the bank, plots and report (:mod:`.outputs`, from the :mod:`.result`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from functools import partial
from pathlib import Path as FsPath
from typing import Sequence

from tqdm.auto import tqdm

from ...config import EntMTPConfig
from ...scheduling.features import threshold
from ...scheduling.policies import FEATURE_POLICIES
from ...trees.retrieval import RetrievalConfig
from ...trees.tree import MC_SIM_7B_63, Tree
from ..checkpoint import check_deadline, config_fingerprint, heads_fingerprint, read_json, write_json
from ..profile import forward_costs as profile_forward_costs
from .choose import Choice, value_costs, value_sets
from .config import REFERENCE, RETRIEVAL_RUNS, VANILLA, SearchConfig
from .frontier import FrontierPoint, greedy_frontier, rank_tuple_scorer
from .measure import RUN_KEYS, CostFn, Measure, eos_ids, generate_measure
from .outputs import write_outputs
from .replay import replay, why_not_replayable
from .result import SearchResult, median, summarise
from .rollout import rollout_scorer
from .trajectories import Trajectory, step_table

#: held-out calibration prompts a scheduler must also beat the static tree on to become a bank's default
CONFIRM_PROMPTS = 8


class TreeSearch:
    """One task's search in one work folder; every stage checkpoints and is skipped when done.

    ``prompts`` are token-id lists (the rendered calibration prompts); ``measure`` replaces
    the timed ``generate`` call (tests inject deterministic timings through it).
    """

    FILES = {
        "settings": "settings.json",
        "trajectories": "trajectories.json",
        "frontier": "frontier.json",
        "rollouts": "rollouts.json",
        "costs": "forward_costs.json",
        "sweep": "sweep.json",
        "confirm": "confirm.json",
        "elapsed": "stage_seconds.json",
    }

    def __init__(
        self,
        model,
        heads,
        prompts: Sequence[Sequence[int]],
        work_dir: str | os.PathLike,
        config: SearchConfig,
        *,
        task: str = "task",
        prompt_ids: Sequence[str] | None = None,
        measure: Measure | None = None,
        sweep_measure: Measure | None = None,
        forward_costs: CostFn | None = None,
        info: dict | None = None,
        progress: bool = True,
        deadline: float | None = None,
    ) -> None:
        if len(prompts) < 1:
            raise ValueError("the search needs at least one calibration prompt")
        self.model, self.heads, self.cfg, self.task = model, heads, config, task
        self.prompts = [list(map(int, p)) for p in prompts[: config.num_prompts]]
        self.prompt_ids = list(prompt_ids or [f"{task}-{i}" for i in range(len(prompts))])[: len(self.prompts)]
        self.dir = FsPath(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.measure = measure or generate_measure(model, config)
        self.warmup_measure = measure or generate_measure(model, config, max_new_tokens=8)
        self.sweep_measure = sweep_measure or self.measure
        self.forward_costs = forward_costs or partial(profile_forward_costs, progress=progress, heads=heads)
        self.info = dict(info or {})
        self.progress = progress
        self.deadline = deadline  # perf_counter time: past it, a stage stops after its next checkpoint (OutOfTime)
        self.max_depth = min(config.max_depth or heads.num_heads, heads.num_heads)
        self.max_rank = min(heads.config.draft_vocab_rows, config.budget)
        self._check_settings()
        self.elapsed: dict[str, float] = read_json(self.path("elapsed")) or {}
        self.stages_run: list[str] = []  # stages that computed something in this run

    # ---------------------------------------------------------------- bookkeeping
    def path(self, name: str) -> FsPath:
        return self.dir / self.FILES.get(name, name)

    def _check_settings(self) -> None:
        settings = {
            "task": self.task,
            "search": self.cfg.to_dict(),
            "prompt_ids": self.prompt_ids,
            "prompts_sha": hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()[:16],
            "heads": heads_fingerprint(self.heads),
            "model": self.info.get("base_model", ""),
        }
        old = read_json(self.path("settings"))
        if old is not None and old != settings:
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            raise ValueError(
                f"{self.dir} holds a search with other settings ({', '.join(diff)} differ); "
                "use another output folder or restart (--restart deletes the checkpoints)"
            )
        write_json(self.path("settings"), settings)

    def _timed(self, stage: str, t0: float) -> None:
        """Add this run's wall time of a stage to the totals kept across resumed runs."""
        self.elapsed[stage] = self.elapsed.get(stage, 0.0) + time.perf_counter() - t0
        self.stages_run.append(stage)
        write_json(self.path("elapsed"), self.elapsed)

    def _stop_if_late(self, t0: float | None, stage: str) -> None:
        """Past the deadline (everything so far checkpointed): count the stage's time, raise OutOfTime."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            if t0 is not None:
                self._timed(stage, t0)
            check_deadline(self.deadline, f"search {self.task}, {stage}")

    # ---------------------------------------------------------------- stage 1
    def trajectories(self) -> list[Trajectory]:
        """Greedy run + rank tuples and signals per prompt (rollout scoring: prompts only);
        resumes per prompt. Checkpoints from before signals were recorded get them from one
        more teacher-forced pass over the stored tokens."""
        saved = read_json(self.path("trajectories")) or {"done": {}, "seconds": 0.0}
        todo = [i for i in range(len(self.prompts)) if self.prompt_ids[i] not in saved["done"]]
        stale = (
            []
            if self.cfg.scoring != "rank_tuple"
            else [pid for pid in self.prompt_ids if pid in saved["done"] and "signals" not in saved["done"][pid]]
        )
        if not todo and not stale:
            return [Trajectory(**saved["done"][pid]) for pid in self.prompt_ids]
        t0 = time.perf_counter()
        for pid in stale:
            row = saved["done"][pid]
            row["tuples"], row["signals"] = step_table(
                self.model, self.heads, row["tokens"], row["prompt_len"], self.max_depth, self.max_rank
            )
        if stale:
            write_json(self.path("trajectories"), saved)
        measure = generate_measure(self.model, self.cfg)
        for i in tqdm(todo, desc="trajectories", unit="prompt", disable=not self.progress):
            t1 = time.perf_counter()
            tokens, tuples, signals = self.prompts[i], [], {}
            if self.cfg.scoring == "rank_tuple":  # the rollout scoring decodes by itself
                tokens = tokens + measure("trajectory", None, self.prompts[i])["tokens"]
                tuples, signals = step_table(
                    self.model, self.heads, tokens, len(self.prompts[i]), self.max_depth, self.max_rank
                )
            saved["done"][self.prompt_ids[i]] = {
                "prompt_len": len(self.prompts[i]),
                "tokens": tokens,
                "tuples": tuples,
                "signals": signals,
            }
            saved["seconds"] += time.perf_counter() - t1
            write_json(self.path("trajectories"), saved)
            if i != todo[-1]:
                self._stop_if_late(t0, "trajectories")
        self._timed("trajectories", t0)
        return [Trajectory(**saved["done"][pid]) for pid in self.prompt_ids]

    # ---------------------------------------------------------------- stage 2
    def frontier(self, trajectories: Sequence[Trajectory]) -> list[FrontierPoint]:
        """The greedy acceptance frontier; rollout scoring checkpoints every added node."""
        saved = read_json(self.path("frontier")) or {"points": [], "complete": False}
        points = [
            FrontierPoint(Tree.from_choices(p["tree"]), p["accept"], tuple(p["added"]) if p["added"] else None)
            for p in saved["points"]
        ]
        if saved["complete"]:
            return points
        t0 = time.perf_counter()
        if self.cfg.scoring == "rank_tuple":
            score = rank_tuple_scorer(trajectories)
        else:
            score = rollout_scorer(self.model, self.heads, self.prompts, self.cfg, eos_ids(self.model))

        def save(pts: list[FrontierPoint], complete: bool = False) -> None:
            rows = [
                {
                    "tree": p.tree.choices,
                    "num_nodes": p.num_nodes,
                    "accept": p.accept,
                    "added": list(p.added) if p.added else None,
                }
                for p in pts
            ]
            write_json(self.path("frontier"), {"points": rows, "complete": complete})

        points = greedy_frontier(score, self.cfg.budget, self.max_depth, self.max_rank, points, save, self.progress)
        save(points, complete=True)
        self._timed("frontier", t0)
        return points

    def timed_indices(self, points: Sequence[FrontierPoint]) -> list[int]:
        """Frontier indices to time: ``timed_sizes`` present on the frontier, or every k-th and the last."""
        if self.cfg.timed_sizes is not None:
            wanted = set(self.cfg.timed_sizes)
            found = [i for i, p in enumerate(points) if p.num_nodes in wanted]
            if not found:
                raise ValueError(
                    f"none of the timed sizes {sorted(wanted)} is on the frontier "
                    f"({points[0].num_nodes}..{points[-1].num_nodes} nodes)"
                )
            return found
        k = self.cfg.time_every
        return sorted({i for i in range(0, len(points), k)} | {len(points) - 1})

    def timing_indices(self) -> list[int]:
        """Prompts timed with ``generate``: the first ``timing_prompts`` calibration prompts."""
        return list(range(min(self.cfg.timing_prompts, len(self.prompts))))

    def reference_tree(self) -> Tree | None:
        tree = Tree.from_choices(MC_SIM_7B_63)
        fits = tree.depth <= self.heads.num_heads and 10 <= self.heads.config.draft_vocab_rows
        return tree if self.cfg.time_reference and fits else None

    # ---------------------------------------------------------------- stages 3 and 4
    def _interleaved(
        self, name: str, runs: dict[str, EntMTPConfig | None], prompts: list[int], measure: Measure
    ) -> tuple[dict, bool]:
        """Every (label, prompt) once, labels rotated per prompt; one untimed warm-up per label.

        A label's saved runs are kept only while its config is the one it was measured with
        (``_configs`` in the file; labels such as ``static`` name a role, and a re-ranking can
        give the role another tree). Returns the requested labels' runs and whether anything
        was measured now."""
        saved = read_json(self.path(name)) or {}
        configs = saved.pop("_configs", {})
        for lab in runs:
            if lab in configs and configs[lab] != config_fingerprint(runs[lab]):
                saved.pop(lab, None)  # measured with another tree or setting: stale
        configs = {lab: config_fingerprint(conf) for lab, conf in runs.items()}
        todo = [(p, lab) for p in prompts for lab in runs if str(p) not in saved.get(lab, {})]
        if not todo:
            return {lab: saved[lab] for lab in runs if lab in saved}, False
        warm_prompt = self.prompts[todo[0][0]][:]
        for lab, conf in tqdm(runs.items(), desc=f"{name} warm-up", unit="run", disable=not self.progress):
            self.warmup_measure(lab, conf, warm_prompt)  # untimed: first-call costs stay out of the medians
        labels = list(runs)
        bar = tqdm(total=len(todo), desc=name, unit="run", disable=not self.progress)
        for p in prompts:
            rot = p % len(labels)
            for lab in labels[rot:] + labels[:rot]:
                if str(p) in saved.get(lab, {}):
                    continue
                r = measure(lab, runs[lab], self.prompts[p])
                saved.setdefault(lab, {})[str(p)] = {k: r[k] for k in RUN_KEYS if k in r}
                write_json(self.path(name), {**saved, "_configs": configs})
                bar.update(1)
                self._stop_if_late(None, name)
        bar.close()
        return {lab: saved[lab] for lab in runs if lab in saved}, True

    def rollouts(self, points: Sequence[FrontierPoint]) -> dict:
        """Debias + throughput: canonical ``generate`` runs of the timed trees and of plain decoding."""
        t0 = time.perf_counter()
        runs: dict[str, EntMTPConfig | None] = {VANILLA: None}
        for i in self.timed_indices(points):
            runs[f"frontier-{points[i].num_nodes}"] = self._tree_config(points[i].tree)
        ref = self.reference_tree()
        if ref is not None:
            runs[REFERENCE] = self._tree_config(ref)
        out, measured = self._interleaved("rollouts", runs, self.timing_indices(), self.measure)
        if measured:
            self._timed("rollouts", t0)
        return out

    def costs(self, points: Sequence[FrontierPoint]) -> dict[int, float]:
        """c(N) for every timed tree size: forward time relative to one token, at a typical context
        length of the calibration runs (median prompt + half the new tokens; interleaved
        medians; checkpointed).

        The modelled ranking multiplies these by the steps each run took: on a shared CPU the
        wall time of single runs varies by tens of percent, far more than the differences
        between the trees it must rank (docs/search.md)."""
        timed = {points[i].num_nodes for i in self.timed_indices(points)}
        # the sweep's retrieval runs verify a timed tree plus up to L retrieved tokens (or L + 1 alone)
        extra = max(r.num_tokens for r in RETRIEVAL_RUNS.values()) if self.cfg.retrieval else 0
        sizes = sorted(
            {1}
            | timed
            | {n + k for n in timed for k in range(1, extra + 1)}
            | ({len(MC_SIM_7B_63) + 1} if self.reference_tree() is not None else set())
        )
        saved = read_json(self.path("costs"))
        if saved is not None and all(str(n) in saved["relative"] for n in sizes):
            return {int(n): float(c) for n, c in saved["relative"].items()}
        t0 = time.perf_counter()
        prefix_len = int(median([len(p) for p in self.prompts])) + self.cfg.max_new_tokens // 2
        seconds = self.forward_costs(self.model, sizes, prefix_len=prefix_len, repeats=self.cfg.cost_repeats)
        relative = {n: seconds[n] / seconds[1] for n in sizes}
        write_json(
            self.path("costs"),
            {
                "prefix_len": prefix_len,
                "repeats": self.cfg.cost_repeats,
                "seconds": {str(n): seconds[n] for n in sizes},
                "relative": {str(n): relative[n] for n in sizes},
            },
        )
        self._timed("costs", t0)
        return relative

    def _tree_config(self, tree: Tree, **kw) -> EntMTPConfig:
        rule = {"greedy": "auto", "exact": "exact", "typical": "typical"}[self.cfg.acceptance]
        extra = {"posterior_threshold": self.cfg.posterior_threshold, "posterior_alpha": self.cfg.posterior_alpha}
        if "trees" in kw:
            return EntMTPConfig(acceptance=rule, **extra, **kw)
        return EntMTPConfig(tree=tree.choices, acceptance=rule, **extra, **kw)

    def sweep(self, runs: dict[str, EntMTPConfig]) -> dict:
        """The :meth:`sweep_runs` (hysteresis τ × feature, ladder thresholds, value sets), measured
        against the static tree."""
        t0 = time.perf_counter()
        prompts = self.timing_indices()[: self.cfg.sweep_prompts]
        out, measured = self._interleaved("sweep", runs, prompts, self.sweep_measure)
        if measured:
            self._timed("sweep", t0)
        return out

    def sweep_runs(
        self,
        trees: dict[str, Tree],
        choice: Choice,
        labels: list[str],
        costs: dict[int, float] | None = None,
        retrieval: RetrievalConfig | None = None,
    ) -> dict[str, EntMTPConfig]:
        """The static tree (alone, and with retrieval branches: :data:`RETRIEVAL_RUNS`),
        hysteresis over each pair of T-, EntMTP* and T+ (label ``hysteresis:{feature}:{tau}:{i}-{j}``,
        indices into ``labels``), the ladder, and the value policy over :func:`value_sets`
        (weighed by ``costs``, c(N) relative to one token; equal costs without them). The
        hysteresis and ladder runs use ``retrieval`` (the bank's retrieval default; off without it)."""
        runs = {"static": self._tree_config(trees[labels[choice.static]])}
        switch = {"retrieval": retrieval or False}
        for label, branch in RETRIEVAL_RUNS.items() if self.cfg.retrieval else ():
            runs[label] = self._tree_config(trees[labels[choice.static]], retrieval=branch)
        pairs = [(a, b) for k, a in enumerate(choice.ladder) for b in choice.ladder[k + 1 :]]
        for f in self.cfg.features:
            for lo, hi in pairs:
                # accept_ema under T- never exceeds T-'s depth + 1: scale its grid to that, not the heads' depth
                low_depth = max(trees[labels[lo]].depth, 1)
                for tau in (threshold(f, t, low_depth) for t in self.cfg.tau_grid):
                    runs[f"hysteresis:{f}:{tau:g}:{lo}-{hi}"] = self._tree_config(
                        None,
                        trees=[trees[labels[lo]].choices, trees[labels[hi]].choices],
                        policy="hysteresis",
                        tau_on=tau,
                        tau_off=tau,
                        feature=f,
                        **switch,
                    )
        ladder = [trees[labels[i]] for i in choice.ladder]
        grid = sorted(set(self.cfg.tau_grid))
        cuts = [grid[i : i + len(ladder) - 1] for i in range(len(grid) - len(ladder) + 2)] if len(ladder) > 2 else []
        # accept_ema on a ladder never exceeds its deepest tree's depth + 1: a grid scaled to the heads' depth
        # (deeper than the ladder's trees) would put thresholds nothing reaches, which the config refuses
        deepest = max((t.depth for t in ladder), default=1)
        for f in self.cfg.features if self.cfg.ladder else ():
            for th in ([threshold(f, t, deepest) for t in cut] for cut in cuts):
                runs[f"ladder:{f}:{','.join(f'{t:g}' for t in th)}"] = self._tree_config(
                    None, trees=[t.choices for t in ladder], policy="ladder", thresholds=list(th), feature=f, **switch
                )
        for label, members in value_sets(trees, choice, labels).items():
            runs[label] = self._tree_config(
                None, trees=[t.choices for t in members], policy="value", costs=value_costs(members, costs)
            )
        return runs

    def confirm(self, runs: dict[str, EntMTPConfig], label: str) -> dict:
        """The sweep's best scheduler against the static tree again, on calibration prompts the
        sweep did not see (up to :data:`CONFIRM_PROMPTS`): the best of many tries on 3 prompts
        is biased upwards, a fresh sample is not. Empty when no prompt is left over."""
        seen = set(self.timing_indices()[: self.cfg.sweep_prompts])
        prompts = [i for i in range(len(self.prompts)) if i not in seen][:CONFIRM_PROMPTS]
        if not prompts:
            return {}
        t0 = time.perf_counter()
        out, measured = self._interleaved(
            "confirm", {"static": runs["static"], label: runs[label]}, prompts, self.sweep_measure
        )
        if measured:
            self._timed("confirm", t0)
        return out

    def replayable(self, runs: dict[str, EntMTPConfig]) -> set[str]:
        """The hysteresis and ladder runs scored by :func:`~.replay.replay` over every
        calibration prompt instead of timed on the sweep prompts: with greedy rank tuples and
        forward costs c(N) (the modelled ranking) their accept lengths and work are exact."""
        if self.cfg.scoring != "rank_tuple" or self.cfg.ranking != "modelled":
            return set()
        return {
            lab
            for lab, conf in runs.items()
            if lab.split(":")[0] in FEATURE_POLICIES and why_not_replayable(conf.resolve(self.heads.num_heads)) is None
        }

    def replay(self, runs: dict[str, EntMTPConfig], trajectories: Sequence[Trajectory]) -> dict[str, dict]:
        """Accept lengths and verified tree sizes of each run replayed over ``trajectories`` (pooled)."""
        out = {}
        for lab, conf in runs.items():
            plan = conf.resolve(self.heads.num_heads)
            reps = [replay(t, plan, conf.feature_window) for t in trajectories]
            out[lab] = {
                "accept_lengths": [a for r in reps for a in r.accept_lengths],
                "tree_sizes": [n for r in reps for n in r.tree_sizes],
            }
        return out

    # ---------------------------------------------------------------- everything
    def run(self, bank_dir: str | os.PathLike | None = None) -> SearchResult:
        """Run (or resume) every stage, then write the bank, plots and report."""
        trajectories = self.trajectories()
        points = self.frontier(trajectories)
        rollouts = self.rollouts(points)
        costs = self.costs(points) if self.cfg.ranking == "modelled" else None
        result = summarise(
            self.task,
            self.cfg,
            trajectories,
            points,
            rollouts,
            timed=self.timed_indices(points),
            timing=self.timing_indices(),
            elapsed=self.elapsed,
            costs=costs,
        )
        if self.cfg.scoring == "rank_tuple" and costs is not None:
            result.with_headroom(trajectories)
        trees = {lab: row["tree"] for lab, row in result.timed.items()}
        runs = self.sweep_runs(trees, result.choice, result.labels, costs)
        replayed = self.replayable(runs)
        result.with_sweep(self.sweep({lab: conf for lab, conf in runs.items() if lab not in replayed}))
        if replayed:  # after the timed sweep: replayed with the retrieval default it chose
            retrieval = result.retrieval_default()
            again = self.sweep_runs(trees, result.choice, result.labels, costs, retrieval=retrieval)
            static = self._tree_config(trees[result.labels[result.choice.static]], retrieval=retrieval or False)
            result.with_replay(
                self.replay(
                    {"static": static, **{lab: c for lab, c in again.items() if lab in replayed}}, trajectories
                ),
                len(trajectories),
            )
        candidate = result.scheduler_candidate()
        if candidate is not None and not result.sweep[candidate].get("replayed"):
            result.with_confirmation(self.confirm(runs, candidate))
        result.elapsed = dict(self.elapsed)
        t0 = time.perf_counter()
        full = bool(self.stages_run) or not (self.dir / "report.md").is_file()
        info = {
            **self.info,
            "prompt_ids": self.prompt_ids,
            "timing_indices": self.timing_indices(),
            "heads_fingerprint": heads_fingerprint(self.heads),
        }
        write_outputs(
            self.dir, result, info, bank_dir, plots_and_report=full
        )  # nothing new: only the bank is rewritten
        if full:
            self._timed("outputs", t0)
        return result
