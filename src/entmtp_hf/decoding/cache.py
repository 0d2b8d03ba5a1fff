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

**A static cache** decodes in full static layers with room for the text and the largest tree
(:func:`lend_static`; a batch's rows compacted into that room when needed, :func:`compact`).
Whatever the cache, the caller's object ends the call as plain ``generate`` leaves it
(:func:`hand_back`), and a cache of another model or batch is refused first (:func:`check_cache`).
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from ..errors import EntMTPError
from .attention import SLIDING

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

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
    """The cache's preallocated layers as transformers' own layers would hold them (sliding layers
    trimmed to their window), so the caller's next turn continues from it with plain ``generate``
    or EntMTP."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, PreallocatedLayer):
            cache.layers[i] = layer.as_transformers_layer()


def hand_back(cache, keep: int | None) -> None:
    """Leave the caller's cache object as plain ``generate`` would: ``keep`` slots (one row: its
    returned text but the last token; the slots past it, a stopped row's nodes, go), in
    transformers' own layer types, a static cache in its own layers (:func:`lend_static`).

    ``keep=None`` (a batch) leaves it empty. Decoding a batch leaves each row's tokens at other
    slots than plain ``generate``'s left-padded layout (a row's rejected nodes leave holes; a
    stopped row leaves the forward before the pad tokens plain ``generate`` feeds it), so no
    next turn could continue from them: an empty cache makes the next turn prefill the whole
    conversation, which gives the text plain ``generate`` continuing its own cache gives."""
    if keep is not None:
        excess = int(cache.get_seq_length()) - keep
        if excess > 0:
            cache.crop(-excess)
    release(cache)
    for i, own in _LENT.pop(cache, {}).items():
        if keep is not None:
            _copy_text(cache.layers[i], own, keep)
        cache.layers[i] = own
    if keep is None:
        cache.reset()


def check_cache(model, cache, rows: int) -> None:
    """Refuse, before any compute, a cache that is not this model's or not this batch's.

    A cache's layers are the model's decoder layers one for one (a cache without layers yet grows
    them); a layer that holds keys holds ``rows`` rows of the model's key/value heads, head size
    and dtype; a sliding-window layer sits where the model has one, with the model's window."""
    types, per_layer = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    foreign = (
        "the cache was built for another model: pass one built for this one (such as "
        "DynamicCache(config=model.config)), or none"
    )
    if cache.layers and len(cache.layers) != len(types):
        raise EntMTPError(f"this cache has {len(cache.layers)} layers and the model {len(types)}: {foreign}")
    try:  # transformers' per-rank (kv heads, head dim), one value or one per layer; None where it cannot say
        shape = model._get_static_cache_init_shape()
    except Exception:  # noqa: BLE001 - a private helper: without it the heads are not checked
        shape = None
    heads, dims = shape if shape is not None else (None, None)
    dtype = model.get_output_embeddings().weight.dtype
    for i, (layer, kind, kwargs) in enumerate(zip(cache.layers, types, per_layer)):
        window = getattr(layer, "sliding_window", None)
        if getattr(layer, "is_sliding", False) and (kind != SLIDING or window not in (None, kwargs["sliding_window"])):
            model_says = f"a window of {kwargs['sliding_window']}" if kind == SLIDING else "full attention"
            raise EntMTPError(
                f"cache layer {i} is a sliding-window layer{f' (window {window})' if window else ''} "
                f"where the model's layer has {model_says}: {foreign}"
            )
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor) or keys.ndim != 4:
            continue
        want_heads = heads[i] if isinstance(heads, (list, tuple)) else heads
        want_dim = dims[i] if isinstance(dims, (list, tuple)) else dims
        if want_heads not in (None, keys.shape[1]) or want_dim not in (None, keys.shape[3]):
            raise EntMTPError(
                f"cache layer {i} holds {keys.shape[1]} key/value heads of size {keys.shape[3]}; the "
                f"model's have {want_heads} of size {want_dim}: {foreign}"
            )
        if keys.dtype != dtype:
            raise EntMTPError(f"cache layer {i} holds {keys.dtype} keys and the model computes in {dtype}: {foreign}")
        if keys.shape[2] and keys.shape[0] != rows:
            raise EntMTPError(
                f"this cache holds {keys.shape[0]} rows and the call decodes {rows}: a cache continues "
                f"the batch that filled it; pass a new cache for this batch"
            )


