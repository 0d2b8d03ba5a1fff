"""What the tools record about the machine they ran on, and its thread setting.

Speeds are only comparable on the same machine and thread count, so every report and bank
written by the tools names the CPU (or GPU), the torch threads and the library versions.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_string() -> str:
    """CPU model, core count and torch threads (or the GPU name)."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA), torch threads {torch.get_num_threads()}"
    return f"{cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def versions() -> dict[str, str]:
    """The versions that decide the decoding's numbers: entmtp-hf, torch, transformers, Python."""
    import transformers

    from .. import __version__ as entmtp_version

    return {
        "entmtp_hf": entmtp_version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (None keeps torch's choice)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
