"""The timed ``generate`` call of the search stages, and what a timed run keeps.

Tests replace :func:`generate_measure` by deterministic timings; everything downstream
reads only the dictionary it returns.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ...config import EntMTPConfig
from ...decoding.stats import PhaseTimer
from .config import SearchConfig

#: ``measure(label, config, prompt)`` -> one timed run (plain decoding when config is None)
Measure = Callable[[str, "EntMTPConfig | None", Sequence[int]], dict]
#: ``(model, sizes, *, prefix_len, repeats)`` -> seconds of one forward per size
CostFn = Callable[..., "dict[int, float]"]
#: what is kept of each timed run (the last three only for EntMTP runs)
RUN_KEYS = ("seconds", "new_tokens", "accept_lengths", "tree_sizes", "forward_seconds", "decode_seconds")


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
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **kwargs, **extra
            )
        seconds = time.perf_counter() - t0
        stats = getattr(out, "entmtp_stats", None) or {}
        run = {
            "seconds": seconds,
            "new_tokens": int(out.sequences.shape[1] - ids.shape[1]),
            "tokens": out.sequences[0, ids.shape[1] :].tolist(),
            "accept_lengths": list(stats.get("accept_lengths", [])),
        }
        if stats:  # what the modelled ranking needs: the work done and this run's own overhead share
            run.update(
                tree_sizes=list(stats["tree_sizes"]),
                forward_seconds=timer.seconds["verify"],
                decode_seconds=stats["total_time"] - stats["prefill_time"],
            )
        return run

    return measure


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
