"""The CLI end to end: real subprocesses, MP4s checked by PyAV (h3serve.testing.mp4check) and Debian's ffprobe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h3serve.testing.mp4check import check_mp4

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "h3serve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def ffprobe(path: Path) -> dict:
    exe = shutil.which("ffprobe")
    assert exe, "ffprobe (Debian ffmpeg) must be installed: scripts/test.sh installs it"
    out = subprocess.run([exe, "-v", "error", "-show_streams", "-show_format", "-of", "json", str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def generated(tiny_checkpoint, tmp_path_factory):
    """Two runs of the same request (same seed) and one with another seed."""
    out = tmp_path_factory.mktemp("cli")
    paths = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        p = out / f"{name}.mp4"
        r = run_cli("generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "a kite over the sea",
                    "--seconds", "5", "--size", "320x256", "--seed", seed, "--steps", "3", "--no-progress",
                    "--json", "-o", str(p))
        assert r.returncode == 0, r.stderr
        paths[name] = (p, json.loads(r.stdout.strip().splitlines()[-1]))
    return paths


def test_cli_writes_valid_mp4(generated):
    path, info = generated["a"]
    report = check_mp4(path, expect_frames=124, fps=24, width=320, height=256, sample_rate=32000, channels=2)
    assert report.frames == 124
    probe = ffprobe(path)
    codecs = {s["codec_type"]: s for s in probe["streams"]}
    assert codecs["video"]["codec_name"] == "h264" and codecs["video"]["pix_fmt"] == "yuv420p"
    assert (int(codecs["video"]["width"]), int(codecs["video"]["height"])) == (320, 256)
    assert codecs["audio"]["codec_name"] == "aac"
    assert int(codecs["audio"]["sample_rate"]) == 32000 and int(codecs["audio"]["channels"]) == 2
    timings = info["timings"]
    for key in ("encoder_s", "dit_s", "vae_s", "t_client", "t_media", "rtf_client"):
        assert timings[key] >= 0, key
    assert abs(timings["t_media"] - 124 / 24) < 0.05


def test_same_seed_same_bytes(generated):
    a, b, c = (generated[k][0].read_bytes() for k in "abc")
    assert a == b
    assert a != c


BAD_REQUESTS = [
    (["--seconds", "3"], "seconds"),
    (["--seconds", "16"], "seconds"),
    (["--seconds", "five"], "seconds"),
    (["--size", "250x256"], "size"),
    (["--size", "256"], "size"),
    (["--size", "8192x256"], "size"),
    (["--seed", "-1"], "seed"),
    (["--steps", "1"], "steps"),
    (["--task", "i2v"], "task"),
    (["--profile", "turbo"], "profile"),
    (["--dtype", "fp8"], "dtype"),
    (["--prompt", ""], "prompt"),
    (["--task", "fl2va"], "first_image"),
    (["--profile", "fasth3", "--task", "fl2va"], "task"),
]


@pytest.mark.parametrize("extra,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_request_is_one_clean_line(tmp_path, extra, field):
    args = ["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x", "-o", str(tmp_path / "o.mp4")]
    # later flags win in argparse, so the bad value overrides the defaults above
    r = run_cli(*args, *extra, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert field in lines[0], lines[0]
    assert not (tmp_path / "o.mp4").exists()


def test_missing_checkpoint_is_clean_error(tmp_path):
    r = run_cli("generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x", "--size", "256x256",
                "-o", str(tmp_path / "o.mp4"), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "nope" in r.stderr
    assert not (tmp_path / "o.mp4").exists()
