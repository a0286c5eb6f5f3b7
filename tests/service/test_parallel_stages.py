"""Stage servers with parallel degrees (`h3serve serve --ulysses 2 --vae-pp 2`): the DiT and the VAE each run as a
world of two ranks, rank 0 serving gRPC. Over gRPC they write the MP4 bytes of all degrees 1; a DiT peer rank that
dies fails the request in flight with UNAVAILABLE naming the DiT, the stage turns NOT_SERVING, exits, and the
launcher restarts it (both ranks) so that the next request is served."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.client import Client
from h3serve.testing.faults import kill_mid_request, wait_replaced

from .conftest import REQUEST, Stack


@pytest.fixture(scope="module")
def pstack(tiny_checkpoint):
    s = Stack(tiny_checkpoint, "--ulysses", "2", "--vae-pp", "2", "--queue-size", "1", "--grace-s", "10")
    yield s
    assert s.stop() == 0


def _info(stack, stage: str) -> dict:
    return json.loads(stack.status(stage).info_json)


def _health(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return None


def test_ulysses2_vae_pp2_services_write_the_bytes_of_degree_1(pstack, embedded):
    for stage in ("dit", "vae"):
        info = _info(pstack, stage)
        assert info["ranks"] == 2 and info["ranks_healthy"] and len(info["rank_pids"]) == 2, info
    assert "ranks" not in _info(pstack, "encoder")   # encoder TP 1: no world
    with Client(pstack.grpc, timeout=120) as client:
        result = client.generate(**REQUEST)
    assert result.mp4 == embedded(**REQUEST)


def test_a_dead_dit_rank_fails_the_request_unavailable_naming_the_dit(pstack, embedded):
    info = _info(pstack, "dit")
    leader, peer = info["rank_pids"]
    with Client(pstack.grpc, timeout=120) as client:
        err, killed_at = kill_mid_request(client, dict(REQUEST, num_inference_steps=60), "dit", peer)
    assert time.monotonic() - killed_at < 10.0
    assert err.stage == "dit" and "rank 1 of 2" in str(err), str(err)
    # NOT_SERVING at once (then the process exits and the launcher starts a new world)
    status = _health(pstack.addresses["dit"])
    assert status != health_pb2.HealthCheckResponse.SERVING
    wait_replaced(lambda: pstack.status("dit"), leader, timeout_s=90)
    info = _info(pstack, "dit")
    assert info["ranks_healthy"] and peer not in info["rank_pids"] and leader not in info["rank_pids"]
    pstack.wait_ready()
    with Client(pstack.grpc, timeout=120) as client:
        assert client.generate(**REQUEST).mp4 == embedded(**REQUEST)
