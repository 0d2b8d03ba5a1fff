"""Per-step tree policies: which precompiled tree a step verifies, as a registry.

Every decode step the scheduler picks one of a few precompiled trees, indexed smallest
first. A policy is registered once with :func:`register_policy`: its rule (a dataclass whose
fields after ``num_trees`` are the policy's arguments, with their defaults), the paper's names
for it, what it reads from drafting and which trees it takes from a bank. Every reader of a
policy name (the config, the bank format, the plan, the drafter) asks the registry, so a new
policy is one module that registers itself. The built-in ones:

* ``static`` (the paper's EntMTP*): always the bank's optimum;
* ``hysteresis`` (EntMTPτ): switch up to T+ when the confidence ``s > tau_on``, back down to
  T- when ``s <= tau_off``;
* ``ladder`` (EntMTP-l): K-1 increasing thresholds bin ``s`` into K trees;
* ``value`` (EntMTP-v): no scalar; every step verifies the tree whose drafted nodes have the
  largest summed path value per unit of forward cost (EAGLE-2's expansion rule restricted to
  precompiled trees, :func:`~entmtp_hf.scheduling.features.tree_values`);
* ``entropy`` (EAS), registered by :mod:`entmtp_hf.scheduling.eas`: the tree truncated where
  the greedy chain's head entropy says the heads are unsure.

``s`` comes from :mod:`entmtp_hf.scheduling.features`. This module imports no policy
implementation; importing :mod:`entmtp_hf.scheduling` registers every built-in one.
"""

from __future__ import annotations

import bisect
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Protocol

from ..errors import ConfigError
from ..validation import Refusal, brief_repr, integer, numbers_in, taus, thresholds

#: what a policy reads from drafting each step to choose its tree
NEEDS_NOTHING = "nothing"  # the tree is known before drafting
NEEDS_FEATURE = "feature"  # a scalar feature read off the greedy chain and the verifier
NEEDS_VALUES = "values"  # the path value of every scheduled tree, from the drafted union
NEEDS_ENTROPIES = "entropies"  # the greedy chain's head entropy at every depth, drafted depth by depth
NEEDS = (NEEDS_NOTHING, NEEDS_FEATURE, NEEDS_VALUES, NEEDS_ENTROPIES)
#: where ``EntMTPConfig`` gets its trees from
SOURCES = ("bank", "tree", "trees")
#: more trees than any bank (1024) or truncated tree (depth + 1) holds
MAX_POLICY_TREES = 2**16
_FIELD = "Scheduler"


class PolicyRule(Protocol):
    """The state of one policy during one call: the tree the next step verifies."""

    num_trees: int
    current: int

    def choose(self, reading: Any) -> int:
        """The index of the tree to verify for this step's reading (see :data:`NEEDS`)."""


