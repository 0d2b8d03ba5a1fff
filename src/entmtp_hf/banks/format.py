"""The bank file format: validation, scheduler defaults, tree encoding and bounded reading.

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

Every size is bounded (the ``MAX_*`` constants) and checked before anything of that size is
built: the metadata's bytes and nesting before it is parsed, ``num_trees`` and each tensor's
dtype and shape from the safetensors header before any tensor is read. The constructor
applies the same limits, so every bank that can be built can be saved and read back.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..costs.retrieval import RetrievalFigures
from ..costs.table import CostTable
from ..errors import EntMTPError, FieldError, FileFormatError
from ..files import nesting_depth, parse_json
from ..scheduling.features import FEATURES
from ..scheduling.policies import get_policy
from ..trees.retrieval import RetrievalConfig
from ..trees.tree import Tree
from ..validation import (
    brief_list,
    brief_repr,
    choice,
    increasing,
    integer,
    mapping,
    number,
    numbers_in,
    sequence,
    taus,
    thresholds,
)

FORMAT_VERSION = 1
METADATA_KEY = "entmtp_bank"
SUFFIX = ".safetensors"
#: Refuse larger files before parsing them: real banks are a few kB, 1000 trees of 500 nodes ~4 MB.
MAX_FILE_BYTES = 16 * 2**20
#: The metadata JSON: searched banks hold ~10 kB (figures per tree, calibration notes).
MAX_METADATA_BYTES = 2**20
MAX_METADATA_DEPTH = 32
#: Trees per bank: a search keeps the trees on its throughput hull, a few dozen at most.
MAX_TREES = 1024
#: Nodes per tree (root included) and per bank: a verified tree is a few hundred rows at most,
#: and reading is ~10 µs per node, so a bank at the limit still loads in well under a second.
MAX_TREE_NODES = 4096
MAX_BANK_NODES = 2**16
#: Depth of a tree: no published or trained heads draft anywhere near this far ahead.
MAX_TREE_DEPTH = 64
#: machines whose measured costs one bank may carry
MAX_MACHINES = 64
#: retrieval settings one frontier may be replayed with
MAX_RETRIEVAL_OPTIONS = 32

TASK_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_RESERVED = ("format_version", "task", "num_trees")
TEXT_KEYS = ("base_model", "heads", "hardware", "created_by")
FIGURES = {
    "mean_accept_length": "mean accept length",
    "biased_accept_length": "biased accept length",
    "measured_accept_length": "measured accept length",
    "tokens_per_s": "tokens/s",
    "speedup_vs_plain": "speed-up vs plain",
}
_INT32_MAX = 2**31 - 1
#: Ends of the paper's threshold grid (0.001 … 0.05), used for default ladder thresholds.
_TAU_GRID_ENDS = (0.001, 0.05)


class BankFormatError(FileFormatError):
    """A bank file that cannot be read; the message names the file and the problem."""


def check_task_name(task: object) -> str:
    """Task names become file stems, so only a safe subset of characters is allowed."""
    if not isinstance(task, str) or not TASK_NAME_RE.fullmatch(task):
        raise ValueError(
            f"task name {brief_repr(task)} is not a safe file stem: use 1-100 letters, digits, '_', '-' or '.', "
            "not starting with '-' or '.' (e.g. 'humaneval')"
        )
    return task


def _index(value: object, field: str) -> int:
    """A tree index (checked against the bank's own trees where they are known)."""
    return integer(value, field, low=0, high=MAX_TREES - 1, error=FieldError)


def _finite(value: object, field: str) -> float:
    return number(value, field, error=FieldError)


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
            raise FieldError("retrieval", f"must be a RetrievalConfig or None, got {brief_repr(self.retrieval)}")
        self._set("policy", get_policy(self.policy, "policy", in_banks=True, error=FieldError).name)
        for name in ("feature", "ladder_feature"):
            choice(getattr(self, name), name, FEATURES, error=FieldError)
        for name in ("static", "conservative", "aggressive"):
            self._set(name, _index(getattr(self, name), name))
        tau_on, tau_off = taus(self.tau_on, self.tau_off, error=FieldError)
        self._set("tau_on", tau_on)
        self._set("tau_off", tau_off)
        self._set(
            "value",
            tuple(
                _index(i, "value entry")
                for i in sequence(self.value, "value", of="tree indices", max_len=MAX_TREES, error=FieldError)
            ),
        )
        costs = numbers_in(self.value_costs, "value_costs", max_len=MAX_TREES, error=FieldError)
        if len(costs) != len(self.value) or any(c <= 0 for c in costs):
            raise FieldError(
                "value_costs",
                f"must give one positive cost per value tree ({len(self.value)}), got {brief_repr(list(costs))}",
            )
        self._set("value_costs", costs)
        if self.policy == "value" and not self.value:
            raise FieldError("policy", "'value' needs the trees it picks from in `value`")
        if self.conservative > self.aggressive:
            raise FieldError("conservative", f"must be <= aggressive ({self.aggressive}), got {self.conservative}")
        self._check_ladder()

    def _set(self, name: str, value: Any) -> None:
        """Store a checked field in its normal form (an int, a float, a tuple)."""
        object.__setattr__(self, name, value)

    def _check_ladder(self) -> None:
        ladder = sequence(self.ladder, "ladder", of="tree indices", max_len=MAX_TREES, error=FieldError)
        if not ladder:
            raise FieldError("ladder", "must list one or more tree indices")
        self._set("ladder", increasing(tuple(_index(i, "ladder entry") for i in ladder), "ladder", error=FieldError))
        self._set(
            "thresholds",
            thresholds(self.thresholds, "thresholds", low=-math.inf, count=len(ladder) - 1, error=FieldError),
        )

    @classmethod
    def from_metadata(cls, raw: Mapping[str, Any] | None, num_trees: int) -> "SchedulerDefaults":
        """Fill what ``raw`` leaves out and check every index against ``num_trees``.

        Defaults: static = aggressive = the last tree, conservative = 0, tau_on = tau_off =
        0.01 (one given: the other copies it), ladder = every tree, thresholds =
        :func:`default_thresholds`, policy ``hysteresis``, features ``best_path_value``,
        no retrieval.
        """
        raw = mapping(raw, "scheduler", optional=True, error=FieldError)
        unknown = sorted(map(str, set(raw) - set(cls.__dataclass_fields__)))
        if unknown:
            allowed = list(cls.__dataclass_fields__)
            raise EntMTPError(f"unknown scheduler keys [{brief_list(map(brief_repr, unknown))}]; allowed: {allowed}")
        last = num_trees - 1
        tau_on = _finite(raw.get("tau_on", raw.get("tau_off", 0.01)), "tau_on")
        ladder = sequence(
            raw.get("ladder", range(num_trees)), "ladder", of="tree indices", max_len=MAX_TREES, error=FieldError
        )
        thresholds = raw.get("thresholds")
        if thresholds is None:
            thresholds = default_thresholds(len(ladder) - 1, tau_on)
        sched = cls(
            static=raw.get("static", last),
            conservative=raw.get("conservative", 0),
            aggressive=raw.get("aggressive", last),
            tau_on=tau_on,
            tau_off=raw.get("tau_off", tau_on),
            ladder=ladder,
            thresholds=thresholds,
            policy=raw.get("policy", "hysteresis"),
            feature=raw.get("feature", "best_path_value"),
            ladder_feature=raw.get("ladder_feature", "best_path_value"),
            retrieval=None if raw.get("retrieval") is None else RetrievalConfig.from_dict(raw["retrieval"]),
            value=raw.get("value", ()),
            value_costs=raw.get("value_costs", ()),
        )
        used = {"static": sched.static, "conservative": sched.conservative, "aggressive": sched.aggressive}
        used.update({f"ladder entry {i}": v for i, v in enumerate(sched.ladder)})
        used.update({f"value entry {i}": v for i, v in enumerate(sched.value)})
        for name, index in used.items():
            if index > last:
                raise FieldError(name, f"is tree {index}, but the bank has only {num_trees} trees (0..{last})")
        return sched

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# ------------------------------------------------------------------ validation
def _check_tree_size(k: int, nodes: int, depth: int, total: int) -> None:
    """The size limits, shared by the constructor and the reader (which checks before decoding)."""
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"tree {k} has {nodes} nodes, above the limit of {MAX_TREE_NODES}")
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"tree {k} has depth {depth}, above the limit of {MAX_TREE_DEPTH}")
    if total > MAX_BANK_NODES:
        raise ValueError(f"trees 0..{k} have {total} nodes together, above the limit of {MAX_BANK_NODES} per bank")


