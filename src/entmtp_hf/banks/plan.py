"""The decode plan: what one ``generate`` call decodes with, built from a :class:`PlanSpec`.

The spec is the call's settings as plain typed data, read once from the user's ``EntMTPConfig``
(already checked, its bank loaded) where ``generate`` is called: this layer sits below the
config and never sees it.

A plan holds the trees a step may verify, their union (drafted once when the choice needs the
whole draft), index maps from each tree into the union, the greedy chain the confidence
feature reads, the scheduler's settings and, with retrieval on, every tree with a retrieved
branch of each length. Everything here is built before the prefill, so a bad tree, bank or
threshold is refused before any compute and a step only looks things up.

With the break-even guard on (:mod:`entmtp_hf.scheduling.guard`), the plan also prices every
tree it may verify relative to a root-alone step, ``c(T) / c(1)``: from this machine's measured
step costs (a bank that adapts), or from the user's ``costs`` (relative to one token, so a
root-alone step costs 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from ..costs.table import CostTable
from ..errors import ConfigError
from ..scheduling.eas import EASConfig
from ..scheduling.features import feature_top
from ..scheduling.policies import (
    NEEDS_ENTROPIES,
    NEEDS_FEATURE,
    PolicySpec,
    Scheduler,
    default_policy,
    get_policy,
)
from ..trees.retrieval import RetrievalConfig, with_branch
from ..trees.tree import Tree
from ..validation import number, numbers_in

if TYPE_CHECKING:
    from .bank import TopologyBank
    from .format import SchedulerDefaults


@dataclass(frozen=True)
class AcceptanceSettings:
    """How a step accepts drafted tokens (``EntMTPConfig.acceptance`` and its typical-acceptance
    settings); the rule itself is fixed once the call's generation config is known
    (:func:`entmtp_hf.decoding.loop.acceptance_rule`)."""

    rule: str = "auto"  # auto | greedy | exact | typical
    posterior_threshold: float = 0.09  # typical: epsilon
    posterior_alpha: float = 0.3  # typical: alpha
    typical_rule: str = "project"  # project | reference


@dataclass(frozen=True)
class PlanSpec:
    """What a plan is built from: the call's settings, checked when the ``EntMTPConfig`` was built
    and read from it once (:meth:`~entmtp_hf.config.EntMTPConfig.plan_spec`). Exactly one of
    ``bank`` (loaded), ``tree`` and ``trees`` is set."""

    bank: TopologyBank | None = None
    tree: Tree | None = None
    trees: tuple[Tree, ...] | None = None
    policy: str | None = None  # a registered policy's name; None: the bank's, else by the number of trees
    tau_on: float | None = None
    tau_off: float | None = None
    thresholds: tuple[float, ...] | None = None
    feature: str | None = None
    feature_window: int = 8
    costs: tuple[float, ...] | None = None  # one per tree of ``trees``, relative to one token
    eas: EASConfig | None = None
    retrieval: RetrievalConfig | Literal[False] | None = None  # None: the bank's default; False: off
    guard: bool | None = None
    acceptance: AcceptanceSettings = AcceptanceSettings()

    @property
    def entropy_adaptive(self) -> bool:
        """Whether the policy reads per-depth entropies (EAS; implied by ``eas``)."""
        return self.eas is not None or (self.policy is not None and get_policy(self.policy).needs == NEEDS_ENTROPIES)


@dataclass(frozen=True)
class DecodePlan:
    """What one generate call decodes with: the trees, their union and the policy."""

    trees: tuple[Tree, ...]
    union: Tree  # every scheduled tree (and the greedy chain the feature reads) merged
    node_maps: tuple[tuple[int, ...], ...]  # per tree: its nodes' indices in ``union``
    chain_nodes: tuple[int, ...]  # union indices of the greedy chain [0], [0,0], ... (depth order)
    scheduler_args: dict
    feature: str = "best_path_value"  # the scalar the hysteresis / ladder policy reads
    eas: EASConfig | None = None  # policy ``entropy``: ``trees[d]`` is the tree truncated at depth d
    retrieval: RetrievalConfig | None = None
    #: with retrieval: ``branches[k][L - 1]`` = (tree k plus a retrieved chain of L tokens, where
    #: each of its nodes' tokens comes from: index < union size = union node, else retrieved token)
    branches: tuple[tuple[tuple[Tree, tuple[int, ...]], ...], ...] = ()
    #: the break-even guard's prices (None: the guard is off): each tree's step cost over a
    #: root-alone step's, and ``branch_costs[k][L - 1]`` that of ``branches[k][L - 1]``
    step_costs: tuple[float, ...] | None = None
    branch_costs: tuple[tuple[float, ...], ...] = ()
    feature_window: int = 8  # the steps the feature averages over
    acceptance: AcceptanceSettings = AcceptanceSettings()

    @property
    def guarded(self) -> bool:
        """Whether the break-even guard runs (the plan is priced)."""
        return self.step_costs is not None

    def new_scheduler(self) -> Scheduler:
        return Scheduler(num_trees=len(self.trees), **self.scheduler_args)

    @property
    def policy(self) -> str:
        """The scheduler's policy."""
        return self.scheduler_args["policy"]

    @property
    def plain(self) -> bool:
        """Nothing to draft: the root alone every step, no retrieval (``generate`` runs plain decoding)."""
        return self.union.num_nodes == 1 and self.retrieval is None and self.eas is None

    @property
    def node_counts(self) -> set[int]:
        """Every number of nodes one step may verify (trees, and trees with retrieved branches)."""
        return {t.num_nodes for t in (*self.trees, *(b for per in self.branches for b, _ in per))}

    @property
    def max_nodes(self) -> int:
        """The most nodes one step can verify (a static cache must hold that many more)."""
        return max(self.node_counts)


