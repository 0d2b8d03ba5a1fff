"""Where a decode step's time goes on this machine, and how fast tree decoding could be here.

* :func:`forward_costs`: the base model's forward time for ``N`` tokens appended to a cached
  prefix, with the 4D tree mask verification uses, relative to one token. On a CPU this
  relative cost ``c(N)`` rises quickly (every extra token costs compute), unlike a GPU where
  it stays near 1 for small ``N``.
* :func:`step_breakdown`: one generate call split into prefill, drafting (the heads),
  the verifier's forward passes and everything else (Python, masks, cache, acceptance).
* :func:`linear_costs`: one linear layer's time by the number of rows, for every weight
  shape of the model: why ``c(N)`` is flat for a few tokens and then jumps on a CPU.
* :func:`analytic_bound`: for each tree, ``tau / c(N)``: the speedup over one-token decoding
  if drafting and bookkeeping were free; the best tree's value is this machine's limit for
  these heads.
* :func:`physical_bound`: the weights' bytes over the machine's read bandwidth, the least a
  forward that reads every weight once can take, against the measured one-token forward and
  each step's milliseconds per token.

``entmtp-hf profile`` runs them on the demo model (eager, or with ``--compile`` on the compiled
path at ``--precision``) and writes ``profile.json`` plus a Markdown summary. Timings are medians
of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..calibration.probe import forward_ms
from ..config import EntMTPConfig
from ..costs.table import interpolate
from ..cpu_kernels import onednn_linears
from ..decoding.stats import PhaseTimer
from ..integration import HEADS_ATTR
from .bench.settings import SAMPLING
from .models import PRECISIONS

SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
#: sizes timed on the compiled path, one graph each: those the demo's trees verify
COMPILED_SIZES = (1, 2, 3, 4, 6, 8)


def _prefilled_cache(model, prefix_len: int, g: torch.Generator) -> DynamicCache:
    """A cache holding ``prefix_len`` random tokens (drawn from ``g``): the context a timed forward sees."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, prefix_len), generator=g).to(model.get_output_embeddings().weight.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def forward_costs(
    model,
    sizes: Sequence[int] = SIZES,
    *,
    prefix_len: int = 256,
    repeats: int = 7,
    progress: bool = False,
    heads=None,
) -> dict[int, float]:
    """Median seconds of one verification forward over ``N`` chained tokens after a ``prefix_len``
    cache: the cost probe's timing (:func:`entmtp_hf.calibration.probe.forward_ms`, on a session
    with ``heads``, default the ones the model is enabled with; ``progress``: a bar over the
    rounds), with the CPU kernels an EntMTP model was enabled with, if any."""
    heads = heads if heads is not None else getattr(model, HEADS_ATTR)
    with (
        torch.inference_mode(),
        tqdm(total=repeats + 1, desc="forward costs", unit="round", disable=not progress) as bar,
    ):
        ms = forward_ms(model, heads, sizes, prefix_len=prefix_len, repeats=repeats, on_round=bar.update)
    return {n: v / 1e3 for n, v in ms.items()}


def kernel_reference(model, *, prefix_len: int = 256, repeats: int = 7, progress: bool = False) -> dict[str, float]:
    """Median seconds of a one-token forward with the model's own kernels (``model``) and with
    every linear layer on oneDNN (``onednn``, :func:`~entmtp_hf.cpu_kernels.onednn_linears`: the
    benchmark's ``vanilla-onednn``), interleaved. Their ratio turns c(N), which is over the
    model's own one-token forward, into the cost over the faster plain step."""
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"model": [], "onednn": []}
    with torch.inference_mode():
        cache = _prefilled_cache(model, prefix_len, g)
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, 1), generator=g)
        ids = ids.to(model.get_output_embeddings().weight.device)
        for r in tqdm(range(repeats + 1), desc="kernel reference", unit="round", disable=not progress):
            for kind in times:
                t0 = time.perf_counter()
                with onednn_linears(model) if kind == "onednn" else nullcontext():
                    model(input_ids=ids, cache=cache, use_cache=True)
                elapsed = time.perf_counter() - t0
                cache.crop(-1)
                if r:
                    times[kind].append(elapsed)
    return {k: statistics.median(v) for k, v in times.items()}


