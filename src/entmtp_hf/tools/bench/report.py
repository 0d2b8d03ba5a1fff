"""Tables and plots made from a benchmark's ``results.json`` (never from live objects).

* the file: :func:`environment` (what the JSON records about the machine),
  :func:`write_results` / :func:`read_results` (format ``entmtp-bench`` v1);
* :func:`summarize`: per task and method, medians and means of the per-prompt figures;
* :func:`table1_markdown`: the paper's Table 1 layout (rows = tasks, columns = methods,
  cells ``tok/s (ρ×, τ)``) plus a detail table per task;
* :func:`results_markdown`: the ``docs/results.md`` page (machine, basket, tables, plots);
* :func:`make_plots`: tokens/s per method and task, accept-length histograms;
* :func:`write_report`: all of it from a results file (``entmtp-hf bench-report``).

Conventions: tok/s in the table is the pooled throughput (all new tokens / all timed
seconds, prefill included); ρ is the geometric mean over prompts of (method tok/s /
vanilla tok/s on the same prompt); τ is the pooled tokens per decoding step after the
prefill (sum of new tokens - 1 per prompt, over decoding steps).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

FORMAT = "entmtp-bench"
FORMAT_VERSION = 1
DASH = "–"
PAIRWISE_NOTE = ("Per prompt, a method's tok/s over the reference's on the same prompt (same interleaved round), "
                 "their geometric mean, a bootstrap 95% interval over prompts, and the tokens-per-step ratio "
                 "(no timing noise in it). A ratio whose interval spans 1 is not resolved by the run.")


# ============================================================================ files
def json_safe(x: Any) -> Any:
    """JSON-safe copy: NaN/inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_results(results: dict, path: str | os.PathLike) -> Path:
    """Write the result JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(results), allow_nan=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_results(path: str | os.PathLike) -> dict:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
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
        "environment": {**first["environment"],
                        "parts": [{k: p["environment"].get(k) for k in keep} for p in parts]},  # fmt: skip
        "skipped": {k: v for p in parts for k, v in p.get("skipped", {}).items()},
        "prompts": {k: v for p in parts for k, v in p["prompts"].items()},
        "records": [r for p in parts for r in p["records"]],
    }
    merged["summary"] = summarize(merged)
    return merged


# ============================================================================ environment
def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[4]  # the checkout (src/entmtp_hf/tools/bench/report.py)
    if not (root / ".git").exists():
        return None
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Any = "cpu", memory_source: str | None = None) -> dict:
    """Versions, hardware, threads, date and git commit, for the result JSON."""
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    import torch

    device = torch.device(device)
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("entmtp-hf", "torch", "transformers", "evaluate", "datasets", "tokenizers")},
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
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
    return env


# ============================================================================ numbers
def _vals(records: Iterable[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def geomean(xs: list[float]) -> float | None:
    """Geometric mean of positive numbers (None for an empty list)."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def bootstrap_interval(xs: Sequence[float], *, level: float = 0.95, draws: int = 2000, seed: int = 0
                       ) -> tuple[float, float] | None:  # fmt: skip
    """Percentile bootstrap interval of the geometric mean, resampling prompts (None if < 3).

    How far the ratio could move with another draw of prompts and noise: a difference inside
    it is below what the run can resolve.
    """
    if len(xs) < 3:
        return None
    logs = [math.log(x) for x in xs]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    lo, hi = means[int((1 - level) / 2 * draws)], means[int((1 + level) / 2 * draws) - 1]
    return math.exp(lo), math.exp(hi)


def _sum_or_none(records: list[dict], key: str) -> float | None:
    xs = _vals(records, key)
    return sum(xs) if xs else None


