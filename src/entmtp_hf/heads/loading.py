"""Format detection and loading of heads from folders, Hub repos or published checkpoints."""

from __future__ import annotations

import functools
import os
from typing import Any

from .base import CONFIG_NAME, FORMAT_KEY, HEADS_REGISTRY, WEIGHTS_NAME, DraftHeads, check_draft_vocab
from .config import FORMAT_VERSION, HeadsConfig
from .files import HeadsLoadError, load_safetensors, match_state, read_json, resolve_file
from .published import load_published_hydra, load_published_medusa


def detect_format(cfg: dict[str, Any]) -> str:
    """'entmtp', 'hydra' or 'medusa' from a checkpoint's ``config.json`` contents ('' if none)."""
    if FORMAT_KEY in cfg:
        return "entmtp"
    if "hydra_num_heads" in cfg:
        return "hydra"
    if "medusa_num_heads" in cfg:
        return "medusa"
    return ""


def load_own_format(cfg: dict[str, Any], cfg_path: str, resolve: Any) -> DraftHeads:
    """Heads saved by :meth:`DraftHeads.save_pretrained` (strict keys, shapes and ids)."""
    cfg = dict(cfg)
    version = cfg.pop(FORMAT_KEY)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise HeadsLoadError(
            f"{cfg_path}: unsupported {FORMAT_KEY} {version!r} (this library reads 1..{FORMAT_VERSION})"
        )
    try:
        config = HeadsConfig.from_dict(cfg)
        heads = HEADS_REGISTRY[config.family](config)
    except ValueError as e:
        raise HeadsLoadError(f"{cfg_path}: {e}") from e
    path = resolve(WEIGHTS_NAME, required=True)
    weights = load_safetensors(path)
    # the module stays float32: load_state_dict casts half-precision weights up, and
    # non-persistent buffers (a prefix layer's RoPE inv_freq) keep full precision
    expected = {k: (k, v.shape) for k, v in heads.state_dict().items()}
    heads.load_state_dict(match_state(weights, expected, path))
    if heads.draft_vocab is not None:
        try:
            check_draft_vocab(heads.draft_vocab, config.vocab_size)
        except ValueError as e:
            raise HeadsLoadError(f"{path}: {e}") from e
    return heads


def load_from_source(
    source: str | os.PathLike,
    *,
    revision: str | None = None,
    base_config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> DraftHeads:
    """Load heads of any supported format from a local folder or a Hub repo id."""
    resolve = functools.partial(resolve_file, source, revision=revision, cache_dir=cache_dir, token=token)
    cfg_path = resolve(CONFIG_NAME, required=True)
    cfg = read_json(cfg_path)
    kind = detect_format(cfg)
    if kind == "entmtp":
        return load_own_format(cfg, cfg_path, resolve)
    if kind == "hydra":
        return load_published_hydra(cfg, cfg_path, resolve, base_config)
    if kind == "medusa":
        return load_published_medusa(cfg, cfg_path, resolve)
    raise HeadsLoadError(
        f"{cfg_path}: not a draft-heads config (no {FORMAT_KEY!r}, 'hydra_num_heads' or 'medusa_num_heads' field)"
    )


def load_heads(
    source: "str | os.PathLike | DraftHeads",
    revision: str | None = None,
    *,
    base_config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> DraftHeads:
    """Heads from an object (returned as is), a local folder or a Hub repo id; format auto-detected."""
    if isinstance(source, DraftHeads):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_heads takes DraftHeads, a folder or a repo id, got {type(source).__name__}")
    return load_from_source(source, revision=revision, base_config=base_config, cache_dir=cache_dir, token=token)


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
