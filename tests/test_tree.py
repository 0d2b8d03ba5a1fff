"""Tree validation and compiled buffers, checked against a brute-force construction."""

import random

import pytest
import torch

from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


def random_tree(rng: random.Random, size: int, max_depth: int = 4, max_rank: int = 5) -> list[list[int]]:
    paths: set[tuple[int, ...]] = set()
    while len(paths) < size:
        parent = rng.choice([()] + [p for p in paths if len(p) < max_depth])
        paths.add(parent + (rng.randrange(max_rank),))
        # keep it a tree: add missing ancestors
        for p in list(paths):
            for k in range(1, len(p)):
                paths.add(p[:k])
    out = [list(p) for p in paths]
    rng.shuffle(out)
    return out


def brute_force(choices):
    """Nodes, ancestors, depths and leaves straight from the definition."""
    paths = [()] + sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    n = len(paths)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(paths):
        for j, q in enumerate(paths):
            visible[i, j] = p[: len(q)] == q  # q is a prefix of p (ancestor or self)
    depths = [len(p) for p in paths]
    leaves = [p for p in paths if not any(len(q) == len(p) + 1 and q[: len(p)] == p for q in paths)]
    rows = {tuple(index[p[:k]] for k in range(len(p) + 1)) for p in leaves}
    return paths, visible, depths, rows


@pytest.mark.parametrize("seed", range(12))
def test_buffers_match_brute_force(seed):
    rng = random.Random(seed)
    choices = MC_SIM_7B_63 if seed == 0 else random_tree(rng, rng.randrange(1, 40))
    tree = Tree.from_choices(choices)
    paths, visible, depths, rows = brute_force(choices)
    b = tree.buffers("cpu", torch.float32)
    assert tree.num_nodes == len(paths) == b.num_nodes
    assert [tuple(p) for p in tree.choices] == paths[1:]
    assert torch.equal(b.attn_mask == 0, visible)
    assert torch.all(b.attn_mask[~visible] == torch.finfo(torch.float32).min)
    assert b.position_ids.tolist() == depths
    got = {tuple(x for x in r if x >= 0) for r in b.retrieve_indices.tolist()}
    assert got == rows
    assert b.retrieve_indices.shape == (len(rows), tree.depth + 1)
    for r in b.retrieve_indices.tolist():  # right padding only
        k = r.index(-1) if -1 in r else len(r)
        assert all(x == -1 for x in r[k:])
    # the depth plan reproduces every node's (parent, rank)
    for step in b.depth_plan:
        for child, row, rank in zip(step.children.tolist(), step.child_parent_row.tolist(), step.child_rank.tolist()):
            parent = step.parents[row].item()
            assert paths[child] == paths[parent] + (rank,)
            assert rank < step.topk
        assert all(depths[p] == step.depth - 1 for p in step.parents.tolist())
    for i, a in enumerate(b.ancestors.tolist()):
        assert [x for x in a if x >= 0] == [paths.index(paths[i][:k]) for k in range(depths[i] + 1)]


def test_mc_sim_shape():
    t = Tree.from_choices(MC_SIM_7B_63)
    assert t.num_nodes == 64 and t.depth == 4 and t.nodes_per_depth() == [10, 28, 23, 2]


def test_buffers_cached_per_device_dtype():
    t = Tree.from_choices([[0], [1], [0, 0]])
    assert t.buffers("cpu", torch.float32) is t.buffers("cpu", torch.float32)
    b64 = t.buffers("cpu", torch.float64)
    assert b64.attn_mask.dtype == torch.float64
    assert b64.attn_mask.min() == torch.finfo(torch.float64).min


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], []], "path #1 is empty"),
        ([[0], [0]], "repeats path #0"),
        ([[0], [-1]], "negative rank"),
        ([[0], [0.5]], "non-integer rank"),
        ([[0], [True]], "non-integer rank"),
        ([[0], [1, 0, 2]], "path [1, 0] is missing"),
        ("abc", "list of paths"),
        ([[0], "x"], "not a list of child ranks"),
    ],
)
def test_invalid_trees_name_the_path(choices, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Tree.from_choices(choices)


def test_order_and_helpers():
    t = Tree.from_choices([[1], [0, 0], [0]])
    assert t.choices == [[0], [1], [0, 0]]
    assert Tree.chain(3).choices == [[0], [0, 0], [0, 0, 0]]
    assert Tree.root_only().num_nodes == 1
    u = Tree.chain(2).union(Tree.from_choices([[1]]))
    assert u.choices == [[0], [1], [0, 0]]
    assert u.subtree_map(Tree.chain(2)) == [0, 1, 3]
    assert Tree.from_choices([[0], [1]]) == Tree.from_choices([[1], [0]])
