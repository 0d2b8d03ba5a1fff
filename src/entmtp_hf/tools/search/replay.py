"""Replaying greedy decoding from rank tuples: a plan's exact accept lengths without a model.

Under greedy decoding the output does not depend on the trees, so one greedy run of a prompt
and one teacher-forced pass of the heads along it (:func:`~.trajectories.rank_tuples`)
fix what every step of any :class:`~entmtp_hf.banks.plan.DecodePlan` would accept: a drafted
node is the verifier's pick iff its rank equals the rank of the true token at its depth, a
retrieved token iff it is the true token. The scheduler's features come from the same pass
(:data:`SIGNALS`, one value per step start), retrieval from the text so far, exactly as
the decode loop builds them. So the offline search can score every hysteresis and ladder
setting on all its calibration prompts in milliseconds, with no timing noise, instead of
timing each on a few prompts (docs/search.md).

Not replayable: the ``value`` and ``entropy`` policies and the ``chain_value`` feature,
which read the heads' probabilities below the first drafted depth along drafted (not
true) paths.

The same tables bound every scheduler: :func:`foresight_rate` is the best tokens per unit of
verification work that any per-step choice among a set of trees reaches when each step's
accept lengths are known in advance. A real scheduler sees only what the decoder knows when
a step starts; the gap between the two says how much a better confidence signal could win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...banks.plan import DecodePlan, build_plan
from ...config import EntMTPConfig
from ...costs.retrieval import RetrievalFigures
from ...decoding.acceptance import walk_tree
from ...drafting.retrieval import NgramIndex
from ...scheduling.features import FeatureTracker
from ...scheduling.policies import FEATURE_POLICIES
from ...trees.retrieval import RetrievalConfig
from ...trees.tree import Tree
from .trajectories import Trajectory, accepted_depth

#: per step start: head 0's top-1 probability, the verifier's top-1 probability and entropy
#: (nats) at the position the root was chosen from
SIGNALS = ("head_confidence", "base_top1", "entropy")
REPLAY_POLICIES = ("static", *FEATURE_POLICIES)
REPLAY_FEATURES = ("best_path_value", "head_confidence", "base_top1", "confidence", "confidence_ema", "accept_ema")


@dataclass(frozen=True)
class Replay:
    """One generation replayed: tokens added, nodes verified and retrieved tokens found (0: no
    continuation) at every step."""

    accept_lengths: list[int]
    tree_sizes: list[int]
    found: list[int] = field(default_factory=list)


def why_not_replayable(plan: DecodePlan) -> str | None:
    """None when :func:`replay` reproduces ``plan`` exactly, else the reason it cannot."""
    policy = plan.scheduler_args.get("policy")
    if plan.eas is not None or policy not in REPLAY_POLICIES:
        return f"policy {policy if plan.eas is None else 'entropy'!r} reads drafted paths"
    if policy in FEATURE_POLICIES and plan.feature not in REPLAY_FEATURES:
        return f"feature {plan.feature!r} reads drafted paths"
    return None


def _flags(
    tree_paths, sources, union_paths, row: Sequence[int], found: Sequence[int], truth: Sequence[int], union_size: int
) -> list[int]:
    """1 for each node whose token is the true one at its depth (given a true parent), else 0."""
    flags = [1]
    for path, src in zip(tree_paths, sources[1:]):
        d = len(path)
        if src < union_size:
            hit = d <= len(row) and union_paths[src][-1] == row[d - 1]
        else:
            k = src - union_size  # the k-th retrieved token
            hit = k < len(found) and d <= len(truth) and found[k] == truth[d - 1]
        flags.append(int(hit))
    return flags


def replay(traj: Trajectory, plan: DecodePlan, window: int = 8) -> Replay:
    """The accept lengths and verified tree sizes of greedy ``generate`` with ``plan`` on the
    trajectory's prompt, stopping where its rank tuples end (as
    :func:`~.trajectories.simulate_canonical` does).

    Mirrors the decode loop step by step: retrieval first (``replace`` mode verifies the found
    continuation alone and skips the scheduler), else the scheduler reads its feature and
    picks a tree; the accepted tokens then extend the text and the accept-length average."""
    reason = why_not_replayable(plan)
    if reason is not None:
        raise ValueError(f"cannot replay this plan: {reason}")
    if plan.scheduler_args.get("policy") in FEATURE_POLICIES and plan.feature != "accept_ema":
        missing = [s for s in SIGNALS if len(traj.signals.get(s, ())) < len(traj.tuples)]
        if missing:
            raise ValueError(f"the trajectory lacks the signals {missing} the feature {plan.feature!r} reads")
    scheduler, tracker = plan.new_scheduler(), FeatureTracker(plan.feature, window)
    union_paths = [()] + list(plan.union.paths)
    union_size = plan.union.num_nodes
    replace = plan.retrieval is not None and plan.retrieval.mode == "replace"
    prompt_len, tokens = traj.prompt_len, traj.tokens
    index = NgramIndex(plan.retrieval, tokens[: prompt_len + 1]) if plan.retrieval is not None else None
    lengths, sizes, founds, j = [], [], [], 0
    while j < len(traj.tuples):
        found = index.continuation() if index is not None else []
        founds.append(len(found))
        k = scheduler.current
        if scheduler.needs_feature and not (found and replace):
            sig = traj.signals
            chain = [sig["head_confidence"][j]] if tracker.reads_draft else []
            p0, entropy = (sig["base_top1"][j], sig["entropy"][j]) if sig else (0.0, 0.0)
            k = scheduler.choose(tracker.value(p0, entropy, chain))
        if found:
            tree, sources = plan.branches[k][len(found) - 1]
        else:
            tree, sources = plan.trees[k], plan.node_maps[k]
        truth = tokens[prompt_len + j + 1 : prompt_len + j + 1 + tree.depth]
        flags = _flags(tree.paths, sources, union_paths, traj.tuples[j], found, truth, union_size)
        a = len(walk_tree(tree.buffers().children, flags, [1] * len(flags)).path)
        a = min(a, len(tokens) - prompt_len - j - 1)  # the run ends there (a retrieved token may reach past it)
        lengths.append(a)
        sizes.append(tree.num_nodes)
        if index is not None:
            index.extend(tokens[prompt_len + j + 1 : prompt_len + j + 1 + a])
        tracker.observe_accept(a)
        j += a
    return Replay(lengths, sizes, founds)


def retrieval_figures(
    trajectories: Sequence[Trajectory], tree: Tree, retrieval: RetrievalConfig, num_heads: int
) -> RetrievalFigures:
    """``tree`` verified every step with ``retrieval``, replayed on every trajectory and pooled:
    what :mod:`entmtp_hf.costs.retrieval` prices on a machine."""
    plan = build_plan(EntMTPConfig(tree=tree.choices, retrieval=retrieval).plan_spec(), num_heads)
    tokens = drafted = 0
    found = [0] * retrieval.num_tokens
    for traj in trajectories:
        r = replay(traj, plan)
        tokens += sum(r.accept_lengths)
        for n in r.found:
            if n:
                found[n - 1] += 1
            else:
                drafted += 1
    return RetrievalFigures(tokens, drafted, tuple(found))


def accept_table(traj: Trajectory, trees: Sequence[Tree]) -> list[list[int]]:
    """``table[j][k]``: the tokens tree ``k`` adds in a greedy step starting at step start ``j``
    (no retrieval): one plus the depth of its deepest path matching the rank tuple."""
    paths = [set(t.paths) for t in trees]
    return [[1 + accepted_depth(row, p) for p in paths] for row in traj.tuples]


def walk_rate(
    tables: Sequence[Sequence[Sequence[int]]], costs: Sequence[float], choose: Callable[[int, int], int]
) -> tuple[float, float]:
    """(tokens, work) of walking every table with ``choose(prompt, j) -> tree index``."""
    tokens = work = 0.0
    for i, table in enumerate(tables):
        j = 0
        while j < len(table):
            k = choose(i, j)
            tokens, work, j = tokens + table[j][k], work + costs[k], j + table[j][k]
    return tokens, work


def foresight_rate(tables: Sequence[Sequence[Sequence[int]]], costs: Sequence[float], rounds: int = 100) -> float:
    """The most tokens per unit of work (Σ accept / Σ c) of any per-step choice of tree, each
    step's accept lengths (``tables``, from :func:`accept_table`) known in advance.

    Dinkelbach's method: for a rate ``r``, a dynamic programme over step starts finds the walk
    maximising Σ (accept - r·c); its own rate is higher unless ``r`` is already the optimum.
    Starts from the best single tree, so the result is never below any static rate."""
    if not tables or not costs or any(c <= 0 for c in costs):
        raise ValueError("foresight_rate needs tables and positive costs")
    k_range = range(len(costs))
    rate = max(a / w for a, w in (walk_rate(tables, costs, lambda i, j, k=k: k) for k in k_range) if w > 0)
    for _ in range(rounds):
        picks = []
        for table in tables:
            n = len(table)
            value, pick = [0.0] * (n + 1), [0] * n
            for j in range(n - 1, -1, -1):
                best = max(k_range, key=lambda k: table[j][k] - rate * costs[k] + value[min(j + table[j][k], n)])
                pick[j] = best
                value[j] = table[j][best] - rate * costs[best] + value[min(j + table[j][best], n)]
            picks.append(pick)
        tokens, work = walk_rate(tables, costs, lambda i, j: picks[i][j])
        if work <= 0 or tokens / work <= rate * (1 + 1e-12):
            return rate
        rate = tokens / work
    return rate
