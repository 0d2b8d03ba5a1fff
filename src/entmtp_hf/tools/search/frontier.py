"""Algorithm 1, the greedy acceptance frontier, and its rank-tuple scorer.

From the root-only tree add the frontier node ν (next-rank sibling or first child, depth <= D,
rank < V') with the largest mean accept length; ties go to the smaller rank sum, then the
shallower node. With rank tuples the gain of ν is the number of step starts whose tuple starts
with ν's path, so every candidate is scored by one dictionary lookup
(:func:`rank_tuple_scorer`); :mod:`.rollout` scores them by self-rollouts instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tqdm.auto import tqdm

from ...trees.tree import Path, Tree
from .trajectories import Trajectory, prefix_counts

#: ``score(T, candidates)`` -> (mean accept length of T, of every T ∪ {ν})
ScoreFn = Callable[[Tree, list[Path]], tuple[float, list[float]]]


@dataclass(frozen=True)
class FrontierPoint:
    """One tree of the greedy acceptance frontier and its (biased) mean accept length."""

    tree: Tree
    accept: float
    added: Path | None  # the node added to the previous frontier tree (None for the root)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes


def frontier_nodes(tree: Tree, max_depth: int, max_rank: int) -> list[Path]:
    """F(T): the first child of every node and the next-rank sibling of every non-root node."""
    have = set(tree.paths)
    found: list[Path] = []
    for p in ((), *tree.paths):
        options = [p + (0,)] if len(p) < max_depth else []
        if p and p[-1] + 1 < max_rank:
            options.append(p[:-1] + (p[-1] + 1,))
        found += [q for q in options if q not in have and q not in found]
    return found


def _preference(path: Path) -> tuple:
    """Tie-break among equal scores: smaller rank sum, then shallower, then lexicographic."""
    return (sum(path), len(path), path)


def greedy_frontier(
    score: ScoreFn,
    budget: int,
    max_depth: int,
    max_rank: int,
    start: Sequence[FrontierPoint] = (),
    on_step: Callable[[list[FrontierPoint]], None] | None = None,
    progress: bool = False,
) -> list[FrontierPoint]:
    """Algorithm 1: grow the tree one node at a time until it has ``budget`` nodes.

    ``score(T, candidates)`` returns the mean accept length of T and of every T ∪ {ν}.
    ``start`` resumes an interrupted run; ``on_step`` sees the frontier after every step.
    """
    points = list(start)
    if not points:
        base, _ = score(Tree.root_only(), [])
        points.append(FrontierPoint(Tree.root_only(), base, None))
    bar = tqdm(total=budget, initial=points[-1].num_nodes, desc="frontier", unit="node", disable=not progress)
    while points[-1].num_nodes < budget:
        tree = points[-1].tree
        candidates = frontier_nodes(tree, max_depth, max_rank)
        if not candidates:
            break
        _, scores = score(tree, candidates)
        best = min(range(len(candidates)), key=lambda k: (-scores[k], _preference(candidates[k])))
        node = candidates[best]
        points.append(FrontierPoint(Tree.from_choices([*tree.choices, list(node)]), scores[best], node))
        bar.update(1)
        if on_step is not None:
            on_step(points)
    bar.close()
    return points


def rank_tuple_scorer(trajectories: Sequence[Trajectory]) -> ScoreFn:
    """Score candidates by prefix counts: adding ν raises the accept length exactly at the
    starts whose tuple begins with ν's path (its parent is in T, so they already reach it)."""
    counts, total = prefix_counts(trajectories)
    total = max(total, 1)

    def score(tree: Tree, candidates: list[Path]) -> tuple[float, list[float]]:
        base = 1.0 + sum(counts.get(p, 0) for p in tree.paths) / total
        return base, [base + counts.get(c, 0) / total for c in candidates]

    return score