def build_plan(
    spec: PlanSpec, num_heads: int, draft_rows: int | None = None, costs: CostTable | None = None
) -> DecodePlan:
    """The plan of ``spec`` for heads with ``num_heads`` heads drafting from ``draft_rows`` tokens
    (ranks at or above it cannot be drafted); ``costs``: this machine's step costs, which re-rank
    a bank that carries its acceptance frontier."""
    if spec.entropy_adaptive:
        plan = _entropy_plan(spec, num_heads, costs)
    else:
        plan = _switching_plan(spec, num_heads, costs)
    _check_trees(plan.trees, num_heads, draft_rows)
    plan = replace(plan, feature_window=spec.feature_window, acceptance=spec.acceptance)
    return _priced(plan, spec, costs)


def _priced(plan: DecodePlan, settings: PlanSpec, costs: CostTable | None) -> DecodePlan:
    """The plan with the break-even guard's prices where the guard is on: this machine's measured
    costs, else (``guard=True``) the caller's ``costs``. ``guard=None`` guards where measured
    costs price the trees for a forward of one row, and leaves the plan as it is elsewhere: a
    batch's forward is padded to its widest row, so one row verifying its root alone saves none
    of it and only loses that row's drafted tokens."""
    if settings.guard is False or plan.plain:
        return plan
    if settings.guard is None and (costs is None or costs.batch_size > 1):
        return plan
    if costs is not None:
        root = costs.step(Tree.root_only())

        def price(tree: Tree, k: int) -> float:
            return costs.step(tree) / root
    elif settings.costs is not None:  # the user's, relative to one token; a tree's branches at its tree's price

        def price(tree: Tree, k: int) -> float:
            return settings.costs[k]
    else:
        raise ConfigError(
            "EntMTPConfig.guard",
            "True needs each tree's step cost: this machine's measured costs "
            "(a bank that adapts, after calibrate(model)) or `costs=` with `trees=`",
        )
    step_costs = tuple(price(t, k) for k, t in enumerate(plan.trees))
    branch_costs = tuple(tuple(price(b, k) for b, _ in per) for k, per in enumerate(plan.branches))
    return replace(plan, step_costs=step_costs, branch_costs=branch_costs)


