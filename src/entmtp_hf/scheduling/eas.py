"""Entropy-adaptive speculation lengths (EAS): halt a draft chain where the drafter is unsure.

A drafter (a small draft model, or a chain of draft heads) proposes tokens one after the
other. Before token ``i`` is proposed we know the distribution ``q_i`` it would be drawn from,
and its entropy ``H_i = -sum_x q_i(x) log q_i(x)`` (nats, raw drafter distribution). The chain
stops at the **first** ``i`` with

* ``H_i > tau``                                   (cause ``threshold``), or
* ``H_i >= max(m + fork_margin, fork_ratio * m)`` (cause ``fork``: an entropy spike, a
  "logical fork" where the text may go several ways),

and token ``i`` is not proposed (``min_length`` > 0 exempts the first tokens: on a CPU the
first few tokens of a chain are verified at about the cost of one). ``m`` is the mean of the
last ``window`` draft entropies and ``tau`` follows it in bands: ``m <= band_edges[0]``
(confident context) gives ``thresholds[0]`` (report: 3.0 nats), the next band
``thresholds[1]`` (2.0), and so on down to the least confident band (1.5). ``tau`` and ``m``
are read once at the start of a chain; the chain's entropies enter the window when it ends. A
chain also ends at ``k_max`` tokens (``k_max``) or at the generation's length budget
(``length``). During the first
``warmup_tokens`` generated tokens the chain has the fixed length ``warmup_length``
(``warmup``) while the window fills.

Two forms share :class:`EASController`, a pure deterministic object built per ``generate``
call:

* draft model: :class:`EntropyAdaptiveCandidateGenerator`, a transformers
  ``CandidateGenerator``; ``model.generate(..., assistant_model=draft, eas_config=EASConfig())``
  on a model enabled with :func:`~entmtp_hf.generation.enable_entmtp`. transformers' assisted
  decoding verifies the chain (greedy: identical output; sampling: speculative sampling,
  which is distribution-preserving because the drafted tokens are drawn from the returned
  logits and the halting rule only reads the drafter's side);
* draft heads: ``EntMTPConfig(tree=..., eas=EASConfig())`` (policy ``entropy``): the tree's
  truncations at every depth ``0..D`` are compiled up front and each step verifies the one
  whose depth is the chain length the rule gives for the greedy-chain head entropies.

Statistics (:class:`EASStats`): chain lengths, halts by cause, and the fraction of verified
draft tokens that were rejected.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList, MinLengthLogitsProcessor

from ..heads.base import entropy_from_logp
from ..decoding.acceptance import check_pick, sample_picks

if TYPE_CHECKING:
    from ..config import EntMTPConfig

HALT_CAUSES = ("threshold", "fork", "k_max", "warmup", "length")


# ============================================================================ config
@dataclass(frozen=True)
class EASConfig:
    """Settings of entropy-adaptive speculation (validated on construction).

    Entropies are in nats of the drafter's raw distribution (temperature 1, no warpers). The
    band defaults are the report's thresholds; the band edges and fork settings are untuned
    starting points: calibrate them per drafter (see ``docs/eas.md``).
    """

    k_max: int = field(default=12, metadata={"help": "longest chain (heads: capped at the tree depth)"})
    thresholds: tuple[float, ...] = field(
        default=(3.0, 2.0, 1.5), metadata={"help": "entropy threshold per band, most confident context first"}
    )
    band_edges: tuple[float, ...] = field(
        default=(1.0, 2.0), metadata={"help": "increasing edges on the recent mean entropy between the bands"}
    )
    window: int = field(default=32, metadata={"help": "number of recent draft entropies the mean is taken over"})
    fork_margin: float = field(default=1.5, metadata={"help": "a fork needs H >= mean + fork_margin ..."})
    fork_ratio: float = field(default=2.0, metadata={"help": "... and H >= fork_ratio * mean"})
    fork_min_history: int = field(default=8, metadata={"help": "entropies in the window before forks are detected"})
    detect_forks: bool = field(default=True, metadata={"help": "halt at entropy spikes below the threshold"})
    warmup_tokens: int = field(default=100, metadata={"help": "generated tokens drafted at the fixed length"})
    warmup_length: int = field(default=4, metadata={"help": "fixed chain length during warm-up (capped at k_max)"})
    min_length: int = field(
        default=0, metadata={"help": "no entropy halt before this many tokens (where a CPU verifies them at no extra cost)"}
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", tuple(float(t) for t in self.thresholds))
        object.__setattr__(self, "band_edges", tuple(float(e) for e in self.band_edges))
        minimum = {"k_max": 1, "window": 1, "fork_min_history": 1, "warmup_tokens": 0, "warmup_length": 0,
                   "min_length": 0}  # fmt: skip
        for name, low in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EASConfig.{name} must be an integer >= {low}, got {value!r}")
        if not self.thresholds or any(not math.isfinite(t) or t < 0 for t in self.thresholds):
            raise ValueError(f"EASConfig.thresholds must be finite entropies >= 0, got {list(self.thresholds)}")
        if len(self.band_edges) != len(self.thresholds) - 1:
            raise ValueError(
                f"EASConfig needs {len(self.thresholds) - 1} band_edges for {len(self.thresholds)} thresholds, "
                f"got {len(self.band_edges)}"
            )
        if any(b <= a for a, b in zip(self.band_edges, self.band_edges[1:])):
            raise ValueError(f"EASConfig.band_edges must be strictly increasing, got {list(self.band_edges)}")
        if self.fork_margin < 0 or math.isnan(self.fork_margin):
            raise ValueError(f"EASConfig.fork_margin must be >= 0 nats, got {self.fork_margin}")
        if self.fork_ratio < 1 or math.isnan(self.fork_ratio):
            raise ValueError(f"EASConfig.fork_ratio must be >= 1, got {self.fork_ratio}")
        if self.fork_min_history > self.window:
            raise ValueError(f"EASConfig.fork_min_history ({self.fork_min_history}) exceeds window ({self.window})")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "EASConfig":
        """Settings saved as a JSON object of fields (``entmtp-hf eas-calibrate`` writes one);
        a missing, malformed or invalid file is named in the error."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            unknown = sorted(set(data) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"unknown fields {unknown}")
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not valid EAS settings ({e})") from e

    def threshold_for(self, mean: float | None) -> float:
        """The band threshold for a recent mean entropy (the least confident band when unknown)."""
        if mean is None:
            return self.thresholds[-1]
        band = sum(mean > edge for edge in self.band_edges)
        return self.thresholds[band]


