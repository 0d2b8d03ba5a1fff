"""``entmtp-hf calibrate``: a bank ranked for this machine in seconds, checked against the clock.

* The probe (:mod:`entmtp_hf.calibration.probe`) measures this machine's step costs for the model and
  heads once (seconds; cached), every task of the bank is re-ranked on them, and the machine's
  entry (costs and the scheduler they rank) is written into a local copy of the bank.
* ``--frontier`` first (re)builds each task's acceptance frontier from greedy runs on its
  calibration prompts (the search's first two stages; minutes per task, and the same on every
  machine), so a bank without one can be re-ranked; shallower frontiers (depth capped) join it,
  so a machine where depth is what costs can rank a fan against a chain.
* ``--check K`` times the ranking's best K trees and plain decoding end to end on the
  calibration prompts, interleaved: the modelled speed-ups against the measured ones, and
  whether the probe picked the fastest measured tree (or what it lost).

The bank's stored figures from the machine it was searched on are kept; the search machine's
costs are reconstructed from its timed runs (:func:`search_machine_costs`) so the report can
say whether the cost model ranks as that search measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ..banks.bank import TopologyBank, list_local_tasks
from ..calibration import batch_bucket
from ..calibration import calibrate as measure_costs
from ..config import EntMTPConfig
from ..costs.retrieval import RETRIEVAL_OPTIONS, retrieval_label
from ..costs.table import CostTable
from ..trees.tree import Tree
from .checkpoint import json_safe, write_json
from .machine import hardware_string, set_threads
from .search.config import SearchConfig
from .search.frontier import greedy_frontier, rank_tuple_scorer
from .search.replay import retrieval_figures
from .search.runner import TreeSearch
from .search.trajectories import simulate_canonical

# ============================================================================ the frontier
#: depth caps of the shallower frontiers a bank carries beside the full one. A drafter that
#: runs once per depth (the EAGLE-style one) pays for depth, so where a few more nodes cost
#: almost nothing (1-3 rows on a CPU's GEMV kernels) a fan can beat the full frontier's chain
#: of the same size; which one does is the cost table's call, so the bank keeps both.
DEPTH_CAPS = (1, 2, 3)
#: the largest tree of a depth-capped frontier (the trees where depth decides are small)
CAPPED_BUDGET = 32


def frontier_of(search: TreeSearch) -> tuple[list[Tree], list[float], list[dict], dict]:
    """The task's acceptance frontier from the search's first two stages, then the trees of the
    frontiers grown with the depth capped at :data:`DEPTH_CAPS` that the full one lacks: trees,
    debiased tokens per step (greedy steps simulated along the rank tuples, pooled over the
    prompts), the frontier's own (biased) estimate per tree, and how they were measured."""
    trajectories = search.trajectories()
    points = [(p, None) for p in search.frontier(trajectories)]
    caps = [c for c in DEPTH_CAPS if c < max(p.tree.depth for p, _ in points)]
    score, budget = rank_tuple_scorer(trajectories), min(search.cfg.budget, CAPPED_BUDGET)
    for cap in caps:
        points += [(p, cap) for p in greedy_frontier(score, budget, cap, search.max_rank)]
    trees, accept, info, seen = [], [], [], set()
    for p, cap in points:
        if p.tree in seen:
            continue
        seen.add(p.tree)
        lengths = [a for t in trajectories for a in simulate_canonical(t, p.tree)]
        trees.append(p.tree)
        accept.append(sum(lengths) / len(lengths))
        extra = {} if cap is None else {"name": f"frontier-{p.num_nodes}-depth{cap}", "max_depth": cap}
        replayed = {
            label: retrieval_figures(trajectories, p.tree, config, search.heads.num_heads).to_dict()
            for label, config in RETRIEVAL_OPTIONS.items()
        }
        info.append(
            {
                "biased_accept_length": p.accept,
                "source": "greedy acceptance frontier" + ("" if cap is None else f", depth <= {cap}"),
                "retrieval": replayed,
                **extra,
            }
        )
    source = {
        "source": f"rank tuples of greedy runs: {len(trajectories)} calibration prompts x "
        f"{search.cfg.max_new_tokens} tokens",
        "prompt_ids": search.prompt_ids,
        "depth_caps": caps,
        "retrieval": {k: dataclasses.asdict(c) for k, c in RETRIEVAL_OPTIONS.items()},
    }
    return trees, accept, info, source


