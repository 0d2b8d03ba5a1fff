"""Tree speculative decoding of a batch of prompts: every row drafts, is verified and accepts its own path.

:class:`BatchDecodeSession` is :class:`~entmtp_hf.decoding.step.DecodeSession` for ``B > 1``
left-padded prompts. Each row has its own candidate generator (heads state, scheduler) and its
own text; one base-model forward verifies every live row's tree, padded to the largest.

**The cache: masked slots.** All rows share one dynamic cache ``[B, kv_heads, S, head_dim]``.
After a verification every row's accepted nodes are moved to the front of the step's slots
and the cache is cropped to the longest accepted path ``K``. A row that accepted ``k < K``
nodes leaves ``K - k`` slots behind that it never attends to (its additive prefix mask holds
the dtype's minimum there), and its positions count only its own tokens, so every row sees
exactly the keys and positions it would see alone. The price is attention over those masked
slots: at most ``K - 1`` per row per step, a few percent of the context at the trees' sizes.
**Finished rows** leave the batch: their cache rows are dropped, so a finished row costs
nothing in later forwards. The output pads finished rows with ``pad_token_id``, as plain
``generate`` does.

**Trees by batch size.** ``plan_for(b)`` gives the plan for ``b`` live rows (the bank ranked
with this machine's costs at that batch size); when rows finish and the live batch size
changes plan, every row's candidate generator is rebuilt on the new plan, keeping its heads'
state.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..drafting.candidates import Draft, EntMTPCandidateGenerator
from ..trees.plan import DecodePlan
from .acceptance import check_pick
from .attention import verifying
from .processors import row_wise
from .stats import DecodeStats, StepRecord
from .step import Rule, accept_tree, emit_tokens

DrafterFactory = Callable[[DecodePlan, object], EntMTPCandidateGenerator]


@dataclass
class BatchRow:
    """One prompt of the batch: its text so far and its own drafting state."""

    index: int  # row in the caller's batch
    ids: Tensor  # [1, L]: the (left-padded) prompt and the tokens generated so far
    drafter: EntMTPCandidateGenerator
    next_pos: int = 0  # position id of the row's next root
    finished: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)


@dataclass(frozen=True)
class BatchStepRecord:
    """What one batch step did: one :class:`StepRecord` per row that was live in it."""

    rows: tuple[tuple[int, StepRecord], ...]  # (row index, record)


@dataclass(frozen=True)
class BatchVerified:
    """One verification forward of every live row's tree, padded to ``num_nodes``."""

    logits: Tensor  # [B, N, V]
    hidden: Tensor  # [B, N, H]
    prefix_len: int


