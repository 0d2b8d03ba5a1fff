"""Every field of transformers' ``GenerationConfig``, set in turn to a random non-default value:
EntMTP's greedy output equals plain ``generate``'s token for token, or the call is refused before
any forward with an ``EntMTPError`` naming the option, as the table of
:mod:`entmtp_hf.decoding.options` says.

Each field is set two ways: as an argument with one prompt, and in ``model.generation_config``
with a left-padded batch of two (the merged config is what counts). Sampling options come with
a setting that leaves one token to draw (``top_k=1``, or the warper itself keeping one), so the
sampled output is deterministic and comparable. A field of a newer transformers that is neither
in :data:`CASES` nor in the table fails :func:`test_every_field_has_a_case` until it is classified.
"""

from __future__ import annotations

import copy
import inspect
import random
import zlib
from typing import Any, Callable

import pytest
import torch
from test_generate_hardening import char_tokenizer
from test_generation import enabled
from tiny import VOCAB
from transformers import CompileConfig, GenerationConfig, SynthIDTextWatermarkingConfig, WatermarkingConfig
from transformers.generation.utils import GenerationMixin

from entmtp_hf import EntMTPConfig, EntMTPError
from entmtp_hf.decoding.options import (
    GENERATE_ARGUMENTS,
    GENERATION_OPTIONS,
    HONOURED,
    IRRELEVANT,
    REFUSED,
    Call,
    merged_generation_config,
)
from entmtp_hf.trees.tree import MC_SIM_7B_63

Case = Callable[[random.Random], dict]
#: draws per field (each alternates the two routes)
DRAWS = 2


def _token(rng: random.Random) -> int:
    return rng.randrange(VOCAB)


def _tokens(rng: random.Random, low: int = 1, high: int = 4) -> list[int]:
    return rng.sample(range(VOCAB), rng.randint(low, high))


def _healing(tokenizer):
    """The tokenizer with the pad and bos tokens token healing needs (it re-tokenizes the prompts)."""
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    tokenizer.bos_token = tokenizer.convert_ids_to_tokens(VOCAB - 1)
    return tokenizer


def _sampled(**kwargs: Any) -> dict:
    """Sampling that leaves one token to draw: deterministic, so comparable token for token."""
    return {"do_sample": True, "top_k": 1, **kwargs}


