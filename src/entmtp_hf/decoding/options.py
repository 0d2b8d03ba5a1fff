"""What EntMTP decoding does with every option of ``generate``: one table, checked before any compute.

transformers' ``generate`` reads a :class:`~transformers.GenerationConfig` merged from the call's
arguments, its ``generation_config=`` and ``model.generation_config`` (in that order of
precedence). EntMTP takes over only the decode loop, so each field of that merged config either
works as in plain ``generate`` (honoured), is refused before any compute with the reason
(refused), or is not read by any decoding EntMTP runs (irrelevant: beam-search and
encoder-decoder settings, metadata). :data:`GENERATION_OPTIONS` is that table for every field,
:data:`GENERATE_ARGUMENTS` for ``generate``'s other named arguments, and
:func:`check_generation_options` applies both: a field set in ``model.generation_config`` is
refused exactly like the same argument. A field this table does not know (a newer transformers)
is refused when set, so no option is ever dropped silently. ``docs/usage.md`` lists the same
classification (``tests/test_docs.py`` compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from transformers import GenerationConfig, SynthIDTextWatermarkingConfig
from transformers.generation.configuration_utils import GenerationMode

from ..errors import EntMTPError
from ..validation import brief_repr

HONOURED, REFUSED, IRRELEVANT = "honoured", "refused", "irrelevant"
#: the fields of this transformers' ``GenerationConfig`` (a model's generation config may hold
#: custom entries besides them: generate ignores those, and so does the check)
CONFIG_FIELDS = frozenset(GenerationConfig().to_dict())
#: the decoding modes EntMTP's loop stands in for (transformers' ``_sample``)
ENTMTP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


def _set(name: str) -> Callable[[Any], bool]:
    return lambda c: getattr(c, name, None) is not None


def _above(name: str, bound: float) -> Callable[[Any], bool]:
    return lambda c: (getattr(c, name, None) or 0) > bound


def _true(name: str) -> Callable[[Any], bool]:
    return lambda c: bool(getattr(c, name, None))


def _contrastive(c: Any) -> bool:
    """transformers' condition for contrastive search (``GenerationConfig.get_generation_mode``)."""
    return (c.penalty_alpha or 0) > 0 and (c.top_k or 0) > 1 and c.do_sample is not True


#: cache implementations EntMTP decodes with: transformers' dynamic cache and its static ones (a
#: static cache's sliding layers are unrolled, see :func:`~entmtp_hf.decoding.cache.unroll_static_windows`)
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "sliding_window", "hybrid", "hybrid_chunked")


@dataclass(frozen=True)
class Refusal:
    """The values of an option EntMTP refuses and why: ``when`` reads the call (:class:`Call`: the
    merged config's fields and the call's other arguments by name)."""

    when: Callable[[Any], bool]
    why: str


@dataclass(frozen=True)
class Option:
    """What EntMTP does with one option: ``treatment`` (:data:`HONOURED`, :data:`REFUSED` or
    :data:`IRRELEVANT`), ``note`` (how it is honoured, or why it is not read) and the values it
    refuses, if any (every value of a refused option that turns it on; some of an honoured one's)."""

    treatment: str
    note: str
    refusal: Refusal | None = None

    def refuses(self, call: Any) -> bool:
        return self.refusal is not None and bool(self.refusal.when(call))


def _honoured(note: str, refusal: Refusal | None = None) -> Option:
    return Option(HONOURED, note, refusal)


def _refused(when: Callable[[Any], bool], why: str) -> Option:
    return Option(REFUSED, why, Refusal(when, why))


def _irrelevant(note: str) -> Option:
    return Option(IRRELEVANT, note)


_PROCESSOR = "a logits processor: every tree node is processed with its own path as context"
_WARPER = "a sampling warper (with do_sample=True), applied to every tree node's scores"
_STOP = "the output is cut exactly where plain decoding stops"
_ASSISTED = "read only by transformers' assisted decoding (assistant_model, prompt lookup), which EntMTP replaces"
_BEAMS = "read only by beam search, which EntMTP refuses"
_ANOTHER_DECODER = (
    "is another speculative decoder; EntMTP drafts with its heads: drop it, or generate without entmtp_config to use it"
)
_REPO_MODE = (
    "is a decoding mode of its own (transformers loads it from a Hub repo); tree decoding verifies plain "
    "greedy or sampled decoding only: drop it, or generate without entmtp_config"
)