def prepare_cache(
    model, model_kwargs: dict, max_length: int, max_nodes: int, max_cache_len: int | None = None, rows: int = 1
):
    """The cache to decode with, the caller's object (a new dynamic one when none was passed):
    dynamic layers (full or sliding, empty or filled by an earlier turn) become preallocated ones
    growing in steps up to ``max_length + max_nodes`` slots; a static cache decodes in full static
    layers with room for the last tree (:func:`lend_static`). Refuses, before any compute, what
    tree decoding cannot keep and a cache of another model or batch (:func:`check_cache`)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    if cache in _LENT:  # a call that ended in an exception never handed it back: its text is unknown
        hand_back(cache, None)
    for layer in cache.layers:
        if type(layer) not in (
            DynamicLayer,
            DynamicSlidingWindowLayer,
            StaticLayer,
            StaticSlidingWindowLayer,
            PreallocatedLayer,
        ):
            raise EntMTPError(
                f"EntMTP decoding supports transformers' dynamic and static caches of full and sliding-window "
                f"attention layers; this cache has {type(layer).__name__} layers"
            )
    check_cache(model, cache, rows)
    if isinstance(cache, StaticCache):
        lend_static(model, cache, max_length, max_nodes, max_cache_len)
    elif isinstance(cache, DynamicCache):
        preallocate(cache, max_length + max_nodes)
    return cache


#: static caches decoding runs in, and the layers of theirs it swapped out (:func:`lend_static`)
_LENT: weakref.WeakKeyDictionary[StaticCache, dict[int, StaticLayer]] = weakref.WeakKeyDictionary()


def lend_static(model, cache: StaticCache, max_length: int, max_nodes: int, max_cache_len: int | None = None) -> None:
    """Decode in ``cache`` (``model``'s StaticCache, empty or filled) through full static layers of one length.

    transformers' static sliding layer is a ring of ``sliding_window`` slots: a verified tree
    would overwrite slots its rejected nodes share with tokens still in the window, before the
    accepted path is known. A full static layer keeps every slot (the text's length in memory,
    as the full layers do) and the tree mask applies the window, so the output is the same; a
    compiled graph sees fixed shapes either way. Every layer has room for the call's longest text
    and its last tree, ``max_length + max_nodes`` slots (a batch's rows are compacted into that
    room when their trees' rejected slots fill it, :func:`compact`); a full layer that has it
    decodes in place, any other is swapped for a full layer of that length (rounded up to
    :data:`STATIC_BUCKET`, at least ``max_cache_len``) holding what it holds (a ring's tokens at
    their slots; the slots before them stay unseen, outside the window). :func:`hand_back` puts
    the caller's layers back, holding what plain ``generate`` would leave in them.

    Refuses, before any compute, a cache too small for the text plain ``generate`` would leave in
    it (``max_length - 1`` tokens, or a sliding layer's window)."""
    need = max_length - 1
    _, per_layer = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    for i, (layer, kwargs) in enumerate(zip(cache.layers, per_layer)):
        # a ring that holds its window holds all plain decoding keeps, whatever the text's length
        if layer.max_cache_len < min(need, kwargs.get("sliding_window") or need):
            raise EntMTPError(
                f"this StaticCache holds {layer.max_cache_len} tokens in layer {i} and the call's text "
                f"reaches {need} (max_length - 1): pass StaticCache(config=model.config, "
                f"max_cache_len={need}) or more, or a DynamicCache"
            )
    filled = int(cache.get_seq_length())
    full = [layer.max_cache_len for layer in cache.layers if not layer.is_sliding]
    room = max_length + max_nodes
    length = min(full) if full and min(full) >= room and len(set(full)) == 1 else None
    if length is None:
        length = max(-(-room // STATIC_BUCKET) * STATIC_BUCKET, max_cache_len or 0)
    lent = {}
    for i, own in enumerate(cache.layers):
        if own.is_sliding or own.max_cache_len != length:
            work = StaticLayer(max_cache_len=length)
            if filled:
                _copy_text(own, work, filled)
            cache.layers[i], lent[i] = work, own
    if lent:
        _LENT[cache] = lent


def _copy_text(src: StaticLayer, dst: StaticLayer, length: int) -> None:
    """Copy a text of ``length`` tokens from ``src`` into ``dst``, each holding it as plain decoding
    would: a static layer of ``max_cache_len >= length`` slots holds token ``j`` at slot ``j``; a
    smaller one (a ring, a sliding layer) the last ``max_cache_len`` tokens in order, its tensor
    count stopped at its size and its integer count at the text's length. Copies the tokens both
    can hold (a full layer filled from a ring keeps the slots before the ring's tokens unseen:
    they lie outside the window of every later token)."""
    if not dst.is_initialized:
        dst.lazy_initialization(src.keys[:, :, :0], src.values[:, :, :0])
    held_src, held_dst = min(length, src.max_cache_len), min(length, dst.max_cache_len)
    first = length - min(held_src, held_dst)  # the first token both hold
    for name in ("keys", "values"):
        getattr(dst, name)[:, :, first - (length - held_dst) : held_dst] = getattr(src, name)[
            :, :, first - (length - held_src) : held_src
        ]
    dst.cumulative_length.fill_(held_dst)
    if dst.is_sliding:
        dst.cumulative_length_int = length


def compact(cache: StaticCache, slot_index: torch.Tensor) -> torch.Tensor:
    """Move every row's seen slots (``slot_index >= 0``) to the front of a static cache, in order,
    and crop the cache to the row with the most: the room of the slots no row sees (padding, and
    the rejected nodes of a batch's shorter paths: the shared cache grows by the longest accepted
    path of any row each step). Returns the slots' text indices after the move (the tree mask and
    a sliding window read those, never a slot's place). Writes the layers' tensors in place (a
    static layer keeps its address)."""
    seen = slot_index >= 0
    order = torch.sort((~seen).to(torch.int8), dim=1, stable=True).indices  # [B, S]: seen slots first, in order
    width, length = slot_index.shape[1], int(seen.sum(dim=1).max())
    for layer in cache.layers:
        idx = order.to(layer.keys.device)[:, None, :, None]
        for t in (layer.keys, layer.values):
            t[:, :, :width] = t[:, :, :width].gather(2, idx.expand(-1, t.shape[1], -1, t.shape[3]))
    if length < width:
        cache.crop(length - width)
    return slot_index.gather(1, order)[:, :length]


def sliding_layers(cache) -> list[PreallocatedLayer]:
    """The cache's preallocated sliding-window layers (what :func:`trim_windows` trims)."""
    return [layer for layer in cache.layers if isinstance(layer, PreallocatedLayer) and layer.is_sliding]


def trim_windows(layers: list[PreallocatedLayer], slot_index: torch.Tensor, last_index: list[int]) -> None:
    """Drop the front slots of the sliding ``layers`` (:func:`sliding_layers`) that no row can
    attend to any more.

    ``slot_index`` [B, S] is the text index (:func:`slot_indices`) of every cached slot of every
    row (-1: padding, a hole, or a slot the row left unfilled), ``last_index[b]`` the text index
    of row ``b``'s last token (its next root). Row ``b`` still needs the slots at indices
    ``>= last_index[b] - window + 1``; a layer keeps everything from the first slot any row needs.
    With one row that is exactly the ``window - 1`` slots plain decoding keeps."""
    if not layers or slot_index.shape[1] == 0:
        return
    last = torch.tensor(last_index, device=slot_index.device)[:, None]
    slots = torch.arange(slot_index.shape[1], device=slot_index.device)
    for window in {layer.sliding_window for layer in layers}:
        needed = slot_index >= last - window + 1  # [B, S]
        first = torch.where(needed, slots, slot_index.shape[1]).min(dim=1).values  # per row; S when none
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


def slot_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] the text index of every slot of a (left-padded) prompt's cache; -1 where the mask is 0.

    A token's text index is its index in the row's text, padding and holes (zeros inside the
    attention mask) included: the key index transformers' masks give it in plain ``generate``'s
    cache (``kv_idx``), which is what a sliding window counts (``kv_idx > q_idx - window``), not
    the position id (:func:`prompt_positions`), which skips the zeros."""
    index = torch.arange(attention_mask.shape[-1], device=attention_mask.device).expand(attention_mask.shape)
    return index.masked_fill(attention_mask == 0, -1)


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] the position ids plain ``generate`` gives a prompt: the count of unmasked tokens
    before each slot (0 where the mask is 0); a new token's is the previous one's plus one."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def accepted_slots(
    slot_index: torch.Tensor, prefix_len: int, first_index: list[int], lengths: list[int]
) -> torch.Tensor:
    """The rows' slot text indices [B, prefix_len + K] after :func:`keep_accepted`: row ``b`` filled
    ``lengths[b]`` of the ``K = max(lengths)`` new slots, at text indices ``first_index[b]`` on,
    and never sees the others (-1)."""
    longest, device = max(lengths), slot_index.device
    offsets = torch.arange(longest, device=device)[None]
    new = torch.tensor(first_index, device=device)[:, None] + offsets
    new = new.masked_fill(offsets >= torch.tensor(lengths, device=device)[:, None], -1)
    return torch.cat([slot_index[:, :prefix_len], new], dim=1)


def additive_mask(slot_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] 0 where a slot holds a token of the row, the dtype's minimum where it never may be seen."""
    return torch.zeros(slot_index.shape, dtype=dtype, device=slot_index.device).masked_fill_(
        slot_index < 0, torch.finfo(dtype).min
    )


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep only the batch rows ``rows`` of every cache layer."""
    for layer in cache.layers:
        idx = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
