"""Validated file access for head checkpoints: resolve, read, and strictly match weights.

Every reader turns a low-level failure into one :class:`HeadsLoadError` that names the
file, because a bad checkpoint otherwise surfaces much later as a shape error deep inside
a forward pass (or, with ``strict=False``, as silently random heads).

Weights are opened for their names, shapes and dtypes only (the safetensors header, or a
memory-mapped weights-only pickle); :func:`check_weights` compares them with the shapes the
config implies before any module is allocated, and only then is the data read.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..banks.format import METADATA_KEY as BANK_METADATA_KEY
from ..errors import FileFormatError
from ..files import check_relative_name, read_json_object, resolve_inside
from ..hub import missing_revision
from ..validation import brief_list

#: ``config.json`` of heads: a few kB (the prefix layer's config included); multimodal base
#: configs reach ~100 kB. Shard indexes of the largest models are well under 1 MiB.
MAX_CONFIG_BYTES = 2**20
MAX_INDEX_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32
#: Float32 bytes the built heads may take per byte of weight files (plus a fixed allowance):
#: half-precision files double, tied blocks of published Hydra heads add a little, so a
#: file can never make the loader allocate far more than it holds.
MAX_GROWTH = 8
GROWTH_ALLOWANCE = 16 * 2**20
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HeadsLoadError(FileFormatError):
    """A head checkpoint (folder, Hub repo or file) is missing, unreadable or inconsistent.

    ``HeadsLoadError(path, problem)``; the message is ``"path: problem"``.
    """


def resolve_file(
    source: str | os.PathLike,
    filename: str,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    required: bool = True,
    named_by: str | None = None,
) -> str | None:
    """Local path of ``filename`` in a folder or Hub repo (downloaded or from the offline cache).

    Returns ``None`` for a missing optional file; raises :class:`HeadsLoadError` for a
    missing required one, a source that is neither a folder nor a valid repo id, or a name
    that leaves the folder or repo. ``named_by``: the file the name was read from (a shard
    index), which the refusal of such a name points at.
    """
    source = os.fspath(source)
    where = named_by or source
    if os.path.isdir(source):
        path = _inside(source, filename, where)
        if os.path.isfile(path):
            return path
        if required:
            raise HeadsLoadError(path, f"file not found in the heads folder {source}")
        return None
    if os.path.exists(source):
        raise HeadsLoadError(source, "expected a folder (or Hub repo id) holding the heads, got a file")
    _relative(filename, where)
    try:
        return hf_hub_download(
            source,
            filename,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            force_download=force_download,
            local_files_only=local_files_only,
        )
    except RevisionNotFoundError as e:
        raise HeadsLoadError(source, f"the Hub repo has no revision {revision!r} (a branch, tag or commit)") from e
    except EntryNotFoundError as e:  # LocalEntryNotFoundError included: offline and not cached
        problem = missing_revision(
            source, revision, cache_dir=cache_dir, token=token, offline=isinstance(e, LocalEntryNotFoundError)
        )
        if problem is not None:
            raise HeadsLoadError(source, problem) from e
        if required:
            raise HeadsLoadError(f"{source}/{filename}", f"(revision {revision or 'main'}) not found ({e})") from e
        return None
    except RepositoryNotFoundError as e:
        raise HeadsLoadError(source, f"no such local folder or Hub repository ({e})") from e
    except HFValidationError as e:
        raise HeadsLoadError(source, f"not a local folder and not a valid Hub repo id ({e})") from e


def _inside(folder: str, name: str, where: str) -> str:
    try:
        return resolve_inside(folder, name, where)
    except FileFormatError as e:
        raise HeadsLoadError(e.path, e.problem) from None


def _relative(name: str, where: str) -> str:
    try:
        return check_relative_name(name, where)
    except FileFormatError as e:
        raise HeadsLoadError(e.path, e.problem) from None


def read_json(path: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A JSON object from ``path``, bounded in bytes and nesting before it is parsed."""
    try:
        return read_json_object(path, max_bytes=max_bytes, max_depth=MAX_JSON_DEPTH)
    except FileFormatError as e:
        raise HeadsLoadError(e.path, e.problem) from None


