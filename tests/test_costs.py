"""Banks that fit the machine: the cost model, the ranking, machine entries in banks, the cache, the probe."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import warnings

import pytest
import torch
from test_generation import enabled, prompts

import entmtp_hf.calibration.probe as probe_module
import entmtp_hf.calibration.tables as tables_module
from entmtp_hf import EntMTPConfig, EntMTPError, FileFormatError, TopologyBank, Tree
from entmtp_hf.banks.bank import published_defaults_bank
from entmtp_hf.calibration import calibrate, tables_for
from entmtp_hf.calibration.probe import probe, probe_batch
from entmtp_hf.calibration.store import key_for, table_path, write_table
from entmtp_hf.costs.fingerprint import machine_fingerprint, model_key
from entmtp_hf.costs.ranking import BATCH_TIE, MARGIN, rank
from entmtp_hf.costs.table import CostTable, interpolate

CHAIN = [Tree.chain(d) for d in range(4)]  # 1, 2, 3, 4 nodes


def table(forward: dict[int, float], *, plain: float | None = None, key: str = "m", model: str = "x") -> CostTable:
    """A synthetic machine: forward ms by size, drafting and overhead free unless given."""
    return CostTable({"key": key}, model, forward, (0.0, 0.0, 0.0), (0.0, 0.0), plain or forward[1])


def frontier_bank(taus=(1.0, 1.6, 2.0, 2.2), scheduler=None) -> TopologyBank:
    per_tree = [{"num_nodes": t.num_nodes, "mean_accept_length": tau} for t, tau in zip(CHAIN, taus)]
    return TopologyBank(
        "t",
        CHAIN,
        {
            "trees": per_tree,
            "frontier": {"trees": [0, 1, 2, 3]},
            "scheduler": scheduler or {"static": 3, "policy": "static"},
        },
    )


# ----------------------------------------------------------------------------- the model
def test_interpolation_and_the_step_cost():
    costs = {1: 10.0, 2: 10.0, 4: 14.0, 8: 20.0}
    assert interpolate(costs, 3) == 12.0 and interpolate(costs, 16) == 32.0
    noisy = {1: 10.0, 12: 18.7, 16: 17.8}  # the last timing came out lower: beyond it the cost stays
    assert interpolate(noisy, 14) == pytest.approx(18.25) and interpolate(noisy, 64) == 17.8
    t = CostTable({"key": "m"}, "x", costs, (1.0, 0.5, 0.1), (2.0, 0.25), 12.0)
    tree = Tree.chain(3)  # 4 nodes, depth 3
    assert t.step(tree) == pytest.approx(14.0 + (1.0 + 1.5 + 0.3) + (2.0 + 1.0))
    assert t.speedup(tree, 2.0) == pytest.approx(2.0 * 12.0 / t.step(tree))
    assert t.drafting(Tree.root_only()) == 0.0


def test_cost_tables_round_trip_and_bad_ones_are_refused_naming_the_source():
    t = CostTable({"key": "m"}, "x", {1: 10.0, 4: 14.0}, (1.0, 0.5, 0.1), (2.0, 0.25), 12.0, 3.5)
    assert CostTable.from_dict(t.to_dict()) == t
    bad = [
        dict(t.to_dict(), plain_ms=-1.0),
        dict(t.to_dict(), forward_ms={"2": 1.0, "3": 2.0}),
        dict(t.to_dict(), draft_ms=[1.0]),
        dict(t.to_dict(), forward_ms={"1": float("nan"), "2": 1.0}),
        dict(t.to_dict(), format_version=9),
        "not a dict",
    ]
    for data in bad:
        with pytest.raises(FileFormatError, match="costs.json"):
            CostTable.from_dict(data, "costs.json")


# ----------------------------------------------------------------------------- the ranking
def test_the_ranking_follows_the_injected_costs():
    taus = {0: 1.0, 1: 1.6, 2: 2.0, 3: 2.2}
    cheap_three = table({1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0})  # three rows cost one, four cost 1.5
    r = rank(CHAIN, taus, cheap_three)
    assert r.static == 2 and (r.conservative, r.aggressive) == (1, 3)
    assert r.speedups[2] == pytest.approx(2.0 / 1.05) and 0 not in r.speedups  # the root is plain decoding
    flat = table({1: 10.0, 4: 10.0})  # every size costs one: the largest tree wins
    assert rank(CHAIN, taus, flat).static == 3


def test_in_a_batch_a_near_tie_goes_to_the_fewest_nodes_and_alone_to_the_faster():
    taus = {1: 1.6, 2: 2.0, 3: 2.2}
    # the 3-node tree: 2.0 / 1.0; the 4-node one: 2.2 / 1.1 = 2.0 too, ahead by half the tie at 4 nodes' cost below
    costs = {1: 10.0, 2: 10.0, 3: 10.0, 4: 11.0 * (1 - BATCH_TIE / 2)}
    one_row, four_rows = table(costs), dataclasses.replace(table(costs), batch_size=4)
    assert rank(CHAIN, taus, one_row).static == 3  # one row: the faster tree, however slightly
    assert rank(CHAIN, taus, four_rows).static == 2  # a batch: the tie goes to the smaller tree
    clear = dataclasses.replace(four_rows, forward_ms={**costs, 4: 11.0 * (1 - 2 * BATCH_TIE)})
    assert rank(CHAIN, taus, clear).static == 3  # a lead larger than the tie stands in a batch too


def test_nothing_beating_plain_decoding_by_the_margin_means_plain_decoding():
    taus = {1: 1.6, 2: 2.0}
    costly = table({1: 10.0, 2: 16.0, 3: 20.5})  # 1.6/1.6 = 1.0 and 2.0/2.05 < 1
    assert rank(CHAIN, taus, costly).static is None
    just_above = table({1: 10.0, 2: 1.6 / (MARGIN + 0.01) * 10.0, 3: 30.0})
    assert rank(CHAIN, taus, just_above).static == 1


def test_a_bank_re_ranks_its_frontier_and_stores_the_machine():
    bank = frontier_bank()
    machine = table({1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0}, key="here")
    assert bank.scheduler.static == 3 and bank.scheduler_for(None) == bank.scheduler
    assert bank.scheduler_for(machine).static == 2  # re-ranked on the fly
    stored = bank.with_machine(machine)
    assert stored.machines[0]["scheduler"]["static"] == 2 and stored.machines[0]["speedups"]["2"] > 1.8
    # a stored entry wins over re-ranking (it may have been checked against the clock)
    entry = stored.machines[0]
    entry["scheduler"]["static"] = 1
    pinned = TopologyBank("t", CHAIN, {**stored.metadata, "machines": [entry]})
    assert pinned.scheduler_for(machine).static == 1
    assert pinned.scheduler_for(table({1: 10.0, 4: 10.0}, key="elsewhere")).static == 3
    again = stored.with_machine(dataclasses.replace(machine, plain_ms=11.0))  # same machine: replaced, not added
    assert len(again.machines) == 1
    # measured again under another model key (new heads or decode step): the old entry goes too
    newer = again.with_machine(dataclasses.replace(machine, model="another-step"))
    assert [m["costs"]["model"] for m in newer.machines] == ["another-step"]
    # other batch sizes and other machines stay
    both = newer.with_machine(dataclasses.replace(machine, batch_size=4)).with_machine(
        table({1: 10.0, 4: 20.0}, key="there")
    )
    assert len(both.machines) == 3 and len(both.with_machine(dataclasses.replace(machine, model="x")).machines) == 3


def test_a_machine_where_nothing_pays_gets_plain_decoding_without_retrieval():
    bank = frontier_bank(scheduler={"static": 3, "policy": "static", "retrieval": {"mode": "replace", "num_tokens": 2}})
    slow = table({1: 10.0, 2: 20.0, 4: 40.0})
    chosen = bank.scheduler_for(slow)
    assert chosen.static == 0 and chosen.policy == "static" and chosen.retrieval is None
    # a policy asked for by name still decodes plainly there (its thresholds are not read)
    scheduled = frontier_bank(
        scheduler={
            "static": 3,
            "conservative": 2,
            "aggressive": 3,
            "policy": "hysteresis",
            "feature": "accept_ema",
            "tau_on": 1.2,
            "tau_off": 1.1,
        }
    )
    plan = EntMTPConfig(bank=scheduled.with_machine(slow), task="t", policy="hysteresis").resolve(4, costs=slow)
    assert plan.plain and plan.policy == "static"


def test_banks_with_machines_round_trip_and_old_banks_load(tmp_path):
    bank = frontier_bank().with_machine(table({1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0}, key="here"))
    bank.save_pretrained(tmp_path)
    assert TopologyBank.from_pretrained(tmp_path, task="t") == bank
    old = published_defaults_bank()  # no frontier: the stored scheduler on every machine
    assert old.frontier == {} and old.scheduler_for(table({1: 1.0, 4: 1.0})) == old.scheduler
    with pytest.raises(ValueError, match="no acceptance frontier"):
        old.with_machine(table({1: 1.0, 4: 1.0}))


@pytest.mark.parametrize(
    "meta",
    [
        {"frontier": {"trees": [7]}},
        {"frontier": {"trees": [1]}, "trees": [{}, {}, {}, {}]},
        {"machines": [{"costs": {"format_version": 1}, "scheduler": {}}]},
        {
            "machines": [
                {
                    "costs": CostTable({"key": "m"}, "x", {1: 1.0, 2: 1.0}, (0, 0, 0), (0, 0), 1.0).to_dict(),
                    "scheduler": {"static": 9},
                }
            ]
        },
    ],
)
def test_bad_frontier_or_machine_entries_are_refused(meta):
    with pytest.raises(ValueError, match="frontier|machines"):
        TopologyBank("t", CHAIN, meta)


# ----------------------------------------------------------------------------- generate adapts
def _with_machine_costs(model, heads, forward):
    lm = model.get_output_embeddings().weight
    fp = machine_fingerprint(lm.device, lm.dtype)
    return CostTable(
        {**fp.to_dict(), "key": fp.key()}, model_key(model, heads), forward, (0.0, 0.0, 0.0), (0.0, 0.0), forward[1]
    )


def test_generate_uses_this_machines_ranking_and_plain_decoding_when_nothing_pays(tiny_cache):
    model = enabled(tiny_cache)
    heads = model.entmtp_heads
    ids = prompts(1)[0]
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    fast_three = frontier_bank().with_machine(_with_machine_costs(model, heads, {1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0}))
    out = model.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=fast_three, task="t"),
    )
    assert torch.equal(out.sequences, ref) and set(out.entmtp_stats["tree_sizes"]) == {3}
    stored = model.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=fast_three, task="t", adapt=False),
    )
    assert set(stored.entmtp_stats["tree_sizes"]) == {4}  # the bank's own choice
    slow = frontier_bank().with_machine(_with_machine_costs(model, heads, {1: 10.0, 2: 30.0, 4: 60.0}))
    plain = model.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=slow, task="t"),
    )
    assert torch.equal(plain.sequences, ref) and plain.entmtp_stats["plain_decoding"]
    assert plain.entmtp_stats["mean_accept_length"] == 1.0


def test_adapt_needs_a_bank_with_a_frontier():
    with pytest.raises(ValueError, match="adapt"):
        EntMTPConfig(tree=[[0]], adapt=True)
    with pytest.raises(ValueError, match="no acceptance frontier"):
        EntMTPConfig(bank=published_defaults_bank(), task="default", adapt=True).adapts


# ----------------------------------------------------------------------------- probe and cache
def test_the_probe_measures_a_valid_table_on_a_tiny_model(tiny_cache):
    model = enabled(tiny_cache)
    t = probe(model, model.entmtp_heads, sizes=(1, 2, 4), repeats=1)
    assert set(t.forward_ms) == {1, 2, 4} and all(v > 0 for v in t.forward_ms.values()) and t.plain_ms > 0
    assert t.seconds > 0 and t.step(Tree.chain(2)) > 0
    assert CostTable.from_dict(t.to_dict()) == t


def test_the_batch_probe_measures_per_row_costs_at_its_batch_size(tiny_cache):
    model = enabled(tiny_cache)
    base = probe(model, model.entmtp_heads, sizes=(1, 2, 4), repeats=1)
    t = probe_batch(model, model.entmtp_heads, base, 4, sizes=(1, 2, 4), repeats=1)
    assert t.batch_size == 4 and t.key.endswith("-b4") and t.plain_ms > 0
    assert set(t.forward_ms) == {1, 2, 4} and all(v > 0 for v in t.forward_ms.values())
    # drafting's fixed and per-depth parts are measured on the batch; the per-node part is the base's
    assert t.draft_ms[2] == base.draft_ms[2] and t.draft_ms[:2] != base.draft_ms[:2]
    assert t.overhead_ms != base.overhead_ms and t.step(Tree.chain(2)) > 0
    assert CostTable.from_dict(t.to_dict()) == t


def test_drafting_and_overhead_come_from_decodes_at_every_batch_size(tiny_cache, monkeypatch):
    """The heads timed on their own run warm and skip their conditioning, so drafting's fixed and
    per-depth parts come from real decodes, at batch size 1 as at any other; only the per-node part
    comes from the heads' own timings."""
    model = enabled(tiny_cache)

    # per decode tree: (drafting ms per row-step, the rest of the step): drafting = 1 + 1.5 depth + 0.5 (nodes - 1)
    def phases(m, heads, ids, tree, tokens):
        return 1.0 + 1.5 * tree.depth + 0.5 * (tree.num_nodes - 1), 0.8 + 0.1 * tree.num_nodes

    monkeypatch.setattr(probe_module, "_decode_phases", phases)
    monkeypatch.setattr(probe_module, "draft_fit", lambda m, h, **k: ((-1.0, 0.5, 0.5), 0.4))  # warm: too cheap
    draft, overhead = probe_module.step_costs(model, model.entmtp_heads, 0.5)
    assert draft == pytest.approx((1.0, 1.5, 0.5)) and overhead == pytest.approx((0.8, 0.1))
    t = probe(model, model.entmtp_heads, sizes=(1, 2), repeats=1)
    assert t.draft_ms == pytest.approx((1.0, 1.5, 0.5)) and t.overhead_ms == pytest.approx((0.8, 0.1))
    assert t.drafting(Tree.chain(2)) == pytest.approx(phases(None, None, None, Tree.chain(2), 0)[0])
    assert probe_batch(model, model.entmtp_heads, t, 2, sizes=(1, 2), repeats=1).draft_ms == pytest.approx(t.draft_ms)


