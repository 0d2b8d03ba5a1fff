"""Choosing trees from the timed frontier: EntMTP*, T- and T+, the hull, the Pareto set,
and the tree sets the value policy is offered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...costs.table import interpolate
from ...trees.tree import Tree

#: the widest fan the value policy is offered (drafted nodes + root): small trees are where two
#: shapes cost the same forward and the per-step choice between them is free
VALUE_MAX_NODES = 4


def upper_hull(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the upper convex hull of (x, y) points, left to right (Andrew's monotone chain)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    hull: list[int] = []
    for i in order:
        if hull and points[hull[-1]][0] == points[i][0]:
            continue  # same x: the higher point came first
        while len(hull) >= 2:
            (x1, y1), (x2, y2), (x3, y3) = points[hull[-2]], points[hull[-1]], points[i]
            if (x2 - x1) * (y3 - y1) - (y2 - y1) * (x3 - x1) >= 0:  # middle point on or below the chord
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both fewer-or-equal x and higher y."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


@dataclass(frozen=True)
class Choice:
    """Indices (into the timed trees) of EntMTP*, T- and T+, plus the hull and Pareto set."""

    static: int
    conservative: int
    aggressive: int
    hull: list[int]
    pareto: list[int]

    @property
    def ladder(self) -> list[int]:
        """T-, EntMTP* and T+ without repeats, smallest first (timed trees are ordered by size)."""
        return sorted({self.conservative, self.static, self.aggressive})


def choose_trees(nodes: Sequence[int], tokens_per_s: Sequence[float], costs: Sequence[float] | None = None) -> Choice:
    """EntMTP* = the throughput-maximal tree (ties: fewer nodes); T- and T+ = the fastest timed
    tree with fewer / more nodes than it (EntMTP* itself when there is none). With ``costs``
    (each tree's forward cost c(N)), T- must also cost less than EntMTP* to verify.

    T± are the trees a scheduler would switch to when a smaller or larger tree pays off, so
    each must be worth running on its own. Where the forward cost is flat in N (a GPU) the
    upper hull's neighbours of EntMTP* usually are these trees; where throughput is far from
    concave in the node count (a CPU) the hull's right neighbour can be the largest and slowest
    tree. A conservative tree that costs more than EntMTP* saves nothing: where c(N) is not
    monotone in N (a BLAS switching kernels at a few rows), the only cheaper tree can be the
    root alone, i.e. plain decoding for the step. The hull and the Pareto set are reported
    alongside.
    """
    pts = [(float(n), float(v)) for n, v in zip(nodes, tokens_per_s)]
    static = max(range(len(pts)), key=lambda i: (pts[i][1], -pts[i][0]))

    def fastest(side: list[int]) -> int:
        return max(side, key=lambda i: (pts[i][1], -pts[i][0])) if side else static

    cheaper = [i for i in range(len(pts)) if costs is None or costs[i] < costs[static]]
    low = fastest([i for i in cheaper if pts[i][0] < pts[static][0]])
    high = fastest([i for i in range(len(pts)) if pts[i][0] > pts[static][0]])
    return Choice(static, low, high, upper_hull(pts), pareto_front(pts))


def fan(num_nodes: int) -> Tree:
    """The depth-1 tree of ``num_nodes`` nodes: the first token's top ``num_nodes - 1`` guesses."""
    return Tree.from_choices([[r] for r in range(num_nodes - 1)]) if num_nodes > 1 else Tree.root_only()


def value_sets(trees: dict[str, Tree], choice: Choice, labels: list[str]) -> dict[str, list[Tree]]:
    """The tree sets the value policy is swept over, labelled ``value:{N}`` (or ``value:{N}+{M}``).

    For EntMTP* and T+ with 3 <= N <= :data:`VALUE_MAX_NODES` nodes: the frontier tree and the
    fan of the same size, two shapes at one forward cost, so the policy trades depth against
    width per step for free; with both sizes, all four trees (then the trees' forward costs
    weigh the choice). Each set is also offered with T- in front when T- is smaller (label
    ``value:{n}+...``): on steps where the drafted nodes' values are too low to pay for their
    share of the forward, the policy verifies the cheaper tree (its nodes are drafted anyway)."""
    sets: dict[str, list[Tree]] = {}
    for i in sorted({choice.static, choice.aggressive}, key=lambda i: trees[labels[i]].num_nodes):
        tree = trees[labels[i]]
        if 3 <= tree.num_nodes <= VALUE_MAX_NODES and fan(tree.num_nodes) != tree:
            sets[f"value:{tree.num_nodes}"] = [tree, fan(tree.num_nodes)]
    if len(sets) == 2:
        (a, ta), (b, tb) = sets.items()
        sets[f"{a}+{b.split(':')[1]}"] = ta + tb
    low = trees[labels[choice.conservative]]
    for label, members in list(sets.items()):
        if low.num_nodes < members[0].num_nodes:
            sets[f"value:{low.num_nodes}+{label.split(':')[1]}"] = [low, *members]
    return sets


def value_costs(trees: Sequence[Tree], costs: dict[int, float] | None) -> list[float]:
    """The value policy's weights: each tree's c(N) relative to one token (equal without costs)."""
    return [interpolate(costs, t.num_nodes) if costs else 1.0 for t in trees]
