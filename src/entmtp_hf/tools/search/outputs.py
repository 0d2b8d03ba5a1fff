"""What a search leaves in its work folder: the bank (with every calibration figure), the
plots, ``report.md`` and ``result.json``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...banks.bank import TopologyBank
from ...costs.table import CostTable, interpolate
from ..checkpoint import json_safe, write_json
from ..machine import hardware_string, versions
from .plots import PLOTS, plot_acceptance, plot_throughput
from .report import report_markdown
from .result import SearchResult, finite, nodes_text


def build_bank(result: SearchResult, info: dict[str, Any]) -> TopologyBank:
    """The task's bank: the timed frontier trees (its acceptance frontier) and the value policy's
    other shapes, smallest first, with every calibration figure."""
    trees, at = result.bank_trees()
    per_tree: list[dict] = [{} for _ in trees]
    for k, tree in enumerate(trees):
        if k not in at:
            cost = interpolate(result.costs, tree.num_nodes) if result.costs else None
            per_tree[k] = {
                "num_nodes": tree.num_nodes,
                "name": f"fan-{tree.num_nodes}",
                "source": "value policy: same size, depth 1",
                **({"relative_forward_cost": cost} if finite(cost) else {}),
            }
    for i, lab in enumerate(result.labels):
        row = result.timed[lab]
        figures = {
            "mean_accept_length": row["unbiased"],
            "biased_accept_length": row["biased"],
            "simulated_accept_length": row["simulated"],
            "tokens_per_s": row["tokens_per_s"],
            "speedup_vs_plain": row["speedup"],
            "tokens_per_forward": row.get("modelled"),
            "relative_forward_cost": (result.costs or {}).get(row["num_nodes"]),
        }
        per_tree[at[i]] = {
            "num_nodes": row["num_nodes"],
            "name": lab,
            "source": "greedy acceptance frontier",
            **{k: v for k, v in figures.items() if finite(v)},
        }
    metadata = {
        **{k: info[k] for k in ("base_model", "heads") if info.get(k)},
        "hardware": hardware_string(),
        "created_by": "entmtp_hf.tools.search",
        "description": f"Per-task bank from the offline tree search (task {result.task}); EntMTP* = tree "
        f"{at[result.choice.static]} ({nodes_text(result.timed[result.labels[result.choice.static]]['num_nodes'])}).",
        "trees": per_tree,
        # the timed frontier trees with their measured tokens per step: what a probe on another
        # machine re-ranks (``calibrate --frontier`` replaces it with every size up to the budget)
        "frontier": {
            "trees": list(at),
            "source": f"the search's timed frontier trees: tokens per step of "
            f"generate on {len(info.get('timing_indices', []))} calibration prompts",
        },
        "scheduler": result.scheduler_defaults(),
        "calibration": {
            "settings": result.settings,
            "prompt_ids": info.get("prompt_ids", []),
            "heads_fingerprint": info.get("heads_fingerprint"),
            "vanilla_tokens_per_s": result.vanilla_tokens_per_s if finite(result.vanilla_tokens_per_s) else None,
            "reference_mc_sim_7b_63": result.reference,
            "sweep": {k: {kk: vv for kk, vv in v.items() if finite(vv)} for k, v in result.sweep.items()},
            "held_out_confirmation": result.confirmation or None,
            "ranking_changed": result.ranking_changed,
            "ranking_changed_simulated": result.ranking_changed_simulated,
            "ranked_by": "modelled tokens per one-token forward" if result.costs is not None else "measured tokens/s",
            "timed_prompt_ids": [info.get("prompt_ids", [])[i] for i in info.get("timing_indices", [])],
            "stage_seconds": {k: round(v, 1) for k, v in result.elapsed.items()},
            "versions": versions(),
        },
    }
    return TopologyBank(result.task, trees, json_safe(metadata))


def write_outputs(
    work_dir: str | os.PathLike,
    result: SearchResult,
    info: dict[str, Any],
    bank_dir: str | os.PathLike | None = None,
    plots_and_report: bool = True,
) -> TopologyBank:
    """``bank/<task>.safetensors`` (+ card) in ``work_dir`` (and ``bank_dir``), then unless
    ``plots_and_report`` is off the plots, ``report.md`` and ``result.json``. ``info``: the
    base model, heads, prompt ids, timed prompt indices and heads fingerprint the bank records."""
    work_dir = Path(work_dir)
    bank = build_bank(result, info)
    bank.save_pretrained(work_dir / "bank")
    if bank_dir is not None:
        bank.save_pretrained(bank_dir)
    if not plots_and_report:
        return bank
    plot_acceptance(result, work_dir / PLOTS[0])
    plot_throughput(result, work_dir / PLOTS[1])
    (work_dir / "report.md").write_text(report_markdown(result, info), encoding="utf-8")
    write_json(work_dir / "result.json", json_safe(result.to_dict()))
    return bank


def file_search_machine(bank_dirs: list[Path], task: str, table: CostTable) -> None:
    """Give the task's bank in every folder an entry for the machine the search ran on (``table``,
    its probed costs) with the trees the search chose by timing: there the bank keeps the
    search's choice; on any other machine the probe re-ranks its timed frontier."""
    for folder in bank_dirs:
        bank = TopologyBank.from_pretrained(folder, task=task)
        bank.with_machine(table, bank.scheduler).save_pretrained(folder)
