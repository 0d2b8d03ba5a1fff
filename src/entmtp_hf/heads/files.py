"""Validated file access for head checkpoints: resolve, read, and strictly match weights.

Every reader turns a low-level failure into one :class:`HeadsLoadError` that names the
file, because a bad checkpoint otherwise surfaces much later as a shape error deep inside
a forward pass (or, with ``strict=False``, as silently random heads).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

_MAX_LISTED = 12  # keys listed in an error message before eliding


class HeadsLoadError(ValueError):
    """A head checkpoint (folder, Hub repo or file) is missing, unreadable or inconsistent."""


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f", ... ({len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def resolve_file(
    source: str | os.PathLike,
    filename: str,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    required: bool = True,
) -> str | None:
    """Local path of ``filename`` in a folder or Hub repo (downloaded or from the offline cache).

    Returns ``None`` for a missing optional file; raises :class:`HeadsLoadError` for a
    missing required one or a source that is neither a folder nor a valid repo id.
    """
    source = os.fspath(source)
    if os.path.isdir(source):
        path = os.path.join(source, filename)
        if os.path.isfile(path):
            return path
        if required:
            raise HeadsLoadError(f"{path}: file not found in the heads folder {source}")
        return None
    if os.path.exists(source):
        raise HeadsLoadError(f"{source}: expected a folder (or Hub repo id) holding the heads, got a file")
    try:
        return hf_hub_download(source, filename, revision=revision, cache_dir=cache_dir, token=token)
    except (EntryNotFoundError, RevisionNotFoundError) as e:  # LocalEntryNotFoundError included
        if required or isinstance(e, RevisionNotFoundError):
            raise HeadsLoadError(f"{source}/{filename} (revision {revision or 'main'}): not found ({e})") from e
        return None
    except RepositoryNotFoundError as e:
        raise HeadsLoadError(f"{source}: no such local folder or Hub repository ({e})") from e
    except HFValidationError as e:
        raise HeadsLoadError(f"{source}: not a local folder and not a valid Hub repo id ({e})") from e


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON object from ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadsLoadError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise HeadsLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_tensors(data: object, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(data, Mapping):
        raise HeadsLoadError(f"{path}: expected a mapping of names to tensors, got {type(data).__name__}")
    bad = [str(k) for k, v in data.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise HeadsLoadError(f"{path}: entries that are not named tensors: {_listing(bad)}")
    return dict(data)


def load_safetensors(path: str, keys_with_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file on CPU (only keys starting with ``keys_with_prefix`` if given)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = [k for k in f.keys() if keys_with_prefix is None or k.startswith(keys_with_prefix)]
            return {k: f.get_tensor(k) for k in names}
    except Exception as e:  # safetensors raises its own error types for truncation/corruption
        raise HeadsLoadError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def load_pickle(path: str) -> dict[str, torch.Tensor]:
    """Read a pickled state dict with ``weights_only=True``: tensors only, never code.

    A pickle that references anything but tensors and plain containers (for instance a
    callable in ``__reduce__``) is refused by torch's restricted unpickler before anything
    runs; the refusal is re-raised as :class:`HeadsLoadError` naming the file.
    """
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise HeadsLoadError(
            f"{path}: refused or unreadable pickle; only plain tensor state dicts are loaded "
            f"(weights_only=True) and nothing in the file was executed ({type(e).__name__}: {e})"
        ) from e
    return _check_tensors(data, path)


def load_weights(path: str, keys_with_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file or a (weights-only) pickle, chosen by extension."""
    if path.endswith(".safetensors"):
        return load_safetensors(path, keys_with_prefix)
    data = load_pickle(path)
    if keys_with_prefix is not None:
        data = {k: v for k, v in data.items() if k.startswith(keys_with_prefix)}
    return data


def match_state(
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[str, torch.Size]],
    path: str,
    ignore: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Strictly match file tensors to module parameters; return them under module names.

    ``expected`` maps a name as spelled in the file to ``(module name, shape)``. Any
    missing, unexpected (not ignored) or misshapen tensor fails with every offending key.
    ``ignore`` lists suffixes of known redundant entries (e.g. copies of the embeddings).
    """
    present = {k for k in weights if not k.endswith(ignore)} if ignore else set(weights)
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    wrong = [
        f"{k} {tuple(weights[k].shape)} (expected {tuple(shape)})"
        for k, (_, shape) in sorted(expected.items())
        if k in weights and weights[k].shape != shape
    ]
    if wrong:
        problems.append(f"wrong shapes: {_listing(wrong)}")
    if problems:
        raise HeadsLoadError(f"{path}: weights do not match the heads config; " + "; ".join(problems))
    return {own: weights[k] for k, (own, _) in expected.items()}

