"""The gateway's pieces in this process, no subprocesses.

* fields: a gRPC GenerateRequest and a videos-API body (JSON, or form strings) map onto the same validated request;
  a bad field is refused naming the field as the caller spelled it;
* plans: `relay` and `direct` run against the real stage servicers (tiny checkpoint) on 127.0.0.1; each gives a
  valid MP4 and the progress events of the API, and both give the same bytes for the same request and seed. The
  direct plan needs NIXL; it is skipped, with the reason, only where NIXL cannot load.
"""

from __future__ import annotations

import threading
import time

import pytest

from h3serve._proto import gateway_pb2
from h3serve.config.request import validate_request
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import START_ORDER
from h3serve.errors import RequestError
from h3serve.runtime.process import StageProcess
from h3serve.services.dit import DiTServicer
from h3serve.services.encoder import EncoderServicer
from h3serve.services.gateway.fields import (
    check_request_id,
    fields_from_http,
    fields_from_proto,
    served_models,
    validate_fields,
)
from h3serve.services.gateway.gateway import Gateway
from h3serve.services.gateway.orchestrate import DIRECT, RELAY, choose_plan
from h3serve.services.gateway.sinks import StreamSink
from h3serve.services.muxer import MuxerServicer
from h3serve.services.vae import VAEServicer
from h3serve.testing.mp4check import check_mp4
from h3serve.transport.nixl.probe import nixl_available

from .conftest import REQUEST, THREADS, embedded_request

CONFIG = StageConfig()   # profile base, fp32: the deployment the fields are validated for
SERVICERS = {"encoder": EncoderServicer, "dit": DiTServicer, "vae": VAEServicer, "muxer": MuxerServicer}


def _request(**fields):
    return validate_request(**embedded_request(**fields))


# ---------------------------------------------------------------------------------------------------------------
# Field mapping

def test_proto_fields_map_to_the_validated_request():
    msg = gateway_pb2.GenerateRequest(**REQUEST)
    fields = fields_from_proto(msg)
    assert fields == REQUEST                    # unset optional fields are left out
    v = validate_fields(fields, config=CONFIG)
    assert v.request == _request(**REQUEST)
    assert v.model == served_models(CONFIG)[0] == "MiniMax-H3"


def test_http_json_and_form_fields_map_to_the_same_request_as_proto():
    want = validate_fields(fields_from_proto(gateway_pb2.GenerateRequest(**REQUEST)), config=CONFIG).request
    body = dict(REQUEST, model="MiniMax-H3", quality="lossless", negative_prompt="")
    fields, names = fields_from_http(body)
    assert names == {}
    assert validate_fields(fields, config=CONFIG, names=names).request == want
    # a form sends strings, extra_params as JSON text; task and duration may come through extra_params
    seconds = REQUEST["seconds"]
    form = {k: str(v) for k, v in REQUEST.items() if k != "seconds"}
    form["extra_params"] = f'{{"task": "t2va", "duration": {seconds}}}'
    fields, names = fields_from_http(form)
    assert names == {"task": "extra_params.task", "seconds": "extra_params.duration"}
    assert validate_fields(fields, config=CONFIG, names=names).request == want


