"""``entmtp-hf train-heads``: command-line flags derived from :class:`TrainConfig` and the
command that runs the extraction or the training (registered by :mod:`entmtp_hf.tools.cli`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .config import SOURCES, TrainConfig
from .loop import RunLog, train_heads
from .teacher import prepare_teacher_cache

_HELP = {
    "model": "base model (Hub id or folder); default: the demo model SmolLM2-135M-Instruct",
    "family": "heads family: hydra, medusa, eagle or mtp (default: the arch's: eagle for the eagle archs, mtp for "
    "mtp, else hydra)",
    "arch": "head architecture: mlp, (hydra) prefix-mlp, (eagle) eagle (EAGLE-1/2 layout) or eagle3, (mtp) mtp: MTP "
    "layers saved with the model in transformers' native layout (--output is then a model folder)",
    "num_layers": "(hydra) blocks per head, (eagle) decoder layers, (mtp) MTP layers",
    "feature_layers": "(eagle) comma-separated base hidden-state indices (0 = embeddings) fused into the "
    "drafter's feature besides the last state, e.g. 2,15; (eagle3) the three fused states, inputs of base "
    "layers (default: 2, L/2, L-3 of an L-layer model); their teacher cache keeps them too",
    "fuse_lr": "(eagle, --feature-layers) learning rate of the fuse projection (0: --lr); it starts at zero "
    "when added to --init-from heads, so it can take a higher rate than the trained rest",
    "work_dir": "folder of the teacher cache (WORK/data) and runs (WORK/RUN); keep it out of git",
    "run_name": "run folder name under WORK (default FAMILY-ARCH)",
    "output": "folder for the final heads (default WORK/RUN/final)",
    "init_from": "start from these heads (a heads folder; --arch mtp: a model folder with MTP layers, as an "
    "earlier run wrote it) instead of a warm start",
    "init_vocab": "with --init-from: 'heads' keeps their drafting vocabulary, 'data' chooses it anew from this "
    "run's data (the head weights do not depend on it: their LM head is the base model's)",
    "draft_vocab_size": "rows of the drafting vocabulary, the most frequent greedy tokens (mtp: the layers train "
    "over the whole vocabulary and EntMTP drafts over these rows; 0: the whole vocabulary)",
    "distill_dir": "folder of distill-*.jsonl self-distilled records",
    "sources": "comma-separated data sources",
    "max_tokens": "token budget of the data set (train + val)",
    "train_offset": "train on the documents after those an earlier run with --max-tokens TRAIN_OFFSET trained "
    "on (same sources and seed): a further round on new text, validated on the held-out documents any run of "
    "the same --max-tokens uses",
    "distill_share": "largest share of distilled data",
    "batch_tokens": "padded tokens per batch",
    "max_steps": "stop after this many steps (else EPOCHS epochs)",
    "ce_weight": "weight of CE on the teacher argmax mixed into the KL loss",
    "head_decay": "head i's loss weight is HEAD_DECAY**i",
    "save_dtype": "precision of the shipped heads",
    "mixed_precision": "accelerate mixed precision: no, bf16 or fp16",
    "teacher_dtype": "precision of the base model's forward when filling the teacher cache: float32 or "
    "bfloat16 (autocast; faster on CPUs with AMX)",
    "reuse_cache": "a filled teacher cache (a WORK or WORK/data folder) of the same base model and teacher "
    "dtype: its sequences' rows are copied into a new cache instead of recomputed",
    "tau_prompts": "held-out prompts for the final tau measurement (0: skip)",
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    for f in TrainConfig.__dataclass_fields__.values():
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if f.name == "sources":
            p.add_argument(flag, default=",".join(SOURCES), help=_HELP["sources"])
        elif f.name == "feature_layers":
            p.add_argument(flag, default="", help=_HELP["feature_layers"])
        elif default is None or isinstance(default, str):
            p.add_argument(flag, default=default, help=_HELP.get(f.name))
        else:
            p.add_argument(flag, type=type(default), default=default, help=_HELP.get(f.name))
    p.set_defaults(max_steps=None)


def _train_command(args: argparse.Namespace) -> int:
    import shlex
    import sys

    if args.threads:
        torch.set_num_threads(args.threads)
    values = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__}
    values["sources"] = tuple(s for s in values["sources"].split(",") if s)
    values["feature_layers"] = tuple(int(s) for s in values["feature_layers"].split(",") if s)
    values["max_steps"] = int(values["max_steps"]) if values["max_steps"] else None
    if args.no_tau:  # no tau check: nothing for tau_prompts to ask of the heads' depth
        values["tau_prompts"] = 0
    cfg = TrainConfig(**values)
    command = "entmtp-hf " + shlex.join(sys.argv[1:]) if sys.argv and "train-heads" in sys.argv else None
    if args.extract_only:
        from ..models import load_base_model

        model, tok = load_base_model(cfg.model)
        Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
        prepare_teacher_cache(model, tok, cfg, RunLog(Path(cfg.work_dir) / "extract.log"))
        return 0
    train_heads(
        cfg,
        resume=args.resume,
        max_minutes=args.max_minutes,
        measure=not args.no_tau,
        command=command,
        extract=not args.skip_extract,
    )
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf train-heads``."""
    p = sub.add_parser(
        "train-heads",
        help="train Hydra/Medusa heads or an EAGLE-style drafter by distillation from the frozen base model",
        description="Build a data set (self-distilled records + real text, no evaluation sets), cache the base "
        "model's hidden states once, and train draft heads on the base model's own next-token distributions. "
        "Runs unchanged under `accelerate launch`.",
    )
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of WORK/RUN")
    p.add_argument("--extract-only", action="store_true", help="only build and fill the teacher cache")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop (checkpoint + final heads) this many minutes after the call starts, the "
        "teacher extraction included; --resume continues",
    )
    p.add_argument("--no-tau", action="store_true", help="skip the final tau measurement")
    p.add_argument(
        "--skip-extract",
        action="store_true",
        help="train on the sequences extracted so far instead of finishing the extraction first",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=_train_command)