class BatchDecodeSession:
    """The state of one EntMTP ``generate`` call on a batch (built by :func:`~entmtp_hf.decoding.loop.entmtp_decode`)."""

    def __init__(self, model, plan_for: Callable[[int], DecodePlan], new_drafter: DrafterFactory, rule: Rule, cache,
                 input_ids: Tensor, attention_mask: Tensor | None, logits_processor, stopping_criteria,
                 pad_token_id: int) -> None:  # fmt: skip
        self.model, self.rule, self.cache = model, rule, cache
        self.plan_for, self.new_drafter = plan_for, new_drafter
        self.device = input_ids.device
        self.dtype = model.get_output_embeddings().weight.dtype
        self.prompt_ids = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.attention_mask = attention_mask
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.row_wise = row_wise(logits_processor)
        self.pad_token_id = pad_token_id
        self.plan = plan_for(input_ids.shape[0])
        self.rows = [BatchRow(i, input_ids[i : i + 1], new_drafter(self.plan, None)) for i in range(input_ids.shape[0])]
        self.live = list(self.rows)  # row b of the cache is live[b]
        heads = self.rows[0].drafter.heads  # one set of heads for every row
        self.features, self.hidden_request = heads.features, heads.hidden_states_request
        #: additive mask [B_live, S] over the cached slots: user padding and other rows' holes are masked
        self.prefix = torch.zeros(0)
        self.finished = False

    @property
    def drafter(self) -> EntMTPCandidateGenerator:
        """The first row's generator (observers that read one call's drafter)."""
        return self.rows[0].drafter

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self) -> None:
        """The prompts' forward: the cache, every row's first token and its heads' context."""
        ids, mask = self.prompt_ids, self.attention_mask
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                         use_cache=True, output_hidden_states=self.hidden_request, **keep)  # fmt: skip
        features = self.features(out.hidden_states)
        minimum = torch.finfo(self.dtype).min
        self.prefix = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(mask == 0, minimum)
        last = out.logits[:, -1].float()
        for b, row in enumerate(self.rows):
            scores = self.logits_processor(row.ids, last[b : b + 1])
            root = check_pick(int(self.rule.pick(scores)[0]))
            row.drafter.observe(features[b][mask[b] == 1], last[b], tokens=ids[b][mask[b] == 1])
            row.next_pos = int(positions[b, -1]) + 1
            self._emit(row, [root], scores)
        self._drop_finished()

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> BatchStepRecord:
        """One speculative step of every live row: draft -> verify -> accept -> commit."""
        drafts = self.draft()
        verified = self.verify(drafts)
        accepted = self.accept(drafts, verified)
        return self.commit(drafts, verified, accepted)

    def draft(self) -> list[Draft]:
        union = [row for row in self.live if row.drafter.drafts_union(row.ids)]
        if len(union) > 1:  # one head call per depth for all of them
            first = union[0].drafter
            proposals = first.heads.propose_rows([r.drafter.state for r in union], [r.ids[0, -1] for r in union],
                                                 first.union_buffers, temperature=first.union_temperature)  # fmt: skip
            for row, proposal in zip(union, proposals):
                row.drafter.preset_union(proposal)
        drafts = []
        for row in self.live:
            row.drafter.get_candidates(row.ids)
            drafts.append(row.drafter.draft)
        return drafts

    def verify(self, drafts: list[Draft]) -> BatchVerified:
        prefix_len = int(self.cache.get_seq_length())
        tokens, positions, mask = batch_tree_inputs(drafts, [r.next_pos for r in self.live], self.prefix)
        with verifying():
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                             use_cache=True, output_hidden_states=self.hidden_request)  # fmt: skip
        return BatchVerified(out.logits, self.features(out.hidden_states), prefix_len)

    def accept(self, drafts: list[Draft], verified: BatchVerified) -> list[tuple[Tensor, list[int], int]]:
        """Every live row's processed scores, accepted path and next token, each against its own text."""
        return [
            accept_tree(self.rule, self.logits_processor, self.row_wise, row.ids, d, verified.logits[b, : d.buffers.num_nodes])
            for b, (row, d) in enumerate(zip(self.live, drafts))
        ]

    def commit(self, drafts: list[Draft], verified: BatchVerified,
               accepted: list[tuple[Tensor, list[int], int]]) -> BatchStepRecord:  # fmt: skip
        paths = [path for _, path, _ in accepted]
        self.prefix = keep_accepted_rows(self.cache, self.prefix, verified.prefix_len, paths)
        EntMTPCandidateGenerator.observe_rows(
            [row.drafter for row in self.live], [verified.hidden[b, p] for b, p in enumerate(paths)],
            [verified.logits[b, p[-1]] for b, p in enumerate(paths)], [d.tokens[p] for d, p in zip(drafts, paths)],
        )
        records = []
        for row, draft, (scores, path, next_token) in zip(self.live, drafts, accepted):
            row.next_pos += len(path)
            emitted = self._emit(row, draft.tokens[path[1:]].tolist() + [next_token], scores[path])
            row.drafter.update_candidate_strategy(row.ids, scores[path][None], len(path) - 1)
            record = StepRecord(draft, path, emitted)
            row.stats.on_step(record)
            records.append((row.index, record))
        self._drop_finished()
        return BatchStepRecord(tuple(records))

    # ------------------------------------------------------------------ rows
    def _emit(self, row: BatchRow, new_tokens: list[int], scores: Tensor) -> int:
        row.ids, emitted, row.finished = emit_tokens(row.ids, new_tokens, scores, self.stopping_criteria)
        return emitted

    def _drop_finished(self) -> None:
        """Finished rows leave the cache and the forward; a new live batch size may bring a new plan."""
        keep = [b for b, row in enumerate(self.live) if not row.finished]
        if len(keep) == len(self.live):
            return
        self.live = [self.live[b] for b in keep]
        self.finished = not self.live
        if self.finished:
            return
        select_rows(self.cache, torch.tensor(keep, device=self.device))
        self.prefix = self.prefix[keep]
        plan = self.plan_for(len(self.live))
        if plan is not self.plan:  # this batch size verifies other trees: same heads state, new generators
            self.plan = plan
            for row in self.live:
                row.drafter = self.new_drafter(plan, row.drafter.state)

    def sequences(self) -> Tensor:
        """[B, L] every row's text, right-padded with ``pad_token_id`` to the longest, as plain ``generate`` does."""
        length = max(row.ids.shape[1] for row in self.rows)
        out = self.prompt_ids.new_full((len(self.rows), length), self.pad_token_id)
        for row in self.rows:
            out[row.index, : row.ids.shape[1]] = row.ids[0]
        return out


