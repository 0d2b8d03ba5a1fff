"""The break-even guard: a call drops to the root alone while its trees lose to plain steps.

A bank's tree is chosen for a task's average acceptance; one prompt the heads draft badly can
still make every tree step cost more than it returns. The guard watches each step and, while
the trees lose, has the step verify the root alone (draft nothing), re-trying the trees now and
then.

**The maths.** A step that verifies tree ``T`` of ``N`` nodes adds ``τ`` tokens (accepted drafted
tokens + the verifier's own) and costs ``c(T)``; the root alone adds exactly 1 token for ``c(1)``
(no drafting, a one-node forward). Per unit of time the tree gives ``τ / c(T)`` tokens and the
root alone ``1 / c(1)``, so the tree pays exactly when

    τ > r(T) = c(T) / c(1)        (the break-even accept length)

Over a stretch of steps with varying trees the fair figure is the ratio of sums, tokens per unit
of cost ``e = Σ τ_t / Σ r_t`` (a ratio of sums, not a mean of ratios: it is the speed-up of the
stretch over root-alone steps). The guard keeps ``e`` over the last ``window`` tree steps (a
window, not a moving average: an average seeded by one lucky first step would overrate a
probe) and:

* **drops** to the root alone when ``e < 1`` (the trees lose), judged only after
  ``min_steps`` tree steps since the trees last started (one unlucky step is no evidence);
* waits ``wait`` root-alone steps, which teach it nothing about the trees (``τ = 1``,
  ``r = 1``: they are not fed to ``e``), then **probes**: the trees run again with the window
  emptied, judged after ``min_steps`` steps like at the start;
* ``wait`` starts at ``backoff_start`` and doubles with every drop, up to ``backoff_max``, so a
  prompt that keeps losing pays for a probe ever more rarely (at most ``min_steps`` tree steps
  per ``wait`` root-alone steps);
* **recovers** (``wait`` back to ``backoff_start``) only when ``e ≥ recover`` (1.1): between
  ``1`` and ``recover`` the trees keep running but a later drop waits longer. This band is the
  hysteresis: a prompt hovering at break-even (where either choice costs the same) cannot flap
  at a fixed short period.

The guard is a pure, deterministic object: it reads accept lengths and relative costs, never a
clock or a model; the relative costs come from the plan (this machine's measured step costs, or
the user's ``costs``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..validation import integer, number

#: tree steps the tokens-per-cost figure sums over (as the scheduler's features' default window)
WINDOW = 8
#: tree steps judged together before a drop: at the start, and on every probe
MIN_STEPS = 4
#: root-alone steps after a first drop; doubled on every later drop, up to BACKOFF_MAX
BACKOFF_START = 4
BACKOFF_MAX = 64
#: tokens per unit of cost that count as a clear win (the backoff resets), above break-even (1)
RECOVER = 1.1

_FIELD = "BreakEvenGuard"


@dataclass
class BreakEvenGuard:
    """Says each step whether to verify the root alone (see the module docstring for the rule)."""

    window: int = WINDOW
    min_steps: int = MIN_STEPS
    backoff_start: int = BACKOFF_START
    backoff_max: int = BACKOFF_MAX
    recover: float = RECOVER
    wait: int = field(init=False, default=0)  # root-alone steps still to run before the next probe
    backoff: int = field(init=False)  # the wait the next drop starts
    #: (τ, r) of the last ``window`` tree steps since the trees last started
    _recent: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.window = integer(self.window, f"{_FIELD}.window", low=1, high=4096)
        self.min_steps = integer(self.min_steps, f"{_FIELD}.min_steps", low=1, high=self.window)
        self.backoff_start = integer(self.backoff_start, f"{_FIELD}.backoff_start", low=1, high=4096)
        self.backoff_max = integer(self.backoff_max, f"{_FIELD}.backoff_max", low=self.backoff_start, high=2**20)
        self.recover = number(self.recover, f"{_FIELD}.recover", low=1.0)
        self.backoff = self.backoff_start
        self._recent = deque(maxlen=self.window)

    @property
    def root_alone(self) -> bool:
        """Whether the next step verifies the root alone."""
        return self.wait > 0

    @property
    def efficiency(self) -> float | None:
        """``e``: tokens per unit of cost over the recent tree steps, relative to root-alone steps
        (1 = break-even); None before the first tree step since the trees last started."""
        if not self._recent:
            return None
        return sum(t for t, _ in self._recent) / sum(r for _, r in self._recent)

    def observe(self, tokens: int, cost: float) -> None:
        """One step's outcome: ``tokens`` it added and its cost over a root-alone step's
        (``r = c(T) / c(1)``; a root-alone step's is 1 and is not fed to ``e``)."""
        if self.wait > 0:  # a root-alone step: nothing learnt about the trees
            self.wait -= 1
            if self.wait == 0:  # probe: the trees run again, measured afresh
                self._recent.clear()
            return
        self._recent.append((float(tokens), float(cost)))
        if len(self._recent) < self.min_steps:
            return
        e = self.efficiency
        if e < 1.0:  # the trees lose to root-alone steps: drop them for a while, longer each time
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, self.backoff_max)
        elif e >= self.recover:  # a clear win: the next drop starts short again
            self.backoff = self.backoff_start
