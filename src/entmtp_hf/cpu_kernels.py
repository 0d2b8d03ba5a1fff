"""Faster CPU products for tree decoding: one explicit, measured, CPU-only opt-in.

A verification forward multiplies N rows (the tree's nodes) by every weight of the model, and
how a CPU's BLAS treats a few rows differs from machine to machine: on some CPUs MKL's
``F.linear`` costs nearly as much per row for 2-4 rows as for one (so a small tree costs
several plain steps), on others it is the fastest kernel at every row count. Nothing here runs
unless asked for: the default path uses only public PyTorch and transformers calls.

:class:`CPUKernels` (``enable_entmtp(model, heads, cpu_kernels=True)``, or on its own as a
context manager) measures this machine once, when it is built, and then routes every product
by its row count:

* the decoder's plain ``nn.Linear`` layers: MKL (``F.linear``) or oneDNN's linear on the plain
  weight, per row count; or, when packing is chosen (``pack="auto"`` packs if a packed pass is
  faster over the measured row counts), every layer's weight reordered in place into oneDNN's
  packed layout (no copy; reading the state dict raises while packed);
* the LM head: ``F.linear``, ``(W @ h.T).T`` or oneDNN, per row count;
* the draft heads' layers (one-row products): MKL or oneDNN.

Each layer's ``forward`` is replaced once, by a dispatcher that reads the measured table, and
given back by :meth:`CPUKernels.remove` (weights bit-exact); nothing changes per call, so
concurrent ``generate`` calls are safe. Every choice computes the same products and, like
verifying several tokens at once, may round differently from the one-token forward.

:func:`onednn_linears` and :func:`packed_linears` are the benchmark's kernel references for
plain decoding (``vanilla-onednn``, ``vanilla-packed``).
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
import types
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DECODER_KERNELS = ("linear", "onednn")
HEAD_LAYOUTS = ("linear", "transposed", "onednn")
#: row counts measured by default: plain steps, small trees, larger trees, a prompt's prefill
DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 16, 64)
PACK_CHOICES = (True, False, "auto")
#: where a packed layer keeps its packed weight while the layer holds none
PACKED_ATTR = "_entmtp_packed_weight"


# ============================================================================ primitives
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's CPU linear (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        x = torch.ones(2, 3)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 3), None, "none", [], "")
        return torch.equal(out, torch.full((2, 4), 3.0))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _onednn_takes(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear may take this weight (CPU, float32 or bfloat16)."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """``x [N, in] @ weight[out, in].T (+ bias)``: by ``F.linear`` (``linear``), as ``(W @ x.T).T``
    (``transposed``) or by oneDNN's linear on the plain weight (``onednn``, CPU float only)."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    if layout == "transposed":
        out = torch.mm(weight, x.t()).t()
        return out + bias if bias is not None else out
    if layout == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    raise ValueError(f"unknown layout {layout!r}; choose one of {HEAD_LAYOUTS}")


def _works(layout: str, weight: torch.Tensor) -> bool:
    """Whether ``layout`` runs on this weight here (some CPUs lack oneDNN's bf16 primitives)."""
    try:
        project(torch.zeros(2, weight.shape[1], dtype=weight.dtype), weight, None, layout)
        return True
    except RuntimeError:
        return False


def _plain_linears(modules: Iterable[torch.nn.Module], exclude: torch.nn.Module | None = None) -> list[torch.nn.Linear]:
    """The plain CPU float ``nn.Linear`` modules with no instance-level ``forward`` of anyone's
    (accelerate's offloading hooks, for instance, install one)."""
    return [m for m in modules if type(m) is torch.nn.Linear and m is not exclude and _onednn_takes(m.weight)
            and "forward" not in vars(m)]  # fmt: skip


def _timed_median(run: Callable[[str], object], choices: Sequence[str], repeats: int) -> dict[str, float]:
    """Median seconds of ``run(choice)`` per choice over ``repeats`` interleaved rounds after a warm-up."""
    times: dict[str, list[float]] = {c: [] for c in choices}
    for r in range(repeats + 1):
        for c in choices:
            t0 = time.perf_counter()
            run(c)
            if r:
                times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(v) for c, v in times.items()}


