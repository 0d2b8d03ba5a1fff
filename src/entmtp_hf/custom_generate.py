"""EntMTP as a transformers ``custom_generate`` method: what an exported repo's ``generate.py`` runs.

transformers loads a decoding method from a Hub repo or a local folder:
``model.generate(custom_generate="org/repo", trust_remote_code=True, ...)`` runs that repo's
``custom_generate/generate.py``, whose ``generate(model, **generate_arguments)`` gets the
call. The file ``entmtp-hf export-generate`` writes holds only its defaults (heads, bank,
task) and calls :func:`entmtp_generate`, so the method itself is this package's, versioned
and tested, and the repo's ``requirements.txt`` names the package.
"""

from __future__ import annotations

import os
from typing import Any

from .config import EntMTPConfig
from .errors import EntMTPError
from .heads import DraftHeads
from .integration import HEADS_ATTR, enable_entmtp
from .trees.tree import MC_SIM_7B_63


def attach_heads(model: Any, heads: "DraftHeads | str | os.PathLike | None") -> None:
    """Give ``model`` these heads, unless it carries them already (the same object, or heads loaded
    from the same folder or repo id); ``None``: the heads it carries (refused if it has none)."""
    carried = getattr(model, HEADS_ATTR, None)
    if heads is None:
        if carried is None:
            raise EntMTPError(
                "this model has no draft heads: pass entmtp_heads=<folder or Hub repo id> "
                "(or export the method with --heads)"
            )
        return
    same = carried is heads or (
        carried is not None and not isinstance(heads, DraftHeads) and carried.name_or_path == os.fspath(heads)
    )
    if not same:
        enable_entmtp(model, heads)


def default_config(bank: Any = None, task: str | None = None) -> EntMTPConfig:
    """The bank's ``task`` when a bank is given, else the published default tree ``mc_sim_7b_63``."""
    if bank is None:
        if task is not None:
            raise EntMTPError(f"entmtp_task={task!r} names a task of a bank: pass entmtp_bank= too")
        return EntMTPConfig(tree=MC_SIM_7B_63)
    return EntMTPConfig(bank=bank, task=task)


def entmtp_generate(
    model: Any,
    *args: Any,
    heads: "DraftHeads | str | os.PathLike | None" = None,
    bank: Any = None,
    task: str | None = None,
    config: EntMTPConfig | None = None,
    **kwargs: Any,
) -> Any:
    """``model.generate(*args, **kwargs)`` with EntMTP: ``heads`` attached (:func:`attach_heads`;
    the model keeps them for later calls, ``disable_entmtp`` removes them), decoding with
    ``config`` if given, else :func:`default_config` of ``bank`` and ``task``."""
    attach_heads(model, heads)
    return model.generate(*args, entmtp_config=config or default_config(bank, task), **kwargs)
