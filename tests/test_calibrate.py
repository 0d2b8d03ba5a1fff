"""``entmtp-hf calibrate``'s pieces: a bank's frontier merged in, the search machine's costs, the clock check."""

from __future__ import annotations

import pytest
import torch
from test_generation import enabled
from tiny import VOCAB

from entmtp_hf import TopologyBank, Tree
from entmtp_hf.costs.retrieval import RETRIEVAL_OPTIONS
from entmtp_hf.costs.table import CostTable
from entmtp_hf.tools.calibrate import check_against_clock, frontier_of, search_machine_costs
from entmtp_hf.tools.search.config import SearchConfig
from entmtp_hf.tools.search.runner import TreeSearch

FAN4 = Tree.from_choices([[0], [1], [2]])


def searched_bank() -> TopologyBank:
    """A bank as a search writes it: timed trees with the search machine's figures, a value fan."""
    trees = [Tree.root_only(), Tree.chain(1), FAN4, Tree.chain(3)]
    per_tree = [
        {"num_nodes": 1, "mean_accept_length": 1.0, "tokens_per_s": 20.0, "relative_forward_cost": 1.0},
        {"num_nodes": 2, "mean_accept_length": 1.5, "tokens_per_s": 27.0, "relative_forward_cost": 1.05},
        {"num_nodes": 4, "name": "fan-4"},
        {"num_nodes": 4, "mean_accept_length": 2.0, "tokens_per_s": 30.0, "relative_forward_cost": 1.2},
    ]
    scheduler = {
        "static": 3,
        "conservative": 1,
        "aggressive": 3,
        "policy": "static",
        "ladder": [0, 1, 3],
        "thresholds": [0.2, 0.4],
        "value": [1, 2],
        "value_costs": [1.05, 1.2],
    }
    return TopologyBank(
        "t", trees, {"trees": per_tree, "scheduler": scheduler, "calibration": {"vanilla_tokens_per_s": 20.0}}
    )


def test_a_frontier_merges_in_and_every_index_follows():
    bank = searched_bank()
    frontier = [Tree.root_only(), Tree.chain(1), Tree.chain(2), Tree.chain(3)]
    merged = bank.with_frontier(frontier, [1.0, 1.4, 1.8, 2.1], source={"source": "test"})
    sizes = [t.num_nodes for t in merged.trees]
    assert sizes == sorted(sizes) and len(merged.trees) == 5  # the chain of 3 nodes is new
    by_tree = {t: k for k, t in enumerate(merged.trees)}
    sched = merged.scheduler
    assert merged.trees[sched.static] == Tree.chain(3) and merged.trees[sched.conservative] == Tree.chain(1)
    assert [merged.trees[k] for k in sched.value] == [Tree.chain(1), FAN4]
    assert merged.frontier == {by_tree[t]: a for t, a in zip(frontier, [1.0, 1.4, 1.8, 2.1])}
    info = merged.metadata["trees"][by_tree[Tree.chain(1)]]
    assert info["mean_accept_length"] == 1.4 and info["measured_accept_length"] == 1.5 and info["tokens_per_s"] == 27.0
    assert merged.metadata["frontier"]["source"] == "test"
    # a second frontier: the timed trees keep the search's measurement, the others hold estimates only
    again = merged.with_frontier(frontier, [1.0, 1.3, 1.7, 2.0]).metadata["trees"]
    measured = {
        merged.trees[k]: i["measured_accept_length"] for k, i in enumerate(again) if "measured_accept_length" in i
    }
    assert measured == {Tree.chain(1): 1.5, Tree.chain(3): 2.0, Tree.root_only(): 1.0}
    with pytest.raises(ValueError, match="one accept length"):
        bank.with_frontier(frontier, [1.0])


def test_the_search_machines_costs_come_back_from_its_timed_runs():
    bank = searched_bank()
    costs = search_machine_costs(bank)
    assert costs.plain_ms == pytest.approx(50.0) and costs.forward(4) == pytest.approx(60.0)
    for tree, tau, tps in ((Tree.chain(1), 1.5, 27.0), (Tree.chain(3), 2.0, 30.0)):  # the fit reproduces them
        assert 1e3 * tau / costs.step(tree) == pytest.approx(tps, rel=0.05)
    frontier = bank.with_frontier([Tree.root_only(), Tree.chain(1), Tree.chain(3)], [1.0, 1.5, 2.0])
    assert search_machine_costs(frontier) is not None  # the measured figures are kept aside
    assert search_machine_costs(TopologyBank("t", [Tree.chain(1)])) is None


