"""``entmtp-hf export-heads``: a drafter in the checkpoint layouts serving engines load.

Engines do not read this project's heads format. They load an EAGLE-style drafter as an EAGLE-3
or EAGLE-1 checkpoint (the layouts SafeAILab/EAGLE publishes and vLLM's ``llama_eagle3.py`` /
``llama_eagle.py`` and SGLang read) and Medusa heads in the Medusa layout (``medusa_lm_head``
with ``{i}.{j}.linear.*`` and ``{i}.{L}.weight``, as TensorRT-LLM's Medusa weight loader reads
it). This module writes those layouts from heads of this project; what a layout cannot express is
refused with the reason, never approximated. Each layout registers itself (:func:`register_layout`:
the heads it holds, what of them it cannot express, its writer and the engines that read it); the
export and its command line read that table only. The project's own readers of the published layouts
(:mod:`entmtp_hf.heads.published`) load the files back with identical outputs, which the tests
check. Weights are written as safetensors only.

Tensor names and config keys (docs/export.md has the sources):

* EAGLE-3: ``fc.weight`` [H, 3H] (the three fused base states, in ascending layer order),
  ``midlayer.*`` (the decoder layer; attention reads 2H), ``norm.weight``, ``lm_head.weight``
  [V', H], ``d2t`` [V'] (target id = draft id + d2t) and ``t2d`` [V] (bool: in the draft
  vocabulary); config.json: a one-layer Llama config with ``architectures``
  ``["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and
  ``eagle_aux_hidden_state_layer_ids`` (the fused hidden-state indices, vLLM's key).
* EAGLE-1: ``fc.weight`` [H, 2H], ``fc.bias``, ``layers.0.*`` without ``input_layernorm``; the
  base model's LM head; config.json: a one-layer Llama config (``LlamaForCausalLM``).
* Medusa: config.json with ``medusa_num_heads``, ``medusa_num_layers``, ``hidden_size``,
  ``vocab_size``; ``medusa_lm_head.safetensors``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from ..errors import EntMTPError
from ..heads import DraftHeads, load_heads
from ..heads.published import eagle_published_name, medusa_published_name
from .checkpoint import write_json

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: the layer config keys that are this project's bookkeeping, not the published config's
_LAYER_SKIP = ("is_encoder_decoder", "pad_token_id", "bos_token_id", "eos_token_id")

Checkpoint = tuple[dict[str, Any], dict[str, torch.Tensor]]


class LayoutError(EntMTPError):
    """The heads hold something the requested layout cannot express."""


@dataclass(frozen=True)
class Layout:
    """A checkpoint layout serving engines load: the heads it holds (``family``, ``archs``; any other
    heads are refused with ``mismatch``, formatted with their ``family`` and ``arch``), what of those
    it cannot express (``check``: the reason, None when it can), how it is written (``write``: its
    ``config.json`` and tensors, the tensors saved as ``weights_name``) and the engines that read it
    (docs/export.md, "read by")."""

    name: str
    family: str
    archs: tuple[str, ...]
    mismatch: str
    check: Callable[[DraftHeads], str | None]
    write: Callable[[DraftHeads], Checkpoint]
    weights_name: str
    served_by: tuple[str, ...]


#: layout name (what ``--to`` takes) -> the layout, in registration order
LAYOUTS: dict[str, Layout] = {}
#: heads families no engine runs, and why: refused in every layout
NO_LAYOUT = {
    "hydra": "Hydra heads are sequentially dependent (each head reads the tokens drafted before it): no engine "
    "runs them and no engine layout holds them"
}


def register_layout(layout: Layout) -> None:
    """Add a layout ``export-heads`` writes; a name registered already is refused (``ValueError``)."""
    if layout.name in LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is registered already")
    LAYOUTS[layout.name] = layout


def refusal(heads: DraftHeads, layout: str) -> str | None:
    """Why ``heads`` cannot be written as ``layout`` (None: they can), in words a user can act on."""
    cfg, spec = heads.config, LAYOUTS[layout]
    if cfg.family in NO_LAYOUT:
        return NO_LAYOUT[cfg.family]
    if cfg.family != spec.family or cfg.head_arch not in spec.archs:
        return spec.mismatch.format(family=cfg.family, arch=cfg.head_arch)
    return spec.check(heads)


def serving(heads: DraftHeads) -> str:
    """Where ``heads`` serve besides transformers' ``generate``: the engines and the export that takes
    them there, or why no engine layout holds them (the refusal of the layout nearest to them)."""
    for name, layout in LAYOUTS.items():
        if refusal(heads, name) is None:
            return (
                f"{', '.join(layout.served_by)} (entmtp-hf export-heads HEADS --to {name}) and transformers' generate"
            )
    cfg = heads.config
    held = [name for name, layout in LAYOUTS.items() if layout.family == cfg.family]
    nearest = next((n for n in held if cfg.head_arch in LAYOUTS[n].archs), held[0] if held else next(iter(LAYOUTS)))
    return f"transformers' generate only: no engine layout holds them ({refusal(heads, nearest)})"


def _layer_config(heads: DraftHeads, architecture: str) -> dict[str, Any]:
    """The drafter layer's Llama config as a published EAGLE config.json holds it."""
    cfg = heads.config
    layer = {k: v for k, v in dict(cfg.prefix_layer_config or {}).items() if k not in _LAYER_SKIP}
    layer.update(
        architectures=[architecture],
        model_type="llama",
        num_hidden_layers=1,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=False,
    )
    return layer


