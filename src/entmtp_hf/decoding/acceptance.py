"""Verifying a drafted tree: the attention inputs, the acceptance rules and the cache update.

The base model checks every node of the tree in one forward pass. Node ``i`` is fed at
absolute position ``prefix_len + depth(i)`` and sees the whole cached prefix plus its own
ancestors, through a float additive 4D mask (a boolean mask is silently wrong under the
eager attention of transformers 5).

Acceptance rules, in the paper's symbols (``p_j`` = the verifier's processed distribution
at node ``j``; the root is the base model's own token and is always kept):

* greedy  - walk down while a child's token equals ``argmax p_j`` of its parent ``j``;
* exact   - at node ``j`` draw ``y ~ p_j``; if ``y`` is a child's token move there, else emit
  ``y`` and stop. Every emitted token is a draw from the target conditional, so the output
  distribution is exactly that of plain sampling;
* typical - keep a child ``x`` of ``j`` iff ``p_j(x) > min(eps, alpha * exp(-H(p_j)))``, take
  the longest kept path (ties: larger sum of ``log p``). Not distribution-preserving.

Each rule returns the accepted path (node indices, root first) and the next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trees.tree import TreeBuffers


@dataclass(frozen=True)
class Acceptance:
    """The outcome of one verification: accepted nodes (root first) and the next token."""

    path: list[int]
    next_token: int


def tree_attention_mask(
    buffers: TreeBuffers, prefix_mask: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """4D additive mask [1, 1, N, kv_len] for a tree appended after the cached prefix.

    ``prefix_mask`` is the additive row the prefix contributes ([L], 0 or min: padding of the
    user's attention mask stays masked). Columns after ``L + N`` (a static cache's unused
    slots) are masked.
    """
    n = buffers.num_nodes
    prefix_len = prefix_mask.shape[0]
    dtype = buffers.attn_mask.dtype
    mask = torch.full((1, 1, n, kv_len), torch.finfo(dtype).min, dtype=dtype, device=buffers.attn_mask.device)
    mask[0, 0, :, :prefix_len] = prefix_mask
    mask[0, 0, :, prefix_len : prefix_len + n] = buffers.attn_mask
    return mask


# ----------------------------------------------------------------------------- rules
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
    interval in the running sum is its probability to ~1e-7) at a fraction of its CPU cost,
    ~0.07 ms against ~1.7 ms per 49k-token row here (docs/performance.md, session 8).
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


def typical_best_path(
    passed: torch.Tensor, node_logp: torch.Tensor, retrieve_indices: torch.Tensor
) -> list[int]:
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


# ----------------------------------------------------------------------------- cache
def keep_accepted(cache, prefix_len: int, num_nodes: int, path: list[int]) -> None:
    """Keep only the accepted nodes' keys and values after a tree forward.

    The tree occupied cache slots ``prefix_len .. prefix_len + num_nodes - 1``; the accepted
    nodes are moved to the front of that range (in path order) and the rest is cropped.
    Works for dynamic and static layers, which both expose ``keys``/``values`` of shape
    [batch, kv_heads, seq, head_dim] and crop by a negative count.
    """
    kept = len(path)
    if path != list(range(kept)):  # the accepted nodes are not already a prefix of the tree
        src = torch.tensor(path, device=cache.layers[0].keys.device) + prefix_len
        for layer in cache.layers:  # .to: a no-op unless a device map spreads the layers
            idx = src.to(layer.keys.device)
            layer.keys[..., prefix_len : prefix_len + kept, :] = layer.keys.index_select(-2, idx)
            layer.values[..., prefix_len : prefix_len + kept, :] = layer.values.index_select(-2, idx)
    if num_nodes > kept:
        cache.crop(-(num_nodes - kept))
