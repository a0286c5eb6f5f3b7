"""End to end over gRPC (sync + asyncio SDK, streaming and unary), HTTP (async jobs and sync) and the CLI: the
MP4 bytes equal the embedded pipeline's for the same request and seed; progress is one event per denoising step,
in order; health, readiness, metrics and OpenAPI are served."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from h3serve.client import Accepted, AsyncClient, Client, Progress
from h3serve.testing.mp4check import check_mp4

from .conftest import REPO, REQUEST, STAGES


def test_grpc_stream_same_bytes_and_one_progress_event_per_step(stack, embedded):
    expected = embedded(**REQUEST)
    with Client(stack.grpc, timeout=120) as client:
        gen = client.stream(**REQUEST)
        events = list(gen)
        result = gen.result()
    assert result.mp4 == expected
    assert isinstance(events[0], Accepted)
    acc = events[0]
    assert (acc.num_frames, acc.width, acc.height, acc.seed, acc.num_inference_steps) == (124, 320, 256, 0, 4)
    dit = [e for e in events if isinstance(e, Progress) and e.stage == "dit"]
    assert [(e.done, e.total) for e in dit] == [(1, 3), (2, 3), (3, 3)]   # 4 grid points -> 3 steps, in order
    stages = [e.stage for e in events[1:]]
    assert stages.index("encoder") < stages.index("dit") < stages.index("vae")
    vae = [e for e in events if isinstance(e, Progress) and e.stage == "vae"]
    assert [e.done for e in vae] == list(range(1, vae[0].total + 1))
    percents = [e.percent for e in events if isinstance(e, Progress)]
    assert percents == sorted(percents) and percents[-1] <= 100
    t = result.timings
    for key in ("queue_s", "encoder_s", "dit_s", "vae_video_s", "vae_audio_s", "mux_tail_s", "fetch_s", "tail_s",
                "t_client", "t_media", "rtf_client"):
        assert t[key] >= 0, key
    assert abs(t["t_media"] - 124 / 24) < 1e-6
    assert t["peak_memory_mb"] > 100   # the largest stage process's peak RSS here (CPU stages; weights, torch)
    assert result.sha256 == __import__("hashlib").sha256(expected).hexdigest()


def test_grpc_unary_and_file_output(stack, embedded, tmp_path):
    expected = embedded(**REQUEST)
    with Client(stack.grpc, timeout=120) as client:
        assert client.generate_sync(**REQUEST).mp4 == expected
        seen = []
        result = client.generate(output=tmp_path / "out.mp4", on_progress=seen.append, **REQUEST)
    assert result.path.read_bytes() == expected and result.mp4 is None
    assert not list(tmp_path.glob(".*.part"))
    assert sum(p.stage == "dit" for p in seen) == 3
    report = check_mp4(result.path, expect_frames=124, fps=24, width=320, height=256, sample_rate=32000, channels=2)
    assert report.frames == 124


def test_asyncio_client_same_bytes(stack, embedded):
    expected = embedded(**REQUEST)

    async def run():
        async with AsyncClient(stack.grpc, timeout=120) as client:
            steps = []
            result = await client.generate(on_progress=lambda p: steps.append(p.done) if p.stage == "dit" else None,
                                           **REQUEST)
            return result, steps

    result, steps = asyncio.run(run())
    assert result.mp4 == expected
    assert steps == [1, 2, 3]


def test_http_async_job_same_bytes(stack, embedded):
    expected = embedded(**REQUEST)
    body = {"prompt": REQUEST["prompt"], "seconds": "5", "size": "320x256", "seed": 0, "num_inference_steps": 4,
            "extra_params": {"task": "t2va"}, "quality": "lossless"}
    with httpx.Client(base_url=stack.http, timeout=60) as http:
        r = http.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["progress"] <= 100
        assert job["size"] == "320x256" and job["num_frames"] == 124
        seen = set()
        end = time.monotonic() + 120
        while job["status"] not in ("completed", "failed") and time.monotonic() < end:
            time.sleep(0.1)
            job = http.get(f"/v1/videos/{job['id']}").json()
            seen.add(job["status"])
        assert job["status"] == "completed", job
        assert job["progress"] == 100 and job["error"] is None
        for key in ("encoder_s", "dit_s", "vae_video_s", "fetch_s", "t_client"):
            assert job["stage_durations"][key] >= 0, key
        assert job["inference_time_s"] > 0 and job["completed_at"] >= job["created_at"]
        assert job["peak_memory_mb"] > 100
        content = http.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.content == expected
        listed = http.get("/v1/videos", params={"limit": 100}).json()
        assert listed["object"] == "list" and job["id"] in [j["id"] for j in listed["data"]]
        d = http.delete(f"/v1/videos/{job['id']}")
        assert d.status_code == 200 and d.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        gone = http.get(f"/v1/videos/{job['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_http_sync_and_form_fields_same_bytes(stack, embedded):
    expected = embedded(**REQUEST)
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        r = http.post("/v1/videos/sync", json={"prompt": REQUEST["prompt"], "width": 320, "height": 256,
                                               "seconds": 5, "seed": 0, "num_inference_steps": 4})
        assert r.status_code == 200, r.text[:300]
        assert r.headers["content-type"] == "video/mp4" and r.content == expected
        assert json.loads(r.headers["x-stage-durations"])["dit_s"] > 0
        # multipart form fields, as OpenAI-style clients send them
        form = {"prompt": REQUEST["prompt"], "size": "320x256", "seconds": "5", "seed": "0",
                "num_inference_steps": "4", "extra_params": '{"task": "t2va"}'}
        body, ctype = multipart(form)
        r = http.post("/v1/videos/sync", content=body, headers={"content-type": ctype})
        assert r.status_code == 200, r.text[:300]
        assert r.content == expected


def multipart(fields: dict[str, str]) -> tuple[bytes, str]:
    boundary = "h3serve-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items()]
    return ("".join(parts) + f"--{boundary}--\r\n").encode(), f"multipart/form-data; boundary={boundary}"


def test_cli_generate_server(stack, embedded, tmp_path):
    expected = embedded(**REQUEST)
    out = tmp_path / "cli.mp4"
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--server", stack.grpc, "--prompt",
                        REQUEST["prompt"], "--seconds", "5", "--size", "320x256", "--seed", "0", "--steps", "4",
                        "--no-progress", "--json", "-o", str(out)], capture_output=True, text=True, timeout=180,
                       cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["frames"] == 124 and info["size"] == "320x256"
    assert out.read_bytes() == expected
    bad = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--server", stack.grpc, "--prompt", "x",
                          "--device", "cpu", "-o", str(tmp_path / "x.mp4")], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--device" in bad.stderr and "Traceback" not in bad.stderr


def test_health_ready_metrics_openapi(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in [stack.grpc, *stack.addresses.values()]:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, address
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
        assert ready.status_code == 200 and ready.json()["stages"] == {s: "SERVING" for s in STAGES}
        metrics = http.get("/metrics").text
        for name in ("h3serve_queue_depth", 'h3serve_requests_total{outcome="completed"}',
                     'h3serve_stage_seconds_count{stage="dit"}', "h3serve_rtf_count", 'h3serve_stage_up{stage="vae"}'):
            assert name in metrics, name
        completed = [ln for ln in metrics.splitlines() if ln.startswith('h3serve_requests_total{outcome="completed"}')]
        assert float(completed[0].split()[-1]) >= 1
        spec = http.get("/openapi.json").json()
        for path in ("/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content", "/v1/videos/sync",
                     "/health", "/ready", "/metrics"):
            assert path in spec["paths"], path
        assert "prompt" in json.dumps(spec["paths"]["/v1/videos"]["post"]["requestBody"])
    with Client(stack.grpc) as client:
        info = client.info()
        assert info["queue_size"] == 1 and info["max_inflight"] == 1 and info["stages"]["dit"] == "SERVING"


def test_reflection_lists_the_services(stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.grpc) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5))
        names = {s.name for s in reply.list_services_response.service}
    assert {"h3serve.v1.Gateway", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("fields,field", [
    (dict(seconds=3), "seconds"), (dict(num_inference_steps=1), "num_inference_steps"), (dict(size="250x256"), "size"),
    (dict(task="i2v"), "task"), (dict(task="fl2va"), "first_image"), (dict(quality="fast"), "quality"),
    (dict(model="sora"), "model"), (dict(fps=30), "fps"), (dict(seed=-1), "seed"),
    (dict(num_frames=100, seconds=5), "num_frames"), (dict(request_id="bad id!"), "request_id"),
])
def test_grpc_invalid_request_names_the_field(stack, fields, field):
    from h3serve.errors import RequestError

    req = dict(REQUEST, **fields)
    with Client(stack.grpc, timeout=30) as client:
        with pytest.raises(RequestError) as info:
            client.generate(**req)
    assert info.value.field == field and field in str(info.value)
