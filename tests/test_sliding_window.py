"""Sliding-window and hybrid attention: every layer sees its own window, lossless far past it.

Tiny float64 models whose window (8 tokens, or 3: shorter than the trees' depth) the prompts
pass 3-5 times over: Mistral and Phi-3 (every layer sliding), Qwen2 with ``use_sliding_window``
and Gemma 3 (full and sliding layers mixed), Gemma 2 (mixed, with soft-capping). The window
counts cache slots, holes in the attention mask included, as transformers' masks do.
"""

import pytest
import torch
from test_generation import CHAIN, SAMPLING_TREE, chi_square_p, random_choices, sample_counts, target_joint
from tiny import SLIDING_ARCHS, VOCAB
from transformers import DynamicCache

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.decoding.attention import AttentionLayout, tree_inputs
from entmtp_hf.decoding.cache import (
    PreallocatedLayer,
    additive_mask,
    preallocate,
    prompt_positions,
    sliding_layers,
    slot_indices,
    trim_windows,
)
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

PAD = 0
TREES = {"chain": CHAIN, "mc_sim": MC_SIM_7B_63, "random": random_choices(2)}


def enabled(tiny_cache, arch):
    model, heads = tiny_cache(arch, "hydra", "mlp")
    return enable_entmtp(model, heads)


def window_of(model) -> int:
    return model.config.sliding_window


def long_prompts(window: int, seed: int = 4) -> list[torch.Tensor]:
    """Prompts of 3, 4 and 5 windows (no pad token inside)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, k * window), generator=g) for k in (3, 4, 5)]


@pytest.mark.parametrize("arch", list(SLIDING_ARCHS))
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_identical_to_vanilla_past_the_window(tiny_cache, arch, tree):
    model = enabled(tiny_cache, arch)
    longest = 0
    for ids in long_prompts(max(window_of(model), 8)):
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            entmtp_config=EntMTPConfig(tree=TREES[tree]),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, ref)
        longest = max(longest, max(out.entmtp_stats["accept_lengths"]))
    assert longest >= (2 if tree == "random" else 3), "the fitted heads should produce long accepted paths"


@pytest.mark.parametrize("arch", list(SLIDING_ARCHS))
def test_a_left_padded_batch_past_the_window(tiny_cache, arch):
    model = enabled(tiny_cache, arch)
    singles = long_prompts(max(window_of(model), 8), seed=6)
    width = max(p.shape[1] for p in singles)
    ids = torch.full((len(singles), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(singles):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    for tree in TREES.values():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=PAD,
            entmtp_config=EntMTPConfig(tree=tree),
        )
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
        assert torch.equal(out, plain)


class CacheWatch:
    """An observer that records, after every step, how many slots each sliding layer keeps."""

    def __init__(self) -> None:
        self.kept: list[tuple[int, list[int]]] = []

    def on_start(self, session) -> None:
        self.session = session

    def on_prefill(self, seconds: float) -> None: ...

    def on_step(self, record) -> None:
        row = self.session.rows[0]
        sliding = [layer.keys.shape[-2] for layer in self.session.cache.layers if layer.is_sliding]
        self.kept.append((row.ids.shape[1] - 1, sliding))

    def on_end(self, seconds: float) -> None: ...


@pytest.mark.parametrize("arch", ["gemma3", "mistral-window-3"])
def test_sliding_layers_hold_what_plain_decoding_holds(tiny_cache, arch):
    """After every step a sliding layer keeps the window - 1 tokens before the next root; the cache
    handed back holds the keys and values plain generate's holds."""
    model = enabled(tiny_cache, arch)
    window = window_of(model)
    ids = long_prompts(8)[0]
    watch = CacheWatch()
    out = model.generate(
        ids,
        max_new_tokens=29,
        do_sample=False,
        entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
        return_dict_in_generate=True,
        entmtp_observers=[watch],
    )
    # the last step may stop inside its path: its nodes past the end go when the cache is handed back
    assert len(watch.kept) > 2 and all(kept == [window - 1] * len(kept) for _, kept in watch.kept[:-1])
    plain = model.generate(ids, max_new_tokens=29, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    for mine, theirs in zip(out.cache.layers, plain.cache.layers):
        assert type(mine) is type(theirs) or not theirs.is_sliding
        assert mine.get_seq_length() == theirs.get_seq_length() == out.sequences.shape[1] - 1
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-9) and torch.allclose(
            mine.values, theirs.values, atol=1e-9
        )


def test_trim_windows_keeps_what_every_row_still_sees():
    from transformers import MistralConfig

    cache = preallocate(DynamicCache(config=MistralConfig(sliding_window=3, num_hidden_layers=1)), limit=32)
    assert isinstance(cache.layers[0], PreallocatedLayer) and cache.layers[0].sliding_window == 3
    keys = torch.arange(2 * 8, dtype=torch.float64).reshape(2, 1, 8, 1)
    cache.update(keys, keys + 100, 0)
    # text indices (slot_indices: padding and holes counted). Row 0: 0..7, next root at 8. Row 1: two
    # pad slots, a hole at slot 4, next root at 6 (its last two slots left unfilled by a shorter path)
    slots = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-1, -1, 2, 3, -1, 5, -1, -1]])
    # row 0 needs indices 6.., row 1 indices 4.. (the hole counts: slot 5); by position ids it would keep slot 3
    trim_windows(sliding_layers(cache), slots, [8, 6])
    layer = cache.layers[0]
    assert isinstance(layer, PreallocatedLayer) and layer.dropped == 5 and layer.get_seq_length() == 8
    assert layer.keys[0, 0, :, 0].tolist() == [5, 6, 7] and layer.get_mask_sizes(2) == (5, 5)
    cache.update(keys[:, :, :1], keys[:, :, :1], 0)  # still appends after the kept slots
    assert layer.keys[1, 0, :, 0].tolist() == [13, 14, 15, 8]


