"""The decode loop ``generate`` hands over to: prefill, then steps until a stopping criterion fires.

transformers' ``generate`` does all of its preparation (generation config, logits processors,
stopping criteria, the cache) and calls :func:`entmtp_decode` through ``custom_generate``.
The loop builds the call's :class:`~entmtp_hf.decoding.session.DecodeSession` (one prompt or a
batch: its rows), runs the prefill and then
:meth:`~entmtp_hf.decoding.session.DecodeSession.step` while the text is not finished, and
tells its observers what happened; the step itself never times anything. Compilation happens
here, before the first step: the step only calls the forward it was given.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..banks.plan import AcceptanceSettings, DecodePlan
from ..drafting.drafter import Draft
from ..errors import EntMTPError
from ..trees.tree import Tree
from .acceptance import greedy_picks, sample_picks
from .cache import prepare_cache
from .compiled import CompiledForward, compiled_call
from .session import DecodeSession, Rule
from .stats import DecodeObserver, DecodeStats


@dataclass
class EntMTPGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the call's EntMTP statistics."""

    entmtp_stats: dict | None = None


def acceptance_rule(settings: AcceptanceSettings, generation_config, temperature: float = 1.0) -> Rule:
    """The call's rule: ``auto`` is greedy without sampling and exact (lossless) with it. The
    reference typical rule takes the verifier's own token by argmax even when sampling, as the
    published code does."""
    name = settings.rule
    if name == "auto":
        name = "exact" if generation_config.do_sample else "greedy"
    if name in ("exact", "typical") and not generation_config.do_sample:
        raise EntMTPError(f"acceptance={name!r} samples: pass do_sample=True (or use acceptance='greedy')")
    if name == "greedy" and generation_config.do_sample:
        raise EntMTPError("acceptance='greedy' with do_sample=True would not sample: use 'exact' or 'typical'")
    reference = name == "typical" and settings.typical_rule == "reference"
    pick = sample_picks if generation_config.do_sample and not reference else greedy_picks
    return Rule(name, pick, settings.posterior_threshold, settings.posterior_alpha, reference, temperature)


def trial_forward(session: DecodeSession, n: int) -> None:
    """A throwaway verification of ``n`` chained nodes in every live row after the cached prefix,
    its keys and values cropped again: what compiles a tree size's graph, and what the cost probe
    times (:mod:`entmtp_hf.calibration.probe`)."""
    buffers = Tree.chain(n - 1).buffers(session.device, session.dtype)  # a size's graph fits every shape
    drafts = [Draft(0, row.ids[0, -1:].repeat(n), buffers, None) for row in session.live]
    session.tree_forward(drafts, int(session.cache.get_seq_length()))  # contiguous, like a drafted tree
    session.cache.crop(-n)


