"""Base-model precisions (``load_base_model(precision=...)``): fp32, bf16, and int8 weight-only through
torchao (the optional extra ``quant``; its tests skip where torchao is not installed)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import VOCAB
from transformers import AutoModelForCausalLM

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.tools.models import PRECISIONS, load_base_model, precision_kwargs
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
    and the CPU kernels leave the quantized layers to their own kernels."""
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
