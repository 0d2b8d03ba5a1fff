"""``entmtp-hf bench`` and ``entmtp-hf bench-report``."""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import time
from pathlib import Path

from ..data.tasks import BUILTIN_TASKS
from ..machine import set_threads
from .context import DEFAULT_FAMILY_BANKS, DEFAULT_HEADS, load_context
from .methods import METHODS, chosen_methods, default_method_names
from .settings import DEFAULT_PRESET, PRESETS, BenchSettings


def _settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = "quick" if args.quick else "standard" if args.standard else args.preset
    n, tokens = PRESETS[preset]
    if args.n is not None or args.max_new_tokens is not None:
        n, tokens = args.n or n, args.max_new_tokens or tokens
        named = [name for name, size in PRESETS.items() if size == (n, tokens)]
        preset = named[0] if named else f"custom ({n} prompts x {tokens} tokens)"
    mode = "typical" if args.typical else "sampling" if args.sampling else "greedy"
    settings = BenchSettings(
        tasks=tuple(args.tasks),
        num_prompts=n,
        max_new_tokens=tokens,
        preset=preset,
        mode=mode,
        methods=tuple(args.methods or ()),
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        perplexity=not args.no_perplexity,
    )
    chosen_methods(settings.methods)  # unknown names fail now, before the model is loaded
    return settings


