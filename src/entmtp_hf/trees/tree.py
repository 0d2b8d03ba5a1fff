"""Draft-tree topologies and the buffers they compile to.

A tree is given in the list-of-paths ("choices") format used by Medusa and Hydra:
each path lists child ranks from the root, e.g. ``[0, 1]`` is the rank-1 child of the
top-1 node at depth 1. The root (the base model's own next token) is implicit, so a
tree of ``len(choices)`` paths has ``len(choices) + 1`` nodes. Node 0 is the root and
the other nodes follow the canonical order: paths sorted by ``(length, path)``.

A :class:`Tree` is an immutable, validated value. :meth:`Tree.buffers` compiles it once
per ``(device, dtype)`` into a frozen :class:`TreeBuffers`; the decode loop only looks
buffers up, it never compiles.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

Path = tuple[int, ...]


@dataclass(frozen=True)
class DepthStep:
    """How to draft the nodes of one depth ``d`` (1-based) from their parents.

    ``parents`` are the node indices at depth ``d - 1`` that have children, ``topk`` the
    number of candidates one draft call must rank per parent (largest child rank + 1),
    and ``children`` / ``child_parent_row`` / ``child_rank`` say, for every node at depth
    ``d``, which row of ``parents`` it hangs from and which rank it takes there.
    """

    depth: int
    parents: torch.Tensor  # [n_parents] long
    topk: int
    children: torch.Tensor  # [n_children] long
    child_parent_row: torch.Tensor  # [n_children] long
    child_rank: torch.Tensor  # [n_children] long


@dataclass(frozen=True)
class TreeBuffers:
    """Everything the decode loop needs about one tree, on one device and dtype.

    Shapes use ``N`` = nodes (root included), ``P`` = leaves and ``D`` = depth.
    """

    attn_mask: torch.Tensor  # [N, N] additive: 0 where visible, finfo(dtype).min elsewhere
    position_ids: torch.Tensor  # [N] long: depth of each node
    retrieve_indices: torch.Tensor  # [P, D + 1] long: root→leaf node indices, -1 padded
    ancestors: torch.Tensor  # [N, D + 1] long: root→node indices of every node, -1 padded
    parents: torch.Tensor  # [N] long: parent node index, -1 for the root
    ranks: torch.Tensor  # [N] long: child rank of each node (0 for the root)
    depth_plan: tuple[DepthStep, ...]  # one entry per depth 1..D
    children: tuple[tuple[int, ...], ...]  # host-side child lists, for walking the tree

    @property
    def num_nodes(self) -> int:
        return int(self.position_ids.shape[0])


def _check_path(path: object, index: int) -> Path:
    if isinstance(path, (str, bytes)) or not isinstance(path, Iterable):
        raise ValueError(f"tree path #{index} {path!r} is not a list of child ranks")
    ranks = list(path)
    if not ranks:
        raise ValueError(f"tree path #{index} is empty; every path needs at least one rank")
    checked = []
    for rank in ranks:
        try:
            if isinstance(rank, bool):
                raise TypeError
            value = operator.index(rank)
        except TypeError:
            raise ValueError(f"tree path #{index} {ranks!r} has a non-integer rank {rank!r}") from None
        if value < 0:
            raise ValueError(f"tree path #{index} {ranks!r} has a negative rank {value}")
        checked.append(value)
    return tuple(checked)


def canonical_order(paths: Iterable[Path]) -> list[Path]:
    """Sort paths by (length, path): the node order shared with Medusa and Hydra."""
    return sorted(paths, key=lambda p: (len(p), p))


@dataclass(frozen=True, eq=False)
class Tree:
    """An immutable draft-tree topology in canonical node order."""

    paths: tuple[Path, ...]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "Tree":
        """Build a tree from a list of paths, validating every path.

        Raises ``ValueError`` naming the offending path when a path is empty, repeated,
        has a negative or non-integer rank, or hangs from a parent path that is missing.
        """
        if isinstance(choices, Tree):
            return choices
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Iterable):
            raise ValueError(f"a tree must be a list of paths, got {type(choices).__name__}")
        seen: dict[Path, int] = {}
        for i, raw in enumerate(choices):
            path = _check_path(raw, i)
            if path in seen:
                raise ValueError(f"tree path #{i} {list(path)} repeats path #{seen[path]}")
            seen[path] = i
        for path, i in seen.items():
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path #{i} {list(path)} has no parent: path {list(path[:-1])} is missing")
        return cls(tuple(canonical_order(seen)))

    @classmethod
    def chain(cls, depth: int) -> "Tree":
        """The top-1 chain of the given depth (``depth == 0`` is the root alone)."""
        if depth < 0:
            raise ValueError(f"chain depth must be >= 0, got {depth}")
        return cls(tuple((0,) * d for d in range(1, depth + 1)))

    @classmethod
    def root_only(cls) -> "Tree":
        return cls(())

    # ---------------------------------------------------------------- properties
    @property
    def choices(self) -> list[list[int]]:
        """The paths as lists, in canonical order (JSON-friendly)."""
        return [list(p) for p in self.paths]

    @property
    def num_nodes(self) -> int:
        """Number of nodes, the implicit root included."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def __len__(self) -> int:
        return self.num_nodes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, depth={self.depth})"

    def nodes_per_depth(self) -> list[int]:
        counts = [0] * self.depth
        for p in self.paths:
            counts[len(p) - 1] += 1
        return counts

    def node_index(self) -> dict[Path, int]:
        """Map each path (the root is ``()``) to its node index."""
        index = {(): 0}
        for i, p in enumerate(self.paths, start=1):
            index[p] = i
        return index

    def union(self, *others: "Tree") -> "Tree":
        """The smallest tree containing this one and ``others`` (their paths merged)."""
        merged = set(self.paths)
        for o in others:
            merged.update(o.paths)
        return Tree(tuple(canonical_order(merged)))

    def subtree_map(self, sub: "Tree") -> list[int]:
        """Node indices in ``self`` of every node of ``sub`` (``sub`` must be contained)."""
        index = self.node_index()
        try:
            return [0] + [index[p] for p in sub.paths]
        except KeyError as e:  # pragma: no cover - guarded by callers
            raise ValueError(f"path {list(e.args[0])} of the subtree is not in this tree") from None

    # ---------------------------------------------------------------- buffers
    def buffers(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> TreeBuffers:
        """Compiled buffers for this tree, cached per (device, dtype)."""
        key = (str(torch.device(device)), dtype)
        cached = self._cache.get(key)
        if cached is None:
            cached = compile_tree(self, torch.device(device), dtype)
            self._cache[key] = cached
        return cached


def compile_tree(tree: Tree, device: torch.device, dtype: torch.dtype) -> TreeBuffers:
    """Compile a tree into attention mask, positions, retrieval rows and a depth plan."""
    index = tree.node_index()
    n = tree.num_nodes
    paths: list[Path] = [()] + list(tree.paths)
    parents = [-1] + [index[p[:-1]] for p in tree.paths]
    ranks = [0] + [p[-1] for p in tree.paths]
    depths = [len(p) for p in paths]

    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(paths):
        for k in range(len(p) + 1):  # the root, every ancestor, and the node itself
            visible[i, index[p[:k]]] = True
    attn_mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype)
    attn_mask.masked_fill_(visible, 0.0)

    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    lineage = []
    for i in range(n):
        row = [index[paths[i][:k]] for k in range(depths[i] + 1)]
        lineage.append(row + [-1] * (tree.depth + 1 - len(row)))
    rows = [lineage[i] for i in range(n) if not children[i]]

    plan = []
    for d in range(1, tree.depth + 1):
        kids = [i for i in range(n) if depths[i] == d]
        par = sorted({parents[i] for i in kids})
        row_of = {p: r for r, p in enumerate(par)}
        plan.append(
            DepthStep(
                depth=d,
                parents=torch.tensor(par, dtype=torch.long, device=device),
                topk=max(ranks[i] for i in kids) + 1,
                children=torch.tensor(kids, dtype=torch.long, device=device),
                child_parent_row=torch.tensor([row_of[parents[i]] for i in kids], dtype=torch.long, device=device),
                child_rank=torch.tensor([ranks[i] for i in kids], dtype=torch.long, device=device),
            )
        )

    return TreeBuffers(
        attn_mask=attn_mask.to(device),
        position_ids=torch.tensor(depths, dtype=torch.long, device=device),
        retrieve_indices=torch.tensor(rows, dtype=torch.long, device=device),
        ancestors=torch.tensor(lineage, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        ranks=torch.tensor(ranks, dtype=torch.long, device=device),
        depth_plan=tuple(plan),
        children=tuple(tuple(c) for c in children),
    )


#: Medusa's and Hydra's default tree (63 drafted nodes; 10/28/23/2 per depth).
MC_SIM_7B_63: list[list[int]] = [
    [0],
    [0, 0],
    [1],
    [0, 1],
    [2],
    [0, 0, 0],
    [1, 0],
    [0, 2],
    [3],
    [0, 3],
    [4],
    [0, 4],
    [2, 0],
    [0, 5],
    [0, 0, 1],
    [5],
    [0, 6],
    [6],
    [0, 7],
    [0, 1, 0],
    [1, 1],
    [7],
    [0, 8],
    [0, 0, 2],
    [3, 0],
    [0, 9],
    [8],
    [9],
    [1, 0, 0],
    [0, 2, 0],
    [1, 2],
    [0, 0, 3],
    [4, 0],
    [2, 1],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 0, 0],
    [0, 1, 1],
    [0, 0, 6],
    [0, 3, 0],
    [5, 0],
    [1, 3],
    [0, 0, 7],
    [0, 0, 8],
    [0, 0, 9],
    [6, 0],
    [0, 4, 0],
    [1, 4],
    [7, 0],
    [0, 1, 2],
    [2, 0, 0],
    [3, 1],
    [2, 2],
    [8, 0],
    [0, 5, 0],
    [1, 5],
    [1, 0, 1],
    [0, 2, 1],
    [9, 0],
    [0, 6, 0],
    [0, 0, 0, 1],
    [1, 6],
    [0, 7, 0],
]
