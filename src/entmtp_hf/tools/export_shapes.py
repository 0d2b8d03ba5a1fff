"""The rules serving engines put on a tree's shape, as projections of its node set.

Pure functions on sets of paths (a path is the child ranks from the root): each keeps the largest
part of a tree that meets one rule (a depth cap, gapless top-k children, a chain, level-uniform
children, a node budget), and a :class:`Rule` pairs one with its words for the export's report.
The engines combine them (:mod:`.export_engines`); the bank's acceptance frontier ranks what to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from ..trees.tree import Path, canonical_order

Paths = frozenset[Path]
Frontier = list[tuple[Paths, float]]


def first_gap(children: set[int]) -> int:
    """How many child ranks 0, 1, 2, ... a node has before the first missing one."""
    k = 0
    while k in children:
        k += 1
    return k


def child_ranks(paths: Paths) -> dict[Path, set[int]]:
    """Parent path (the root is ``()``) -> the ranks of its children."""
    kids: dict[Path, set[int]] = {}
    for p in paths:
        kids.setdefault(p[:-1], set()).add(p[-1])
    return kids


def within_depth(paths: Paths, depth: int | None) -> Paths:
    """The nodes at most ``depth`` deep (an engine drafts one level per head or draft step)."""
    return paths if depth is None else frozenset(p for p in paths if len(p) <= depth)


def contiguous(paths: Paths, up_to_depth: int | None = None) -> Paths:
    """The nodes whose siblings of lower rank are all there, at depths up to ``up_to_depth``.

    A top-k drafter drafts a node's k children as ranks 0..k-1; a rank behind a gap would be
    drafted as another token. Its subtree goes with it.
    """
    kept: set[Path] = set()
    for p in canonical_order(paths):  # parents first, then ranks in order
        rooted = len(p) == 1 or p[:-1] in kept
        closed = p[-1] == 0 or p[:-1] + (p[-1] - 1,) in kept or (up_to_depth is not None and len(p) > up_to_depth)
        if rooted and closed:
            kept.add(p)
    return frozenset(kept)


def top1_chain(paths: Paths) -> Paths:
    """The top-1 chain ``[0], [0, 0], ...`` inside the tree: what one argmax per head drafts."""
    chain, p = set(), (0,)
    while p in paths:
        chain.add(p)
        p = p + (0,)
    return frozenset(chain)


def uniform_subtrees(paths: Paths) -> Iterator[Paths]:
    """Every subtree in which all nodes of a level have the same children ranks 0..k-1."""
    gaps = {parent: first_gap(ranks) for parent, ranks in child_ranks(paths).items()}

    def grow(level: list[Path], kept: Paths) -> Iterator[Paths]:
        yield kept
        for k in range(1, min(gaps.get(p, 0) for p in level) + 1):
            nxt = [p + (r,) for p in level for r in range(k)]
            yield from grow(nxt, kept | frozenset(nxt))

    return grow([()], frozenset())


def best_chain(paths: Paths, frontier: Frontier) -> Paths:
    """The prefix of the tree's top-1 chain that the bank's figures support best.

    vLLM verifies drafts as a chain, so only the tree's chain ``[0], [0, 0], ...`` counts; each of
    its prefixes verifies no more tokens than the tree did. A prefix's figure is the frontier's
    lower bound (exact for a frontier chain); the shortest prefix reaching the best figure wins, as
    a longer one costs draft steps that no figure shows paying. Without any chain figure (no
    frontier, or none inside the chain) the whole chain is kept.
    """
    chain = sorted(top1_chain(paths), key=len)
    figures = [
        max((v for s, v in frontier if s and s <= frozenset(chain[:k])), default=None) for k in range(1, len(chain) + 1)
    ]
    known = [(v, -k) for k, v in enumerate(figures, start=1) if v is not None]
    if not known:
        return frozenset(chain)
    return frozenset(chain[: -max(known)[1]])


def largest_uniform(paths: Paths, budget: int | None, frontier: Frontier) -> Paths:
    """The largest level-uniform subtree within ``budget`` nodes; ties go to the higher frontier bound."""
    fits = (s for s in uniform_subtrees(paths) if budget is None or len(s) <= budget)
    return max(fits, key=lambda s: (len(s), accept_bounds(s, frontier)[0] or 0.0))


def frontier_priority(frontier: Frontier) -> Callable[[Path], float]:
    """A node's value order: the size of the first frontier tree holding it (the search added the
    most valuable node first); nodes of no frontier tree come last."""
    first: dict[Path, int] = {}
    for s, _ in sorted(frontier, key=lambda item: len(item[0])):
        for p in s:
            first.setdefault(p, len(s))
    return lambda p: first.get(p, float("inf"))


def within_budget(paths: Paths, budget: int | None, priority: Callable[[Path], float]) -> Paths:
    """The ``budget`` most valuable nodes that still form a tree, creating no gap between siblings.

    A node is ranked after everything it needs (its parent and its next-lower sibling), so every
    prefix of the order is a valid tree.
    """
    if budget is None or len(paths) <= budget:
        return paths
    rank: dict[Path, float] = {}
    for p in canonical_order(paths):  # what a node needs comes before it in this order
        needs = [q for q in (p[:-1], p[:-1] + (p[-1] - 1,)) if q in rank]
        rank[p] = max([priority(p), *(rank[q] for q in needs)])
    order = sorted(paths, key=lambda p: (rank[p], len(p), p))
    return frozenset(order[:budget])


@dataclass(frozen=True)
class Rule:
    """One requirement of an engine, in words, and the projection onto the trees that meet it."""

    text: str
    project: Callable[[Paths], Paths]


#: a top-k drafter's rule: children are ranks 0..k-1
TOPK = Rule("each node's children are its top-k: ranks 0..k-1 without gaps", contiguous)


def budget_rules(max_nodes: int | None, frontier: Frontier) -> list[Rule]:
    """The user's node cap (``--max-nodes``), the most valuable nodes kept; none without a cap."""
    if not max_nodes:
        return []
    return [
        Rule(
            f"at most {max_nodes} drafted nodes (--max-nodes), the most valuable first",
            lambda s: within_budget(s, max_nodes, frontier_priority(frontier)),
        )
    ]


def accept_bounds(paths: Paths, frontier: Frontier) -> tuple[float | None, float | None]:
    """Tokens per step of a tree bounded by the frontier: the largest frontier tree inside it and
    the smallest one around it (a tree's greedy accept length never drops when nodes are added)."""
    lower = max((v for s, v in frontier if s <= paths), default=None)
    upper = min((v for s, v in frontier if paths <= s), default=None)
    return lower, upper
