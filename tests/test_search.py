"""Offline tree search on a tiny float64 Llama with random Hydra heads.

The rank-tuple shortcut is exact for greedy decoding, so several checks here are exact
equalities against real ``generate`` runs: a step starting at t accepts 1 + (the number of
prefixes of t's rank tuple that are paths of the tree), and real steps start where the
previous one ended.
"""

import json
import shutil

import pytest
import torch
from tiny import VOCAB, tiny_model

from entmtp_hf.banks.bank import TopologyBank
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.costs.table import CostTable
from entmtp_hf.heads import HydraHeads, MedusaHeads
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.tools.cli import build_parser
from entmtp_hf.tools.search import runner
from entmtp_hf.tools.search.choose import Choice, choose_trees, fan, value_sets
from entmtp_hf.tools.search.config import RETRIEVAL_RUNS, SearchConfig
from entmtp_hf.tools.search.frontier import frontier_nodes, greedy_frontier, rank_tuple_scorer
from entmtp_hf.tools.search.measure import generate_measure
from entmtp_hf.tools.search.outputs import file_search_machine
from entmtp_hf.tools.search.result import median
from entmtp_hf.tools.search.rollout import joint_rollout, rollout_scorer
from entmtp_hf.tools.search.runner import TreeSearch
from entmtp_hf.tools.search.trajectories import (
    Trajectory,
    accepted_depth,
    rank_tuples,
    simulate_canonical,
    table_accept,
)
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

NEW = 16
DEPTH = 3
DRAFT_VOCAB = 6  # ranks are limited to the draft vocabulary


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(seed=3)
    torch.manual_seed(3)
    heads = HydraHeads.for_model(model, num_heads=DEPTH, draft_vocab=torch.arange(DRAFT_VOCAB) * 2).double()
    # sharpen toward the model's own LM head rows so ranks are not uniform noise
    heads.init_lm_heads_from(model)
    enable_entmtp(model, heads)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (3 + i,), generator=g).tolist() for i in range(3)]
    cfg = SearchConfig(num_prompts=3, max_new_tokens=NEW, budget=8)
    measure = generate_measure(model, cfg)
    trajectories = []
    for p in prompts:
        tokens = p + measure("plain", None, p)["tokens"]
        trajectories.append(Trajectory(len(p), tokens, rank_tuples(model, heads, tokens, len(p), DEPTH, 8)))
    return model, heads, prompts, trajectories, measure


# ----------------------------------------------------------------------------- frontier
def test_frontier_nodes_children_siblings_and_limits():
    tree = Tree.from_choices([[0], [1], [0, 0]])
    assert set(frontier_nodes(tree, max_depth=2, max_rank=3)) == {(2,), (1, 0), (0, 1)}
    assert set(frontier_nodes(tree, max_depth=3, max_rank=2)) == {(1, 0), (0, 0, 0), (0, 1)}
    assert frontier_nodes(Tree.root_only(), 4, 10) == [(0,)]


def test_frontier_grows_one_node_at_a_time(setup):
    *_, trajectories, _ = setup
    points = greedy_frontier(rank_tuple_scorer(trajectories), 12, DEPTH, DRAFT_VOCAB)
    assert [p.num_nodes for p in points] == list(range(1, 13))
    assert points[0].tree == Tree.root_only()
    for prev, cur in zip(points, points[1:]):
        assert set(cur.tree.paths) - set(prev.tree.paths) == {cur.added}
        assert cur.tree == Tree.from_choices(cur.tree.choices)  # valid: every parent present
        assert cur.added in frontier_nodes(prev.tree, DEPTH, DRAFT_VOCAB)
        assert cur.accept >= prev.accept
        assert cur.tree.depth <= DEPTH and max(p[-1] for p in cur.tree.paths) < DRAFT_VOCAB
        assert cur.accept == pytest.approx(table_accept(trajectories, cur.tree))


def test_frontier_ties_prefer_small_rank_sum_then_shallow():
    def flat(tree, cands):  # every candidate scores the same
        return 1.0, [1.0] * len(cands)

    points = greedy_frontier(flat, 5, 3, 4)
    assert [p.added for p in points[1:]] == [(0,), (0, 0), (0, 0, 0), (1,)]


# ----------------------------------------------------------------------------- exactness
def test_rank_tuples_reproduce_canonical_generate(setup):
    """The rank-tuple table walked along the canonical path equals real generate, step by step."""
    model, _, prompts, trajectories, measure = setup
    frontier = greedy_frontier(rank_tuple_scorer(trajectories), 8, DEPTH, DRAFT_VOCAB)
    for tree in (frontier[3].tree, frontier[-1].tree, Tree.chain(DEPTH)):
        for p, traj in zip(prompts[:2], trajectories):
            run = measure("tree", EntMTPConfig(tree=tree.choices), p)
            assert run["tokens"] == traj.tokens[len(p) :]
            assert run["accept_lengths"] == simulate_canonical(traj, tree)


