"""What one benchmark run measures: the basket, the decoding mode and the methods' names.

Presets size the basket: ``standard`` (the default, 20 prompts x 128 tokens per task) is
enough prompts to rank methods by their paired per-prompt ratios and short enough for a CPU;
``paper`` is the paper's 100 x 256; ``quick`` is a smoke run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..data.tasks import BUILTIN_TASKS

#: preset name -> (prompts per task, max new tokens)
PRESETS = {"quick": (3, 64), "standard": (20, 128), "paper": (100, 256)}
DEFAULT_PRESET = "standard"
#: decoding modes: generate kwargs and the EntMTP acceptance rule (paper: T=0.7, typical ε=0.09, α=0.3)
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
MODES: dict[str, tuple[dict, dict]] = {
    "greedy": ({"do_sample": False}, {"acceptance": "greedy"}),
    "sampling": (SAMPLING, {"acceptance": "exact"}),
    "typical": (SAMPLING, {"acceptance": "typical", "posterior_threshold": 0.09, "posterior_alpha": 0.3}),
}


@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run measures (validated on construction; method names are checked
    against the registry when the run resolves them, :func:`~.methods.chosen_methods`)."""

    tasks: tuple[str, ...] = BUILTIN_TASKS
    num_prompts: int = PRESETS[DEFAULT_PRESET][0]
    max_new_tokens: int = PRESETS[DEFAULT_PRESET][1]
    preset: str = DEFAULT_PRESET  # the basket's name in reports ("custom" when N / tokens were overridden)
    mode: str = "greedy"
    methods: tuple[str, ...] = ()  # empty: the registry's default methods
    seed: int = 123
    warmup_tokens: int = 16
    max_input_tokens: int = 1400
    perplexity: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {list(MODES)}")
        for name in ("num_prompts", "max_new_tokens", "warmup_tokens", "max_input_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tasks:
            raise ValueError("give at least one task")
