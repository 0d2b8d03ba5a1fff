"""Per-step tree policies: which precompiled tree a step verifies.

Every decode step the scheduler picks one of a few precompiled trees, indexed smallest
first. Policies are deterministic objects that can be tested without a model:

* ``static`` (the paper's EntMTP*): always the bank's optimum;
* ``hysteresis`` (EntMTPτ): switch up to T+ when the confidence ``s > tau_on``, back down to
  T- when ``s <= tau_off``;
* ``ladder`` (EntMTP-l): K-1 increasing thresholds bin ``s`` into K trees;
* ``value`` (EntMTP-v): no scalar; every step verifies the tree whose drafted nodes have the
  largest summed path value per unit of forward cost (EAGLE-2's expansion rule restricted to
  precompiled trees, :func:`~entmtp_hf.scheduling.features.tree_values`).

``s`` comes from :mod:`entmtp_hf.scheduling.features`. The ``entropy`` policy of
:class:`~entmtp_hf.config.EntMTPConfig` is not a scalar-feature policy: it reads every chain
depth's head entropy (:mod:`entmtp_hf.scheduling.eas`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


POLICIES = ("static", "hysteresis", "ladder", "value")
#: the policies that switch on one scalar feature (read off the greedy chain and the verifier)
FEATURE_POLICIES = ("hysteresis", "ladder")
#: the paper's names, accepted wherever a policy is named
POLICY_ALIASES = {"EntMTP*": "static", "EntMTPτ": "hysteresis", "EntMTPtau": "hysteresis", "EntMTP-l": "ladder",
                  "EntMTP-v": "value"}  # fmt: skip


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
