"""This process's device: the one a stage runs on and its dtype by name (`pick_device`, `TORCH_DTYPES`), and the peak
memory over one piece of work (`PeakMemory`: what a stage reports as a request's `peak_memory_mb`).

On a CUDA device: the caching allocator's peak of allocated bytes on that device (weights included), reset when the
work starts. On the CPU: the process's peak resident set (VmHWM, weights included), reset by writing "5" to
/proc/self/clear_refs (Linux). 0.0 where neither can be read. `process_memory`: the same numbers over the process's
whole life, for benchmarks.
"""

from __future__ import annotations

import resource

import torch

from h3serve.config.vocab import TORCH_DTYPE_NAMES
from h3serve.errors import H3Error

__all__ = ["TORCH_DTYPES", "pick_device", "check_ranks_fit", "PeakMemory", "process_memory"]

MIB = float(1 << 20)
TORCH_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in TORCH_DTYPE_NAMES.items()}


def pick_device(device: str | None) -> torch.device:
    """The device asked for (refused if it is CUDA and there is none), else CUDA when present, else the CPU."""
    if device:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise H3Error(f"device={device!r} requested but no CUDA device is available; use --device cpu")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_ranks_fit(degrees, device: str | None, stages=("encoder", "dit", "vae")) -> None:
    """Before any rank starts: on CUDA each rank of a stage needs its own visible device (`check_devices`)."""
    if pick_device(device).type == "cuda":
        degrees.check_devices(torch.cuda.device_count(), stages)


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


def process_memory(device: torch.device | str) -> dict:
    """This process's memory over its whole life, read-only (nothing is reset): the CUDA caching allocator's peaks
    on `device` (None on the CPU), the device's used bytes now (all processes), and the process's peak RSS."""
    device = torch.device(device)
    stats = {"device": str(device), "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             "max_allocated_bytes": None, "max_reserved_bytes": None, "device_used_bytes": None,
             "device_total_bytes": None}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        stats.update(max_allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
                     max_reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
                     device_used_bytes=int(total - free), device_total_bytes=int(total))
    return stats
