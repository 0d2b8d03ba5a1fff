"""Retrieval branches priced on a machine: the figures a bank stores, their cost, the ranking's choice."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from entmtp_hf import FileFormatError, RetrievalConfig, TopologyBank, Tree
from entmtp_hf.costs.retrieval import RETRIEVAL_OPTIONS, RetrievalFigures, retrieval_label, retrieval_speedup
from entmtp_hf.costs.table import CostTable
from entmtp_hf.trees.retrieval import with_branch

FAN = Tree.from_choices([[0], [1]])  # 3 nodes, depth 1
TREES = [Tree.root_only(), Tree.chain(1), FAN]
REPLACE2, APPEND1 = RetrievalConfig(mode="replace", num_tokens=2), RetrievalConfig(mode="append", num_tokens=1)
OPTIONS = {"replace-2": dataclasses.asdict(REPLACE2), "append-1": dataclasses.asdict(APPEND1)}


def machine(forward: dict[int, float], draft=(2.0, 1.0, 0.5), key="m") -> CostTable:
    """Forward ms by size, drafting a + b·depth + c·(nodes - 1), a 1 ms overhead per step."""
    return CostTable({"key": key}, "x", forward, draft, (1.0, 0.0), forward[1])


def bank(figures: dict | None, scheduler: dict | None = None) -> TopologyBank:
    """Tree 1 (2 nodes) and the fan (3 nodes) on the frontier; the fan's figures under ``figures``."""
    per_tree = [
        {"num_nodes": 1, "mean_accept_length": 1.0},
        {"num_nodes": 2, "mean_accept_length": 1.4},
        {"num_nodes": 3, "mean_accept_length": 1.5},
    ]
    frontier = {"trees": [1, 2]}
    if figures is not None:
        per_tree[2]["retrieval"] = figures
        frontier["retrieval"] = OPTIONS
    return TopologyBank(
        "chat",
        TREES,
        {"trees": per_tree, "frontier": frontier, "scheduler": scheduler or {"static": 2, "policy": "static"}},
    )


def test_a_step_that_found_a_continuation_is_priced_by_the_mode():
    table = machine({1: 10.0, 2: 10.0, 3: 11.0, 4: 20.0, 5: 22.0})
    figures = RetrievalFigures(tokens=300, drafted=100, found=(20, 80))
    # replace: 100 fan steps as drafted, then chains of 1 and 2 tokens verified without drafting
    replace_ms = 100 * table.step(FAN) + 20 * (10.0 + 1.0) + 80 * (11.0 + 1.0)
    assert retrieval_speedup(table, FAN, REPLACE2, figures) == pytest.approx(300 * 10.0 / replace_ms)
    # append: the fan plus the branch, drafted (the heads still draft the fan)
    appended = RetrievalFigures(tokens=200, drafted=100, found=(50,))
    append_ms = 100 * table.step(FAN) + 50 * table.step(with_branch(FAN, 1)[0])
    assert with_branch(FAN, 1)[0].num_nodes == 4 and table.step(with_branch(FAN, 1)[0]) == 20.0 + 2.0 + 1.0 + 1.5 + 1.0
    assert retrieval_speedup(table, FAN, APPEND1, appended) == pytest.approx(200 * 10.0 / append_ms)
    assert [retrieval_label(c) for c in (None, REPLACE2, APPEND1)] == ["off", "replace-2", "append-1"]
    assert set(RETRIEVAL_OPTIONS) == {"replace-1", "replace-2", "replace-3", "append-1", "append-2"}


def test_the_ranking_takes_retrieval_where_it_pays_on_this_machine_and_drops_it_where_not():
    figures = {
        "replace-2": {"tokens": 200, "drafted": 60, "found": [0, 40]},
        "append-1": {"tokens": 160, "drafted": 60, "found": [40]},
    }
    b = bank(figures, {"static": 2, "policy": "static", "retrieval": {"mode": "append", "num_tokens": 4}})
    cheap_rows = machine({1: 10.0, 2: 10.0, 3: 10.5, 4: 18.0}, draft=(0.5, 0.2, 0.1))
    ranking = b.ranking(cheap_rows)
    assert set(ranking.retrieval) == {2} and ranking.retrieval[2] == REPLACE2  # only the fan carries figures
    with_replace = retrieval_speedup(cheap_rows, FAN, REPLACE2, RetrievalFigures(200, 60, (0, 40)))
    assert ranking.speedups[2] == pytest.approx(with_replace) and with_replace > cheap_rows.speedup(FAN, 1.5) > 1.05
    assert b.scheduler_for(cheap_rows).retrieval == REPLACE2 and b.scheduler_for(cheap_rows).static == 2
    # continuations that are never right: retrieval only costs, so the machine's entry turns it off
    useless = {"replace-2": {"tokens": 100, "drafted": 40, "found": [0, 60]}}
    b2 = bank(useless, {"static": 2, "policy": "static", "retrieval": {"mode": "replace", "num_tokens": 2}})
    assert b2.ranking(cheap_rows).retrieval[2] is None
    assert b2.scheduler_for(cheap_rows).retrieval is None
    # a bank without figures keeps its stored retrieval on every machine
    b3 = bank(None, {"static": 2, "policy": "static", "retrieval": {"mode": "replace", "num_tokens": 2}})
    assert b3.ranking(cheap_rows).retrieval == {} and b3.scheduler_for(cheap_rows).retrieval == REPLACE2


