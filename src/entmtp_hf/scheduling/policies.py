"""Per-step tree scheduling: confidence features and the policies that read them.

Every decode step the scheduler picks one of a few precompiled trees from a scalar
confidence ``s``. Features are small pure functions of tensors the loop already holds (the
verifier's distribution at the last accepted position, the heads' probabilities along the
top-1 chain, recent accept lengths); policies are deterministic objects that can be tested
without a model.

* ``best_path_value`` (the paper's feature): ``s = max(p0, g_1, ..., g_D)`` with ``p0`` the base
  model's top-1 probability at the last accepted position, ``p_d`` head ``d``'s top-1
  probability along the greedy chain and ``g_d = p0 * p_1 * ... * p_d`` (EAGLE-2's path
  value). Since every ``p_d <= 1`` this equals ``p0``; it is kept as specified.
* ``chain_value``: ``g_D``, the value of the deepest greedy chain node.
* ``head_confidence``: ``p_1``, head 0's top-1 probability (the first drafted token).
* ``base_top1``: ``p0``;  ``confidence``: ``exp(-H)`` of the base distribution;
  ``confidence_ema``: ``exp(-EMA(H))``;  ``accept_ema``: EMA of recent accept lengths.

Policies: ``static`` (one tree: EntMTP*), ``hysteresis`` (EntMTPτ: switch up to T+ when
``s > tau_on``, back down to T- when ``s <= tau_off``), ``ladder`` (EntMTP-l: K-1 increasing
thresholds bin ``s`` into K trees), ``value`` (EntMTP-v: no scalar; every step verifies the
tree whose drafted nodes have the largest summed path value per unit of forward cost,
EAGLE-2's expansion rule restricted to precompiled trees; :func:`tree_values`). The
``entropy`` policy of :class:`~entmtp_hf.config.EntMTPConfig` is not a scalar-feature policy:
it reads every chain depth's head entropy and lives in :mod:`entmtp_hf.eas`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

FEATURES = ("best_path_value", "chain_value", "head_confidence", "base_top1", "confidence", "confidence_ema",
            "accept_ema")
POLICIES = ("static", "hysteresis", "ladder", "value")
#: the policies that switch on one scalar feature (read off the greedy chain and the verifier)
FEATURE_POLICIES = ("hysteresis", "ladder")
#: the features that read the heads' draft; the others are known before the heads run, so only
#: the chosen tree is drafted (``best_path_value`` is max(p0, p0·p1, ...) = p0: no draft needed)
DRAFT_FEATURES = ("chain_value", "head_confidence")
#: the features that read the verifier's distribution at the root (its top-1 probability or
#: entropy, a softmax over the whole vocabulary per step); ``head_confidence`` reads it only
#: when nothing is drafted, ``accept_ema`` never
BASE_FEATURES = ("best_path_value", "chain_value", "base_top1", "confidence", "confidence_ema")


# ----------------------------------------------------------------------------- features
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


def threshold(feature: str, t: float, depth: int) -> float:
    """A threshold given on the probability scale [0, 1] in ``feature``'s own units: every
    feature is a probability except ``accept_ema`` (tokens per step, 1 to depth + 1)."""
    return 1.0 + t * depth if feature == "accept_ema" else t


def ema(previous: float | None, value: float, window: int) -> float:
    """Exponential moving average with smoothing ``2 / (window + 1)``."""
    if previous is None:
        return value
    a = 2.0 / (window + 1.0)
    return a * value + (1.0 - a) * previous


@dataclass
class FeatureTracker:
    """Keeps the running averages a feature needs across steps of one generate call."""

    name: str = "best_path_value"
    window: int = 8
    entropy_ema: float | None = None
    accept_ema: float | None = None

    def __post_init__(self) -> None:
        if self.name not in FEATURES:
            raise ValueError(f"unknown scheduler feature {self.name!r}; choose one of {FEATURES}")
        if self.window < 1:
            raise ValueError(f"feature window must be >= 1, got {self.window}")

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
        if self.name == "best_path_value":
            return best_path_value(p0, chain_probs)
        if self.name == "chain_value":
            return path_values(p0, chain_probs)[-1] if chain_probs else p0
        if self.name == "head_confidence":
            return chain_probs[0] if chain_probs else p0
        if self.name == "base_top1":
            return p0
        if self.name == "confidence":
            return math.exp(-entropy)
        if self.name == "confidence_ema":
            return math.exp(-self.entropy_ema)
        return self.accept_ema if self.accept_ema is not None else 1.0  # accept_ema


# ----------------------------------------------------------------------------- policies
@dataclass
class Scheduler:
    """Maps the confidence ``s`` of each step to the index of the tree to verify.

    ``num_trees`` trees are indexed smallest first. ``static`` always returns ``static_index``;
    ``hysteresis`` moves between ``low`` (T-) and ``high`` (T+); ``ladder`` returns the number of
    ``thresholds`` below ``s``; ``value`` picks from per-tree values (:meth:`choose_value`)
    weighed by ``costs``, each tree's forward cost relative to the others.
    """

    policy: str
    num_trees: int
    static_index: int = 0
    low: int = 0
    high: int = 0
    tau_on: float = 0.01
    tau_off: float = 0.01
    thresholds: tuple[float, ...] = ()
    costs: tuple[float, ...] = ()
    current: int = field(init=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {POLICIES}")
        if self.tau_off > self.tau_on:
            raise ValueError(f"tau_off ({self.tau_off}) must be <= tau_on ({self.tau_on})")
        for name in ("static_index", "low", "high"):
            if not 0 <= getattr(self, name) < self.num_trees:
                raise ValueError(f"{name}={getattr(self, name)} is not a tree index (0..{self.num_trees - 1})")
        if self.policy == "ladder":
            if len(self.thresholds) != self.num_trees - 1:
                raise ValueError(
                    f"the ladder needs {self.num_trees - 1} thresholds for {self.num_trees} trees, "
                    f"got {len(self.thresholds)}"
                )
            if any(b <= a for a, b in zip(self.thresholds, self.thresholds[1:])):
                raise ValueError(f"ladder thresholds must be strictly increasing, got {list(self.thresholds)}")
        if self.costs and (len(self.costs) != self.num_trees or any(not c > 0 for c in self.costs)):
            raise ValueError(f"costs must give one positive cost per tree ({self.num_trees}), got {list(self.costs)}")
        self.current = {"static": self.static_index, "hysteresis": self.low, "ladder": 0, "value": 0}[self.policy]

    @property
    def needs_feature(self) -> bool:
        """Whether ``choose`` reads a scalar feature (``value`` reads per-tree values instead)."""
        return self.policy in FEATURE_POLICIES

    def choose_value(self, values: list[float]) -> int:
        """Policy ``value``: the tree with the most expected tokens, ``1 + values[k]``, per unit
        of cost (ties: the earlier, smaller tree)."""
        costs = self.costs or (1.0,) * self.num_trees
        rates = [(1.0 + v) / c for v, c in zip(values, costs)]
        self.current = max(range(len(rates)), key=lambda k: (rates[k], -k))
        return self.current

    def choose(self, s: float) -> int:
        """Tree index for a step whose confidence is ``s``."""
        if self.policy == "hysteresis":
            if s > self.tau_on:
                self.current = self.high
            elif s <= self.tau_off:
                self.current = self.low
        elif self.policy == "ladder":
            self.current = bisect.bisect_left(self.thresholds, s)
        return self.current
