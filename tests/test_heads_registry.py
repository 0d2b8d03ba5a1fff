"""Heads families as a registry: a family registered from outside the package in one call is saved,
loaded back by ``load_heads`` and ``enable_entmtp`` and decodes exactly as plain ``generate``; unknown
families and archs are refused naming the registered ones."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tiny import VOCAB, fitted_heads, tiny_model

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.errors import ConfigError
from entmtp_hf.heads import (
    FAMILIES,
    HEADS_REGISTRY,
    HeadsConfig,
    HeadsLoadError,
    MedusaHeads,
    load_heads,
    register_family,
)
from entmtp_hf.trees.tree import MC_SIM_7B_63

NAME = "tagged-medusa"


@dataclasses.dataclass
class TaggedConfig(HeadsConfig):
    """A family's own config class: one field the shipped families do not have."""

    trained_on: str = dataclasses.field(default="", metadata={"help": "what the heads were fitted to"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.trained_on, str):
            raise ConfigError("HeadsConfig.trained_on", f"must be a string, got {self.trained_on!r}")


class TaggedHeads(MedusaHeads):
    """Medusa heads under a family of their own."""


class OwnLayerHeads(MedusaHeads):
    """Heads a family builds from the model (as MTP heads are the model's own layers)."""


@pytest.fixture
def tagged():
    family = register_family(NAME, TaggedHeads, config_class=TaggedConfig, archs=("mlp",))
    yield family
    del FAMILIES[NAME]


def test_a_family_registered_outside_the_package_saves_loads_and_decodes_as_plain_generate(tmp_path, tagged):
    model = tiny_model()
    heads = fitted_heads(model, family=NAME)
    heads.config = dataclasses.replace(heads.config, trained_on="the model's greedy continuations")
    heads.save_pretrained(tmp_path / "heads")
    saved = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert saved["family"] == NAME and saved["trained_on"] == "the model's greedy continuations"

    loaded = load_heads(tmp_path / "heads")
    assert type(loaded) is TaggedHeads and HEADS_REGISTRY[NAME] is TaggedHeads
    assert type(loaded.config) is TaggedConfig and loaded.config == heads.config

    enable_entmtp(model, str(tmp_path / "heads"))
    assert type(model.entmtp_heads) is TaggedHeads
    g = torch.Generator().manual_seed(1)
    longest = 0
    for ids in (torch.randint(0, VOCAB, (1, n), generator=g) for n in (3, 5)):
        ref = model.generate(ids, max_new_tokens=30, do_sample=False)
        out = model.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, ref)
        longest = max(longest, max(out.entmtp_stats["accept_lengths"]))
    assert longest >= 2, "the fitted heads should have drafted accepted tokens"


def test_unknown_families_and_archs_are_refused_naming_the_registered_ones(tmp_path, tagged):
    ok = dict(family=NAME, num_heads=2, hidden_size=8, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"HeadsConfig\.family: must be one of \[.*'medusa'.*'tagged-medusa'") as e:
        HeadsConfig(**{**ok, "family": "lookahead"})
    assert all(repr(name) in str(e.value) for name in FAMILIES)
    with pytest.raises(ConfigError, match=r"HeadsConfig\.head_arch: for 'tagged-medusa' must be one of \['mlp'\]"):
        TaggedConfig(**{**ok, "head_arch": "prefix-mlp"})

    TaggedHeads.for_model(tiny_model(), num_heads=2).save_pretrained(tmp_path / "heads")
    path = tmp_path / "heads" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "family": "lookahead"}))
    refusal = r"config\.json: HeadsConfig\.family: must be one of \[.*'tagged-medusa'"
    with pytest.warns(UserWarning, match="trained_on"), pytest.raises(HeadsLoadError, match=refusal):
        load_heads(tmp_path / "heads")  # read as a plain HeadsConfig, which has no trained_on


def test_a_family_name_is_registered_once(tagged):
    with pytest.raises(ValueError, match="is taken"):
        register_family(NAME, TaggedHeads, config_class=TaggedConfig, archs=("mlp",))
    with pytest.raises(ValueError, match="not among its archs"):
        register_family("other", TaggedHeads, config_class=TaggedConfig, archs=("mlp",), layer_archs=("eagle",))
    assert "other" not in FAMILIES


def test_a_family_built_from_the_model_is_loaded_by_its_name():
    """``from_model``: heads that are a model's own layers come from the model, not from a folder."""
    model = tiny_model()
    register_family("own-layers", OwnLayerHeads, config_class=HeadsConfig, archs=("mlp",), from_model=built_from)
    try:
        with pytest.raises(ValueError, match="pass the model"):
            load_heads("own-layers")
        heads = load_heads("own-layers", model=model)
        assert type(heads) is OwnLayerHeads and heads.config.family == "own-layers"
    finally:
        del FAMILIES["own-layers"]


def built_from(model: torch.nn.Module) -> OwnLayerHeads:
    return OwnLayerHeads.for_model(model, num_heads=2)