def step_breakdown(
    model, input_ids: torch.Tensor, config: EntMTPConfig, max_new_tokens: int = 128, temperature: float | None = None
) -> dict[str, Any]:
    """Milliseconds per decode step (prefill excluded) in each phase of the step.

    ``draft_ms``: the heads' proposal; ``forward_ms``: the verifier's forward; ``accept_ms``:
    logits processors and the acceptance rule (with a ``temperature``: exact sampling at it
    alone, no top-k / top-p, as ``entmtp-hf bench --sampling``, so the draws too);
    ``commit_ms``: the cache update, the heads' conditioning on the accepted positions (Hydra's
    prefix layer, a transformer layer of the drafter) and emitting; ``other_ms``: the rest."""
    sample = {**SAMPLING, "temperature": temperature} if temperature else {"do_sample": False}
    timer = PhaseTimer()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            entmtp_config=config,
            return_dict_in_generate=True,
            entmtp_observers=[timer],
            **sample,
        )
    st = out.entmtp_stats
    steps = max(st["steps"], 1)
    decode = st["total_time"] - st["prefill_time"]
    phases = timer.seconds
    other = max(decode - sum(phases.values()), 0.0)
    result = {
        "steps": st["steps"],
        "mean_accept_length": st["mean_accept_length"],
        "mean_tree_nodes": sum(st["tree_sizes"]) / steps,
        "ms_per_step": 1e3 * decode / steps,
        "draft_ms": 1e3 * phases["draft"] / steps,
        "forward_ms": 1e3 * phases["verify"] / steps,
        "accept_ms": 1e3 * phases["accept"] / steps,
        "commit_ms": 1e3 * phases["commit"] / steps,
        "other_ms": 1e3 * other / steps,
    }
    result["draft_share"] = phases["draft"] / decode if decode else 0.0
    result["other_share"] = other / decode if decode else 0.0
    return result


def relative_cost(costs: dict[int, float], n: int) -> float:
    """``c(n)``: forward time for ``n`` tokens over one token's."""
    return interpolate(costs, n) / costs[1]


