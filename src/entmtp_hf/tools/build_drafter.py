"""``entmtp-hf build-drafter``: from a base model to a drafter and its tree banks in one command.

The stages run in order, each resumable, and a stage already done is skipped when the same
command runs again (docs/your-model.md):

1. ``data``: the model's own greedy answers (:func:`~entmtp_hf.tools.data.distill.distill`) in ``WORK/data``;
2. ``train``: a drafter (EAGLE-3 by default, the layout serving engines load) over a pruned drafting vocabulary
   (:func:`~entmtp_hf.tools.training.train_heads`; checkpoints in ``WORK/train``, heads in ``WORK/heads``); with
   ``--arch mtp``, MTP layers saved with the model in transformers' native layout (``WORK/heads`` is then the
   model folder that ``generate(use_mtp=True)`` runs, :mod:`~entmtp_hf.tools.training.mtp_layout`);
3. ``search``: one bank per task (:func:`~entmtp_hf.tools.search.cli.search_tasks`; ``WORK/search/TASK``,
   banks in ``WORK/banks``);
4. ``calibrate``: each bank's whole acceptance frontier from the search's checkpoints, ranked
   for this machine (:func:`~entmtp_hf.tools.calibrate.calibrate`), into ``OUT/banks``;
5. ``publish``: the heads into ``OUT`` (beside ``OUT/banks``), and to the Hub with ``--push-to-hub``.

``WORK/build-drafter.json`` records each stage's arguments, whether it is done, the wall time
of every call and a one-line summary. A finished stage run again with other arguments is
refused (``--redo STAGE`` runs it and every later stage anew); ``--budget-minutes`` gives each
stage a share of the call, and a stage out of time stops at a checkpoint (exit status 3) that
the next call resumes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from .checkpoint import OutOfTime, check_deadline, json_safe, read_json, write_json

STAGES = ("data", "train", "search", "calibrate", "publish")
#: each stage's share of ``--budget-minutes``; a stage may also use what the stages before it left
SHARES = {"data": 0.3, "train": 0.4, "search": 0.25, "calibrate": 0.05, "publish": 0.0}
STATE_NAME = "build-drafter.json"
STATE_FORMAT = 1
#: the exit status of a call that stopped at its budget with stages left (the same command continues)
EXIT_UNFINISHED = 3
#: drafting vocabulary sizes whose coverage of held-out answers the data stage reports
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class BuildOptions:
    """What ``entmtp-hf build-drafter`` is given; every field is a flag of the same name."""

    model: str
    work_dir: str
    out: str
    tasks: tuple[str, ...] = ("humaneval", "gsm8k", "chat")
    # data: the model's own answers
    data_sources: tuple[str, ...] = ("math", "code", "chat")
    data_prompts: int = 3000
    data_new_tokens: int = 256
    data_max_prompt_tokens: int = 512
    data_batch_size: int = 32
    data_dtype: str = "float32"
    data_from: str | None = None
    # train: the drafter (EAGLE-3 by default: the layout the serving engines load)
    arch: str = "eagle3"
    depth: int = 5
    #: eagle3: the three fused base states (default 2, L/2, L-3); eagle: further states besides the last
    feature_layers: tuple[int, ...] = ()
    mtp_layers: int = 1
    draft_vocab_size: int = 8192
    train_tokens: int = 800_000
    train_epochs: int = 2
    train_steps: int | None = None
    batch_tokens: int = 1024
    lr: float = 1e-3
    warmup_steps: int = 30
    teacher_dtype: str = "float32"
    #: a filled teacher cache whose rows are copied (not part of the stage's arguments: a copied row
    #: equals a recomputed one up to the rounding of another batch shape)
    reuse_cache: str | None = None
    mixed_precision: str = "no"
    tau_prompts: int = 4
    # search: one bank per task
    search_prompts: int = 16
    timing_prompts: int = 4
    search_new_tokens: int = 128
    timed_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    nodes: int = 64
    cost_repeats: int = 30
    # the call
    seed: int = 0
    threads: int | None = None
    budget_minutes: float | None = None
    redo: str | None = None
    push_to_hub: str | None = None
    banks_repo: str | None = None
    progress: bool = True
    command: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.tasks, self.data_sources = tuple(self.tasks), tuple(self.data_sources)
        self.timed_sizes = tuple(int(n) for n in self.timed_sizes)
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if self.feature_layers:  # refused now, not after the hours of the data stage
            from .training.config import TrainConfig

            try:
                TrainConfig(arch=self.arch, feature_layers=self.feature_layers, tau_prompts=0)
            except ValueError as e:
                raise ValueError(f"--feature-layers: {e}") from None
        if not self.tasks:
            raise ValueError("--tasks names no task")
        if self.redo is not None and self.redo not in STAGES:
            raise ValueError(f"--redo must name a stage of {STAGES}, got {self.redo!r}")
        if self.budget_minutes is not None and self.budget_minutes <= 0:
            raise ValueError(f"--budget-minutes must be > 0, got {self.budget_minutes}")
        if self.timing_prompts > self.search_prompts:
            raise ValueError(
                f"--timing-prompts ({self.timing_prompts}) must not exceed --search-prompts "
                f"({self.search_prompts}): the timed prompts are the first calibration prompts"
            )
        from .training.config import TAU_TREE_DEPTH

        if self.tau_prompts > 0 and self.depth < TAU_TREE_DEPTH:
            raise ValueError(
                f"--tau-prompts checks the drafter with mc_sim_7b_63, a tree of depth {TAU_TREE_DEPTH}, "
                f"deeper than --depth {self.depth}: use --depth {TAU_TREE_DEPTH} or more, or --tau-prompts 0"
            )
        if self.arch == "mtp" and (isinstance(self.mtp_layers, bool) or self.mtp_layers < 1):
            raise ValueError(f"--mtp-layers must be >= 1, got {self.mtp_layers}")
        if not any(n <= self.nodes for n in self.timed_sizes):
            raise ValueError(f"--timed-sizes {list(self.timed_sizes)} has no size within --nodes {self.nodes}")

    def stage_args(self) -> dict[str, dict[str, Any]]:
        """What each stage's result depends on (a finished stage run with others is refused)."""
        d = asdict(self)

        def pick(*names: str) -> dict[str, Any]:
            return {"model": self.model, **{n: d[n] for n in names}}

        return {
            "data": pick(
                "data_sources",
                "data_prompts",
                "data_new_tokens",
                "data_max_prompt_tokens",
                "data_dtype",
                "data_from",
                "seed",
            ),
            "train": pick(
                "arch",
                "depth",
                "draft_vocab_size",
                "train_tokens",
                "train_epochs",
                "train_steps",
                "batch_tokens",
                "lr",
                "warmup_steps",
                "teacher_dtype",
                "mixed_precision",
                "tau_prompts",
                "seed",
                *(("mtp_layers",) if self.arch == "mtp" else ()),  # runs of the other archs keep their arguments
                *(("feature_layers",) if self.feature_layers else ()),  # runs with the default layers keep theirs
            ),
            "search": pick(
                "tasks",
                "search_prompts",
                "timing_prompts",
                "search_new_tokens",
                "timed_sizes",
                "nodes",
                "cost_repeats",
                "seed",
            ),
            "calibrate": pick("tasks", "nodes", "out"),  # it writes OUT/banks
            "publish": pick("out", "push_to_hub", "banks_repo"),
        }


