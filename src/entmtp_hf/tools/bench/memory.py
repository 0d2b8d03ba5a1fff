"""Peak memory of one generation, as the machine allows it to be read."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import torch


class PeakMemory:
    """Peak memory of one generation: CUDA allocator peak, or peak RSS on the CPU.

    On Linux the RSS high-water mark (VmHWM) is reset before each generation through
    ``/proc/self/clear_refs``; where that is not allowed the process-lifetime
    ``ru_maxrss`` is reported instead (``source`` says which).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.source = "torch.cuda.max_memory_allocated"
        elif self._clear_refs():
            self.source = "VmHWM (peak RSS, reset per generation)"
        else:
            self.source = "ru_maxrss (peak RSS over the process lifetime)"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.source.startswith("VmHWM"):
            self._clear_refs()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.source.startswith("VmHWM"):
            found = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
            if found:
                return int(found.group(1)) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
