"""Hydra heads: sequentially dependent ("grounded") draft heads.

Head i scores token t+i+2 from concat[c_t, E(x_{t+1}), ..., E(x_{t+i+1})], where c_t is
h_t (arch ``mlp``) or the prefix layer's output at t (arch ``prefix-mlp``), x_{t+1} is the
root token and x_{t+2..t+i+1} the drafted tokens on the node's path. Because a node's
children depend on its path, a tree is drafted depth by depth: one batched head call per
depth over that depth's expanded nodes.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from ..trees.tree import TreeBuffers
from .base import DraftHeads, DraftState, Proposal, ResBlock, StopFn, text_config
from .config import HeadsConfig
from .registry import register_family

#: config entries that describe the checkpoint, not the layer; dropped from prefix_layer_config
_NOISE_KEYS = (
    "architectures",
    "_name_or_path",
    "transformers_version",
    "id2label",
    "label2id",
    "auto_map",
    "quantization_config",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "problem_type",
    "chunk_size_feed_forward",
)


def prefix_layer_config(base_config: Any) -> dict[str, Any]:
    """JSON-ready one-layer copy of the base model's config, enough to rebuild the prefix layer."""
    data = {k: v for k, v in text_config(base_config).to_dict().items() if k not in _NOISE_KEYS}
    data["num_hidden_layers"] = 1
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:1]
    return data


def build_prefix_config(data: dict[str, Any]) -> Any:
    """Rebuild a transformers config object from :func:`prefix_layer_config`'s dict."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"prefix layer: unknown base model_type {model_type!r}")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as e:
        raise ValueError(f"prefix layer: invalid base config for {model_type!r} ({e})") from e
    if config._attn_implementation not in ("eager", "sdpa"):
        config._attn_implementation = "sdpa"
    return config


def _architecture_classes(config: Any) -> tuple[type, type, type]:
    """DecoderLayer, RMSNorm and RotaryEmbedding classes of the config's architecture (a text
    config of a multimodal family, e.g. ``Gemma3TextConfig``, names its classes without "Text")."""
    name = type(config).__name__.removesuffix("Config")
    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    parts = ("DecoderLayer", "RMSNorm", "RotaryEmbedding")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"heads with a decoder layer need the base architecture's module; {config.model_type!r} has none ({e})"
        ) from e
    for prefix in dict.fromkeys((name, name.removesuffix("Text"))):
        if all(hasattr(module, f"{prefix}{part}") for part in parts):
            return tuple(getattr(module, f"{prefix}{part}") for part in parts)
    raise ValueError(
        f"prefix-mlp and EAGLE-style heads need a Llama-like architecture (DecoderLayer, RMSNorm, RotaryEmbedding); "
        f"{config.model_type!r} does not provide them as {name}DecoderLayer, ... in {module_name}"
    )


def rope_kwargs(rope_cls: type, config: Any) -> dict[str, str]:
    """What a call of the architecture's rotary embedding needs besides (x, position_ids): the
    layer type where the architecture keeps one RoPE per type (Gemma 3: local and global); a
    one-layer config's only layer gives it."""
    if "layer_type" not in inspect.signature(rope_cls.forward).parameters:
        return {}
    return {"layer_type": config.layer_types[0]}