def _switching_plan(settings: PlanSpec, num_heads: int, costs: CostTable | None) -> DecodePlan:
    feature = settings.feature or "best_path_value"
    bank = settings.bank
    defaults = bank.scheduler_for(costs) if bank is not None else None
    retrieval = _retrieval(settings, defaults)
    if bank is not None:
        trees, spec, args = _from_bank(settings, bank, defaults)
        if settings.feature is None:
            feature = defaults.ladder_feature if spec.name == "ladder" else defaults.feature
    elif settings.tree is not None:
        trees, spec, args = (settings.tree,), get_policy(settings.policy or "static"), {}
    else:
        trees, spec, args = _from_trees(settings)
    if settings.tau_on is not None:
        args["tau_on"] = settings.tau_on
    if settings.tau_off is not None:
        args["tau_off"] = settings.tau_off
    elif settings.tau_on is not None and args.get("tau_off", settings.tau_on) > settings.tau_on:
        args["tau_off"] = settings.tau_on
    depth = max(t.depth for t in trees)
    if spec.needs == NEEDS_FEATURE:
        args.setdefault("tau_off", args.get("tau_on", 0.01))
        _check_thresholds(feature, args, depth)
    args = {"policy": spec.name, **{k: v for k, v in args.items() if k in spec.arguments}}
    try:
        Scheduler(num_trees=len(trees), **args)  # validated now, before any compute
    except ConfigError as e:  # the scheduler's arguments that can be wrong here are EntMTPConfig's fields
        raise ConfigError(e.field.replace("Scheduler", "EntMTPConfig", 1), e.problem) from None
    chain = Tree.chain(depth) if spec.needs == NEEDS_FEATURE else Tree.root_only()  # what features read
    return _plan(trees, chain, args, feature=feature, retrieval=retrieval)


def _from_trees(settings: PlanSpec) -> tuple[tuple[Tree, ...], PolicySpec, dict]:
    trees = settings.trees
    spec = get_policy(settings.policy or default_policy(len(trees)))
    args: dict = {"low": 0, "high": min(1, len(trees) - 1)}
    if settings.costs is not None:
        args["costs"] = settings.costs
    if "thresholds" in spec.arguments:
        if settings.thresholds is None:
            raise ConfigError(
                "EntMTPConfig.thresholds",
                f"the {spec.name} policy over {len(trees)} trees needs {len(trees) - 1} increasing values",
            )
        args["thresholds"] = settings.thresholds
    return trees, spec, args


def _from_bank(
    settings: PlanSpec, bank: "TopologyBank", d: "SchedulerDefaults"
) -> tuple[tuple[Tree, ...], PolicySpec, dict]:
    """The bank's trees for the policy (its static tree alone when that is the root: plain
    decoding pays most there), with the policy's arguments from the bank and the caller's."""
    trees = tuple(bank.trees)
    spec = get_policy(settings.policy or d.policy)
    if spec.from_bank is None:
        raise ConfigError("EntMTPConfig.policy", f"the {spec.name} policy takes no trees from a bank's scheduler")
    if spec.name == "static" or trees[d.static].num_nodes == 1:
        spec = get_policy("static")
    indices, args = spec.from_bank(d, trees)
    if not indices:
        raise ConfigError(
            "EntMTPConfig.policy", f"the bank for task {bank.task!r} lists no trees for the {spec.name} policy"
        )
    if settings.thresholds is not None and "thresholds" in spec.arguments:
        args["thresholds"] = settings.thresholds
    return tuple(trees[i] for i in indices), spec, args