# ============================================================================ controller
def entropy_nats(logits: torch.Tensor) -> torch.Tensor:
    """``H = -sum p log p`` of ``softmax(logits)`` over the last dimension, in nats."""
    return entropy_from_logp(torch.log_softmax(logits.float(), dim=-1))


@dataclass
class EASStats:
    """One generate call's EAS statistics, as data."""

    chain_lengths: list[int] = field(default_factory=list)
    halts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HALT_CAUSES, 0))
    thresholds: list[float | None] = field(default_factory=list)  # tau of every chain (None: warm-up)
    verified_draft_tokens: int = 0  # drafted tokens the target model checked
    accepted_draft_tokens: int = 0

    def as_dict(self) -> dict:
        d = {k: (type(v)(v) if isinstance(v, (dict, list)) else v) for k, v in vars(self).items()}  # copies
        verified = self.verified_draft_tokens
        d["rejected_fraction"] = (verified - self.accepted_draft_tokens) / verified if verified else 0.0
        d["mean_chain_length"] = sum(self.chain_lengths) / len(self.chain_lengths) if self.chain_lengths else 0.0
        return d


@dataclass(frozen=True)
class ChainRule:
    """The halting rule of one chain: fixed when the chain starts."""

    max_length: int
    end_cause: str  # cause when ``max_length`` is reached
    threshold: float | None  # None during warm-up: no entropy halts
    fork_level: float | None  # H at or above this is a fork (None: no fork detection)
    min_length: int = 0  # tokens before the first entropy halt may happen

    def cause_at(self, index: int, entropy: float | None = None) -> str | None:
        """Why the chain stops before token ``index`` (0-based) with entropy ``entropy``, or None."""
        if index >= self.max_length:
            return self.end_cause
        if entropy is None or self.threshold is None or index < self.min_length:
            return None
        if entropy > self.threshold:
            return "threshold"
        if self.fork_level is not None and entropy >= self.fork_level:
            return "fork"
        return None