def _by_rows(table: dict[int, str]) -> list[str]:
    """Every row count up to the largest measured -> the choice of the nearest measured count at
    or above it (index 0: an empty input, which ``F.linear`` handles)."""
    measured = sorted(table)
    out, k = ["linear"], 0
    for rows in range(1, measured[-1] + 1):
        while measured[k] < rows:
            k += 1
        out.append(table[measured[k]])
    return out


class _Dispatch:
    """A linear layer's forward that picks its kernel by the input's row count (a shared table;
    counts above the largest measured take its choice)."""

    def __init__(self, module: torch.nn.Linear, kernels: list[str]) -> None:
        self.module, self.kernels = module, kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.kernels[min(rows, len(self.kernels) - 1)]
        m = self.module
        if kernel == "linear":
            return F.linear(x, m.weight, m.bias)
        return project(x.reshape(rows, x.shape[-1]), m.weight, m.bias, kernel).reshape(*x.shape[:-1], -1)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` on the weight :func:`_pack` reordered for oneDNN."""
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return x.new_zeros(*x.shape[:-1], self.out_features)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), vars(self)[PACKED_ATTR], self.bias,
                                             "none", [], "")  # fmt: skip
    return out.reshape(*x.shape[:-1], -1)


def _refuse_while_packed(module, *args, **kwargs) -> None:
    raise RuntimeError("this layer's weight is packed for oneDNN (entmtp_hf.cpu_kernels); unpack it "
                       "(remove the kernels or leave the block) before saving or reading the state dict")  # fmt: skip


def _pack(layers: list[torch.nn.Linear], rows: int = 4) -> list[tuple]:
    """Reorder each layer's weight in place into oneDNN's packed layout; returns what :func:`_unpack`
    needs. A layer is in the returned list before its weight is emptied, so a failure halfway
    leaves every weight recoverable."""
    done: list[tuple] = []
    try:
        for m in layers:
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows)
            hook = m.register_state_dict_pre_hook(_refuse_while_packed)  # nothing of m changed before here
            done.append((m, hook, vars(m).get("forward")))
            vars(m)[PACKED_ATTR] = packed
            m.weight.data = m.weight.data.new_empty(0)
            vars(m)["forward"] = types.MethodType(_packed_forward, m)
    except Exception:
        _unpack(done)
        raise
    return done


def _unpack(done: list[tuple]) -> None:
    for m, hook, before in done:
        hook.remove()
        if before is None:
            vars(m).pop("forward", None)
        else:
            vars(m)["forward"] = before
        m.weight.data = vars(m).pop(PACKED_ATTR).to_dense()


def _unshared(model, layers: list[torch.nn.Linear]) -> list[torch.nn.Linear]:
    """Layers whose weight no other module uses (a shared weight must keep its dense form)."""
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [m for m in layers if uses[id(m.weight)] == 1]


# ============================================================================ the opt-in
class CPUKernels:
    """The measured kernel choices of one model (and its heads) on this machine, installed.

    Built by ``enable_entmtp(..., cpu_kernels=True)`` or directly; ``rows``: the row counts to
    measure (a product of more rows uses the largest's choice); ``pack``: ``True``, ``False`` or
    ``"auto"`` (pack when measured faster); ``repeats``: interleaved timing rounds. Measuring
    takes a few seconds, once, and is logged; the choices are installed right after it, and
    :meth:`remove` / :meth:`install` take them off and put them back without measuring again.
    A model on another device or in another dtype, or a torch without oneDNN, is left as it is
    (:attr:`active` is False, :attr:`reason` says why).
    """

    def __init__(self, model, heads=None, *, rows: Sequence[int] = DEFAULT_ROWS, pack: bool | str = "auto",
                 repeats: int = 3) -> None:
        if pack not in PACK_CHOICES:
            raise ValueError(f"pack must be one of {PACK_CHOICES}, got {pack!r}")
        rows = sorted(set(rows))
        if not rows or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows) or repeats < 1:
            raise ValueError(f"rows must be positive integers and repeats >= 1, got {rows} and {repeats}")
        self.model, self.heads, self.rows = model, heads, rows
        self.decoder: dict[int, str] = {}
        self.lm_head: dict[int, str] = {}
        self.drafting = "linear"
        self.packed = False
        self.seconds = 0.0
        self.reason = self._unavailable()
        self._installed: list[tuple[torch.nn.Module, object]] = []
        self._packed: list[tuple] = []
        if self.reason is None:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._measure(pack, repeats)
            self.seconds = time.perf_counter() - t0
            log.info("entmtp-hf CPU kernels: %s", self.describe())
            self.install()

    @property
    def active(self) -> bool:
        return self.reason is None

    def _unavailable(self) -> str | None:
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            return "the model is not on the CPU"
        if not onednn_available():
            return "this torch build has no oneDNN linear"
        if not _onednn_takes(weight) or not _works("onednn", weight):
            return f"oneDNN's linear does not take {weight.dtype} weights on this CPU"
        return None

    def _layers(self) -> list[torch.nn.Linear]:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        return _plain_linears(decoder.modules(), exclude=self.model.get_output_embeddings())

    # ------------------------------------------------------------------ measuring
    def _measure(self, pack: bool | str, repeats: int) -> None:
        layers = self._layers()
        dense = {r: _timed_median(self._decoder_pass(layers, r), DECODER_KERNELS, repeats) for r in self.rows}
        self.decoder = {r: min(t, key=t.get) for r, t in dense.items()}
        if pack is not False and layers:
            faster = self._measure_packing(layers, sum(min(t.values()) for t in dense.values()), repeats)
            self.packed = bool(self._packed) and (pack is True or faster)
            _unpack(self._packed)
            self._packed = []
        head = self.model.get_output_embeddings()
        layouts = [lay for lay in HEAD_LAYOUTS if _works(lay, head.weight)]
        self.lm_head = {r: self._fastest_head(head, r, layouts, repeats) for r in self.rows}
        if self.heads is not None:
            self.drafting = self._measure_drafting(repeats)

    def _measure_packing(self, layers: list[torch.nn.Linear], best_dense: float, repeats: int) -> bool:
        """Whether a packed pass over the measured row counts beats the best dense kernels
        (packed here for the timing; :meth:`_measure` unpacks)."""
        try:
            self._packed = _pack(_unshared(self.model, layers))
        except RuntimeError as e:  # no packed primitive for this dtype on this CPU
            log.info("entmtp-hf CPU kernels: packing unavailable (%s)", e)
            return False
        packed = sum(_timed_median(self._decoder_pass(layers, r, packed=True), ("packed",), repeats)["packed"]
                     for r in self.rows)  # fmt: skip
        return packed < best_dense

    def _decoder_pass(self, layers: list[torch.nn.Linear], rows: int, packed: bool = False) -> Callable[[str], None]:
        """One pass of ``rows`` rows over every decoder weight, as a forward reads them."""
        g = torch.Generator().manual_seed(rows)
        inputs = {n: torch.randn(rows, n, generator=g).to(layers[0].weight.dtype)
                  for n in {m.in_features for m in layers}} if layers else {}  # fmt: skip

        def run(kernel: str) -> None:
            for m in layers:
                x = inputs[m.in_features]
                m(x) if packed else project(x, m.weight, m.bias, kernel)

        return run

    def _fastest_head(self, head: torch.nn.Module, rows: int, layouts: list[str], repeats: int) -> str:
        x = torch.randn(rows, head.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(head.weight)
        times = _timed_median(lambda lay: project(x, head.weight, getattr(head, "bias", None), lay), layouts, repeats)
        return min(layouts, key=times.get)

    def _measure_drafting(self, repeats: int) -> str:
        """The faster kernel for the heads' one-row products: their layers, and the base LM rows
        they draft from."""
        layers = _plain_linears(self.heads.modules())
        lm_rows = self.model.get_output_embeddings().weight[: self.heads.config.draft_vocab_rows]
        weights = [(m.weight, m.bias) for m in layers] + [(lm_rows, None)]
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(1, w.shape[1], generator=g).to(w) for w, _ in weights]

        def draft_pass(kernel: str) -> None:
            for (w, b), x in zip(weights, inputs):
                project(x, w, b, kernel)

        times = _timed_median(draft_pass, DECODER_KERNELS, repeats)
        return min(DECODER_KERNELS, key=times.get)

    # ------------------------------------------------------------------ installing
    def install(self) -> None:
        """Put the measured choices on the model (and heads); a no-op when already installed."""
        if not self.active or self._installed or self._packed:
            return
        layers = self._layers()
        self._dispatch(self.model.get_output_embeddings(), self.lm_head)
        if self.packed:
            self._packed = _pack(_unshared(self.model, layers))
        else:
            for m in layers:
                self._dispatch(m, self.decoder)
        if self.heads is not None and self.drafting != "linear":
            for m in _plain_linears(self.heads.modules()):
                self._dispatch(m, {1: self.drafting})
            self.heads.lm_kernel = self.drafting

    def _dispatch(self, module: torch.nn.Module, table: dict[int, str]) -> None:
        if all(k == "linear" for k in table.values()):
            return
        self._installed.append((module, vars(module).get("forward")))
        vars(module)["forward"] = _Dispatch(module, _by_rows(table))

    def remove(self) -> None:
        """Give every layer its own forward and dense weight back (bit-exact)."""
        for module, before in reversed(self._installed):
            if before is None:
                vars(module).pop("forward", None)
            else:
                vars(module)["forward"] = before
        self._installed = []
        _unpack(self._packed)
        self._packed = []
        if self.heads is not None and "lm_kernel" in vars(self.heads):
            del self.heads.lm_kernel

    def describe(self) -> str:
        """One line: what was chosen, and how long measuring took."""
        if not self.active:
            return f"off ({self.reason})"
        decoder = "packed for oneDNN" if self.packed else _runs(self.decoder)
        return (f"decoder {decoder}; LM head {_runs(self.lm_head)}; drafting {self.drafting} "
                f"(measured {self.rows[0]}-{self.rows[-1]} rows in {self.seconds:.1f} s)")  # fmt: skip

    def __enter__(self) -> "CPUKernels":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _runs(table: dict[int, str]) -> str:
    """``{1: 'linear', 2: 'onednn', 3: 'onednn'}`` -> ``'linear at 1, onednn at 2-3 rows'``."""
    parts, items = [], sorted(table.items())
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i][1] != items[start][1]:
            lo, hi = items[start][0], items[i - 1][0]
            parts.append(f"{items[start][1]} at {lo}" + (f"-{hi}" if hi != lo else ""))
            start = i
    return ", ".join(parts) + " rows"


def kernel_routing(*modules: torch.nn.Module | None) -> list[str]:
    """Which kinds of forward the linear layers of ``modules`` (a model, its heads) run where
    something replaced ``nn.Linear.forward`` on the instance (:class:`CPUKernels`' row-count
    dispatchers or packed weights, the benchmark's references, anyone's): empty on the default
    path. A step's cost depends on it as much as on the processor, so it is part of a cost
    table's key (:func:`~entmtp_hf.costs.fingerprint.model_key`). The kinds, not the choice per
    row count: those flip between near-equal kernels from one measurement to the next, and each
    flip would measure the step costs again."""
    kinds = set()
    for root in modules:
        for m in root.modules() if root is not None else ():
            forward = vars(m).get("forward") if isinstance(m, torch.nn.Linear) else None
            if isinstance(forward, _Dispatch):
                kinds.add("by row count")
            elif forward is not None:
                func = getattr(forward, "__func__", forward)
                kinds.add(f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}")
    return sorted(kinds)


# ============================================================================ benchmark references
def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` by oneDNN's linear (empty inputs keep ``F.linear``)."""
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return F.linear(x, self.weight, self.bias)
    return project(x.reshape(rows, x.shape[-1]), self.weight, self.bias, "onednn").reshape(*x.shape[:-1], -1)


@contextmanager
def onednn_linears(model) -> Iterator[None]:
    """Inside the block every plain CPU float ``nn.Linear`` of ``model``, its LM head included,
    runs on oneDNN at any row count: the benchmark's kernel reference for plain decoding
    (``vanilla-onednn``). A layer whose forward someone else replaced is left alone."""
    layers = _plain_linears(model.modules()) if onednn_available() else []
    for m in layers:
        vars(m)["forward"] = types.MethodType(_onednn_forward, m)
    try:
        yield
    finally:
        for m in layers:
            vars(m).pop("forward", None)


@contextmanager
def packed_linears(model, rows: int = 4) -> Iterator[int]:
    """Inside the block the decoder's plain CPU float ``nn.Linear`` layers hold their weights in
    oneDNN's packed layout, in place (the benchmark's ``vanilla-packed`` reference, and
    :class:`CPUKernels`' packing on its own). Reading the state dict raises while packed; the
    exact weights come back when the block ends, also on errors. Yields the number of layers packed."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = _unshared(model, _plain_linears(decoder.modules(), exclude=head)) if onednn_available() else []
    done = _pack(layers, rows)
    try:
        yield len(done)
    finally:
        _unpack(done)
