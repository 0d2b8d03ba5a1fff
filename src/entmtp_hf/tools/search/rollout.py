"""Scoring frontier candidates by joint self-rollouts (``scoring="rollout"``).

One self-rollout with the joint tree T ∪ F(T) per prompt: the trajectory advances with T, and
each candidate's accept length is read off the verifier's results masked to its paths. Unlike
the rank tuples this covers sampling and typical acceptance too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from transformers import DynamicCache

from ...decoding.acceptance import sample_picks, typical_accept_flags
from ...decoding.attention import tree_attention_mask
from ...decoding.cache import keep_accepted
from ...trees.tree import Path, Tree
from .config import SearchConfig
from .frontier import ScoreFn


@dataclass
class RolloutCounts:
    """Per-step accept lengths of one self-rollout: the trajectory's tree and each candidate."""

    tree: list[int] = field(default_factory=list)
    candidates: list[list[int]] = field(default_factory=list)  # [steps][candidate]


def _emitted(tokens: list[int], left: int, eos: set[int]) -> int:
    """How many of ``tokens`` generate would append: at most ``left``, up to the first EOS."""
    for k, tok in enumerate(tokens[:left]):
        if tok in eos:
            return k + 1
    return min(len(tokens), left)


def _node_checks(rule, scores, tokens, buffers, picks, eps, alpha):
    """Per-node pass flags (node token accepted at its parent) and log p under the parent."""
    parents = buffers.parents
    if rule == "typical":
        return typical_accept_flags(scores, tokens, parents, eps, alpha)
    ok = tokens == picks[parents.clamp(min=0)]
    ok[0] = True
    return ok, torch.zeros_like(scores[:, 0])


def _deepest_reached(b, reached: torch.Tensor, allowed: torch.Tensor, logp: torch.Tensor) -> int:
    """The deepest reached node among ``allowed`` (ties: the larger sum of log p on its path)."""
    anc, valid = b.ancestors.clamp(min=0), b.ancestors >= 0
    key = b.position_ids.double() * 1e6 + (logp[anc] * valid).sum(-1).double()
    return int(torch.where(reached & allowed, key, torch.full_like(key, -1e18)).argmax())


def _verify(model, heads, cache, b, tokens: torch.Tensor, next_pos: int):
    """One base-model forward over a drafted tree appended to the cache."""
    prefix_len = int(cache.get_seq_length())
    dtype = b.attn_mask.dtype
    mask = tree_attention_mask(b, torch.zeros(prefix_len, dtype=dtype, device=tokens.device), prefix_len + b.num_nodes)
    return model(
        input_ids=tokens[None],
        attention_mask=mask,
        position_ids=(b.position_ids + next_pos)[None],
        cache=cache,
        use_cache=True,
        output_hidden_states=heads.hidden_states_request,
    )


@torch.no_grad()
def joint_rollout(
    model,
    heads,
    prompt: Sequence[int],
    tree: Tree,
    candidates: Sequence[Path],
    max_new_tokens: int,
    *,
    rule: str = "greedy",
    temperature: float = 1.0,
    epsilon: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
    eos_token_ids: Iterable[int] = (),
) -> RolloutCounts:
    """One self-rollout over the joint tree U = T ∪ F: verify U every step, advance with T.

    A node *passes* when its token is the verifier's pick at its parent (greedy: argmax;
    exact: one shared draw per node; typical: the p > min(ε, α·e^{-H}) test); it is
    *reached* when it and all its ancestors pass. Tree S accepts the deepest reached node
    of S, so candidate T ∪ {ν} accepts max(d_T, depth(ν) if ν is reached).
    """
    eos = set(eos_token_ids)
    joint = Tree.from_choices([*tree.choices, *map(list, candidates)])
    device = model.get_output_embeddings().weight.device
    b = joint.buffers(device, model.get_output_embeddings().weight.dtype)
    in_tree = torch.zeros(joint.num_nodes, dtype=torch.bool, device=device)
    in_tree[joint.subtree_map(tree)] = True
    cand_nodes = [joint.node_index()[tuple(c)] for c in candidates]
    depth = b.position_ids.tolist()
    scale = 1.0 if rule == "greedy" else 1.0 / temperature

    def pick(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float() * scale
        if rule == "greedy":
            return scores.argmax(-1)
        return sample_picks(scores, generator)

    state, cache = heads.new_state(model), DynamicCache(config=model.config)
    prompt_ids = torch.tensor([list(prompt)], device=device)
    out = model(input_ids=prompt_ids, cache=cache, use_cache=True, output_hidden_states=heads.hidden_states_request)
    heads.observe(state, heads.features(out.hidden_states)[0], tokens=prompt_ids[0])
    root, emitted, next_pos, counts = int(pick(out.logits[0, -1:])[0]), 1, len(prompt), RolloutCounts()
    while emitted < max_new_tokens and root not in eos:
        tokens = heads.propose(state, torch.tensor(root, device=device), b).tokens.to(device)
        out = _verify(model, heads, cache, b, tokens, next_pos)
        picks = pick(out.logits[0])
        ok, logp = _node_checks(rule, out.logits[0].float() * scale, tokens, b, picks, epsilon, alpha)
        reached = (ok[b.ancestors.clamp(min=0)] | (b.ancestors < 0)).all(-1)
        last = _deepest_reached(b, reached, in_tree, logp)

        def emitted_along(node: int) -> int:
            nodes = b.ancestors[node][1 : depth[node] + 1].tolist()
            return _emitted(tokens[nodes].tolist() + [int(picks[node])], max_new_tokens - emitted, eos)

        n_tree = emitted_along(last)
        counts.tree.append(n_tree)
        counts.candidates.append(
            [emitted_along(u) if reached[u] and depth[u] > depth[last] else n_tree for u in cand_nodes]
        )
        path = b.ancestors[last][: depth[last] + 1].tolist()
        keep_accepted(cache, int(cache.get_seq_length()) - joint.num_nodes, [path])
        heads.observe(state, heads.features(out.hidden_states)[0, path], tokens=tokens[path])
        root = (tokens[path[1:]].tolist() + [int(picks[last])])[n_tree - 1]
        emitted, next_pos = emitted + n_tree, next_pos + len(path)
    return counts


def rollout_scorer(model, heads, prompts: Sequence[Sequence[int]], cfg: SearchConfig, eos: Iterable[int]) -> ScoreFn:
    """Score T and every T ∪ {ν} by joint self-rollouts on all prompts (steps pooled)."""
    eos = tuple(eos)

    def score(tree: Tree, candidates: list[Path]) -> tuple[float, list[float]]:
        gen = torch.Generator().manual_seed(cfg.seed)
        tree_sum, cand_sums, steps = 0, [0] * len(candidates), 0
        for prompt in prompts:
            c = joint_rollout(
                model,
                heads,
                prompt,
                tree,
                candidates,
                cfg.max_new_tokens,
                rule=cfg.acceptance,
                temperature=cfg.temperature,
                epsilon=cfg.posterior_threshold,
                alpha=cfg.posterior_alpha,
                generator=gen,
                eos_token_ids=eos,
            )
            steps += len(c.tree)
            tree_sum += sum(c.tree)
            cand_sums = [s + sum(row[k] for row in c.candidates) for k, s in enumerate(cand_sums)]
        steps = max(steps, 1)
        return tree_sum / steps, [s / steps for s in cand_sums]

    return score
