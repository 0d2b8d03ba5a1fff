"""This project's own heads format, and loading heads of any registered format.

Importing this module registers the own format (``config.json`` with ``entmtp_heads_format``,
a ``model.safetensors`` and an optional ``card.json``); :mod:`.published` registers the Hydra
and Medusa layouts.
"""

from __future__ import annotations

import os
from typing import Any

from ..validation import brief_repr
from .base import FORMAT_KEY, WEIGHTS_NAME, DraftHeads, check_draft_vocab
from .card import CARD_NAME, HeadsCard, read_card
from .config import FORMAT_VERSION, HeadsConfig
from .files import HeadsLoadError, open_safetensors
from .registry import FAMILIES, Resolver, build_checked, detect_format, register_format

__all__ = ["convert_heads", "detect_format", "load_heads", "load_own_format"]


def _own_config(cfg: dict[str, Any], cfg_path: str) -> HeadsConfig:
    cfg = dict(cfg)
    version = cfg.pop(FORMAT_KEY)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise HeadsLoadError(
            cfg_path, f"unsupported {FORMAT_KEY} {brief_repr(version)} (this library reads 1..{FORMAT_VERSION})"
        )
    try:
        return HeadsConfig.from_dict(cfg)  # as its family's registered config class
    except ValueError as e:
        raise HeadsLoadError(cfg_path, str(e)) from e


def load_own_format(cfg: dict[str, Any], cfg_path: str, resolve: Resolver, base_config: Any = None) -> DraftHeads:
    """Heads saved by :meth:`DraftHeads.save_pretrained` (strict keys, shapes, dtypes and ids),
    with their card (``card.json``; heads saved before cards existed have none).

    ``base_config`` is not needed: the prefix layer's config is saved with the heads.
    """
    config = _own_config(cfg, cfg_path)
    card_path = resolve(CARD_NAME, required=False)
    card = read_card(card_path, config.num_heads) if card_path is not None else HeadsCard()
    weights = open_safetensors(resolve(WEIGHTS_NAME, required=True))
    # the module stays float32: load_state_dict casts half-precision weights up, and
    # non-persistent buffers (a prefix layer's RoPE inv_freq) keep full precision
    heads = build_checked(config, weights, cfg_path)
    if heads.draft_vocab is not None:
        try:
            check_draft_vocab(heads.draft_vocab, config.vocab_size)
        except ValueError as e:
            raise HeadsLoadError(weights.path, str(e)) from e
    heads.card = card
    return heads


register_format("entmtp", FORMAT_KEY, load_own_format)


def load_heads(
    source: "str | os.PathLike | DraftHeads",
    revision: str | None = None,
    *,
    model: Any = None,
    base_config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
) -> DraftHeads:
    """Heads from an object (returned as is), a local folder or a Hub repo id (format auto-detected), or
    the name of a family whose heads are a model's own layers (``"mtp"``: ``model``'s multi-token-prediction
    layers, :meth:`~entmtp_hf.heads.mtp.MtpHeads.from_model`; a folder of that name is ``"./mtp"``)."""
    if isinstance(source, DraftHeads):
        return source
    family = FAMILIES.get(source) if isinstance(source, str) else None
    if family is not None and family.from_model is not None:
        if model is None:
            raise ValueError(f"heads {source!r} are a model's own layers: pass the model (model=...)")
        return family.from_model(model)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_heads takes DraftHeads, a folder or a repo id, got {type(source).__name__}")
    return DraftHeads.from_pretrained(
        source,
        revision,
        base_config=base_config,
        cache_dir=cache_dir,
        token=token,
        force_download=force_download,
        local_files_only=local_files_only,
    )


def convert_heads(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    revision: str | None = None,
    base_config: Any = None,
) -> DraftHeads:
    """Rewrite a published (or own-format) checkpoint into this project's format at ``dst``."""
    heads = load_heads(src, revision, base_config=base_config)
    heads.save_pretrained(dst)
    return heads
