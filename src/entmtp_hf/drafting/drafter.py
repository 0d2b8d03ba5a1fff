"""Drafting every live row's tree in one call: the drafter of one plan.

:class:`TreeDrafter` is built once per ``generate`` call and plan (a batch whose live size
changes plan gets a new one) and drafts for every live row at once, as vLLM drafts for its
input batch: ``draft(rows, texts)`` returns each row's :class:`Draft` (the tokens, root first,
and the tree's buffers), which is exactly what the step verifies; ``observe`` gives the heads
the features of each row's newly accepted positions (in one call for every row) and the
confidence features the verifier's logits at each next root; ``learn`` feeds what each row's
step accepted of its draft to its guard, features and EAS. What rows share (the plan's trees
compiled to buffers, once: :class:`PlanBuffers`) lives in the drafter; what each row owns is
plain data (:class:`RowDrafting`).

How a row's step picks its tree depends on what the plan's policy reads (registered with it,
see :data:`~entmtp_hf.scheduling.policies.NEEDS`; a table, not a chain of ifs): a policy that
reads nothing (``static``) drafts its one tree; one that reads a scalar feature (``hysteresis``
/ ``ladder``) reads it before drafting when it needs no draft (then only the chosen tree is
drafted), else off the drafted union of every schedulable tree; one that reads per-tree values
(``value``) drafts the union and takes the tree with the most path value per unit of cost
(probabilities at the sampling temperature); one that reads per-depth entropies (``entropy``,
EAS) drafts depth by depth and stops where the rule ends the chain. Every row that drafts the
union drafts it in one head call per depth (``heads.propose_rows``); the others draft alone. A
switch between trees is an index lookup. With retrieval on, each row's n-gram index takes the
text it has not seen at the start of ``draft`` (an explicit step; the query that follows reads
it only), and the chosen tree gets one more branch whenever the text's suffix recurs
(:mod:`entmtp_hf.drafting.retrieval`; in ``replace`` mode the branch is verified instead).

With a priced plan the break-even guard (:mod:`entmtp_hf.scheduling.guard`) sits above each
row's policy: while it says the trees lose to root-alone steps, the row's draft is its root
alone, and those steps feed neither the features nor EAS (a plain step says nothing about the
heads); the heads still see every accepted position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..banks.plan import DecodePlan
from ..heads.base import DraftState, Proposal
from ..scheduling.eas import EASController
from ..scheduling.features import FeatureTracker, top1_and_entropy, tree_values
from ..scheduling.guard import BreakEvenGuard
from ..scheduling.policies import (
    NEEDS_ENTROPIES,
    NEEDS_FEATURE,
    NEEDS_NOTHING,
    NEEDS_VALUES,
    Scheduler,
    get_policy,
)
from ..trees.tree import Tree, TreeBuffers
from .retrieval import NgramIndex


@dataclass(frozen=True)
class Draft:
    """One row's drafted tree, ready for verification."""

    tree_index: int
    tokens: Tensor  # [N] long, node 0 = root, on the verifier's device
    buffers: TreeBuffers
    feature: float | None
    branch_node: int | None = None  # the retrieval branch's first node (None: no branch this step)
    guarded: bool = False  # the break-even guard's root alone: nothing drafted, ``tree_index`` the policy's tree


@dataclass(frozen=True)
class Branch:
    """A tree with a retrieved chain, compiled: its buffers, where each node's token comes from
    (an index < the union's size: a union node's; else a retrieved token's) and the chain's first node."""

    buffers: TreeBuffers  # on the verifier's device
    pool_map: Tensor  # [N] long, on the heads' device
    first_node: int


