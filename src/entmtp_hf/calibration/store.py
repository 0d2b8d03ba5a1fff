"""Cost tables on disk: measured once per (machine, model and heads, dtype, batch size), read after.

Files live in ``<entmtp-hf cache>/costs/<key>.json`` (see :func:`entmtp_hf.paths.cache_dir`),
written whole then renamed, so a reader never sees half a file. A file that cannot be read, or
whose content describes another machine, model or batch size than its name, is ignored (with a
warning) and measured again when the user next calibrates. The cache is an optimisation: a
folder that cannot be read or written warns once and decoding goes on.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterable

from ..costs.fingerprint import machine_fingerprint, model_key
from ..costs.table import CostTable, table_key
from ..errors import FileFormatError
from ..files import read_json_object
from ..paths import cache_dir

log = logging.getLogger(__name__)
MAX_BYTES = 1 << 20


def table_path(key: str, folder: Path | None = None) -> Path:
    return (Path(folder) if folder is not None else cache_dir() / "costs") / f"{key}.json"


def key_for(model, heads, batch_size: int = 1) -> str:
    """The key of this machine's table for ``model`` (enabled with ``heads``) at ``batch_size`` rows."""
    lm = model.get_output_embeddings().weight
    return table_key(machine_fingerprint(lm.device, lm.dtype).key(), model_key(model, heads), batch_size)


def read_table(path: Path, key: str | None = None) -> CostTable | None:
    """The table at ``path``, or None when there is none or it cannot be trusted (warned): it does
    not parse, or it says it was measured for another key than ``key`` (its file name)."""
    try:
        if not path.is_file():
            return None
        table = CostTable.from_dict(read_json_object(path, max_bytes=MAX_BYTES, max_depth=8), str(path))
    except FileFormatError as e:
        warnings.warn(f"entmtp-hf: ignoring the cached cost table {path} ({e.problem})", stacklevel=2)
        return None
    except OSError as e:
        _unusable(path.parent, e)
        return None
    key = key or path.stem
    if table.key != key:
        warnings.warn(
            f"entmtp-hf: ignoring the cached cost table {path}: it describes {table.key!r}, "
            f"not {key!r} (copied from another machine or model?)",
            stacklevel=2,
        )
        return None
    return table


def write_table(table: CostTable, path: Path) -> Path | None:
    """Write ``table`` to ``path`` whole (a temporary file renamed over it); None, with one warning,
    when the folder cannot take it (the table is still used by this process)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table.to_dict(), f, indent=1)
        os.replace(tmp, path)
        return path
    except OSError as e:
        _unusable(path.parent, e)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _unusable(folder: Path, error: OSError) -> None:
    warnings.warn(
        f"entmtp-hf: the cost-table cache {folder} cannot be used ({type(error).__name__}: "
        f"{error.strerror or error}); measured costs are not kept across processes. Set ENTMTP_HF_CACHE "
        "to a writable folder to keep them",
        stacklevel=3,
    )


def find_table(
    model, heads, batch_size: int = 1, *, known: Iterable[CostTable] = (), folder: Path | None = None
) -> CostTable | None:
    """This machine's measured table at ``batch_size`` rows, without measuring: one of ``known`` (a
    bank's machine entries) filed under this machine, else the cache's; None when neither has it."""
    key = key_for(model, heads, batch_size)
    found = next((t for t in known if t.key == key), None)
    return found if found is not None else read_table(table_path(key, folder), key)
