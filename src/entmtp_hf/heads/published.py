"""Reading the published Hydra, Medusa and EAGLE checkpoints into this project's heads.

Facts about the layouts (key names, quirks) are in docs/DESIGN §2. In short:

* Hydra: ``config.json`` with ``hydra_*`` fields and a pickled ``hydra_lm_head.pt``;
  keys ``hydra_mlp.{i}.{j}.(linear|res_connection).*`` and ``hydra_lm_head.{i}.*``. In
  ``prefix-mlp`` the even entries of each ``hydra_mlp.{i}`` are Dropout (blocks sit at odd
  indices), ``hydra_lm_head.{i}.1`` is the linear, and ``prefix_embeding_layer.*`` is a
  one-layer base model (its ``embed_tokens`` copy is ignored, as is ``input_embed_fn``).
* Medusa: ``config.json`` with ``medusa_*`` fields and ``medusa_lm_head.pt`` with keys
  ``{i}.{j}.linear.*`` and ``{i}.{L}.weight``; Medusa-2 full models prefix them with
  ``medusa_head.``. Head and layer counts come from the weights (the published 7B
  config understates the head count).
* EAGLE-1/2 (SafeAILab/EAGLE ``cnets1.py``): a one-layer Llama ``config.json`` (no marker of its
  own) and ``pytorch_model.bin`` with ``fc.weight`` [H, 2H] (``fc.bias`` unless the config says
  ``"bias": false``), ``layers.0.*`` without ``input_layernorm``, and a copy of the base
  embeddings (``embed_tokens.weight``, ignored: the base model's own are used); no final norm,
  the base LM head. EAGLE-3 (``cnets.py``): ``fc.weight`` [H, 3H], ``midlayer.*`` (q/k/v read
  2H), ``norm.weight``, its own ``lm_head.weight`` [V', H] and ``d2t`` (target id = draft id +
  d2t[draft id]; ``t2d`` is its inverse, ignored); the fused states are the inputs of base
  layers 2, L/2 and L-3, so the base config is needed (``base_config``) unless the config names
  them (``eagle_aux_hidden_state_layer_ids``, vLLM's key, which ``export-heads`` writes).

Importing this module registers both formats. Pickles are read weights-only and memory-mapped;
shard names from an index are refused when they leave the folder or repo; every size read off
the weights is bounded and checked against the whole file before the heads are allocated.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ..validation import brief_list, brief_repr, integer
from .base import text_config
from .config import MAX_BASE_LAYERS, MAX_HEADS, MAX_HIDDEN_SIZE, MAX_LAYERS, MAX_VOCAB_SIZE, HeadsConfig
from .eagle import EagleHeads, eagle3_feature_layers
from .files import MAX_INDEX_BYTES, HeadsLoadError, Weights, merge_weights, open_weights, read_json, stored_tensor
from .hydra import HydraHeads, prefix_layer_config
from .medusa import MedusaHeads
from .registry import Resolver, build_checked, register_format

HYDRA_WEIGHT_FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
HYDRA_IGNORED = ("input_embed_fn.weight", "prefix_embeding_layer.embed_tokens.weight", "rotary_emb.inv_freq")
MEDUSA_WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
MEDUSA_FULL_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
MEDUSA_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MEDUSA2_PREFIX = "medusa_head."
EAGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EAGLE_IGNORED = ("embed_tokens.weight", "t2d", "rotary_emb.inv_freq")
#: published EAGLE config keys that are not the layer's architecture
EAGLE_CONFIG_KEYS = ("bias", "draft_vocab_size", "target_hidden_size", "qkv_bias", "eagle_aux_hidden_state_layer_ids")
#: tree depth a published EAGLE drafter may draft to (its checkpoints do not say; EAGLE's own trees go to 5-8)
EAGLE_MAX_DEPTH = 12
_MISSING = object()


def _field(cfg: dict[str, Any], name: str, kind: type | tuple[type, ...], path: str, default: Any = _MISSING) -> Any:
    """A typed config field (bools are not ints here)."""
    if name not in cfg:
        if default is _MISSING:
            raise HeadsLoadError(path, f"missing field {name!r}")
        return default
    value = cfg[name]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise HeadsLoadError(path, f"field {name!r} has type {type(value).__name__}, expected {kind}")
    return value


def _first_file(resolve: Resolver, names: tuple[str, ...]) -> str | None:
    for name in names:
        path = resolve(name, required=False)
        if path is not None:
            return path
    return None


def _shape(weights: Weights, key: str, dims: int) -> tuple[int, ...]:
    """The shape of a tensor that sizes are read off: present, ``dims``-D, no zero-size dimension."""
    if key not in weights.tensors:
        raise HeadsLoadError(weights.path, f"missing key {key!r}")
    shape = tuple(weights.tensors[key].shape)
    if len(shape) != dims:
        raise HeadsLoadError(weights.path, f"{key} has shape {shape}, expected {dims} dims")
    if 0 in shape:
        raise HeadsLoadError(weights.path, f"{key} has shape {shape}, with a zero-size dimension")
    return shape


def _sized_config(weights: Weights, cfg_path: str, **fields: Any) -> HeadsConfig:
    """A config whose sizes come partly from ``cfg_path``, partly from the weights' shapes."""
    try:
        return HeadsConfig(**fields)
    except ValueError as e:
        raise HeadsLoadError(weights.path, f"{e} (sizes read from this file and {cfg_path})") from e


