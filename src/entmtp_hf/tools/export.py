"""``entmtp-hf export``: a bank's tree as the settings of TensorRT-LLM, vLLM or SGLang.

An engine takes one fixed tree (TensorRT-LLM), a chain (vLLM, which verifies drafts as a chain
whatever tree it drafted) or only a budget (SGLang), and each has rules on the tree's shape. The
export takes the bank's EntMTP* tree (``bank.scheduler.static``, or a stored machine entry's),
projects it onto the largest subtree (or chain) the engine takes, says which
nodes that dropped and what it costs in tokens per step by the bank's acceptance frontier, and
prints the engine's own keyword arguments and command-line flags. Every rule names the engine
file it was read from; docs/export.md has the versions and the details.

No engine runs Hydra heads: the tree suits the engine's own drafter family (Medusa heads or an
EAGLE draft model), and the bank's tokens per step are those of the bank's heads.

The engines and their drafters are registered in :mod:`.export_engines`, the shape rules they
combine are :mod:`.export_shapes`; this module reads those tables only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path as FilePath
from typing import Any

from ..banks.bank import SHIPPED_DIR, SchedulerDefaults, TopologyBank, shipped_bank_path
from ..errors import EntMTPError
from ..trees.tree import Tree, canonical_order
from .checkpoint import write_json
from .export_engines import DRAFTERS, ENGINES, TARGETS, engine_config, engine_notes, snippet
from .export_shapes import Frontier, Rule, accept_bounds, within_depth


# ============================================================================ projection
def rules_for(target: tuple[str, str], max_depth: int | None, max_nodes: int | None, frontier: Frontier) -> list[Rule]:
    """The rules of ``target`` (engine, drafter variant) in the order they apply: the user's depth cap
    where given, then the target's own (its shape rules and the node cap)."""
    depth = [Rule(f"at most {max_depth} levels (--max-depth)", lambda s: within_depth(s, max_depth))]
    return [*(depth if max_depth else []), *TARGETS[target].shape(frontier, max_nodes)]


def project(tree: Tree, rules: list[Rule]) -> tuple[Tree, list[dict[str, Any]]]:
    """The tree after every rule, and what each rule dropped."""
    paths, steps = frozenset(tree.paths), []
    for rule in rules:
        kept = rule.project(paths)
        steps.append({"rule": rule.text, "dropped": [list(p) for p in canonical_order(paths - kept)]})
        paths = kept
    return Tree.from_choices(canonical_order(paths)), steps


# ============================================================================ tokens per step
def frontier_of(bank: TopologyBank) -> Frontier:
    """The bank's acceptance frontier as (node set, debiased tokens per step) pairs."""
    return [(frozenset(bank.trees[k].paths), value) for k, value in bank.frontier.items()]


def tokens_per_step(source: Tree, exported: Tree, frontier: Frontier, dynamic: bool) -> dict[str, Any]:
    """The source tree's tokens per step, the exported tree's bounds, and the loss between them."""
    if not frontier:
        return {"estimate": "the bank carries no acceptance frontier: no modelled tokens per step"}
    src_lo, src_hi = accept_bounds(frozenset(source.paths), frontier)
    out = {"source": src_lo if src_lo == src_hi else None, "source_bounds": [src_lo, src_hi]}
    if dynamic:
        return {**out, "estimate": "the engine picks its tree each step from the drafter's scores: not modelled"}
    lo, hi = accept_bounds(frozenset(exported.paths), frontier)
    lost = [None if None in (src_lo, hi) else max(src_lo - hi, 0.0), None if None in (src_hi, lo) else src_hi - lo]
    return {
        **out,
        "exported_bounds": [lo, hi],
        "lost_bounds": lost,
        "estimate": "frontier bounds: the largest frontier tree inside the tree (lower) and the smallest "
        "one around it (upper)",
    }


# ============================================================================ the export
def pick_tree(scheduler: SchedulerDefaults, which: str, num_trees: int) -> int:
    """The bank tree to export: static (EntMTP*), the hysteresis pair's conservative/aggressive, or an index."""
    if which in ("static", "conservative", "aggressive"):
        return getattr(scheduler, which)
    if not which.isdigit() or int(which) >= num_trees:
        raise ValueError(
            f"--tree must be static, conservative, aggressive or an index below {num_trees}, got {which!r}"
        )
    return int(which)