# --------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a weights file: shape and dtype known, data read only by ``read()``."""

    shape: torch.Size
    dtype: torch.dtype | None  # None: a dtype torch has no name for here (refused if expected)
    read: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Weights:
    """The tensors of one or more weight files (a shard index names them all)."""

    path: str  # what error messages name: the weights file, or the shard index
    tensors: dict[str, StoredTensor]
    nbytes: int  # total size of the files, which bounds what loading them may allocate


def stored_tensor(tensor: torch.Tensor) -> StoredTensor:
    return StoredTensor(tensor.shape, tensor.dtype, lambda: tensor)


def open_safetensors(path: str, keys_with_prefix: str | None = None) -> Weights:
    """Names, shapes and dtypes from a safetensors header; only matching keys, prefix removed."""
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")  # kept open by the readers below
        if BANK_METADATA_KEY in (handle.metadata() or {}):
            raise HeadsLoadError(path, "this is an entmtp-hf topology bank (a file of trees), not draft-head weights")
        names = [k for k in handle.keys() if keys_with_prefix is None or k.startswith(keys_with_prefix)]
        slices = {k: handle.get_slice(k) for k in names}
        specs = {k: (torch.Size(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype())) for k, s in slices.items()}
    except HeadsLoadError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncation/corruption
        raise HeadsLoadError(path, f"not a readable safetensors file ({type(e).__name__}: {e})") from e

    def reader(key: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            try:
                return handle.get_tensor(key)
            except Exception as e:
                raise HeadsLoadError(path, f"cannot read tensor {key} ({type(e).__name__}: {e})") from e

        return read

    tensors = {k.removeprefix(keys_with_prefix or ""): StoredTensor(*specs[k], reader(k)) for k in names}
    return Weights(path, tensors, os.path.getsize(path))


def _check_archive(path: str) -> None:
    """A ``torch.save`` zip whose entries are stored, not compressed (as torch writes them),
    so the memory-mapped tensors never hold more than the file: no zip bombs, no legacy format."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise HeadsLoadError(
            path, f"not a torch.save zip archive ({e}); pickles from torch < 1.6 are not read, re-save them"
        ) from e
    packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise HeadsLoadError(path, f"compressed entries, which torch.save never writes: {brief_list(packed)}")


def _check_tensors(data: object, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(data, Mapping):
        raise HeadsLoadError(path, f"expected a mapping of names to tensors, got {type(data).__name__}")
    plain = (torch.Tensor, torch.nn.Parameter)  # no tensor subclasses: their methods are not ours to run
    bad = [str(k) for k, v in data.items() if not isinstance(k, str) or type(v) not in plain]
    if bad:
        raise HeadsLoadError(path, f"entries that are not named tensors: {brief_list(bad)}")
    odd = [k for k, v in data.items() if v.layout != torch.strided or v.is_quantized]
    if odd:
        raise HeadsLoadError(path, f"tensors that are not plain dense tensors: {brief_list(odd)}")
    # a view cannot hold more elements than its storage unless it repeats them (stride 0):
    # such a tensor would make the loader allocate far more than the file holds
    grown = [k for k, v in data.items() if v.numel() * v.element_size() > v.untyped_storage().nbytes()]
    if grown:
        raise HeadsLoadError(path, f"tensors that repeat their storage (expanded views): {brief_list(grown)}")
    return dict(data)


def _pickle_problem(error: Exception) -> str:
    """torch's reason for refusing a pickle, in one line: the line that names what the pickle
    asked for, without torch's advice around it (which suggests ``weights_only=False``, the
    very thing that would run the pickle's code)."""
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue", "WeightsUnpickler error")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if not line.startswith(advice)), lines[0] if lines else "")
    text = f"{type(error).__name__}: {reason}"
    return text if len(text) <= 200 else text[:197] + "..."


def open_pickle(path: str, keys_with_prefix: str | None = None) -> Weights:
    """A pickled state dict, read with ``weights_only=True`` (tensors only, never code) and
    memory-mapped, so nothing is read into memory before the shapes are checked.

    A pickle that references anything but tensors and plain containers (for instance a
    callable in ``__reduce__``) is refused by torch's restricted unpickler before anything
    runs; the refusal is re-raised as :class:`HeadsLoadError` naming the file.
    """
    _check_archive(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise HeadsLoadError(
            path,
            f"refused or unreadable pickle ({_pickle_problem(e)}); nothing in it was run. "
            "Only plain tensor state dicts are read: re-save the tensors from a copy you trust "
            "(torch.save of a dict of tensors, or safetensors)",
        ) from e
    tensors = _check_tensors(data, path)
    kept = {
        k.removeprefix(keys_with_prefix or ""): stored_tensor(v)
        for k, v in tensors.items()
        if keys_with_prefix is None or k.startswith(keys_with_prefix)
    }
    return Weights(path, kept, os.path.getsize(path))


def open_weights(path: str, keys_with_prefix: str | None = None) -> Weights:
    """A ``.safetensors`` file or a (weights-only) pickle, chosen by extension."""
    if path.endswith(".safetensors"):
        return open_safetensors(path, keys_with_prefix)
    return open_pickle(path, keys_with_prefix)


def merge_weights(path: str, parts: list[Weights]) -> Weights:
    """The shards of one checkpoint as one set of weights; errors name ``path`` (the index)."""
    tensors: dict[str, StoredTensor] = {}
    for part in parts:
        repeated = sorted(set(tensors) & set(part.tensors))
        if repeated:
            raise HeadsLoadError(path, f"tensors stored in more than one shard: {brief_list(repeated)}")
        tensors.update(part.tensors)
    return Weights(path, tensors, sum(p.nbytes for p in parts))


# --------------------------------------------------------------------------- matching
def _shape_problems(weights: Weights, expected: Mapping[str, tuple[str, torch.Tensor]]) -> list[str]:
    problems = []
    wrong = [
        f"{k} {tuple(weights.tensors[k].shape)} (expected {tuple(t.shape)})"
        for k, (_, t) in sorted(expected.items())
        if weights.tensors[k].shape != t.shape
    ]
    if wrong:
        problems.append(f"wrong shapes: {brief_list(wrong)}")
    dtypes = []
    for k, (_, t) in sorted(expected.items()):
        allowed, kind = (FLOAT_DTYPES, "a float") if t.is_floating_point() else (INDEX_DTYPES, "an integer")
        if weights.tensors[k].dtype not in allowed:
            dtypes.append(f"{k} {weights.tensors[k].dtype} (expected {kind} dtype)")
    if dtypes:
        problems.append(f"wrong dtypes: {brief_list(dtypes)}")
    return problems


def check_weights(
    weights: Weights, expected: Mapping[str, tuple[str, torch.Tensor]], ignore: tuple[str, ...] = ()
) -> dict[str, StoredTensor]:
    """Strictly match file tensors to the module's tensors before the module is allocated.

    ``expected`` maps a name as spelled in the file to ``(module name, meta tensor)`` (the
    module built on the meta device gives shapes and dtypes without memory). Any missing,
    unexpected (not ignored), misshapen or wrongly typed tensor fails with every offending
    key; so does a module that would take far more memory than the files hold. Returns the
    stored tensors under module names, still unread.
    """
    present = {k for k in weights.tensors if not k.endswith(ignore)} if ignore else set(weights.tensors)
    if expected and not present & set(expected):
        raise HeadsLoadError(
            weights.path,
            f"holds none of the heads' tensors (it has {brief_list(sorted(present))}): not weights of these heads",
        )
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys: {brief_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {brief_list(unexpected)}")
    if not problems:
        problems = _shape_problems(weights, expected)
    if problems:
        raise HeadsLoadError(weights.path, "weights do not match the heads config; " + "; ".join(problems))
    needed = 4 * sum(t.numel() for _, t in expected.values())  # the module is float32 (or smaller)
    if needed > MAX_GROWTH * weights.nbytes + GROWTH_ALLOWANCE:
        raise HeadsLoadError(
            weights.path, f"the heads would take {needed} bytes, far more than the {weights.nbytes} bytes of weights"
        )
    return {own: weights.tensors[k] for k, (own, _) in expected.items()}
