"""The profiler: forward costs by size, the step breakdown and the analytic bound."""

import pytest
import torch

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.generation import enable_entmtp
from entmtp_hf.profile import analytic_bound, forward_costs, interpolate_cost, linear_costs, relative_cost, step_breakdown
from tiny import VOCAB


def test_forward_costs_time_every_size_and_leave_the_cache_alone(tiny_cache):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    costs = forward_costs(model, sizes=(1, 3, 8), prefix_len=16, repeats=2)
    assert sorted(costs) == [1, 3, 8] and all(v > 0 for v in costs.values())


def test_relative_cost_interpolates_between_timed_sizes():
    costs = {1: 0.1, 4: 0.2, 8: 0.4}
    assert relative_cost(costs, 1) == 1.0 and relative_cost(costs, 4) == pytest.approx(2.0)
    assert relative_cost(costs, 6) == pytest.approx(3.0)  # halfway between 2 and 4
    assert relative_cost(costs, 12) == pytest.approx(6.0)  # beyond the last size: the last two sizes' slope
    with pytest.raises(ValueError, match="tree of 0 nodes"):
        relative_cost(costs, 0)
    with pytest.raises(ValueError, match=r"measured: \[1\]"):
        interpolate_cost({1: 1.0}, 2)


def test_linear_costs_time_every_weight_shape(tiny_cache):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    costs = linear_costs(model, rows=(1, 4), repeats=2)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(costs) == len(shapes) and all(set(per) == {1, 4} and min(per.values()) > 0 for per in costs.values())


def test_analytic_bound_is_tau_over_cost():
    rows = analytic_bound([{"num_nodes": 4, "mean_accept_length": 3.0}, {"num_nodes": 8}], {1: 0.1, 4: 0.2, 8: 0.4})
    assert rows == [{"num_nodes": 4, "mean_accept_length": 3.0, "relative_cost": pytest.approx(2.0), "bound": pytest.approx(1.5)}]


def test_step_breakdown_parts_add_up(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    b = step_breakdown(model, ids, EntMTPConfig(tree=[[0], [0, 0]]), max_new_tokens=20)
    assert b["steps"] > 0 and b["mean_tree_nodes"] == 3.0
    assert b["draft_ms"] > 0 and b["forward_ms"] > 0 and b["other_ms"] >= 0
    assert b["draft_ms"] + b["forward_ms"] + b["other_ms"] == pytest.approx(b["ms_per_step"], rel=1e-6)
    assert b["observe_ms"] > 0 and b["draft_ms"] == pytest.approx(b["propose_ms"] + b["observe_ms"])
    torch.manual_seed(0)
    sampled = step_breakdown(model, ids, EntMTPConfig(tree=[[0], [0, 0]]), max_new_tokens=20, temperature=0.7)
    assert sampled["steps"] > 0
    assert sampled["draft_ms"] + sampled["forward_ms"] + sampled["other_ms"] == pytest.approx(sampled["ms_per_step"])
