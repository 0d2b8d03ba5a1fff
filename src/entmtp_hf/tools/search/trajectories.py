"""Rank tuples: what one greedy run of a calibration prompt fixes about every tree.

At every step start ``t`` (root = x_{t+1}, heads conditioned on h_t) the **rank tuple**
(r_0, ..., r_{D-1}) of the true continuation is stored: r_i is the rank of x_{t+i+2} in head
i's distribution given the true path. Under greedy decoding the output does not depend on the
tree, so a step at ``t`` accepts depth ``d`` iff (r_0..r_{d-1}) is a path of the tree:
``accept(T, t) = 1 + #{prefixes of the tuple that are paths of T}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ...scheduling.features import top1_and_entropy
from ...trees.tree import Path, Tree


@dataclass
class Trajectory:
    """One calibration prompt's greedy run and the rank tuple of every step start.

    ``tuples[j]`` belongs to step start ``t = prompt_len - 1 + j``; it lists the ranks of the
    true tokens up to (not including) the first one the heads cannot draft within the rank
    cap, and never reaches the last token (a step's emission ends there anyway). ``signals``
    are empty in checkpoints written before they were recorded.
    """

    prompt_len: int
    tokens: list[int]  # prompt + greedy output
    tuples: list[list[int]]
    #: per step start, what the scheduler's features read (:data:`~entmtp_hf.tools.search.replay.SIGNALS`)
    signals: dict[str, list[float]] = field(default_factory=dict)


def _draft_ids(heads, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token id -> row of the heads' drafting vocabulary (-1 where the heads cannot draft it)."""
    device = ids.device
    to_draft = torch.full((max(heads.config.vocab_size, int(ids.max()) + 1),), -1, dtype=torch.long, device=device)
    if heads.draft_vocab is not None:
        to_draft[heads.draft_vocab.to(device)] = torch.arange(vocab, device=device)
    else:
        to_draft[:vocab] = torch.arange(vocab, device=device)
    return to_draft


@torch.no_grad()
def step_table(
    model, heads, tokens: Sequence[int], prompt_len: int, max_depth: int, rank_cap: int
) -> tuple[list[list[int]], dict[str, list[float]]]:
    """Rank tuples of the true continuation at every step start, and the scheduler's
    :data:`~entmtp_hf.tools.search.replay.SIGNALS` there, from one teacher-forced pass."""
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([list(tokens)], device=device)
    out = model(input_ids=ids, output_hidden_states=heads.hidden_states_request)
    logits = heads.forward_train(
        heads.features(out.hidden_states), ids, model.get_input_embeddings(), model.get_output_embeddings()
    )
    length = len(tokens)
    starts = torch.arange(prompt_len - 1, length - 2, device=device)  # t = P-1 .. L-3
    to_draft = _draft_ids(heads, ids, logits[0].shape[-1])
    columns = []
    for i in range(max_depth):
        target = starts + i + 2  # head i at row t predicts x_{t+i+2}
        valid = target <= length - 2  # the last token is never drafted-and-accepted: the run stops there
        if logits[i].shape[1] == 0:
            columns.append(torch.full_like(starts, -1))
            continue
        rows = logits[i][0, starts.clamp(max=logits[i].shape[1] - 1)]
        draft_id = to_draft[ids[0, target.clamp(max=length - 1)]]
        true_logit = rows.gather(1, draft_id.clamp(min=0)[:, None])
        rank = (rows > true_logit).sum(-1)
        ok = valid & (draft_id >= 0) & (rank < rank_cap)
        columns.append(torch.where(ok, rank, torch.full_like(rank, -1)))
    table = torch.stack(columns, dim=1).tolist() if columns else [[] for _ in range(len(starts))]
    base_top1, entropy = top1_and_entropy(out.logits[0, starts])
    signals = {"base_top1": base_top1.tolist(), "entropy": entropy.tolist()}
    if logits and logits[0].shape[1] > 0:
        signals["head_confidence"] = torch.softmax(logits[0][0, starts].float(), -1).max(-1).values.tolist()
    return [row[: row.index(-1)] if -1 in row else row for row in table], signals


def rank_tuples(model, heads, tokens: Sequence[int], prompt_len: int, max_depth: int, rank_cap: int) -> list[list[int]]:
    """Rank tuples of the true continuation at every step start (:func:`step_table`)."""
    return step_table(model, heads, tokens, prompt_len, max_depth, rank_cap)[0]


def prefix_counts(trajectories: Iterable[Trajectory]) -> tuple[dict[Path, int], int]:
    """How many step starts have each path as a prefix of their rank tuple, and the number of starts."""
    counts: dict[Path, int] = {}
    total = 0
    for traj in trajectories:
        total += len(traj.tuples)
        for row in traj.tuples:
            for k in range(1, len(row) + 1):
                key = tuple(row[:k])
                counts[key] = counts.get(key, 0) + 1
    return counts, total


def accepted_depth(row: Sequence[int], paths: set[tuple[int, ...]]) -> int:
    """How deep a tree (its ``paths``) matches a rank tuple: the drafted tokens a greedy step accepts."""
    d = 0
    while d < len(row) and tuple(row[: d + 1]) in paths:
        d += 1
    return d


def simulate_canonical(traj: Trajectory, tree: Tree) -> list[int]:
    """Accept lengths of a greedy ``generate`` with ``tree``, read off the rank tuples.

    Steps start only where the previous one ended: t_0 = P-1, t_{k+1} = t_k + a_k.
    """
    paths, lengths, j = set(tree.paths), [], 0
    while j < len(traj.tuples):
        a = 1 + accepted_depth(traj.tuples[j], paths)
        lengths.append(a)
        j += a
    return lengths


def table_accept(trajectories: Sequence[Trajectory], tree: Tree) -> float:
    """Mean accept length of ``tree`` over every step start (the rank-tuple estimate)."""
    counts, total = prefix_counts(trajectories)
    return 1.0 + sum(counts.get(p, 0) for p in tree.paths) / max(total, 1)
