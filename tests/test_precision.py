"""Base-model precisions (``load_base_model(precision=...)``): fp32, bf16, and int8 weight-only through
torchao (the optional extra ``quant``; its tests skip where torchao is not installed)."""

from __future__ import annotations

import copy

import pytest
import torch
from op_calls import extension_calls
from tiny import VOCAB, tiny_model
from transformers import AutoModelForCausalLM

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf import cpu_kernels as K
from entmtp_hf import gemv as G
from entmtp_hf.decoding import precompiled
from entmtp_hf.decoding.compiled import _COMPILED_ATTR, compiled_call, compiled_generation
from entmtp_hf.heads import HydraHeads
from entmtp_hf.tools.models import PRECISIONS, int8_output_embeddings, load_base_model, precision_kwargs
from entmtp_hf.trees.tree import Tree


def test_float_precisions_are_dtypes_and_an_unknown_one_is_named():
    assert precision_kwargs("fp32") == {"dtype": torch.float32}
    assert precision_kwargs("bf16") == {"dtype": torch.bfloat16}
    with pytest.raises(ValueError, match="'fp16'.*fp32, bf16, int8"):
        precision_kwargs("fp16")
    with pytest.raises(ValueError, match="not both"):
        load_base_model("unused", dtype=torch.float32, precision="fp32")
    assert PRECISIONS == ("fp32", "bf16", "int8")


def test_int8_weight_only_verifies_losslessly(tiny_cache, tmp_path):
    """torchao's int8 weight-only linear layers loaded the Hugging Face way (``TorchAoConfig``), here with
    float32 activations: EntMTP's greedy output equals plain greedy ``generate`` on the same quantized model,
    whichever kernel this machine's measurement gives the quantized layers (torchao's or the package's)."""
    pytest.importorskip("torchao", reason="int8 needs torchao: pip install 'entmtp-hf[quant]'")
    model, heads = tiny_cache("llama", "hydra", "mlp")
    copy.deepcopy(model).float().save_pretrained(tmp_path)  # the shared float64 model stays as it is
    kwargs = precision_kwargs("int8") | {"dtype": torch.float32}
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    layer = quantized.model.layers[0].self_attn.q_proj
    assert type(layer.weight).__name__ == "Int8Tensor"
    quantized.generation_config.pad_token_id = None
    enable_entmtp(quantized, copy.deepcopy(heads).float())
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=24, do_sample=False)
    config = EntMTPConfig(tree=Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices)
    out = quantized.generate(ids, **greedy, entmtp_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, quantized.generate(ids, **greedy))
    assert out.entmtp_stats["mean_accept_length"] > 1