# --------------------------------------------------------------------------- Hydra
#: the sizes a published Hydra or Medusa config.json may declare beside the weights, and their bounds
DECLARED_SIZES = {"hidden_size": MAX_HIDDEN_SIZE, "vocab_size": MAX_VOCAB_SIZE}


def _check_declared_sizes(cfg: dict[str, Any], cfg_path: str, weights: Weights, **found: int) -> None:
    """The sizes ``cfg_path`` declares (:data:`DECLARED_SIZES`; optional) are integers within their
    bounds and the sizes ``found`` in the weights' shapes: the weights size the heads, so a config
    that disagrees with them belongs to other heads (or was edited), and is refused naming it."""
    for name, actual in found.items():
        if cfg.get(name) is None:
            continue
        declared = integer(
            cfg[name],
            name,
            low=1,
            high=DECLARED_SIZES[name],
            error=lambda field, problem: HeadsLoadError(cfg_path, f"{field} {problem}"),
        )
        if declared != actual:
            raise HeadsLoadError(cfg_path, f"{name} is {declared}, but the weights in {weights.path} have {actual}")


def hydra_published_name(own_key: str, arch: str) -> str:
    """The published key of one of :class:`HydraHeads`' parameters."""
    m = re.fullmatch(r"mlps\.(\d+)\.(\d+)\.(.+)", own_key)
    if m:
        i, j, rest = int(m[1]), int(m[2]), m[3]
        return f"hydra_mlp.{i}.{2 * j + 1 if arch == 'prefix-mlp' else j}.{rest}"
    m = re.fullmatch(r"lm_heads\.(\d+)\.(.+)", own_key)
    if m:
        return f"hydra_lm_head.{m[1]}.{'1.' if arch == 'prefix-mlp' else ''}{m[2]}"
    return own_key  # prefix_embeding_layer.* keeps its published name


def _hydra_base_config(base_config: Any, base_name: str | None, path: str) -> Any:
    if base_config is not None:
        if isinstance(base_config, dict):
            from transformers import AutoConfig

            return AutoConfig.for_model(**base_config)
        return base_config
    if not base_name:
        raise HeadsLoadError(path, "prefix-mlp heads need the base model config; pass base_config=")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(base_name)
    except Exception as e:
        raise HeadsLoadError(
            path,
            f"prefix-mlp heads need the config of base model {brief_repr(base_name)}, which could not be loaded "
            f"({type(e).__name__}: {e}); pass base_config=model.config",
        ) from e


