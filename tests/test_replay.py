"""Replaying greedy decoding from rank tuples must reproduce real ``generate`` step by step.

A tiny float64 Llama with random Hydra heads decodes each plan for real; the replay sees only
the plain greedy output, its rank tuples and teacher-forced signals. Accept lengths and
verified tree sizes must be equal at every step, for switching policies (their features
read from the signals) and with retrieval branches, appended or replacing the tree.
"""

import pytest
import torch
from tiny import VOCAB, tiny_model

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.heads import HydraHeads
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.tools.search.config import SearchConfig
from entmtp_hf.tools.search.measure import generate_measure
from entmtp_hf.tools.search.replay import (
    SIGNALS,
    accept_table,
    foresight_rate,
    replay,
    retrieval_figures,
    walk_rate,
    why_not_replayable,
)
from entmtp_hf.tools.search.trajectories import Trajectory, simulate_canonical, step_table
from entmtp_hf.trees.retrieval import RetrievalConfig
from entmtp_hf.trees.tree import Tree

NEW = 40
DEPTH = 3
SMALL, LARGE = Tree.from_choices([[0], [1]]), Tree.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(seed=3)
    torch.manual_seed(3)
    heads = HydraHeads.for_model(model, num_heads=DEPTH, draft_vocab=torch.arange(8) * 3).double()
    heads.init_lm_heads_from(model)
    enable_entmtp(model, heads)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (4 + 3 * i,), generator=g).tolist() for i in range(3)]
    measure = generate_measure(model, SearchConfig(max_new_tokens=NEW))
    trajectories = []
    for p in prompts:
        tokens = p + measure("plain", None, p)["tokens"]
        tuples, signals = step_table(model, heads, tokens, len(p), DEPTH, 8)
        trajectories.append(Trajectory(len(p), tokens, tuples, signals))
    return model, heads, prompts, trajectories, measure


def _median_signal(trajectories, name: str, q: float = 0.5) -> float:
    values = sorted(v for t in trajectories for v in t.signals[name])
    return values[int(len(values) * q)]


def _configs(trajectories) -> dict[str, EntMTPConfig]:
    two = [SMALL.choices, LARGE.choices]
    hyst = {"trees": two, "policy": "hysteresis"}
    out = {
        "static": EntMTPConfig(tree=LARGE.choices),
        "accept_ema": EntMTPConfig(**hyst, feature="accept_ema", feature_window=4, tau_on=1.3, tau_off=1.2),
        "head_confidence": EntMTPConfig(
            **hyst,
            feature="head_confidence",
            tau_on=_median_signal(trajectories, "head_confidence"),
            tau_off=_median_signal(trajectories, "head_confidence") * 0.9,
        ),
        "confidence_ema": EntMTPConfig(
            **hyst,
            feature="confidence_ema",
            feature_window=4,
            tau_on=_median_signal(trajectories, "base_top1") * 0.5,
            tau_off=_median_signal(trajectories, "base_top1") * 0.5,
        ),
        "ladder": EntMTPConfig(
            trees=[Tree.root_only().choices, *two],
            policy="ladder",
            feature="base_top1",
            thresholds=[
                _median_signal(trajectories, "base_top1", 0.25),
                _median_signal(trajectories, "base_top1", 0.75),
            ],
        ),
    }
    for mode, n in (("append", 3), ("replace", 2)):
        retrieval = RetrievalConfig(num_tokens=n, mode=mode)
        out[f"static+{mode}"] = EntMTPConfig(tree=LARGE.choices, retrieval=retrieval)
        out[f"accept_ema+{mode}"] = EntMTPConfig(
            **hyst, feature="accept_ema", tau_on=1.3, tau_off=1.3, retrieval=retrieval
        )
        out[f"head_confidence+{mode}"] = EntMTPConfig(
            **hyst,
            feature="head_confidence",
            retrieval=retrieval,
            tau_on=_median_signal(trajectories, "head_confidence"),
            tau_off=_median_signal(trajectories, "head_confidence"),
        )
    return out


@pytest.mark.parametrize(
    "name",
    [
        "static",
        "accept_ema",
        "head_confidence",
        "confidence_ema",
        "ladder",
        "static+append",
        "static+replace",
        "accept_ema+append",
        "accept_ema+replace",
        "head_confidence+append",
        "head_confidence+replace",
    ],
)
def test_replay_equals_generate_step_by_step(setup, name):
    model, heads, prompts, trajectories, measure = setup
    config = _configs(trajectories)[name]
    plan = config.resolve(heads.num_heads)
    sizes_seen = set()
    for p, traj in zip(prompts, trajectories):
        run = measure(name, config, p)
        assert run["tokens"] == traj.tokens[len(p) :]  # lossless: the same greedy output
        got = replay(traj, plan, config.feature_window)
        assert got.accept_lengths == run["accept_lengths"]
        assert got.tree_sizes == run["tree_sizes"]
        sizes_seen.update(run["tree_sizes"])
    if name != "static":  # the case is not vacuous: the policy switched, or retrieval changed the tree
        assert len(sizes_seen) > 1, sizes_seen