@dataclass(frozen=True)
class PlanBuffers:
    """One plan's trees compiled once per call, on the devices that read them; shared by every row."""

    union: TreeBuffers  # what a shared head call drafts (the heads' device)
    trees: tuple[TreeBuffers, ...]  # what the step verifies (the verifier's device)
    draft_trees: tuple[TreeBuffers, ...]  # each tree drafted alone (the heads' device; ``trees`` where they agree)
    node_maps: tuple[Tensor, ...]  # per tree: its nodes' indices in the union
    chain_nodes: Tensor  # union indices of the greedy chain the confidence features read
    members: Tensor | None  # [K, N] the value policy's: which non-root union nodes each tree has
    branches: tuple[tuple[Branch, ...], ...]  # with retrieval: ``branches[k][L - 1]``, tree k and L tokens
    root: TreeBuffers  # the root alone (the guard's plain step)

    @classmethod
    def compile(cls, plan: DecodePlan, device: torch.device, heads_device: torch.device, dtype) -> "PlanBuffers":
        trees = tuple(t.buffers(device, dtype) for t in plan.trees)
        same = torch.device(heads_device) == torch.device(device)
        first = plan.union.num_nodes  # pool index of the first retrieved token

        def index(m: Sequence[int]) -> Tensor:
            return torch.tensor(m, dtype=torch.long, device=heads_device)

        members = None
        if get_policy(plan.policy).needs == NEEDS_VALUES:
            members = torch.zeros(len(plan.trees), plan.union.num_nodes, dtype=torch.float64)
            for k, m in enumerate(plan.node_maps):
                members[k, list(m[1:])] = 1.0
            members = members.to(heads_device)
        return cls(
            union=plan.union.buffers(heads_device, dtype),
            trees=trees,
            draft_trees=trees if same else tuple(t.buffers(heads_device, dtype) for t in plan.trees),
            node_maps=tuple(index(m) for m in plan.node_maps),
            chain_nodes=index(plan.chain_nodes),
            members=members,
            branches=tuple(
                tuple(Branch(t.buffers(device, dtype), index(m), m.index(first)) for t, m in per)
                for per in plan.branches
            ),
            root=Tree.root_only().buffers(device, dtype),
        )


@dataclass
class RowDrafting:
    """One row's drafting state, as plain data (what rows share is the drafter's)."""

    heads_state: DraftState  # the heads' per-row context
    scheduler: Scheduler
    feature: FeatureTracker
    eas: EASController | None = None  # policy ``entropy``
    guard: BreakEvenGuard | None = None  # a priced plan
    index: NgramIndex | None = None  # retrieval: the row's text, indexed
    p0: float = 0.0  # the verifier's top-1 probability at the next root (where the feature reads it)
    entropy: float = 0.0  # and its entropy