def load_published_hydra(cfg: dict[str, Any], cfg_path: str, resolve: Resolver, base_config: Any = None) -> HydraHeads:
    """Hydra heads from a published Hydra checkpoint (grounded ``mlp`` / ``prefix-mlp``)."""
    num_heads = _field(cfg, "hydra_num_heads", int, cfg_path)
    num_layers = _field(cfg, "hydra_num_layers", int, cfg_path)
    arch = _field(cfg, "hydra_head_arch", str, cfg_path)
    grounded = _field(cfg, "grounded_heads", bool, cfg_path)
    offset = _field(cfg, "hidden_state_offset", int, cfg_path, default=0)
    base_name = _field(cfg, "base_model_name_or_path", (str, type(None)), cfg_path, default=None)
    if arch not in ("mlp", "prefix-mlp"):
        supported = "'mlp', 'prefix-mlp'"
        raise HeadsLoadError(cfg_path, f"unsupported hydra_head_arch {brief_repr(arch)} (supported: {supported})")
    if not grounded:
        raise HeadsLoadError(cfg_path, "non-grounded Hydra heads (grounded_heads=false) are not supported")
    if offset != 0:
        raise HeadsLoadError(cfg_path, f"hidden_state_offset={offset} is not supported (only 0)")

    path = _first_file(resolve, HYDRA_WEIGHT_FILES)
    if path is None:
        raise HeadsLoadError(cfg_path, f"no Hydra weights next to it (looked for {', '.join(HYDRA_WEIGHT_FILES)})")
    weights = open_weights(path)
    block = "1" if arch == "prefix-mlp" else "0"
    hidden = _shape(weights, f"hydra_mlp.0.{block}.linear.weight", 2)[0]
    vocab = _shape(weights, f"hydra_lm_head.0.{'1.' if arch == 'prefix-mlp' else ''}weight", 2)[0]
    _check_declared_sizes(cfg, cfg_path, weights, hidden_size=hidden, vocab_size=vocab)
    prefix = None
    if arch == "prefix-mlp":
        prefix = prefix_layer_config(_hydra_base_config(base_config, base_name, cfg_path))
        if prefix.get("hidden_size") != hidden:
            theirs = brief_repr(prefix.get("hidden_size"))
            raise HeadsLoadError(path, f"hidden size {hidden} differs from the base config's {theirs}")
    config = _sized_config(
        weights,
        cfg_path,
        family="hydra",
        head_arch=arch,
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        base_model_name_or_path=base_name,
        prefix_layer_config=prefix,
    )
    return build_checked(config, weights, cfg_path, lambda k: hydra_published_name(k, arch), ignore=HYDRA_IGNORED)


