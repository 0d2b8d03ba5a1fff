"""Tree-verification attention: the 4D tree mask of a batch of trees, and grouped heads kept grouped.

The base model checks every node of the tree in one forward pass. Node ``i`` is fed at
absolute position ``prefix_len + depth(i)`` and sees the whole cached prefix plus its own
ancestors, through a float additive 4D mask (a boolean mask is silently wrong under the
eager attention of transformers 5): :func:`tree_inputs`, one builder for one row or many.
Layers with a sliding window see only the tokens less than the window behind the query, the
tree's own ancestors included. The window counts cache slots, not position ids: transformers'
rule is ``kv_idx > q_idx - window`` on the slot indices of plain ``generate``'s cache, where
every token of the row's text has a slot, padding and holes in the attention mask included
(the position ids skip those). That slot index is a token's *text index*
(:func:`~entmtp_hf.decoding.cache.slot_indices`); a node's is its root's plus its depth.
:class:`AttentionLayout` turns the tree mask into each layer type's mask, passed as one tensor
when every layer attends alike and as a dict keyed by layer type when the model mixes them
(Gemma 2/3, Qwen2 with ``use_sliding_window``, ...), which is what those models' forwards take.

A verification forward passes a custom 4D mask. With a mask, transformers' ``sdpa``
attention expands grouped key/value heads to one copy per query head (``repeat_kv``) in
every layer and every step, because masked grouped-query SDPA falls back to the slow math
kernel on CUDA. On a CPU, PyTorch's flash kernel takes the mask *and* the grouped heads
(``enable_gqa=True``) directly and gives the same result: on the demo model (9 query heads,
3 key/value heads, 30 layers) that copy is ~6 ms of a ~70 ms forward at a 300-token
context, and grows with the context (docs/performance.md).

:func:`grouped_tree_attention` is that attention, registered with transformers'
``AttentionInterface`` under :data:`ATTENTION_NAME` (the documented extension point, no
change to any modelling file). :func:`use_tree_attention` selects it once, when EntMTP is
enabled on a model that uses ``sdpa`` (:func:`restore_attention` undoes it). It takes the
grouped path only inside :func:`verifying` (a context variable: per thread and task, nothing
stored on the model) and only for a masked multi-token CPU forward, and in every masked CPU
forward of a compiled graph (plain decoding's one token included: transformers regroups a single
query only outside compiled code, so its compiled step expands the heads of the whole static
cache); everything else, eager plain ``generate`` included, goes to the stock ``sdpa`` function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import gemv as _gemv
from ..errors import EntMTPError
from ..gemv import kernel_takes
from ..trees.tree import TreeBuffers

if TYPE_CHECKING:
    from ..drafting.drafter import Draft

ATTENTION_NAME = "entmtp_sdpa"
#: the layer types tree verification can mask (transformers' ``config.layer_types`` names)
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class AttentionLayout:
    """How a model's decoder layers attend: ``window``, the sliding layers' window (None: every
    layer sees the whole text), and ``mixed``, whether full and sliding layers are mixed (a
    forward then takes one mask per layer type)."""

    window: int | None = None
    mixed: bool = False

    @classmethod
    def of(cls, config) -> "AttentionLayout":
        """The layout of a model's (text) config; refuses layer types a tree mask cannot express."""
        text = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise EntMTPError(
                f"EntMTP verifies trees on full and sliding-window attention layers; this model has "
                f"{', '.join(unknown)} layers"
            )
        windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == SLIDING}
        if len(windows) > 1:
            raise EntMTPError(f"EntMTP supports one sliding window per model; this one has {sorted(windows)}")
        window = windows.pop() if windows else None
        return cls(window=window, mixed=window is not None and FULL in types)

    def masks(
        self, full: torch.Tensor, node_index: torch.Tensor, slot_index: torch.Tensor, dropped: int
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward's ``attention_mask`` from the tree mask ``full`` [B, 1, N, S + N] (:func:`tree_inputs`),
        the nodes' text indices ``node_index`` [B, N] (the root's plus the depth), the cached slots'
        text indices ``slot_index`` [B, S] (-1: never seen) and the slots the sliding layers dropped
        from their front. Text indices, not position ids: the window counts padding and holes."""
        if self.window is None:
            return full
        keys = torch.cat([slot_index, node_index], dim=1)  # [B, S + N]
        if keys.shape[1] < full.shape[-1]:  # a static cache's unfilled slots (masked in ``full`` already)
            keys = torch.cat([keys, keys.new_full((keys.shape[0], full.shape[-1] - keys.shape[1]), -1)], dim=1)
        outside = (node_index[:, None, :, None] - keys[:, None, None, :]) >= self.window
        sliding = full.masked_fill(outside, torch.finfo(full.dtype).min)[..., dropped:]
        return {FULL: full, SLIDING: sliding} if self.mixed else sliding


def tree_inputs(
    drafts: Sequence["Draft"], next_pos: Sequence[int], prefix: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, N], position ids [B, N] and the 4D additive mask [B, 1, N, kv_len] of a batch
    of trees appended after the cached prefix.

    Row ``b``'s tree occupies its first ``N_b`` slots, at positions ``next_pos[b] + depth``; its
    node ``i`` sees the row's prefix (``prefix`` [B, S]: 0 or the dtype's minimum, so user
    padding stays masked) and its own ancestors. The padding nodes after a smaller tree repeat
    its root at the root's position and see only the prefix and themselves (their outputs are
    never read and their keys are cropped or masked). Columns after ``S + N`` (a static cache's
    unused slots) are masked.
    """
    batch, prefix_len = len(drafts), prefix.shape[1]
    n = max(d.buffers.num_nodes for d in drafts)
    dtype, device = prefix.dtype, prefix.device
    tokens = torch.empty(batch, n, dtype=torch.long, device=device)
    positions = torch.empty(batch, n, dtype=torch.long, device=device)
    mask = torch.full((batch, 1, n, kv_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, 0, :, :prefix_len] = prefix[:, None, :]
    pad_diag = torch.arange(n, device=device)
    for b, (d, pos) in enumerate(zip(drafts, next_pos)):
        nb = d.buffers.num_nodes
        tokens[b, :nb], tokens[b, nb:] = d.tokens, d.tokens[0]
        positions[b, :nb], positions[b, nb:] = d.buffers.position_ids + pos, pos
        mask[b, 0, :nb, prefix_len : prefix_len + nb] = d.buffers.attn_mask.to(dtype)
        mask[b, 0, pad_diag[nb:], prefix_len + pad_diag[nb:]] = 0
    return tokens, positions, mask


def tree_attention_mask(buffers: TreeBuffers, prefix_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """4D additive mask [1, 1, N, kv_len] of one tree after a prefix whose additive row is
    ``prefix_mask`` [L] (:func:`tree_inputs` for a batch of one)."""
    root = buffers.position_ids.new_zeros(1)
    draft = _TreeOnly(root.repeat(buffers.num_nodes), buffers)
    return tree_inputs([draft], [0], prefix_mask[None].to(buffers.attn_mask.dtype), kv_len)[2]


@dataclass(frozen=True)
class _TreeOnly:
    """What :func:`tree_inputs` reads of a draft, for a mask without tokens."""

    tokens: torch.Tensor
    buffers: TreeBuffers


#: set while a tree is verified (:func:`verifying`)
_VERIFYING: ContextVar[bool] = ContextVar("entmtp_verifying", default=False)


def grouped_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``sdpa`` keeping grouped key/value heads grouped on CPU: a verified tree, any compiled decode
    forward (there on the package's decode attention where it runs, :func:`graph_attention`)."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and dropout == 0.0
    # a compiled graph is a decode forward (the prefill stays eager), a tree's or plain decoding's; the
    # context variable is not traceable: checked only outside compiled code
    compiled = torch.compiler.is_compiling()
    decoding = compiled or (_VERIFYING.get() and query.shape[2] > 1)
    if plain and decoding and attention_mask is not None and query.device.type == "cpu":
        if compiled and kernel_takes(query, key, value) and graph_attention() == KERNEL:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return torch.ops.entmtp_hf_cpu.decode_attention(query, key, value, attention_mask, scale), None
        if groups > 1:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
            )
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


#: what :func:`graph_attention` names the package's decode attention: an operator of the package's CPU
#: extension (``csrc/module.cpp``), which the graph calls through the dispatcher, no Python in between
KERNEL = "entmtp_hf_cpu::decode_attention"


@torch.compiler.assume_constant_result  # asked while tracing: a constant of the graph, not a break
def graph_attention() -> str:
    """What a compiled CPU decode forward attends with: the package's decode attention
    (:data:`KERNEL`, ``csrc/attention.cpp``: one layer of the demo model at one token took 23 us in
    float32 and 32 us in bfloat16 where PyTorch's flash kernel took 59 and 332 us) where the package's
    CPU kernels are built here, else ``sdpa``. Part of a saved graph's key."""
    return KERNEL if _gemv.unavailable() is None else "sdpa"


AttentionInterface.register(ATTENTION_NAME, grouped_tree_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def verifying() -> Iterator[None]:
    """Inside the block (this thread or task only) a masked multi-token forward is a tree verification."""
    token = _VERIFYING.set(True)
    try:
        yield
    finally:
        _VERIFYING.reset(token)


def use_tree_attention(model) -> bool:
    """Select :func:`grouped_tree_attention` (transformers' ``set_attn_implementation``) for a model
    that uses ``sdpa``; True if it was switched."""
    if model.config.get_text_config()._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION_NAME)
    return True


def restore_attention(model) -> None:
    """Undo :func:`use_tree_attention`."""
    if model.config.get_text_config()._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation("sdpa")
