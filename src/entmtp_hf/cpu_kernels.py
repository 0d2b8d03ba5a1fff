"""Faster CPU products for EntMTP calls: measured once per model, used only inside them.

A verification forward multiplies N rows (the tree's nodes) by every weight of the model, and
how a CPU's BLAS treats a few rows differs from machine to machine: on some CPUs MKL's
``F.linear`` costs nearly as much per row for 2-4 rows as for one (so a small tree costs
several plain steps), on others it is the fastest kernel at every row count.

:class:`CPUKernels` measures, for one model (and its heads) on this machine, which product is
fastest at each row count: MKL (``F.linear``), oneDNN's linear on the plain weight, oneDNN's
linear on a packed copy of the weight (``pack``), for float32, bfloat16 and int8 weight-only weights on
a CPU with AVX2 the package's own few-row product (:mod:`entmtp_hf.gemv`, ``gemv``), or for bfloat16
and int8 the float32 product of the weight widened (``widened``, what many rows such as a prompt's
prefill run fastest on a CPU without bfloat16 instructions); for the LM head also ``(W @ h.T).T``; for
the heads' one-row products MKL, oneDNN or ``gemv``. ``enable_entmtp`` measures them by default on a CPU
model (seconds, said once) and installs them (:func:`kernels_of`): each routed ``nn.Linear``
gets a dispatcher as its instance ``forward`` that runs ``F.linear`` exactly as before except
inside :meth:`CPUKernels.applied`, which every EntMTP call on the model (and the cost probe)
enters in its own thread. So a plain ``generate`` runs as it did, concurrent calls are safe,
and nothing of the weights changes: ``state_dict()``, ``save_pretrained`` and ``model.to(...)``
work at all times. Every choice computes the same products and, like verifying several tokens at
once, may round differently from the one-token forward.

Never a stale packed copy: each entry into :meth:`CPUKernels.applied` (each EntMTP call) first
fits every layer's kernels to its weight as it is now (:meth:`_Dispatch.refresh`). A weight of
another shape, dtype or device, or one a parametrization computes on access, runs ``F.linear``; a
packed copy is packed again when its weight's bytes changed. The bytes are what is compared (a
CRC-32, read at memory speed: about one plain step's weight traffic per call), because a write
through ``.data`` (a LoRA merge's ``weight.data += delta``, some quantizers) bumps no version
counter and a tensor made in ``torch.inference_mode()`` has none. Packed copies never travel with
the model: ``copy.deepcopy`` and pickling (``torch.save(model)``) carry the choices, and the copy
packs its own weights at its first call.

In a compiled graph (``torch.compile`` of the model's forward, the package's compiled decoding) a
routed layer's product is one operator, chosen when the graph is traced for its row count
(:meth:`_Dispatch.graph_kernel`). Where the layer's kernel at that count is the package's own, the
graph calls the extension's ``entmtp_hf_cpu::gemv`` on the weight it is given, through the
dispatcher with no Python in between (about 8 us per product against 15 through a Python operator,
211 products per forward of the demo model), in every call of that graph: it reads the weight as
the graph receives it, so it is never stale. Any other routed choice is ``entmtp_hf::linear``
(:func:`_graph_linear`), which runs the layer's dispatcher when the graph runs: a packed oneDNN
tensor cannot be a graph input, so the operator finds the dispatcher by the weight's address
(:data:`_DISPATCH_BY_WEIGHT`, weak references) and uses it only where that dispatcher's layer holds
this very weight and its model is inside :meth:`CPUKernels.applied` in this thread; anywhere else
it runs ``F.linear``. So a compiled EntMTP call multiplies on the measured kernels as an eager one
does (on a 2-core AMD EPYC Zen 2 a compiled 3-token forward of the demo model took 49.8 ms on them
against 92.9 ms on MKL), and a graph traced with the kernels stays correct in any call. Both need
the weights as graph inputs, so a routed model's bfloat16 forward compiles without inductor's
``freezing`` (:func:`~entmtp_hf.decoding.compiled.default_options`).

Why instance forwards and not a :class:`~torch.overrides.TorchFunctionMode` or module hooks:
on the demo model (2-core AMD EPYC, fp32) a mode that sees every torch call added 8-10 ms to a
60-70 ms tree forward, per-layer hooks that enter a mode 4-7 ms, the dispatchers under 1 ms.

:func:`onednn_linears` and :func:`packed_linears` are the benchmark's kernel references for
plain decoding (``vanilla-onednn``, ``vanilla-packed``).
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import threading
import time
import weakref
import zlib
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from . import gemv as _gemv

log = logging.getLogger(__name__)

DENSE_KERNELS = ("linear", "onednn", "gemv", "widened")
PACKED = "packed"
HEAD_LAYOUTS = ("linear", "transposed", "onednn", "gemv")
#: row counts measured by default: plain steps, small trees, larger trees, a prompt's prefill
DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 16, 64)
PACK_CHOICES = (True, False, "auto")
#: the share of the memory available now that the packed copies of the decoder's weights may take
PACK_MEMORY_SHARE = 0.25
#: where a model keeps its measured kernels (:func:`kernels_of`)
KERNELS_ATTR = "_entmtp_cpu_kernels"


# ============================================================================ primitives
@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's CPU linear (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        x = torch.ones(2, 3)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 3), None, "none", [], "")
        return torch.equal(out, torch.full((2, 4), 3.0))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _onednn_takes(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear may take this weight (CPU, float32 or bfloat16, a plain tensor: a
    quantized tensor subclass such as torchao's reports its activations' dtype and runs its own kernels)."""
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
    return plain and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