def linear_costs(
    model, rows: Sequence[int] = (1, 2, 3, 4, 6, 8, 16), *, repeats: int = 15, progress: bool = False
) -> dict[str, dict[int, float]]:
    """Median seconds of ``F.linear`` on ``M`` rows for every distinct weight shape of ``model``.

    Explains the shape of c(N) on a CPU: BLAS libraries handle a few rows with a streaming
    kernel that reads the weight once, and switch to a packing GEMM from a few rows on, whose
    cost per call can double at that step (measured in docs/performance.md)."""
    by_shape: dict[tuple[int, ...], tuple[str, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # one weight per shape, named after its first layer
            by_shape.setdefault(tuple(module.weight.shape), (name.split(".")[-1], module.weight.detach()))
    weights = {f"{list(shape)} {name}": w for shape, (name, w) in by_shape.items()}
    g = torch.Generator().manual_seed(0)
    times: dict[str, dict[int, list[float]]] = {k: {m: [] for m in rows} for k in weights}
    with torch.inference_mode():
        xs = {(k, m): torch.randn(m, w.shape[1], generator=g).to(w) for k, w in weights.items() for m in rows}
        for r in tqdm(range(repeats + 1), desc="linear costs", unit="round", disable=not progress):
            for m in rows:  # weights innermost: no call finds its weight left in cache by the call before
                for k, w in weights.items():
                    t0 = time.perf_counter()
                    torch.nn.functional.linear(xs[k, m], w)
                    if r:  # the first round warms up
                        times[k][m].append(time.perf_counter() - t0)
    return {k: {m: statistics.median(v) for m, v in per.items()} for k, per in times.items()}


def analytic_bound(trees: Sequence[dict], costs: dict[int, float], reference: float | None = None) -> list[dict]:
    """Per tree (``num_nodes``, ``mean_accept_length``): ``tau / c(N)``, the speedup limit;
    with ``reference`` (a faster plain step's time over the model's own, :func:`kernel_reference`)
    also the limit over that plain step, ``tau * reference / c(N)``."""
    rows = []
    for t in trees:
        n, tau = int(t["num_nodes"]), t.get("mean_accept_length")
        if tau is None:
            continue
        c = relative_cost(costs, n)
        row = {"num_nodes": n, "mean_accept_length": tau, "relative_cost": c, "bound": tau / c}
        if reference is not None:
            row["bound_over_reference"] = tau * reference / c
        rows.append(row)
    return rows


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once, the draft heads of an enabled
    model left out: what one plain forward reads at least. Tied embeddings count once, as the LM head
    reads the whole matrix; an untied input embedding table (``precision="int8"``'s, beside its int8
    LM head) not at all, as a forward reads one row of it per token."""
    heads = getattr(model, HEADS_ATTR, None)
    left_out = {id(t) for t in [*heads.parameters(), *heads.buffers()]} if isinstance(heads, torch.nn.Module) else set()
    if hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings"):
        table = getattr(model.get_input_embeddings(), "weight", None)
        if table is not None and table is not getattr(model.get_output_embeddings(), "weight", None):
            left_out.add(id(table))
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in left_out:
            continue
        try:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError, TypeError):  # a tensor subclass (quantized weights)
            key, size = id(t), sum(x.nbytes for x in _plain_tensors(t))
        if key not in seen:
            seen.add(key)
            total += size
    return total


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (quantized) tensor subclass stores: its flattened inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for name in names for x in _plain_tensors(getattr(t, name))]
    return [t]


def read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes per second this process reads from memory with torch's threads: the median time of
    summing a float32 tensor of ``megabytes``, far larger than the caches."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()  # pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(times)


def physical_bound(model, forward_s: float, bandwidth: float) -> dict[str, float]:
    """The one-token forward (``forward_s`` seconds) against the time to read the weights once."""
    size = weight_bytes(model)
    bound = size / bandwidth
    return {
        "weight_bytes": size,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bound_ms": 1e3 * bound,
        "forward_ms": 1e3 * forward_s,
        "forward_over_bound": forward_s / bound,
    }


# ============================================================================ CLI
def _markdown(report: dict) -> str:
    lines = [f"Profile of the {report.get('path', 'eager')} path, {report.get('precision', 'fp32')}.", ""]
    lines += ["## Forward cost by tokens verified", "", "| tokens N | ms | c(N) |", "|---|---|---|"]
    base = report["forward_costs_ms"]["1"]
    lines += [f"| {n} | {ms:.1f} | {ms / base:.2f} |" for n, ms in report["forward_costs_ms"].items()]
    lines += [
        "",
        "## Step breakdown (per decode step)",
        "",
        "| run | nodes | tau | ms/step | drafting | verifier forward | acceptance | commit (cache, heads' "
        "conditioning, emit) | other | drafting share | other share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, b in report["breakdown"].items():
        lines.append(
            f"| {name} | {b['mean_tree_nodes']:.1f} | {b['mean_accept_length']:.2f} | {b['ms_per_step']:.1f} | "
            f"{b['draft_ms']:.1f} | {b['forward_ms']:.1f} | {b['accept_ms']:.1f} | {b['commit_ms']:.1f} | "
            f"{b['other_ms']:.1f} | {b['draft_share']:.1%} | {b['other_share']:.1%} |"
        )
    phys = report.get("physical_bound")
    if phys:
        lines += [
            "",
            "## Against the physical bound",
            "",
            f"The weights ({phys['weight_bytes'] / 1e6:.0f} MB) read once at this process's measured read bandwidth "
            f"({phys['bandwidth_gb_s']:.1f} GB/s) take {phys['bound_ms']:.1f} ms: the least a one-token forward can "
            f"take. The measured one is {phys['forward_ms']:.1f} ms, {phys['forward_over_bound']:.2f}x that. Per "
            "token generated (a step's milliseconds over the tokens it accepted, the bound's one forward per "
            "token being plain decoding at the bound):",
            "",
            "| run | ms per token | over the bound |",
            "|---|---|---|",
        ]
        for name, b in report["breakdown"].items():
            per_token = b["ms_per_step"] / max(b["mean_accept_length"], 1e-9)
            lines.append(f"| {name} | {per_token:.1f} | {per_token / phys['bound_ms']:.2f}x |")
    if report.get("linear_costs_ms"):
        sizes = list(next(iter(report["linear_costs_ms"].values())))
        lines += [
            "",
            "## One linear layer by rows (time relative to one row)",
            "",
            "| weight | ms at 1 row | " + " | ".join(f"{m} rows" for m in sizes) + " |",
            "|---|---|" + "---|" * len(sizes),
        ]
        for name, per in report["linear_costs_ms"].items():
            lines.append(
                f"| {name} | {per[sizes[0]]:.3f} | " + " | ".join(f"{per[m] / per[sizes[0]]:.2f}" for m in sizes) + " |"
            )
    ref = report.get("kernel_reference_ms")
    if ref:
        lines += [
            "",
            "## The kernel reference",
            "",
            f"A one-token forward takes {ref['model']:.1f} ms with the model's own kernels and {ref['onednn']:.1f} ms "
            f"with every linear layer on oneDNN (`vanilla-onednn`): {ref['onednn'] / ref['model']:.2f} of it. The "
            f"bound over vanilla-onednn is tau / c(N) times that.",
        ]
    for task, rows in report.get("bound", {}).items():
        over = bool(rows) and "bound_over_reference" in rows[0]
        lines += [
            "",
            f"## Analytic bound, task {task} (tau / c(N))",
            "",
            "| nodes | tau | c(N) | bound |" + (" over vanilla-onednn |" if over else ""),
            "|---|---|---|---|" + ("---|" if over else ""),
        ]
        lines += [
            f"| {r['num_nodes']} | {r['mean_accept_length']:.2f} | {r['relative_cost']:.2f} | {r['bound']:.2f}x |"
            + (f" {r['bound_over_reference']:.2f}x |" if over else "")
            for r in rows
        ]
    return "\n".join(lines) + "\n"


def _breakdowns(
    model, tokenizer, bank_dir: Path, args: argparse.Namespace, costs: dict[int, float], reference: float | None
) -> tuple[dict, dict]:
    """Per task: the step breakdown of the bank's static tree and default policy (greedy, and
    sampled at ``--temperature`` if given), and the analytic bound of every bank tree."""
    from ..demo.run import config_for
    from .data.tasks import evaluation_basket

    banks = {task: config_for(bank_dir, task).load_bank() for task in args.tasks}  # or the folder's default
    bound = {task: analytic_bound(bank.metadata.get("trees", []), costs, reference) for task, bank in banks.items()}
    temperatures = (None, args.temperature) if args.temperature else (None,)
    runs = [(task, policy, t) for task in args.tasks for policy in ("static", None) for t in temperatures]
    breakdown = {}
    for task, policy, t in tqdm(runs, desc="step breakdown", unit="run"):
        bank = banks[task]
        ids = torch.tensor([evaluation_basket(task, 1)[0].render(tokenizer)])
        cfg = EntMTPConfig(bank=bank, task=bank.task, policy=policy)
        label = f"{task} {policy or 'bank default (' + bank.scheduler.policy + ')'}"
        step_breakdown(model, ids, cfg, max_new_tokens=8, temperature=t)  # warm-up
        breakdown[label + (f", sampled at T = {t:g}" if t else "")] = step_breakdown(
            model, ids, cfg, args.max_new_tokens, temperature=t
        )
    return breakdown, bound


def _profile(args: argparse.Namespace) -> int:
    from ..demo.run import load_demo
    from .machine import set_threads

    set_threads(args.threads)
    model, tokenizer, bank_dir = load_demo(precision=args.precision, compile=args.compile)
    bank_dir = Path(args.bank) if args.bank else bank_dir
    path = "compiled" if args.compile else "eager"
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "bank": bank_dir.name,  # the folder's name: a report carries no machine paths
        "path": path,
        "precision": args.precision,
    }
    # a compiled model compiles one graph per size: only the sizes trees verify, unless asked
    sizes = tuple(args.sizes) if args.sizes else (COMPILED_SIZES if args.compile else SIZES)
    costs = forward_costs(model, sizes, prefix_len=args.prefix_len, repeats=args.repeats, progress=True)
    report["forward_costs_ms"] = {str(n): 1e3 * s for n, s in costs.items()}
    reference = None
    if not args.compile:  # the eager kernels' comparison (a compiled graph calls the same kernels inside EntMTP calls)
        plain = kernel_reference(model, prefix_len=args.prefix_len, repeats=args.repeats, progress=True)
        report["kernel_reference_ms"] = {k: 1e3 * v for k, v in plain.items()}
        reference = plain["onednn"] / plain["model"]
        report["linear_costs_ms"] = {
            k: {str(m): 1e3 * t for m, t in per.items()}
            for k, per in linear_costs(model, repeats=args.repeats, progress=True).items()
        }
    report["breakdown"], report["bound"] = _breakdowns(model, tokenizer, bank_dir, args, costs, reference)
    report["physical_bound"] = physical_bound(model, costs[1], read_bandwidth())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    md = _markdown(report)
    (out / "profile.md").write_text(md, encoding="utf-8")
    print(md)
    print(f"wrote {out / 'profile.json'} and {out / 'profile.md'}")
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf profile``."""
    p = sub.add_parser(
        "profile",
        help="forward cost by tree size, step-time breakdown and the analytic speedup bound on this machine",
        description="Time the demo model's forward for 1..64 verified tokens, split decode steps into drafting / "
        "forward / other, and compute tau / c(N) for every tree of the bank.",
    )
    p.add_argument("--tasks", nargs="+", default=["humaneval", "gsm8k", "chat"])
    p.add_argument("--bank", default=None, help="bank folder (default: the demo model's shipped banks)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=256, help="cached tokens before the timed forward")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="also break down sampled steps (exact acceptance) at this temperature",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="profile the compiled path (load_demo(compile=True))")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="the demo model's weights")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="tokens per timed forward (default: by path)")
    p.add_argument("--out", default="runs/profile")
    p.set_defaults(func=_profile)
