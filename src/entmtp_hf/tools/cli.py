"""The ``entmtp-hf`` command line: one subcommand per task, each a small function."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


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
        help="rewrite a published Hydra/Medusa checkpoint into the entmtp-hf heads format",
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


#: subcommand registrars; other modules' commands are added here.
from .training import add_subcommand as _add_train_heads  # noqa: E402

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_convert_heads, _add_train_heads]

from .search.cli import add_subcommand as _add_search  # noqa: E402

SUBCOMMANDS.append(_add_search)

from .bench.cli import add_subcommand as _add_bench  # noqa: E402  (bench, bench-report)
from .acceptance_table import add_subcommand as _add_acceptance  # noqa: E402
from .profile import add_subcommand as _add_profile  # noqa: E402
from .regime import add_subcommand as _add_regime  # noqa: E402
from .eas_calibration import add_subcommand as _add_eas_calibrate  # noqa: E402

SUBCOMMANDS += [_add_bench, _add_regime, _add_profile, _add_acceptance, _add_eas_calibrate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entmtp-hf", description="EntMTP tree speculative decoding tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"entmtp-hf {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
