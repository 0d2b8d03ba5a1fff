"""The model card (``README.md``) of a bank folder, regenerated on every save.

It reads every bank file of the folder through the same bounded reader as loading, so an
unreadable neighbour becomes one line of the card instead of failing the save.
"""

from __future__ import annotations

from pathlib import Path

from ..drafting.retrieval import RetrievalConfig
from .bank_format import FIGURES, SUFFIX, TEXT_KEYS, BankContents, BankFormatError, list_local_tasks, load_bank_contents

CARD_NAME = "README.md"
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
    return lines + ["", _scheduler_text(bank), ""]


def model_card(folder: Path) -> str:
    """The README.md of a bank folder: YAML front matter and one table per task."""
    tasks = list_local_tasks(folder)
    tags = ("entmtp-hf", "speculative-decoding", "tree-attention", "multi-token-prediction")
    lines = ["---", "library_name: entmtp-hf", "tags:", *(f"- {t}" for t in tags), "---", ""]
    lines += [
        "# entmtp-hf topology banks",
        "",
        "Draft-tree banks for tree speculative decoding with entmtp-hf: one `<task>.safetensors` "
        "file per task, K trees smallest first (format: `docs/banks.md` of entmtp-hf). Load one with",
        "",
        "```python",
        "from entmtp_hf.bank import TopologyBank",
        f'bank = TopologyBank.from_pretrained("<this folder or repo id>", task="{tasks[0] if tasks else "default"}")',
        "```",
        "",
    ]
    for task in tasks:
        try:
            lines += _task_section(load_bank_contents(folder / f"{task}{SUFFIX}"))
        except BankFormatError as e:
            lines += [f"## Task `{task}`", "", f"Unreadable bank file: {_cell(e.problem)}", ""]
    return "\n".join(lines)
