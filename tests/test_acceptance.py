"""Simulated tokens per step on benchmark outputs equal what generate measures."""

import pytest
import torch
from tiny import VOCAB

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.tools.acceptance_table import acceptance_table, markdown, trajectories
from entmtp_hf.tools.search.trajectories import simulate_canonical
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


def fake_results(model, prompts, tree=None):
    """A greedy results dict: vanilla outputs, plus measured accept lengths of ``tree``."""
    results = {"settings": {"mode": "greedy"}, "prompts": {"t": []}, "records": []}
    for i, ids in enumerate(prompts):
        results["prompts"]["t"].append({"prompt_id": str(i), "input_ids": ids[0].tolist()})
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        results["records"].append(
            {"task": "t", "prompt_index": i, "method": "vanilla", "output_ids": ref[0, ids.shape[1] :].tolist()}
        )
        out = model.generate(
            ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=tree), return_dict_in_generate=True
        )
        results["records"].append(
            {
                "task": "t",
                "prompt_index": i,
                "method": "hydra-default",
                "accept_lengths": out.entmtp_stats["accept_lengths"],
            }
        )
    return results


def test_simulated_accept_length_equals_generate(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (1, 4 + i), generator=g) for i in range(3)]
    results = fake_results(model, prompts, MC_SIM_7B_63)
    table = acceptance_table(
        model,
        model.entmtp_heads,
        results,
        {"t": {"mc_sim_7b_63": Tree.from_choices(MC_SIM_7B_63), "chain": Tree.chain(2)}},
    )
    row = table["t"]
    assert row["prompts"] == 3 and row["tau"]["mc_sim_7b_63"]["num_nodes"] == 64
    measured = row["measured_hydra_default"]
    assert row["tau"]["mc_sim_7b_63"]["tau"] == pytest.approx(measured, rel=0.1) and measured > 1.5
    # step by step: every step but the last (which max_new_tokens cuts) is simulated exactly
    trajs = trajectories(model, model.entmtp_heads, results, "t")
    runs = [r["accept_lengths"] for r in results["records"] if r["method"] == "hydra-default"]
    for traj, real in zip(trajs, runs):
        sim = simulate_canonical(traj, Tree.from_choices(MC_SIM_7B_63))
        assert sim[: len(real) - 1] == real[:-1]
    assert 1.0 < row["tau"]["chain"]["tau"] <= 3.0
    assert "| mc_sim_7b_63 | 64 |" in markdown(table)


def test_sampling_runs_are_refused(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    results = {
        "settings": {"mode": "sampling"},
        "prompts": {"t": [{"input_ids": [1, 2]}]},
        "records": [{"task": "t", "prompt_index": 0, "method": "vanilla", "output_ids": [3]}],
    }
    with pytest.raises(ValueError, match="greedy"):
        acceptance_table(model, heads, results, {"t": {"chain": Tree.chain(1)}})
