"""Typical acceptance as the published Hydra/Medusa code computes it (``typical_rule="reference"``).

The reference below is a direct transcription of the published formula in plain Python:
posterior ``softmax(raw logits / T)``, entropy ``-sum p log(p + 1e-5)``, a drafted token
passes iff its probability exceeds ``min(eps, alpha * exp(-H))``, the longest run of passing
nodes from the root wins, ties go to the larger sum of ``log p`` (the first such path on an
exact tie).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_generation import enabled, prompts, random_choices

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.decoding.acceptance import reference_typical_flags, typical_accept_flags, typical_best_path
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree


def published_typical(
    logits: list[list[float]], tokens: list[int], rows: list[list[int]], temperature: float, eps: float, alpha: float
) -> list[int]:
    """The published rule, node by node: the accepted path (node indices, root first)."""

    def posterior(node: int) -> list[float]:
        scaled = [x / temperature for x in logits[node]]
        top = max(scaled)
        weights = [math.exp(x - top) for x in scaled]
        return [w / sum(weights) for w in weights]

    best_key, best = None, None
    for row in rows:
        path, loglik = [row[0]], 0.0
        for parent, child in zip(row, row[1:]):
            if child < 0:
                break
            p = posterior(parent)
            entropy = -sum(q * math.log(q + 1e-5) for q in p)
            if not p[tokens[child]] > min(eps, alpha * math.exp(-entropy)):
                break
            path.append(child)
            loglik += math.log(p[tokens[child]])
        key = (len(path), loglik)
        if best_key is None or key > best_key:
            best_key, best = key, path
    return best


def reference_path(
    logits: torch.Tensor, tokens: torch.Tensor, tree: Tree, temperature: float, eps: float, alpha: float
) -> list[int]:
    b = tree.buffers()
    passed, logp = reference_typical_flags(logits, tokens, b.parents, temperature, eps, alpha)
    return typical_best_path(passed, logp, b.retrieve_indices)


TREES = {
    "mc_sim_7b_63": Tree.from_choices(MC_SIM_7B_63),
    "random": Tree.from_choices(random_choices(3)),
    "chain": Tree.chain(4),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_reference_rule_matches_the_published_formula(name):
    tree, g = TREES[name], torch.Generator().manual_seed(0)
    rows = tree.buffers().retrieve_indices.tolist()
    for trial in range(40):
        vocab = 6 + trial % 11
        logits = torch.randn(tree.num_nodes, vocab, generator=g, dtype=torch.float64) * (0.5 + trial % 5)
        tokens = torch.randint(0, vocab, (tree.num_nodes,), generator=g)
        temperature = (0.3, 0.7, 1.0, 1.6)[trial % 4]
        eps, alpha = (0.09, 0.3) if trial % 3 else (0.2, 0.9)
        got = reference_path(logits, tokens, tree, temperature, eps, alpha)
        assert got == published_typical(logits.tolist(), tokens.tolist(), rows, temperature, eps, alpha), trial


def test_exact_ties_go_to_the_first_path_like_the_published_code():
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0]])  # two equal branches of depth 2
    logits = torch.zeros(tree.num_nodes, 4, dtype=torch.float64)
    logits[:, 2:] = 3.0  # tokens 2 and 3 equally likely everywhere
    tokens = torch.tensor([0, 2, 3, 3, 2])
    rows = tree.buffers().retrieve_indices.tolist()
    assert (
        reference_path(logits, tokens, tree, 1.0, 0.09, 0.3)
        == published_typical(logits.tolist(), tokens.tolist(), rows, 1.0, 0.09, 0.3)
        == [0, 1, 3]
    )


def test_the_entropy_offset_changes_borderline_decisions():
    """Not the exact entropy: a token just above the exact threshold can fail the published one."""
    tree = Tree.chain(1)
    logits = torch.tensor([[0.0] * 8, [0.0] * 8], dtype=torch.float64)  # uniform: p = 1/8, H = log 8
    tokens = torch.tensor([0, 5])
    alpha = 0.125 * 8 * (1 - 1e-6)  # alpha * exp(-log 8) just below 1/8: the exact rule accepts
    b = tree.buffers()
    passed, logp = typical_accept_flags(logits, tokens, b.parents, 1.0, alpha)
    assert typical_best_path(passed, logp, b.retrieve_indices) == [0, 1]  # this project's rule: exact entropy
    assert reference_path(logits, tokens, tree, 1.0, 1.0, alpha) == [0]  # -sum p log(p + 1e-5) < log 8: higher bar
    assert published_typical(logits.tolist(), tokens.tolist(), [[0, 1]], 1.0, 1.0, alpha) == [0]


def roots(sequence: torch.Tensor, prompt_len: int, accept_lengths: list[int]) -> list[int]:
    """Positions of the verifier's own tokens: the prefill's, then the last of every whole step."""
    positions, at = [prompt_len], prompt_len
    for n in accept_lengths[:-1]:  # the last step may be cut by the length limit
        at += n
        positions.append(at)
    return positions


@pytest.mark.parametrize("rule", ["project", "reference"])
def test_typical_decoding_runs_with_either_rule(tiny_cache, rule):
    model = enabled(tiny_cache)
    config = EntMTPConfig(tree=MC_SIM_7B_63, acceptance="typical", typical_rule=rule)
    argmax_roots, all_roots, multi = 0, 0, 0
    for i, ids in enumerate(prompts(3, seed=5)):
        torch.manual_seed(i)
        out = model.generate(
            ids, max_new_tokens=30, do_sample=True, temperature=0.7, entmtp_config=config, return_dict_in_generate=True
        )
        seq, lengths = out.sequences[0], out.entmtp_stats["accept_lengths"]
        assert seq.shape[0] == ids.shape[1] + 30
        multi += sum(n > 1 for n in lengths)
        with torch.no_grad():
            greedy = model(seq[None]).logits[0].argmax(-1)  # greedy[k] = the argmax after seq[: k + 1]
        for pos in roots(seq, ids.shape[1], lengths):
            all_roots += 1
            argmax_roots += int(seq[pos] == greedy[pos - 1])
    assert multi > 5, "drafted tokens should often be accepted"
    if rule == "reference":
        assert argmax_roots == all_roots  # the root by argmax, even when sampling
    else:
        assert argmax_roots < all_roots  # control: this project's rule samples the root
