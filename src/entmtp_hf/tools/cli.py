"""The ``entmtp-hf`` command line: one subcommand per task, each registered by its own module."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from . import missing_extra

Registrar = Callable[[argparse._SubParsersAction], None]


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
    from .export_heads import add_subcommand as export_heads
    from .export_generate import add_subcommand as export_generate
    from .profile import add_subcommand as profile
    from .regime import add_subcommand as regime
    from .search.cli import add_subcommand as search
    from .training.cli import add_subcommand as train_heads

    return [_add_convert_heads, export_generate, build_drafter, train_heads, search, calibrate, export, export_heads, bench, regime,
            profile, acceptance, eas_calibrate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entmtp-hf", description="EntMTP tree speculative decoding tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in subcommands():
        add(sub)
    return parser


def _missing_extra(error: ImportError, command: str = "") -> int:
    """Exit status 2 with the extra to install when ``error`` is a missing optional dependency."""
    missing = missing_extra(error)
    if missing is None:
        raise error
    print(f"entmtp-hf{' ' + command if command else ''}: {missing}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a bad argument or a missing optional dependency is one line and exit status 2."""
    try:
        parser = build_parser()
    except ImportError as e:
        return _missing_extra(e)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        one_line = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"entmtp-hf {args.command}: error: {one_line}", file=sys.stderr)
        return 2
    except ImportError as e:
        return _missing_extra(e, args.command)


if __name__ == "__main__":
    sys.exit(main())