#: a bank's scheduler defaults and trees -> the bank trees the policy uses and its arguments
FromBank = Callable[[Any, tuple], tuple[tuple[int, ...], dict[str, Any]]]


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: see :func:`register_policy`."""

    name: str
    rule: type
    needs: str
    aliases: tuple[str, ...]
    sources: tuple[str, ...]
    min_trees: int
    what: str
    from_bank: FromBank | None

    @property
    def arguments(self) -> dict[str, Any]:
        """The policy's arguments and their defaults (its rule's fields after ``num_trees``)."""
        out = {}
        for f in fields(self.rule):
            if f.init and f.name != "num_trees":
                out[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default
        return out


_REGISTRY: dict[str, PolicySpec] = {}
_ALIASES: dict[str, str] = {}


def register_policy(
    name: str,
    rule: type,
    *,
    needs: str,
    aliases: tuple[str, ...] = (),
    sources: tuple[str, ...] = SOURCES,
    min_trees: int = 1,
    what: str = "",
    from_bank: FromBank | None = None,
) -> PolicySpec:
    """Register a tree policy under ``name``.

    ``rule``: a dataclass taking ``num_trees`` then the policy's arguments (each with a default),
    checking them when built, with a ``current`` tree index and ``choose(reading) -> int``;
    ``needs``: what ``choose`` reads (one of :data:`NEEDS`); ``aliases``: other names accepted
    wherever a policy is named (the paper's); ``sources``: which of ``EntMTPConfig``'s
    ``bank``, ``tree`` and ``trees`` it works with, ``min_trees`` the shortest ``trees`` list
    and ``what`` how it uses them (for the config's messages); ``from_bank``: the bank trees it
    uses and its arguments, from a bank's scheduler defaults (None: a bank cannot store it as
    its default policy). A name or alias registered already is refused (``ValueError``: a
    programming error, not bad input).
    """
    if not isinstance(name, str) or not name or any(n in _REGISTRY or n in _ALIASES for n in (name, *aliases)):
        raise ValueError(
            f"policy name {brief_repr(name)} or one of its aliases {list(aliases)} is taken; "
            f"registered: {policy_names()}, aliases: {list(_ALIASES)}"
        )
    if needs not in NEEDS:
        raise ValueError(f"a policy needs one of {list(NEEDS)}, got {brief_repr(needs)}")
    if not set(sources) <= set(SOURCES):
        raise ValueError(f"a policy's sources are among {list(SOURCES)}, got {brief_repr(sources)}")
    arguments = [f for f in fields(rule) if f.init and f.name != "num_trees"]
    if any(f.default is MISSING and f.default_factory is MISSING for f in arguments):
        raise ValueError(f"every argument of {rule.__name__} needs a default")
    spec = PolicySpec(name, rule, needs, tuple(aliases), tuple(sources), min_trees, what or "chooses a tree", from_bank)
    _REGISTRY[name] = spec
    _ALIASES.update(dict.fromkeys(aliases, name))
    return spec


def policy_names(*, needs: str | None = None, in_banks: bool = False) -> list[str]:
    """The registered policies (in registration order), those reading ``needs`` only, or only
    those a bank may store as its default."""
    return [n for n, s in _REGISTRY.items() if (needs is None or s.needs == needs) and (not in_banks or s.from_bank)]


def policy_aliases() -> dict[str, str]:
    """Every alias and the policy it names."""
    return dict(_ALIASES)


def canonical_policy(name: object) -> object:
    """The policy an alias names, else ``name`` itself (anything unhashable included)."""
    return _ALIASES.get(name, name) if isinstance(name, str) else name


def get_policy(
    name: object, field: str = f"{_FIELD}.policy", *, in_banks: bool = False, error: Refusal = ConfigError
) -> PolicySpec:
    """The registered policy ``name`` (or an alias) names; anything else (an unknown name, a
    list, a number) is ``error(field, ...)`` listing the registered names."""
    spec = _REGISTRY.get(canonical_policy(name)) if isinstance(name, str) else None
    if spec is None or (in_banks and spec.from_bank is None):
        names = policy_names(in_banks=in_banks)
        aliases = [a for a, n in _ALIASES.items() if n in names]
        raise error(field, f"must be one of {names} or an alias {aliases}; unknown policy {brief_repr(name)}")
    return spec


def default_policy(num_trees: int) -> str:
    """The policy of a list of trees given without one: static for one tree, hysteresis for
    two (T- = first, T+ = second), the ladder for more."""
    return "static" if num_trees == 1 else "hysteresis" if num_trees == 2 else "ladder"


# ------------------------------------------------------------------ the scheduler
class Scheduler:
    """Maps what each step reads from drafting to the index of the tree to verify.

    ``Scheduler(policy, num_trees, **arguments)``: the registered ``policy``'s rule over
    ``num_trees`` trees, indexed smallest first; ``arguments`` are the policy's own (others
    are refused). Every problem is a :class:`~entmtp_hf.errors.ConfigError` naming the field.
    """

    def __init__(self, policy: str, num_trees: int, **arguments: Any) -> None:
        self.spec = get_policy(policy)
        unknown = sorted(set(arguments) - set(self.spec.arguments))
        if unknown:
            raise ConfigError(_FIELD, f"the {self.spec.name} policy takes {list(self.spec.arguments)}, not {unknown}")
        num_trees = integer(num_trees, f"{_FIELD}.num_trees", low=1, high=MAX_POLICY_TREES)
        self.rule: PolicyRule = self.spec.rule(num_trees, **arguments)

    @property
    def policy(self) -> str:
        return self.spec.name

    @property
    def needs(self) -> str:
        """What :meth:`choose` reads (see :data:`NEEDS`)."""
        return self.spec.needs

    @property
    def needs_feature(self) -> bool:
        """Whether :meth:`choose` reads a scalar feature."""
        return self.spec.needs == NEEDS_FEATURE

    @property
    def num_trees(self) -> int:
        return self.rule.num_trees

    @property
    def current(self) -> int:
        """The tree the last step chose (before the first: the policy's starting tree)."""
        return self.rule.current

    def choose(self, reading: Any = None) -> int:
        """Tree index for this step's reading: the confidence ``s`` (``feature``), the per-tree
        values (``values``), the chain length the entropies give (``entropies``), nothing."""
        return self.rule.choose(reading)


def tree_index(value: Any, name: str, num_trees: int) -> int:
    """An index among ``num_trees`` trees."""

    def refuse(field: str, problem: str) -> ConfigError:
        return ConfigError(field, f"is not a tree index: {problem}")

    return integer(value, f"{_FIELD}.{name}", low=0, high=num_trees - 1, error=refuse)


# ------------------------------------------------------------------ the built-in policies
@dataclass
class StaticRule:
    """``static``: always tree ``static_index``."""

    num_trees: int
    static_index: int = 0
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.current = tree_index(self.static_index, "static_index", self.num_trees)

    def choose(self, reading: Any = None) -> int:
        return self.current


@dataclass
class HysteresisRule:
    """``hysteresis``: up to ``high`` (T+) when ``s > tau_on``, down to ``low`` (T-) when ``s <= tau_off``."""

    num_trees: int
    low: int = 0
    high: int = 0
    tau_on: float = 0.01
    tau_off: float = 0.01
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.tau_on, self.tau_off = taus(self.tau_on, self.tau_off, prefix=f"{_FIELD}.")
        self.high = tree_index(self.high, "high", self.num_trees)
        self.current = self.low = tree_index(self.low, "low", self.num_trees)

    def choose(self, s: float) -> int:
        if s > self.tau_on:
            self.current = self.high
        elif s <= self.tau_off:
            self.current = self.low
        return self.current


@dataclass
class LadderRule:
    """``ladder``: the number of ``thresholds`` below ``s`` (K-1 increasing thresholds, K trees)."""

    num_trees: int
    thresholds: tuple[float, ...] = ()
    current: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.thresholds = thresholds(
            self.thresholds, f"{_FIELD}.thresholds", low=-float("inf"), count=self.num_trees - 1
        )

    def choose(self, s: float) -> int:
        self.current = bisect.bisect_left(self.thresholds, s)
        return self.current


@dataclass
class ValueRule:
    """``value``: the tree with the most expected tokens, ``1 + values[k]``, per unit of its
    forward cost ``costs[k]`` (relative to the others; equal when not given)."""

    num_trees: int
    costs: tuple[float, ...] = ()
    current: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        costs = numbers_in(self.costs, f"{_FIELD}.costs")
        if costs and (len(costs) != self.num_trees or min(costs) <= 0):
            raise ConfigError(
                f"{_FIELD}.costs",
                f"must give one positive cost per tree ({self.num_trees}), got {brief_repr(list(costs))}",
            )
        self.costs = costs

    def choose(self, values: list[float]) -> int:
        """Ties go to the earlier, smaller tree."""
        costs = self.costs or (1.0,) * self.num_trees
        rates = [(1.0 + v) / c for v, c in zip(values, costs)]
        self.current = max(range(len(rates)), key=lambda k: (rates[k], -k))
        return self.current


def _hysteresis_from_bank(d: Any, trees: tuple) -> tuple[tuple[int, ...], dict[str, Any]]:
    low, high = sorted((d.conservative, d.aggressive), key=lambda i: trees[i].num_nodes)
    return (low, high), {"low": 0, "high": 1, "tau_on": d.tau_on, "tau_off": d.tau_off}


register_policy(
    "static",
    StaticRule,
    needs=NEEDS_NOTHING,
    aliases=("EntMTP*",),
    what="verifies one tree",
    from_bank=lambda d, trees: ((d.static,), {}),
)
register_policy(
    "hysteresis",
    HysteresisRule,
    needs=NEEDS_FEATURE,
    aliases=("EntMTPτ", "EntMTPtau"),
    min_trees=2,
    what="switches between two trees (T-, T+)",
    from_bank=_hysteresis_from_bank,
)
register_policy(
    "ladder",
    LadderRule,
    needs=NEEDS_FEATURE,
    aliases=("EntMTP-l",),
    sources=("bank", "trees"),
    what="picks among several trees",
    from_bank=lambda d, trees: (tuple(d.ladder), {"thresholds": tuple(d.thresholds)}),
)
register_policy(
    "value",
    ValueRule,
    needs=NEEDS_VALUES,
    aliases=("EntMTP-v",),
    sources=("bank", "trees"),
    what="picks among several trees",
    from_bank=lambda d, trees: (tuple(d.value), {"costs": tuple(d.value_costs)}),
)


def __getattr__(name: str) -> Any:
    """``POLICIES``, ``FEATURE_POLICIES`` and ``POLICY_ALIASES``, read off the registry when asked
    for (so they include policies registered later): the policies a bank may store, those that
    read a scalar feature, and the aliases."""
    if name == "POLICIES":
        return tuple(policy_names(in_banks=True))
    if name == "FEATURE_POLICIES":
        return tuple(policy_names(needs=NEEDS_FEATURE))
    if name == "POLICY_ALIASES":
        return policy_aliases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
