"""``entmtp-hf export-heads``: drafters written in the engines' layouts, read back by the project's own
readers of those layouts with the same outputs; what a layout cannot hold is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import VOCAB, tiny_model

from entmtp_hf.heads import EagleHeads, HeadsLoadError, HydraHeads, MedusaHeads, load_heads
from entmtp_hf.tools.cli import main
from entmtp_hf.tools.export_heads import LayoutError, export_heads
from entmtp_hf.trees.tree import Tree

DRAFT_IDS = [0, 2, 3, 5, 8, 9, 11, 13, 14, 17, 19, 23]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def randomised(heads):
    """Random weights everywhere (norm weights too), so a misplaced tensor cannot go unseen."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))
    return heads.eval()


def outputs(model, heads, length=9):
    """The heads' teacher-forced logits on one sequence of the model (every depth)."""
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, output_hidden_states=heads.hidden_states_request)
        feats = heads.features(out.hidden_states)
        return heads.forward_train(feats, ids, model.get_input_embeddings(), model.get_output_embeddings())


def chain_tokens(model, heads, depth=3):
    """The tokens the heads draft along a chain after a short prompt (target ids)."""
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, output_hidden_states=heads.hidden_states_request)
        feats = heads.features(out.hidden_states)
        state = heads.new_state(model)
        heads.observe(state, feats[0, :-1], tokens=ids[0, :-1])
        return heads.propose(state, ids[0, -1], Tree.chain(depth).buffers("cpu", torch.float32)).tokens


# ============================================================================ round trips
@pytest.mark.parametrize("layers", [[0, 1, 2], None], ids=["ascending", "default"])
def test_eagle3_with_a_pruned_vocabulary_round_trips(tmp_path, model, layers):
    heads = randomised(
        EagleHeads.for_model(model, num_heads=3, arch="eagle3", draft_vocab=DRAFT_IDS, feature_layers=layers)
    )
    out = export_heads(heads, "eagle3", tmp_path / "eagle3")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    sizes = (config["draft_vocab_size"], config["target_hidden_size"], config["vocab_size"])
    assert sizes == (len(DRAFT_IDS), 32, VOCAB)
    assert config["eagle_aux_hidden_state_layer_ids"] == sorted(heads.config.feature_layers)  # as engines concat
    assert {k for k in tensors if not k.startswith("midlayer.")} == {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    layer = {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight"}
    assert layer <= set(tensors)
    assert torch.equal(torch.arange(len(DRAFT_IDS)) + tensors["d2t"], torch.tensor(DRAFT_IDS))
    assert tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["t2d"].nonzero().flatten(), torch.tensor(DRAFT_IDS))
    again = load_heads(out)  # the published EAGLE-3 reader; the fused layers come from the config
    assert again.config.feature_layers == sorted(heads.config.feature_layers)
    assert torch.equal(again.draft_vocab, heads.draft_vocab)
    mine, theirs = outputs(model, heads), outputs(model, again)
    for a, b in zip(mine, theirs):
        if layers is not None:  # the same fc column order: the same arithmetic
            assert torch.equal(a, b)
        else:  # fc's column blocks reordered to ascending layers: equal up to the order of a float sum
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.equal(chain_tokens(model, heads), chain_tokens(model, again))


def test_eagle1_round_trips(tmp_path, model):
    heads = randomised(EagleHeads.for_model(model, num_heads=3, arch="eagle", use_base_lm_head=True))
    out = export_heads(heads, "eagle", tmp_path / "eagle")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert config["architectures"] == ["LlamaForCausalLM"] and "draft_vocab_size" not in config
    assert tensors["fc.weight"].shape == (32, 64) and "fc.bias" in tensors
    assert "layers.0.input_layernorm.weight" not in tensors and "lm_head.weight" not in tensors
    again = load_heads(out)
    assert (again.config.head_arch, again.config.use_base_lm_head) == ("eagle", True)
    # the reader drafts deeper (a published EAGLE-1 checkpoint names no depth): compare the shared depths
    for a, b in zip(outputs(model, heads), outputs(model, again)):
        assert torch.equal(a, b)
    assert torch.equal(chain_tokens(model, heads), chain_tokens(model, again))


def test_eagle1_without_fc_bias_is_written_as_the_llama3_drafters_are(tmp_path, model):
    heads = randomised(EagleHeads.for_model(model, num_heads=3, arch="eagle", use_base_lm_head=True))
    with torch.no_grad():
        heads.fc.bias.zero_()
    out = export_heads(heads, "eagle", tmp_path / "eagle")
    assert json.loads((out / "config.json").read_text())["bias"] is False
    assert "fc.bias" not in load_file(out / "model.safetensors")
    again = load_heads(out)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, heads), outputs(model, again)))


