"""Per-request LoRA through the served stack (`h3serve serve --loras`): a request naming an adapter changes its own
MP4 only (the next request without one gives the bytes it gave before), a few-step adapter runs its steps, and a
name the deployment does not list, a file path, or a scale out of range is refused naming the field, over HTTP and
gRPC."""

from __future__ import annotations

import time

import httpx
import pytest

from h3serve.client import Client
from h3serve.errors import RequestError
from h3serve.testing.adapters import init_lora

from .conftest import REQUEST, Stack, embedded_maker

SMALL = dict(REQUEST, size="64x64", num_inference_steps=3)   # the smallest canvas: the test compares bytes, not looks


@pytest.fixture(scope="module")
def lora_stack(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    style = init_lora(tiny_checkpoint, d / "style.safetensors")
    turbo = init_lora(tiny_checkpoint, d / "turbo.safetensors", seed=1)
    loras = f"style={d / 'style.safetensors'}@{style},turbo={d / 'turbo.safetensors'}@{turbo}@3"
    s = Stack(tiny_checkpoint, "--loras", loras, "--grace-s", "10", "--no-warmup")
    s.loras = {"style": str(d / "style.safetensors")}
    s.loras_knob = loras
    yield s
    assert s.stop() == 0


def _post(http: httpx.Client, **body) -> bytes:
    r = http.post("/v1/videos/sync", json={**SMALL, **body})
    assert r.status_code == 200, r.text
    return r.content


def test_lora_changes_its_own_request_only(lora_stack):
    with httpx.Client(base_url=lora_stack.http, timeout=180) as http, Client(lora_stack.grpc, timeout=180) as client:
        before = client.generate_sync(**SMALL).mp4
        styled = client.generate_sync(**SMALL, lora={"name": "style", "scale": 1.0})
        after = _post(http)
        assert after == before and styled.mp4 != before
        listed = lora_stack.loras["style"]   # vLLM-Omni's shape: the name with its (listed) file
        assert _post(http, lora={"name": "style", "local_path": listed}) == styled.mp4   # HTTP: the same bytes
        models = http.get("/v1/models").json()["data"]
        assert models[0]["loras"] == [{"name": "style"}, {"name": "turbo", "steps": 3}]
        job = http.post("/v1/videos", json={**SMALL, "num_inference_steps": None, "lora": "turbo"}).json()
        end = time.monotonic() + 120
        while job["status"] not in ("completed", "failed") and time.monotonic() < end:
            time.sleep(0.1)
            job = http.get(f"/v1/videos/{job['id']}").json()
        assert job["status"] == "completed", job
        assert job["lora"] == {"name": "turbo", "scale": 1.0} and job["num_inference_steps"] == 3
        turbo = client.validate(**{**SMALL, "num_inference_steps": None}, lora="turbo")
        assert turbo.num_inference_steps == 3   # the adapter's grid points, resolved at the gateway


@pytest.mark.parametrize("lora,field", [("nope", "lora.name"), ({"name": "style", "path": "/etc/x"}, "lora.path"),
                                        ({"name": "style", "scale": 10}, "lora.scale")])
def test_refusals_name_the_field(lora_stack, lora, field):
    r = httpx.post(f"{lora_stack.http}/v1/videos", json={**SMALL, "lora": lora}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    if isinstance(lora, str) or "path" not in lora:
        with Client(lora_stack.grpc, timeout=30) as client, pytest.raises(RequestError) as info:
            client.validate(**SMALL, lora=lora)
        assert info.value.field == field


def test_the_embedded_pipeline_gives_a_lora_requests_served_bytes(lora_stack, tiny_checkpoint, tmp_path):
    """`Pipeline.load(loras=)` (`h3serve generate --loras ... --lora NAME`): the same MP4 as the served stack."""
    from h3serve.pipeline import Pipeline

    pipe = Pipeline.load(tiny_checkpoint, dtype="fp32", device="cpu", loras=lora_stack.loras_knob)
    try:
        make = embedded_maker(pipe, tmp_path)
        with Client(lora_stack.grpc, timeout=180) as client:
            styled = client.generate_sync(**SMALL, lora={"name": "style", "scale": 0.5}).mp4
            plain = client.generate_sync(**SMALL).mp4
        assert make(**SMALL, lora={"name": "style", "scale": 0.5}) == styled != plain
        assert make(**SMALL) == plain
        with pytest.raises(RequestError, match="lora"):
            make(**SMALL, lora="unlisted")
    finally:
        pipe.close()
