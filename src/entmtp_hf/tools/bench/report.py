"""Markdown made from a benchmark's ``results.json`` (never from live objects).

* :func:`table1_markdown`: the paper's Table 1 layout (rows = tasks, columns = methods,
  cells ``tok/s (ρ×, τ)``) plus a detail table per task (:func:`details_markdown`);
* :func:`pairwise_markdown`: methods against EntMTP* and against the kernel reference, prompt
  by prompt; :func:`speculation_markdown` and :func:`eas_markdown`: drafting and its waste;
* :func:`table_markdown` (``table.md``) and :func:`results_markdown` (the ``docs/results.md`` page);
* :func:`write_report`: all of it, with the plots, from one or more results files
  (``entmtp-hf bench-report``).

The figures' conventions are :mod:`.summary`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..checkpoint import write_json
from .plots import make_plots
from .results import merge_results, portable, read_results, summary_of, write_results
from .summary import bootstrap_interval, geomean, paired_ratios, ran_methods, summarize

DASH = "–"
PAIRWISE_NOTE = (
    "Per prompt, a method's tok/s over the reference's on the same prompt (same interleaved round), "
    "their geometric mean, a bootstrap 95% interval over prompts, and the tokens-per-step ratio "
    "(no timing noise in it). A ratio whose interval spans 1 is not resolved by the run."
)
PAIR_REFERENCE = "entmtp-static"  # EntMTP*: what a scheduler must beat to pay for itself
#: plain decoding with oneDNN's kernels: the speed-up speculation adds over the kernel alone
KERNEL_REFERENCE = "vanilla-onednn"
KERNEL_NOTE = (
    "Every method against plain decoding with every linear layer on oneDNN (the kernel the tree "
    "methods verify with where it was timed faster): what speculation adds beyond the kernel."
)


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return DASH if x is None else f"{x:{fmt}}{suffix}"


def table1_markdown(results: dict) -> str:
    """Rows = tasks, columns = methods, cells ``tok/s (ρ×, τ)``."""
    summary = results.get("summary") or summarize(results)
    methods = ran_methods(results)
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
    head = (
        "| method | tok/s median | ρ median | ρ geomean (95% interval) | τ | drafted → accepted (rate) "
        "| draft / verify time | peak MB | PPL median | mismatches |"
    )
    for task, per in summary.items():
        out += [f"#### {task}", "", head, "|---" * 10 + "|"]
        for m, s in per.items():
            drafted = (
                DASH
                if s["drafted_tokens"] is None
                else (
                    f"{s['drafted_tokens']:.0f} → {s['accepted_draft_tokens']:.0f} ({_f(s['acceptance_rate'], '.1%')})"
                )
            )
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
    out = [
        "| task | method | chains | mean chain | halts by cause | verified drafts rejected |",
        "|---|---|---|---|---|---|",
    ]
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
        for method in ran_methods(results):
            s = per.get(method)
            if not s or not s.get("drafted_tokens") or not s.get("steps"):
                continue
            rate = s["accepted_draft_tokens"] / s["drafted_tokens"]
            out.append(
                f"| {task} | {method} | {_f(s['speedup_geomean'], '.2f', '×')} | {_f(s['tau'])} | "
                f"{s['drafted_tokens'] / s['steps']:.2f} | {rate:.1%} | {1 - rate:.1%} |"
            )
    if not out:
        return ""
    head = ["| task | method | speed-up | tokens/step | verified drafts/step | accepted | wasted |", "|---" * 7 + "|"]
    return "\n".join(head + out) + "\n"


def pairwise_markdown(results: dict, reference: str = PAIR_REFERENCE) -> str:
    """Every other tree method against ``reference`` prompt by prompt ("" if it did not run)."""
    rows = []
    for task in results["prompts"]:
        for method in ran_methods(results):
            if method in (reference, "vanilla", KERNEL_REFERENCE):
                continue
            pairs = paired_ratios(results, task, reference, method)
            if not pairs:
                continue
            speed = [p[0] for p in pairs]
            ci = bootstrap_interval(speed)
            ci_text = f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else DASH
            rows.append(
                f"| {task} | {method} | {len(pairs)} | {_f(geomean(speed), '.3f', '×')} | {ci_text} | "
                f"{_f(geomean([p[1] for p in pairs]), '.3f', '×')} |"
            )
    if not rows:
        return ""
    head = [
        f"| task | method | prompts | tok/s over {reference} (geomean) | 95% interval | tokens/step over {reference} |",
        "|---" * 6 + "|",
    ]
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
    return (
        f"basket `{s['preset']}`: the first {s['num_prompts']} prompts of each task's evaluation pool × up to "
        f"{s['max_new_tokens']} new tokens, mode `{s['mode']}`, one warm-up generation per method "
        f"({s['warmup_tokens']} tokens) excluded, prefill included, sampling seed {s['seed']}"
    )


def machine_line(env: dict) -> str:
    hw = env.get("gpu") or f"{env.get('cpu_model')} ({env.get('cpu_affinity') or env.get('cpu_count')} cores)"
    v = env.get("versions", {})
    return (
        f"{hw}, device `{env.get('device')}`, torch threads {env.get('torch_threads')}, "
        f"load average at start {env.get('load_average')}; torch {v.get('torch')}, transformers "
        f"{v.get('transformers')}, entmtp-hf {v.get('entmtp-hf')} (commit {str(env.get('git_commit'))[:10]}"
        f"{', dirty tree' if env.get('git_dirty') else ''}); {env.get('date_utc')}"
    )


def table_markdown(results: dict) -> str:
    """``table.md``: Table 1 layout, details, mismatches and skips of one run."""
    env, ctx = results["environment"], portable(results.get("context", {}))
    parts = [
        "# Benchmark",
        "",
        f"Machine: {machine_line(env)}.",
        "",
        f"Model: {ctx.get('model')}; heads: {ctx.get('heads')}; bank: {ctx.get('bank')}.",
        "",
        _basket_line(results) + ".",
        "",
        "Cells: tok/s (speedup ρ over vanilla, geometric mean over prompts; τ = tokens per step).",
        "",
        table1_markdown(results),
        "",
        "### Details",
        "",
        details_markdown(results),
    ]
    spec = speculation_markdown(results)
    if spec:
        parts += ["### Speculation: speed-up and wasted verification", "", spec]
    parts += _comparison_sections(results, "###")
    mism = mismatch_lines(results)
    if results["settings"]["mode"] == "greedy":
        parts += (
            ["### Greedy mismatches against vanilla", ""] + (mism or ["none: every output is token-identical"]) + [""]
        )
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
    return [
        "- commands (one process per task group, run at the same time; ratios are taken within a task):",
        *[f"  - {line(e)}" for e in env["parts"]],
    ]


def results_markdown(results: dict, plots: dict[str, str] | None = None) -> str:
    """The ``docs/results.md`` page for one run; ``plots`` maps a caption to a relative path."""
    env = results["environment"]
    parts = [
        "# Results",
        "",
        "The latest benchmark run of `entmtp-hf bench` (regenerate this page with "
        "`entmtp-hf bench-report RESULTS.json --results-md docs/results.md`).",
        "",
        "## Setup",
        "",
        f"- machine: {machine_line(env)}",
        f"- {_basket_line(results)}",
        f"- model: {results.get('context', {}).get('model')}",
        f"- heads: {results.get('context', {}).get('heads')}",
        f"- bank: {results.get('context', {}).get('bank')}",
        f"- peak memory source: {env.get('memory_source')}",
        *_command_lines(env),
        "",
        "## Table 1 layout",
        "",
        "Cells: tok/s (ρ× over vanilla, τ). tok/s = all new tokens / all timed seconds; ρ = geometric mean over "
        "prompts of the per-prompt speedup; τ = tokens per decoding step. Compare methods within this run only: "
        "the machine is shared and absolute speeds drift.",
        "",
        table1_markdown(results),
        "",
        "## Details",
        "",
        details_markdown(results),
    ]
    parts += _comparison_sections(results, "##")
    if results["settings"]["mode"] == "greedy":
        parts += (
            ["## Greedy outputs against vanilla", ""]
            + (mismatch_lines(results) or ["All outputs are token-identical."])
            + [""]
        )
    if skipped_lines(results):
        parts += ["## Skipped methods", ""] + skipped_lines(results) + [""]
    if plots:
        parts += ["## Plots", ""] + [f"![{cap}]({path})" for cap, path in plots.items()] + [""]
    return "\n".join(parts)


def write_report(
    results_path: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    *,
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
    paths["summary"] = write_json(out_dir / "summary.json", summary_of(results))
    plots = make_plots(results, out_dir)
    paths.update(plots)
    if results_md is not None:
        md = Path(results_md)
        md.parent.mkdir(parents=True, exist_ok=True)
        rel = {cap: os.path.relpath(p, md.parent) for cap, p in plots.items()}
        md.write_text(results_markdown(results, rel), encoding="utf-8")
        paths["results_md"] = md
    return paths
