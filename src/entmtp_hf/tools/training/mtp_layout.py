"""MTP layers trained for a model, saved in transformers' native layout (``build-drafter --arch mtp``).

New layers are transformers' own ``MtpModel`` layers for the base model (its decoder-layer class,
``enorm``/``hnorm``, ``eh_proj``, a post-norm; embedding, LM head and rotary embedding shared and
frozen), trained by the common loop as the ``mtp`` heads family. The folder they are saved in is a
transformers model folder that ``generate(use_mtp=True)`` runs unchanged:

* the base model's files (tokenizer, generation config, chat template) and its weights byte for
  byte: its shards, or its single file renamed :data:`BASE_SHARD`;
* :data:`MTP_SHARD`: the MTP layers under ``mtp.layers.K.`` followed by ``MtpModel``'s own
  parameter names (transformers' ``MtpModel`` conversions remove the ``mtp`` prefix), and
  ``model.safetensors.index.json`` naming every tensor's file;
* ``config.json``: the base config plus ``num_mtp_layers`` (and ``mtp_layer_types`` where the
  base lists ``layer_types``: full attention) and an ``auto_map`` naming :data:`MODELING_FILE`;
* :data:`MODELING_FILE`: the base model's class, unchanged but for the key pattern of its MTP
  tensors. ``MtpModel.from_pretrained`` finds MTP tensors through the model class's
  ``_keys_to_ignore_on_load_unexpected`` (the families with MTP layers declare theirs in
  transformers; a Llama-class model declares none), so a model without MTP layers in transformers
  declares it in code shipped with the weights, loaded with ``trust_remote_code=True``: the way
  the Hub ships a model class transformers lacks;
* :data:`DRAFTING_FILE`: how EntMTP drafts with the layers (tree depth, drafting vocabulary),
  which is what the folder's banks were searched with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ...errors import FileFormatError
from ...files import check_relative_name, read_json_object
from ...heads.mtp import MtpHeads

#: the prefix of the MTP tensors' keys in the checkpoint
MTP_PREFIX = "mtp."
#: the regular expression the model class declares for them
MTP_KEY_PATTERN = r"^mtp\."
MTP_SHARD = "model-mtp.safetensors"
BASE_SHARD = "model-base.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODELING_FILE = "modeling_mtp.py"
DRAFTING_FILE = "entmtp_drafting.json"
#: a base config.json or shard index past this size is not one
MAX_CONFIG_BYTES = 16 << 20
#: a drafting vocabulary of a whole 256k-token vocabulary fits
MAX_DRAFTING_BYTES = 4 << 20
#: base files not copied: weights (added as shards), and what describes the base model alone
_SKIPPED = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|msgpack|h5)$|.*\.index\.json$|README\.md|\..*|modeling_.*")
_MODELING = '''"""{base} with multi-token-prediction layers, as transformers' ``generate(use_mtp=True)`` loads them.

