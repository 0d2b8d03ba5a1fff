"""This machine's cost tables, measured where the user sees it and only read by ``generate``.

:func:`calibrate` measures (with a progress bar and one line saying what and how long) and
caches; ``enable_entmtp(..., calibrate=...)``, ``entmtp_hf.calibrate(model)`` and
``entmtp-hf calibrate`` call it. :func:`tables_for` is what a ``generate`` call with an adapting
bank reads: the measured tables, a batch size without one priced from the nearest measured one
(said in the log), and nothing at all (the bank's stored choice, warned once) when this machine
was never measured. A table whose timings changed while it was measured (a busy machine) ranks
nothing: one inflated forward can make plain decoding look best for every task, and the bank's
stored ranking is the safer guess until ``calibrate`` measures it again. No ``generate`` call
measures anything.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

from tqdm.auto import tqdm

from ..costs.table import CostTable
from ..cpu_kernels import applied_kernels
from ..errors import EntMTPError
from ..heads import HEADS_ATTR
from .probe import STAGES, probe, probe_batch
from .store import find_table, key_for, table_path, write_table

log = logging.getLogger(__name__)
MAX_CALIBRATED_BATCH = 256


def batch_bucket(batch_size: int) -> int:
    """The batch size whose costs rank the trees of ``batch_size`` live rows: the largest power of
    two not above it (a shrinking batch re-ranks at 8, 4, 2, 1 rows, not at every size)."""
    return 1 << (max(batch_size, 1).bit_length() - 1)


def _batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = list(batch_sizes) if isinstance(batch_sizes, (list, tuple, set, range)) else None
    if not sizes or any(type(b) is not int or not 1 <= b <= MAX_CALIBRATED_BATCH for b in sizes):
        raise EntMTPError(f"calibrate: batch_sizes must be integers in 1..{MAX_CALIBRATED_BATCH}, got {batch_sizes!r}")
    return sorted({1, *(batch_bucket(b) for b in sizes)})  # every size builds on batch size 1


def calibrate(
    model,
    heads=None,
    *,
    batch_sizes: Sequence[int] = (1,),
    refresh: bool = False,
    folder: str | Path | None = None,
    progress: bool = True,
) -> dict[int, CostTable]:
    """Measure this machine's step costs for ``model`` (and its draft heads, default the ones it is
    enabled with) at each of ``batch_sizes`` (rounded down to powers of two, as decoding ranks
    them) and cache them; sizes already cached are read, unless ``refresh`` or their timings
    were unsteady. Returns the table per batch size. Takes seconds per batch size."""
    heads = heads if heads is not None else getattr(model, HEADS_ATTR, None)
    if heads is None:
        raise EntMTPError("calibrate needs the model's draft heads: call enable_entmtp(model, heads) first")
    folder = Path(folder) if folder is not None else None
    sizes, tables = _batch_sizes(batch_sizes), {}
    todo = []
    for b in sizes:
        found = None if refresh else find_table(model, heads, b, folder=folder)
        if found is not None and found.notes.get("timings_steady", True):
            tables[b] = found
        else:
            todo.append(b)
    if not todo:
        return tables
    t0 = time.perf_counter()
    stages = len(STAGES) * len(todo) - (len(todo) - (1 in todo))  # batch sizes above 1 skip the heads' stage
    with tqdm(total=stages, desc="entmtp-hf: measuring step costs", unit="stage", disable=not progress) as bar:
        for b in todo:

            def tick(stage: str, b: int = b) -> None:
                bar.set_postfix_str(f"batch size {b}: {stage} done")
                bar.update()

            with applied_kernels(model):  # what its calls run on
                table = probe(model, heads, tick=tick) if b == 1 else probe_batch(model, heads, tables[1], b, tick=tick)
            tables[b] = table
            write_table(table, table_path(table.key, folder))
    seconds = time.perf_counter() - t0
    message = (
        f"entmtp-hf: measured this machine's step costs at batch size{'s' * (len(todo) > 1)} "
        f"{', '.join(map(str, todo))} in {seconds:.1f} s (cached in {table_path('', folder).parent})"
    )
    unsteady = [b for b in todo if not tables[b].notes.get("timings_steady", True)]
    if unsteady:
        warnings.warn(
            f"{message}; the timings at batch size {unsteady} changed while measuring (a busy machine): "
            "decoding ranks the bank's trees as stored there until the next calibrate call measures them again",
            stacklevel=2,
        )
    elif progress:
        tqdm.write(message, file=sys.stderr)  # beside the bar, and shown whatever logging's level
    log.info(message)
    return tables


def tables_for(
    model, heads, batch_sizes: Iterable[int], *, known: Iterable[CostTable] = (), folder: str | Path | None = None
) -> dict[int, CostTable | None]:
    """The table that ranks each of ``batch_sizes`` for a ``generate`` call, read, never measured:
    the measured one (a bank's machine entry, else the cache) if its timings were steady, else the
    nearest steady batch size's (the largest below, else the smallest above; logged), else None
    for all (this machine was never measured for the model, or only while busy: warned)."""
    known = tuple(known)
    folder = Path(folder) if folder is not None else None
    wanted = sorted(set(batch_sizes))
    found = {b: find_table(model, heads, b, known=known, folder=folder) for b in wanted}
    measured = {b: t if _steady(t) else None for b, t in found.items()}
    have = {b: t for b, t in measured.items() if t is not None}
    if len(have) < len(wanted):
        have.update(_other_sizes(model, heads, known, folder, exclude=set(wanted)))
    if not have:
        busy = sorted(b for b, t in found.items() if t is not None)
        warnings.warn(
            (
                f"entmtp-hf: this machine's step costs for this model at batch size {busy} were measured while "
                "the machine was busy (the timings changed while measuring), so the bank ranks its trees as "
                "stored; measure them again on a quiet machine with entmtp_hf.calibrate(model) or "
                "`entmtp-hf calibrate`"
            )
            if busy
            else (
                "entmtp-hf: this machine's step costs for this model were never measured, so the bank ranks its "
                "trees as stored; measure them once (seconds, cached) with enable_entmtp(model, heads, "
                "calibrate=True), entmtp_hf.calibrate(model) or `entmtp-hf calibrate`"
            ),
            stacklevel=4,
        )
        return dict.fromkeys(wanted)
    out = {}
    for b in wanted:
        if measured[b] is not None:
            out[b] = measured[b]
            continue
        below = [m for m in have if m < b]
        nearest = max(below) if below else min(have)
        log.info(
            "entmtp-hf: no step costs measured at batch size %d on this machine; ranking with those at batch "
            "size %d (calibrate(model, batch_sizes=[%d]) measures them)",
            b,
            nearest,
            b,
        )
        out[b] = have[nearest]
    return out


def _steady(table: CostTable | None) -> bool:
    """Whether ``table`` exists and its timings agreed with their recheck (see :func:`probe`)."""
    return table is not None and table.notes.get("timings_steady", True)


def _other_sizes(model, heads, known: tuple, folder: Path | None, exclude: set[int]) -> dict[int, CostTable]:
    """Steady measured tables at the batch sizes decoding ranks (powers of two) outside ``exclude``."""
    found = {}
    for b in (1 << k for k in range(MAX_CALIBRATED_BATCH.bit_length())):
        if b not in exclude:
            table = find_table(model, heads, b, known=known, folder=folder)
            if _steady(table):
                found[b] = table
    return found


__all__ = ["batch_bucket", "calibrate", "key_for", "tables_for"]