# --------------------------------------------------------------------------- Medusa
def _medusa2_weights(resolve: Resolver) -> Weights | None:
    """``medusa_head.*`` tensors of a Medusa-2 full-model repo (single file or sharded), prefix removed."""
    path = _first_file(resolve, MEDUSA_FULL_MODEL_FILES)
    if path is not None:
        return open_weights(path, keys_with_prefix=MEDUSA2_PREFIX)
    index_path = _first_file(resolve, MEDUSA_INDEX_FILES)
    if index_path is None:
        return None
    weight_map = read_json(index_path, max_bytes=MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HeadsLoadError(index_path, "missing or invalid 'weight_map'")
    shards = sorted({f for k, f in weight_map.items() if k.startswith(MEDUSA2_PREFIX)})
    # each shard name comes from the index, so resolving refuses any that leaves the folder or repo
    parts = [open_weights(resolve(shard, required=True, named_by=index_path), MEDUSA2_PREFIX) for shard in shards]
    return merge_weights(index_path, parts)


def infer_medusa_layout(weights: Weights) -> tuple[int, int, int, int]:
    """(num_heads, num_layers, hidden_size, vocab_size) read off Medusa weight names and shapes."""
    path = weights.path
    blocks: dict[int, set[int]] = {}
    for key in weights.tensors:
        m = re.fullmatch(r"(\d{1,9})\.(\d{1,9})\.linear\.weight", key)
        if m:
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
    if not blocks:
        raise HeadsLoadError(path, "no Medusa head weights ('{i}.{j}.linear.weight') found")
    num_heads = len(blocks)
    if num_heads > MAX_HEADS:
        raise HeadsLoadError(path, f"{num_heads} Medusa heads, above the limit of {MAX_HEADS}")
    if sorted(blocks) != list(range(num_heads)):
        raise HeadsLoadError(path, f"Medusa head indices [{brief_list(sorted(blocks))}] are not 0..{num_heads - 1}")
    num_layers = len(blocks[0])
    if num_layers > MAX_LAYERS:
        raise HeadsLoadError(path, f"{num_layers} blocks per Medusa head, above the limit of {MAX_LAYERS}")
    uneven = [f"head {i}: [{brief_list(sorted(j))}]" for i, j in blocks.items() if j != set(range(num_layers))]
    if uneven:
        raise HeadsLoadError(path, f"Medusa heads have different or non-contiguous blocks: {brief_list(uneven)}")
    vocab, hidden = _shape(weights, f"0.{num_layers}.weight", 2)
    return num_heads, num_layers, hidden, vocab


def medusa_published_name(own_key: str, num_layers: int) -> str:
    """The published key of one of :class:`MedusaHeads`' parameters."""
    m = re.fullmatch(r"mlps\.(\d+)\.(\d+)\.(.+)", own_key)
    if m:
        return f"{m[1]}.{m[2]}.{m[3]}"
    m = re.fullmatch(r"lm_heads\.(\d+)\.(.+)", own_key)
    if m:
        return f"{m[1]}.{num_layers}.{m[2]}"
    return own_key


def load_published_medusa(
    cfg: dict[str, Any], cfg_path: str, resolve: Resolver, base_config: Any = None
) -> MedusaHeads:
    """Medusa heads from a published Medusa-1 head file or a Medusa-2 full-model repo.

    ``base_config`` is not needed (Medusa heads have no prefix layer).
    """
    cfg_heads = _field(cfg, "medusa_num_heads", int, cfg_path)
    cfg_layers = _field(cfg, "medusa_num_layers", int, cfg_path, default=None)
    base_name = _field(cfg, "base_model_name_or_path", (str, type(None)), cfg_path, default=None)
    path = _first_file(resolve, MEDUSA_WEIGHT_FILES)
    weights = open_weights(path) if path is not None else _medusa2_weights(resolve)
    if weights is None:
        raise HeadsLoadError(
            cfg_path,
            f"no Medusa weights next to it (looked for {', '.join(MEDUSA_WEIGHT_FILES)} "
            f"and Medusa-2 {', '.join(MEDUSA_FULL_MODEL_FILES)} or their shard indexes)",
        )
    num_heads, num_layers, hidden, vocab = infer_medusa_layout(weights)
    _check_declared_sizes(cfg, cfg_path, weights, hidden_size=hidden, vocab_size=vocab)
    if (cfg_heads, num_layers if cfg_layers is None else cfg_layers) != (num_heads, num_layers):
        warnings.warn(
            f"{cfg_path} declares {cfg_heads} heads x {cfg_layers} layers but {weights.path} holds "
            f"{num_heads} x {num_layers}; using the weights",
            UserWarning,
            stacklevel=3,
        )
    config = _sized_config(
        weights,
        cfg_path,
        family="medusa",
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        base_model_name_or_path=base_name,
    )
    return build_checked(config, weights, cfg_path, lambda k: medusa_published_name(k, num_layers))


# --------------------------------------------------------------------------- EAGLE
def is_eagle_config(cfg: dict[str, Any]) -> bool:
    """A published EAGLE drafter's config: a one-layer Llama config (EAGLE-3's names its draft vocabulary)."""
    return (
        cfg.get("num_hidden_layers") == 1
        and "hidden_size" in cfg
        and ("draft_vocab_size" in cfg or cfg.get("model_type", "llama") == "llama")
    )


def eagle_published_name(own_key: str, arch: str) -> str:
    """The published key of one of :class:`EagleHeads`' tensors (EAGLE-3 names its layer ``midlayer``)."""
    if arch == "eagle3" and own_key.startswith("layers.0."):
        return "midlayer." + own_key.removeprefix("layers.0.")
    return own_key


def _eagle_layer_config(cfg: dict[str, Any], cfg_path: str) -> dict[str, Any]:
    """The drafter layer's architecture from a published EAGLE config (RoPE theta 10000 unless it says)."""
    if cfg.get("qkv_bias"):
        raise HeadsLoadError(cfg_path, "EAGLE drafters with qkv_bias=true are not supported")
    layer = {k: v for k, v in cfg.items() if k not in EAGLE_CONFIG_KEYS and k not in ("architectures", "_name_or_path")}
    layer.setdefault("model_type", "llama")
    layer.setdefault("hidden_act", "silu")
    if layer["model_type"] != "llama":
        raise HeadsLoadError(
            cfg_path, f"EAGLE drafters are Llama layers; got model_type {brief_repr(layer['model_type'])}"
        )
    try:
        from transformers import LlamaConfig

        return prefix_layer_config(LlamaConfig.from_dict(layer))
    except Exception as e:
        raise HeadsLoadError(cfg_path, f"not a valid EAGLE drafter config ({type(e).__name__}: {e})") from e


def load_published_eagle(cfg: dict[str, Any], cfg_path: str, resolve: Resolver, base_config: Any = None) -> EagleHeads:
    """An EAGLE-1/2 or EAGLE-3 drafter from its published checkpoint (``base_config``: the base
    model's config, needed by EAGLE-3 for its fused layers)."""
    path = _first_file(resolve, EAGLE_WEIGHT_FILES)
    if path is None:
        raise HeadsLoadError(cfg_path, f"no EAGLE weights next to it (looked for {', '.join(EAGLE_WEIGHT_FILES)})")
    weights = open_weights(path)
    tensors = dict(weights.tensors)
    arch = "eagle3" if "midlayer.self_attn.q_proj.weight" in tensors else "eagle"
    if "fc.weight" not in tensors:
        raise HeadsLoadError(path, "no 'fc.weight': not an EAGLE drafter's weights")
    hidden, fc_in = _shape(weights, "fc.weight", 2)
    if fc_in != (3 if arch == "eagle3" else 2) * hidden:
        raise HeadsLoadError(
            path, f"fc.weight has shape {(hidden, fc_in)}; {arch} expects [H, {3 if arch == 'eagle3' else 2}H]"
        )
    layer = _eagle_layer_config(cfg, cfg_path)
    vocab = _field(cfg, "vocab_size", int, cfg_path)
    fields: dict[str, Any] = dict(
        family="eagle",
        head_arch=arch,
        num_heads=EAGLE_MAX_DEPTH,
        num_layers=1,
        hidden_size=hidden,
        vocab_size=vocab,
        prefix_layer_config=layer,
    )
    if arch == "eagle":
        layers = {int(k.split(".")[1]) for k in tensors if re.fullmatch(r"layers\.\d{1,3}\..+", k)}
        if layers != set(range(len(layers))) or not layers:
            raise HeadsLoadError(path, f"EAGLE layers [{brief_list(sorted(layers))}] are not 0..n-1")
        fields.update(num_layers=len(layers), use_base_lm_head=True)
        if "fc.bias" not in tensors and cfg.get("bias", True) is False:  # the LLaMA-3 drafters' fc has no bias
            tensors["fc.bias"] = stored_tensor(torch.zeros(hidden, dtype=tensors["fc.weight"].dtype or torch.float32))
    else:
        d2t = _check_d2t(weights, vocab)
        fields.update(draft_vocab_size=int(d2t.numel()), feature_layers=_eagle3_layers(base_config, cfg_path, cfg))
        tensors["draft_vocab"] = stored_tensor(torch.arange(d2t.numel()) + d2t)
        del tensors["d2t"]
    config = _sized_config(weights, cfg_path, **fields)
    checked = Weights(weights.path, tensors, weights.nbytes + 8 * vocab + 4 * hidden)
    return build_checked(config, checked, cfg_path, lambda k: eagle_published_name(k, arch), ignore=EAGLE_IGNORED)


def _check_d2t(weights: Weights, vocab: int) -> torch.Tensor:
    """EAGLE-3's draft-to-target offsets, read and checked: integer, every target id in range and distinct."""
    (rows,) = _shape(weights, "d2t", 1)
    d2t = weights.tensors["d2t"].read()
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise HeadsLoadError(weights.path, f"d2t must hold integer offsets, got {d2t.dtype}")
    target = torch.arange(rows) + d2t.long()
    if rows > vocab or int(target.min()) < 0 or int(target.max()) >= vocab or target.unique().numel() != rows:
        raise HeadsLoadError(weights.path, f"d2t maps its {rows} draft ids outside [0, {vocab}) or onto repeated ids")
    return d2t.long()


def _eagle3_layers(base_config: Any, cfg_path: str, cfg: dict[str, Any] | None = None) -> list[int]:
    """The fused layers of an EAGLE-3 drafter: those its config names (vLLM's
    ``eagle_aux_hidden_state_layer_ids``), else the default for the base model of ``base_config``
    (a config or its dict)."""
    named = (cfg or {}).get("eagle_aux_hidden_state_layer_ids")
    if named is not None:
        if (
            not isinstance(named, list)
            or len(named) != 3
            or not all(type(i) is int and 0 <= i <= MAX_BASE_LAYERS for i in named)
        ):
            raise HeadsLoadError(
                cfg_path,
                f"eagle_aux_hidden_state_layer_ids must list 3 hidden-state indices in "
                f"[0, {MAX_BASE_LAYERS}], got {brief_repr(named)}",
            )
        return list(named)
    if isinstance(base_config, dict):
        depth = base_config.get("num_hidden_layers")
    else:
        depth = getattr(text_config(base_config), "num_hidden_layers", None) if base_config is not None else None
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise HeadsLoadError(
            cfg_path,
            "an EAGLE-3 drafter fuses base layers 2, L/2 and L-3: pass base_config= "
            "(the base model's config; enable_entmtp does)",
        )
    return eagle3_feature_layers(depth)


register_format("hydra", "hydra_num_heads", load_published_hydra)
register_format("medusa", "medusa_num_heads", load_published_medusa)
register_format("eagle", "", load_published_eagle, detect=is_eagle_config)
