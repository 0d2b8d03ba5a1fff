"""The profiler: forward costs by size, the step breakdown and the analytic bound."""

import pytest
import torch
from tiny import VOCAB

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.costs.table import interpolate
from entmtp_hf.integration import HEADS_ATTR, enable_entmtp
from entmtp_hf.tools.profile import (
    analytic_bound,
    forward_costs,
    kernel_reference,
    linear_costs,
    relative_cost,
    step_breakdown,
)


def test_forward_costs_time_every_size_and_leave_the_cache_alone(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    costs = forward_costs(model, sizes=(1, 3, 8), prefix_len=16, repeats=2, heads=heads)
    assert sorted(costs) == [1, 3, 8] and all(v > 0 for v in costs.values())


def test_relative_cost_interpolates_between_timed_sizes():
    costs = {1: 0.1, 4: 0.2, 8: 0.4}
    assert relative_cost(costs, 1) == 1.0 and relative_cost(costs, 4) == pytest.approx(2.0)
    assert relative_cost(costs, 6) == pytest.approx(3.0)  # halfway between 2 and 4
    assert relative_cost(costs, 12) == pytest.approx(6.0)  # beyond the last size: the last two sizes' slope
    with pytest.raises(ValueError, match="for 0 nodes"):
        relative_cost(costs, 0)
    with pytest.raises(ValueError, match=r"measured: \[1\]"):
        interpolate({1: 1.0}, 2)


def test_linear_costs_time_every_weight_shape(tiny_cache):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    costs = linear_costs(model, rows=(1, 4), repeats=2)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(costs) == len(shapes) and all(set(per) == {1, 4} and min(per.values()) > 0 for per in costs.values())


def test_analytic_bound_is_tau_over_cost():
    rows = analytic_bound([{"num_nodes": 4, "mean_accept_length": 3.0}, {"num_nodes": 8}], {1: 0.1, 4: 0.2, 8: 0.4})
    assert rows == [
        {"num_nodes": 4, "mean_accept_length": 3.0, "relative_cost": pytest.approx(2.0), "bound": pytest.approx(1.5)}
    ]


def test_the_bound_over_a_faster_plain_step_scales_by_its_time():
    rows = analytic_bound([{"num_nodes": 4, "mean_accept_length": 3.0}], {1: 0.1, 4: 0.2}, reference=0.6)
    assert rows[0]["bound"] == pytest.approx(1.5) and rows[0]["bound_over_reference"] == pytest.approx(0.9)


def test_kernel_reference_times_both_plain_steps_and_leaves_the_cache_alone(tiny_cache):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    ref = kernel_reference(model, prefix_len=12, repeats=2)
    assert set(ref) == {"model", "onednn"} and min(ref.values()) > 0
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_step_breakdown_parts_add_up(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    b = step_breakdown(model, ids, EntMTPConfig(tree=[[0], [0, 0]]), max_new_tokens=20)
    assert b["steps"] > 0 and b["mean_tree_nodes"] == 3.0
    parts = ("draft_ms", "forward_ms", "accept_ms", "commit_ms", "other_ms")
    assert all(b[p] > 0 for p in parts[:-1]) and b["other_ms"] >= 0
    assert sum(b[p] for p in parts) == pytest.approx(b["ms_per_step"], rel=1e-6)
    torch.manual_seed(0)
    sampled = step_breakdown(model, ids, EntMTPConfig(tree=[[0], [0, 0]]), max_new_tokens=20, temperature=0.7)
    assert sampled["steps"] > 0
    assert sum(sampled[p] for p in parts) == pytest.approx(sampled["ms_per_step"])


def test_the_report_shows_the_kernel_reference_and_both_bounds():
    from entmtp_hf.tools.profile import _markdown

    report = {
        "forward_costs_ms": {"1": 40.0, "4": 44.0},
        "breakdown": {},
        "kernel_reference_ms": {"model": 40.0, "onednn": 28.0},
        "bound": {"t": analytic_bound([{"num_nodes": 4, "mean_accept_length": 2.2}], {1: 40.0, 4: 44.0}, 0.7)},
    }
    md = _markdown(report)
    assert "40.0 ms with the model's own kernels and 28.0 ms" in md and "0.70 of it" in md
    assert "| 4 | 2.20 | 1.10 | 2.00x | 1.40x |" in md


class _TinyLM(torch.nn.Module):
    """Input embeddings and an LM head, found as transformers' models expose them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_the_weights_bytes_count_a_tied_matrix_once_and_an_untied_table_not_at_all():
    from entmtp_hf.tools.profile import weight_bytes

    model = _TinyLM()
    model.head.weight = model.embed.weight  # tied, as the demo model's LM head is
    assert weight_bytes(model) == 10 * 4 * 4
    model.head.weight = torch.nn.Parameter(torch.zeros(10, 4, dtype=torch.bfloat16))
    assert weight_bytes(model) == 10 * 4 * 2  # a forward reads one row of the untied table per token
    setattr(model, HEADS_ATTR, torch.nn.Linear(4, 4))  # an enabled model's drafter: not the plain forward's
    assert weight_bytes(model) == 10 * 4 * 2
    plain = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    assert weight_bytes(plain) == 10 * 4 * 4 * 2  # no embeddings to tell apart: every weight counts


def test_the_physical_bound_is_the_weights_over_the_bandwidth_and_the_report_compares_each_run():
    from entmtp_hf.tools.profile import _markdown, physical_bound, read_bandwidth

    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB
    phys = physical_bound(model, forward_s=0.004, bandwidth=2e9)
    assert phys["bound_ms"] == pytest.approx(2.0) and phys["forward_over_bound"] == pytest.approx(2.0)
    assert read_bandwidth(megabytes=8, repeats=2) > 0
    step = {"mean_tree_nodes": 3, "mean_accept_length": 2.0, "ms_per_step": 6.0, "draft_ms": 1, "forward_ms": 4}
    step |= {"accept_ms": 0.2, "commit_ms": 0.3, "other_ms": 0.5, "draft_share": 0.17, "other_share": 0.08}
    report = {"forward_costs_ms": {"1": 4.0}, "breakdown": {"gsm8k static": step}, "physical_bound": phys}
    report |= {"path": "compiled", "precision": "bf16"}
    md = _markdown(report)
    assert md.startswith("Profile of the compiled path, bf16.")
    assert "(4 MB) read once at this process's measured read bandwidth (2.0 GB/s) take 2.0 ms" in md
    assert "| gsm8k static | 3.0 | 1.50x |" in md  # 6 ms a step over 2 tokens, against 2 ms a token
