"""``EntMTPConfig``: the per-call decoding settings passed to ``model.generate``.

Kept apart from the heads' config (saved with the weights) and from offline search or
benchmark settings. Every field is type- and range-checked when the object is built, and a
bad one raises :class:`~entmtp_hf.errors.ConfigError` naming the field and what it accepts;
what needs the heads (tree depth, drafting vocabulary) or the bank (task, scheduler defaults)
is checked by :meth:`EntMTPConfig.resolve` before any forward pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from .banks.bank import TopologyBank, check_task_name
from .banks.plan import AcceptanceSettings, DecodePlan, PlanSpec, build_plan
from .costs.table import CostTable
from .errors import ConfigError
from .scheduling.eas import EASConfig
from .scheduling.features import FEATURES, MAX_FEATURE_WINDOW, feature_top
from .scheduling.policies import SOURCES, default_policy, get_policy
from .trees.retrieval import RetrievalConfig
from .trees.tree import Tree
from .validation import brief_repr, choice, integer, number, numbers_in, sequence, taus, thresholds

ACCEPTANCE_RULES = ("auto", "greedy", "exact", "typical")
#: typical acceptance: this project's rule, or the published Hydra/Medusa code's (see ``typical_rule``)
TYPICAL_RULES = ("project", "reference")
#: the most trees one ``trees=`` list may schedule (a bank holds at most 1024)
MAX_CONFIG_TREES = 1024


def _name(field_name: str) -> str:
    return f"EntMTPConfig.{field_name}"


def _tree(field_name: str, value: Any) -> Tree:
    try:
        return Tree.from_choices(value)
    except ValueError as e:
        raise ConfigError(_name(field_name), str(e)) from None


@dataclass
class EntMTPConfig:
    """How ``generate`` drafts and verifies trees.

    Give a ``bank`` (a :class:`~entmtp_hf.banks.bank.TopologyBank`, a folder or a Hub repo id)
    and its ``task``; or one explicit ``tree`` (a list of paths); or several ``trees`` (smallest
    first). ``policy`` defaults to the bank's calibrated policy, and without a bank to
    ``static`` for one tree, ``hysteresis`` for two trees (T- = first, T+ = second) and
    ``ladder`` for more (the paper's names ``EntMTP*``, ``EntMTPτ``, ``EntMTP-l``, ``EntMTP-v``
    are accepted too). ``tau_on``/``tau_off``/``thresholds`` and ``feature`` default to the
    bank's calibrated values (``best_path_value`` otherwise); thresholds are in the feature's
    units (probabilities in [0, 1]; ``accept_ema``: tokens per step). ``policy="value"``
    verifies, each step, the tree whose drafted nodes carry the most path value per unit of
    ``costs`` (each tree's relative forward cost; equal when not given, the bank's with one).
    ``acceptance="auto"`` means greedy without sampling and exact (lossless) sampling with
    ``do_sample=True``; ``typical`` is Medusa/Hydra's typical acceptance with
    ``posterior_threshold`` (ε) and ``posterior_alpha`` (α). ``typical_rule="project"`` (default)
    tests the processed scores with the exact entropy and samples the verifier's own token;
    ``"reference"`` computes it as the published code does, to reproduce its figures: on
    ``softmax(raw logits / temperature)`` with the entropy ``-Σ p·log(p + 1e-5)``, the
    verifier's own token by argmax even when sampling.

    ``policy="entropy"`` (implied by ``eas=EASConfig(...)``) is entropy-adaptive speculation on
    one tree (``tree=``, or the bank's static optimum): every step verifies the tree truncated
    at the depth where the greedy chain's head entropy first crosses the adaptive threshold
    (:mod:`entmtp_hf.scheduling.eas`).

    ``retrieval=True`` (or a :class:`~entmtp_hf.trees.retrieval.RetrievalConfig`) adds to each
    step's tree a branch copied from earlier text whenever the text's last few tokens recur;
    left unset, a bank's calibrated default decides (off without a bank).

    ``adapt`` (banks only): a bank that carries its task's acceptance frontier is re-ranked for
    this machine: the step costs are measured once per machine, model and heads (a few seconds,
    logged, cached on disk; ``entmtp-hf calibrate`` does it ahead of time) and EntMTP* becomes
    the tree with the highest modelled speed-up, or plain decoding when none beats it
    (:mod:`entmtp_hf.costs`). ``None`` (default): re-rank where the bank allows it;
    ``False``: the bank's stored choice; ``True``: the bank must allow it.

    ``guard``: the break-even guard (:mod:`entmtp_hf.scheduling.guard`): while the trees' tokens
    per step fall below their cost relative to a root-alone step, steps verify the root alone
    and draft nothing, re-trying the trees after a wait that doubles while they keep losing.
    ``None`` (default): on wherever this machine's measured step costs price the trees (a bank
    that adapts, on a measured machine), off elsewhere; ``True``: on, priced with those or with
    ``costs`` (``trees=``), an error without either; ``False``: off.
    """

    bank: Any = None
    task: str | None = None
    tree: Sequence[Sequence[int]] | None = None
    trees: Sequence[Sequence[Sequence[int]]] | None = None
    policy: str | None = None
    tau_on: float | None = None
    tau_off: float | None = None
    thresholds: Sequence[float] | None = None
    feature: str | None = None
    feature_window: int = 8
    costs: Sequence[float] | None = None
    acceptance: str = "auto"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    typical_rule: str = "project"
    revision: str | None = None
    eas: EASConfig | None = None
    retrieval: RetrievalConfig | bool | None = None
    adapt: bool | None = None
    guard: bool | None = None
    _resolved: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _bank: Any = field(default=None, init=False, repr=False, compare=False)
    _spec: PlanSpec | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_sources()
        if self.policy is not None:
            self.policy = get_policy(self.policy, _name("policy")).name
        self._check_schedule()
        self._check_threshold_units()
        self._check_acceptance()
        if self.revision is not None and not isinstance(self.revision, str):
            raise ConfigError(_name("revision"), f"must be a string (branch, tag or commit), got {self.revision!r}")
        if self.eas is not None:
            if not isinstance(self.eas, EASConfig):
                raise ConfigError(_name("eas"), f"must be an EASConfig, got {type(self.eas).__name__}")
            if self.policy not in (None, "entropy"):
                raise ConfigError(_name("eas"), f"needs policy='entropy', got policy={self.policy!r}")
        if self.adapt not in (None, True, False):
            raise ConfigError(_name("adapt"), f"must be None, True or False, got {self.adapt!r}")
        if self.adapt is not None and self.bank is None:
            raise ConfigError(_name("adapt"), "re-ranks a bank's trees: give a `bank`")
        self._check_guard()
        if self.retrieval is True:
            self.retrieval = RetrievalConfig()
        elif self.retrieval not in (None, False) and not isinstance(self.retrieval, RetrievalConfig):
            raise ConfigError(_name("retrieval"), f"must be True, False or a RetrievalConfig, got {self.retrieval!r}")
        self._check_policy_fits()

    def _check_sources(self) -> None:
        given = [name for name in ("bank", "tree", "trees") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ConfigError(
                "EntMTPConfig", f"needs exactly one of `bank` (with `task`), `tree` or `trees`; got {given or 'none'}"
            )
        if self.bank is not None:
            if not isinstance(self.bank, (str, os.PathLike, TopologyBank)):
                raise ConfigError(
                    _name("bank"), f"must be a TopologyBank, a folder or a Hub repo id, got {type(self.bank).__name__}"
                )
            if not self.task:
                raise ConfigError(_name("task"), "a bank also needs `task=` (e.g. task='gsm8k')")
            try:
                check_task_name(self.task)
            except ValueError as e:
                raise ConfigError(_name("task"), str(e)) from None
        if self.tree is not None:
            _tree("tree", self.tree)
        if self.trees is not None:
            trees = sequence(self.trees, _name("trees"), of="trees", max_len=MAX_CONFIG_TREES)
            if not trees:
                raise ConfigError(_name("trees"), "is empty; give at least one tree")
            for i, t in enumerate(trees):
                _tree(f"trees[{i}]", t)

    def _check_guard(self) -> None:
        """The guard needs prices: measured ones come with a bank that adapts, else ``costs``."""
        if self.guard is not None and not isinstance(self.guard, bool):  # not 0, 1 or "no"
            raise ConfigError(_name("guard"), f"must be None, True or False, got {brief_repr(self.guard)}")
        if self.guard is not True:
            return
        if self.bank is not None and self.adapt is False:
            raise ConfigError(
                _name("guard"),
                "True prices trees with this machine's measured step costs, which "
                "adapt=False leaves out: drop adapt=False",
            )
        if self.bank is None and self.costs is None:
            raise ConfigError(
                _name("guard"),
                "True needs each tree's step cost relative to one token: pass `trees=` "
                "with `costs=` (or a bank, priced by this machine's measured costs)",
            )

    def _check_schedule(self) -> None:
        self.tau_on, self.tau_off = taus(self.tau_on, self.tau_off, low=0.0, prefix="EntMTPConfig.")
        if self.thresholds is not None:
            self.thresholds = thresholds(self.thresholds, _name("thresholds"))
        if self.feature is not None:
            choice(self.feature, _name("feature"), FEATURES)
        self.feature_window = integer(self.feature_window, _name("feature_window"), low=1, high=MAX_FEATURE_WINDOW)
        if self.costs is not None:
            costs = numbers_in(self.costs, _name("costs"), low=0.0, low_open=True, max_len=MAX_CONFIG_TREES)
            if self.trees is None or len(costs) != len(self.trees):
                raise ConfigError(_name("costs"), "must give one positive forward cost per tree in `trees`")
            self.costs = costs

    def _check_threshold_units(self) -> None:
        """Without a bank the feature is known now, so are its units: probabilities in [0, 1],
        ``accept_ema`` in tokens per step (at most the deepest tree's depth + 1). With a bank the
        plan checks them against the bank's feature."""
        if self.bank is not None:
            return
        feature = self.feature or "best_path_value"
        trees = [self.tree] if self.tree is not None else list(self.trees)
        top = feature_top(feature, max(Tree.from_choices(t).depth for t in trees))
        taus(self.tau_on, self.tau_off, low=0.0, high=top, prefix="EntMTPConfig.")
        if self.thresholds is not None:
            thresholds(self.thresholds, _name("thresholds"), high=top)

    def _check_acceptance(self) -> None:
        choice(self.acceptance, _name("acceptance"), ACCEPTANCE_RULES)
        self.posterior_threshold = number(
            self.posterior_threshold, _name("posterior_threshold"), low=0.0, high=1.0, low_open=True
        )
        self.posterior_alpha = number(self.posterior_alpha, _name("posterior_alpha"), low=0.0, low_open=True)
        choice(self.typical_rule, _name("typical_rule"), TYPICAL_RULES)
        if self.typical_rule == "reference" and self.acceptance != "typical":
            raise ConfigError(
                _name("typical_rule"),
                f"'reference' is a typical-acceptance rule: it needs "
                f"acceptance='typical', got acceptance={self.acceptance!r}",
            )

    def _check_policy_fits(self) -> None:
        """The trees given suit the policy (as registered: where it takes its trees from, how many)."""
        source = next(name for name in SOURCES if getattr(self, name) is not None)
        num_trees = len(self.trees) if self.trees is not None else None
        policy = self.policy or ("entropy" if self.eas is not None else None)
        policy = policy or (default_policy(num_trees) if num_trees is not None else None)
        if policy is None:  # the bank's default, checked when the plan is built
            return
        spec = get_policy(policy)
        if source not in spec.sources:
            given = " or ".join(f"`{s}=`" if s != "bank" else "a `bank`" for s in spec.sources)
            raise ConfigError(_name("policy"), f"the {spec.name} policy {spec.what}: pass {given}")
        if num_trees is not None and num_trees < spec.min_trees:
            raise ConfigError(
                _name("policy"), f"the {spec.name} policy {spec.what}: `trees` needs at least {spec.min_trees} trees"
            )
        if self.thresholds is not None and num_trees is not None and "thresholds" in spec.arguments:
            thresholds(self.thresholds, _name("thresholds"), count=num_trees - 1)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (a bank object is written as its task's name only)."""
        out = {}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, (EASConfig, RetrievalConfig)):
                value = dict(vars(value))
            elif isinstance(value, TopologyBank):  # not plain data: save it with save_pretrained
                value = f"<TopologyBank task={value.task!r}>"
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EntMTPConfig":
        """Inverse of :meth:`to_dict` for configs whose bank is a folder or a repo id."""
        if not isinstance(data, dict):
            raise ConfigError("EntMTPConfig", f"from_dict takes a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls) if not f.name.startswith("_")})
        if unknown:
            raise ConfigError("EntMTPConfig", f"unknown fields {unknown}")
        data = dict(data)
        if isinstance(data.get("eas"), dict):
            data["eas"] = EASConfig(**data["eas"])
        if isinstance(data.get("retrieval"), dict):
            data["retrieval"] = RetrievalConfig(**data["retrieval"])
        return cls(**data)

    # ------------------------------------------------------------------ resolution
    def plan_spec(self) -> PlanSpec:
        """The settings a plan is built from, as typed data (the bank loaded, the trees compiled):
        what :func:`~entmtp_hf.banks.plan.build_plan` reads, so the layers below never see this
        config. Read once per config object; every field was checked when it was built."""
        if self._spec is None:
            self._spec = PlanSpec(
                bank=self.load_bank() if self.bank is not None else None,
                tree=Tree.from_choices(self.tree) if self.tree is not None else None,
                trees=tuple(Tree.from_choices(t) for t in self.trees) if self.trees is not None else None,
                policy=self.policy,
                tau_on=self.tau_on,
                tau_off=self.tau_off,
                thresholds=tuple(self.thresholds) if self.thresholds is not None else None,
                feature=self.feature,
                feature_window=self.feature_window,
                costs=tuple(float(c) for c in self.costs) if self.costs is not None else None,
                eas=self.eas,
                retrieval=self.retrieval,
                guard=self.guard,
                acceptance=AcceptanceSettings(
                    self.acceptance, self.posterior_threshold, self.posterior_alpha, self.typical_rule
                ),
            )
        return self._spec

    def load_bank(self) -> TopologyBank:
        """The bank (read once per config object)."""
        if isinstance(self.bank, TopologyBank):
            if self.bank.task != self.task:
                raise ConfigError(_name("task"), f"the bank given is for task {self.bank.task!r}, not {self.task!r}")
            return self.bank
        if self._bank is None:
            self._bank = TopologyBank.from_pretrained(self.bank, task=self.task, revision=self.revision)
        return self._bank

    @property
    def adapts(self) -> bool:
        """Whether this config re-ranks its bank for the machine (see ``adapt``)."""
        if self.bank is None or self.adapt is False:
            return False
        if self.load_bank().frontier:
            return True
        if self.adapt:
            raise ConfigError(_name("adapt"), f"the bank for task {self.task!r} carries no acceptance frontier")
        return False

    def resolve(self, num_heads: int, draft_rows: int | None = None, costs: CostTable | None = None) -> DecodePlan:
        """The :class:`~entmtp_hf.banks.plan.DecodePlan` for heads with ``num_heads`` heads drafting
        from ``draft_rows`` tokens, ranked by ``costs`` (a machine's step costs) if the config
        adapts. Cached on the config, so trees are compiled once and later calls only look the
        plan up."""
        costs = costs if self.adapts else None
        key = (num_heads, draft_rows, costs.key if costs is not None else None)
        plan = self._resolved.get(key)
        if plan is None:
            plan = self._resolved[key] = build_plan(self.plan_spec(), num_heads, draft_rows, costs)
        return plan
