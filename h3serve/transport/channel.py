"""The gRPC settings every h3serve server and channel shares (message limits, keepalive, reconnect backoff) and
the health wait. Plain grpc, no torch: the SDK (h3serve.client) imports this and nothing of the tensor transport."""

from __future__ import annotations

import time
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MiB = 1 << 20
CHUNK_BYTES = 4 * MiB                 # largest tensor payload per message
MESSAGE_LIMIT = CHUNK_BYTES + 64 * 1024   # the explicit send/receive limit of every stage server and channel

# Keepalive: a peer that vanishes without closing its socket (host down, partition) is noticed within ~15 s even
# on an idle call; a process that dies is noticed at once (the kernel closes its sockets).
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


# A client channel resolves its DNS target again only when a connection ends: a server that asks its clients to
# reconnect after this long (GOAWAY; calls in flight finish, the grace is unbounded) lets a balanced channel find
# replicas added since (a DiT scaled 1 -> 2 got no call from a gateway's old channel: found on the real cluster).
MAX_CONNECTION_AGE_MS = 30_000


def server_options(max_message: int = MESSAGE_LIMIT) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_send_message_length", int(max_message)),
        ("grpc.max_receive_message_length", int(max_message)),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        *_KEEPALIVE,
    ]


def channel_options(max_message: int = MESSAGE_LIMIT) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", int(max_message)),
        ("grpc.max_receive_message_length", int(max_message)),
        # Transparent retries only (no retry policy is configured): gRPC resends a call the server never saw, such
        # as one refused by the MAX_CONNECTION_AGE_MS GOAWAY above, so a generation never runs twice. Without them
        # a call started just as that GOAWAY arrived failed UNAVAILABLE ("GOAWAY received ... max_age").
        ("grpc.enable_retries", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        *_KEEPALIVE,
    ]


def insecure_channel(address: str, max_message: int = MESSAGE_LIMIT):
    return grpc.insecure_channel(address, options=channel_options(max_message))


# Initial metadata of every gRPC health answer of an h3serve stage: the server's pid, so that a supervisor counts a
# SERVING only from the process it started (another server on the port would otherwise answer for it).
PID_METADATA = "h3serve-pid"
# Metadata of a gateway Generate call whose caller may re-attach (Attach) after its stream drops: "1" keeps the job
# running through a dropped stream for the gateway's attach grace (without it the stream's end cancels the job).
KEEP_ON_DISCONNECT_METADATA = "h3serve-keep-on-disconnect"


def wait_serving(address: str, timeout: float, *, service: str = "", alive: Callable[[], bool] = lambda: True,
                 credentials: grpc.ChannelCredentials | None = None, pid: int | None = None) -> bool:
    """Poll gRPC health at `address` until it reports SERVING (True), `timeout` passes or `alive()` fails (False).
    With `pid`, only an answer whose `PID_METADATA` is that pid counts."""
    end = time.monotonic() + timeout
    with (grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            if not alive():
                return False
            try:
                r, call = stub.Check.with_call(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING and (
                        pid is None or dict(call.initial_metadata()).get(PID_METADATA) == str(pid)):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False
