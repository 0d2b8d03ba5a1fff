"""Drafting the scheduled tree from the heads.

:class:`EntMTPCandidateGenerator` is built once per ``generate`` call. Each step it drafts
the union of every tree the scheduler may pick (one batched head call per depth for Hydra,
one call per head for Medusa), reads the confidence feature off the draft, lets the
scheduler choose a tree (under the ``value`` policy: the tree whose drafted nodes carry the
most path value per unit of cost, with the heads' probabilities taken at the sampling
temperature when sampling), and returns that tree's tokens with its precompiled
buffers: a switch between trees is an index lookup, never a recompilation. Under the
``entropy`` policy an :class:`~entmtp_hf.eas.EASController` picks the tree instead: the
plan's trees are the truncations of one tree at depth 0..D, and the index is the chain length
the EAS rule gives for the greedy chain's head entropies; the heads draft depth by depth and stop where the rule
stops, so a short chain does not pay for the deeper heads. Likewise a feature known before
drafting (the verifier's confidence, recent accept lengths) picks the tree first, and only
that tree is drafted. With retrieval on, the chosen tree
gets one more branch whenever the text's suffix recurs (:mod:`entmtp_hf.retrieval`; in
``replace`` mode the branch is verified instead of the tree); the tree with a branch of each
length is compiled up front too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DecodePlan
from ..scheduling.eas import EASController
from .retrieval import NgramIndex
from ..scheduling.policies import FeatureTracker, Scheduler, top1_and_entropy, tree_values
from ..trees.tree import TreeBuffers


@dataclass(frozen=True)
class Candidates:
    """One step's drafted tree, ready for verification."""

    tree_index: int
    tokens: torch.Tensor  # [N] long, node 0 = root
    buffers: TreeBuffers
    feature: float | None
    branch_node: int | None = None  # the retrieval branch's first node (None: no branch this step)


