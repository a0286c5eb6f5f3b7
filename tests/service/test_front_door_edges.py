"""The smaller front-door holes of issue 21 (item 6): two Authorization headers, a 405 without Allow, `--no-auth`
starting silently, malformed WAVs and a sink port of non-ASCII digits answering 500. Each is now a clear 4xx (or
INVALID_ARGUMENT) naming what is wrong, and `--no-auth` says what it does."""

from __future__ import annotations

import hashlib
import logging
import struct
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from h3serve.config.request import Upload
from h3serve.config.stage import StageConfig
from h3serve.errors import RequestError
from h3serve.errortable import Unauthenticated, classify
from h3serve.runtime.tls import check_peer, parse_peers
from h3serve.services.gateway.auth import Authenticator, check_exposure
from h3serve.services.gateway.http import create_app
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.uploads import _audio


@pytest.fixture
def app(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{n} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n"
                            for n, k in (("alice", "alice-key"), ("bob", "bob-key"))))
    jobs = SimpleNamespace(queue=[], running={}, store_error=None, list=lambda owner: [])
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
    assert c.field == "audio_reference" and c.kind.http == 422 and "Traceback" not in c.message, name


@pytest.mark.parametrize("peers", [None, "127.0.0.1:50051"])
@pytest.mark.parametrize("port", ["\u00b2", "\u0665\u0660", "\uff15\uff10", "0", "65536"])
def test_a_sink_port_of_other_digits_is_refused_naming_the_field(peers, port):
    with pytest.raises(RequestError) as info:
        check_peer(parse_peers(peers), f"127.0.0.1:{port}", "sink.address")
    assert classify(info.value).field == "sink.address"
    if not port.isascii():   # nor is such a port a --peers item
        with pytest.raises(RequestError, match="peers"):
            parse_peers(f"127.0.0.1:{port}")