def test_the_probe_times_decoding_s_own_session(tiny_cache, monkeypatch):
    """The forward the probe times is the session's tree forward, and its decodes are decoding's
    own loop: no copy of the verification forward, and no generate call with EntMTP."""
    from entmtp_hf.decoding.session import DecodeSession

    model = enabled(tiny_cache)
    seen, real = [], DecodeSession.tree_forward
    monkeypatch.setattr(DecodeSession, "tree_forward", lambda self, d, p: seen.append(len(d)) or real(self, d, p))
    generate = model.generate
    monkeypatch.setattr(
        model, "generate", lambda *a, **k: pytest.fail("EntMTP generate") if "entmtp_config" in k else generate(*a, **k)
    )
    probe_module.forward_ms(model, model.entmtp_heads, (1, 2), repeats=1, batch_size=3)
    assert seen and set(seen) == {3}  # every row of the batch in one forward
    probe(model, model.entmtp_heads, sizes=(1, 2), repeats=1)


def test_the_forward_sizes_shrink_with_the_batch():
    assert probe_module.sizes_at(1) == probe_module.PROBE_SIZES
    assert probe_module.sizes_at(4) == (1, 2, 3, 4, 6, 8, 12, 16)
    assert probe_module.sizes_at(8) == (1, 2, 3, 4, 6, 8)
    assert probe_module.sizes_at(256)[:4] == (1, 2, 3, 4)  # always enough to interpolate the small trees


