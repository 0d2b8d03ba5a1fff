"""One generate call's decoding state and its speculative step: draft -> verify -> accept -> commit.

:class:`DecodeSession` owns everything one call needs (the cache, the text so far, the
candidate generator with the heads' state and the scheduler, the acceptance rule) and nothing
is stored on the model. :meth:`DecodeSession.step` is the method:

1. **draft**  - the candidate generator drafts the step's tree after the text (its root is
   the text's last token, the verifier's own pick);
2. **verify** - one base-model forward over the tree's nodes appended to the cache (4D float
   mask: each node sees the prefix and its ancestors; positions = prefix length + depth);
3. **accept** - the logits processors on every node with its own path as context, then the
   greedy / exact / typical rule: the accepted path and the verifier's next token (the
   reference typical rule reads the raw logits instead, as the published code does);
4. **commit** - the cache keeps the accepted path's keys and values, the heads see its hidden
   states, and the accepted tokens plus the next one are emitted one by one (stopping
   criteria and streamer as in plain ``generate``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import StaticCache

from ..drafting.candidates import Draft, EntMTPCandidateGenerator
from .acceptance import check_pick, reference_typical_flags, typical_accept_flags, typical_best_path, walk_tree
from .attention import tree_attention_mask, verifying
from .cache import keep_accepted
from .processors import process_tree_scores, row_wise
from .stats import StepRecord


@dataclass(frozen=True)
class Rule:
    """The acceptance rule of a call and how it picks the verifier's tokens."""

    name: str  # greedy | exact | typical
    pick: Callable[[torch.Tensor], torch.Tensor]  # scores [N, V] -> one token per row
    epsilon: float = 0.09
    alpha: float = 0.3
    #: typical only: the published formula on softmax(raw logits / temperature) instead of the processed scores
    reference: bool = False
    temperature: float = 1.0


@dataclass(frozen=True)
class Verified:
    """One verification forward: raw logits [N, V] and the heads' features [N, F] of the tree's nodes,
    which the cache holds after its first ``prefix_len`` positions."""

    logits: torch.Tensor
    hidden: torch.Tensor
    prefix_len: int


class DecodeSession:
    """The state of one EntMTP ``generate`` call (built by :func:`~entmtp_hf.decoding.loop.entmtp_decode`)."""

    def __init__(self, model, drafter: EntMTPCandidateGenerator, rule: Rule, cache, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, logits_processor, stopping_criteria, streamer=None,
                 verify_forward: Callable | None = None) -> None:
        self.model, self.drafter, self.rule, self.cache = model, drafter, rule, cache
        #: the verification forward: the model's own, or its compiled call (one graph per tree size)
        self.forward = verify_forward or model
        self.input_ids = input_ids
        self.device = input_ids.device
        self.dtype = model.get_output_embeddings().weight.dtype
        self.attention_mask = attention_mask
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.row_wise = row_wise(logits_processor)  # decided once: the processors do not change during the call
        self.finished = False
        self.next_pos = 0  # position id of the next root
        self.features = drafter.heads.features  # the hidden states the heads read, from output_hidden_states
        self.hidden_request = drafter.heads.hidden_states_request
        self._prefix_row = torch.zeros(0, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self) -> None:
        """The prompt's forward: its cache, the first token, the heads' context."""
        ids, mask = self.input_ids, self.attention_mask
        if mask is not None:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            positions = torch.arange(ids.shape[1], device=self.device)[None]
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, output_hidden_states=self.hidden_request, **keep)  # fmt: skip
        self.next_pos = int(positions[0, -1]) + 1
        last = out.logits[0, -1:].float()
        scores = self.logits_processor(ids, last)
        root = check_pick(int(self.rule.pick(scores)[0]))
        self.drafter.observe(self.features(out.hidden_states)[0], last[0], tokens=ids[0])
        self._prefix_row = _prefix_row(mask, ids.shape[1], self.device, self.dtype)
        self._emit([root], scores)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> StepRecord:
        """One speculative step: draft -> verify -> accept -> commit."""
        draft = self.draft()
        verified = self.verify(draft)
        scores, path, next_token = self.accept(draft, verified)
        return self.commit(draft, verified, scores, path, next_token)

    def draft(self) -> Draft:
        self.drafter.get_candidates(self.input_ids)
        return self.drafter.draft

    def verify(self, draft: Draft) -> Verified:
        prefix_len = int(self.cache.get_seq_length())
        out = self.tree_forward(draft.tokens, draft.buffers, prefix_len)
        return Verified(out.logits[0], self.features(out.hidden_states)[0], prefix_len)

    def tree_forward(self, tokens: torch.Tensor, buffers, prefix_len: int):
        """One forward of a tree's nodes appended after the first ``prefix_len`` cached positions."""
        kv_len = self.cache.get_max_length() if isinstance(self.cache, StaticCache) else prefix_len + buffers.num_nodes
        if self._prefix_row.shape[0] < prefix_len:  # generated tokens are never padding
            grow = self._prefix_row.new_zeros(prefix_len - self._prefix_row.shape[0])
            self._prefix_row = torch.cat([self._prefix_row, grow])
        with verifying():
            return self.forward(
                input_ids=tokens[None],
                attention_mask=tree_attention_mask(buffers, self._prefix_row[:prefix_len], kv_len),
                position_ids=(buffers.position_ids + self.next_pos)[None],
                cache=self.cache,
                use_cache=True,
                output_hidden_states=self.hidden_request,
            )

    def accept(self, draft: Draft, verified: Verified) -> tuple[torch.Tensor, list[int], int]:
        """Processed scores of every node, the accepted path (root first) and the next token."""
        return accept_tree(self.rule, self.logits_processor, self.row_wise, self.input_ids, draft, verified.logits)

    def commit(self, draft: Draft, verified: Verified, scores: torch.Tensor, path: list[int],
               next_token: int) -> StepRecord:
        keep_accepted(self.cache, verified.prefix_len, draft.buffers.num_nodes, path)
        self.drafter.observe(verified.hidden[path], verified.logits[path[-1]], tokens=draft.tokens[path])
        self.next_pos += len(path)
        emitted = self._emit(draft.tokens[path[1:]].tolist() + [next_token], scores[path])
        self.drafter.update_candidate_strategy(self.input_ids, scores[path][None], len(path) - 1)
        return StepRecord(draft, path, emitted)

    # ------------------------------------------------------------------ emitting
    def _emit(self, new_tokens: list[int], scores: torch.Tensor) -> int:
        """Append tokens one at a time, stopping exactly where a stopping criterion fires;
        returns how many tokens were appended."""
        self.input_ids, emitted, self.finished = emit_tokens(self.input_ids, new_tokens, scores, self.stopping_criteria)
        if self.streamer is not None and emitted:
            self.streamer.put(torch.tensor(new_tokens[:emitted]))
        return emitted

