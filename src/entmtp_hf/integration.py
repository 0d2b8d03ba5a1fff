"""Tree speculative decoding inside ``model.generate``.

:func:`enable_entmtp` re-classes a loaded decoder-only model as a subclass of
:class:`EntMTPGenerationMixin` and of its own class, with the draft heads as a submodule.
``model.generate(..., entmtp_config=EntMTPConfig(...))`` then runs all of transformers'
preparation (generation config, logits processors, stopping criteria, cache) and hands
over to :func:`entmtp_decode` through ``custom_generate``. Without ``entmtp_config`` the
model generates exactly as before. ``generate(..., assistant_model=draft, eas_config=EASConfig())``
instead runs transformers' assisted decoding with the entropy-adaptive draft-model candidate
generator of :mod:`entmtp_hf.eas` (chosen through ``_get_candidate_generator``).

The decode loop, per step:
  1. draft   - the heads propose the union of the schedulable trees; the scheduler picks one;
  2. verify  - one base-model forward over the tree (4D float mask, depth positions,
               grouped key/value heads kept grouped: :mod:`entmtp_hf.attention`);
  3. accept  - greedy / exact / typical rule on the processed scores of every node;
  4. cache   - keep only the accepted path's keys and values;
  5. emit    - append the accepted tokens one by one, with streamer and stopping criteria.
"""

from __future__ import annotations

import functools
import inspect
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .decoding.attention import tree_attention
from .drafting.candidates import EntMTPCandidateGenerator
from .config import EntMTPConfig
from .scheduling.eas import ACTIVE_EAS_CALL, EASCall, EASConfig, build_candidate_generator
from .cpu_kernels import LAYOUTS_ATTR, RowLayouts, tree_forward
from .scheduling.policies import FeatureTracker
from .decoding.acceptance import (
    check_pick,
    greedy_picks,
    keep_accepted,
    sample_picks,
    tree_attention_mask,
    typical_accept_flags,
    typical_best_path,
    walk_tree,
)

HEADS_ATTR = "entmtp_heads"
# transformers' processors whose output row depends on that row's scores alone (exact types)
ROW_WISE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


@dataclass
class EntMTPGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the run's EntMTP statistics."""

    entmtp_stats: dict | None = None


@dataclass
class DecodeStats:
    """Per-run statistics, returned as data; rates are computed by the caller."""

    accept_lengths: list[int] = field(default_factory=list)  # tokens each step added
    tree_indices: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    features: list[float | None] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    forward_time: float = 0.0  # the verification forwards alone (part of verify_time)
    observe_time: float = 0.0  # the heads conditioning on accepted positions (Hydra's prefix layer; part of verify_time)
    prefill_time: float = 0.0
    total_time: float = 0.0
    eas: dict | None = None  # EAS statistics (policy ``entropy`` only)
    retrieval_steps: int = 0  # steps whose tree carried a retrieval branch
    retrieval_accepted: int = 0  # drafted tokens accepted from retrieval branches

    def as_dict(self) -> dict:
        steps = len(self.accept_lengths)
        d = {k: v for k, v in self.__dict__.items() if not (k == "eas" and v is None)}
        d["steps"] = steps
        d["new_tokens"] = sum(self.accept_lengths) + 1  # the prefill emits the first token
        d["mean_accept_length"] = sum(self.accept_lengths) / steps if steps else 0.0
        d["drafted_tokens"] = sum(n - 1 for n in self.tree_sizes)
        d["accepted_draft_tokens"] = sum(a - 1 for a in self.accept_lengths)
        return d