def method_summary(recs: list[dict]) -> dict[str, Any]:
    """Aggregates of one (task, method)'s records."""
    tokens, seconds = sum(r["new_tokens"] for r in recs), sum(r["time_s"] for r in recs)
    steps = sum(r["steps"] for r in recs)
    speedups = _vals(recs, "speedup")
    drafted, accepted = _sum_or_none(recs, "drafted_tokens"), _sum_or_none(recs, "accepted_draft_tokens")
    draft_t, verify_t, prefill_t = (_sum_or_none(recs, f"{k}_time_s") for k in ("draft", "verify", "prefill"))
    ppl = _vals(recs, "perplexity")
    mism = [r["mismatch"] for r in recs if r.get("mismatch")]
    gaps = [m["logit_gap"] for m in mism if m.get("logit_gap") is not None]
    return {
        "prompts": len(recs),
        "new_tokens": tokens,
        "time_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_s_median": _median(_vals(recs, "tokens_per_s")),
        "tokens_per_s_mean": _mean(_vals(recs, "tokens_per_s")),
        "speedup_geomean": geomean(speedups),
        "speedup_interval": bootstrap_interval(speedups) if all(x > 0 for x in speedups) else None,
        "speedup_median": _median(speedups),
        "speedup_mean": _mean(speedups),
        "steps": steps,
        "tau": (tokens - len(recs)) / steps if steps else None,
        "tau_median": _median(_vals(recs, "mean_accept_length")),
        "drafted_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_time_s": draft_t,
        "verify_time_s": verify_t,
        "prefill_time_s": prefill_t,
        "draft_share": draft_t / seconds if draft_t is not None and seconds > 0 else None,
        "verify_share": verify_t / seconds if verify_t is not None and seconds > 0 else None,
        "peak_memory_bytes": max(_vals(recs, "peak_memory_bytes"), default=None),
        "perplexity_median": _median(ppl),
        "perplexity_mean": _mean(ppl),
        "mismatches": len(mism),
        "mismatch_min_logit_gap": min(gaps, key=abs) if gaps else None,
    }


def summarize(results: dict) -> dict[str, dict[str, dict]]:
    """``{task: {method: aggregates}}`` in run order."""
    out: dict[str, dict[str, dict]] = {}
    for task in results["prompts"]:
        for method in results["settings"]["methods"]:
            recs = [r for r in results["records"] if r["task"] == task and r["method"] == method]
            if recs:
                out.setdefault(task, {})[method] = method_summary(recs)
    return out


# ============================================================================ Markdown
def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return DASH if x is None else f"{x:{fmt}}{suffix}"


def _methods(results: dict) -> list[str]:
    ran = {r["method"] for r in results["records"]}
    return [m for m in results["settings"]["methods"] if m in ran]


