"""Scheduler features and policies, without a model."""

import math

import pytest
import torch

from entmtp_hf.scheduling.features import (
    FEATURES,
    FeatureTracker,
    best_path_value,
    ema,
    path_values,
    threshold,
    top1_and_entropy,
    tree_values,
)
from entmtp_hf.scheduling.policies import Scheduler
from entmtp_hf.trees.tree import Tree


def test_path_values_and_best_path_value():
    assert path_values(0.5, [0.5, 0.2]) == pytest.approx([0.25, 0.05])
    assert best_path_value(0.5, [0.5, 0.2]) == pytest.approx(0.5)
    assert best_path_value(0.9, []) == pytest.approx(0.9)


def test_top1_and_entropy_against_formula():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    top1, h = top1_and_entropy(logits)
    assert top1.item() == pytest.approx(p.max().item())
    assert h.item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    # a one-hot distribution has zero entropy and no NaN
    top1, h = top1_and_entropy(torch.tensor([0.0, -float("inf"), -float("inf")]))
    assert top1.item() == 1.0 and h.item() == pytest.approx(0.0)


def test_ema():
    assert ema(None, 3.0, 4) == 3.0
    assert ema(1.0, 3.0, 3) == pytest.approx(0.5 * 3 + 0.5 * 1)


def test_feature_tracker_values():
    f = FeatureTracker("chain_value")
    assert f.value(0.5, 1.0, [0.5, 0.5]) == pytest.approx(0.125)
    f = FeatureTracker("confidence")
    assert f.value(0.5, 2.0, []) == pytest.approx(math.exp(-2.0))
    f = FeatureTracker("head_confidence")
    assert f.value(0.9, 1.0, [0.3, 0.8]) == pytest.approx(0.3)  # head 0's top-1, not the base's
    assert f.value(0.9, 1.0, []) == pytest.approx(0.9)  # no chain: the base's
    f = FeatureTracker("accept_ema", window=1)
    f.observe_accept(3)
    assert f.value(0.5, 2.0, []) == 3.0
    with pytest.raises(ValueError, match="unknown scheduler feature"):
        FeatureTracker("nope")


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("chain", [[0.3, 0.8], []])
def test_reads_base_says_whether_the_value_depends_on_the_verifier(name, chain):
    """The decode loop skips the verifier's softmax when ``reads_base`` is False: the feature's
    value must then be the same whatever the verifier's top-1 probability and entropy are."""

    def values(p0: float, entropy: float) -> list[float]:
        f = FeatureTracker(name, window=2)
        f.observe_accept(2)
        return [f.value(p0, entropy, chain) for _ in range(3)]

    depends = values(0.9, 0.2) != values(0.4, 2.5)
    assert depends == FeatureTracker(name).reads_base(drafted=bool(chain))


def test_threshold_maps_the_probability_grid_to_each_feature():
    assert threshold("head_confidence", 0.4, 4) == 0.4
    assert threshold("accept_ema", 0.0, 4) == 1.0 and threshold("accept_ema", 1.0, 4) == 5.0  # 1 .. depth + 1
    assert threshold("accept_ema", 0.25, 4) == pytest.approx(2.0)


def test_static_policy_never_moves():
    s = Scheduler("static", num_trees=3, static_index=2)
    assert [s.choose(x) for x in (0.0, 0.5, 1.0)] == [2, 2, 2]


def test_hysteresis_switches_with_band():
    s = Scheduler("hysteresis", num_trees=2, low=0, high=1, tau_on=0.5, tau_off=0.2)
    seq = [0.1, 0.6, 0.4, 0.3, 0.2, 0.3, 0.51, 0.21]
    assert [s.choose(x) for x in seq] == [0, 1, 1, 1, 0, 0, 1, 1]


def test_ladder_bins():
    s = Scheduler("ladder", num_trees=3, thresholds=(0.1, 0.5))
    assert [s.choose(x) for x in (0.05, 0.1, 0.2, 0.5, 0.9)] == [0, 0, 1, 1, 2]


def test_tree_values_sum_path_values_per_tree():
    # union: root, a=(0,) p=.6, b=(1,) p=.3, c=(0,0) p=.5 ; trees: chain {a, c}, fan {a, b}
    tree = Tree.from_choices([[0], [1], [0, 0]])
    index = tree.node_index()
    probs = torch.ones(tree.num_nodes, dtype=torch.float64)
    probs[index[(0,)]], probs[index[(1,)]], probs[index[(0, 0)]] = 0.6, 0.3, 0.5
    members = torch.zeros(2, tree.num_nodes)
    members[0, [index[(0,)], index[(0, 0)]]] = 1
    members[1, [index[(0,)], index[(1,)]]] = 1
    values = tree_values(probs, tree.buffers().ancestors, members)
    assert values.tolist() == pytest.approx([0.6 + 0.6 * 0.5, 0.6 + 0.3])


def test_value_policy_weighs_value_by_cost():
    s = Scheduler("value", num_trees=3, costs=(1.0, 1.0, 1.5))
    assert s.choose([0.9, 0.8, 1.5]) == 0
    assert s.choose([0.5, 0.8, 1.5]) == 1  # 1.8 vs 2.5 / 1.5 = 1.67
    assert s.choose([0.5, 0.8, 2.0]) == 2  # 3 / 1.5 = 2
    assert s.choose([0.7, 0.7, 0.0]) == 0  # ties go to the earlier tree
    assert not s.needs_feature


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="bogus", num_trees=1), "unknown policy"),
        (dict(policy="hysteresis", num_trees=2, high=1, tau_on=0.1, tau_off=0.2), "tau_off"),
        (dict(policy="ladder", num_trees=3, thresholds=(0.5,)), "needs 2 thresholds"),
        (dict(policy="ladder", num_trees=3, thresholds=(0.5, 0.1)), "strictly increasing"),
        (dict(policy="static", num_trees=2, static_index=2), "not a tree index"),
        (dict(policy="value", num_trees=2, costs=(1.0,)), "one positive cost per tree"),
        (dict(policy="value", num_trees=2, costs=(1.0, -1.0)), "one positive cost per tree"),
    ],
)
def test_invalid_scheduler(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(**kwargs)