def _weights(heads: DraftHeads, rename) -> dict[str, torch.Tensor]:
    """The heads' persistent tensors under their published names, contiguous and detached (float as stored)."""
    return {rename(k): v.detach().contiguous().cpu() for k, v in heads.state_dict().items() if k != "draft_vocab"}


# ============================================================================ EAGLE-3
def eagle3_checkpoint(heads: DraftHeads) -> Checkpoint:
    """config.json and tensors of an EAGLE-3 checkpoint; the fused states in ascending layer order."""
    cfg = heads.config
    tensors = _weights(heads, lambda k: eagle_published_name(k, "eagle3"))
    layers = list(cfg.feature_layers)
    order = sorted(range(len(layers)), key=layers.__getitem__)
    h = cfg.hidden_size
    tensors["fc.weight"] = torch.cat([tensors["fc.weight"][:, i * h : (i + 1) * h] for i in order], dim=1).contiguous()
    rows = cfg.draft_vocab_rows
    draft = heads.draft_vocab.cpu().long() if heads.draft_vocab is not None else torch.arange(rows)
    tensors["d2t"] = draft - torch.arange(rows)
    tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, draft, True)
    config = _layer_config(heads, EAGLE3_ARCHITECTURE)
    config.update(
        draft_vocab_size=rows, target_hidden_size=h, eagle_aux_hidden_state_layer_ids=[layers[i] for i in order]
    )
    return config, tensors


def eagle3_check(heads: DraftHeads) -> str | None:
    cfg = heads.config
    if cfg.use_base_lm_head:
        return "an EAGLE-3 checkpoint carries its own LM head over the draft vocabulary; these use the base one"
    layers = list(cfg.feature_layers or ())
    if len(set(layers)) != len(layers):
        return f"the drafter fuses a hidden state twice ({layers}); engines collect each layer's state once"
    return None


register_layout(
    Layout(
        "eagle3",
        family="eagle",
        archs=("eagle3",),
        mismatch="an eagle3 checkpoint holds an eagle3 drafter; these are {family} heads ({arch})",
        check=eagle3_check,
        write=eagle3_checkpoint,
        weights_name="model.safetensors",
        served_by=("vLLM", "SGLang", "TensorRT-LLM"),
    )
)


# ============================================================================ EAGLE-1
def eagle1_checkpoint(heads: DraftHeads) -> Checkpoint:
    """config.json and tensors of an EAGLE-1 checkpoint (the base LM head is the engine's).

    An all-zero ``fc.bias`` is left out with ``"bias": false``, as the LLaMA-3 drafters are
    published: vLLM's EAGLE-1 model (0.18.0) has an ``fc`` without bias and takes only such files.
    """
    config = _layer_config(heads, "LlamaForCausalLM")
    tensors = _weights(heads, lambda k: eagle_published_name(k, "eagle"))
    if not tensors["fc.bias"].any():
        del tensors["fc.bias"]
        config["bias"] = False
    return config, tensors


