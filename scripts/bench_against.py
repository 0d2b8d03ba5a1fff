"""This code against another commit (a release), or the default drafter against another drafter,
on the same basket, interleaved run by run.

Each variant runs ``entmtp-hf bench --batch-size ...`` (plain batched ``generate`` and the
method under test) in a process of its own, with ``PYTHONPATH`` pointing at its source, after it
measured its own cost tables into a cache folder of its own; the order alternates (this, other,
other, this, ...) so a drift of the machine falls on both (a killed run leaves its git worktree:
``git worktree prune``). Each cell is the method's median per-call ratio to plain ``generate`` in
the same run; the table gives every pair's cells and their medians, and whether
every row of every run was token-identical to plain ``generate``.

    python scripts/bench_against.py 8ac5e00 --out runs/against --pairs 2 --n 8 --max-new-tokens 64
    python scripts/bench_against.py --heads eagle3-out --out runs/drafters --pairs 2

``--heads DIR``: this code with the drafter ``entmtp-hf build-drafter`` wrote to ``DIR`` (its banks
in ``DIR/banks`` unless ``--bank``) against this code with ``load_demo()``'s default drafter.

``--shared-costs``: the other version ranks with the tables this code measured (the order starts with
this code), so both decode with the same trees wherever their ranking code agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from entmtp_hf.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def worktree(ref: str, where: Path) -> Path:
    """``ref``'s ``src`` folder, checked out into ``where`` (a detached worktree)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True)
    return where / "src"


@dataclass(frozen=True)
class Variant:
    """What one side of the comparison runs: the code in ``src`` with the drafter in ``heads`` and its
    banks in ``bank`` (``None``: the demo's default drafter and banks)."""

    label: str
    slug: str
    src: Path
    heads: Path | None = None
    bank: Path | None = None


def calibrate(variant: Variant, cache: Path, args: argparse.Namespace) -> None:
    """The variant measures its cost tables for the demo model and its drafter at the powers of two
    up to the bench's largest batch size (every live batch size a batch call reaches), into
    ``cache`` (what its ``generate`` then ranks its banks with)."""
    env = dict(os.environ, PYTHONPATH=str(variant.src), ENTMTP_HF_CACHE=str(cache))
    code = f"import torch; torch.set_num_threads({args.threads}); from entmtp_hf.demo import load_demo; "
    sizes = [2**i for i in range(max(args.batch_sizes).bit_length())]
    heads = "" if variant.heads is None else f"{str(variant.heads)!r}, banks={str(variant.bank)!r}, "
    code += f"load_demo({heads}calibrate={sizes})"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def bench(variant: Variant, cache: Path, out: Path, args: argparse.Namespace) -> dict:
    """One bench run of the variant; its ``summary.json``'s summary."""
    env = dict(os.environ, PYTHONPATH=str(variant.src), ENTMTP_HF_CACHE=str(cache))
    cmd = [sys.executable, "-m", "entmtp_hf.tools.cli", "bench", "--methods", "vanilla", args.method]
    if variant.heads is not None:
        cmd += ["--eagle-heads", str(variant.heads), "--eagle-bank", str(variant.bank)]
    cmd += ["--batch-size", *map(str, args.batch_sizes), "--n", str(args.n)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--no-progress"]
    cmd += ["--tasks", *args.tasks, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env)
    return json.loads((out / "summary.json").read_text())["summary"]


def cells(summary: dict, method: str) -> dict[str, tuple[float, bool]]:
    """``task, B=b`` -> (the method's median ratio to plain generate, every row identical)."""
    out = {}
    for task, by_b in summary.items():
        for b, methods in by_b.items():
            m = methods[method]
            out[f"{task}, B={b}"] = (m["median_ratio_to_vanilla"], m["rows_identical"] == m["rows"])
    return out


def table(runs: dict[str, list[dict[str, tuple[float, bool]]]]) -> str:
    labels = list(runs)
    keys = list(next(r for rs in runs.values() for r in rs))
    lines = ["| cell | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for key in keys:
        row = []
        for label in labels:
            values = [r[key][0] for r in runs[label]]
            if not values:
                row.append("-")
                continue
            row.append(", ".join(f"{v:.2f}" for v in values) + f": **{statistics.median(values):.2f}**")
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    identical = all(ok for rs in runs.values() for r in rs for _, ok in r.values())
    lines.append("")
    lines.append(f"every row token-identical to plain generate: {'yes' if identical else 'NO'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ref", nargs="?", help="the other commit (e.g. the last release)")
    p.add_argument("--heads", type=Path, default=None, help="instead of a commit: another drafter's folder")
    p.add_argument("--bank", type=Path, default=None, help="with --heads: its banks (default HEADS/banks)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--method", default="eagle-static")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--tasks", nargs="+", default=["humaneval", "gsm8k", "chat"])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--shared-costs",
        action="store_true",
        help="both versions rank their banks with the cost tables this code measures (the code compared, not "
        "two measurements of the machine: each table is measured once, and at a batch size its noise can move a "
        "bank's choice by a tree size)",
    )
    args = p.parse_args(argv)
    if (args.ref is None) == (args.heads is None):
        p.error("give either a commit (REF) or --heads DIR")
    if args.bank is not None and args.heads is None:
        p.error("--bank goes with --heads")
    if args.shared_costs and args.heads is not None:
        p.error("--shared-costs compares code, not drafters: a step's costs include its drafter's")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        this = Variant("this code" if args.heads is None else "default drafter", "this", ROOT / "src")
        if args.heads is None:
            other = Variant(args.ref, "other", worktree(args.ref, tmp / "other"))
        else:
            heads = args.heads.resolve()
            bank = (args.bank or heads / "banks").resolve()
            if not (heads / "config.json").is_file() or not any(bank.glob("*.safetensors")):
                p.error(f"--heads {heads}: needs a drafter (config.json) and banks (*.safetensors in {bank})")
            other = Variant(heads.name, "other", ROOT / "src", heads, bank)
        try:
            runs: dict[str, list] = {this.label: [], other.label: []}
            order = [v for i in range(args.pairs) for v in ((this, other) if i % 2 == 0 else (other, this))]
            for i, variant in enumerate(order):
                cache = args.out / f"cache-{variant.slug}"
                fresh = not cache.exists()
                cache.mkdir(exist_ok=True)
                for folder in cache_dir().glob("SmolLM2*"):  # the demo model's copy is shared; the cost tables are not
                    if not (cache / folder.name).exists():
                        (cache / folder.name).symlink_to(folder)
                if fresh and args.shared_costs and variant is other:
                    shutil.copytree(args.out / "cache-this" / "costs", cache / "costs")
                elif fresh:
                    calibrate(variant, cache, args)
                summary = bench(variant, cache, args.out / f"{i + 1:02d}-{variant.slug}", args)
                runs[variant.label].append(cells(summary, args.method))
                print(table(runs), flush=True)
        finally:
            if args.heads is None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "other")], check=False
                )
    text = table(runs)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    (args.out / "runs.json").write_text(
        json.dumps(
            {
                "args": vars(args) | {k: getattr(args, k) and getattr(args, k).name for k in ("out", "heads", "bank")},
                "runs": runs,
            },
            indent=1,
        )
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
