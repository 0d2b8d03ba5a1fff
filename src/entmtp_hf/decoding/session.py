"""One generate call's decoding state and its speculative step: draft -> verify -> accept -> commit.

:class:`DecodeSession` owns everything one call needs and nothing is stored on the model. Its
rows are the batch: one prompt is a batch of one row, so every feature is written once. Each
row has its own text, drafting state (heads' state, scheduler: plain data) and statistics; one
drafter drafts for every live row and one base-model forward verifies every row's tree, padded
to the largest. :meth:`DecodeSession.step` is the method:

1. **draft**  - the call's drafter drafts every live row's tree after the row's text (its root
   is the text's last token, the verifier's own pick), rows that draft the same union together;
2. **verify** - one base-model forward over every row's nodes appended to the cache (4D float
   mask: a node sees its row's prefix and its own ancestors; positions = the row's next
   position + depth);
3. **accept** - per row, the logits processors on every node with its own path as context, then
   the greedy / exact / typical rule: the accepted path and the verifier's next token;
4. **commit** - the cache keeps every row's accepted path, the heads see its hidden states, and
   the accepted tokens plus the next one are emitted one by one (stopping criteria as in plain
   ``generate``), and the streamer gets each new column of the batch once every row has it.

**Rows that stop.** As in plain ``generate``: with an EOS criterion a stopped row is padded
with ``pad_token_id`` up to the longest row; without one it keeps decoding real tokens until
every row has stopped, and every row ends at the length where the last one stopped. A stopped
row leaves the forward (its cache row is dropped, so it costs nothing later) with a dynamic
cache; a static cache keeps every row (a compiled graph is specialised to the batch size), the
stopped ones verifying their root alone and keeping no slot. The shared cache grows each step by
the longest accepted path of any row, so a static cache's room can fill with the slots shorter
paths left unseen: the rows' seen slots are then moved to its front
(:func:`~entmtp_hf.decoding.cache.compact`), after which each row holds at most its own text.

**Trees by batch size.** ``plan_for(b)`` gives the plan for ``b`` rows in the forward (the bank
ranked with this machine's costs at that batch size); when that number changes plan, a drafter
of the new plan takes the rows over (:meth:`~entmtp_hf.drafting.drafter.TreeDrafter.carry`:
their heads' state kept).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from transformers import StaticCache

from ..banks.plan import DecodePlan
from ..drafting.drafter import Draft, RowDrafting, TreeDrafter
from ..errors import EntMTPError
from ..trees.tree import Tree
from .acceptance import check_pick, reference_typical_flags, typical_accept_flags, typical_best_path, walk_tree
from .attention import AttentionLayout, tree_inputs, verifying
from .cache import (
    accepted_slots,
    additive_mask,
    compact,
    hand_back,
    keep_accepted,
    prompt_positions,
    select_rows,
    sliding_layers,
    slot_indices,
    trim_windows,
)
from .processors import for_row, process_tree_scores, row_wise
from .stats import RowStep, StepRecord


@dataclass(frozen=True)
class Rule:
    """The acceptance rule of a call and how it picks the verifier's tokens."""

    name: str  # greedy | exact | typical
    pick: Callable[[Tensor], Tensor]  # scores [N, V] -> one token per row
    epsilon: float = 0.09
    alpha: float = 0.3
    #: typical only: the published formula on softmax(raw logits / temperature) instead of the processed scores
    reference: bool = False
    temperature: float = 1.0  # the call's sampling temperature (1 without sampling)


@dataclass(frozen=True)
class Verified:
    """One verification forward: raw logits [B, N, V] and the heads' features [B, N, F] of every
    row's nodes (padded to the largest tree), which the cache holds after ``prefix_len`` slots."""

    logits: Tensor
    hidden: Tensor
    prefix_len: int


@dataclass(frozen=True)
class Accepted:
    """A row's verdict on its tree: processed scores [N, V], accepted path (root first), next token."""

    scores: Tensor
    path: list[int]
    next_token: int


#: what a done row kept in the forward (a static cache) accepts: its root alone, emitting nothing
IDLE = Accepted(torch.empty(0, 0), [0], -1)