def _flat_grid(ms: float = 10.0, counts: list | None = None):
    """A fake :func:`forward_grid`: every size ``ms``; ``counts`` gets the sizes of each call."""

    def grid(session, sizes, repeats=3, **kwargs):
        counts is not None and counts.append(tuple(sizes))
        return {n: ms for n in sizes}, set()

    return grid


def test_a_probe_on_a_busy_machine_measures_again_what_changed_and_says_so(tiny_cache, tmp_path, monkeypatch):
    """The one-node forward and the plain step are timed twice; the one that disagrees (a busy
    machine) is measured again, alone; steady when the new timing agrees with one of the two; a
    table that never agreed is kept with a note and measured again by the next calibrate call
    (generate ranks the bank's trees as stored meanwhile, or on a steady table of another batch size)."""
    model = enabled(tiny_cache)
    assert probe_module.steady(10.0, 12.0) and not probe_module.steady(10.0, 15.0)
    assert probe_module.steady(10.0, 15.0, 11.0) and not probe_module.steady(10.0, 15.0, 5.0)
    # every timing injected (a real one could disagree on a loaded machine and measure again)
    grids = []
    monkeypatch.setattr(probe_module, "forward_grid", _flat_grid(10.0, grids))
    plains = iter([50.0, 32.0, 33.0])  # busy during the first measurement, idle after
    monkeypatch.setattr(probe_module, "_plain_ms", lambda *a, **k: next(plains))
    monkeypatch.setattr(probe_module, "step_costs", lambda m, h, per_node, b=1: ((0.0, 0.0, per_node), (0.1, 0.0)))
    t = probe(model, model.entmtp_heads, sizes=(1, 2), repeats=1)
    assert t.plain_ms == 33.0 and t.notes["timings_steady"] is True  # the second measurement agreed
    assert t.notes["measured_again"] == ["plain decoding"] and grids == [(1, 2), (1,)]  # the forwards agreed
    always_busy = iter([10.0, 20.0, 40.0] * 10)  # every plain timing far from those before it
    monkeypatch.setattr(probe_module, "_plain_ms", lambda *a, **k: next(always_busy))
    with pytest.warns(UserWarning, match="changed while measuring"):
        busy = calibrate(model, folder=tmp_path, progress=False)[1]
    assert busy.notes["timings_steady"] is False and len(list(tmp_path.glob("*.json"))) == 1
    with pytest.warns(UserWarning, match=r"at batch size \[1\] were measured while the machine was busy"):
        assert tables_for(model, model.entmtp_heads, [1], folder=tmp_path) == {1: None}  # the stored ranking
    steady_two = dataclasses.replace(busy, batch_size=2, notes={})
    write_table(steady_two, table_path(steady_two.key, tmp_path))
    assert tables_for(model, model.entmtp_heads, [1], folder=tmp_path) == {1: steady_two}  # the nearest steady size
    calls = []
    monkeypatch.setattr(tables_module, "probe", lambda m, h, **k: calls.append(1) or busy)
    with pytest.warns(UserWarning, match="changed while measuring"):
        calibrate(model, folder=tmp_path, progress=False)
    assert calls == [1]  # measured again


