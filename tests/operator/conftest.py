"""Fixtures for the operator tests: a real control plane (see cluster.py) and the operator as a process."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cluster as _cluster  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: runs against a real kube-apiserver/etcd/KCM/scheduler + kwok started by the harness "
                   "(built once into $H3SERVE_TOOLS_CACHE by tests/operator/tools.sh)")


@pytest.fixture(scope="session")
def control_plane():
    cp = _cluster.ControlPlane.start(nodes=12, gpus_per_node=8, cpu_nodes=1)
    print(f"control plane up: {cp.timings}")
    yield cp
    cp.stop()


def wait_for(what: str, fn, timeout: float = 60.0, interval: float = 0.5):
    """Poll fn() until it returns something truthy; fail with the last value/error after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
            last = v
        except Exception as e:  # noqa: BLE001
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


class Operator:
    """`python -m h3serve.operator.cli operator` as a child process, with the credentials it is given."""

    def __init__(self, kubeconfig: pathlib.Path, namespaces: list[str], log: pathlib.Path, env: dict):
        self.kubeconfig, self.namespaces, self.log, self.env = kubeconfig, namespaces, log, env
        self.proc: subprocess.Popen | None = None
        self.port = _cluster.free_port()

    def start(self) -> "Operator":
        args = [sys.executable, "-m", "h3serve.operator.cli", "operator",
                *[f"--namespace={n}" for n in self.namespaces], f"--liveness=http://127.0.0.1:{self.port}/healthz"]
        env = {**self.env, "KUBECONFIG": str(self.kubeconfig), "H3SERVE_RESYNC_SECONDS": "20",
               "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        wait_for("operator liveness", self.alive, timeout=60)
        return self

    def alive(self) -> bool:
        import urllib.request

        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"operator exited: {self.tail()}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
            return r.status == 200

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def load_example(name: str, namespace: str) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    return doc
