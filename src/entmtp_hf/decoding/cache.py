"""The KV cache of tree decoding: prepared once per call, trimmed to the accepted path each step.

A transformers ``DynamicLayer`` grows by concatenation: every forward copies the layer's whole
cache into a new tensor, for every layer. At a batch of 4 rows and a few hundred tokens of
context that copy is about a fifth of a decode forward on the demo model. Tree decoding fills
the empty dynamic cache ``generate`` prepares with :class:`PreallocatedLayer` instead: each
layer's keys and values live in preallocated buffers, and the
cache's ``keys`` / ``values`` are views of their filled part, so a forward writes only its new
tokens and cropping is a shorter view. The buffers grow :data:`GROWTH_STEP` slots at a time
(within the call's longest text): one copy of the cache every that many tokens instead of one
per forward, and at most that many unused slots per row, so a large ``max_new_tokens`` with an
early end costs no memory it does not use.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer


#: a static cache's length is rounded up to a multiple of this: a compiled verification graph
#: is specialised to the cache's shape, so prompts of nearby lengths share graphs
STATIC_BUCKET = 256


#: slots a :class:`PreallocatedLayer`'s buffers grow by
GROWTH_STEP = 64


class PreallocatedLayer(DynamicLayer):
    """A dynamic cache layer whose keys and values are views of buffers that grow in steps.

    Invariant: after every :meth:`update`, ``keys`` / ``values`` are the first
    ``get_seq_length()`` slots of the buffers ``[batch, kv_heads, capacity, head_dim]``, so
    writing into them (the accepted-path moves of :func:`keep_accepted`) writes the buffers, and
    transformers' ``crop`` (a shorter slice) keeps the invariant. Anything that puts other
    tensors there (row selection, beam reordering) is copied back into fresh buffers at the next
    update. ``limit``, the call's longest text if known, caps the growth steps; a longer text
    still fits (the buffers then grow to it).
    """

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.capacity = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True
        self._allocate(key_states[..., :0, :], value_states[..., :0, :], 0)

    def _room(self, length: int) -> int:
        """The capacity for a text of ``length`` slots: a growth step more, within the limit."""
        grown = length + GROWTH_STEP
        return max(length, min(grown, self.limit) if self.limit is not None else grown)

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """New buffers of ``capacity`` slots holding ``keys`` / ``values`` at their front."""
        b, h, n, _ = keys.shape
        self._key_buffer = keys.new_empty((b, h, capacity, keys.shape[-1]))
        self._value_buffer = values.new_empty((b, values.shape[1], capacity, values.shape[-1]))
        self._key_buffer[:, :, :n] = keys
        self._value_buffer[:, :, :n] = values
        self.capacity = capacity
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]

    def _holds_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still the front of this layer's buffers."""
        return all(
            t._base is buf and t.data_ptr() == buf.data_ptr() and t.shape[:2] == buf.shape[:2]
            for t, buf in ((self.keys, self._key_buffer), (self.values, self._value_buffer))
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not self._holds_views():
            self._allocate(self.keys, self.values, self._room(self.keys.shape[-2]))
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            self._allocate(self.keys, self.values, self._room(end))
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


def preallocate(cache: DynamicCache, limit: int | None = None) -> DynamicCache:
    """``cache`` (empty, plain dynamic layers) with every layer a :class:`PreallocatedLayer`
    (growing up to ``limit`` slots in steps), in place; any other cache is returned unchanged."""
    if int(cache.get_seq_length()) == 0 and cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers[:] = [PreallocatedLayer(limit) for _ in cache.layers]
    return cache


def prepare_cache(model, model_kwargs: dict, max_length: int, max_nodes: int, max_cache_len: int | None = None):
    """The cache to decode with: the prepared one (its dynamic layers preallocated in steps up to
    ``max_length + max_nodes`` slots), or a static one with room for the last tree (at least
    ``max_cache_len``, generation config's worst case across calls, when given)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    if isinstance(cache, StaticCache):
        needed = max(-(-(max_length + max_nodes) // STATIC_BUCKET) * STATIC_BUCKET, max_cache_len or 0)
        if cache.get_max_length() < max_length + max_nodes or int(cache.get_seq_length()) > 0:
            cache = StaticCache(config=model.config, max_cache_len=needed)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, StaticLayer, PreallocatedLayer):
            raise ValueError(
                f"EntMTP decoding supports full-attention dynamic or static caches; "
                f"this model's cache has {type(layer).__name__} layers"
            )
    if int(cache.get_seq_length()) > 0:
        raise ValueError("EntMTP decoding starts from an empty cache; do not pass a filled cache")
    if isinstance(cache, DynamicCache):
        preallocate(cache, max_length + max_nodes)
    return cache


def keep_accepted(cache, prefix_len: int, paths: list[list[int]]) -> None:
    """Keep every row's accepted nodes after a verification of the rows' trees.

    Row ``b``'s tree occupied cache slots ``prefix_len ..``; its accepted nodes move to the front
    of that range (in path order) and the cache is cropped to ``prefix_len + K`` (``K`` the
    longest path). A row that accepted fewer leaves slots behind that it must never attend to
    (:func:`accepted_prefix` masks them). Works for dynamic and static layers, which both expose
    ``keys`` / ``values`` of shape [batch, kv_heads, seq, head_dim] and crop by a negative count.
    """
    longest = max(len(p) for p in paths)
    if any(p != list(range(len(p))) for p in paths):  # some path is not already a prefix of its tree
        src = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths], device=cache.layers[0].keys.device)
        src = src + prefix_len
        for layer in cache.layers:  # .to: a no-op unless a device map spreads the layers
            idx = src.to(layer.keys.device)[:, None, :, None]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, prefix_len : prefix_len + longest] = t.gather(2, idx.expand(-1, t.shape[1], -1, t.shape[3]))
    surplus = int(cache.get_seq_length()) - prefix_len - longest
    if surplus > 0:
        cache.crop(-surplus)


def accepted_prefix(prefix: torch.Tensor, prefix_len: int, lengths: list[int]) -> torch.Tensor:
    """The rows' additive mask [B, prefix_len + K] after :func:`keep_accepted`: row ``b`` filled
    ``lengths[b]`` of the ``K = max(lengths)`` new slots, and never sees the others."""
    longest = max(lengths)
    filled = torch.arange(longest, device=prefix.device)[None] < torch.tensor(lengths, device=prefix.device)[:, None]
    new = torch.zeros(len(lengths), longest, dtype=prefix.dtype, device=prefix.device)
    new.masked_fill_(~filled, torch.finfo(prefix.dtype).min)
    return torch.cat([prefix[:, :prefix_len], new], dim=1)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep only the batch rows ``rows`` of every cache layer."""
    for layer in cache.layers:
        idx = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
