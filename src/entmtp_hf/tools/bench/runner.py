"""The benchmark runner: every method on every task's basket, interleaved, results as data.

Protocol (the paper's, scaled by presets): per task a deterministic basket of N prompts
(:func:`~entmtp_hf.tools.data.tasks.evaluation_basket`), chat template applied, batch size 1.
Every method gets one warm-up generation per task that is not measured. The timed region is
the whole ``generate`` call, prefill included. Methods run *interleaved*: for prompt ``i``
every method runs once, in an order rotated by ``i``, so machine drift hits all methods alike.
Whatever a method prepares (heads swap, packed weights, installed kernels) happens outside the
clock, and what it holds is released right after its timed call. One progress bar counts the
run's measured generations.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from ..checkpoint import json_safe
from ..data.tasks import evaluation_basket
from .checks import postprocess
from .context import BenchContext, log
from .memory import PeakMemory
from .methods import Generation, Method, Run, chosen_methods
from .results import FORMAT, FORMAT_VERSION, environment, write_results
from .settings import MODES, BenchSettings
from .summary import summarize

#: task label -> (task as given, its prompts, their rendered token ids)
Baskets = dict[str, tuple[str, list, list[list[int]]]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gen_kwargs(ctx: BenchContext, settings: BenchSettings, max_new_tokens: int) -> dict:
    kwargs = dict(MODES[settings.mode][0], max_new_tokens=max_new_tokens)
    eos = ctx.tokenizer.eos_token_id
    pad = ctx.model.generation_config.pad_token_id
    kwargs["pad_token_id"] = pad if pad is not None else eos
    return kwargs


def _prompt_ids(ctx: BenchContext, prompt, settings: BenchSettings) -> list[int]:
    ids = prompt.render(ctx.tokenizer)
    if len(ids) > settings.max_input_tokens:
        log.warning("%s: %d prompt tokens, keeping the last %d", prompt.prompt_id, len(ids), settings.max_input_tokens)
        ids = ids[-settings.max_input_tokens :]
    return ids


class _ForwardCounter:
    """Counts base-model forward calls (prefill + one per decoding step)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


class _Meter:
    """Times one generation (clock read twice), its forwards and its peak memory."""

    def __init__(self, ctx: BenchContext, clock: Callable[[], float]) -> None:
        self.device, self.clock = ctx.device, clock
        self.memory, self.counter = PeakMemory(self.device), _ForwardCounter(ctx.model)

    def measure(self, run: Run, input_ids, gen_kwargs) -> tuple[Generation, float, int, int]:
        self.memory.reset()
        self.counter.count = 0
        _sync(self.device)
        t0 = self.clock()
        gen = run(input_ids, gen_kwargs)
        _sync(self.device)
        elapsed = self.clock() - t0
        return gen, elapsed, self.counter.count, self.memory.peak_bytes()


def rotation(names: Sequence[str], index: int) -> list[str]:
    """Run order of the methods for prompt ``index``: the list rotated by ``index``."""
    if not names:
        return []
    k = index % len(names)
    return list(names[k:]) + list(names[:k])


def _record(task, prompt_index, prompt, method, gen: Generation, elapsed, forwards, peak) -> dict:
    stats = gen.stats or {}
    new = len(gen.new_ids)
    # steps = verification forwards; tree methods prefill first, assisted decoding verifies from its first forward
    prefill = 0 if gen.assisted else 1
    steps = len(stats["accept_lengths"]) if "accept_lengths" in stats else max(forwards - prefill, 0)
    rec = {
        "task": task,
        "prompt_index": prompt_index,
        "prompt_id": prompt.prompt_id,
        "method": method,
        "new_tokens": new,
        "time_s": elapsed,
        "tokens_per_s": new / elapsed if elapsed > 0 else None,
        "forwards": forwards,
        "steps": steps,
        "mean_accept_length": (new - prefill) / steps if steps else None,  # tokens per verification step
        "peak_memory_bytes": peak,
        "output_ids": list(gen.new_ids),
    }
    for key in (
        "accept_lengths",
        "tree_indices",
        "tree_sizes",
        "features",
        "drafted_tokens",
        "accepted_draft_tokens",
        "eas",
    ):
        rec[key] = stats.get(key)
    for key in ("draft_time", "verify_time", "prefill_time"):
        rec[f"{key}_s"] = stats.get(key)
    if isinstance(stats.get("eas"), dict):  # a method's own statistics (e.g. EAS) ride along
        rec["eas"] = stats["eas"]
    return rec