@dataclass
class Row:
    """One prompt of the call: its text so far and its own drafting state."""

    index: int  # row in the caller's batch
    ids: Tensor  # [1, L]: the (left-padded) prompt and the tokens generated so far
    drafting: RowDrafting
    processors: object  # the call's logits processors as they apply to this row alone
    prompt_len: int
    next_pos: int = 0  # position id of the row's next root
    #: a new token's text index (its slot in plain generate's cache) minus its position id: the
    #: prompt's slots that have no position (padding, holes in the attention mask)
    shift: int = 0
    scores: list[Tensor] = field(default_factory=list)  # [n, V] processed scores of emitted tokens (if kept)
    logits: list[Tensor] = field(default_factory=list)  # [n, V] raw logits of emitted tokens (if kept)
    stopped_at: int | None = None  # new tokens when a stopping criterion fired
    done: bool = False  # nothing more to decode (stopped, and caught up with the others where needed)

    @property
    def new_tokens(self) -> int:
        return self.ids.shape[1] - self.prompt_len

    @property
    def last_index(self) -> int:
        """Text index of the row's last token (the next root's, unless a criterion stopped the row
        inside its accepted path): its index in the row's ids, padding and holes included."""
        return self.ids.shape[1] - 1

    @property
    def next_index(self) -> int:
        """Text index of the row's next root (where plain generate's cache holds it)."""
        return self.next_pos + self.shift


