"""Re-ranking a bank's acceptance frontier by one machine's step costs.

The acceptance side of a bank (each frontier tree's debiased tokens per step on the task) does
not depend on the machine; the cost side does. Given a :class:`~entmtp_hf.costs.table.CostTable`,
every frontier tree gets a modelled speed-up ``τ(T)·P / step(T)``, and:

* EntMTP* (``static``) is the tree with the largest one, or the root alone (plain decoding,
  which ``generate`` then runs as plain ``generate``) unless some tree beats plain decoding by
  :data:`MARGIN`: a model error must not make decoding slower; in a batch, trees within
  :data:`BATCH_TIE` of the largest are a tie that goes to the fewest nodes;
* the hysteresis pair is the fastest tree below and the fastest above EntMTP* (its thresholds
  and feature stay the bank's: they were calibrated on the task, not the machine);
* the value policy's trees keep their shapes and get this machine's relative costs;
* where the bank carries replayed retrieval figures (:mod:`~entmtp_hf.costs.retrieval`), each
  tree is priced with and without every retrieval setting, and EntMTP*'s best setting (or
  none) becomes the retrieval the bank's scheduler adds on this machine.

Every tree a policy can pick comes from the same table, so none of them is priced by another
machine. Pure functions: the probe measures, the bank stores, this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from ..trees.retrieval import RetrievalConfig
from ..trees.tree import Tree
from .retrieval import RetrievalFigures, retrieval_speedup
from .table import CostTable

#: a tree must beat plain decoding by this factor in the model before it replaces it
MARGIN = 1.05
#: in a batch, trees whose modelled speed-ups lie within this share of the best one's are a tie the
#: table cannot resolve, and the tree with the fewest nodes wins it. Two reasons, both measured on
#: the demo model at four rows: three rounds leave a forward size's median a few percent off (one
#: size's cost over its neighbour's varied 1.05-1.39 round to round), and a batch's step waits for
#: its slowest row, which keeps less of the mean tokens per step the deeper the tree, so the model
#: overrates the larger tree of a near tie (docs/performance.md, "Ties in a batch")
BATCH_TIE = 0.01


@dataclass(frozen=True)
class Ranking:
    """One machine's choice over a bank's trees, and the speed-ups it was made from."""

    static: int | None  # the EntMTP* tree's index; None: plain decoding
    conservative: int | None
    aggressive: int | None
    speedups: dict[int, float]  # modelled speed-up of every rankable tree (index -> speed-up)
    value_costs: tuple[float, ...]
    #: trees priced with retrieval figures -> the retrieval setting their speed-up assumes (None: none)
    retrieval: dict[int, RetrievalConfig | None] = field(default_factory=dict)


def rank(
    trees: Sequence[Tree],
    taus: dict[int, float],
    table: CostTable,
    value: Sequence[int] = (),
    margin: float = MARGIN,
    retrieval: Mapping[int, Mapping[str, RetrievalFigures]] | None = None,
    options: Mapping[str, RetrievalConfig] | None = None,
) -> Ranking:
    """Rank the trees with known tokens per step (``taus``: index -> τ) on ``table``'s machine;
    ``retrieval``: per tree, its replayed figures under each setting of ``options`` (label -> config)."""
    speedups = {k: table.speedup(trees[k], tau) for k, tau in taus.items() if trees[k].num_nodes > 1}
    chosen: dict[int, RetrievalConfig | None] = {}
    for k, per in (retrieval or {}).items():
        if k not in speedups:
            continue
        chosen[k] = None
        for label, figures in per.items():
            s = retrieval_speedup(table, trees[k], options[label], figures)
            if s > speedups[k]:
                speedups[k], chosen[k] = s, options[label]
    best = _best(trees, speedups, BATCH_TIE if table.batch_size > 1 else 0.0)
    if best is None or speedups[best] < margin:
        return Ranking(None, None, None, speedups, _value_costs(trees, value, table), chosen)
    size = trees[best].num_nodes
    below = [k for k in speedups if trees[k].num_nodes < size]
    above = [k for k in speedups if trees[k].num_nodes > size]
    low = max(below, key=speedups.get, default=best)
    high = max(above, key=speedups.get, default=best)
    return Ranking(best, low, high, speedups, _value_costs(trees, value, table), chosen)


def _best(trees: Sequence[Tree], speedups: dict[int, float], tie: float) -> int | None:
    """The fewest-nodes tree among those within ``tie`` of the largest speed-up (then the faster)."""
    if not speedups:
        return None
    top = max(speedups.values())
    near = [k for k, s in speedups.items() if s >= top * (1 - tie)]
    return min(near, key=lambda k: (trees[k].num_nodes, -speedups[k]))


def priced(
    tree: Tree,
    tau: float,
    table: CostTable,
    retrieval: RetrievalConfig | None,
    figures: Mapping[str, RetrievalFigures],
    options: Mapping[str, RetrievalConfig],
) -> float | None:
    """The modelled speed-up of ``tree`` (``tau`` tokens per step) run with ``retrieval`` (None:
    none), or None when its ``figures`` lack that setting."""
    if retrieval is None:
        return table.speedup(tree, tau)
    label = next((k for k, config in options.items() if config == retrieval and k in figures), None)
    return None if label is None else retrieval_speedup(table, tree, retrieval, figures[label])


def _value_costs(trees: Sequence[Tree], value: Sequence[int], table: CostTable) -> tuple[float, ...]:
    return tuple(table.relative(trees[k]) for k in value)


def scheduler_for(defaults, ranking: Ranking, root_only: int | None):
    """The bank's :class:`~entmtp_hf.banks.format.SchedulerDefaults` with this machine's trees.

    Plain decoding (no tree beats it) becomes the static policy on the root-only tree with no
    retrieval, which ``generate`` runs as plain ``generate``. Where EntMTP* was priced with
    retrieval figures, the retrieval setting is the one it was priced with (possibly none).
    """
    if ranking.static is None:
        if root_only is None:
            return defaults
        return replace(
            defaults,
            static=root_only,
            conservative=root_only,
            aggressive=root_only,
            policy="static",
            retrieval=None,
            value_costs=ranking.value_costs,
        )
    low, high = sorted((ranking.conservative, ranking.aggressive))
    retrieval = ranking.retrieval.get(ranking.static, defaults.retrieval)
    return replace(
        defaults,
        static=ranking.static,
        conservative=low,
        aggressive=high,
        retrieval=retrieval,
        value_costs=ranking.value_costs,
    )
