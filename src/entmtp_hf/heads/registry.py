"""Registries of heads families and checkpoint formats, and loading through them.

The base class and the loaders both need these tables, so they live here, below both:
``base`` registers nothing and imports no loader, the family modules (``hydra``, ``medusa``)
register their classes, and the format modules (``loading``: this project's own format,
``published``: Hydra and Medusa) register their readers. ``heads/__init__`` imports them
all, own format first, so a checkpoint is recognised whichever module a caller imports.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from .config import HeadsConfig
from .files import HeadsLoadError, Weights, check_weights, read_json, resolve_file

CONFIG_NAME = "config.json"

#: family name -> heads class (a ``DraftHeads`` subclass; typed as a module so that this
#: module never imports the base); filled by :func:`register_heads` when the family modules import.
HEADS_REGISTRY: dict[str, type[nn.Module]] = {}
_H = TypeVar("_H", bound=type)

#: resolve(filename, required=...) -> local path (None for a missing optional file)
Resolver = Callable[..., "str | None"]
#: load(config dict, config path, resolve, base_config) -> heads
Loader = Callable[[dict[str, Any], str, Resolver, Any], nn.Module]


def register_heads(family: str) -> Callable[[_H], _H]:
    """Class decorator adding a heads class to :data:`HEADS_REGISTRY` under ``family``."""

    def add(cls: _H) -> _H:
        cls.family = family
        HEADS_REGISTRY[family] = cls
        return cls

    return add


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint layout: recognised by a key of its ``config.json`` (or ``detect``), read by ``load``."""

    name: str
    marker: str  # the config.json key that identifies the format ('' when ``detect`` does)
    load: Loader
    detect: Callable[[dict[str, Any]], bool] | None = None

    def matches(self, cfg: dict[str, Any]) -> bool:
        return (bool(self.marker) and self.marker in cfg) or (self.detect is not None and self.detect(cfg))


#: formats in registration order, which is the order they are tried in
FORMATS: dict[str, CheckpointFormat] = {}


def register_format(
    name: str, marker: str, load: Loader, detect: Callable[[dict[str, Any]], bool] | None = None
) -> None:
    """Add a checkpoint format recognised by ``marker`` in ``config.json`` (or by ``detect(cfg)``,
    for layouts without a key of their own) and read by ``load``."""
    FORMATS[name] = CheckpointFormat(name, marker, load, detect)


def detect_format(cfg: dict[str, Any]) -> str:
    """The name of the first registered format that recognises ``cfg`` ('' if none)."""
    return next((f.name for f in FORMATS.values() if f.matches(cfg)), "")


def load_from_source(
    source: str | os.PathLike,
    *,
    revision: str | None = None,
    base_config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
) -> nn.Module:
    """Load heads of any registered format from a local folder or a Hub repo id; the heads
    remember ``source`` as their ``name_or_path``."""
    resolve = functools.partial(
        resolve_file,
        source,
        revision=revision,
        cache_dir=cache_dir,
        token=token,
        force_download=force_download,
        local_files_only=local_files_only,
    )
    cfg_path = resolve(CONFIG_NAME, required=True)
    cfg = read_json(cfg_path)
    kind = detect_format(cfg)
    if not kind:
        markers = ", ".join(repr(f.marker) for f in FORMATS.values() if f.marker)
        raise HeadsLoadError(
            cfg_path,
            f"not a draft-heads config (none of the fields {markers}, nor a one-layer EAGLE config){_foreign(cfg)}",
        )
    heads = FORMATS[kind].load(cfg, cfg_path, resolve, base_config)
    heads.name_or_path = os.fspath(source)
    return heads


def _foreign(cfg: dict[str, Any]) -> str:
    """What a ``config.json`` that holds no heads seems to be instead, for the refusal."""
    if isinstance(cfg.get("model_type"), str) or "architectures" in cfg:
        return f"; it looks like the config of a transformers model (model_type {cfg.get('model_type')!r}), not heads"
    return ""


def _same(name: str) -> str:
    return name


def build_checked(
    config: HeadsConfig,
    weights: Weights,
    cfg_path: str,
    name_in_file: Callable[[str], str] = _same,
    ignore: tuple[str, ...] = (),
) -> nn.Module:
    """Heads for ``config`` holding ``weights``, allocated only once the weights fit.

    The heads are first built on the meta device (shapes and dtypes, no memory) and the
    weights checked against them; ``name_in_file`` maps a module key to the file's name for
    it. Any failure to build what the config describes names ``cfg_path``.
    """
    cls = HEADS_REGISTRY[config.family]
    try:
        with torch.device("meta"):
            skeleton = cls(config)
    except Exception as e:  # transformers raises many types for a prefix config it cannot build
        raise HeadsLoadError(cfg_path, f"cannot build the heads this config describes ({type(e).__name__}: {e})") from e
    expected = {name_in_file(k): (k, t) for k, t in skeleton.state_dict().items()}
    stored = check_weights(weights, expected, ignore)
    heads = cls(config)  # float32; half-precision weights are cast up on load
    heads.load_state_dict({k: s.read() for k, s in stored.items()})
    return heads