def test_a_retry_that_does_not_fit_the_budget_is_left_out(tiny_cache, monkeypatch):
    """A forward grid that disagrees with its recheck is measured again only if a pass fits what is
    left of the budget; otherwise the table keeps the first grid and says it was never steady."""
    model = enabled(tiny_cache)
    ones = iter([1e3, 1e3, 2e3, 1e3, 1e3])  # the grid's one-node forward, then its recheck twice as slow
    grids = []

    def grid(session, sizes, repeats=3, **kwargs):
        grids.append(tuple(sizes))
        return {n: next(ones) * n for n in sizes}, {2} if len(sizes) > 1 else set()

    monkeypatch.setattr(probe_module, "forward_grid", grid)
    monkeypatch.setattr(probe_module, "_plain_ms", lambda *a, **k: 30.0)
    monkeypatch.setattr(probe_module, "step_costs", lambda m, h, per_node, b=1: ((0.0, 0.0, per_node), (0.1, 0.0)))
    base = probe(model, model.entmtp_heads, sizes=(1, 2), repeats=1, budget_s=1e6)
    assert grids == [(1, 2), (1,), (1, 2)] and base.notes["measured_again"] == ["forward"]
    assert base.notes["timings_steady"] is True and base.notes["timed_again"] == [2]
    ones, grids[:] = iter([1e3, 1e3, 2e3]), []  # a pass of 3 s does not fit a tenth of a fast probe's time
    t = probe_batch(model, model.entmtp_heads, base, 2, sizes=(1, 2), repeats=1, budget_s=0.0)
    assert grids == [(1, 2), (1,)] and t.notes["measured_again"] == [] and t.notes["timings_steady"] is False
    assert t.forward_ms == {1: 1e3, 2: 2e3}  # the first grid, kept