#: every field of transformers' ``GenerationConfig`` (``GenerationConfig().to_dict()``)
GENERATION_OPTIONS: dict[str, Option] = {
    # ---- length and stopping
    "max_length": _honoured(_STOP),
    "max_new_tokens": _honoured(_STOP),
    "min_length": _honoured(_PROCESSOR),
    "min_new_tokens": _honoured(_PROCESSOR),
    "max_time": _honoured("a stopping criterion, checked after each emitted token"),
    "stop_strings": _honoured(
        "with tokenizer=: a stopping criterion, checked after each emitted token",
        Refusal(
            lambda c: c.stop_strings is not None and c.tokenizer is None,
            "stop strings are matched on decoded text: pass the model's tokenizer=... to generate",
        ),
    ),
    "early_stopping": _irrelevant(_BEAMS),
    # ---- decoding mode
    "do_sample": _honoured("exact acceptance: the output's distribution is plain sampling's"),
    "num_beams": _refused(
        _above("num_beams", 1),
        "beam search keeps several hypotheses per prompt; tree decoding "
        "continues one sequence per row: drop num_beams, or generate without entmtp_config",
    ),
    "num_beam_groups": _refused(_above("num_beam_groups", 1), "group beam search " + _REPO_MODE),
    "diversity_penalty": _irrelevant("read only by group beam search, which EntMTP refuses"),
    "length_penalty": _irrelevant(_BEAMS),
    "low_memory": _irrelevant(_BEAMS),
    "constraints": _refused(_set("constraints"), "constrained beam search " + _REPO_MODE),
    "force_words_ids": _refused(_set("force_words_ids"), "constrained beam search " + _REPO_MODE),
    "penalty_alpha": _refused(_contrastive, "penalty_alpha > 0 with top_k > 1 (contrastive search) " + _REPO_MODE),
    "dola_layers": _refused(_set("dola_layers"), "DoLa decoding " + _REPO_MODE),
    "guidance_scale": _refused(
        lambda c: c.guidance_scale is not None and c.guidance_scale != 1,
        "classifier-free guidance runs an unconditional forward of the model inside its logits processor, once per "
        "emitted token; a verified tree's nodes cannot feed it: drop guidance_scale, or generate without "
        "entmtp_config",
    ),
    "token_healing": _refused(
        _true("token_healing"),
        "token healing re-tokenizes the prompt inside generate, which can change its length under its attention "
        "mask: heal it first (model.heal_tokens(input_ids, tokenizer)) and pass the healed ids",
    ),
    "use_mtp": _refused(_true("use_mtp"), "assisted decoding with the model's own MTP layers " + _ANOTHER_DECODER),
    "prompt_lookup_num_tokens": _refused(
        _set("prompt_lookup_num_tokens"), "prompt lookup decoding " + _ANOTHER_DECODER
    ),
    "assistant_early_exit": _refused(_set("assistant_early_exit"), "early-exit self-speculation " + _ANOTHER_DECODER),
    "is_assistant": _refused(
        _true("is_assistant"),
        "marks the config of an assistant model inside transformers' "
        "assisted decoding; the model EntMTP decodes with is not one: drop it",
    ),
    "num_assistant_tokens": _irrelevant(_ASSISTED),
    "num_assistant_tokens_schedule": _irrelevant(_ASSISTED),
    "assistant_confidence_threshold": _irrelevant(_ASSISTED),
    "max_matching_ngram_size": _irrelevant(_ASSISTED),
    "assistant_lookbehind": _irrelevant(_ASSISTED),
    "target_lookbehind": _irrelevant(_ASSISTED),
    "assistant_ensemble_weight": _irrelevant(_ASSISTED),
    "speculation_type": _irrelevant(_ASSISTED),
    # ---- cache and compilation
    "use_cache": _honoured("the output does not depend on it: tree verification always keeps a cache"),
    "cache_implementation": _honoured(
        "the dynamic and static caches ('dynamic', 'static'; 'sliding_window', 'hybrid', 'hybrid_chunked' are "
        "static ones); compiled verification with a static cache",
        Refusal(
            lambda c: c.cache_implementation not in CACHE_IMPLEMENTATIONS,
            "EntMTP verifies trees in transformers' dynamic and static caches on the model's device; offloaded, "
            "quantized and paged (continuous batching) caches are not kept that way: use 'dynamic' or "
            "'static'",
        ),
    ),
    "cache_config": _irrelevant("read only by cache_implementation='quantized', which EntMTP refuses"),
    "max_cache_len": _honoured("a static cache is at least this long"),
    "prefill_chunk_size": _refused(
        _set("prefill_chunk_size"),
        "EntMTP prefills the prompt in one forward (the draft heads read every prompt position's hidden state), so "
        "the bound on the prefill's memory would not hold: drop prefill_chunk_size",
    ),
    "compile_config": _honoured("compiled verification, one graph per tree size"),
    "disable_compile": _honoured("no compiled verification, as plain generate compiles nothing"),
    "continuous_batching_config": _irrelevant(
        "read only by continuous batching (generate_batch, cache_implementation='paged'), which EntMTP refuses"
    ),
    # ---- logits processors and warpers
    "temperature": _honoured(_WARPER),
    "top_k": _honoured(_WARPER),
    "top_p": _honoured(_WARPER),
    "min_p": _honoured(_WARPER),
    "top_h": _honoured(_WARPER),
    "typical_p": _honoured(_WARPER),
    "epsilon_cutoff": _honoured(_WARPER),
    "eta_cutoff": _honoured(_WARPER),
    "repetition_penalty": _honoured(_PROCESSOR),
    "encoder_repetition_penalty": _honoured(_PROCESSOR + " (on a decoder-only model it reads the prompt)"),
    "no_repeat_ngram_size": _honoured(_PROCESSOR),
    "encoder_no_repeat_ngram_size": _honoured(_PROCESSOR + " (on a decoder-only model it reads the prompt)"),
    "bad_words_ids": _honoured(_PROCESSOR),
    "renormalize_logits": _honoured(_PROCESSOR),
    "forced_bos_token_id": _honoured(_PROCESSOR),
    "forced_eos_token_id": _honoured(_PROCESSOR),
    "remove_invalid_values": _honoured(_PROCESSOR),
    "exponential_decay_length_penalty": _honoured(_PROCESSOR),
    "suppress_tokens": _honoured(_PROCESSOR),
    "begin_suppress_tokens": _honoured(_PROCESSOR),
    "sequence_bias": _honoured(_PROCESSOR),
    "watermarking_config": _honoured(
        _PROCESSOR + " (WatermarkingConfig's green lists depend on the context alone)",
        Refusal(
            lambda c: isinstance(c.watermarking_config, SynthIDTextWatermarkingConfig),
            "the SynthID watermark's processor keeps state that assumes one call per emitted token, which a "
            "verified tree does not make: use WatermarkingConfig, or generate without entmtp_config",
        ),
    ),
    # ---- outputs and special tokens
    "num_return_sequences": _honoured(
        "with sampling, k independent rows per prompt (greedy k > 1 is refused by plain generate)"
    ),
    "return_dict_in_generate": _honoured("sequences, cache and entmtp_stats"),
    "output_scores": _honoured("the processed scores each emitted token was picked from"),
    "output_logits": _honoured("the raw logits of each emitted token"),
    "output_attentions": _honoured(
        "without return_dict_in_generate, nothing is returned either way",
        Refusal(
            lambda c: bool(c.output_attentions and c.return_dict_in_generate),
            "a verified tree's attentions are not plain decoding's: drop output_attentions=True",
        ),
    ),
    "output_hidden_states": _honoured(
        "without return_dict_in_generate, nothing is returned either way",
        Refusal(
            lambda c: bool(c.output_hidden_states and c.return_dict_in_generate),
            "a verified tree's hidden states are not plain decoding's: drop output_hidden_states=True",
        ),
    ),
    "pad_token_id": _honoured("stopped rows of a batch are padded with it"),
    "bos_token_id": _honoured("as plain generate reads it (an empty prompt starts with it)"),
    "eos_token_id": _honoured(_STOP + " (lists too)"),
    "decoder_start_token_id": _irrelevant("read only by encoder-decoder models, which EntMTP refuses"),
    # ---- metadata
    "transformers_version": _irrelevant("metadata"),
    "_from_model_config": _irrelevant("metadata"),
}

