"""The package's own product for a few rows (``gemv``): float32, bfloat16 or int8 weight-only weights,
AVX2 + FMA, built once per machine.

A decode step multiplies one row (a plain step) or a few (a small tree's nodes) by every weight of
the model, so it is bound by reading the weights. MKL and oneDNN are built for many rows: on a
2-core AMD EPYC Zen 2 (AVX2, 32.5 GB/s) all of the demo model's products at one row took 43.7 ms
on MKL (``F.linear``) and 30.8 ms on oneDNN against the 16.6 ms its weights take to read; this
kernel, which multiplies each weight row into every input row while it is in registers (fetching
the rows ahead), took 18.9 ms at one row and 21.4 at three; in bfloat16, read as one stream per
thread, 10.6 ms at one row and 14.7 at three (``scripts/product_kernels.py``). It is one more candidate for
:class:`~entmtp_hf.cpu_kernels.CPUKernels`, which measures it beside the others and uses it only
at the row counts where it is fastest on this machine.

bfloat16 weights are widened to float32 in registers (a bfloat16 is a float32's upper half), so
they are read at half the bytes on CPUs without bfloat16 instructions too; sums are float32 and the
output is rounded to bfloat16 once. int8 weight-only weights (torchao's ``Int8Tensor`` with a scale
per row, :func:`int8_parts`) multiply float32 rows widened likewise; bfloat16 rows, the int8 models'
activations, meet them in integers: each row held as 16-bit integers per block of 64 values with a
power-of-two scale (exact for every value within 2^8 of its block's largest, a smaller one off by
at most 2^-15 of that largest), sixteen weights multiplied and added per
instruction into exact int32 sums, each block's sums scaled into float32 (widening every weight to
float32 was what bounded int8 products). The sums are multiplied by the row's scale.
Its output row ``i`` depends only on input row ``i`` (the sums run in the same order whatever the
number of rows), so a tree's verification product equals the one-token product bit for bit.

The C++ sources (``csrc/gemv.cpp``, and ``csrc/attention.cpp``: the decode attention compiled
graphs run, :func:`~entmtp_hf.decoding.attention.graph_attention`) are compiled into one extension
at first use with torch's extension builder (a C++ compiler and ninja; about 40 s, announced) in
the user cache folder, keyed by the sources, the flags and the torch version, and loaded from there
by later processes. The extension gives eager calls Python functions and compiled graphs four
operators, ``entmtp_hf_cpu::gemv``, ``entmtp_hf_cpu::gemv_int8``, ``entmtp_hf_cpu::gemv_int8_group`` (a
layer's int8 products of one input in one call, :mod:`~entmtp_hf.decoding.product_groups`) and
``entmtp_hf_cpu::decode_attention`` (``csrc/module.cpp``), which a graph calls through the
dispatcher. Where it cannot be built or run (not x86-64 with AVX2, no compiler) :func:`unavailable`
says why and the other kernels (and ``sdpa``) are used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from .paths import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: the extension's sources: the few-row product, the decode attention
#: (:func:`~entmtp_hf.decoding.attention.grouped_tree_attention` runs it in compiled graphs) and the module
SOURCES = tuple(CSRC / name for name in ("gemv.cpp", "attention.cpp", "module.cpp"))
HEADERS = (CSRC / "simd.h",)  # what the sources include: part of the build's key
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")  # OpenMP: torch's parallel_for splits the columns over its threads
DTYPES = (torch.float32, torch.bfloat16)
#: the CPU capabilities (``torch.backends.cpu.get_cpu_capability()``) that include AVX2 and FMA
CAPABLE = ("AVX2", "AVX512")


def int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(qdata, scale)`` of an int8 weight-only weight quantized per row, as torchao's ``Int8Tensor``
    holds it (``Int8WeightOnlyConfig()``: a scale per output row, activations left in floating point);
    None for any other weight. Its zero point, which torchao's weight-only product does not apply, is
    checked by :func:`takes` (all zeros: symmetric)."""
    if type(weight).__name__ != "Int8Tensor":
        return None
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor) or qdata.dtype != torch.int8:
        return None
    if any(getattr(weight, name, None) is not None for name in ("act_quant_kwargs", "act_pre_scale")):
        return None
    per_row = qdata.dim() == 2 and list(getattr(weight, "block_size", ())) == [1, qdata.shape[1]]
    return (qdata, scale) if per_row and scale.numel() == qdata.shape[0] else None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`gemv` computes ``F.linear(x, weight, bias)`` for these tensors: plain CPU tensors
    all float32 or all bfloat16, a contiguous weight (a transposed view would be copied per call), or
    a float32 or bfloat16 ``x`` with an int8 weight-only weight (:func:`int8_parts`, its int8 values
    contiguous); no gradient wanted."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    parts = int8_parts(weight)
    if parts is not None:
        qdata, scale = parts
        inputs = (x,) if bias is None else (x, bias)
        plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in inputs)
        floats = x.dtype in DTYPES and (bias is None or bias.dtype == x.dtype)
        on_cpu = all(t.device.type == "cpu" for t in (*inputs, qdata, scale))
        zero = getattr(weight, "zero_point", None)
        symmetric = zero is None or not bool(zero.any())
        return plain and floats and on_cpu and symmetric and qdata.is_contiguous()
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
    if not plain or weight.dtype not in DTYPES:
        return False
    if any(t.dtype != weight.dtype or t.device.type != "cpu" for t in tensors):
        return False
    return weight.dim() == 2 and weight.is_contiguous() and (bias is None or bias.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the kernel (check :func:`takes` and :func:`unavailable` first)."""
    parts = int8_parts(weight)
    if parts is not None:
        return extension().gemv_int8(x, parts[0], parts[1], bias)
    return extension().gemv(x, weight, bias)


def graph_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gemv` as a compiled graph calls it: the extension's operator (``entmtp_hf_cpu::gemv``,
    ``entmtp_hf_cpu::gemv_int8`` on an int8 weight's values and scales), through the dispatcher."""
    parts = int8_parts(weight)
    if parts is not None:
        return torch.ops.entmtp_hf_cpu.gemv_int8(x, parts[0], parts[1], bias)
    return torch.ops.entmtp_hf_cpu.gemv(x, weight, bias)


def int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of an int8 weight-only weight given as its values and per-row scales (:func:`int8_parts`),
    computed as torchao's ``Int8Tensor`` computes it: the product in ``x``'s dtype, then the scales, then
    the bias."""
    y = F.linear(x, qdata.to(x.dtype)) * scale.to(x.dtype).flatten()
    return y if bias is None else y + bias


@torch.compiler.assume_constant_result  # asked while tracing: a constant of the graph, not a break
def graph_operator() -> bool:
    """Whether compiled graphs may call the kernel as the extension's operator (``entmtp_hf_cpu::gemv``,
    registered when the extension loads): it is built, or can be, here."""
    return unavailable() is None


def extension():
    """The built extension (``gemv``, ``decode_attention``); raises where it cannot run here."""
    module, why = _built()
    if module is None:
        raise RuntimeError(f"the package's CPU kernels are not available: {why}")
    return module


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can; the first call builds or loads it)."""
    return _built()[1]