@dataclass(frozen=True)
class Layout:
    """Where every stage reads and writes."""

    work: Path
    out: Path

    @property
    def state(self) -> Path:
        return self.work / STATE_NAME

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def train(self) -> Path:
        return self.work / "train"

    @property
    def heads(self) -> Path:
        return self.work / "heads"

    @property
    def search(self) -> Path:
        return self.work / "search"

    @property
    def banks(self) -> Path:
        """The searched banks (this machine's entry filed by the search), before the calibration."""
        return self.work / "banks"

    @property
    def out_banks(self) -> Path:
        return self.out / "banks"

    def outputs(self, stage: str) -> list[Path]:
        """What a stage writes (deleted when it is redone)."""
        return {
            "data": [self.data],
            "train": [self.train, self.heads],
            "search": [self.search, self.banks],
            "calibrate": [self.out_banks],
            "publish": [],
        }[stage]


class BuildState:
    """The JSON state file: per stage its arguments, ``done``, the wall time of each call, a summary."""

    def __init__(self, path: Path):
        self.path = path
        self.data = read_json(path) or {"format": STATE_FORMAT, "stages": {}}
        if self.data.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: state format {self.data.get('format')!r}, this version reads {STATE_FORMAT}")

    def stage(self, name: str) -> dict[str, Any]:
        return self.data["stages"].get(name, {})

    def done(self, name: str) -> bool:
        return bool(self.stage(name).get("done"))

    def check(self, wanted: dict[str, dict[str, Any]], redo: str | None) -> None:
        """Refuse a recorded stage (before ``redo``) whose arguments differ from this call's."""
        for name in STAGES:
            if redo is not None and STAGES.index(name) >= STAGES.index(redo):
                return
            old = self.stage(name).get("args")
            if old is None:
                continue
            new = json.loads(json.dumps(wanted[name]))  # tuples as lists, as stored
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if diff:
                changes = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff)
                raise ValueError(
                    f"{self.path}: stage {name!r} was {'run' if self.done(name) else 'started'} with other arguments "
                    f"({changes}); pass the same arguments to continue, or --redo {name} to run it and the later "
                    "stages anew"
                )

    def reset(self, first: str) -> None:
        for name in STAGES[STAGES.index(first) :]:
            self.data["stages"].pop(name, None)
        self.save()

    def record(
        self, name: str, args: dict[str, Any], seconds: float, done: bool, result: dict[str, Any], summary: str
    ) -> None:
        entry = self.data["stages"].setdefault(name, {"calls": []})
        entry["calls"].append(
            {"seconds": round(seconds, 1), "finished": done, "ended": time.strftime("%Y-%m-%d %H:%M:%S")}
        )
        entry.update(
            args=args,
            done=done,
            seconds=round(sum(c["seconds"] for c in entry["calls"]), 1),
            result=json_safe(result),
            summary=summary,
        )  # NaN (e.g. no held-out data) as null
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