def _recompile_limit() -> int | None:
    """dynamo's graphs per compiled function (None where this torch hides or lacks the setting)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        try:
            return int(getattr(config, name))
        except (AttributeError, TypeError, ValueError):
            continue
    return None


def precompile(session: DecodeSession, forward: CompiledForward) -> dict[int, float]:
    """Compile the verification graph of every tree size the session's plan can verify that
    ``forward`` (the session's compiled call) has not run yet at this batch size
    (:func:`trial_forward`). Returns the seconds each new size took (mostly compiling). A compiled
    call has a static cache, which keeps every row: the batch size and plan stay."""
    done = forward.verify_shapes
    rows = len(session.live)
    seconds = {}
    todo = [n for n in sorted(session.plan.node_counts) if (rows, n) not in done]
    graphs, limit = len(done) + len(todo) + 1, _recompile_limit()  # one per (rows, size), and plain decoding's
    # past dynamo's limit a new shape runs eagerly; saved graphs are compiled one by one, without it
    if todo and limit and graphs > limit and not forward.warned_limit and not forward.saves_graphs:
        warnings.warn(
            f"entmtp-hf: compiled verification needs {graphs} graphs of the model's forward "
            f"(one per batch size and tree size, and plain decoding's), more than torch._dynamo.config."
            f"recompile_limit ({limit}): the shapes beyond it run uncompiled; raise the limit to compile "
            f"them all",
            stacklevel=2,
        )
        forward.warned_limit = True
    for n in todo:
        t0 = time.perf_counter()
        trial_forward(session, n)
        seconds[n] = time.perf_counter() - t0
        done.add((rows, n))
    return seconds


def open_session(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    plan: DecodePlan,
    heads,
    streamer=None,
    plan_for: Callable[[int], DecodePlan] | None = None,
    **model_kwargs,
) -> DecodeSession:
    """The session of one call (its cache, acceptance rule, drafter and verification forward: the
    compiled call exactly when transformers' own generate would compile), before its prefill.
    Everything the call's ``EntMTPConfig`` says comes in its plans (``plan``, ``plan_for``)."""
    # the call's options were checked before generate ran (decoding.options: beam search, outputs it cannot return)
    if input_ids.shape[-1] == 0:
        raise EntMTPError(
            "input_ids is empty: EntMTP decoding continues a prompt of at least one token (plain "
            "generate cannot decode an empty one either); pass one, such as the tokenizer's BOS token"
        )
    returns = bool(generation_config.return_dict_in_generate)
    temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 1.0
    rule = acceptance_rule(plan.acceptance, generation_config, temperature)
    plan_for = plan_for or (lambda b: plan)
    plans = [plan_for(b) for b in range(1, input_ids.shape[0] + 1)]
    cache = prepare_cache(
        model,
        model_kwargs,
        generation_config.max_length,
        max(p.max_nodes for p in plans),
        getattr(generation_config, "max_cache_len", None),
        rows=input_ids.shape[0],
    )
    compiled = model._valid_auto_compile_criteria({"cache": cache}, generation_config)
    # the package's compiled forward (what the EntMTP mixin's get_compiled_call gives plain generate)
    forward = compiled_call(model, generation_config.compile_config) if compiled else None

    pad = getattr(generation_config, "_pad_token_tensor", None)
    return DecodeSession(
        model,
        heads,
        plan_for,
        rule,
        cache,
        input_ids,
        model_kwargs.get("attention_mask"),
        logits_processor,
        stopping_criteria,
        pad_token_id=int(pad) if pad is not None else 0,
        max_length=generation_config.max_length,
        streamer=streamer,
        verify_forward=forward,
        keep_scores=returns and bool(generation_config.output_scores),
        keep_logits=returns and bool(generation_config.output_logits),
    )


def entmtp_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    plan: DecodePlan,
    heads,
    streamer=None,
    observers: Sequence[DecodeObserver] = (),
    plan_for: Callable[[int], DecodePlan] | None = None,
    **model_kwargs,
):
    """Tree speculative decoding of one prompt or a batch (see the module docstring); ``plan_for(b)``
    is the plan for ``b`` rows in the forward (default: ``plan`` for every batch size)."""
    t_start = time.perf_counter()
    session = open_session(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        plan=plan,
        heads=heads,
        streamer=streamer,
        plan_for=plan_for,
        **model_kwargs,
    )
    stats = DecodeStats()
    watchers = (stats, *observers)
    for obs in watchers:
        obs.on_start(session)
    session.prefill()
    if isinstance(session.forward, CompiledForward) and not session.finished:  # every tree size's graph first
        stats.compile_seconds = precompile(session, session.forward)  # none compiles mid-decode
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
    sequences = session.sequences()
    cache = session.release_cache()  # the caller's next turn may continue from it
    if generation_config.return_dict_in_generate:
        return EntMTPGenerateOutput(
            sequences=sequences,
            cache=cache,
            entmtp_stats=stats.as_dict(),
            scores=session.per_token("scores") if session.keep_scores else None,
            logits=session.per_token("logits") if session.keep_logits else None,
        )
    return sequences
