"""The break-even guard: its rule without a model, where its prices come from, and decoding with it on."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from test_batch import PAD, batch_of
from test_costs import _with_machine_costs, frontier_bank, table
from test_generation import CHAIN, SAMPLING_TREE, chi_square_p, enabled, prompts, target_joint
from tiny import tiny_model

import entmtp_hf.drafting.drafter as drafter
from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.costs.table import CostTable
from entmtp_hf.errors import ConfigError
from entmtp_hf.heads import HEADS_REGISTRY
from entmtp_hf.scheduling.guard import BACKOFF_MAX, BACKOFF_START, MIN_STEPS, BreakEvenGuard
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


def run(guard: BreakEvenGuard, taus: list[int], cost: float) -> str:
    """Feed ``taus`` as the accept lengths of tree steps costing ``cost`` (a root-alone step adds 1
    token at cost 1): 'T' for every tree step, 'R' for every root-alone step."""
    modes = []
    for tau in taus:
        alone = guard.root_alone
        modes.append("R" if alone else "T")
        guard.observe(1 if alone else tau, 1.0 if alone else cost)
    return "".join(modes)


def runs(modes: str, kind: str) -> list[int]:
    """Lengths of the stretches of ``kind`` in ``modes``."""
    return [len(r) for r in modes.replace("T" if kind == "R" else "R", " ").split()]


# ----------------------------------------------------------------------------- the rule
def test_trees_above_break_even_are_never_dropped():
    guard = BreakEvenGuard()
    assert run(guard, [3, 2] * 100, cost=2.4) == "T" * 200  # e = 2.5 / 2.4 > 1
    assert guard.efficiency == pytest.approx(2.5 / 2.4)


def test_below_break_even_drops_after_min_steps_with_a_doubling_capped_wait():
    guard = BreakEvenGuard()
    modes = run(guard, [1] * 400, cost=1.5)  # nothing accepted: every tree step loses a third
    assert modes.startswith("T" * MIN_STEPS + "R" * BACKOFF_START + "T")
    waits = runs(modes, "R")[:-1]  # the last stretch is cut by the end of the feed
    assert waits[:5] == [BACKOFF_START * 2**i for i in range(5)] and set(waits[5:]) == {BACKOFF_MAX}
    assert set(runs(modes, "T")) == {MIN_STEPS}  # every probe is judged after MIN_STEPS steps
    assert modes.count("R") > 0.85 * len(modes)


def test_break_even_is_tokens_per_step_against_the_cost_ratio():
    """τ = 2 pays at r = 1.9 and loses at r = 2.1: the threshold is c(N)/c(1), nothing else."""
    assert "R" not in run(BreakEvenGuard(), [2] * 50, cost=1.9)
    assert run(BreakEvenGuard(), [2] * 50, cost=2.1).startswith("T" * MIN_STEPS + "R")


def test_the_trees_come_back_when_acceptance_recovers():
    guard = BreakEvenGuard()
    losing = run(guard, [1] * 60, cost=2.0)
    assert guard.backoff > BACKOFF_START and losing.endswith("R")
    winning = run(guard, [4] * 200, cost=2.0)
    back = winning.index("T")
    assert back <= BACKOFF_MAX and "R" not in winning[back:]  # back at the next probe, for good
    assert guard.backoff == BACKOFF_START  # a clear win: the next drop waits the shortest again
    # the window still holds the good steps: six bad ones bring it below break-even (26 / 16 < 2)
    assert run(guard, [1] * 12, cost=2.0) == "T" * 6 + "R" * BACKOFF_START + "TT"


def test_near_break_even_the_guard_does_not_flap():
    """A prompt hovering just below break-even (e ≈ 0.9, noisy): every decision holds for at least
    MIN_STEPS tree steps or BACKOFF_START root-alone steps, and the band between break-even and
    ``recover`` keeps the waits growing; without the band the guard switches far more often."""
    rng = random.Random(0)
    taus = [rng.choice([1, 2, 2, 2, 2]) for _ in range(1500)]
    modes = run(BreakEvenGuard(), taus, cost=2.0)
    assert min(runs(modes, "T")) >= MIN_STEPS and min(runs(modes, "R")[:-1]) >= BACKOFF_START
    no_band = run(BreakEvenGuard(recover=1.0), taus, cost=2.0)
    assert modes.count("TR") * 2 < no_band.count("TR")
    assert modes.count("R") > 0.8 * len(modes)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=0), "window"),
        (dict(min_steps=9), "min_steps"),
        (dict(backoff_start=8, backoff_max=4), "backoff_max"),
        (dict(recover=0.9), "recover"),
    ],
)
def test_invalid_guard(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BreakEvenGuard(**kwargs)


# ----------------------------------------------------------------------------- prices and the config field
def test_a_bank_ranked_with_measured_costs_is_guarded_by_default():
    machine = table({1: 10.0, 2: 10.0, 3: 10.5, 4: 15.0})
    machine = CostTable(machine.fingerprint, "x", machine.forward_ms, (1.0, 0.5, 0.1), (2.0, 0.25), 10.0)
    bank = frontier_bank().with_machine(machine)
    plan = EntMTPConfig(bank=bank, task="t", guard=True).resolve(4, costs=machine)
    root = machine.step(Tree.root_only())
    assert plan.guarded and plan.step_costs == tuple(machine.step(t) / root for t in plan.trees)
    assert EntMTPConfig(bank=bank, task="t").resolve(4, costs=machine).step_costs == plan.step_costs  # the default
    assert not EntMTPConfig(bank=bank, task="t", guard=False).resolve(4, costs=machine).guarded
    assert not EntMTPConfig(bank=bank, task="t").resolve(4).guarded  # a machine never measured: nothing to price with
    # a batch's forward is padded to its widest row: one row's root alone saves nothing of it
    batch = dataclasses.replace(machine, draft_ms=(0.0, 0.0, 0.0), overhead_ms=(0.0, 0.0), batch_size=4)
    unguarded = EntMTPConfig(bank=bank, task="t").resolve(4, costs=batch)
    assert not unguarded.plain and not unguarded.guarded
    assert EntMTPConfig(bank=bank, task="t", guard=True).resolve(4, costs=batch).guarded
    with pytest.raises(ConfigError, match="EntMTPConfig.guard"):
        EntMTPConfig(bank=bank, task="t", guard=True).resolve(4)
    # retrieval branches are priced as the trees they extend plus their nodes
    plan = EntMTPConfig(bank=bank, task="t", retrieval=True, guard=True).resolve(4, costs=machine)
    assert plan.branch_costs == tuple(tuple(machine.step(b) / root for b, _ in per) for per in plan.branches)


def test_explicit_trees_are_guarded_only_when_asked_with_costs():
    assert not EntMTPConfig(tree=CHAIN).resolve(4).guarded
    assert not EntMTPConfig(trees=[CHAIN[:2], CHAIN], costs=[1.2, 1.8]).resolve(4).guarded
    plan = EntMTPConfig(trees=[CHAIN[:2], CHAIN], costs=[1.2, 1.8], guard=True).resolve(4)
    assert plan.step_costs == (1.2, 1.8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree=CHAIN, guard="yes"), "EntMTPConfig.guard: must be None, True or False"),
        (dict(tree=CHAIN, guard=1), "EntMTPConfig.guard: must be None, True or False"),
        (dict(tree=CHAIN, guard=True), "EntMTPConfig.guard: True needs each tree's step cost"),
        (dict(trees=[CHAIN], guard=True), "EntMTPConfig.guard: True needs each tree's step cost"),
        (dict(bank=frontier_bank(), task="t", adapt=False, guard=True), "EntMTPConfig.guard: True prices trees"),
    ],
)
def test_invalid_guard_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EntMTPConfig(**kwargs)


# ----------------------------------------------------------------------------- decoding with the guard on
#: a guard that switches within a few steps, so short calls run both kinds of step
QUICK = functools.partial(BreakEvenGuard, min_steps=1, backoff_start=1, backoff_max=2)
#: each tree at a price near what the fitted heads accept, so the guard drops them now and then
GUARDED = {
    "chain": lambda: EntMTPConfig(trees=[CHAIN], costs=[2.5], guard=True),
    "mc_sim": lambda: EntMTPConfig(trees=[MC_SIM_7B_63], costs=[4.0], guard=True),
}


@pytest.mark.parametrize("name", list(GUARDED))
def test_greedy_with_the_guard_is_plain_generate(tiny_cache, monkeypatch, name):
    monkeypatch.setattr(drafter, "BreakEvenGuard", QUICK)
    model = enabled(tiny_cache)
    alone = longest = 0
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, entmtp_config=GUARDED[name](), return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, ref)
        stats = out.entmtp_stats
        alone += stats["root_alone_steps"]
        assert stats["tree_sizes"].count(1) == stats["root_alone_steps"]
        longest = max(longest, max(stats["accept_lengths"]))
    assert alone > 0 and longest >= 3, "both kinds of step should run for the test to mean anything"


@pytest.mark.parametrize("name", list(GUARDED))
def test_a_left_padded_batch_with_the_guard_is_plain_generate(tiny_cache, monkeypatch, name):
    monkeypatch.setattr(drafter, "BreakEvenGuard", QUICK)
    model = enabled(tiny_cache)
    _, ids, mask = batch_of()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=PAD,
        entmtp_config=GUARDED[name](),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref)
    per_row = [r["root_alone_steps"] for r in out.entmtp_stats["rows"]]
    assert sum(per_row) > 0 and any(max(r["accept_lengths"]) >= 3 for r in out.entmtp_stats["rows"])


def test_exact_sampling_with_the_guard_keeps_the_distribution(tiny_cache, monkeypatch):
    monkeypatch.setattr(drafter, "BreakEvenGuard", QUICK)
    model = enabled(tiny_cache)
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n, counts, guarded, long_paths = 1000, {}, 0, 0
    torch.manual_seed(1234)
    for _ in range(n):
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=True,
            temperature=0.7,
            top_k=4,
            return_dict_in_generate=True,
            entmtp_config=EntMTPConfig(trees=[SAMPLING_TREE], costs=[2.0], guard=True),
        )
        key = tuple(out.sequences[0, ids.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        guarded += out.entmtp_stats["root_alone_steps"] > 0
        long_paths += max(out.entmtp_stats["accept_lengths"]) >= 2
    assert guarded > n // 4 and long_paths > n // 6  # both kinds of step, often enough for the test to have power
    assert chi_square_p(counts, probs, n) > 1e-3


def test_heads_that_never_accept_decode_mostly_root_alone(tiny_cache):
    """Unfitted heads on a bank ranked with this machine's costs, the guard on: after
    the first probes almost every step verifies the root alone, and the text is plain generate's."""
    model = tiny_model("llama", seed=0)
    heads = HEADS_REGISTRY["hydra"].for_model(model, num_heads=4, arch="mlp").double().eval()
    enable_entmtp(model, heads)
    # the ranking picks the 3-node chain, a step at 1.4 root-alone steps: break-even at 1.4 tokens per step
    bank = frontier_bank().with_machine(_with_machine_costs(model, heads, {1: 10.0, 2: 13.0, 3: 14.0, 4: 20.0}))
    ids = prompts(1)[0]
    ref = model.generate(ids, max_new_tokens=80, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=80,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=bank, task="t", guard=True),
    )
    stats = out.entmtp_stats
    assert torch.equal(out.sequences, ref) and set(stats["tree_sizes"]) == {1, 3}
    assert stats["root_alone_steps"] > 0.6 * stats["steps"]
    default = model.generate(
        ids,
        max_new_tokens=80,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=bank, task="t"),
    )
    assert default.entmtp_stats["root_alone_steps"] == stats["root_alone_steps"]  # on by default, priced here
    off = model.generate(
        ids,
        max_new_tokens=80,
        do_sample=False,
        return_dict_in_generate=True,
        entmtp_config=EntMTPConfig(bank=bank, task="t", guard=False),
    )
    assert torch.equal(off.sequences, ref) and off.entmtp_stats["root_alone_steps"] == 0
    assert off.entmtp_stats["mean_accept_length"] < 1.2  # the heads do draft badly