class _Build:
    """One call of the pipeline: the options, the folders, the model (loaded once, when a stage needs it)."""

    def __init__(self, opts: BuildOptions, state: BuildState):
        self.opts, self.paths, self.state = opts, Layout(Path(opts.work_dir), Path(opts.out)), state
        self._loaded: tuple[Any, Any] | None = None
        self._heads_enabled = False

    def loaded(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from .models import load_base_model

            self._loaded = load_base_model(self.opts.model)
        return self._loaded

    def with_heads(self) -> tuple[Any, Any]:
        """The model with the trained heads enabled (MTP layers: the model saved with them, loaded as a user
        loads it, drafting with the settings saved beside them)."""
        from ..heads import load_heads
        from ..integration import enable_entmtp

        if self._heads_enabled:
            return self.loaded()
        if self.opts.arch == "mtp":
            from .training.mtp_layout import load_mtp_checkpoint, mtp_drafter

            model, tokenizer = load_mtp_checkpoint(self.paths.heads)
            tokenizer = tokenizer if tokenizer is not None else self.loaded()[1]
            enable_entmtp(model, mtp_drafter(model, self.paths.heads))
            self._loaded = (model, tokenizer)
        else:
            model, tokenizer = self.loaded()
            enable_entmtp(model, load_heads(str(self.paths.heads), base_config=model.config))
        self._heads_enabled = True
        return model, tokenizer

    # ------------------------------------------------------------------ 1. data
    def data(self, deadline: float | None) -> tuple[bool, dict[str, Any], str]:
        from .data.distill import DistillConfig, distill

        o = self.opts
        if o.data_from is not None:
            return self._data_from(Path(o.data_from))
        cfg = DistillConfig(
            self.paths.data,
            o.model,
            o.data_batch_size,
            max_new_tokens=o.data_new_tokens,
            max_prompt_tokens=o.data_max_prompt_tokens,
            limit=o.data_prompts,
            sources=o.data_sources,
            seed=1234 + o.seed,
            dtype=o.data_dtype,
        )
        model, tokenizer = self.loaded() if o.data_dtype == "float32" else (None, None)
        ran = distill(cfg, model, tokenizer, deadline=deadline, progress=o.progress)
        answers = _answers(self.paths.data)
        tokens = sum(len(a) for a in answers)
        result = {**ran, "answers": len(answers), "answer_tokens": tokens, "vocab_coverage": vocab_coverage(answers)}
        cover = ", ".join(f"{k}: {v:.3f}" for k, v in result["vocab_coverage"].items())
        return (
            ran["complete"],
            result,
            f"{len(answers)} answers, {tokens} answer tokens; held-out coverage by "
            f"drafting vocabulary size {{{cover}}}",
        )

    def _data_from(self, source: Path) -> tuple[bool, dict[str, Any], str]:
        """The data stage on answers the model gave before (``--data-from``): their records copied in."""
        copied = copy_records(source, self.paths.data, vocab_size=self.loaded()[0].config.get_text_config().vocab_size)
        answers = _answers(self.paths.data)
        tokens = sum(len(a) for a in answers)
        result = {
            "from": str(source),
            "files": copied,
            "answers": len(answers),
            "answer_tokens": tokens,
            "vocab_coverage": vocab_coverage(answers),
        }
        return True, result, f"{len(answers)} answers, {tokens} answer tokens, copied from {source}"

    # ------------------------------------------------------------------ 2. train
    def train(self, deadline: float | None) -> tuple[bool, dict[str, Any], str]:
        from .training import TrainConfig, train_heads

        o = self.opts
        cfg = TrainConfig(
            model=o.model,
            arch=o.arch,
            num_heads=o.depth,
            num_layers=o.mtp_layers if o.arch == "mtp" else 1,
            feature_layers=o.feature_layers,
            draft_vocab_size=o.draft_vocab_size,
            work_dir=str(self.paths.train),
            run_name="drafter",
            output=str(self.paths.heads),
            distill_dir=str(self.paths.data),
            sources=("distill",),
            max_tokens=o.train_tokens,
            distill_share=1.0,
            batch_tokens=o.batch_tokens,
            epochs=o.train_epochs,
            max_steps=o.train_steps,
            lr=o.lr,
            warmup_steps=o.warmup_steps,
            teacher_dtype=o.teacher_dtype,
            reuse_cache=o.reuse_cache,
            mixed_precision=o.mixed_precision,
            eval_every=0,
            tau_prompts=o.tau_prompts,
            seed=o.seed,
        )
        model, tokenizer = self.loaded()
        minutes = None if deadline is None else max(1e-3, (deadline - time.perf_counter()) / 60)
        summary = train_heads(
            cfg,
            model,
            tokenizer,
            resume=True,
            max_minutes=minutes,
            measure=o.tau_prompts > 0,
            command=o.command,
            progress=o.progress,
        )
        done = summary["steps"] >= summary["total_steps"]
        val = summary["validation"]
        result = {
            k: summary.get(k)
            for k in (
                "steps",
                "total_steps",
                "train_seconds",
                "train_tokens_per_s",
                "draft_vocab_size",
                "draft_vocab_val_coverage",
                "weights_bytes",
            )
        }
        result["top1"] = val.get("top1")
        tau = (summary.get("tau_mc_sim_7b_63") or {}).get("mean_accept_length")
        result["tau_mc_sim_7b_63"] = tau
        top1 = " / ".join(f"{x:.3f}" for x in val.get("top1", []))
        vocab = summary["draft_vocab_size"] or "the whole vocabulary"
        text = (
            f"{summary['steps']} of {summary['total_steps']} steps, drafting vocabulary {vocab} "
            f"(held-out coverage {summary['draft_vocab_val_coverage']:.3f}), top-1 by "
            f"{'MTP layer' if o.arch == 'mtp' else 'depth'} {top1}" + (f", tau {tau:.2f}" if tau else "")
        )
        return done, result, text

    # ------------------------------------------------------------------ 3. search
    def search_config(self):
        from .search.config import SearchConfig

        o = self.opts
        return SearchConfig(
            num_prompts=o.search_prompts,
            timing_prompts=o.timing_prompts,
            max_new_tokens=o.search_new_tokens,
            budget=o.nodes,
            timed_sizes=tuple(n for n in o.timed_sizes if n <= o.nodes),
            time_reference=False,
            sweep_prompts=min(3, o.timing_prompts),
            cost_repeats=o.cost_repeats,
            seed=o.seed,
        )

    def _search_info(self) -> dict[str, str]:
        from .models import base_model_id

        return {
            "heads_name": self.opts.push_to_hub or f"build-drafter heads ({Path(self.opts.out).name})",
            "base_model": base_model_id(self.opts.model),
        }

    def search(self, deadline: float | None) -> tuple[bool, dict[str, Any], str]:
        from .search.cli import search_tasks, task_name
        from .search.result import nodes_text

        model, tokenizer = self.with_heads()
        done = dict((self.state.stage("search").get("result") or {}).get("tasks", {}))  # tasks of earlier calls
        try:
            for task in self.opts.tasks:
                if task_name(task) in done:
                    continue
                check_deadline(deadline, f"search, before task {task}")
                result = search_tasks(
                    model,
                    tokenizer,
                    [task],
                    str(self.paths.search / "{task}"),
                    self.search_config(),
                    bank_dir=str(self.paths.banks),
                    progress=self.opts.progress,
                    deadline=deadline,
                    **self._search_info(),
                )[task_name(task)]
                static = result.timed[result.labels[result.choice.static]]
                done[task_name(task)] = {
                    "entmtp_star_nodes": static["num_nodes"],
                    "stage_seconds": {k: round(v, 1) for k, v in result.elapsed.items()},
                }
        except OutOfTime as stop:
            return False, {"tasks": done}, f"{len(done)} of {len(self.opts.tasks)} tasks searched; {stop}"
        text = "; ".join(f"{t}: EntMTP* {nodes_text(r['entmtp_star_nodes'])}" for t, r in done.items())
        return True, {"tasks": done}, text

    # ------------------------------------------------------------------ 4. calibrate
    def calibrate(self, deadline: float | None) -> tuple[bool, dict[str, Any], str]:
        from .calibrate import calibrate, calibrate_options
        from .search.cli import task_name, task_search
        from .search.result import nodes_text

        o = self.opts
        model, tokenizer = self.with_heads()
        info = self._search_info()
        searches = {
            task_name(t): task_search(
                model, tokenizer, t, self.paths.search / task_name(t), self.search_config(), progress=o.progress, **info
            )
            for t in o.tasks
        }
        args = calibrate_options(
            self.paths.banks,
            self.paths.out_banks,
            tasks=list(searches),
            frontier=True,
            threads=o.threads,
            num_prompts=o.search_prompts,
            max_new_tokens=o.search_new_tokens,
            budget=o.nodes,
        )
        report = calibrate(args, loaded=(model, tokenizer), searches=searches)
        chosen = {t: r.get("num_nodes") for t, r in report["tasks"].items()}
        text = "this machine's EntMTP*: " + ", ".join(f"{t} {nodes_text(n)}" for t, n in chosen.items())
        return True, {"entmtp_star_nodes": chosen, "probe_seconds": report.get("probe_seconds")}, text

    # ------------------------------------------------------------------ 5. publish
    def publish(self, deadline: float | None) -> tuple[bool, dict[str, Any], str]:
        from .training.mtp_layout import is_mtp_checkpoint, link_or_copy

        out, mtp = self.paths.out, is_mtp_checkpoint(self.paths.heads)
        out.mkdir(parents=True, exist_ok=True)
        copied = []
        for f in sorted(self.paths.heads.iterdir()):
            if f.is_file():
                (out / f.name).unlink(missing_ok=True)
                (link_or_copy if mtp else shutil.copy2)(f, out / f.name)  # MTP layers: the base weights too
                copied.append(f.name)
        if mtp:
            served = (
                "transformers' generate(use_mtp=True) (trust_remote_code=True) and EntMTP (enable_entmtp(model, 'mtp'))"
            )
        else:
            from ..heads import DraftHeads
            from .export_heads import serving

            served = serving(DraftHeads.from_pretrained(out))
        banks = sorted(p.stem for p in self.paths.out_banks.glob("*.safetensors"))
        result: dict[str, Any] = {"files": copied, "banks": banks, "serves_in": served}
        text = f"heads in {out}, banks in {self.paths.out_banks}; serves in {served}"
        if self.opts.push_to_hub:
            result["hub"] = push_to_hub(out, self.opts.push_to_hub, self.opts.banks_repo)
            text += f"; pushed to {result['hub']['heads']} and {result['hub']['banks']}"
        return True, result, text


def push_to_hub(out: Path, repo: str, banks_repo: str | None = None) -> dict[str, str]:
    """The heads in ``out`` to the Hub repo ``repo`` (MTP layers: the model folder, banks aside), and every
    bank of ``out/banks`` to ``banks_repo`` (default ``REPO-banks``: a bank repo's model card is its README,
    as is the heads')."""
    from ..banks.bank import TopologyBank, list_local_tasks
    from ..heads import DraftHeads
    from .training.mtp_layout import is_mtp_checkpoint

    banks_repo = banks_repo or f"{repo}-banks"
    if is_mtp_checkpoint(out):
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(out), ignore_patterns=["banks/*", STATE_NAME])
    else:
        DraftHeads.from_pretrained(out).push_to_hub(repo)
    for task in list_local_tasks(out / "banks"):
        TopologyBank.from_pretrained(out / "banks", task=task).push_to_hub(banks_repo)
    return {"heads": repo, "banks": banks_repo}


