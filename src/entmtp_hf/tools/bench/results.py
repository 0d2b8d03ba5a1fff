"""The benchmark's result file, ``results.json`` (format ``entmtp-bench`` v1), and what it
records about the machine.

It holds the settings, the environment (versions, CPU/GPU, torch threads, date, git commit),
every prompt's token ids and one record per (task, prompt, method) with all per-prompt
figures; every table and plot is made from this file only, never from live objects.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ...errors import FileFormatError
from ..checkpoint import json_safe, write_json
from ..machine import cpu_model
from .summary import summarize

FORMAT = "entmtp-bench"
FORMAT_VERSION = 1


def write_results(results: dict, path: str | os.PathLike) -> Path:
    """Write the result JSON atomically (NaN and infinities become null)."""
    return write_json(path, json_safe(results), indent=None)


def portable(value: Any) -> Any:
    """``value`` with absolute paths cut to their last two parts (a summary travels between machines)."""
    if isinstance(value, str) and os.path.isabs(value):
        return "/".join(Path(value).parts[-2:])
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    return value


def summary_of(results: dict) -> dict:
    """What a results folder keeps for the record: the settings, the environment, the per-task
    per-method summary and every prompt's speed-up over vanilla, without token ids or records."""
    speedups: dict[str, dict[str, list]] = {}
    for r in results["records"]:
        speedups.setdefault(r["task"], {}).setdefault(r["method"], []).append(r.get("speedup"))
    keep = ("format", "format_version", "settings", "environment", "context", "skipped")
    return portable(
        json_safe(
            {
                **{k: results[k] for k in keep if k in results},
                "prompt_ids": {t: [p["prompt_id"] for p in ps] for t, ps in results["prompts"].items()},
                "summary": summarize(results),
                "speedups": speedups,
            }
        )
    )


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; text that is not JSON, or not an object, is a
    :class:`~entmtp_hf.errors.FileFormatError` naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise FileFormatError(path, f"not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise FileFormatError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def read_results(path: str | os.PathLike) -> dict:
    data = read_json_object(path)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an {FORMAT} result file")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {data['format_version']} is newer than this library reads")
    return data


def merge_results(parts: Sequence[dict]) -> dict:
    """One results dict from runs of the same basket on disjoint tasks (e.g. one process per core).

    Settings other than the task list, and the model / heads / bank, must agree: ratios are only
    ever taken within a task, so tasks timed in separate processes stay comparable as ratios.
    The first part's environment is kept, with every part's command, machine load and wall time
    listed under ``environment["parts"]``.
    """
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    base = {k: v for k, v in first["settings"].items() if k != "tasks"}
    tasks: list[str] = []
    for i, part in enumerate(parts):
        other = {k: v for k, v in part["settings"].items() if k != "tasks"}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise ValueError(f"results part {i} has other settings ({', '.join(diff)}): only disjoint tasks merge")
        if part.get("context") != first.get("context"):
            raise ValueError(f"results part {i} used another model, heads or bank: {part.get('context')}")
        overlap = set(tasks) & set(part["settings"]["tasks"])
        if overlap:
            raise ValueError(f"results part {i} repeats tasks {sorted(overlap)}")
        tasks += part["settings"]["tasks"]
    keep = ("argv", "load_average", "load_average_end", "wall_time_s", "date_utc", "cpu_affinity", "git_commit")
    merged = {
        **first,
        "settings": {**first["settings"], "tasks": tasks},
        "environment": {**first["environment"], "parts": [{k: p["environment"].get(k) for k in keep} for p in parts]},
        "skipped": {k: v for p in parts for k, v in p.get("skipped", {}).items()},
        "prompts": {k: v for p in parts for k, v in p["prompts"].items()},
        "records": [r for p in parts for r in p["records"]],
    }
    merged["summary"] = summarize(merged)
    return merged


def _git(*args: str) -> str | None:
    """A git command's output in the checkout this file runs from (None outside a checkout)."""
    root = Path(__file__).resolve().parents[4]  # src/entmtp_hf/tools/bench/results.py -> the checkout
    if not (root / ".git").exists():
        return None
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: Any = "cpu", memory_source: str | None = None) -> dict:
    """Versions, hardware, threads, date and git commit, for the result JSON."""

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    device = torch.device(device)
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {
            p: version(p) for p in ("entmtp-hf", "torch", "transformers", "evaluate", "datasets", "tokenizers")
        },
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "argv": sys.argv,
        "memory_source": memory_source,
    }
