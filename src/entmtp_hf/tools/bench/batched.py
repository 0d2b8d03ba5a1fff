"""``entmtp-hf bench --batch-size 1 2 4 8``: total tokens/s of batched decoding, per method and batch size.

Protocol: per task the basket's prompts are cut into consecutive groups of ``B`` (a last,
incomplete group is left out, so every timed call has ``B`` rows), left-padded, and every
method decodes every group, interleaved (the order rotated by group) after one warm-up call
per method and batch size (which also measures a bank's step costs at that batch size, once
per machine). The figure is the total tokens/s of each (task, batch size, method): new tokens
of every row (up to and including its EOS) over the summed wall time of its calls, prefill
included, and the median over groups of each call's ratio to plain batched ``generate``. Every
greedy row is compared with plain batched ``generate``'s row token for token; a divergence is
reported with the base model's logit gap there.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ...demo.compare import find_mismatch
from ..data.tasks import evaluation_basket
from .context import BenchContext, log
from .memory import PeakMemory
from .methods import Method, chosen_methods
from .results import environment
from .runner import _gen_kwargs, _prompt_ids, rotation
from .settings import MODES, BenchSettings

#: the batched comparison when --methods is not given
BATCH_METHODS = ("vanilla", "hydra-default", "entmtp-static", "entmtp-tau")


def batch_inputs(rows: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, L] and their attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r))
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def row_tokens(row: Sequence[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS (what follows is padding)."""
    out = []
    for t in row:
        out.append(int(t))
        if int(t) in eos:
            break
    return out


def _kwargs(ctx: BenchContext, method: Method, task: str, mode: str) -> dict:
    """What ``generate`` gets for ``method`` (its heads attached now, outside the clock)."""
    kwargs = dict(method.generate_kwargs)
    if method.entmtp is not None:
        ctx.enable(method.heads, kernels=method.cpu_kernels)
        kwargs["entmtp_config"] = method._config(ctx, task, mode)
    return kwargs


def _batch_capable(method: Method) -> str | None:
    if type(method).prepare is not Method.prepare:
        return "prepares its own runner (batch size 1 only)"
    if any(k in method.generate_kwargs for k in ("prompt_lookup_num_tokens", "assistant_model")):
        return "transformers' assisted decoding takes one prompt"
    return None


def _eos(ctx: BenchContext) -> set[int]:
    eos = ctx.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return {int(e) for e in eos} | (
        {int(ctx.tokenizer.eos_token_id)} if ctx.tokenizer.eos_token_id is not None else set()
    )


