"""Any device layout: a model dispatched by accelerate (offloaded layers, hooks on their forwards)
decodes with EntMTP exactly as plain generate does."""

from __future__ import annotations

import copy

import pytest
import torch
from test_generation import prompts

from entmtp_hf import EntMTPConfig, disable_entmtp, enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

accelerate = pytest.importorskip("accelerate")  # the [train] extra; installed by `make test`


def test_an_offloaded_model_decodes_like_plain_generate(tiny_cache, tmp_path):
    model64, heads = tiny_cache("llama", "hydra", "mlp")
    model = disable_entmtp(copy.deepcopy(model64))  # a plain model, as from_pretrained(device_map=...) gives
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    enable_entmtp(model, copy.deepcopy(heads))
    assert model.hf_device_map["model.layers.1"] == "disk"  # that layer's weights load from disk per forward
    for ids in prompts(2):
        ref = model.generate(ids, max_new_tokens=16, do_sample=False)
        out = model.generate(ids, max_new_tokens=16, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)