def check_trees(trees: Sequence[Tree | Sequence[Sequence[int]]]) -> tuple[Tree, ...]:
    """Trees as :class:`Tree` objects, smallest first and within the size limits."""
    if isinstance(trees, (str, bytes, Tree)) or not isinstance(trees, Sequence):
        raise ValueError("trees must be a list of Tree objects or lists of paths")
    if not trees:
        raise ValueError("a bank needs at least one tree")
    if len(trees) > MAX_TREES:
        raise ValueError(f"a bank holds at most {MAX_TREES} trees, got {len(trees)}")
    out: list[Tree] = []
    total = 0
    for k, raw in enumerate(trees):
        try:
            tree = Tree.from_choices(raw)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"tree {k}: {e}") from None
        total += tree.num_nodes
        _check_tree_size(k, tree.num_nodes, tree.depth, total)
        if any(r > _INT32_MAX for p in tree.paths for r in p):
            raise ValueError(f"tree {k} has a child rank above {_INT32_MAX}, which the int32 file format cannot hold")
        if out and tree.num_nodes < out[-1].num_nodes:
            raise ValueError(
                f"trees must be ordered smallest first: tree {k} has {tree.num_nodes} nodes, "
                f"tree {k - 1} has {out[-1].num_nodes}"
            )
        out.append(tree)
    return tuple(out)


