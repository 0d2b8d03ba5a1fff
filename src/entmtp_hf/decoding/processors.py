"""Logits processors on a verified tree: every node scored with its own path as context.

In plain ``generate`` a processor sees the text so far and the next token's scores. A tree's
node ``i`` stands for the text followed by the drafted tokens on the path to ``i``, so that is
the context it must get. Processors whose output row depends on that row's scores alone
(temperature, top-k, top-p, ...; :data:`ROW_WISE_PROCESSORS`) ignore the context, and one
call covers the whole tree. ``min_length`` and ``min_new_tokens`` (:data:`LENGTH_WISE_PROCESSORS`)
read only the context's length, a node's depth: with row-wise processors alone beside them they
are applied to every node at once, each in its place in the list, as they define it (EOS scores
set to -inf while the text is shorter than the minimum). Any other processor (repetition
penalty, n-gram blocking, forced or suppressed tokens, a user's own) is called once per node with
a batch of one row, exactly as plain ``generate`` would call it for that text.

Rows of a batch are at different lengths (each accepts its own path), so a row's processors
are called on that row alone. A processor that holds per-row state for the caller's batch
is narrowed to the row first (:func:`for_row`): the repetition penalty's prompt padding
lengths, the batch id a prefix-constraint function is given, the prompt ids the encoder
processors hold on a decoder-only model (``encoder_repetition_penalty``,
``encoder_no_repeat_ngram_size``). A user's own processor that keeps per-row state of its own
sees a batch of one: such a processor must not rely on the batch's row order.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
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


#: transformers' processors whose output depends on the context's length alone (exact types): per
#: node, its depth. Each call of theirs builds a vocabulary-wide EOS mask (~0.2 ms at 49k tokens), so
#: one call per node cost ~1 ms a step on the demo model's 3-node trees.
LENGTH_WISE_PROCESSORS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)


def row_wise(logits_processor) -> bool:
    """Whether every processor reads only its row's scores (:data:`ROW_WISE_PROCESSORS`)."""
    return all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor or ())


def _length_wise(logits_processor) -> bool:
    """Whether every processor is row-wise or reads only the context's length."""
    return all(type(p) in ROW_WISE_PROCESSORS + LENGTH_WISE_PROCESSORS for p in logits_processor or ())


def _minimum_length(processor, lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processor`` (a :data:`LENGTH_WISE_PROCESSORS` one) on every row of ``scores`` at once, row ``i``
    standing for a text of ``lengths[i]`` tokens: EOS scores -inf where that text is shorter than the
    minimum, as the processor computes it for each row alone."""
    if isinstance(processor, MinNewTokensLengthLogitsProcessor):
        short = lengths - processor.prompt_length_to_skip < processor.min_new_tokens
    else:
        short = lengths < processor.min_length
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    eos = torch.isin(vocab, torch.as_tensor(processor.eos_token_id, device=scores.device))
    return torch.where(short.to(scores.device)[:, None] & eos[None, :], -math.inf, scores)


def for_row(logits_processor, row: int, batch_size: int):
    """The call's processors as they apply to row ``row`` of a ``batch_size``-row batch called
    alone (see the module docstring); the processors themselves when nothing needs narrowing."""
    if batch_size == 1 or not logits_processor:
        return logits_processor
    return LogitsProcessorList(_narrowed(p, row, batch_size) for p in logits_processor)


def _narrowed(processor, row: int, batch_size: int):
    if isinstance(processor, RepetitionPenaltyLogitsProcessor):
        lengths = processor.prompt_ignore_length
        if isinstance(lengths, torch.Tensor) and lengths.shape[0] == batch_size:
            processor = copy.copy(processor)
            processor.prompt_ignore_length = lengths[row : row + 1]
    elif isinstance(processor, PrefixConstrainedLogitsProcessor):
        allowed = processor._prefix_allowed_tokens_fn
        processor = copy.copy(processor)
        processor._prefix_allowed_tokens_fn = lambda _batch_id, sent: allowed(row, sent)
    elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
        prompts = processor.encoder_input_ids.shape[0]
        processor = copy.copy(processor)
        index = _prompt_of(row, batch_size, prompts)
        processor.encoder_input_ids = processor.encoder_input_ids[index : index + 1]
    elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
        prompts = processor.batch_size
        processor = copy.copy(processor)
        processor.generated_ngrams = [processor.generated_ngrams[_prompt_of(row, batch_size, prompts)]]
        processor.batch_size = 1
    return processor


def _prompt_of(row: int, batch_size: int, prompts: int) -> int:
    """The prompt row ``row`` of the batch continues: transformers repeats each of ``prompts``
    prompts ``batch_size // prompts`` times in a row (``num_return_sequences``), and the encoder
    processors, which hold the prompts' ids, map a row to its prompt that way."""
    return row // max(batch_size // prompts, 1)


def process_tree_scores(
    logits_processor,
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    buffers: TreeBuffers,
    logits: torch.Tensor,
    *,
    row_wise: bool,
) -> torch.Tensor:
    """Processed float32 scores [N, V] of every node of a verified tree (see the module docstring).

    ``input_ids`` [1, L] is the text up to and including the root; ``tokens`` [N] the tree's tokens.
    """
    scores = logits.float()
    if not logits_processor:
        return scores
    if row_wise:
        return logits_processor(input_ids.expand(scores.shape[0], -1), scores)
    if _length_wise(logits_processor):  # each in its place in the list: the order is the processors'
        lengths = input_ids.shape[-1] + buffers.position_ids[: scores.shape[0]]
        context = input_ids.expand(scores.shape[0], -1)
        for processor in logits_processor:
            is_length = type(processor) in LENGTH_WISE_PROCESSORS
            scores = _minimum_length(processor, lengths, scores) if is_length else processor(context, scores)
        return scores
    out = torch.empty_like(scores)
    for i in range(scores.shape[0]):
        depth = int(buffers.position_ids[i])
        path = tokens[buffers.ancestors[i, 1 : depth + 1]]  # the drafted tokens after the root, to node i
        context = torch.cat([input_ids, path[None].to(input_ids.device)], dim=-1)
        out[i : i + 1] = logits_processor(context, scores[i : i + 1])
    return out