def test_a_doubted_size_never_timed_again_leaves_the_table_unsteady(tiny_cache, monkeypatch):
    """Sizes that disagree with their neighbours and found no time for its second look is a
    guess: the table says which and is measured again by the next calibrate; one that was timed
    again and held is a kink of the kernels, kept."""
    model = enabled(tiny_cache)
    monkeypatch.setattr(probe_module, "_plain_ms", lambda *a, **k: 30.0)
    monkeypatch.setattr(probe_module, "step_costs", lambda m, h, per_node, b=1: ((0.0, 0.0, per_node), (0.1, 0.0)))
    dip = {1: 10.0, 2: 12.0, 3: 9.0}
    for timed_again, steady in ((set(), False), ({1, 2, 3}, True)):

        def grid(session, sizes, repeats=3, timed_again=timed_again, **kwargs):
            return {n: dip[n] for n in sizes}, timed_again if len(sizes) > 1 else set()

        monkeypatch.setattr(probe_module, "forward_grid", grid)
        t = probe(model, model.entmtp_heads, sizes=(1, 2, 3), repeats=1)
        assert t.notes["timings_steady"] is steady
        assert t.notes["unchecked_sizes"] == ([] if steady else [1, 2, 3])


def test_the_retry_budget():
    assert probe_module.retry_seconds(22.0) == pytest.approx(probe_module.BUDGET_S - 22.0)
    assert probe_module.retry_seconds(300.0) == pytest.approx(probe_module.RETRY_SHARE * 300.0)  # a large model
    assert probe_module.retry_seconds(29.0, budget_s=30.0) == pytest.approx(2.9)


