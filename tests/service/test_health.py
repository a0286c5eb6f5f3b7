"""gRPC health checking follows a stage's life: NOT_SERVING while it loads and warms up, SERVING after, and not
serving once it drains; a stage that is stopped cancels its in-flight work after the grace period, within one
denoising step. Real servers on 127.0.0.1, in this process."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.config.stage import StageConfig
from h3serve.runtime.process import StageProcess
from h3serve.services.dit import DiTServicer


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_not_serving_until_loaded_and_warmed_up():
    from h3serve.services.muxer import MuxerServicer

    release = threading.Event()

    class SlowMuxer(MuxerServicer):
        def load(self):
            release.wait(30)
            super().load()   # the warm-up encode runs here

    proc = StageProcess(StageConfig.from_knobs(stage="muxer", port=0), servicer_factory=lambda c, h: SlowMuxer(c, h))
    loader = threading.Thread(target=proc.load)
    loader.start()
    try:
        for _ in range(3):
            assert _health(proc.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _health(proc.address, "h3serve.v1.Muxer") == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.1)
        release.set()
        loader.join(30)
        assert _health(proc.address) == health_pb2.HealthCheckResponse.SERVING
        assert _health(proc.address, "h3serve.v1.Muxer") == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        proc.shutdown(grace=1.0)


def test_stop_cancels_inflight_work_after_the_grace_period(tiny_checkpoint):
    from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc
    from h3serve.transport.grpc import iter_tensor_chunks

    cfg = StageConfig.from_knobs(stage="dit", checkpoint=str(tiny_checkpoint), threads=1, port=0, warmup=False)
    proc = StageProcess(cfg, DiTServicer)
    proc.load()
    params = dit_pb2.DiTParams(request_id="long", latent_frames=37, latent_height=16, latent_width=20,
                               audio_latents=207, seed=0, task="t2va", profile="base", steps=400)
    inputs = [dit_pb2.DiTInput(params=params),
              *[dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_states", torch.randn(1, 8, 64))],
              *[dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_tags", torch.ones(8, dtype=torch.long))],
              dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=2))]
    with grpc.insecure_channel(proc.address) as ch:
        call = dit_pb2_grpc.DiTStub(ch).Generate(iter(inputs), timeout=120)
        steps = 0
        for ev in call:
            if ev.WhichOneof("event") == "progress":
                steps = ev.progress.done
                if steps >= 2:
                    break
        t0 = time.monotonic()
        proc.shutdown(grace=0.5)
        took = time.monotonic() - t0
        with pytest.raises(grpc.RpcError):
            for _ in call:
                pass
    servicer = proc.servicer
    assert servicer.last.outcome == "cancelled", servicer.last.outcome
    assert servicer.last.units - servicer.last.units_at_signal <= 1   # stopped within one step
    assert servicer.last.units < 100
    assert took < 0.5 + 5.0
