"""Retrieval branches priced on one machine: whether copying earlier text pays here, and how.

Whether a retrieval branch (:mod:`entmtp_hf.trees.retrieval`) speeds decoding up depends on
the task (how often the text's suffix recurs and how often what followed it comes again) and
on the machine (what the extra or replacing rows cost). The task's side is a replay of greedy
decoding with the tree and the setting on the calibration runs (exact under greedy decoding,
no model needed: :func:`~entmtp_hf.tools.search.replay.replay`), summarised per tree and
setting as :class:`RetrievalFigures`; the machine's side is the cost table. The modelled
speed-up is the replay's tokens over the time its steps cost here:

* a step that found no continuation verifies the tree as drafted: ``step(T)``;
* ``replace``: a step that found ``L`` tokens verifies the root and those ``L`` alone, and
  the heads draft nothing: ``F(L + 1) + overhead(L + 1)``;
* ``append``: a step that found ``L`` tokens verifies the tree plus the ``L``-token branch;
* in a batch the rows' nodes are padded to the widest row, so a step's forward is that of the
  widest of ``B`` rows (each row's kind of step drawn independently from the replay's), and
  drafting and the overhead are paid per row.

Pure functions and plain data: the bank stores the figures, the ranking decides with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..errors import FieldError
from ..trees.retrieval import RetrievalConfig, with_branch
from ..trees.tree import Tree
from ..validation import MAX_COUNT, brief_repr, integer
from .table import CostTable

#: the settings a calibrated frontier is replayed with (labels are what banks store)
RETRIEVAL_OPTIONS: dict[str, RetrievalConfig] = {
    **{f"replace-{n}": RetrievalConfig(mode="replace", num_tokens=n) for n in (1, 2, 3)},
    **{f"append-{n}": RetrievalConfig(mode="append", num_tokens=n) for n in (1, 2)},
}


def retrieval_label(config: RetrievalConfig | None) -> str:
    """``replace-2``, ``append-1``, ... (``off`` for none): how reports name a setting."""
    return "off" if config is None else f"{config.mode}-{config.num_tokens}"


@dataclass(frozen=True)
class RetrievalFigures:
    """One tree with one retrieval setting, replayed on a task's calibration runs: the tokens
    the steps added, the steps that found no continuation (``drafted``), and ``found[L - 1]``
    the steps that found an ``L``-token one."""

    tokens: int
    drafted: int
    found: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, value in (("tokens", self.tokens), ("drafted", self.drafted), *(("found", n) for n in self.found)):
            integer(value, f"retrieval figures' {name}", low=0, high=MAX_COUNT, error=FieldError)
        if self.steps == 0 or self.tokens < self.steps:
            raise ValueError(
                f"retrieval figures: {self.tokens} tokens in {self.steps} steps (every step adds one at least)"
            )

    @property
    def steps(self) -> int:
        return self.drafted + sum(self.found)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "found": list(self.found)}

    @classmethod
    def from_dict(cls, raw: object, max_tokens: int) -> "RetrievalFigures":
        """Validated: the keys above, and no continuation longer than the setting's ``max_tokens``."""
        if not isinstance(raw, Mapping) or set(raw) != {"tokens", "drafted", "found"}:
            raise ValueError(
                f"retrieval figures must be a dict of 'tokens', 'drafted' and 'found', got {brief_repr(raw)}"
            )
        found = raw["found"]
        if not isinstance(found, list) or len(found) > max_tokens:
            raise ValueError(
                f"retrieval figures: 'found' must list at most {max_tokens} counts, got {brief_repr(found)}"
            )
        return cls(raw["tokens"], raw["drafted"], tuple(found))


def _step_kinds(
    table: CostTable, tree: Tree, config: RetrievalConfig, figures: RetrievalFigures
) -> list[tuple[float, int, float]]:
    """(share of steps, nodes verified, drafting + overhead ms of the row) of each kind of step."""
    kinds = [(figures.drafted, tree, True)]
    for length, n in enumerate(figures.found, 1):
        if config.mode == "replace":
            kinds.append((n, Tree.chain(length), False))
        else:
            kinds.append((n, with_branch(tree, length)[0], True))
    steps = figures.steps
    return [
        (n / steps, t.num_nodes, (table.drafting(t) if drafted else 0.0) + table.overhead(t.num_nodes))
        for n, t, drafted in kinds
        if n
    ]


def retrieval_speedup(table: CostTable, tree: Tree, config: RetrievalConfig, figures: RetrievalFigures) -> float:
    """Modelled speed-up over plain ``generate`` of ``tree`` with retrieval ``config`` (its replayed ``figures``).

    At batch size ``B`` one forward verifies every row's nodes padded to the widest row, so a
    step's forward costs ``F`` of the widest of ``B`` rows, each drawn from the replay's step
    kinds independently (at ``B = 1``: the row's own); drafting and the overhead are per row."""
    kinds, b = _step_kinds(table, tree, config, figures), table.batch_size
    forward, below = 0.0, 0.0
    for width in sorted({w for _, w, _ in kinds}):
        at_most = sum(share for share, w, _ in kinds if w <= width)
        forward += table.forward(width) * (at_most**b - below**b)
        below = at_most
    per_row = sum(share * ms for share, _, ms in kinds)
    return (figures.tokens / figures.steps) * table.plain_ms / (forward + b * per_row)
