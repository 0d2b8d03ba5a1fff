"""Drafting the scheduled tree from the heads: a transformers ``CandidateGenerator`` for trees.

:class:`EntMTPCandidateGenerator` is built once per ``generate`` call and follows transformers'
``CandidateGenerator`` contract where a tree can:

* ``get_candidates(input_ids)`` drafts the step's tree from the heads and returns
  ``(input_ids + drafted tokens, None)``: the drafted nodes in the tree's canonical order
  (node 0, the root, is the last token of ``input_ids``), and no logits (the heads' are not the
  verifier's). A tree is not a chain, so its shape comes with it: the pair is a
  :class:`TreeCandidates`, whose ``draft`` (a :class:`Draft`: the tokens with the root first, the
  tree's precompiled buffers, which tree, the feature read) is what the decode step verifies;
* ``update_candidate_strategy(input_ids, scores, num_matches)`` takes what transformers passes
  (the text after the step, the processed scores of every drafted node [1, N, V], how many
  drafted tokens were accepted) and feeds the outcome to the scheduler's running features and
  to EAS.

One call the contract does not have: :meth:`EntMTPCandidateGenerator.observe` gives the heads
the hidden states of newly accepted positions (Hydra conditions on them) and the verifier's
logits at the next root (the confidence features read them).

How a step picks its tree depends on what the plan's policy reads (registered with it, see
:data:`~entmtp_hf.scheduling.policies.NEEDS`; a table, not a chain of ifs): a policy that
reads nothing (``static``) drafts its one tree; one that reads a scalar feature
(``hysteresis`` / ``ladder``) reads it before drafting when it needs no draft (then only the
chosen tree is drafted), else off the drafted union of every schedulable tree; one that reads
per-tree values (``value``) drafts the union and takes the tree with the most path value per
unit of cost (probabilities at the sampling temperature); one that reads per-depth entropies
(``entropy``, EAS) drafts depth by depth and stops where the rule ends the chain. A switch between trees is an
index lookup: every tree is compiled to buffers when the generator is built. With retrieval
on, the chosen tree gets one more branch whenever the text's suffix recurs
(:mod:`entmtp_hf.drafting.retrieval`; in ``replace`` mode the branch is verified instead).

With a priced plan the break-even guard (:mod:`entmtp_hf.scheduling.guard`) sits above the
policy: while it says the trees lose to root-alone steps, ``get_candidates`` returns the root
alone and drafts nothing, and those steps feed neither the features nor EAS (a plain step says
nothing about the heads); the heads still see every accepted position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..banks.plan import DecodePlan
from ..scheduling.eas import EASController
from ..scheduling.features import FeatureTracker, top1_and_entropy, tree_values
from ..scheduling.guard import BreakEvenGuard
from ..scheduling.policies import NEEDS_ENTROPIES, NEEDS_FEATURE, NEEDS_NOTHING, NEEDS_VALUES, Scheduler
from ..trees.tree import Tree, TreeBuffers
from .retrieval import NgramIndex


@dataclass(frozen=True)
class Draft:
    """One step's drafted tree, ready for verification."""

    tree_index: int
    tokens: torch.Tensor  # [N] long, node 0 = root, on the verifier's device
    buffers: TreeBuffers
    feature: float | None
    branch_node: int | None = None  # the retrieval branch's first node (None: no branch this step)
    guarded: bool = False  # the break-even guard's root alone: nothing drafted, ``tree_index`` the policy's tree


class TreeCandidates(tuple):
    """``(candidate_ids, candidate_logits)`` as transformers' ``CandidateGenerator`` returns them,
    with the drafted tree they flatten (:attr:`draft`)."""

    draft: Draft

    def __new__(cls, candidate_ids: torch.LongTensor, candidate_logits: torch.Tensor | None, draft: Draft):
        pair = super().__new__(cls, (candidate_ids, candidate_logits))
        pair.draft = draft
        return pair


@dataclass(frozen=True)
class _Choice:
    """A policy's pick: tree ``k`` and the drafted tokens, of the union or already of tree ``k``."""

    k: int
    tokens: torch.Tensor
    feature: float | None = None
    of_union: bool = True