#: every ``GenerationConfig`` field: a random non-default value, with the companions it needs
CASES: dict[str, Case] = {
    "max_length": lambda r: {"max_new_tokens": None, "max_length": r.randint(10, 20)},
    "max_new_tokens": lambda r: {"max_new_tokens": r.randint(1, 16)},
    "min_length": lambda r: {"min_length": r.randint(8, 16), "eos_token_id": _token(r)},
    "min_new_tokens": lambda r: {"min_new_tokens": r.randint(2, 10), "eos_token_id": _token(r)},
    "early_stopping": lambda r: {"early_stopping": r.choice([True, "never"])},
    "max_time": lambda r: {"max_time": r.uniform(100.0, 1000.0)},
    "stop_strings": lambda r: {
        "stop_strings": [chr(ord("a") + t) for t in _tokens(r, 2, 5)],
        "tokenizer": char_tokenizer(),
    },
    "do_sample": lambda r: _sampled(),
    "num_beams": lambda r: {"num_beams": r.randint(2, 4)},
    "use_mtp": lambda r: {"use_mtp": True},
    "use_cache": lambda r: {"use_cache": False},
    "cache_implementation": lambda r: {
        "cache_implementation": r.choice(
            ["dynamic", "static", "sliding_window", "hybrid", "offloaded", "offloaded_static", "quantized", "paged"]
        )
    },
    "cache_config": lambda r: {"cache_config": {"backend": "quanto", "nbits": r.choice([2, 4])}},
    "max_cache_len": lambda r: {"cache_implementation": "static", "max_cache_len": r.randint(40, 90)},
    "temperature": lambda r: _sampled(temperature=r.uniform(0.2, 3.0)),
    "top_k": lambda r: r.choice([_sampled(), {"top_k": r.randint(2, 12)}]),  # greedy: plain ignores it
    "top_p": lambda r: {"do_sample": True, "top_p": r.uniform(1e-9, 1e-6)},  # keeps the top token alone
    "min_p": lambda r: _sampled(min_p=r.uniform(0.01, 0.9)),
    "top_h": lambda r: _sampled(top_h=r.uniform(0.1, 0.9)),
    "typical_p": lambda r: {"do_sample": True, "typical_p": r.uniform(1e-9, 1e-6)},  # keeps one, not the top one
    "epsilon_cutoff": lambda r: {"do_sample": True, "epsilon_cutoff": r.uniform(0.5, 0.9)},  # above every prob
    "eta_cutoff": lambda r: _sampled(eta_cutoff=r.uniform(1e-4, 0.5)),
    "repetition_penalty": lambda r: {"repetition_penalty": r.uniform(0.5, 3.0)},
    "encoder_repetition_penalty": lambda r: {"encoder_repetition_penalty": r.uniform(0.5, 3.0)},
    "length_penalty": lambda r: {"length_penalty": r.uniform(-2.0, 2.0)},
    "no_repeat_ngram_size": lambda r: {"no_repeat_ngram_size": r.randint(1, 4)},
    "bad_words_ids": lambda r: {"bad_words_ids": [[t] for t in _tokens(r)] + [_tokens(r, 2, 2)]},
    "renormalize_logits": lambda r: {"renormalize_logits": True},
    "forced_bos_token_id": lambda r: {"forced_bos_token_id": _token(r)},
    "forced_eos_token_id": lambda r: {"forced_eos_token_id": _token(r)},
    "remove_invalid_values": lambda r: {"remove_invalid_values": True},
    "exponential_decay_length_penalty": lambda r: {
        "exponential_decay_length_penalty": (r.randint(1, 6), r.uniform(1.05, 2.0)),
        "eos_token_id": _token(r),
    },
    "suppress_tokens": lambda r: {"suppress_tokens": _tokens(r)},
    "begin_suppress_tokens": lambda r: {"begin_suppress_tokens": _tokens(r)},
    "sequence_bias": lambda r: {"sequence_bias": {(_token(r),): r.uniform(-8, 8), tuple(_tokens(r, 2, 2)): 4.0}},
    "token_healing": lambda r: {"token_healing": True, "tokenizer": _healing(char_tokenizer())},
    "guidance_scale": lambda r: {"guidance_scale": r.choice([1.0, r.uniform(1.1, 3.0)])},
    "watermarking_config": lambda r: {
        "watermarking_config": r.choice(
            [
                WatermarkingConfig(bias=r.uniform(1.0, 5.0), hashing_key=r.randrange(10**6)),
                SynthIDTextWatermarkingConfig(keys=_tokens(r, 2, 4), ngram_len=2),
            ]
        )
    },
    "num_return_sequences": lambda r: _sampled(num_return_sequences=r.randint(2, 3)),
    "output_attentions": lambda r: {"output_attentions": True, "return_dict_in_generate": r.random() < 0.5},
    "output_hidden_states": lambda r: {"output_hidden_states": True, "return_dict_in_generate": r.random() < 0.5},
    "output_scores": lambda r: {"output_scores": True, "return_dict_in_generate": True},
    "output_logits": lambda r: {"output_logits": True, "return_dict_in_generate": True},
    "return_dict_in_generate": lambda r: {"return_dict_in_generate": True},
    "pad_token_id": lambda r: {"pad_token_id": _token(r)},
    "bos_token_id": lambda r: {"bos_token_id": _token(r)},
    "eos_token_id": lambda r: {"eos_token_id": r.choice([_token(r), _tokens(r, 2, 3)])},
    "encoder_no_repeat_ngram_size": lambda r: {"encoder_no_repeat_ngram_size": r.randint(1, 3)},
    "decoder_start_token_id": lambda r: {"decoder_start_token_id": _token(r)},
    "is_assistant": lambda r: {"is_assistant": True},
    "num_assistant_tokens": lambda r: {"num_assistant_tokens": r.randint(1, 20)},
    "num_assistant_tokens_schedule": lambda r: {
        "num_assistant_tokens_schedule": r.choice(["heuristic_transient", "constant"])
    },
    "assistant_confidence_threshold": lambda r: {"assistant_confidence_threshold": r.uniform(0.1, 0.9)},
    "prompt_lookup_num_tokens": lambda r: {"prompt_lookup_num_tokens": r.randint(1, 10)},
    "max_matching_ngram_size": lambda r: {"max_matching_ngram_size": r.randint(1, 4)},
    "assistant_early_exit": lambda r: {"assistant_early_exit": r.randint(1, 2)},
    "assistant_lookbehind": lambda r: {"assistant_lookbehind": r.randint(1, 20)},
    "target_lookbehind": lambda r: {"target_lookbehind": r.randint(1, 20)},
    "assistant_ensemble_weight": lambda r: {"assistant_ensemble_weight": r.uniform(0.1, 0.9)},
    "speculation_type": lambda r: {"speculation_type": "dflash"},
    "compile_config": lambda r: {"compile_config": CompileConfig(fullgraph=r.random() < 0.5)},
    "disable_compile": lambda r: {"disable_compile": True},
    "continuous_batching_config": lambda r: {"continuous_batching_config": {"max_batch_tokens": r.randint(64, 512)}},
    "low_memory": lambda r: {"low_memory": True},
    "penalty_alpha": lambda r: {"penalty_alpha": r.uniform(0.1, 1.0), "top_k": r.choice([1, r.randint(2, 6)])},
    "dola_layers": lambda r: {"dola_layers": r.choice(["low", "high", [0, 1]])},
    "diversity_penalty": lambda r: {"diversity_penalty": r.uniform(0.1, 2.0)},
    "num_beam_groups": lambda r: {"num_beam_groups": 2, "num_beams": 2},
    "constraints": lambda r: {"constraints": [_tokens(r, 1, 2)]},  # transformers 5 keeps the field, not the classes
    "force_words_ids": lambda r: {"force_words_ids": [[t] for t in _tokens(r, 1, 2)]},
    "prefill_chunk_size": lambda r: {"prefill_chunk_size": r.randint(1, 4)},
    "transformers_version": lambda r: {"transformers_version": "4.0.0"},
    "_from_model_config": lambda r: {"_from_model_config": True},
}
FIELDS = list(GenerationConfig().to_dict())


