"""Registries of heads families and checkpoint formats, and loading through them.

The base class, the config and the loaders all need these tables, so they live here, below
them all: ``base`` and ``config`` register nothing and import no family, each family module
(``hydra``, ``medusa``, ``eagle``, ``mtp``) registers itself in one :func:`register_family`
call, and the format modules (``loading``: this project's own format, ``published``: Hydra,
Medusa and EAGLE) register their readers. ``heads/__init__`` imports them all, own format
first, so a checkpoint is recognised whichever module a caller imports.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..validation import brief_repr
from .files import HeadsLoadError, Weights, check_weights, read_json, resolve_file

if TYPE_CHECKING:
    from .config import HeadsConfig

CONFIG_NAME = "config.json"

#: resolve(filename, required=...) -> local path (None for a missing optional file)
Resolver = Callable[..., "str | None"]
#: load(config dict, config path, resolve, base_config) -> heads
Loader = Callable[[dict[str, Any], str, Resolver, Any], nn.Module]


@dataclass(frozen=True)
class HeadsFamily:
    """A registered heads family: see :func:`register_family`."""

    name: str
    heads_class: type[nn.Module]  # a ``DraftHeads`` subclass (typed as a module: this module never imports the base)
    config_class: type  # ``HeadsConfig`` or a subclass of it: what the family's ``config.json`` is read into
    archs: tuple[str, ...]
    layer_archs: tuple[str, ...]
    from_model: Callable[[nn.Module], nn.Module] | None


#: family name -> its registration, in registration order; filled when the family modules import
FAMILIES: dict[str, HeadsFamily] = {}


def register_family(
    name: str,
    heads_class: type[nn.Module],
    *,
    config_class: type,
    archs: tuple[str, ...],
    layer_archs: tuple[str, ...] = (),
    from_model: Callable[[nn.Module], nn.Module] | None = None,
) -> HeadsFamily:
    """Register a heads family under ``name`` (the ``family`` its configs name), as peft registers a method.

    ``heads_class``: the ``DraftHeads`` subclass built from its config (its ``family`` is set to
    ``name``); ``config_class``: ``HeadsConfig`` or the family's own subclass of it (fields the
    family adds are saved in ``config.json`` and read back into it); ``archs``: the ``head_arch``
    values it builds, ``layer_archs`` those built on a one-layer copy of the base config
    (``prefix_layer_config``); ``from_model``: for heads that are a model's own layers, what builds
    them from the model (``load_heads(name, model=...)`` and ``enable_entmtp(model, name)`` call it).
    A name registered already, or archs that are not a non-empty tuple of names, are refused
    (``ValueError``: a programming error, not bad input).
    """
    if not isinstance(name, str) or not name or name in FAMILIES:
        raise ValueError(f"heads family name {brief_repr(name)} is taken or empty; registered: {list(FAMILIES)}")
    if not isinstance(archs, tuple) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise ValueError(f"family {name!r}: archs must be a non-empty tuple of names, got {brief_repr(archs)}")
    if not set(layer_archs) <= set(archs):
        raise ValueError(f"family {name!r}: layer_archs {list(layer_archs)} are not among its archs {list(archs)}")
    family = HeadsFamily(name, heads_class, config_class, archs, tuple(layer_archs), from_model)
    heads_class.family = name
    FAMILIES[name] = family
    return family


class _HeadsClasses(Mapping[str, type]):
    """Family name -> heads class, read from :data:`FAMILIES` (one table, two views)."""

    def __getitem__(self, name: str) -> type:
        return FAMILIES[name].heads_class

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


#: family name -> heads class (a ``DraftHeads`` subclass)
HEADS_REGISTRY: Mapping[str, type] = _HeadsClasses()


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
    cls = FAMILIES[config.family].heads_class
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
