"""Medusa heads: independent draft heads on h_t.

Head i is ``num_layers`` residual blocks x + SiLU(W x + b) on h_t followed by a bias-free
LM head; it ignores the drafted path, so a tree's node at depth d simply takes the
rank-r token of head d-1 (the Cartesian proposal) and each head runs once per step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..trees.tree import TreeBuffers
from .base import DraftHeads, DraftState, Proposal, ResBlock, StopFn
from .config import HeadsConfig
from .registry import register_family


class MedusaHeads(DraftHeads):
    """Medusa-1 style heads (arch ``mlp``)."""

    lm_head_bias = False

    def _build_mlps(self) -> nn.ModuleList:
        h = self.config.hidden_size
        return nn.ModuleList(
            nn.ModuleList(ResBlock(h, h) for _ in range(self.config.num_layers)) for _ in range(self.config.num_heads)
        )

    @torch.no_grad()
    def propose(
        self,
        state: DraftState,
        root_token: Tensor,
        buffers: TreeBuffers,
        until: StopFn | None = None,
        temperature: float = 1.0,
    ) -> Proposal:
        """One call per depth's head on h_t; children take their rank of that head's top-k
        (``until``, ``temperature``: see the base class)."""
        tokens, probs, entropy = self._start(state, root_token, buffers)
        cond = state.cond[None]
        for i, step in enumerate(buffers.depth_plan):
            logits = self._head(i, cond, state.lm_weight, state.lm_bias, state.kernel)  # [1, V']
            rows = torch.zeros_like(step.child_rank)
            tok, p, h = self._children(logits, rows, step, temperature)
            tokens[step.children], probs[step.children], entropy[step.children] = tok, p, h
            if until is not None and until(i + 1, entropy):
                return Proposal(tokens=tokens, probs=probs, entropy=entropy, depth=i + 1)
        return Proposal(tokens=tokens, probs=probs, entropy=entropy)

    def forward_train(
        self,
        hidden: Tensor,
        input_ids: Tensor | None = None,
        embed: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ) -> list[Tensor]:
        """Teacher-forced logits; element i is [B, T-i-1, V'], row t predicts token t+i+2 from h_t.

        ``input_ids`` and ``embed`` are accepted for interface parity and not used.
        """
        seq = hidden.shape[1]
        hidden = hidden.to(self._dtype)
        lm_weight, lm_bias = self._train_lm(lm_head)
        return [self._head(i, hidden[:, : max(seq - i - 1, 0)], lm_weight, lm_bias) for i in range(self.num_heads)]


register_family("medusa", MedusaHeads, config_class=HeadsConfig, archs=("mlp",))