@pytest.mark.parametrize("cls,arch", [(HydraHeads, "prefix-mlp"), (MedusaHeads, "mlp")])
def test_rank_tuples_exact_for_other_heads(cls, arch):
    model = tiny_model(seed=4)
    torch.manual_seed(4)
    heads = cls.for_model(model, num_heads=4, arch=arch).double().init_lm_heads_from(model)
    enable_entmtp(model, heads)
    measure = generate_measure(model, SearchConfig(max_new_tokens=NEW))
    prompt = [3, 1, 4, 1, 5]
    tokens = prompt + measure("plain", None, prompt)["tokens"]
    traj = Trajectory(len(prompt), tokens, rank_tuples(model, heads, tokens, len(prompt), 4, 64))
    run = measure("mc_sim", EntMTPConfig(tree=MC_SIM_7B_63), prompt)
    assert run["accept_lengths"] == simulate_canonical(traj, Tree.from_choices(MC_SIM_7B_63))


@pytest.mark.parametrize("arch", ["eagle", "eagle3"])
def test_rank_tuples_and_rollouts_exact_for_an_eagle_drafter(tiny_cache, arch):
    """The search's teacher-forced table (the drafter's unrolled training forward) and its rollout
    (the drafter's tree drafting) both reproduce real generate with an EAGLE-style drafter."""
    model, heads = tiny_cache("llama", "eagle", arch)
    enable_entmtp(model, heads)
    measure = generate_measure(model, SearchConfig(max_new_tokens=NEW))
    prompt = [3, 1, 4, 1, 5]
    tokens = prompt + measure("plain", None, prompt)["tokens"]
    traj = Trajectory(len(prompt), tokens, rank_tuples(model, heads, tokens, len(prompt), 4, 64))
    tree = Tree.from_choices(MC_SIM_7B_63)
    run = measure("mc_sim", EntMTPConfig(tree=MC_SIM_7B_63), prompt)
    assert run["accept_lengths"] == simulate_canonical(traj, tree)
    assert joint_rollout(model, heads, prompt, tree, [], NEW).tree == simulate_canonical(traj, tree)
    assert max(run["accept_lengths"]) >= 3  # the fitted drafter drafts deep enough for this to test depth


def test_joint_rollout_single_candidate_equals_rank_tuple_score(setup):
    """From the root-only tree F = {[0]}: the joint rollout visits every step start, so its
    score of [0] is exactly the rank-tuple score (both average over all starts)."""
    model, heads, prompts, trajectories, _ = setup
    root = Tree.root_only()
    assert frontier_nodes(root, DEPTH, DRAFT_VOCAB) == [(0,)]
    base, [joint] = rollout_scorer(model, heads, prompts, SearchConfig(max_new_tokens=NEW), [])(root, [(0,)])
    _, [table] = rank_tuple_scorer(trajectories)(root, [(0,)])
    assert base == 1.0
    assert joint == pytest.approx(table, abs=1e-12)


def test_joint_rollout_candidates_read_off_the_trajectory(setup):
    """With a larger T the rollout advances with T only; each candidate's per-step accept
    length is the table value at the starts T visits (its known optimism is exactly that)."""
    model, heads, prompts, trajectories, _ = setup
    tree = Tree.from_choices([[0], [1], [0, 0]])
    cands = frontier_nodes(tree, DEPTH, DRAFT_VOCAB)
    for p, traj in zip(prompts, trajectories):
        counts = joint_rollout(model, heads, p, tree, cands, NEW)
        assert counts.tree == simulate_canonical(traj, tree)
        starts = [sum(counts.tree[:k]) for k in range(len(counts.tree))]
        for j, row in zip(starts, counts.candidates):
            want = [1 + accepted_depth(traj.tuples[j], set(tree.paths) | {c}) for c in cands]
            assert row == want


@pytest.mark.parametrize("rule", ["exact", "typical"])
def test_joint_rollout_sampling_rules(setup, rule):
    model, heads, prompts, *_ = setup
    tree = Tree.chain(1)
    cands = frontier_nodes(tree, DEPTH, DRAFT_VOCAB)
    g = torch.Generator().manual_seed(0)
    c = joint_rollout(model, heads, prompts[0], tree, cands, NEW, rule=rule, temperature=0.7, generator=g)
    assert sum(c.tree) == NEW - 1  # every token after the prefill's comes from a step
    assert all(min(row) >= t for t, row in zip(c.tree, c.candidates))  # adding a node never hurts


