"""Statistics of a benchmark's records: per task and method, pooled and per-prompt figures.

Conventions: tok/s is the pooled throughput (all new tokens / all timed seconds, prefill
included); ρ is the geometric mean over prompts of (method tok/s / vanilla tok/s on the same
prompt); τ is the pooled tokens per decoding step after the prefill (sum of new tokens - 1 per
prompt, over decoding steps). Paired ratios compare two methods prompt by prompt: both ran in
the same interleaved round, so they share the machine's drift.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Iterable, Sequence


def values(records: Iterable[dict], key: str) -> list[float]:
    """The non-missing ``key`` figures of ``records``."""
    return [r[key] for r in records if r.get(key) is not None]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def geomean(xs: list[float]) -> float | None:
    """Geometric mean of positive numbers (None for an empty list)."""
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def bootstrap_interval(
    xs: Sequence[float], *, level: float = 0.95, draws: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
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
    xs = values(records, key)
    return sum(xs) if xs else None


def method_summary(recs: list[dict]) -> dict[str, Any]:
    """Aggregates of one (task, method)'s records."""
    tokens, seconds = sum(r["new_tokens"] for r in recs), sum(r["time_s"] for r in recs)
    steps = sum(r["steps"] for r in recs)
    speedups = values(recs, "speedup")
    drafted, accepted = _sum_or_none(recs, "drafted_tokens"), _sum_or_none(recs, "accepted_draft_tokens")
    draft_t, verify_t, prefill_t = (_sum_or_none(recs, f"{k}_time_s") for k in ("draft", "verify", "prefill"))
    ppl = values(recs, "perplexity")
    mism = [r["mismatch"] for r in recs if r.get("mismatch")]
    gaps = [m["logit_gap"] for m in mism if m.get("logit_gap") is not None]
    return {
        "prompts": len(recs),
        "new_tokens": tokens,
        "time_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_s_median": _median(values(recs, "tokens_per_s")),
        "tokens_per_s_mean": _mean(values(recs, "tokens_per_s")),
        "speedup_geomean": geomean(speedups),
        "speedup_interval": bootstrap_interval(speedups) if all(x > 0 for x in speedups) else None,
        "speedup_median": _median(speedups),
        "speedup_mean": _mean(speedups),
        "steps": steps,
        "tau": (tokens - len(recs)) / steps if steps else None,
        "tau_median": _median(values(recs, "mean_accept_length")),
        "drafted_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_time_s": draft_t,
        "verify_time_s": verify_t,
        "prefill_time_s": prefill_t,
        "draft_share": draft_t / seconds if draft_t is not None and seconds > 0 else None,
        "verify_share": verify_t / seconds if verify_t is not None and seconds > 0 else None,
        "peak_memory_bytes": max(values(recs, "peak_memory_bytes"), default=None),
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


def ran_methods(results: dict) -> list[str]:
    """The methods that left records, in the run's order."""
    ran = {r["method"] for r in results["records"]}
    return [m for m in results["settings"]["methods"] if m in ran]


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
        tau_a, tau_b = (
            (r["new_tokens"] - 1) / r["steps"] if r.get("steps") else 1.0 for r in (a, b)
        )  # plain: 1 per step
        out.append((b["tokens_per_s"] / a["tokens_per_s"], tau_b / tau_a if tau_a > 0 else float("nan")))
    return out