def machine_scheduler(bank: TopologyBank, machine: str | None, batch_size: int = 1) -> SchedulerDefaults:
    """The stored scheduler, or that of the bank's machine entry at ``batch_size`` whose fingerprint
    key is ``machine`` or whose processor name contains it (the entry a calibration on that machine
    stored; an entry's full key, with its ``-b<B>``, picks that entry whatever the batch size)."""
    if machine is None:
        return bank.scheduler
    tables = bank.machine_tables()

    def named(t) -> bool:
        return machine == t.fingerprint.get("key") or machine.lower() in str(t.fingerprint.get("processor", "")).lower()

    found = [t for t in tables if t.key == machine] or [t for t in tables if t.batch_size == batch_size and named(t)]
    if len(found) != 1:
        known = [f"{t.key} ({t.fingerprint.get('processor')}, batch size {t.batch_size})" for t in tables]
        raise ValueError(
            f"--machine {machine!r} matches {len(found)} of the bank's machine entries at batch size "
            f"{batch_size}: {known}"
        )
    return bank.scheduler_for(found[0])


def scheduler_note(bank: TopologyBank, scheduler: SchedulerDefaults, exported: int) -> dict[str, Any]:
    """What the bank's scheduler would have switched between, which an engine with one tree does not."""

    def tree(k: int) -> dict[str, Any]:
        t = bank.trees[k]
        return {"index": k, "num_nodes": t.num_nodes, "depth": t.depth, "tokens_per_step": bank.frontier.get(k)}

    s = scheduler
    switched = {
        "static": f"the static tree {s.static}",
        "hysteresis": f"trees {s.conservative} and {s.aggressive} "
        f"(T-/T+) on {s.feature} at tau_on {s.tau_on:g} / tau_off {s.tau_off:g}",
        "ladder": f"the ladder {list(s.ladder)} on {s.ladder_feature}",
        "value": f"the value policy's trees {list(s.value)}",
    }.get(s.policy, f"the {s.policy} policy")
    text = (
        f"The bank's default policy is {s.policy}: in generate it runs {switched}. An engine runs one tree "
        f"(SGLang: one budget) for every step: tree {exported} is exported."
    )
    return {
        "policy": s.policy,
        "static": tree(s.static),
        "conservative": tree(s.conservative),
        "aggressive": tree(s.aggressive),
        "tau_on": s.tau_on,
        "tau_off": s.tau_off,
        "feature": s.feature,
        "text": text,
    }


def batch_note(batch_size: int, machine: str | None) -> str:
    """Which batch size the exported tree was chosen for: a machine entry's, or the stored batch-1 choice."""
    if machine is not None:
        return f"ranked with the machine entry's step costs at batch size {batch_size}"
    note = "the bank's stored (batch-1) choice"
    return (
        note
        if batch_size == 1
        else (
            f"{note}, not ranked for batch size {batch_size}: pass --machine with an "
            "entry calibrated at that size (entmtp-hf calibrate --batch-sizes)"
        )
    )


def export(
    bank: TopologyBank,
    engine: str,
    drafter: str | None = None,
    *,
    tree: str = "static",
    machine: str | None = None,
    max_depth: int | None = None,
    max_nodes: int | None = None,
    batch_size: int = 1,
    vllm_tree: bool = False,
) -> dict[str, Any]:
    """The export of one bank task to one engine, as the JSON the CLI writes (``vllm_tree``: vLLM's
    branching ``speculative_token_tree`` instead of the chain it verifies)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    drafter = drafter or DRAFTERS[engine][0]
    if drafter not in DRAFTERS[engine]:
        raise ValueError(f"{engine} runs a tree with drafters {DRAFTERS[engine]}, not {drafter!r}")
    branching = TARGETS[(engine, drafter)].branching
    if vllm_tree and branching is None:
        raise ValueError(f"--vllm-tree is vLLM's EAGLE speculative_token_tree, not {engine} with {drafter}")
    target = (engine, branching.drafter if vllm_tree else drafter)
    scheduler = machine_scheduler(bank, machine, batch_size)
    index = pick_tree(scheduler, tree, len(bank))
    source, frontier = bank.trees[index], frontier_of(bank)
    exported, steps = project(source, rules_for(target, max_depth, max_nodes, frontier))
    config, options = engine_config(target, exported)
    return {
        "engine": engine,
        "drafter": drafter,
        "vllm_tree": vllm_tree,
        "task": bank.task,
        "source_tree": {"index": index, "num_nodes": source.num_nodes, "depth": source.depth, "tree": source.choices},
        "tree": exported.choices,
        "config": config,
        "engine_options": options,
        "dropped": [p for step in steps for p in step["dropped"]],
        "projection": steps,
        "tokens_per_step": tokens_per_step(source, exported, frontier, dynamic=ENGINES[engine].picks_tree),
        "scheduler": scheduler_note(bank, scheduler, index),
        "machine": machine,
        "batch_size": batch_size,
        "batch_note": batch_note(batch_size, machine),
        "notes": engine_notes(target, exported),
        "sources": list(TARGETS[target].sources),
    }


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


def report_lines(result: dict[str, Any]) -> list[str]:
    """The export's report as comment lines above the snippet."""
    src, tps = result["source_tree"], result["tokens_per_step"]
    lines = [
        f"# entmtp-hf export: task {result['task']} -> {result['engine']} ({result['drafter']} drafter)",
        f"# bank tree {src['index']}: {src['num_nodes']} nodes, depth {src['depth']}; exported: "
        f"{len(result['tree']) + 1} nodes",
    ]
    lines += [f"# dropped ({step['rule']}): {step['dropped']}" for step in result["projection"] if step["dropped"]]
    if "source_bounds" not in tps:
        lines.append(f"# tokens per step: {tps['estimate']}")
    elif "exported_bounds" in tps and not result["dropped"]:
        lines.append(f"# tokens per step: {_number(tps['source'])}, the bank tree's: nothing dropped")
    elif "exported_bounds" in tps:
        (lo, hi), (lost_lo, lost_hi) = tps["exported_bounds"], tps["lost_bounds"]
        lines.append(
            f"# tokens per step: bank tree {_number(tps['source'])}; exported {_number(lo)}..{_number(hi)}; "
            f"lost {_number(lost_lo)}..{_number(lost_hi)} ({tps['estimate']})"
        )
    else:
        lines.append(f"# tokens per step: bank tree {_number(tps.get('source'))} ({tps['estimate']})")
    lines += [f"# {result['scheduler']['text']}", f"# batch size {result['batch_size']}: {result['batch_note']}"]
    return lines + [f"# note: {n}" for n in result["notes"]]


