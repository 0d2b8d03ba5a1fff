"""The demo model's products by kernel, and its compiled forward on the kernels EntMTP measures.

Two measurements of the demo model (``--threads`` threads), each interleaved over rounds, medians:

* **products**: every ``nn.Linear`` of the decoder and the LM head back to back, as one forward runs
  them, at 1, 2, 3, 4, 6, 8 and 16 rows, by kernel: MKL (``F.linear``), oneDNN's linear on the plain
  weight and on a copy packed for 4 rows (where this CPU packs that dtype), the package's few-row
  kernel (:mod:`entmtp_hf.gemv`) and, in bfloat16, the float32 product of the widened weight
  (``widened``); in float32 and in bfloat16, beside the weights' bytes over the read bandwidth this
  process measures (the bound); with ``--precision int8`` also the decoder's int8 weight-only
  layers on torchao's product, ``gemv`` and ``widened``;
* **forward**: the package's compiled forward (:mod:`entmtp_hf.decoding.compiled`) at 1-4 tokens on a
  static cache of 512 slots (300 filled), on ``F.linear`` (outside EntMTP's calls), on the kernels
  measured without the package's kernel, and on the kernels measured with it (the default), in
  ``--precision`` (a bfloat16 or int8 model whose products are not routed compiles frozen: its
  ``F.linear`` row is inductor's own products; oneDNN takes no int8 weight-only layer, so int8 has no
  row without the package's kernel); with ``--compare-options`` also the default's model compiled with
  inductor's default options instead of the package's (which drop inductor's per-call size checks and
  group a layer's int8 products of one input: :func:`~entmtp_hf.decoding.compiled.default_options`).

    python scripts/product_kernels.py --out runs/product-kernels.json
    python scripts/product_kernels.py --no-products --precision bf16 --tokens 1 3 --out runs/product-kernels-bf16.json
    python scripts/product_kernels.py --no-products --precision int8 --tokens 1 3 --out runs/product-kernels-int8.json
    python scripts/product_kernels.py --precision int8 --rows 1 4 16 64 200 --tokens --out runs/prefill-int8.json
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn.functional as F
from compile_forward import interleaved
from onednn_in_graph import back_to_back_ms, tree_inputs
from transformers import CompileConfig

from entmtp_hf import gemv
from entmtp_hf.costs.fingerprint import machine_fingerprint
from entmtp_hf.cpu_kernels import CPUKernels, Scratch, project
from entmtp_hf.decoding.attention import use_tree_attention
from entmtp_hf.decoding.compiled import compiled_call
from entmtp_hf.tools.checkpoint import write_json
from entmtp_hf.tools.models import load_base_model
from entmtp_hf.tools.profile import read_bandwidth, weight_bytes

KERNELS = ("mkl", "onednn", "packed-4", "gemv", "widened")
ROWS = (1, 2, 3, 4, 6, 8, 16)


def products_ms(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, float]:
    """Median ms of all ``weights``' products at ``rows`` rows, per kernel of :data:`KERNELS` this
    CPU runs for their dtype, interleaved."""
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in weights]
    except RuntimeError:  # no packed primitive for this dtype here
        packed = []
    onednn = torch.ops.mkldnn._linear_pointwise
    products = {
        "mkl": lambda i, x: F.linear(x, weights[i]),
        "onednn": lambda i, x: onednn(x, weights[i], None, "none", [], ""),
        "packed-4": lambda i, x: onednn(x, packed[i], None, "none", [], ""),
        "gemv": lambda i, x: gemv.gemv(x, weights[i]),
        "widened": lambda i, x: project(x, weights[i], None, "widened", scratch),
    }
    scratch = Scratch()
    x = torch.randn(rows, weights[0].shape[1]).to(weights[0].dtype)
    runs = {}
    for name in KERNELS:
        try:
            products[name](0, x)
            runs[name] = products[name]
        except (RuntimeError, IndexError):  # not for this dtype on this CPU
            pass
    if weights[0].dtype == torch.float32:
        runs.pop("widened", None)  # F.linear itself
    return back_to_back_ms(weights, rows, rounds, runs)


def int8_products_ms(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, float]:
    """Median ms of the int8 weight-only ``weights``' products (torchao's ``Int8Tensor``, bf16 rows) at
    ``rows`` rows: torchao's own product, ``gemv`` and ``widened``, interleaved."""
    scratch = Scratch()
    runs = {
        "torchao": lambda i, x: F.linear(x, weights[i]),
        "gemv": lambda i, x: gemv.gemv(x, weights[i]),
        "widened": lambda i, x: project(x, weights[i], None, "widened", scratch),
    }
    return back_to_back_ms(weights, rows, rounds, runs)


