"""Where the compiled fp32 forward's products go on a CPU whose MKL is slow for a few rows, and what
oneDNN's packed products inside the compiled graph would save.

Two measurements of the demo model (fp32, ``--threads`` threads), each interleaved over rounds, medians:

* **products**: every ``nn.Linear`` of the decoder and the LM head, run back to back as one forward
  runs them, for 1 and 3 rows, by kernel: MKL (``F.linear``), oneDNN's linear on the plain weight,
  on a copy packed for 1 or 4 rows, ``x @ W.T`` on a transposed copy, ``(W @ x.T)``;
* **forward**: the package's compiled forward (:mod:`entmtp_hf.decoding.compiled`: its products are
  MKL's) against the same compile with every decoder product and the LM head replaced by one
  operator (a ``torch.library`` op) that runs oneDNN's linear on a copy packed for 4 rows, at 1 and 3
  tokens on a static cache of 512 slots (300 filled). A packed oneDNN tensor cannot be a graph input,
  so the op finds its copy by the plain weight's address: a prototype, not the package's path.

    python scripts/onednn_in_graph.py --out runs/onednn-in-graph.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from copy import deepcopy
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from compile_forward import decode_inputs, interleaved

from entmtp_hf.costs.fingerprint import machine_fingerprint
from entmtp_hf.decoding.attention import use_tree_attention
from entmtp_hf.decoding.compiled import compiled_call
from entmtp_hf.tools.checkpoint import write_json
from entmtp_hf.tools.models import load_base_model


def back_to_back_ms(
    weights: list[torch.Tensor], rows: int, rounds: int, kernels: dict[str, Callable[[int, torch.Tensor], Any]]
) -> dict[str, float]:
    """Median ms of all ``weights``' products at ``rows`` rows back to back, per kernel, interleaved
    (each kernel a function of the weight's index and the input rows)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(weights[0].dtype) for w in weights}

    def run(product: Callable[[int, torch.Tensor], Any]) -> float:
        t0 = time.perf_counter()
        for i, w in enumerate(weights):
            product(i, xs[w.shape[1]])
        return time.perf_counter() - t0

    times = {k: [] for k in kernels}
    for _ in range(rounds + 1):
        for k, product in kernels.items():
            times[k].append(run(product))
    return {k: round(1e3 * statistics.median(v[1:]), 1) for k, v in times.items()}


def products_ms(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, float]:
    """Median ms of all ``weights``' products at ``rows`` rows, per kernel (MKL, oneDNN, packed, transposed)."""
    packed = {r: [torch.ops.mkldnn._reorder_linear_weight(w, r) for w in weights] for r in (1, 4)}
    transposed = [w.t().contiguous() for w in weights]
    onednn = torch.ops.mkldnn._linear_pointwise
    kernels = {
        "mkl": lambda i, x: F.linear(x, weights[i]),
        "onednn": lambda i, x: onednn(x, weights[i], None, "none", [], ""),
        "packed-1": lambda i, x: onednn(x, packed[1][i], None, "none", [], ""),
        "packed-4": lambda i, x: onednn(x, packed[4][i], None, "none", [], ""),
        "x@WT": lambda i, x: torch.mm(x, transposed[i]),
        "W@xT": lambda i, x: torch.mm(weights[i], x.t()),
    }
    return back_to_back_ms(weights, rows, rounds, kernels)


def with_packed_products(model) -> torch.nn.Module:
    """A copy of ``model`` whose decoder products and LM head run one library op on oneDNN's packed copies."""
    copies: dict[int, torch.Tensor] = {}
    lib = torch.library.Library("entmtp_onednn_proto", "DEF")
    lib.define("linear(Tensor x, Tensor weight) -> Tensor")

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, copies[weight.data_ptr()], None, "none", [], "")
        return out.reshape(*x.shape[:-1], -1)

    lib.impl("linear", linear, "CPU")
    torch.library.register_fake("entmtp_onednn_proto::linear", lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))
    op = torch.ops.entmtp_onednn_proto.linear.default

    class Packed(torch.nn.Module):
        def __init__(self, layer: torch.nn.Linear) -> None:
            super().__init__()
            assert layer.bias is None, "the demo model's products have no bias"
            self.weight = layer.weight
            copies[layer.weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, self.weight)

    copy = deepcopy(model)
    copy.lib = lib  # kept alive with the model
    for module in list(copy.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, Packed(child))
    return copy


def tree_inputs(model, tokens: int) -> tuple:
    """A static cache (512 slots, 300 filled) and a forward of ``tokens`` new tokens, causal among themselves."""
    cache, inputs = decode_inputs(model, 512, 300)
    if tokens > 1:
        inputs = dict(inputs)
        inputs["input_ids"] = inputs["input_ids"].repeat(1, tokens)
        inputs["position_ids"] = torch.arange(300, 300 + tokens)[None]
        mask = torch.full((1, 1, tokens, 512), torch.finfo(torch.float32).min)
        for i in range(tokens):
            mask[0, 0, i, : 300 + i + 1] = 0
        inputs["attention_mask"] = mask
    return cache, inputs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # a fresh inductor folder, so neither compile loads the other's saved graph
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    model, _ = load_base_model(precision="fp32")
    weights = [m.weight.detach() for m in model.model.modules() if type(m) is torch.nn.Linear]
    weights.append(model.lm_head.weight.detach())
    result = {
        "what": "demo model, fp32: its products by kernel, and compiled forwards, ms (medians, interleaved)",
        "processor": machine_fingerprint(torch.device("cpu"), torch.float32).processor,
        "threads": args.threads,
        "torch": torch.__version__,
        "products_ms": {},
        "forward_ms": {},
    }
    for rows in (1, 3):
        result["products_ms"][rows] = products_ms(weights, rows, args.rounds)
        print(f"products, {rows} row(s): {result['products_ms'][rows]}", flush=True)
    plain = deepcopy(model)
    use_tree_attention(plain)
    packed = with_packed_products(plain)
    routes = {"package": compiled_call(plain, None), "package + oneDNN packed products": compiled_call(packed, None)}
    with torch.no_grad():
        for tokens in (1, 3):
            cache, inputs = tree_inputs(model, tokens)
            for call in routes.values():  # the compiles
                call(**inputs)
                cache.crop(-tokens)
            runs = {name: (lambda c=call: c(**inputs), lambda: cache.crop(-tokens)) for name, call in routes.items()}
            times = interleaved(runs, args.rounds, 4)
            result["forward_ms"][tokens] = {n: round(1e3 * statistics.median(v), 1) for n, v in times.items()}
            print(f"compiled forward, {tokens} token(s): {result['forward_ms'][tokens]}", flush=True)
        cache, inputs = tree_inputs(model, 1)
        ref = routes["package"](**inputs).logits
        cache.crop(-1)
        out = routes["package + oneDNN packed products"](**inputs).logits
        result["max_abs_logit_difference"] = (ref - out).abs().max().item()
    print(f"largest logit difference between the two: {result['max_abs_logit_difference']:.2e}")
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
