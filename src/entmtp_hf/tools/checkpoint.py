"""JSON files of the resumable tools: atomic writes, strict JSON, and fingerprints.

A tool that checkpoints into a work folder writes each file whole (temporary file, then
rename), so an interrupted run never leaves half a file; and it stores fingerprints of what
it was run with, so resuming with other heads or settings is refused instead of mixing results.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """A copy in which NaN and infinities are None: the data as strict JSON can hold it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 1) -> Path:
    """Write ``data`` as strict JSON (NaN raises) to ``path`` atomically; returns the path.

    The text goes to a temporary file beside ``path`` (a name of its own, so concurrent
    writers never share one), then is renamed over it; the temporary file never outlives a
    failed write. A path that cannot be written raises the ``OSError``.
    """
    path = Path(path)
    text = json.dumps(data, indent=indent, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # gone already after the rename, or never made
            tmp.unlink()
    return path


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in ``path``, or None when there is no such file (nothing checkpointed yet)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def config_fingerprint(config: Any) -> str:
    """A short hash of a config's fields (its repr), to spot results measured with another one."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def heads_fingerprint(heads) -> str:
    """A short hash of the heads' config and weights: resuming with other heads is refused."""
    h = hashlib.sha256(json.dumps(heads.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(heads.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().double().sum().item().hex().encode())
    return h.hexdigest()[:16]


class OutOfTime(Exception):
    """A resumable tool reached its deadline right after writing a checkpoint: the same call again continues."""


def check_deadline(deadline: float | None, where: str) -> None:
    """Raise :class:`OutOfTime` once ``time.perf_counter()`` is past ``deadline`` (None: no deadline).
    Call it only where everything done so far is checkpointed."""
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime(f"{where}: stopped at the deadline with its checkpoint written; run it again to continue")
