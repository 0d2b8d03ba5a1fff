"""One plain decode forward of the demo model, eager against compiled routes.

Each route runs the forward plain ``generate`` runs at a decode step: one token, a static cache of
``LEN`` slots (300 filled), the 4D mask ``prepare_inputs_for_generation`` builds for a static cache.
Routes are ``NAME:LEN`` (``--routes eager:512 transformers:2048 direct:512``):

* ``eager``: the model's own forward;
* ``transformers``: ``model.get_compiled_call(CompileConfig())``, transformers' defaults (what plain
  ``generate`` compiles when told to: ``mode="reduce-overhead"``, ``dynamic=None``, no options);
* ``bench``: what the project's compiled benchmark methods ran (``CompileConfig(dynamic=False,
  mode=None, options={"freezing": True})`` through ``get_compiled_call``);
* ``direct``: ``torch.compile(model.forward, dynamic=False, fullgraph=True)`` with inductor's
  ``cpp_wrapper`` and ``freezing``;
* ``freezing``: the same without ``cpp_wrapper``;
* ``entmtp``: the package's compiled forward (:mod:`entmtp_hf.decoding.compiled`) on a copy of the
  model with EntMTP's attention, what plain and EntMTP ``generate`` run on a model with compiled
  decoding (on a CPU: ``freezing``); ``entmtp-cpp``: the same with inductor's ``cpp_wrapper`` too;
  ``entmtp-nofreeze`` and ``entmtp-nofreeze-cpp``: the package's forward without ``freezing`` (which
  makes inductor compile past its AOTAutograd cache: what a second process pays), alone and with
  ``cpp_wrapper``.

``--precision`` is one of the package's (``fp32``, ``bf16``, ``int8``) or a weight format it does
not ship, measured to say why: ``int8-fp32`` (torchao's int8 weight-only linears with fp32
activations, for a CPU without bf16 instructions), ``bnb8`` and ``bnb4`` (bitsandbytes' LLM.int8()
and NF4 with fp32 compute, loaded through ``BitsAndBytesConfig``; eager routes only).

Every compile is timed (cold: a fresh inductor cache folder unless ``--inductor-cache``); the
forwards are then timed interleaved (rounds of ``--per-round`` calls per route, medians), after the
cache is cropped back each call so every forward sees the same 300 filled slots. The JSON goes to
``--out``.

    python scripts/compile_forward.py --precision fp32 --routes eager:512 direct:512 \\
        --out docs/results/compile-forward/xeon-fp32.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from copy import deepcopy
from pathlib import Path
from typing import Callable

import torch
from transformers import CompileConfig, StaticCache

from entmtp_hf.costs.fingerprint import machine_fingerprint
from entmtp_hf.tools.checkpoint import write_json
from entmtp_hf.tools.models import PRECISIONS, demo_model_dir, load_base_model

ROUTES = (
    "eager",
    "transformers",
    "bench",
    "direct",
    "freezing",
    "entmtp",
    "entmtp-cpp",
    "entmtp-nofreeze",
    "entmtp-nofreeze-cpp",
)
#: inductor options of the package's routes (None: the package's own default)
PACKAGE_OPTIONS = {
    "entmtp": None,
    "entmtp-cpp": {"freezing": True, "cpp_wrapper": True},
    "entmtp-nofreeze": {},
    "entmtp-nofreeze-cpp": {"cpp_wrapper": True},
}


#: weight formats measured here but not shipped by ``load_base_model(precision=...)``
EXTRA_PRECISIONS = ("int8-fp32", "bnb8", "bnb4")


def load_model(precision: str):
    """The demo model in ``precision``: one of the package's, or of :data:`EXTRA_PRECISIONS`."""
    if precision in PRECISIONS:
        return load_base_model(precision=precision)[0]
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

    if precision == "int8-fp32":
        from torchao.quantization import Int8WeightOnlyConfig

        kwargs = {"quantization_config": TorchAoConfig(Int8WeightOnlyConfig())}
    elif precision in ("bnb8", "bnb4"):  # bitsandbytes runs on a CPU from 0.48
        bnb = {"load_in_8bit": True} if precision == "bnb8" else {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
        kwargs = {"quantization_config": BitsAndBytesConfig(**bnb, bnb_4bit_compute_dtype=torch.float32)}
    else:
        raise ValueError(f"unknown precision {precision!r}")
    folder = demo_model_dir()  # the demo model, fetched and converted once
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu", **kwargs).eval()


def interleaved(runs: dict[str, tuple[Callable[[], object], Callable[[], object]]], rounds: int, per_round: int):
    """Seconds of each ``run`` by name, timed in ``rounds`` rounds of ``per_round`` calls each, the
    names taking turns; each call's ``reset`` (the cache cropped back) runs after it, off the clock."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (run, reset) in runs.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
                reset()
    return times


def decode_inputs(model, cache_len: int, fill: int) -> tuple[StaticCache, dict]:
    """A static cache of ``cache_len`` slots with ``fill`` filled (an eager prefill) and the inputs of
    the next plain decode step, built as ``generate`` builds them."""
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, fill + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :fill], cache=cache, use_cache=True)
    inputs = model.prepare_inputs_for_generation(
        ids,
        next_sequence_length=1,
        cache=cache,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.tensor([[fill]]),
        use_cache=True,
    )
    return cache, inputs


def route_call(model, name: str):
    """The callable of route ``name`` (compiled lazily, at its first call)."""
    if name == "eager":
        return model
    if name == "transformers":
        return model.get_compiled_call(CompileConfig())
    if name == "bench":
        return model.get_compiled_call(CompileConfig(dynamic=False, mode=None, options={"freezing": True}))
    if name in ("direct", "freezing"):
        options = {"freezing": True, "cpp_wrapper": name == "direct"}
        return torch.compile(model.forward, dynamic=False, fullgraph=True, options=options)
    if name in PACKAGE_OPTIONS:  # a copy with EntMTP's attention (grouped key/value heads kept grouped)
        from entmtp_hf.decoding.attention import use_tree_attention
        from entmtp_hf.decoding.compiled import compiled_call

        copy = deepcopy(model)
        use_tree_attention(copy)
        options = PACKAGE_OPTIONS[name]
        return compiled_call(copy, CompileConfig(options=options) if options is not None else None)
    raise ValueError(f"unknown route {name!r}; the routes are {', '.join(ROUTES)}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=PRECISIONS + EXTRA_PRECISIONS, default="fp32")
    ap.add_argument(
        "--routes", nargs="+", default=["eager:512", "direct:512"], help="NAME:LEN, NAME one of " + ", ".join(ROUTES)
    )
    ap.add_argument("--fill", type=int, default=300, help="filled cache slots")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--inductor-cache", default=None, help="inductor's cache folder (default: a fresh one: cold compiles)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache or tempfile.mkdtemp(prefix="inductor-")
    model = load_model(args.precision)
    routes = []
    for spec in args.routes:
        name, _, length = spec.partition(":")
        cache, inputs = decode_inputs(model, int(length or 512), args.fill)
        call = route_call(model, name)
        t0 = time.perf_counter()
        with torch.no_grad():
            call(**inputs)  # the compile, for a compiled route
        cache.crop(-1)
        seconds = time.perf_counter() - t0
        routes.append(
            {"route": spec, "first_call_s": round(seconds, 1), "call": call, "cache": cache, "inputs": inputs}
        )
        print(f"{spec}: first call {seconds:.1f} s", flush=True)
    with torch.no_grad():
        for r in routes:  # warm-up
            for _ in range(2):
                r["call"](**r["inputs"])
                r["cache"].crop(-1)
        runs = {r["route"]: (lambda r=r: r["call"](**r["inputs"]), lambda r=r: r["cache"].crop(-1)) for r in routes}
        times = interleaved(runs, args.rounds, args.per_round)
    result = {
        "what": "one plain decode forward (1 token, static cache, 4D mask as generate builds it), ms",
        "model": "SmolLM2-135M-Instruct",
        "precision": args.precision,
        "filled_slots": args.fill,
        "threads": args.threads,
        "processor": machine_fingerprint(torch.device("cpu"), torch.float32).processor,
        "torch": torch.__version__,
        "calls_per_route": args.rounds * args.per_round,
        "interleaved": f"{args.rounds} rounds of {args.per_round} calls per route",
        "routes": [],
    }
    for r in routes:
        ms = [t * 1e3 for t in times[r["route"]]]
        q = statistics.quantiles(ms, n=10)
        entry = {"route": r["route"], "median_ms": round(statistics.median(ms), 1), "p10_ms": round(q[0], 1)}
        entry |= {"min_ms": round(min(ms), 1), "first_call_s": r["first_call_s"]}
        result["routes"].append(entry)
        print(f"{r['route']:>20}: median {entry['median_ms']} ms, p10 {entry['p10_ms']}, min {entry['min_ms']}")
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
