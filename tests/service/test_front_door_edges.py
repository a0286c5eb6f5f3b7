"""The smaller front-door holes of issue 21 (item 6): two Authorization headers, a 405 without Allow, `--no-auth`
starting silently, malformed WAVs and a sink port of non-ASCII digits answering 500, a client leaving
`/v1/videos/sync` not cancelling its job, Range errors as text. Each is now a clear 4xx (or INVALID_ARGUMENT) naming
what is wrong, `--no-auth` says what it does, and the sync job is cancelled."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from h3serve.config.request import Upload
from h3serve.config.stage import StageConfig
from h3serve.errors import RequestError, Unauthenticated
from h3serve.errortable import classify
from h3serve.runtime.tls import check_peer, parse_peers
from h3serve.runtime.prechecks import check_exposure
from h3serve.services.gateway.auth import Authenticator
from h3serve.services.gateway.http import create_app
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.uploads import _audio


@pytest.fixture
def app(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{n} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n"
                            for n, k in (("alice", "alice-key"), ("bob", "bob-key"))))
    jobs = SimpleNamespace(queue=[], running={}, store_error=None, list=lambda owner: [],
                           page=lambda owner, limit, after, order: ([], False))
    gateway = SimpleNamespace(metrics=GatewayMetrics(), ready=lambda: True, store_ready=lambda: True,
                              stages=SimpleNamespace(status={}), draining=False, jobs=jobs,
                              transports=SimpleNamespace(details=lambda: {}), config=StageConfig())
    return TestClient(create_app(gateway, Authenticator(str(keys))))


def test_two_authorization_headers_are_refused(app):
    assert app.get("/v1/videos", headers={"Authorization": "Bearer alice-key"}).status_code == 200
    for pair in (("alice-key", "bob-key"), ("alice-key", "alice-key"), ("nope", "alice-key")):
        r = app.get("/v1/videos", headers=[("Authorization", f"Bearer {k}") for k in pair])
        assert r.status_code == 401, r.text
        assert "2 Authorization headers: send exactly one" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    auth = Authenticator(None)
    assert auth.caller_of((("authorization", "Bearer a"), ("authorization", "Bearer b"))) is None   # auth off


def test_two_authorization_metadata_entries_are_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alice sha256:{hashlib.sha256(b'alice-key').hexdigest()}\n")
    auth = Authenticator(str(keys))
    assert auth.caller_of((("authorization", "Bearer alice-key"),)) == "alice"
    with pytest.raises(Unauthenticated, match="2 'authorization' metadata entries: send exactly one"):
        auth.caller_of((("authorization", "Bearer alice-key"), ("authorization", "Bearer other")))


def test_a_405_says_which_methods_are_allowed(app):
    r = app.put("/v1/videos", headers={"Authorization": "Bearer alice-key"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
    r = app.patch("/health")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_no_auth_says_what_it_does(caplog):
    with caplog.at_level(logging.WARNING, logger="h3serve.gateway"):
        check_exposure(None, True, ("0.0.0.0",))
    assert any("--no-auth" in r.getMessage() and "without an API key" in r.getMessage() and "0.0.0.0" in
               r.getMessage() for r in caplog.records), caplog.text


def wav(channels=1, rate=32000, bits=16, fmt=1, data=b"\0\0" * 100) -> bytes:
    fmtc = struct.pack("<HHIIHH", fmt, channels, rate, rate * channels * bits // 8, channels * bits // 8, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmtc)) + fmtc + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("name,data", [
    ("0 bits per sample", wav(bits=0)),
    ("WAVE_FORMAT_EXTENSIBLE without its extension", wav(fmt=0xFFFE)),
    ("no samples", wav(data=b"")),
    ("float samples that are NaN", wav(fmt=3, bits=32, data=b"\x00\x00\xc0\x7f" * 100)),
])
def test_malformed_wavs_are_refused_naming_the_field(name, data):
    with pytest.raises(RequestError) as info:
        _audio(Upload(data, "audio_reference", "a.wav"), "audio_reference", 32000 * 60)
    c = classify(info.value)
    assert c.field == "audio_reference" and c.kind.http == 400 and "Traceback" not in c.message, name


@pytest.mark.parametrize("peers", [None, "127.0.0.1:50051"])
@pytest.mark.parametrize("port", ["\u00b2", "\u0665\u0660", "\uff15\uff10", "0", "65536"])
def test_a_sink_port_of_other_digits_is_refused_naming_the_field(peers, port):
    with pytest.raises(RequestError) as info:
        check_peer(parse_peers(peers), f"127.0.0.1:{port}", "sink.address")
    assert classify(info.value).field == "sink.address"
    if not port.isascii():   # nor is such a port a --peers item
        with pytest.raises(RequestError, match="peers"):
            parse_peers(f"127.0.0.1:{port}")


# -- on a real front door (uvicorn, in this process) -------------------------------------------------------------

def test_leaving_sync_cancels_the_job(tmp_path):
    """A client that leaves POST /v1/videos/sync has its job cancelled (Starlette's BaseHTTPMiddleware kept
    `is_disconnected()` from ever firing: the job ran on for nobody)."""
    from .test_upload_caps import start_front

    front = start_front(tmp_path)
    try:
        front.gateway.stages.not_ready = lambda profile=None: {}   # admitted; no worker takes it: it waits queued
        body = json.dumps({"prompt": "a kite", "seconds": 5, "size": "320x256"}).encode()
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/videos/sync HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice-key\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            end = time.monotonic() + 20
            while not front.gateway.jobs.jobs and time.monotonic() < end:
                time.sleep(0.05)
            (job,) = front.gateway.jobs.jobs.values()
            assert job.status == "queued"
        t0 = time.monotonic()
        while job.status != "failed" and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert job.status == "failed" and job.error.kind.code == "cancelled", (job.status, job.error)
        assert "the HTTP client disconnected" in job.error.message
        assert front.gateway.jobs.store.get_record(job.id)["status"] == "failed"
        print("FIGURES", {"cancelled_after_s": round(time.monotonic() - t0, 3)})
    finally:
        front.stop()


def test_range_errors_are_the_error_object(tmp_path):
    from .test_upload_caps import start_front

    front = start_front(tmp_path)
    try:
        job = front.gateway.new_job({"prompt": "p", "seconds": 5, "size": "320x256"}, kind="http", owner="alice")
        front.gateway.jobs.store.put_record({**job.record(), "status": "completed", "progress": 100.0,
                                             "completed_at": time.time()})
        with open(front.gateway.jobs.store.spool_path(job.id), "wb") as f:
            f.write(bytes(range(256)) * 4)   # 1,024 bytes stand in for the MP4
        url, auth = f"{front.url}/v1/videos/{job.id}/content", {"Authorization": "Bearer alice-key"}
        r = httpx.get(url, headers={**auth, "Range": "bytes=10-19"}, timeout=10)
        assert r.status_code == 206 and r.content == bytes(range(10, 20))
        r = httpx.get(url, headers={**auth, "Range": "bytes=5000-"}, timeout=10)
        assert r.status_code == 416 and r.headers["content-range"] == "bytes */1024", r.text
        err = r.json()["error"]
        assert err["param"] == "Range" and err["code"] == "range_not_satisfiable" and "1,024 bytes" in err["message"]
        for bad in ("bytes=9-3", "pages=1-2", "bytes"):
            r = httpx.get(url, headers={**auth, "Range": bad}, timeout=10)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (bad, r.text)
            assert r.json()["error"]["param"] == "Range", bad
    finally:
        front.stop()


def test_the_realtime_websocket_needs_a_key(app):
    from starlette.websockets import WebSocketDisconnect

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(WebSocketDisconnect) as e:
            with app.websocket_connect("/v1/realtime/video", headers=headers):
                pass
        assert e.value.code == 1008