def test_frontier_of_the_first_two_search_stages(tiny_cache, tmp_path):
    model = enabled(tiny_cache)
    prompts = [torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    cfg = SearchConfig(num_prompts=3, max_new_tokens=12, budget=8)
    search = TreeSearch(model, model.entmtp_heads, prompts, tmp_path, cfg, task="t", progress=False)
    trees, accept, info, source = frontier_of(search)
    full = [k for k, i in enumerate(info) if "max_depth" not in i]
    assert full == list(range(8)) and [t.num_nodes for t in trees[:8]] == list(range(1, 9)) and accept[0] == 1.0
    assert all(set(trees[k].paths) < set(trees[k + 1].paths) for k in range(7))  # nested: each adds one node
    assert accept[7] >= accept[1] > 1.0 and "3 calibration prompts" in source["source"]
    # the shallower frontiers: trees the full one lacks, none deeper than its cap, none twice
    deepest = max(t.depth for t in trees[:8])
    assert source["depth_caps"] == [c for c in (1, 2, 3) if c < deepest] and len(trees) > 8
    assert len(set(trees)) == len(trees)
    for tree, tau, extra in zip(trees[8:], accept[8:], info[8:]):
        assert tree.depth <= extra["max_depth"] < deepest and tau >= 1.0
        assert extra["name"] == f"frontier-{tree.num_nodes}-depth{extra['max_depth']}"
    fans = [t for t, i in zip(trees, info) if i.get("max_depth") == 1]
    assert fans and all(t.depth == 1 for t in fans)
    # every tree replayed with every retrieval setting over the same text (the same tokens, in
    # at least one step per prompt); the bank takes the figures and their settings
    assert set(source["retrieval"]) == set(RETRIEVAL_OPTIONS)
    assert all(set(extra["retrieval"]) == set(RETRIEVAL_OPTIONS) for extra in info)
    replayed = [f for extra in info for f in extra["retrieval"].values()]
    assert len({f["tokens"] for f in replayed}) == 1 and all(f["drafted"] + sum(f["found"]) >= 3 for f in replayed)
    bank = TopologyBank("t", [Tree.root_only()]).with_frontier(trees, accept, info, source)
    options, figures = bank.retrieval_figures
    assert set(options) == set(RETRIEVAL_OPTIONS) and len(figures) == len(trees)


def test_the_check_times_the_best_trees_against_plain_decoding(tiny_cache):
    model = enabled(tiny_cache)
    bank = TopologyBank(
        "t",
        [Tree.root_only(), Tree.chain(1), Tree.chain(2)],
        {"trees": [{"mean_accept_length": a} for a in (1.0, 1.6, 2.0)], "frontier": {"trees": [0, 1, 2]}},
    )
    table = CostTable({"key": "m"}, "x", {1: 10.0, 3: 10.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 10.0)
    prompts = [torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    check = check_against_clock(model, bank, table, prompts, top=2, max_new_tokens=8)
    assert set(check["trees"]) == {1, 2} and check["chosen"] == 2 and check["prompts"] == 2
    assert check["ratio_lost"] >= 1.0 and all(r["measured"] > 0 for r in check["trees"].values())


def test_the_check_and_the_cost_table_at_a_batch_size(tiny_cache):
    import dataclasses

    from entmtp_hf.tools.bench.batched import batch_inputs
    from entmtp_hf.tools.calibrate import forward_cost_lines

    model = enabled(tiny_cache)
    bank = TopologyBank(
        "t",
        [Tree.root_only(), Tree.chain(1), Tree.chain(2)],
        {"trees": [{"mean_accept_length": a} for a in (1.0, 1.6, 2.0)], "frontier": {"trees": [0, 1, 2]}},
    )
    one = CostTable({"key": "m"}, "x", {1: 10.0, 3: 10.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 10.0)
    two = dataclasses.replace(one, forward_ms={1: 12.0, 3: 18.0}, plain_ms=12.0, batch_size=2)
    g = torch.Generator().manual_seed(0)
    groups = [
        batch_inputs([torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 6)], 0, "cpu") for _ in range(2)
    ]
    check = check_against_clock(model, bank, two, groups, top=2, max_new_tokens=8)
    assert set(check["trees"]) == {1, 2} and check["prompts"] == 2
    assert all(r["measured"] > 0 for r in check["trees"].values())
    lines = forward_cost_lines([one, two])
    assert "| 1 | 1.00 | 1.00 | 10.0 |" in lines and "| 2 | 1.00 | 1.50 | 12.0 |" in lines


def test_the_clock_chooses_each_batch_sizes_tree(tiny_cache, tmp_path, monkeypatch):
    import dataclasses

    import entmtp_hf.tools.calibrate as calibrate_module
    from entmtp_hf.tools.calibrate import time_batch_sizes, timed_choice

    model = enabled(tiny_cache)
    bank = TopologyBank(
        "t",
        [Tree.root_only(), Tree.chain(1), Tree.chain(2)],
        {
            "trees": [{"mean_accept_length": a} for a in (1.0, 1.6, 2.0)],
            "frontier": {"trees": [0, 1, 2]},
            "scheduler": {"static": 2, "policy": "static"},
        },
    )
    one = CostTable({"key": "m"}, "x", {1: 10.0, 3: 10.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 10.0)
    four = dataclasses.replace(one, batch_size=4)
    slow = {"trees": {1: {"measured": 0.9}, 2: {"measured": 0.8}}, "fastest_measured": 1}
    fast = {"trees": {1: {"measured": 1.3}, 2: {"measured": 1.1}}, "fastest_measured": 1}
    chosen = timed_choice(timed_choice(bank, one, fast), four, slow)
    assert chosen.scheduler_for(one).static == 1  # the fastest timed tree
    assert chosen.scheduler_for(four).static == 0  # nothing beat plain batched decoding: the root alone
    # end to end, on the tiny model with its prompts stubbed (the probe's tables injected)
    bank.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        calibrate_module,
        "measure_costs",
        lambda m, h, batch_sizes: {b: dataclasses.replace(one, batch_size=b) for b in batch_sizes},
    )
    monkeypatch.setattr(
        calibrate_module,
        "_calibration_inputs",
        lambda tok, task, n: ([torch.randint(1, VOCAB, (5,), generator=g).tolist() for _ in range(n)], []),
    )
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": None})()
    timed = time_batch_sizes(
        model, model.entmtp_heads, tok, [tmp_path], "t", [1, 2], top=2, prompts_per_size=1, max_new_tokens=6
    )
    assert set(timed) == {1, 2} and all(r["prompts"] == 1 for r in timed.values())
    saved = TopologyBank.from_pretrained(tmp_path, task="t")
    assert {t.batch_size for t in saved.machine_tables()} == {1, 2}