@pytest.mark.parametrize("fields, field", [
    ({"num_inference_steps": 1}, "num_inference_steps"),
    ({"seconds": 99}, "seconds"),
    ({"size": "300x256"}, "size"),
    ({"fps": 30}, "fps"),
    ({"seed": -1}, "seed"),
    ({"task": "fl2va"}, "first_image"),        # fl2va is served; its keyframe is missing
    ({"model": "another-model"}, "model"),
    ({"quality": "fast"}, "quality"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_proto_fields_are_refused_naming_the_field(fields, field):
    msg = gateway_pb2.GenerateRequest(**dict(REQUEST, **fields))
    with pytest.raises(RequestError) as info:
        validate_fields(fields_from_proto(msg), config=CONFIG)
    assert info.value.field == field, info.value


@pytest.mark.parametrize("body, field", [
    ({"num_inference_steps": 1}, "num_inference_steps"),
    ({"num_inference_steps": "many"}, "num_inference_steps"),
    ({"seconds": True}, "seconds"),
    ({"prompt": 5}, "prompt"),
    ({"size": [320, 256]}, "size"),
    ({"extra_params": {"duration": 99}, "seconds": None}, "extra_params.duration"),
    ({"extra_params": {"duration": 5}}, "extra_params.duration"),       # with seconds: not both
    ({"extra_params": {"task": "ref2va"}}, "extra_params.task"),   # not in the default --tasks
    ({"extra_params": {"task": "video"}}, "extra_params.task"),
    ({"extra_params": {"audio_flow_shift": 6}}, "extra_params.audio_flow_shift"),   # not the checkpoint's 3
    ({"extra_params": {"colour": "red"}}, "extra_params.colour"),
    ({"extra_params": "{not json"}, "extra_params"),
    ({"negative_prompt": "blurry"}, "negative_prompt"),
    ({"guidance_scale": 5}, "guidance_scale"),
    ({"resolution": "720p"}, "resolution"),
    ({"model": "another-model"}, "model"),
])
def test_bad_http_fields_are_refused_naming_the_field(body, field):
    with pytest.raises(RequestError) as info:
        fields, names = fields_from_http(dict(REQUEST, **body))
        validate_fields(fields, config=CONFIG, names=names, http=True)
    assert info.value.field == field, info.value


def test_a_body_that_is_not_an_object_and_a_bad_request_id_are_refused():
    with pytest.raises(RequestError) as info:
        fields_from_http(["a kite"])
    assert info.value.field == "body"
    with pytest.raises(RequestError) as info:
        validate_fields({"seconds": 5}, config=CONFIG)
    assert info.value.field == "prompt"
    check_request_id("job-1.a_b")
    with pytest.raises(RequestError) as info:
        check_request_id("no spaces")
    assert info.value.field == "request_id"


def test_the_deployment_profile_and_model_name_decide_the_accepted_models():
    fast = StageConfig.from_knobs(profile="fasth3", model_name="acme-video")
    assert served_models(fast) == ("acme-video", "FastH3", "fasth3")
    v = validate_fields({"prompt": "a kite", "model": "fasth3", "seed": 0}, config=fast)
    assert (v.model, v.request.profile, v.request.steps) == ("acme-video", "fasth3", 5)
    with pytest.raises(RequestError) as info:   # fasth3 runs a fixed grid
        validate_fields({"prompt": "a kite", "num_inference_steps": 4}, config=fast)
    assert info.value.field == "num_inference_steps"


# ---------------------------------------------------------------------------------------------------------------
# Plans over real in-process stages

@pytest.fixture(scope="module")
def stages(tiny_checkpoint):
    """The four stages' real servicers, each on its own gRPC server here, NIXL requested on every edge (a stage
    falls back to gRPC where it cannot load NIXL)."""
    procs = {}
    try:
        for stage in (s for s in START_ORDER if s in SERVICERS):
            cfg = StageConfig.from_knobs(stage=stage, checkpoint=str(tiny_checkpoint), threads=THREADS, port=0,
                              warmup=False, transport="nixl")
            procs[stage] = StageProcess(cfg, SERVICERS[stage])
            procs[stage].load()
        yield {s: p.address for s, p in procs.items()}
    finally:
        for p in procs.values():
            p.shutdown(grace=1.0)


def _generate(addresses: dict, transport: str) -> tuple[bytes, list, Gateway]:
    """The canonical request through a gateway whose --transport is `transport`: (MP4, progress events, gateway)."""
    gw = Gateway(StageConfig.from_knobs(transport=transport, **addresses))
    gw.start()
    try:
        end = time.monotonic() + 30
        while not gw.ready():
            assert time.monotonic() < end, f"stages not ready: {gw.stages.status}"
            time.sleep(0.05)
        job = gw.new_job(dict(REQUEST), kind="stream", sink_factory=lambda j: StreamSink(j.emit))
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
    mp4 = b"".join(e.mp4.data for e in events if e.WhichOneof("event") == "mp4")
    progress = [e.progress for e in events if e.WhichOneof("event") == "progress"]
    assert job.mp4_bytes == len(mp4) and job.status == "completed"
    return mp4, progress, gw


def _relayed(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("h3serve_gateway_latents_bytes_total")


def _check_progress(progress) -> None:
    stages = [p.stage for p in progress]
    steps = REQUEST["num_inference_steps"] - 1
    assert stages[:1 + steps] == ["encoder"] + ["dit"] * steps and set(stages[1 + steps:]) == {"vae"}, stages
    percents = [p.percent for p in progress]
    assert percents == sorted(percents) and 0 < percents[0] and percents[-1] < 100, percents


@pytest.fixture(scope="module")
def relay_run(stages):
    assert choose_plan("grpc") is RELAY
    return _generate(stages, "grpc")


def test_relay_plan_gives_a_valid_mp4_and_carries_the_latents(relay_run):
    mp4, progress, gw = relay_run
    req = _request(**REQUEST)
    check_mp4(mp4, expect_frames=req.num_frames, width=req.width, height=req.height)
    _check_progress(progress)
    assert _relayed(gw) > 0        # DiT -> gateway -> VAE
    assert gw.transports.details()["dit->vae"]["chosen"] == "grpc"


def test_direct_plan_gives_the_same_mp4_and_relays_no_latents(stages, relay_run):
    ok, reason = nixl_available()
    if not ok:
        pytest.skip(f"the direct plan needs NIXL: {reason}")
    assert choose_plan("nixl") is DIRECT
    mp4, progress, gw = _generate(stages, "nixl")
    want, want_progress, _ = relay_run
    check_mp4(mp4, expect_frames=_request(**REQUEST).num_frames)
    assert mp4 == want
    assert [(p.stage, p.done, p.total) for p in progress] == [(p.stage, p.done, p.total) for p in want_progress]
    assert _relayed(gw) == 0       # DiT -> VAE directly
    edges = gw.transports.details()
    assert edges["dit->vae"]["chosen"] == "nixl" and edges["vae->muxer"]["chosen"] == "nixl", edges