#: ``generate``'s named arguments besides ``inputs`` and ``generation_config``
GENERATE_ARGUMENTS: dict[str, Option] = {
    "logits_processor": _honoured(_PROCESSOR + " (a user's own sees a batch of one row)"),
    "stopping_criteria": _honoured("checked after each emitted token"),
    "prefix_allowed_tokens_fn": _honoured(_PROCESSOR),
    "streamer": _honoured("one [B] column per new token, as plain generate streams a batch"),
    "synced_gpus": _refused(
        _true("synced_gpus"),
        "EntMTP's loop does not keep the ranks of a DeepSpeed ZeRO-3 or "
        "FSDP model in step: generate without entmtp_config there",
    ),
    "assistant_model": _refused(
        _set("assistant_model"),
        "assisted decoding with a draft model "
        + _ANOTHER_DECODER
        + " (eas_config= runs entropy-adaptive drafting with a draft model)",
    ),
    "negative_prompt_ids": _irrelevant("read only by classifier-free guidance (guidance_scale), which EntMTP refuses"),
    "negative_prompt_attention_mask": _irrelevant(
        "read only by classifier-free guidance (guidance_scale), which EntMTP refuses"
    ),
    "custom_generate": _refused(
        lambda a: callable(a.custom_generate),
        "a custom_generate callable is another decode loop; EntMTP's is one (a custom_generate "
        "repo or folder gets the whole call instead)",
    ),
}


