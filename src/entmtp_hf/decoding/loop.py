"""The decode loop ``generate`` hands over to: prefill, then steps until a stopping criterion fires.

transformers' ``generate`` does all of its preparation (generation config, logits processors,
stopping criteria, the cache) and calls :func:`entmtp_decode` through ``custom_generate``.
The loop builds the call's :class:`~entmtp_hf.decoding.step.DecodeSession`, runs the prefill
and then :meth:`~entmtp_hf.decoding.step.DecodeSession.step` while the text is not finished,
and tells its observers what happened; the step itself never times anything. A batch of
prompts runs a :class:`~entmtp_hf.decoding.batch.BatchDecodeSession` the same way (its plan
for each live batch size from ``plan_for``); observers then get a ``BatchStepRecord`` per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..drafting.candidates import EntMTPCandidateGenerator
from ..errors import EntMTPError
from ..trees.plan import DecodePlan
from ..trees.tree import Tree
from .acceptance import greedy_picks, sample_picks
from .batch import BatchDecodeSession
from .cache import prepare_cache
from .stats import DecodeObserver, DecodeStats
from .step import DecodeSession, Rule


@dataclass
class EntMTPGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the call's EntMTP statistics."""

    entmtp_stats: dict | None = None


def acceptance_rule(config, generation_config, temperature: float = 1.0) -> Rule:
    """The call's rule: ``auto`` is greedy without sampling and exact (lossless) with it. The
    reference typical rule takes the verifier's own token by argmax even when sampling, as the
    published code does."""
    name = config.acceptance
    if name == "auto":
        name = "exact" if generation_config.do_sample else "greedy"
    if name in ("exact", "typical") and not generation_config.do_sample:
        raise EntMTPError(f"acceptance={name!r} samples: pass do_sample=True (or use acceptance='greedy')")
    if name == "greedy" and generation_config.do_sample:
        raise EntMTPError("acceptance='greedy' with do_sample=True would not sample: use 'exact' or 'typical'")
    reference = name == "typical" and config.typical_rule == "reference"
    pick = sample_picks if generation_config.do_sample and not reference else greedy_picks
    return Rule(name, pick, config.posterior_threshold, config.posterior_alpha, reference, temperature)


def precompile(session: DecodeSession, plan: DecodePlan) -> dict[int, float]:
    """Compile the verification graph of every tree size the plan can verify that this compiled
    call has not run yet: a throwaway forward per size on the root's token, its keys and values
    cropped again. Returns the seconds each new size took (mostly compiling)."""
    done = vars(session.forward).setdefault("_entmtp_tree_sizes", set())  # on the model's compiled call
    seconds, prefix_len = {}, int(session.cache.get_seq_length())
    root = session.input_ids[0, -1:]
    for n in sorted(plan.node_counts - done):
        buffers = Tree.chain(n - 1).buffers(session.device, session.dtype)  # a size's graph fits every shape
        t0 = time.perf_counter()
        session.tree_forward(root.repeat(n), buffers, prefix_len)  # contiguous, like a drafted tree
        session.cache.crop(-n)
        seconds[n] = time.perf_counter() - t0
        done.add(n)
    return seconds


