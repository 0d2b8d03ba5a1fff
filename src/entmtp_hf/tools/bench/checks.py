"""What is checked on each prompt's outputs once every method ran it: speed-ups over vanilla,
greedy outputs token for token against vanilla (with the base model's logit gap where they
part), and the responses' perplexity under the base model."""

from __future__ import annotations

import logging
from typing import Any

from ...demo.compare import find_mismatch
from ..metrics import load_perplexity
from .context import BenchContext
from .settings import BenchSettings

log = logging.getLogger("entmtp_hf.tools.bench")


def postprocess(
    ctx: BenchContext,
    records: list[dict],
    prompts: list[dict],
    settings: BenchSettings,
    references: dict[str, str] | None = None,
    models: dict[str, Any] | None = None,
) -> None:
    """Speedups over vanilla, greedy mismatch checks (each method against its ``references``
    entry, vanilla by default; a divergence's logit gap read from the method's entry in ``models``,
    the fp32 model by default) and response perplexity, in place."""
    references, models = references or {}, models or {}
    by_method = {(r["method"], r["prompt_index"]): r for r in records}
    for r in records:
        base = by_method.get(("vanilla", r["prompt_index"]))
        ok = base is not None and base["tokens_per_s"] and r["tokens_per_s"] is not None
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None
        r["mismatch"] = None
        ref_name = references.get(r["method"], "vanilla")
        ref = by_method.get((ref_name, r["prompt_index"]))
        if settings.mode == "greedy" and ref is not None and r is not ref:
            prompt_ids = prompts[r["prompt_index"]]["input_ids"]
            model = models.get(r["method"], ctx.model)
            r["mismatch"] = find_mismatch(ref["output_ids"], r["output_ids"], model, prompt_ids)
            if r["mismatch"] is not None:
                log.warning(
                    "%s %s prompt %d: output differs from %s: %s",
                    r["task"],
                    r["method"],
                    r["prompt_index"],
                    ref_name,
                    r["mismatch"],
                )
    if settings.perplexity:
        add_perplexity(ctx, records, prompts)


def add_perplexity(ctx: BenchContext, records: list[dict], prompts: list[dict]) -> None:
    """Response perplexity under the base model (given the prompt), via the shipped metric."""
    metric = load_perplexity()
    cache: dict[tuple, float | None] = {}
    for r in records:
        key = (r["prompt_index"], tuple(r["output_ids"]))
        if key not in cache:
            text = ctx.tokenizer.decode(r["output_ids"], skip_special_tokens=True)
            context = ctx.tokenizer.decode(prompts[r["prompt_index"]]["input_ids"])
            if not text.strip():
                cache[key] = None
            else:
                res = metric.compute(
                    predictions=[text], contexts=[context], model=ctx.model, tokenizer=ctx.tokenizer, batch_size=1
                )
                cache[key] = res["perplexities"][0]
        r["perplexity"] = cache[key]
