"""Tokens per step of any tree on held-out prompts, without timing anything.

Under greedy decoding the output does not depend on the tree, and neither does the rank of
each true next token under each head: one teacher-forced pass over prompt + output gives
them (:func:`~entmtp_hf.tools.search.trajectories.rank_tuples`), and walking them the way the
decoder walks (:func:`~entmtp_hf.tools.search.trajectories.simulate_canonical`) gives every
tree's accept lengths exactly, up to floating-point ties. So one greedy benchmark run (its
vanilla outputs) is enough to report τ for ``mc_sim_7b_63``, every tree of a bank, or any
other tree, on the same prompts per task; the measured τ of the tree methods that ran checks
the simulation.

``entmtp-hf acceptance RESULTS.json`` writes ``acceptance.json`` and ``acceptance.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ..trees.tree import MC_SIM_7B_63, Tree
from .search.trajectories import Trajectory, rank_tuples, simulate_canonical


def trajectories(
    model, heads, results: dict, task: str, method: str = "vanilla", progress: bool = False
) -> list[Trajectory]:
    """One trajectory per prompt of ``task``: prompt + the greedy output ``method`` produced
    (``progress``: a bar over the prompts)."""
    prompts = results["prompts"][task]
    records = sorted(
        (r for r in results["records"] if r["task"] == task and r["method"] == method), key=lambda r: r["prompt_index"]
    )
    if not records:
        raise ValueError(f"the results hold no {method!r} records for task {task!r}")
    if results["settings"]["mode"] != "greedy":
        raise ValueError("accept lengths can be simulated from greedy runs only")
    out = []
    depth, rank_cap = heads.num_heads, heads.config.draft_vocab_rows
    for r in tqdm(records, desc=f"rank tuples {task}", unit="prompt", disable=not progress):
        prompt = prompts[r["prompt_index"]]["input_ids"]
        tokens = list(prompt) + list(r["output_ids"])
        with torch.no_grad():
            tuples = rank_tuples(model, heads, tokens, len(prompt), depth, rank_cap)
        out.append(Trajectory(prompt_len=len(prompt), tokens=tokens, tuples=tuples))
    return out


def mean_accept(trajs: Sequence[Trajectory], tree: Tree) -> float:
    """Tokens per step pooled over every step of every trajectory."""
    lengths = [a for t in trajs for a in simulate_canonical(t, tree)]
    return sum(lengths) / len(lengths) if lengths else float("nan")


def measured_accept(results: dict, task: str, method: str) -> float | None:
    """Pooled tokens per step of a tree method's records (None if it did not run)."""
    lengths = [
        a
        for r in results["records"]
        if r["task"] == task and r["method"] == method
        for a in (r.get("accept_lengths") or [])
    ]
    return sum(lengths) / len(lengths) if lengths else None


def acceptance_table(
    model, heads, results: dict, trees: dict[str, dict[str, Tree]], progress: bool = False
) -> dict[str, Any]:
    """τ per task for the named trees; ``trees[task]`` maps a label to a tree."""
    table: dict[str, Any] = {}
    for task, named in trees.items():
        trajs = trajectories(model, heads, results, task, progress=progress)
        table[task] = {
            "prompts": len(trajs),
            "tau": {label: {"num_nodes": t.num_nodes, "tau": mean_accept(trajs, t)} for label, t in named.items()},
            "measured_hydra_default": measured_accept(results, task, "hydra-default"),
        }
    return table


def markdown(table: dict[str, Any]) -> str:
    labels = list(dict.fromkeys(label for row in table.values() for label in row["tau"]))
    tasks = list(table)
    lines = [f"| tree | nodes | {' | '.join(tasks)} | mean |", "|---|---|" + "---|" * (len(tasks) + 1)]
    for label in labels:
        cells = [table[t]["tau"].get(label) for t in tasks]
        nodes = next(c["num_nodes"] for c in cells if c)
        vals = [c["tau"] if c else float("nan") for c in cells]
        lines.append(
            f"| {label} | {nodes} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |"
        )
    measured = [table[t]["measured_hydra_default"] for t in tasks]
    if all(m is not None for m in measured):
        lines.append(
            "| mc_sim_7b_63 measured by the run (`hydra-default`) | 64 | "
            + " | ".join(f"{m:.2f}" for m in measured)
            + f" | {sum(measured) / len(measured):.2f} |"
        )
    return "\n".join(lines) + "\n"


def _acceptance(args: argparse.Namespace) -> int:
    from ..banks.bank import TopologyBank
    from ..demo.run import load_demo
    from .bench.results import read_results
    from .machine import set_threads

    set_threads(args.threads)
    results = read_results(args.results)
    model, _, demo_banks = load_demo(args.heads)
    heads = model.entmtp_heads
    bank_dir = Path(args.bank) if args.bank else demo_banks
    banked = set(TopologyBank.list_tasks(bank_dir))
    trees: dict[str, dict[str, Tree]] = {}
    for task in args.tasks or list(results["prompts"]):
        named = {"mc_sim_7b_63": Tree.from_choices(MC_SIM_7B_63)}
        if task in banked:
            bank = TopologyBank.from_pretrained(bank_dir, task=task)
            for i, t in enumerate(bank.trees):
                named[f"bank tree {i}"] = t
        trees[task] = named
    table = acceptance_table(model, heads, results, trees, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    md = markdown(table)
    (out / "acceptance.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf acceptance``."""
    p = sub.add_parser(
        "acceptance",
        help="tokens per step of mc_sim_7b_63 and every bank tree on a greedy benchmark run's outputs",
        description="Simulate greedy tree decoding exactly on the vanilla outputs of RESULTS.json (one teacher-"
        "forced pass per prompt) and report the mean accept length per task and tree.",
    )
    p.add_argument("results", help="results.json of a greedy `entmtp-hf bench` run with the vanilla method")
    p.add_argument("--tasks", nargs="+", default=None)
    p.add_argument("--bank", default=None, help="bank folder (default: the demo model's shipped banks)")
    p.add_argument("--heads", default=None, help="heads folder (default: the demo model's shipped heads)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/acceptance")
    p.set_defaults(func=_acceptance)
