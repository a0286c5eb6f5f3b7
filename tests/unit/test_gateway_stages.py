"""The gateway's view of a stage: SERVING only once the channel its requests use has connected."""

import socket
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from h3serve.config.stage import StageConfig
from h3serve.services.gateway.stages import CONNECTING, StageClients


def health_server(port: int = 0) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, servicer, port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(clients: StageClients, stage: str, value: str, timeout: float = 10.0, leave: bool = False) -> None:
    """Until the stage's status is `value` (or, with `leave`, is no longer)."""
    deadline = time.monotonic() + timeout
    while (clients.status[stage] == value) == leave:
        assert time.monotonic() < deadline, f"{stage}: {clients.status[stage]}, never {value}"
        time.sleep(0.05)


def test_a_stage_back_to_serving_is_not_ready_until_its_request_channel_connects():
    """Its health channel reaches the replica at its old address; the fresh request channel cannot reach it yet
    (on a cluster: the Service name's cached denial). Requests then would fail, so the stage is CONNECTING (not
    ready) until that channel connects, then SERVING."""
    server, servicer, port = health_server()
    later = free_port()
    address = f"127.0.0.1:{port}"
    clients = StageClients(StageConfig.from_knobs(stage="gateway", encoder=address, dit=address, vae=address,
                                                  muxer=address))
    clients.start()
    late = None
    try:
        for s in ("encoder", "dit", "vae", "muxer"):
            wait_for(clients, s, "SERVING")
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        wait_for(clients, "vae", "SERVING", leave=True)   # NOT_SERVING, or UNAVAILABLE: none left to ask
        clients.addresses["vae"] = f"127.0.0.1:{later}"   # where the renewed request channel dials: nothing yet
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        wait_for(clients, "vae", CONNECTING)
        time.sleep(1.5)
        assert clients.status["vae"] == CONNECTING and not clients.ready()
        assert clients.not_ready() == {"vae": CONNECTING}
        late, _, _ = health_server(later)
        wait_for(clients, "vae", "SERVING", timeout=30.0)   # gRPC's reconnect backoff
        assert clients.ready()
    finally:
        clients.close()
        server.stop(0)
        if late is not None:
            late.stop(0)
