"""Two encoder replicas behind one gateway address (`ipv4:A,B`, as a headless Service resolves): calls are spread
over both per request, and a replica that drains (NOT_SERVING) stops receiving calls while the other serves on."""

from __future__ import annotations

import grpc

from h3serve._proto import common_pb2, encoder_pb2_grpc
from h3serve.client import Client

from .conftest import REQUEST, Stack
from .conftest import LoneStage


def _requests(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return encoder_pb2_grpc.EncoderStub(ch).Status(common_pb2.StatusRequest(), timeout=5).requests_total


def test_two_encoder_replicas_both_serve_and_a_draining_one_is_skipped(tiny_checkpoint):
    a = LoneStage("encoder", "--checkpoint", str(tiny_checkpoint), "--grace-s", "30", env={})
    b = LoneStage("encoder", "--checkpoint", str(tiny_checkpoint), env={})
    s = None
    try:
        target = f"ipv4:{a.address},{b.address}"
        s = Stack(tiny_checkpoint, "--stages", "dit,vae,muxer,gateway", "--encoder", target,
                  "--queue-size", "4")
        s.wait_ready()
        with Client(s.grpc, timeout=120) as client:
            # validation-free calls of the encoder alone would not show the gateway's balancing: run requests
            for i in range(4):
                client.generate_sync(**dict(REQUEST, prompt=f"replica request {i}"))
            counts = (_requests(a.address), _requests(b.address))
            assert counts[0] >= 1 and counts[1] >= 1 and sum(counts) == 4, counts
            # replica a drains: NOT_SERVING for its grace period, still accepting connections
            a.proc.send_signal(__import__("signal").SIGTERM)
            import time

            time.sleep(1.5)   # the gateway's health watch sees NOT_SERVING
            for i in range(3):
                client.generate_sync(**dict(REQUEST, prompt=f"after the drain {i}"))
            assert _requests(b.address) == counts[1] + 3
    finally:
        if s is not None:
            assert s.stop() == 0
        a.stop()
        b.stop()