def dense(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a plain float32 matrix (an int8 weight-only one dequantized)."""
    parts = gemv.int8_parts(weight)
    if parts is not None:
        return parts[0].float() * parts[1].float().reshape(-1, 1)
    return weight.detach().float()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 3, 4], help="of the compiled forwards (none: none)")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="of the products")
    ap.add_argument("--no-products", action="store_true", help="the compiled forwards only")
    ap.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32", help="of the compiled forwards")
    ap.add_argument(
        "--compare-options",
        action="store_true",
        help="also the kernels' forward compiled with inductor's default options (size checks, no product groups)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if gemv.unavailable() is not None:
        raise SystemExit(f"the package's kernel is off here: {gemv.unavailable()}")
    model, _ = load_base_model(precision=args.precision)
    held = [m.weight for m in model.model.modules() if type(m) is torch.nn.Linear] + [model.lm_head.weight]
    weights = [dense(w) for w in held]
    gbs = read_bandwidth() / 1e9
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    result = {
        "what": "demo model: products by kernel, compiled forwards by kernel set, ms (interleaved medians)",
        "forward_precision": args.precision,
        "processor": machine_fingerprint(torch.device("cpu"), torch.float32).processor,
        "threads": args.threads,
        "torch": torch.__version__,
        "read_gb_per_s": round(gbs, 1),
        "bound_ms": {"fp32": round(1e3 * nbytes / (gbs * 1e9), 1), "bf16": round(0.5e3 * nbytes / (gbs * 1e9), 1)}
        | ({"int8": round(1e3 * weight_bytes(model) / (gbs * 1e9), 1)} if args.precision == "int8" else {}),
        "products_ms": {"fp32": {}, "bf16": {}} | ({"int8": {}} if args.precision == "int8" else {}),
        "forward_ms": {},
    }
    print(f"weights {nbytes / 1e6:.0f} MB, read at {gbs:.1f} GB/s: bound {result['bound_ms']} ms", flush=True)
    for precision, dtype in () if args.no_products else (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        typed = [w.to(dtype) for w in weights]
        for rows in args.rows:
            result["products_ms"][precision][rows] = products_ms(typed, rows, args.rounds)
            print(f"products, {precision}, {rows} row(s): {result['products_ms'][precision][rows]}", flush=True)
        del typed
    int8 = [w for w in held if gemv.int8_parts(w) is not None]
    for rows in args.rows if int8 and not args.no_products else ():
        result["products_ms"]["int8"][rows] = int8_products_ms(int8, rows, args.rounds)
        print(f"products, int8 (the decoder's), {rows} row(s): {result['products_ms']['int8'][rows]}", flush=True)
    if not args.tokens:  # the products only
        if args.out:
            write_json(args.out, result)
        return result
    use_tree_attention(model)
    models = {"F.linear": model, "kernels": deepcopy(model)}
    kernels = {"kernels": CPUKernels(models["kernels"]).install()}
    if args.precision != "int8":  # oneDNN takes no int8 weight-only layer
        models["kernels without gemv"] = deepcopy(model)
        kernels["kernels without gemv"] = CPUKernels(models["kernels without gemv"], gemv=False).install()
    for name, k in kernels.items():
        result[f"{name}: chosen"] = k.describe()
        print(f"{name}: {k.describe()}", flush=True)
    calls = {name: compiled_call(m, None) for name, m in models.items()}
    if args.compare_options:  # the same model and kernels, compiled with inductor's defaults
        calls["kernels, inductor's default options"] = compiled_call(models["kernels"], CompileConfig(options={}))

    with torch.no_grad(), ExitStack() as stack:
        for k in kernels.values():  # entered once, as a generate call does (each entry checks the weights)
            stack.enter_context(k.applied())
        for tokens in args.tokens:
            cache, inputs = tree_inputs(model, tokens)
            runs = {}
            for name, call in calls.items():
                call(**inputs)  # the compile (or the saved graph's load)
                cache.crop(-tokens)
                runs[name] = (lambda c=call: c(**inputs), lambda: cache.crop(-tokens))
            times = interleaved(runs, args.rounds, 4)
            result["forward_ms"][tokens] = {n: round(1e3 * statistics.median(v), 1) for n, v in times.items()}
            print(f"compiled forward, {tokens} token(s): {result['forward_ms'][tokens]}", flush=True)
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