def entmtp_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    entmtp_config,
    plan: DecodePlan,
    heads,
    streamer=None,
    observers: Sequence[DecodeObserver] = (),
    plan_for: Callable[[int], DecodePlan] | None = None,
    **model_kwargs,
):
    """Tree speculative decoding of one prompt or a batch (see the module docstring); ``plan_for(b)``
    is the plan for ``b`` live rows (default: ``plan`` for every batch size)."""
    if (generation_config.num_beams or 1) > 1:
        raise EntMTPError("EntMTP decoding does not support beam search")
    t_start = time.perf_counter()
    temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 1.0
    rule = acceptance_rule(entmtp_config, generation_config, temperature)
    if input_ids.shape[0] > 1:
        return _decode_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, rule,
                             entmtp_config, plan_for or (lambda b: plan), heads, observers, model_kwargs, t_start)  # fmt: skip
    drafter = EntMTPCandidateGenerator(model, heads, plan, feature_window=entmtp_config.feature_window,
                                       temperature=temperature)  # fmt: skip
    cache = prepare_cache(model, model_kwargs, generation_config.max_length, plan.max_nodes,
                          getattr(generation_config, "max_cache_len", None))  # fmt: skip
    # exactly when transformers' own generate would compile its forward (a static cache, and CUDA or compile_config)
    compiled = model._valid_auto_compile_criteria({"cache": cache}, generation_config)
    forward = model.get_compiled_call(generation_config.compile_config) if compiled else None
    session = DecodeSession(model, drafter, rule, cache, input_ids, model_kwargs.get("attention_mask"),
                            logits_processor, stopping_criteria, streamer, verify_forward=forward)  # fmt: skip
    stats = DecodeStats()
    watchers = (stats, *observers)
    for obs in watchers:
        obs.on_start(session)
    session.prefill()
    if compiled:  # every tree size's graph before the first step: no compilation while decoding
        stats.compile_seconds = precompile(session, plan)
    prefill = time.perf_counter() - t_start
    for obs in watchers:
        obs.on_prefill(prefill)
    while not session.finished:
        record = session.step()
        for obs in watchers:
            obs.on_step(record)
    if streamer is not None:
        streamer.end()
    total = time.perf_counter() - t_start
    for obs in watchers:
        obs.on_end(total)
    if generation_config.return_dict_in_generate:
        return EntMTPGenerateOutput(sequences=session.input_ids, cache=cache, entmtp_stats=stats.as_dict())
    return session.input_ids


def _decode_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, rule: Rule,
                  entmtp_config, plan_for: Callable[[int], DecodePlan], heads, observers: Sequence[DecodeObserver],
                  model_kwargs: dict, t_start: float):  # fmt: skip
    """:func:`entmtp_decode` for a batch: a :class:`~entmtp_hf.decoding.batch.BatchDecodeSession`."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and not isinstance(cache, DynamicCache):
        raise EntMTPError(
            f"EntMTP decodes a batch with a dynamic cache (rows accept different lengths); got a {type(cache).__name__}: "
            "leave cache_implementation unset"
        )
    max_nodes = max(plan_for(b).max_nodes for b in range(1, input_ids.shape[0] + 1))
    cache = prepare_cache(model, model_kwargs, generation_config.max_length, max_nodes)
    temperature = rule.temperature

    def new_drafter(plan: DecodePlan, state) -> EntMTPCandidateGenerator:
        return EntMTPCandidateGenerator(model, heads, plan, feature_window=entmtp_config.feature_window,
                                        temperature=temperature, state=state)  # fmt: skip

    pad = generation_config._pad_token_tensor
    session = BatchDecodeSession(model, plan_for, new_drafter, rule, cache, input_ids,
                                 model_kwargs.get("attention_mask"), logits_processor, stopping_criteria,
                                 pad_token_id=int(pad) if pad is not None else 0)  # fmt: skip
    sizes: list[int] = []
    for obs in observers:
        obs.on_start(session)
    session.prefill()
    prefill = time.perf_counter() - t_start
    for obs in observers:
        obs.on_prefill(prefill)
    while not session.finished:
        sizes.append(len(session.live))
        record = session.step()
        for obs in observers:
            obs.on_step(record)
    total = time.perf_counter() - t_start
    for obs in observers:
        obs.on_end(total)
    for row in session.rows:
        row.stats.prefill_time, row.stats.total_time = prefill, total
    sequences = session.sequences()
    if generation_config.return_dict_in_generate:
        rows = [row.stats.as_dict() for row in session.rows]
        stats = {"rows": rows, "steps": len(sizes), "live_batch_sizes": sizes, "total_time": total,
                 "new_tokens": sum(r["new_tokens"] for r in rows)}  # fmt: skip
        return EntMTPGenerateOutput(sequences=sequences, cache=cache, entmtp_stats=stats)
    return sequences
