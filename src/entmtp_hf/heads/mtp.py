"""A model's own multi-token-prediction (MTP) layers as the drafter.

DeepSeek-V3/R1, GLM-4.5 (``glm4_moe``), ERNIE 4.5 MoE, Mellum, Step and other families ship MTP
layers in their checkpoints (``num_mtp_layers`` / ``num_nextn_predict_layers`` in the config).
transformers builds them as :class:`~transformers.modeling_layers.MtpModel` (``MtpLayer`` = the
model's own decoder-layer class, plus ``enorm``/``hnorm``, the projection ``eh_proj`` and a
post-norm; embedding, LM head and rotary embedding shared with the model) and drafts a chain with
them, one token per layer, in ``generate(..., use_mtp=True)``. :meth:`MtpHeads.from_model` loads
the very same layers by the very same path (``MtpModel.from_pretrained(model)``) and drafts trees.

How layer k (1-based) reads the text, as in transformers: its entry at position p pairs the token
x_p with the state before it, ``eh_proj(cat[enorm(E(x_p)), hnorm(s_{p-1})])``, where s is the base
model's last hidden state (``hidden_states[-1]`` of a forward asking for it: after the final norm,
what ``MTPCandidateGenerator`` passes as ``last_hidden_states``) for layer 1 and layer k-1's output
for layer k > 1; its output at p scores x_{p+1}. Every layer keeps its own key/value cache of the
committed text up to the root's position, filled when ``propose`` brings the root (which completes
the last pair), one call per layer; each layer's last output waits for the next accepted text.

How a tree is drafted. Depth d is scored by layer d, and by the last layer again for every depth
beyond the model's count (vLLM's ``mtp`` method cycles its layers instead; with the single MTP
layer most models carry both agree). A node's entry in layer k pairs its token with its parent's
output of the previous depth's layer (the root's: the committed output at the root's position).
The first time depth d uses layer d it runs over the expanded nodes of depths 1..d-1 on the
queried paths (the entries transformers' chain holds in layer d's window); a reused layer runs
only the new depth. Each entry attends to its layer's committed cache and to the entries of its
own ancestors in that layer (a tree mask, sliding windows applied by position); drafted keys and
values live only inside ``propose``: the committed caches only ever hold accepted text. A chain as
long as the model's MTP layers therefore drafts exactly the tokens ``use_mtp=True`` drafts.

Cost: every depth projects through the model's LM head (the shared head), over the full vocabulary
as transformers does. ``from_model(model, draft_vocab=ids)`` restricts drafting to a subset of its
rows (a frequent-token subset, as the other families' ``draft_vocab``): a smaller product per depth,
the drafts stay proposals (the output is unchanged), but they are no longer ``use_mtp=True``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cpu_kernels import project
from ..trees.tree import TreeBuffers
from .base import DraftHeads, DraftState, HeadsMismatchError, Proposal, StopFn, check_draft_vocab, text_config
from .config import HeadsConfig
from .eagle import PairQueue, appended, left_padded
from .registry import register_family

#: the deepest tree :meth:`MtpHeads.from_model` allows by default (at least the model's MTP layers)
DEFAULT_DEPTH = 5
#: the attention types a tree mask expresses in an MTP layer
_MASKABLE = ("full_attention", "sliding_attention")


class _Past:
    """What an MTP layer's attention takes as its cache for one call: the keys and values ``past`` it
    may attend to (``[B, *, K, d]`` each, or None), to which it appends its own (read back as ``new``).

    Attention layers call ``cache.update(key_states, value_states, layer_idx)`` and attend to what it
    returns; whatever they cache (DeepSeek's MLA: its compressed latents) is concatenated along the
    sequence axis, so one object serves every family."""

    def __init__(self, keys: Tensor | None, values: Tensor | None) -> None:
        self.keys, self.values = keys, values
        self.new: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.new = (key_states, value_states)
        if self.keys is None:
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@dataclass
class MtpCache:
    """One call's MTP state: per layer its committed keys and values (``[*, C, d]``, one entry per committed
    position up to the root's) and its output at the root's position; the base states waiting for their
    next token; the root's position (counted from the call's first observed token); per tree, its plan."""

    keys: list[Tensor | None]
    values: list[Tensor | None]
    last_outs: list[Tensor | None]  # per layer [H]: output at the root's position (None: no entry yet)
    queued_feats: list[Tensor] = field(default_factory=list)
    queued_tokens: list[Tensor] = field(default_factory=list)
    waiting: Tensor | None = None  # the last observed state; its token is the next root
    root_pos: int = 0
    last_root: Tensor | None = None
    plans: dict[int, tuple[TreeBuffers, list[_Rows | None]]] = field(default_factory=dict)

    @property
    def last_out(self) -> Tensor | None:
        """The first layer's output at the root's position (what :class:`~.eagle.PairQueue` checks)."""
        return self.last_outs[0]

    def length(self, layer: int) -> int:
        """Committed entries of ``layer``."""
        keys = self.keys[layer]
        return 0 if keys is None else keys.shape[-2]


@dataclass(frozen=True)
class _Rows:
    """The entries one drafting depth runs through ``layer`` (fixed by the tree and the layer count)."""

    layer: int  # the layer this depth runs
    prev: int  # the layer whose outputs its entries read (the previous depth's)
    nodes: Tensor  # [Q] the nodes whose entries run, in node order
    parents: Tensor  # [Q] their parents
    depth: Tensor  # [Q] their depths
    see: Tensor  # [Q, S] bool: query q sees scratch entry s (its own path: ancestors and itself)
    gap: Tensor  # [Q, S] depth(q) - depth(s), for sliding windows
    start: int  # scratch entries this layer holds before this depth (S - Q)


class MtpHeads(PairQueue, DraftHeads):
    """The MTP layers of a model as draft heads: ``num_layers`` layers drafting trees up to ``num_heads``
    deep (see the module docstring). Build with :meth:`from_model` (or ``enable_entmtp(model, "mtp")``);
    the weights are the model's own and are not saved apart from it."""

    def __init__(
        self,
        config: HeadsConfig,
        layers: nn.ModuleList | None = None,
        mtp_config: Any = None,
        shared_post_norm: nn.Module | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        if layers is None or mtp_config is None or rotary is None:
            raise ValueError(
                "MTP heads are a model's own layers: build them with MtpHeads.from_model(model) or "
                "enable_entmtp(model, 'mtp'), not from a heads config"
            )
        if len(layers) != config.num_layers:
            raise ValueError(f"the config says {config.num_layers} MTP layers, {len(layers)} were given")
        super().__init__(config)
        self.layers = layers
        self.shared_post_norm = shared_post_norm
        self.mtp_config = mtp_config
        # the model's rotary embedding, as MtpModel ties it (not a submodule: neither saved nor moved here)
        object.__setattr__(self, "_rotary", rotary)
        types = getattr(mtp_config, "layer_types", None) or ["full_attention"] * config.num_layers
        window = getattr(mtp_config, "sliding_window", None)
        #: per layer, its sliding window (None: it sees the whole text)
        self.windows = [window if t == "sliding_attention" else None for t in types]
        per_layer_rope = len(mtp_config.nested_rope_parameter_keys(mtp_config.rope_parameters)) > 0
        self._rope_kwargs = [{"layer_type": t} if per_layer_rope else {} for t in types]

    def _build_mlps(self) -> nn.ModuleList:
        return nn.ModuleList()

    def _build_lm_heads(self) -> None:
        return None  # the model's own LM head drafts every depth

    # ------------------------------------------------------------------ building
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        depth: int | None = None,
        *,
        draft_vocab: Tensor | list[int] | None = None,
        mtp_model: Any = None,
    ) -> MtpHeads:
        """The MTP layers of ``model``, as transformers loads them for ``generate(use_mtp=True)``:
        ``MtpModel.from_pretrained(model)``, from the checkpoint the model was loaded from (its
        ``config.name_or_path``). ``depth``: the deepest tree they draft (default: the larger of
        :data:`DEFAULT_DEPTH` and the layer count). ``draft_vocab``: the token ids drafting scores
        (default: the whole vocabulary). ``mtp_model``: an ``MtpModel`` of this model built already
        (its layers are used as they are, e.g. ones being trained).

        Refused with :class:`HeadsMismatchError` before anything is loaded: a config without
        ``num_mtp_layers``; and after: a checkpoint without the MTP tensors transformers looks for.
        """
        text = text_config(model.config)
        name = type(model).__name__
        count = getattr(text, "num_mtp_layers", None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise HeadsMismatchError(
                f"{name} has no MTP layers to draft with: its config sets no num_mtp_layers "
                f"(num_nextn_predict_layers), got {count!r}; give enable_entmtp trained heads instead (a folder "
                "or a Hub repo id)"
            )
        depth = max(DEFAULT_DEPTH, count) if depth is None else depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: the deepest tree the MTP layers draft, a positive integer; got {depth!r}")
        dv = check_draft_vocab(draft_vocab, text.vocab_size)
        if mtp_model is None:
            mtp_model = _load_mtp_model(model, name)
        layer_types = getattr(mtp_model.config, "layer_types", None) or []
        odd = sorted(set(layer_types) - set(_MASKABLE))
        if odd:
            raise HeadsMismatchError(
                f"{name}'s MTP layers include {', '.join(odd)} layers, which a tree mask cannot "
                "express; EntMTP drafts with full and sliding-window attention layers"
            )
        rotary = getattr(mtp_model, "rotary_emb", None)
        if rotary is None or hasattr(mtp_model.embed_tokens, "embed_norm"):
            raise HeadsMismatchError(
                f"{name}'s MTP layers use learned position biases or embeddings without their "
                "norm (a copy of the embedding layer); EntMTP does not draft with those yet"
            )
        config = HeadsConfig(
            family="mtp",
            head_arch="mtp",
            num_heads=depth,
            num_layers=count,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            use_base_lm_head=True,
            draft_vocab_size=0 if dv is None else int(dv.numel()),
            base_model_name_or_path=getattr(model, "name_or_path", None) or None,
        )
        heads = cls(config, mtp_model.layers, mtp_model.config, getattr(mtp_model, "shared_post_norm", None), rotary)
        if dv is not None:
            heads.draft_vocab.copy_(dv)
        heads.name_or_path = getattr(model, "name_or_path", None) or None
        param = next(mtp_model.layers.parameters(), None)
        return heads.to(param.device) if param is not None else heads

    @classmethod
    def for_model(cls, model: nn.Module, *args: Any, **kwargs: Any) -> MtpHeads:
        raise ValueError("MTP heads are a model's own layers: MtpHeads.from_model(model)")

    def _save_pretrained(self, save_directory: Any) -> None:
        raise ValueError(
            "MTP heads are the model's own layers and are saved with it, in its checkpoint; "
            "enable them on the loaded model with enable_entmtp(model, 'mtp')"
        )

    # ------------------------------------------------------------------ the layers' maths
    def _run(
        self,
        layer: int,
        states: Tensor,
        tokens: Tensor,
        positions: Tensor,
        embed: nn.Module,
        past: tuple[Tensor | None, Tensor | None],
        allowed: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Outputs [B, Q, H] of ``layer``'s entries (``states``, ``tokens``) [B, Q, *] at ``positions`` [B, Q],
        attending to ``past`` then themselves where ``allowed`` [B, Q, K + Q]; and their keys and values."""
        emb = embed(tokens).to(states.dtype)
        cos_sin = self._rotary(emb, positions, **self._rope_kwargs[layer])
        mask = torch.zeros(allowed.shape, dtype=states.dtype, device=states.device)
        mask.masked_fill_(~allowed, torch.finfo(states.dtype).min)
        cache = _Past(*past)
        out = self.layers[layer](
            emb, states, position_embeddings=cos_sin, attention_mask=mask[:, None], position_ids=positions, cache=cache
        )
        if self.shared_post_norm is not None:
            out = self.shared_post_norm(out)
        return out, *cache.new

    def logits(self, out: Tensor, lm_weight: Tensor | None, lm_bias: Tensor | None, kernel: str = "linear") -> Tensor:
        """Scores over the drafting vocabulary of MTP outputs [..., H], as ``MtpModel._project_to_logits``."""
        if lm_weight is None:
            raise ValueError("MTP heads draft through the model's LM head: pass it (new_state(model) / lm_head=...)")
        multiplier = getattr(self.mtp_config, "logits_mup_width_multiplier", None)
        x = out / multiplier if multiplier is not None else out
        if kernel == "linear":
            logits = F.linear(x, lm_weight, lm_bias)
        else:
            logits = project(x.reshape(-1, x.shape[-1]), lm_weight, lm_bias, kernel).reshape(*x.shape[:-1], -1)
        unpadded = getattr(self.mtp_config, "unpadded_vocab_size", None)
        if self.draft_vocab is None and unpadded is not None and unpadded < logits.shape[-1]:
            logits = logits[..., :unpadded]
        return logits

    def _window(self, layer: int, gap: Tensor) -> Tensor:
        """Where a key ``gap`` positions behind its query is inside ``layer``'s window."""
        window = self.windows[layer]
        return torch.ones_like(gap, dtype=torch.bool) if window is None else gap < window

    # ------------------------------------------------------------------ committing
    def _new_prefix_cache(self) -> MtpCache:
        n = self.config.num_layers
        return MtpCache(keys=[None] * n, values=[None] * n, last_outs=[None] * n)

    def _commit_rows(self, states: list[DraftState], roots: list[Tensor]) -> list[MtpCache]:
        """Run every row's newly committed positions, up to its root, through every layer, one call per
        layer for all rows: layer 1 takes the queued base states, layer k > 1 layer k-1's outputs one
        position behind (its last output from the previous commit, then this commit's but the last).
        Each row's entries sit right-aligned after its cache, left-padded to the longest (masked out)."""
        caches = [s.prefix_cache for s in states]
        todo = [(c, q) for c, q in ((c, self._take_queue(c, r)) for c, r in zip(caches, roots)) if q is not None]
        if not todo:
            return caches
        embed = states[0].embed
        # per row: the entries' input states, their tokens and positions (the text up to the root)
        inputs = []
        for cache, (feats, tokens) in todo:
            n = feats.shape[0]
            positions = torch.arange(cache.root_pos + 1, cache.root_pos + n + 1, device=feats.device)
            inputs.append((feats, tokens, positions))
            cache.root_pos += n
        for layer in range(self.config.num_layers):
            rows = [(b, x) for b, x in enumerate(inputs) if x[0].shape[0] > 0]
            if not rows:
                break
            outs = self._commit_layer(layer, [todo[b][0] for b, _ in rows], [x for _, x in rows], embed)
            for (b, (feats, tokens, positions)), out in zip(rows, outs):
                cache = todo[b][0]
                before = cache.last_outs[layer]  # the output one position behind this commit's first
                nxt = out[:-1] if before is None else torch.cat([before[None], out[:-1]])
                keep = tokens.shape[0] - nxt.shape[0]  # the positions the next layer's entries sit at
                inputs[b] = (nxt, tokens[keep:], positions[keep:])
                cache.last_outs[layer] = out[-1]
        return caches

    def _commit_layer(
        self, layer: int, caches: list[MtpCache], inputs: list[tuple[Tensor, Tensor, Tensor]], embed: nn.Module
    ) -> list[Tensor]:
        """Append the rows' new entries to ``layer``'s committed caches; their outputs, one [n_b, H] per row."""
        device = inputs[0][0].device
        counts = torch.tensor([x[0].shape[0] for x in inputs], device=device)
        lengths = torch.tensor([c.length(layer) for c in caches], device=device)
        width, longest = int(counts.max()), int(lengths.max())
        states = torch.stack([F.pad(x[0], (0, 0, width - x[0].shape[0], 0)) for x in inputs])
        tokens = torch.stack([F.pad(x[1], (width - x[1].shape[0], 0)) for x in inputs])
        positions = torch.stack([F.pad(x[2], (width - x[2].shape[0], 0)) for x in inputs])
        lead = (width - counts)[:, None]  # padding before a row's new entries
        new = torch.arange(width, device=device)
        # key positions: the committed entries end one position before the first new one
        old = torch.arange(longest, device=device)[None] - longest + positions[:, -1:] - counts[:, None] + 1
        own = old >= positions[:, -1:] - counts[:, None] - lengths[:, None] + 1  # [rows, longest]: not padding
        causal = (new[None, None] <= new[None, :, None]) & (new[None, None] >= lead[:, :, None])
        allowed = torch.cat([own[:, None].expand(-1, width, -1), causal], dim=-1)
        gap = positions[:, :, None] - torch.cat([old, positions], dim=-1)[:, None]
        allowed &= self._window(layer, gap)
        past_k = left_padded([[c.keys[layer]] if c.keys[layer] is not None else [] for c in caches], longest)
        past_v = left_padded([[c.values[layer]] if c.values[layer] is not None else [] for c in caches], longest)
        past = (past_k[0], past_v[0]) if past_k else (None, None)
        out, keys, values = self._run(layer, states, tokens, positions, embed, past, allowed)
        outs = []
        for b, cache in enumerate(caches):
            first = int(lead[b])
            for store, new in ((cache.keys, keys[b, :, first:]), (cache.values, values[b, :, first:])):
                store[layer] = new.contiguous() if store[layer] is None else appended([store[layer]], [new])[0]
            outs.append(out[b, first:])
        return outs

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(
        self,
        state: DraftState,
        root_token: Tensor,
        buffers: TreeBuffers,
        until: StopFn | None = None,
        temperature: float = 1.0,
    ) -> Proposal:
        """Draft the tree depth by depth, one layer call per depth (``until``, ``temperature``: see the base class)."""
        return self._draft([state], [root_token], buffers, temperature, until)[0]

    @torch.no_grad()
    def propose_rows(
        self, states: list[DraftState], roots: list[Tensor], buffers: TreeBuffers, temperature: float = 1.0
    ) -> list[Proposal]:
        """:meth:`propose` for several rows, one layer call per depth over every row's entries."""
        return self._draft(states, roots, buffers, temperature)

    def _plan(self, cache: MtpCache, buffers: TreeBuffers) -> list[_Rows | None]:
        """Which entries each depth runs through which layer (None for depth 1, scored by the root's
        committed output), derived once per tree and call."""
        known = cache.plans.get(id(buffers))
        if known is not None and known[0] is buffers:
            return known[1]
        device, last = buffers.parents.device, self.config.num_layers - 1
        lineage = buffers.ancestors.tolist()
        visible = buffers.attn_mask == 0  # [N, N]: a node and its ancestors
        scratch: list[list[int]] = [[] for _ in range(self.config.num_layers)]  # per layer: nodes with an entry
        plan: list[_Rows | None] = [None]
        for i, step in enumerate(buffers.depth_plan[1:], start=1):
            layer, prev = min(i, last), min(i - 1, last)
            have = set(scratch[layer])
            nodes = sorted({a for q in step.parents.tolist() for a in lineage[q] if a > 0} - have)
            start = len(scratch[layer])
            scratch[layer] = scratch[layer] + nodes
            keys = torch.tensor(scratch[layer], dtype=torch.long, device=device)
            idx = torch.tensor(nodes, dtype=torch.long, device=device)
            depth = buffers.position_ids[idx]
            plan.append(
                _Rows(
                    layer=layer,
                    prev=prev,
                    nodes=idx,
                    parents=buffers.parents[idx],
                    depth=depth,
                    see=visible[idx][:, keys],
                    gap=depth[:, None] - buffers.position_ids[keys][None],
                    start=start,
                )
            )
        cache.plans[id(buffers)] = (buffers, plan)
        return plan

    def _draft(
        self,
        states: list[DraftState],
        roots: list[Tensor],
        buffers: TreeBuffers,
        temperature: float,
        until: StopFn | None = None,
    ) -> list[Proposal]:
        """Each row commits its text up to its root; then every depth runs one layer call over all rows'
        entries of that depth (see :class:`_Rows`), on the rows' committed caches left-padded to the
        longest (padding masked out). ``until`` reads the first row's entropies.

        ``outs[b, n]`` is row b's latest output at node n's entry (node 0: the committed output at the
        root's position of the layer the previous depth ran); ``valid[b, n]`` says it exists (a layer k
        has entries from position k on: shorter texts leave the first ones out, as transformers does).
        """
        starts = [self._start(s, r, buffers) for s, r in zip(states, roots)]
        tokens, probs, entropy = (torch.stack(t) for t in zip(*starts))  # [B, N] each
        caches = self._commit_rows(states, [t[:1] for t in tokens])
        first, rows, device, n = states[0], len(states), tokens.device, buffers.num_nodes
        plan = self._plan(caches[0], buffers)
        root_pos = torch.tensor([c.root_pos for c in caches], device=device)
        like = caches[0].last_outs[0]
        outs = like.new_zeros(rows, n, like.shape[-1])
        valid = torch.zeros(rows, n, dtype=torch.bool, device=device)
        # per layer: the committed keys and values left-padded ([B, *, C, d]) then this call's entries
        past: dict[int, tuple[Tensor | None, Tensor | None]] = {}
        committed: dict[int, tuple[Tensor, Tensor]] = {}  # per layer: key positions [B, C], not padding [B, C]
        entry_ok: dict[int, Tensor] = {}  # per layer: [B, S] this call's entries that exist
        for i, step in enumerate(buffers.depth_plan):
            rows_i = plan[i]
            layer = 0 if rows_i is None else rows_i.prev
            outs[:, 0], valid[:, 0] = self._root_outs(caches, layer, like)
            if rows_i is not None:
                layer = rows_i.layer
                if layer not in past:
                    past[layer], committed[layer] = self._committed(caches, layer, root_pos)
                    entry_ok[layer] = valid.new_zeros(rows, 0)
                q = rows_i.nodes.shape[0]
                ok = valid[:, rows_i.parents]
                entry_ok[layer] = torch.cat([entry_ok[layer], ok], dim=1)
                positions = root_pos[:, None] + rows_i.depth[None]
                key_pos, own = committed[layer]
                gap = positions[:, :, None] - key_pos[:, None]
                old = own[:, None] & self._window(layer, gap)  # [B, Q, C]
                tree = (rows_i.see[None] & entry_ok[layer][:, None]) & self._window(layer, rows_i.gap)[None]
                tree[:, torch.arange(q, device=device), rows_i.start + torch.arange(q, device=device)] = True
                allowed = torch.cat([old, tree], dim=-1)
                out, keys, values = self._run(
                    layer,
                    outs[:, rows_i.parents],
                    tokens[:, rows_i.nodes],
                    positions,
                    first.embed,
                    past[layer],
                    allowed,
                )
                pk, pv = past[layer]
                past[layer] = (
                    keys if pk is None else torch.cat([pk, keys], dim=-2),
                    values if pv is None else torch.cat([pv, values], dim=-2),
                )
                outs[:, rows_i.nodes], valid[:, rows_i.nodes] = out, ok
            logits = self.logits(outs[:, step.parents], first.lm_weight, first.lm_bias, first.kernel)
            tok, p, h = self._children(logits, step.child_parent_row, step, temperature)
            tokens[:, step.children], probs[:, step.children], entropy[:, step.children] = tok, p, h
            if until is not None and until(i + 1, entropy[0]):
                return [Proposal(tokens=tokens[0], probs=probs[0], entropy=entropy[0], depth=i + 1)]
        return [Proposal(tokens=tokens[b], probs=probs[b], entropy=entropy[b]) for b in range(rows)]

    @staticmethod
    def _root_outs(caches: list[MtpCache], layer: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Every row's committed output of ``layer`` at its root's position (zeros where it has none yet),
        and whether it has one."""
        outs = [c.last_outs[layer] for c in caches]
        have = torch.tensor([o is not None for o in outs], device=like.device)
        return torch.stack([o if o is not None else torch.zeros_like(like) for o in outs]), have

    @staticmethod
    def _committed(
        caches: list[MtpCache], layer: int, root_pos: Tensor
    ) -> tuple[tuple[Tensor | None, Tensor | None], tuple[Tensor, Tensor]]:
        """``layer``'s committed keys and values of every row, left-padded to the longest; the
        positions of those entries (ending at the row's root) and which are not padding."""
        lengths = torch.tensor([c.length(layer) for c in caches], device=root_pos.device)
        longest = int(lengths.max())
        slots = torch.arange(longest, device=root_pos.device)[None]
        positions = root_pos[:, None] - longest + 1 + slots
        own = slots >= longest - lengths[:, None]
        if longest == 0:
            return (None, None), (positions, own)
        keys = left_padded([[c.keys[layer]] if c.keys[layer] is not None else [] for c in caches], longest)[0]
        values = left_padded([[c.values[layer]] if c.values[layer] is not None else [] for c in caches], longest)[0]
        return (keys, values), (positions, own)

    # ------------------------------------------------------------------ training
    def forward_train(
        self, hidden: Tensor, input_ids: Tensor, embed: nn.Module | None, lm_head: nn.Module | None = None
    ) -> list[Tensor]:
        """Teacher-forced logits of every drafted depth (``num_heads``) as the tree drafts them: element k is
        [B, T-k-1, V'] and row j predicts token j+k+2. Layer k+1 (k below the layer count) runs causally
        over the entries (its input state at j, x_{j+k+1}) at positions j+k+1, its input state being the base
        state h_j (layer 1) or layer k's output at j, as transformers' ``MtpModel`` runs them over a text.
        Deeper elements reuse the last layer unrolled: the entry (element k-1's output at j, x_{j+k+1})
        attends to the last layer's own entries up to row j (the text and the tree's triangle) and to row
        j's entries of the depths unrolled before it, as a drafted path does. Right padding only."""
        if embed is None:
            raise ValueError("MTP layers need the base model's input embeddings (embed=model.get_input_embeddings())")
        lm_weight, lm_bias = self._train_lm(lm_head)
        batch, seq = input_ids.shape
        device, last = input_ids.device, self.config.num_layers - 1
        x, out = hidden.to(self._dtype), []
        own: tuple[Tensor, Tensor] | None = None  # the last layer's keys and values over the text
        unrolled: list[tuple[Tensor, Tensor]] = []  # per unrolled depth, its keys and values
        for k in range(self.num_heads):
            n = seq - k - 1
            if n <= 0:
                break
            layer = min(k, last)
            positions = torch.arange(k + 1, k + 1 + n, device=device)[None].expand(batch, -1)
            rows = torch.arange(n, device=device)
            if k <= last:
                gap = rows[:, None] - rows[None]
                allowed, past = (gap >= 0) & self._window(layer, gap), (None, None)
            else:  # row j sees the last layer's rows i <= j (positions i + last + 1) and its unrolled entries
                text = torch.arange(own[0].shape[-2], device=device)
                gap = rows[:, None] + k - last - text[None]
                eye = torch.eye(n, dtype=torch.bool, device=device)
                seen = [(gap >= k - last) & self._window(layer, gap)]
                seen += [eye & self._window(layer, torch.full_like(gap[:, :n], k - d)) for d in range(last + 1, k)]
                allowed = torch.cat([*seen, eye], dim=-1)
                past = tuple(torch.cat([own[i], *(u[i][..., :n, :] for u in unrolled)], dim=-2) for i in (0, 1))
            allowed = allowed[None].expand(batch, -1, -1)
            x, keys, values = self._run(
                layer, x[:, :n], input_ids[:, k + 1 : k + 1 + n], positions, embed, past, allowed
            )
            if k == last:
                own = (keys, values)
            elif k > last:
                unrolled.append((keys, values))
            out.append(self.logits(x, lm_weight, lm_bias))
        return out


def _load_mtp_model(model: nn.Module, name: str) -> Any:
    """``MtpModel.from_pretrained(model)`` as ``generate(use_mtp=True)`` loads it (on the device of the
    model's last layer), its failures turned into a refusal that says what is missing."""
    from transformers.modeling_layers import MtpModel

    source = getattr(model.config, "name_or_path", None)  # where MtpModel.from_pretrained reads the files
    if not source:
        raise HeadsMismatchError(
            f"{name} was not loaded from a checkpoint (its config has no name_or_path): its MTP "
            "layers are read from the checkpoint's files; load the model with from_pretrained"
        )
    decoder = model.get_decoder()
    device = next(decoder.layers[-1].parameters()).device
    try:
        return MtpModel.from_pretrained(model, device_map={"": device})
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        declared = (getattr(model.config, "auto_map", None) or {}).get("AutoModelForCausalLM")
        hint = (
            f"; its folder declares its model class in code ({declared}), which says where the MTP tensors sit: "
            "load it with from_pretrained(..., trust_remote_code=True) (the tools: --trust-remote-code)"
            if declared and not str(declared).endswith("." + name)
            else ""
        )
        raise HeadsMismatchError(
            f"{name}'s checkpoint {source} holds no MTP layers transformers can load ({type(e).__name__}: "
            f"{e}){hint}".replace("\n", " ")
        ) from e


#: ``enable_entmtp(model, "mtp")`` builds the drafter from the model's own MTP layers
register_family("mtp", MtpHeads, config_class=HeadsConfig, archs=("mtp",), from_model=MtpHeads.from_model)