def table1_markdown(results: dict) -> str:
    """Rows = tasks, columns = methods, cells ``tok/s (ρ×, τ)``."""
    summary = results.get("summary") or summarize(results)
    methods = _methods(results)
    lines = ["| task | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for task, per in summary.items():
        cells = []
        for m in methods:
            s = per.get(m)
            if s is None:
                cells.append(DASH)
            elif m == "vanilla":
                cells.append(_f(s["tokens_per_s"], ".1f"))
            else:
                cells.append(f"{_f(s['tokens_per_s'], '.1f')} ({_f(s['speedup_geomean'], '.2f', '×')}, {_f(s['tau'])})")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def details_markdown(results: dict) -> str:
    """One table per task with the secondary figures."""
    summary = results.get("summary") or summarize(results)
    out = []
    head = ("| method | tok/s median | ρ median | ρ geomean (95% interval) | τ | drafted → accepted (rate) "
            "| draft / verify time | peak MB | PPL median | mismatches |")  # fmt: skip
    for task, per in summary.items():
        out += [f"#### {task}", "", head, "|---" * 10 + "|"]
        for m, s in per.items():
            drafted = DASH if s["drafted_tokens"] is None else (
                f"{s['drafted_tokens']:.0f} → {s['accepted_draft_tokens']:.0f} ({_f(s['acceptance_rate'], '.1%')})")
            split = DASH if s["draft_share"] is None else f"{s['draft_share']:.0%} / {s['verify_share']:.0%}"
            mb = None if s["peak_memory_bytes"] is None else s["peak_memory_bytes"] / 2**20
            gap = "" if s["mismatch_min_logit_gap"] is None else f" (min gap {s['mismatch_min_logit_gap']:.2g})"
            ci = s.get("speedup_interval") if m != "vanilla" else None  # older summaries lack it
            rho = _f(s["speedup_geomean"], ".2f", "×") + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")
            out.append(
                f"| {m} | {_f(s['tokens_per_s_median'], '.1f')} | {_f(s['speedup_median'], '.2f', '×')} "
                f"| {rho} | {_f(s['tau'])} | {drafted} | {split} | {_f(mb, '.0f')} "
                f"| {_f(s['perplexity_median'], '.3f')} | {s['mismatches']}{gap} |"
            )
        out.append("")
    return "\n".join(out)


def eas_markdown(results: dict) -> str:
    """Per task and EAS method: chain lengths, halts by cause and the rejected fraction ("" if none)."""
    rows = {}
    for r in results["records"]:
        e = r.get("eas")
        if not isinstance(e, dict):
            continue
        agg = rows.setdefault((r["task"], r["method"]), {"chains": [], "halts": {}, "verified": 0, "accepted": 0})
        agg["chains"] += e.get("chain_lengths", [])
        for cause, n in e.get("halts", {}).items():
            agg["halts"][cause] = agg["halts"].get(cause, 0) + n
        agg["verified"] += e.get("verified_draft_tokens", 0)
        agg["accepted"] += e.get("accepted_draft_tokens", 0)
    if not rows:
        return ""
    out = ["| task | method | chains | mean chain | halts by cause | verified drafts rejected |", "|---|---|---|---|---|---|"]
    for (task, method), a in rows.items():
        mean = sum(a["chains"]) / len(a["chains"]) if a["chains"] else 0.0
        halts = ", ".join(f"{k} {v}" for k, v in a["halts"].items() if v) or DASH
        rejected = (a["verified"] - a["accepted"]) / a["verified"] if a["verified"] else None
        out.append(f"| {task} | {method} | {len(a['chains'])} | {mean:.2f} | {halts} | {_f(rejected, '.1%')} |")
    return "\n".join(out) + "\n"


def speculation_markdown(results: dict) -> str:
    """The EAS report's layout: per task and drafting method, speed-up, tokens per step, drafted
    tokens verified per step, their acceptance rate and the wasted share ("" if no method drafts)."""
    summary = summarize(results)  # from the records: summaries stored by older versions lack "steps"
    out = []
    for task, per in summary.items():
        for method in _methods(results):
            s = per.get(method)
            if not s or not s.get("drafted_tokens") or not s.get("steps"):
                continue
            rate = s["accepted_draft_tokens"] / s["drafted_tokens"]
            out.append(f"| {task} | {method} | {_f(s['speedup_geomean'], '.2f', '×')} | {_f(s['tau'])} | "
                       f"{s['drafted_tokens'] / s['steps']:.2f} | {rate:.1%} | {1 - rate:.1%} |")  # fmt: skip
    if not out:
        return ""
    head = ["| task | method | speed-up | tokens/step | verified drafts/step | accepted | wasted |", "|---" * 7 + "|"]
    return "\n".join(head + out) + "\n"


PAIR_REFERENCE = "entmtp-static"  # EntMTP*: what a scheduler must beat to pay for itself
#: plain decoding with oneDNN's kernels: the speed-up speculation adds over the kernel alone
KERNEL_REFERENCE = "vanilla-onednn"
KERNEL_NOTE = ("Every method against plain decoding with every linear layer on oneDNN (the kernel the tree "
               "methods verify with where it was timed faster): what speculation adds beyond the kernel.")


def paired_ratios(results: dict, task: str, reference: str, method: str) -> list[tuple[float, float]]:
    """Per prompt of ``task``: (tok/s ratio, tokens-per-step ratio) of ``method`` over ``reference``.

    Both ran the same prompt in the same interleaved round, so the pair shares the machine's
    drift; the tokens-per-step ratio is the part of the speed ratio that timing noise cannot touch.
    """
    def by_prompt(m: str) -> dict[int, dict]:
        return {r["prompt_index"]: r for r in results["records"] if r["task"] == task and r["method"] == m}

    ref, other = by_prompt(reference), by_prompt(method)
    out = []
    for i in sorted(set(ref) & set(other)):
        a, b = ref[i], other[i]
        if not (a.get("tokens_per_s") and b.get("tokens_per_s")):
            continue
        tau_a, tau_b = ((r["new_tokens"] - 1) / r["steps"] if r.get("steps") else 1.0 for r in (a, b))  # plain: 1 per step
        out.append((b["tokens_per_s"] / a["tokens_per_s"], tau_b / tau_a if tau_a > 0 else float("nan")))
    return out


def pairwise_markdown(results: dict, reference: str = PAIR_REFERENCE) -> str:
    """Every other tree method against ``reference`` prompt by prompt ("" if it did not run)."""
    rows = []
    for task in results["prompts"]:
        for method in _methods(results):
            if method in (reference, "vanilla", KERNEL_REFERENCE):
                continue
            pairs = paired_ratios(results, task, reference, method)
            if not pairs:
                continue
            speed = [p[0] for p in pairs]
            ci = bootstrap_interval(speed)
            ci_text = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else DASH
            rows.append(f"| {task} | {method} | {len(pairs)} | {_f(geomean(speed), '.3f', '×')} | {ci_text} | "
                        f"{_f(geomean([p[1] for p in pairs]), '.3f', '×')} |")  # fmt: skip
    if not rows:
        return ""
    head = [f"| task | method | prompts | tok/s over {reference} (geomean) | 95% interval | tokens/step over "
            f"{reference} |", "|---" * 6 + "|"]  # fmt: skip
    return "\n".join(head + rows) + "\n"


def mismatch_lines(results: dict) -> list[str]:
    lines = []
    for r in results["records"]:
        m = r.get("mismatch")
        if m:
            gap = DASH if m.get("logit_gap") is None else f"{m['logit_gap']:.3g} (top-2 gap {m['top2_gap']:.3g})"
            lines.append(
                f"- {r['task']} prompt {r['prompt_index']} ({r['prompt_id']}), {r['method']}: first divergence at "
                f"new token {m['position']} (vanilla {m['reference_token']}, got {m['token']}); logit gap {gap}"
            )
    return lines


def skipped_lines(results: dict) -> list[str]:
    lines = []
    for method, per_task in results.get("skipped", {}).items():
        reasons = sorted(set(per_task.values()))
        lines.append(f"- {method} ({', '.join(per_task)}): " + "; ".join(reasons))
    return lines


def _basket_line(results: dict) -> str:
    s = results["settings"]
    return (f"basket `{s['preset']}`: the first {s['num_prompts']} prompts of each task's evaluation pool × up to "
            f"{s['max_new_tokens']} new tokens, mode `{s['mode']}`, one warm-up generation per method "
            f"({s['warmup_tokens']} tokens) excluded, prefill included, sampling seed {s['seed']}")  # fmt: skip


def machine_line(env: dict) -> str:
    hw = env.get("gpu") or f"{env.get('cpu_model')} ({env.get('cpu_affinity') or env.get('cpu_count')} cores)"
    v = env.get("versions", {})
    return (f"{hw}, device `{env.get('device')}`, torch threads {env.get('torch_threads')}, "
            f"load average at start {env.get('load_average')}; torch {v.get('torch')}, transformers "
            f"{v.get('transformers')}, entmtp-hf {v.get('entmtp-hf')} (commit {str(env.get('git_commit'))[:10]}"
            f"{', dirty tree' if env.get('git_dirty') else ''}); {env.get('date_utc')}")  # fmt: skip


def table_markdown(results: dict) -> str:
    """``table.md``: Table 1 layout, details, mismatches and skips of one run."""
    env, ctx = results["environment"], results.get("context", {})
    parts = [
        "# Benchmark", "",
        f"Machine: {machine_line(env)}.", "",
        f"Model: {ctx.get('model')}; heads: {ctx.get('heads')}; bank: {ctx.get('bank')}.", "",
        _basket_line(results) + ".", "",
        "Cells: tok/s (speedup ρ over vanilla, geometric mean over prompts; τ = tokens per step).", "",
        table1_markdown(results), "", "### Details", "", details_markdown(results),
    ]  # fmt: skip
    spec = speculation_markdown(results)
    if spec:
        parts += ["### Speculation: speed-up and wasted verification", "", spec]
    parts += _comparison_sections(results, "###")
    mism = mismatch_lines(results)
    if results["settings"]["mode"] == "greedy":
        parts += ["### Greedy mismatches against vanilla", ""] + (mism or ["none: every output is token-identical"]) + [""]
    skipped = skipped_lines(results)
    if skipped:
        parts += ["### Skipped methods", ""] + skipped + [""]
    return "\n".join(parts)


def _comparison_sections(results: dict, heading: str) -> list[str]:
    """The prompt-by-prompt sections (against EntMTP* and the kernel reference) and the EAS
    table, each only when the run has what it compares; ``heading`` is their markdown level."""
    parts: list[str] = []
    for reference, note in ((PAIR_REFERENCE, PAIRWISE_NOTE), (KERNEL_REFERENCE, KERNEL_NOTE)):
        table = pairwise_markdown(results, reference)
        if table:
            parts += [f"{heading} Against {reference}, prompt by prompt", "", note, "", table]
    eas = eas_markdown(results)
    if eas:
        parts += [f"{heading} Entropy-adaptive chains", "", eas]
    return parts


def _command_lines(env: dict) -> list[str]:
    def line(e: dict) -> str:
        wall = e.get("wall_time_s")
        return f"`{' '.join(e.get('argv') or [])}`" + (f", wall time {wall / 60:.1f} min" if wall else "")

    if not env.get("parts"):
        return [f"- command: {line(env)}"]
    return ["- commands (one process per task group, run at the same time; ratios are taken within a task):",
            *[f"  - {line(e)}" for e in env["parts"]]]  # fmt: skip


def results_markdown(results: dict, plots: dict[str, str] | None = None) -> str:
    """The ``docs/results.md`` page for one run; ``plots`` maps a caption to a relative path."""
    env = results["environment"]
    wall = env.get("wall_time_s")
    parts = [
        "# Results", "",
        "The latest benchmark run of `entmtp-hf bench` (regenerate this page with "
        "`entmtp-hf bench-report RESULTS.json --results-md docs/results.md`).", "",
        "## Setup", "",
        f"- machine: {machine_line(env)}",
        f"- {_basket_line(results)}",
        f"- model: {results.get('context', {}).get('model')}",
        f"- heads: {results.get('context', {}).get('heads')}",
        f"- bank: {results.get('context', {}).get('bank')}",
        f"- peak memory source: {env.get('memory_source')}",
        *_command_lines(env),
        "", "## Table 1 layout", "",
        "Cells: tok/s (ρ× over vanilla, τ). tok/s = all new tokens / all timed seconds; ρ = geometric mean over "
        "prompts of the per-prompt speedup; τ = tokens per decoding step. Compare methods within this run only: "
        "the machine is shared and absolute speeds drift.", "",
        table1_markdown(results), "", "## Details", "", details_markdown(results),
    ]  # fmt: skip
    parts += _comparison_sections(results, "##")
    if results["settings"]["mode"] == "greedy":
        parts += ["## Greedy outputs against vanilla", ""] + (mismatch_lines(results) or ["All outputs are token-identical."]) + [""]
    if skipped_lines(results):
        parts += ["## Skipped methods", ""] + skipped_lines(results) + [""]
    if plots:
        parts += ["## Plots", ""] + [f"![{cap}]({path})" for cap, path in plots.items()] + [""]
    return "\n".join(parts)


# ============================================================================ plots
def make_plots(results: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """``tokens_per_s.png`` and ``accept_lengths.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks, methods, recs = list(results["prompts"]), _methods(results), results["records"]
    paths = {}

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks) * max(len(methods), 1) / 3), 4))
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        meds, lo, hi = [], [], []
        for t in tasks:
            xs = sorted(_vals([r for r in recs if r["task"] == t and r["method"] == m], "tokens_per_s"))
            med = statistics.median(xs) if xs else 0.0
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [med, med, med]
            meds.append(med), lo.append(med - q[0]), hi.append(q[2] - med)
        xpos = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        ax.bar(xpos, meds, width, yerr=[lo, hi], capsize=2, label=m)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("tokens/s (median, IQR)")
    ax.set_title(f"tokens/s per method and task ({results['settings']['mode']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths["tokens/s per method and task"] = out_dir / "tokens_per_s.png"
    fig.savefig(paths["tokens/s per method and task"], dpi=120)
    plt.close(fig)

    tree_methods = [m for m in methods if any(r.get("accept_lengths") for r in recs if r["method"] == m)]
    if tree_methods:
        fig, axes = plt.subplots(len(tasks), len(tree_methods), squeeze=False, sharex=True,
                                 figsize=(2.4 * len(tree_methods), 1.9 * len(tasks)))  # fmt: skip
        top = max(max(r["accept_lengths"] or [1]) for r in recs if r.get("accept_lengths"))
        for i, t in enumerate(tasks):
            for j, m in enumerate(tree_methods):
                ax = axes[i][j]
                xs = [a for r in recs if r["task"] == t and r["method"] == m for a in (r.get("accept_lengths") or [])]
                if xs:
                    ax.hist(xs, bins=[b + 0.5 for b in range(top + 1)], density=True, color=f"C{j}")
                    ax.set_title(f"{m}: τ={statistics.fmean(xs):.2f}", fontsize=8)
                if j == 0:
                    ax.set_ylabel(t, fontsize=8)
                ax.set_xticks(range(1, top + 1))
                if i == len(tasks) - 1:
                    ax.set_xlabel("accept length", fontsize=8)
        fig.tight_layout()
        paths["accept-length histograms"] = out_dir / "accept_lengths.png"
        fig.savefig(paths["accept-length histograms"], dpi=110)
        plt.close(fig)
    return paths


def write_report(
    results_path: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None, *,
    results_md: str | os.PathLike | None = None,
) -> dict[str, Path]:
    """``table.md`` and the plots from a results file; optionally the docs/results.md page.

    Several files (disjoint tasks of one basket) are merged first; the merged ``results.json``
    is written to ``out_dir``, which is then required."""
    paths_in = [results_path] if isinstance(results_path, (str, os.PathLike)) else list(results_path)
    parts = [read_results(p) for p in paths_in]
    for part in parts:  # from the records: a partial file has no summary, an older one lacks newer figures
        part["summary"] = summarize(part)
    if len(parts) > 1 and out_dir is None:
        raise ValueError("merging several results files needs an output folder (--out)")
    results = merge_results(parts) if len(parts) > 1 else parts[0]
    out_dir = Path(out_dir) if out_dir is not None else Path(paths_in[0]).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": out_dir / "table.md"}
    if len(parts) > 1:
        paths["results"] = write_results(results, out_dir / "results.json")
    paths["table"].write_text(table_markdown(results), encoding="utf-8")
    plots = make_plots(results, out_dir)
    paths.update(plots)
    if results_md is not None:
        md = Path(results_md)
        md.parent.mkdir(parents=True, exist_ok=True)
        rel = {cap: os.path.relpath(p, md.parent) for cap, p in plots.items()}
        md.write_text(results_markdown(results, rel), encoding="utf-8")
        paths["results_md"] = md
    return paths


__all__ = [
    "bootstrap_interval", "details_markdown", "eas_markdown", "environment", "geomean", "json_safe",
    "make_plots", "merge_results", "method_summary", "paired_ratios", "pairwise_markdown", "read_results",
    "results_markdown", "summarize", "table1_markdown", "table_markdown", "write_report", "write_results",
]
