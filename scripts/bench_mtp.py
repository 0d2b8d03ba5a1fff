"""EntMTP drafting with a model's MTP layers against transformers' ``generate(use_mtp=True)`` on the same layers.

The model is ``load_demo(heads="mtp")`` (SmolLM2 with its shipped MTP layers) or, with ``--model``, a folder
``entmtp-hf build-drafter --arch mtp`` wrote (its banks in ``FOLDER/banks`` unless ``--banks``). Prompts are
the benchmark's held-out baskets (``entmtp-hf bench``'s: the first ``--n`` of each task's evaluation pool,
disjoint from the calibration prompts the banks were searched on and from the training data, chat template
applied). Greedy, fp32, eager.

Batch size 1: per prompt, plain ``generate``, ``generate(use_mtp=True)`` and EntMTP with its bank
(``entmtp_config=EntMTPConfig(bank=..., task=TASK)``) run interleaved (the order rotated by prompt and repeat),
after one warm-up call per method and task; each call is timed with ``time.perf_counter`` around
``generate`` (prefill included; for ``use_mtp=True`` also the loading of its MTP layers from the checkpoint,
which transformers does in every call), the median of ``--repeats`` calls is the prompt's time. Speed-ups
are per prompt, in time per new token (the time ratio where the outputs are identical). EntMTP calls run on
the CPU kernels ``enable_entmtp`` measures (its default path), plain ``generate`` and ``use_mtp=True`` on
``F.linear`` as transformers runs them; ``--no-cpu-kernels`` runs EntMTP on ``F.linear`` too.

Tokens per step: a forward pre-hook on the model counts its forwards in each call; the first is the prefill,
which emits the first new token, and every other verifies drafts (one token for plain decoding), so tokens
per step = (new tokens - 1) / (forwards - 1), for every method alike. For EntMTP it is also read from its
statistics (``mean_accept_length`` over its ``steps``), and ``forwards - 1 == steps`` is checked.

Batch sizes above 1: left-padded consecutive groups of the same prompts, EntMTP against plain batched
``generate``, interleaved the same way; ``use_mtp=True`` is not run (transformers' MTP decoding takes one
prompt per call); EntMTP's tokens per step there are its statistics' (every row's steps, one forward verifying
all rows). Every output is compared with plain greedy's token for token; a difference is reported
with its first position and the base model's logit gap there.

    python scripts/bench_mtp.py --model smollm2-mtp --out runs/bench-mtp
    python scripts/bench_mtp.py --model smollm2-mtp --tasks gsm8k --n 4 --repeats 3 --batch-sizes 1 --out runs/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from entmtp_hf.banks.bank import SHIPPED_DIR
from entmtp_hf.calibration.probe import draft_fit
from entmtp_hf.calibration.tables import calibrate as entmtp_calibrate
from entmtp_hf.cpu_kernels import kernels_of
from entmtp_hf.demo import MTP_HEADS, config_for, load_demo
from entmtp_hf.demo.compare import find_mismatch
from entmtp_hf.heads import HEADS_ATTR, MtpHeads
from entmtp_hf.tools.bench.batched import _eos, batch_inputs, row_tokens
from entmtp_hf.tools.bench.context import BenchContext
from entmtp_hf.tools.bench.report import machine_line
from entmtp_hf.tools.bench.results import environment
from entmtp_hf.tools.bench.runner import _ForwardCounter, _gen_kwargs, _prompt_ids, rotation
from entmtp_hf.tools.bench.settings import BenchSettings
from entmtp_hf.tools.data.tasks import BUILTIN_TASKS, evaluation_basket

METHODS = ("plain", "use_mtp", "entmtp")
KERNELS_TEXT = {True: "the CPU kernels `enable_entmtp` measured", False: "`F.linear` too (`--no-cpu-kernels`)"}
#: the target: EntMTP's median per-prompt speed-up over use_mtp on every task, and its lowest
BAR_MEDIAN, BAR_MIN = 1.2, 1.0
WARMUP_TOKENS = 16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a folder `build-drafter --arch mtp` wrote (default: the demo's MTP layers)")
    p.add_argument("--banks", help="the tree banks (default: the model's)")
    p.add_argument("--tasks", nargs="+", default=list(BUILTIN_TASKS))
    p.add_argument("--n", type=int, default=20, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=1, help="timed calls per method and prompt (their median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's step costs at --batch-sizes first")
    p.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="EntMTP on F.linear too (enable_entmtp(..., cpu_kernels=False)), as plain generate and use_mtp=True run",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and summary.md")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.max_new_tokens < 2 or args.repeats < 1 or min(args.batch_sizes) < 1:
        p.error("--max-new-tokens must be at least 2 (a decode step after the prefill), --repeats and batch sizes 1")
    return args


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def per_step(new_tokens: int, forwards: int) -> float | None:
    """Tokens per verification forward: the prefill forward emits the first new token."""
    return (new_tokens - 1) / (forwards - 1) if forwards > 1 else None


class Bench:
    """The loaded model, the counter on its forwards and the run's options."""

    def __init__(self, args: argparse.Namespace) -> None:
        calibrate = tuple(sorted(set(args.batch_sizes))) if args.calibrate else False
        model, tokenizer, self.bank_dir = load_demo(
            MTP_HEADS, model=args.model, banks=args.banks, calibrate=calibrate if args.cpu_kernels else False
        )
        kernels = kernels_of(model)
        if not args.cpu_kernels and kernels is not None:  # EntMTP on F.linear, as plain and use_mtp=True run
            kernels.remove()
            if calibrate:  # a cost table is keyed by the kernels: the F.linear path's own
                entmtp_calibrate(model, batch_sizes=calibrate)
        self.ctx = BenchContext(model, tokenizer, model_name=str(args.model or "demo MTP layers"))
        self.settings = BenchSettings(
            tasks=tuple(args.tasks), num_prompts=args.n, max_new_tokens=args.max_new_tokens, preset="custom"
        )
        self.args, self.model, self.eos = args, model, _eos(self.ctx)
        self.counter = _ForwardCounter(model)
        self.configs: dict[str, Any] = {}  # one EntMTP config per task, as a user keeps one: its plan resolved once
        self.bar = tqdm(desc="bench-mtp", unit="gen", total=0, disable=args.no_progress, file=sys.stderr)

    def kwargs(self, method: str, task: str, max_new_tokens: int) -> dict:
        extra = {"plain": {}, "use_mtp": {"use_mtp": True}}.get(method)
        if extra is None:
            if task not in self.configs:
                self.configs[task] = config_for(self.bank_dir, task)
            extra = {"entmtp_config": self.configs[task]}
        return {**_gen_kwargs(self.ctx, self.settings, max_new_tokens), **extra}

    def call(self, ids: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> dict:
        """One timed ``generate``: new tokens per row, seconds, the model's forwards, EntMTP's statistics."""
        self.counter.count = 0
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        elapsed = time.perf_counter() - t0
        rows = out.sequences[:, ids.shape[1] :].tolist()
        stats = getattr(out, "entmtp_stats", None) or {}
        return {"rows": rows, "time_s": elapsed, "forwards": self.counter.count, "stats": stats}

    # ------------------------------------------------------------------ batch size 1
    def single(self, task: str, prompts: list[tuple[str, list[int]]]) -> list[dict]:
        a, tok = self.args, self.args.max_new_tokens
        first = torch.tensor([prompts[0][1]])
        for m in METHODS:
            self.model.generate(first, **self.kwargs(m, task, min(WARMUP_TOKENS, tok)))
        records = []
        for i, (pid, ids) in enumerate(prompts):
            x, runs = torch.tensor([ids]), {m: [] for m in METHODS}
            for r in range(a.repeats):
                for m in rotation(METHODS, i * a.repeats + r):
                    self.bar.set_postfix_str(f"{task} {m}")
                    runs[m].append(self.call(x, None, self.kwargs(m, task, tok)))
                    self.bar.update(1)
            records.append(self.single_record(task, pid, ids, runs))
        return records

    def single_record(self, task: str, pid: str, ids: list[int], runs: dict[str, list[dict]]) -> dict:
        reference = runs["plain"][0]["rows"][0]
        methods: dict[str, Any] = {}
        for m, calls in runs.items():
            new = len(calls[0]["rows"][0])
            mismatch = next(
                (d for c in calls if (d := find_mismatch(reference, c["rows"][0], self.model, ids)) is not None), None
            )
            t = median([c["time_s"] for c in calls])
            rec = {"time_s": t, "times_s": [c["time_s"] for c in calls], "new_tokens": new, "s_per_token": t / new}
            rec |= {"forwards": calls[0]["forwards"], "tokens_per_step": per_step(new, calls[0]["forwards"])}
            rec |= {"identical": mismatch is None, "mismatch": mismatch, "output_ids": calls[0]["rows"][0]}
            stats = calls[0]["stats"]
            if m == "entmtp":
                rec |= {
                    "steps": stats.get("steps"),
                    "tokens_per_step_stats": stats.get("mean_accept_length"),
                    "forwards_match_steps": calls[0]["forwards"] - 1 == stats.get("steps"),
                    "plain_decoding": bool(stats.get("plain_decoding")),
                    "tree_sizes": stats.get("tree_sizes"),
                }
            methods[m] = rec
        ratio = {m: methods[m]["s_per_token"] / methods["entmtp"]["s_per_token"] for m in ("use_mtp", "plain")}
        return {
            "task": task,
            "prompt_id": pid,
            "prompt_tokens": len(ids),
            "speedup_vs_use_mtp": ratio["use_mtp"],
            "speedup_vs_plain": ratio["plain"],
            "use_mtp_vs_plain": methods["plain"]["s_per_token"] / methods["use_mtp"]["s_per_token"],
            "methods": methods,
        }

    # ------------------------------------------------------------------ batch size > 1
    def batched(self, task: str, prompts: list[tuple[str, list[int]]], b: int) -> list[dict]:
        a, tok = self.args, self.args.max_new_tokens
        pad = _gen_kwargs(self.ctx, self.settings, tok)["pad_token_id"]
        groups = [prompts[i : i + b] for i in range(0, len(prompts) - b + 1, b)]
        names = ("plain", "entmtp")
        if groups:
            ids, mask = batch_inputs([p[1] for p in groups[0]], pad, "cpu")
            for m in names:
                self.model.generate(ids, attention_mask=mask, **self.kwargs(m, task, min(WARMUP_TOKENS, tok)))
        records = []
        for g, group in enumerate(groups):
            ids, mask = batch_inputs([p[1] for p in group], pad, "cpu")
            runs = {m: [] for m in names}
            for r in range(a.repeats):
                for m in rotation(names, g * a.repeats + r):
                    self.bar.set_postfix_str(f"{task} B={b} {m}")
                    runs[m].append(self.call(ids, mask, self.kwargs(m, task, tok)))
                    self.bar.update(1)
            records.append(self.batch_record(task, b, g, group, runs))
        return records

    def batch_record(self, task: str, b: int, g: int, group, runs: dict[str, list[dict]]) -> dict:
        rows = {m: [row_tokens(r, self.eos) for r in calls[0]["rows"]] for m, calls in runs.items()}
        new = {m: sum(len(r) for r in rs) for m, rs in rows.items()}
        t = {m: median([c["time_s"] for c in calls]) for m, calls in runs.items()}
        mismatches = [
            {"row": k, **d}
            for c in runs["entmtp"]
            for k, (want, got) in enumerate(zip(rows["plain"], [row_tokens(r, self.eos) for r in c["rows"]]))
            if (d := find_mismatch(want, got, self.model, group[k][1])) is not None
        ]
        stats = runs["entmtp"][0]["stats"]
        return {
            "task": task,
            "batch_size": b,
            "group": g,
            "prompt_ids": [p[0] for p in group],
            "speedup_vs_plain": (t["plain"] / new["plain"]) / (t["entmtp"] / new["entmtp"]),
            "methods": {
                m: {"time_s": t[m], "times_s": [c["time_s"] for c in runs[m]], "new_tokens": new[m]} for m in t
            },
            "entmtp_tokens_per_step_stats": stats.get("mean_accept_length"),
            "entmtp_steps": stats.get("steps"),
            "plain_decoding": bool(stats.get("plain_decoding")),
            "rows_identical": b - len({m["row"] for m in mismatches}),
            "mismatches": mismatches,
        }


def summarize(single: list[dict], batched: list[dict]) -> dict:
    """Per task: the speed-ups' medians and minimum, tokens per step over all of its calls, identity."""
    out: dict[str, Any] = {"single": {}, "batched": {}}
    for task in dict.fromkeys(r["task"] for r in single):
        rs = [r for r in single if r["task"] == task]

        def tps(m: str, rs: list[dict] = rs) -> float:  # over all of the task's calls, as per_step counts
            return sum(r["methods"][m]["new_tokens"] - 1 for r in rs) / sum(r["methods"][m]["forwards"] - 1 for r in rs)

        vs_mtp = [r["speedup_vs_use_mtp"] for r in rs]
        entmtp = [r["methods"]["entmtp"] for r in rs]
        out["single"][task] = {
            "prompts": len(rs),
            "median_speedup_vs_use_mtp": median(vs_mtp),
            "min_speedup_vs_use_mtp": min(vs_mtp),
            "median_speedup_vs_plain": median([r["speedup_vs_plain"] for r in rs]),
            "median_use_mtp_vs_plain": median([r["use_mtp_vs_plain"] for r in rs]),
            "tokens_per_step": {m: tps(m) for m in METHODS},
            "entmtp_tokens_per_step_stats": sum(e["tokens_per_step_stats"] * e["steps"] for e in entmtp if e["steps"])
            / sum(e["steps"] for e in entmtp),
            "entmtp_forwards_match_steps": all(e["forwards_match_steps"] for e in entmtp),
            "differing_prompts": {m: sum(not r["methods"][m]["identical"] for r in rs) for m in ("use_mtp", "entmtp")},
            "bar_met": median(vs_mtp) >= BAR_MEDIAN and min(vs_mtp) >= BAR_MIN,
            "prompts_below_1x": sum(x < 1.0 for x in vs_mtp),
        }
    for task, b in dict.fromkeys((r["task"], r["batch_size"]) for r in batched):
        rs = [r for r in batched if (r["task"], r["batch_size"]) == (task, b)]
        out["batched"].setdefault(task, {})[str(b)] = {
            "batches": len(rs),
            "median_speedup_vs_plain": median([r["speedup_vs_plain"] for r in rs]),
            "min_speedup_vs_plain": min(r["speedup_vs_plain"] for r in rs),
            "entmtp_tokens_per_step_stats": median([r["entmtp_tokens_per_step_stats"] or 0.0 for r in rs]),
            "rows": b * len(rs),
            "rows_identical": sum(r["rows_identical"] for r in rs),
            "plain_decoding_calls": sum(r["plain_decoding"] for r in rs),
        }
    return out


def table(results: dict) -> str:
    """summary.md: the batch-size-1 comparison and the batched one, with the machine and the settings."""
    s, summary = results["settings"], results["summary"]
    lines = [
        "# EntMTP against `generate(use_mtp=True)` on the same MTP layers",
        "",
        f"Machine: {machine_line(results['environment'])}.",
        "",
        f"Model {results['model']}, banks {results['banks']}; {s['n']} held-out prompts per task, greedy, "
        f"{s['max_new_tokens']} new tokens, methods interleaved, median of {s['repeats']} call(s) per prompt. "
        f"EntMTP on {KERNELS_TEXT[s.get('cpu_kernels', True)]}; plain `generate` and `use_mtp=True` on `F.linear`. "
        "Speed-ups per prompt in time per new token; tokens per step = (new tokens - 1) / (forwards - 1).",
        "",
        "| task | prompts | EntMTP / use_mtp (median) | min | EntMTP / plain | use_mtp / plain "
        "| tokens/step EntMTP | tokens/step use_mtp | identical to plain | prompts below 1.0x |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, v in summary["single"].items():
        tps, diff = v["tokens_per_step"], v["differing_prompts"]
        same = "yes" if not any(diff.values()) else f"no (use_mtp {diff['use_mtp']}, EntMTP {diff['entmtp']} differ)"
        lines.append(
            f"| {task} | {v['prompts']} | {v['median_speedup_vs_use_mtp']:.2f}x | {v['min_speedup_vs_use_mtp']:.2f}x "
            f"| {v['median_speedup_vs_plain']:.2f}x | {v['median_use_mtp_vs_plain']:.2f}x | {tps['entmtp']:.2f} "
            f"| {tps['use_mtp']:.2f} | {same} | {v['prompts_below_1x']} |"
        )
    lines.append("")
    if results.get("use_mtp_load_ms") is not None:
        lines.append(
            f"`use_mtp=True` loads its MTP layers from the checkpoint in every call ({results['use_mtp_load_ms']:.0f} "
            "ms median here), inside its timed calls."
        )
    costs = results.get("drafting_costs")
    if costs:
        d, f = costs["draft_vocab"], costs["full_vocab"]
        lines += [
            "",
            f"Drafting vocabulary ({costs['draft_vocab_rows']} of {costs['vocab_rows']} rows) against the whole "
            "vocabulary, the MTP layers timed on their own (fit: a + b·depth + c·(nodes - 1) ms):",
            "",
            "| scored rows | a | b (per depth) | c (per node) | LM head, 8 nodes |",
            "|---|---|---|---|---|",
        ]
        for label, v in ((costs["draft_vocab_rows"], d), (costs["vocab_rows"], f)):
            a, b, c = v["fit_ms"]
            lines.append(f"| {label} | {a:.2f} | {b:.2f} | {c:.3f} | {v['lm_head_8_nodes_ms']:.2f} ms |")
    if summary["batched"]:
        lines += [
            "",
            "Batches: EntMTP against plain batched `generate` on the same left-padded groups. `use_mtp=True` is "
            "not run here: transformers' MTP decoding takes one prompt per call.",
            "",
            "| task | B | batches | EntMTP / plain batched (median) | min | tokens/step EntMTP | rows identical |",
            "|---|---|---|---|---|---|---|",
        ]
        for task, per_b in summary["batched"].items():
            for b, v in per_b.items():
                lines.append(
                    f"| {task} | {b} | {v['batches']} | {v['median_speedup_vs_plain']:.2f}x "
                    f"| {v['min_speedup_vs_plain']:.2f}x | {v['entmtp_tokens_per_step_stats']:.2f} "
                    f"| {v['rows_identical']}/{v['rows']} |"
                )
    lines += ["", *prompt_lines(results["single"])] if results.get("single") else []
    return "\n".join(lines) + "\n"


def prompt_lines(single: list[dict]) -> list[str]:
    """Batch size 1, prompt by prompt: what the medians above summarize."""
    lines = [
        "Per prompt (seconds of the call, tokens per step):",
        "",
        "| task | prompt | new tokens | plain s | use_mtp s | EntMTP s | tokens/step use_mtp | tokens/step EntMTP "
        "| EntMTP / use_mtp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in single:
        m = r["methods"]
        lines.append(
            f"| {r['task']} | {r['prompt_id']} | {m['entmtp']['new_tokens']} | {m['plain']['time_s']:.2f} "
            f"| {m['use_mtp']['time_s']:.2f} | {m['entmtp']['time_s']:.2f} | {m['use_mtp']['tokens_per_step']:.2f} "
            f"| {m['entmtp']['tokens_per_step']:.2f} | {r['speedup_vs_use_mtp']:.2f}x |"
        )
    return lines


def bank_name(folder: Path) -> str:
    """A shipped bank by its name (``shipped_bank_path``'s), any other by its folder."""
    folder = Path(folder).resolve()
    return f"shipped {folder.name}" if folder.parent == SHIPPED_DIR.resolve() else str(folder)


def mtp_load_ms(model, repeats: int = 5) -> float:
    """The median milliseconds of the loading ``generate(use_mtp=True)`` does in every call (transformers'
    ``MtpModel.from_pretrained`` of the model's checkpoint), which its timed calls include."""
    from transformers.modeling_layers import MtpModel

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        MtpModel.from_pretrained(model, device_map={"": model.device})
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def drafting_costs(model) -> dict[str, Any] | None:
    """What the drafting vocabulary saves: the enabled MTP drafter's fitted drafting ms (``a + b·depth +
    c·(nodes - 1)``, the cost probe's :func:`~entmtp_hf.calibration.probe.draft_fit`, the layers timed on their
    own) over its drafting vocabulary and over the whole vocabulary (``use_mtp=True``'s), and the LM head's
    product alone for 8 nodes over each. None where the drafter scores the whole vocabulary already."""
    heads = getattr(model, HEADS_ATTR)
    if not heads.config.draft_vocab_size:
        return None
    full = MtpHeads.from_model(model, heads.num_heads).to(dtype=model.get_output_embeddings().weight.dtype).eval()
    weight = model.get_output_embeddings().weight
    x = torch.randn(8, weight.shape[1], dtype=weight.dtype)
    subset = weight[heads.draft_vocab].contiguous()
    out: dict[str, Any] = {"draft_vocab_rows": int(heads.config.draft_vocab_size), "vocab_rows": int(weight.shape[0])}
    with torch.no_grad():
        for name, h, w in (("draft_vocab", heads, subset), ("full_vocab", full, weight)):
            (a, b, c), error = draft_fit(model, h)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = {"fit_ms": [a, b, c], "fit_error": error, "lm_head_8_nodes_ms": statistics.median(times)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    baskets = {
        task: [(p.prompt_id, _prompt_ids(bench.ctx, p, bench.settings)) for p in evaluation_basket(task, args.n)]
        for task in args.tasks
    }
    sizes = list(dict.fromkeys(args.batch_sizes))
    bench.bar.total = args.repeats * sum(
        (3 * len(ps) if b == 1 else 2 * (len(ps) // b)) for ps in baskets.values() for b in sizes
    )
    results: dict[str, Any] = {
        "format": "entmtp-hf-bench-mtp",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment(bench.ctx.device),
        "model": bench.ctx.model_name,
        "banks": bank_name(bench.bank_dir),
        "single": [],
        "batched": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # use_mtp=True loads its layers in every call: no loading bar on the clock
    try:
        results["use_mtp_load_ms"] = mtp_load_ms(bench.ctx.model)
        results["drafting_costs"] = drafting_costs(bench.ctx.model)
        with torch.no_grad():  # generate runs without gradients; so do the logit gaps of a difference
            for task, prompts in baskets.items():
                for b in sizes:
                    if b == 1:
                        results["single"] += bench.single(task, prompts)
                    else:
                        results["batched"] += bench.batched(task, prompts, b)
                results["summary"] = summarize(results["single"], results["batched"])
                (args.out / "results.json").write_text(json.dumps(results, indent=1))  # complete tasks survive a stop
    finally:
        bench.bar.close()
        bench.counter.close()
        if bars:
            hf_logging.enable_progress_bar()
    text = table(results)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
