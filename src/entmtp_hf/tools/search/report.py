"""The search's ``report.md``: settings, the frontier with its bias table, the chosen trees,
the scheduler sweep, the headroom and the held-out check, all from a :class:`SearchResult`."""

from __future__ import annotations

import json
from typing import Any

from ..machine import hardware_string, versions
from .result import CONFIRM_MARGIN, SearchResult, finite, inversions, nodes_text


# ============================================================================ the report
def _f(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if finite(value) else "–"


def _bias_table(result: SearchResult) -> list[str]:
    header = [
        "tree",
        "nodes",
        "biased τ (all prompts)",
        "biased τ",
        "simulated τ",
        "unbiased τ (generate)",
        "bias",
        "tokens/s",
        "vs plain",
        "c(N)",
        "modelled",
    ]
    costs = result.costs or {}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    c = result.choice
    marks = {c.static: " (EntMTP*)", c.conservative: " (T−)", c.aggressive: " (T+)"}
    for k, lab in enumerate(result.labels):
        r = result.timed[lab]
        base = r["biased_timed"] if finite(r["biased_timed"]) else r["biased"]
        bias = (base - r["unbiased"]) / r["unbiased"] if finite(r["unbiased"]) and r["unbiased"] else None
        bias_text = f"{100 * bias:+.1f}%" if bias is not None else "–"
        lines.append(
            f"| {k}{marks.get(k, '')} | {r['num_nodes']} | {_f(r['biased'])} | {_f(r['biased_timed'])} | "
            f"{_f(r['simulated_timed'])} | {_f(r['unbiased'])} | {bias_text} | {_f(r['tokens_per_s'], 2)} | "
            f"{_f(r['speedup'], 2)}× | {_f(costs.get(r['num_nodes']), 2)} | {_f(r.get('modelled'))} |"
        )
    if result.reference:
        r = result.reference
        lines.append(
            f"| mc_sim_7b_63 | 64 | – | – | – | {_f(r['unbiased'])} | – | "
            f"{_f(r['tokens_per_s'], 2)} | {_f(r['speedup'], 2)}× | {_f(costs.get(64), 2)} | "
            f"{_f(r.get('modelled'))} |"
        )
    return lines


def _header(result: SearchResult, info: dict[str, Any]) -> list[str]:
    s, timed, sweep = result.settings, len(info.get("timing_indices", [])), result.settings["sweep_prompts"]
    stages = ", ".join(f"{k} {v:.0f}" for k, v in result.elapsed.items())
    return [
        f"# Tree search report: `{result.task}`",
        "",
        f"- base model: {info.get('base_model', '?')}; heads: {info.get('heads', '?')}",
        f"- hardware: {hardware_string()}; versions: {versions()}",
        f"- calibration: {len(info.get('prompt_ids', []))} prompts × {s['max_new_tokens']} new tokens (frontier), "
        f"the first {timed} of them timed with `generate`, the first {min(sweep, timed)} in the sweep; "
        f"scoring `{s['scoring']}`, acceptance `{s['acceptance']}`, node budget {s['budget']}",
        f"- stage wall times (s): {stages}",
        "",
    ]


def _frontier_section(result: SearchResult) -> list[str]:
    f, t = result.frontier, result.timed
    yes_no = {True: "yes", False: "no", None: "n/a"}
    inverted = inversions(list(t.values()), "biased", "unbiased")
    return [
        "## Frontier",
        "",
        f"{len(f)} trees, {f[0]['num_nodes']}..{f[-1]['num_nodes']} nodes; biased τ {_f(f[0]['biased'])} → "
        f"{_f(f[-1]['biased'])}. {len(result.labels)} of them were timed with `generate` (debias + throughput):",
        "",
        *_bias_table(result),
        "",
        "biased τ (all prompts) is the frontier's score; the other columns use the timed prompts only: biased τ "
        "averages every step start, simulated τ walks the rank tuples the way the decoder does, unbiased τ is "
        "measured with `generate`; bias = (biased − unbiased) / unbiased. c(N) = forward time for N tokens over "
        "one token; modelled = decoded tokens per one-token forward (tokens over Σ c(N) of the steps, scaled by "
        "the run's own time outside the forwards): "
        + (
            "the trees and schedulers were ranked by it."
            if result.costs is not None
            else "not computed, the trees and schedulers were ranked by measured tokens/s."
        ),
        "",
        f"Frontier ranking changed by debiasing (timed trees, measured τ): **{yes_no[result.ranking_changed]}** "
        f"(inverted pairs, by nodes: {inverted or 'none'}); over all {len(f)} frontier trees (simulated τ): "
        f"**{yes_no[result.ranking_changed_simulated]}**. "
        f"Plain decoding: {_f(result.vanilla_tokens_per_s, 2)} tokens/s.",
        "",
    ]


def _choice_section(result: SearchResult) -> list[str]:
    c, t, labels = result.choice, result.timed, result.labels
    size = {k: t[labels[k]]["num_nodes"] for k in (c.static, c.conservative, c.aggressive)}
    sweep = [
        f"| {lab} | {_f(v['tokens_per_s'], 2)} | {_f(v.get('measured_vs_static'), 3)} | {_f(v['vs_static'], 3)} "
        f"| {_f(v.get('tokens_per_step'), 3)} |"
        for lab, v in result.sweep.items()
    ]
    replayed = next((v["replayed"] for v in result.sweep.values() if v.get("replayed")), None)
    retrieval = result.retrieval_default()
    how = (
        (
            f"Rows with a tokens/step figure were replayed, not timed: greedy decoding walked along the rank tuples "
            f"of all {replayed} calibration prompts (exact accept lengths, the scheduler fed the teacher-forced "
            f"features, retrieval {'`' + retrieval.mode + '`' if retrieval else 'off'} as the bank stores it), "
            f"ranked by tokens per unit of verification work (Σ accept / Σ c(N)) against the static tree replayed "
            f"the same way, `static (replayed)`."
        )
        if replayed
        else ""
    )
    ranked = "modelled" if result.costs is not None else "measured"
    features = {k: v["feature"] for k, v in result.winners.items() if "feature" in v}
    _, at = result.bank_trees()  # "tree k" below is the bank's index
    return [
        "## Chosen trees",
        "",
        f"- EntMTP* (static optimum): tree {at[c.static]}, **{nodes_text(size[c.static])}** "
        f"({size[c.static] - 1} drafted) "
        f"against mc_sim_7b_63's 63 drafted nodes; {_f(t[labels[c.static]]['tokens_per_s'], 2)} tokens/s",
        f"- T− (conservative): tree {at[c.conservative]}, {nodes_text(size[c.conservative])}; "
        f"T+ (aggressive): tree {at[c.aggressive]}, {nodes_text(size[c.aggressive])}",
        *(
            [
                "- EntMTP* is the root-only tree: no drafted tree paid for its verification on this machine with "
                "these heads (the bank then decodes plainly through the EntMTP loop)."
            ]
            if size[c.static] == 1
            else []
        ),
        f"- upper hull: {[t[labels[i]]['num_nodes'] for i in c.hull]} nodes; "
        f"Pareto set: {[t[labels[i]]['num_nodes'] for i in c.pareto]} nodes",
        "",
        "## Scheduler sweep",
        "",
        f"Median paired ratios to the static tree; the winners were picked by the {ranked} ratio.",
        "",
        *([how, ""] if how else []),
        "| run | tokens/s | measured vs static | ranking ratio vs static | tokens/step (replayed) |",
        "|---|---|---|---|---|",
        *sweep,
        "",
        *_headroom_lines(result),
        _confirmation_line(result),
        f"Stored defaults: {json.dumps(result.scheduler_defaults())}; features: {features}.",
        "",
    ]


def _headroom_lines(result: SearchResult) -> list[str]:
    h = result.headroom
    if not h:
        return []
    replayed = [v["vs_static"] for lab, v in result.sweep.items() if v.get("replayed") and lab != "static (replayed)"]
    best = f"; the best replayed scheduler above reaches {max(replayed):.3f}× its static tree" if replayed else ""
    return [
        f"Headroom: with every step's accept lengths known in advance, switching among the timed trees "
        f"({h['trees']} nodes) would verify {h['foresight_vs_static']:.3f}× the tokens per unit of work of the best "
        f"static one ({nodes_text(h['best_static_nodes'])}; no retrieval, {h['prompts']} prompts){best}. Schedulers "
        f"see only what the decoder knows when a step starts; the gap is what a better confidence signal could "
        f"win.",
        "",
    ]


def _confirmation_line(result: SearchResult) -> str:
    c = result.confirmation
    if not c:
        return "No scheduler cleared the sweep's margin (or no held-out prompt was left): nothing to confirm.\n"
    verdict = "kept as the default policy" if c["vs_static"] >= CONFIRM_MARGIN else "rejected: the default stays static"
    return (
        f"Held-out check of the sweep's best scheduler `{c['label']}` on {c['prompts']} calibration prompts the "
        f"sweep did not use: {_f(c['vs_static'])} vs static ({_f(c.get('measured_vs_static'))} measured); "
        f"needs {CONFIRM_MARGIN}: {verdict}.\n"
    )


def report_markdown(result: SearchResult, info: dict[str, Any]) -> str:
    plots = ["![acceptance frontier](acceptance_frontier.png)", "", "![throughput frontier](throughput_frontier.png)"]
    return "\n".join([*_header(result, info), *_frontier_section(result), *_choice_section(result), *plots, ""])
