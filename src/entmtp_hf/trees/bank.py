"""Topology banks: one task's precompiled draft trees plus the figures that chose them.

A :class:`TopologyBank` holds K trees, smallest first, and metadata (who measured them,
on which model, heads and hardware, their accept lengths and speeds, and the scheduler's
defaults). Banks live in Hub-style folders, one file per task, so one Hub repo can hold
the banks of many tasks and a user downloads only the task they run.

File format (version 1), ``{folder}/{task}.safetensors``:

* tensors ``tree.0`` … ``tree.{K-1}``: int32, shape ``[num_paths, depth]``; each row is
  one path of child ranks from the root (the Medusa/Hydra "choices" format), right-padded
  with ``-1``. The root is implicit; the root-only tree is a ``[0, 0]`` tensor.
* header metadata ``__metadata__ = {"entmtp_bank": <JSON>}``; the JSON object holds
  ``format_version`` (1), ``task`` (equal to the file stem), ``num_trees`` (K) and the
  user metadata: ``base_model``, ``heads``, ``hardware``, ``created_by`` (strings),
  ``trees`` (one dict per tree, e.g. ``num_nodes``, ``mean_accept_length``,
  ``biased_accept_length``, ``tokens_per_s``), ``scheduler`` (see
  :class:`SchedulerDefaults`), ``calibration`` (free-form dict) and any other JSON keys.

``{folder}/README.md`` is a model card regenerated on every save, one table per task.
Reading validates everything and turns every problem into one :class:`BankFormatError`
naming the file; no pickle is ever involved. See ``docs/banks.md``.
"""

from __future__ import annotations

import copy
import json
import math
import operator
import os
import re
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from ..drafting.retrieval import RetrievalConfig
from ..scheduling.policies import FEATURES, POLICIES
from .tree import MC_SIM_7B_63, Tree

FORMAT_VERSION = 1
METADATA_KEY = "entmtp_bank"
SUFFIX = ".safetensors"
CARD_NAME = "README.md"
#: Refuse larger files before parsing them: real banks are a few kB, 1000 trees of 500 nodes ~4 MB.
MAX_FILE_BYTES = 16 * 2**20
#: the banks shipped with the package (package data: present in wheels and checkouts alike)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "banks"

_TASK_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_RESERVED = ("format_version", "task", "num_trees")
_TEXT_KEYS = ("base_model", "heads", "hardware", "created_by")
_FIGURES = {"mean_accept_length": "mean accept length", "biased_accept_length": "biased accept length",
            "tokens_per_s": "tokens/s"}  # fmt: skip
_CARD_KEYS = (*_TEXT_KEYS, "description")
_INT32_MAX = 2**31 - 1
#: Ends of the paper's threshold grid (0.001 … 0.05), used for default ladder thresholds.
_TAU_GRID_ENDS = (0.001, 0.05)


class BankFormatError(ValueError):
    """A bank file that cannot be read; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def check_task_name(task: object) -> str:
    """Task names become file stems, so only a safe subset of characters is allowed."""
    if not isinstance(task, str) or not _TASK_RE.fullmatch(task):
        raise ValueError(
            f"task name {task!r} is not a safe file stem: use 1-100 letters, digits, '_', '-' or '.', "
            "not starting with '-' or '.' (e.g. 'humaneval')"
        )
    return task


def _as_index(value: object, what: str) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"{what} must be an integer tree index, got {value!r}")


def _as_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _as_list(value: object, what: str, of: str) -> Sequence:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a list of {of}, got {value!r}")
    return value


def _strictly_increasing(values: Sequence[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def default_thresholds(count: int, tau: float = 0.01) -> tuple[float, ...]:
    """Ladder thresholds when none are given: one threshold is ``tau``; more are spaced
    evenly in log scale over the paper's grid ends 0.001 … 0.05 (uncalibrated guesses)."""
    if count <= 0:
        return ()
    if count == 1:
        return (tau,)
    lo, hi = (math.log(v) for v in _TAU_GRID_ENDS)
    return tuple(round(math.exp(lo + (hi - lo) * i / (count - 1)), 6) for i in range(count))