def _bench(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .report import write_report
    from .results import read_results, write_results
    from .runner import run_benchmark

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for module in args.plugin or ():
        importlib.import_module(module)
    settings = _settings_from_args(args)
    set_threads(args.threads)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-{settings.mode}-{stamp}")
    heads = {"hydra": args.hydra_heads, "medusa": args.medusa_heads, "eagle": args.eagle_heads}
    banks = {"eagle": args.eagle_bank}
    t0 = time.perf_counter()
    if args.batch_size:
        return _bench_batched(args, settings, out, heads, banks, t0)
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        ctx = load_context(
            args.model,
            heads=heads,
            random_missing=args.random_heads,
            bank=args.bank,
            family_banks=banks,
            device=args.device,
        )
        ctx.eas_config = args.eas_config
        ctx.bank_tasks = _bank_tasks(args.bank_tasks or [])
        previous = read_results(out / "results.json") if args.resume and (out / "results.json").is_file() else None
        results = run_benchmark(
            ctx, settings, out_path=out / "results.json", resume=previous, progress=not args.no_progress
        )
    results["environment"]["wall_time_s"] = time.perf_counter() - t0
    write_results(results, out / "results.json")
    paths = write_report(out / "results.json", out)
    print(Path(paths["table"]).read_text(encoding="utf-8"))
    if args.regime:
        from ..regime import analyse_results

        analyse_results(results, ctx, out, progress=not args.no_progress)
    print(f"results: {out / 'results.json'}; wall time {time.perf_counter() - t0:.0f} s")
    return 0


def write_batched_report(results: dict, out: Path) -> str:
    """``table.md``, ``summary.json`` and the throughput plot of a batched run; returns the table."""
    from .batched import batched_plot, batched_table, summarize_batched
    from .results import portable

    results["summary"] = summarize_batched(results)
    table = batched_table(results)
    (out / "table.md").write_text(table, encoding="utf-8")
    batched_plot(results, out / "throughput_by_batch_size.png")
    summary = portable(
        {
            "settings": results["settings"],
            "environment": results["environment"],
            "skipped": results["skipped"],
            "summary": results["summary"],
        }
    )  # a record: no machine paths
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    return table


def _bench_batched(
    args: argparse.Namespace, settings: BenchSettings, out: Path, heads: dict, banks: dict, t0: float
) -> int:
    """``--batch-size``: :mod:`~entmtp_hf.tools.bench.batched` instead of the per-prompt runner."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .batched import run_batched, write_batched

    if any(b < 1 for b in args.batch_size):
        raise SystemExit(f"--batch-size: batch sizes must be positive, got {args.batch_size}")
    with logging_redirect_tqdm():
        ctx = load_context(
            args.model,
            heads=heads,
            random_missing=args.random_heads,
            bank=args.bank,
            family_banks=banks,
            device=args.device,
        )
        ctx.batch_sizes = tuple(sorted(set(args.batch_size)))
        results = run_batched(
            ctx, settings, sorted(set(args.batch_size)), progress=not args.no_progress, out_path=out / "results.json"
        )
    results["environment"]["wall_time_s"] = time.perf_counter() - t0
    write_batched(results, out / "results.json")
    print(write_batched_report(results, out))
    print(f"results: {out / 'results.json'}; wall time {time.perf_counter() - t0:.0f} s")
    return 0


def _bench_report(args: argparse.Namespace) -> int:
    from .report import write_report
    from .results import read_json_object

    first = Path(args.results[0] if isinstance(args.results, list) else args.results)
    data = read_json_object(first)
    if data.get("format") == "entmtp-hf-batched-bench":  # `bench --batch-size`: its own table and plot
        out = Path(args.out) if args.out else first.parent
        out.mkdir(parents=True, exist_ok=True)
        print(write_batched_report(data, out))
        return 0

    paths = write_report(args.results, args.out, results_md=args.results_md)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark decoding methods on task baskets (tokens/s, speedup, accept length, ...)",
        description="Run the methods interleaved on per-task prompt baskets; write results.json, "
        "a Table-1 style Markdown table and plots to --out.",
    )
    p.add_argument(
        "--tasks", nargs="+", default=list(BUILTIN_TASKS), help="humaneval, gsm8k, chat, a JSONL file or a Hub dataset"
    )
    size = p.add_mutually_exclusive_group()
    for name in ("quick", "standard"):
        size.add_argument(
            f"--{name}",
            action="store_true",
            help=f"preset {name}: {PRESETS[name][0]} prompts x {PRESETS[name][1]} tokens",
        )
    n, tokens = PRESETS[DEFAULT_PRESET]
    size.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=DEFAULT_PRESET,
        help=f"basket preset (default: {DEFAULT_PRESET}, {n} x {tokens})",
    )
    p.add_argument("--n", type=int, default=None, help="prompts per task (overrides the preset)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (overrides the preset)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help=f"methods to run (default: {' '.join(default_method_names())}); registered: {', '.join(METHODS)}",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sampling", action="store_true", help="T=0.7 sampling, exact (lossless) acceptance")
    mode.add_argument("--typical", action="store_true", help="T=0.7 sampling, typical acceptance (eps 0.09, alpha 0.3)")
    p.add_argument("--model", default=None, help="base model id or folder (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--hydra-heads", default=None, help=f"Hydra heads (default {DEFAULT_HEADS['hydra']})")
    p.add_argument("--medusa-heads", default=None, help=f"Medusa heads (default {DEFAULT_HEADS['medusa']})")
    p.add_argument("--eagle-heads", default=None, help=f"EAGLE-style drafter (default {DEFAULT_HEADS['eagle']})")
    p.add_argument(
        "--eagle-bank",
        default=None,
        help=f"bank of the eagle-* methods, searched with the drafter (default {DEFAULT_FAMILY_BANKS['eagle']})",
    )
    p.add_argument(
        "--random-heads", action="store_true", help="use random heads where trained ones are missing (smoke runs)"
    )
    p.add_argument(
        "--eas-config",
        default=None,
        help="EAS settings (JSON) of the eas-calibrated method; {task} is replaced by the task",
    )
    p.add_argument(
        "--bank-tasks",
        nargs="+",
        default=None,
        metavar="FILE_STEM=TASK",
        help="decode a prompt file's prompts with another bank task (e.g. unseen-code=humaneval)",
    )
    p.add_argument(
        "--bank",
        default=None,
        help="tree bank folder (default: the shipped smollm2-135m-cpu bank, else published-defaults)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice; 1 is far faster on an oversubscribed CPU)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=123,
        help="seed of the sampling draws (prompt i of every method: seed * 100003 + i); it does not "
        "choose the prompts: --n takes the first N of each task's fixed evaluation pool",
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each method's warm-up generation")
    p.add_argument("--no-perplexity", action="store_true", help="skip the response perplexity")
    p.add_argument(
        "--resume", action="store_true", help="keep the complete prompts of --out's results.json, run the rest"
    )
    p.add_argument("--regime", action="store_true", help="also run the regime analysis on the EntMTP records")
    p.add_argument("--plugin", nargs="+", default=None, help="modules to import first (they may register methods)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--batch-size",
        nargs="+",
        type=int,
        default=None,
        metavar="B",
        help="batched decoding instead: total tokens/s per method and batch size (default methods: "
        "vanilla hydra-default entmtp-static entmtp-tau)",
    )
    p.add_argument("--out", default=None, help="output folder (default runs/bench-<mode>-<utc time>)")
    p.set_defaults(func=_bench)


def _add_bench_report(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "bench-report",
        help="tables and plots from a bench results.json",
        description="Regenerate table.md and the PNG plots from RESULTS.json; given several "
        "files (the same basket's tasks split over processes), merge them into --out/results.json "
        "first.",
    )
    r.add_argument("results", nargs="+", help="results.json written by entmtp-hf bench (one or more)")
    r.add_argument("--out", default=None, help="output folder (default: next to RESULTS; required to merge)")
    r.add_argument("--results-md", default=None, help="also write the docs/results.md page to this path")
    r.set_defaults(func=_bench_report)


def _bank_tasks(pairs: list[str]) -> dict[str, str]:
    bad = [p for p in pairs if p.count("=") != 1 or not all(p.split("="))]
    if bad:
        raise ValueError(f"--bank-tasks takes FILE_STEM=TASK pairs, got {bad}")
    return dict(p.split("=") for p in pairs)


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf bench`` and ``entmtp-hf bench-report``."""
    _add_bench(sub)
    _add_bench_report(sub)
