"""What a killed test run leaves of its cluster (no `down` ran) is reclaimed by the next `Cluster.up`; a cluster with a
live process is someone's running cluster and is left alone. No cluster runs here: a dead one's remains are laid out
by hand, the way they are found after a SIGKILL."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import cluster as C  # noqa: E402

pytestmark = pytest.mark.realcluster


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture
def remains():
    """A dead cluster's network namespace, host veth (with the host's address), resolv.conf, cgroups with a pod's
    process still in them, and its folder whose supervisor is gone."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces and cgroups")
    if C.leftovers():
        pytest.skip(f"this host already holds a cluster's things: {C.leftovers()}")
    name = C.PREFIX + "dead"
    sh("ip", "netns", "add", name)
    sh("ip", "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)
    sh("ip", "addr", "add", f"{C.HOST_IP}/24", "dev", name)
    etc = pathlib.Path("/etc/netns") / name
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text(f"nameserver {C.DNS_IP}\n")
    pod = subprocess.Popen(["sleep", "600"], start_new_session=True)
    for h in C.cgroup_hierarchies():
        d = h / name / "pod"
        d.mkdir(parents=True)
        if h.name == "cpuset":
            for f in ("cpuset.cpus", "cpuset.mems"):
                for level in (d.parent, d):
                    (level / f).write_text((h / f).read_text())
        if h.name in ("memory", "pids"):
            (d / "cgroup.procs").write_text(str(pod.pid))
    run = pathlib.Path(tempfile.mkdtemp(prefix="h3serve-cluster-", dir="/tmp"))
    (run / "state.json").write_text(json.dumps({"netns": name, "veth": name, "cgroup_root": name,
                                                "supervisor": 2 ** 22 + 1, "timings": {}}))
    yield {"pod": pod, "run": run}
    pod.kill()
    pod.wait()
    C.reclaim_stale()


def test_a_dead_clusters_remains_are_reclaimed(remains):
    assert len(C.leftovers()) >= 5
    found = C.reclaim_stale()
    assert any(x.startswith("netns ") for x in found)
    assert C.leftovers() == []
    assert remains["pod"].wait(timeout=10) is not None  # the pod's process went with its cgroup
    assert not remains["run"].exists()


def test_a_live_cluster_is_left_alone(remains):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(remains["run"])])
    try:
        assert C.reclaim_stale() == []
        assert any(x.startswith("netns ") for x in C.leftovers())
        assert remains["pod"].poll() is None
    finally:
        live.kill()
        live.wait()
