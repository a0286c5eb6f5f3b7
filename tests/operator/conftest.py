"""Fixtures for the operator tests: a real control plane (see kube_harness.py)."""

from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import kube_harness as _cluster  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: runs against a real kube-apiserver/etcd/KCM/scheduler + kwok started by the harness "
                   "(built once into $H3SERVE_TOOLS_CACHE by tests/operator/tools.sh)")


@pytest.fixture(scope="session")
def control_plane():
    cp = _cluster.ControlPlane.start(nodes=12, gpus_per_node=8, cpu_nodes=2)
    print(f"control plane up: {cp.timings}")
    yield cp
    cp.stop()
