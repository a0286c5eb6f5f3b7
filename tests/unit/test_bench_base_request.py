"""bench/base_request.py on the tiny checkpoint (CPU, fp32): ours' whole base request with levers, diffusers' DiT
forward at the same geometry, and the levers' deviation from a run without them in the same --out.

The script runs as a subprocess, as the GPU runner runs it, and must print one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "base_request.py"
COMMON = ("--size", "256x256", "--seconds", "5", "--steps", "3", "--device", "cpu", "--dtype", "fp32")


def _run(checkpoint, out: Path, *extra: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), *COMMON, "--out", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) <= 1, f"stdout must be at most one JSON line:\n{proc.stdout[-2000:]}"
    return proc.returncode, (json.loads(lines[0]) if lines else {}), proc.stderr


def test_levers_against_a_plain_run_and_diffusers_forward(tiny_checkpoint, tmp_path):
    rc, plain, err = _run(tiny_checkpoint, tmp_path, "--tag", "plain", "--skip-diffusers")
    assert rc == 0, err[-4000:]
    assert plain["ours"]["levers"] == [] and "diffusers" not in plain

    rc, report, err = _run(tiny_checkpoint, tmp_path, "--tag", "levers", "--fp8", "on", "--adaln-table", "on",
                           "--quality", "high", "--diffusers-iters", "1")
    assert rc == 0, err[-4000:]
    ours, theirs = report["ours"], report["diffusers"]
    assert set(ours["levers"]) == {"fp8", "adaln_table"} and ours["quality"] == "high"
    assert report["forwards"] == ours["forwards"] == theirs["forwards"] == 2
    assert 1 <= ours["forwards_computed"] <= 2
    assert ours["t_client"] > ours["stages"]["dit_s"] > 0
    # the packed length diffusers ran is the request's: text rows from ours' tokenizer + 37 x 8 x 8 video patches
    # (124 frames at 256x256) + audio rows
    assert theirs["seq_len"] > 2368 + ours["text_tokens"] > 2368
    assert theirs["request_s_lower_bound"] == theirs["forwards"] * theirs["forward_s"] > 0
    assert report["speedup_vs_diffusers"] == theirs["request_s_lower_bound"] / ours["t_client"]
    assert report["meets_target"] == (report["speedup_vs_diffusers"] >= report["target"] == 6.0)
    # FP8 moves the latents a little, and the pair is found by the run key
    pair = report["latents_pairs"]["ours-levers vs ours-plain"]
    assert 0 < pair["video"]["rel_l2"] < 0.05 and 0 < pair["audio"]["rel_l2"] < 0.05
    saved = torch.load(tmp_path / "ours-levers_latents.pt")
    assert saved["video"].shape[1] == 24 and torch.isfinite(saved["video"]).all()


@pytest.mark.parametrize("flag, value, says", [("--steps", "1", "--steps 1: at least 2"),
                                               ("--seconds", "1", "seconds='1' is invalid")])
def test_bad_input_is_a_clear_error_and_runs_nothing(tiny_checkpoint, tmp_path, flag, value, says):
    rc, report, err = _run(tiny_checkpoint, tmp_path, flag, value)
    assert rc != 0 and report == {} and says in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