class ChainWalk:
    """One chain, fed the candidate entropies in order; stops as soon as the rule does.

    ``done`` says whether the next entropy is still needed; :meth:`close` ends the chain when
    the drafter has no more tokens (cause ``k_max``) and returns its length.
    """

    def __init__(self, controller: "EASController", rule: ChainRule) -> None:
        self.controller, self.rule = controller, rule
        self.length: int = 0
        self.examined: list[float] = []
        self.done = False
        self._end_if(rule.cause_at(0))

    def _end_if(self, cause: str | None) -> bool:
        if cause is not None:
            self.controller.finish_chain(self.rule, self.length, cause, self.examined)
            self.done = True
        return self.done

    def feed(self, entropy: float) -> bool:
        """Entropy of candidate ``length``; True when the chain has ended (no more needed)."""
        if self.done:
            raise RuntimeError("the chain has ended")
        self.examined.append(float(entropy))
        if self._end_if(self.rule.cause_at(self.length, entropy)):
            return True
        self.length += 1
        return self._end_if(self.rule.cause_at(self.length))

    def close(self) -> int:
        if not self.done:
            self._end_if("k_max")
        return self.length


class EASController:
    """Per-call EAS state: the recent entropy window, the warm-up count and the statistics.

    Protocol per step: :meth:`start_chain` -> for each candidate token ``rule.cause_at(i, H_i)``
    -> :meth:`finish_chain` -> after verification :meth:`observe_verified`.
    :meth:`chain_length` does the first three when every entropy is known up front (heads).
    """

    def __init__(self, config: EASConfig, k_max: int | None = None) -> None:
        self.config = config
        self.k_max = config.k_max if k_max is None else min(config.k_max, k_max)
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        self.recent: deque[float] = deque(maxlen=config.window)
        self.generated = 0
        self.stats = EASStats()
        self._last_length = 0

    @property
    def warming_up(self) -> bool:
        return self.generated < self.config.warmup_tokens

    def recent_mean(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def start_chain(self, limit: int | None = None) -> ChainRule:
        """The rule for the next chain; ``limit`` caps it (e.g. the tokens left to generate)."""
        cfg = self.config
        if self.warming_up:
            length, cause, tau, fork = min(cfg.warmup_length, self.k_max), "warmup", None, None
        else:
            mean = self.recent_mean()
            length, cause, tau = self.k_max, "k_max", cfg.threshold_for(mean)
            fork = None
            if cfg.detect_forks and mean is not None and len(self.recent) >= cfg.fork_min_history:
                fork = max(mean + cfg.fork_margin, cfg.fork_ratio * mean)
        if limit is not None and limit < length:
            length, cause = max(limit, 0), "length"
        return ChainRule(length, cause, tau, fork, cfg.min_length)

    def finish_chain(self, rule: ChainRule, length: int, cause: str, entropies: Sequence[float]) -> None:
        """Record a chain of ``length`` proposed tokens that ended for ``cause``.

        ``entropies`` are those the rule examined (the proposed tokens' and, for an entropy
        halt, the halting one's); they enter the recent window.
        """
        if cause not in HALT_CAUSES:
            raise ValueError(f"unknown halt cause {cause!r}; one of {HALT_CAUSES}")
        self.recent.extend(float(h) for h in entropies)
        self.stats.chain_lengths.append(length)
        self.stats.halts[cause] += 1
        self.stats.thresholds.append(rule.threshold)
        self._last_length = length

    def walk(self, limit: int | None = None) -> "ChainWalk":
        """Start a chain whose candidate entropies arrive one at a time (heads drafting lazily)."""
        return ChainWalk(self, self.start_chain(limit))

    def chain_length(self, entropies: Sequence[float], limit: int | None = None) -> int:
        """Length of a chain whose candidate tokens have ``entropies`` (all known up front)."""
        walk = self.walk(limit)
        for h in entropies:
            if walk.done or walk.feed(h):
                break
        return walk.close()

    def observe_verified(self, verified: int, accepted: int, new_tokens: int) -> None:
        """After verification: ``verified`` drafted tokens checked, ``accepted`` kept, ``new_tokens`` emitted."""
        self.stats.verified_draft_tokens += verified
        self.stats.accepted_draft_tokens += min(accepted, verified)
        self.generated += new_tokens


# ============================================================================ draft model
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

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Count the verification outcome (the rule itself adapts from draft entropies only)."""
        matched = int(num_matches)
        self.controller.observe_verified(self.last_proposed, matched, matched + 1)


# ============================================================================ generate hook
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


# ============================================================================ benchmark methods
def eas_bench_config(ctx, task: str, acceptance: dict, eas: EASConfig | None = None) -> "EntMTPConfig":
    """Benchmark factory: the Hydra head chain as deep as the heads go, halted by EAS."""
    from ..config import EntMTPConfig
    from ..trees.tree import Tree

    depth = ctx.heads["hydra"].num_heads
    return EntMTPConfig(tree=Tree.chain(depth).choices, eas=eas or EASConfig(), **acceptance)


def fixed_chain_config(k: int):
    """Benchmark factory: the fixed head chain of length ``k`` (unavailable with fewer heads)."""
    from ..config import EntMTPConfig
    from ..trees.tree import Tree

    def make(ctx, task: str, acceptance: dict) -> "EntMTPConfig":
        return EntMTPConfig(tree=Tree.chain(k).choices, **acceptance)

    return make


def quantized_draft(model):
    """An int8 copy of ``model`` (dynamic quantisation of every ``nn.Linear``; CPU only) to
    draft with: the target's own vocabulary and weights at a quarter of the bytes per step,
    a draft/target pair that needs no second checkpoint and no training."""
    with warnings.catch_warnings():  # torch.ao's eager quantisation warns that it moved to torchao
        warnings.simplefilter("ignore")
        draft = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).float(), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    return draft.eval()


def fixed_length(k: int) -> EASConfig:
    """An :class:`EASConfig` that drafts exactly ``k`` tokens every step (the fixed-chain
    baseline of the draft-model form): the warm-up never ends."""
    return EASConfig(k_max=k, warmup_tokens=2**62, warmup_length=k)


# ============================================================================ overhead
def measure_overhead(model=None, heads=None, repeats: int = 200, tree=None) -> dict:
    """Median per-step cost (ms) of EAS on the demo model (or ``model`` + ``heads``).

    * ``decision_ms``: heads form, what the ``entropy`` policy adds per step (reading the
      chain's entropies to the host, the rule, the bookkeeping);
    * ``head_entropy_ms``: computing the entropies of one step's head distributions (the
      heads already compute them for every proposal; timed alone here);
    * ``draft_token_ms``: draft-model form, the entropy of one draft distribution over the
      full vocabulary plus the rule;
    * ``propose_ms`` / ``base_step_ms``: the chain proposal and one base decode step, for scale.
    """
    import time

    from ..heads import HydraHeads
    from ..trees.tree import Tree

    if model is None:
        from ..demo.model import load_base_model

        model, _ = load_base_model()
    if heads is None:
        torch.manual_seed(0)
        heads = HydraHeads.for_model(model).eval()
    depth = heads.num_heads
    tree = Tree.from_choices(tree) if tree is not None else Tree.chain(depth)
    union = tree.union(Tree.chain(tree.depth))
    index = union.node_index()
    chain_nodes = torch.tensor([index[(0,) * d] for d in range(1, tree.depth + 1)])
    buffers = union.buffers("cpu", torch.float32)
    state = heads.new_state(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    with torch.no_grad():
        out = model(ids, output_hidden_states=-1, use_cache=True)
        heads.observe(state, out.hidden_states[-1][0])
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        root = out.logits[0, -1].argmax()

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    proposal = heads.propose(state, root.view(1), buffers)
    ctrl = EASController(EASConfig(warmup_tokens=0), k_max=tree.depth)
    ctrl.recent.extend([1.0] * ctrl.config.window)

    def decision() -> None:
        ctrl.chain_length(proposal.entropy[chain_nodes].tolist())
        ctrl.observe_verified(tree.num_nodes - 1, 1, 2)

    rows = [len(step.parents) for step in buffers.depth_plan]
    logps = [torch.log_softmax(torch.randn(r, heads.config.draft_vocab_rows), -1) for r in rows]
    logits = torch.randn(model.config.vocab_size)
    rule = ChainRule(max_length=99, end_cause="k_max", threshold=2.0, fork_level=None)
    with torch.no_grad():
        result = {
            "decision_ms": median_ms(decision),
            "head_entropy_ms": median_ms(lambda: [entropy_from_logp(lp) for lp in logps]),
            "draft_token_ms": median_ms(lambda: rule.cause_at(0, float(entropy_nats(logits)))),
            "propose_ms": median_ms(lambda: heads.propose(state, root.view(1), buffers)),
        }
        step = torch.tensor([[int(root)]])

        def base_step() -> None:
            model(step, cache=cache, use_cache=True)
            cache.crop(-1)

        result["base_step_ms"] = median_ms(base_step) if repeats else None
    result.update(
        tree_nodes=tree.num_nodes, chain_depth=tree.depth, head_rows_per_depth=rows,
        draft_vocab=heads.config.draft_vocab_rows, vocab=model.config.vocab_size,
        torch_threads=torch.get_num_threads(), repeats=repeats,
    )  # fmt: skip
    return result