class EntMTPCandidateGenerator:
    """Owns the heads' per-call state, the scheduler and the compiled trees of one call."""

    def __init__(
        self, model, heads, plan: DecodePlan, feature: FeatureTracker, device, dtype, temperature: float = 1.0
    ) -> None:
        self.heads = heads
        self.plan = plan
        self.scheduler: Scheduler = plan.new_scheduler()
        self.eas = EASController(plan.eas, k_max=len(plan.trees) - 1) if plan.eas is not None else None
        self.feature = feature
        self.state = heads.new_state(model)
        heads_device = next(heads.parameters()).device
        # compiled once here, never inside the loop
        self.union_buffers = plan.union.buffers(heads_device, dtype)
        self.buffers = tuple(t.buffers(device, dtype) for t in plan.trees)
        same = torch.device(heads_device) == torch.device(device)
        self.draft_buffers = self.buffers if same else tuple(t.buffers(heads_device, dtype) for t in plan.trees)
        self.node_maps = tuple(torch.tensor(m, dtype=torch.long, device=heads_device) for m in plan.node_maps)
        self.chain_nodes = torch.tensor(plan.chain_nodes, dtype=torch.long, device=heads_device)
        # the verifier's top-1 probability and entropy, only where the scheduler's feature reads them
        self.reads_base = (
            self.eas is None and self.scheduler.needs_feature and feature.reads_base(drafted=len(plan.chain_nodes) > 0)
        )
        self.members = None  # value policy: [K, N] which non-root union nodes each tree has
        if self.scheduler.policy == "value":
            self.members = torch.zeros(len(plan.trees), plan.union.num_nodes, dtype=torch.float64)
            for k, m in enumerate(plan.node_maps):
                self.members[k, list(m[1:])] = 1.0
            self.members = self.members.to(heads_device)
        # the value policy estimates acceptance: under sampling at T, a draft is kept with its probability at T
        self.temperature = temperature if self.members is not None else 1.0
        self.device = device
        self.index = NgramIndex(plan.retrieval) if plan.retrieval is not None else None
        self.replace = plan.retrieval is not None and plan.retrieval.mode == "replace"
        self.branch_buffers = tuple(tuple(t.buffers(device, dtype) for t, _ in per) for per in plan.branches)
        self.branch_maps = tuple(
            tuple(torch.tensor(m, dtype=torch.long, device=heads_device) for _, m in per) for per in plan.branches
        )
        first = plan.union.num_nodes  # pool index of the first retrieved token
        self.branch_nodes = tuple(tuple(m.index(first) for _, m in per) for per in plan.branches)

    def confidence(self, logits: torch.Tensor) -> tuple[float, float]:
        """Top-1 probability and entropy of the verifier's logits at the next root, when the
        scheduler's feature reads them (0, 0 otherwise: a softmax over the whole vocabulary
        every step, 0.1 ms on this project's CPU, for nothing)."""
        if not self.reads_base:
            return 0.0, 0.0
        p0, entropy = top1_and_entropy(logits)
        return float(p0), float(entropy)

    def extend_text(self, tokens: list[int]) -> None:
        """Tokens added to the text (the prompt first): what retrieval may copy from."""
        if self.index is not None:
            self.index.extend(tokens)

    def observe(self, hidden: torch.Tensor) -> None:
        """Feed the last hidden states of newly accepted positions ([T, H])."""
        self.heads.observe(self.state, hidden)

    def observe_accept(self, accept_length: int, verified: int = 0, accepted: int = 0) -> None:
        """After a step: tokens it added, drafted tokens verified and drafted tokens accepted."""
        self.feature.observe_accept(accept_length)
        if self.eas is not None:
            self.eas.observe_verified(verified, accepted, accept_length)

    def get_candidates(self, root_token: torch.Tensor, p0: float, entropy: float) -> Candidates:
        """Draft the union tree, score the step's confidence and pick the tree to verify (in
        retrieval's ``replace`` mode a found continuation is verified alone, undrafted by the heads)."""
        found = self.index.continuation() if self.index is not None else []
        if found and self.replace:
            k, n = self.scheduler.current, len(found) - 1
            tokens = torch.cat([root_token.reshape(1).to(self.device), root_token.new_tensor(found, device=self.device)])
            return Candidates(k, tokens.long(), self.branch_buffers[k][n], None, self.branch_nodes[k][n])
        s = None
        if self.eas is not None:
            # the heads draft depth by depth and stop as soon as the EAS rule ends the chain
            walk, chain = self.eas.walk(), self.plan.chain_nodes
            proposal = self.heads.propose(
                self.state, root_token, self.union_buffers,
                until=lambda d, ent: walk.done or walk.feed(float(ent[chain[d - 1]])),
            )  # fmt: skip
            k = walk.close()
        elif self.scheduler.needs_feature and not self.feature.reads_draft and not found:
            # the feature is known before drafting: draft the chosen tree only, not the union
            s = self.feature.value(p0, entropy, [])
            k = self.scheduler.choose(s)
            proposal = self.heads.propose(self.state, root_token, self.draft_buffers[k])
            return Candidates(k, proposal.tokens.to(self.device), self.buffers[k], s)
        else:
            proposal = self.heads.propose(self.state, root_token, self.union_buffers, temperature=self.temperature)
            if self.members is not None:
                values = tree_values(proposal.probs, self.union_buffers.ancestors, self.members)
                k = self.scheduler.choose_value(values.tolist())
            elif self.scheduler.needs_feature:
                values = proposal.probs[self.chain_nodes].tolist() if len(self.chain_nodes) else []
                s = self.feature.value(p0, entropy, values)
                k = self.scheduler.choose(s)
            else:
                k = self.scheduler.current
        if found:
            pool = torch.cat([proposal.tokens, proposal.tokens.new_tensor(found)])
            n = len(found) - 1
            tokens = pool[self.branch_maps[k][n]].to(self.device)
            return Candidates(k, tokens, self.branch_buffers[k][n], s, self.branch_nodes[k][n])
        tokens = proposal.tokens[self.node_maps[k]].to(self.device)
        return Candidates(k, tokens, self.buffers[k], s)