def _routable(weight: torch.Tensor) -> bool:
    """Whether some kernel here may take this weight: a plain CPU float one (:func:`_onednn_takes`) or
    an int8 weight-only one, which only ``gemv`` takes (:func:`~entmtp_hf.gemv.int8_parts`)."""
    return _onednn_takes(weight) or (_gemv.int8_parts(weight) is not None and weight.device.type == "cpu")


def _address(weight: torch.Tensor) -> int:
    """Where a weight's values lie: its own storage, or an int8 weight's values (a tensor subclass
    has no storage of its own)."""
    parts = _gemv.int8_parts(weight)
    return (parts[0] if parts is not None else weight).data_ptr()


class Scratch:
    """A float32 buffer per thread, grown to the largest request and reused: where :func:`widened`
    widens a weight. A fresh allocation of a few MB per product costs its page faults every call
    (the demo model's int8 layers at 64 rows took about a third longer with fresh buffers)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, numel: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < numel:
            buf = self._local.buf = torch.empty(numel)
        return buf[:numel]

    def __getstate__(self) -> dict:
        return {}  # a copy grows its own

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str, scratch: Scratch | None = None
) -> torch.Tensor:
    """``x [N, in] @ weight[out, in].T (+ bias)``: by ``F.linear`` (``linear``), as ``(W @ x.T).T``
    (``transposed``), by oneDNN's linear on the plain weight (``onednn``, CPU float only), by the
    package's few-row kernel (``gemv``: float32 or bfloat16, a contiguous weight; ``F.linear`` where a gradient
    is wanted, which the kernel does not compute) or in float32 on the weight widened (``widened``:
    :func:`widened`, into ``scratch`` where given)."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    if layout == "widened":
        parts = _gemv.int8_parts(weight)
        w, scale = parts if parts is not None else (weight, None)
        return widened(x, w, scale, bias, scratch(w.numel()).view(w.shape) if scratch is not None else None)
    if layout == "gemv":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return F.linear(x, weight, bias)
        return _gemv.gemv(x, weight, bias)
    if layout == "transposed":
        out = torch.mm(weight, x.t()).t()
        return out + bias if bias is not None else out
    if layout == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    raise ValueError(f"unknown layout {layout!r}; choose one of {HEAD_LAYOUTS}")


