"""Offline tree search: from a model, its draft heads and a task to a calibrated bank.

Stages (DESIGN §1, "Offline: building a per-task tree bank"), each checkpointed as JSON in
the work folder so an interrupted search resumes where it stopped:

1. ``trajectories`` - one greedy generation per calibration prompt, then one teacher-forced
   pass of the heads along prompt + output. At every step start ``t`` (root = x_{t+1},
   heads conditioned on h_t) the **rank tuple** (r_0, ..., r_{D-1}) of the true
   continuation is stored: r_i is the rank of x_{t+i+2} in head i's distribution given
   the true path. A greedy step at ``t`` accepts depth ``d`` iff (r_0..r_{d-1}) is a path
   of the tree, so ``accept(T, t) = 1 + #{prefixes of the tuple that are paths of T}``.
2. ``frontier`` - Algorithm 1, the greedy acceptance frontier: from the root-only tree add
   the frontier node ν (next-rank sibling or first child, depth <= D, rank < V') with the
   largest mean accept length; ties go to the smaller rank sum, then the shallower node.
   With rank tuples the gain of ν is the number of positions whose tuple starts with ν's
   path, so every candidate is scored by one dictionary lookup. ``scoring="rollout"``
   scores them instead by one self-rollout with the joint tree T ∪ F(T) (the trajectory
   advances with T, each candidate's accept length is read off the verifier's results
   masked to its paths), which also covers sampling and typical acceptance.
3. ``rollouts`` - debias + throughput: each timed frontier tree (plain decoding and
   mc_sim_7b_63 too) runs ``generate`` on the first ``timing_prompts`` calibration prompts,
   interleaved, after one untimed warm-up each. The runs give the unbiased (canonical)
   accept length and tokens/s (median over prompts). For greedy decoding the rank tuples
   also give every frontier tree's canonical accept length exactly (:func:`simulate_canonical`).
4. ``costs`` - c(N), the forward time for N tokens over one token, for every timed size
   (interleaved medians). With ``ranking="modelled"`` (the default) trees and schedulers are
   ranked by decoded tokens per one-token forward: a run's tokens over Σ c(N) of its steps,
   scaled by its own share of time outside the forwards. On a shared CPU single-run wall
   times vary by tens of percent; this ranking only lets that noise in through the small
   overhead share. ``ranking="measured"`` ranks by wall-clock tokens/s.
5. ``sweep`` - EntMTP* = the throughput-maximal tree; T- / T+ = the fastest smaller / larger
   timed tree; hysteresis (every pair of the three) × τ × feature and ladder thresholds are
   scored against the static tree: replayed along the rank tuples of every calibration prompt
   (:mod:`entmtp_hf.replay`, greedy with the modelled ranking), else timed on the sweep
   prompts like the retrieval runs and the value policy.
6. ``outputs`` - the bank, plots and report (:mod:`entmtp_hf.search_report`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ...config import EntMTPConfig
from ...decoding.stats import PhaseTimer
from ..profile import forward_costs as profile_forward_costs
from ..profile import interpolate_cost
from .replay import accepted_depth, replay, why_not_replayable
from ...drafting.retrieval import RetrievalConfig
from ...scheduling.features import FEATURES, threshold, top1_and_entropy
from ...scheduling.policies import FEATURE_POLICIES
from ...trees.tree import MC_SIM_7B_63, Path, Tree
from ...decoding.acceptance import sample_picks, typical_accept_flags
from ...decoding.attention import tree_attention_mask
from ...decoding.cache import keep_accepted

if TYPE_CHECKING:
    from .report import SearchResult

#: hysteresis thresholds and ladder cut points swept per feature, on the probability scale
#: (:func:`~entmtp_hf.scheduler.threshold` maps them to ``accept_ema``'s tokens per step)
TAU_GRID = (0.05, 0.2, 0.4, 0.6, 0.8)
TIMED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SCORINGS = ("rank_tuple", "rollout")
RULES = ("greedy", "exact", "typical")
#: the sweep's runs of the static tree with retrieval branches: appended (up to 4 tokens), or
#: verified instead of the tree (2 tokens: a 3-node tree, which costs about one forward on a CPU)
RETRIEVAL_RUNS = {
    "static+retrieval": RetrievalConfig(),
    "static+retrieval-replace": RetrievalConfig(mode="replace", num_tokens=2),
}
VANILLA = "vanilla"
REFERENCE = "mc_sim_7b_63"
RANKINGS = ("modelled", "measured")
#: what is kept of each timed run (the last three only for EntMTP runs)
RUN_KEYS = ("seconds", "new_tokens", "accept_lengths", "tree_sizes", "forward_seconds", "decode_seconds")


# ============================================================================ settings
@dataclass
class SearchConfig:
    """Offline search settings (kept apart from heads and per-call decoding configs).

    The defaults finish one task on the demo model on a 2-core CPU in about half an hour.
    """

    num_prompts: int = 16  # calibration prompts of the acceptance frontier (one greedy run each)
    timing_prompts: int = 6  # first prompts of those timed with generate (debias + throughput)
    max_new_tokens: int = 64  # per generation
    budget: int = 64  # node budget B, root included (mc_sim_7b_63 has 64 nodes)
    max_depth: int | None = None  # D; None = number of heads
    scoring: str = "rank_tuple"  # or "rollout" (joint-tree self-rollout)
    acceptance: str = "greedy"  # rule of the rollout scoring and of every generate run
    temperature: float = 0.7  # for exact / typical acceptance
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    timed_sizes: tuple[int, ...] | None = TIMED_SIZES  # frontier sizes to time; None = every k-th
    time_every: int = 1  # with timed_sizes=None: time every k-th frontier size (and the last)
    time_reference: bool = True  # also time mc_sim_7b_63 when the heads can draft it
    sweep_prompts: int = 3  # first calibration prompts of the timed sweep (hysteresis and ladder are replayed on all)
    tau_grid: tuple[float, ...] = TAU_GRID
    features: tuple[str, ...] = ("head_confidence", "accept_ema")  # tau_grid mapped by scheduler.threshold
    ladder: bool = True  # calibrate ladder thresholds (adjacent pairs of tau_grid)
    retrieval: bool = True  # also time the static tree with retrieval branches (the bank's retrieval default)
    ranking: str = "modelled"  # choose trees and schedulers by modelled or by measured tokens/s
    cost_repeats: int = 60  # interleaved rounds of the forward-cost measurement (15 left c(2) off by up to 7%)
    seed: int = 123

    def __post_init__(self) -> None:
        self.timed_sizes = tuple(self.timed_sizes) if self.timed_sizes is not None else None
        self.tau_grid, self.features = tuple(self.tau_grid), tuple(self.features)
        for name in ("num_prompts", "timing_prompts", "max_new_tokens", "budget", "time_every", "sweep_prompts",
                     "cost_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"SearchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens < 2:
            raise ValueError("SearchConfig.max_new_tokens must be >= 2 (the first token comes from the prefill)")
        if self.ranking not in RANKINGS:
            raise ValueError(f"SearchConfig.ranking must be one of {RANKINGS}, got {self.ranking!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"SearchConfig.scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.acceptance not in RULES:
            raise ValueError(f"SearchConfig.acceptance must be one of {RULES}, got {self.acceptance!r}")
        if self.scoring == "rank_tuple" and self.acceptance != "greedy":
            raise ValueError("rank-tuple scoring holds for greedy decoding only: use scoring='rollout' for sampling")
        if self.temperature <= 0:
            raise ValueError(f"SearchConfig.temperature must be > 0, got {self.temperature}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"SearchConfig.max_depth must be >= 1, got {self.max_depth}")
        if not self.tau_grid or any(not 0.0 <= t <= 1.0 for t in self.tau_grid):
            raise ValueError(f"SearchConfig.tau_grid must list thresholds in [0, 1], got {self.tau_grid}")
        bad = [f for f in self.features if f not in FEATURES]
        if not self.features or bad:
            raise ValueError(f"SearchConfig.features must come from {FEATURES}, got {list(self.features)}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))


# ============================================================================ rank tuples
@dataclass
class Trajectory:
    """One calibration prompt's greedy run and the rank tuple of every step start.

    ``tuples[j]`` belongs to step start ``t = prompt_len - 1 + j``; it lists the ranks of the
    true tokens up to (not including) the first one the heads cannot draft within the rank
    cap, and never reaches the last token (a step's emission ends there anyway). ``signals``
    are empty in checkpoints written before they were recorded.
    """

    prompt_len: int
    tokens: list[int]  # prompt + greedy output
    tuples: list[list[int]]
    #: per step start, what the scheduler's features read (:data:`~entmtp_hf.replay.SIGNALS`)
    signals: dict[str, list[float]] = field(default_factory=dict)


@torch.no_grad()
def step_table(
    model, heads, tokens: Sequence[int], prompt_len: int, max_depth: int, rank_cap: int
) -> tuple[list[list[int]], dict[str, list[float]]]:
    """Rank tuples of the true continuation at every step start, and the scheduler's
    :data:`~entmtp_hf.replay.SIGNALS` there, from one teacher-forced pass."""
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([list(tokens)], device=device)
    out = model(input_ids=ids, output_hidden_states=-1)
    hidden = out.hidden_states[-1]
    logits = heads.forward_train(hidden, ids, model.get_input_embeddings(), model.get_output_embeddings())
    length = len(tokens)
    starts = torch.arange(prompt_len - 1, length - 2, device=device)  # t = P-1 .. L-3
    vocab = logits[0].shape[-1]
    to_draft = torch.full((max(heads.config.vocab_size, int(ids.max()) + 1),), -1, dtype=torch.long, device=device)
    if heads.draft_vocab is not None:
        to_draft[heads.draft_vocab.to(device)] = torch.arange(vocab, device=device)
    else:
        to_draft[:vocab] = torch.arange(vocab, device=device)
    columns = []
    for i in range(max_depth):
        target = starts + i + 2  # head i at row t predicts x_{t+i+2}
        valid = target <= length - 2  # the last token is never drafted-and-accepted: the run stops there
        if logits[i].shape[1] == 0:
            columns.append(torch.full_like(starts, -1))
            continue
        rows = logits[i][0, starts.clamp(max=logits[i].shape[1] - 1)]
        draft_id = to_draft[ids[0, target.clamp(max=length - 1)]]
        true_logit = rows.gather(1, draft_id.clamp(min=0)[:, None])
        rank = (rows > true_logit).sum(-1)
        ok = valid & (draft_id >= 0) & (rank < rank_cap)
        columns.append(torch.where(ok, rank, torch.full_like(rank, -1)))
    table = torch.stack(columns, dim=1).tolist() if columns else [[] for _ in range(len(starts))]
    base_top1, entropy = top1_and_entropy(out.logits[0, starts])
    signals = {"base_top1": base_top1.tolist(), "entropy": entropy.tolist()}
    if logits and logits[0].shape[1] > 0:
        signals["head_confidence"] = torch.softmax(logits[0][0, starts].float(), -1).max(-1).values.tolist()
    return [row[: row.index(-1)] if -1 in row else row for row in table], signals


def rank_tuples(model, heads, tokens: Sequence[int], prompt_len: int, max_depth: int, rank_cap: int) -> list[list[int]]:
    """Rank tuples of the true continuation at every step start (:func:`step_table`)."""
    return step_table(model, heads, tokens, prompt_len, max_depth, rank_cap)[0]


def prefix_counts(trajectories: Iterable[Trajectory]) -> tuple[dict[Path, int], int]:
    """How many step starts have each path as a prefix of their rank tuple, and the number of starts."""
    counts: dict[Path, int] = {}
    total = 0
    for traj in trajectories:
        total += len(traj.tuples)
        for row in traj.tuples:
            for k in range(1, len(row) + 1):
                key = tuple(row[:k])
                counts[key] = counts.get(key, 0) + 1
    return counts, total


def simulate_canonical(traj: Trajectory, tree: Tree) -> list[int]:
    """Accept lengths of a greedy ``generate`` with ``tree``, read off the rank tuples.

    Steps start only where the previous one ended: t_0 = P-1, t_{k+1} = t_k + a_k.
    """
    paths, lengths, j = set(tree.paths), [], 0
    while j < len(traj.tuples):
        a = 1 + accepted_depth(traj.tuples[j], paths)
        lengths.append(a)
        j += a
    return lengths


def table_accept(trajectories: Sequence[Trajectory], tree: Tree) -> float:
    """Mean accept length of ``tree`` over every step start (the rank-tuple estimate)."""
    counts, total = prefix_counts(trajectories)
    return 1.0 + sum(counts.get(p, 0) for p in tree.paths) / max(total, 1)


# ============================================================================ the frontier
@dataclass(frozen=True)
class FrontierPoint:
    """One tree of the greedy acceptance frontier and its (biased) mean accept length."""

    tree: Tree
    accept: float
    added: Path | None  # the node added to the previous frontier tree (None for the root)

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes


def frontier_nodes(tree: Tree, max_depth: int, max_rank: int) -> list[Path]:
    """F(T): the first child of every node and the next-rank sibling of every non-root node."""
    have = set(tree.paths)
    found: list[Path] = []
    for p in ((), *tree.paths):
        options = [p + (0,)] if len(p) < max_depth else []
        if p and p[-1] + 1 < max_rank:
            options.append(p[:-1] + (p[-1] + 1,))
        found += [q for q in options if q not in have and q not in found]
    return found


def _preference(path: Path) -> tuple:
    """Tie-break among equal scores: smaller rank sum, then shallower, then lexicographic."""
    return (sum(path), len(path), path)


ScoreFn = Callable[[Tree, list[Path]], tuple[float, list[float]]]


def greedy_frontier(
    score: ScoreFn,
    budget: int,
    max_depth: int,
    max_rank: int,
    start: Sequence[FrontierPoint] = (),
    on_step: Callable[[list[FrontierPoint]], None] | None = None,
    progress: bool = False,
) -> list[FrontierPoint]:
    """Algorithm 1: grow the tree one node at a time until it has ``budget`` nodes.

    ``score(T, candidates)`` returns the mean accept length of T and of every T ∪ {ν}.
    ``start`` resumes an interrupted run; ``on_step`` sees the frontier after every step.
    """
    points = list(start)
    if not points:
        base, _ = score(Tree.root_only(), [])
        points.append(FrontierPoint(Tree.root_only(), base, None))
    bar = tqdm(total=budget, initial=points[-1].num_nodes, desc="frontier", unit="node", disable=not progress)
    while points[-1].num_nodes < budget:
        tree = points[-1].tree
        candidates = frontier_nodes(tree, max_depth, max_rank)
        if not candidates:
            break
        _, scores = score(tree, candidates)
        best = min(range(len(candidates)), key=lambda k: (-scores[k], _preference(candidates[k])))
        node = candidates[best]
        points.append(FrontierPoint(Tree.from_choices([*tree.choices, list(node)]), scores[best], node))
        bar.update(1)
        if on_step is not None:
            on_step(points)
    bar.close()
    return points


def rank_tuple_scorer(trajectories: Sequence[Trajectory]) -> ScoreFn:
    """Score candidates by prefix counts: adding ν raises the accept length exactly at the
    starts whose tuple begins with ν's path (its parent is in T, so they already reach it)."""
    counts, total = prefix_counts(trajectories)
    total = max(total, 1)

    def score(tree: Tree, candidates: list[Path]) -> tuple[float, list[float]]:
        base = 1.0 + sum(counts.get(p, 0) for p in tree.paths) / total
        return base, [base + counts.get(c, 0) / total for c in candidates]

    return score


# ============================================================================ joint rollout
@dataclass
class RolloutCounts:
    """Per-step accept lengths of one self-rollout: the trajectory's tree and each candidate."""

    tree: list[int] = field(default_factory=list)
    candidates: list[list[int]] = field(default_factory=list)  # [steps][candidate]


def _emitted(tokens: list[int], left: int, eos: set[int]) -> int:
    """How many of ``tokens`` generate would append: at most ``left``, up to the first EOS."""
    for k, tok in enumerate(tokens[:left]):
        if tok in eos:
            return k + 1
    return min(len(tokens), left)


def _node_checks(rule, scores, tokens, buffers, picks, eps, alpha):
    """Per-node pass flags (node token accepted at its parent) and log p under the parent."""
    parents = buffers.parents
    if rule == "typical":
        return typical_accept_flags(scores, tokens, parents, eps, alpha)
    ok = tokens == picks[parents.clamp(min=0)]
    ok[0] = True
    return ok, torch.zeros_like(scores[:, 0])


def _deepest_reached(b, reached: torch.Tensor, allowed: torch.Tensor, logp: torch.Tensor) -> int:
    """The deepest reached node among ``allowed`` (ties: the larger sum of log p on its path)."""
    anc, valid = b.ancestors.clamp(min=0), b.ancestors >= 0
    key = b.position_ids.double() * 1e6 + (logp[anc] * valid).sum(-1).double()
    return int(torch.where(reached & allowed, key, torch.full_like(key, -1e18)).argmax())


def _verify(model, cache, b, tokens: torch.Tensor, next_pos: int):
    """One base-model forward over a drafted tree appended to the cache."""
    prefix_len = int(cache.get_seq_length())
    dtype = b.attn_mask.dtype
    mask = tree_attention_mask(b, torch.zeros(prefix_len, dtype=dtype, device=tokens.device), prefix_len + b.num_nodes)
    return model(input_ids=tokens[None], attention_mask=mask, position_ids=(b.position_ids + next_pos)[None],
                 cache=cache, use_cache=True, output_hidden_states=-1)  # fmt: skip


@torch.no_grad()
def joint_rollout(
    model, heads, prompt: Sequence[int], tree: Tree, candidates: Sequence[Path], max_new_tokens: int, *,
    rule: str = "greedy", temperature: float = 1.0, epsilon: float = 0.09, alpha: float = 0.3,
    generator: torch.Generator | None = None, eos_token_ids: Iterable[int] = (),
) -> RolloutCounts:  # fmt: skip
    """One self-rollout over the joint tree U = T ∪ F: verify U every step, advance with T.

    A node *passes* when its token is the verifier's pick at its parent (greedy: argmax;
    exact: one shared draw per node; typical: the p > min(ε, α·e^{-H}) test); it is
    *reached* when it and all its ancestors pass. Tree S accepts the deepest reached node
    of S, so candidate T ∪ {ν} accepts max(d_T, depth(ν) if ν is reached).
    """
    eos = set(eos_token_ids)
    joint = Tree.from_choices([*tree.choices, *map(list, candidates)])
    device = model.get_output_embeddings().weight.device
    b = joint.buffers(device, model.get_output_embeddings().weight.dtype)
    in_tree = torch.zeros(joint.num_nodes, dtype=torch.bool, device=device)
    in_tree[joint.subtree_map(tree)] = True
    cand_nodes = [joint.node_index()[tuple(c)] for c in candidates]
    depth = b.position_ids.tolist()
    scale = 1.0 if rule == "greedy" else 1.0 / temperature

    def pick(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float() * scale
        if rule == "greedy":
            return scores.argmax(-1)
        return sample_picks(scores, generator)

    state, cache = heads.new_state(model), DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([list(prompt)], device=device), cache=cache, use_cache=True,
                output_hidden_states=-1)  # fmt: skip
    heads.observe(state, out.hidden_states[-1][0])
    root, emitted, next_pos, counts = int(pick(out.logits[0, -1:])[0]), 1, len(prompt), RolloutCounts()
    while emitted < max_new_tokens and root not in eos:
        tokens = heads.propose(state, torch.tensor(root, device=device), b).tokens.to(device)
        out = _verify(model, cache, b, tokens, next_pos)
        picks = pick(out.logits[0])
        ok, logp = _node_checks(rule, out.logits[0].float() * scale, tokens, b, picks, epsilon, alpha)
        reached = (ok[b.ancestors.clamp(min=0)] | (b.ancestors < 0)).all(-1)
        last = _deepest_reached(b, reached, in_tree, logp)

        def emitted_along(node: int) -> int:
            nodes = b.ancestors[node][1 : depth[node] + 1].tolist()
            return _emitted(tokens[nodes].tolist() + [int(picks[node])], max_new_tokens - emitted, eos)

        n_tree = emitted_along(last)
        counts.tree.append(n_tree)
        counts.candidates.append(
            [emitted_along(u) if reached[u] and depth[u] > depth[last] else n_tree for u in cand_nodes]
        )
        path = b.ancestors[last][: depth[last] + 1].tolist()
        keep_accepted(cache, int(cache.get_seq_length()) - joint.num_nodes, joint.num_nodes, path)
        heads.observe(state, out.hidden_states[-1][0, path])
        root = (tokens[path[1:]].tolist() + [int(picks[last])])[n_tree - 1]
        emitted, next_pos = emitted + n_tree, next_pos + len(path)
    return counts


def rollout_scorer(model, heads, prompts: Sequence[Sequence[int]], cfg: SearchConfig, eos: Iterable[int]) -> ScoreFn:
    """Score T and every T ∪ {ν} by joint self-rollouts on all prompts (steps pooled)."""
    eos = tuple(eos)

    def score(tree: Tree, candidates: list[Path]) -> tuple[float, list[float]]:
        gen = torch.Generator().manual_seed(cfg.seed)
        tree_sum, cand_sums, steps = 0, [0] * len(candidates), 0
        for prompt in prompts:
            c = joint_rollout(model, heads, prompt, tree, candidates, cfg.max_new_tokens, rule=cfg.acceptance,
                              temperature=cfg.temperature, epsilon=cfg.posterior_threshold,
                              alpha=cfg.posterior_alpha, generator=gen, eos_token_ids=eos)  # fmt: skip
            steps += len(c.tree)
            tree_sum += sum(c.tree)
            cand_sums = [s + sum(row[k] for row in c.candidates) for k, s in enumerate(cand_sums)]
        steps = max(steps, 1)
        return tree_sum / steps, [s / steps for s in cand_sums]

    return score


# ============================================================================ throughput
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def upper_hull(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the upper convex hull of (x, y) points, left to right (Andrew's monotone chain)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    hull: list[int] = []
    for i in order:
        if hull and points[hull[-1]][0] == points[i][0]:
            continue  # same x: the higher point came first
        while len(hull) >= 2:
            (x1, y1), (x2, y2), (x3, y3) = points[hull[-2]], points[hull[-1]], points[i]
            if (x2 - x1) * (y3 - y1) - (y2 - y1) * (x3 - x1) >= 0:  # middle point on or below the chord
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both fewer-or-equal x and higher y."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


@dataclass(frozen=True)
class Choice:
    """Indices (into the timed trees) of EntMTP*, T- and T+, plus the hull and Pareto set."""

    static: int
    conservative: int
    aggressive: int
    hull: list[int]
    pareto: list[int]

    @property
    def ladder(self) -> list[int]:
        """T-, EntMTP* and T+ without repeats, smallest first (timed trees are ordered by size)."""
        return sorted({self.conservative, self.static, self.aggressive})


def fan(num_nodes: int) -> Tree:
    """The depth-1 tree of ``num_nodes`` nodes: the first token's top ``num_nodes - 1`` guesses."""
    return Tree.from_choices([[r] for r in range(num_nodes - 1)]) if num_nodes > 1 else Tree.root_only()


#: held-out calibration prompts a scheduler must also beat the static tree on to become a bank's default
CONFIRM_PROMPTS = 8

#: the widest fan the value policy is offered (drafted nodes + root): small trees are where two
#: shapes cost the same forward and the per-step choice between them is free
VALUE_MAX_NODES = 4


def value_sets(trees: dict[str, Tree], choice: Choice, labels: list[str]) -> dict[str, list[Tree]]:
    """The tree sets the value policy is swept over, labelled ``value:{N}`` (or ``value:{N}+{M}``).

    For EntMTP* and T+ with 3 <= N <= :data:`VALUE_MAX_NODES` nodes: the frontier tree and the
    fan of the same size, two shapes at one forward cost, so the policy trades depth against
    width per step for free; with both sizes, all four trees (then the trees' forward costs
    weigh the choice). Each set is also offered with T- in front when T- is smaller (label
    ``value:{n}+...``): on steps where the drafted nodes' values are too low to pay for their
    share of the forward, the policy verifies the cheaper tree (its nodes are drafted anyway)."""
    sets: dict[str, list[Tree]] = {}
    for i in sorted({choice.static, choice.aggressive}, key=lambda i: trees[labels[i]].num_nodes):
        tree = trees[labels[i]]
        if 3 <= tree.num_nodes <= VALUE_MAX_NODES and fan(tree.num_nodes) != tree:
            sets[f"value:{tree.num_nodes}"] = [tree, fan(tree.num_nodes)]
    if len(sets) == 2:
        (a, ta), (b, tb) = sets.items()
        sets[f"{a}+{b.split(':')[1]}"] = ta + tb
    low = trees[labels[choice.conservative]]
    for label, members in list(sets.items()):
        if low.num_nodes < members[0].num_nodes:
            sets[f"value:{low.num_nodes}+{label.split(':')[1]}"] = [low, *members]
    return sets


def value_costs(trees: Sequence[Tree], costs: dict[int, float] | None) -> list[float]:
    """The value policy's weights: each tree's c(N) relative to one token (equal without costs)."""
    return [interpolate_cost(costs, t.num_nodes) if costs else 1.0 for t in trees]


def choose_trees(
    nodes: Sequence[int], tokens_per_s: Sequence[float], costs: Sequence[float] | None = None
) -> Choice:
    """EntMTP* = the throughput-maximal tree (ties: fewer nodes); T- and T+ = the fastest timed
    tree with fewer / more nodes than it (EntMTP* itself when there is none). With ``costs``
    (each tree's forward cost c(N)), T- must also cost less than EntMTP* to verify.

    T± are the trees a scheduler would switch to when a smaller or larger tree pays off, so
    each must be worth running on its own. On a GPU the upper hull's neighbours of EntMTP*
    usually are these trees; on a CPU, where throughput is far from concave in the node
    count, the hull's right neighbour can be the largest (and slowest) tree. A conservative
    tree that costs more than EntMTP* saves nothing: on the AMD EPYC of session 10 a 4-token
    forward costs 1.28 one-token forwards and a 2- or 3-token one 1.33 and 1.56, so there the
    only cheaper tree is the root alone (plain decoding for the step). The hull and the
    Pareto set are reported alongside.
    """
    pts = [(float(n), float(v)) for n, v in zip(nodes, tokens_per_s)]
    static = max(range(len(pts)), key=lambda i: (pts[i][1], -pts[i][0]))

    def fastest(side: list[int]) -> int:
        return max(side, key=lambda i: (pts[i][1], -pts[i][0])) if side else static

    cheaper = [i for i in range(len(pts)) if costs is None or costs[i] < costs[static]]
    low = fastest([i for i in cheaper if pts[i][0] < pts[static][0]])
    high = fastest([i for i in range(len(pts)) if pts[i][0] > pts[static][0]])
    return Choice(static, low, high, upper_hull(pts), pareto_front(pts))


# ============================================================================ measuring
Measure = Callable[[str, "EntMTPConfig | None", Sequence[int]], dict]
CostFn = Callable[..., "dict[int, float]"]  # (model, sizes, *, prefix_len, repeats) -> seconds per size


def generate_kwargs(model, cfg: SearchConfig, max_new_tokens: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": cfg.acceptance != "greedy"}
    if kw["do_sample"]:
        kw.update(temperature=cfg.temperature, top_k=None, top_p=None)
    eos = model.generation_config.eos_token_id
    if model.generation_config.pad_token_id is None and eos is not None:
        kw["pad_token_id"] = eos if isinstance(eos, int) else list(eos)[0]
    return kw


def generate_measure(model, cfg: SearchConfig, max_new_tokens: int | None = None) -> Measure:
    """The default measurement: one ``generate`` call, wall time around it (prefill included)."""
    kwargs = generate_kwargs(model, cfg, max_new_tokens or cfg.max_new_tokens)
    device = model.get_output_embeddings().weight.device

    def measure(label: str, config: EntMTPConfig | None, prompt: Sequence[int]) -> dict:
        ids = torch.tensor([list(prompt)], device=device)
        timer = PhaseTimer()
        extra = {"entmtp_config": config, "entmtp_observers": [timer]} if config is not None else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                 **kwargs, **extra)  # fmt: skip
        seconds = time.perf_counter() - t0
        stats = getattr(out, "entmtp_stats", None) or {}
        run = {
            "seconds": seconds,
            "new_tokens": int(out.sequences.shape[1] - ids.shape[1]),
            "tokens": out.sequences[0, ids.shape[1] :].tolist(),
            "accept_lengths": list(stats.get("accept_lengths", [])),
        }
        if stats:  # what the modelled ranking needs: the work done and this run's own overhead share
            run.update(tree_sizes=list(stats["tree_sizes"]), forward_seconds=timer.seconds["verify"],
                       decode_seconds=stats["total_time"] - stats["prefill_time"])  # fmt: skip
        return run

    return measure


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# ============================================================================ the pipeline
def _atomic_json(path: FsPath, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: FsPath) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _fingerprint(config: EntMTPConfig | None) -> str:
    """What a timed run label was measured with (its config's fields), to spot stale checkpoints."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def heads_fingerprint(heads) -> str:
    """A short hash of the heads' config and weights: resuming with other heads is refused."""
    h = hashlib.sha256(json.dumps(heads.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(heads.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().double().sum().item().hex().encode())
    return h.hexdigest()[:16]


class TreeSearch:
    """One task's search in one work folder; every stage checkpoints and is skipped when done.

    ``prompts`` are token-id lists (the rendered calibration prompts); ``measure`` replaces
    the timed ``generate`` call (tests inject deterministic timings through it).
    """

    FILES = {"settings": "settings.json", "trajectories": "trajectories.json", "frontier": "frontier.json",
             "rollouts": "rollouts.json", "costs": "forward_costs.json", "sweep": "sweep.json", "confirm": "confirm.json",
             "elapsed": "stage_seconds.json"}  # fmt: skip

    def __init__(
        self, model, heads, prompts: Sequence[Sequence[int]], work_dir: str | os.PathLike, config: SearchConfig,
        *, task: str = "task", prompt_ids: Sequence[str] | None = None, measure: Measure | None = None,
        sweep_measure: Measure | None = None, forward_costs: CostFn | None = None, info: dict | None = None,
        progress: bool = True,
    ) -> None:  # fmt: skip
        if len(prompts) < 1:
            raise ValueError("the search needs at least one calibration prompt")
        self.model, self.heads, self.cfg, self.task = model, heads, config, task
        self.prompts = [list(map(int, p)) for p in prompts[: config.num_prompts]]
        self.prompt_ids = list(prompt_ids or [f"{task}-{i}" for i in range(len(prompts))])[: len(self.prompts)]
        self.dir = FsPath(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.measure = measure or generate_measure(model, config)
        self.warmup_measure = measure or generate_measure(model, config, max_new_tokens=8)
        self.sweep_measure = sweep_measure or self.measure
        self.forward_costs = forward_costs or partial(profile_forward_costs, progress=progress)
        self.info = dict(info or {})
        self.progress = progress
        self.max_depth = min(config.max_depth or heads.num_heads, heads.num_heads)
        self.max_rank = min(heads.config.draft_vocab_rows, config.budget)
        self._check_settings()
        self.elapsed: dict[str, float] = _read_json(self.path("elapsed")) or {}
        self.stages_run: list[str] = []  # stages that computed something in this run

    # ---------------------------------------------------------------- bookkeeping
    def path(self, name: str) -> FsPath:
        return self.dir / self.FILES.get(name, name)

    def _check_settings(self) -> None:
        settings = {"task": self.task, "search": self.cfg.to_dict(), "prompt_ids": self.prompt_ids,
                    "prompts_sha": hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()[:16],
                    "heads": heads_fingerprint(self.heads), "model": self.info.get("base_model", "")}  # fmt: skip
        old = _read_json(self.path("settings"))
        if old is not None and old != settings:
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            raise ValueError(
                f"{self.dir} holds a search with other settings ({', '.join(diff)} differ); "
                "use another output folder or restart (--restart deletes the checkpoints)"
            )
        _atomic_json(self.path("settings"), settings)

    def _timed(self, stage: str, t0: float) -> None:
        """Add this run's wall time of a stage to the totals kept across resumed runs."""
        self.elapsed[stage] = self.elapsed.get(stage, 0.0) + time.perf_counter() - t0
        self.stages_run.append(stage)
        _atomic_json(self.path("elapsed"), self.elapsed)

    # ---------------------------------------------------------------- stage 1
    def trajectories(self) -> list[Trajectory]:
        """Greedy run + rank tuples and signals per prompt (rollout scoring: prompts only);
        resumes per prompt. Checkpoints from before signals were recorded get them from one
        more teacher-forced pass over the stored tokens."""
        saved = _read_json(self.path("trajectories")) or {"done": {}, "seconds": 0.0}
        todo = [i for i in range(len(self.prompts)) if self.prompt_ids[i] not in saved["done"]]
        stale = [] if self.cfg.scoring != "rank_tuple" else [
            pid for pid in self.prompt_ids if pid in saved["done"] and "signals" not in saved["done"][pid]]
        if not todo and not stale:
            return [Trajectory(**saved["done"][pid]) for pid in self.prompt_ids]
        t0 = time.perf_counter()
        for pid in stale:
            row = saved["done"][pid]
            row["tuples"], row["signals"] = step_table(self.model, self.heads, row["tokens"], row["prompt_len"],
                                                       self.max_depth, self.max_rank)  # fmt: skip
        if stale:
            _atomic_json(self.path("trajectories"), saved)
        measure = generate_measure(self.model, self.cfg)
        for i in tqdm(todo, desc="trajectories", unit="prompt", disable=not self.progress):
            t1 = time.perf_counter()
            tokens, tuples, signals = self.prompts[i], [], {}
            if self.cfg.scoring == "rank_tuple":  # the rollout scoring decodes by itself
                tokens = tokens + measure("trajectory", None, self.prompts[i])["tokens"]
                tuples, signals = step_table(self.model, self.heads, tokens, len(self.prompts[i]), self.max_depth,
                                             self.max_rank)  # fmt: skip
            saved["done"][self.prompt_ids[i]] = {"prompt_len": len(self.prompts[i]), "tokens": tokens,
                                                 "tuples": tuples, "signals": signals}  # fmt: skip
            saved["seconds"] += time.perf_counter() - t1
            _atomic_json(self.path("trajectories"), saved)
        self._timed("trajectories", t0)
        return [Trajectory(**saved["done"][pid]) for pid in self.prompt_ids]

    # ---------------------------------------------------------------- stage 2
    def frontier(self, trajectories: Sequence[Trajectory]) -> list[FrontierPoint]:
        """The greedy acceptance frontier; rollout scoring checkpoints every added node."""
        saved = _read_json(self.path("frontier")) or {"points": [], "complete": False}
        points = [FrontierPoint(Tree.from_choices(p["tree"]), p["accept"], tuple(p["added"]) if p["added"] else None)
                  for p in saved["points"]]  # fmt: skip
        if saved["complete"]:
            return points
        t0 = time.perf_counter()
        if self.cfg.scoring == "rank_tuple":
            score = rank_tuple_scorer(trajectories)
        else:
            score = rollout_scorer(self.model, self.heads, self.prompts, self.cfg, eos_ids(self.model))

        def save(pts: list[FrontierPoint], complete: bool = False) -> None:
            rows = [{"tree": p.tree.choices, "num_nodes": p.num_nodes, "accept": p.accept,
                     "added": list(p.added) if p.added else None} for p in pts]  # fmt: skip
            _atomic_json(self.path("frontier"), {"points": rows, "complete": complete})

        points = greedy_frontier(score, self.cfg.budget, self.max_depth, self.max_rank, points, save, self.progress)
        save(points, complete=True)
        self._timed("frontier", t0)
        return points

    def timed_indices(self, points: Sequence[FrontierPoint]) -> list[int]:
        """Frontier indices to time: ``timed_sizes`` present on the frontier, or every k-th and the last."""
        if self.cfg.timed_sizes is not None:
            wanted = set(self.cfg.timed_sizes)
            found = [i for i, p in enumerate(points) if p.num_nodes in wanted]
            if not found:
                raise ValueError(f"none of the timed sizes {sorted(wanted)} is on the frontier "
                                 f"({points[0].num_nodes}..{points[-1].num_nodes} nodes)")  # fmt: skip
            return found
        k = self.cfg.time_every
        return sorted({i for i in range(0, len(points), k)} | {len(points) - 1})

    def timing_indices(self) -> list[int]:
        """Prompts timed with ``generate``: the first ``timing_prompts`` calibration prompts."""
        return list(range(min(self.cfg.timing_prompts, len(self.prompts))))

    def reference_tree(self) -> Tree | None:
        tree = Tree.from_choices(MC_SIM_7B_63)
        fits = tree.depth <= self.heads.num_heads and 10 <= self.heads.config.draft_vocab_rows
        return tree if self.cfg.time_reference and fits else None

    # ---------------------------------------------------------------- stages 3 and 4
    def _interleaved(
        self, name: str, runs: dict[str, EntMTPConfig | None], prompts: list[int], measure: Measure
    ) -> tuple[dict, bool]:
        """Every (label, prompt) once, labels rotated per prompt; one untimed warm-up per label.

        A label's saved runs are kept only while its config is the one it was measured with
        (``_configs`` in the file; labels such as ``static`` name a role, and a re-ranking can
        give the role another tree). Returns the requested labels' runs and whether anything
        was measured now."""
        saved = _read_json(self.path(name)) or {}
        configs = saved.pop("_configs", {})
        for lab in runs:
            if lab in configs and configs[lab] != _fingerprint(runs[lab]):
                saved.pop(lab, None)  # measured with another tree or setting: stale
        configs = {lab: _fingerprint(conf) for lab, conf in runs.items()}
        todo = [(p, lab) for p in prompts for lab in runs if str(p) not in saved.get(lab, {})]
        if not todo:
            return {lab: saved[lab] for lab in runs if lab in saved}, False
        warm_prompt = self.prompts[todo[0][0]][:]
        for lab, conf in tqdm(runs.items(), desc=f"{name} warm-up", unit="run", disable=not self.progress):
            self.warmup_measure(lab, conf, warm_prompt)  # untimed: first-call costs stay out of the medians
        labels = list(runs)
        bar = tqdm(total=len(todo), desc=name, unit="run", disable=not self.progress)
        for p in prompts:
            rot = p % len(labels)
            for lab in labels[rot:] + labels[:rot]:
                if str(p) in saved.get(lab, {}):
                    continue
                r = measure(lab, runs[lab], self.prompts[p])
                saved.setdefault(lab, {})[str(p)] = {k: r[k] for k in RUN_KEYS if k in r}
                _atomic_json(self.path(name), {**saved, "_configs": configs})
                bar.update(1)
        bar.close()
        return {lab: saved[lab] for lab in runs if lab in saved}, True

    def rollouts(self, points: Sequence[FrontierPoint]) -> dict:
        """Debias + throughput: canonical ``generate`` runs of the timed trees and of plain decoding."""
        t0 = time.perf_counter()
        runs: dict[str, EntMTPConfig | None] = {VANILLA: None}
        for i in self.timed_indices(points):
            runs[f"frontier-{points[i].num_nodes}"] = self._tree_config(points[i].tree)
        ref = self.reference_tree()
        if ref is not None:
            runs[REFERENCE] = self._tree_config(ref)
        out, measured = self._interleaved("rollouts", runs, self.timing_indices(), self.measure)
        if measured:
            self._timed("rollouts", t0)
        return out

    def costs(self, points: Sequence[FrontierPoint]) -> dict[int, float]:
        """c(N) for every timed tree size: forward time relative to one token, at a typical context
        length of the calibration runs (median prompt + half the new tokens; interleaved
        medians; checkpointed).

        The modelled ranking multiplies these by the steps each run took: on a shared CPU the
        wall time of single runs varies by tens of percent, far more than the differences
        between the trees it must rank (docs/search.md)."""
        timed = {points[i].num_nodes for i in self.timed_indices(points)}
        # the sweep's retrieval runs verify a timed tree plus up to L retrieved tokens (or L + 1 alone)
        extra = max(r.num_tokens for r in RETRIEVAL_RUNS.values()) if self.cfg.retrieval else 0
        sizes = sorted({1} | timed | {n + k for n in timed for k in range(1, extra + 1)}
                       | ({len(MC_SIM_7B_63) + 1} if self.reference_tree() is not None else set()))  # fmt: skip
        saved = _read_json(self.path("costs"))
        if saved is not None and all(str(n) in saved["relative"] for n in sizes):
            return {int(n): float(c) for n, c in saved["relative"].items()}
        t0 = time.perf_counter()
        prefix_len = int(median([len(p) for p in self.prompts])) + self.cfg.max_new_tokens // 2
        seconds = self.forward_costs(self.model, sizes, prefix_len=prefix_len, repeats=self.cfg.cost_repeats)
        relative = {n: seconds[n] / seconds[1] for n in sizes}
        _atomic_json(self.path("costs"), {"prefix_len": prefix_len, "repeats": self.cfg.cost_repeats,
                                          "seconds": {str(n): seconds[n] for n in sizes},
                                          "relative": {str(n): relative[n] for n in sizes}})  # fmt: skip
        self._timed("costs", t0)
        return relative

    def _tree_config(self, tree: Tree, **kw) -> EntMTPConfig:
        rule = {"greedy": "auto", "exact": "exact", "typical": "typical"}[self.cfg.acceptance]
        extra = {"posterior_threshold": self.cfg.posterior_threshold, "posterior_alpha": self.cfg.posterior_alpha}
        if "trees" in kw:
            return EntMTPConfig(acceptance=rule, **extra, **kw)
        return EntMTPConfig(tree=tree.choices, acceptance=rule, **extra, **kw)

    def sweep(self, runs: dict[str, EntMTPConfig]) -> dict:
        """The :meth:`sweep_runs` (hysteresis τ × feature, ladder thresholds, value sets), measured
        against the static tree."""
        t0 = time.perf_counter()
        prompts = self.timing_indices()[: self.cfg.sweep_prompts]
        out, measured = self._interleaved("sweep", runs, prompts, self.sweep_measure)
        if measured:
            self._timed("sweep", t0)
        return out

    def sweep_runs(
        self, trees: dict[str, Tree], choice: Choice, labels: list[str], costs: dict[int, float] | None = None,
        retrieval: RetrievalConfig | None = None,
    ) -> dict[str, EntMTPConfig]:
        """The static tree (alone, and with retrieval branches: :data:`RETRIEVAL_RUNS`),
        hysteresis over each pair of T-, EntMTP* and T+ (label ``hysteresis:{feature}:{tau}:{i}-{j}``,
        indices into ``labels``), the ladder, and the value policy over :func:`value_sets`
        (weighed by ``costs``, c(N) relative to one token; equal costs without them). The
        hysteresis and ladder runs use ``retrieval`` (the bank's retrieval default; off without it)."""
        runs = {"static": self._tree_config(trees[labels[choice.static]])}
        switch = {"retrieval": retrieval or False}
        for label, branch in RETRIEVAL_RUNS.items() if self.cfg.retrieval else ():
            runs[label] = self._tree_config(trees[labels[choice.static]], retrieval=branch)
        pairs = [(a, b) for k, a in enumerate(choice.ladder) for b in choice.ladder[k + 1 :]]
        for f in self.cfg.features:
            for lo, hi in pairs:
                # accept_ema under T- never exceeds T-'s depth + 1: scale its grid to that, not the heads' depth
                low_depth = max(trees[labels[lo]].depth, 1)
                for tau in (threshold(f, t, low_depth) for t in self.cfg.tau_grid):
                    runs[f"hysteresis:{f}:{tau:g}:{lo}-{hi}"] = self._tree_config(
                        None, trees=[trees[labels[lo]].choices, trees[labels[hi]].choices], policy="hysteresis",
                        tau_on=tau, tau_off=tau, feature=f, **switch,
                    )  # fmt: skip
        ladder = [trees[labels[i]] for i in choice.ladder]
        grid = sorted(set(self.cfg.tau_grid))
        cuts = [grid[i : i + len(ladder) - 1] for i in range(len(grid) - len(ladder) + 2)] if len(ladder) > 2 else []
        for f in self.cfg.features if self.cfg.ladder else ():
            for th in ([threshold(f, t, self.heads.num_heads) for t in cut] for cut in cuts):
                runs[f"ladder:{f}:{','.join(f'{t:g}' for t in th)}"] = self._tree_config(
                    None, trees=[t.choices for t in ladder], policy="ladder", thresholds=list(th), feature=f, **switch
                )
        for label, members in value_sets(trees, choice, labels).items():
            runs[label] = self._tree_config(None, trees=[t.choices for t in members], policy="value",
                                            costs=value_costs(members, costs))  # fmt: skip
        return runs

    def confirm(self, runs: dict[str, EntMTPConfig], label: str) -> dict:
        """The sweep's best scheduler against the static tree again, on calibration prompts the
        sweep did not see (up to :data:`CONFIRM_PROMPTS`): the best of many tries on 3 prompts
        is biased upwards, a fresh sample is not. Empty when no prompt is left over."""
        seen = set(self.timing_indices()[: self.cfg.sweep_prompts])
        prompts = [i for i in range(len(self.prompts)) if i not in seen][:CONFIRM_PROMPTS]
        if not prompts:
            return {}
        t0 = time.perf_counter()
        out, measured = self._interleaved("confirm", {"static": runs["static"], label: runs[label]}, prompts,
                                          self.sweep_measure)  # fmt: skip
        if measured:
            self._timed("confirm", t0)
        return out

    def replayable(self, runs: dict[str, EntMTPConfig]) -> set[str]:
        """The hysteresis and ladder runs scored by :func:`~entmtp_hf.replay.replay` over every
        calibration prompt instead of timed on the sweep prompts: with greedy rank tuples and
        forward costs c(N) (the modelled ranking) their accept lengths and work are exact."""
        if self.cfg.scoring != "rank_tuple" or self.cfg.ranking != "modelled":
            return set()
        return {lab for lab, conf in runs.items() if lab.split(":")[0] in FEATURE_POLICIES
                and why_not_replayable(conf.resolve(self.heads.num_heads)) is None}  # fmt: skip

    def replay(self, runs: dict[str, EntMTPConfig], trajectories: Sequence[Trajectory]) -> dict[str, dict]:
        """Accept lengths and verified tree sizes of each run replayed over ``trajectories`` (pooled)."""
        out = {}
        for lab, conf in runs.items():
            plan = conf.resolve(self.heads.num_heads)
            reps = [replay(t, plan, conf.feature_window) for t in trajectories]
            out[lab] = {"accept_lengths": [a for r in reps for a in r.accept_lengths],
                        "tree_sizes": [n for r in reps for n in r.tree_sizes]}  # fmt: skip
        return out

    # ---------------------------------------------------------------- everything
    def run(self, bank_dir: str | os.PathLike | None = None) -> "SearchResult":
        """Run (or resume) every stage, then write the bank, plots and report."""
        from .report import summarise, write_outputs

        trajectories = self.trajectories()
        points = self.frontier(trajectories)
        rollouts = self.rollouts(points)
        costs = self.costs(points) if self.cfg.ranking == "modelled" else None
        result = summarise(self, trajectories, points, rollouts, costs)
        if self.cfg.scoring == "rank_tuple" and costs is not None:
            result.with_headroom(trajectories)
        trees = {lab: row["tree"] for lab, row in result.timed.items()}
        runs = self.sweep_runs(trees, result.choice, result.labels, costs)
        replayed = self.replayable(runs)
        result.with_sweep(self.sweep({lab: conf for lab, conf in runs.items() if lab not in replayed}))
        if replayed:  # after the timed sweep: replayed with the retrieval default it chose
            retrieval = result.retrieval_default()
            again = self.sweep_runs(trees, result.choice, result.labels, costs, retrieval=retrieval)
            static = self._tree_config(trees[result.labels[result.choice.static]], retrieval=retrieval or False)
            result.with_replay(self.replay({"static": static, **{lab: c for lab, c in again.items() if lab in replayed}},
                                           trajectories), len(trajectories))  # fmt: skip
        candidate = result.scheduler_candidate()
        if candidate is not None and not result.sweep[candidate].get("replayed"):
            result.with_confirmation(self.confirm(runs, candidate))
        result.elapsed = dict(self.elapsed)
        t0 = time.perf_counter()
        full = bool(self.stages_run) or not (self.dir / "report.md").is_file()
        write_outputs(self, result, bank_dir, plots_and_report=full)  # nothing new: only the bank is (re)written
        if full:
            self._timed("outputs", t0)
        return result


# ============================================================================ CLI
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf search`` (the parser and its handler live in :mod:`.search_report`)."""
    from .report import add_search_parser

    add_search_parser(sub)