def run_batched(
    ctx: BenchContext,
    settings: BenchSettings,
    batch_sizes: Sequence[int],
    *,
    progress: bool = True,
    out_path: Path | None = None,
) -> dict[str, Any]:
    """Every method on every task's groups of every batch size, interleaved; returns the result dict."""
    methods = chosen_methods(settings.methods or BATCH_METHODS)
    skipped = {m.name: why for m in methods if (why := _batch_capable(m))}
    methods = [m for m in methods if m.name not in skipped]
    if "vanilla" not in [m.name for m in methods]:
        raise ValueError("the batched bench compares with plain batched generate: include the 'vanilla' method")
    mode_kwargs = MODES[settings.mode][0]
    eos, memory = _eos(ctx), PeakMemory(ctx.device)
    gen = _gen_kwargs(ctx, settings, settings.max_new_tokens)
    pad = gen["pad_token_id"]
    results: dict[str, Any] = {
        "format": "entmtp-hf-batched-bench",
        "settings": {**settings.__dict__, "batch_sizes": list(batch_sizes)},
        "environment": environment(ctx.device, memory.source),
        "skipped": skipped,
        "records": [],
    }
    baskets = {}
    for task in settings.tasks:
        basket = evaluation_basket(task, settings.num_prompts)
        baskets[basket[0].task if basket else task] = (task, [_prompt_ids(ctx, p, settings) for p in basket])
    total = sum(len(ids) // b * len(methods) for _, ids in baskets.values() for b in batch_sizes)
    bar = tqdm(total=total, desc="batched bench", unit="call", disable=not progress)
    for label, (task, all_ids) in baskets.items():
        for b in batch_sizes:
            groups = [all_ids[i : i + b] for i in range(0, len(all_ids) - b + 1, b)]
            for m in methods:  # warm-up (and a bank's step costs at this batch size, measured once)
                ids, mask = batch_inputs(groups[0], pad, ctx.device)
                t0 = time.perf_counter()
                kwargs = _kwargs(
                    ctx, m, task, settings.mode
                )  # before ``generate`` is looked up: it re-classes the model
                ctx.model.generate(
                    ids, attention_mask=mask, **{**gen, "max_new_tokens": settings.warmup_tokens}, **kwargs
                )
                log.info("%s B=%d %s warm-up %.1f s", label, b, m.name, time.perf_counter() - t0)
            for gi, group in enumerate(groups):
                ids, mask = batch_inputs(group, pad, ctx.device)
                for name in rotation([m.name for m in methods], gi):
                    kwargs = _kwargs(ctx, next(m for m in methods if m.name == name), task, settings.mode)
                    if settings.mode != "greedy":
                        torch.manual_seed(settings.seed * 100003 + gi)
                    memory.reset()
                    t0 = time.perf_counter()
                    out = ctx.model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **gen, **kwargs)
                    elapsed = time.perf_counter() - t0
                    rows = [row_tokens(r, eos) for r in out.sequences[:, ids.shape[1] :].tolist()]
                    stats = getattr(out, "entmtp_stats", None) or {}
                    results["records"].append(
                        {
                            "task": label,
                            "batch_size": b,
                            "group": gi,
                            "method": name,
                            "time_s": elapsed,
                            "new_tokens": sum(len(r) for r in rows),
                            "rows": rows,
                            "peak_memory_bytes": memory.peak_bytes(),
                            "plain_decoding": bool(stats.get("plain_decoding")),
                            "tree_sizes": [r.get("tree_sizes") for r in stats.get("rows", [])]
                            or stats.get("tree_sizes"),
                        }
                    )
                    bar.update(1)
                _check_rows(ctx, results["records"], label, b, gi, group, mode_kwargs)
            if out_path is not None:
                write_batched(results, out_path)
    bar.close()
    results["summary"] = summarize_batched(results)
    return results


def _check_rows(ctx: BenchContext, records: list[dict], task: str, b: int, gi: int, group, mode_kwargs: dict) -> None:
    """Greedy: every method's rows against plain batched ``generate``'s, with the logit gap at a divergence."""
    if mode_kwargs.get("do_sample"):
        return
    mine = [r for r in records if (r["task"], r["batch_size"], r["group"]) == (task, b, gi)]
    ref = next(r for r in mine if r["method"] == "vanilla")
    for rec in mine:
        rec["mismatches"] = []
        if rec is ref:
            continue
        for i, (want, got) in enumerate(zip(ref["rows"], rec["rows"])):
            m = find_mismatch(want, got, ctx.model, group[i])
            if m is not None:
                rec["mismatches"].append({"row": i, **m})
                log.warning("%s B=%d group %d row %d %s differs from vanilla: %s", task, b, gi, i, rec["method"], m)