def test_static_replay_is_the_canonical_simulation(setup):
    *_, trajectories, _ = setup
    plan = EntMTPConfig(tree=LARGE.choices).resolve(DEPTH)
    for traj in trajectories:
        assert replay(traj, plan).accept_lengths == simulate_canonical(traj, LARGE)


def test_signals_cover_every_step_start(setup):
    *_, trajectories, _ = setup
    for traj in trajectories:
        for name in SIGNALS:
            assert len(traj.signals[name]) == len(traj.tuples)
        assert all(0.0 < p <= 1.0 for p in traj.signals["head_confidence"] + traj.signals["base_top1"])
        assert all(h >= 0.0 for h in traj.signals["entropy"])


def test_what_cannot_be_replayed_is_refused(setup):
    *_, trajectories, _ = setup
    value = EntMTPConfig(trees=[SMALL.choices, LARGE.choices], policy="value").resolve(DEPTH)
    chain = EntMTPConfig(trees=[SMALL.choices, LARGE.choices], feature="chain_value").resolve(DEPTH)
    assert "value" in why_not_replayable(value) and "chain_value" in why_not_replayable(chain)
    with pytest.raises(ValueError, match="cannot replay"):
        replay(trajectories[0], value)
    bare = Trajectory(trajectories[0].prompt_len, trajectories[0].tokens, trajectories[0].tuples)
    head = EntMTPConfig(trees=[SMALL.choices, LARGE.choices], feature="head_confidence").resolve(DEPTH)
    with pytest.raises(ValueError, match="lacks the signals"):
        replay(bare, head)
    assert replay(bare, EntMTPConfig(trees=[SMALL.choices, LARGE.choices], feature="accept_ema").resolve(DEPTH))


def test_accept_table_is_the_static_replay(setup):
    """A static walk along the table takes the steps a real static run takes."""
    for traj in setup[3]:
        table = accept_table(traj, [SMALL, LARGE])
        for k, tree in enumerate((SMALL, LARGE)):
            j, lengths = 0, []
            while j < len(table):
                lengths.append(table[j][k])
                j += table[j][k]
            assert lengths == simulate_canonical(traj, tree)


def test_foresight_rate_bounds_every_walk_and_finds_the_obvious_optimum():
    # tree 0 (cost 1) adds 1 token; tree 1 (cost 2) adds 3 where a long run starts (j % 4 == 0), else 1:
    # with foresight, the big tree only at those starts: 4 tokens per 3 units of work, every 4 tokens
    table = [[1, 3 if j % 4 == 0 else 1] for j in range(40)]
    assert foresight_rate([table], [1.0, 2.0]) == pytest.approx(4 / 3)
    a, w = walk_rate([table], [1.0, 2.0], lambda i, j: 1)
    assert a / w == pytest.approx(1.0)  # the big tree always: 3 + 1 tokens per 2 + 2 units of work
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tables = [
            [[1 + int(x) for x in torch.randint(0, 4, (3,), generator=g).cummax(0).values] for _ in range(25)]
            for _ in range(3)
        ]
        costs = [1.0, 1.3, 1.9]
        best = foresight_rate(tables, costs)
        picks = torch.randint(0, 3, (3, 25), generator=g)
        for choose in (lambda i, j: 0, lambda i, j: 1, lambda i, j: 2, lambda i, j: int(picks[i, j])):
            a, w = walk_rate(tables, costs, choose)
            assert a / w <= best + 1e-12
    with pytest.raises(ValueError, match="positive costs"):
        foresight_rate([table], [1.0, 0.0])


def test_retrieval_figures_count_the_steps_generate_takes(setup):
    """The pooled figures a bank stores: tokens, steps without a continuation and steps with one
    of each length, equal to what real ``generate`` runs with the setting (replace: a found
    continuation of L tokens verifies L + 1 nodes, fewer than the tree's)."""
    model, heads, prompts, trajectories, measure = setup
    retrieval = RetrievalConfig(num_tokens=2, mode="replace")
    figures = retrieval_figures(trajectories, LARGE, retrieval, DEPTH)
    sizes, tokens = [], 0
    for p in prompts:
        run = measure("replace-2", EntMTPConfig(tree=LARGE.choices, retrieval=retrieval), p)
        sizes += run["tree_sizes"]
        tokens += sum(run["accept_lengths"])
    assert figures.tokens == tokens
    assert figures.drafted == sizes.count(LARGE.num_nodes)
    assert list(figures.found) == [sizes.count(n + 1) for n in (1, 2)]
    assert sum(figures.found) > 0  # not vacuous: continuations were found
