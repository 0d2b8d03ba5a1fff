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

**Sliding-window layers** (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3, ...)
are preallocated layers too, with their ``sliding_window``: a verified tree appends to them like
to any layer (the 4D mask applies the window), and after each step :func:`trim_windows` drops the
front slots no row can see any more, so with one row such a layer ends every step holding the
``sliding_window - 1`` tokens plain decoding would hold. Each layer counts the slots it dropped
(:attr:`PreallocatedLayer.dropped`), so positions and lengths keep meaning the whole text.

**A filled cache** (the previous turn of a chat, from plain ``generate`` or from EntMTP) keeps
its contents: its layers become preallocated layers holding the same keys and values.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from ..errors import EntMTPError


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

    ``sliding_window``: the layer attends that many tokens back (the mask applies it). It keeps
    every slot until :meth:`drop_front` drops the oldest; ``dropped`` counts them, and
    ``get_seq_length`` / ``get_mask_sizes`` answer for the whole text, as transformers' sliding
    layers do, so a forward that builds its own masks (the prefill) places them right.
    """

    def __init__(self, limit: int | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.dropped = 0  # front slots dropped (sliding layers only)
        self.capacity = 0
        self._start = 0  # buffer slot of keys[..., 0, :]
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
        self.capacity, self._start = capacity, 0
        self.keys, self.values = self._key_buffer[:, :, :n], self._value_buffer[:, :, :n]

    def _holds_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still views of this layer's buffers from ``_start`` on."""
        return all(
            t._base is buf and t.data_ptr() == buf[:, :, self._start :].data_ptr() and t.shape[:2] == buf.shape[:2]
            for t, buf in ((self.keys, self._key_buffer), (self.values, self._value_buffer))
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not self._holds_views():
            self._allocate(self.keys, self.values, self._room(self.keys.shape[-2]))
        if self._start + self.keys.shape[-2] + key_states.shape[-2] > self.capacity:
            self._allocate(self.keys, self.values, self._room(self.keys.shape[-2] + key_states.shape[-2]))
        start = self._start + self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, self._start : end], self._value_buffer[:, :, self._start : end]
        return self.keys, self.values

    def drop_front(self, count: int) -> None:
        """Forget the oldest ``count`` slots (a sliding layer's tokens no query can see any more)."""
        if count <= 0:
            return
        if self._holds_views():
            self._start += count
        self.keys, self.values = self.keys[:, :, count:], self.values[:, :, count:]
        self.dropped += count

    def get_seq_length(self) -> int:
        """Tokens of the whole text this layer has seen (the dropped ones included)."""
        return self.dropped + super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The keys a forward of ``query_length`` tokens attends over: the kept slots and the new
        ones, the first at text position ``dropped``."""
        return super().get_seq_length() + query_length, self.dropped

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` slots (transformers' convention: a negative count)."""
        if self.is_initialized and -tokens_to_remove > self.keys.shape[-2]:
            raise ValueError(f"cannot crop {-tokens_to_remove} slots from a layer that keeps {self.keys.shape[-2]}")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.dropped, self._start = 0, 0
        self._key_buffer = self._value_buffer = None

    @classmethod
    def holding(cls, layer: DynamicLayer, limit: int | None) -> "PreallocatedLayer":
        """A preallocated layer holding what the dynamic ``layer`` (full or sliding) holds."""
        window = layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
        new = cls(limit, window)
        if layer.is_initialized and layer.keys is not None and layer.keys.numel():
            new.device, new.is_initialized = layer.keys.device, True
            new._allocate(layer.keys, layer.values, new._room(layer.keys.shape[-2]))
            new.dropped = layer.get_seq_length() - layer.keys.shape[-2]
        return new

    def as_transformers_layer(self) -> DynamicLayer:
        """This layer as transformers' own dynamic layer (a sliding one keeps the last
        ``sliding_window - 1`` slots, as it would after plain decoding), for the caller's next turn."""
        if not self.is_sliding:
            return self
        layer = DynamicSlidingWindowLayer(self.sliding_window)
        if self.is_initialized and self.keys is not None:
            keep = self.sliding_window - 1
            layer.lazy_initialization(self.keys, self.values)
            layer.keys, layer.values = self.keys[:, :, -keep:].clone(), self.values[:, :, -keep:].clone()
            layer.cumulative_length = self.get_seq_length()
        return layer


def preallocate(cache: DynamicCache, limit: int | None = None) -> DynamicCache:
    """``cache`` (transformers' dynamic layers, full or sliding, empty or filled) with every layer a
    :class:`PreallocatedLayer` holding the same (growing up to ``limit`` slots in steps), in
    place; any other cache is returned unchanged."""
    kinds = (DynamicLayer, DynamicSlidingWindowLayer, PreallocatedLayer)
    if cache.layers and all(type(layer) in kinds for layer in cache.layers):
        cache.layers[:] = [
            layer if type(layer) is PreallocatedLayer else PreallocatedLayer.holding(layer, limit)
            for layer in cache.layers
        ]
    return cache


