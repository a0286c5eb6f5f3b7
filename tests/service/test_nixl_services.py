"""`--transport nixl` through the real services: the DiT sends the latents to the VAE and the VAE streams frames +
PCM to the muxer by NIXL (real agents in
separate stage processes, loopback), `Muxer.Control` carrying the control pipe.

* the MP4 is byte-identical to the one `--transport grpc` makes for the same request;
* the latents go DiT -> VAE by NIXL (`VAE.Control`), the gateway carries none of them;
* NIXL disabled on the DiT and the muxer (`H3SERVE_NIXL_DISABLE=1`): the request goes over gRPC (frames by Push,
  latents inline in `VAE.Control`) and succeeds, the Status details, /ready and the metrics say chosen=grpc and why;
* the VAE killed mid-stream: the caller gets UNAVAILABLE naming the VAE within its deadline, the muxer released its
  NIXL agent and pool, and the next request is served over NIXL.

The transport-level properties (1 GB of frames, back-pressure, 100 failed streams without a leak) are in
tests/transport.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from h3serve._proto import common_pb2, muxer_pb2_grpc
from h3serve.client import Client
from h3serve.testing.faults import kill_mid_request, wait_replaced

from .conftest import REQUEST, LoneStage, Stack

pytest.importorskip("nixl")


def _transport(stack, stage: str) -> dict:
    return json.loads(stack.status(stage).info_json)["transport"]


def _nixl_counters(stack, stage: str) -> dict:
    return json.loads(stack.status(stage).info_json)["nixl"]


def _metrics(stack) -> list[str]:
    return [line for line in httpx.get(f"{stack.http}/metrics", timeout=5).text.splitlines()
            if line.startswith("h3serve_transport")]


@pytest.fixture(scope="module")
def nixl_stack(tiny_checkpoint):
    s = Stack(tiny_checkpoint, "--transport", "nixl", "--queue-size", "1", "--max-inflight", "1", "--grace-s", "10")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def grpc_mp4(stack):
    """The canonical request's MP4 from the `--transport grpc` stack."""
    with Client(stack.grpc, timeout=120) as client:
        return client.generate(**REQUEST).mp4


def test_mp4_over_nixl_is_byte_identical_to_grpc(nixl_stack, grpc_mp4):
    with Client(nixl_stack.grpc, timeout=120) as client:
        result = client.generate(**REQUEST)
    assert result.mp4 == grpc_mp4
    for stage in ("vae", "muxer"):
        t = _transport(nixl_stack, stage)
        assert (t["requested"], t["chosen"]) == ("nixl", "nixl"), t
        assert (t["last_stream"]["requested"], t["last_stream"]["chosen"]) == ("nixl", "nixl"), t
        assert t["reason"].startswith("NIXL "), t
    t = _transport(nixl_stack, "encoder")   # no NIXL edge: its text states go to the gateway by gRPC
    assert t == {"requested": "nixl", "chosen": "grpc",
                 "reason": "the encoder has no NIXL edge: its tensors travel by gRPC"}, t
    assert _nixl_counters(nixl_stack, "muxer")["agents_live"] == 0      # the session's agent and pool are gone
    assert _nixl_counters(nixl_stack, "muxer")["regions_registered"] == 0
    ready = httpx.get(f"{nixl_stack.http}/ready", timeout=5).json()
    assert ready["transport"]["vae->muxer"]["chosen"] == "nixl"
    assert ready["transport"]["dit->vae"]["chosen"] == "nixl"       # latents go DiT -> VAE directly
    for stage in ("dit", "vae"):
        t = json.loads(nixl_stack.status(stage).info_json)
        t = t["latents_transport" if stage == "vae" else "transport"]
        assert (t["last_stream"]["requested"], t["last_stream"]["chosen"]) == ("nixl", "nixl"), t
    metrics = _metrics(nixl_stack)
    assert any(m.startswith("h3serve_transport_info") and 'edge="dit->vae"' in m and 'chosen="nixl"' in m
               for m in metrics), metrics
    relayed = [line for line in httpx.get(f"{nixl_stack.http}/metrics", timeout=5).text.splitlines()
               if line.startswith("h3serve_gateway_latents_bytes_total")]
    assert relayed == ["h3serve_gateway_latents_bytes_total 0.0"], relayed   # the gateway carried no latents
    assert any('edge="vae->muxer"' in m and 'chosen="nixl"' in m and 'requested="nixl"' in m and
               m.startswith("h3serve_transport_info") and m.endswith(" 1.0") for m in metrics), metrics