The model is {base} unchanged; this class only declares where its MTP layers' tensors sit in the
checkpoint (``{prefix}layers.K.*``): the model skips them when it loads, ``MtpModel.from_pretrained``
loads them. Written by ``entmtp-hf build-drafter --arch mtp``.
"""

from transformers import {base}


class {name}({base}):
    _keys_to_ignore_on_load_unexpected = [*({base}._keys_to_ignore_on_load_unexpected or []), r"{pattern}"]
'''


class MtpLayoutError(ValueError):
    """A base model or folder that the native MTP layout cannot be written from or read from."""


# ============================================================================ new layers
def new_mtp_heads(model: nn.Module, num_layers: int, depth: int) -> MtpHeads:
    """``num_layers`` new MTP layers for ``model`` (transformers' ``MtpModel`` layers, its initialisation)
    as heads drafting trees ``depth`` deep. ``model``'s own weights are untouched and its config is left
    as it was: it declares ``num_mtp_layers`` only while the layers are built."""
    from transformers.modeling_layers import MtpModel

    text = model.config.get_text_config()
    for name in ("num_mtp_layers", "num_nextn_predict_layers"):
        if getattr(text, name, None):
            raise MtpLayoutError(
                f"{type(model).__name__} carries MTP layers already ({name}={getattr(text, name)}): draft with "
                "them (enable_entmtp(model, 'mtp')) instead of training new ones"
            )
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the number of MTP layers must be a positive integer, got {num_layers!r}")
    fields = mtp_fields(lambda k: getattr(text, k, None), num_layers)
    for k, v in fields.items():
        setattr(text, k, v)
    try:
        mtp = MtpModel(model, num_layers)
        heads = MtpHeads.from_model(model, depth, mtp_model=mtp)
    finally:
        for k in fields:
            delattr(text, k)
    return heads


def mtp_fields(get: Callable[[str], Any], num_layers: int) -> dict[str, Any]:
    """The config fields that declare ``num_layers`` MTP layers on a text config read by ``get``: their
    count, and where the base lists its layers' types, theirs (full attention; the last MLP type)."""
    fields: dict[str, Any] = {"num_mtp_layers": num_layers}
    if get("layer_types") is not None and get("mtp_layer_types") is None:
        fields["mtp_layer_types"] = ["full_attention"] * num_layers
    mlp = get("mlp_layer_types")
    if mlp is not None and get("mtp_mlp_layer_types") is None:
        fields["mtp_mlp_layer_types"] = [mlp[-1]] * num_layers
    return fields


@torch.no_grad()
def warm_start_mtp(heads: MtpHeads, hidden_rms: float) -> None:
    """Start every MTP layer as the base LM head on its input state: the projection passes the state
    through (the token's embedding enters at a tenth), the block's output projections are zero (see
    ``warm_start``), and the post-norm restores the base states' scale."""
    h = heads.config.hidden_size
    for layer in heads.layers:
        w = layer.eh_proj.weight
        hidden = slice(0, h) if getattr(heads.mtp_config, "mtp_hidden_states_first", False) else slice(h, 2 * h)
        w.mul_(0.1)
        w[:, hidden] = torch.eye(h, dtype=w.dtype, device=w.device)
        if layer.post_norm is not None:
            layer.post_norm.weight.fill_(hidden_rms)


def mtp_tensors(heads: MtpHeads) -> dict[str, Tensor]:
    """The MTP layers' tensors under their checkpoint keys (``mtp.layers.K.<MtpModel name>``), in their dtype."""
    tensors = {f"{MTP_PREFIX}layers.{k}": v for k, v in heads.layers.state_dict().items()}
    if heads.shared_post_norm is not None:
        tensors.update({f"{MTP_PREFIX}shared_post_norm.{k}": v for k, v in heads.shared_post_norm.state_dict().items()})
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


@torch.no_grad()
def load_trained_layers(heads: MtpHeads, folder: str | Path) -> list[int] | None:
    """Copy the MTP layers an earlier run saved in ``folder`` (the native layout) into ``heads`` (new layers of
    the same count for the same base model), so that a run continues training them; returns the folder's
    drafting vocabulary (None: the whole vocabulary). Every tensor must match by name, shape and dtype class."""
    from ...heads.files import open_safetensors

    folder = Path(folder)
    path = folder / MTP_SHARD
    if not path.is_file():  # a model folder in the native layout, or its MTP shard alone (as the demo ships it)
        raise MtpLayoutError(
            f"--init-from {folder}: no MTP layers here (no {MTP_SHARD}), as `entmtp-hf build-drafter --arch mtp` "
            "or `train-heads --arch mtp` writes them"
        )
    stored = open_safetensors(str(path)).tensors
    want = mtp_tensors(heads)
    if stored.keys() != want.keys():
        extra, missing = sorted(stored.keys() - want.keys()), sorted(want.keys() - stored.keys())
        raise FileFormatError(
            path,
            f"its MTP tensors are not those of {len(heads.layers)} layer(s) for this base model (missing: "
            f"{missing[:3]}, unexpected: {extra[:3]}): pass --num-layers as that run had them",
        )
    wrong = [
        k
        for k, t in want.items()
        if stored[k].shape != t.shape or not (stored[k].dtype or torch.int8).is_floating_point
    ]
    if wrong:
        raise FileFormatError(path, f"tensors of another shape or dtype than this base model's layers: {wrong[:3]}")

    def part(prefix: str) -> dict[str, Tensor]:
        return {k.removeprefix(prefix): stored[k].read().float() for k in want if k.startswith(prefix)}

    heads.layers.load_state_dict(part(f"{MTP_PREFIX}layers."))
    if heads.shared_post_norm is not None:
        heads.shared_post_norm.load_state_dict(part(f"{MTP_PREFIX}shared_post_norm."))
    return drafting_settings(folder).get("draft_vocab")


# ============================================================================ writing
def save_trained_mtp(
    model: nn.Module, heads: MtpHeads, out: Path, scratch: Path, draft_vocab: Tensor | None
) -> tuple[nn.Module, MtpHeads, MtpHeads]:
    """Write MTP layers ``heads`` trained for ``model`` in the native layout at ``out`` (their drafting
    settings: their depth and ``draft_vocab``), then load them back as a user would: the model, its
    layers as ``generate(use_mtp=True)`` reads them (the whole vocabulary) drafting as deep as ``heads``,
    and as EntMTP drafts with them. ``scratch``: a folder for the base checkpoint where ``model`` has none."""
    drafting = {"depth": heads.num_heads, "draft_vocab": None if draft_vocab is None else draft_vocab.tolist()}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:  # the folder's hard links outlive a scratch copy
        write_mtp_checkpoint(base_checkpoint(model, Path(tmp)), mtp_tensors(heads), out, drafting=drafting)
    param = next(model.parameters())
    judge, _ = load_mtp_checkpoint(out, dtype=param.dtype, device=param.device)
    return judge, MtpHeads.from_model(judge, heads.num_heads), mtp_drafter(judge, out)


def base_checkpoint(model: nn.Module, scratch: Path) -> Path:
    """A folder holding ``model``'s checkpoint in safetensors: the folder or Hub snapshot it was loaded
    from, or (a model built in memory, or one loaded from other weights) ``model`` saved into ``scratch``."""
    source = str(getattr(model.config, "name_or_path", "") or "")
    folder = Path(source) if source and Path(source).is_dir() else None
    if folder is None and source and not Path(source).exists():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(
                snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
            )
        except (OSError, ValueError):  # a name the Hub does not resolve here: the in-memory weights are the checkpoint
            folder = None
    if folder is not None and ((folder / "model.safetensors").is_file() or (folder / INDEX_NAME).is_file()):
        return folder
    model.save_pretrained(scratch)
    return scratch


def write_mtp_checkpoint(
    base_dir: str | Path,
    mtp: dict[str, Tensor] | str | Path,
    out: str | Path,
    *,
    drafting: dict[str, Any] | None = None,
    readme: str | None = None,
) -> Path:
    """Write the native MTP folder ``out`` (see the module docstring) from the base checkpoint in
    ``base_dir`` and the MTP tensors ``mtp`` (under their checkpoint keys, or a safetensors file of them,
    copied as it is). The base weights are hard-linked where the file system allows, else copied.
    ``out`` is replaced as a whole (written beside it first); a folder there that is not such a
    checkpoint is refused."""
    from safetensors.torch import save_file

    base_dir, out = Path(base_dir), Path(out)
    config = _base_config(base_dir)
    base = _base_class(config, base_dir)
    keys = _mtp_keys(mtp)
    layers = sorted({int(m.group(1)) for k in keys if (m := re.match(rf"{re.escape(MTP_PREFIX)}layers\.(\d+)\.", k))})
    if not layers or layers != list(range(len(layers))):
        raise MtpLayoutError(f"the MTP tensors name layers {layers}, not 0..N-1 under '{MTP_PREFIX}layers.'")
    if out.exists() and any(out.iterdir()) and not (out / MODELING_FILE).is_file():
        raise MtpLayoutError(f"{out} holds files that are not an MTP checkpoint: choose an empty or new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for f in sorted(base_dir.iterdir()):
            if f.is_file() and not _SKIPPED.fullmatch(f.name):
                shutil.copy2(f, tmp / f.name)
        weight_map = _link_base_weights(base_dir, tmp)
        clash = sorted(k for k in weight_map if k.startswith(MTP_PREFIX))
        if clash:
            raise MtpLayoutError(f"{base_dir}: the base checkpoint has tensors under '{MTP_PREFIX}' ({clash[0]}, ...)")
        if isinstance(mtp, dict):
            save_file(mtp, str(tmp / MTP_SHARD), metadata={"format": "pt"})
        else:
            shutil.copyfile(mtp, tmp / MTP_SHARD)
        weight_map.update(dict.fromkeys(keys, MTP_SHARD))
        total = sum(_tensor_bytes(tmp / f) for f in sorted(set(weight_map.values())))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        name = _declare(config, base, len(layers))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / MODELING_FILE).write_text(
            _MODELING.format(base=base, name=name, prefix=MTP_PREFIX, pattern=MTP_KEY_PATTERN)
        )
        if drafting is not None:
            (tmp / DRAFTING_FILE).write_text(json.dumps(drafting) + "\n")
        if readme is not None:
            (tmp / "README.md").write_text(readme)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _base_config(base_dir: Path) -> dict[str, Any]:
    """The base ``config.json``, refused where it has MTP layers already or its class is code of its own."""
    path = base_dir / "config.json"
    if not path.is_file():
        raise MtpLayoutError(f"{base_dir}: no config.json (not a transformers model folder)")
    config = read_json_object(path, max_bytes=MAX_CONFIG_BYTES, max_depth=16)
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise FileFormatError(path, "text_config is not an object")
    for name in ("num_mtp_layers", "num_nextn_predict_layers"):
        if text.get(name):
            raise MtpLayoutError(f"{path}: the model has MTP layers already ({name}={text[name]})")
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        raise MtpLayoutError(
            f"{path}: the model's class is code of its own (auto_map); declare the MTP key pattern "
            f"{MTP_KEY_PATTERN!r} in that class instead"
        )
    return config


def _base_class(config: dict[str, Any], base_dir: Path) -> str:
    """The name of the base model's transformers class (``architectures[0]``), checked to exist."""
    import transformers

    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise MtpLayoutError(
            f"{base_dir / 'config.json'}: architectures {names} names no model class of transformers to subclass"
        )
    return names[0]


def _declare(config: dict[str, Any], base: str, num_layers: int) -> str:
    """Add the MTP layers and the class declaring their key pattern to ``config``; that class's name."""
    text = config.get("text_config") or config
    text.update(mtp_fields(text.get, num_layers))
    name = f"{base.removesuffix('ForCausalLM')}MtpForCausalLM" if base.endswith("ForCausalLM") else f"{base}WithMtp"
    config["architectures"] = [name]
    config["auto_map"] = {**(config.get("auto_map") or {}), "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{name}"}
    return name


def _mtp_keys(mtp: dict[str, Tensor] | str | Path) -> list[str]:
    if isinstance(mtp, dict):
        keys = list(mtp)
    else:
        from safetensors import safe_open

        with safe_open(str(mtp), framework="pt") as f:
            keys = list(f.keys())
    odd = [k for k in keys if not k.startswith(MTP_PREFIX)]
    if odd:
        raise MtpLayoutError(f"MTP tensors must be keyed under '{MTP_PREFIX}', got {odd[0]!r}")
    return keys


def _link_base_weights(base_dir: Path, dest: Path) -> dict[str, str]:
    """Hard-link (else copy) the base weights into ``dest``: their shards as they are, a single file as
    :data:`BASE_SHARD`; the tensor -> file map."""
    from safetensors import safe_open

    index = base_dir / INDEX_NAME
    if index.is_file():
        weight_map = read_json_object(index, max_bytes=MAX_CONFIG_BYTES, max_depth=8).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise FileFormatError(index, "no weight_map of tensor names to files")
        files = {f: f for f in {check_relative_name(v, index) for v in weight_map.values()}}
    elif (base_dir / "model.safetensors").is_file():
        with safe_open(str(base_dir / "model.safetensors"), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), BASE_SHARD)
        files = {"model.safetensors": BASE_SHARD}
    else:
        raise MtpLayoutError(f"{base_dir}: no safetensors weights (model.safetensors or {INDEX_NAME})")
    for src, name in files.items():
        if name in (MTP_SHARD, INDEX_NAME):
            raise MtpLayoutError(f"{base_dir}: a base weights file is named {name}, the name of the MTP layers' file")
        link_or_copy(base_dir / src, dest / name)
    return weight_map


