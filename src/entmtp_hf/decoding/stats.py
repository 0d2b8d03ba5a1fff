"""Observers of the decode loop: the statistics every call returns, and an optional phase timer.

The loop tells its observers when it starts, when the prefill is done, what every step did
(a :class:`StepRecord`, a :class:`RowStep` per row) and when it ends; it never measures
anything itself beyond the prefill and total wall time. :class:`DecodeStats` turns the records
into the ``entmtp_stats`` of ``return_dict_in_generate`` (as data, per row; rates are the
caller's business).
:class:`PhaseTimer`, passed as ``generate(..., entmtp_observers=[timer])``, times the four
phases of every step (draft, verify, accept, commit) by wrapping the session's phase methods
for that call only: profiling code, kept out of the step itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..scheduling.eas import EASStats

if TYPE_CHECKING:
    from ..drafting.drafter import Draft

PHASES = ("draft", "verify", "accept", "commit")


@dataclass(frozen=True)
class RowStep:
    """What one decode step did for one row of the call."""

    row: int  # the row's index in the caller's batch
    draft: "Draft"
    path: list[int]  # accepted nodes, root first
    emitted: int  # tokens this step added to the row's text (fewer than len(path) if a stop fired)


@dataclass(frozen=True)
class StepRecord:
    """What one decode step did: a :class:`RowStep` per row that decoded in it."""

    rows: tuple[RowStep, ...]
    forward_rows: int  # rows in the verification forward (a static cache keeps stopped rows there)


class DecodeObserver(Protocol):
    """What the loop calls; every method is optional in spirit (implement them as no-ops)."""

    def on_start(self, session: Any) -> None: ...
    def on_prefill(self, seconds: float) -> None: ...
    def on_step(self, record: StepRecord) -> None: ...
    def on_end(self, seconds: float) -> None: ...


@dataclass
class RowStats:
    """One row's statistics, as data."""

    accept_lengths: list[int] = field(default_factory=list)  # tokens each step added
    tree_indices: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    features: list[float | None] = field(default_factory=list)
    retrieval_steps: int = 0  # steps whose tree carried a retrieval branch
    retrieval_accepted: int = 0  # drafted tokens accepted from retrieval branches
    root_alone_steps: int = 0  # steps the break-even guard verified the root alone (the trees were losing)
    eas: EASStats | None = None  # EAS statistics (policy ``entropy`` only)

    def add(self, step: RowStep) -> None:
        draft, path = step.draft, step.path
        self.accept_lengths.append(step.emitted)
        self.tree_indices.append(draft.tree_index)
        self.tree_sizes.append(draft.buffers.num_nodes)
        self.features.append(draft.feature)
        self.root_alone_steps += draft.guarded
        if draft.branch_node is not None:
            self.retrieval_steps += 1
            if len(path) > 1 and path[1] == draft.branch_node:
                self.retrieval_accepted += len(path) - 1

    @classmethod
    def merged(cls, rows: list["RowStats"]) -> "RowStats":
        """The figures of every row's steps together (rows one after the other); one row's own."""
        if len(rows) == 1:
            return rows[0]
        out = cls()
        for f in fields(cls):
            values = [getattr(r, f.name) for r in rows]
            if f.name == "eas":
                out.eas = _merged_eas([v for v in values if v is not None])
            elif isinstance(values[0], list):
                setattr(out, f.name, [x for v in values for x in v])
            else:
                setattr(out, f.name, sum(values))
        return out

    def as_dict(self) -> dict:
        steps = len(self.accept_lengths)
        d = {k: v for k, v in self.__dict__.items() if k != "eas"}
        if self.eas is not None:
            d["eas"] = self.eas.as_dict()
        d["steps"] = steps
        d["new_tokens"] = sum(self.accept_lengths) + 1  # the prefill emits the first token
        d["mean_accept_length"] = sum(self.accept_lengths) / steps if steps else 0.0
        d["drafted_tokens"] = sum(n - 1 for n in self.tree_sizes)
        d["accepted_draft_tokens"] = sum(a - 1 for a in self.accept_lengths)
        return d


def _merged_eas(stats: list[EASStats]) -> EASStats | None:
    """Several rows' EAS statistics as one: every chain, the halts and tokens summed."""
    if len(stats) < 2:
        return stats[0] if stats else None
    return EASStats(
        chain_lengths=[n for s in stats for n in s.chain_lengths],
        halts={cause: sum(s.halts[cause] for s in stats) for cause in stats[0].halts},
        thresholds=[t for s in stats for t in s.thresholds],
        verified_draft_tokens=sum(s.verified_draft_tokens for s in stats),
        accepted_draft_tokens=sum(s.accepted_draft_tokens for s in stats),
    )


@dataclass
class DecodeStats:
    """Per-call statistics (``entmtp_stats``), returned as data: one :class:`RowStats` per row and,
    at the top level, the call's: every row's steps together (:meth:`RowStats.merged`: one prompt's
    are its row's), the call's steps, the live batch size of each, the times."""

    rows: list[RowStats] = field(default_factory=list)
    forward_rows: list[int] = field(default_factory=list)  # rows in each step's verification forward
    prefill_time: float = 0.0
    total_time: float = 0.0
    compile_seconds: dict[int, float] | None = None  # compiled verification: seconds per tree size compiled

    def on_start(self, session: Any) -> None:
        self._session = session
        self.rows = [RowStats() for _ in session.rows]

    def on_prefill(self, seconds: float) -> None:
        self.prefill_time = seconds

    def on_step(self, record: StepRecord) -> None:
        self.forward_rows.append(record.forward_rows)
        for step in record.rows:
            self.rows[step.row].add(step)

    def on_end(self, seconds: float) -> None:
        self.total_time = seconds
        for stats, row in zip(self.rows, self._session.rows):
            eas = row.drafting.eas
            stats.eas = eas.stats if eas is not None else None

    def as_dict(self) -> dict:
        rows = [r.as_dict() for r in self.rows]
        d = RowStats.merged(self.rows).as_dict()
        d.update(
            rows=rows,
            steps=len(self.forward_rows),
            live_batch_sizes=list(self.forward_rows),
            prefill_time=self.prefill_time,
            total_time=self.total_time,
            new_tokens=sum(r["new_tokens"] for r in rows),
        )
        if self.compile_seconds is not None:
            d["compile_seconds"] = self.compile_seconds
        return d


class PhaseTimer:
    """Seconds spent in each step phase (:data:`PHASES`) over one or more generate calls.

    On CUDA every phase ends with a synchronisation, so kernels are charged to the phase that
    queued them (which slows decoding a little: use it to profile, not to benchmark).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def on_start(self, session: Any) -> None:
        device = session.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        for phase in PHASES:
            setattr(session, phase, self._timed(phase, getattr(session, phase), sync))

    def _timed(self, phase: str, run, sync):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            sync()
            self.seconds[phase] += time.perf_counter() - t0
            return out

        return timed

    def on_prefill(self, seconds: float) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        self.steps += 1

    def on_end(self, seconds: float) -> None:
        pass