def _completed_prompts(resume: dict | None, results: dict, methods, available, task: str) -> set[tuple[str, int]]:
    """(task, prompt index) pairs of ``task`` in ``resume`` that hold a record of every method to run."""
    if not resume:
        return set()

    def normal(d: dict) -> str:  # compare as the JSON file holds them (tuples -> lists)
        return json.dumps(json_safe({k: v for k, v in d.items() if k != "warmup_tokens"}), sort_keys=True)

    if normal(resume["settings"]) != normal(results["settings"]) or resume["prompts"] != results["prompts"]:
        raise ValueError("cannot resume: the earlier run used other settings or prompts")
    seen: dict[tuple[str, int], set] = {}
    for r in resume["records"]:
        if r["task"] == task:
            seen.setdefault((task, r["prompt_index"]), set()).add(r["method"])
    wanted = {m.name for m in methods if task in available[m.name]}
    return {key for key, ran in seen.items() if wanted <= ran}


@dataclass
class _Run:
    """One benchmark run's shared state: what every task and prompt of it reads and extends."""

    ctx: BenchContext
    settings: BenchSettings
    methods: list[Method]
    results: dict
    meter: _Meter
    bar: Any  # tqdm over the run's measured generations
    out_path: str | os.PathLike | None
    resume: dict | None

    def show(self, task: str, method: str) -> None:
        self.bar.set_postfix_str(f"{task} {method}")

    def availability(self, label: str, baskets: Baskets) -> dict[str, set]:
        """Per method, whether it can run on task ``label`` (the reasons for the others go into
        the result's ``skipped``); each one that can is warmed up on the task's first prompt."""
        skipped, mode = self.results["skipped"], self.settings.mode
        available: dict[str, set] = {m.name: set() for m in self.methods}
        for m in self.methods:
            why = m.unavailable(self.ctx, label, mode)
            if why is None:
                available[m.name].add(label)
            else:
                log.warning("skipping %s on %s: %s", m.name, label, why)
                skipped.setdefault(m.name, {})[label] = why
        for name, why in self._warm_up(label, baskets[label][2][0], available).items():
            skipped.setdefault(name, {})[label] = why
            available[name] = set()
        return available

    def _warm_up(self, label: str, ids: list[int], available: dict[str, set]) -> dict[str, str]:
        """One unmeasured generation per available method; ``{method: reason}`` for those that failed."""
        s = self.settings
        kwargs = _gen_kwargs(self.ctx, s, min(s.warmup_tokens, s.max_new_tokens))
        failed = {}
        for m in (m for m in self.methods if label in available[m.name]):
            self.show(label, f"{m.name} (warm-up)")
            try:
                m.prepare(self.ctx, label, s.mode)(torch.tensor([ids], device=self.ctx.device), kwargs)
            except Exception as e:  # noqa: BLE001 - any failure means: skip this method, say why
                failed[m.name] = f"warm-up failed: {type(e).__name__}: {e}"
                log.warning("skipping %s: %s", m.name, failed[m.name])
            finally:
                self.ctx.release()
        return failed

    def task(self, label: str, baskets: Baskets) -> None:
        """Every prompt of one task's basket, each by every method that can run it."""
        _, basket, all_ids = baskets[label]
        available = self.availability(label, baskets)  # per task, when it starts: its bank is read only now
        done = _completed_prompts(self.resume, self.results, self.methods, available, label)
        if done:
            self.results["records"] += [r for r in self.resume["records"] if (r["task"], r["prompt_index"]) in done]
            resumed = self.results.setdefault(
                "resumed", {"from": self.resume["environment"].get("date_utc"), "prompts": 0}
            )
            resumed["prompts"] += len(done)
            log.info("resuming %s: %d prompts already complete", label, len(done))
        names = [m.name for m in self.methods if label in available[m.name]]
        self.bar.total += (len(basket) - len(done)) * len(names) - len(basket) * len(self.methods)
        self.bar.refresh()
        for i, (prompt, ids) in enumerate(zip(basket, all_ids)):
            if (label, i) not in done:
                self.prompt(label, i, prompt, ids, names)

    def prompt(self, label: str, i: int, prompt, ids: list[int], names: list[str]) -> None:
        """One prompt by every method, in the order rotated by ``i``; then its checks."""
        s, records, by_name = self.settings, self.results["records"], {m.name: m for m in self.methods}
        input_ids = torch.tensor([ids], device=self.ctx.device)
        gen_kwargs = _gen_kwargs(self.ctx, s, s.max_new_tokens)
        for position, name in enumerate(rotation(names, i)):
            self.show(label, name)
            run = by_name[name].prepare(self.ctx, label, s.mode)  # outside the clock
            torch.manual_seed(s.seed * 100_003 + i)  # same seed for every method of a prompt
            measured = self.meter.measure(run, input_ids, gen_kwargs)
            self.ctx.release()  # whatever the method held for its timed call (outside the clock)
            rec = _record(label, i, prompt, name, *measured)
            rec.update(order=len(records), rotation_position=position, prompt_tokens=len(ids))
            records.append(rec)
            self.bar.update(1)
        mine = [r for r in records if r["task"] == label and r["prompt_index"] == i]
        postprocess(
            self.ctx,
            mine,
            self.results["prompts"][label],
            s,
            {m.name: m.reference for m in self.methods},
            {m.name: m.model(self.ctx) for m in self.methods},
        )
        if self.out_path is not None:  # a long run leaves complete per-prompt results behind
            write_results(self.results, self.out_path)