def _json_copy(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy through JSON (tuples become lists) within the size and nesting limits."""
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"metadata must be JSON-serialisable (no NaN/inf, no objects, no deep nesting): {e}") from None
    size = len(text.encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata takes {size} bytes as JSON, above the limit of {MAX_METADATA_BYTES}")
    if nesting_depth(text, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata nests deeper than the limit of {MAX_METADATA_DEPTH} levels")
    return json.loads(text)


def check_metadata(metadata: Mapping[str, Any] | None, task: str, trees: tuple[Tree, ...]) -> dict[str, Any]:
    """Normalise metadata through JSON and check the schema."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    meta = _json_copy(metadata)
    expected = {"format_version": FORMAT_VERSION, "task": task, "num_trees": len(trees)}
    for key, value in expected.items():  # reserved keys are written by the bank itself
        if key in meta and meta.pop(key) != value:
            raise ValueError(f"metadata[{key!r}] is set by the bank and must be {value!r} (or left out)")
    for key in TEXT_KEYS:
        if key in meta and not isinstance(meta[key], str):
            raise ValueError(f"metadata[{key!r}] must be a string, got {brief_repr(meta[key])}")
    for key in ("scheduler", "calibration"):
        if key in meta and not isinstance(meta[key], dict):
            raise ValueError(f"metadata[{key!r}] must be a dict, got {type(meta[key]).__name__}")
    per_tree = meta.get("trees")
    if per_tree is not None:
        if not isinstance(per_tree, list) or len(per_tree) != len(trees):
            raise ValueError(f"metadata['trees'] must be a list of {len(trees)} dicts, one per tree")
        for k, (info, tree) in enumerate(zip(per_tree, trees)):
            if not isinstance(info, dict):
                raise ValueError(f"metadata['trees'][{k}] must be a dict, got {brief_repr(info)}")
            if "num_nodes" in info and info["num_nodes"] != tree.num_nodes:
                got = brief_repr(info["num_nodes"])
                raise ValueError(f"metadata['trees'][{k}]['num_nodes'] is {got}, tree {k} has {tree.num_nodes}")
            for fig in FIGURES:
                if fig in info:
                    _finite(info[fig], f"metadata['trees'][{k}][{fig!r}]")
    _check_frontier(meta, trees)
    _check_retrieval_figures(meta)
    _check_machines(meta, len(trees))
    return meta


def _check_frontier(meta: dict[str, Any], trees: tuple[Tree, ...]) -> None:
    """``frontier``: which trees form the task's acceptance frontier; each needs its tokens per step."""
    frontier = meta.get("frontier")
    if frontier is None:
        return
    if not isinstance(frontier, dict) or not isinstance(frontier.get("trees"), list) or not frontier["trees"]:
        raise ValueError("metadata['frontier'] must be a dict whose 'trees' lists tree indices")
    per_tree = meta.get("trees") or []
    for i in frontier["trees"]:
        k = _index(i, "metadata['frontier'] tree")
        if not 0 <= k < len(trees):
            raise ValueError(f"metadata['frontier'] names tree {k}, but the bank has {len(trees)} trees")
        if k >= len(per_tree) or "mean_accept_length" not in per_tree[k]:
            raise ValueError(f"frontier tree {k} has no metadata['trees'][{k}]['mean_accept_length']")


def _check_retrieval_figures(meta: dict[str, Any]) -> None:
    """``frontier['retrieval']``: the retrieval settings (label -> :class:`RetrievalConfig` fields)
    the frontier was replayed with; a tree's ``retrieval`` maps some of those labels to its
    :class:`~entmtp_hf.costs.retrieval.RetrievalFigures`."""
    raw = (meta.get("frontier") or {}).get("retrieval")
    if raw is not None and (not isinstance(raw, dict) or len(raw) > MAX_RETRIEVAL_OPTIONS):
        raise ValueError(
            f"metadata['frontier']['retrieval'] must map at most {MAX_RETRIEVAL_OPTIONS} labels "
            f"to retrieval settings, got {brief_repr(raw)}"
        )
    options = {}
    for label, config in (raw or {}).items():
        try:
            options[label] = RetrievalConfig.from_dict(config)
        except ValueError as e:
            raise ValueError(f"metadata['frontier']['retrieval'][{brief_repr(label)}]: {e}") from None
    for k, info in enumerate(meta.get("trees") or []):
        figures = info.get("retrieval")
        if figures is None:
            continue
        if not isinstance(figures, dict) or set(figures) - set(options):
            raise ValueError(
                f"metadata['trees'][{k}]['retrieval'] must map labels of metadata['frontier']"
                f"['retrieval'] ({sorted(options)}) to figures, got {brief_repr(figures)}"
            )
        for label, f in figures.items():
            try:
                RetrievalFigures.from_dict(f, options[label].num_tokens)
            except ValueError as e:
                raise ValueError(f"metadata['trees'][{k}]['retrieval'][{label!r}]: {e}") from None


def _check_machines(meta: dict[str, Any], num_trees: int) -> None:
    """``machines``: per machine, the cost table measured there and the scheduler it chose."""
    machines = meta.get("machines")
    if machines is None:
        return
    if not isinstance(machines, list) or len(machines) > MAX_MACHINES:
        raise ValueError(f"metadata['machines'] must be a list of at most {MAX_MACHINES} entries")
    for m, entry in enumerate(machines):
        if not isinstance(entry, dict) or set(entry) - {"costs", "scheduler", "speedups"}:
            raise ValueError(f"metadata['machines'][{m}] must be a dict of 'costs', 'scheduler' and 'speedups'")
        try:
            CostTable.from_dict(entry.get("costs"))
            SchedulerDefaults.from_metadata(entry.get("scheduler"), num_trees)
            _check_speedups(entry.get("speedups", {}), num_trees)
        except (ValueError, FileFormatError) as e:
            raise ValueError(f"metadata['machines'][{m}]: {e}") from None


def _check_speedups(speedups: object, num_trees: int) -> None:
    """A machine's modelled speed-ups: tree index (as a string, JSON keys) -> a finite number."""
    if not isinstance(speedups, dict):
        raise ValueError(f"'speedups' must map tree indices to speed-ups, got {brief_repr(speedups)}")
    for key, value in speedups.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < num_trees):
            raise ValueError(f"'speedups' names tree {brief_repr(key)}, but the bank has {num_trees} trees")
        _finite(value, f"'speedups'[{key!r}]")


