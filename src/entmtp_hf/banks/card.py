"""The model card (``README.md``) of a bank folder, regenerated on every save.

It reads every bank file of the folder through the same bounded reader as loading, so an
unreadable neighbour becomes one line of the card instead of failing the save. Per task it
shows the trees with their figures, the scheduler defaults and the speed-ups: measured on the
machine the bank was searched on, and modelled on every machine the bank carries costs for.
"""

from __future__ import annotations

from pathlib import Path

from ..costs.retrieval import retrieval_label
from ..trees.retrieval import RetrievalConfig
from .format import (
    FIGURES,
    SUFFIX,
    TEXT_KEYS,
    BankContents,
    BankFormatError,
    SchedulerDefaults,
    list_local_tasks,
    load_bank_contents,
)

CARD_NAME = "README.md"
#: EntMTP*, the static policy's tree, written so that Markdown does not read the star as emphasis
STATIC = r"EntMTP\*"
_CARD_KEYS = (*TEXT_KEYS, "description")


def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _retrieval_text(config: RetrievalConfig | None) -> str:
    if config is None:
        return "none"
    return f"{config.mode}, up to {config.num_tokens} tokens after a {config.min_ngram}-{config.max_ngram}-token match"


def _scheduler_text(bank: BankContents) -> str:
    sched = bank.scheduler
    costs = [float(f"{c:.3g}") for c in sched.value_costs]
    value = f"value policy over trees {list(sched.value)} (relative costs {costs}); " if sched.value else ""
    return (
        f"Scheduler defaults: policy `{sched.policy}` (what runs when none is given); static tree {sched.static}; "
        f"hysteresis T− = tree {sched.conservative}, T+ = tree {sched.aggressive} on `{sched.feature}`, "
        f"τ_on = {sched.tau_on:g}, τ_off = {sched.tau_off:g}; ladder trees {list(sched.ladder)} on "
        f"`{sched.ladder_feature}` with thresholds {[float(f'{t:g}') for t in sched.thresholds]}; "
        f"{value}retrieval branches by default: {_retrieval_text(sched.retrieval)}."
    )


def _tree_text(bank: BankContents, k: int) -> str:
    tree = bank.trees[k]
    return "plain decoding (the root alone)" if tree.num_nodes == 1 else f"tree {k} ({tree.num_nodes} nodes)"


def _times(value: object) -> str:
    return f"×{value:.3g}" if isinstance(value, (int, float)) else "not recorded"


def _machine_name(fingerprint: dict) -> str:
    """A machine entry's fingerprint in words: processor, then device, threads, dtype, torch."""
    details = [str(fingerprint[k]) for k in ("device", "dtype") if k in fingerprint]
    if "threads" in fingerprint:
        details.insert(1, f"{fingerprint['threads']} threads")
    if "torch" in fingerprint:
        details.append(f"torch {fingerprint['torch']}")
    name = str(fingerprint.get("processor", "unknown machine"))
    return f"{name} ({', '.join(details)})" if details else name


def _machine_rows(bank: BankContents) -> list[list[str]]:
    rows = []
    for entry in bank.metadata.get("machines", []):
        scheduler = SchedulerDefaults.from_metadata(entry["scheduler"], len(bank.trees))
        costs, chosen = entry["costs"], scheduler.static
        speedups = entry.get("speedups", {})
        best = max(speedups, key=speedups.get, default=None)
        reconstructed = (
            " (costs reconstructed from the search's timed runs)"
            if (costs.get("notes") or {}).get("reconstructed")
            else ""
        )
        modelled = 1.0 if bank.trees[chosen].num_nodes == 1 else speedups.get(str(chosen))
        batch = f", batches of {costs['batch_size']}" if costs.get("batch_size", 1) > 1 else ""
        rows.append(
            [
                _cell(_machine_name(costs["fingerprint"]) + batch + reconstructed),
                _tree_text(bank, chosen),
                retrieval_label(scheduler.retrieval),
                _times(modelled),
                f"{_times(speedups[best])}, {_tree_text(bank, int(best))}" if best else "",
            ]
        )
    return rows


