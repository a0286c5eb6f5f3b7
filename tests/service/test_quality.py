"""`quality` through the served stack: a quality=high request (step reuse) over gRPC and HTTP gives the embedded
pipeline's quality=high MP4 for the same seed and reports fewer DiT forwards computed than lossless, which reports
all of them; FastH3 refuses high with the one lever message; unknown values are refused naming the field and the
allowed values, at the gateway and at the DiT stage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from h3serve.client import Client
from h3serve.config.levers import LEVERS_MESSAGE, REQUEST_NAMES
from h3serve.config.stage import StageConfig
from h3serve.errors import RequestError
from h3serve.services.gateway.fields import validate_fields

from .conftest import REPO, REQUEST

# 13 grid points (12 forwards): past the policy's 4 warm-up and 2 final steps, so reuse engages on the tiny model
REUSE = dict(REQUEST, num_inference_steps=13)
FORWARDS = REUSE["num_inference_steps"] - 1


def test_grpc_high_equals_embedded_and_computes_fewer_forwards(stack, embedded):
    expected = embedded(**REUSE, quality="high")
    lossless = embedded(**REUSE)
    assert expected != lossless   # reuse changed the latents: the test below compares something
    with Client(stack.grpc, timeout=120) as client:
        high = client.generate_sync(**REUSE, quality="high")
        plain = client.generate_sync(**REUSE, quality="lossless")
    assert high.mp4 == expected and plain.mp4 == lossless
    assert plain.timings["dit_steps"] == FORWARDS and plain.forwards_computed == FORWARDS
    assert plain.timings["dit_block_evaluations"] == FORWARDS * 2   # every block (the tiny DiT has 2) of every step
    assert high.timings["dit_steps"] == FORWARDS and 0 < high.forwards_computed < FORWARDS
    assert FORWARDS * 1 <= high.timings["dit_block_evaluations"] < FORWARDS * 2


def _finished(http: httpx.Client, job: dict, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    while job["status"] not in ("completed", "failed") and time.monotonic() < end:
        time.sleep(0.1)
        job = http.get(f"/v1/videos/{job['id']}").json()
    return job


def test_http_job_reports_quality_and_forwards_computed(stack, embedded):
    expected = embedded(**REUSE, quality="high")
    body = {**REUSE, "seconds": "5", "quality": "high"}
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        r = http.post("/v1/videos", json={**REQUEST, "quality": "lossless"})   # 4 grid points: 3 forwards
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["quality"] == "lossless"
        job = _finished(http, job)
        assert job["status"] == "completed", job
        assert job["dit_forwards_computed"] == 3 and job["dit_block_evaluations"] == 3 * 2
        r = http.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["quality"] == "high"
        job = _finished(http, job)
        assert job["status"] == "completed", job
        assert 0 < job["dit_forwards_computed"] < FORWARDS
        content = http.get(f"/v1/videos/{job['id']}/content").content
        assert hashlib.sha256(content).hexdigest() == hashlib.sha256(expected).hexdigest()


def test_cli_generate_server_carries_quality(stack, embedded, tmp_path):
    out = tmp_path / "cli.mp4"
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--server", stack.grpc, "--prompt",
                        REUSE["prompt"], "--seconds", "5", "--size", "320x256", "--seed", "0", "--steps",
                        str(REUSE["num_inference_steps"]), "--quality", "high", "--no-progress", "--json", "-o",
                        str(out)], capture_output=True, text=True, timeout=180, cwd=REPO, check=False,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 < info["timings"]["dit_forwards_computed"] < FORWARDS
    assert out.read_bytes() == embedded(**REUSE, quality="high")


def test_unknown_quality_is_refused_naming_the_field_and_values(stack):
    with Client(stack.grpc, timeout=30) as client, pytest.raises(RequestError) as info:
        client.generate_sync(**REQUEST, quality="fast")
    assert info.value.field == "quality" and "lossless | high" in str(info.value)
    r = httpx.post(f"{stack.http}/v1/videos", json={**REQUEST, "quality": "fast"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["field"] == "quality" and "lossless | high" in err["message"], r.text


def test_dit_stage_refuses_an_unknown_quality(stack):
    from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc

    params = dit_pb2.DiTParams(request_id="quality-direct", latent_frames=37, latent_height=8, latent_width=10,
                               audio_latents=207, seed=0, task="t2va", profile="base", steps=4, quality="fast")
    inputs = [dit_pb2.DiTInput(params=params), dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=0))]
    with grpc.insecure_channel(stack.addresses["dit"]) as ch, pytest.raises(grpc.RpcError) as err:
        for _ in dit_pb2_grpc.DiTStub(ch).Generate(iter(inputs), timeout=30):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "quality" in err.value.details() and "lossless | high" in err.value.details()


@pytest.mark.parametrize("config", [StageConfig.from_knobs(profile="fasth3", dtype="fp32"),
                                    StageConfig.from_knobs(profile="base", dtype="fp32", fasth3_dit="127.0.0.1:1")])
def test_fasth3_refuses_high_with_the_lever_message(config):
    with pytest.raises(RequestError) as info:
        validate_fields({"prompt": "a kite", "model": "FastH3", "quality": "high"}, config=config, http=True)
    assert info.value.field == "quality"
    assert info.value.allowed == LEVERS_MESSAGE.format(**REQUEST_NAMES)