def eagle1_check(heads: DraftHeads) -> str | None:
    cfg = heads.config
    if not cfg.use_base_lm_head:
        return "EAGLE-1 drafts through the base model's LM head; these heads have their own"
    if cfg.draft_vocab_size:
        return (
            f"the EAGLE-1 layout has no drafting vocabulary (these draft over {cfg.draft_vocab_size} tokens): "
            "an engine would draft over the whole vocabulary"
        )
    if heads.fuse is not None:
        return (
            f"the drafter fuses further base states (feature_layers {cfg.feature_layers}), which the EAGLE-1 "
            "layout has no place for"
        )
    if cfg.num_layers != 1:
        return (
            f"the drafter has {cfg.num_layers} decoder layers; published EAGLE-1 drafters, and this project's "
            "reader of them, have one"
        )
    return None


register_layout(
    Layout(
        "eagle",
        family="eagle",
        archs=("eagle",),
        mismatch="an eagle checkpoint holds an eagle drafter; these are {family} heads ({arch})",
        check=eagle1_check,
        write=eagle1_checkpoint,
        weights_name="model.safetensors",
        served_by=("vLLM", "SGLang"),
    )
)


# ============================================================================ Medusa
def medusa_checkpoint(heads: DraftHeads) -> Checkpoint:
    """config.json and tensors of a Medusa-1 head file."""
    cfg = heads.config
    config = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "base_model_name_or_path": cfg.base_model_name_or_path,
    }
    return config, _weights(heads, lambda k: medusa_published_name(k, cfg.num_layers))


def medusa_check(heads: DraftHeads) -> str | None:
    cfg = heads.config
    if cfg.use_base_lm_head:
        return "the Medusa layout stores each head's own LM head; these heads project with the base model's"
    if cfg.draft_vocab_size:
        return (
            f"the Medusa layout's LM heads span the whole vocabulary; these draft over a pruned one of "
            f"{cfg.draft_vocab_size} tokens"
        )
    return None


register_layout(
    Layout(
        "medusa",
        family="medusa",
        archs=("mlp",),
        mismatch="the Medusa layout holds Medusa heads; these are {family} ({arch})",
        check=medusa_check,
        write=medusa_checkpoint,
        weights_name="medusa_lm_head.safetensors",
        served_by=("TensorRT-LLM",),
    )
)


# ============================================================================ the export
def export_heads(heads: DraftHeads, layout: str, out: str | os.PathLike) -> Path:
    """Write ``heads`` into the folder ``out`` in ``layout`` (eagle3, eagle or medusa); returns the folder.

    Raises :class:`LayoutError` naming what the layout cannot express, and refuses a folder that
    already holds files, so that an export never mixes with another checkpoint.
    """
    if layout not in LAYOUTS:
        raise LayoutError(f"--to must be one of {tuple(LAYOUTS)}, got {layout!r}")
    reason = refusal(heads, layout)
    if reason is not None:
        raise LayoutError(f"cannot write these heads as {layout}: {reason}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LayoutError(f"--out {out}: {'not a folder' if not out.is_dir() else 'not empty'}; give a new folder")
    config, tensors = LAYOUTS[layout].write(heads)
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / LAYOUTS[layout].weights_name), metadata={"format": "pt"})
        write_json(out / "config.json", config)
    except OSError as e:
        raise LayoutError(f"--out {out}: cannot write the checkpoint there ({e.strerror or e})") from None
    return out


# ============================================================================ CLI
def _run(args: argparse.Namespace) -> int:
    base_config = None
    if args.base_config:
        from transformers import AutoConfig

        base_config = AutoConfig.from_pretrained(args.base_config)
    heads = load_heads(args.heads, args.revision, base_config=base_config)
    out = export_heads(heads, args.to, args.out)
    cfg = heads.config
    print(f"wrote the {cfg.family} heads ({cfg.head_arch}) in the {args.to} layout to {out}")
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-heads",
        help="write draft heads as an EAGLE-3, EAGLE-1 or Medusa checkpoint that serving engines load",
        description="Load heads (entmtp-hf format or a published layout) and write them to the new folder OUT in the "
        "layout an engine loads: eagle3 (SafeAILab/EAGLE, vLLM, SGLang), eagle (EAGLE-1) or medusa (the Medusa "
        "head file). What a layout cannot express (Hydra heads, a pruned vocabulary where the layout has none, "
        "...) is refused with the reason.",
    )
    p.add_argument("heads", help="heads folder or Hub repo id")
    p.add_argument("--to", required=True, choices=list(LAYOUTS), help="the checkpoint layout")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--revision", default=None, help="Hub revision of HEADS")
    p.add_argument(
        "--base-config",
        default=None,
        help="folder or repo id of the base model's config (published EAGLE-3 heads that name no fused layers)",
    )
    p.set_defaults(func=_run)
