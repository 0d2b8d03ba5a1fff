"""The configuration saved next to the draft-head weights.

Only what is needed to rebuild the heads lives here (sizes, family, architecture). The
per-call decoding settings belong to the generation config, never to this file, so one
set of heads can serve every decoding policy. The families, their archs and config classes
are read from the registry (:func:`~entmtp_hf.heads.registry.register_family`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..validation import brief_list, brief_repr, choice, integer, number
from .registry import FAMILIES

#: Version of the on-disk layout written by ``save_pretrained``; bump on breaking changes.
FORMAT_VERSION = 1
#: Size limits, far above any published or trained heads (4-5 heads of 1-4 blocks, hidden
#: sizes up to 8192, vocabularies up to ~256k) and low enough that a config cannot ask for
#: an absurd module: every size is checked here before anything is built.
MAX_HEADS = 64
MAX_LAYERS = 64
MAX_BASE_LAYERS = 4096  # a base model's depth, for the hidden-state indices an eagle3 drafter fuses
MAX_HIDDEN_SIZE = 65536
MAX_VOCAB_SIZE = 2**21
#: The prefix layer's own sizes (attention heads, their width, the MLP width, positions).
MAX_ATTENTION_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_INTERMEDIATE_SIZE = 2**20
MAX_POSITIONS = 2**24
_FIELD = "HeadsConfig"
_MAX_VERSION = 2**31 - 1  # any version number; those above FORMAT_VERSION are refused as too new
_PREFIX = f"{_FIELD}.prefix_layer_config"


def _check_rope(field: str, rope: Any) -> None:
    """RoPE settings: a dict whose numbers are finite and whose theta and factors are positive."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ConfigError(field, f"must be a dict or null, got {brief_repr(rope)}")
    for key, value in rope.items():
        where = f"{field}.{key}"
        if key in ("rope_type", "type"):
            if not isinstance(value, str):
                raise ConfigError(where, f"must be a string, got {brief_repr(value)}")
        elif key == "rope_theta" or "factor" in key:  # factor, low_freq_factor, short_factor (a list), ...
            for x in value if isinstance(value, list) else [value]:
                number(x, where, low=0.0, low_open=True)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number(value, where)


