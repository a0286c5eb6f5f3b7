"""Streaming output against the real gateway over the tiny checkpoint: `GET /v1/videos/{id}/content?stream=true`
and the gRPC `StreamContent` deliver a fragmented MP4 whose first fragment arrives while the job still runs; the
stream decodes to the finished MP4's frames and audio, and the finished MP4 is still the embedded pipeline's bytes."""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import numpy as np
from PIL import Image

from h3serve.client import Client, Progress
from h3serve.media.fragments import decoded_media

from .conftest import REQUEST


def _assert_same_media(live: bytes, mp4: bytes) -> None:
    frames, audio = decoded_media(mp4)
    live_frames, live_audio = decoded_media(live)
    assert len(live_frames) == len(frames) == 124
    assert all(np.array_equal(a, b) for a, b in zip(frames, live_frames))
    assert live_audio.shape == audio.shape and np.array_equal(live_audio, audio)


def test_http_stream_starts_before_the_job_completes_and_equals_the_mp4(stack, embedded):
    expected = embedded(**REQUEST)
    with httpx.Client(base_url=stack.http, timeout=120) as http:
        job = http.post("/v1/videos", json=dict(REQUEST, preview_every=1)).json()
        live, first_status = bytearray(), None
        with http.stream("GET", f"/v1/videos/{job['id']}/content", params={"stream": "true"}) as r:
            assert r.status_code == 200 and r.headers["x-h3-stream"] == "fmp4", r.read()
            assert r.headers["content-type"] == "video/mp4"
            for data in r.iter_bytes():
                live += data
                if first_status is None and b"moof" in live:   # the first playable fragment is here
                    first_status = http.get(f"/v1/videos/{job['id']}").json()["status"]
        assert first_status == "in_progress"
        assert live[4:8] == b"ftyp" and live.count(b"moof") > 2
        while http.get(f"/v1/videos/{job['id']}").json()["status"] != "completed":
            time.sleep(0.05)
        mp4 = http.get(f"/v1/videos/{job['id']}/content").content
        assert mp4 == expected   # the finished file: the same bytes as before streaming and previews existed
        preview = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "preview"})
        assert preview.headers["content-type"] == "image/jpeg" and preview.content[:2] == b"\xff\xd8"
        _assert_same_media(bytes(live), mp4)
        done = http.get(f"/v1/videos/{job['id']}/content", params={"stream": "true"})   # finished: the MP4
        assert done.headers["x-h3-stream"] == "mp4" and done.content == mp4
        bad = http.get(f"/v1/videos/{job['id']}/content", params={"stream": "true", "variant": "thumbnail"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"


def test_grpc_stream_content_equals_the_generated_mp4_and_previews_arrive(stack):
    with Client(stack.grpc, timeout=120) as client, Client(stack.grpc, timeout=120) as watcher:
        gen = client.stream(**dict(REQUEST, request_id="live-1", preview_every=1))
        live: list[bytes] = []
        errors: list[BaseException] = []

        def watch():
            try:
                live.extend(watcher.stream_content("live-1"))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        events = iter(gen)
        next(events)   # accepted: the job exists; the stream waits for its muxer session
        t = threading.Thread(target=watch)
        t.start()
        previews = [(e.done, e.total, e.preview_jpeg) for e in events
                    if isinstance(e, Progress) and e.preview_jpeg]
        result = gen.result()
        t.join(30)
        assert not errors, errors
        _assert_same_media(b"".join(live), result.mp4)
        # a preview after every one of the 3 denoising steps: a JPEG of 3 latent frames side by side
        assert [(d, t) for d, t, _ in previews] == [(1, 3), (2, 3), (3, 3)]
        image = Image.open(io.BytesIO(previews[-1][2]))
        assert image.format == "JPEG" and image.width > image.height


def test_preview_every_is_bounded_by_the_deployment_and_served_over_http(stack):
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        # 49 denoising steps with a preview after each: more than --max-previews (10)
        bad = http.post("/v1/videos", params={"validate_only": "true"},
                        json=dict(REQUEST, num_inference_steps=50, preview_every=1))
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "preview_every" and "--max-previews" in err["message"] and ">= 5" in err["message"]
        ok = http.post("/v1/videos", params={"validate_only": "true"},
                       json=dict(REQUEST, num_inference_steps=50, preview_every=5))
        assert ok.status_code == 200, ok.text


def test_muxer_stream_of_an_aborted_session_ends_with_the_reason(stack):
    import grpc

    from h3serve._proto import muxer_pb2, muxer_pb2_grpc

    with grpc.insecure_channel(stack.addresses["muxer"]) as channel:
        stub = muxer_pb2_grpc.MuxerStub(channel)
        sid = stub.OpenSession(muxer_pb2.OpenSessionRequest(request_id="abort-live", width=64, height=64, fps=24,
                                                            sample_rate=32000, channels=2, ttl_s=60),
                               timeout=10).session_id
        outcome: list = []

        def read():
            try:
                outcome.extend(stub.Stream(muxer_pb2.FetchRequest(session_id=sid), timeout=30))
            except grpc.RpcError as err:
                outcome.append(err)

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.3)   # the reader waits on an empty stream
        assert stub.Abort(muxer_pb2.AbortRequest(session_id=sid, reason="test"), timeout=10).existed
        t.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], grpc.RpcError), outcome
        assert outcome[0].code() == grpc.StatusCode.UNAVAILABLE and "aborted: test" in outcome[0].details()


def test_realtime_websocket_streams_the_fmp4_as_vllm_omni_clients_read_it(stack):
    """vLLM-Omni's WS /v1/realtime/video protocol, as its streaming_video_client sends and reads it: session.start,
    video.start, chunk metadata + binary frames, session.done; the frames decode to the job's MP4."""
    from websockets.sync.client import connect

    url = stack.http.replace("http://", "ws://") + "/v1/realtime/video"
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.start", "format": "m4s", **REQUEST}))
        start = json.loads(ws.recv(timeout=60))
        assert start["type"] == "video.start" and start["format"] == "m4s", start
        assert start["config"]["num_frames"] == 124 and start["config"]["width"] == 320
        ws.send(json.dumps({"type": "session.ping"}))
        ws.send(json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "a gull"}}}))
        live, metas, pong, refused = bytearray(), [], False, None
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, bytes):
                assert metas and metas[-1]["byte_length"] == len(msg)
                live += msg
                continue
            msg = json.loads(msg)
            if msg["type"] == "video.chunk_metadata":
                assert msg["transport_chunk_index"] == len(metas)
                metas.append(msg)
            elif msg["type"] == "session.pong":
                pong = True
            elif msg["type"] == "error":
                refused = msg
            elif msg["type"] == "session.done":
                done = msg
                break
    assert pong and refused is not None and "one clip per request" in refused["message"]
    assert done == {"type": "session.done", "request_id": start["request_id"], "chunks": len(metas), "stopped": False}
    assert live[4:8] == b"ftyp" and live.count(b"moof") > 2
    with httpx.Client(base_url=stack.http, timeout=60) as http:
        job = http.get(f"/v1/videos/{start['request_id']}").json()
        assert job["status"] == "completed"
        _assert_same_media(bytes(live), http.get(f"/v1/videos/{start['request_id']}/content").content)
    with connect(url, open_timeout=30) as ws:   # bad input: an error naming the field, the socket closed
        ws.send(json.dumps({"type": "session.start", **dict(REQUEST, seconds=99)}))
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["param"] == "seconds" and err["request_id"] is None, err