def link_or_copy(source: Path, dest: Path) -> None:
    """``dest`` as a hard link to ``source`` (the file it resolves to) where the file system allows, else a
    copy: weights files are written once and replaced, never rewritten in place."""
    source = Path(source).resolve()
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _tensor_bytes(path: Path) -> int:
    """Bytes of the tensors of a safetensors file (its size less its header)."""
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


# ============================================================================ reading
def is_mtp_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds MTP layers in the native layout written here."""
    folder = Path(folder)
    return (folder / MODELING_FILE).is_file() and (folder / MTP_SHARD).is_file()


def drafting_settings(folder: str | Path) -> dict[str, Any]:
    """How EntMTP drafts with the folder's layers (``depth``, ``draft_vocab``: None for the whole
    vocabulary); ``{}`` where the folder says nothing."""
    path = Path(folder) / DRAFTING_FILE
    if not path.is_file():
        return {}
    data = read_json_object(path, max_bytes=MAX_DRAFTING_BYTES, max_depth=4)
    if not isinstance(data.get("depth", 1), int) or not isinstance(data.get("draft_vocab") or [], list):
        raise FileFormatError(path, "not EntMTP's drafting settings (depth: an integer, draft_vocab: a list or null)")
    return data


def mtp_drafter(model: nn.Module, folder: str | Path | None = None, **overrides: Any) -> MtpHeads:
    """``model``'s MTP layers as EntMTP drafts with them: loaded as ``generate(use_mtp=True)`` loads them
    (:meth:`MtpHeads.from_model`), with the depth and drafting vocabulary of ``folder``'s
    :data:`DRAFTING_FILE` (what its banks were searched with) unless ``overrides`` say otherwise."""
    settings = {**(drafting_settings(folder) if folder is not None else {}), **overrides}
    return MtpHeads.from_model(model, settings.get("depth"), draft_vocab=settings.get("draft_vocab"))


def load_mtp_checkpoint(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a native MTP folder, as a user loads it (``trust_remote_code=True``:
    the folder's :data:`MODELING_FILE` declares where the MTP tensors sit); the tokenizer pads with EOS
    where it has no pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not is_mtp_checkpoint(folder):
        raise MtpLayoutError(
            f"{folder} holds no MTP layers in the native layout ({MODELING_FILE} and {MTP_SHARD}): write them with "
            "`entmtp-hf build-drafter --arch mtp`"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=True).to(device).eval()
    tokenizer = None
    if any(folder.glob("tokenizer*")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
