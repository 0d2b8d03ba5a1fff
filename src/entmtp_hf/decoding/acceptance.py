"""Acceptance rules: which drafted nodes of a verified tree are kept, and the next token.

Rules, in the paper's symbols (``p_j`` = the verifier's processed distribution
at node ``j``; the root is the base model's own token and is always kept):

* greedy  - walk down while a child's token equals ``argmax p_j`` of its parent ``j``;
* exact   - at node ``j`` draw ``y ~ p_j``; if ``y`` is a child's token move there, else emit
  ``y`` and stop. Every emitted token is a draw from the target conditional, so the output
  distribution is exactly that of plain sampling;
* typical - keep a child ``x`` of ``j`` iff ``p_j(x) > min(eps, alpha * exp(-H(p_j)))``, take
  the longest kept path (ties: larger sum of ``log p``). Not distribution-preserving. Two
  variants: this project's (:func:`typical_accept_flags`: ``p_j`` the processed scores, the
  exact entropy) and the published Hydra/Medusa code's (:func:`reference_typical_flags`:
  ``p_j = softmax(raw logits / T)``, entropy ``-sum p log(p + 1e-5)``), which reproduces their
  results.

Each rule returns the accepted path (node indices, root first) and the next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: what the published typical rule adds to ``p`` inside the logarithm of its entropy
REFERENCE_ENTROPY_EPS = 1e-5


@dataclass(frozen=True)
class Acceptance:
    """The outcome of one verification: accepted nodes (root first) and the next token."""

    path: list[int]
    next_token: int


def walk_tree(children: tuple[tuple[int, ...], ...], tokens: list[int], picks: list[int]) -> Acceptance:
    """Follow ``picks`` (the verifier's choice at every node) down the tree.

    Shared by greedy (``picks`` = argmax) and exact sampling (``picks`` = one independent draw
    per node): at node ``j`` move to the child whose token is ``picks[j]``, else stop and emit it.
    """
    node, path = 0, [0]
    while True:
        wanted = picks[node]
        for child in children[node]:
            if tokens[child] == wanted:
                node = child
                path.append(child)
                break
        else:
            return Acceptance(path, wanted)


def greedy_picks(scores: torch.Tensor) -> torch.Tensor:
    """argmax of the processed scores at every node ([N, V] -> [N])."""
    return scores.argmax(dim=-1)


def sample_picks(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One independent draw per node from softmax(scores) ([N, V] -> [N]); see :func:`sample_tokens`."""
    return sample_tokens(torch.softmax(scores.float(), dim=-1), generator)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` ([N, V], rows summing to any positive total) -> [N].

    Inverse CDF: a uniform draw scaled to the row's total, located in the running sum. It draws
    from the same distribution as ``torch.multinomial`` (both to fp32 rounding: a token's
    interval in the running sum is its probability to ~1e-7) at a fraction of its CPU cost.
    Zero-probability tokens are never drawn. A row that is not a distribution (NaN or inf
    somewhere, or all zero) gives -1, for the caller to reject as ``multinomial`` would.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total after rounding
    picks = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    valid = (total.squeeze(-1) > 0) & torch.isfinite(total.squeeze(-1))
    return torch.where(valid, picks, torch.full_like(picks, -1))


def check_pick(token: int) -> int:
    """``token``, or the error ``torch.multinomial`` gives for a row that is not a distribution."""
    if token < 0:
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (or sums to 0)")
    return token


def typical_accept_flags(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, epsilon: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-node typical-acceptance test and log-probability under the parent's distribution.

    Node ``i`` (parent ``j``) passes iff ``p_j(x_i) > min(epsilon, alpha * exp(-H(p_j)))``.
    The root (no parent) always passes with log-probability 0.
    """
    logp = torch.log_softmax(scores, dim=-1)  # [N, V]
    probs = logp.exp()
    entropy = -(probs * torch.where(probs > 0, logp, torch.zeros_like(logp))).sum(-1)  # [N]
    threshold = torch.clamp(alpha * torch.exp(-entropy), max=epsilon)  # [N]
    par = parents.clamp(min=0)
    node_logp = logp[par, tokens]  # [N]
    passed = node_logp.exp() > threshold[par]
    passed[0] = True
    node_logp = node_logp.clone()
    node_logp[0] = 0.0
    return passed, node_logp


def reference_typical_flags(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, temperature: float, epsilon: float, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`typical_accept_flags` as the published Hydra/Medusa code computes it, so their
    figures can be reproduced: ``p_j = softmax(logits_j / temperature)`` on the raw logits (no
    other processing), entropy ``-sum p log(p + 1e-5)``, node ``i`` passes iff
    ``p_j(x_i) > min(epsilon, alpha * exp(-H(p_j)))``; log-probabilities are ``log p_j(x_i)``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)  # [N, V]
    entropy = -(probs * torch.log(probs + REFERENCE_ENTROPY_EPS)).sum(-1)  # [N]
    threshold = torch.clamp(alpha * torch.exp(-entropy), max=epsilon)
    par = parents.clamp(min=0)
    node_p = probs[par, tokens]  # [N]
    passed = node_p > threshold[par]
    passed[0] = True
    node_logp = torch.log(node_p)
    node_logp[0] = 0.0
    return passed, node_logp


def typical_best_path(passed: torch.Tensor, node_logp: torch.Tensor, retrieve_indices: torch.Tensor) -> list[int]:
    """Longest path of consecutively passing nodes; ties broken by the larger sum of log p."""
    valid = retrieve_indices >= 0
    idx = retrieve_indices.clamp(min=0)
    ok = passed[idx] & valid  # [P, D+1]
    run = torch.cumprod(ok.long(), dim=1)  # 1 while every node so far passed
    lengths = run.sum(dim=1)  # nodes kept per row (>= 1: the root)
    logp_sum = (node_logp[idx] * run).sum(dim=1)
    best_len = lengths.max()
    candidates = lengths == best_len
    score = torch.where(candidates, logp_sum, torch.full_like(logp_sum, -float("inf")))
    row = int(score.argmax())
    return retrieve_indices[row, : int(best_len)].tolist()
