"""A stage world joined the way the operator's gang StatefulSets start it (NNODES=2, one rank per pod, RANK /
WORLD_SIZE / MASTER_ADDR from the environment): rank 0 serves the stage; the follower serves gRPC health only, so the
kubelet's probes of a follower pod pass once its part is in the world, and it leaves when rank 0 goes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve._proto import common_pb2, vae_pb2_grpc
from h3serve.distributed.world import free_port
from h3serve.errors import H3Error
from h3serve.runtime.ranks import FollowerHealth

from .conftest import REPO, THREADS

SERVING = health_pb2.HealthCheckResponse.SERVING


def _health(address: str, service: str = "") -> int | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=2).status
    except grpc.RpcError:
        return None


def _pod(checkpoint, rank: int, port: int, master_port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "h3serve.cli", "--log-level", "WARNING", "serve", "--stages", "vae",
            "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), "--threads", str(THREADS),
            "--device", "cpu", "--ulysses", "2", "--vae-pp", "2", "--no-warmup"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), WORLD_SIZE="2", NNODES="2",
               NPROC_PER_NODE="1", NODE_RANK=str(rank), RANK=str(rank))
    env.pop("LOCAL_RANK", None)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env, cwd=REPO)


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_follower_pod_answers_health_and_leaves_with_rank0(tiny_checkpoint):
    ports = [free_port(), free_port()]
    master = free_port()
    follower = _pod(tiny_checkpoint, 1, ports[1], master)
    leader = _pod(tiny_checkpoint, 0, ports[0], master)
    try:
        addr0, addr1 = (f"127.0.0.1:{p}" for p in ports)
        assert _wait(lambda: _health(addr0) == SERVING, 180), "rank 0 never served"
        assert _wait(lambda: _health(addr1) == SERVING, 30), "the follower's health never turned SERVING"
        # health only: the stage's own service is not served on the follower
        with grpc.insecure_channel(addr1) as ch:
            try:
                vae_pb2_grpc.VAEStub(ch).Status(common_pb2.StatusRequest(), timeout=5)
                raise AssertionError("the follower answered VAE.Status")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) == 0        # the shutdown reached it through the world
        assert _health(addr1) is None                 # and its health port is closed
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_follower_health_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(H3Error, match=rf"--port {port}: cannot bind 127.0.0.1:{port}"):
            FollowerHealth("127.0.0.1", port)