def _speedup_section(bank: BankContents) -> list[str]:
    """What the task's trees gained over plain decoding: measured where the bank was searched,
    modelled from measured step costs on every machine it carries an entry for."""
    meta, static = bank.metadata, bank.scheduler.static
    per_tree = meta.get("trees") or [{} for _ in bank.trees]
    timed = {
        k: info["speedup_vs_plain"]
        for k, info in enumerate(per_tree)
        if "speedup_vs_plain" in info and bank.trees[k].num_nodes > 1
    }
    lines = []
    if timed:
        best = max(timed, key=timed.get)
        plain = (meta.get("calibration") or {}).get("vanilla_tokens_per_s")
        plain_text = f" (plain `generate`: {plain:.4g} tokens/s)" if isinstance(plain, (int, float)) else ""
        lines += [
            f"Measured on {_cell(meta.get('hardware', 'hardware not recorded'))}{plain_text} by the search "
            f"that wrote this bank: {STATIC} = {_tree_text(bank, static)} at {_times(timed.get(static))} the "
            f"speed of plain decoding; the fastest timed tree: {_tree_text(bank, best)} at "
            f"{_times(timed[best])}.",
            "",
        ]
    rows = _machine_rows(bank)
    if rows:
        header = ["machine", f"{STATIC} there", "retrieval there", "its modelled speed-up", "best modelled"]
        lines += [
            "Modelled from each machine's measured step costs (`entmtp-hf calibrate`; another machine re-ranks "
            "the frontier at its first `generate`):",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
    return ["### Speed-ups", "", *lines] if lines else []


def _task_section(bank: BankContents) -> list[str]:
    meta = bank.metadata
    per_tree = meta.get("trees") or [{} for _ in bank.trees]
    columns = {"name": "name", "source": "source", **FIGURES}
    figures = [f for f in columns if any(f in info for info in per_tree)]
    lines = [f"## Task `{bank.task}`", ""]
    lines += [f"- {key.replace('_', ' ')}: {_cell(meta[key])}" for key in _CARD_KEYS if key in meta]
    header = ["tree", "nodes", "depth", "nodes per depth"] + [columns[f] for f in figures]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k, (tree, info) in enumerate(zip(bank.trees, per_tree)):
        per_depth = "/".join(map(str, tree.nodes_per_depth())) or "-"
        cells = [str(k), str(tree.num_nodes), str(tree.depth), per_depth]
        cells += [_cell(info[f]) if f in info else "" for f in figures]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", _scheduler_text(bank), "", *_speedup_section(bank)]


def model_card(folder: Path) -> str:
    """The README.md of a bank folder: YAML front matter and one table per task."""
    tasks = list_local_tasks(folder)
    tags = ("entmtp-hf", "speculative-decoding", "tree-attention", "multi-token-prediction")
    lines = ["---", "library_name: entmtp-hf", "tags:", *(f"- {t}" for t in tags), "---", ""]
    lines += [
        "# entmtp-hf topology banks",
        "",
        "Draft-tree banks for tree speculative decoding with entmtp-hf: one `<task>.safetensors` "
        "file per task, K trees smallest first (format: `docs/banks.md` of entmtp-hf). Use one with",
        "",
        "```python",
        "from entmtp_hf import EntMTPConfig, enable_entmtp",
        'enable_entmtp(model, "<heads>")   # the draft heads a task below names',
        f'out = model.generate(**inputs, entmtp_config=EntMTPConfig(bank="<this repo id or folder>", '
        f'task="{tasks[0] if tasks else "default"}"))',
        "```",
        "",
        '`TopologyBank.from_pretrained("<this repo id or folder>", task=...)` reads one task\'s trees and figures.',
        "",
    ]
    for task in tasks:
        try:
            lines += _task_section(load_bank_contents(folder / f"{task}{SUFFIX}"))
        except BankFormatError as e:
            lines += [f"## Task `{task}`", "", f"Unreadable bank file: {_cell(e.problem)}", ""]
    return "\n".join(lines)
