"""The ``entmtp-hf`` command line: one subcommand per task, each registered by its own module."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .reporting import LOCAL, LOCAL_OR_HUB, check_input, missing_extra_status, report_errors

Registrar = Callable[[argparse._SubParsersAction], None]

#: the arguments, by their name in any command (argparse's ``dest``), that name what the command
#: reads: each is checked before the command runs (:func:`check_inputs`), so a missing or
#: unreadable input is one line, not a traceback after minutes of loading
INPUTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "src",
            "heads",
            "bank",
            "model",
            "base_config",
            "hydra_heads",
            "medusa_heads",
            "eagle_heads",
            "eagle_bank",
            "init_from",
        ),
        LOCAL_OR_HUB,
    ),
    **dict.fromkeys(("results", "eas_config", "distill_dir", "data_from", "reuse_cache"), LOCAL),
}


def _convert_heads(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from ..heads import convert_heads

    base_config = AutoConfig.from_pretrained(args.base_config) if args.base_config else None
    heads = convert_heads(args.src, args.dst, revision=args.revision, base_config=base_config)
    cfg = heads.config
    print(f"wrote {cfg.num_heads} {cfg.family} heads ({cfg.head_arch}, {cfg.num_layers} layer(s)) to {args.dst}")
    return 0


def _add_convert_heads(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-heads",
        help="rewrite a published Hydra, Medusa or EAGLE checkpoint into the entmtp-hf heads format",
        description="Load draft heads from SRC (folder or Hub repo; published Hydra/Medusa or entmtp-hf format) "
        "and save them to the folder DST as config.json + model.safetensors + README.md.",
    )
    p.add_argument("src", help="local folder or Hub repo id of the heads")
    p.add_argument("dst", help="output folder")
    p.add_argument("--revision", default=None, help="Hub revision of SRC")
    p.add_argument(
        "--base-config",
        default=None,
        help="folder or repo id of the base model's config (prefix-mlp Hydra heads whose base is not reachable)",
    )
    p.set_defaults(func=_convert_heads)


def subcommands() -> list[Registrar]:
    """Every subcommand's registrar, in help order (imported here: the tools load only when the CLI runs)."""
    from .acceptance_table import add_subcommand as acceptance
    from .bench.cli import add_subcommand as bench
    from .build_drafter import add_subcommand as build_drafter
    from .calibrate import add_subcommand as calibrate
    from .eas_calibration import add_subcommand as eas_calibrate
    from .export import add_subcommand as export
    from .export_generate import add_subcommand as export_generate
    from .export_heads import add_subcommand as export_heads
    from .profile import add_subcommand as profile
    from .regime import add_subcommand as regime
    from .search.cli import add_subcommand as search
    from .training.cli import add_subcommand as train_heads

    return [
        _add_convert_heads,
        export_generate,
        build_drafter,
        train_heads,
        search,
        calibrate,
        export,
        export_heads,
        bench,
        regime,
        profile,
        acceptance,
        eas_calibrate,
    ]


def check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check every input argument (:data:`INPUTS`) the chosen command was given, before it runs."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[args.command]._actions:
        kind = INPUTS.get(action.dest)
        value = getattr(args, action.dest, None)
        if kind is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            check_input(action.option_strings[-1] if action.option_strings else action.dest.upper(), item, kind)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entmtp-hf", description="EntMTP tree speculative decoding tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in subcommands():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand, its inputs checked first (:func:`check_inputs`); whichever command it
    is, a bad input is one line and exit status 2 (:func:`report_errors`)."""
    try:
        parser = build_parser()
    except ImportError as e:
        return missing_extra_status(e)
    args = parser.parse_args(argv)

    def run() -> int:
        check_inputs(parser, args)
        return args.func(args)

    return report_errors(f"entmtp-hf {args.command}", run)


if __name__ == "__main__":
    sys.exit(main())
