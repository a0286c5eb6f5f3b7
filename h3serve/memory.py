"""Peak memory of this process over one piece of work: what a stage reports as a request's `peak_memory_mb`.

On a CUDA device: the caching allocator's peak of allocated bytes on that device (weights included), reset when the
work starts. On the CPU: the process's peak resident set (VmHWM, weights included), reset by writing "5" to
/proc/self/clear_refs (Linux). 0.0 where neither can be read.
"""

from __future__ import annotations

import torch

__all__ = ["PeakMemory"]

MIB = float(1 << 20)


def _rss_hwm_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / MIB   # kB
    except OSError:
        pass
    return 0.0


class PeakMemory:
    """`with PeakMemory(device) as peak: work()` then `peak.mb`: MiB at the peak of the work (0.0: unknown)."""

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device or "cpu")
        self.mb = 0.0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")   # the peak RSS restarts from the current RSS
            except OSError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.mb = torch.cuda.max_memory_allocated(self.device) / MIB
        else:
            self.mb = _rss_hwm_mb()
