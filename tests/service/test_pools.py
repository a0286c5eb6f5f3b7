"""Base and FastH3 behind one gateway: one `h3serve serve --fasth3-adapter ...` runs the base stages and a FastH3
DiT pool on this machine, the gateway routing by `model` (--fasth3-dit). Each pool's MP4 is its embedded
pipeline's; FastH3 keeps its contract (t2va only, its fixed schedule); `/v1/models` lists both."""

from __future__ import annotations

import json

import httpx
import pytest

from h3serve.client import Client
from h3serve.config.levers import LEVERS_MESSAGE, REQUEST_NAMES
from h3serve.errors import RequestError

from .conftest import REQUEST, THREADS, Stack, embedded_request
from .test_conditions import FIRST

FAST = dict(prompt="a kite, fast", seconds=5, size="320x256", seed=1)


@pytest.fixture(scope="module")
def pools(tiny_checkpoint, tiny_adapter):
    s = Stack(tiny_checkpoint, "--fasth3-adapter", str(tiny_adapter.path), "--fasth3-adapter-sha256",
              tiny_adapter.sha256, "--queue-size", "2")
    s.wait_ready()
    yield s
    assert s.stop() == 0


def _embedded_fasth3(tiny_checkpoint, tiny_adapter, tmp_path) -> bytes:
    import torch

    from h3serve.config.request import validate_request
    from h3serve.pipeline import Pipeline

    pipe = Pipeline.load(tiny_checkpoint, profile="fasth3", adapter=str(tiny_adapter.path),
                         adapter_sha256=tiny_adapter.sha256, dtype="fp32", device="cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        pipe.generate(validate_request(**dict(FAST, profile="fasth3", dtype="fp32")), tmp_path / "fast.mp4")
    finally:
        torch.set_num_threads(before)
    return (tmp_path / "fast.mp4").read_bytes()


def test_model_routes_to_its_pool_and_each_equals_embedded(pools, embedded, tiny_checkpoint, tiny_adapter,
                                                          tmp_path):
    expected_fast = _embedded_fasth3(tiny_checkpoint, tiny_adapter, tmp_path)
    with Client(pools.grpc, timeout=120) as client:
        fast = client.generate_sync(**FAST, model="FastH3")
        assert fast.accepted.profile == "fasth3" and fast.accepted.num_inference_steps == 5
        assert fast.mp4 == expected_fast
        base = client.generate_sync(**REQUEST)   # no model: the deployment's own (base) pool
        assert base.accepted.profile == "base" and base.mp4 == embedded(**REQUEST)
        with pytest.raises(RequestError) as info:      # FastH3 serves t2va only
            client.generate(**FAST, model="FastH3", first_image=FIRST)
        assert info.value.field == "task"
        with pytest.raises(RequestError) as info:      # and its own schedule
            client.generate(**FAST, model="FastH3", num_inference_steps=8)
        assert info.value.field == "num_inference_steps"
    r = httpx.post(f"{pools.http}/v1/videos", params={"validate_only": "true"},
                   json={**FAST, "model": "fasth3", "num_inference_steps": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["num_inference_steps"] == 5 and r.json()["model"] == "FastH3"
    r = httpx.post(f"{pools.http}/v1/videos", params={"validate_only": "true"},
                   json={**FAST, "model": "fasth3", "quality": "high"}, timeout=30)   # no step reuse on FastH3
    assert r.status_code == 400 and r.json()["error"]["field"] == "quality", r.text
    assert r.json()["error"]["message"].endswith(LEVERS_MESSAGE.format(**REQUEST_NAMES))


def test_models_lists_both_pools(pools):
    data = httpx.get(f"{pools.http}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["profile"], m["tasks"]) for m in data] == [
        ("MiniMax-H3", "base", ["t2va", "fl2va"]), ("FastH3", "fasth3", ["t2va"])]   # the default --tasks
    ready = httpx.get(f"{pools.http}/ready", timeout=10).json()
    assert ready["stages"]["dit-fasth3"] == "SERVING"
    serving = next(e for e in pools.events if e["event"] == "serving")
    assert set(serving["stages"]) == {"encoder", "dit", "dit-fasth3", "vae", "muxer", "gateway"}


def test_cli_server_selects_the_fasth3_pool_and_first_image_implies_fl2va(pools, tmp_path, capsys):
    """`h3serve generate --server ADDR --model fasth3` runs on the FastH3 pool (the MP4 is the SDK's FastH3 one);
    `--first-image` alone is task fl2va (on the base pool), and a --task that contradicts it is refused up front."""
    from h3serve.cli import main

    common = ["--server", pools.grpc, "--prompt", FAST["prompt"], "--seconds", "5", "--size", "320x256", "--seed",
              "1", "--no-progress", "--json"]
    assert main(["generate", *common, "--model", "fasth3", "-o", str(tmp_path / "fast.mp4")]) == 0
    out = json.loads(capsys.readouterr().out)
    with Client(pools.grpc, timeout=120) as client:
        assert out["sha256"] == client.generate_sync(**FAST, model="FastH3").sha256
    first = tmp_path / "first.png"
    first.write_bytes(FIRST)
    assert main(["generate", *common, "--steps", "4", "--first-image", str(first),
                 "-o", str(tmp_path / "fl2va.mp4")]) == 0
    out = json.loads(capsys.readouterr().out)
    with Client(pools.grpc, timeout=120) as client:   # the finished job, watched again by its id
        replay = client.attach(out["request_id"])
        assert replay.result().sha256 == out["sha256"]
        assert (replay.accepted.task, replay.accepted.profile) == ("fl2va", "base")
    assert main(["generate", *common, "--task", "t2va", "--first-image", str(first), "-o",
                 str(tmp_path / "no.mp4")]) != 0
    err = capsys.readouterr().err
    assert "--first-image" in err and "--task is t2va" in err and "fl2va" in err