# the batch-4 grid of the demo model seen on a shared 2-core VM: F(8) timed below F(6), while six
# later timings of the 8-node forward gave 189-215 ms
NOISY_B4 = {1: 100.0, 2: 110.0, 3: 120.0, 4: 130.0, 6: 172.3, 8: 169.7, 12: 250.0, 16: 320.0}


def test_the_check_doubts_a_size_below_its_smaller_neighbour_or_off_their_line():
    doubtful = probe_module.doubtful
    assert doubtful({n: 50.0 + 10.0 * n for n in (1, 2, 3, 4, 6, 8, 12, 16)}) == set()  # a line
    assert doubtful({1: 40.0, 2: 39.8, 3: 40.1, 4: 40.3, 6: 43.0, 8: 46.0}) == set()  # flat within noise
    assert doubtful(NOISY_B4) == {4, 6, 8, 12}  # 6 and 8 off their lines, 8 below 6
    assert doubtful({1: 40.0, 2: 36.0, 3: 41.0}) == {1, 2, 3}  # a drop of 10%
    assert doubtful({1: 40.0, 2: 60.0}) == set()  # two sizes have no line to be off
    assert doubtful({1: 40.0}) == set()


def _fake_timer(true_ms: dict[int, float], calls: list):
    """``time_again`` for :func:`settle`: every further round of a size takes its true seconds."""

    def time_again(sizes, rounds):
        calls.append((tuple(sorted(sizes)), rounds))
        return {n: [true_ms[n] / 1e3] * rounds for n in sizes}

    return time_again


def test_a_noisy_median_is_timed_again_until_it_agrees_with_its_neighbours():
    true = {**NOISY_B4, 6: 160.0, 8: 200.0}
    samples = {n: [ms / 1e3] * 3 for n, ms in NOISY_B4.items()}  # three rounds each
    calls = []
    again = probe_module.settle(samples, _fake_timer(true, calls))
    assert again == {4, 6, 8, 12} and calls == [((4, 6, 8, 12), probe_module.CHECK_ROUNDS)]  # settled in one check
    medians = {n: 1e3 * statistics.median(v) for n, v in samples.items()}
    assert medians[8] == pytest.approx(200.0) and medians[6] == pytest.approx(160.0)
    assert probe_module.doubtful(medians) == set()
    assert all(len(samples[n]) == 3 for n in samples if n not in again)  # the rest are left alone


def test_a_kink_that_holds_is_kept_and_the_checks_are_bounded():
    kink = {1: 40.0, 2: 41.0, 3: 42.0, 4: 36.0, 6: 38.0, 8: 40.0}  # a kernel's small-row path ends at 4 rows
    samples, calls = {n: [ms / 1e3] * 3 for n, ms in kink.items()}, []
    again = probe_module.settle(samples, _fake_timer(kink, calls))
    assert again == {3, 4, 6} and len(calls) == probe_module.CHECKS  # timed again, still there: kept
    assert {n: 1e3 * statistics.median(v) for n, v in samples.items()} == pytest.approx(kink)
    samples, calls = {n: [ms / 1e3] * 3 for n, ms in kink.items()}, []
    assert probe_module.settle(samples, _fake_timer(kink, calls), lambda: 0.4) == set() and calls == []
    # a check's 4 rounds of 3, 4 and 6 nodes would take 0.46 s: over the 0.4 s left


