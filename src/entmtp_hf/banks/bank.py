"""Topology banks: one task's precompiled draft trees plus the figures that chose them.

A :class:`TopologyBank` holds K trees, smallest first, and metadata (who measured them,
on which model, heads and hardware, their accept lengths and speeds, and the scheduler's
defaults). Banks live in Hub-style folders, one file per task, so one Hub repo can hold
the banks of many tasks and a user downloads only the task they run.

The file format, its limits and the reader are in :mod:`.bank_format`; ``{folder}/README.md``
is a model card (:mod:`.bank_card`) regenerated on every save, one table per task. Reading
validates everything and turns every problem into one :class:`BankFormatError` naming the
file; no pickle is ever involved. See ``docs/banks.md``.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import save as safetensors_bytes

from ..costs.ranking import Ranking, priced, rank, scheduler_for
from ..costs.retrieval import RetrievalFigures
from ..costs.table import CostTable
from ..errors import EntMTPError
from ..hub import missing_revision
from ..trees.retrieval import RetrievalConfig
from ..trees.tree import MC_SIM_7B_63, Tree
from .card import CARD_NAME, model_card
from .format import (
    FORMAT_VERSION,
    MAX_BANK_NODES,
    MAX_FILE_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    MAX_TREES,
    METADATA_KEY,
    SUFFIX,
    TASK_NAME_RE,
    BankContents,
    BankFormatError,
    SchedulerDefaults,
    check_task_name,
    decode_tree,
    default_thresholds,
    encode_tree,
    list_local_tasks,
    load_bank_contents,
    tasks_from_names,
)

#: the banks shipped with the package (package data: present in wheels and checkouts alike)
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"

__all__ = [
    "CARD_NAME",
    "FORMAT_VERSION",
    "MAX_BANK_NODES",
    "MAX_FILE_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "MAX_TREE_DEPTH",
    "MAX_TREE_NODES",
    "MAX_TREES",
    "METADATA_KEY",
    "SHIPPED_DIR",
    "SUFFIX",
    "BankFormatError",
    "SchedulerDefaults",
    "TopologyBank",
    "check_task_name",
    "decode_tree",
    "default_thresholds",
    "encode_tree",
    "list_local_tasks",
    "load_bank_file",
    "model_card",
    "published_defaults_bank",
    "shipped_bank_path",
]


def load_bank_file(path: str | os.PathLike[str]) -> "TopologyBank":
    """Read and validate one bank file; every problem is a :class:`BankFormatError`."""
    return TopologyBank._wrap(load_bank_contents(path))


# ------------------------------------------------------------------ the bank
class TopologyBank:
    """One task's trees (smallest first) with metadata and scheduler defaults."""

    def __init__(
        self,
        task: str,
        trees: Sequence[Tree | Sequence[Sequence[int]]],
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._set(BankContents.validated(task, trees, metadata))

    def _set(self, contents: BankContents) -> None:
        self._task, self._trees = contents.task, contents.trees
        self._metadata, self._scheduler = contents.metadata, contents.scheduler

    @classmethod
    def _wrap(cls, contents: BankContents) -> "TopologyBank":
        """A bank around contents that were validated already (by the reader)."""
        bank = cls.__new__(cls)
        bank._set(contents)
        return bank

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

    # -------------------------------------------------------------- machines
    @property
    def frontier(self) -> dict[int, float]:
        """Tree index -> tokens per step (debiased) of the task's acceptance frontier; empty for
        a bank that carries none (such a bank keeps its stored scheduler on every machine)."""
        indices = (self._metadata.get("frontier") or {}).get("trees", [])
        per_tree = self._metadata.get("trees") or []
        return {k: float(per_tree[k]["mean_accept_length"]) for k in indices}

    @property
    def retrieval_figures(self) -> tuple[dict[str, RetrievalConfig], dict[int, dict[str, RetrievalFigures]]]:
        """The retrieval settings the frontier was replayed with (label -> config) and, per frontier
        tree, its figures under each (machine-independent, like the tokens per step); empty for a
        bank without them (its stored retrieval default then holds on every machine)."""
        listed = (self._metadata.get("frontier") or {}).get("retrieval") or {}
        options = {label: RetrievalConfig(**fields) for label, fields in listed.items()}
        per_tree = self._metadata.get("trees") or []
        figures = {
            k: {
                label: RetrievalFigures.from_dict(f, options[label].num_tokens)
                for label, f in per_tree[k]["retrieval"].items()
            }
            for k in self.frontier
            if options and "retrieval" in per_tree[k]
        }
        return options, figures

    @property
    def machines(self) -> list[dict[str, Any]]:
        """The machines this bank was ranked on: their cost tables and schedulers (copies)."""
        return copy.deepcopy(self._metadata.get("machines", []))

    def machine_tables(self) -> list[CostTable]:
        """The cost tables of the machines this bank carries entries for."""
        return [CostTable.from_dict(entry["costs"]) for entry in self._metadata.get("machines", [])]

    def scheduler_for(self, table: CostTable | None) -> SchedulerDefaults:
        """The scheduler for the machine ``table`` was measured on: its stored entry if the bank
        has one, else the frontier re-ranked by ``table``; the stored defaults without a
        frontier or a table."""
        if table is None or not self.frontier:
            return self._scheduler
        for entry, known in zip(self._metadata.get("machines", []), self.machine_tables()):
            if known.key == table.key:
                return SchedulerDefaults.from_metadata(entry["scheduler"], len(self._trees))
        return self._ranked(table)[0]

    def ranking(self, table: CostTable) -> Ranking:
        """The frontier ranked on ``table``'s machine (with its retrieval figures, if any)."""
        options, figures = self.retrieval_figures
        return rank(self._trees, self.frontier, table, self._scheduler.value, retrieval=figures, options=options)

    def _ranked(self, table: CostTable) -> tuple[SchedulerDefaults, Ranking]:
        ranking = self.ranking(table)
        root = next((k for k, t in enumerate(self._trees) if t.num_nodes == 1), None)
        return scheduler_for(self._scheduler, ranking, root), ranking

    def with_frontier(
        self,
        trees: Sequence[Tree],
        accept: Sequence[float],
        info: Sequence[Mapping[str, Any]] = (),
        source: Mapping[str, Any] | None = None,
    ) -> "TopologyBank":
        """A copy of this bank that carries the task's acceptance frontier ``trees`` with their
        tokens per step ``accept`` (debiased), merged with the bank's own trees: a tree the bank
        has keeps its figures and gets the frontier's; every index (scheduler, machines) follows
        the merge. ``info``: more figures per frontier tree; ``source``: how they were measured.
        Stored machine entries are dropped: they ranked the old trees."""
        if len(accept) != len(trees) or (info and len(info) != len(trees)):
            raise ValueError("give one accept length (and one info dict, if any) per frontier tree")
        per_tree = [dict(d) for d in self._metadata.get("trees") or [{} for _ in self._trees]]
        merged = list(zip(self._trees, per_tree, range(len(self._trees))))  # (tree, info, old index)
        index = {t: k for k, t in enumerate(self._trees)}
        frontier = []
        for tree, tau, extra in zip(trees, accept, info or [{}] * len(trees)):
            figures = {"num_nodes": tree.num_nodes, "mean_accept_length": float(tau), **extra}
            if tree in index:
                old = merged[index[tree]][1]
                if "tokens_per_s" in old and "mean_accept_length" in old:  # timed by the search: kept beside
                    old.setdefault("measured_accept_length", old["mean_accept_length"])
                else:  # an estimate (an earlier frontier's or the search's): the new frontier replaces it
                    old.pop("measured_accept_length", None)
                old.update(figures)
            else:
                index[tree] = len(merged)
                merged.append((tree, {"name": f"frontier-{tree.num_nodes}", **figures}, None))
            frontier.append(tree)
        merged.sort(key=lambda row: row[0].num_nodes)  # stable: equal sizes keep their order
        new = {old: k for k, (_, _, old) in enumerate(merged) if old is not None}
        meta = {k: v for k, v in self._metadata.items() if k != "machines"}
        meta["trees"] = [i for _, i, _ in merged]
        meta["scheduler"] = _remapped(self._scheduler.to_dict(), new)
        position = {t: k for k, (t, _, _) in enumerate(merged)}
        meta["frontier"] = {**(source or {}), "trees": [position[t] for t in frontier]}
        return TopologyBank(self._task, [t for t, _, _ in merged], meta)

    def with_machine(self, table: CostTable, scheduler: SchedulerDefaults | None = None) -> "TopologyBank":
        """A copy of this bank that also carries ``table``'s machine: its costs and the scheduler
        they rank, or ``scheduler`` when one was chosen there by timing (the search's accurate
        path). It replaces the entry for the same machine at the same batch size, whatever model key
        that one was filed under: the key changes with the heads and with the decode step's
        implementation, so an older key is a measurement no ``generate`` of this bank reads again."""
        if not self.frontier:
            raise EntMTPError(f"the bank for task {self._task!r} carries no acceptance frontier to re-rank")
        ranked, ranking = self._ranked(table)
        speedups = dict(ranking.speedups)
        k = scheduler.static if scheduler is not None else None
        if k in speedups and k in ranking.retrieval and ranking.retrieval[k] != scheduler.retrieval:
            # a timed choice ran its tree with another retrieval setting than the one it was ranked with
            options, figures = self.retrieval_figures
            price = priced(self._trees[k], self.frontier[k], table, scheduler.retrieval, figures.get(k, {}), options)
            if price is None:
                del speedups[k]
            else:
                speedups[k] = price
        scheduler = scheduler or ranked
        entry = {
            "costs": table.to_dict(),
            "scheduler": scheduler.to_dict(),
            "speedups": {str(k): round(v, 4) for k, v in speedups.items()},
        }
        machine = (table.fingerprint.get("key", ""), table.batch_size)
        others = [
            m
            for m, known in zip(self._metadata.get("machines", []), self.machine_tables())
            if (known.fingerprint.get("key", ""), known.batch_size) != machine
        ]
        return TopologyBank(self._task, self._trees, {**self._metadata, "machines": [*others, entry]})

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
        except RevisionNotFoundError as e:
            raise EntMTPError(f"Hub repo {repo_id!r} has no revision {revision!r} (a branch, tag or commit)") from e
        except (RemoteEntryNotFoundError, LocalEntryNotFoundError) as e:
            offline = isinstance(e, LocalEntryNotFoundError)  # offline, or the Hub unreachable, and not cached
            problem = missing_revision(
                repo_id, revision, cache_dir=hub_kwargs.get("cache_dir"), token=hub_kwargs.get("token"), offline=offline
            )
            if problem is not None:
                raise EntMTPError(problem) from e
            tasks = _tasks_or_unknown(repo_id, revision, hub_kwargs, cached_only=offline)
            where = f"Hub repo {repo_id!r} ({revision or 'main'})"
            if not offline:
                raise EntMTPError(f"{where} has no task {task!r}; tasks there: {tasks}") from e
            raise EntMTPError(
                f"{where} has no task {task!r} in the local cache and the Hub is offline or unreachable; cached "
                f"tasks: {tasks}; there is no local folder {repo_id!r} either"
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
            snap = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                allow_patterns=[f"*{SUFFIX}"],
                local_files_only=True,
            )
            names = [p.name for p in Path(snap).iterdir()]
        else:
            names = HfApi(token=token).list_repo_files(repo_id, revision=revision)
        return tasks_from_names(names)

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
            for name in tasks_from_names(remote):
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


def _remapped(scheduler: dict[str, Any], new: dict[int, int]) -> dict[str, Any]:
    """Scheduler defaults with every tree index moved to its new place (``new``: old -> new)."""
    out = dict(scheduler)
    for key in ("static", "conservative", "aggressive"):
        out[key] = new[out[key]]
    for key in ("ladder", "value"):
        out[key] = [new[k] for k in out[key]]
    return out


def _tasks_or_unknown(
    repo_id: str, revision: str | None, hub_kwargs: Mapping[str, Any], cached_only: bool
) -> list[str] | str:
    """Best-effort task list for an error message that is already being raised."""
    try:
        return TopologyBank.list_tasks(
            repo_id,
            revision,
            token=hub_kwargs.get("token"),
            cache_dir=hub_kwargs.get("cache_dir"),
            local_files_only=cached_only,
        )
    except Exception as e:  # noqa: BLE001 - cosmetic; the original error is chained
        return f"unknown ({type(e).__name__})"


# ------------------------------------------------------------------ shipped banks
def published_defaults_bank() -> TopologyBank:
    """The bank shipped in ``banks/shipped/published-defaults``: the published systems' trees
    (rewritten with ``published_defaults_bank().save_pretrained(shipped_bank_path("published-defaults"))``)."""
    source = "Medusa (Cai et al., 2024) and Hydra (Ankner et al., 2024) default tree `mc_sim_7b_63`"
    return TopologyBank(
        "default",
        [Tree.root_only(), Tree.chain(4), Tree.from_choices(MC_SIM_7B_63)],
        metadata={
            "created_by": "entmtp_hf.banks.bank.published_defaults_bank",
            "heads": "any Medusa or Hydra heads",
            "hardware": "any (not measured)",
            "description": "Published default trees, uncalibrated; thresholds come from the paper's τ grid.",
            "trees": [
                {"num_nodes": 1, "name": "root-only", "source": "no drafting (plain decoding)"},
                {"num_nodes": 5, "name": "chain-4", "source": "top-1 chain of depth 4"},
                {"num_nodes": 64, "name": "mc_sim_7b_63", "source": source},
            ],
            "scheduler": {
                "static": 2,
                "conservative": 1,
                "aggressive": 2,
                "tau_on": 0.01,
                "tau_off": 0.01,
                "ladder": [0, 1, 2],
                "thresholds": [0.005, 0.02],
            },
        },
    )


def shipped_bank_path(name: str) -> Path:
    """Folder of a bank shipped with the package (``entmtp_hf/banks/shipped/<name>``)."""
    path = SHIPPED_DIR / name
    if not TASK_NAME_RE.fullmatch(name) or not path.is_dir():
        shipped = sorted(p.name for p in SHIPPED_DIR.iterdir()) if SHIPPED_DIR.is_dir() else []
        raise ValueError(f"no shipped bank {name!r} in {SHIPPED_DIR} (found: {shipped}); load it from the Hub instead")
    return path