class TreeDrafter:
    """Drafts the trees of one plan for every live row of a call (see the module docstring)."""

    def __init__(self, heads, plan: DecodePlan, *, device: torch.device, dtype, temperature: float = 1.0) -> None:
        """``device``, ``dtype``: the verifier's (its output embeddings'); ``temperature``: the call's
        sampling temperature (1 without sampling)."""
        self.heads, self.plan, self.device = heads, plan, device
        self.buffers = PlanBuffers.compile(plan, device, next(heads.parameters()).device, dtype)
        self.needs = get_policy(plan.policy).needs
        # the value policy estimates acceptance: under sampling at T a draft is kept with its probability at T
        self.temperature = temperature if self.needs == NEEDS_VALUES else 1.0
        feature = FeatureTracker(plan.feature, plan.feature_window)
        self.reads_draft = feature.reads_draft
        # the verifier's top-1 probability and entropy, only where the scheduler's feature reads them
        self.reads_base = self.needs == NEEDS_FEATURE and feature.reads_base(len(plan.chain_nodes) > 0)
        self.replace = plan.retrieval is not None and plan.retrieval.mode == "replace"
        #: a row whose policy drafts before (or instead of) the union: its own draft, None to share the union's
        self._alone: Callable[[RowDrafting, Tensor, list[int]], Draft | None] | None = {
            NEEDS_FEATURE: self._chosen_first,
            NEEDS_ENTROPIES: self._by_entropy,
        }.get(self.needs)
        #: what the policy reads off a drafted union: (tree index, feature read)
        self._read: Callable[[RowDrafting, Proposal], tuple[int, float | None]] | None = {
            NEEDS_NOTHING: self._current,
            NEEDS_FEATURE: self._by_feature,
            NEEDS_VALUES: self._by_value,
        }.get(self.needs)

    # ------------------------------------------------------------------ rows
    def new_row(self, heads_state: DraftState) -> RowDrafting:
        """A row's drafting state on this plan, continuing the heads' state ``heads_state``."""
        plan = self.plan
        return RowDrafting(
            heads_state,
            plan.new_scheduler(),
            FeatureTracker(plan.feature, plan.feature_window),
            EASController(plan.eas, k_max=len(plan.trees) - 1) if plan.eas is not None else None,
            BreakEvenGuard() if plan.guarded else None,
            NgramIndex(plan.retrieval) if plan.retrieval is not None else None,
        )

    def carry(self, row: RowDrafting) -> RowDrafting:
        """``row`` (drafted on another plan) on this one: the heads' state, the indexed text and the
        EAS statistics carry over; the scheduler, features, guard and EAS window start again (they
        index and price the other plan's trees)."""
        new = self.new_row(row.heads_state)
        if new.index is not None and row.index is not None and row.index.config == new.index.config:
            new.index = row.index
        if new.eas is not None and row.eas is not None:
            new.eas.stats = row.eas.stats  # the call's statistics run on
        return new

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: Sequence[RowDrafting], texts: Sequence[Tensor]) -> list[Draft]:
        """Each row's tree after its text ``texts[i]`` [1, L] (its last token is the root, the
        verifier's own pick): what the step verifies."""
        self._index(rows, texts)
        found = [row.index.continuation() if row.index is not None else [] for row in rows]
        roots = [text[0, -1] for text in texts]
        drafts = [self._own(row, root, hit) for row, root, hit in zip(rows, roots, found)]
        shared = [i for i, d in enumerate(drafts) if d is None]
        proposals = self._propose_union([rows[i].heads_state for i in shared], [roots[i] for i in shared])
        for i, proposal in zip(shared, proposals):
            k, feature = self._read(rows[i], proposal)
            drafts[i] = self._place(k, proposal.tokens, feature, found[i])
        return drafts

    def _index(self, rows: Sequence[RowDrafting], texts: Sequence[Tensor]) -> None:
        """Each row's n-gram index takes the text it has not seen yet (the root included)."""
        for row, text in zip(rows, texts):
            if row.index is not None:
                row.index.extend(text[0, len(row.index.tokens) :].tolist())

    def _own(self, row: RowDrafting, root: Tensor, found: list[int]) -> Draft | None:
        """A row's draft when it does not share the union's head call, else None."""
        k = row.scheduler.current
        if row.guard is not None and row.guard.root_alone:  # the trees lose here: a plain step
            return Draft(k, root.reshape(1).to(self.device), self.buffers.root, None, guarded=True)
        if found and self.replace:  # a found continuation is verified alone, undrafted by the heads
            branch = self.buffers.branches[k][len(found) - 1]
            tokens = torch.cat([root.reshape(1).to(self.device), root.new_tensor(found, device=self.device)])
            return Draft(k, tokens.long(), branch.buffers, None, branch.first_node)
        return self._alone(row, root, found) if self._alone is not None else None

    def _propose_union(self, states: list[DraftState], roots: list[Tensor]) -> list[Proposal]:
        """The union drafted for every row that shares it, in one head call per depth (one row: the
        heads' single-row call, the same draft without the batch's stacking)."""
        union, t = self.buffers.union, self.temperature
        if len(states) == 1:
            return [self.heads.propose(states[0], roots[0], union, temperature=t)]
        return self.heads.propose_rows(states, roots, union, temperature=t) if states else []

    def _place(self, k: int, tokens: Tensor, feature: float | None, found: list[int]) -> Draft:
        """Tree ``k``'s draft out of the union's drafted ``tokens``, with the retrieval branch if found."""
        if found:
            branch = self.buffers.branches[k][len(found) - 1]
            pool = torch.cat([tokens, tokens.new_tensor(found)])
            return Draft(k, pool[branch.pool_map].to(self.device), branch.buffers, feature, branch.first_node)
        return Draft(k, tokens[self.buffers.node_maps[k]].to(self.device), self.buffers.trees[k], feature)

    # ------------------------------------------------------------------ the policies' readings
    def _current(self, row: RowDrafting, proposal: Proposal) -> tuple[int, float | None]:
        """A policy that reads nothing (``static``): its tree (the union is that tree)."""
        return row.scheduler.current, None

    def _by_feature(self, row: RowDrafting, proposal: Proposal) -> tuple[int, float | None]:
        """A policy that reads a scalar feature (``hysteresis`` / ``ladder``), read off the drafted union."""
        chain = proposal.probs[self.buffers.chain_nodes].tolist() if len(self.buffers.chain_nodes) else []
        s = row.feature.value(row.p0, row.entropy, chain)
        return row.scheduler.choose(s), s

    def _by_value(self, row: RowDrafting, proposal: Proposal) -> tuple[int, float | None]:
        """A policy that reads per-tree values (``value``: the tree with the most expected accepted
        tokens per unit of cost)."""
        values = tree_values(proposal.probs, self.buffers.union.ancestors, self.buffers.members)
        return row.scheduler.choose(values.tolist()), None

    def _chosen_first(self, row: RowDrafting, root: Tensor, found: list[int]) -> Draft | None:
        """A scalar feature known before drafting picks the tree, and only that tree is drafted;
        one read off the draft (or a retrieval branch, which hangs from the union) shares the union."""
        if self.reads_draft or found:
            return None
        s = row.feature.value(row.p0, row.entropy, [])
        k = row.scheduler.choose(s)
        tokens = self.heads.propose(row.heads_state, root, self.buffers.draft_trees[k]).tokens
        return Draft(k, tokens.to(self.device), self.buffers.trees[k], s)

    def _by_entropy(self, row: RowDrafting, root: Tensor, found: list[int]) -> Draft:
        """A policy that reads per-depth entropies (``entropy``, EAS): the heads draft depth by depth
        until the rule ends the chain; the policy maps the chain's length to the tree to verify."""
        walk, chain = row.eas.walk(), self.plan.chain_nodes

        def until(depth: int, entropy: Tensor) -> bool:
            return walk.done or walk.feed(float(entropy[chain[depth - 1]]))

        proposal = self.heads.propose(row.heads_state, root, self.buffers.union, until=until)
        return self._place(row.scheduler.choose(walk.close()), proposal.tokens, None, found)

    # ------------------------------------------------------------------ after verification
    def observe(
        self,
        rows: Sequence[RowDrafting],
        hiddens: Sequence[Tensor],
        tokens: Sequence[Tensor],
        root_logits: Sequence[Tensor],
    ) -> None:
        """Each row's features [T, F] of its newly accepted positions and the ids there [T] (the
        heads condition on them, one call for every row), and the verifier's logits [V] at its
        next root (what the confidence features read)."""
        self.heads.observe_rows([row.heads_state for row in rows], list(hiddens), list(tokens))
        if self.reads_base:
            for row, logits in zip(rows, root_logits):
                p0, entropy = top1_and_entropy(logits)
                row.p0, row.entropy = float(p0), float(entropy)

    def learn(self, rows: Sequence[RowDrafting], drafts: Sequence[Draft], accepted: Sequence[int]) -> None:
        """What each row's step accepted of the draft it verified (``accepted[i]``: the nodes of its
        accepted path, root included): the guard, the features and EAS learn from it."""
        for row, draft, length in zip(rows, drafts, accepted):
            if row.guard is not None:
                row.guard.observe(length, 1.0 if draft.guarded else self._price(draft))
            if draft.guarded:  # a plain step: nothing about the heads or the policy's trees
                continue
            row.feature.observe_accept(length)
            if row.eas is not None:
                row.eas.observe_verified(draft.buffers.num_nodes - 1, length - 1, length)

    def _price(self, draft: Draft) -> float:
        """A drafted step's cost over a root-alone step's, as the plan priced it."""
        k = draft.tree_index
        if draft.branch_node is None:
            return self.plan.step_costs[k]
        base = 1 if self.replace else self.plan.trees[k].num_nodes  # the branch's tree holds base + L nodes
        return self.plan.branch_costs[k][draft.buffers.num_nodes - base - 1]
