"""``entmtp-hf search``: flags from :class:`~.config.SearchConfig`, then one search per task."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path as FsPath
from typing import Any

import torch

from ...demo import DEMO_HEADS
from ...scheduling.features import FEATURES
from ..machine import set_threads
from .config import RANKINGS, RULES, SCORINGS, TAU_GRID, TIMED_SIZES, SearchConfig
from .outputs import file_search_machine
from .plots import PLOTS
from .result import nodes_text
from .runner import TreeSearch


def _parse_list(text: str, kind: type) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf search``."""
    d = SearchConfig()
    p = sub.add_parser(
        "search",
        help="build a per-task tree bank: acceptance frontier, debias, throughput hull, scheduler sweep",
        description="Offline tree search (docs/search.md). Every stage is checkpointed in --out; rerunning the "
        "same command resumes an interrupted search.",
    )
    p.add_argument(
        "--task",
        required=True,
        help="humaneval | gsm8k | chat | a JSONL file or Hub dataset id; or several, comma-separated",
    )
    p.add_argument(
        "--heads",
        default=None,
        help="heads folder or Hub repo id, or 'mtp': the model's own MTP layers (default: the demo heads if any)",
    )
    p.add_argument(
        "--random-heads",
        type=int,
        default=0,
        metavar="N",
        help="use N randomly initialised Hydra heads (to time the stages before heads exist)",
    )
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="with --random-heads: draft on the first K ids")
    p.add_argument("--model", default=None, help="base model id or folder (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model class --model ships as code (a build-drafter --arch mtp folder, with --heads mtp)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="work folder: checkpoints, bank/, plots, report.md ('{task}' becomes the task name)",
    )
    p.add_argument("--bank-dir", default=None, help="also save the bank into this Hub-style folder")
    p.add_argument("--restart", action="store_true", help="delete this search's checkpoints in --out first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="calibration prompts of the frontier")
    p.add_argument(
        "--timing-prompts",
        type=int,
        default=d.timing_prompts,
        help="how many of them (the first) are timed with generate",
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--budget", type=int, default=d.budget, help="node budget B (root included)")
    p.add_argument("--max-depth", type=int, default=None, help="D (default: number of heads)")
    p.add_argument("--scoring", choices=SCORINGS, default=d.scoring)
    p.add_argument("--acceptance", choices=RULES, default=d.acceptance)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument(
        "--timed-sizes",
        default=",".join(map(str, TIMED_SIZES)),
        help="frontier sizes to time, comma-separated, or 'every' (with --time-every)",
    )
    p.add_argument("--time-every", type=int, default=d.time_every, help="time every k-th frontier size")
    p.add_argument("--no-reference", action="store_true", help="do not time mc_sim_7b_63")
    p.add_argument("--sweep-prompts", type=int, default=d.sweep_prompts)
    p.add_argument("--tau-grid", default=",".join(f"{t:g}" for t in TAU_GRID))
    p.add_argument("--features", default=",".join(d.features), help=f"comma-separated, from {', '.join(FEATURES)}")
    p.add_argument("--no-ladder", action="store_true", help="skip the ladder threshold sweep")
    p.add_argument(
        "--no-retrieval",
        action="store_true",
        help="do not time retrieval branches (the bank's retrieval default stays off)",
    )
    p.add_argument(
        "--ranking",
        choices=RANKINGS,
        default=d.ranking,
        help="choose trees and schedulers by modelled tokens per forward (measured forward costs x "
        "steps; robust to a noisy machine) or by measured tokens/s",
    )
    p.add_argument("--cost-repeats", type=int, default=d.cost_repeats, help="rounds of the forward-cost timing")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=None,
        metavar="B",
        help="then, per batch size: this machine's c(N, B), the best modelled trees timed end to end "
        "on batches of calibration prompts, and a bank entry with the fastest",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_cli)


def config_from_args(args: argparse.Namespace) -> SearchConfig:
    sizes = None if args.timed_sizes.strip() == "every" else _parse_list(args.timed_sizes, int)
    return SearchConfig(
        num_prompts=args.num_prompts,
        timing_prompts=args.timing_prompts,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        max_depth=args.max_depth,
        scoring=args.scoring,
        acceptance=args.acceptance,
        temperature=args.temperature,
        timed_sizes=sizes,
        time_every=args.time_every,
        time_reference=not args.no_reference,
        sweep_prompts=args.sweep_prompts,
        tau_grid=_parse_list(args.tau_grid, float),
        features=_parse_list(args.features, str),
        ladder=not args.no_ladder,
        retrieval=not args.no_retrieval,
        ranking=args.ranking,
        cost_repeats=args.cost_repeats,
        seed=args.seed,
    )


def _load_heads(args: argparse.Namespace, model) -> tuple[Any, str]:
    from ...heads import HydraHeads, MtpHeads, load_heads
    from ..models import DEMO_NAME, heads_source

    if args.random_heads:
        torch.manual_seed(args.seed)
        rows = min(args.draft_vocab_size, model.config.vocab_size)
        heads = HydraHeads.for_model(model, num_heads=args.random_heads, draft_vocab=torch.arange(rows))
        return heads, f"random Hydra heads ({args.random_heads} heads, draft vocab {rows}, seed {args.seed})"
    source = args.heads or (str(DEMO_HEADS) if args.model is None and DEMO_HEADS.is_dir() else None)
    if source is None:
        raise ValueError("give --heads (a folder or Hub repo id) or --random-heads N")
    if source == MtpHeads.family:
        return heads_source(source, model, args.model), f"the MTP layers of {args.model or DEMO_NAME}"
    name = f"entmtp-hf demo heads ({DEMO_HEADS.name})" if FsPath(source).resolve() == DEMO_HEADS else str(source)
    return load_heads(source, model=model, base_config=model.config), name


def _restart(out: FsPath) -> None:
    """Delete this search's own files in ``out`` (nothing else)."""
    if out.is_dir():
        for name in [*TreeSearch.FILES.values(), "result.json", "report.md", *PLOTS]:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "bank", ignore_errors=True)


