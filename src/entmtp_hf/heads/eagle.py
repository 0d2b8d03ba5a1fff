"""EAGLE-style feature drafters: a small decoder that predicts the base model's next feature.

Two architectures (their published layouts: docs/heads.md):

* ``eagle`` (EAGLE-1/2): ``fc`` maps concat[E(x_{j+1}), f_j] (2H) to H, then decoder layer(s)
  of the base architecture (the first without its input norm); no final norm, and the output
  goes to the base LM head (rows restricted to the drafting vocabulary). The committed feature
  f_j is the base model's last hidden state after the final norm.
  With ``feature_layers`` (further base states, then -1) the feature is f_j plus a projection of
  those states (each RMS-normed), zero at the start: an EAGLE-1 drafter extended with it drafts
  as before, and training adds what the lower layers know (this library's own variant).
* ``eagle3`` (EAGLE-3): the committed feature is ``fc`` of the base model's low, middle and high
  layer states (3H -> H); one layer whose attention reads concat[norm(E(x)), norm(f)] (2H)
  with f as the residual; a final norm and its own LM head over a drafting vocabulary.

How it drafts. The drafter runs over *pairs* (f_j, x_{j+1}), the feature at position j and the
token after it; its output at pair j stands for f_{j+1} and scores token x_{j+2}. For drafted
nodes the feature is the drafter's own output at the node's parent. ``observe(state, hidden,
tokens)`` queues the pairs it can complete (the last feature waits for its token: the root,
which ``propose`` brings); ``propose`` runs the queued pairs into the drafter's cache (they are
committed text), then drafts the tree depth by depth, one call per depth over that depth's
expanded nodes, each attending to the committed cache and to its own ancestors (a tree mask).
The drafted keys and values live only inside ``propose``; the committed cache never holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cpu_kernels import project
from ..gemv import kernel_attention
from ..trees.tree import TreeBuffers
from .base import DraftHeads, DraftState, Proposal, StopFn
from .config import HeadsConfig
from .hydra import _architecture_classes, build_prefix_config, prefix_layer_config, rope_kwargs
from .registry import register_family


def eagle3_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's fused states: the inputs of base layers 2, L/2 and L-3 (hidden-state indices; 0 = embeddings)."""
    return [min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``x`` [..., T, d] with ``cos`` / ``sin`` [T, d] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, computed in float32 or wider (the base layers' float32 norm, exact in float64)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class DraftAttention(nn.Module):
    """Grouped-query attention with RoPE over a plain key/value cache, under an additive mask."""

    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        h, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def _split(self, y: Tensor, heads: int) -> Tensor:
        """[..., Q, heads * d] -> [..., heads, Q, d]."""
        return y.unflatten(-1, (heads, self.head_dim)).transpose(-2, -3)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated queries [..., heads, Q, d] of inputs ``x`` [..., Q, in]."""
        return rotate(self._split(self.q_proj(x), self.num_heads), cos, sin)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values [..., kv_heads, Q, d] of inputs ``x`` [..., Q, in]."""
        k, v = self._split(self.k_proj(x), self.num_kv_heads), self._split(self.v_proj(x), self.num_kv_heads)
        return rotate(k, cos, sin), v

    def merge(self, out: Tensor) -> Tensor:
        """The output projection of per-head results [..., heads, Q, d]."""
        return self.o_proj(out.transpose(-2, -3).flatten(-2))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Queries from ``x`` [B, Q, in] over ``keys`` / ``values`` [B, kv_heads, K, d] (the queries'
        own included) under ``mask`` [B, Q, K] (additive); on the package's decode attention where it
        takes them (:func:`~entmtp_hf.gemv.kernel_attention`)."""
        q = self.queries(x, cos, sin)
        out = kernel_attention(q, keys, values, mask[:, None], self.head_dim**-0.5)
        if out is not None:  # [B, Q, heads, d]
            return self.o_proj(out.flatten(-2))
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.merge(out)


class DraftMLP(nn.Module):
    """The base architecture's gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        h, i, bias = config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        # Gemma names it hidden_activation (gelu_pytorch_tanh), the Llama family hidden_act
        self.act_fn = ACT2FN[getattr(config, "hidden_activation", None) or config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One drafter decoder layer. ``fused`` (EAGLE-3): attention reads concat[norm(emb), norm(x)]
    (2H) and ``x`` is the residual; else a base-style layer on ``x`` whose input norm is absent
    in the first layer (EAGLE-1/2: ``fc``'s output enters attention unnormalised)."""

    def __init__(self, config: Any, fused: bool, input_norm: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fused = fused
        self.self_attn = DraftAttention(config, 2 * h if fused else h)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(h, eps=eps) if input_norm or fused else None
        self.hidden_norm = RMSNorm(h, eps=eps) if fused else None
        self.post_attention_layernorm = RMSNorm(h, eps=eps)

    def attention_input(self, x: Tensor, emb: Tensor | None) -> Tensor:
        if self.fused:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        return self.input_layernorm(x) if self.input_layernorm is not None else x

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """Residual around attention, then the MLP block."""
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class EagleCache:
    """The drafter's per-call state: its committed keys and values (one pair per committed
    position), the pairs waiting to be run, and the output at the last committed pair."""

    keys: list[Tensor] = field(default_factory=list)  # per layer [kv_heads, L, d]
    values: list[Tensor] = field(default_factory=list)
    queued_feats: list[Tensor] = field(default_factory=list)
    queued_tokens: list[Tensor] = field(default_factory=list)
    waiting: Tensor | None = None  # the last observed feature; its token is the next root
    last_out: Tensor | None = None  # [H] output at the last committed pair (predicts depth 1)
    last_root: Tensor | None = None

    @property
    def length(self) -> int:
        """Committed pairs in the cache."""
        return self.keys[0].shape[1] if self.keys else 0


class PairQueue:
    """``observe`` and the queue of drafters that run over pairs (a base state, the token after it): the
    pairs newly accepted positions complete wait in the per-call cache (``queued_feats``,
    ``queued_tokens``), the last state waits for its token (``waiting``: the next root, which ``propose``
    brings); ``last_out`` is the drafter's output at the last committed pair (None before the first)."""

    @torch.no_grad()
    def observe(self, state: DraftState, hidden: Tensor, tokens: Tensor | None = None) -> None:
        """Queue the pairs (feature, next token) that ``hidden`` [T, F] and ``tokens`` [T] (the ids at
        those positions) complete; the last feature waits for the next root."""
        hidden = self._observed(hidden)
        if tokens is None or tokens.reshape(-1).shape[0] != hidden.shape[0]:
            raise ValueError(
                f"{type(self).__name__} pairs each feature with the next token: pass tokens=[T] (the "
                "ids at the hidden states' positions)"
            )
        cache = state.prefix_cache
        hidden, tokens = hidden.to(self._dtype), tokens.reshape(-1).to(hidden.device)
        if cache.waiting is not None:
            cache.queued_feats.append(cache.waiting[None])
            cache.queued_tokens.append(tokens[:1])
        if hidden.shape[0] > 1:
            cache.queued_feats.append(hidden[:-1])
            cache.queued_tokens.append(tokens[1:])
        cache.waiting = hidden[-1]
        state.num_observed += hidden.shape[0]
        state.cond = hidden[-1]

    @staticmethod
    def _take_queue(cache: Any, root: Tensor) -> tuple[Tensor, Tensor] | None:
        """The queued pairs' features and tokens, the last pair completed by ``root``, and the queue
        emptied; ``None`` when nothing waits (a second ``propose`` with the same root)."""
        if cache.waiting is None:
            if cache.last_out is None:
                raise ValueError("observe() the prompt's hidden states before propose()")
            if not torch.equal(cache.last_root, root):
                raise ValueError("propose() again with another root and nothing observed in between")
            return None
        feats = torch.cat([*cache.queued_feats, cache.waiting[None]])
        tokens = torch.cat([*cache.queued_tokens, root])
        cache.queued_feats, cache.queued_tokens, cache.waiting, cache.last_root = [], [], None, root.clone()
        return feats, tokens


class EagleHeads(PairQueue, DraftHeads):
    """EAGLE-style drafter (archs ``eagle``: EAGLE-1/2, ``eagle3``: EAGLE-3). ``num_heads`` is the
    deepest tree it drafts (and the training unroll); ``num_layers`` its decoder layers."""

    @classmethod
    def card_summary(cls, config: Any, vocab: str, lm: str, stored: str) -> tuple[str, str]:
        lm = lm if config.use_base_lm_head else "its own LM head"
        name = "EAGLE-3 drafter" if config.head_arch == "eagle3" else "EAGLE-style drafter"
        what = (
            f"An {name} (`{config.head_arch}`, {config.num_layers} decoder layer(s), hidden size "
            f"{config.hidden_size}, trees up to depth {config.num_heads}) drafting over {vocab} with {lm}; "
            f"stored in {stored}. At depth d it predicts the base model's feature from "
            "its own output at depth d-1 and the token drafted there, so it drafts token t+d+1."
        )
        layers = config.feature_layers or []
        if config.head_arch == "eagle" and len(layers) > 1:
            what += (
                f" Its feature at committed positions is the base model's last hidden state plus a projection "
                f"of its states {', '.join(map(str, layers[:-1]))} (hidden-state indices, 0 = embeddings)."
            )
        elif layers:
            what += f" It fuses the base model's hidden states {', '.join(map(str, layers))} (0 = embeddings)."
        return name, what

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        layer_config = build_prefix_config(config.prefix_layer_config)
        rope_cls = _architecture_classes(layer_config)[2]
        h, fused = config.hidden_size, config.head_arch == "eagle3"
        self.fused = fused
        self.fc = nn.Linear((3 if fused else 2) * h, h, bias=not fused)
        self.layers = nn.ModuleList(DraftLayer(layer_config, fused, input_norm=i > 0) for i in range(config.num_layers))
        self.norm = RMSNorm(h, eps=layer_config.rms_norm_eps) if fused else None
        extra = len(config.feature_layers or ()) - 1 if not fused else 0
        # eagle with further base states: f + fuse(cat[norm(s_i)]); a zero ``fuse`` drafts as without them
        self.fuse = nn.Linear(extra * h, h, bias=False) if extra > 0 else None
        self.fuse_norms = nn.ModuleList(RMSNorm(h, eps=layer_config.rms_norm_eps) for _ in range(max(extra, 0)))
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)
        self.lm_head = None if config.use_base_lm_head else nn.Linear(h, config.draft_vocab_rows, bias=False)
        self.rotary_emb = rope_cls(config=layer_config)  # buffers are non-persistent: not saved
        self._rope_kwargs = rope_kwargs(rope_cls, layer_config)

    def _build_mlps(self) -> nn.ModuleList:
        return nn.ModuleList()

    def _build_lm_heads(self) -> None:
        return None  # one LM head for every depth (``self.lm_head``), or the base one

    @staticmethod
    def _prefix_layer_config(base_config: Any) -> dict[str, Any]:
        return prefix_layer_config(base_config)

    @staticmethod
    def _default_feature_layers(base_config: Any, arch: str) -> list[int] | None:
        return eagle3_feature_layers(base_config.num_hidden_layers) if arch == "eagle3" else None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers) if self.config.feature_layers else (-1,)

    def _new_prefix_cache(self) -> Any:
        return EagleCache()

    # ------------------------------------------------------------------ the drafter's maths
    def _rope(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        """cos / sin [Q, d] of ``positions`` [Q], or [B, 1, Q, d] (broadcast over heads) of [B, Q]."""
        if positions.dim() == 1:
            cos, sin = self.rotary_emb(like, positions[None], **self._rope_kwargs)
            return cos[0].to(like.dtype), sin[0].to(like.dtype)
        cos, sin = self.rotary_emb(like, positions, **self._rope_kwargs)
        return cos[:, None].to(like.dtype), sin[:, None].to(like.dtype)

    def committed_feature(self, hidden: Tensor) -> Tensor:
        """The drafter's input feature of committed positions: the base state, (EAGLE-3) ``fc`` of the
        fused states, or (eagle fusing further states) the last state plus ``fuse`` of the others."""
        if self.fused:
            return self.fc(hidden)
        if self.fuse is None:
            return hidden
        h = self.config.hidden_size
        parts = hidden[..., :-h].split(h, dim=-1)
        return hidden[..., -h:] + self.fuse(torch.cat([norm(x) for norm, x in zip(self.fuse_norms, parts)], dim=-1))

    def _layer_input(self, feat: Tensor, emb: Tensor) -> Tensor:
        return feat if self.fused else self.fc(torch.cat([emb, feat], dim=-1))

    def run(
        self, feat: Tensor, emb: Tensor, positions: Tensor, past: tuple[list[Tensor], list[Tensor]], mask: Tensor
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Outputs [B, Q, H] of pairs (``feat``, ``emb``) [B, Q, H] at ``positions`` [B, Q] over the keys in
        ``past`` (per layer, [B, kv_heads, K, d]; empty lists: none) and their own, under ``mask``
        [B, Q, K + Q]; with the keys and values extended by theirs."""
        cos, sin = self._rope(positions, feat)
        x = self._layer_input(feat, emb)
        all_keys, all_values = [], []
        for i, layer in enumerate(self.layers):
            a_in = layer.attention_input(x, emb)
            k, v = layer.self_attn.project_kv(a_in, cos, sin)
            keys = torch.cat([past[0][i], k], dim=-2) if past[0] else k
            values = torch.cat([past[1][i], v], dim=-2) if past[1] else v
            x = layer.finish(x, layer.self_attn(a_in, cos, sin, keys, values, mask))
            all_keys.append(keys)
            all_values.append(values)
        return x, all_keys, all_values

    def logits(self, out: Tensor, lm_weight: Tensor | None, lm_bias: Tensor | None, kernel: str = "linear") -> Tensor:
        """Scores over the drafting vocabulary of outputs ``out`` [..., H]; ``kernel``: how the base
        LM rows multiply (:func:`~entmtp_hf.cpu_kernels.project`)."""
        x = self.norm(out) if self.norm is not None else out
        if self.lm_head is not None:
            return self.lm_head(x)
        if lm_weight is None:
            raise ValueError("this drafter uses the base LM head: pass it (new_state(model) / lm_head=...)")
        if kernel == "linear":
            return F.linear(x, lm_weight, lm_bias)
        return project(x.reshape(-1, x.shape[-1]), lm_weight, lm_bias, kernel).reshape(*x.shape[:-1], -1)

    # ------------------------------------------------------------------ drafting
    def _commit_rows(self, states: list[DraftState], roots: list[Tensor]) -> list[EagleCache]:
        """Run every row's queued pairs, the last completed by its root, into its committed cache, in
        one drafter call: each row's new pairs sit right-aligned after its cache, left-padded to the
        longest (the padding is masked out and dropped). Rows with nothing queued are left as they are."""
        caches = [s.prefix_cache for s in states]
        todo = [(c, q) for c, q in ((c, self._take_queue(c, r)) for c, r in zip(caches, roots)) if q is not None]
        if not todo:
            return caches
        some, rows = todo[0][1][0], len(todo)
        device, dtype = some.device, some.dtype
        counts = torch.tensor([q[0].shape[0] for _, q in todo], device=device)
        lengths = torch.tensor([c.length for c, _ in todo], device=device)
        width, longest = int(counts.max()), int(lengths.max())
        feat = torch.stack([F.pad(q[0], (0, 0, width - q[0].shape[0], 0)) for _, q in todo])  # [rows, width, F]
        tokens = torch.stack([F.pad(q[1], (width - q[1].shape[0], 0)) for _, q in todo])
        lead = (width - counts)[:, None]  # padding before a row's new pairs
        new = torch.arange(width, device=device)
        positions = (lengths[:, None] + new[None] - lead).clamp(min=0)
        own = torch.arange(longest, device=device)[None] >= (longest - lengths)[:, None]  # [rows, longest]
        causal = (new[None, None] <= new[None, :, None]) & (new[None, None] >= lead[:, :, None])  # [rows, width, width]
        allowed = torch.cat([own[:, None].expand(-1, width, -1), causal], dim=-1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        past = (left_padded([c.keys for c, _ in todo], longest), left_padded([c.values for c, _ in todo], longest))
        emb = states[0].embed(tokens).to(dtype)
        out, keys, values = self.run(self.committed_feature(feat), emb, positions, past, mask)
        for b, (cache, _) in enumerate(todo):
            if rows == 1:  # no padding: the run's keys and values are the cache
                cache.keys, cache.values = [k[0] for k in keys], [v[0] for v in values]
            else:
                first = longest + int(lead[b])
                cache.keys = appended(cache.keys, [k[b, :, first:] for k in keys])
                cache.values = appended(cache.values, [v[b, :, first:] for v in values])
            cache.last_out = out[b, -1]
        return caches

    @torch.no_grad()
    def propose(
        self,
        state: DraftState,
        root_token: Tensor,
        buffers: TreeBuffers,
        until: StopFn | None = None,
        temperature: float = 1.0,
    ) -> Proposal:
        """Draft the tree depth by depth, one drafter call per depth over its expanded nodes
        (``until``, ``temperature``: see the base class)."""
        return self._draft([state], [root_token], buffers, temperature, until)[0]

    @torch.no_grad()
    def propose_rows(
        self, states: list[DraftState], roots: list[Tensor], buffers: TreeBuffers, temperature: float = 1.0
    ) -> list[Proposal]:
        """:meth:`propose` for several rows, one drafter call per depth over every row's nodes."""
        return self._draft(states, roots, buffers, temperature)

    def _draft(
        self,
        states: list[DraftState],
        roots: list[Tensor],
        buffers: TreeBuffers,
        temperature: float,
        until: StopFn | None = None,
    ) -> list[Proposal]:
        """Each row commits its own queued pairs (their number differs per row), then every depth
        runs one drafter call over all rows' expanded nodes, on the rows' committed caches
        left-padded to the longest (padding masked out). ``until`` reads the first row's entropies.

        ``outs[b, n]`` is row b's drafter output at node n's pair (node 0: the last committed pair);
        a node's children come from its output's scores, and the pair of an expanded node at depth
        d is (its parent's output, its token) at position root + d.
        """
        starts = [self._start(s, r, buffers) for s, r in zip(states, roots)]
        tokens, probs, entropy = (torch.stack(t) for t in zip(*starts))  # [B, N] each
        caches = self._commit_rows(states, [t[:1] for t in tokens])
        first, rows, device, n = states[0], len(states), tokens.device, buffers.num_nodes
        lengths = torch.tensor([c.length for c in caches], device=device)
        longest, padded = max(c.length for c in caches), len({c.length for c in caches}) > 1
        # run() extends copies: the committed caches stay as they are
        keys, values = left_padded([c.keys for c in caches], longest), left_padded([c.values for c in caches], longest)
        last = torch.stack([c.last_out for c in caches])
        dtype = last.dtype
        padding = torch.arange(longest, device=device)[None] < (longest - lengths)[:, None]  # [B, longest]
        outs = last.new_empty(rows, n, last.shape[-1])
        outs[:, 0] = last
        row_of = torch.full((n,), -1, dtype=torch.long, device=device)  # a drafted pair's row in the scratch keys
        drafted = 0
        for i, step in enumerate(buffers.depth_plan):
            if i > 0:  # step.parents sit at depth i: run their pairs
                parents = step.parents
                row_of[parents] = torch.arange(drafted, drafted + parents.shape[0], device=device)
                mask = self._tree_mask(buffers, parents, row_of, longest, drafted, dtype).expand(rows, -1, -1)
                if padded:
                    mask = mask.clone()
                    mask[:, :, :longest].masked_fill_(padding[:, None], torch.finfo(dtype).min)
                positions = (lengths - 1 + i)[:, None].expand(-1, parents.shape[0])
                emb = first.embed(tokens[:, parents]).to(dtype)
                outs[:, parents], keys, values = self.run(
                    outs[:, buffers.parents[parents]], emb, positions, (keys, values), mask
                )
                drafted += parents.shape[0]
            logits = self.logits(outs[:, step.parents], first.lm_weight, first.lm_bias, first.kernel)
            tok, p, h = self._children(logits, step.child_parent_row, step, temperature)
            tokens[:, step.children], probs[:, step.children], entropy[:, step.children] = tok, p, h
            if until is not None and until(i + 1, entropy[0]):
                return [Proposal(tokens=tokens[0], probs=probs[0], entropy=entropy[0], depth=i + 1)]
        return [Proposal(tokens=tokens[b], probs=probs[b], entropy=entropy[b]) for b in range(rows)]

    @staticmethod
    def _tree_mask(
        buffers: TreeBuffers, parents: Tensor, row_of: Tensor, committed: int, drafted: int, dtype: torch.dtype
    ) -> Tensor:
        """[P, committed + drafted + P] additive: every committed key, and the drafted pairs of each
        query's own path (its ancestors below the root and itself)."""
        q = parents.shape[0]
        mask = torch.full((q, committed + drafted + q), torch.finfo(dtype).min, dtype=dtype, device=parents.device)
        mask[:, :committed] = 0
        path = buffers.ancestors[parents]  # [P, D+1] root -> node, -1 padded
        rows = torch.where(path > 0, row_of[path.clamp(min=0)], -1)
        hit = rows >= 0
        mask[torch.nonzero(hit)[:, 0], committed + rows[hit]] = 0
        return mask

    # ------------------------------------------------------------------ training
    def forward_train(
        self, hidden: Tensor, input_ids: Tensor, embed: nn.Module | None, lm_head: nn.Module | None = None
    ) -> list[Tensor]:
        """Teacher-forced logits with the drafting unrolled ``num_heads`` steps ("training-time test").

        Element s is [B, T-s-1, V']: row j is depth s+1 drafted after root pair j, i.e. it predicts
        token j+s+2. Step 0 runs the pairs (f_j, x_{j+1}) causally; step s >= 1 runs (its own step
        s-1 output at j, x_{j+s+1}) attending to step 0's keys up to j and to steps 1..s at j
        exactly as a drafted path attends at decode time. Right padding only.
        """
        if embed is None:
            raise ValueError(
                "EAGLE drafters need the base model's input embeddings (embed=model.get_input_embeddings())"
            )
        seq, dtype = hidden.shape[1], self._dtype
        lm_weight, lm_bias = self._train_lm(lm_head)
        emb = embed(input_ids).to(dtype)
        feat = self.committed_feature(hidden.to(dtype))[:, : seq - 1]
        past_k: list[list[Tensor]] = [[] for _ in self.layers]  # per layer: step 0's keys, then each step's
        past_v: list[list[Tensor]] = [[] for _ in self.layers]
        out_list = []
        for s in range(min(self.num_heads, seq - 1)):
            n = seq - s - 1
            positions = torch.arange(s, s + n, device=hidden.device)
            cos, sin = self._rope(positions, feat)
            x = self._layer_input(feat[:, :n], emb[:, s + 1 : s + 1 + n])
            for i, layer in enumerate(self.layers):
                a_in = layer.attention_input(x, emb[:, s + 1 : s + 1 + n])
                att = layer.self_attn
                k, v = att.project_kv(a_in, cos, sin)
                past_k[i].append(k)
                past_v[i].append(v)
                attn = unrolled_attention(
                    att.queries(a_in, cos, sin), past_k[i], past_v[i], att.num_heads // att.num_kv_heads
                )
                x = layer.finish(x, att.merge(attn))
            out_list.append(self.logits(x, lm_weight, lm_bias))
            feat = x
        return out_list


def appended(cache: list[Tensor], new: list[Tensor]) -> list[Tensor]:
    """Per layer, ``cache`` [kv_heads, L, d] extended by ``new`` [kv_heads, n, d] (slices of a padded
    batch: a first commit copies them, so the cache keeps no view of the batch alive)."""
    if not cache:
        return [t.contiguous() for t in new]
    return [torch.cat([old, t], dim=-2) for old, t in zip(cache, new)]


def left_padded(per_row: list[list[Tensor]], longest: int) -> list[Tensor]:
    """Per layer, the rows' caches ([kv_heads, L_b, d] each; an empty list: none yet) as one
    [rows, kv_heads, longest, d], each row right-aligned after zeros; no layers when ``longest`` is 0."""
    if longest == 0:
        return []
    if len(per_row) == 1:
        return [t[None] for t in per_row[0]]
    like = next(layers for layers in per_row if layers)
    out = []
    for i, ref in enumerate(like):
        stacked = ref.new_zeros(len(per_row), ref.shape[0], longest, ref.shape[-1])
        for b, layers in enumerate(per_row):
            if layers:
                stacked[b, :, longest - layers[i].shape[1] :] = layers[i]
        out.append(stacked)
    return out


def unrolled_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], groups: int) -> Tensor:
    """Attention of unroll step s = len(keys) - 1: query j [B, h, n, d] sees step 0's keys 0..j
    (causal) and the keys of steps 1..s at j (their own path); keys[r] has >= n rows."""
    n, scale = q.shape[2], q.shape[-1] ** -0.5
    k0 = keys[0][:, :, :n].repeat_interleave(groups, 1)
    v0 = values[0][:, :, :n].repeat_interleave(groups, 1)
    scores = [torch.matmul(q, k0.transpose(-1, -2)) * scale]  # [B, h, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, torch.finfo(scores[0].dtype).min)
    diag_v = []
    for k, v in zip(keys[1:], values[1:]):
        k, v = k[:, :, :n].repeat_interleave(groups, 1), v[:, :, :n].repeat_interleave(groups, 1)
        scores.append(((q * k).sum(-1) * scale)[..., None])  # [B, h, n, 1]
        diag_v.append(v)
    scores = torch.cat(scores, dim=-1)
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    out = torch.matmul(weights[..., :n], v0)
    for r, v in enumerate(diag_v):
        out = out + weights[..., n + r : n + r + 1] * v
    return out


register_family(
    "eagle", EagleHeads, config_class=HeadsConfig, archs=("eagle", "eagle3"), layer_archs=("eagle", "eagle3")
)