@dataclass(frozen=True, eq=False)
class BankContents:
    """A validated bank: what :class:`~entmtp_hf.banks.bank.TopologyBank` wraps and the model card reads."""

    task: str
    trees: tuple[Tree, ...]
    metadata: dict[str, Any]  # the user metadata (without format_version / task / num_trees)
    scheduler: SchedulerDefaults

    @classmethod
    def validated(
        cls, task: str, trees: Sequence[Tree | Sequence[Sequence[int]]], metadata: Mapping[str, Any] | None
    ) -> "BankContents":
        """Every check of the format; raises ``ValueError`` naming the problem."""
        task = check_task_name(task)
        checked = check_trees(trees)
        meta = check_metadata(metadata, task, checked)
        try:
            scheduler = SchedulerDefaults.from_metadata(meta.get("scheduler"), len(checked))
        except ValueError as e:
            raise ValueError(f"metadata['scheduler']: {e}") from None
        return cls(task, checked, meta, scheduler)


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
        tree = Tree.from_choices(paths)
    except ValueError as e:
        raise ValueError(f"tensor {name} is not a valid tree: {e}") from None
    if tensor.shape[1] != tree.depth:  # columns of padding only
        raise ValueError(f"tensor {name} has {tensor.shape[1]} columns but its tree has depth {tree.depth}")
    return tree


