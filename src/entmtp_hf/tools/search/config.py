"""What an offline tree search is run with: :class:`SearchConfig` and the names of its runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ...scheduling.features import FEATURES
from ...trees.retrieval import RetrievalConfig

#: hysteresis thresholds and ladder cut points swept per feature, on the probability scale
#: (:func:`~entmtp_hf.scheduling.features.threshold` maps them to ``accept_ema``'s tokens per step)
TAU_GRID = (0.05, 0.2, 0.4, 0.6, 0.8)
TIMED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SCORINGS = ("rank_tuple", "rollout")
RULES = ("greedy", "exact", "typical")
RANKINGS = ("modelled", "measured")
#: the sweep's runs of the static tree with retrieval branches: appended (up to 4 tokens), or
#: verified instead of the tree (2 tokens: a 3-node tree, whose forward costs about one token's
#: where a forward's cost is flat in its first few tokens)
RETRIEVAL_RUNS = {
    "static+retrieval": RetrievalConfig(),
    "static+retrieval-replace": RetrievalConfig(mode="replace", num_tokens=2),
}
VANILLA = "vanilla"
REFERENCE = "mc_sim_7b_63"


@dataclass
class SearchConfig:
    """Offline search settings (kept apart from heads and per-call decoding configs).

    The defaults size one task's search on the demo model for a small CPU: tens of minutes.
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
    features: tuple[str, ...] = ("head_confidence", "accept_ema")  # tau_grid mapped by features.threshold
    ladder: bool = True  # calibrate ladder thresholds (adjacent pairs of tau_grid)
    retrieval: bool = True  # also time the static tree with retrieval branches (the bank's retrieval default)
    ranking: str = "modelled"  # choose trees and schedulers by modelled or by measured tokens/s
    cost_repeats: int = 60  # interleaved rounds of the forward-cost timing: small-N costs differ by a few %
    seed: int = 123

    def __post_init__(self) -> None:
        self.timed_sizes = tuple(self.timed_sizes) if self.timed_sizes is not None else None
        self.tau_grid, self.features = tuple(self.tau_grid), tuple(self.features)
        for name in (
            "num_prompts",
            "timing_prompts",
            "max_new_tokens",
            "budget",
            "time_every",
            "sweep_prompts",
            "cost_repeats",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SearchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens < 2:
            raise ValueError("SearchConfig.max_new_tokens must be >= 2 (the first token comes from the prefill)")
        self._check_choices()
        if self.temperature <= 0:
            raise ValueError(f"SearchConfig.temperature must be > 0, got {self.temperature}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"SearchConfig.max_depth must be >= 1, got {self.max_depth}")
        if not self.tau_grid or any(not 0.0 <= t <= 1.0 for t in self.tau_grid):
            raise ValueError(f"SearchConfig.tau_grid must list thresholds in [0, 1], got {self.tau_grid}")
        bad = [f for f in self.features if f not in FEATURES]
        if not self.features or bad:
            raise ValueError(f"SearchConfig.features must come from {FEATURES}, got {list(self.features)}")

    def _check_choices(self) -> None:
        for name, allowed in (("ranking", RANKINGS), ("scoring", SCORINGS), ("acceptance", RULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SearchConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.scoring == "rank_tuple" and self.acceptance != "greedy":
            raise ValueError("rank-tuple scoring holds for greedy decoding only: use scoring='rollout' for sampling")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))