# ----------------------------------------------------------------------------- throughput choice
def test_upper_hull_and_choice():
    nodes, tps = [1, 2, 4, 8, 16], [10.0, 14.0, 15.0, 20.0, 12.0]
    c = choose_trees(nodes, tps)
    assert c.static == 3 and c.hull == [0, 1, 3, 4] and (c.conservative, c.aggressive) == (2, 4)  # fastest each side
    far = choose_trees([1, 2, 3, 64], [10.0, 14.0, 13.0, 7.0])  # CPU-like: the hull's right neighbour is 64
    assert (far.static, far.conservative, far.aggressive) == (1, 0, 2) and far.hull == [0, 1, 3]
    assert c.pareto == [0, 1, 2, 3]
    assert choose_trees([1, 2], [5.0, 5.0]).static == 0  # ties: fewer nodes
    one = choose_trees([3], [1.0])
    assert (one.static, one.conservative, one.aggressive) == (0, 0, 0)


def test_the_conservative_tree_must_also_cost_less():
    """Where a 4-token forward is cheaper than 2 or 3 tokens (a BLAS switching kernels at a few
    rows), the only cheaper tree than a 4-node EntMTP* is the root alone; with monotone costs nothing changes."""
    nodes, speed = [1, 2, 3, 4, 8], [0.95, 1.08, 1.09, 1.38, 1.30]
    amd = choose_trees(nodes, speed, costs=[1.0, 1.33, 1.56, 1.28, 1.66])
    assert (amd.static, amd.conservative, amd.aggressive) == (3, 0, 4)
    monotone = choose_trees(nodes, speed, costs=[1.0, 1.01, 1.09, 1.5, 2.0])
    assert (monotone.static, monotone.conservative) == (3, 2) == (choose_trees(nodes, speed).static, 2)
    alone = choose_trees([2, 4], [1.0, 1.2], costs=[1.3, 1.2])  # nothing cheaper: EntMTP* itself
    assert alone.conservative == alone.static == 1


FAKE_TPS = {"vanilla": 10.0, "frontier-1": 10.0, "frontier-2": 14.0, "frontier-4": 21.0, "frontier-8": 12.0}


def fake(measure, table, calls):
    """Real generate (for accept lengths), but the seconds say ``table[label]`` tokens/s."""

    def run(label, config, prompt):
        calls.append(label)
        r = measure(label, config, prompt)
        tps = table.get(label, 20.0 + 0.1 * sum(map(ord, label)) % 3)
        return {**r, "seconds": r["new_tokens"] / tps}

    return run


def small_config(**kw):
    args = dict(
        num_prompts=2,
        timing_prompts=2,
        max_new_tokens=12,
        budget=8,
        timed_sizes=(1, 2, 4, 8),
        time_reference=False,
        sweep_prompts=2,
        tau_grid=(0.3, 0.9),
        features=("base_top1",),
        ranking="measured",
    )
    return SearchConfig(**{**args, **kw})


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def pipeline(setup, tmp_path_factory):
    """One search run three times: interrupted in the rollout stage, resumed, rerun when done."""
    model, heads, prompts, _, measure = setup
    out = tmp_path_factory.mktemp("search")
    calls: list[list[str]] = [[], [], []]

    def flaky(label, config, prompt):  # dies on the 9th measurement (inside the rollout stage)
        if len(calls[0]) == 8:
            raise Interrupt
        return fake(measure, FAKE_TPS, calls[0])(label, config, prompt)

    def search(cfg=None, measure_fn=None):
        return TreeSearch(
            model, heads, prompts[:2], out, cfg or small_config(), task="tiny", measure=measure_fn, progress=False
        )

    with pytest.raises(Interrupt):
        search(measure_fn=flaky).run()
    interrupted = {k: len(v) for k, v in json.loads((out / "rollouts.json").read_text()).items() if k != "_configs"}
    frontier_done = json.loads((out / "frontier.json").read_text())["complete"]
    with pytest.MonkeyPatch.context() as mp:  # resumed runs must not recompute the first stages
        mp.setattr(runner, "step_table", lambda *a, **k: pytest.fail("trajectories stage was recomputed"))
        mp.setattr(runner, "greedy_frontier", lambda *a, **k: pytest.fail("frontier stage was recomputed"))
        result = search(measure_fn=fake(measure, FAKE_TPS, calls[1])).run(bank_dir=out / "banks")
        search(measure_fn=fake(measure, FAKE_TPS, calls[2])).run()
    return out, result, calls, interrupted, frontier_done, search


