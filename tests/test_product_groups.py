"""Compiled graphs' int8 products of one input grouped into one call (``decoding.product_groups``)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from entmtp_hf import gemv as G
from entmtp_hf.decoding.product_groups import ProductGroups, group_products

pytestmark = pytest.mark.skipif(
    G.unavailable() is not None, reason=f"the package's CPU kernels are off here: {G.unavailable()}"
)


def _weights(sizes: tuple[int, ...], k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        out += [
            torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            torch.rand(n, generator=g).bfloat16() / 64,
        ]
    return out


def _layer(x, y, q0, s0, q1, s1, q2, s2, q3, s3):
    """Three products of x (q, k, v), one of y (o): as a decoder layer's graph calls them."""
    op = torch.ops.entmtp_hf_cpu.gemv_int8
    return op(x, q0, s0, None) + 1, op(x, q1, s1, None) * 2, op(x, q2, s2, None), op(y, q3, s3, None)


def test_products_of_one_input_become_one_call_and_keep_their_values(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    G.extension()  # registers the operators
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 3, 64, generator=g).bfloat16(), torch.randn(1, 3, 32, generator=g).bfloat16()
    weights = _weights((64, 16, 16), 64, 1) + _weights((64,), 32, 2)
    compiled = torch.compile(_layer, dynamic=False, options={"post_grad_custom_post_pass": ProductGroups()})
    out, code = run_and_get_code(compiled, x, y, *weights)
    assert all(torch.equal(o, e) for o, e in zip(out, _layer(x, y, *weights)))
    text = "\n".join(code)
    assert text.count("torch.ops.entmtp_hf_cpu.gemv_int8_group.default(") == 1
    assert text.count("torch.ops.entmtp_hf_cpu.gemv_int8.default(") == 1  # y's product stays alone


def test_a_weight_made_after_the_first_product_is_left_out():
    """The group call stands where the first product stood, so a product whose weight is computed
    later stays a call of its own (a graph's weights are its inputs; this is the general case)."""
    G.extension()
    op = torch.ops.entmtp_hf_cpu.gemv_int8

    def late(x, q0, s0, q1, s1, q2, s2):
        first = op(x, q0, s0, None)
        return first, op(x, q1, s1, None), op(x, q2 + first.sum().to(torch.int8), s2, None)

    x = torch.randn(1, 2, 32).bfloat16()
    graph = make_fx(late, tracing_mode="fake")(x, *_weights((8, 8, 8), 32, 3)).graph
    assert group_products(graph) == 1  # the first two grouped, the third left
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.entmtp_hf_cpu.gemv_int8_group.default) == 1
    assert targets.count(torch.ops.entmtp_hf_cpu.gemv_int8.default) == 1


def test_the_pass_is_part_of_the_cache_keys_and_stable():
    """Inductor keys its caches on ``uuid``, the saved graphs' names on ``repr``: the same in every process."""
    assert ProductGroups().uuid() == ProductGroups().uuid() and repr(ProductGroups()) == repr(ProductGroups())
    assert ProductGroups() == ProductGroups() and hash(ProductGroups()) == hash(ProductGroups())