def test_retrieval_figures_round_trip(tmp_path):
    figures = {"replace-2": {"tokens": 200, "drafted": 60, "found": [10, 30]}}
    b = bank(figures)
    b.save_pretrained(tmp_path)
    back = TopologyBank.from_pretrained(tmp_path, task="chat")
    options, per_tree = back.retrieval_figures
    assert options == {"replace-2": REPLACE2, "append-1": APPEND1}
    assert per_tree == {2: {"replace-2": RetrievalFigures(200, 60, (10, 30))}}


@pytest.mark.parametrize(
    "figures, options, match",
    [
        ({"replace-9": {"tokens": 9, "drafted": 3, "found": [1]}}, OPTIONS, "must map labels"),
        ({"replace-2": {"tokens": 9, "drafted": 3, "found": [1, 1, 1]}}, OPTIONS, "at most 2 counts"),
        ({"replace-2": {"tokens": 9, "drafted": -1, "found": [1]}}, OPTIONS, "drafted must be an integer"),
        ({"replace-2": {"tokens": 2, "drafted": 3, "found": [1]}}, OPTIONS, "every step adds one"),
        ({"replace-2": {"tokens": 9, "drafted": 3}}, OPTIONS, "'tokens', 'drafted' and 'found'"),
        ({"replace-2": {"tokens": 9, "drafted": 3, "found": [1]}}, {"replace-2": {"mode": "swap"}}, "mode"),
    ],
)
def test_bad_retrieval_figures_are_refused_naming_the_file(tmp_path, figures, options, match):
    good = bank({"replace-2": {"tokens": 9, "drafted": 3, "found": [1]}})
    meta = good.metadata
    meta["trees"][2]["retrieval"] = figures
    meta["frontier"]["retrieval"] = options
    with pytest.raises(ValueError, match=match):
        TopologyBank("chat", TREES, meta)
    good.save_pretrained(tmp_path)  # the same problem in a file: a format error that names it
    path = tmp_path / "chat.safetensors"
    with safe_open(path, "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    stored = json.loads(header["entmtp_bank"])
    stored["trees"][2]["retrieval"], stored["frontier"]["retrieval"] = figures, options
    save_file(tensors, path, metadata={"entmtp_bank": json.dumps(stored)})
    with pytest.raises(FileFormatError, match="chat.safetensors"):
        TopologyBank.from_pretrained(tmp_path, task="chat")


def test_in_a_batch_the_widest_row_sets_the_forward():
    """Two rows, each finding a 3-token continuation at half its steps (4 nodes against the fan's
    3): the forward is 4 nodes wide unless neither row found one (a quarter of the steps)."""
    two_rows = dataclasses.replace(machine({1: 10.0, 2: 10.0, 3: 11.0, 4: 20.0}), batch_size=2)
    figures = RetrievalFigures(tokens=400, drafted=100, found=(0, 0, 100))
    replace3 = RetrievalConfig(mode="replace", num_tokens=3)
    per_row = 0.5 * (two_rows.drafting(FAN) + 1.0) + 0.5 * 1.0  # drafting only where no continuation
    expected = 2.0 * 10.0 / (0.25 * 11.0 + 0.75 * 20.0 + 2 * per_row)
    assert retrieval_speedup(two_rows, FAN, replace3, figures) == pytest.approx(expected)
    one_row = machine({1: 10.0, 2: 10.0, 3: 11.0, 4: 20.0})  # alone, each step pays its own width
    alone = 2.0 * 10.0 / (0.5 * (11.0 + one_row.drafting(FAN) + 1.0) + 0.5 * (20.0 + 1.0))
    assert retrieval_speedup(one_row, FAN, replace3, figures) == pytest.approx(alone)


def test_a_timed_choice_is_recorded_with_the_retrieval_it_ran_with():
    """A machine entry chosen by timing (the search's) keeps its own retrieval setting, and its
    modelled speed-up is that setting's, not the best the ranking found for the tree."""
    figures = {"replace-2": {"tokens": 200, "drafted": 60, "found": [0, 40]}}
    b = bank(figures)
    table = machine({1: 10.0, 2: 10.0, 3: 10.5, 4: 18.0}, draft=(0.5, 0.2, 0.1))
    timed = dataclasses.replace(b.scheduler_for(table), retrieval=None)
    entry = b.with_machine(table, timed).machines[-1]
    assert entry["scheduler"]["retrieval"] is None
    assert entry["speedups"]["2"] == pytest.approx(table.speedup(FAN, 1.5), abs=1e-4)
    assert b.with_machine(table).machines[-1]["speedups"]["2"] > entry["speedups"]["2"]
    unknown = dataclasses.replace(timed, retrieval=RetrievalConfig(mode="append", num_tokens=4))
    assert "2" not in b.with_machine(table, unknown).machines[-1]["speedups"]  # no figures for it: not modelled
