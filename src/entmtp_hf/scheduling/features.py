"""Confidence features: the scalar ``s`` a switching policy reads each step.

Features are small pure functions of what the decode loop already holds: the verifier's
distribution at the last accepted position (top-1 probability ``p0``, entropy ``H``), the
heads' top-1 probabilities along the greedy chain (``p_1 .. p_D``) and recent accept lengths.

* ``best_path_value`` (the paper's feature): ``s = max(p0, g_1, ..., g_D)`` with
  ``g_d = p0 * p_1 * ... * p_d`` (EAGLE-2's path value). Since every ``p_d <= 1`` this equals
  ``p0``; it is kept as specified.
* ``chain_value``: ``g_D``, the value of the deepest greedy chain node.
* ``head_confidence``: ``p_1``, head 0's top-1 probability (the first drafted token).
* ``base_top1``: ``p0``;  ``confidence``: ``exp(-H)``;  ``confidence_ema``: ``exp(-EMA(H))``;
  ``accept_ema``: EMA of recent accept lengths (tokens per step, not a probability).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ..validation import brief_repr, integer

#: the features that read the heads' draft; the others are known before the heads run, so only
#: the chosen tree is drafted (``best_path_value`` is max(p0, p0·p1, ...) = p0: no draft needed)
DRAFT_FEATURES = ("chain_value", "head_confidence")
#: the features that read the verifier's distribution at the root (its top-1 probability or
#: entropy, a softmax over the whole vocabulary per step); ``head_confidence`` reads it only
#: when nothing is drafted, ``accept_ema`` never
BASE_FEATURES = ("best_path_value", "chain_value", "base_top1", "confidence", "confidence_ema")
#: the most recent steps a running average weighs
MAX_FEATURE_WINDOW = 4096
#: the one feature whose values are tokens per step (1 .. depth + 1); every other is in [0, 1]
TOKEN_FEATURES = ("accept_ema",)


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` over the last dimension from log-probabilities (nats; ``p = 0`` adds 0).

    Computed as ``exp(logp) * logp`` in place (``0 * -inf`` gives nan, zeroed): on CPU about
    ten times faster than ``torch.special.entr``, which takes a second logarithm.
    """
    return logp.exp().mul_(logp).nan_to_num_(nan=0.0).sum(-1).neg_()


def top1_and_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 probability and entropy (nats) of softmax(logits) over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    return probs.max(-1).values, entropy


def path_values(p0: float, chain_probs: list[float]) -> list[float]:
    """EAGLE-2 path values ``g_d = p0 * p_1 * ... * p_d`` along the greedy chain."""
    values, g = [], p0
    for p in chain_probs:
        g *= p
        values.append(g)
    return values


def best_path_value(p0: float, chain_probs: list[float]) -> float:
    """``max(p0, g_1, ..., g_D)``."""
    return max([p0, *path_values(p0, chain_probs)])


def tree_values(probs: torch.Tensor, ancestors: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Expected drafted tokens accepted of each tree, estimated from one drafted union tree.

    ``probs`` [N]: each union node's probability under the head that drafted it (1 for the
    root); ``ancestors`` [N, D + 1]: root→node indices, -1 padded; ``members`` [K, N]: 1 where
    tree k has the (non-root) union node. A node's path value is the product of the
    probabilities along its path (the chance the whole path is accepted if the heads were
    calibrated); a tree's value is the sum over its nodes, its expected accept length minus one.
    """
    logp = torch.cat([probs.double().clamp(min=1e-30).log(), probs.new_zeros(1, dtype=torch.float64)])
    path = logp[ancestors.masked_fill(ancestors < 0, probs.shape[0])].sum(-1).exp()
    return members.double() @ path


def feature_top(feature: str, depth: int) -> float:
    """The largest value ``feature`` takes on trees ``depth`` deep: 1 for a probability,
    ``depth + 1`` tokens per step for ``accept_ema``."""
    return depth + 1.0 if feature in TOKEN_FEATURES else 1.0


def threshold(feature: str, t: float, depth: int) -> float:
    """A threshold given on the probability scale [0, 1] in ``feature``'s own units: every
    feature is a probability except ``accept_ema`` (tokens per step, 1 to depth + 1)."""
    return 1.0 + t * depth if feature in TOKEN_FEATURES else t


def ema(previous: float | None, value: float, window: int) -> float:
    """Exponential moving average with smoothing ``2 / (window + 1)``."""
    if previous is None:
        return value
    a = 2.0 / (window + 1.0)
    return a * value + (1.0 - a) * previous


@dataclass
class FeatureTracker:
    """Keeps the running averages a feature needs across the steps of one generate call."""

    name: str = "best_path_value"
    window: int = 8
    entropy_ema: float | None = None
    accept_ema: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in FEATURES:
            raise ConfigError(
                "FeatureTracker.name",
                f"unknown scheduler feature {brief_repr(self.name)}; choose one of {list(FEATURES)}",
            )
        self.window = integer(self.window, "FeatureTracker.window", low=1, high=MAX_FEATURE_WINDOW)

    def observe_accept(self, accept_length: int) -> None:
        self.accept_ema = ema(self.accept_ema, float(accept_length), self.window)

    @property
    def reads_draft(self) -> bool:
        """Whether the feature needs the heads' chain probabilities (see :data:`DRAFT_FEATURES`)."""
        return self.name in DRAFT_FEATURES

    def reads_base(self, drafted: bool = True) -> bool:
        """Whether :meth:`value` reads ``p0`` or ``entropy`` (see :data:`BASE_FEATURES`); when it
        does not, the decode loop skips the softmax they come from. ``drafted``: whether the
        step has a drafted chain (``head_confidence`` falls back to ``p0`` without one)."""
        return self.name in BASE_FEATURES or (self.name == "head_confidence" and not drafted)

    def value(self, p0: float, entropy: float, chain_probs: list[float]) -> float:
        """The scalar ``s`` for this step (``chain_probs`` is read only if :attr:`reads_draft`)."""
        self.entropy_ema = ema(self.entropy_ema, entropy, self.window)
        return _FEATURES[self.name](self, p0, entropy, chain_probs)


_Feature = Callable[[FeatureTracker, float, float, list], float]
#: name -> how the feature reads (tracker, p0, entropy, chain probabilities)
_FEATURES: dict[str, _Feature] = {
    "best_path_value": lambda t, p0, h, chain: best_path_value(p0, chain),
    "chain_value": lambda t, p0, h, chain: path_values(p0, chain)[-1] if chain else p0,
    "head_confidence": lambda t, p0, h, chain: chain[0] if chain else p0,
    "base_top1": lambda t, p0, h, chain: p0,
    "confidence": lambda t, p0, h, chain: math.exp(-h),
    "confidence_ema": lambda t, p0, h, chain: math.exp(-t.entropy_ema),
    "accept_ema": lambda t, p0, h, chain: t.accept_ema if t.accept_ema is not None else 1.0,
}
FEATURES = tuple(_FEATURES)