def widened(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` of a bfloat16 weight, or of an int8 weight-only one (its values and per-row
    ``scale``), computed in float32 on the weight widened for the call (into ``out``, a float32
    buffer of its shape, where given), then the scales, then the bias, rounded once to ``x``'s dtype.
    Many rows at once (a prompt's prefill) then run MKL's float32 product, which a CPU without
    bfloat16 instructions runs several times faster than its bfloat16 one, and faster than ``gemv``,
    which widens each weight row again for every few rows of ``x`` (the demo model's int8 layers at
    200 rows on a 2-core Zen 2 EPYC: 392 against 622 ms)."""
    y = F.linear(x.float(), weight.float() if out is None else out.copy_(weight))
    if scale is not None:
        y = y * scale.float().flatten()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fitted_layout(layout: str, weight: torch.Tensor | None) -> str:
    """``layout`` where it takes ``weight`` as it is now, else ``"linear"``: a layout measured for a
    model later moved to another dtype or device (the heads' drafting kernel, read per call)."""
    if weight is None or (layout == "onednn" and not _onednn_takes(weight)):
        return "linear"
    if layout == "gemv" and not _works("gemv", weight):
        return "linear"
    return layout


def _works(layout: str, weight: torch.Tensor) -> bool:
    """Whether ``layout`` runs on this weight here (some CPUs lack oneDNN's bf16 primitives; the
    ``gemv`` kernel takes contiguous float32 and bfloat16 weights, and int8 weight-only ones, on an
    x86-64 CPU with AVX2, once built)."""
    if layout == "onednn" and not _onednn_takes(weight):
        return False
    if layout == "widened" and _gemv.int8_parts(weight) is None and weight.dtype not in (torch.bfloat16, torch.float16):
        return False  # float32 weights: F.linear itself
    if layout == "gemv":
        x = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():  # whether it takes the weight, gradients aside (not .detach(): torchao's
            takes = _gemv.takes(x, weight, None)  # subclass cannot detach inside inference mode)
        if not (takes and _gemv.unavailable() is None):
            return False
    try:
        project(torch.zeros(2, weight.shape[1], dtype=weight.dtype), weight, None, layout)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):  # no such primitive here (or no oneDNN at all)
        return False


def _linears(modules: Iterable[torch.nn.Module], exclude: torch.nn.Module | None = None) -> list[torch.nn.Linear]:
    """The plain CPU float ``nn.Linear`` layers oneDNN may take, with no instance-level ``forward``
    of anyone else's (accelerate's offloading hooks, for instance, install one)."""
    return [
        m
        for m in modules
        if type(m) is torch.nn.Linear
        and m is not exclude
        and _routable(m.weight)
        and isinstance(vars(m).get("forward"), (type(None), _Dispatch))
    ]


def _pack(weight: torch.Tensor, rows: int = 4) -> torch.Tensor:
    """A copy of ``weight`` reordered into oneDNN's packed layout (the weight itself is untouched)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _available_bytes() -> int | None:
    """Memory available now (Linux), or None where the OS does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


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


def _form(weight: torch.Tensor) -> tuple:
    """What a layer's measured kernels were chosen for: its weight's shape, dtype and device."""
    return tuple(weight.shape), weight.dtype, weight.device


def _checksum(weight: torch.Tensor) -> int:
    """CRC-32 of the weight's bytes: what a packed copy was made from. Not its ``_version``: a write
    through ``.data`` bumps none, and a tensor made in ``torch.inference_mode()`` has none."""
    flat = weight.detach().contiguous().view(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy())


# ============================================================================ the compiled graph's product
#: each routed weight's dispatcher by the weight's address, as its last :meth:`_Dispatch.refresh` left
#: it: how :func:`_graph_linear` finds a packed copy (an opaque oneDNN tensor no graph can take as an
#: input). Weak, so a dropped model leaves nothing; an entry serves only while the layer still holds
#: a weight at that address and its model is inside ``applied`` in the calling thread.
_DISPATCH_BY_WEIGHT: "weakref.WeakValueDictionary[int, _Dispatch]" = weakref.WeakValueDictionary()
_GRAPH_OPS = torch.library.Library("entmtp_hf", "DEF")
_GRAPH_OPS.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the measured kernel of the layer holding ``weight``, where its
    dispatcher may serve this call (see :data:`_DISPATCH_BY_WEIGHT`); ``F.linear`` otherwise."""
    dispatch = _DISPATCH_BY_WEIGHT.get(weight.data_ptr())
    if dispatch is None:
        return F.linear(x, weight, bias)
    params = dispatch.module._parameters  # not the attribute: a parametrized weight is not there (F.linear)
    held, held_bias = params.get("weight"), params.get("bias")
    # the very tensors the layer holds (a graph's inputs are), else the same storage and layout
    if held is not weight and _storage(held) != _storage(weight):
        return F.linear(x, weight, bias)
    if held_bias is not bias and _storage(held_bias) != _storage(bias):
        return F.linear(x, weight, bias)
    return dispatch(x).contiguous()  # the layer's own product (``transposed`` returns a transposed view)


def _storage(t: torch.Tensor | None) -> tuple | None:
    """Where and how a tensor's values lie: two tensors alike here hold the same values."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _graph_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_GRAPH_OPS.impl("linear", _graph_linear, "CPU")
torch.library.register_fake("entmtp_hf::linear", _graph_linear_shape, lib=_GRAPH_OPS)


# ============================================================================ routing
class _Routes:
    """Each layer's kernel per row count (counts above the largest measured take its choice) and
    packed copy, installed as the layers' instance ``forward`` and used only in the threads that
    are inside :meth:`applied` (elsewhere each layer runs ``F.linear`` as before). Entering
    :meth:`applied` fits every layer to its weight as it is now (:meth:`_Dispatch.refresh`)."""

    def __init__(
        self,
        tables: dict[torch.nn.Linear, tuple[list[str], torch.Tensor | None]],
        pack_rows: int = 4,
        scratch: Scratch | None = None,
    ) -> None:
        self.dispatches = [_Dispatch(m, kernels, self, packed, pack_rows) for m, (kernels, packed) in tables.items()]
        self.scratch = scratch or Scratch()  # where the ``widened`` products widen their weights
        self._local = threading.local()
        self._lock = threading.Lock()

    def active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextmanager
    def applied(self) -> Iterator[None]:
        self.refresh()  # every call sees the weights as they are now, edited in place or not
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def refresh(self) -> None:
        """Fit every layer's kernels to its weight as it is now (one thread at a time: a re-pack
        replaces a layer's copy whole)."""
        with self._lock:
            for dispatch in self.dispatches:
                dispatch.refresh()

    def hold_current(self) -> None:
        """Hold again the int8 parts of each layer whose weight was replaced since (:meth:`_Dispatch.hold`)."""
        for dispatch in self.dispatches:
            if not dispatch.held_current():
                dispatch.hold()

    def install(self) -> None:
        for dispatch in self.dispatches:
            if "forward" not in vars(dispatch.module):
                vars(dispatch.module)["forward"] = dispatch

    def remove(self) -> None:
        for dispatch in self.dispatches:
            if vars(dispatch.module).get("forward") is dispatch:
                del vars(dispatch.module)["forward"]

    def __getstate__(self) -> dict:
        """Copied or pickled with the model: the layers' choices, not this process's thread state."""
        return {"dispatches": self.dispatches}

    def __setstate__(self, state: dict) -> None:
        self.dispatches = state["dispatches"]
        self.scratch = Scratch()
        self._local = threading.local()
        self._lock = threading.Lock()


class _Dispatch:
    """A layer's forward: its kernel for the input's row count inside :meth:`_Routes.applied` while
    the layer is fit for it (:meth:`refresh`, on entering), ``F.linear`` otherwise (and in a graph
    ``torch.compile`` traces).

    Invariant: ``ready`` is None (``F.linear`` only) or ``(data_ptr, packed, checksum)`` of the
    weight as :meth:`refresh` last saw it; ``packed`` (where the kernels use it) is a copy of
    exactly those bytes. A product runs on the kernels only while the weight's ``data_ptr`` is
    still that one (a weight replaced within a call runs ``F.linear``).
    """

    __slots__ = ("module", "kernels", "owner", "pack_rows", "measured", "ready", "int8", "int8_of", "__weakref__")

    def __init__(
        self, module: torch.nn.Linear, kernels: list[str], owner: _Routes, packed: torch.Tensor | None, pack_rows: int
    ) -> None:
        self.module, self.kernels, self.owner, self.pack_rows = module, kernels, owner, pack_rows
        weight = module.weight
        self.measured = _form(weight)
        self.ready = (weight.data_ptr(), packed, _checksum(weight)) if packed is not None else None
        self.hold()

    def hold(self) -> None:
        """Hold the int8 values and scales of an int8 weight-only weight as it is now (:attr:`int8`, and
        the weight they are read from, :attr:`int8_of`; both None for any other weight). A compiled graph
        reads them from here, not through the weight: a graph that reaches a tensor subclass cannot be
        saved (its guards would pickle an empty copy of the weight, which torchao's ``Int8Tensor`` does
        not implement), and one that reaches only plain tensors checks only plain tensors' guards
        per call. :meth:`held_current` is what keeps them the layer's."""
        weight = self.module._parameters.get("weight")
        parts = _gemv.int8_parts(weight) if weight is not None else None
        self.int8, self.int8_of = (parts, weight) if parts is not None else (None, None)

    def held_current(self) -> bool:
        """Whether the held int8 parts (if any) are the layer's weight's: False once the weight was
        replaced by another tensor (values written in place stay the held tensors')."""
        return self.int8_of is None or self.module._parameters.get("weight") is self.int8_of

    def graph_kernel(self, rows: int) -> str:
        """What a compiled graph of ``rows`` rows, without gradients, calls for this layer: ``gemv``
        (the extension's operator, called from the graph with no Python in between:
        :func:`~entmtp_hf.gemv.graph_gemv`) where the layer's kernel at that row count is the package's
        own, ``F.linear`` where it is ``F.linear``, else the ``operator`` (``entmtp_hf::linear``, which
        runs this dispatcher: a packed copy cannot be a graph input). A saved graph's key holds it for
        the graph's row count."""
        kernel = self.kernels[min(rows, len(self.kernels) - 1)]
        if kernel == "linear":
            return "F.linear"
        return "gemv" if kernel == "gemv" and _gemv.graph_operator() else "operator"

    def refresh(self) -> None:
        """Fit the kernels to the weight as it is now (:meth:`_fit`) and file this dispatcher under
        that weight for the compiled graphs' operator."""
        self._fit()
        self.hold()
        if self.ready is not None:
            _DISPATCH_BY_WEIGHT[_address(self.module.weight)] = self

    def _fit(self) -> None:
        """Fit the kernels to the weight as it is now: ``F.linear`` for a weight of another shape,
        dtype or device than measured (call ``enable_entmtp`` again to measure for it) or one a
        parametrization computes on each access; a packed copy packed again when the weight's
        bytes changed since it was made (a LoRA merge, a loaded state dict)."""
        m = self.module
        if parametrize.is_parametrized(m, "weight") or _form(m.weight) != self.measured:
            self.ready = None
            return
        if "gemv" in self.kernels and not m.weight.is_contiguous():  # a view the kernel would not take
            self.ready = None
            return
        weight, ready = m.weight, self.ready
        if ready is None and not all(_works(k, weight) for k in set(self.kernels) - {"linear", PACKED}):
            return  # not on this machine (a model unpickled elsewhere, say): F.linear
        if PACKED not in self.kernels:
            self.ready = (_address(weight), None, None)
            return
        checksum = _checksum(weight)
        if ready is not None and ready[1] is not None and ready[2] == checksum:
            self.ready = (weight.data_ptr(), ready[1], checksum)  # the same bytes (perhaps moved): the same copy
            return
        try:
            self.ready = (weight.data_ptr(), _pack(weight, self.pack_rows), checksum)
        except RuntimeError:  # no packed primitive here
            self.ready = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, ready = self.module, self.ready
        if torch.compiler.is_compiling():  # one operator the graph calls (:meth:`graph_kernel`)
            kind = "F.linear" if torch.is_grad_enabled() else self.graph_kernel(x.numel() // x.shape[-1])
            if self.int8 is not None and not torch.is_grad_enabled():  # the held values, not the subclass
                qdata, scale = self.int8
                if kind == "gemv":
                    return torch.ops.entmtp_hf_cpu.gemv_int8(x, qdata, scale, m.bias)
                if self.kernels[min(x.numel() // x.shape[-1], len(self.kernels) - 1)] == "widened":
                    return widened(x, qdata, scale, m.bias)
                return _gemv.int8_linear(x, qdata, scale, m.bias)
            if kind == "gemv":
                return _gemv.graph_gemv(x, m.weight, m.bias)
            if kind == "operator":
                return torch.ops.entmtp_hf.linear(x, m.weight, m.bias)
            return F.linear(x, m.weight, m.bias)
        if ready is None or not self.owner.active():
            return F.linear(x, m.weight, m.bias)
        params = m._parameters  # read directly: nn.Module's attribute lookup costs microseconds per product
        weight, bias = params.get("weight"), params.get("bias")
        if weight is None:  # parametrized since this call began
            return F.linear(x, m.weight, m.bias)
        rows = x.numel() // x.shape[-1]
        kernel = self.kernels[min(rows, len(self.kernels) - 1)]
        if kernel == "linear" or rows == 0 or _address(weight) != ready[0]:
            return F.linear(x, weight, bias)
        if kernel == "gemv" and not torch.is_grad_enabled():  # any leading shape, as F.linear
            return _gemv.gemv(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if kernel == PACKED:
            out = torch.ops.mkldnn._linear_pointwise(flat, ready[1], bias, "none", [], "")
        else:
            out = project(flat, weight, bias, kernel, self.owner.scratch)
        return out.reshape(*x.shape[:-1], -1)

    def __getstate__(self) -> dict:
        """Copied or pickled without the packed copy (an opaque oneDNN tensor that neither
        ``deepcopy`` nor pickle can read): the copy packs its own weight at its first call. The held
        int8 parts travel (a deep copy of the model copies them in one memo with the weight, so the
        copy holds its own weight's; a saved graph's guards read them)."""
        return {k: getattr(self, k) for k in self.__slots__ if k not in ("ready", "__weakref__")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.ready = None


def kernels_of(model) -> "CPUKernels | None":
    """The kernels attached to ``model`` (:meth:`CPUKernels.install`), or None."""
    return vars(model).get(KERNELS_ATTR) if model is not None else None


def applied_kernels(model) -> AbstractContextManager:
    """A block that runs on ``model``'s kernels (:meth:`CPUKernels.applied`), if it has any."""
    kernels = kernels_of(model)
    return kernels.applied() if kernels is not None else nullcontext()


def hold_current(model) -> None:
    """Before a compiled call of ``model``: the int8 parts its graphs read follow any weight replaced
    since they were held (a ``load_state_dict(..., assign=True)``, say; one identity check per routed
    layer, tens of microseconds on the demo model)."""
    kernels = kernels_of(model)
    if kernels is not None:
        kernels._routes.hold_current()


def held_weights(model) -> set[int]:
    """The ids of ``model``'s int8 weights that its compiled graphs never read: they read the values and
    scales their layers' dispatchers hold (:meth:`_Dispatch.hold`)."""
    kernels = kernels_of(model)
    if kernels is None:
        return set()
    return {id(d.int8_of) for d in kernels._routes.dispatches if d.int8_of is not None and d.held_current()}


def kernel_routing(model) -> list[str]:
    """What kinds of product the EntMTP calls of ``model`` run on (empty: ``F.linear`` throughout).
    A step's cost depends on it as much as on the processor, so it is part of a cost table's key
    (:func:`~entmtp_hf.costs.fingerprint.model_key`). The kinds, not the choice per row count:
    those flip between near-equal kernels from one measurement to the next, and each flip would
    measure the step costs again."""
    kernels = kernels_of(model)
    return kernels.kinds() if kernels is not None and kernels.active else []


# ============================================================================ the measured kernels
class CPUKernels:
    """The measured kernel choices of one model (and its heads) on this machine.

    ``rows``: the row counts to measure (a product of more rows uses the largest's choice);
    ``pack``: ``"auto"`` (a packed copy where it measures faster and fits
    :data:`PACK_MEMORY_SHARE` of the free memory), ``True`` (packed at every row count) or
    ``False``; ``gemv``: whether the package's own few-row kernel is a candidate (float32 and bfloat16 on an
    x86-64 CPU with AVX2; built once per machine at first use, :mod:`entmtp_hf.gemv`);
    ``repeats``: interleaved timing rounds. Measuring takes a few seconds, once, and is
    logged. :meth:`install` attaches the choices to the model for its EntMTP calls,
    :meth:`remove` takes them off; :meth:`applied` runs any block on them. A model on another
    device or in another dtype, or a torch without oneDNN, gets none (:attr:`active` is False,
    :attr:`reason` says why).
    """

    def __init__(
        self,
        model,
        heads=None,
        *,
        rows: Sequence[int] = DEFAULT_ROWS,
        pack: bool | str = "auto",
        gemv: bool = True,
        repeats: int = 3,
    ) -> None:
        if pack not in PACK_CHOICES:
            raise ValueError(f"pack must be one of {PACK_CHOICES}, got {pack!r}")
        rows = sorted(set(rows))
        if not rows or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows) or repeats < 1:
            raise ValueError(f"rows must be positive integers and repeats >= 1, got {rows} and {repeats}")
        self.model, self.heads, self.rows, self.gemv = model, heads, rows, bool(gemv)
        self.decoder: dict[int, str] = {}
        self.lm_head: dict[int, str] = {}
        self.drafting = "linear"
        self.pack_note = ""
        self.seconds = 0.0
        self.reason = self._unavailable()
        self._scratch = Scratch()
        self._routes = _Routes({})
        if self.reason is None:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._measure(pack, repeats)
            self.seconds = time.perf_counter() - t0

    @property
    def active(self) -> bool:
        return self.reason is None

    @property
    def packed(self) -> bool:
        """Whether some row count runs the decoder on packed copies."""
        return PACKED in self.decoder.values()

    def kinds(self) -> list[str]:
        """``"by row count"`` where some layer is routed, ``"packed"`` where a packed copy is and
        ``"gemv"`` where the package's kernel is; empty where every measured choice is ``F.linear``
        (the default path's costs)."""
        dispatches = self._routes.dispatches
        if not dispatches:
            return []
        used = {k for d in dispatches for k in d.kernels}
        return ["by row count"] + [k for k in (PACKED, "gemv") if k in used]

    def _unavailable(self) -> str | None:
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            return "the model is not on the CPU"
        if not _routable(weight):
            return f"no kernel here takes {weight.dtype} weights"
        if (self.gemv and _works("gemv", weight)) or _gemv.int8_parts(weight) is not None:
            return None  # an int8 weight-only LM head: gemv, or widened, which runs anywhere
        if not onednn_available():
            return "this torch build has no oneDNN linear"
        if not _works("onednn", weight):
            return f"oneDNN's linear does not take {weight.dtype} weights on this CPU"
        return None

    def _layers(self) -> list[torch.nn.Linear]:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        return _linears(decoder.modules(), exclude=self.model.get_output_embeddings())

    # ------------------------------------------------------------------ measuring
    def _measure(self, pack: bool | str, repeats: int) -> None:
        layers = self._layers()
        packed = self._packed_copies(layers, pack)
        kinds = {(type(m.weight), m.weight.dtype): m.weight for m in layers}.values()  # one weight of each kind
        choices = tuple(self._dense(*kinds) if layers else ("linear",)) + ((PACKED,) if packed else ())
        times = {r: _timed_median(self._decoder_pass(layers, packed, r), choices, repeats) for r in self.rows}
        if pack is True and packed:
            self.decoder = dict.fromkeys(self.rows, PACKED)
        else:
            self.decoder = {r: min(t, key=t.get) for r, t in times.items()}
        table, keep = _by_rows(self.decoder), packed if self.packed else {}
        tables = {m: (table, keep.get(id(m.weight))) for m in layers}
        head = self.model.get_output_embeddings()
        layouts = [lay for lay in HEAD_LAYOUTS if (self.gemv or lay != "gemv") and _works(lay, head.weight)]
        self.lm_head = {r: self._fastest_head(head, r, layouts, repeats) for r in self.rows}
        if _linears([head]):
            tables[head] = (_by_rows(self.lm_head), None)
        if self.heads is not None:
            self.drafting = self._measure_drafting(repeats)
            for m in _linears(self.heads.modules()):
                tables[m] = (_by_rows({1: self.drafting}), None)
        self._routes = _Routes({m: t for m, t in tables.items() if set(t[0]) != {"linear"}}, scratch=self._scratch)

    def _packed_copies(self, layers: list[torch.nn.Linear], pack: bool | str) -> dict[int, torch.Tensor]:
        """Packed copies of the decoder's weights to measure (and keep where chosen), if asked for,
        available on this CPU and dtype, and within :data:`PACK_MEMORY_SHARE` of the free memory."""
        if pack is False or not layers or not onednn_available():
            return {}
        if any(_gemv.int8_parts(m.weight) is not None for m in layers):  # oneDNN packs no int8 weight-only layer
            return {}
        size, free = sum(m.weight.numel() * m.weight.element_size() for m in layers), _available_bytes()
        if pack == "auto" and free is not None and size > PACK_MEMORY_SHARE * free:
            self.pack_note = (
                f"not packed: copies of {size / 2**30:.1f} GiB would take over {PACK_MEMORY_SHARE:.0%} "
                "of the free memory"
            )
            return {}
        try:
            return {id(m.weight): _pack(m.weight) for m in layers}
        except RuntimeError as e:  # no packed primitive for this dtype on this CPU
            self.pack_note = f"not packed: {e}".splitlines()[0]
            return {}

    def _decoder_pass(
        self, layers: list[torch.nn.Linear], packed: dict[int, torch.Tensor], rows: int
    ) -> Callable[[str], None]:
        """One pass of ``rows`` rows over every decoder weight, as a forward reads them."""
        g = torch.Generator().manual_seed(rows)
        inputs = (
            {n: torch.randn(rows, n, generator=g).to(layers[0].weight.dtype) for n in {m.in_features for m in layers}}
            if layers
            else {}
        )

        def run(kernel: str) -> None:
            for m in layers:
                x = inputs[m.in_features]
                if kernel == PACKED:
                    torch.ops.mkldnn._linear_pointwise(x, packed[id(m.weight)], m.bias, "none", [], "")
                else:
                    project(x, m.weight, m.bias, kernel, self._scratch)

        return run

    def _fastest_head(self, head: torch.nn.Module, rows: int, layouts: list[str], repeats: int) -> str:
        x = torch.randn(rows, head.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(head.weight)
        times = _timed_median(lambda lay: project(x, head.weight, getattr(head, "bias", None), lay), layouts, repeats)
        return min(layouts, key=times.get)

    def _measure_drafting(self, repeats: int) -> str:
        """The faster kernel for the heads' one-row products: their layers, and the base LM rows
        they draft from."""
        layers = _linears(self.heads.modules())
        lm_rows = self.model.get_output_embeddings().weight[: self.heads.config.draft_vocab_rows]
        weights = [(m.weight, m.bias) for m in layers] + [(lm_rows, None)]
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(1, w.shape[1], generator=g).to(w) for w, _ in weights]

        def draft_pass(kernel: str) -> None:
            for (w, b), x in zip(weights, inputs):
                project(x, w, b, kernel, self._scratch)

        kernels = self._dense(*(w for w, _ in weights))
        times = _timed_median(draft_pass, kernels, repeats)
        return min(kernels, key=times.get)

    def _dense(self, *weights: torch.Tensor) -> list[str]:
        """The plain-weight kernels to measure on these weights: those that run on every one of them."""
        return [k for k in DENSE_KERNELS if (self.gemv or k != "gemv") and all(_works(k, w) for w in weights)]

    # ------------------------------------------------------------------ using them
    def applied(self):
        """A context in which this thread's calls of the model (and heads) run on the choices
        (installed ones: :meth:`install`)."""
        return self._routes.applied()

    def install(self) -> "CPUKernels":
        """Put the choices on the model's layers for its EntMTP calls (and the cost probe)."""
        if self.active:
            other = kernels_of(self.model)
            if other is not None and other is not self:
                other.remove()
            self._routes.install()
            vars(self.model)[KERNELS_ATTR] = self
            if self.heads is not None and self.drafting != "linear":
                self.heads.lm_kernel = self.drafting
        return self

    def remove(self) -> None:
        """Give every layer its own forward back (the weights were never changed)."""
        self._routes.remove()
        if vars(self.model).get(KERNELS_ATTR) is self:
            del vars(self.model)[KERNELS_ATTR]
        if self.heads is not None and "lm_kernel" in vars(self.heads):
            del self.heads.lm_kernel

    def describe(self) -> str:
        """One line: what was chosen, and how long measuring took."""
        if not self.active:
            return f"off ({self.reason})"
        note = f" ({self.pack_note})" if self.pack_note else ""
        return (
            f"decoder {_runs(self.decoder)}{note}; LM head {_runs(self.lm_head)}; drafting {self.drafting} "
            f"(measured {self.rows[0]}-{self.rows[-1]} rows in {self.seconds:.1f} s)"
        )

    def __enter__(self) -> "CPUKernels":
        return self.install()

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


# ============================================================================ benchmark references
@contextmanager
def _references(
    model, tables: dict[torch.nn.Linear, tuple[list[str], torch.Tensor | None]], pack_rows: int = 4
) -> Iterator[int]:
    """``tables`` installed and applied in this thread for the block, with the model's own
    kernels (if any) off their layers meanwhile. Yields the number of layers routed."""
    own = kernels_of(model)
    if own is not None:
        own._routes.remove()
    routes = _Routes(tables, pack_rows)
    routes.install()
    try:
        with routes.applied():
            yield len(tables)
    finally:
        routes.remove()
        if own is not None:
            own._routes.install()


def onednn_linears(model):
    """Inside the block this thread's products by every plain CPU float ``nn.Linear`` of ``model``,
    its LM head included, run on oneDNN at any row count: the benchmark's kernel reference for
    plain decoding (``vanilla-onednn``). Yields the number of layers routed."""
    layers = _linears(model.modules()) if onednn_available() else []
    return _references(model, {m: (["linear", "onednn"], None) for m in layers})


def packed_linears(model, rows: int = 4):
    """Inside the block this thread's products by the decoder's plain CPU float ``nn.Linear``
    layers run on packed copies of their weights (the benchmark's ``vanilla-packed`` reference);
    the weights themselves are untouched. Yields the number of layers packed."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = _linears(decoder.modules(), exclude=head) if onednn_available() else []
    return _references(model, {m: (["linear", PACKED], _pack(m.weight, rows)) for m in layers}, rows)
