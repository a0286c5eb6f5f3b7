"""bench/n_outputs.py on the CPU: one JSON line comparing n forwards of one with one forward of n."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_n_outputs_bench_cpu_smoke():
    cmd = [sys.executable, str(REPO / "bench" / "n_outputs.py"), "--n", "2", "--height", "64", "--width", "64",
           "--iters", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # 32 text rows + 37 latent frames x 2 x 2 patches + 2 audio channels x round(124 / 24 * 40) latents
    assert (report["n"], report["seq_len"], report["geometry"]) == (2, 32 + 37 * 2 * 2 + 2 * 207, "124x64x64")
    assert report["singles_ms"] > 0 and report["batched_ms"] > 0 and report["max_abs_dev"] >= 0.0
    assert abs(report["batch_gain"] - report["singles_ms"] / report["batched_ms"]) < 0.01   # of the rounded times