class DecodeSession:
    """The state of one EntMTP ``generate`` call (built by :func:`~entmtp_hf.decoding.loop.entmtp_decode`)."""

    def __init__(
        self,
        model,
        heads,
        plan_for: Callable[[int], DecodePlan],
        rule: Rule,
        cache,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        logits_processor,
        stopping_criteria,
        *,
        pad_token_id: int,
        max_length: int,
        streamer=None,
        verify_forward: Callable | None = None,
        keep_scores: bool = False,
        keep_logits: bool = False,
    ) -> None:
        self.model, self.rule, self.cache = model, rule, cache
        #: the verification forward: the model's own, or its compiled call (one graph per tree size)
        self.forward = verify_forward or model
        self.heads, self.plan_for = heads, plan_for
        self.features, self.hidden_request = heads.features, heads.hidden_states_request
        self.device = input_ids.device
        lm = model.get_output_embeddings().weight
        self.lm_device, self.dtype = lm.device, lm.dtype  # the verifier's output: where drafts are verified
        self.prompt_ids = input_ids
        self.attention_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.row_wise = row_wise(logits_processor)  # decided once: the processors do not change during the call
        self.pad_token_id, self.max_length = pad_token_id, max_length
        #: generate's output_scores / output_logits: every emitted token's processed scores / raw logits
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        #: plain generate pads a stopped row only when an EOS criterion exists; else it decodes on
        self.pads_stopped = any(hasattr(c, "eos_token_id") for c in stopping_criteria or ())
        #: a static cache keeps its batch size (compiled graphs are specialised to it): stopped rows stay
        self.drops_rows = not isinstance(cache, StaticCache)
        batch = input_ids.shape[0]
        self.plan = plan_for(batch)
        self.drafter = self._drafter(self.plan)
        self.rows = [
            Row(
                b,
                input_ids[b : b + 1],
                self.drafter.new_row(heads.new_state(model)),
                for_row(logits_processor, b, batch),
                input_ids.shape[1],
            )
            for b in range(batch)
        ]
        self.live = list(self.rows)  # row b of the cache and of every forward is live[b]
        self.streamed = 0  # new tokens of every row the streamer has had
        #: [B_live, S] the text index (cache.slot_indices: what a sliding window counts) of every cached
        #: slot of every live row; -1 for user padding, holes and the slots a row left unfilled, never seen
        self.slot_index = torch.zeros(0, dtype=torch.long)
        self.layout = AttentionLayout.of(model.config)  # sliding-window layers: their masks
        #: the cache's sliding layers this session trims (found once: decoding keeps the layer objects)
        self.sliding = sliding_layers(cache)
        self._idle = Tree.root_only().buffers(
            self.device, self.dtype
        )  # what a stopped row kept in the forward verifies
        self.finished = False

    def _drafter(self, plan: DecodePlan) -> TreeDrafter:
        return TreeDrafter(self.heads, plan, device=self.lm_device, dtype=self.dtype, temperature=self.rule.temperature)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self) -> None:
        """The prompts' forward: the cache, every row's first token and its heads' context.

        A cache filled by an earlier turn holds the prompts' first tokens: only the rest are run,
        and the heads see those (their context starts at this call's new tokens)."""
        ids, mask = self.prompt_ids, self.attention_mask
        cached = int(self.cache.get_seq_length())
        if cached >= ids.shape[1]:
            raise EntMTPError(
                f"the cache already holds {cached} tokens and the prompt has {ids.shape[1]}: a call "
                f"that continues from a filled cache needs at least one new token"
            )
        self.slot_index = slot_indices(mask)
        positions = prompt_positions(mask)  # as plain generate's: holes take no position
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        out = self.model(
            input_ids=ids[:, cached:],
            attention_mask=mask,
            position_ids=positions[:, cached:],
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.hidden_request,
            **keep,
        )
        features = self.features(out.hidden_states)
        last = out.logits[:, -1].float()
        seen = mask[:, cached:] != 0
        seen[~seen.any(dim=-1), -1] = True  # a row of padding alone: plain generate decodes it too
        self.drafter.observe(
            [row.drafting for row in self.rows],
            [features[b][seen[b]] for b in range(len(self.rows))],
            [ids[b, cached:][seen[b]] for b in range(len(self.rows))],
            list(last),
        )
        for b, row in enumerate(self.rows):
            scores = row.processors(row.ids, last[b : b + 1])
            root = check_pick(int(self.rule.pick(scores)[0]))
            row.next_pos = int(positions[b, -1]) + 1
            row.shift = ids.shape[1] - row.next_pos  # the root's text index is the prompt's length
            self._emit(row, [root], scores, last[b : b + 1])
        trim_windows(self.sliding, self.slot_index, [row.last_index for row in self.live])
        self._settle()
        self._stream()

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> StepRecord:
        """One speculative step of every row: draft -> verify -> accept -> commit."""
        drafts = self.draft()
        verified = self.verify(drafts)
        accepted = self.accept(drafts, verified)
        return self.commit(drafts, verified, accepted)

    def draft(self) -> list[Draft]:
        """Every live row's tree, as the drafter returns it; a done row kept in the forward (a static
        cache) verifies its last token alone."""
        active = [row for row in self.live if not row.done]
        drafted = iter(self.drafter.draft([row.drafting for row in active], [row.ids for row in active]))
        return [self._idle_draft(row) if row.done else next(drafted) for row in self.live]

    def verify(self, drafts: list[Draft]) -> Verified:
        prefix_len = int(self.cache.get_seq_length())
        width = max(d.buffers.num_nodes for d in drafts)
        if isinstance(self.cache, StaticCache) and prefix_len + width > self.cache.get_max_length():
            # a batch's rejected slots filled the room; compacted, every row holds at most its text
            # but the root, which leaves room for the tree (cache.lend_static)
            self.slot_index = compact(self.cache, self.slot_index)
            prefix_len = int(self.cache.get_seq_length())
        out = self.tree_forward(drafts, prefix_len)
        return Verified(out.logits, self.features(out.hidden_states), prefix_len)

    def tree_forward(self, drafts: list[Draft], prefix_len: int):
        """One forward of every live row's tree appended after the first ``prefix_len`` cached slots."""
        width = max(d.buffers.num_nodes for d in drafts)
        kv_len = self.cache.get_max_length() if isinstance(self.cache, StaticCache) else prefix_len + width
        prefix = additive_mask(self.slot_index, self.dtype)
        tokens, positions, mask = tree_inputs(drafts, [r.next_pos for r in self.live], prefix, kv_len)
        node_index = positions + positions.new_tensor([r.shift for r in self.live])[:, None]
        mask = self.layout.masks(mask, node_index, self.slot_index, self.sliding[0].dropped if self.sliding else 0)
        with verifying():
            return self.forward(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                cache=self.cache,
                use_cache=True,
                output_hidden_states=self.hidden_request,
            )

    def accept(self, drafts: list[Draft], verified: Verified) -> list[Accepted]:
        """Every row's processed scores, accepted path and next token, each against its own text."""
        return [
            IDLE
            if row.done
            else accept_tree(
                self.rule, row.processors, self.row_wise, row.ids, d, verified.logits[b, : d.buffers.num_nodes]
            )
            for b, (row, d) in enumerate(zip(self.live, drafts))
        ]

    def commit(self, drafts: list[Draft], verified: Verified, accepted: list[Accepted]) -> StepRecord:
        paths = [a.path for a in accepted]
        keep_accepted(self.cache, verified.prefix_len, paths)
        first = [r.next_index for r in self.live]
        # a done row kept in the forward (a static cache) keeps no slot: nothing reads its verdicts
        lengths = [0 if row.done else len(p) for row, p in zip(self.live, paths)]
        self.slot_index = accepted_slots(self.slot_index, verified.prefix_len, first, lengths)
        active = [b for b, row in enumerate(self.live) if not row.done]
        rows = [self.live[b].drafting for b in active]
        self.drafter.observe(
            rows,
            [verified.hidden[b, paths[b]] for b in active],
            [drafts[b].tokens[paths[b]] for b in active],
            [verified.logits[b, paths[b][-1]] for b in active],
        )
        self.drafter.learn(rows, [drafts[b] for b in active], [len(paths[b]) for b in active])
        steps = []
        for b in active:
            row, draft, path, scores = self.live[b], drafts[b], paths[b], accepted[b].scores
            row.next_pos += len(path)
            emitted = self._emit(
                row, draft.tokens[path[1:]].tolist() + [accepted[b].next_token], scores[path], verified.logits[b, path]
            )
            steps.append(RowStep(row.index, draft, path, emitted))
        trim_windows(self.sliding, self.slot_index, [r.last_index for r in self.live])
        self._settle()
        self._stream()
        return StepRecord(tuple(steps), forward_rows=len(drafts))

    # ------------------------------------------------------------------ rows
    def _emit(self, row: Row, new_tokens: list[int], scores: Tensor, logits: Tensor) -> int:
        """Append tokens to ``row`` one at a time up to where a stopping criterion fires; a stopped
        row of a batch that decodes on (no EOS criterion) takes the rest unchecked, up to the call's
        longest text. ``scores`` / ``logits`` [n, V]: each token's processed scores and raw logits,
        kept for the appended ones when the call returns them. Returns how many tokens were appended."""
        rest = new_tokens
        if row.stopped_at is None:
            row.ids, emitted, stopped = emit_tokens(row.ids, new_tokens, scores, self.stopping_criteria)
            if stopped:
                row.stopped_at = row.new_tokens
            decodes_on = stopped and not self.pads_stopped and len(self.rows) > 1
            rest = new_tokens[emitted:] if decodes_on else []
        else:
            emitted = 0
        if rest:
            rest = rest[: max(self.max_length - row.ids.shape[1], 0)]
            row.ids = torch.cat([row.ids, row.ids.new_tensor([rest])], dim=-1)
            emitted += len(rest)
        if self.keep_scores and emitted:
            row.scores.append(scores[:emitted])
        if self.keep_logits and emitted:
            row.logits.append(logits[:emitted].float())
        return emitted

    def _settle(self) -> None:
        """Which rows are done; done rows leave the forward when the cache allows it, and a new
        number of rows in the forward may bring a new plan."""
        stops = [row.stopped_at for row in self.rows]
        everyone = all(s is not None for s in stops)
        longest = max(s for s in stops if s is not None) if everyone else None
        for row in self.rows:
            if row.stopped_at is not None and (self.pads_stopped or (everyone and row.new_tokens >= longest)):
                row.done = True
            elif row.ids.shape[1] >= self.max_length:  # a row decoding on cannot pass the call's longest text
                row.done = True
        self.finished = all(row.done for row in self.rows)
        if self.finished or not self.drops_rows:
            return
        keep = [b for b, row in enumerate(self.live) if not row.done]
        if len(keep) == len(self.live):
            return
        self.live = [self.live[b] for b in keep]
        select_rows(self.cache, torch.tensor(keep, device=self.device))
        self.slot_index = self.slot_index[keep]
        plan = self.plan_for(len(self.live))
        if plan is not self.plan:  # this batch size verifies other trees: a drafter of them takes the rows over
            self.plan, self.drafter = plan, self._drafter(plan)
            for row in self.live:
                row.drafting = self.drafter.carry(row.drafting)

    def _stream(self) -> None:
        """Hand the streamer every new column of the batch that each row now has, one [B] tensor per
        column as plain ``generate`` does (a stopped row's pad token where an EOS criterion pads it),
        so what is streamed is what :meth:`sequences` returns."""
        if self.streamer is None:
            return
        if self.finished:
            ready = self.returned_new_tokens
        else:  # a row padded after its stop has every column; an unfinished call has a row that has not stopped
            ready = min(row.new_tokens for row in self.rows if not (self.pads_stopped and row.stopped_at is not None))
        if ready <= self.streamed:
            return
        block = self.prompt_ids.new_full((len(self.rows), ready - self.streamed), self.pad_token_id)
        for b, row in enumerate(self.rows):
            new = row.ids[0, row.prompt_len + self.streamed : row.prompt_len + ready]
            block[b, : new.shape[0]] = new
        for column in block.cpu().unbind(1):
            self.streamer.put(column)
        self.streamed = ready

    def _idle_draft(self, row: Row) -> Draft:
        """A done row kept in the forward (a static cache) verifies its last token alone."""
        return Draft(0, row.ids[0, -1:], self._idle, None)

    def release_cache(self):
        """The cache object the call was given, handed back as plain ``generate`` would leave it for
        the caller's next turn (:func:`~entmtp_hf.decoding.cache.hand_back`): with one row, the
        returned text but its last token (a row stopped inside its accepted path drops the nodes
        past its end), in transformers' own layer types; after a batch, empty, so the next turn
        prefills the whole conversation: plain ``generate``'s layout cannot be rebuilt without a
        forward (a row that stopped left a dynamic cache with its keys, and plain ``generate`` holds
        the keys of the pad tokens it fed stopped rows)."""
        hand_back(self.cache, self.rows[0].ids.shape[1] - 1 if len(self.rows) == 1 else None)
        return self.cache

    def per_token(self, kind: str) -> tuple[Tensor, ...]:
        """``generate``'s ``scores`` (``kind="scores"``) or ``logits``: one [B, V] tensor per new token
        of the returned sequences. A row's entries past its end are those of a forced pad token
        (0 at ``pad_token_id``, the minimum elsewhere): the row emitted nothing there."""
        steps = self.returned_new_tokens
        per_row = [torch.cat(getattr(row, kind)) if getattr(row, kind) else None for row in self.rows]
        some = next(t for t in per_row if t is not None)
        forced = torch.full_like(some[0], torch.finfo(some.dtype).min)
        forced[self.pad_token_id] = 0.0
        return tuple(
            torch.stack([t[i] if t is not None and i < t.shape[0] else forced for t in per_row]) for i in range(steps)
        )

    @property
    def returned_new_tokens(self) -> int:
        """New tokens per row of the returned sequences: as many as the row that stopped last."""
        return max(row.stopped_at or row.new_tokens for row in self.rows)

    def sequences(self) -> Tensor:
        """[B, L] every row's text, as plain ``generate`` returns a batch: every row as long as the
        one that stopped last, a stopped row padded with ``pad_token_id`` where an EOS criterion exists."""
        length = self.prompt_ids.shape[1] + self.returned_new_tokens
        out = self.prompt_ids.new_full((len(self.rows), length), self.pad_token_id)
        for row in self.rows:
            kept = row.ids[0, :length]
            out[row.index, : kept.shape[0]] = kept
        return out


