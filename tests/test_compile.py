"""Compiled verification: one graph per tree size, compiled before the first step, never while decoding.

transformers compiles the forward of plain decoding with a static cache when the device calls
for it (CUDA) or ``compile_config`` asks for it on any device; EntMTP then verifies with the
same compiled call. On this CPU with inductor, a tiny model's graph takes seconds to compile.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from tiny import VOCAB, left_padded
from transformers import CompileConfig

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.trees.tree import Tree

#: two trees of different sizes and thresholds the tiny model's confidence crosses both ways
TREES = [Tree.chain(1).choices, Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices]


def compile_config(**options) -> CompileConfig:
    config = CompileConfig(fullgraph=False, dynamic=False, backend="inductor", **({"mode": "default"} | options))
    config._compile_all_devices = True  # transformers compiles on CUDA by itself; on a CPU when asked
    return config


def _graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_verification_is_lossless_and_never_recompiles_while_decoding(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    config = EntMTPConfig(trees=TREES, tau_on=0.1, tau_off=0.09, feature="base_top1")
    prompts = [torch.randint(0, VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    static = dict(max_new_tokens=24, do_sample=False, cache_implementation="static")
    compiled_kwargs = dict(static, compile_config=compile_config(), entmtp_config=config, return_dict_in_generate=True)

    first = model.generate(prompts[0], **compiled_kwargs)
    sizes = {len(t) + 1 for t in TREES}
    assert set(first.entmtp_stats["compile_seconds"]) == sizes  # every tree size compiled up front
    after_warm_up, used = _graphs(), set()
    for ids in prompts:
        out = model.generate(ids, **compiled_kwargs)
        eager = model.generate(ids, **static, entmtp_config=config)
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(out.sequences, eager) and torch.equal(out.sequences, plain)
        used |= set(out.entmtp_stats["tree_sizes"])
        assert out.entmtp_stats["compile_seconds"] == {}  # nothing left to compile
    assert used == sizes  # the hysteresis switched between both trees
    assert _graphs() == after_warm_up  # zero recompiles after the warm-up, across the switches


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_verification_of_a_left_padded_batch_equals_plain_batched_generate(tiny_cache, arch):
    """One session for every batch size: a static cache and compiled verification with several rows,
    rows ending at different steps (stopped rows stay in the forward, verifying their root alone).
    Gemma 3's sliding layers (window 8, passed three times over) verify with their own mask."""
    model, heads = tiny_cache(arch, "hydra", "mlp")
    enable_entmtp(model, heads)
    lengths = (3, 7, 5)
    ids, mask = left_padded(lengths)
    plain_kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    free = model.generate(ids, **plain_kwargs)
    eos = [int(free[0, max(lengths) + 6])]  # ends the first row early, the others later or never
    plain_kwargs["eos_token_id"] = eos
    config = EntMTPConfig(trees=TREES, tau_on=0.1, tau_off=0.09, feature="base_top1")
    out = model.generate(
        ids,
        **plain_kwargs,
        cache_implementation="static",
        compile_config=compile_config(),
        entmtp_config=config,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, model.generate(ids, **plain_kwargs))
    assert set(out.entmtp_stats["compile_seconds"]) == {len(t) + 1 for t in TREES}
    assert set(out.entmtp_stats["live_batch_sizes"]) == {len(lengths)}


@pytest.mark.slow
def test_verification_compiled_with_frozen_weights_is_lossless(tiny_cache):
    """Inductor's freezing (the weights constants of each graph, prepacked where oneDNN takes
    them): the CPU fast path the benchmark measures as ``*-compiled-frozen``."""
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=16, do_sample=False)
    frozen = compile_config(mode=None, options={"freezing": True})
    with torch.no_grad():
        out = model.generate(
            ids,
            **kwargs,
            cache_implementation="static",
            compile_config=frozen,
            entmtp_config=EntMTPConfig(tree=TREES[1]),
        )
    assert torch.equal(out, model.generate(ids, **kwargs))


@pytest.mark.slow
def test_more_graphs_than_dynamo_compiles_are_warned_of_and_stay_lossless(tiny_cache):
    """Past ``torch._dynamo.config.recompile_limit`` a new shape of the forward runs uncompiled:
    slower, not wrong, and said once."""
    model, heads = tiny_cache("llama", "hydra", "mlp", seed=7)  # a model no other test compiled
    enable_entmtp(model, heads)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=12, do_sample=False)
    config = EntMTPConfig(trees=TREES, tau_on=0.1, tau_off=0.09, feature="base_top1")
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning, match="recompile_limit"):
        out = model.generate(
            ids, **kwargs, cache_implementation="static", compile_config=compile_config(), entmtp_config=config
        )
    assert torch.equal(out, model.generate(ids, **kwargs))


@pytest.mark.slow
def test_compiled_verification_on_a_model_with_cpu_kernels_is_lossless(tiny_cache):
    """A float32 model gets its CPU kernels from ``enable_entmtp`` (packed oneDNN copies here); compiled
    verification multiplies on them through the ``entmtp_hf::linear`` operator, eager steps directly."""
    from entmtp_hf.cpu_kernels import kernels_of

    model, heads = tiny_cache("llama", "hydra", "mlp")
    model, heads = copy.deepcopy(model).float(), copy.deepcopy(heads).float()  # the cached float64 pair stays
    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1, pack=True, gemv=False)
    assert kernels_of(model) is not None and kernels_of(model).kinds() == ["by row count", "packed"]
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=16, do_sample=False)
    config = EntMTPConfig(tree=TREES[1])
    out = model.generate(
        ids, **kwargs, cache_implementation="static", compile_config=compile_config(), entmtp_config=config
    )
    plain = model.generate(ids, **kwargs)
    assert torch.equal(out, plain) and torch.equal(model.generate(ids, **kwargs, entmtp_config=config), plain)