# ============================================================================ enabling
class EntMTPGenerationMixin:
    """Adds ``entmtp_config=`` and ``eas_config=`` to ``generate``. Mixed in ahead of the model's own class."""

    def generate(
        self, *args, entmtp_config: EntMTPConfig | None = None, eas_config: EASConfig | None = None, **kwargs
    ):
        if eas_config is not None:
            if entmtp_config is not None:
                raise ValueError(
                    "eas_config (draft-model EAS) and entmtp_config (draft heads) are exclusive; for "
                    "entropy-adaptive heads pass EntMTPConfig(tree=..., eas=EASConfig(...))"
                )
            return self._eas_generate(args, kwargs, eas_config)
        if entmtp_config is None:
            return super().generate(*args, **kwargs)
        if not isinstance(entmtp_config, EntMTPConfig):
            raise ValueError(f"entmtp_config must be an EntMTPConfig, got {type(entmtp_config).__name__}")
        if kwargs.get("custom_generate") is not None:
            raise ValueError("entmtp_config cannot be combined with custom_generate")
        heads = getattr(self, HEADS_ATTR, None)
        if heads is None:
            raise ValueError("this model has no draft heads: call enable_entmtp(model, heads) first")
        check_supported_call(args, kwargs)
        plan = entmtp_config.resolve(heads.num_heads)  # raises on bad trees/bank before compute
        loop = functools.partial(entmtp_decode, entmtp_config=entmtp_config, plan=plan, streamer=kwargs.get("streamer"))
        return super().generate(*args, custom_generate=loop, **kwargs)

    def _eas_generate(self, args: tuple, kwargs: dict, eas_config: EASConfig):
        """Assisted generation with the EAS candidate generator (see :mod:`entmtp_hf.eas`)."""
        if not isinstance(eas_config, EASConfig):
            raise ValueError(f"eas_config must be an EASConfig, got {type(eas_config).__name__}")
        if kwargs.get("assistant_model") is None:
            raise ValueError("eas_config drafts with a draft model: pass assistant_model=<draft model>")
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer", "custom_generate"):
            if kwargs.get(name) is not None:
                raise ValueError(f"eas_config cannot be combined with {name}")
        check_supported_call(args, {k: v for k, v in kwargs.items() if k != "assistant_model"})
        call = EASCall(model=self, config=eas_config)
        token = ACTIVE_EAS_CALL.set(call)
        try:
            out = super().generate(*args, **kwargs)
        finally:
            ACTIVE_EAS_CALL.reset(token)
        if call.generator is None:
            raise RuntimeError("generate did not run assisted decoding, so EAS was not used; check the call's options")
        if isinstance(out, GenerateDecoderOnlyOutput):
            fields = {k: v for k, v in out.items() if k != "entmtp_stats"}
            return EntMTPGenerateOutput(**fields, entmtp_stats={"eas": call.generator.controller.stats.as_dict()})
        return out

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' hook for assisted decoding: the EAS generator while an EAS call runs on this model."""
        call = ACTIVE_EAS_CALL.get()
        if call is None or call.model is not self:
            return super()._get_candidate_generator(*args, **kwargs)
        bound = inspect.signature(super()._get_candidate_generator).bind(*args, **kwargs)
        return build_candidate_generator(call, bound.arguments)


def check_supported_call(args: tuple, kwargs: dict) -> None:
    """Refuse modes tree decoding does not support, before any compute."""
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("EntMTP decoding needs input_ids, not inputs_embeds")
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and inputs.shape[0] != 1:
        raise ValueError(f"EntMTP decoding supports batch size 1 only, got a batch of {inputs.shape[0]}")
    for name in ("num_beams", "num_return_sequences", "num_beam_groups"):
        if (kwargs.get(name) or 1) > 1:
            raise ValueError(f"EntMTP decoding does not support {name}={kwargs[name]}")
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if kwargs.get(name) is not None:
            raise ValueError(f"EntMTP decoding cannot be combined with {name}")


