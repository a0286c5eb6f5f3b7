"""h3serve.runtime.device.PeakMemory on the CPU: the process's peak RSS over a piece of work, reset at its start."""

from __future__ import annotations

import torch

from h3serve.runtime.device import PeakMemory, _rss_hwm_mb


def test_peak_covers_the_work_and_restarts_for_the_next():
    with PeakMemory("cpu") as big:
        x = torch.ones(64 << 20, dtype=torch.float32)   # 256 MiB, every page touched
        del x
    with PeakMemory("cpu") as small:
        y = torch.ones(1 << 20)
        del y
    assert big.mb >= 256, big.mb
    assert small.mb <= big.mb - 200, (small.mb, big.mb)   # the 256 MiB of the first work is not counted again
    assert 0 < _rss_hwm_mb()