@dataclass(frozen=True)
class SchedulerDefaults:
    """Which trees of a bank each scheduler policy uses, and its thresholds.

    ``static``: the tree of the static policy (EntMTP*). ``conservative`` / ``aggressive``:
    T− / T+ of the hysteresis policy, switched on ``tau_on`` / ``tau_off`` of ``feature``.
    ``ladder``: the tree indices, in increasing order, that ``thresholds`` (one fewer) bin
    ``ladder_feature`` into. ``policy``: what ``EntMTPConfig(bank=..., task=...)`` runs when
    no policy is given (the search stores the fastest one it measured). ``retrieval``: the
    retrieval branches it adds when ``retrieval`` is not given (None: none; the search stores
    the settings that made the static tree faster, if any did).
    """

    static: int
    conservative: int
    aggressive: int
    tau_on: float
    tau_off: float
    ladder: tuple[int, ...]
    thresholds: tuple[float, ...]
    policy: str = "hysteresis"
    feature: str = "best_path_value"
    ladder_feature: str = "best_path_value"
    retrieval: RetrievalConfig | None = None
    value: tuple[int, ...] = ()
    value_costs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.retrieval is not None and not isinstance(self.retrieval, RetrievalConfig):
            raise ValueError(f"retrieval must be a RetrievalConfig or None, got {self.retrieval!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("feature", "ladder_feature"):
            if getattr(self, name) not in FEATURES:
                raise ValueError(f"{name} must be one of {FEATURES}, got {getattr(self, name)!r}")
        for name in ("static", "conservative", "aggressive"):
            if _as_index(getattr(self, name), name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        _as_number(self.tau_on, "tau_on")
        _as_number(self.tau_off, "tau_off")
        if any(_as_index(i, "value entry") < 0 for i in self.value):
            raise ValueError(f"value must list tree indices >= 0, got {list(self.value)}")
        costs = [_as_number(c, "value cost") for c in self.value_costs]
        if len(costs) != len(self.value) or any(c <= 0 for c in costs):
            raise ValueError(f"value_costs must give one positive cost per value tree ({len(self.value)}), got {costs}")
        if self.policy == "value" and not self.value:
            raise ValueError("policy 'value' needs the trees it picks from in `value`")
        if self.tau_off > self.tau_on:
            raise ValueError(f"tau_off ({self.tau_off}) must be <= tau_on ({self.tau_on})")
        if self.conservative > self.aggressive:
            raise ValueError(f"conservative ({self.conservative}) must be <= aggressive ({self.aggressive})")
        if not self.ladder or any(_as_index(i, "ladder entry") < 0 for i in self.ladder):
            raise ValueError(f"ladder must list one or more tree indices >= 0, got {list(self.ladder)}")
        if not _strictly_increasing(self.ladder):
            raise ValueError(f"ladder indices must be strictly increasing, got {list(self.ladder)}")
        if len(self.thresholds) != len(self.ladder) - 1:
            raise ValueError(
                f"a ladder of {len(self.ladder)} trees needs {len(self.ladder) - 1} thresholds, "
                f"got {len(self.thresholds)}"
            )
        for t in self.thresholds:
            _as_number(t, "threshold")
        if not _strictly_increasing(self.thresholds):
            raise ValueError(f"thresholds must be strictly increasing, got {list(self.thresholds)}")

    @classmethod
    def from_metadata(cls, raw: Mapping[str, Any] | None, num_trees: int) -> "SchedulerDefaults":
        """Fill what ``raw`` leaves out and check every index against ``num_trees``.

        Defaults: static = aggressive = the last tree, conservative = 0, tau_on = tau_off =
        0.01 (one given: the other copies it), ladder = every tree, thresholds =
        :func:`default_thresholds`, policy ``hysteresis``, features ``best_path_value``,
        no retrieval.
        """
        raw = dict(raw or {})
        unknown = sorted(set(raw) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"unknown scheduler keys {unknown}; allowed: {list(cls.__dataclass_fields__)}")
        last = num_trees - 1
        tau_on = raw.get("tau_on", raw.get("tau_off", 0.01))
        ladder = _as_list(raw.get("ladder", range(num_trees)), "ladder", "tree indices")
        ladder = tuple(_as_index(i, "ladder entry") for i in ladder)
        thresholds = raw.get("thresholds")
        if thresholds is None:
            thresholds = default_thresholds(len(ladder) - 1, _as_number(tau_on, "tau_on"))
        _as_list(thresholds, "thresholds", "numbers")
        sched = cls(
            static=_as_index(raw.get("static", last), "static"),
            conservative=_as_index(raw.get("conservative", 0), "conservative"),
            aggressive=_as_index(raw.get("aggressive", last), "aggressive"),
            tau_on=_as_number(tau_on, "tau_on"),
            tau_off=_as_number(raw.get("tau_off", tau_on), "tau_off"),
            ladder=ladder,
            thresholds=tuple(_as_number(t, "threshold") for t in thresholds),
            policy=raw.get("policy", "hysteresis"),
            feature=raw.get("feature", "best_path_value"),
            ladder_feature=raw.get("ladder_feature", "best_path_value"),
            retrieval=None if raw.get("retrieval") is None else RetrievalConfig.from_dict(raw["retrieval"]),
            value=tuple(_as_index(i, "value entry") for i in _as_list(raw.get("value", ()), "value", "tree indices")),
            value_costs=tuple(_as_number(c, "value cost") for c in _as_list(raw.get("value_costs", ()), "value_costs", "numbers")),
        )
        used = {"static": sched.static, "conservative": sched.conservative, "aggressive": sched.aggressive}
        used.update({f"ladder entry {i}": v for i, v in enumerate(sched.ladder)})
        used.update({f"value entry {i}": v for i, v in enumerate(sched.value)})
        for name, index in used.items():
            if index > last:
                raise ValueError(f"{name} is tree {index}, but the bank has only {num_trees} trees (0..{last})")
        return sched

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# ------------------------------------------------------------------ validation helpers
def _coerce_trees(trees: Sequence[Tree | Sequence[Sequence[int]]]) -> tuple[Tree, ...]:
    if isinstance(trees, (str, bytes, Tree)) or not isinstance(trees, Sequence):
        raise ValueError("trees must be a list of Tree objects or lists of paths")
    if not trees:
        raise ValueError("a bank needs at least one tree")
    out = []
    for k, raw in enumerate(trees):
        try:
            tree = Tree.from_choices(raw)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"tree {k}: {e}") from None
        if any(r > _INT32_MAX for p in tree.paths for r in p):
            raise ValueError(f"tree {k} has a child rank above {_INT32_MAX}, which the int32 file format cannot hold")
        if out and tree.num_nodes < out[-1].num_nodes:
            raise ValueError(
                f"trees must be ordered smallest first: tree {k} has {tree.num_nodes} nodes, "
                f"tree {k - 1} has {out[-1].num_nodes}"
            )
        out.append(tree)
    return tuple(out)


def _check_metadata(metadata: Mapping[str, Any] | None, task: str, trees: tuple[Tree, ...]) -> dict[str, Any]:
    """Normalise metadata through JSON (a deep copy; tuples become lists) and check the schema."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        meta = json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serialisable (no NaN/inf, no objects): {e}") from None
    expected = {"format_version": FORMAT_VERSION, "task": task, "num_trees": len(trees)}
    for key, value in expected.items():  # reserved keys are written by the bank itself
        if key in meta and meta.pop(key) != value:
            raise ValueError(f"metadata[{key!r}] is set by the bank and must be {value!r} (or left out)")
    for key in _TEXT_KEYS:
        if key in meta and not isinstance(meta[key], str):
            raise ValueError(f"metadata[{key!r}] must be a string, got {meta[key]!r}")
    for key in ("scheduler", "calibration"):
        if key in meta and not isinstance(meta[key], dict):
            raise ValueError(f"metadata[{key!r}] must be a dict, got {type(meta[key]).__name__}")
    per_tree = meta.get("trees")
    if per_tree is not None:
        if not isinstance(per_tree, list) or len(per_tree) != len(trees):
            raise ValueError(f"metadata['trees'] must be a list of {len(trees)} dicts, one per tree")
        for k, (info, tree) in enumerate(zip(per_tree, trees)):
            if not isinstance(info, dict):
                raise ValueError(f"metadata['trees'][{k}] must be a dict, got {info!r}")
            if "num_nodes" in info and info["num_nodes"] != tree.num_nodes:
                got = info["num_nodes"]
                raise ValueError(f"metadata['trees'][{k}]['num_nodes'] is {got}, tree {k} has {tree.num_nodes}")
            for fig in _FIGURES:
                if fig in info:
                    _as_number(info[fig], f"metadata['trees'][{k}][{fig!r}]")
    return meta


# ------------------------------------------------------------------ tensor encoding
def encode_tree(tree: Tree) -> torch.Tensor:
    """[num_paths, depth] int32, one path per row, right-padded with -1."""
    rows = [list(p) + [-1] * (tree.depth - len(p)) for p in tree.paths]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tree.paths), tree.depth)


def decode_tree(tensor: torch.Tensor, name: str) -> Tree:
    """Inverse of :func:`encode_tree`, refusing anything it could not have written."""
    if tensor.dtype != torch.int32:
        raise ValueError(f"tensor {name} has dtype {tensor.dtype}; expected torch.int32")
    if tensor.dim() != 2:
        raise ValueError(f"tensor {name} has shape {list(tensor.shape)}; expected [num_paths, depth]")
    if bool((tensor < -1).any()):
        raise ValueError(f"tensor {name} has negative values other than the -1 padding")
    pad = tensor == -1
    if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
        raise ValueError(f"tensor {name} has a rank after -1 padding; padding must be on the right only")
    paths = [[r for r in row if r != -1] for row in tensor.tolist()]
    try:
        return Tree.from_choices(paths)
    except ValueError as e:
        raise ValueError(f"tensor {name} is not a valid tree: {e}") from None


# ------------------------------------------------------------------ reading one file
def _read_header(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"not a readable safetensors file ({e})") from None
    if METADATA_KEY not in header:
        raise ValueError(f"no {METADATA_KEY!r} header metadata; not a bank written by TopologyBank.save_pretrained")
    try:
        meta = json.loads(header[METADATA_KEY])
    except ValueError as e:
        raise ValueError(f"{METADATA_KEY!r} header metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{METADATA_KEY!r} header metadata must be a JSON object")
    return meta, tensors


def _read_bank(path: Path) -> "TopologyBank":
    if not path.is_file():
        raise ValueError("file not found")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"file is {path.stat().st_size} bytes, above the {MAX_FILE_BYTES}-byte limit for banks")
    meta, tensors = _read_header(path)
    version = meta.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ValueError(f"format_version {version!r} is not supported (this entmtp-hf reads {FORMAT_VERSION})")
    task = meta.get("task")
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.stem
    if task != stem:
        raise ValueError(f"metadata task {task!r} does not match the file name {path.name!r}")
    num_trees = meta.get("num_trees")
    if isinstance(num_trees, bool) or not isinstance(num_trees, int) or num_trees < 1:
        raise ValueError(f"num_trees must be an integer >= 1, got {num_trees!r}")
    names = [f"tree.{k}" for k in range(num_trees)]
    missing = [n for n in names if n not in tensors]
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise ValueError(f"num_trees is {num_trees} but tensors {missing} are missing and {extra} unexpected")
    trees = [decode_tree(tensors[n], n) for n in names]
    user = {k: v for k, v in meta.items() if k not in _RESERVED}
    return TopologyBank(task, trees, user)


def load_bank_file(path: str | os.PathLike[str]) -> "TopologyBank":
    """Read and validate one bank file; every problem is a :class:`BankFormatError`."""
    path = Path(path)
    try:
        return _read_bank(path)
    except ValueError as e:
        raise BankFormatError(path, str(e)) from e


# ------------------------------------------------------------------ the bank
class TopologyBank:
    """One task's trees (smallest first) with metadata and scheduler defaults."""

    def __init__(
        self,
        task: str,
        trees: Sequence[Tree | Sequence[Sequence[int]]],
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._task = check_task_name(task)
        self._trees = _coerce_trees(trees)
        self._metadata = _check_metadata(metadata, task, self._trees)
        try:
            self._scheduler = SchedulerDefaults.from_metadata(self._metadata.get("scheduler"), len(self._trees))
        except ValueError as e:
            raise ValueError(f"metadata['scheduler']: {e}") from None

    @property
    def task(self) -> str:
        """The task name, also the file stem."""
        return self._task

    @property
    def trees(self) -> tuple[Tree, ...]:
        """The trees, smallest first."""
        return self._trees

    @property
    def scheduler(self) -> SchedulerDefaults:
        """Scheduler defaults, validated against the number of trees."""
        return self._scheduler

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the user metadata (without format_version / task / num_trees)."""
        return copy.deepcopy(self._metadata)

    def tree(self, index: int) -> Tree:
        return self._trees[index]

    def __len__(self) -> int:
        return len(self._trees)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopologyBank):
            return NotImplemented
        return (self._task, self._trees, self._metadata) == (other._task, other._trees, other._metadata)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        nodes = [t.num_nodes for t in self._trees]
        return f"TopologyBank(task={self._task!r}, num_nodes={nodes}, static={self._scheduler.static})"

    # -------------------------------------------------------------- local folders
    def save_pretrained(self, folder: str | os.PathLike[str]) -> Path:
        """Write (or replace) this task's file and regenerate the folder's model card."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"tree.{k}": encode_tree(t) for k, t in enumerate(self._trees)}
        meta = {"format_version": FORMAT_VERSION, "task": self._task, "num_trees": len(self._trees), **self._metadata}
        header = {METADATA_KEY: json.dumps(meta, allow_nan=False)}
        target = folder / f"{self._task}{SUFFIX}"
        tmp = folder / f".{target.name}.{uuid.uuid4().hex}.tmp"
        try:  # write then rename, so readers never see a half-written bank
            tmp.write_bytes(safetensors_bytes(tensors, metadata=header))  # honours the umask
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        (folder / CARD_NAME).write_text(model_card(folder), encoding="utf-8")
        return target

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "TopologyBank":
        return load_bank_file(path)

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike[str], task: str, revision: str | None = None, **hub_kwargs: Any
    ) -> "TopologyBank":
        """Load ``task`` from a local folder or a Hub repo (``hub_kwargs`` go to ``hf_hub_download``)."""
        check_task_name(task)
        local = Path(path_or_repo_id)
        if local.is_dir():
            if not (local / f"{task}{SUFFIX}").is_file():
                raise ValueError(f"folder {str(local)!r} has no task {task!r}; tasks there: {list_local_tasks(local)}")
            return load_bank_file(local / f"{task}{SUFFIX}")
        repo_id = str(path_or_repo_id)
        try:
            path = hf_hub_download(repo_id, f"{task}{SUFFIX}", revision=revision, **hub_kwargs)
        except HFValidationError as e:
            raise ValueError(f"{repo_id!r} is neither a local folder nor a valid Hub repo id ({e})") from e
        except RemoteEntryNotFoundError as e:
            tasks = _tasks_or_unknown(repo_id, revision, hub_kwargs, cached_only=False)
            where = f"Hub repo {repo_id!r} ({revision or 'main'})"
            raise ValueError(f"{where} has no task {task!r}; tasks there: {tasks}") from e
        except LocalEntryNotFoundError as e:  # offline, or the Hub unreachable, and not cached
            tasks = _tasks_or_unknown(repo_id, revision, hub_kwargs, cached_only=True)
            raise ValueError(
                f"Hub repo {repo_id!r} ({revision or 'main'}) has no task {task!r} in the local cache and the Hub "
                f"is offline or unreachable; cached tasks: {tasks}; there is no local folder {repo_id!r} either"
            ) from e
        return load_bank_file(path)

    @staticmethod
    def list_tasks(
        path_or_repo_id: str | os.PathLike[str],
        revision: str | None = None,
        *,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool = False,
    ) -> list[str]:
        """Sorted task names of a folder or Hub repo; offline, those in the cached snapshot."""
        if Path(path_or_repo_id).is_dir():
            return list_local_tasks(Path(path_or_repo_id))
        repo_id = str(path_or_repo_id)
        if local_files_only or hf_constants.is_offline_mode():
            snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                     allow_patterns=[f"*{SUFFIX}"], local_files_only=True)  # fmt: skip
            names = [p.name for p in Path(snap).iterdir()]
        else:
            names = HfApi(token=token).list_repo_files(repo_id, revision=revision)
        return _tasks_from_names(names)

    # -------------------------------------------------------------- the Hub
    def push_to_hub(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        private: bool | None = None,
        commit_message: str | None = None,
        revision: str | None = None,
        create_pr: bool | None = None,
    ) -> Any:
        """Add or replace this task's file in a Hub repo (created if needed); returns the
        ``CommitInfo`` of ``HfApi.upload_folder``. Other tasks' files are fetched first so the
        uploaded model card lists every task of the repo."""
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            try:
                remote = api.list_repo_files(repo_id, revision=revision)
            except RevisionNotFoundError:
                remote = []
            for name in _tasks_from_names(remote):
                if name != self._task:
                    api.hf_hub_download(repo_id, f"{name}{SUFFIX}", revision=revision, local_dir=tmp)
            self.save_pretrained(tmp)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                allow_patterns=[f"{self._task}{SUFFIX}", CARD_NAME],
                commit_message=commit_message or f"Upload entmtp-hf topology bank for task {self._task}",
                revision=revision,
                create_pr=create_pr,
            )


