"""Fixtures for the tests on a real node: the project's image, built by scripts/image.sh (cached by content hash)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "realcluster: runs real containers on this machine (root, runc; the image from scripts/image.sh, "
                   "cached in $H3SERVE_TOOLS_CACHE/image)")


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: mmdebstrap, umoci and runc run as root here")


@pytest.fixture(scope="session")
def image() -> dict:
    """{"image", "archive", "pause", "pause_archive"}: the last stdout line of scripts/image.sh."""
    need_root()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, timeout=3600)
    if run.returncode != 0:
        pytest.fail(f"scripts/image.sh failed ({run.returncode}):\n{run.stderr[-6000:]}")
    print(run.stderr.strip().splitlines()[-1])
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def runc() -> str:
    need_root()
    path = shutil.which("runc")
    if path is None:
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "runc"], check=True,
                       stdout=subprocess.DEVNULL, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        path = shutil.which("runc")
    return path
