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

* draft model: :class:`~entmtp_hf.assisted.EntropyAdaptiveCandidateGenerator`, a transformers
  ``CandidateGenerator``; ``model.generate(..., assistant_model=draft, eas_config=EASConfig())``
  on a model enabled with :func:`~entmtp_hf.enable_entmtp`. transformers' assisted
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

import os
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from ..errors import ConfigError, FileFormatError
from ..files import read_json_object
from ..validation import flag, increasing, integer, number, numbers_in
from .features import entropy_from_logp
from .policies import NEEDS_ENTROPIES, register_policy

HALT_CAUSES = ("threshold", "fork", "k_max", "warmup", "length")
#: the longest chain: far beyond any drafter's useful length (heads: capped at the tree depth)
MAX_CHAIN = 1024
#: the most recent entropies one mean is taken over (each chain's start sums them)
MAX_WINDOW = 4096
#: more generated tokens than any generation produces (:func:`fixed_length`'s warm-up never ends)
MAX_TOKENS = 2**62
MAX_BANDS = 64
MAX_SETTINGS_BYTES = 2**16
#: the integer fields' ranges (``fork_min_history`` is also at most ``window``)
_INTEGER_RANGES = {
    "k_max": (1, MAX_CHAIN),
    "window": (1, MAX_WINDOW),
    "fork_min_history": (1, MAX_WINDOW),
    "warmup_tokens": (0, MAX_TOKENS),
    "warmup_length": (0, MAX_CHAIN),
    "min_length": (0, MAX_CHAIN),
}


def _name(field_name: str) -> str:
    return f"EASConfig.{field_name}"


# ============================================================================ config
@dataclass(frozen=True)
class EASConfig:
    """Settings of entropy-adaptive speculation (validated on construction: a bad field is a
    :class:`~entmtp_hf.errors.ConfigError` naming it).

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
        default=0,
        metadata={"help": "no entropy halt before this many tokens (where a CPU verifies them at no extra cost)"},
    )

    def __post_init__(self) -> None:
        for name, (low, high) in _INTEGER_RANGES.items():
            object.__setattr__(self, name, integer(getattr(self, name), _name(name), low=low, high=high))
        if self.fork_min_history > self.window:
            raise ConfigError(
                _name("fork_min_history"), f"must be at most window ({self.window}), got {self.fork_min_history}"
            )
        bands = numbers_in(self.thresholds, _name("thresholds"), low=0.0, max_len=MAX_BANDS)
        if not bands:
            raise ConfigError(_name("thresholds"), "needs one entropy threshold per band, at least one")
        edges = numbers_in(self.band_edges, _name("band_edges"), max_len=MAX_BANDS)
        if len(edges) != len(bands) - 1:
            raise ConfigError(
                _name("band_edges"), f"needs {len(bands) - 1} edges for {len(bands)} thresholds, got {len(edges)}"
            )
        object.__setattr__(self, "thresholds", bands)
        object.__setattr__(self, "band_edges", increasing(edges, _name("band_edges")))
        object.__setattr__(self, "fork_margin", number(self.fork_margin, _name("fork_margin"), low=0.0))
        object.__setattr__(self, "fork_ratio", number(self.fork_ratio, _name("fork_ratio"), low=1.0))
        flag(self.detect_forks, _name("detect_forks"))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "EASConfig":
        """Settings saved as a JSON object of fields (``entmtp-hf eas-calibrate`` writes one);
        a missing, malformed or invalid file is a :class:`~entmtp_hf.errors.FileFormatError`
        naming it."""
        try:
            data = read_json_object(path, max_bytes=MAX_SETTINGS_BYTES, max_depth=4)
            unknown = sorted(map(str, set(data) - {f.name for f in fields(cls)}))
            if unknown:
                raise ConfigError("EASConfig", f"unknown fields {unknown}")
            return cls(**data)
        except FileFormatError as e:
            raise FileFormatError(path, f"not valid EAS settings ({e.problem})") from e
        except ConfigError as e:
            raise FileFormatError(path, f"not valid EAS settings ({e})") from e

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
        if k_max is not None:
            k_max = min(config.k_max, integer(k_max, "EASController.k_max", low=0, high=MAX_CHAIN))
        self.k_max = config.k_max if k_max is None else k_max
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


def fixed_length(k: int) -> EASConfig:
    """An :class:`EASConfig` that drafts exactly ``k`` tokens every step (the fixed-chain
    baseline of the draft-model form): the warm-up never ends."""
    return EASConfig(k_max=k, warmup_tokens=MAX_TOKENS, warmup_length=k)


# ============================================================================ the policy
@dataclass
class EntropyRule:
    """Policy ``entropy``: ``trees[d]`` is the tree truncated at depth ``d``, and a step verifies
    the one whose depth is the chain length the halting rule gives (:class:`EASController`
    reads the entropies). ``current`` stays the whole tree: what a step verifies when a
    retrieved branch replaces the draft."""

    num_trees: int
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.num_trees - 1

    def choose(self, length: int) -> int:
        return length


register_policy("entropy", EntropyRule, needs=NEEDS_ENTROPIES, sources=("bank", "tree"), what="truncates one tree")