def test_plain_decoding_is_timed_at_the_forwards_context(tiny_cache, monkeypatch):
    """c(N) divides a forward after PREFIX_LEN cached tokens by a plain step: the plain steps' contexts
    must centre on the same length (a step's attention grows with its context), at every batch size."""
    model = enabled(tiny_cache)
    real, contexts = probe_module._plain_ms, []

    def spy(m, ids, tokens):
        contexts.append((ids.shape[0], ids.shape[1] + tokens / 2))  # rows, the steps' mean context
        return real(m, ids, tokens)

    monkeypatch.setattr(probe_module, "_plain_ms", spy)
    base = probe(model, model.entmtp_heads, sizes=(1, 2), repeats=1)
    probe_batch(model, model.entmtp_heads, base, 2, sizes=(1, 2), repeats=1)
    assert {rows for rows, _ in contexts} == {1, 2}
    assert all(abs(c - probe_module.PREFIX_LEN) <= 1 for _, c in contexts), contexts


def _this_machine(model, heads, forward=None, batch_size: int = 1) -> CostTable:
    return dataclasses.replace(_with_machine_costs(model, heads, forward or {1: 1.0, 2: 1.0}), batch_size=batch_size)


def _fake_probes(monkeypatch, model, heads, calls: list) -> None:
    monkeypatch.setattr(tables_module, "probe", lambda m, h, **k: calls.append(1) or _this_machine(m, h))
    monkeypatch.setattr(
        tables_module,
        "probe_batch",
        lambda m, h, base, b, **k: calls.append(b) or dataclasses.replace(base, batch_size=b),
    )


def test_the_cache_is_keyed_by_machine_and_model(tiny_cache, tmp_path, monkeypatch):
    model = enabled(tiny_cache)
    heads, calls = model.entmtp_heads, []
    _fake_probes(monkeypatch, model, heads, calls)
    first = calibrate(model, folder=tmp_path, progress=False)
    second = calibrate(model, folder=tmp_path, progress=False)
    assert first == second and calls == [1] and len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count: another machine
    calibrate(model, folder=tmp_path, progress=False)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.json"))) == 2
    newest = max(tmp_path.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)  # this machine's file
    newest.write_text("{not json")  # a broken file is measured again, not trusted
    with pytest.warns(UserWarning, match="ignoring the cached cost table"):
        calibrate(model, folder=tmp_path, progress=False)
    assert len(calls) == 3


def test_calibrating_several_batch_sizes_measures_batch_size_one_once(tiny_cache, tmp_path, monkeypatch):
    """Every batch size's table builds on the batch-size-1 one; sizes round down to the powers of two
    decoding ranks at; bad sizes are refused before anything is measured."""
    model, calls = enabled(tiny_cache), []
    _fake_probes(monkeypatch, model, model.entmtp_heads, calls)
    tables = calibrate(model, batch_sizes=[2, 5], folder=tmp_path, refresh=True, progress=False)
    assert calls == [1, 2, 4] and sorted(tables) == [1, 2, 4] and tables[4].batch_size == 4
    calibrate(model, batch_sizes=[8], folder=tmp_path, progress=False)
    assert calls == [1, 2, 4, 8]  # batch size 1 read from the cache
    for bad in ([0], [True], [2.0], 4, [], [1000]):
        with pytest.raises(EntMTPError, match="batch_sizes"):
            calibrate(model, batch_sizes=bad, folder=tmp_path, progress=False)


def test_generate_never_measures(tiny_cache, tmp_path, monkeypatch):
    """Never measured: the bank's stored choice, with one warning that says how to measure; measured
    at batch size 1 only: a batch of 4 is ranked with batch size 1's costs (logged)."""
    model = enabled(tiny_cache)
    heads, ids = model.entmtp_heads, prompts(1)[0]
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    for name in ("probe", "probe_batch"):
        monkeypatch.setattr(tables_module, name, lambda *a, **k: pytest.fail("generate measured"))
    config = EntMTPConfig(bank=frontier_bank(), task="t")
    with pytest.warns(UserWarning, match="never measured") as caught:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, entmtp_config=config)
    assert len([w for w in caught if "never measured" in str(w.message)]) == 1
    assert set(out.entmtp_stats["tree_sizes"]) == {4}  # the stored static tree
    fast_three = _this_machine(model, heads, {1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0})
    table_path(fast_three.key).parent.mkdir(parents=True)
    table_path(fast_three.key).write_text(json.dumps(fast_three.to_dict()))
    assert tables_for(model, heads, [1, 2, 4]) == dict.fromkeys([1, 2, 4], fast_three)
    batch = torch.cat([prompts(1)[0]] * 4)
    out = model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=config,
    )
    assert {n for row in out.entmtp_stats["rows"] for n in row["tree_sizes"]} == {3}  # ranked on batch size 1's costs


