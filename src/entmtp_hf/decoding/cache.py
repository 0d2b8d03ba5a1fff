"""The KV cache of tree decoding: prepared once per call, trimmed to the accepted path each step."""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer


#: a static cache's length is rounded up to a multiple of this: a compiled verification graph
#: is specialised to the cache's shape, so prompts of nearby lengths share graphs
STATIC_BUCKET = 256


def prepare_cache(model, model_kwargs: dict, max_length: int, max_nodes: int, max_cache_len: int | None = None):
    """The cache to decode with: the prepared one, or a static one with room for the last tree
    (at least ``max_cache_len``, generation config's worst case across calls, when given)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    if isinstance(cache, StaticCache):
        needed = max(-(-(max_length + max_nodes) // STATIC_BUCKET) * STATIC_BUCKET, max_cache_len or 0)
        if cache.get_max_length() < max_length + max_nodes or int(cache.get_seq_length()) > 0:
            cache = StaticCache(config=model.config, max_cache_len=needed)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, StaticLayer):
            raise ValueError(
                f"EntMTP decoding supports full-attention dynamic or static caches; "
                f"this model's cache has {type(layer).__name__} layers"
            )
    if int(cache.get_seq_length()) > 0:
        raise ValueError("EntMTP decoding starts from an empty cache; do not pass a filled cache")
    return cache


def keep_accepted(cache, prefix_len: int, num_nodes: int, path: list[int]) -> None:
    """Keep only the accepted nodes' keys and values after a tree forward.

    The tree occupied cache slots ``prefix_len .. prefix_len + num_nodes - 1``; the accepted
    nodes are moved to the front of that range (in path order) and the rest is cropped.
    Works for dynamic and static layers, which both expose ``keys``/``values`` of shape
    [batch, kv_heads, seq, head_dim] and crop by a negative count.
    """
    kept = len(path)
    if path != list(range(kept)):  # the accepted nodes are not already a prefix of the tree
        src = torch.tensor(path, device=cache.layers[0].keys.device) + prefix_len
        for layer in cache.layers:  # .to: a no-op unless a device map spreads the layers
            idx = src.to(layer.keys.device)
            layer.keys[..., prefix_len : prefix_len + kept, :] = layer.keys.index_select(-2, idx)
            layer.values[..., prefix_len : prefix_len + kept, :] = layer.values.index_select(-2, idx)
    if num_nodes > kept:
        cache.crop(-(num_nodes - kept))
