"""Faults (issue: hung stages, bounded sessions, bad input): a stage stopped with SIGSTOP keeps its port open, so
only its health checks (each with a deadline) tell; the gateway's watchdog fails the callers that need it with
UNAVAILABLE naming it, new requests are refused at once, and the launcher's liveness probe kills and restarts it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from h3serve.client import Client, Progress, StageUnavailable

from .conftest import REQUEST, LoneStage

FIELDS = {k: v for k, v in REQUEST.items() if k != "prompt"}


# 20,000 characters (the tiny encoder's forward takes ~15 s), a prompt of its own: never encoded whole, so
# never a cache hit
HUGE_PROMPT = "a kite over the hung sea " * 800


def wait_event(stack, pred, timeout, since: int = 0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        hit = next((e for e in stack.events[since:] if pred(e)), None)
        if hit is not None:
            return hit
        time.sleep(0.05)
    raise TimeoutError(f"no such event within {timeout}s: {stack.events[since:]}")


def wait_busy(stack, stage: str, timeout: float = 60.0) -> None:
    """Until `stage` works on a request (its own Status says so)."""
    end = time.monotonic() + timeout
    while not stack.status(stage).current_request_id:
        assert time.monotonic() < end, f"{stage} took no request within {timeout}s"
        time.sleep(0.02)


@pytest.mark.parametrize("stage,during", [("encoder", "encoder"), ("dit", "dit"), ("vae", "vae"),
                                          ("muxer", "vae")])
def test_a_hung_stage_fails_its_callers_fast_and_is_restarted(stack, tmp_path, stage, during):
    """`during`: the stage the request is in when `stage` stops (the muxer stops while the VAE streams to it; the
    encoder while it encodes a 20,000-character prompt, which it reports no progress for). On the shared stack:
    each case ends with its stage restarted and a request served."""
    pid, since = stack.status(stage).pid, len(stack.events)
    out = tmp_path / "hung.mp4"
    prompt = HUGE_PROMPT if during == "encoder" else REQUEST["prompt"]
    figures = {}
    with Client(stack.grpc, retry=None) as client:   # the refusals themselves, not their retries
        gen = client.stream(prompt, output=out, timeout=300, **dict(FIELDS, seconds=14))
        stopped_at = None
        with pytest.raises(StageUnavailable) as info:
            for event in gen:
                if stopped_at is None and (during == "encoder" or isinstance(event, Progress)
                                           and event.stage == during):
                    if during == "encoder":
                        wait_busy(stack, "encoder")
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
            gen.result()
        figures["caller_failed_after_s"] = round(time.monotonic() - stopped_at, 2)
        assert info.value.stage == stage and "health checks" in str(info.value)
        assert figures["caller_failed_after_s"] < 10.0          # not the 300 s deadline
        assert not out.exists() and not (tmp_path / f".{out.name}.part").exists()   # nothing half-written kept

        t0 = time.monotonic()
        with pytest.raises(StageUnavailable) as refused:    # new work is refused at once while it is hung
            client.generate_sync(REQUEST["prompt"], timeout=60, **FIELDS)
        assert refused.value.stage == stage and time.monotonic() - t0 < 2.0

        hung = wait_event(stack, lambda e: e.get("event") == "hung" and e.get("stage") == stage, 30, since)
        assert hung["pid"] == pid
        wait_event(stack, lambda e: e.get("event") == "restarted" and e.get("stage") == stage, 30, since)
        figures["restarted_after_s"] = round(time.monotonic() - stopped_at, 2)
        stack.wait_ready(120)
        assert client.generate_sync(REQUEST["prompt"], timeout=120, **FIELDS).mp4_bytes > 0
    print("FIGURES", json.dumps({"stage": stage, "during": during, **figures}))


def _encoder(stack):
    import grpc

    from h3serve._proto import encoder_pb2, encoder_pb2_grpc

    ch = grpc.insecure_channel(stack.addresses["encoder"])
    return ch, encoder_pb2_grpc.EncoderStub(ch), encoder_pb2


def test_the_encoder_stops_a_huge_prompt_when_its_caller_gives_up(stack):
    """20,000 characters keep the tiny encoder busy ~15 s on one core; a 1.5 s deadline or a cancel frees it at
    once, and the next request does not wait for the abandoned one."""
    import grpc

    ch, stub, pb = _encoder(stack)
    huge = "a kite over the sea " * 1000
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Encode(pb.EncodeRequest(request_id="huge-deadline", prompt=huge, task="t2va"), timeout=1.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stack.wait_idle("encoder", timeout=3.0)
        freed_deadline = time.monotonic() - t0

        call = stub.Encode(pb.EncodeRequest(request_id="huge-cancel", prompt=huge, task="t2va"), timeout=60)
        time.sleep(0.5)
        t0 = time.monotonic()
        call.cancel()
        stack.wait_idle("encoder", timeout=3.0)
        freed_cancel = time.monotonic() - t0

        t0 = time.monotonic()
        events = list(stub.Encode(pb.EncodeRequest(request_id="next", prompt="a kite", task="t2va"), timeout=30))
        assert events[-1].WhichOneof("event") == "done" and time.monotonic() - t0 < 5.0
    finally:
        ch.close()
    print("FIGURES", json.dumps({"encoder_free_after_deadline_s": round(freed_deadline, 2),
                                 "encoder_free_after_cancel_s": round(freed_cancel, 2)}))


def test_muxer_sessions_are_capped_in_count_and_ttl_and_never_hold_sigterm():
    import grpc

    from h3serve._proto import muxer_pb2, muxer_pb2_grpc

    mux = LoneStage("muxer", "--grace-s", "900", "--max-sessions", "3", env={})
    try:
        with grpc.insecure_channel(mux.address) as ch:
            stub = muxer_pb2_grpc.MuxerStub(ch)

            def open_(**kw):
                return stub.OpenSession(muxer_pb2.OpenSessionRequest(
                    request_id="r", width=64, height=64, fps=24, sample_rate=32000, channels=2, **kw), timeout=5)

            for ttl in (1e300, float("inf"), float("nan"), -1.0, 7201.0):
                with pytest.raises(grpc.RpcError) as info:
                    open_(ttl_s=ttl)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in info.value.details()
            for _ in range(3):
                open_(ttl_s=600)
            with pytest.raises(grpc.RpcError) as info:
                open_()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-sessions 3" in info.value.details()
        t0 = time.monotonic()
        mux.proc.send_signal(signal.SIGTERM)       # three sessions opened, none pushed: nothing to wait for
        assert mux.proc.wait(30) == 0
        stopped = time.monotonic() - t0
        assert stopped < 10.0
    finally:
        if mux.proc.poll() is None:
            mux.proc.kill()
            mux.proc.wait()
    print("FIGURES", json.dumps({"muxer_sigterm_with_open_sessions_s": round(stopped, 2)}))


@pytest.mark.parametrize("field,value", [("latent_frames", 3), ("latent_frames", 2), ("latent_frames", 112),
                                         ("audio_latents", 0), ("audio_latents", 208), ("latent_height", 0),
                                         ("latent_width", 4096)])
def test_the_dit_refuses_a_geometry_no_request_has(stack, field, value):
    import grpc

    from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc

    good = dict(latent_frames=37, latent_height=16, latent_width=20, audio_latents=207)
    params = dit_pb2.DiTParams(request_id="bad-geometry", seed=0, task="t2va", profile="base", steps=4,
                               **{**good, field: value})
    inputs = [dit_pb2.DiTInput(params=params), dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=0))]
    with grpc.insecure_channel(stack.addresses["dit"]) as ch, pytest.raises(grpc.RpcError) as err:
        list(dit_pb2_grpc.DiTStub(ch).Generate(iter(inputs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())["h3serve-field"] == field and str(value) in err.value.details()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_oversize_bodies_are_refused_before_they_are_read(stack):
    import httpx

    pid = stack.events[0]["stages"]["gateway"]["pid"]
    before = _rss_mb(pid)
    big = b'{"prompt": "' + b"a" * (64 << 20) + b'"}'           # 64 MiB announced
    r = httpx.post(f"{stack.http}/v1/videos", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large" and "body" in r.json()["error"]["message"]

    def chunked():                                               # no length announced: cut off while it streams
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * (1 << 20)
        yield b'"}'

    try:
        r = httpx.post(f"{stack.http}/v1/videos", content=chunked(), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413
    except httpx.HTTPError:
        pass   # the server answered 413 and closed while the client was still sending
    grown = _rss_mb(pid) - before
    assert grown < 50, f"the gateway grew by {grown:.0f} MB"
    ok = httpx.post(f"{stack.http}/v1/videos?validate_only=true", json={"prompt": "é" * 20000}, timeout=30)
    assert ok.status_code == 200      # the largest prompt still fits
    print("FIGURES", json.dumps({"gateway_rss_growth_mb_after_128MiB_of_bodies": round(grown, 1)}))


def test_an_unwritable_output_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    from h3serve.client import Client
    from h3serve.errors import RequestError

    from .conftest import REPO

    missing = tmp_path / "no" / "such" / "dir" / "out.mp4"
    with Client("127.0.0.1:9") as client, pytest.raises(RequestError) as info:   # no server needed: refused first
        client.stream("a kite", output=missing)
    assert info.value.field == "output" and not missing.parent.exists()        # nothing created
    out = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--server", "127.0.0.1:9", "--prompt",
                          "a kite", "-o", str(missing)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "--output" in out.stderr and "Traceback" not in out.stderr


def _fuzz_requests(rng, n: int):
    """n requests mixing valid and malformed methods, paths, headers, content types and field values."""
    values = [None, True, 0, -1, 1, 3, 2**63, 2**64, 1e308, -0.0, "", "x", "é" * 300, "\udcff", [], {}, [1, "a"],
              {"task": "t2va"}, "1344x768", "320x256", "0x0", "99999x1", "5", "nan", "inf", "-5", " 4 ", "a" * 5000]
    fields = ["prompt", "seconds", "size", "width", "height", "num_frames", "fps", "seed", "num_inference_steps",
              "quality", "model", "extra_params", "", "unknown", "prompt\x00"]
    paths = ["/v1/videos", "/v1/videos?validate_only=true", "/v1/videos/sync?validate_only=true",
             "/v1/videos/video_0", "/v1/videos/%00", "/v1/videos/" + "a" * 3000, "/v1/videos/x/content",
             "/v1/videos/x/cancel", "/v1/videos?limit=0", "/v1/videos?limit=abc&order=sideways", "/v1/videos?after=zz"]
    ctypes = ["application/json", "multipart/form-data; boundary=zz", "application/x-www-form-urlencoded",
              "text/plain", "", "application/json; charset=latin-1"]
    for _ in range(n):
        method = rng.choice(["GET", "POST", "POST", "POST", "DELETE", "PUT", "PATCH"])
        path = rng.choice(paths)
        if method == "POST" and path == "/v1/videos":
            path += "?validate_only=true"      # malformed bodies are the point, not generations
        body = {rng.choice(fields): rng.choice(values) for _ in range(rng.randint(0, 6))}
        kind = rng.random()
        if kind < 0.6:
            try:
                content = json.dumps(body).encode()
            except (TypeError, ValueError):
                content = b"{"
        elif kind < 0.8:
            content = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        else:
            content = "&".join(f"{k}={v}" for k, v in body.items()).encode("utf-8", "surrogateescape")
        headers = {"content-type": rng.choice(ctypes)}
        if rng.random() < 0.2:
            headers["x-request-timeout"] = rng.choice(["0", "-1", "nan", "1e400", "abc", "5"])
        yield method, path, headers, content


def test_fuzzed_http_requests_get_no_5xx(stack):
    """A bounded, seeded fuzz of the HTTP API: every answer is a 2xx or 4xx with the error object (503s only
    from a stage down: none here)."""
    import random

    import httpx

    rng = random.Random(15)
    n, by_status = int(os.environ.get("H3SERVE_FUZZ_N", "3000")), {}   # bounded; raise it for a longer run
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        for method, path, headers, content in _fuzz_requests(rng, n):
            r = http.request(method, path, headers=headers, content=content)
            by_status[r.status_code] = by_status.get(r.status_code, 0) + 1
            assert r.status_code < 500, (method, path, headers, content[:200], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert "error" in r.json() and r.json()["error"]["message"]
        for job in http.get("/v1/videos?limit=100").json()["data"]:   # leave the shared stack idle
            http.delete(f"/v1/videos/{job['id']}")
    print("FIGURES", json.dumps({"fuzzed_requests": n, "status_counts": dict(sorted(by_status.items()))}))


@pytest.mark.parametrize("case", ["steps_1", "steps_huge", "states_dim", "states_rank", "tags_len", "tags_float"])
def test_the_dit_refuses_bad_text_and_steps_naming_the_field(stack, case):
    import grpc
    import torch

    from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc
    from h3serve.transport.grpc import iter_tensor_chunks

    states, tags, steps = torch.randn(1, 8, 64), torch.ones(8, dtype=torch.long), 4
    field = {"steps_1": "steps", "steps_huge": "steps", "states_dim": "text_states", "states_rank": "text_states",
             "tags_len": "text_tags", "tags_float": "text_tags"}[case]
    if case == "steps_1":
        steps = 1
    elif case == "steps_huge":
        steps = 100000
    elif case == "states_dim":
        states = torch.randn(1, 8, 65)
    elif case == "states_rank":
        states = torch.randn(8, 64)
    elif case == "tags_len":
        tags = torch.ones(7, dtype=torch.long)
    else:
        tags = torch.ones(8)
    params = dit_pb2.DiTParams(request_id=f"bad-{case}", latent_frames=37, latent_height=16, latent_width=20,
                               audio_latents=207, seed=0, task="t2va", profile="base", steps=steps)
    inputs = [dit_pb2.DiTInput(params=params),
              *[dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_states", states)],
              *[dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_tags", tags)],
              dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=2))]
    with grpc.insecure_channel(stack.addresses["dit"]) as ch, pytest.raises(grpc.RpcError) as err:
        list(dit_pb2_grpc.DiTStub(ch).Generate(iter(inputs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert dict(err.value.trailing_metadata())["h3serve-field"] == field


@pytest.mark.parametrize("case", ["video_channels", "audio_channels", "audio_stereo", "sink_not_a_peer"])
def test_the_vae_refuses_bad_latents_and_undeclared_sinks_naming_the_field(stack, tiny_checkpoint, case):
    import grpc
    import torch

    from h3serve._proto import common_pb2, vae_pb2, vae_pb2_grpc
    from h3serve.transport.grpc import iter_tensor_chunks

    cv = json.loads((tiny_checkpoint / "vae" / "config.json").read_text())["latent_channels"]
    ca = json.loads((tiny_checkpoint / "audio_vae" / "config.json").read_text())["latent_channels"]
    video, audio = torch.zeros(1, cv, 7, 16, 20), torch.zeros(2, ca, 40)
    sink = common_pb2.Sink(address=stack.addresses["muxer"], session_id="no-such-session")
    field = {"video_channels": "video_latents", "audio_channels": "audio_latents", "audio_stereo": "audio_latents",
             "sink_not_a_peer": "sink.address"}[case]
    if case == "video_channels":
        video = torch.zeros(1, cv + 1, 7, 16, 20)
    elif case == "audio_channels":
        audio = torch.zeros(2, ca + 1, 40)
    elif case == "audio_stereo":
        audio = torch.zeros(3, ca, 40)
    else:
        sink = common_pb2.Sink(address="169.254.169.254:80", session_id="x")
    params = vae_pb2.DecodeParams(request_id=f"bad-{case}", sink=sink, num_frames=22, width=320, height=256)
    inputs = [vae_pb2.DecodeInput(params=params),
              *[vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("video_latents", video)],
              *[vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("audio_latents", audio)],
              vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=2))]
    t0 = time.monotonic()
    with grpc.insecure_channel(stack.addresses["vae"]) as ch, pytest.raises(grpc.RpcError) as err:
        list(vae_pb2_grpc.VAEStub(ch).Decode(iter(inputs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert dict(err.value.trailing_metadata())["h3serve-field"] == field and time.monotonic() - t0 < 10


def test_form_bodies_that_cannot_be_read_as_given_are_refused(stack):
    import httpx

    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(f"{stack.http}/v1/videos?validate_only=true", content=b"prompt=caf\xe9&seconds=5", headers=form,
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body" and "UTF-8" in r.json()["error"]["message"]
    r = httpx.post(f"{stack.http}/v1/videos?validate_only=true", content=b"prompt=a+kite&=5", headers=form,
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["field"] == "form field name"
    r = httpx.post(f"{stack.http}/v1/videos?validate_only=true", content="prompt=caf%C3%A9".encode(), headers=form,
                   timeout=10)
    assert r.status_code == 200 and r.json()["prompt"] == "café"