@pytest.mark.skipif(G.unavailable() is not None, reason=f"the package's CPU kernels are off here: {G.unavailable()}")
def test_int8_weight_only_layers_multiply_on_the_package_kernel_eager_and_compiled(tiny_cache, tmp_path, monkeypatch):
    """Where the CPU kernels choose ``gemv`` for torchao's int8 weight-only layers (bf16 activations, the
    LM head left in bf16, as ``TorchAoConfig`` loads them), eager calls multiply on the package's
    int8 kernel and compiled graphs call it as ``entmtp_hf_cpu::gemv_int8`` on the int8 values and
    scales the layers' dispatchers hold; EntMTP's greedy output equals plain ``generate`` on the same
    kernels, eager and compiled. The graphs reach no tensor subclass, so they are saved whole: a later
    process loads them, and a weight replaced after they were traced is the one they multiply by."""
    pytest.importorskip("torchao", reason="int8 needs torchao: pip install 'entmtp-hf[quant]'")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "gemv") for c in choices})
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model, heads = tiny_cache("llama", "hydra", "mlp")
    model, heads = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(heads).to(torch.bfloat16)
    int8 = Int8WeightOnlyConfig()
    quantize_(model, int8, filter_fn=lambda m, fqn: type(m) is torch.nn.Linear and fqn != "lm_head")
    assert G.int8_parts(model.model.layers[0].mlp.down_proj.weight) is not None
    assert not precompiled.plain_weights(model)  # without the kernels a graph reads the subclass: not saved
    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1)
    assert set(K.kernels_of(model).decoder.values()) == {"gemv"}
    assert precompiled.plain_weights(model)  # the graphs read the held int8 values and scales
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    greedy, fast = dict(max_new_tokens=20, do_sample=False), compiled_generation(max_cache_len=64)
    config = EntMTPConfig(tree=Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices)
    with K.kernels_of(model).applied():
        eager = model.generate(ids, **greedy)
    assert torch.equal(model.generate(ids, **greedy, entmtp_config=config), eager)
    copied = copy.deepcopy(model)
    with torch.inference_mode():  # the copy fits its kernels afresh, on weights made outside inference mode
        assert torch.equal(copied.generate(ids, **greedy, entmtp_config=config), eager)
    with K.kernels_of(model).applied():
        plain, calls = extension_calls(lambda: model.generate(ids, **greedy, **fast))
    # per layer q, k and v in one call, gate and up in one (product_groups), o and down alone
    layers = model.config.num_hidden_layers
    assert len(calls["gemv_int8_group"]) >= 2 * layers and len(calls["gemv_int8"]) >= 2 * layers
    assert {x[-2] for x in calls["gemv_int8"] + calls["gemv_int8_group"]} == {1}
    out, calls = extension_calls(lambda: model.generate(ids, **greedy, **fast, entmtp_config=config))
    assert torch.equal(out, plain) and max(x[-2] for x in calls["gemv_int8_group"]) > 1
    compiled_once = compiled_call(model, fast["compile_config"]).compile_seconds
    assert compiled_once and all(not what.endswith("loaded") for what, _ in compiled_once)

    # a new process: dynamo and the model's compiled forwards forgotten, every graph loaded from disk
    vars(model).pop(_COMPILED_ATTR)
    torch._dynamo.reset()
    assert torch.equal(model.generate(ids, **greedy, **fast, entmtp_config=config), plain)
    loaded = compiled_call(model, fast["compile_config"]).compile_seconds
    assert loaded and {what for what, _ in loaded} <= {f"{what}, loaded" for what, _ in compiled_once}

    # a weight replaced by another tensor: the traced graphs multiply by the new one, as a copy
    # compiled (here: loaded) after the replacement does
    layer = model.model.layers[0].mlp.down_proj
    source = torch.nn.Linear(layer.in_features, layer.out_features, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(source.weight, std=2.0)
    quantize_(source, int8)
    layer.weight = source.weight
    replaced = model.generate(ids, **greedy, **fast)
    fresh = copy.deepcopy(model)
    with K.kernels_of(fresh).applied():  # entering holds each layer's weight as it is now
        assert not torch.equal(replaced, plain) and torch.equal(fresh.generate(ids, **greedy, **fast), replaced)

    # trees on the widened float32 product (a measured choice at many rows): eager and compiled, EntMTP's
    # output stays plain decoding's on the same kernels
    widened, real = [], K.widened
    monkeypatch.setattr(K, "widened", lambda *a: widened.append(1) or real(*a))
    for d in K.kernels_of(model)._routes.dispatches:
        if d.int8 is not None:
            d.kernels = ["gemv", "gemv", "widened"]  # one row on gemv, two and more widened
    with K.kernels_of(model).applied():
        eager = model.generate(ids, **greedy)
    assert torch.equal(model.generate(ids, **greedy, entmtp_config=config), eager) and widened
    assert torch.equal(
        model.generate(ids, **greedy, **fast, entmtp_config=config), model.generate(ids, **greedy, **fast)
    )


@pytest.mark.skipif(G.unavailable() is not None, reason=f"the package's CPU kernels are off here: {G.unavailable()}")
def test_an_int8_lm_head_is_untied_quantized_and_drafted_from_losslessly(monkeypatch):
    """``precision="int8"`` quantizes the LM head too (:func:`int8_output_embeddings`, as llama.cpp's Q8_0
    files hold it): a tied head is untied first and the input embeddings keep their bf16 values. The CPU
    kernels take the int8 head, heads that draft from the base LM rows multiply by its int8 rows on the
    package's int8 kernel, and EntMTP's greedy output equals plain ``generate`` on the same kernels."""
    pytest.importorskip("torchao", reason="int8 needs torchao: pip install 'entmtp-hf[quant]'")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "gemv") for c in choices})
    model = tiny_model(seed=5).to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the demo model's
    model.config.tie_word_embeddings = True
    embeddings = model.model.embed_tokens.weight.detach().clone()
    torch.manual_seed(5)
    heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: type(m) is torch.nn.Linear and fqn != "lm_head")
    int8_output_embeddings(model)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert G.int8_parts(head) is not None and not model.config.tie_word_embeddings
    assert type(embed) is torch.nn.Parameter and torch.equal(embed, embeddings)
    int8_output_embeddings(model)  # quantized already: left as it is
    assert model.get_output_embeddings().weight is head

    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1)
    kernels = K.kernels_of(model)
    assert kernels is not None and set(kernels.lm_head.values()) == {"gemv"} and heads.lm_kernel == "gemv"
    products, real = [], G.gemv
    monkeypatch.setattr(G, "gemv", lambda x, w, b=None: products.append(w) or real(x, w, b))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=20, do_sample=False)
    with kernels.applied():
        plain = model.generate(ids, **greedy)
    products.clear()
    config = EntMTPConfig(tree=Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices)
    assert torch.equal(model.generate(ids, **greedy, entmtp_config=config), plain)
    drafted = [w for w in products if w is not head and w.shape == (heads.config.draft_vocab_rows, head.shape[1])]
    assert drafted and all(G.int8_parts(w) is not None for w in drafted)