@pytest.mark.parametrize("where", ["proc", "file", "directory"])
def test_an_unusable_cache_folder_warns_once_and_decodes(tiny_cache, tmp_path, monkeypatch, where):
    model, calls = enabled(tiny_cache), []
    heads = model.entmtp_heads
    _fake_probes(monkeypatch, model, heads, calls)
    folder = {"proc": "/proc/entmtp-hf-cache", "file": str(tmp_path / "f"), "directory": str(tmp_path / "d")}[where]
    (tmp_path / "f").write_text("not a folder")
    if where == "directory":  # a folder where this machine's table file goes
        (tmp_path / "d" / "costs" / f"{key_for(model, heads)}.json").mkdir(parents=True)
    monkeypatch.setenv("ENTMTP_HF_CACHE", folder)
    with pytest.warns(UserWarning, match="cannot be used"):
        tables = calibrate(model, progress=False)
    assert tables[1].batch_size == 1 and calls == [1]
    assert not list(tmp_path.rglob(".*.tmp"))
    ids = prompts(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids, max_new_tokens=8, do_sample=False, entmtp_config=EntMTPConfig(bank=frontier_bank(), task="t")
        )
    assert torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_a_foreign_table_under_this_machine_s_key_is_not_trusted(tiny_cache, tmp_path, monkeypatch):
    model = enabled(tiny_cache)
    heads = model.entmtp_heads
    foreign = CostTable(
        {"key": "another-machine"},
        "another-model",
        {1: 1.0, 2: 900.0},
        (0.0, 0.0, 0.0),
        (0.0, 0.0),
        1.0,
        batch_size=1024,
    )
    path = table_path(key_for(model, heads), tmp_path)
    path.write_text(json.dumps(foreign.to_dict()))
    with pytest.warns(UserWarning, match="describes 'another-machine-another-model-b1024'"):
        assert tables_for(model, heads, [1], folder=tmp_path) == {1: None}
    calls = []
    _fake_probes(monkeypatch, model, heads, calls)
    with pytest.warns(UserWarning, match="ignoring"):
        assert calibrate(model, folder=tmp_path, progress=False)[1].key == key_for(model, heads) and calls == [1]


def test_enable_entmtp_calibrates_when_asked(tiny_cache, tmp_path, monkeypatch, capsys):
    model, calls = enabled(tiny_cache), []
    _fake_probes(monkeypatch, model, model.entmtp_heads, calls)
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    from entmtp_hf import enable_entmtp

    enable_entmtp(model, model.entmtp_heads)
    assert calls == []
    enable_entmtp(model, model.entmtp_heads, calibrate=[1, 4])
    assert calls == [1, 4]
    assert "measured this machine's step costs at batch sizes 1, 4" in capsys.readouterr().err


def test_the_model_key_tells_compiled_and_quantized_decoding_apart(tiny_cache):
    """A compiled route or quantized weights cost a tree differently: their tables are not an eager model's."""
    from entmtp_hf.decoding.compiled import use_compiled_decoding

    model = enabled(tiny_cache)
    heads, saved = model.entmtp_heads, model.generation_config
    eager = model_key(model, heads)
    model.generation_config = copy.deepcopy(saved)  # use_compiled_decoding updates it in place
    try:
        use_compiled_decoding(model)
        compiled = model_key(model, heads)
        model.generation_config.compile_config.dynamic = True
        assert len({eager, compiled, model_key(model, heads)}) == 3
        model.generation_config.disable_compile = True  # generate decodes eagerly: the eager key
        assert model_key(model, heads) == eager
    finally:
        model.generation_config = saved
    model.config.quantization_config = {"quant_method": "torchao", "quant_type": "Int8WeightOnlyConfig"}
    try:
        assert model_key(model, heads) != eager
    finally:
        del model.config.quantization_config
    assert model_key(model, heads) == eager