def run_cli(args: argparse.Namespace) -> int:
    """Load the model and heads once, then search every task of ``--task`` (comma-separated) in turn."""
    from ...integration import enable_entmtp
    from ..models import DEMO_NAME, load_base_model

    config = config_from_args(args)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    if len(tasks) > 1 and "{task}" not in args.out:
        raise ValueError("with several tasks, --out must contain '{task}', e.g. runs/search-{task}")
    set_threads(args.threads)
    model, tokenizer = load_base_model(args.model, trust_remote_code=args.trust_remote_code)
    heads, heads_name = _load_heads(args, model)
    enable_entmtp(model, heads)
    search_tasks(
        model,
        tokenizer,
        tasks,
        args.out,
        config,
        heads_name=heads_name,
        base_model=args.model or DEMO_NAME,
        bank_dir=args.bank_dir,
        restart=args.restart,
        progress=not args.no_progress,
        batch_sizes=args.batch_sizes,
    )
    return 0


def search_tasks(
    model,
    tokenizer,
    tasks: list[str],
    out: str,
    config: SearchConfig,
    *,
    heads_name: str,
    base_model: str,
    bank_dir: str | None = None,
    restart: bool = False,
    progress: bool = True,
    batch_sizes: list[int] | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Search each task in turn with the heads ``model`` is enabled with: the work folder ``out``
    (``{task}`` becomes the task's name), the bank into ``out/bank`` and ``bank_dir``, this
    machine's entry filed in both. ``deadline`` (a ``time.perf_counter()`` time): a search stops
    after its next checkpoint once past it (:class:`~entmtp_hf.tools.checkpoint.OutOfTime`).
    Returns each task's :class:`~.result.SearchResult`."""
    from ...calibration import calibrate
    from ...integration import HEADS_ATTR

    results = {}
    for task in tasks:
        folder = FsPath(out.replace("{task}", FsPath(task).stem))
        if restart:
            _restart(folder)
        search = task_search(
            model,
            tokenizer,
            task,
            folder,
            config,
            heads_name=heads_name,
            base_model=base_model,
            progress=progress,
            deadline=deadline,
        )
        result = search.run(bank_dir)
        seconds = json.dumps({k: round(v) for k, v in result.elapsed.items()})
        nodes = result.timed[result.labels[result.choice.static]]["num_nodes"]
        print(f"{search.task}: EntMTP* = {nodes_text(nodes)}; stage seconds {seconds}; outputs in {folder}", flush=True)
        folders = [folder / "bank", *([FsPath(bank_dir)] if bank_dir else [])]
        file_search_machine(folders, search.task, calibrate(model, getattr(model, HEADS_ATTR), progress=progress)[1])
        if batch_sizes:
            from ..calibrate import time_batch_sizes

            timed = time_batch_sizes(
                model,
                getattr(model, HEADS_ATTR),
                tokenizer,
                folders,
                search.task,
                sorted(set(batch_sizes)),
                prompt_source=task,
            )
            (folder / "batch_sizes.json").write_text(json.dumps(timed, indent=1, default=str), encoding="utf-8")
            for b, r in timed.items():
                print(
                    f"{search.task} B={b}: tree {r['static']} "
                    f"({r['trees'].get(r['static'], {}).get('num_nodes', 1)} nodes)"
                    f"; measured {json.dumps({k: round(v['measured'], 2) for k, v in r['trees'].items()})}",
                    flush=True,
                )
        results[search.task] = result
    return results


def task_search(
    model,
    tokenizer,
    task: str,
    folder: str | FsPath,
    config: SearchConfig,
    *,
    heads_name: str,
    base_model: str,
    progress: bool = True,
    deadline: float | None = None,
) -> TreeSearch:
    """The search of ``task`` (a built-in task, or a JSONL file named by its stem) in ``folder``
    with the heads ``model`` is enabled with, on the task's rendered calibration prompts: what
    ``entmtp-hf search`` runs, and what reads its checkpoints back (the same settings)."""
    from ...integration import HEADS_ATTR
    from ..data.tasks import calibration_prompts

    prompts = calibration_prompts(task, config.num_prompts)
    return TreeSearch(
        model,
        getattr(model, HEADS_ATTR),
        [p.render(tokenizer) for p in prompts],
        folder,
        config,
        task=task_name(task),
        prompt_ids=[p.prompt_id for p in prompts],
        info={"base_model": base_model, "heads": heads_name},
        progress=progress,
        deadline=deadline,
    )


def task_name(task: str) -> str:
    """The bank's name for ``task``: a JSONL file's stem, else the task as given."""
    return FsPath(task).stem if FsPath(task).exists() else task