def test_medusa_round_trips(tmp_path, model):
    heads = randomised(MedusaHeads.for_model(model, num_heads=3, num_layers=2))
    out = export_heads(heads, "medusa", tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "medusa_lm_head.safetensors")
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
    assert set(tensors) == {f"{i}.{j}.linear.{w}" for i in range(3) for j in range(2) for w in ("weight", "bias")} | {
        f"{i}.2.weight" for i in range(3)
    }
    again = load_heads(out)
    assert isinstance(again, MedusaHeads) and again.config.num_heads == 3
    mine, theirs = outputs(model, heads), outputs(model, again)
    assert len(mine) == len(theirs) == 3 and all(torch.equal(a, b) for a, b in zip(mine, theirs))


# ============================================================================ refusals
def refused(heads, layout, tmp_path, match):
    with pytest.raises(LayoutError, match=match):
        export_heads(heads, layout, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_hydra_is_refused_in_every_layout(tmp_path, model):
    hydra = HydraHeads.for_model(model, num_heads=2)
    for layout in ("eagle3", "eagle", "medusa"):
        refused(hydra, layout, tmp_path, "Hydra heads are sequentially dependent")


def test_the_engines_a_drafter_serves_in_are_named_or_why_none(model):
    from entmtp_hf.tools.export_heads import serving

    eagle3 = serving(EagleHeads.for_model(model, num_heads=2, arch="eagle3", draft_vocab=DRAFT_IDS))
    assert eagle3.startswith("vLLM, SGLang, TensorRT-LLM (entmtp-hf export-heads HEADS --to eagle3)")
    pruned = serving(
        EagleHeads.for_model(model, num_heads=2, arch="eagle", draft_vocab=DRAFT_IDS, use_base_lm_head=True)
    )
    assert pruned.startswith("transformers' generate only") and "no drafting vocabulary" in pruned
    assert "sequentially dependent" in serving(HydraHeads.for_model(model, num_heads=2))


def test_what_a_layout_cannot_hold_is_refused_by_name(tmp_path, model):
    refused(MedusaHeads.for_model(model, num_heads=2, draft_vocab=DRAFT_IDS), "medusa", tmp_path, "pruned one of 12")
    refused(MedusaHeads.for_model(model, num_heads=2, use_base_lm_head=True), "medusa", tmp_path, "base model's")
    eagle3 = EagleHeads.for_model(model, num_heads=2, arch="eagle3")
    refused(eagle3, "medusa", tmp_path, "holds Medusa heads")
    refused(eagle3, "eagle", tmp_path, r"eagle drafter; these are eagle heads \(eagle3\)")
    refused(
        EagleHeads.for_model(model, num_heads=2, arch="eagle3", use_base_lm_head=True),
        "eagle3",
        tmp_path,
        "its own LM head",
    )
    refused(
        EagleHeads.for_model(model, num_heads=2, arch="eagle3", feature_layers=[1, 1, 2]),
        "eagle3",
        tmp_path,
        "fuses a hidden state twice",
    )
    refused(EagleHeads.for_model(model, num_heads=2, arch="eagle"), "eagle", tmp_path, "have their own")
    refused(
        EagleHeads.for_model(model, num_heads=2, arch="eagle", use_base_lm_head=True, draft_vocab=DRAFT_IDS),
        "eagle",
        tmp_path,
        "no drafting vocabulary",
    )
    refused(
        EagleHeads.for_model(model, num_heads=2, arch="eagle", use_base_lm_head=True, feature_layers=[0, -1]),
        "eagle",
        tmp_path,
        "fuses further base states",
    )
    refused(
        EagleHeads.for_model(model, num_heads=2, num_layers=2, arch="eagle", use_base_lm_head=True),
        "eagle",
        tmp_path,
        "2 decoder layers",
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(LayoutError, match="not empty"):
        export_heads(MedusaHeads.for_model(model, num_heads=2), "medusa", tmp_path / "full")


def test_a_bad_fused_layer_list_is_refused_naming_the_file(tmp_path, model):
    out = export_heads(EagleHeads.for_model(model, num_heads=2, arch="eagle3"), "eagle3", tmp_path / "e3")
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, "2", 3]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsLoadError, match=r"config\.json.*eagle_aux_hidden_state_layer_ids"):
        load_heads(out)


# ============================================================================ the command line
def test_cli_writes_and_refuses_in_one_line(tmp_path, model, capsys):
    heads = randomised(EagleHeads.for_model(model, num_heads=3, arch="eagle3", draft_vocab=DRAFT_IDS))
    heads.save_pretrained(tmp_path / "own")
    assert main(["export-heads", str(tmp_path / "own"), "--to", "eagle3", "--out", str(tmp_path / "e3")]) == 0
    assert "in the eagle3 layout" in capsys.readouterr().out
    assert torch.equal(chain_tokens(model, load_heads(tmp_path / "e3")), chain_tokens(model, heads))
    assert main(["export-heads", str(tmp_path / "own"), "--to", "medusa", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("entmtp-hf export-heads: error: cannot write these heads as medusa") and err.count("\n") == 1


def test_weights_are_written_as_safetensors_only(tmp_path, model):
    out = export_heads(MedusaHeads.for_model(model, num_heads=2), "medusa", tmp_path / "m")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]