def release(cache) -> None:
    """Hand the cache back as transformers' own layers would hold it (sliding layers trimmed to
    their window), so the caller's next turn continues from it with plain ``generate`` or EntMTP."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, PreallocatedLayer):
            cache.layers[i] = layer.as_transformers_layer()


def prepare_cache(model, model_kwargs: dict, max_length: int, max_nodes: int, max_cache_len: int | None = None):
    """The cache to decode with: the prepared one (its dynamic layers, full or sliding, empty or
    filled by an earlier turn, preallocated in steps up to ``max_length + max_nodes`` slots), or a
    static one with room for the last tree (at least ``max_cache_len``, generation config's worst
    case across calls, when given). Refuses, before any compute, what tree decoding cannot keep."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    if isinstance(cache, StaticCache):
        if int(cache.get_seq_length()) > 0:
            raise EntMTPError("EntMTP decoding continues a conversation from a filled DynamicCache; this StaticCache "
                              "is filled: pass a DynamicCache (or an empty StaticCache)")  # fmt: skip
        needed = max(-(-(max_length + max_nodes) // STATIC_BUCKET) * STATIC_BUCKET, max_cache_len or 0)
        if cache.get_max_length() < max_length + max_nodes:
            cache = StaticCache(config=model.config, max_cache_len=needed)
        full = [layer.max_cache_len for layer in cache.layers if isinstance(layer, StaticLayer) and not layer.is_sliding]
        unroll_static_windows(cache, max(full) if full else needed)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, PreallocatedLayer):
            raise EntMTPError(
                f"EntMTP decoding supports transformers' dynamic and static caches of full and sliding-window "
                f"attention layers; this cache has {type(layer).__name__} layers"
            )
    if isinstance(cache, DynamicCache):
        preallocate(cache, max_length + max_nodes)
    return cache


def unroll_static_windows(cache: StaticCache, length: int) -> None:
    """An empty static cache's sliding layers as full static layers of ``length`` slots, in place.

    transformers' static sliding layer is a ring of ``sliding_window`` slots: a verified tree
    would overwrite slots its rejected nodes share with tokens still in the window, before the
    accepted path is known. A full static layer keeps every slot (the text's length in memory,
    as the full layers do) and the tree mask applies the window, so the output is the same; a
    compiled graph sees fixed shapes either way."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StaticLayer) and layer.is_sliding:
            cache.layers[i] = StaticLayer(max_cache_len=length)


def sliding_layers(cache) -> list[PreallocatedLayer]:
    """The cache's preallocated sliding-window layers (what :func:`trim_windows` trims)."""
    return [layer for layer in cache.layers if isinstance(layer, PreallocatedLayer) and layer.is_sliding]


def trim_windows(layers: list[PreallocatedLayer], slot_pos: torch.Tensor, next_pos: list[int]) -> None:
    """Drop the front slots of the sliding ``layers`` (:func:`sliding_layers`) that no row can
    attend to any more.

    ``slot_pos`` [B, S] is the text position of every cached slot of every row (-1: padding or a
    slot the row left unfilled), ``next_pos[b]`` the position of row ``b``'s next root. Row ``b``
    still needs the slots at positions ``>= next_pos[b] - window + 1``; a layer keeps everything
    from the first slot any row needs. With one row that is exactly the ``window - 1`` tokens
    plain decoding keeps."""
    if not layers or slot_pos.shape[1] == 0:
        return
    nxt = torch.tensor(next_pos, device=slot_pos.device)[:, None]
    slots = torch.arange(slot_pos.shape[1], device=slot_pos.device)
    for window in {layer.sliding_window for layer in layers}:
        needed = slot_pos >= nxt - window + 1  # [B, S]
        first = torch.where(needed, slots, slot_pos.shape[1]).min(dim=1).values  # per row; S when none
        keep_from = int(first.min())
        for layer in layers:
            if layer.sliding_window == window:
                layer.drop_front(keep_from - layer.dropped)


def keep_accepted(cache, prefix_len: int, paths: list[list[int]]) -> None:
    """Keep every row's accepted nodes after a verification of the rows' trees.

    Row ``b``'s tree occupied cache slots ``prefix_len ..``; its accepted nodes move to the front
    of that range (in path order) and the cache is cropped to ``prefix_len + K`` (``K`` the
    longest path). A row that accepted fewer leaves slots behind that it must never attend to
    (:func:`accepted_slots` marks them). Works for dynamic and static layers, which both expose
    ``keys`` / ``values`` of shape [batch, kv_heads, seq, head_dim] and crop by a negative count.
    """
    longest = max(len(p) for p in paths)
    if any(p != list(range(len(p))) for p in paths):  # some path is not already a prefix of its tree
        src = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in paths], device=cache.layers[0].keys.device)
        for layer in cache.layers:  # .to: a no-op unless a device map spreads the layers
            start = prefix_len - getattr(layer, "dropped", 0)  # a sliding layer's slots begin later
            idx = (src + start).to(layer.keys.device)[:, None, :, None]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[:, :, start : start + longest] = t.gather(2, idx.expand(-1, t.shape[1], -1, t.shape[3]))
    surplus = int(cache.get_seq_length()) - prefix_len - longest
    if surplus > 0:
        cache.crop(-surplus)


def slot_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] the text position of every slot of a (left-padded) prompt's cache; -1 for padding."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, -1)


def accepted_slots(slot_pos: torch.Tensor, prefix_len: int, first_pos: list[int], lengths: list[int]) -> torch.Tensor:
    """The rows' slot positions [B, prefix_len + K] after :func:`keep_accepted`: row ``b`` filled
    ``lengths[b]`` of the ``K = max(lengths)`` new slots, at positions ``first_pos[b]`` on, and
    never sees the others (-1)."""
    longest, device = max(lengths), slot_pos.device
    offsets = torch.arange(longest, device=device)[None]
    new = torch.tensor(first_pos, device=device)[:, None] + offsets
    new = new.masked_fill(offsets >= torch.tensor(lengths, device=device)[:, None], -1)
    return torch.cat([slot_pos[:, :prefix_len], new], dim=1)


def additive_mask(slot_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] 0 where a slot holds a token of the row, the dtype's minimum where it never may be seen."""
    return torch.zeros(slot_pos.shape, dtype=dtype, device=slot_pos.device).masked_fill_(
        slot_pos < 0, torch.finfo(dtype).min
    )


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep only the batch rows ``rows`` of every cache layer."""
    for layer in cache.layers:
        idx = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
