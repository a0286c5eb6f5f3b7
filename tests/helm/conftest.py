"""The chart tests use the real `helm` binary, built from the Go module proxy by tests/operator/tools.sh."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tests" / "operator" / "tools.sh"


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    r = subprocess.run(["bash", str(TOOLS), "helm"], capture_output=True, text=True)
    assert r.returncode == 0, f"building helm failed:\n{r.stderr[-4000:]}"
    exe = pathlib.Path(r.stdout.strip().splitlines()[-1]) / "helm"
    home = tmp_path_factory.mktemp("helm")
    env = {"HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data"), "HOME": str(home), "PATH": "/usr/bin:/bin"}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env)
        if check:
            assert p.returncode == 0, f"helm {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
        return p
    return run
