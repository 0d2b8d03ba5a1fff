"""``python -m entmtp_hf.demo`` (what ``make demo`` runs): EntMTP on the embedded demo model.

It streams EntMTP's answers to a coding, a math and a chat prompt, then measures on this
machine, in one run with the methods interleaved: plain ``generate``, plain ``generate`` on the
CPU kernels ``enable_entmtp`` measured (:class:`~entmtp_hf.cpu_kernels.CPUKernels`: the fastest
plain decoding here), EntMTP as ``enable_entmtp`` sets it up (on those kernels) and EntMTP with
``F.linear`` throughout (``cpu_kernels=False``); then plain ``generate`` and EntMTP on the
compiled path (:func:`~entmtp_hf.decoding.compiled.compiled_generation`: a static cache, each
shape's graph compiled once per machine and loaded by later runs; the banks ranked as for eager
decoding), unless ``--no-compile``. Warm-up runs, compilation included, are excluded; every greedy
output is compared token for token with plain ``generate``'s on the same path (eager or compiled;
a divergence is named with the base model's logit gap there), and the result is said in words:
the speed-up over plain ``generate`` and over the fastest plain decoding measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

import torch
from tqdm.auto import tqdm
from transformers import TextStreamer

from ..calibration import calibrate
from ..cpu_kernels import CPUKernels, kernels_of
from ..decoding.compiled import compiled_generation
from ..integration import HEADS_ATTR
from ..scheduling.policies import POLICIES
from . import DEFAULT_DRAFTER, DEMO_PROMPTS, config_for, load_demo
from .compare import find_mismatch, mismatch_text

PLAIN, PLAIN_K, ENTMTP, ENTMTP_F = "plain generate", "plain generate + CPU kernels", "EntMTP", "EntMTP, F.linear only"
PLAIN_C, ENTMTP_C = "plain generate, compiled", "EntMTP, compiled"


def _encode(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]


def _methods(
    configs: dict, kernels: CPUKernels | None, compiled: bool
) -> dict[str, tuple[Callable[[], ContextManager], dict]]:
    """name -> (the context of its calls, generate kwargs per task)."""
    plain = {task: {} for task in configs}
    tree = {task: {"entmtp_config": cfg, "return_dict_in_generate": True} for task, cfg in configs.items()}
    methods = {PLAIN: (nullcontext, plain)}
    if kernels is not None:
        methods[PLAIN_K] = (kernels.applied, plain)
    methods[ENTMTP] = (nullcontext, tree)
    if kernels is not None:
        methods[ENTMTP_F] = (lambda: _lifted(kernels), tree)
    if compiled:
        fast = compiled_generation(max_cache_len=512)
        methods[PLAIN_C] = (nullcontext, {task: dict(fast) for task in configs})
        methods[ENTMTP_C] = (nullcontext, {task: {**kw, **fast} for task, kw in tree.items()})
    return methods


@contextmanager
def _lifted(kernels: CPUKernels) -> Iterator[None]:
    """The model without its CPU kernels for one call (``cpu_kernels=False``), outside the clock."""
    kernels.remove()
    try:
        yield
    finally:
        kernels.install()


def _rank_banks(model, configs: dict, setting: str = "") -> None:
    """The banks re-rank their trees for this machine from its step costs: measured here, up front
    and said so (the first time on a machine, and again for the CPU kernels, which change what a
    tree costs; read from the cache after), not inside a generate call."""
    print(
        f"The banks pick their trees for this machine{setting} from its step costs (measured once per machine, "
        "then cached) ...",
        flush=True,
    )
    heads = getattr(model, HEADS_ATTR)
    table = calibrate(model, heads)[1]
    chosen = []
    for task, config in configs.items():
        bank = config.load_bank()
        tree = bank.trees[bank.scheduler_for(table).static]
        chosen.append(f"{task}: {tree.num_nodes} nodes" if tree.num_nodes > 1 else f"{task}: plain decoding")
    print(f"  measured in {table.seconds:.1f} s; the trees EntMTP* verifies here: {', '.join(chosen)}\n")


def _stream(model, tokenizer, inputs, configs, greedy: dict) -> None:
    for task, ids, text in inputs:
        print(f"### [{task}] {text}\n")
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        model.generate(ids, streamer=streamer, entmtp_config=configs[task], **greedy)
        print()


def _measure(model, inputs, methods: dict, greedy: dict, repeats: int) -> dict:
    """Per task and method: tokens/s of each timed run, tokens per step, and the outputs."""
    runs = {task: {name: {"tps": [], "tau": [], "out": None} for name in methods} for task, _, _ in inputs}
    bar = tqdm(total=len(inputs) * len(methods) * repeats, desc="timing", unit="run")
    for task, ids, _ in inputs:
        for r in range(repeats):
            order = list(methods)[r % len(methods) :] + list(methods)[: r % len(methods)]  # rotate who goes first
            for name in order:
                context, kwargs = methods[name]
                bar.set_postfix_str(f"{task}: {name}")
                with context():
                    t0 = time.perf_counter()
                    out = model.generate(ids, **greedy, **kwargs[task])
                    seconds = time.perf_counter() - t0
                seqs = getattr(out, "sequences", out)
                cell = runs[task][name]
                cell["tps"].append((seqs.shape[1] - ids.shape[1]) / seconds)
                stats = getattr(out, "entmtp_stats", None)
                cell["tau"].append(stats["mean_accept_length"] if stats else 1.0)
                cell["out"] = seqs[0, ids.shape[1] :].tolist()
                bar.update()
    bar.close()
    return runs


def _report(model, inputs, runs: dict, methods: list[str]) -> dict:
    """Print the table and the summary in words; return the figures."""
    mismatches = []
    for task, ids, _ in inputs:
        for name in methods:
            ref = runs[task][PLAIN_C if name.endswith(", compiled") else PLAIN]["out"]
            diff = find_mismatch(ref, runs[task][name]["out"], model, ids[0].tolist())
            if diff is not None:
                mismatches.append({"task": task, "method": name, **diff})
    ratio = {
        name: statistics.median(
            statistics.median(runs[t][name]["tps"]) / statistics.median(runs[t][PLAIN]["tps"]) for t in runs
        )
        for name in methods
    }
    print(f"\n{'':<30}" + "".join(f"{task:>22}" for task in runs))
    for name in methods:
        cells = [
            f"{statistics.median(runs[t][name]['tps']):.1f} tok/s, {statistics.mean(runs[t][name]['tau']):.2f}/step"
            for t in runs
        ]
        print(f"{name:<30}" + "".join(f"{c:>22}" for c in cells))
    print("(tokens per second: the median of the timed runs; tokens per step: 1 for plain decoding)")
    fastest_plain = max((n for n in methods if n.startswith(PLAIN)), key=ratio.get)
    best = max((n for n in methods if n.startswith(ENTMTP)), key=ratio.get)
    same = (
        "identical token for token"
        if not mismatches
        else ("NOT identical: " + "; ".join(f"{m['method']}, " + mismatch_text(m) for m in mismatches))
    )
    print(
        f"\nIn words: {best} answered these prompts {ratio[best]:.2f}x as fast as plain `generate`"
        + (
            f" and {ratio[best] / ratio[fastest_plain]:.2f}x as fast as the fastest plain decoding measured here "
            f"({fastest_plain})"
            if fastest_plain != PLAIN
            else ""
        )
        + f" (median over the prompts); the greedy outputs were {same}."
    )
    return {
        "speedup": ratio,
        "best": best,
        "fastest_plain": fastest_plain,
        "identical_to_plain": not mismatches,
        "mismatches": mismatches,
    }


def run_demo(max_new_tokens: int = 128, repeats: int = 2, policy: str | None = None, compiled: bool = True) -> dict:
    """Stream the three prompts with EntMTP, then time every method on them (see the module docstring)."""
    t0 = time.perf_counter()
    model, tokenizer, bank_dir = load_demo()
    drafter = {"eagle3": "EAGLE-3 drafter", "eagle": "EAGLE-style drafter", "hydra": "Hydra heads"}[DEFAULT_DRAFTER]
    print(
        f"entmtp-hf demo: SmolLM2-135M-Instruct (float32, {torch.get_num_threads()} CPU threads) with its shipped "
        f"{drafter} and tree banks, loaded in {time.perf_counter() - t0:.1f} s\n"
    )
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    configs = {task: config_for(bank_dir, task, policy) for task, _ in DEMO_PROMPTS}
    inputs = [(task, _encode(tokenizer, text), text) for task, text in DEMO_PROMPTS]
    _rank_banks(model, configs)
    _stream(model, tokenizer, inputs, configs, greedy)

    kernels = kernels_of(model)
    if kernels is not None:  # measured by enable_entmtp in load_demo (said there)
        print(f"EntMTP runs on the CPU kernels measured here: {kernels.describe()}")
        with _lifted(kernels):
            _rank_banks(model, configs, " with F.linear only (cpu_kernels=False)")
    methods = _methods(configs, kernels, compiled)
    if compiled:
        print(
            "Compiled decoding: the forward is compiled once per shape on this machine (a minute or more each, "
            "announced), and later runs load the graphs in seconds."
        )
    for name, (context, kwargs) in methods.items():  # warm-up outside the timings: every task's tree sizes
        for task, ids, _ in inputs:
            # a compiled method's warm-up is the timed call itself (greedy: the same steps), so every graph
            # it takes is compiled here, the one-token verification a step may fall back to included
            warm = greedy if "compile_config" in kwargs[task] else {"max_new_tokens": 8, "do_sample": False}
            with context():
                model.generate(ids, **warm, **kwargs[task])
    print(f"Then {repeats} timed run(s) per prompt and method, interleaved; warm-up runs excluded.")
    runs = _measure(model, inputs, methods, greedy, repeats)
    return _report(model, inputs, runs, list(methods))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="EntMTP on the embedded demo model")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per prompt and method")
    parser.add_argument("--policy", choices=POLICIES, default=None, help="override the banks' default policy")
    parser.add_argument("--no-compile", action="store_true", help="time eager decoding only (nothing compiled)")
    args = parser.parse_args(argv)
    run_demo(args.max_new_tokens, args.repeats, args.policy, compiled=not args.no_compile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