def test_every_field_has_a_case():
    assert set(CASES) == set(FIELDS), "classify the new GenerationConfig fields in decoding/options.py, then here"


def test_the_table_classifies_every_field_and_argument():
    assert set(GENERATION_OPTIONS) == set(FIELDS)
    named = set(inspect.signature(GenerationMixin.generate).parameters) - {
        "self",
        "inputs",
        "generation_config",
        "kwargs",
    }
    assert set(GENERATE_ARGUMENTS) == named
    for option in [*GENERATION_OPTIONS.values(), *GENERATE_ARGUMENTS.values()]:
        assert option.treatment in (HONOURED, REFUSED, IRRELEVANT) and option.note
        assert (option.treatment == REFUSED) <= (option.refusal is not None)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    pad = int(torch.randint(1, 4, (1,), generator=g))
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def _run(model, route: str, ids, mask, fields: dict, extra: dict, **entmtp):
    """generate with ``fields`` as arguments, or set in ``model.generation_config`` (restored after)."""
    saved = copy.deepcopy(model.generation_config)
    try:
        if route == "argument":
            out = model.generate(ids, attention_mask=mask, **fields, **extra, **entmtp)
        else:
            model.generation_config.update(**fields)
            out = model.generate(ids, attention_mask=mask, **extra, **entmtp)
    finally:
        model.generation_config = saved
    return out.sequences if hasattr(out, "sequences") else out


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_works_as_in_plain_generate_or_is_refused_before_compute(tiny_cache, field):
    model = enabled(tiny_cache)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    config = EntMTPConfig(tree=MC_SIM_7B_63)
    try:
        for draw in range(DRAWS):
            rng = random.Random(zlib.crc32(f"{field}:{draw}".encode()))
            case = {"max_new_tokens": 10, "do_sample": False, **CASES[field](rng)}
            fields = {k: v for k, v in case.items() if k in FIELDS}
            extra = {k: v for k, v in case.items() if k not in FIELDS}
            route = ("argument", "model.generation_config")[draw % 2]
            ids, mask = _batch(draw)
            if route == "argument":
                ids, mask = ids[1:], mask[1:]  # one prompt
            merged = merged_generation_config(model, fields)
            refused = [name for name, option in GENERATION_OPTIONS.items() if option.refuses(Call(merged, extra))]
            calls.clear()
            if refused:
                assert field in refused, f"{field}={fields[field]!r} is refused because of {refused}"
                with pytest.raises(EntMTPError, match=f"({'|'.join(refused)})=") as info:
                    _run(model, route, ids, mask, fields, extra, entmtp_config=config)
                assert calls == [], f"{field}: refused after a forward"
                if route != "argument":
                    assert "model.generation_config" in str(info.value)
                continue
            plain = _run(model, route, ids, mask, fields, extra)
            ours = _run(model, route, ids, mask, fields, extra, entmtp_config=config)
            assert torch.equal(ours, plain), f"{field}={fields[field]!r} ({route}): EntMTP differs from plain generate"
    finally:
        handle.remove()


def test_prompt_lookup_in_the_models_generation_config_is_refused_like_the_argument(tiny_cache):
    model = enabled(tiny_cache)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.prompt_lookup_num_tokens = 3
        with pytest.raises(EntMTPError, match="prompt_lookup_num_tokens=3 .set in model.generation_config."):
            model.generate(ids, max_new_tokens=5, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    finally:
        model.generation_config = saved
    passed = GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=5)
    with pytest.raises(EntMTPError, match="prompt_lookup_num_tokens=3 .set in the generation_config passed."):
        model.generate(ids, generation_config=passed, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))


def test_a_field_the_table_does_not_know_is_refused_when_set(tiny_cache, monkeypatch):
    model = enabled(tiny_cache)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    monkeypatch.delitem(GENERATION_OPTIONS, "low_memory")  # as if a newer transformers had added it
    with pytest.raises(EntMTPError, match="does not know the generate option low_memory=True"):
        model.generate(ids, max_new_tokens=5, low_memory=True, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    model.generate(ids, max_new_tokens=5, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))  # unset: not refused


@pytest.mark.parametrize(
    "name, value",
    [("synced_gpus", True), ("custom_generate", lambda *a, **k: None), ("assistant_model", "a draft model")],
)
def test_generate_arguments_the_table_refuses_are_refused_before_compute(tiny_cache, name, value):
    model = enabled(tiny_cache)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    try:
        with pytest.raises(EntMTPError, match=name):
            model.generate(ids, max_new_tokens=5, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **{name: value})
    finally:
        handle.remove()
    assert calls == [] and GENERATE_ARGUMENTS[name].treatment == REFUSED
