"""Acceptance rules and the cache update, on fixed tensors."""

import math

import pytest
import torch
from test_generation import chi_square_p
from transformers import DynamicCache, LlamaConfig

from entmtp_hf.decoding.acceptance import (
    check_pick,
    sample_tokens,
    typical_accept_flags,
    typical_best_path,
    walk_tree,
)
from entmtp_hf.decoding.attention import tree_attention_mask
from entmtp_hf.decoding.cache import GROWTH_STEP, PreallocatedLayer, keep_accepted, preallocate
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


def test_walk_tree_greedy():
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0]])  # nodes: 0, [0]=1, [1]=2, [0,0]=3, [1,0]=4
    b = tree.buffers()
    tokens = [9, 5, 6, 7, 8]
    # verifier picks: at root 6 (node 2), at node 2 -> 8 (node 4), at node 4 -> 3 (new)
    picks = [6, 0, 8, 0, 3]
    acc = walk_tree(b.children, tokens, picks)
    assert acc.path == [0, 2, 4] and acc.next_token == 3
    acc = walk_tree(b.children, tokens, [1, 0, 0, 0, 0])
    assert acc.path == [0] and acc.next_token == 1


def direct_typical(scores, tokens, paths_rows, eps, alpha):
    """The paper's rule evaluated node by node in plain Python."""
    probs = torch.softmax(scores.double(), -1)
    best = None
    for row in paths_rows:
        row = [x for x in row if x >= 0]
        kept, logp = [row[0]], 0.0
        for parent, child in zip(row, row[1:]):
            p = probs[parent]
            h = -sum(float(q) * math.log(float(q)) for q in p if q > 0)
            x = float(p[tokens[child]])
            if x > min(eps, alpha * math.exp(-h)):
                kept.append(child)
                logp += math.log(x)
            else:
                break
        key = (len(kept), logp)
        if best is None or key > best[0]:
            best = (key, kept)
    return best[1]


def test_typical_matches_direct_formula():
    g = torch.Generator().manual_seed(0)
    tree = Tree.from_choices(MC_SIM_7B_63)
    b = tree.buffers()
    for trial in range(20):
        V = 12
        scores = torch.randn(tree.num_nodes, V, generator=g) * (1 + trial % 4)
        tokens = torch.randint(0, V, (tree.num_nodes,), generator=g)
        eps, alpha = 0.09, 0.3
        passed, logp = typical_accept_flags(scores, tokens, b.parents, eps, alpha)
        path = typical_best_path(passed, logp, b.retrieve_indices)
        assert path == direct_typical(scores, tokens, b.retrieve_indices.tolist(), eps, alpha)


def test_tree_attention_mask_layout():
    b = Tree.from_choices([[0], [1]]).buffers()
    prefix = torch.tensor([0.0, torch.finfo(torch.float32).min, 0.0])
    m = tree_attention_mask(b, prefix, kv_len=8)
    assert m.shape == (1, 1, 3, 8)
    assert torch.equal(m[0, 0, :, :3], prefix.expand(3, 3))
    assert torch.equal(m[0, 0, :, 3:6], b.attn_mask)
    assert torch.all(m[0, 0, :, 6:] == torch.finfo(torch.float32).min)


def test_a_preallocated_cache_holds_what_a_dynamic_one_holds():
    """Updates past the capacity, crops, in-place path moves and row selection: the preallocated
    layers hold exactly the dynamic layers' keys and values, as views of their buffers."""
    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=2, hidden_size=8)
    plain, pre = DynamicCache(config=cfg), preallocate(DynamicCache(config=cfg), limit=6)
    assert all(isinstance(layer, PreallocatedLayer) for layer in pre.layers)
    g = torch.Generator().manual_seed(0)

    def both(n: int, rows: int = 3) -> None:
        for i in range(2):
            k, v = torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)
            for cache in (plain, pre):
                out_k, out_v = cache.update(k, v, i)
                assert torch.equal(out_k, cache.layers[i].keys) and torch.equal(out_v, cache.layers[i].values)

    def same() -> None:
        for a, b in zip(plain.layers, pre.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert b.keys._base is b._key_buffer or not b._holds_views()

    both(4)  # the prompt: a growth step more, within the limit
    assert pre.layers[0].capacity == 6
    both(5)  # a tree past the limit: the buffers grow to hold it
    assert pre.layers[0].capacity == 9
    same()
    for cache in (plain, pre):
        keep_accepted(cache, 4, [[0, 2, 4]])
    same()
    assert pre.get_seq_length() == 7 and pre.layers[0]._holds_views()
    for cache in (plain, pre):  # a finished row leaves the batch
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[[0, 2]], layer.values[[0, 2]]
    both(2, rows=2)  # the next update copies the selected rows back into buffers
    same()
    assert pre.layers[1]._holds_views() and pre.layers[1]._key_buffer.shape[0] == 2
    unlimited = preallocate(DynamicCache(config=cfg))
    unlimited.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4), 0)
    assert unlimited.layers[0].capacity == 10 + GROWTH_STEP


def test_keep_accepted_moves_path_to_front():
    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=1, hidden_size=4)
    cache = DynamicCache(config=cfg)
    L, N = 3, 5
    for i in range(2):
        k = torch.arange(L + N, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2).clone()
        cache.update(k, k + 100, i)
    keep_accepted(cache, L, [[0, 2, 4]])
    assert cache.get_seq_length() == L + 3
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 7]
        assert layer.values[0, 0, :, 0].tolist() == [100, 101, 102, 103, 105, 107]


def test_sample_tokens_draws_each_row_from_its_distribution():
    probs = torch.tensor(
        [
            [0.5, 0.0, 0.25, 0.125, 0.0, 0.125],  # zeros inside and at both ends
            [0.0, 0.0, 0.0, 0.0, 0.0, 3.0],  # unnormalised, one token
            [1e-3, 2e-3, 0.0, 4e-3, 5e-3, 0.0],  # small total
        ]
    )
    n = 20000
    g = torch.Generator().manual_seed(0)
    draws = sample_tokens(probs[:, None, :].expand(-1, n, -1).reshape(-1, 6), g).view(3, n)
    for row, d in zip(probs, draws):
        dist = row / row.sum()
        counts = {t: int((d == t).sum()) for t in range(6)}
        assert all(counts[t] == 0 for t in range(6) if dist[t] == 0), counts
        if int((dist > 0).sum()) > 1:  # one possible token: the zero counts above are the test
            assert chi_square_p(counts, {t: float(dist[t]) for t in range(6)}, n) > 1e-3, counts


def test_sample_tokens_ends_at_the_last_possible_token():
    """A uniform draw that rounds up to the row's total must not land on a zero-probability tail."""
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    torch.manual_seed(0)
    draws = sample_tokens(probs.expand(50000, -1))
    assert set(draws.tolist()) == {0, 1}


def test_sample_tokens_flags_rows_that_are_not_distributions():
    probs = torch.tensor([[0.5, 0.5], [float("nan"), 1.0], [float("inf"), 1.0], [0.0, 0.0]])
    draws = sample_tokens(probs).tolist()
    assert draws[0] in (0, 1) and draws[1:] == [-1, -1, -1]
    assert check_pick(1) == 1
    with pytest.raises(RuntimeError, match="inf"):
        check_pick(-1)