def test_resume_skips_finished_stages(pipeline):
    out, _, calls, interrupted, frontier_done, search = pipeline
    done = sum(interrupted.values())
    assert frontier_done and done == 3  # 5 warm-ups, then 3 of the 10 timed runs were saved
    rollout_labels = set(FAKE_TPS)
    assert len([c for c in calls[1] if c in rollout_labels]) == 5 + 10 - done  # warm-ups again + the rest
    assert calls[2] == []  # everything done: only the outputs are rewritten
    with pytest.raises(ValueError, match="other settings"):
        search(small_config(budget=6))


def test_search_static_is_throughput_max_and_bank_is_valid(pipeline):
    out, result, *_ = pipeline
    assert result.labels == ["frontier-1", "frontier-2", "frontier-4", "frontier-8"]
    assert result.timed["frontier-4"]["tokens_per_s"] == pytest.approx(21.0)
    assert result.timed["frontier-1"]["unbiased"] == 1.0
    bank = TopologyBank.from_pretrained(out / "banks", task="tiny")
    copy = TopologyBank.from_pretrained(out / "bank", task="tiny")  # rewritten by the third run
    assert (copy.trees, copy.scheduler) == (bank.trees, bank.scheduler)
    # the timed frontier, plus the 4-node fan the value policy may pick instead of frontier-4
    assert [t.num_nodes for t in bank.trees] == [1, 2, 4, 4, 8] and bank.trees[3] == fan(4)
    trees, at = result.bank_trees()
    assert trees == list(bank.trees) and at == [0, 1, 2, 4]
    # its acceptance frontier: the timed trees with their measured tokens per step
    assert bank.frontier == {at[i]: result.timed[lab]["unbiased"] for i, lab in enumerate(result.labels)}
    sched = bank.scheduler
    assert sched.static == 2 and sched.ladder == (1, 2, 4)  # the max; the ladder = it and its hull neighbours
    hyst = result.winners["hysteresis"]  # the best of every pair of ladder trees and every tau
    assert (sched.conservative, sched.aggressive) == tuple(at[i] for i in hyst["trees"])
    assert sched.conservative < sched.aggressive
    # value: frontier-4 against the fan of 4 (T+ has 8 nodes, too many to offer a fan for), alone and
    # with T- (frontier-2) as the cheaper option
    assert [lab for lab in result.sweep if lab.startswith("value")] == ["value:4", "value:2+4"]
    win = result.winners["value"]
    assert sched.value == tuple(bank.trees.index(Tree.from_choices(t)) for t in win["trees"])
    assert sched.value == {"value:4": (2, 3), "value:2+4": (1, 2, 3)}[win["label"]]
    assert sched.value_costs == tuple(win["costs"])
    assert sched.tau_on == hyst["values"][0] and sched.tau_on in (0.3, 0.9) and len(sched.thresholds) == 2
    assert {lab.split(":")[3] for lab in result.sweep if lab.startswith("hysteresis")} == {"1-2", "1-3", "2-3"}
    speed = {
        "static": 1.0,
        **{k: v["vs_static"] for k, v in result.winners.items() if k != "retrieval" and v["vs_static"] >= 1.05},
    }
    assert sched.policy == max(speed, key=speed.get) and sched.feature == "base_top1"
    assert result.confirmation == {} and not (out / "confirm.json").exists()  # 2 prompts, both the sweep's
    assert set(RETRIEVAL_RUNS) <= set(result.sweep)  # the static tree with retrieval branches, timed in the sweep
    won = result.winners["retrieval"]
    assert won["vs_static"] == max(result.sweep[lab]["vs_static"] for lab in RETRIEVAL_RUNS)
    assert sched.retrieval == (RETRIEVAL_RUNS[won["label"]] if won["vs_static"] >= 1.05 else None)
    meta = bank.metadata
    for k, info in enumerate(meta["trees"]):
        assert info["num_nodes"] == bank.trees[k].num_nodes
        if k in at:
            assert {"mean_accept_length", "biased_accept_length", "tokens_per_s"} <= set(info)
        else:
            assert info["name"] == "fan-4" and info["source"].startswith("value policy")
    assert meta["calibration"]["settings"]["budget"] == 8 and meta["hardware"] and meta["calibration"]["versions"]
    plan = EntMTPConfig(bank=str(out / "banks"), task="tiny").resolve(8)  # the bank's calibrated defaults
    assert plan.feature == "base_top1" and plan.scheduler_args["policy"] == sched.policy
    for name in ("report.md", "acceptance_frontier.png", "throughput_frontier.png", "result.json"):
        assert (out / name).stat().st_size > 0
    assert "EntMTP*" in (out / "report.md").read_text()
    assert json.loads((out / "result.json").read_text())["scheduler"]["static"] == 2


