"""``EntMTPConfig``: the per-call decoding settings passed to ``model.generate``.

Kept apart from the heads' config (saved with the weights) and from offline search or
benchmark settings. Values are validated when the object is built; what needs the heads
(tree depth) or the bank (task, scheduler defaults) is checked by :meth:`EntMTPConfig.resolve`
before any forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .scheduling.eas import EASConfig
from .drafting.retrieval import RetrievalConfig, with_branch
from .scheduling.policies import FEATURE_POLICIES, FEATURES, POLICIES, Scheduler
from .trees.tree import Tree

if TYPE_CHECKING:
    from .trees.bank import TopologyBank

ACCEPTANCE_RULES = ("auto", "greedy", "exact", "typical")
#: the scheduler's policies plus ``entropy`` (EAS: truncate the tree where the heads are unsure)
DECODE_POLICIES = (*POLICIES, "entropy")


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

    def new_scheduler(self) -> Scheduler:
        return Scheduler(num_trees=len(self.trees), **self.scheduler_args)

    @property
    def node_counts(self) -> set[int]:
        """Every number of nodes one step may verify (trees, and trees with retrieved branches)."""
        return {t.num_nodes for t in (*self.trees, *(b for per in self.branches for b, _ in per))}

    @property
    def max_nodes(self) -> int:
        """The most nodes one step can verify (a static cache must hold that many more)."""
        return max(self.node_counts)


@dataclass
class EntMTPConfig:
    """How ``generate`` drafts and verifies trees.

    Give a ``bank`` (a :class:`~entmtp_hf.bank.TopologyBank`, a folder or a Hub repo id) and
    its ``task``; or one explicit ``tree`` (a list of paths); or several ``trees`` (smallest
    first). ``policy`` defaults to the bank's calibrated policy (the fastest the search
    measured), and without a bank to ``static`` for one tree, ``hysteresis`` for two trees
    (T- = first, T+ = second) and ``ladder`` for more. ``tau_on``/``tau_off``/``thresholds``
    and ``feature`` default to the bank's calibrated values (``best_path_value`` otherwise).
    ``policy="value"`` verifies, each step, the tree whose drafted nodes carry the most path
    value (the product of head probabilities along a node's path) per unit of ``costs`` (each
    tree's forward cost, relative; equal when not given, the bank's measured costs with one).
    ``acceptance="auto"`` means greedy without sampling and exact (lossless) sampling with
    ``do_sample=True``.

    ``policy="entropy"`` (implied by ``eas=EASConfig(...)``) is entropy-adaptive speculation on
    one tree (``tree=``, or the bank's static optimum): every step verifies the tree truncated
    at the depth where the greedy chain's head entropy first crosses the adaptive threshold
    (see :mod:`entmtp_hf.eas`). The truncations at depths ``0..D`` are compiled up front.

    ``retrieval=True`` (or a :class:`~entmtp_hf.retrieval.RetrievalConfig`) adds to each step's
    tree a branch copied from earlier text whenever the text's last few tokens recur (see
    :mod:`entmtp_hf.retrieval`); verification is unchanged, so output is too. Left unset, a
    bank's calibrated default decides (off without a bank); ``retrieval=False`` turns it off.
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
    revision: str | None = None
    eas: EASConfig | None = None
    retrieval: RetrievalConfig | bool | None = None
    _resolved: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("bank", "tree", "trees") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "EntMTPConfig needs exactly one of `bank` (with `task`), `tree` or `trees`; "
                f"got {given or 'none'}"
            )
        if self.bank is not None and not self.task:
            raise ValueError("EntMTPConfig(bank=...) also needs `task=` (e.g. task='gsm8k')")
        if self.tree is not None:
            Tree.from_choices(self.tree)
        if self.trees is not None:
            if len(self.trees) == 0:
                raise ValueError("`trees` is empty; give at least one tree")
            for t in self.trees:
                Tree.from_choices(t)
        if self.policy is not None and self.policy not in DECODE_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {DECODE_POLICIES}")
        if self.eas is not None:
            if not isinstance(self.eas, EASConfig):
                raise ValueError(f"eas must be an EASConfig, got {type(self.eas).__name__}")
            if self.policy not in (None, "entropy"):
                raise ValueError(f"eas=EASConfig(...) needs policy='entropy', got policy={self.policy!r}")
        if self.policy == "entropy" and self.trees is not None:
            raise ValueError("the entropy policy truncates one tree: pass `tree=` (or a `bank`), not `trees=`")
        if self.retrieval is True:
            self.retrieval = RetrievalConfig()
        elif self.retrieval not in (None, False) and not isinstance(self.retrieval, RetrievalConfig):
            raise ValueError(f"retrieval must be True, False or a RetrievalConfig, got {self.retrieval!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"unknown acceptance {self.acceptance!r}; choose one of {ACCEPTANCE_RULES}")
        if self.feature is not None and self.feature not in FEATURES:
            raise ValueError(f"unknown feature {self.feature!r}; choose one of {FEATURES}")
        if self.tau_on is not None and self.tau_off is not None and self.tau_off > self.tau_on:
            raise ValueError(f"tau_off ({self.tau_off}) must be <= tau_on ({self.tau_on}); lower tau_off")
        if self.thresholds is not None:
            th = list(self.thresholds)
            if any(b <= a for a, b in zip(th, th[1:])):
                raise ValueError(f"ladder thresholds must be strictly increasing, got {th}")
        if not 0.0 < self.posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold must be in (0, 1], got {self.posterior_threshold}")
        if self.posterior_alpha <= 0.0:
            raise ValueError(f"posterior_alpha must be > 0, got {self.posterior_alpha}")
        if self.costs is not None:
            if self.trees is None or len(self.costs) != len(self.trees) or any(not c > 0 for c in self.costs):
                raise ValueError(f"costs must give one positive forward cost per tree in `trees`, got {self.costs!r}")
        if self.policy == "value" and self.tree is not None:
            raise ValueError("the value policy picks among several trees: pass `trees=` or a `bank`")
        if self.policy == "ladder" and self.tree is not None:
            raise ValueError("the ladder policy needs several trees: pass `trees=` or a `bank`")
        if self.policy == "hysteresis" and self.trees is not None and len(self.trees) < 2:
            raise ValueError("the hysteresis policy needs two trees (T-, T+) in `trees`")

    # ------------------------------------------------------------------ resolution
    def load_bank(self) -> "TopologyBank":
        from .trees.bank import TopologyBank

        if isinstance(self.bank, TopologyBank):
            if self.bank.task != self.task:
                raise ValueError(f"the bank given is for task {self.bank.task!r}, not task={self.task!r}")
            return self.bank
        return TopologyBank.from_pretrained(self.bank, task=self.task, revision=self.revision)

    def resolve(self, num_heads: int) -> DecodePlan:
        """Turn this config into a :class:`DecodePlan` for heads with ``num_heads`` heads.

        Cached on the config object, so trees are compiled once and later calls only look
        the plan up.
        """
        plan = self._resolved.get(num_heads)
        if plan is None:
            plan = self._build_plan(num_heads)
            self._resolved[num_heads] = plan
        return plan

    @property
    def entropy_adaptive(self) -> bool:
        return self.policy == "entropy" or self.eas is not None

    def _build_plan(self, num_heads: int) -> DecodePlan:
        if self.entropy_adaptive:
            return self._entropy_plan(num_heads)
        feature = self.feature or "best_path_value"
        bank = self.load_bank() if self.bank is not None else None
        retrieval = self._retrieval(bank)
        if bank is not None:
            trees, policy, args = self._from_bank(bank)
            if self.feature is None:
                feature = bank.scheduler.ladder_feature if policy == "ladder" else bank.scheduler.feature
        elif self.tree is not None:
            trees, policy = (Tree.from_choices(self.tree),), self.policy or "static"
            args = {}
        else:
            all_trees = tuple(Tree.from_choices(t) for t in self.trees)
            policy = self.policy or ("static" if len(all_trees) == 1 else "hysteresis" if len(all_trees) == 2 else "ladder")
            trees, args = all_trees, {"low": 0, "high": min(1, len(all_trees) - 1)}
            if self.costs is not None:
                args["costs"] = tuple(float(c) for c in self.costs)
            if policy == "ladder":
                if self.thresholds is None:
                    raise ValueError(f"the ladder over {len(trees)} trees needs `thresholds` ({len(trees) - 1} values)")
                args["thresholds"] = tuple(self.thresholds)
        _check_depth(trees, num_heads)
        args = {**args, "policy": policy}
        if self.tau_on is not None:
            args["tau_on"] = self.tau_on
        if self.tau_off is not None:
            args["tau_off"] = self.tau_off
        elif self.tau_on is not None and args.get("tau_off", self.tau_on) > self.tau_on:
            args["tau_off"] = self.tau_on
        if policy in FEATURE_POLICIES:
            args.setdefault("tau_off", args.get("tau_on", 0.01))
        Scheduler(num_trees=len(trees), **args)  # validate now, before any compute

        depth = max(t.depth for t in trees)
        chain = Tree.chain(depth) if policy in FEATURE_POLICIES else Tree.root_only()  # what features read
        return _plan(trees, chain, args, feature=feature, retrieval=retrieval)

    def _entropy_plan(self, num_heads: int) -> DecodePlan:
        """Policy ``entropy``: the tree's truncations at depth 0..D (index = depth) and the chain."""
        if self.tree is not None:
            tree, retrieval = Tree.from_choices(self.tree), self._retrieval(None)
        else:
            bank = self.load_bank()
            tree, retrieval = bank.trees[bank.scheduler.static], self._retrieval(bank)
        _check_depth((tree,), num_heads)
        trees = tuple(Tree(tuple(p for p in tree.paths if len(p) <= d)) for d in range(tree.depth + 1))
        args = {"policy": "static", "static_index": tree.depth}
        return _plan(trees, Tree.chain(tree.depth), args, eas=self.eas or EASConfig(), retrieval=retrieval)

    def _retrieval(self, bank: "TopologyBank | None") -> RetrievalConfig | None:
        """The retrieval settings in force: the config's own, else the bank's default (off without one)."""
        if self.retrieval is None:
            return bank.scheduler.retrieval if bank is not None else None
        return self.retrieval or None

    def _from_bank(self, bank: "TopologyBank") -> tuple[tuple[Tree, ...], str, dict]:
        d = bank.scheduler
        trees = tuple(bank.trees)
        policy = self.policy or d.policy
        if policy == "static":
            return (trees[d.static],), policy, {}
        if policy == "hysteresis":
            low, high = sorted((d.conservative, d.aggressive), key=lambda i: trees[i].num_nodes)
            return (trees[low], trees[high]), policy, {"low": 0, "high": 1, "tau_on": d.tau_on, "tau_off": d.tau_off}
        if policy == "value":
            if not d.value:
                raise ValueError(f"the bank for task {bank.task!r} lists no trees for the value policy")
            return tuple(trees[i] for i in d.value), policy, {"costs": tuple(d.value_costs)}
        ladder = tuple(trees[i] for i in d.ladder)
        thresholds = tuple(self.thresholds) if self.thresholds is not None else tuple(d.thresholds)
        return ladder, policy, {"thresholds": thresholds}


def _check_depth(trees: tuple[Tree, ...], num_heads: int) -> None:
    for i, t in enumerate(trees):
        if t.depth > num_heads:
            raise ValueError(
                f"tree #{i} has depth {t.depth} but the heads draft only {num_heads} tokens ahead; "
                f"use a tree of depth <= {num_heads} or heads with more heads"
            )


def _plan(
    trees: tuple[Tree, ...], chain: Tree, scheduler_args: dict, *, feature: str = "best_path_value",
    eas: EASConfig | None = None, retrieval: RetrievalConfig | None = None,
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
