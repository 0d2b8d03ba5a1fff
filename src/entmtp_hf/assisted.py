"""Entropy-adaptive speculation with a draft model, through transformers' assisted decoding.

``model.generate(..., assistant_model=draft, eas_config=EASConfig())`` on a model enabled with
:func:`~entmtp_hf.enable_entmtp` runs transformers' own assisted decoding with
:class:`EntropyAdaptiveCandidateGenerator`: the draft model proposes a chain token by token and
the EAS rule (:mod:`entmtp_hf.scheduling.eas`) halts it where the drafter is unsure.
transformers verifies the chain (greedy: identical output; sampling: speculative sampling,
distribution-preserving because the drafted tokens are drawn from the returned logits and the
halting rule only reads the drafter's side). This path is separate from the draft heads' tree
decoding (:mod:`entmtp_hf.decoding`).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList, MinLengthLogitsProcessor

from .decoding.acceptance import check_pick, sample_picks
from .scheduling.eas import EASConfig, EASController, entropy_nats


class EntropyAdaptiveCandidateGenerator(CandidateGenerator):
    """Drafts a chain with a draft model, token by token on its own KV cache, halting by EAS.

    The draft model must share the target's vocabulary (same logits width). Drafted tokens
    are the argmax (greedy) or a sample (``do_sample``) of the draft's scores after the call's
    logits processors; those scores are returned as the candidate logits, which is what
    transformers' speculative sampling needs to stay lossless.
    """

    def __init__(
        self,
        input_ids: torch.LongTensor,
        assistant_model,
        generation_config,
        model_kwargs: dict,
        logits_processor=None,
        controller: EASController | None = None,
    ) -> None:
        if input_ids.shape[0] != 1:
            raise ValueError(f"EAS drafting supports batch size 1 only, got {input_ids.shape[0]}")
        self.draft = assistant_model
        self.device = assistant_model.device
        self.controller = controller if controller is not None else EASController(EASConfig())
        self.cache = DynamicCache(config=assistant_model.config)
        self.cached = torch.empty(0, dtype=torch.long, device=self.device)  # tokens whose keys are cached
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        # min-length forcing is the target's business; like transformers' assistant, skip it
        self.logits_processor = LogitsProcessorList(
            p for p in (logits_processor or []) if not isinstance(p, MinLengthLogitsProcessor)
        )
        mask = model_kwargs.get("attention_mask")
        self.prompt_mask = mask.to(self.device) if mask is not None else None
        self.last_proposed = 0

    def _mask_and_positions(self, total: int, new: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.prompt_mask is None:
            return None, torch.arange(total - new, total, device=self.device)[None]
        extra = total - self.prompt_mask.shape[1]
        mask = torch.cat([self.prompt_mask, self.prompt_mask.new_ones(1, extra)], dim=-1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return mask, positions[:, total - new :]

    @torch.no_grad()
    def _next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft logits after ``ids`` [L]: reuse the cached common prefix, feed the rest."""
        n = min(self.cached.numel(), ids.numel() - 1)
        same = self.cached[:n] == ids[:n]
        keep = n if bool(same.all()) else int(same.long().argmin())
        if self.cached.numel() > keep:
            self.cache.crop(-(self.cached.numel() - keep))
        mask, positions = self._mask_and_positions(ids.numel(), ids.numel() - keep)
        out = self.draft(
            input_ids=ids[None, keep:], attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True
        )
        self.cached = ids.clone()
        return out.logits[0, -1].float()

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft until the EAS rule halts; returns ``(input_ids + chain, chain scores or None)``."""
        ids = input_ids[0].to(self.device)
        rule = self.controller.start_chain(limit=self.max_length - ids.numel() - 1)
        drafted, scores, entropies, cause = [], [], [], None
        while True:
            cause = rule.cause_at(len(drafted))  # length limits first: no draft forward past them
            if cause is not None:
                break
            logits = self._next_logits(torch.cat([ids, ids.new_tensor(drafted)]))
            entropy = float(entropy_nats(logits))
            entropies.append(entropy)
            cause = rule.cause_at(len(drafted), entropy)
            if cause is not None:
                break
            context = torch.cat([ids, ids.new_tensor(drafted)])[None]
            step_scores = self.logits_processor(context, logits[None])
            if self.do_sample:
                token = check_pick(int(sample_picks(step_scores)[0]))
            else:
                token = int(step_scores[0].argmax())
            drafted.append(token)
            scores.append(step_scores[0])
        self.controller.finish_chain(rule, len(drafted), cause, entropies)
        self.last_proposed = len(drafted)
        if not drafted:
            return input_ids, None
        chain = input_ids.new_tensor(drafted)[None]
        return torch.cat([input_ids, chain], dim=-1), torch.stack(scores)[None]

    @property
    def num_drafting_tokens(self) -> int:
        """The longest chain one step drafts: the controller's ``k_max`` (transformers 5.25 keeps that many
        steps of a recurrent target cache's past, to roll rejected drafts back)."""
        return self.controller.k_max

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Count the verification outcome (the rule itself adapts from draft entropies only)."""
        matched = int(num_matches)
        self.controller.observe_verified(self.last_proposed, matched, matched + 1)


@dataclass
class EASCall:
    """One ``generate(..., eas_config=...)`` call in flight: its model, config and generator."""

    model: Any
    config: EASConfig
    generator: EntropyAdaptiveCandidateGenerator | None = None


#: The EAS call running in this context (thread / task). Set by ``EntMTPGenerationMixin.generate``
#: around transformers' ``generate`` and read by its ``_get_candidate_generator``; nothing is
#: stored on the model.
ACTIVE_EAS_CALL: ContextVar[EASCall | None] = ContextVar("entmtp_active_eas_call", default=None)


def build_candidate_generator(call: EASCall, kwargs: dict) -> EntropyAdaptiveCandidateGenerator:
    """The candidate generator for ``_get_candidate_generator``'s keyword arguments."""
    if kwargs.get("assistant_tokenizer") is not None or kwargs.get("target_tokenizer") is not None:
        raise ValueError("eas_config needs a draft model with the target's tokenizer (no assistant_tokenizer)")
    assistant = kwargs.get("assistant_model")
    if assistant is None:
        raise ValueError("eas_config needs assistant_model=<draft model>")
    generator = EntropyAdaptiveCandidateGenerator(
        input_ids=kwargs["input_ids"],
        assistant_model=assistant,
        generation_config=kwargs["generation_config"],
        model_kwargs=kwargs.get("model_kwargs") or {},
        logits_processor=kwargs.get("logits_processor"),
        controller=EASController(call.config),
    )
    call.generator = generator
    return generator
