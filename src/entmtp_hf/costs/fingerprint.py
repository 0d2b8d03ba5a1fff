"""Which machine, and which model and heads, a cost table belongs to.

A tree's acceptance (tokens per step) depends on the model, the heads and the task; what a
step costs depends on the machine: the processor and its instruction set, the threads torch
uses, the dtype, the torch build, the shapes of the model and heads (not their weights) and the
kernels their linear layers run on. :class:`Fingerprint` holds the machine side, :func:`model_key`
the rest; together they key a measured cost table, so a bank re-ranks itself once per machine
(and kernel choice) and reuses it after.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cpu_kernels import kernel_routing

#: instruction-set flags that change which kernels a CPU's BLAS runs
_ISA = re.compile(r"^(avx\w*|amx\w*|fma\w*|f16c|sse4_\d|vnni\w*|sve\w*|neon|asimd\w*)$")


@dataclass(frozen=True)
class Fingerprint:
    """The machine a cost table was measured on."""

    device: str  # "cpu", "cuda", ...
    processor: str  # CPU model name or accelerator name
    isa: str  # the CPU's instruction-set flags that matter for kernels, or the CUDA capability
    threads: int
    dtype: str
    torch: str

    def key(self) -> str:
        """A short stable hash of every field."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.processor} ({self.device}, {self.threads} threads, {self.dtype}, torch {self.torch})"


def _cpu() -> tuple[str, str]:
    """CPU model name and its kernel-relevant instruction-set flags (Linux: /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not flags:
                name = value.strip()
            elif key in ("flags", "Features"):
                flags = sorted(f for f in value.split() if _ISA.match(f))
                break
    except OSError:
        pass
    return name, " ".join(flags)


def machine_fingerprint(device: torch.device, dtype: torch.dtype) -> Fingerprint:
    """This machine, for a model on ``device`` in ``dtype``."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        processor, isa = torch.cuda.get_device_name(device), f"sm_{major}{minor}"
    else:
        processor, isa = _cpu()
    return Fingerprint(
        device.type, processor, isa, torch.get_num_threads(), str(dtype).removeprefix("torch."), torch.__version__
    )


#: the decode step's implementation and the probe's method: a change that moves the costs (the
#: cache's layout, rows drafted or committed together, plain decoding timed at the forward's
#: context, drafting timed inside decoding) bumps this, so tables measured before are measured again
STEP_VERSION = 4


def quantization_of(model) -> dict | None:
    """The model's ``quantization_config`` as a dict (None for plain weights)."""
    quantization = getattr(model.config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return quantization or None


def compiled_route(model) -> dict | None:
    """The compile settings ``generate`` decodes ``model`` with by default (a static cache and a
    ``compile_config`` in its generation config, as ``use_compiled_decoding`` sets), else None."""
    generation = getattr(model, "generation_config", None)
    config = getattr(generation, "compile_config", None)
    if config is None or getattr(generation, "cache_implementation", None) != "static" or generation.disable_compile:
        return None
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_")} | {
        "all_devices": bool(getattr(config, "_compile_all_devices", False))
    }


def model_key(model, heads) -> str:
    """What a step's cost depends on beside the machine: the base model's architecture and size,
    the heads', the decode step's implementation (:data:`STEP_VERSION`) and the kernels the
    linear layers run on (:func:`~entmtp_hf.cpu_kernels.kernel_routing`: the same CPU costs a
    tree differently with ``cpu_kernels=True``), the weights' quantization and the compiled route
    ``generate`` takes (:func:`compiled_route`)."""
    config = model.config.get_text_config()
    shape = {
        "step": STEP_VERSION,
        "model_type": getattr(config, "model_type", type(model).__name__),
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden_size": getattr(config, "hidden_size", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "vocab": getattr(config, "vocab_size", None),
        "heads": {
            k: v
            for k, v in heads.config.to_dict().items()
            if k not in ("base_model_name_or_path", "prefix_layer_config")
        },
    }
    # only off the default path, so tables measured there keep their keys
    routing, quantization, compiled = kernel_routing(model), quantization_of(model), compiled_route(model)
    if routing:
        shape["kernels"] = routing
    if quantization:  # int8 weights cost what their kernels cost, not what the dtype says
        shape["quantization"] = quantization
    if compiled:  # a compiled step costs what its graphs cost
        shape["compiled"] = compiled
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