def _tasks_or_unknown(
    repo_id: str, revision: str | None, hub_kwargs: Mapping[str, Any], cached_only: bool
) -> list[str] | str:
    """Best-effort task list for an error message that is already being raised."""
    try:
        return TopologyBank.list_tasks(repo_id, revision, token=hub_kwargs.get("token"),
                                       cache_dir=hub_kwargs.get("cache_dir"), local_files_only=cached_only)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - cosmetic; the original error is chained
        return f"unknown ({type(e).__name__})"


def _tasks_from_names(names: Sequence[str]) -> list[str]:
    """Task names from top-level file names, ignoring anything that is not a bank file."""
    stems = (n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX) and "/" not in n)
    return sorted(s for s in stems if _TASK_RE.fullmatch(s))


def list_local_tasks(folder: Path) -> list[str]:
    return _tasks_from_names([p.name for p in folder.iterdir() if p.is_file()])


# ------------------------------------------------------------------ model card
def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _retrieval_text(config: RetrievalConfig | None) -> str:
    if config is None:
        return "none"
    return f"{config.mode}, up to {config.num_tokens} tokens after a {config.min_ngram}-{config.max_ngram}-token match"


def _task_section(bank: TopologyBank) -> list[str]:
    meta, sched = bank.metadata, bank.scheduler
    per_tree = meta.get("trees") or [{} for _ in bank.trees]
    columns = {"name": "name", "source": "source", **_FIGURES}
    figures = [f for f in columns if any(f in info for info in per_tree)]
    lines = [f"## Task `{bank.task}`", ""]
    lines += [f"- {key.replace('_', ' ')}: {_cell(meta[key])}" for key in _CARD_KEYS if key in meta]
    header = ["tree", "nodes", "depth", "nodes per depth"] + [columns[f] for f in figures]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for k, (tree, info) in enumerate(zip(bank.trees, per_tree)):
        per_depth = "/".join(map(str, tree.nodes_per_depth())) or "-"
        cells = [str(k), str(tree.num_nodes), str(tree.depth), per_depth]
        cells += [_cell(info[f]) if f in info else "" for f in figures]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Scheduler defaults: policy `{sched.policy}` (what runs when none is given); static tree {sched.static}; "
        f"hysteresis T− = tree {sched.conservative}, T+ = tree {sched.aggressive} on `{sched.feature}`, "
        f"τ_on = {sched.tau_on:g}, τ_off = {sched.tau_off:g}; ladder trees {list(sched.ladder)} on "
        f"`{sched.ladder_feature}` with thresholds {[float(f'{t:g}') for t in sched.thresholds]}; "
        + (f"value policy over trees {list(sched.value)} (relative costs "
           f"{[float(f'{c:.3g}') for c in sched.value_costs]}); " if sched.value else "")
        + f"retrieval branches by default: {_retrieval_text(sched.retrieval)}.",
        "",
    ]
    return lines


