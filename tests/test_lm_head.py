"""Verification logits from the last hidden states: the same product in either layout, checked
against the model's own logits, and greedy decoding unchanged whichever layout runs."""

import pytest
import torch

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.generation import disable_entmtp, enable_entmtp
from entmtp_hf.lm_head import LAYOUTS, LOGITS_ATTR, TreeLogits, project, tree_forward
from entmtp_hf.tree import MC_SIM_7B_63
from tiny import VOCAB


@pytest.fixture
def tiny(tiny_cache):
    """The shared tiny model with heads, re-enabled afterwards (tests here replace its TreeLogits)."""
    model, heads = tiny_cache("llama", "hydra", "mlp")
    yield enable_entmtp(model, heads)
    enable_entmtp(model, heads)


def _head(rows: int = 40, hidden: int = 8, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(hidden, rows, bias=bias).double()


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_layouts_compute_the_same_product(n):
    head = _head()
    h = torch.randn(n, 8, dtype=torch.float64)
    want = h @ head.weight.T
    for layout in LAYOUTS:
        got = project(h, head.weight, layout)
        assert got.shape == (n, 40) and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="unknown layout"):
        project(h, head.weight, "blocked")


def test_each_row_count_is_timed_once_and_one_row_keeps_the_models_layout():
    logits = TreeLogits(_head(), repeats=2)
    assert logits.layouts == {1: "linear"}
    h = torch.randn(3, 8, dtype=torch.float64)
    assert torch.allclose(logits(h), h @ logits.weight.T)
    assert set(logits.layouts) == {1, 3} and logits.layouts[3] in LAYOUTS
    logits.layouts[3] = "transposed"  # stored: a later call reads it and does not time again
    assert torch.allclose(logits(h), h @ logits.weight.T) and logits.layouts[3] == "transposed"


def test_bad_heads_and_settings_are_refused():
    with pytest.raises(ValueError, match="no bias"):
        TreeLogits(_head(bias=True))
    with pytest.raises(ValueError, match="repeats"):
        TreeLogits(_head(), repeats=0)
    with pytest.raises(ValueError, match="unknown layouts"):
        TreeLogits(_head(), layouts={2: "fast"})


def test_matches_only_the_plain_product():
    logits = TreeLogits(_head())
    h = torch.randn(8, dtype=torch.float64)
    plain = h @ logits.weight.T
    assert logits.matches(h, plain)
    assert not logits.matches(h, plain * 0.5)  # a logit scale
    assert not logits.matches(h, 3.0 * torch.tanh(plain / 3.0))  # soft-capping
    assert not logits.matches(h, plain[:-1])  # another vocabulary


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_forward_equals_the_models_forward(tiny, layout):
    ids = _ids(6)
    ref = tiny(input_ids=ids, output_hidden_states=-1)
    logits, hidden = tree_forward(tiny, TreeLogits(tiny.get_output_embeddings(), layouts={6: layout}), input_ids=ids)
    assert torch.allclose(logits, ref.logits[0], rtol=1e-10, atol=1e-10)
    assert torch.equal(hidden, ref.hidden_states[-1][0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_decoding_identical_in_either_layout(tiny, layout):
    setattr(tiny, LOGITS_ATTR, TreeLogits(tiny.get_output_embeddings(), layouts={n: layout for n in range(2, 65)}))
    for seed in range(3):
        ids = _ids(4 + seed, seed)
        ref = tiny.generate(ids, max_new_tokens=30, do_sample=False)
        out = tiny.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)


def test_a_model_whose_logits_are_not_the_plain_product_decodes_with_its_own(tiny):
    """The prefill check fails (here: a wrapped LM head adds a per-token offset that moves the
    argmax), so the loop keeps the model's logits and the output stays vanilla's."""
    head = tiny.get_output_embeddings()
    original = head.forward
    offsets = 3.0 * torch.randn(VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    head.forward = lambda x: original(x) + offsets
    try:
        ids = _ids(5, 7)
        ref = tiny.generate(ids, max_new_tokens=30, do_sample=False)
        out = tiny.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)
        h = tiny(input_ids=ids, output_hidden_states=-1)  # the prefill check is what catches it
        assert not getattr(tiny, LOGITS_ATTR).matches(h.hidden_states[-1][0, -1], h.logits[0, -1])
    finally:
        del head.forward


def test_enabling_again_keeps_the_timed_layouts(tiny, tiny_cache):
    """Swapping heads (as the benchmark does between methods) must not time the layouts again."""
    kept = getattr(tiny, LOGITS_ATTR)
    kept.layouts[3] = "transposed"
    enable_entmtp(tiny, tiny_cache("llama", "medusa", "mlp")[1])
    assert getattr(tiny, LOGITS_ATTR) is kept and kept.layouts[3] == "transposed"


def test_disable_removes_the_tree_logits(tiny):
    disable_entmtp(tiny)
    assert not hasattr(tiny, LOGITS_ATTR)