def test_the_sliding_mask_of_a_chain_is_transformers_own():
    """After prompts with left padding and holes, a chain's sliding mask is the one transformers
    builds for the same text: the window counts cache slots (kv_idx), holes included, while the
    position ids skip the holes."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    window, depth = 3, 3
    prompt = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 1], [1, 1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    rows, length, n = prompt.shape[0], prompt.shape[1], depth + 1
    positions = prompt_positions(prompt)
    assert positions[1].tolist() == [0, 1, 0, 0, 2, 0, 3, 4]  # as generate's: cumsum of the mask, 0 in the holes
    next_pos = (positions[:, -1] + 1).tolist()
    buffers = Tree.chain(depth).buffers(torch.device("cpu"), torch.float64)
    drafts = [type("D", (), {"buffers": buffers, "tokens": torch.arange(1, n + 1)})() for _ in range(rows)]
    slots = slot_indices(prompt)
    _, node_pos, full = tree_inputs(drafts, next_pos, additive_mask(slots, torch.float64), length + n)
    node_index = node_pos + (length - torch.tensor(next_pos))[:, None]  # a node's slot in plain generate's cache
    mine = AttentionLayout(window=window).masks(full, node_index, slots, 0) == 0
    text = torch.cat([prompt, torch.ones(rows, n, dtype=torch.long)], dim=1).bool()
    theirs = sdpa_mask(
        batch_size=rows,
        q_length=n,
        kv_length=length + n,
        q_offset=length,
        mask_function=sliding_window_causal_mask_function(window),
        attention_mask=text,
        local_size=window,
        allow_is_causal_skip=False,
    )
    assert torch.equal(mine, theirs)
    assert mine[1, 0, 0, 4:length].tolist() == [False, False, True, True]  # the holes take room in the window


def holed(prompt: torch.Tensor, every: int = 3) -> torch.Tensor:
    """``prompt`` with the pad token at every ``every``-th slot from the second, the last excepted:
    transformers masks those itself (generate's attention mask is ``input_ids != pad_token_id``),
    holes inside the text."""
    out = prompt.clone()
    out[:, 1:-1:every] = PAD
    return out


@pytest.mark.parametrize("arch", list(SLIDING_ARCHS))
def test_holes_in_the_attention_mask_count_inside_the_window(tiny_cache, arch):
    """The pad token inside an unpadded prompt (one row, and a left-padded batch, on dynamic and
    static caches): EntMTP counts the holes inside the window as plain ``generate`` does."""
    model = enabled(tiny_cache, arch)
    prompts = [holed(p, every) for p, every in zip(long_prompts(max(window_of(model), 8), seed=3), (3, 2, 4))]
    for ids in prompts:
        for cache in ("dynamic", "static"):
            kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD, cache_implementation=cache)
            out = model.generate(ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **kwargs)
            assert torch.equal(out, model.generate(ids, **kwargs)), (cache, ids.tolist())
    width = max(p.shape[1] for p in prompts)
    batch = torch.full((len(prompts), width), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - p.shape[1] :] = p[0]
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD, attention_mask=(batch != PAD).long())
    out = model.generate(batch, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **kwargs)
    assert torch.equal(out, model.generate(batch, **kwargs))


def test_attention_layouts():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

    assert AttentionLayout.of(LlamaConfig()) == AttentionLayout()
    assert AttentionLayout.of(MistralConfig(sliding_window=8)) == AttentionLayout(window=8, mixed=False)
    gemma = Gemma3TextConfig(sliding_window=16, num_hidden_layers=6)
    assert AttentionLayout.of(gemma) == AttentionLayout(window=16, mixed=True)
    chunked = LlamaConfig(num_hidden_layers=2)
    chunked.layer_types, chunked.attention_chunk_size = ["full_attention", "chunked_attention"], 4
    with pytest.raises(ValueError, match="chunked_attention"):
        AttentionLayout.of(chunked)


@pytest.mark.parametrize("arch", list(SLIDING_ARCHS))
def test_a_static_cache_past_the_window(tiny_cache, arch):
    """A static cache's sliding layers keep every slot (the mask applies the window): as plain."""
    model = enabled(tiny_cache, arch)
    for ids in long_prompts(max(window_of(model), 8))[:2]:
        for tree in (MC_SIM_7B_63, TREES["random"]):
            out = model.generate(
                ids,
                max_new_tokens=30,
                do_sample=False,
                cache_implementation="static",
                entmtp_config=EntMTPConfig(tree=tree),
            )
            assert torch.equal(out, model.generate(ids, max_new_tokens=30, do_sample=False))


def test_exact_sampling_preserves_distribution_past_the_window(tiny_cache):
    model = enabled(tiny_cache, "mistral-window-3")
    ids = long_prompts(3, seed=8)[1]  # 12 tokens: four windows
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n = 1000
    counts, long_paths = sample_counts(model, ids, n, entmtp_config=EntMTPConfig(tree=SAMPLING_TREE))
    assert long_paths > n // 6, "drafted tokens should often be accepted"
    assert chi_square_p(counts, probs, n) > 1e-3