class EntMTPCandidateGenerator(CandidateGenerator):
    """Owns the heads' per-call state, the scheduler and the compiled trees of one call."""

    def __init__(
        self, model, heads, plan: DecodePlan, *, feature_window: int = 8, temperature: float = 1.0, state=None
    ) -> None:
        """``state``: the heads' state to continue from (a batch row moving to another plan), else a fresh one."""
        self.heads, self.plan = heads, plan
        self.scheduler: Scheduler = plan.new_scheduler()
        self.eas = EASController(plan.eas, k_max=len(plan.trees) - 1) if plan.eas is not None else None
        self.feature = FeatureTracker(plan.feature, feature_window)
        self.state = state if state is not None else heads.new_state(model)
        lm = model.get_output_embeddings().weight
        device, dtype = lm.device, lm.dtype
        heads_device = next(heads.parameters()).device
        self.device = device
        # compiled once here, never inside the loop
        self.union_buffers = plan.union.buffers(heads_device, dtype)
        self.buffers = tuple(t.buffers(device, dtype) for t in plan.trees)
        same = torch.device(heads_device) == torch.device(device)
        self.draft_buffers = self.buffers if same else tuple(t.buffers(heads_device, dtype) for t in plan.trees)
        self.node_maps = tuple(torch.tensor(m, dtype=torch.long, device=heads_device) for m in plan.node_maps)
        self.chain_nodes = torch.tensor(plan.chain_nodes, dtype=torch.long, device=heads_device)
        self.members = self._value_members(heads_device) if self.scheduler.needs == NEEDS_VALUES else None
        # the value policy estimates acceptance: under sampling at T a draft is kept with its probability at T
        self.temperature = temperature if self.members is not None else 1.0
        # the verifier's top-1 probability and entropy, only where the scheduler's feature reads them
        self.reads_base = (
            self.eas is None and self.scheduler.needs_feature and self.feature.reads_base(len(plan.chain_nodes) > 0)
        )
        self.p0 = self.entropy = 0.0
        self.index = NgramIndex(plan.retrieval) if plan.retrieval is not None else None
        self.replace = plan.retrieval is not None and plan.retrieval.mode == "replace"
        self.branch_buffers = tuple(tuple(t.buffers(device, dtype) for t, _ in per) for per in plan.branches)
        self.branch_maps = tuple(
            tuple(torch.tensor(m, dtype=torch.long, device=heads_device) for _, m in per) for per in plan.branches
        )
        first = plan.union.num_nodes  # pool index of the first retrieved token
        self.branch_nodes = tuple(tuple(m.index(first) for _, m in per) for per in plan.branches)
        choosers: dict[str, Callable[[torch.Tensor, bool], _Choice]] = {
            NEEDS_NOTHING: self._current,
            NEEDS_FEATURE: self._by_feature,
            NEEDS_VALUES: self._by_value,
            NEEDS_ENTROPIES: self._by_entropy,
        }
        self._choose = choosers[self.scheduler.needs]
        self.guard = BreakEvenGuard() if plan.guarded else None
        self.root_buffers = Tree.root_only().buffers(device, dtype) if self.guard is not None else None
        self._drafted: Draft | None = None  # the last draft returned (what update_candidate_strategy scores)
        self._preset = None  # the union's proposal, drafted for this row with the other rows of a batch

    def _value_members(self, device) -> torch.Tensor:
        """[K, N]: which non-root union nodes each tree of the value policy has."""
        members = torch.zeros(len(self.plan.trees), self.plan.union.num_nodes, dtype=torch.float64)
        for k, m in enumerate(self.plan.node_maps):
            members[k, list(m[1:])] = 1.0
        return members.to(device)

    # ------------------------------------------------------------------ the contract
    def get_candidates(self, input_ids: torch.LongTensor) -> TreeCandidates:
        """Draft this step's tree after ``input_ids`` [1, L] (its last token is the root): ``input_ids``
        followed by the drafted nodes in canonical order, no logits, and the tree (``.draft``)."""
        if self.index is not None:
            self.index.extend(input_ids[0, len(self.index.tokens) :].tolist())
        if self.guard is not None and self.guard.root_alone:  # the trees lose here: a plain step
            draft = Draft(
                self.scheduler.current, input_ids[0, -1:].to(self.device), self.root_buffers, None, guarded=True
            )
        else:
            draft = self._draft(input_ids[0, -1])
        self._drafted, self._preset = draft, None
        return TreeCandidates(torch.cat([input_ids, draft.tokens[1:].to(input_ids.device)[None]], dim=-1), None, draft)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """After verification of the last draft: ``scores`` [1, N, V] of its nodes, ``num_matches``
        drafted tokens accepted."""
        accept_length = int(num_matches) + 1
        if self.guard is not None:
            self.guard.observe(accept_length, 1.0 if self._drafted.guarded else self._price(self._drafted))
        if self._drafted.guarded:  # a plain step: nothing about the heads or the policy's trees
            return
        self.feature.observe_accept(accept_length)
        if self.eas is not None:
            self.eas.observe_verified(self._drafted.buffers.num_nodes - 1, int(num_matches), accept_length)

    def _price(self, draft: Draft) -> float:
        """A drafted step's cost over a root-alone step's, as the plan priced it."""
        k = draft.tree_index
        if draft.branch_node is None:
            return self.plan.step_costs[k]
        base = 1 if self.replace else self.plan.trees[k].num_nodes  # the branch's tree holds base + L nodes
        return self.plan.branch_costs[k][draft.buffers.num_nodes - base - 1]

    def observe(self, hidden: torch.Tensor, root_logits: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Features [T, F] of newly accepted positions (the heads condition on them), the ids at those
        positions, and the verifier's logits [V] at the next root (what the confidence features read)."""
        self.heads.observe(self.state, hidden, tokens)
        self._read_root(root_logits)

    def _read_root(self, root_logits: torch.Tensor) -> None:
        """The confidence features' reading of the verifier's logits at the next root."""
        if self.reads_base:
            p0, entropy = top1_and_entropy(root_logits)
            self.p0, self.entropy = float(p0), float(entropy)

    @staticmethod
    def observe_rows(
        generators: list["EntMTPCandidateGenerator"],
        hiddens: list[torch.Tensor],
        root_logits: list[torch.Tensor],
        tokens: list[torch.Tensor],
    ) -> None:
        """:meth:`observe` for the rows of a batch, one generator each, sharing one set of heads
        (whose conditioning then runs once for every row)."""
        generators[0].heads.observe_rows([g.state for g in generators], hiddens, tokens)
        for g, logits in zip(generators, root_logits):
            g._read_root(logits)

    # ------------------------------------------------------------------ drafting
    def _draft(self, root: torch.Tensor) -> Draft:
        found = self.index.continuation() if self.index is not None else []
        if found and self.replace:  # a found continuation is verified alone, undrafted by the heads
            k, n = self.scheduler.current, len(found) - 1
            tokens = torch.cat([root.reshape(1).to(self.device), root.new_tensor(found, device=self.device)])
            return Draft(k, tokens.long(), self.branch_buffers[k][n], None, self.branch_nodes[k][n])
        choice = self._choose(root, bool(found))
        if not choice.of_union:
            return Draft(choice.k, choice.tokens.to(self.device), self.buffers[choice.k], choice.feature)
        k = choice.k
        if found:
            n = len(found) - 1
            pool = torch.cat([choice.tokens, choice.tokens.new_tensor(found)])
            tokens = pool[self.branch_maps[k][n]].to(self.device)
            return Draft(k, tokens, self.branch_buffers[k][n], choice.feature, self.branch_nodes[k][n])
        return Draft(k, choice.tokens[self.node_maps[k]].to(self.device), self.buffers[k], choice.feature)

    def drafts_union(self, input_ids: torch.LongTensor) -> bool:
        """Whether the next draft after ``input_ids`` [1, L] is the union's, drafted by the heads
        alone (so a batch can draft it for several rows at once: :meth:`preset_union`); a found
        retrieval continuation that replaces the draft needs no heads."""
        if self.eas is not None or (self.guard is not None and self.guard.root_alone):
            return False
        found = False
        if self.index is not None:
            self.index.extend(input_ids[0, len(self.index.tokens) :].tolist())
            found = bool(self.index.continuation())
            if found and self.replace:
                return False
        needs = self.scheduler.needs
        return needs in (NEEDS_NOTHING, NEEDS_VALUES) or (
            needs == NEEDS_FEATURE and (self.feature.reads_draft or found)
        )

    @property
    def union_temperature(self) -> float:
        """The temperature this generator drafts the union at (only the value policy reads it)."""
        return self.temperature if self.scheduler.needs == NEEDS_VALUES else 1.0

    def preset_union(self, proposal) -> None:
        """The union's proposal for the next draft, drafted already (at :attr:`temperature`)."""
        self._preset = proposal

    def _propose_union(self, root: torch.Tensor, **kwargs):
        if self._preset is not None:
            proposal, self._preset = self._preset, None
            return proposal
        return self.heads.propose(self.state, root, self.union_buffers, **kwargs)

    def _current(self, root: torch.Tensor, found: bool) -> _Choice:
        """A policy that reads nothing (``static``): its tree (the union is that tree)."""
        return _Choice(self.scheduler.current, self._propose_union(root).tokens)

    def _by_feature(self, root: torch.Tensor, found: bool) -> _Choice:
        """A policy that reads a scalar feature (``hysteresis`` / ``ladder``) picks the tree with it."""
        if not self.feature.reads_draft and not found:  # known before drafting: draft the chosen tree only
            s = self.feature.value(self.p0, self.entropy, [])
            k = self.scheduler.choose(s)
            return _Choice(k, self.heads.propose(self.state, root, self.draft_buffers[k]).tokens, s, of_union=False)
        proposal = self._propose_union(root)
        chain = proposal.probs[self.chain_nodes].tolist() if len(self.chain_nodes) else []
        s = self.feature.value(self.p0, self.entropy, chain)
        return _Choice(self.scheduler.choose(s), proposal.tokens, s)

    def _by_value(self, root: torch.Tensor, found: bool) -> _Choice:
        """A policy that reads per-tree values (``value``: the tree with the most expected accepted
        tokens per unit of cost)."""
        proposal = self._propose_union(root, temperature=self.temperature)
        values = tree_values(proposal.probs, self.union_buffers.ancestors, self.members)
        return _Choice(self.scheduler.choose(values.tolist()), proposal.tokens)

    def _by_entropy(self, root: torch.Tensor, found: bool) -> _Choice:
        """A policy that reads per-depth entropies (``entropy``, EAS): the heads draft depth by depth
        until the rule ends the chain; the policy maps the chain's length to the tree to verify."""
        walk, chain = self.eas.walk(), self.plan.chain_nodes
        proposal = self._propose_union(root, until=lambda d, ent: walk.done or walk.feed(float(ent[chain[d - 1]])))
        return _Choice(self.scheduler.choose(walk.close()), proposal.tokens)