@functools.lru_cache(maxsize=None)
def _entmtp_class(cls: type) -> type:
    """The subclass of ``cls`` with EntMTP generation (one per model class).

    It keeps the class's name, so code that checks model types by name (``pipeline``'s
    supported-model check) still recognises the model; ``isinstance(model,
    EntMTPGenerationMixin)`` tells an enabled model apart.
    """
    return type(cls.__name__, (EntMTPGenerationMixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def enable_entmtp(model, heads) -> Any:
    """Attach draft heads to ``model`` and give its ``generate`` the ``entmtp_config`` option.

    ``heads`` is a heads object, a local folder or a Hub repo id (project format or the
    published Hydra / Medusa ones). Returns the same model object. Calling it again replaces
    the heads.
    """
    from .heads import load_heads

    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("EntMTP supports decoder-only models; this model is an encoder-decoder")
    heads = load_heads(heads, base_config=model.config)
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to verify with")
    heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    heads.eval()
    if not isinstance(model, EntMTPGenerationMixin):
        model.__class__ = _entmtp_class(type(model))
    setattr(model, HEADS_ATTR, heads)
    plain = model._supports_logits_to_keep() and getattr(lm_head, "bias", None) is None
    kept = getattr(model, LAYOUTS_ATTR, None)
    if not (plain and kept is not None and kept.lm_head is lm_head):  # a heads swap keeps the layouts timed
        setattr(model, LAYOUTS_ATTR, RowLayouts(model) if plain else None)
    return model


def disable_entmtp(model) -> Any:
    """Undo :func:`enable_entmtp`: drop the heads and restore the model's class."""
    if isinstance(model, EntMTPGenerationMixin):
        delattr(model, HEADS_ATTR)
        delattr(model, LAYOUTS_ATTR)
        model.__class__ = next(c for c in type(model).__mro__[1:] if not issubclass(c, EntMTPGenerationMixin))
    return model


# ============================================================================ decoding
def _prepare_cache(model, model_kwargs: dict, max_length: int, max_nodes: int):
    """The cache to decode with: the prepared one, or one large enough for the last tree."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    if isinstance(cache, StaticCache):
        needed = max_length + max_nodes
        if cache.get_max_length() < needed or int(cache.get_seq_length()) > 0:
            cache = StaticCache(config=model.config, max_cache_len=needed)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, StaticLayer):
            raise ValueError(
                f"EntMTP decoding supports full-attention dynamic or static caches; "
                f"this model's cache has {type(layer).__name__} layers"
            )
    if int(cache.get_seq_length()) > 0:
        raise ValueError("EntMTP decoding starts from an empty cache; do not pass a filled cache")
    return cache


def _row_wise(logits_processor) -> bool:
    """Whether every processor reads only its row's scores (:data:`ROW_WISE_PROCESSORS`)."""
    return all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor or ())


def _process_tree_scores(logits_processor, input_ids, tokens, buffers, logits, *, row_wise: bool):
    """Apply the logits processors to every node with that node's own path as context.

    When every processor reads only its row's scores (``row_wise``: temperature, top-k,
    top-p, ...), the context does not matter and one call covers the whole tree: the
    per-depth calls cost ~1 ms each on the demo model, a few percent of a step.
    """
    scores = logits.float()
    if not logits_processor:
        return scores
    if row_wise:
        return logits_processor(input_ids.expand(scores.shape[0], -1), scores)
    out = torch.empty_like(scores)
    depths = buffers.position_ids
    for d in range(int(depths.max()) + 1):
        nodes = (depths == d).nonzero().squeeze(-1)
        path = tokens[buffers.ancestors[nodes, 1 : d + 1]]  # [n_d, d] tokens after the root
        context = torch.cat([input_ids.expand(len(nodes), -1), path], dim=-1)
        out[nodes] = logits_processor(context, scores[nodes])
    return out


def _prefix_row(attention_mask: torch.Tensor | None, length: int, device, dtype) -> torch.Tensor:
    """Additive mask row for the cached prefix (user padding stays masked)."""
    row = torch.zeros(length, dtype=dtype, device=device)
    if attention_mask is not None:
        row[: attention_mask.shape[1]].masked_fill_(attention_mask[0] == 0, torch.finfo(dtype).min)
    return row


def _model_dtype(model) -> torch.dtype:
    return model.get_output_embeddings().weight.dtype


def entmtp_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    entmtp_config: EntMTPConfig,
    plan,
    streamer=None,
    **model_kwargs,
):
    """The decode loop ``generate`` hands over to (see the module docstring)."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"EntMTP decoding supports batch size 1 only, got a batch of {input_ids.shape[0]}")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("EntMTP decoding does not support beam search")
    rule = entmtp_config.acceptance
    if rule == "auto":
        rule = "exact" if generation_config.do_sample else "greedy"
    if rule in ("exact", "typical") and not generation_config.do_sample:
        raise ValueError(f"acceptance={rule!r} samples: pass do_sample=True (or use acceptance='greedy')")
    if rule == "greedy" and generation_config.do_sample:
        raise ValueError("acceptance='greedy' with do_sample=True would not sample: use 'exact' or 'typical'")

    t_start = time.perf_counter()
    stats = DecodeStats()
    device = input_ids.device
    dtype = _model_dtype(model)
    heads = getattr(model, HEADS_ATTR)
    max_nodes = plan.max_nodes
    cache = _prepare_cache(model, model_kwargs, generation_config.max_length, max_nodes)
    attention_mask = model_kwargs.get("attention_mask")
    generator = EntMTPCandidateGenerator(
        model, heads, plan, FeatureTracker(plan.feature, entmtp_config.feature_window), device, dtype,
        temperature=float(generation_config.temperature or 1.0) if generation_config.do_sample else 1.0,
    )
    row_wise = _row_wise(logits_processor)  # decided once: the processors do not change during the call

    def pick(scores: torch.Tensor) -> torch.Tensor:
        return sample_picks(scores) if generation_config.do_sample else greedy_picks(scores)

    # 0. prefill: the prompt's cache, the first token, the heads' context
    prompt_len = input_ids.shape[1]
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        positions = torch.arange(prompt_len, device=device)[None]
    keep = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
    row_layouts = getattr(model, LAYOUTS_ATTR, None)  # this machine's faster kernels (entmtp_hf.layouts)
    with row_layouts.prefill(prompt_len) if row_layouts is not None else nullcontext():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            output_hidden_states=-1,
            **keep,
        )
    next_pos = int(positions[0, -1]) + 1
    last_logits = out.logits[0, -1:].float()
    scores = logits_processor(input_ids, last_logits)
    root = check_pick(int(pick(scores)[0]))
    generator.observe(out.hidden_states[-1][0])
    p0, entropy = generator.confidence(last_logits[0])
    # verification products by this machine's faster kernels, where the model's logits are the plain product
    layouts = row_layouts
    if layouts is not None and not layouts.matches(out.hidden_states[-1][0, -1], out.logits[0, -1]):
        layouts = None
    for n in sorted(plan.node_counts) if layouts is not None else ():
        layouts.layout(n)  # timed once per model and size, not inside a step
    stats.prefill_time = time.perf_counter() - t_start

    finished = _emit(input_ids, [root], scores, stopping_criteria, streamer)
    input_ids = finished.input_ids
    generator.extend_text(input_ids[0].tolist())
    prefix_row = _prefix_row(attention_mask, prompt_len, device, dtype)

    # the verification forwards' attention and the drafting kernels; both restored when decoding ends
    drafting = row_layouts.drafting(heads, generator.state) if row_layouts is not None else nullcontext()
    with tree_attention(model), drafting:
        while not finished.stop:
            # 1. draft
            t0 = time.perf_counter()
            cand = generator.get_candidates(input_ids[0, -1], p0, entropy)
            buffers, tokens = cand.buffers, cand.tokens
            t1 = time.perf_counter()

            # 2. verify
            prefix_len = int(cache.get_seq_length())
            kv_len = cache.get_max_length() if isinstance(cache, StaticCache) else prefix_len + buffers.num_nodes
            if prefix_row.shape[0] < prefix_len:
                prefix_row = torch.cat([prefix_row, prefix_row.new_zeros(prefix_len - prefix_row.shape[0])])
            t_forward = time.perf_counter()
            logits, hidden = tree_forward(
                model,
                layouts,
                input_ids=tokens[None],
                attention_mask=tree_attention_mask(buffers, prefix_row[:prefix_len], kv_len),
                position_ids=(buffers.position_ids + next_pos)[None],
                cache=cache,
                use_cache=True,
            )
            if device.type == "cuda":  # the accounting needs the kernels done; step 3 waits for them anyway
                torch.cuda.synchronize(device)
            stats.forward_time += time.perf_counter() - t_forward

            # 3. accept
            scores = _process_tree_scores(logits_processor, input_ids, tokens, buffers, logits, row_wise=row_wise)
            if rule == "typical":
                passed, node_logp = typical_accept_flags(
                    scores, tokens, buffers.parents, entmtp_config.posterior_threshold, entmtp_config.posterior_alpha
                )
                path = typical_best_path(passed, node_logp, buffers.retrieve_indices)
                next_token = check_pick(int(pick(scores[path[-1] : path[-1] + 1])[0]))
            else:
                host = torch.stack([tokens, pick(scores)]).tolist()
                acc = walk_tree(buffers.children, host[0], host[1])
                path, next_token = acc.path, check_pick(acc.next_token)

            # 4. cache: keep the accepted path; the heads see its hidden states
            keep_accepted(cache, prefix_len, buffers.num_nodes, path)
            t_observe = time.perf_counter()
            generator.observe(hidden[path])
            stats.observe_time += time.perf_counter() - t_observe
            p0, entropy = generator.confidence(logits[path[-1]])
            next_pos += len(path)
            t2 = time.perf_counter()

            # 5. emit the accepted drafted tokens and the verifier's own next token
            new_tokens = tokens[path[1:]].tolist() + [next_token]
            parent_scores = scores[path]
            finished = _emit(input_ids, new_tokens, parent_scores, stopping_criteria, streamer)
            input_ids = finished.input_ids
            generator.extend_text(new_tokens[: finished.count])
            if cand.branch_node is not None:
                stats.retrieval_steps += 1
                if len(path) > 1 and path[1] == cand.branch_node:
                    stats.retrieval_accepted += len(path) - 1

            stats.accept_lengths.append(finished.count)
            stats.tree_indices.append(cand.tree_index)
            stats.tree_sizes.append(buffers.num_nodes)
            stats.features.append(cand.feature)
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            generator.observe_accept(finished.count, verified=buffers.num_nodes - 1, accepted=len(path) - 1)

    if streamer is not None:
        streamer.end()
    stats.total_time = time.perf_counter() - t_start
    if generator.eas is not None:
        stats.eas = generator.eas.stats.as_dict()
    if generation_config.return_dict_in_generate:
        return EntMTPGenerateOutput(sequences=input_ids, cache=cache, entmtp_stats=stats.as_dict())
    return input_ids


@dataclass
class _Emitted:
    input_ids: torch.Tensor
    stop: bool
    count: int


def _emit(input_ids, new_tokens: list[int], scores, stopping_criteria, streamer) -> _Emitted:
    """Append tokens one at a time, stopping exactly where a stopping criterion fires.

    ``scores[i]`` are the processed scores the ``i``-th token was chosen from, handed to the
    stopping criteria as ``generate`` does.
    """
    emitted = []
    stop = False
    for i, tok in enumerate(new_tokens):
        input_ids = torch.cat([input_ids, input_ids.new_tensor([[tok]])], dim=-1)
        emitted.append(tok)
        if bool(stopping_criteria(input_ids, scores[i : i + 1]).any()):
            stop = True
            break
    if streamer is not None and emitted:
        streamer.put(torch.tensor(emitted))
    return _Emitted(input_ids, stop, len(emitted))
