"""Tree-verification attention without copying the KV cache per layer.

A verification forward passes a custom 4D mask. With a mask, transformers' ``sdpa``
attention expands grouped key/value heads to one copy per query head (``repeat_kv``) in
every layer and every step, because masked grouped-query SDPA falls back to the slow math
kernel on CUDA. On a CPU, PyTorch's flash kernel takes the mask *and* the grouped heads
(``enable_gqa=True``) directly and gives the same result: on the demo model (9 query heads,
3 key/value heads, 30 layers) that copy is ~6 ms of a ~70 ms forward at a 300-token
context, and grows with the context (docs/performance.md).

:func:`grouped_tree_attention` is that attention, registered with transformers'
``AttentionInterface`` under :data:`ATTENTION_NAME` (the documented extension point, no
change to any modelling file); everything it does not handle goes to the stock ``sdpa``
function unchanged. :func:`tree_attention` switches a model that uses ``sdpa`` to it for
the span of a ``with`` block, so the model is left as it was.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "entmtp_sdpa"


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
    """``sdpa`` attention that keeps grouped key/value heads grouped when a mask is given on CPU."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and dropout == 0.0
    if groups > 1 and attention_mask is not None and query.device.type == "cpu" and plain and query.shape[2] > 1:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


AttentionInterface.register(ATTENTION_NAME, grouped_tree_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def tree_attention(model) -> Iterator[None]:
    """Use :func:`grouped_tree_attention` inside the block if the model uses ``sdpa``; restore after."""
    config = model.config.get_text_config()
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
