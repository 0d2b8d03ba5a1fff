"""The package's decode attention (``csrc/attention.cpp``, ``entmtp_hf_cpu::decode_attention``): what
``F.scaled_dot_product_attention`` computes, each query row on its own (a tree's rows equal one-token
calls bit for bit), and what compiled CPU decode forwards attend with where it is built."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from op_calls import extension_calls
from tiny import VOCAB

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf import cpu_kernels as K
from entmtp_hf import gemv as G
from entmtp_hf.decoding import attention as A
from entmtp_hf.decoding import precompiled
from entmtp_hf.decoding.compiled import compiled_generation
from entmtp_hf.trees.tree import Tree

pytestmark = pytest.mark.skipif(G.unavailable() is not None, reason=f"the CPU kernels are off here: {G.unavailable()}")


def _inputs(b, h, kvh, t, s, d, dtype, seed=0, boolean=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k, v = (torch.randn(b, kvh, s, d, generator=g).to(dtype) for _ in range(2))
    attend = torch.rand(b, 1, t, s, generator=g) < 0.7  # a tree's pattern: holes anywhere
    attend[..., 0] = True
    mask = attend if boolean else torch.zeros(b, 1, t, s, dtype=dtype).masked_fill(~attend, torch.finfo(dtype).min)
    return q, k, v, mask


def _reference(q, k, v, mask, scale):
    mask = mask if mask.dtype == torch.bool else mask.float()
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("d", [64, 24, 128])
@pytest.mark.parametrize("boolean", [False, True])
def test_float32_attention_is_sdpas(heads, tokens, d, boolean):
    h, kvh = heads
    q, k, v, mask = _inputs(2, h, kvh, tokens, 37, d, torch.float32, boolean=boolean)
    out = G.extension().decode_attention(q, k, v, mask, d**-0.5)
    assert out.shape == (2, tokens, h, d) and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(q, k, v, mask, d**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("boolean", [False, True])
def test_bfloat16_attention_sums_in_float32_and_rounds_once(tokens, boolean):
    q, k, v, mask = _inputs(1, 9, 3, tokens, 300, 64, torch.bfloat16, seed=1, boolean=boolean)
    out = G.extension().decode_attention(q, k, v, mask, 0.125)
    assert out.dtype == torch.bfloat16
    want = _reference(q, k, v, mask, 0.125).to(torch.bfloat16)  # float32 of the same bf16 inputs, rounded once
    assert (out.float() - want.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_row_is_computed_on_its_own(dtype):
    """A tree's rows equal one-token calls bit for bit, whatever else shares the call (the invariant
    that keeps compiled verification equal to compiled plain decoding)."""
    q, k, v, mask = _inputs(2, 9, 3, 6, 513, 64, dtype, seed=2)
    ext = G.extension()
    whole = ext.decode_attention(q, k, v, mask, 0.125)
    rows = [ext.decode_attention(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], 0.125) for i in range(6)]
    rows = torch.cat(rows, 1)
    assert torch.equal(whole, rows)
    # nor on the query heads beside it
    heads = [
        ext.decode_attention(q[:, h : h + 1], k[:, h // 3 : h // 3 + 1], v[:, h // 3 : h // 3 + 1], mask, 0.125)
        for h in range(9)
    ]
    assert torch.equal(whole, torch.cat(heads, 2))


def test_masked_keys_are_left_out_and_a_fully_masked_row_follows_the_formula():
    q, k, v, mask = _inputs(1, 4, 2, 2, 40, 16, torch.float32, seed=3)
    mask[..., 20:] = torch.finfo(torch.float32).min
    ext = G.extension()
    cut = ext.decode_attention(q, k[:, :, :20], v[:, :, :20], mask[..., :20], 0.25)
    torch.testing.assert_close(ext.decode_attention(q, k, v, mask, 0.25), cut, atol=1e-6, rtol=1e-6)
    mask[:, :, 1] = torch.finfo(torch.float32).min  # every key of the second row masked
    out = ext.decode_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, _reference(q, k, v, mask, 0.25), atol=2e-6, rtol=1e-5)


def test_a_mask_per_head_and_batch_row_is_read_where_it_lies():
    """A mask of [B, H, T, S] (not shared over heads), and a float32 mask of a bf16 call."""
    q, k, v, _ = _inputs(2, 4, 2, 3, 21, 16, torch.float32, seed=4)
    attend = torch.rand(2, 4, 3, 21, generator=torch.Generator().manual_seed(5)) < 0.6
    attend[..., 0] = True
    out = G.extension().decode_attention(q, k, v, attend, 0.25)
    torch.testing.assert_close(out, _reference(q, k, v, attend, 0.25), atol=2e-6, rtol=1e-5)
    additive = torch.zeros(2, 4, 3, 21).masked_fill(~attend, torch.finfo(torch.float32).min)
    b16 = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(
        G.extension().decode_attention(*b16, additive, 0.25), G.extension().decode_attention(*b16, attend, 0.25)
    )


def test_the_compiled_graphs_operators_declare_what_they_compute():
    """The operators a compiled graph calls (``entmtp_hf_cpu::gemv``, ``entmtp_hf_cpu::decode_attention``):
    their schemas and shape functions agree with their kernels; the product falls back to
    ``F.linear`` on what the kernel does not take."""
    q, k, v, mask = _inputs(1, 9, 3, 2, 40, 64, torch.bfloat16, boolean=True)
    ops = torch.ops.entmtp_hf_cpu
    torch.library.opcheck(
        ops.decode_attention.default, (q, k, v, mask, 0.125), test_utils=("test_schema", "test_faketensor")
    )
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(1, 3, 24, generator=g), torch.randn(10, 24, generator=g), torch.randn(10, generator=g)
    for args in ((x, w, b), (x.bfloat16(), w.bfloat16(), None)):
        torch.library.opcheck(ops.gemv.default, args, test_utils=("test_schema", "test_faketensor"))
        torch.testing.assert_close(ops.gemv(*args), F.linear(*args), atol=1e-2, rtol=1e-2)
    for args in ((x.double(), w.double(), b.double()), (x, w.t().contiguous().t(), None)):  # float64, a strided weight
        assert torch.equal(ops.gemv(*args), F.linear(*args))


def test_the_op_checks_its_inputs():
    q, k, v, mask = _inputs(1, 4, 2, 1, 8, 16, torch.float32)
    ext = G.extension()
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        ext.decode_attention(q[:, :3], k, v, mask, 0.25)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.decode_attention(q, k.double(), v, mask, 0.25)
    with pytest.raises(RuntimeError, match="mask must be"):
        ext.decode_attention(q, k, v, mask[..., :5], 0.25)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.decode_attention(q[..., :12], k[..., :12], v[..., :12], mask, 0.25)


def test_compiled_graphs_take_it_for_a_few_tokens_where_it_is_built(monkeypatch):
    q, k, v, _ = _inputs(1, 4, 2, 3, 8, 16, torch.float32)
    assert A.graph_attention() == A.KERNEL and G.kernel_takes(q, k, v)
    assert not G.kernel_takes(q.double(), k.double(), v.double())  # float64 stays on sdpa
    assert not G.kernel_takes(q[..., :12], k[..., :12], v[..., :12])
    assert not G.kernel_takes(torch.zeros(1, 4, G.KERNEL_MAX_TOKENS + 1, 16), k, v)
    monkeypatch.setattr(G, "unavailable", lambda: "no compiler")
    assert A.graph_attention() == "sdpa"


def test_a_saved_graphs_key_holds_what_it_attends_with(tiny_cache, monkeypatch):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    key = precompiled.artifact_key(model, (), {})
    monkeypatch.setattr(precompiled, "graph_attention", lambda: "sdpa")
    assert precompiled.artifact_key(model, (), {}) != key


@pytest.mark.slow
def test_compiled_bf16_decoding_attends_with_the_kernel_and_stays_lossless(tiny_cache, tmp_path, monkeypatch):
    """Compiled plain decoding and compiled EntMTP of a bfloat16 model on the same kernels (gemv
    products, the graphs unfrozen; the decode attention), both called by the graphs as the extension's
    operators, give the same greedy tokens; a graph's products run the kernel chosen for its row count
    in every call, inside an EntMTP call or not (float32: ``test_compiled_decoding``, against eager
    plain ``generate``)."""
    dtype = torch.bfloat16
    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "gemv") for c in choices})
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model, heads = tiny_cache("llama", "hydra", "mlp")
    model, heads = copy.deepcopy(model).to(dtype), copy.deepcopy(heads).to(dtype)
    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1, pack=False)
    assert "gemv" in K.kernels_of(model).kinds()
    config = EntMTPConfig(tree=Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    greedy, fast = dict(max_new_tokens=20, do_sample=False), compiled_generation(max_cache_len=64)
    with K.kernels_of(model).applied():
        plain, calls = extension_calls(lambda: model.generate(ids, **greedy, **fast))
    layers = model.config.num_hidden_layers
    assert {q[2] for q in calls["decode_attention"]} == {1} and len(calls["decode_attention"]) >= layers
    assert {x[-2] for x in calls["gemv"]} == {1} and len(calls["gemv"]) >= 7 * layers  # every product
    again, calls = extension_calls(lambda: model.generate(ids, **greedy, **fast))  # outside an EntMTP call
    assert torch.equal(again, plain) and len(calls["gemv"]) >= 7 * layers
    out, calls = extension_calls(lambda: model.generate(ids, **greedy, **fast, entmtp_config=config))
    assert torch.equal(out, plain)
    assert max(q[2] for q in calls["decode_attention"]) > 1  # the trees' verification attended with the kernel
    assert max(x[-2] for x in calls["gemv"]) > 1  # and multiplied on it


def test_the_drafters_few_query_attention_runs_on_it_and_computes_sdpas():
    """An EAGLE drafter layer's attention (a few queries, no gradient wanted) runs on the kernel and
    computes what ``sdpa`` does; training (a gradient wanted) and float64 stay on ``sdpa``."""
    from types import SimpleNamespace

    from entmtp_hf.heads.eagle import DraftAttention

    config = SimpleNamespace(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    attention = DraftAttention(config, 48)
    q_tokens, keys = 3, 40
    x = torch.randn(2, q_tokens, 48)
    angle = torch.randn(q_tokens, 16)
    cos, sin = angle.cos(), angle.sin()
    _, k, v, mask = _inputs(2, 6, 2, q_tokens, keys, 16, torch.float32, seed=4)
    mask = mask[:, 0]  # the drafter's [B, Q, K]

    def reference() -> torch.Tensor:
        q = attention.queries(x, cos, sin)
        return attention.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True))

    with torch.no_grad():
        out, calls = extension_calls(lambda: attention(x, cos, sin, k, v, mask))
        want = reference()
    assert calls.get("decode_attention")
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    trained, calls = extension_calls(lambda: attention(x, cos, sin, k, v, mask))
    assert trained.requires_grad and "decode_attention" not in calls
    torch.testing.assert_close(trained.detach(), want, atol=2e-6, rtol=1e-5)
    attention.double()
    x, cos, sin, k, v, mask = (t.double() for t in (x, cos, sin, k, v, mask))
    with torch.no_grad():
        out, calls = extension_calls(lambda: attention(x, cos, sin, k, v, mask))
        assert "decode_attention" not in calls and torch.equal(out, reference())