def summarize_batched(results: dict) -> dict:
    """Per task, batch size and method: total tokens/s, median per-call ratio to vanilla, rows identical."""
    out: dict = {}
    recs = results["records"]
    keys = sorted({(r["task"], r["batch_size"]) for r in recs})
    for task, b in keys:
        mine = [r for r in recs if r["task"] == task and r["batch_size"] == b]
        base = {r["group"]: r["time_s"] / max(r["new_tokens"], 1) for r in mine if r["method"] == "vanilla"}
        per_method = {}
        for name in dict.fromkeys(r["method"] for r in mine):
            rs = [r for r in mine if r["method"] == name]
            ratios = [base[r["group"]] / (r["time_s"] / max(r["new_tokens"], 1)) for r in rs if r["group"] in base]
            rows = sum(len(r["rows"]) for r in rs)
            bad = [m for r in rs for m in r.get("mismatches", [])]
            per_method[name] = {
                "tokens_per_s": sum(r["new_tokens"] for r in rs) / sum(r["time_s"] for r in rs),
                "median_ratio_to_vanilla": statistics.median(ratios) if ratios else None,
                "calls": len(rs),
                "rows": rows,
                "rows_identical": rows - len(bad),
                "min_abs_logit_gap": min(
                    (abs(m["logit_gap"]) for m in bad if m.get("logit_gap") is not None), default=None
                ),
                "peak_memory_mb": statistics.median(r["peak_memory_bytes"] for r in rs) / 2**20,
                "plain_decoding_calls": sum(r["plain_decoding"] for r in rs),
            }
        out.setdefault(task, {})[str(b)] = per_method
    return out


def write_batched(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def batched_table(results: dict) -> str:
    """Markdown: one row per task and batch size, one column per method (tokens/s and ratio)."""
    from .report import machine_line

    summary, s = results["summary"], results["settings"]
    methods = list(dict.fromkeys(m for per_b in summary.values() for per in per_b.values() for m in per))
    skipped = "; ".join(f"{m}: {why}" for m, why in results.get("skipped", {}).items()) or "none"
    lines = [
        "# Batched benchmark",
        "",
        f"Machine: {machine_line(results['environment'])}.",
        "",
        f"{s['num_prompts']} prompts per task x up to {s['max_new_tokens']} new tokens, mode `{s['mode']}`, "
        f"in consecutive groups of B (an incomplete last group left out), left-padded; methods interleaved "
        f"per group after a warm-up call per method and batch size. Cells: total tokens/s (new tokens of every "
        f"row up to its EOS over the calls' wall time, prefill included) and the median over groups of each "
        f"call's ratio to plain batched `generate`. Skipped: {skipped}.",
        "",
        "| task | B | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for task, per_b in summary.items():
        for b, per in sorted(per_b.items(), key=lambda kv: int(kv[0])):
            cells = []
            for m in methods:
                s = per.get(m)
                if s is None:
                    cells.append("-")
                    continue
                ratio = s["median_ratio_to_vanilla"]
                same = "" if s["rows_identical"] == s["rows"] else f", {s['rows'] - s['rows_identical']} rows differ"
                cells.append(f"{s['tokens_per_s']:.1f} tok/s ({ratio:.2f}x{same})")
            lines.append(f"| {task} | {b} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Rows identical to plain batched `generate`, peak memory (MB, median over calls) and calls that "
        "ran plain batched decoding because no tree paid at that batch size:",
        "",
        "| task | B | method | rows identical | peak MB | plain calls |",
        "|---|---|---|---|---|---|",
    ]
    for task, per_b in summary.items():
        for b, per in sorted(per_b.items(), key=lambda kv: int(kv[0])):
            for m, v in per.items():
                gap = "" if v["min_abs_logit_gap"] is None else f" (min gap {v['min_abs_logit_gap']:.3g})"
                lines.append(
                    f"| {task} | {b} | {m} | {v['rows_identical']}/{v['rows']}{gap} | {v['peak_memory_mb']:.0f} | "
                    f"{v['plain_decoding_calls']}/{v['calls']} |"
                )
    return "\n".join(lines) + "\n"


def batched_plot(results: dict, path: Path) -> Path:
    """Total tokens/s against batch size, one panel per task, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(4.5 * len(summary), 3.6), squeeze=False)
    for ax, (task, per_b) in zip(axes[0], summary.items()):
        sizes = sorted(int(b) for b in per_b)
        for m in dict.fromkeys(m for per in per_b.values() for m in per):
            ys = [per_b[str(b)].get(m, {}).get("tokens_per_s") for b in sizes]
            ax.plot(sizes, ys, marker="o", label=m)
        ax.set(title=task, xlabel="batch size", ylabel="total tokens/s", xticks=sizes)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