def batch_tree_inputs(drafts: list[Draft], next_pos: list[int], prefix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids [B, N], position ids [B, N] and the 4D additive mask [B, 1, N, S + N] of a batch of trees.

    Row ``b``'s tree occupies its first ``N_b`` slots; the padding nodes after it repeat its root
    at the root's position and see only the prefix and themselves (their outputs are never read
    and their keys are cropped or masked). ``prefix`` [B, S] is the rows' additive mask over the cache.
    """
    batch, prefix_len = len(drafts), prefix.shape[1]
    n = max(d.buffers.num_nodes for d in drafts)
    dtype, device = prefix.dtype, prefix.device
    tokens = torch.empty(batch, n, dtype=torch.long, device=device)
    positions = torch.empty(batch, n, dtype=torch.long, device=device)
    mask = torch.full((batch, 1, n, prefix_len + n), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, 0, :, :prefix_len] = prefix[:, None, :]
    pad_diag = torch.arange(n, device=device)
    for b, (d, pos) in enumerate(zip(drafts, next_pos)):
        nb = d.buffers.num_nodes
        tokens[b, :nb], tokens[b, nb:] = d.tokens, d.tokens[0]
        positions[b, :nb], positions[b, nb:] = d.buffers.position_ids + pos, pos
        mask[b, 0, :nb, prefix_len : prefix_len + nb] = d.buffers.attn_mask.to(dtype)
        mask[b, 0, pad_diag[nb:], prefix_len + pad_diag[nb:]] = 0
    return tokens, positions, mask


def keep_accepted_rows(cache, prefix: Tensor, prefix_len: int, paths: list[list[int]]) -> Tensor:
    """Keep every row's accepted nodes after a batch verification; returns the new prefix mask.

    Row ``b``'s accepted nodes move to slots ``prefix_len .. prefix_len + k_b - 1`` (path order),
    the cache is cropped to ``prefix_len + K`` (``K`` the longest path) and the slots a row did not
    fill are masked in its row of the returned mask [B, prefix_len + K].
    """
    longest = max(len(p) for p in paths)
    if any(p != list(range(len(p))) for p in paths):
        src = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths], device=cache.layers[0].keys.device)
        src = src + prefix_len
        for layer in cache.layers:
            idx = src.to(layer.keys.device)[:, None, :, None]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, prefix_len : prefix_len + longest] = t.gather(2, idx.expand(-1, t.shape[1], -1, t.shape[3]))
    surplus = int(cache.get_seq_length()) - prefix_len - longest
    if surplus > 0:
        cache.crop(-surplus)
    filled = torch.arange(longest, device=prefix.device)[None] < torch.tensor([len(p) for p in paths], device=prefix.device)[:, None]
    new = torch.zeros(len(paths), longest, dtype=prefix.dtype, device=prefix.device)
    new.masked_fill_(~filled, torch.finfo(prefix.dtype).min)
    return torch.cat([prefix[:, :prefix_len], new], dim=1)


def select_rows(cache, rows: Tensor) -> None:
    """Keep only the batch rows ``rows`` of every cache layer."""
    for layer in cache.layers:
        idx = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