def accept_tree(rule: Rule, logits_processor, row_wise: bool, input_ids: torch.Tensor, draft: Draft,
                logits: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """One verified tree's processed scores [N, V], accepted path (root first) and next token.

    ``input_ids`` [1, L] is the text up to and including the root, ``logits`` [N, V] the raw
    logits of the tree's nodes."""
    buffers, tokens = draft.buffers, draft.tokens
    scores = process_tree_scores(logits_processor, input_ids, tokens, buffers, logits, row_wise=row_wise)
    if rule.name == "typical":
        if rule.reference:  # the published formula, on the raw logits
            passed, node_logp = reference_typical_flags(logits, tokens, buffers.parents, rule.temperature,
                                                        rule.epsilon, rule.alpha)  # fmt: skip
        else:
            passed, node_logp = typical_accept_flags(scores, tokens, buffers.parents, rule.epsilon, rule.alpha)
        path = typical_best_path(passed, node_logp, buffers.retrieve_indices)
        return scores, path, check_pick(int(rule.pick(scores[path[-1] : path[-1] + 1])[0]))
    host = torch.stack([tokens, rule.pick(scores)]).tolist()
    acc = walk_tree(buffers.children, host[0], host[1])
    return scores, acc.path, check_pick(acc.next_token)


def emit_tokens(ids: torch.Tensor, new_tokens: list[int], scores: torch.Tensor,
                stopping_criteria) -> tuple[torch.Tensor, int, bool]:
    """``ids`` [1, L] with ``new_tokens`` appended one at a time up to where a stopping criterion
    fires: (the new ids, how many were appended, whether one fired). ``scores[i]`` are the processed
    scores the ``i``-th token was chosen from, handed to the criteria as ``generate`` does."""
    for i, tok in enumerate(new_tokens):
        ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=-1)
        if bool(stopping_criteria(ids, scores[i : i + 1]).any()):
            return ids, i + 1, True
    return ids, len(new_tokens), False


def _prefix_row(attention_mask: torch.Tensor | None, length: int, device, dtype) -> torch.Tensor:
    """Additive mask row for the cached prefix (user padding stays masked)."""
    row = torch.zeros(length, dtype=dtype, device=device)
    if attention_mask is not None:
        row[: attention_mask.shape[1]].masked_fill_(attention_mask[0] == 0, torch.finfo(dtype).min)
    return row