class Call:
    """One ``generate`` call as :class:`Refusal` predicates read it: a field of the merged
    generation config, or another argument of the call, by name (None when not given)."""

    def __init__(self, config: GenerationConfig, kwargs: dict) -> None:
        self.config, self.kwargs = config, kwargs

    def __getattr__(self, name: str) -> Any:
        if name in GENERATION_OPTIONS or name in vars(self.config):
            return getattr(self.config, name, None)
        return self.kwargs.get(name)


def merged_generation_config(model, kwargs: dict) -> GenerationConfig:
    """The generation config plain ``generate`` would decode with for these arguments: ``kwargs``'
    fields over ``generation_config=`` over ``model.generation_config`` (transformers' own merge;
    the arguments are not changed)."""
    given = {k: v for k, v in kwargs.items() if k in CONFIG_FIELDS}
    config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **given)
    return config


def _source(name: str, kwargs: dict) -> str:
    """Where a field's value came from, for the error message."""
    if name in kwargs:
        return ""
    passed = kwargs.get("generation_config")
    if passed is not None and getattr(passed, name, None) is not None:
        return " (set in the generation_config passed)"
    return " (set in model.generation_config)"


def check_generation_options(model, kwargs: dict, *, allowed: tuple[str, ...] = ()) -> GenerationConfig:
    """Refuse, before any compute, every option :data:`GENERATION_OPTIONS` and
    :data:`GENERATE_ARGUMENTS` refuse for this call (``allowed``: arguments the caller handles
    itself, such as ``assistant_model`` for ``eas_config``), and any field of this transformers'
    ``GenerationConfig`` the table does not know that is set. Returns the merged config."""
    config = merged_generation_config(model, kwargs)
    call = Call(config, kwargs)
    for name, option in GENERATE_ARGUMENTS.items():
        if name not in allowed and option.refuses(call):
            raise EntMTPError(
                f"EntMTP decoding does not support {name}={brief_repr(kwargs[name])}: {option.refusal.why}"
            )
    for name, value in config.to_dict().items():
        option = GENERATION_OPTIONS.get(name)
        if option is None:
            if name in CONFIG_FIELDS and value is not None:
                raise EntMTPError(
                    f"EntMTP decoding does not know the generate option {name}={brief_repr(value)} "
                    f"of this transformers version{_source(name, kwargs)}: drop it, or generate "
                    f"without entmtp_config"
                )
        elif option.refuses(call):
            raise EntMTPError(
                f"EntMTP decoding does not support {name}={brief_repr(getattr(config, name))}"
                f"{_source(name, kwargs)}: {option.refusal.why}"
            )
    mode = config.get_generation_mode()
    if mode not in ENTMTP_MODES:  # a field above turns every other mode on: this holds the table to transformers
        raise EntMTPError(f"EntMTP decoding does not support the decoding mode {mode.value!r} these options select")
    return config
