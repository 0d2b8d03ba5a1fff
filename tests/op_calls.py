"""What the package's C++ operators a block ran, as torch's profiler sees them (compiled graphs call
them through the dispatcher, with no Python a test could wrap)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def extension_calls(run: Callable[[], T]) -> tuple[T, dict[str, list[list[int]]]]:
    """``run()``'s result and the ``entmtp_hf_cpu`` operators it called: by name, each call's first
    input's shape."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = run()
    calls: dict[str, list[list[int]]] = {}
    for event in prof.events():
        if event.name.startswith("entmtp_hf_cpu::"):
            calls.setdefault(event.name.split("::")[1], []).append(event.input_shapes[0])
    return out, calls
