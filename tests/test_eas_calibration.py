"""EAS calibration: the replay reproduces the decode loop's steps, the model ranks settings."""

import json

import pytest
from test_generation import prompts

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.scheduling.eas import EASConfig, fixed_length
from entmtp_hf.tools.eas_calibration import (
    ChainReplay,
    Costs,
    calibrate,
    drafting_costs,
    grid,
    load_replays,
    replay_chains,
    replay_steps,
    save_replays,
    simulate,
)
from entmtp_hf.trees.tree import Tree

SETTINGS = [
    EASConfig(k_max=4, thresholds=(1.2,), band_edges=(), warmup_tokens=0),
    EASConfig(
        k_max=4,
        thresholds=(2.0, 1.0),
        band_edges=(1.0,),
        warmup_tokens=5,
        warmup_length=2,
        window=4,
        fork_min_history=2,
    ),
    fixed_length(3),
]


@pytest.mark.parametrize("config", SETTINGS, ids=["single", "bands-warmup-forks", "fixed-3"])
def test_replay_reproduces_the_decode_loop(tiny_cache, config):
    """Chain lengths, accepted drafts, tokens per step and EAS statistics equal a real greedy decode."""
    model, heads = tiny_cache()
    enable_entmtp(model, heads)
    for ids in prompts(2):
        out = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            return_dict_in_generate=True,
            entmtp_config=EntMTPConfig(tree=Tree.chain(4).choices, eas=config),
        )
        st = out.entmtp_stats
        rep = replay_chains(model, heads, out.sequences[0].tolist(), ids.shape[1])
        steps = replay_steps(rep, config, depth=4)
        assert [s.chain for s in steps] == st["eas"]["chain_lengths"]
        assert [s.new for s in steps] == st["accept_lengths"]
        # the last step may accept drafts past the output's end, which the replay cannot see
        assert 0 <= st["eas"]["accepted_draft_tokens"] - sum(s.accepted for s in steps) <= steps[-1].chain
        assert sum(s.chain for s in steps) == st["eas"]["verified_draft_tokens"]


def replay(entropies, matches, prompt_len=2):
    return ChainReplay(prompt_len, list(range(prompt_len + len(matches) + 1)), entropies, matches)


def test_simulate_costs_and_statistics_by_hand():
    # 6 new tokens; chain-2 steps: j=0 (2 match) adds 3, j=3 (0 match) adds 1, j=4 (2) adds 2 (the last)
    rep = replay([[0.1, 0.1]] * 6, [2, 0, 0, 0, 2, 0])
    costs = Costs({1: 1.0, 2: 1.1, 3: 1.2}, [0.0, 0.05, 0.1])
    assert [(s.chain, s.accepted, s.new) for s in replay_steps(rep, fixed_length(2), 2)] == [
        (2, 2, 3),
        (2, 0, 1),
        (2, 2, 2),
    ]
    r = simulate([rep], fixed_length(2), costs)
    assert r["speedup"] == pytest.approx(6 / (3 * 1.3)) and r["tokens_per_step"] == 2
    assert r["rejected_fraction"] == pytest.approx(2 / 6) and r["drafted_depths_per_step"] == 2
    # a threshold of 0.05 stops every chain at once: one-token steps, one depth drafted each
    halt = simulate([rep], EASConfig(k_max=2, thresholds=(0.05,), band_edges=(), warmup_tokens=0), costs)
    assert halt["mean_chain"] == 0 and halt["speedup"] == pytest.approx(1 / 1.05)


def test_calibrate_halts_where_the_heads_are_unsure_when_drafts_cost():
    matches = [0, 0, 0, 3, 0, 0, 0, 0, 0]
    rep = replay([[0.1, 0.1, 0.1] if m else [3.0, 3.0, 3.0] for m in matches], matches)
    flat = Costs({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, [0.0, 0.0, 0.0, 0.0])  # a GPU-like machine
    steep = Costs({1: 1.0, 2: 1.9, 3: 2.8, 4: 3.7}, [0.0, 0.01, 0.02, 0.03])  # each token costs a forward
    for costs in (flat, steep):
        result = calibrate([rep], costs)
        speed = {r["label"]: r["speedup"] for r in result["rows"]}
        assert speed[result["best"]] >= speed[result["best_fixed"]] and result["best_fixed"].startswith("chain-")
        assert EASConfig(**result["config"]) in grid(3).values()
    best = calibrate([rep], steep)
    assert best["rows"][0]["label"] == best["best"] and best["rows"][0]["speedup"] > 1.0  # halting pays here
    assert calibrate([rep], flat)["rows"][0]["speedup"] == pytest.approx(9 / 6)  # no halting cost: 6 steps either way


def test_replays_round_trip_and_bad_file_named(tmp_path):
    reps = {"a": replay([[0.5]] * 3, [1, 0, 0])}
    save_replays(tmp_path / "r.json", reps)
    assert load_replays(tmp_path / "r.json") == reps
    (tmp_path / "bad.json").write_text(json.dumps({"a": {"tokens": 3}}))
    with pytest.raises(ValueError, match="bad.json"):
        load_replays(tmp_path / "bad.json")


def test_drafting_costs_grow_with_depth(tiny_cache):
    model, heads = tiny_cache()
    costs = drafting_costs(model, heads, repeats=3, prefix_len=8)
    assert len(costs) == heads.num_heads + 1 and costs[0] == 0 and all(c > 0 for c in costs[1:])


def test_eas_config_from_json(tmp_path):
    path = tmp_path / "eas.json"
    path.write_text(json.dumps({"k_max": 6, "thresholds": [1.0], "band_edges": []}))
    assert EASConfig.from_json(path) == EASConfig(k_max=6, thresholds=(1.0,), band_edges=())
    for text, why in [("[1]", "JSON object"), ('{"k_mx": 3}', "unknown fields"), ('{"k_max": 0}', "k_max"), ("{", "")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"eas.json: not valid EAS settings.*{why}"):
            EASConfig.from_json(path)
    with pytest.raises(ValueError, match="missing.json"):
        EASConfig.from_json(tmp_path / "missing.json")
