"""Logits processors on a verified tree: every node scored with its own path as context.

In plain ``generate`` a processor sees the text so far and the next token's scores. A tree's
node ``i`` stands for the text followed by the drafted tokens on the path to ``i``, so that is
the context it must get. Processors whose output row depends on that row's scores alone
(temperature, top-k, top-p, ...; :data:`ROW_WISE_PROCESSORS`) ignore the context, and one
call covers the whole tree. Any other processor (repetition penalty, n-gram blocking, forced
or suppressed tokens, a user's own) is called once per node with a batch of one row, exactly
as plain ``generate`` would call it for that text: per-row state it holds for the caller's
batch of one (e.g. the prompt's padding length for the repetition penalty) stays valid.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..trees.tree import TreeBuffers

#: transformers' processors whose output row depends on that row's scores alone (exact types)
ROW_WISE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


def row_wise(logits_processor) -> bool:
    """Whether every processor reads only its row's scores (:data:`ROW_WISE_PROCESSORS`)."""
    return all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor or ())


def process_tree_scores(
    logits_processor, input_ids: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers, logits: torch.Tensor,
    *, row_wise: bool,
) -> torch.Tensor:
    """Processed float32 scores [N, V] of every node of a verified tree (see the module docstring).

    ``input_ids`` [1, L] is the text up to and including the root; ``tokens`` [N] the tree's tokens.
    """
    scores = logits.float()
    if not logits_processor:
        return scores
    if row_wise:
        return logits_processor(input_ids.expand(scores.shape[0], -1), scores)
    out = torch.empty_like(scores)
    for i in range(scores.shape[0]):
        depth = int(buffers.position_ids[i])
        path = tokens[buffers.ancestors[i, 1 : depth + 1]]  # the drafted tokens after the root, to node i
        context = torch.cat([input_ids, path[None].to(input_ids.device)], dim=-1)
        out[i : i + 1] = logits_processor(context, scores[i : i + 1])
    return out