def copy_records(source: Path, dest: Path, vocab_size: int) -> list[str]:
    """Copy the self-distilled records of ``source`` (``distill-*.jsonl``, and the disjointness report
    beside them if any) into ``dest``, after checking each line is a record of a model with
    ``vocab_size`` tokens; a file that is not is refused by name before anything is copied."""
    from .training.teacher import read_distill

    files = sorted(source.glob("distill-*.jsonl")) if source.is_dir() else []
    if not files:
        raise FileNotFoundError(f"--data-from {source}: no distill-*.jsonl records there (the data stage's files)")
    try:
        records = read_distill(source)[0]
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--data-from {source}: a line is not JSON ({exc})") from exc
    for where, record in records:
        ids = (record.get("prompt_ids"), record.get("response_ids")) if isinstance(record, dict) else (None, None)
        if not all(isinstance(x, list) and all(isinstance(t, int) and 0 <= t < vocab_size for t in x) for x in ids):
            raise ValueError(
                f"--data-from {source / where.split(':')[0]} line {int(where.split(':')[1]) + 1}: not a "
                f"record of this model (prompt_ids and response_ids: lists of ids below {vocab_size})"
            )
    dest.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in files] + (["disjointness.json"] if (source / "disjointness.json").is_file() else [])
    for name in names:
        shutil.copy2(source / name, dest / name)
    return names


