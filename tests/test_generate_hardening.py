"""Config and generate reproducers: bad fields refused when built, every documented generate
feature working as in plain ``generate``, half precision on this CPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_generation import enabled, prompts
from tiny import VOCAB, fitted_heads, tiny_model
from transformers import StopStringCriteria

from entmtp_hf import ConfigError, EntMTPConfig, EntMTPError, enable_entmtp
from entmtp_hf.demo.compare import find_mismatch
from entmtp_hf.trees.tree import MC_SIM_7B_63

TREES = [[[0]], [[0], [0, 0], [1]]]


# ----------------------------------------------------------------------------- config fields
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(trees=TREES, tau_on=0.2, tau_off="0.1"), "tau_off"),
        (dict(trees=TREES * 2, policy="ladder", thresholds=0.5), "thresholds"),
        (dict(trees=TREES, policy="value", costs=["1", "2"]), r"costs\[0\]"),
        (dict(tree=[[0]], feature_window="8"), "feature_window"),
        (dict(tree=[[0]], feature_window=1.5), "feature_window"),
        (dict(tree=[[0]], feature_window=True), "feature_window"),
        (dict(trees=TREES * 2, policy="ladder", thresholds=[0.1, math.nan, 0.3]), r"thresholds\[1\]"),
        (dict(tree=[[0]], posterior_alpha=math.nan), "posterior_alpha"),
        (dict(tree=[[0]], posterior_threshold=0.0), "posterior_threshold"),
        (dict(tree=[[0]], acceptance="typical", typical_rule="medusa"), "typical_rule"),
        (dict(tree=[[0]], typical_rule="reference"), "typical_rule"),  # needs acceptance="typical"
        (dict(trees=TREES, tau_on=-0.1), "tau_on"),
        (dict(trees=TREES, tau_on=5), "tau_on"),
        (dict(trees=TREES, tau_on=math.inf), "tau_on"),
        (dict(tree="[[0]]"), "tree"),
        (dict(tree=[[0]], revision=3), "revision"),
        (dict(bank=3, task="t"), "bank"),
        (dict(bank="folder", task="../up"), "task"),
    ],
)
def test_wrong_typed_or_out_of_range_fields_are_refused_when_built(kwargs, field):
    with pytest.raises(ConfigError, match=f"EntMTPConfig.{field}"):
        EntMTPConfig(**kwargs)


def test_thresholds_in_tokens_per_step_are_accepted_for_accept_ema():
    cfg = EntMTPConfig(trees=TREES, tau_on=2.5, tau_off=1.5, feature="accept_ema")
    assert cfg.resolve(4).scheduler_args["tau_on"] == 2.5
    with pytest.raises(ConfigError, match="tau_on"):
        EntMTPConfig(trees=TREES, tau_on=9.0, feature="accept_ema")  # above depth + 1 tokens per step


def test_the_papers_policy_names_are_aliases():
    assert EntMTPConfig(trees=TREES, policy="EntMTPτ").policy == "hysteresis"
    assert EntMTPConfig(tree=[[0]], policy="EntMTP*").policy == "static"


def test_config_round_trips_through_a_dict():
    cfg = EntMTPConfig(trees=TREES, tau_on=0.3, retrieval=True)
    assert EntMTPConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown fields"):
        EntMTPConfig.from_dict({"tree": [[0]], "speed": 2})


def test_config_errors_are_value_errors_of_the_projects_type():
    with pytest.raises(ValueError) as info:
        EntMTPConfig(tree=[[0]], acceptance="fast")
    assert isinstance(info.value, EntMTPError) and info.value.field == "EntMTPConfig.acceptance"


# ----------------------------------------------------------------------------- before any forward
def test_a_rank_beyond_the_drafting_vocabulary_is_refused_before_the_prefill(tiny_cache):
    model = enabled(tiny_cache)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ConfigError, match=f"draft from {VOCAB} tokens"):
            model.generate(prompts(1)[0], max_new_tokens=4, entmtp_config=EntMTPConfig(tree=[[VOCAB]]))
    finally:
        handle.remove()
    assert calls == []


# ----------------------------------------------------------------------------- generate features
def char_tokenizer():
    """One letter per token id (a-x): stop strings are matched on the decoded text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = [chr(ord("a") + i) for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(letters)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a")


def test_repetition_penalty_with_a_left_padded_mask(tiny_cache):
    model = enabled(tiny_cache)
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompts(1)[0]], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, ids.shape[1] - 3, dtype=torch.long)], dim=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    ref = model.generate(ids, **kwargs)
    out = model.generate(ids, **kwargs, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(out, ref)


def test_stop_strings_with_a_tokenizer_stop_where_plain_generate_stops(tiny_cache):
    model = enabled(tiny_cache)
    tok = char_tokenizer()
    ids = prompts(1)[0]
    free = model.generate(ids, max_new_tokens=30, do_sample=False)
    stop = tok.decode(free[0, ids.shape[1] + 8 : ids.shape[1] + 10])  # two words the output reaches
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    ref = model.generate(ids, **kwargs)
    out = model.generate(ids, **kwargs, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(out, ref) and ref.shape[1] < free.shape[1]
    by_hand = model.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
        stopping_criteria=[StopStringCriteria(tokenizer=tok, stop_strings=[stop])],
    )
    assert torch.equal(by_hand, ref)
    with pytest.raises(EntMTPError, match="tokenizer"):
        model.generate(ids, max_new_tokens=5, stop_strings=[stop], entmtp_config=EntMTPConfig(tree=[[0]]))


# ----------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decodes_like_plain_generate_in_that_dtype(tiny_cache, arch, dtype):
    """Greedy EntMTP output equals plain ``generate`` in the same dtype; a divergence must be a
    near-tie of the base model's logits there (reported, with its gap)."""
    model64, heads64 = tiny_cache(arch, "hydra", "mlp")
    model = copy.deepcopy(model64).to(dtype)
    enable_entmtp(model, copy.deepcopy(heads64))
    assert next(model.entmtp_heads.parameters()).dtype == dtype  # heads follow the LM head's dtype
    near_ties = []
    for seed in range(6):
        ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)
        out = model.generate(ids, max_new_tokens=24, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        if not torch.equal(out, ref):
            diff = find_mismatch(ref[0, 5:].tolist(), out[0, 5:].tolist(), model, ids[0].tolist())
            near_ties.append(diff)
            scale = float(model.get_output_embeddings().weight.abs().max())  # logits are of that order
            assert abs(diff["logit_gap"]) <= 8 * torch.finfo(dtype).eps * scale * 10, diff
    if near_ties:
        print(f"{arch} {dtype}: near-ties {near_ties}")


def test_heads_fitted_in_float64_run_on_a_bfloat16_model_without_errors():
    model = tiny_model(seed=9)
    heads = fitted_heads(model, steps=5, seed=9)
    model = model.to(torch.bfloat16)
    enable_entmtp(model, heads)
    out = model.generate(
        prompts(1)[0], max_new_tokens=12, do_sample=False, entmtp_config=EntMTPConfig(tree=[[0], [0, 0]])
    )
    assert out.shape[1] == prompts(1)[0].shape[1] + 12