def _new_results(ctx: BenchContext, settings: BenchSettings, methods: list[Method]) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "settings": asdict(settings) | {"methods": [m.name for m in methods]},
        "environment": environment(ctx.device, PeakMemory(ctx.device).source),
        "context": {
            "model": ctx.model_name,
            "heads": dict(ctx.heads_sources),
            "bank": str(ctx.bank_folder),
            "eas_config": ctx.eas_config,
        },
        "skipped": {},
        "prompts": {},
        "records": [],
    }


def _baskets(ctx: BenchContext, settings: BenchSettings, results: dict) -> Baskets:
    """Each task's basket and its rendered prompts (also recorded in ``results["prompts"]``)."""
    baskets: Baskets = {}
    for task in settings.tasks:
        basket = evaluation_basket(task, settings.num_prompts)
        label = basket[0].task if basket else task
        ids = [_prompt_ids(ctx, p, settings) for p in basket]
        baskets[label] = (task, basket, ids)
        results["prompts"][label] = [{"prompt_id": p.prompt_id, "input_ids": i} for p, i in zip(basket, ids)]
    return baskets


def run_benchmark(
    ctx: BenchContext,
    settings: BenchSettings,
    *,
    clock: Callable[[], float] = time.perf_counter,
    out_path: str | os.PathLike | None = None,
    resume: dict | None = None,
    progress: bool = False,
) -> dict:
    """Run every method on every task's basket, interleaved; returns the result dict.

    ``clock`` is read only around measured generations (twice each). With ``out_path``
    the JSON is rewritten after every prompt, so a long run leaves partial results;
    ``resume`` (such a partial result of the same settings) keeps its complete prompts
    and runs only the others. ``progress``: one bar over the run's measured generations,
    the running task and method in its postfix.
    """
    methods = chosen_methods(settings.methods)
    results = _new_results(ctx, settings, methods)
    baskets = _baskets(ctx, settings, results)
    total = len(methods) * sum(len(b[1]) for b in baskets.values())
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress)
    run = _Run(ctx, settings, methods, results, _Meter(ctx, clock), bar, out_path, resume)
    try:
        for label in baskets:
            run.task(label, baskets)
    finally:
        bar.close()
        ctx.release()
        run.meter.counter.close()
    results["environment"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if ctx.kernel_choices():
        results["environment"]["cpu_kernels"] = ctx.kernel_choices()
    results["summary"] = summarize(results)
    if out_path is not None:
        write_results(results, out_path)
    return results
