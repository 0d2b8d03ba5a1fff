"""Draft heads as Hub artefacts: save / push / pull with their card, pinned revisions, foreign files refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hub_standin import MiniHubServer, fake_cache
from huggingface_hub import ModelCard, ModelHubMixin
from huggingface_hub import constants as hf_constants
from safetensors.torch import save_file
from tiny import tiny_model
from transformers import LlamaConfig

from entmtp_hf import enable_entmtp
from entmtp_hf.banks.bank import published_defaults_bank
from entmtp_hf.errors import ConfigError, FileFormatError
from entmtp_hf.heads import (
    DataSource,
    DraftHeads,
    HeadsCard,
    HeadsLoadError,
    HydraHeads,
    MedusaHeads,
    TokensPerStep,
    load_heads,
)

CARD = HeadsCard(
    training_data=(DataSource("distill", 1000, 50, "the base model's own answers"),),
    recipe="Distillation from the frozen base model.",
    command="entmtp-hf train-heads --family hydra",
    validation_top1=(0.61, 0.48),
    tokens_per_step=(
        TokensPerStep("mc_sim_7b_63", 3.19, 4, 64, "greedy"),
        TokensPerStep("my-banks/chat static tree (4 nodes)", 1.62, 20, 128, "greedy"),
    ),
    hardware="AMD EPYC, 2 cores, torch threads 1",
)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_heads(model, seed: int = 0, card: HeadsCard = CARD, cls=HydraHeads) -> DraftHeads:
    torch.manual_seed(seed)
    heads = cls.for_model(model, num_heads=2).float()  # what loading builds, so load -> save is byte-identical
    heads.config.base_model_name_or_path = "org/tiny-base"
    heads.card = card
    return heads


def same_weights(a: DraftHeads, b: DraftHeads) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


# ----------------------------------------------------------------------------- folders and cards
def test_save_writes_the_card_and_a_model_card_readme(tmp_path, model):
    heads = make_heads(model)
    assert isinstance(heads, ModelHubMixin)
    heads.save_pretrained(tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a")) == ["README.md", "card.json", "config.json", "model.safetensors"]
    readme = ModelCard.load(tmp_path / "a" / "README.md")
    assert readme.data.library_name == "entmtp-hf" and readme.data.base_model == "org/tiny-base"
    assert {"entmtp-hf", "speculative-decoding", "hydra"} <= set(readme.data.tags)
    assert readme.data.to_dict().get("pipeline_tag") is None  # heads alone generate nothing
    text = readme.text
    for expected in (
        "| distill | 1000 | 50 |",
        "| 0 | t+2 | 0.61 |",
        "| 1 | t+3 | 0.48 |",
        "| mc_sim_7b_63 | 3.19 |",
        "| my-banks/chat static tree (4 nodes) | 1.62 |",
        "AMD EPYC, 2 cores",
        "enable_entmtp(model",
        "entmtp-hf train-heads --family hydra",
    ):
        assert expected in text, expected
    loaded = DraftHeads.from_pretrained(tmp_path / "a")
    assert loaded.card == CARD and loaded.name_or_path == str(tmp_path / "a") and same_weights(heads, loaded)
    loaded.save_pretrained(tmp_path / "b")  # load -> save keeps the figures and the text
    for name in ("card.json", "README.md", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_a_card_without_figures_says_so_and_a_local_base_is_no_hub_id(tmp_path, model):
    heads = make_heads(model, card=HeadsCard(), cls=MedusaHeads)
    heads.config.base_model_name_or_path = "/models/local-base"
    heads.save_pretrained(tmp_path)
    readme = ModelCard.load(tmp_path / "README.md")
    assert readme.data.base_model is None and "medusa" in readme.data.tags
    assert "No training record or measured figures" in readme.text and "## Validation" not in readme.text
    assert json.loads((tmp_path / "card.json").read_text()) == {"card_version": 1}
    assert DraftHeads.from_pretrained(tmp_path).card == HeadsCard()


def test_heads_saved_without_a_card_load_with_an_empty_one(tmp_path, model):
    make_heads(model).save_pretrained(tmp_path)
    (tmp_path / "card.json").unlink()
    assert DraftHeads.from_pretrained(tmp_path).card == HeadsCard()


def test_the_card_is_validated_when_built():
    assert HeadsCard.from_dict(CARD.to_dict()) == CARD
    assert HeadsCard(tokens_per_step=[{"tree": "chain-4", "value": 2}]).tokens_per_step[0].value == 2.0
    for build, field in [
        (lambda: HeadsCard(validation_top1=[0.5, 1.2]), r"HeadsCard.validation_top1\[1\]"),
        (lambda: HeadsCard(validation_top1="0.5"), "HeadsCard.validation_top1"),
        (lambda: HeadsCard(tokens_per_step=[TokensPerStep("t", 0.5)]), "HeadsCard.tokens_per_step.value"),
        (lambda: HeadsCard(tokens_per_step=[{"tree": "t"}]), r"tokens_per_step\[0\]: lacks the fields \['value'\]"),
        (lambda: HeadsCard(training_data=[{"name": "x", "rows": 3}]), "unknown fields"),
        (lambda: HeadsCard(training_data=[DataSource("")]), "HeadsCard.training_data.name"),
        (lambda: HeadsCard(training_data=[DataSource("x", train_tokens=-1)]), "train_tokens"),
        (lambda: HeadsCard(recipe=3), "HeadsCard.recipe"),
        (lambda: HeadsCard(hardware="x" * 9000), "HeadsCard.hardware"),
        (lambda: HeadsCard.from_dict({"card_version": 2}), "card_version"),
        (lambda: HeadsCard.from_dict({"card_version": 1, "speedup": 2}), "unknown fields"),
    ]:
        with pytest.raises(ConfigError, match=field):
            build()


def test_save_refuses_figures_for_another_number_of_heads(tmp_path, model):
    heads = make_heads(model, card=HeadsCard(validation_top1=(0.5, 0.4, 0.3)))
    with pytest.raises(ConfigError, match="3 values for 2 heads"):
        heads.save_pretrained(tmp_path)


# ----------------------------------------------------------------------------- the Hub
def test_push_to_and_pull_from_the_hub_with_the_card(mini_hub: MiniHubServer, model):
    heads = make_heads(model)
    info = heads.push_to_hub("org/name", token="hf_test")
    assert info.oid == mini_hub.refs["main"]
    assert sorted(mini_hub.files) == ["README.md", "card.json", "config.json", "model.safetensors"]
    pulled = DraftHeads.from_pretrained("org/name", token="hf_test")
    assert same_weights(heads, pulled) and pulled.card == CARD and pulled.name_or_path == "org/name"
    assert "| 0 | t+2 | 0.61 |" in mini_hub.files["README.md"].decode()


def test_a_revision_pins_the_weights_it_names(mini_hub: MiniHubServer, model, tmp_path):
    first, second = make_heads(model, seed=1), make_heads(model, seed=2, card=HeadsCard(hardware="another machine"))
    first.push_to_hub("org/name", token="hf_test")
    pinned = mini_hub.refs["main"]
    second.save_pretrained(tmp_path / "second", push_to_hub=True, repo_id="org/name", token="hf_test")  # save and push
    assert mini_hub.refs["main"] != pinned and not same_weights(first, second)
    assert same_weights(DraftHeads.from_pretrained("org/name"), second)
    old = DraftHeads.from_pretrained("org/name", revision=pinned)
    assert same_weights(old, first) and old.card == CARD
    assert same_weights(load_heads("org/name", pinned), first)
    enable_entmtp(model, "org/name", revision=pinned)
    assert same_weights(first, model.entmtp_heads)
    with pytest.raises(HeadsLoadError, match="has no revision 'nosuch'"):
        DraftHeads.from_pretrained("org/name", revision="nosuch")


def test_the_offline_cache_serves_heads_with_their_card(tmp_path, model, monkeypatch):
    make_heads(model).save_pretrained(tmp_path / "src")
    commit = fake_cache(tmp_path / "hub", tmp_path / "src")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    for revision in (None, commit):
        assert DraftHeads.from_pretrained("org/name", revision).card == CARD
    assert DraftHeads.from_pretrained("org/name", local_files_only=True).card == CARD


# ----------------------------------------------------------------------------- foreign files
def _bank_file(folder: Path) -> None:
    bank_file = published_defaults_bank().save_pretrained(folder / "bank")
    os.replace(bank_file, folder / "model.safetensors")


FOREIGN = {
    "a bank file as the weights": ("model.safetensors", _bank_file, "this is an entmtp-hf topology bank"),
    "a random safetensors as the weights": (
        "model.safetensors",
        lambda d: save_file({"weight": torch.zeros(3, 3)}, d / "model.safetensors"),
        r"holds none of the heads' tensors \(it has weight\)",
    ),
    "a transformers config": (
        "config.json",
        lambda d: LlamaConfig(hidden_size=32).to_json_file(d / "config.json"),
        "not a draft-heads config .*config of a transformers model .*'llama'",
    ),
    "another library's config": (
        "config.json",
        lambda d: (d / "config.json").write_text('{"hidden_size": 32}'),
        "not a draft-heads config",
    ),
    "a card that is not JSON": ("card.json", lambda d: (d / "card.json").write_text("{oops"), "JSON"),
    "a card of other heads": (
        "card.json",
        lambda d: (d / "card.json").write_text('{"card_version": 1, "validation_top1": [0.5, 0.4, 0.3]}'),
        "3 values for 2 heads",
    ),
    "a card with unknown fields": (
        "card.json",
        lambda d: (d / "card.json").write_text('{"card_version": 1, "speedup": 3}'),
        r"HeadsCard: unknown fields \['speedup'\]",
    ),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_corrupt_or_foreign_file_is_refused_naming_it(tmp_path, model, case):
    name, plant, message = FOREIGN[case]
    make_heads(model).save_pretrained(tmp_path)
    plant(tmp_path)
    with pytest.raises(HeadsLoadError, match=message) as err:
        DraftHeads.from_pretrained(tmp_path)
    assert isinstance(err.value, FileFormatError) and err.value.path == str(tmp_path / name)
    assert str(err.value).startswith(f"{tmp_path / name}: ")