# ============================================================================ CLI
def bank_source(name: str) -> str | FilePath:
    """A folder, a shipped bank's name (``smollm2-135m-cpu``) or a Hub repo id, in that order."""
    if FilePath(name).is_dir() or not (SHIPPED_DIR / name).is_dir():
        return name
    return shipped_bank_path(name)


def _write_out(out: str, result: dict[str, Any]) -> FilePath:
    """The export as JSON in ``out``; a path that cannot be written is refused in one line."""
    try:
        return write_json(out, result)
    except OSError as e:
        raise EntMTPError(f"--out {out}: cannot write the export there ({e.strerror or e})") from None


def _run(args: argparse.Namespace) -> int:
    if args.out and os.path.isdir(args.out):  # refused before any work, like any bad argument
        raise EntMTPError(f"--out {args.out} is a folder; give the path of the JSON file to write")
    bank = TopologyBank.from_pretrained(bank_source(args.bank), task=args.task, revision=args.revision)
    result = export(
        bank,
        args.to,
        args.drafter,
        tree=args.tree,
        machine=args.machine,
        max_depth=args.max_depth,
        max_nodes=args.max_nodes,
        batch_size=args.batch_size,
        vllm_tree=args.vllm_tree,
    )
    result["bank"], result["revision"] = args.bank, args.revision
    print("\n".join(report_lines(result)) + "\n")
    print(snippet(result["engine"], result["config"], result["engine_options"]), end="")
    if args.out:
        print(f"# wrote {_write_out(args.out, result)}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _drafters_help(engine: str) -> str:
    first, *others = DRAFTERS[engine]
    return f"{engine}: " + " or ".join([f"{first} (default)", *others] if others else [first])


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a bank's tree as TensorRT-LLM, vLLM or SGLang speculative-decoding settings",
        description="Project a bank task's EntMTP* tree onto what the engine accepts, report the dropped nodes and "
        "the modelled tokens per step lost, and print the engine's keyword arguments and flags.",
    )
    p.add_argument("bank", help="bank folder, shipped bank name (smollm2-135m-cpu, published-defaults) or Hub repo id")
    p.add_argument("--task", required=True, help="task of the bank")
    p.add_argument("--to", required=True, choices=sorted(ENGINES), help="the engine")
    p.add_argument("--drafter", default=None, help="; ".join(map(_drafters_help, DRAFTERS)))
    p.add_argument("--tree", default="static", help="static (EntMTP*, default), conservative, aggressive or an index")
    p.add_argument("--machine", default=None, help="use this stored machine entry's scheduler (key or processor name)")
    p.add_argument("--max-depth", type=_positive, default=None, help="deepest level the drafter drafts (e.g. heads)")
    p.add_argument("--max-nodes", type=_positive, default=None, help="most drafted nodes the engine takes")
    p.add_argument("--batch-size", type=_positive, default=1, help="serving batch size (banks are batch-1 today)")
    p.add_argument(
        "--vllm-tree",
        action="store_true",
        help="vLLM: write a branching speculative_token_tree (TREE_ATTN; releases between vllm#20401 and "
        "#42121, e.g. 0.18.0) instead of the chain; vLLM still verifies it as a chain",
    )
    p.add_argument("--revision", default=None, help="Hub revision of BANK")
    p.add_argument("--out", default=None, help="also write the export as JSON to this file")
    p.set_defaults(func=_run)