# ------------------------------------------------------------------ task names in folders
def tasks_from_names(names: Sequence[str]) -> list[str]:
    """Task names from top-level file names, ignoring anything that is not a bank file."""
    stems = (n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX) and "/" not in n)
    return sorted(s for s in stems if TASK_NAME_RE.fullmatch(s))


def list_local_tasks(folder: Path) -> list[str]:
    return tasks_from_names([p.name for p in folder.iterdir() if p.is_file()])


# ------------------------------------------------------------------ reading one file
def _bank_metadata(header: Mapping[str, str] | None, path: Path) -> dict[str, Any]:
    """The parsed ``entmtp_bank`` JSON, bounded before parsing."""
    header = header or {}
    if METADATA_KEY not in header:
        raise ValueError(f"no {METADATA_KEY!r} header metadata; not a bank written by TopologyBank.save_pretrained")
    what = f"{METADATA_KEY!r} header metadata"
    meta = parse_json(header[METADATA_KEY], path, max_bytes=MAX_METADATA_BYTES, max_depth=MAX_METADATA_DEPTH, what=what)
    if not isinstance(meta, dict):
        raise ValueError(f"{what} must be a JSON object")
    return meta


def _tree_names(meta: Mapping[str, Any], path: Path, present: set[str]) -> list[str]:
    """Check the reserved metadata keys; the tensor names ``num_trees`` promises, all present."""
    version = meta.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ValueError(
            f"format_version {brief_repr(version)} is not supported (this entmtp-hf reads {FORMAT_VERSION})"
        )
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.stem
    if meta.get("task") != stem:
        raise ValueError(f"metadata task {brief_repr(meta.get('task'))} does not match the file name {path.name!r}")
    num_trees = integer(meta.get("num_trees"), "num_trees", low=1, high=MAX_TREES, error=FieldError)
    names = [f"tree.{k}" for k in range(num_trees)]
    missing = [n for n in names if n not in present]
    extra = sorted(present - set(names))
    if missing or extra:
        raise ValueError(
            f"num_trees is {num_trees} but tensors [{brief_list(map(brief_repr, missing))}] are missing "
            f"and [{brief_list(map(brief_repr, extra))}] unexpected"
        )
    return names


def _check_tensor_header(name: str, dtype: str, shape: list[int], k: int, total: int) -> int:
    """Dtype and shape of tree ``k`` from the header alone; returns the bank's node count so far."""
    if dtype != "I32":
        raise ValueError(f"tensor {name} has dtype {dtype}; expected I32 (torch.int32)")
    if len(shape) != 2:
        raise ValueError(f"tensor {name} has shape {shape}; expected [num_paths, depth]")
    total += shape[0] + 1
    _check_tree_size(k, shape[0] + 1, shape[1], total)
    return total


def read_bank_contents(path: Path) -> BankContents:
    """Read and validate one bank file, raising ``ValueError`` for any problem."""
    if not path.is_file():
        raise ValueError("file not found")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"file is {path.stat().st_size} bytes, above the {MAX_FILE_BYTES}-byte limit for banks")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _bank_metadata(f.metadata(), path)
            names = _tree_names(meta, path, set(f.keys()))
            total = 0
            for k, name in enumerate(names):  # every size is checked before the first tensor is read
                part = f.get_slice(name)
                total = _check_tensor_header(name, part.get_dtype(), part.get_shape(), k, total)
            tensors = [f.get_tensor(name) for name in names]
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"not a readable safetensors file ({e})") from None
    trees = [decode_tree(t, n) for t, n in zip(tensors, names)]
    user = {k: v for k, v in meta.items() if k not in _RESERVED}
    return BankContents.validated(meta["task"], trees, user)


def load_bank_contents(path: str | os.PathLike[str]) -> BankContents:
    """:func:`read_bank_contents`, every problem a :class:`BankFormatError` naming the file."""
    path = Path(path)
    try:
        return read_bank_contents(path)
    except FileFormatError as e:
        raise BankFormatError(e.path, e.problem) from e
    except ValueError as e:
        raise BankFormatError(path, str(e)) from e
