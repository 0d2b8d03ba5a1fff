"""Grouped tree attention: the same result as transformers' sdpa, without repeating keys/values."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from entmtp_hf.decoding import attention as A
from entmtp_hf.decoding.attention import tree_attention_mask
from entmtp_hf.trees.tree import Tree


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(n: int, kv: int = 2, groups: int = 3, length: int = 40, dtype=torch.float64):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, kv * groups, n, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(1, kv, length, 8, generator=g, dtype=dtype) for _ in range(2))
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)][: max(n - 1, 0)]) if n > 1 else Tree.chain(0)
    buffers = tree.buffers("cpu", dtype)
    row = torch.zeros(length - buffers.num_nodes, dtype=dtype)
    row[:3] = torch.finfo(dtype).min  # padding in the prefix stays masked
    return q, k, v, tree_attention_mask(buffers, row, length)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_grouped_attention_matches_sdpa_with_a_tree_mask(n):
    q, k, v, mask = _inputs(n)
    module = _Module(groups=3)
    with A.verifying():
        got, _ = A.grouped_tree_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (1, n, 6, 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_cases_it_does_not_handle_go_to_sdpa_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(A, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or ("sdpa", None))
    q, k, v, mask = _inputs(3)
    assert A.grouped_tree_attention(_Module(3), q, k, v, mask)[0] == "sdpa"  # not verifying a tree: plain generate
    with A.verifying():
        assert A.grouped_tree_attention(_Module(3), q[:, :, :1], k, v, mask[:, :, :1])[0] == "sdpa"  # one query
        assert A.grouped_tree_attention(_Module(3), q, k, v, None)[0] == "sdpa"  # no mask: sdpa's own GQA path
        assert A.grouped_tree_attention(_Module(1), q[:, :2], k, v, mask)[0] == "sdpa"  # no grouping
        assert A.grouped_tree_attention(_Module(3), q, k, v, mask, softcap=30.0)[0] == "sdpa"
    assert len(calls) == 5


def test_verifying_is_per_thread_and_restored():
    import threading

    seen = []
    with A.verifying():
        thread = threading.Thread(target=lambda: seen.append(A._VERIFYING.get()))
        thread.start()
        thread.join()
        assert A._VERIFYING.get()
    assert seen == [False] and not A._VERIFYING.get()


def test_tree_attention_is_selected_once_and_restored():
    model = tiny_model()
    config = model.config.get_text_config()
    assert config._attn_implementation == "sdpa"
    assert A.use_tree_attention(model) and config._attn_implementation == A.ATTENTION_NAME
    A.restore_attention(model)
    assert config._attn_implementation == "sdpa"


def test_tree_attention_leaves_other_implementations_alone():
    model = tiny_model()
    model.set_attn_implementation("eager")
    assert not A.use_tree_attention(model)
    A.restore_attention(model)
    assert model.config._attn_implementation == "eager"


def test_a_model_forward_uses_it_and_gives_the_same_logits(monkeypatch):
    model = tiny_model()
    ids = torch.tensor([[1, 5, 7, 2, 9, 3]])
    tree = Tree.from_choices([(0,), (1,), (0, 0)])
    b = tree.buffers("cpu", torch.float64)
    mask = tree_attention_mask(b, torch.zeros(ids.shape[1], dtype=torch.float64), ids.shape[1] + b.num_nodes)
    kwargs = dict(input_ids=torch.tensor([[4, 6, 8, 10]]), attention_mask=mask, position_ids=(b.position_ids + 6)[None])
    with torch.no_grad():
        want = model(**kwargs, cache=_prefilled(model, ids)).logits
        cache = _prefilled(model, ids)
        used = []
        real = A.F.scaled_dot_product_attention
        monkeypatch.setattr(A.F, "scaled_dot_product_attention", lambda *a, **k: used.append(k) or real(*a, **k))
        A.use_tree_attention(model)
        with A.verifying():
            got = model(**kwargs, cache=cache).logits
    assert len(used) == model.config.num_hidden_layers and all(k["enable_gqa"] for k in used)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _prefilled(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    return cache
