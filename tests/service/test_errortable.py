"""One error table: each domain error crosses gRPC (status code + trailing metadata) and comes back as the same
typed error with its field or stage; HTTP statuses follow the same table."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from h3serve._proto import gateway_pb2, gateway_pb2_grpc
from h3serve.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    Draining,
    MediaError,
    NotFound,
    QueueFull,
    RequestError,
    StageFailed,
    StageUnavailable,
    TooLarge,
    TransportError,
)
from h3serve.errortable import from_grpc, grpc_method, http_error

CASES = [
    (AlreadyExists("request_id", "job-1"), grpc.StatusCode.ALREADY_EXISTS, 409, AlreadyExists, "request_id", None),
    (RequestError("seconds", 3, "4..15"), grpc.StatusCode.INVALID_ARGUMENT, 400, RequestError, "seconds", None),
    (QueueFull("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, QueueFull, None, None),
    (TooLarge("big"), grpc.StatusCode.RESOURCE_EXHAUSTED, 413, TooLarge, None, None),
    (Draining("bye"), grpc.StatusCode.UNAVAILABLE, 503, Draining, None, None),
    (StageUnavailable("vae", "died"), grpc.StatusCode.UNAVAILABLE, 503, StageUnavailable, None, "vae"),
    (TransportError("broke", edge="vae->muxer"), grpc.StatusCode.UNAVAILABLE, 503, StageUnavailable, None, "muxer"),
    (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, DeadlineExceeded, None, None),
    (Cancelled("cancelled by id"), grpc.StatusCode.CANCELLED, 499, Cancelled, None, None),
    (NotFound("who"), grpc.StatusCode.NOT_FOUND, 404, NotFound, None, None),
    (StageFailed("dit", "nan"), grpc.StatusCode.INTERNAL, 500, StageFailed, None, "dit"),
    (MediaError("no audio"), grpc.StatusCode.INTERNAL, 500, StageFailed, None, None),
    (ZeroDivisionError("x"), grpc.StatusCode.INTERNAL, 500, StageFailed, None, None),
]


class Raiser(gateway_pb2_grpc.GatewayServicer):
    def __init__(self):
        self.exc = None

    @grpc_method("gateway")
    def Cancel(self, request, context):
        raise self.exc

    @grpc_method("gateway")
    def Generate(self, request, context):
        yield gateway_pb2.GenerateEvent(accepted=gateway_pb2.Accepted(request_id="r"))
        raise self.exc


@pytest.fixture(scope="module")
def server():
    servicer = Raiser()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    srv.stop(0)


@pytest.mark.parametrize("exc,code,http,cls,field,stage", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_round_trip(server, exc, code, http, cls, field, stage):
    servicer, stub = server
    servicer.exc = exc
    for call in (lambda: stub.Cancel(gateway_pb2.CancelRequest(), timeout=5),
                 lambda: list(stub.Generate(gateway_pb2.GenerateRequest(), timeout=5))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code
        back = from_grpc(info.value, stage="gateway")
        assert isinstance(back, cls), (back, cls)
        if field:
            assert back.field == field and field in str(back)
        if stage:
            assert back.stage == stage and stage in str(back)
    status, body = http_error(exc)
    assert status == http
    assert body["error"]["field"] == field


def test_client_side_cancel_is_cancelled_whatever_the_code(server):
    servicer, stub = server
    servicer.exc = StageUnavailable("vae")
    with pytest.raises(grpc.RpcError) as info:
        stub.Cancel(gateway_pb2.CancelRequest(), timeout=5)
    assert isinstance(from_grpc(info.value, cancelled=True), Cancelled)


def test_unreachable_server_is_unavailable_naming_it():
    with grpc.insecure_channel("127.0.0.1:1") as ch:
        with pytest.raises(grpc.RpcError) as info:
            gateway_pb2_grpc.GatewayStub(ch).Cancel(gateway_pb2.CancelRequest(), timeout=2)
    err = from_grpc(info.value, stage="encoder")
    assert isinstance(err, StageUnavailable) and err.stage == "encoder"
