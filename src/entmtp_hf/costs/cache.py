"""Cost tables on disk: measured once per (machine, model and heads, dtype), read after.

Files live in ``<entmtp-hf cache>/costs/<key>.json`` (see :func:`entmtp_hf.paths.cache_dir`),
written whole then renamed, so a reader never sees half a file; an unreadable or foreign file
is measured again rather than trusted.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

from ..errors import FileFormatError
from ..files import read_json_object
from ..paths import cache_dir
from .fingerprint import machine_fingerprint, model_key
from .probe import probe, probe_batch
from .table import CostTable, table_key

log = logging.getLogger(__name__)
MAX_BYTES = 1 << 20


def table_path(key: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir() / "costs") / f"{key}.json"


def read_table(path: Path) -> CostTable | None:
    """The table at ``path``, or None when there is none or it cannot be trusted (logged)."""
    if not path.is_file():
        return None
    try:
        return CostTable.from_dict(read_json_object(path, max_bytes=MAX_BYTES, max_depth=8), str(path))
    except FileFormatError as e:
        log.warning("entmtp-hf: ignoring the cached cost table %s (%s)", path, e.problem)
        return None


def write_table(table: CostTable, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table.to_dict(), f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def cost_table(model, heads, *, known: Iterable[CostTable] = (), refresh: bool = False,
               folder: Path | None = None, batch_size: int = 1, base: CostTable | None = None) -> CostTable:
    """This machine's table for ``model`` and ``heads`` at ``batch_size`` rows: one of ``known`` (a
    bank's machine entries) filed under this machine, else the cache, else probed now (logged) and
    cached (unless its timings were unsteady: :func:`~entmtp_hf.costs.probe.steady`). A batch
    size's table builds on the batch-size-1 one: ``base``, else found or probed the same way (pass
    it when measuring several batch sizes with ``refresh``, or each measures it again)."""
    known = tuple(known)
    lm = model.get_output_embeddings().weight
    key = table_key(machine_fingerprint(lm.device, lm.dtype).key(), model_key(model, heads), batch_size)
    found = next((t for t in known if t.key == key), None)
    if found is not None and not refresh:
        return found
    path = table_path(key, folder)
    table = None if refresh else read_table(path)
    if table is None:
        log.info("entmtp-hf: measuring this machine's step costs for the bank's re-ranking%s (once; cached in %s)",
                 f" at batch size {batch_size}" if batch_size > 1 else "", path)  # fmt: skip
        if batch_size > 1:
            base = base or cost_table(model, heads, known=known, refresh=refresh, folder=folder)
            table = probe_batch(model, heads, base, batch_size)
        else:
            table = probe(model, heads)
        if table.notes.get("timings_steady", True):
            write_table(table, path)
        else:  # measured on a busy machine: good for this call, not for every later one
            log.warning("entmtp-hf: not caching this machine's step costs (its timings were unsteady); "
                        "they are measured again next time")  # fmt: skip
    return table


def batch_bucket(batch_size: int) -> int:
    """The batch size whose costs rank the trees of ``batch_size`` live rows: the largest power of
    two not above it (a shrinking batch re-ranks at 8, 4, 2, 1 rows, not at every size)."""
    return 1 << (max(batch_size, 1).bit_length() - 1)