def test_a_searched_bank_keeps_its_timed_choice_there_and_is_re_ranked_elsewhere(pipeline, tmp_path):
    out, result, *_ = pipeline
    shutil.copytree(out / "banks", tmp_path / "bank")
    here = CostTable(
        {"key": "search"}, "probe", {1: 10.0, 2: 10.0, 4: 40.0, 8: 80.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 10.0
    )
    file_search_machine([tmp_path / "bank"], "tiny", here)
    bank = TopologyBank.from_pretrained(tmp_path / "bank", task="tiny")
    stored = bank.scheduler.static
    ranked = TopologyBank.from_pretrained(out / "banks", task="tiny").scheduler_for(here).static
    assert bank.trees[ranked].num_nodes == 2 != bank.trees[stored].num_nodes  # the ranking takes the cheap tree ...
    assert bank.scheduler_for(here).static == stored  # ... but the search machine keeps what it timed
    # elsewhere every node costs a forward of its own: no tree pays, the root alone
    slow = CostTable({"key": "slow"}, "probe", {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 10.0)
    assert bank.scheduler_for(slow).static == 0


def test_search_with_rollout_scoring_and_sampling(setup, tmp_path):
    """Exact-sampling search: joint-rollout frontier, sampled generate runs, a valid bank."""
    model, heads, prompts, _, _ = setup
    cfg = small_config(
        scoring="rollout",
        acceptance="exact",
        budget=4,
        timed_sizes=(1, 4),
        tau_grid=(0.5,),
        ladder=False,
        sweep_prompts=1,
    )
    measure = generate_measure(model, cfg)
    result = TreeSearch(
        model, heads, prompts[:2], tmp_path, cfg, task="tiny-exact", measure=fake(measure, {}, []), progress=False
    ).run()
    frontier = json.loads((tmp_path / "frontier.json").read_text())
    assert [p["num_nodes"] for p in frontier["points"]] == [1, 2, 3, 4] and frontier["complete"]
    assert result.frontier[0]["simulated"] is None and result.timed["frontier-4"]["unbiased"] >= 1.0
    bank = TopologyBank.from_pretrained(tmp_path / "bank", task="tiny-exact")
    assert [t.num_nodes for t in bank.trees] == [1, 4, 4]  # the frontier-4 and its fan, for the value policy
    assert {"value:4", "value:1+4"} <= set(result.sweep)  # the value sets, with root-only (T-) in front too
    assert bank.scheduler.value == {"value:4": (1, 2), "value:1+4": (0, 1, 2)}[result.winners["value"]["label"]]


def test_config_validation_and_cli():
    with pytest.raises(ValueError, match="greedy"):
        SearchConfig(acceptance="typical")
    with pytest.raises(ValueError, match="features"):
        SearchConfig(features=("nope",))
    argv = ["search", "--task", "gsm8k", "--out", "x", "--timed-sizes", "1,3", "--tau-grid", "0.1"]
    args = build_parser().parse_args(argv)
    from entmtp_hf.tools.search.cli import config_from_args

    cfg = config_from_args(args)
    assert cfg.timed_sizes == (1, 3) and cfg.tau_grid == (0.1,) and args.func.__name__ == "run_cli"


def test_value_sets_are_also_offered_with_the_cheaper_t_minus():
    trees = {
        "f1": Tree.root_only(),
        "f2": Tree.chain(1),
        "f3": Tree.chain(2),
        "f4": Tree.from_choices([[0], [0, 0], [1]]),
    }
    labels = list(trees)
    choice = Choice(static=2, conservative=1, aggressive=3, hull=[0, 1, 2, 3], pareto=[0, 1, 2, 3])
    sets = value_sets(trees, choice, labels)
    assert list(sets) == ["value:3", "value:4", "value:3+4", "value:2+3", "value:2+4", "value:2+3+4"]
    assert sets["value:2+3"] == [trees["f2"], trees["f3"], fan(3)]
    assert sets["value:2+3+4"] == [trees["f2"], trees["f3"], fan(3), trees["f4"], fan(4)]
    # T- no smaller than a set's trees adds nothing; root-only is offered like any smaller tree
    same = Choice(static=2, conservative=2, aggressive=3, hull=[0, 1, 2, 3], pareto=[0, 1, 2, 3])
    assert list(value_sets(trees, same, labels)) == ["value:3", "value:4", "value:3+4"]
    root = Choice(static=2, conservative=0, aggressive=2, hull=[0, 2], pareto=[0, 2])
    assert value_sets(trees, root, labels) == {
        "value:3": [trees["f3"], fan(3)],
        "value:1+3": [trees["f1"], trees["f3"], fan(3)],
    }


@pytest.mark.parametrize(
    "hyst,ladder,value,retrieval,held_out,policy",
    [
        (1.03, 0.9, 1.0, 1.04, None, "static"),
        (1.08, 1.06, 1.07, 1.3, None, "hysteresis"),
        (1.06, 1.2, 1.0, 1.06, 1.03, "ladder"),
        (1.06, 1.05, 1.1, 1.0, None, "value"),
        (1.08, 1.06, 1.07, 1.3, 1.01, "static"),
    ],
)
def test_default_policy_needs_a_clear_win_over_static(hyst, ladder, value, retrieval, held_out, policy):
    from entmtp_hf.tools.search.result import SearchResult

    choice = choose_trees([1, 2, 3], [10.0, 12.0, 11.0])
    timed = {lab: {"tree": Tree.chain(n - 1), "num_nodes": n} for lab, n in (("a", 1), ("b", 2), ("c", 3))}
    result = SearchResult(
        task="t",
        settings={},
        frontier=[],
        timed=timed,
        labels=["a", "b", "c"],
        choice=choice,
        vanilla_tokens_per_s=10.0,
        reference=None,
        elapsed={},
    )
    result.winners = {
        "hysteresis": {"label": "h", "feature": "chain_value", "values": [0.4], "vs_static": hyst, "trees": [0, 2]},
        "ladder": {"label": "l", "feature": "base_top1", "values": [0.2, 0.6], "vs_static": ladder},
        "value": {
            "label": "v",
            "trees": [Tree.chain(2).choices, fan(3).choices],
            "costs": [1.0, 1.0],
            "vs_static": value,
        },
        "retrieval": {
            "label": "static+retrieval-replace",
            "vs_static": retrieval,
            "config": {"mode": "replace", "num_tokens": 2},
        },
    }
    assert result.scheduler_candidate() == (
        None if max(hyst, ladder, value) < 1.05 else {"hysteresis": "h", "ladder": "l", "value": "v"}.get(policy, "h")
    )
    if held_out is not None:  # the sweep's winner measured again on prompts it was not picked on
        result.confirmation = {"label": result.scheduler_candidate(), "vs_static": held_out, "prompts": 8}
    d = result.scheduler_defaults()
    # a win over static turns retrieval on (its settings stored); never a policy itself
    stored = {"min_ngram": 2, "max_ngram": 4, "num_tokens": 2, "mode": "replace"}
    assert d["retrieval"] == (stored if retrieval >= 1.05 else None)
    # the fan joins the bank after the 3-node chain: indices past it move up by one
    assert d["value"] == [2, 3] and d["ladder"] == [0, 1, 2]
    assert d["policy"] == policy and (d["conservative"], d["aggressive"]) == (0, 2) and d["tau_on"] == 0.4
    assert d["feature"] == "chain_value" and d["ladder_feature"] == "base_top1" and d["thresholds"] == [0.2, 0.6]


def test_confirm_measures_the_candidate_on_prompts_the_sweep_did_not_use(setup, tmp_path):
    model, heads, prompts, _, measure = setup
    calls: list[str] = []
    seen: list[list[int]] = []

    def record(label, config, prompt):
        seen.append(prompt)
        return fake(measure, {"static": 10.0, "cand": 12.0}, calls)(label, config, prompt)

    cfg = small_config(num_prompts=3, timing_prompts=3, sweep_prompts=1)
    search = TreeSearch(model, heads, prompts, tmp_path, cfg, task="tiny", measure=record, progress=False)
    runs = {
        "static": EntMTPConfig(tree=Tree.chain(1).choices),
        "cand": EntMTPConfig(tree=Tree.chain(2).choices),
        "other": EntMTPConfig(tree=Tree.chain(3).choices),
    }
    out = search.confirm(runs, "cand")
    assert set(out) == {"static", "cand"} and set(out["cand"]) == {"1", "2"}  # prompt 0 was the sweep's
    assert all(p in (prompts[1], prompts[2]) for p in seen[-4:]) and "other" not in calls
    from entmtp_hf.tools.search.result import SearchResult

    result = SearchResult(
        task="t",
        settings={},
        frontier=[],
        timed={},
        labels=[],
        choice=choose_trees([1], [1.0]),
        vanilla_tokens_per_s=1.0,
        reference=None,
        elapsed={},
    )
    result.with_confirmation(out)
    assert result.confirmation["label"] == "cand" and result.confirmation["prompts"] == 2
    assert result.confirmation["measured_vs_static"] == pytest.approx(1.2)
    cfg = small_config(num_prompts=3, timing_prompts=3, sweep_prompts=3)  # nothing held out: nothing to confirm
    assert (
        TreeSearch(model, heads, prompts, tmp_path / "b", cfg, task="tiny", measure=record, progress=False).confirm(
            runs, "cand"
        )
        == {}
    )


def test_checkpointed_runs_are_remeasured_when_their_label_gets_another_config(setup, tmp_path):
    model, heads, prompts, _, measure = setup
    calls: list[str] = []
    search = TreeSearch(
        model,
        heads,
        prompts[:2],
        tmp_path,
        small_config(),
        task="tiny",
        measure=fake(measure, {}, calls),
        progress=False,
    )
    first = {"static": EntMTPConfig(tree=Tree.chain(1).choices), "other": EntMTPConfig(tree=Tree.chain(2).choices)}
    out, measured = search._interleaved("sweep", first, [0, 1], search.measure)
    assert measured and set(out) == {"static", "other"}
    calls.clear()
    # a re-ranking gives the role "static" another tree: only it is measured again, "other" is kept
    second = {"static": EntMTPConfig(tree=Tree.chain(3).choices), "other": first["other"]}
    out, measured = search._interleaved("sweep", second, [0, 1], search.measure)
    assert measured and [c for c in calls if c == "other"] == ["other"]  # its warm-up only
    assert calls.count("static") == 1 + 2
    out, measured = search._interleaved("sweep", {"other": first["other"]}, [0, 1], search.measure)
    assert not measured and set(out) == {"other"}  # only the labels asked for come back


def test_sweep_thresholds_are_in_each_features_units(setup, tmp_path):
    """accept_ema is swept in tokens per step (1 + t * depth of T-, or of the ladder's deepest tree)."""
    model, heads, prompts, _, _ = setup
    cfg = small_config(features=("head_confidence", "accept_ema"), tau_grid=(0.25, 0.5, 0.75))
    search = TreeSearch(model, heads, prompts[:2], tmp_path, cfg, task="tiny", progress=False)
    trees = {f"t{n}": Tree.chain(n) for n in (1, 2, 3)}
    runs = search.sweep_runs(trees, Choice(1, 0, 2, [0, 1, 2], [0, 1, 2]), list(trees))
    taus = {
        f: sorted({float(lab.split(":")[2]) for lab in runs if lab.startswith(f"hysteresis:{f}:")})
        for f in cfg.features
    }
    assert taus["head_confidence"] == [0.25, 0.5, 0.75]
    # hysteresis on accept_ema: 1 + t * depth of T- (floored at 1), reachable while T- runs
    for lo, hi in ((0, 1), (0, 2), (1, 2)):
        got = sorted(
            float(lab.split(":")[2])
            for lab in runs
            if lab.startswith("hysteresis:accept_ema:") and lab.endswith(f":{lo}-{hi}")
        )
        d = max(trees[f"t{lo + 1}"].depth, 1)
        assert got == [1.0 + d * t for t in (0.25, 0.5, 0.75)] and max(got) <= trees[f"t{lo + 1}"].depth + 1
    assert max(t.depth for t in trees.values()) == DEPTH  # the ladder's deepest tree
    ladder = runs[f"ladder:accept_ema:{1 + DEPTH * 0.25:g},{1 + DEPTH * 0.5:g}"]
    plan = ladder.resolve(DEPTH)
    assert plan.feature == "accept_ema" and tuple(plan.scheduler_args["thresholds"]) == (
        1 + DEPTH * 0.25,
        1 + DEPTH * 0.5,
    )
    shallow = search.sweep_runs(
        {"t1": Tree.chain(1), "t2": Tree.chain(2)}, Choice(1, 0, 1, [0, 1], [0, 1]), ["t1", "t2"]
    )
    assert not any(lab.startswith("ladder:") for lab in shallow)  # two trees: hysteresis covers it
    three = {f"t{n}": Tree.chain(n) for n in (1, 2)} | {"t2b": Tree.from_choices([[0], [1]])}
    runs = search.sweep_runs(three, Choice(1, 0, 2, [0, 1, 2], [0, 1, 2]), list(three))
    ladders = [conf for lab, conf in runs.items() if lab.startswith("ladder:accept_ema:")]
    assert ladders  # shallower than the heads: thresholds stay within the trees' reach (depth 2 + 1)
    assert all(max(conf.thresholds) <= 3.0 and conf.resolve(DEPTH) is not None for conf in ladders)


# ----------------------------------------------------------------------------- modelled ranking
def test_modelled_speed_is_tokens_over_work_and_own_overhead():
    from entmtp_hf.tools.search.result import modelled_speed

    run = {
        "seconds": 9.0,
        "new_tokens": 7,
        "accept_lengths": [2, 1, 3],
        "tree_sizes": [2, 2, 3],
        "forward_seconds": 1.0,
        "decode_seconds": 1.1,
    }
    costs = {1: 1.0, 2: 1.2, 3: 1.5}
    assert modelled_speed(run, costs) == pytest.approx(6 / ((1.2 + 1.2 + 1.5) * 1.1))
    assert modelled_speed({**run, "seconds": 90.0}, costs) == modelled_speed(run, costs)  # wall time plays no part
    assert modelled_speed({"seconds": 1.0, "new_tokens": 7, "accept_lengths": []}, costs) is None  # plain decoding
    # sizes the cost stage did not time (retrieval branches): linear between neighbours, or along the last two
    assert modelled_speed(run, {1: 1.0, 2: 1.2}) == pytest.approx(6 / ((1.2 + 1.2 + 1.4) * 1.1))


def test_modelled_ranking_ignores_wall_time_and_checkpoints_costs(setup, tmp_path):
    """Wall times say the 8-node tree is fastest; with forward costs that grow fast in N the
    modelled ranking picks the tree with the most tokens per unit of modelled work."""
    from entmtp_hf.tools.search.result import modelled_speed

    model, heads, prompts, _, measure = setup
    asked = []

    def costs(model_, sizes, *, prefix_len, repeats):
        asked.append((tuple(sizes), prefix_len, repeats))
        return {n: 0.01 * (1 + 0.6 * (n - 1)) for n in sizes}

    wall = {"vanilla": 10.0, "frontier-1": 10.0, "frontier-2": 11.0, "frontier-4": 12.0, "frontier-8": 30.0}
    cfg = small_config(ranking="modelled", cost_repeats=3)
    result = TreeSearch(
        model,
        heads,
        prompts[:2],
        tmp_path,
        cfg,
        task="tiny",
        measure=fake(measure, wall, []),
        forward_costs=costs,
        progress=False,
    ).run()
    # the timed trees' sizes and those plus up to 4 retrieved tokens (the sweep's retrieval runs)
    want_sizes = tuple(sorted({1, 2, 4, 8} | {n + k for n in (1, 2, 4, 8) for k in range(1, 5)}))
    assert asked == [(want_sizes, int(median([len(p) for p in prompts[:2]])) + 6, 3)]
    rel = {n: 1 + 0.6 * (n - 1) for n in want_sizes}
    assert result.costs == pytest.approx(rel)
    runs = json.loads((tmp_path / "rollouts.json").read_text())
    want = {lab: median([modelled_speed(r, rel) for r in runs[lab].values()]) for lab in result.labels}
    assert {lab: result.timed[lab]["modelled"] for lab in result.labels} == pytest.approx(want)
    best = max(result.labels, key=lambda lab: (want[lab], -result.timed[lab]["num_nodes"]))
    assert result.labels[result.choice.static] == best != "frontier-8"
    timed_sweep = json.loads((tmp_path / "sweep.json").read_text())
    static = timed_sweep["static"]
    replayed = {lab for lab, v in result.sweep.items() if v.get("replayed")}
    # greedy rank tuples + forward costs: every hysteresis and ladder run is replayed, not timed
    assert replayed == {lab for lab in result.sweep if lab.startswith(("hysteresis:", "ladder:"))} | {
        "static (replayed)"
    }
    assert len(replayed) >= 3 and not replayed & set(timed_sweep)
    for lab, v in result.sweep.items():  # the timed sweep's winners are ranked the same way
        if lab in replayed:
            continue
        mine = timed_sweep[lab]
        ratios = [modelled_speed(r, rel) / modelled_speed(static[p], rel) for p, r in mine.items()]
        assert v["vs_static"] == pytest.approx(median(ratios))
    bank = TopologyBank.from_pretrained(tmp_path / "bank", task="tiny")
    assert bank.metadata["calibration"]["ranked_by"].startswith("modelled")
    assert "c(N)" in (tmp_path / "report.md").read_text()
    h = result.headroom  # foresight bounds every static tree and every replayed scheduler (no retrieval in them)
    assert h["trees"] == [result.timed[lab]["num_nodes"] for lab in result.labels] and h["prompts"] == 2
    assert h["foresight_vs_static"] >= 1.0 and "Headroom:" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "result.json").read_text())["headroom"] == h
    TreeSearch(
        model,
        heads,
        prompts[:2],
        tmp_path,
        cfg,
        task="tiny",
        measure=fake(measure, wall, []),
        forward_costs=lambda *a, **k: pytest.fail("costs were measured again"),
        progress=False,
    ).run()