def _not_here() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in CAPABLE:
        return f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) to build it with"
    return None


def build_dir() -> Path:
    """Where the built kernel lives: per source, flags and torch / Python version."""
    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join(CFLAGS).encode()).hexdigest()[:12]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / "kernels" / f"gemv-{key}-torch{torch.__version__.replace('+', '-')}-{py}"


@functools.lru_cache(maxsize=None)
def _built() -> tuple[ModuleType | None, str | None]:
    """The extension, built or loaded once per process, or None and why not."""
    why = _not_here()
    if why is not None:
        return None, why
    from torch.utils import cpp_extension

    folder = build_dir()
    fresh = not any(folder.glob("*.so"))
    if fresh:
        what = "few-row product, decode attention; once per machine, ~40 s"
        print(f"entmtp-hf: building the package's CPU kernels ({what}) ...", file=sys.stderr)
    t0 = time.perf_counter()
    try:  # a folder that cannot be written, a failed build or a wrong result: the other kernels serve
        folder.mkdir(parents=True, exist_ok=True)
        with _ninja_on_path():
            module = cpp_extension.load(
                name="entmtp_hf_cpu",
                sources=[str(p) for p in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
        _check(module)
    except Exception as e:
        last = (str(e).strip().splitlines() or [""])[-1]
        why = f"could not build or run it in {folder} ({type(e).__name__}: {last})"
        log.warning("entmtp-hf: the gemv kernel is off: %s", why)
        return None, why
    if fresh:
        print(f"entmtp-hf: built it in {time.perf_counter() - t0:.0f} s ({folder})", file=sys.stderr)
    return module, None


class _ninja_on_path:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` package installs it into the
    environment's bin folder, which PATH need not hold when Python is started by its full path."""

    def __enter__(self) -> None:
        self.saved = os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            try:
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + self.saved
            except ImportError:
                pass

    def __exit__(self, *exc) -> None:
        os.environ["PATH"] = self.saved


def _check(module: ModuleType) -> None:
    """The built kernels against torch on odd shapes: products (column and depth tails, 1-5 rows,
    bias; float32, and int8 weights with a scale per row) against ``F.linear``, attention (3 query
    heads on one key/value head, a masked key, a key count off the groups of four) against
    ``F.scaled_dot_product_attention``."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(7, 13, generator=g), torch.randn(7, generator=g)
    for rows in range(1, 6):
        x = torch.randn(rows, 13, generator=g)
        for bias in (None, b):
            if not torch.allclose(module.gemv(x, w, bias), F.linear(x, w, bias), atol=1e-5):
                raise RuntimeError(f"wrong products at {rows} rows")
    q, k, v = (
        torch.randn(1, 3, 2, 16, generator=g),
        torch.randn(1, 1, 5, 16, generator=g),
        torch.randn(1, 1, 5, 16, generator=g),
    )
    mask = torch.zeros(1, 1, 2, 5)
    mask[..., 3] = torch.finfo(torch.float32).min
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if not torch.allclose(module.decode_attention(q, k, v, mask, 0.25), want.transpose(1, 2), atol=1e-5):
        raise RuntimeError("wrong attention")
    qdata = torch.randint(-127, 128, (7, 37), generator=g, dtype=torch.int8)
    scale, x = torch.rand(7, generator=g) / 64, torch.randn(3, 37, generator=g)
    if not torch.allclose(module.gemv_int8(x, qdata, scale, b), F.linear(x, qdata * scale[:, None], b), atol=1e-5):
        raise RuntimeError("wrong int8 products")


#: the most query tokens the decode attention takes: it reads a head's keys once per query row, and
#: past ~8 tokens of the demo model's 3 query heads per key/value head the flash kernel was faster
KERNEL_MAX_TOKENS = 8


def kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the decode attention takes these queries [B, H, T, d], keys and values [B, kvH, S, d]."""
    if query.shape[2] > KERNEL_MAX_TOKENS:
        return False
    same = query.dtype == key.dtype == value.dtype and query.dtype in (torch.float32, torch.bfloat16)
    grouped = query.shape[1] % key.shape[1] == 0 and query.shape[-1] % 8 == 0
    return same and grouped and key.stride(-1) == 1 and value.stride(-1) == 1


def kernel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Attention of queries [B, H, T, d] over keys and values [B, kvH, S, d] under the additive or
    boolean ``mask`` [B or 1, H or 1, T, S] on the package's decode attention, as [B, T, H, d]; None
    where it does not take them (not the CPU, another dtype, more than :data:`KERNEL_MAX_TOKENS`
    queries, a gradient wanted, the kernels not buildable here; the first call builds them, once per
    machine). What the drafters' few-query attention runs on (PyTorch's CPU flash kernel spends most
    of such a call around its little work)."""
    if query.device.type != "cpu" or not kernel_takes(query, key, value):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return None  # the kernel computes no gradient
    if unavailable() is not None:
        return None
    return torch.ops.entmtp_hf_cpu.decode_attention(query, key, value, mask, scale)