def model_card(folder: Path) -> str:
    """The README.md of a bank folder: YAML front matter and one table per task."""
    tasks = list_local_tasks(folder)
    tags = ("entmtp-hf", "speculative-decoding", "tree-attention", "multi-token-prediction")
    lines = ["---", "library_name: entmtp-hf", "tags:", *(f"- {t}" for t in tags), "---", ""]
    lines += [
        "# entmtp-hf topology banks",
        "",
        "Draft-tree banks for tree speculative decoding with entmtp-hf: one `<task>.safetensors` "
        "file per task, K trees smallest first (format: `docs/banks.md` of entmtp-hf). Load one with",
        "",
        "```python",
        "from entmtp_hf.bank import TopologyBank",
        f'bank = TopologyBank.from_pretrained("<this folder or repo id>", task="{tasks[0] if tasks else "default"}")',
        "```",
        "",
    ]
    for task in tasks:
        try:
            lines += _task_section(load_bank_file(folder / f"{task}{SUFFIX}"))
        except BankFormatError as e:
            lines += [f"## Task `{task}`", "", f"Unreadable bank file: {_cell(e.problem)}", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ shipped banks
def published_defaults_bank() -> TopologyBank:
    """The bank shipped in ``trees/published-defaults``: the published systems' trees."""
    source = "Medusa (Cai et al., 2024) and Hydra (Ankner et al., 2024) default tree `mc_sim_7b_63`"
    return TopologyBank(
        "default",
        [Tree.root_only(), Tree.chain(4), Tree.from_choices(MC_SIM_7B_63)],
        metadata={
            "created_by": "entmtp_hf.bank.published_defaults_bank",
            "heads": "any Medusa or Hydra heads",
            "hardware": "any (not measured)",
            "description": "Published default trees, uncalibrated; thresholds come from the paper's τ grid.",
            "trees": [
                {"num_nodes": 1, "name": "root-only", "source": "no drafting (plain decoding)"},
                {"num_nodes": 5, "name": "chain-4", "source": "top-1 chain of depth 4"},
                {"num_nodes": 64, "name": "mc_sim_7b_63", "source": source},
            ],
            "scheduler": {"static": 2, "conservative": 1, "aggressive": 2, "tau_on": 0.01, "tau_off": 0.01,
                          "ladder": [0, 1, 2], "thresholds": [0.005, 0.02]},  # fmt: skip
        },
    )


def shipped_bank_path(name: str) -> Path:
    """Folder of a bank shipped with the package (``entmtp_hf/banks/<name>``)."""
    path = SHIPPED_DIR / name
    if not _TASK_RE.fullmatch(name) or not path.is_dir():
        shipped = sorted(p.name for p in SHIPPED_DIR.iterdir()) if SHIPPED_DIR.is_dir() else []
        raise ValueError(f"no shipped bank {name!r} in {SHIPPED_DIR} (found: {shipped}); load it from the Hub instead")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m entmtp_hf.bank [FOLDER]``: (re)write the published-defaults bank."""
    args = list(sys.argv[1:] if argv is None else argv)
    folder = Path(args[0]) if args else SHIPPED_DIR / "published-defaults"
    print(published_defaults_bank().save_pretrained(folder))


if __name__ == "__main__":
    main()