# ============================================================================ the search machine
#: the model key of the search machine's reconstructed table: no probe measured it, so no model's key matches it
SEARCH_MODEL_KEY = "search"


def search_machine_costs(bank: TopologyBank) -> CostTable | None:
    """The search machine's step costs reconstructed from its timed runs stored in the bank: a
    plain token from its vanilla speed, ``F(N)`` from the relative forward costs, and drafting
    plus overhead fitted to each timed tree's measured step time. None if the bank lacks them."""
    meta, rows = bank.metadata, []
    vanilla = (meta.get("calibration") or {}).get("vanilla_tokens_per_s")
    for tree, info in zip(bank.trees, meta.get("trees") or []):
        # a frontier built after the search keeps the search's measured tokens per step aside
        measured = info.get("measured_accept_length", info.get("mean_accept_length"))
        if measured is not None and all(k in info for k in ("tokens_per_s", "relative_forward_cost")):
            rows.append((tree, {**info, "measured_accept_length": measured}))
    if not vanilla or len(rows) < 3:
        return None
    plain = 1e3 / vanilla
    forward = {t.num_nodes: plain * i["relative_forward_cost"] for t, i in rows}
    forward.setdefault(1, plain)
    x = torch.tensor([[1.0, t.depth, t.num_nodes - 1] for t, _ in rows], dtype=torch.float64)
    extra = [1e3 * i["measured_accept_length"] / i["tokens_per_s"] - forward[t.num_nodes] for t, i in rows]
    coef = torch.linalg.lstsq(x, torch.tensor(extra, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    fingerprint = {"key": "search-machine", "processor": meta.get("hardware", "the search machine")}
    return CostTable(
        fingerprint,
        SEARCH_MODEL_KEY,
        forward,
        (coef[0], coef[1], coef[2]),
        (0.0, 0.0),
        plain,
        notes={"reconstructed": "from the search's timed runs stored in the bank"},
    )


# ============================================================================ against the clock
def check_against_clock(
    model,
    bank: TopologyBank,
    table: CostTable,
    prompts: Sequence[torch.Tensor | tuple],
    top: int,
    max_new_tokens: int = 64,
) -> dict[str, Any]:
    """Time the ranking's best ``top`` trees and plain decoding on ``prompts``, interleaved. A prompt
    is ids [1, L], or ``(ids, attention_mask)`` of a left-padded batch (then ``table`` is that batch
    size's and the figures are total tokens/s)."""
    ranking = bank.ranking(table)
    best = sorted(ranking.speedups, key=ranking.speedups.get, reverse=True)[:top]
    labels = ["plain", *(f"tree {k}" for k in best)]
    configs = {
        "plain": None,
        **{
            f"tree {k}": EntMTPConfig(tree=bank.trees[k].choices, retrieval=ranking.retrieval.get(k) or False)
            for k in best
        },
    }
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    times: dict[str, list[float]] = {lab: [] for lab in labels}
    for i, prompt in enumerate(tqdm(prompts, desc=f"check {bank.task}", unit="prompt")):
        ids, mask = prompt if isinstance(prompt, tuple) else (prompt, None)
        masked = {"attention_mask": mask} if mask is not None else {}
        for lab in labels[i % len(labels) :] + labels[: i % len(labels)]:  # rotate who goes first
            extra = {"entmtp_config": configs[lab]} if configs[lab] is not None else {}
            t0 = time.perf_counter()
            out = model.generate(ids, **greedy, **masked, **extra)
            times[lab].append(ids.shape[0] * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
    measured = {k: statistics.median(a / b for a, b in zip(times[f"tree {k}"], times["plain"])) for k in best}
    fastest = max(measured, key=measured.get)
    chosen = best[0]
    return {
        "trees": {
            k: {"num_nodes": bank.trees[k].num_nodes, "modelled": ranking.speedups[k], "measured": measured[k]}
            for k in best
        },
        "chosen": chosen,
        "fastest_measured": fastest,
        "same_tree": chosen == fastest,
        "ratio_lost": measured[fastest] / measured[chosen],
        "prompts": len(prompts),
    }


# ============================================================================ report
def _task_lines(bank: TopologyBank, table: CostTable, top: int = 6) -> list[str]:
    ranking = bank.ranking(table)
    chosen = bank.scheduler_for(table)
    static = bank.trees[chosen.static]
    verdict = (
        "plain decoding (no tree beats it here)"
        if static.num_nodes == 1
        else f"tree {chosen.static}: {static.num_nodes} nodes, depth {static.depth}, retrieval "
        f"{retrieval_label(chosen.retrieval)}, modelled {ranking.speedups[chosen.static]:.2f}x plain"
    )
    batch = f", batch size {table.batch_size}" if table.batch_size > 1 else ""
    lines = [
        f"### Task `{bank.task}`{batch}",
        "",
        f"EntMTP* here: {verdict}.",
        "",
        "| tree | nodes | depth | tokens/step | step ms | retrieval | modelled speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in sorted(ranking.speedups, key=ranking.speedups.get, reverse=True)[:top]:
        t = bank.trees[k]
        lines.append(
            f"| {k} | {t.num_nodes} | {t.depth} | {bank.frontier[k]:.2f} | {table.step(t):.1f} | "
            f"{retrieval_label(ranking.retrieval.get(k))} | {ranking.speedups[k]:.2f}x |"
        )
    search = search_machine_costs(bank) if table.batch_size == 1 else None
    if search is not None:
        theirs = bank.ranking(search)
        stored = bank.scheduler.static
        picked = "plain decoding (no tree by 5%)" if theirs.static is None else f"tree {theirs.static}"
        agree = "the same tree" if theirs.static == stored else f"{picked} instead of tree {stored}"
        lines += [
            "",
            f"On the search machine's figures ({search.fingerprint['processor']}) the cost model picks "
            f"{agree}, which that search chose by timing every frontier tree.",
        ]
    return lines + [""]


def _check_lines(check: dict[str, Any]) -> list[str]:
    lines = [
        f"Against the clock ({check['prompts']} calibration prompts, interleaved, median of per-prompt ratios):",
        "",
        "| tree | nodes | modelled | measured |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {r['num_nodes']} | {r['modelled']:.2f}x | {r['measured']:.2f}x |" for k, r in check["trees"].items()
    ]
    same = (
        "the fastest measured tree"
        if check["same_tree"]
        else (
            f"tree {check['chosen']}, not the fastest measured (tree {check['fastest_measured']}): "
            f"{check['ratio_lost']:.3f}x lost"
        )
    )
    return lines + ["", f"The probe picked {same}.", ""]


def timed_choice(bank: TopologyBank, table: CostTable, check: dict[str, Any]) -> TopologyBank:
    """``bank`` with ``table``'s machine entry whose EntMTP* is the tree the clock found fastest
    (plain decoding, when no timed tree beat it): the accurate path, per batch size."""
    ranked = bank.with_machine(table).scheduler_for(table)
    fastest = check["fastest_measured"]
    root = next((k for k, t in enumerate(bank.trees) if t.num_nodes == 1), None)
    static = root if check["trees"][fastest]["measured"] < 1.0 and root is not None else fastest
    return bank.with_machine(table, dataclasses.replace(ranked, static=static))


def time_batch_sizes(
    model,
    heads,
    tokenizer,
    bank_dirs: Sequence[Path],
    task: str,
    batch_sizes: Sequence[int],
    *,
    top: int = 4,
    prompts_per_size: int = 4,
    max_new_tokens: int = 64,
    prompt_source: str | None = None,
) -> dict[int, dict]:
    """For every batch size: this machine's costs there, the ranking's best ``top`` trees timed against
    plain batched decoding on batches of the task's calibration prompts, and the bank (in every
    folder of ``bank_dirs``) given that batch size's entry with the tree the clock chose.
    ``prompt_source``: where the calibration prompts come from (default: ``task``)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bank = TopologyBank.from_pretrained(bank_dirs[0], task=task)
    out = {}
    for b in batch_sizes:
        table = measure_costs(model, heads, batch_sizes=[b])[batch_bucket(b)]
        prompts, _ = _calibration_inputs(tokenizer, prompt_source or task, prompts_per_size * b)
        inputs = [torch.tensor([p]) for p in prompts] if b == 1 else _batches(prompts, b, pad)
        check = check_against_clock(model, bank, table, inputs, top, max_new_tokens)
        bank = timed_choice(bank, table, check)
        out[b] = {**check, "static": bank.scheduler_for(table).static}
    for folder in bank_dirs:
        bank.save_pretrained(folder)
    return out


def forward_cost_lines(tables: Sequence[CostTable]) -> list[str]:
    """c(N, B): the verification forward of B rows of N nodes over plain batched decoding's step."""
    sizes = sorted(set.intersection(*(set(t.forward_ms) for t in tables)))
    lines = [
        "c(N, B): a verification forward of B rows of N nodes each, over one step of plain batched "
        "decoding at B rows (its ms per step in the last column).",
        "",
        "| B | " + " | ".join(f"N={n}" for n in sizes) + " | plain ms/step |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for t in tables:
        cells = " | ".join(f"{t.forward_ms[n] / t.plain_ms:.2f}" for n in sizes)
        lines.append(f"| {t.batch_size} | {cells} | {t.plain_ms:.1f} |")
    return lines + [""]


def _batches(prompts: list[list[int]], b: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from .bench.batched import batch_inputs

    return [batch_inputs(prompts[i : i + b], pad, "cpu") for i in range(0, len(prompts) - b + 1, b)]


# ============================================================================ CLI
def _calibration_inputs(tokenizer, task: str, n: int) -> tuple[list[list[int]], list[str]]:
    from .data.tasks import calibration_prompts

    prompts = calibration_prompts(task, n)
    return [p.render(tokenizer) for p in prompts], [p.prompt_id for p in prompts]


def calibrate(
    args: argparse.Namespace, *, loaded: tuple[Any, Any] | None = None, searches: dict[str, TreeSearch] | None = None
) -> dict[str, Any]:
    """Load the model and heads, probe, (re)build frontiers if asked, rank, check, write.

    ``loaded``: ``(model, tokenizer)`` with the heads already enabled (``--model`` and ``--heads``
    are then not read); ``searches``: per task, the search whose checkpointed first two stages
    give the frontier (instead of new greedy runs in ``--work``)."""
    from ..demo import DEMO_HEADS
    from ..integration import HEADS_ATTR, enable_entmtp
    from .models import heads_source, load_base_model

    set_threads(args.threads)
    source, out = Path(args.bank), Path(args.out)
    tasks = args.tasks or list_local_tasks(source)
    if loaded is None:
        model, tokenizer = load_base_model(args.model, trust_remote_code=args.trust_remote_code)
        enable_entmtp(model, heads_source(args.heads, model, args.model) if args.heads else str(DEMO_HEADS))
    else:
        model, tokenizer = loaded
    heads = getattr(model, HEADS_ATTR)
    t0 = time.perf_counter()
    measured = measure_costs(model, heads, batch_sizes=args.batch_sizes, refresh=args.refresh)
    tables = [measured[b] for b in sorted({batch_bucket(b) for b in args.batch_sizes})]
    table = tables[0]
    probe_s = time.perf_counter() - t0
    report = {
        "machine": table.fingerprint,
        "hardware": hardware_string(),
        "probe_seconds": table.seconds,
        "lookup_seconds": probe_s,
        "tasks": {},
    }
    lines = [
        "# Calibration",
        "",
        f"Machine: {hardware_string()}; step costs measured in "
        f"{sum(t.seconds for t in tables):.1f} s (this run: {probe_s:.1f} s, from the cache if lower).",
        "",
    ]
    if len(tables) > 1 or table.batch_size > 1:
        lines += forward_cost_lines(tables)
        report["forward_cost"] = {t.batch_size: {"forward_ms": t.forward_ms, "plain_ms": t.plain_ms} for t in tables}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for task in tasks:
        bank = TopologyBank.from_pretrained(source, task=task)
        if args.frontier:
            searched = search_machine_costs(bank)  # read before the frontier moves the search's figures aside
            search = (searches or {}).get(task)
            if search is None:
                cfg = SearchConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, budget=args.budget)
                prompts, ids = _calibration_inputs(tokenizer, task, cfg.num_prompts)
                search = TreeSearch(model, heads, prompts, Path(args.work) / task, cfg, task=task, prompt_ids=ids)
            bank = bank.with_frontier(*frontier_of(search))
            if searched is not None:  # the search machine, with the trees that search chose by timing
                bank = bank.with_machine(searched, bank.scheduler)
        entries = {}
        for t in tables:
            bank = bank.with_machine(t)
            lines += _task_lines(bank, t)
            static = bank.scheduler_for(t).static
            entry = {
                "static": static,
                "num_nodes": bank.trees[static].num_nodes,
                "speedups": bank.machines[-1]["speedups"],
            }
            if args.check:
                prompts, _ = _calibration_inputs(tokenizer, task, args.check_prompts * t.batch_size)
                inputs = (
                    [torch.tensor([p]) for p in prompts] if t.batch_size == 1 else _batches(prompts, t.batch_size, pad)
                )
                entry["check"] = check_against_clock(model, bank, t, inputs, args.check)
                lines += _check_lines(entry["check"])
            entries[t.batch_size] = entry
        bank.save_pretrained(out)
        report["tasks"][task] = entries if len(tables) > 1 else entries[table.batch_size]
    (out / f"calibration-{table.fingerprint.get('key', 'machine')}.md").write_text("\n".join(lines), encoding="utf-8")
    write_json(out / f"calibration-{table.fingerprint.get('key', 'machine')}.json", json_safe(report))
    print("\n".join(lines))
    return report


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="rank a bank's trees for this machine (seconds) and write a local copy that carries the ranking",
        description="Measure this machine's step costs for the model and heads (cached), re-rank every task's "
        "acceptance frontier on them, and write the bank with this machine's entry to --out.",
    )
    p.add_argument("bank", help="bank folder (e.g. a shipped bank: entmtp_hf/banks/shipped/smollm2-135m-cpu)")
    p.add_argument("--tasks", nargs="+", default=None, help="tasks of the bank (default: all)")
    p.add_argument("--out", required=True, help="folder for the calibrated copy of the bank and the report")
    p.add_argument("--model", default=None, help="base model id or folder (default: the demo model)")
    p.add_argument(
        "--heads",
        default=None,
        help="heads folder or Hub id, or 'mtp' for the model's own MTP layers (default: the demo heads)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model class --model ships as code (a build-drafter --arch mtp folder, with --heads mtp)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (the costs are per thread count)")
    p.add_argument("--refresh", action="store_true", help="measure again even if this machine's costs are cached")
    p.add_argument("--frontier", action="store_true", help="(re)build each task's acceptance frontier first (minutes)")
    p.add_argument("--work", default="runs/calibrate", help="checkpoints of the frontier runs")
    p.add_argument("--num-prompts", type=int, default=16, help="calibration prompts of the frontier")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per frontier run")
    p.add_argument("--budget", type=int, default=64, help="largest frontier tree (nodes)")
    p.add_argument("--check", type=int, default=0, metavar="K", help="time the K best trees end to end")
    p.add_argument(
        "--check-prompts",
        type=int,
        default=6,
        help="calibration prompts the check times (batches of them at each batch size)",
    )
    p.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=[1],
        metavar="B",
        help="also probe c(N, B) and rank the frontier at these batch sizes (an entry per size)",
    )
    p.set_defaults(func=_run)


def calibrate_options(bank: str | Path, out: str | Path, **values: Any) -> argparse.Namespace:
    """The options of ``entmtp-hf calibrate BANK --out OUT`` with the command line's defaults,
    ``values`` (by attribute name, e.g. ``frontier=True``) set on them; an unknown name is refused."""
    parser = argparse.ArgumentParser(prog="entmtp-hf")
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["calibrate", str(bank), "--out", str(out)])
    unknown = sorted(set(values) - set(vars(args)))
    if unknown:
        raise ValueError(f"calibrate has no options {unknown}")
    for name, value in values.items():
        setattr(args, name, value)
    return args


def _run(args: argparse.Namespace) -> int:
    calibrate(args)
    return 0