def test_vae_killed_mid_stream_under_nixl_fails_unavailable_and_the_next_request_works(nixl_stack, grpc_mp4):
    pid = nixl_stack.status("vae").pid
    with Client(nixl_stack.grpc, timeout=60) as client:   # 14 s, 21 clips: time to kill between two
        err, killed_at = kill_mid_request(client, dict(REQUEST, seconds=14), "vae", pid)
    assert time.monotonic() - killed_at < 10.0       # well within the 60 s deadline
    assert err.stage == "vae" and "vae" in str(err)
    muxer = nixl_stack.wait_idle("muxer")
    assert muxer.last.outcome in ("error", "cancelled")   # the broken call counts as its end signal
    counters = _nixl_counters(nixl_stack, "muxer")
    assert counters["agents_live"] == 0 and counters["regions_registered"] == 0, counters   # released
    wait_replaced(lambda: nixl_stack.status("vae"), pid)
    nixl_stack.wait_ready()
    with Client(nixl_stack.grpc, timeout=120) as client:
        assert client.generate(**REQUEST).mp4 == grpc_mp4
    assert _transport(nixl_stack, "vae")["last_stream"]["chosen"] == "nixl"


def test_nixl_disabled_on_the_muxer_falls_back_to_grpc_and_says_why(tiny_checkpoint, grpc_mp4):
    # the DiT and the muxer in one process with NIXL disabled: both NIXL edges fall back, each saying why
    muxer = LoneStage("muxer", "--transport", "nixl", env={"H3SERVE_NIXL_DISABLE": "1"})
    dit = None
    try:
        dit = LoneStage("dit", "--transport", "nixl", "--checkpoint", str(tiny_checkpoint),
                         env={"H3SERVE_NIXL_DISABLE": "1"})
        s = Stack(tiny_checkpoint, "--stages", "encoder,vae,gateway", "--muxer", muxer.address,
                  "--dit", dit.address, "--transport", "nixl")
        try:
            with Client(s.grpc, timeout=120) as client:
                result = client.generate(**REQUEST)
            assert result.mp4 == grpc_mp4
            with grpc.insecure_channel(muxer.address) as channel:
                st = muxer_pb2_grpc.MuxerStub(channel).Status(common_pb2.StatusRequest(), timeout=5)
            t = json.loads(st.info_json)["transport"]
            assert (t["requested"], t["chosen"]) == ("nixl", "grpc") and "H3SERVE_NIXL_DISABLE" in t["reason"], t
            assert t["last_stream"]["chosen"] == "grpc" and "H3SERVE_NIXL_DISABLE" in t["last_stream"]["reason"]
            v = _transport(s, "vae")
            assert (v["requested"], v["chosen"]) == ("nixl", "nixl")        # the VAE itself could use NIXL
            last = v["last_stream"]
            assert (last["requested"], last["chosen"]) == ("nixl", "grpc"), last
            assert last["reason"].startswith("muxer: ") and "H3SERVE_NIXL_DISABLE" in last["reason"], last
            ready = httpx.get(f"{s.http}/ready", timeout=5).json()["transport"]["vae->muxer"]
            assert ready["chosen"] == "grpc" and "H3SERVE_NIXL_DISABLE" in ready["reason"], ready
            metrics = _metrics(s)
            assert any(m.startswith("h3serve_transport_info") and 'chosen="grpc"' in m and 'edge="vae->muxer"' in m
                       and "H3SERVE_NIXL_DISABLE" in m for m in metrics), metrics
            assert 'h3serve_transport_fallbacks_total{edge="vae->muxer"} 1.0' in metrics, metrics
            latents = httpx.get(f"{s.http}/ready", timeout=5).json()["transport"]["dit->vae"]
            assert (latents["requested"], latents["chosen"]) == ("nixl", "grpc"), latents
            assert latents["reason"].startswith("dit: ") and "H3SERVE_NIXL_DISABLE" in latents["reason"], latents
            assert 'h3serve_transport_fallbacks_total{edge="dit->vae"} 1.0' in metrics, metrics
        finally:
            assert s.stop() == 0
    finally:
        if dit is not None:
            dit.stop()
        muxer.stop()