def _check_attention(cfg: dict[str, Any], hidden_size: int) -> None:
    """Head counts and widths: positive, bounded, and dividing as attention needs them to."""
    heads = cfg.get("num_attention_heads")
    if heads is not None:
        integer(heads, f"{_PREFIX}.num_attention_heads", low=1, high=MAX_ATTENTION_HEADS)
        if cfg.get("head_dim") is None and hidden_size % heads:  # head_dim = hidden_size // heads
            raise ConfigError(f"{_PREFIX}.num_attention_heads", f"{heads} does not divide hidden_size {hidden_size}")
    kv = cfg.get("num_key_value_heads")
    if kv is not None:
        integer(kv, f"{_PREFIX}.num_key_value_heads", low=1, high=heads or MAX_ATTENTION_HEADS)
        if heads is not None and heads % kv:
            raise ConfigError(f"{_PREFIX}.num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    if cfg.get("head_dim") is not None:
        integer(cfg["head_dim"], f"{_PREFIX}.head_dim", low=1, high=MAX_HEAD_DIM)


def check_prefix_layer_config(cfg: Any, hidden_size: int) -> None:
    """The fields of a prefix layer's config that the layer is built from, by type and range.

    Unchecked fields are left to transformers; whatever it still refuses is reported by the
    loader as an error naming the file.
    """
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ConfigError(_PREFIX, "must be the base model's config dict (with 'model_type') for prefix-mlp heads")
    if cfg.get("hidden_size") != hidden_size:
        got = brief_repr(cfg.get("hidden_size"))
        raise ConfigError(f"{_PREFIX}.hidden_size", f"{got} != hidden_size {hidden_size}")
    if cfg.get("num_hidden_layers", 1) != 1:  # the prefix layer is one decoder layer
        raise ConfigError(f"{_PREFIX}.num_hidden_layers", f"must be 1, got {brief_repr(cfg['num_hidden_layers'])}")
    _check_attention(cfg, hidden_size)
    for key, maximum in (
        ("intermediate_size", MAX_INTERMEDIATE_SIZE),
        ("max_position_embeddings", MAX_POSITIONS),
        ("vocab_size", MAX_VOCAB_SIZE),
    ):
        if cfg.get(key) is not None:
            integer(cfg[key], f"{_PREFIX}.{key}", low=1, high=maximum)
    if "hidden_act" in cfg:
        from transformers.activations import ACT2FN

        act = cfg["hidden_act"]
        if not isinstance(act, str) or act not in ACT2FN:
            known = brief_list(sorted(ACT2FN))
            raise ConfigError(f"{_PREFIX}.hidden_act", f"must be one of [{known}], got {brief_repr(act)}")
    for key in ("rms_norm_eps", "rope_theta"):
        if key in cfg:
            number(cfg[key], f"{_PREFIX}.{key}", low=0.0, low_open=True)
    for key in ("attention_dropout", "partial_rotary_factor"):
        if cfg.get(key) is not None:
            number(cfg[key], f"{_PREFIX}.{key}", low=0.0, high=1.0, low_open=key == "partial_rotary_factor")
    for key in ("attention_bias", "mlp_bias"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise ConfigError(f"{_PREFIX}.{key}", f"must be a bool, got {brief_repr(cfg[key])}")
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope(f"{_PREFIX}.{key}", cfg.get(key))


@dataclass
class HeadsConfig:
    """Shape and family of a set of draft heads (validated on construction).

    A family whose heads need more fields registers its own subclass (``register_family(...,
    config_class=...)``); :meth:`from_dict` reads a saved config into its family's class.
    """

    family: str = field(
        metadata={
            "help": "a registered family: 'hydra' (path-dependent), 'medusa' (independent), 'eagle' (feature "
            "drafter), 'mtp' (the model's own MTP layers), ..."
        }
    )
    num_heads: int = field(metadata={"help": "number of heads = maximum draft depth (eagle: the depth it drafts to)"})
    hidden_size: int = field(metadata={"help": "hidden size H of the base model"})
    vocab_size: int = field(metadata={"help": "vocabulary size V of the base model"})
    head_arch: str = field(default="mlp", metadata={"help": "'mlp', (hydra) 'prefix-mlp', (eagle) 'eagle' or 'eagle3'"})
    num_layers: int = field(
        default=1, metadata={"help": "residual blocks per head (eagle: decoder layers, mtp: the model's MTP layers)"}
    )
    use_base_lm_head: bool = field(default=False, metadata={"help": "project with the base LM head"})
    draft_vocab_size: int = field(default=0, metadata={"help": "V' of the drafting vocabulary; 0 = full"})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "base model the heads fit"})
    prefix_layer_config: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "one-layer base model config dict the prefix layer (prefix-mlp) or drafter layers (eagle) are "
            "built from"
        },
    )
    feature_layers: list[int] | None = field(
        default=None,
        metadata={
            "help": "eagle3: the base hidden-state indices fused into the drafter's feature; "
            "eagle: further states fused into the last one (-1, listed last)"
        },
    )
    format_version: int = field(default=FORMAT_VERSION, metadata={"help": "on-disk layout version"})

    def __post_init__(self) -> None:
        family = FAMILIES[choice(self.family, f"{_FIELD}.family", sorted(FAMILIES))]
        if not isinstance(self.head_arch, str) or self.head_arch not in family.archs:
            got = brief_repr(self.head_arch)
            raise ConfigError(
                f"{_FIELD}.head_arch", f"for {self.family!r} must be one of {list(family.archs)}, got {got}"
            )
        for name, maximum in (
            ("num_heads", MAX_HEADS),
            ("num_layers", MAX_LAYERS),
            ("hidden_size", MAX_HIDDEN_SIZE),
            ("vocab_size", MAX_VOCAB_SIZE),
        ):
            setattr(self, name, integer(getattr(self, name), f"{_FIELD}.{name}", low=1, high=maximum))
        self.draft_vocab_size = integer(
            self.draft_vocab_size, f"{_FIELD}.draft_vocab_size", low=0, high=self.vocab_size
        )
        self.format_version = integer(self.format_version, f"{_FIELD}.format_version", low=1, high=_MAX_VERSION)
        if self.format_version > FORMAT_VERSION:
            raise ConfigError(
                f"{_FIELD}.format_version",
                f"{self.format_version} is newer than this library supports ({FORMAT_VERSION}); upgrade entmtp-hf",
            )
        if not isinstance(self.use_base_lm_head, bool):
            raise ConfigError(f"{_FIELD}.use_base_lm_head", f"must be a bool, got {brief_repr(self.use_base_lm_head)}")
        if self.base_model_name_or_path is not None and not isinstance(self.base_model_name_or_path, str):
            raise ConfigError(f"{_FIELD}.base_model_name_or_path", "must be a string or null")
        if self.head_arch in family.layer_archs:
            check_prefix_layer_config(self.prefix_layer_config, self.hidden_size)
        elif self.prefix_layer_config is not None:
            archs = f" of head_arch in {list(family.layer_archs)}" if family.layer_archs else ""
            raise ConfigError(_PREFIX, f"is {'only' if archs else 'not'} used by {self.family!r} heads{archs}")
        self._check_feature_layers()

    def _check_feature_layers(self) -> None:
        where, layers = f"{_FIELD}.feature_layers", self.feature_layers
        if self.head_arch == "eagle" and layers is not None:  # further base states fused into an EAGLE-1 feature
            if not isinstance(layers, list) or len(layers) < 2 or layers[-1] != -1:
                raise ConfigError(
                    where,
                    "an 'eagle' drafter fuses base hidden states into its feature: a list "
                    f"of indices ending with -1 (the last state), got {brief_repr(layers)}",
                )
            for index in layers[:-1]:
                integer(index, where, low=0, high=MAX_BASE_LAYERS)
            if len(set(layers)) != len(layers):
                raise ConfigError(where, f"repeats a hidden state: {layers}")
            return
        if self.head_arch != "eagle3":
            if layers is not None:
                raise ConfigError(where, "is only used by head_arch 'eagle3' (and 'eagle', fusing further states)")
            return
        if not isinstance(layers, list) or len(layers) != 3:
            raise ConfigError(
                where, f"eagle3 fuses three base hidden states: a list of 3 indices, got {brief_repr(layers)}"
            )
        for (
            index
        ) in layers:  # hidden-state indices: 0 is the embeddings' output (checked against a model in check_fits)
            integer(index, where, low=0, high=MAX_BASE_LAYERS)
        if self.num_layers != 1:
            raise ConfigError(f"{_FIELD}.num_layers", f"eagle3 has one decoder layer, got {self.num_layers}")

    @property
    def draft_vocab_rows(self) -> int:
        """Rows of each head's LM head: V' when a drafting vocabulary is set, else V."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadsConfig":
        """Build from a dict, as its family's registered config class (a subclass of ``cls``) where it names a
        registered family, warning about (and dropping) keys that class does not know."""
        if not isinstance(data, dict):
            raise ConfigError(_FIELD, f"a heads config must be a JSON object, got {type(data).__name__}")
        family = FAMILIES.get(data["family"]) if isinstance(data.get("family"), str) else None
        target = family.config_class if family is not None and issubclass(family.config_class, cls) else cls
        known = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            warnings.warn(f"ignoring unknown heads config keys [{brief_list(unknown)}]", UserWarning, stacklevel=2)
        missing = [
            f.name for f in dataclasses.fields(target) if f.name not in data and f.default is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(_FIELD, f"heads config lacks required keys {missing}")
        return target(**{k: v for k, v in data.items() if k in known})
