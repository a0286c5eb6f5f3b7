"""Both ends of a stream over a gRPC `Control` call (h3serve.transport.control) on a loopback server, NIXL not
used (the bytes inline on the call, no agent needed): the round trip, the reason reported when this process cannot
use NIXL, the consumer's error reaching the producer, a producer that gives up, a consumer without `Control`."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch

from h3serve._proto import vae_pb2, vae_pb2_grpc
from h3serve.errors import MediaError, StageFailed, StageUnavailable
from h3serve.errortable import grpc_method
from h3serve.transport.control import LATENTS_EDGE, ControlReceiver, ControlSender, ControlUnavailable
from h3serve.transport.channel import channel_options, server_options


class Scope:
    """The part of a request scope the producer uses."""

    def remaining(self) -> float:
        return 30.0

    def check(self, where: str = "") -> None:
        pass


class Consumer(vae_pb2_grpc.VAEServicer):
    """`Control` as the VAE serves it: a ControlReceiver, the messages collected on its worker thread."""

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after
        self.got: list = []
        self.info = None
        self.error = None
        self.done = threading.Event()

    @grpc_method("vae")
    def Control(self, request_iterator, context):
        first = next(request_iterator)
        stream = ControlReceiver(LATENTS_EDGE, first.data, (m.data for m in request_iterator), context,
                                 transport="grpc", pool_buffers=2, buffer_bytes=1 << 20)

        def work():
            try:
                for msg in stream.messages():
                    self.got.append((msg.header.name, msg.tensor.clone(), msg.meta))
                    if self.fail_after is not None and len(self.got) >= self.fail_after:
                        raise MediaError("vae: the consumer refused the stream")
                self.info = stream.info
            except Exception as exc:
                self.error = exc
                raise
            finally:
                self.done.set()

        yield from stream.serve(work, lambda data: vae_pb2.LatentsControl(data=data))


@pytest.fixture
def serve():
    servers, channels = [], []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options())
        vae_pb2_grpc.add_VAEServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        servers.append(server)
        channels.append(channel)
        return vae_pb2_grpc.VAEStub(channel)

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(0)


def _sender(stub) -> ControlSender:
    return ControlSender(LATENTS_EDGE, stub.Control, vae_pb2.LatentsControl(session_id="s", transport="nixl"),
                         lambda data: vae_pb2.LatentsControl(data=data), Scope(), transport="grpc",
                         local_reason="dit: NIXL disabled here")


def test_round_trip_inline_with_the_local_reason(serve):
    consumer = Consumer()
    stub = serve(consumer)
    sent = [("video_latents", torch.randn(1, 24, 5, 4, 6)), ("audio_latents", torch.randn(2, 32, 40)),
            ("big", torch.randint(0, 256, (3 << 20,), dtype=torch.uint8))]    # several inline chunks
    with _sender(stub) as tx:
        for name, t in sent:
            tx.send(name, t, Scope(), {"name": name})
        assert tx.finish(Scope()) >= 0
    assert consumer.done.wait(10) and consumer.error is None
    assert [(n, m["name"]) for n, _, m in consumer.got] == [(n, n) for n, _ in sent]
    assert all(torch.equal(got, t) for (_, got, _), (_, t) in zip(consumer.got, sent))
    assert tx.info == {"edge": "dit->vae", "requested": "nixl", "chosen": "grpc", "reason": "dit: NIXL disabled here"}
    assert consumer.info["edge"] == "dit->vae" and consumer.info["chosen"] == "grpc"


def test_the_consumers_error_reaches_the_producer(serve):
    stub = serve(Consumer(fail_after=1))
    with pytest.raises(StageFailed, match="the consumer refused the stream") as info:
        with _sender(stub) as tx:
            tx.send("video_latents", torch.zeros(4), Scope())
            tx.send("audio_latents", torch.zeros(4), Scope())
            tx.finish(Scope())
    assert info.value.stage == "vae"


def test_a_producer_that_gives_up_fails_the_consumer_naming_it(serve):
    consumer = Consumer()
    stub = serve(consumer)
    tx = _sender(stub)
    tx.send("video_latents", torch.zeros(4), Scope())
    tx.abort()
    assert consumer.done.wait(10)
    assert isinstance(consumer.error, StageUnavailable) and consumer.error.stage == "dit", consumer.error
    assert "dit->vae" in str(consumer.error)


def test_a_consumer_without_control_is_control_unavailable(serve):
    stub = serve(vae_pb2_grpc.VAEServicer())     # every RPC UNIMPLEMENTED
    with pytest.raises(ControlUnavailable) as info:
        _sender(stub)
    assert info.value.stage == "vae"
