"""A video-referenced ref2va request through the real stage servicers in this process (encoder, DiT, VAE, muxer on
127.0.0.1, relayed by a gateway here): the video and its soundtrack cross the stages as the kinds "soundtrack" then
"video", and the MP4 is the embedded pipeline's, byte for byte (the embedded pipeline's latents match diffusers:
tests/conformance/test_pipeline.py).

In process so that the reference videos' canvas rule can be scaled down for the CPU, on both sides alike (the rule
at its released values is checked against diffusers in tests/unit/test_video_reference.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from h3serve.config.request import Upload, validate_request
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import START_ORDER
from h3serve.runtime.process import StageProcess
from h3serve.services.dit import DiTServicer
from h3serve.services.encoder import EncoderServicer
from h3serve.services.gateway.gateway import Gateway
from h3serve.services.gateway.sinks import StreamSink
from h3serve.services.muxer import MuxerServicer
from h3serve.services.vae import VAEServicer
from h3serve.testing.mp4check import check_mp4

from .conftest import THREADS, embedded_request

SERVICERS = {"encoder": EncoderServicer, "dit": DiTServicer, "vae": VAEServicer, "muxer": MuxerServicer}
SMALL_CANVAS_RULE = (64, 64 * 112)
REQUEST = dict(prompt="the subject dances", seconds=5, size="320x256", seed=2, num_inference_steps=3)


@pytest.fixture
def small_canvas(monkeypatch):
    import h3serve.media.video as media_video

    monkeypatch.setattr(media_video, "CANVAS_RULE", SMALL_CANVAS_RULE)


def test_video_reference_through_the_stages_equals_embedded(tiny_checkpoint, tmp_path, small_canvas):
    import torch

    from h3serve.pipeline import Pipeline
    from h3serve.testing.clips import write_video

    rng = np.random.default_rng(8)
    t = np.arange(int(1.1 * 32000)) / 32000
    write_video(tmp_path / "dance.mp4", rng.integers(0, 255, (33, 48, 48, 3), dtype=np.uint8), 30,
                (0.3 * np.sin(2 * np.pi * 220 * t))[None])   # mono soundtrack: duplicated to stereo
    data = (tmp_path / "dance.mp4").read_bytes()

    procs = {}
    try:
        for stage in (s for s in START_ORDER if s in SERVICERS):
            cfg = StageConfig.from_knobs(stage=stage, checkpoint=str(tiny_checkpoint), threads=THREADS, port=0,
                                         warmup=False, transport="grpc", tasks="t2va,ref2va")
            procs[stage] = StageProcess(cfg, SERVICERS[stage])
            procs[stage].load()
        gw = Gateway(StageConfig.from_knobs(transport="grpc", tasks="t2va,ref2va",
                                            **{s: p.address for s, p in procs.items()}))
        gw.start()
        try:
            end = time.monotonic() + 30
            while not gw.ready():
                assert time.monotonic() < end, f"stages not ready: {gw.stages.status}"
                time.sleep(0.05)
            fields = dict(REQUEST, references=[{"kind": "video", "path": Upload(data, "references[0]", "d.mp4")}])
            job = gw.new_job(fields, kind="stream", sink_factory=lambda j: StreamSink(j.emit))
            assert job.validated.conditions.kinds == ("soundtrack", "video")
            events = []
            reader = threading.Thread(target=lambda: events.extend(job.watch(object(), lambda: True)), daemon=True)
            reader.start()
            gw.submit(job)
            assert job.done.wait(300), "the request did not finish"
            reader.join(10)
            if job.exc is not None:
                raise job.exc
        finally:
            gw.close()
    finally:
        for p in procs.values():
            p.shutdown(grace=1.0)
    mp4 = b"".join(e.mp4.data for e in events if e.WhichOneof("event") == "mp4")
    check_mp4(mp4, expect_frames=124, width=320, height=256, sample_rate=32000, channels=2)

    pipe = Pipeline.load(tiny_checkpoint, dtype="fp32", device="cpu", tasks=("ref2va",))
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        pipe.generate(validate_request(**embedded_request(**REQUEST, references=[f"video:{tmp_path / 'dance.mp4'}"])),
                      tmp_path / "embedded.mp4")
    finally:
        torch.set_num_threads(before)
    assert mp4 == (tmp_path / "embedded.mp4").read_bytes()