def _answers(folder: Path) -> list[list[int]]:
    """The answer token ids of every complete distilled record in ``folder``."""
    from .training.teacher import read_distill

    return [r["response_ids"] for _, r in read_distill(folder)[0]] if folder.is_dir() else []


def vocab_coverage(answers: list[list[int]], sizes: tuple[int, ...] = COVERAGE_SIZES) -> dict[int, float]:
    """For each drafting vocabulary size k: the share of held-out answer tokens (every tenth
    answer) among the k ids most frequent in the other answers, which is how the drafter's
    vocabulary is chosen (``train_heads`` counts the base model's greedy tokens instead)."""
    held = [t for i, a in enumerate(answers) if i % 10 == 9 for t in a]
    counts = Counter(t for i, a in enumerate(answers) if i % 10 != 9 for t in a)
    ranked = [t for t, _ in counts.most_common()]
    out = {}
    for k in sizes:
        top = set(ranked[:k])
        out[k] = round(sum(t in top for t in held) / len(held), 4) if held else float("nan")
        if k >= len(ranked):
            break
    return {k: v for k, v in out.items() if v == v}


def _deadlines(start: float, budget_minutes: float | None) -> dict[str, float | None]:
    """Each stage's deadline: the call's start plus its share and every earlier stage's, so time an
    earlier stage left (or did not need, being done) passes on."""
    if budget_minutes is None:
        return {s: None for s in STAGES}
    total, out = 0.0, {}
    for s in STAGES:
        total += SHARES[s]
        out[s] = start + 60 * budget_minutes * total
    return out