def causal_mask(q_len: int, past: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive [1, 1, q_len, past + q_len] mask: query j sees keys 0..past+j."""
    keys = torch.arange(past + q_len, device=device)
    queries = torch.arange(past, past + q_len, device=device)
    mask = torch.zeros(q_len, past + q_len, dtype=dtype, device=device)
    mask.masked_fill_(keys[None, :] > queries[:, None], torch.finfo(dtype).min)
    return mask[None, None]


class PrefixLayer(nn.Module):
    """One decoder layer of the base architecture plus a final norm, over base hidden states.

    It mirrors the published Hydra ``prefix_embeding_layer`` (a one-layer base model run on
    ``inputs_embeds``), so its parameter names are ``layers.0.*`` and ``norm.weight``.
    """

    def __init__(self, config_dict: dict[str, Any]) -> None:
        super().__init__()
        config = build_prefix_config(config_dict)
        layer_cls, norm_cls, rope_cls = _architecture_classes(config)
        self.layers = nn.ModuleList([layer_cls(config, layer_idx=0)])
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rope_cls(config=config)  # buffers are non-persistent: not saved
        self._rope_kwargs = rope_kwargs(rope_cls, config)

    def forward(self, hidden: Tensor, past: int = 0, cache: Any = None) -> Tensor:
        """Run causally over ``hidden`` [B, T, H] at positions past..past+T-1, appending to ``cache``."""
        seq = hidden.shape[1]
        position_ids = torch.arange(past, past + seq, device=hidden.device)[None]
        mask = causal_mask(seq, past, hidden.dtype, hidden.device)
        out = self.layers[0](
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(hidden, position_ids, **self._rope_kwargs),
        )
        return self.norm(out)

    def forward_rows(self, hiddens: list[Tensor], caches: list[Any]) -> list[Tensor]:
        """:meth:`forward` of several rows in one call: row ``b`` runs ``hiddens[b]`` [T_b, H] after
        the ``P_b`` positions its own one-layer ``caches[b]`` holds, and gets its new keys and values.

        The rows' cached keys are stacked left-padded to the longest ``P`` and their new positions
        right-padded to the longest ``T``; the additive mask lets row ``b`` see its own ``P_b`` cached
        slots and its new positions causally (a padded position sees itself only, so no row of the
        mask is empty). The stacking copies one layer's keys per step, against one weight read
        instead of one per row."""
        batch, seq = len(hiddens), max(h.shape[0] for h in hiddens)
        ref = hiddens[0]
        dtype, device, minimum = ref.dtype, ref.device, torch.finfo(ref.dtype).min
        pasts = [c.get_seq_length() for c in caches]
        past = max(pasts)
        x = ref.new_zeros(batch, seq, ref.shape[-1])
        mask = torch.full((batch, 1, seq, past + seq), minimum, dtype=dtype, device=device)
        cols = torch.arange(seq, device=device)
        causal, itself = cols[None, :] <= cols[:, None], torch.eye(seq, dtype=torch.bool, device=device)
        positions = torch.empty(batch, seq, dtype=torch.long, device=device)
        for b, (h, p) in enumerate(zip(hiddens, pasts)):
            t = h.shape[0]
            x[b, :t] = h
            mask[b, 0, :, past - p : past] = 0
            mask[b, 0, :, past:].masked_fill_((causal & (cols < t)) | itself, 0)
            positions[b] = torch.arange(p, p + seq, device=device)
        joint = DynamicCache()
        filled = [(b, c.layers[0]) for b, c in enumerate(caches) if pasts[b]]
        if filled:
            first = filled[0][1]
            keys = first.keys.new_zeros(batch, first.keys.shape[1], past, first.keys.shape[-1])
            values = first.values.new_zeros(batch, first.values.shape[1], past, first.values.shape[-1])
            for b, layer in filled:
                keys[b, :, past - pasts[b] :], values[b, :, past - pasts[b] :] = layer.keys[0], layer.values[0]
            joint.update(keys, values, 0)
        out = self.norm(
            self.layers[0](
                x,
                attention_mask=mask,
                position_ids=positions,
                cache=joint,
                use_cache=True,
                position_embeddings=self.rotary_emb(x, positions, **self._rope_kwargs),
            )
        )
        new_keys, new_values = joint.layers[0].keys[:, :, past:], joint.layers[0].values[:, :, past:]
        for b, (h, cache) in enumerate(zip(hiddens, caches)):
            t = h.shape[0]
            cache.update(new_keys[b : b + 1, :, :t], new_values[b : b + 1, :, :t], 0)
        return [out[b, : h.shape[0]] for b, h in enumerate(hiddens)]


class HydraHeads(DraftHeads):
    """Grounded Hydra heads (archs ``mlp`` and ``prefix-mlp``)."""

    lm_head_bias = True
    card_inputs = "the base model's last hidden state at t and the embeddings of the tokens drafted on its path"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.head_arch == "prefix-mlp":
            self.prefix_embeding_layer = PrefixLayer(config.prefix_layer_config)  # published name, sic
        else:
            self.prefix_embeding_layer = None

    def _build_mlps(self) -> nn.ModuleList:
        h, n = self.config.hidden_size, self.config.num_layers
        # Block 0 of head i reads (i+2)·H features; every block owns its weights (no [Block]*n).
        return nn.ModuleList(
            nn.ModuleList([ResBlock((i + 2) * h, h)] + [ResBlock(h, h) for _ in range(n - 1)])
            for i in range(self.config.num_heads)
        )

    @staticmethod
    def _prefix_layer_config(base_config: Any) -> dict[str, Any]:
        return prefix_layer_config(base_config)

    def _new_prefix_cache(self) -> Any:
        return None if self.prefix_embeding_layer is None else DynamicCache()

    def _condition(self, state: DraftState, hidden: Tensor) -> Tensor:
        if self.prefix_embeding_layer is None:
            return hidden
        out = self.prefix_embeding_layer(hidden[None], past=state.num_observed, cache=state.prefix_cache)
        return out[0]

    @torch.no_grad()
    def observe_rows(self, states: list[DraftState], hiddens: list[Tensor], tokens: list[Tensor | None]) -> None:
        """:meth:`observe` for several rows, the prefix layer run once over all of them."""
        if self.prefix_embeding_layer is None or len(states) < 2:
            return super().observe_rows(states, hiddens, tokens)
        hiddens = [self._observed(h).to(self._dtype) for h in hiddens]
        conds = self.prefix_embeding_layer.forward_rows(hiddens, [s.prefix_cache for s in states])
        for state, hidden, cond in zip(states, hiddens, conds):
            state.num_observed += hidden.shape[0]
            state.cond = cond[-1]

    @torch.no_grad()
    def propose(
        self,
        state: DraftState,
        root_token: Tensor,
        buffers: TreeBuffers,
        until: StopFn | None = None,
        temperature: float = 1.0,
    ) -> Proposal:
        """Draft the tree depth by depth, one batched head call per depth (``until``, ``temperature``: see the
        base class).

        ``feats`` holds, for every node of the previous depth, its head input
        concat[c_t, E(root), E(path...)]; a parent's row is found through ``slot`` (each
        node's position within its depth), children append their own token embedding.
        """
        tokens, probs, entropy = self._start(state, root_token, buffers)
        embed = state.embed
        dtype = self._dtype
        feats = torch.cat([state.cond[None], embed(tokens[:1]).to(dtype)], dim=-1)  # depth 0: [1, 2H]
        slot = torch.zeros(buffers.num_nodes, dtype=torch.long, device=tokens.device)
        for i, step in enumerate(buffers.depth_plan):
            parent_x = feats[slot[step.parents]]
            logits = self._head(i, parent_x, state.lm_weight, state.lm_bias, state.kernel)
            tok, p, h = self._children(logits, step.child_parent_row, step, temperature)
            tokens[step.children], probs[step.children], entropy[step.children] = tok, p, h
            slot[step.children] = torch.arange(step.children.shape[0], device=slot.device)
            if until is not None and until(i + 1, entropy):
                return Proposal(tokens=tokens, probs=probs, entropy=entropy, depth=i + 1)
            feats = torch.cat([parent_x[step.child_parent_row], embed(tok).to(dtype)], dim=-1)
        return Proposal(tokens=tokens, probs=probs, entropy=entropy)

    @torch.no_grad()
    def propose_rows(
        self, states: list[DraftState], roots: list[Tensor], buffers: TreeBuffers, temperature: float = 1.0
    ) -> list[Proposal]:
        """:meth:`propose` for several rows at once: one head call per depth over every row's parents."""
        starts = [self._start(s, r, buffers) for s, r in zip(states, roots)]
        tokens, probs, entropy = (torch.stack(t) for t in zip(*starts))  # [B, N] each
        first, dtype = states[0], self._dtype
        cond = torch.stack([s.cond for s in states])
        feats = torch.cat([cond[:, None], first.embed(tokens[:, :1]).to(dtype)], dim=-1)  # depth 0: [B, 1, 2H]
        slot = torch.zeros(buffers.num_nodes, dtype=torch.long, device=tokens.device)
        for i, step in enumerate(buffers.depth_plan):
            parent_x = feats[:, slot[step.parents]]
            logits = self._head(i, parent_x, first.lm_weight, first.lm_bias, first.kernel)
            tok, p, h = self._children(logits, step.child_parent_row, step, temperature)
            tokens[:, step.children], probs[:, step.children], entropy[:, step.children] = tok, p, h
            slot[step.children] = torch.arange(step.children.shape[0], device=slot.device)
            feats = torch.cat([parent_x[:, step.child_parent_row], first.embed(tok).to(dtype)], dim=-1)
        return [Proposal(tokens=tokens[b], probs=probs[b], entropy=entropy[b]) for b in range(len(states))]

    def forward_train(
        self, hidden: Tensor, input_ids: Tensor, embed: nn.Module | None, lm_head: nn.Module | None = None
    ) -> list[Tensor]:
        """Teacher-forced logits; element i is [B, T-i-1, V'] and row t predicts token t+i+2.

        Row t of head i reads c_t and E(input_ids[t+1..t+i+1]). The prefix layer runs at
        positions 0..T-1, so sequences must not be left-padded.
        """
        if embed is None:
            raise ValueError("Hydra heads need the base model's input embeddings (embed=model.get_input_embeddings())")
        batch, seq, _ = hidden.shape
        dtype = self._dtype
        hidden = hidden.to(dtype)
        base = self.prefix_embeding_layer(hidden) if self.prefix_embeding_layer is not None else hidden
        emb = embed(input_ids).to(dtype)
        lm_weight, lm_bias = self._train_lm(lm_head)
        out = []
        for i in range(self.num_heads):
            n = max(seq - i - 1, 0)
            x = torch.cat([base[:, :n]] + [emb[:, k : k + n] for k in range(1, i + 2)], dim=-1)
            out.append(self._head(i, x, lm_weight, lm_bias))
        return out


register_family("hydra", HydraHeads, config_class=HeadsConfig, archs=("mlp", "prefix-mlp"), layer_archs=("prefix-mlp",))