def accept_tree(
    rule: Rule, logits_processor, row_wise: bool, input_ids: Tensor, draft: Draft, logits: Tensor
) -> Accepted:
    """One verified tree's processed scores [N, V], accepted path (root first) and next token.

    ``input_ids`` [1, L] is the text up to and including the root, ``logits`` [N, V] the raw
    logits of the tree's nodes."""
    buffers, tokens = draft.buffers, draft.tokens
    scores = process_tree_scores(logits_processor, input_ids, tokens, buffers, logits, row_wise=row_wise)
    if rule.name == "typical":
        if rule.reference:  # the published formula, on the raw logits
            passed, node_logp = reference_typical_flags(
                logits, tokens, buffers.parents, rule.temperature, rule.epsilon, rule.alpha
            )
        else:
            passed, node_logp = typical_accept_flags(scores, tokens, buffers.parents, rule.epsilon, rule.alpha)
        path = typical_best_path(passed, node_logp, buffers.retrieve_indices)
        return Accepted(scores, path, check_pick(int(rule.pick(scores[path[-1] : path[-1] + 1])[0])))
    host = torch.stack([tokens, rule.pick(scores)]).tolist()
    acc = walk_tree(buffers.children, host[0], host[1])
    return Accepted(scores, acc.path, check_pick(acc.next_token))


def emit_tokens(ids: Tensor, new_tokens: list[int], scores: Tensor, stopping_criteria) -> tuple[Tensor, int, bool]:
    """``ids`` [1, L] with ``new_tokens`` appended one at a time up to where a stopping criterion
    fires: (the new ids, how many were appended, whether one fired). ``scores[i]`` are the processed
    scores the ``i``-th token was chosen from, handed to the criteria as ``generate`` does."""
    for i, tok in enumerate(new_tokens):
        ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=-1)
        if bool(stopping_criteria(ids, scores[i : i + 1]).any()):
            return ids, i + 1, True
    return ids, len(new_tokens), False