def _entropy_plan(settings: PlanSpec, num_heads: int, costs: CostTable | None) -> DecodePlan:
    """Policy ``entropy``: the tree's truncations at depth 0..D (index = depth) and the chain."""
    if settings.tree is not None:
        tree, retrieval = settings.tree, _retrieval(settings, None)
    else:
        defaults = settings.bank.scheduler_for(costs)
        tree, retrieval = settings.bank.trees[defaults.static], _retrieval(settings, defaults)
    trees = tuple(Tree(tuple(p for p in tree.paths if len(p) <= d)) for d in range(tree.depth + 1))
    args = {"policy": get_policy(settings.policy or "entropy").name}
    return _plan(trees, Tree.chain(tree.depth), args, eas=settings.eas or EASConfig(), retrieval=retrieval)


def _retrieval(settings: PlanSpec, defaults: "SchedulerDefaults | None") -> RetrievalConfig | None:
    """The retrieval settings in force: the caller's own, else the bank's default (off without one)."""
    if settings.retrieval is None:
        return defaults.retrieval if defaults is not None else None
    return settings.retrieval or None


def _check_thresholds(feature: str, args: dict, depth: int) -> None:
    """Thresholds in the feature's units: probabilities in [0, 1], tokens per step in [0, depth + 1]."""
    top = feature_top(feature, depth)

    def refuse(field: str, problem: str) -> ConfigError:
        return ConfigError(field, f"{problem}, the range of feature {feature!r}")

    for name in ("tau_on", "tau_off"):
        if args.get(name) is not None:
            number(args[name], f"EntMTPConfig.{name}", low=0.0, high=top, error=refuse)
    numbers_in(args.get("thresholds", ()), "EntMTPConfig.thresholds", low=0.0, high=top, error=refuse)


def _check_trees(trees: tuple[Tree, ...], num_heads: int, draft_rows: int | None) -> None:
    """Every tree must be draftable: no deeper than the heads, no rank beyond their vocabulary."""
    for i, t in enumerate(trees):
        if t.depth > num_heads:
            raise ConfigError(
                "EntMTPConfig",
                f"tree #{i} has depth {t.depth} but the heads draft only {num_heads} "
                f"tokens ahead; use a tree of depth <= {num_heads} or heads with more heads",
            )
        widest = max((r for p in t.paths for r in p), default=-1)
        if draft_rows is not None and widest >= draft_rows:
            raise ConfigError(
                "EntMTPConfig",
                f"tree #{i} asks for the rank-{widest} child but the heads draft from "
                f"{draft_rows} tokens; use ranks below {draft_rows}",
            )


def _plan(
    trees: tuple[Tree, ...],
    chain: Tree,
    scheduler_args: dict,
    *,
    feature: str = "best_path_value",
    eas: EASConfig | None = None,
    retrieval: RetrievalConfig | None = None,
) -> DecodePlan:
    """The plan over ``trees``: their union with ``chain`` (read by the feature) and index maps."""
    union = trees[0].union(*trees[1:], chain)
    index = union.node_index()
    node_maps = tuple(tuple(union.subtree_map(t)) for t in trees)
    branches = ()
    if retrieval is not None:
        replace = retrieval.mode == "replace"  # root + the chain only; else tree k + the chain

        def branch(k: int, length: int) -> tuple[Tree, tuple[int, ...]]:
            tree, sources = with_branch(Tree.root_only() if replace else trees[k], length)
            return tree, tuple(node_maps[k][i] if i >= 0 else union.num_nodes - i - 1 for i in sources)

        branches = tuple(tuple(branch(k, n) for n in range(1, retrieval.num_tokens + 1)) for k in range(len(trees)))
    return DecodePlan(
        trees=trees,
        union=union,
        node_maps=node_maps,
        chain_nodes=tuple(index[(0,) * d] for d in range(1, chain.depth + 1)),
        scheduler_args=scheduler_args,
        feature=feature,
        eas=eas,
        retrieval=retrieval,
        branches=branches,
    )
