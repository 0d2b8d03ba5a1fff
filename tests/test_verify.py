"""Acceptance rules and the cache update, on fixed tensors."""

import math

import torch
from transformers import DynamicCache, LlamaConfig

from entmtp_hf.tree import MC_SIM_7B_63, Tree
from entmtp_hf.verify import (
    keep_accepted,
    tree_attention_mask,
    typical_accept_flags,
    typical_best_path,
    walk_tree,
)


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


def test_keep_accepted_moves_path_to_front():
    cfg = LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=1, hidden_size=4)
    cache = DynamicCache(config=cfg)
    L, N = 3, 5
    for i in range(2):
        k = torch.arange(L + N, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2).clone()
        cache.update(k, k + 100, i)
    keep_accepted(cache, L, N, [0, 2, 4])
    assert cache.get_seq_length() == L + 3
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 7]
        assert layer.values[0, 0, :, 0].tolist() == [100, 101, 102, 103, 105, 107]
