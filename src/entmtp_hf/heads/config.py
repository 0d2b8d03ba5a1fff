"""The configuration saved next to the draft-head weights.

Only what is needed to rebuild the heads lives here (sizes, family, architecture). The
per-call decoding settings belong to the generation config, never to this file, so one
set of heads can serve every decoding policy.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

#: Version of the on-disk layout written by ``save_pretrained``; bump on breaking changes.
FORMAT_VERSION = 1
FAMILIES = ("hydra", "medusa")
HEAD_ARCHS = {"hydra": ("mlp", "prefix-mlp"), "medusa": ("mlp",)}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"HeadsConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"HeadsConfig.{name} must be >= {minimum}, got {value}")


@dataclass
class HeadsConfig:
    """Shape and family of a set of draft heads (validated on construction)."""

    family: str = field(metadata={"help": "'hydra' (path-dependent) or 'medusa' (independent)"})
    num_heads: int = field(metadata={"help": "number of heads = maximum draft depth"})
    hidden_size: int = field(metadata={"help": "hidden size H of the base model"})
    vocab_size: int = field(metadata={"help": "vocabulary size V of the base model"})
    head_arch: str = field(default="mlp", metadata={"help": "'mlp' or (hydra only) 'prefix-mlp'"})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per head"})
    use_base_lm_head: bool = field(default=False, metadata={"help": "project with the base LM head"})
    draft_vocab_size: int = field(default=0, metadata={"help": "V' of the drafting vocabulary; 0 = full"})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "base model the heads fit"})
    prefix_layer_config: dict[str, Any] | None = field(
        default=None, metadata={"help": "base model config dict used to build the prefix layer (prefix-mlp)"}
    )
    format_version: int = field(default=FORMAT_VERSION, metadata={"help": "on-disk layout version"})

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"HeadsConfig.family must be one of {FAMILIES}, got {self.family!r}")
        archs = HEAD_ARCHS[self.family]
        if self.head_arch not in archs:
            raise ValueError(
                f"HeadsConfig.head_arch for {self.family!r} must be one of {archs}, got {self.head_arch!r}"
            )
        _check_int("num_heads", self.num_heads, 1)
        _check_int("num_layers", self.num_layers, 1)
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("draft_vocab_size", self.draft_vocab_size, 0)
        _check_int("format_version", self.format_version, 1)
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"HeadsConfig.format_version {self.format_version} is newer than this library supports "
                f"({FORMAT_VERSION}); upgrade entmtp-hf"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"HeadsConfig.draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})"
            )
        if not isinstance(self.use_base_lm_head, bool):
            raise ValueError(f"HeadsConfig.use_base_lm_head must be a bool, got {self.use_base_lm_head!r}")
        if self.base_model_name_or_path is not None and not isinstance(self.base_model_name_or_path, str):
            raise ValueError("HeadsConfig.base_model_name_or_path must be a string or null")
        self._check_prefix_layer_config()

    def _check_prefix_layer_config(self) -> None:
        cfg = self.prefix_layer_config
        if self.head_arch != "prefix-mlp":
            if cfg is not None:
                raise ValueError("HeadsConfig.prefix_layer_config is only used by head_arch='prefix-mlp'")
            return
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise ValueError(
                "HeadsConfig.prefix_layer_config must be the base model's config dict (with 'model_type') "
                "when head_arch='prefix-mlp'"
            )
        if cfg.get("hidden_size") != self.hidden_size:
            raise ValueError(
                f"HeadsConfig.prefix_layer_config hidden_size {cfg.get('hidden_size')!r} "
                f"!= hidden_size {self.hidden_size}"
            )

    @property
    def draft_vocab_rows(self) -> int:
        """Rows of each head's LM head: V' when a drafting vocabulary is set, else V."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadsConfig":
        """Build from a dict, warning about (and dropping) keys this version does not know."""
        if not isinstance(data, dict):
            raise ValueError(f"a heads config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"ignoring unknown heads config keys {unknown}", UserWarning, stacklevel=2)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"heads config lacks required keys {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})
