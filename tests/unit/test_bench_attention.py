"""bench/attention.py on the CPU: one JSON line, each kernel once, a kernel that cannot run reported, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_attention_bench_cpu_smoke():
    cmd = [sys.executable, str(REPO / "bench" / "attention.py"), "--device", "cpu", "--seq", "96", "--heads", "2",
           "--head-dim", "32", "--kernels", "sdpa,cudnn,sdpa", "--iters", "2", "--warmup", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["shape_bnhd"] == [1, 96, 2, 32] and report["flop"] == 4 * 96 ** 2 * 2 * 32
    assert list(report["kernels"]) == ["sdpa", "cudnn"]  # the repeated name runs once
    assert report["kernels"]["sdpa"]["reference"] and len(report["kernels"]["sdpa"]["ms_runs"]) == 2
    assert "needs a CUDA device" in report["kernels"]["cudnn"]["error"]
