"""The pods' exec probe (h3serve/runtime/probe.py), run as the rendered pod runs it, against a real gRPC health
server in another process: plaintext and mTLS, SERVING, NOT_SERVING (draining) and hung (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from h3serve.config.spec import parse_and_validate
from h3serve.config.stage import TLS_DIR
from h3serve.operator import manifests as M

from tests.service.certs import make_ca, make_leaf

SERVER = r"""
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
status, cert, key, ca = sys.argv[1], *(sys.argv[2:5] if len(sys.argv) > 2 else (None, None, None))
server = grpc.server(futures.ThreadPoolExecutor(2))
h = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(h, server)
h.set("", getattr(health_pb2.HealthCheckResponse, status))
if cert:
    creds = grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())],
                                        root_certificates=open(ca, "rb").read(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
else:
    port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
time.sleep(600)
"""


@pytest.fixture()
def serve():
    procs = []

    def start(status: str, *tls: str) -> tuple[subprocess.Popen, int]:
        p = subprocess.Popen([sys.executable, "-c", SERVER, status, *tls], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return p, int(p.stdout.readline())

    yield start
    for p in procs:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()


def rendered(tls: bool) -> dict[str, list[str]]:
    """probe kind -> the exec command of the rendered DiT pod (TLS: the mounted files)."""
    from pathlib import Path

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "base-disaggregated.yaml").read_text())
    if not tls:
        del doc["spec"]["tls"]
    objs = M.render(parse_and_validate(doc["spec"], "h3"), "h3", "ns")
    dit = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "h3-dit")
    c = dit["spec"]["template"]["spec"]["containers"][0]
    return {k: c[k]["exec"]["command"] for k in ("startupProbe", "readinessProbe", "livenessProbe") if "exec" in c[k]}


def run(cmd: list[str], port: int, files: dict[str, str] | None = None) -> tuple[int, str, float]:
    argv = [sys.executable, *cmd[1:]]
    argv[argv.index("--port") + 1] = str(port)
    argv = [files.get(a, a) if files else a for a in argv]
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout.strip() + r.stderr.strip(), time.monotonic() - t


def test_liveness_passes_a_draining_server_and_fails_a_hung_one(serve):
    cmds = rendered(tls=False)
    assert set(cmds) == {"livenessProbe"}  # plaintext: startup and readiness are the kubelet's gRPC probe
    live = cmds["livenessProbe"]
    p, serving = serve("SERVING")
    assert run(live, serving)[0] == 0
    _, draining = serve("NOT_SERVING")  # draining: alive
    rc, out, _ = run(live, draining)
    assert rc == 0 and "NOT_SERVING" in out
    os.kill(p.pid, signal.SIGSTOP)  # hung: the port still accepts connections, health never answers
    rc, out, took = run(live, serving)
    assert rc == 1 and "no health answer" in out and took < 15, (out, took)  # inside the rendered timeoutSeconds
    print(f"FIGURES probe: hung server failed after {took:.2f}s")


def test_tls_probes_present_the_pods_certificate(serve, tmp_path):
    ca_key, ca_cert, ca = make_ca(tmp_path / "ca")
    crt, key = make_leaf(tmp_path / "pod", ca_key, ca_cert)
    files = {f"{TLS_DIR}/tls.crt": str(crt), f"{TLS_DIR}/tls.key": str(key), f"{TLS_DIR}/ca.crt": str(ca)}
    cmds = rendered(tls=True)
    assert set(cmds) == {"startupProbe", "readinessProbe", "livenessProbe"}
    _, port = serve("SERVING", str(crt), str(key), str(ca))
    for kind, cmd in cmds.items():
        assert "--server-name" in cmd
        # the test certificate names localhost / 127.0.0.1, not the Service: check it by its loopback name
        cmd = [*cmd[:cmd.index("--server-name")], "--server-name", "localhost"]
        rc, out, _ = run(cmd, port, files)
        assert rc == 0, (kind, out)
    _, port = serve("NOT_SERVING", str(crt), str(key), str(ca))
    ready = [*cmds["readinessProbe"][:cmds["readinessProbe"].index("--server-name")], "--server-name", "localhost"]
    rc, out, _ = run(ready, port, files)
    assert rc == 1 and "NOT_SERVING" in out
    # the kubelet's plaintext gRPC probe could not pass here: the server refuses a plaintext client
    rc, out, _ = run([*M.PROBE, "--port", "0"], port)
    assert rc == 1