def build_drafter(opts: BuildOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) every stage not done yet; returns the state. A stage out of its time share
    stops at a checkpoint and the later stages wait for the next call (``state["complete"]`` False)."""
    from .machine import set_threads

    paths = Layout(Path(opts.work_dir), Path(opts.out))
    paths.work.mkdir(parents=True, exist_ok=True)
    state = BuildState(paths.state)
    wanted = opts.stage_args()
    state.check(wanted, opts.redo)
    if opts.redo is not None:
        for name in STAGES[STAGES.index(opts.redo) :]:
            for path in paths.outputs(name):
                shutil.rmtree(path, ignore_errors=True)
        state.reset(opts.redo)
    set_threads(opts.threads)
    build, start = _Build(opts, state), time.perf_counter()
    deadlines = _deadlines(start, opts.budget_minutes)
    complete = True
    for i, name in enumerate(STAGES, 1):
        if state.done(name):
            seconds = state.stage(name)["seconds"]
            log(f"[build-drafter] {i}/{len(STAGES)} {name}: done earlier ({seconds:.0f} s), skipped")
            continue
        if deadlines[name] is not None and time.perf_counter() > deadlines[name]:
            log(f"[build-drafter] {i}/{len(STAGES)} {name}: no time left in this call's budget")
            complete = False
            break
        log(f"[build-drafter] {i}/{len(STAGES)} {name} ...")
        t0 = time.perf_counter()
        done, result, text = getattr(build, name)(deadlines[name])
        seconds = time.perf_counter() - t0
        state.record(name, wanted[name], seconds, done, result, text)
        total = state.stage(name)["seconds"]
        status = "done" if done else "stopped at its time share (run the same command again to continue)"
        log(f"[build-drafter] {name}: {status}; {seconds:.0f} s this call, {total:.0f} s in all: {text}")
        if not done:
            complete = False
            break
    state.data["complete"] = complete
    state.save()
    if complete:
        write_json(paths.out / STATE_NAME, state.data)  # provenance beside the heads and banks
        use = (
            f"load_demo(model={str(paths.out)!r}, heads='mtp')"
            if opts.arch == "mtp"
            else f"load_demo(model={opts.model!r}, heads={str(paths.out)!r})"
        )
        log(f"[build-drafter] drafter in {paths.out}, banks in {paths.out_banks}: {use}")
    return state.data


# ============================================================================ CLI
_HELP = {
    "model": "base model: a demo model's name (gemma-3-270m, smollm2-135m-instruct), a Hub id or a local folder",
    "work_dir": "folder of every stage's checkpoints and the state file (rerun the same command to resume)",
    "out": "the result: the drafter's heads, and its banks in OUT/banks",
    "tasks": "comma-separated tasks to search a bank for: humaneval, gsm8k, chat or JSONL files",
    "data_sources": "comma-separated prompt pools answered by the model: math, code, chat",
    "data_prompts": "prompts answered (the data stage's size)",
    "data_new_tokens": "tokens per answer at most",
    "data_max_prompt_tokens": "longer prompts are skipped",
    "data_batch_size": "prompts answered per batch",
    "data_dtype": "precision of the answering model: float32 or bfloat16 (faster on CPUs with AMX)",
    "data_from": "a folder of answers this model gave before (distill-*.jsonl, e.g. the data stage of another run): "
    "copied in instead of answering --data-prompts prompts",
    "arch": "drafter architecture: eagle3 (EAGLE-3, the layout vLLM, SGLang and TensorRT-LLM load; the default), "
    "eagle (EAGLE-style, one decoder layer, generate only with a drafting vocabulary), prefix-mlp or mlp (Hydra "
    "heads), mtp (MTP layers saved with the model in transformers' native layout: generate(use_mtp=True) runs "
    "them too)",
    "depth": "tokens the drafter drafts ahead (heads, the EAGLE-style drafter's unrolled steps, or the depth of the "
    "trees MTP layers draft, the last layer again beyond their count)",
    "feature_layers": "comma-separated base hidden-state indices (0 = embeddings) the drafter fuses: with --arch "
    "eagle3 three inputs of base layers (default 2, L/2, L-3 of an L-layer model, vLLM's default too; the export "
    "names them for the engines), with --arch eagle further states fused into the last one",
    "mtp_layers": "with --arch mtp: the MTP layers trained (transformers' use_mtp=True drafts one token per layer)",
    "draft_vocab_size": "rows of the drafting vocabulary: the most frequent tokens of the model's answers (--arch mtp: "
    "the layers train over the whole vocabulary, EntMTP drafts over these rows; 0: the whole vocabulary)",
    "train_tokens": "token budget of the training data",
    "train_epochs": "passes over the training data",
    "train_steps": "stop training after this many steps (else --train-epochs)",
    "batch_tokens": "padded tokens per training batch",
    "lr": "peak learning rate",
    "warmup_steps": "linear warm-up",
    "teacher_dtype": "precision of the teacher pass: float32 or bfloat16",
    "reuse_cache": "the work folder of an earlier build-drafter run (or a teacher cache) of the same base model and "
    "teacher precision that kept at least this drafter's layers (an EAGLE-3 run's serves every arch): the rows of "
    "the sequences it holds are copied instead of recomputed",
    "mixed_precision": "the drafter's training precision: no, bf16 or fp16",
    "tau_prompts": "held-out prompts of the training's accept-length check (0: skip it)",
    "search_prompts": "calibration prompts per task",
    "timing_prompts": "of them, how many are timed",
    "search_new_tokens": "tokens per calibration run",
    "timed_sizes": "comma-separated tree sizes timed",
    "nodes": "largest tree of the frontier (nodes, root included)",
    "cost_repeats": "rounds of the forward-cost timing",
    "seed": "seed of the data order, split and training",
    "threads": "torch CPU threads",
    "budget_minutes": "time for this call, shared among the stages; a stage out of "
    "its share stops at a checkpoint (exit status 3) and the same command continues",
    "redo": "run this stage and every later one anew (their outputs are deleted first); for one call: drop it to "
    "continue an interrupted redo",
    "push_to_hub": "then push the heads to this Hub repo and the banks to REPO-banks",
    "banks_repo": "with --push-to-hub: the banks' Hub repo (default REPO-banks)",
}
_LISTS = {"tasks": str, "data_sources": str, "timed_sizes": int, "feature_layers": int}


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf build-drafter``."""
    p = sub.add_parser(
        "build-drafter",
        help="from a base model to a drafter and its tree banks: data, training, search, calibration, publishing",
        description="Run the stages from a base model to a drafter with one bank per task (docs/your-model.md): "
        "self-distilled data, a drafter (EAGLE-3 unless --arch says otherwise) over a pruned drafting vocabulary, the "
        "tree search, the "
        "calibration for this machine, and the result in --out. Every stage resumes; rerunning the same command "
        "skips the stages done (state in WORK/build-drafter.json).",
    )
    for f in fields(BuildOptions):
        if f.name in ("progress", "command"):
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        required = f.name in ("model", "work_dir", "out")
        if f.name in _LISTS:
            p.add_argument(flag, default=",".join(map(str, default)), help=_HELP[f.name])
        elif f.name == "redo":
            p.add_argument(flag, choices=STAGES, default=None, help=_HELP[f.name])
        elif default is None or isinstance(default, str) or required:
            kind = {"train_steps": int, "threads": int, "budget_minutes": float}.get(f.name, str)
            p.add_argument(
                flag, type=kind, required=required, default=None if required else default, help=_HELP[f.name]
            )
        else:
            p.add_argument(flag, type=type(default), default=default, help=_HELP[f.name])
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    import shlex
    import sys

    values = {f.name: getattr(args, f.name) for f in fields(BuildOptions) if f.name not in ("progress", "command")}
    for name, kind in _LISTS.items():
        values[name] = tuple(kind(x.strip()) for x in str(values[name]).split(",") if x.strip())
    command = "entmtp-hf " + shlex.join(sys.argv[1:]) if "build-drafter" in sys.argv else None
    return BuildOptions(**values, progress=not args.no_progress, command=command)


def _run(args: argparse.Namespace) -> int:
    state = build_drafter(options_from_args(args))
    return 0 if state["complete"] else EXIT_UNFINISHED
