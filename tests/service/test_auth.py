"""Callers (DESIGN §7): bearer API keys from a file, held hashed and re-read when it changes, on HTTP and gRPC;
each job belongs to its caller. The matrix: no key, a wrong key, another caller's job, key rotation — on a real
stack (`h3serve serve --api-keys-file`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from h3serve.client import AlreadyExists, Client, PermissionDenied, Unauthenticated
from h3serve.errors import H3Error
from h3serve.runtime.prechecks import check_exposure
from h3serve.services.gateway.auth import Authenticator, KeysFileError

from .conftest import REPO, REQUEST, Stack

ALICE, ALICE2, BOB = "alice-key-0001", "alice-key-0002", "bob-key-0001"


def line(name: str, key: str) -> str:
    return f"{name} sha256:{hashlib.sha256(key.encode()).hexdigest()}\n"


def write_keys(path, *entries) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# callers\n" + "".join(line(n, k) for n, k in entries))
    os.replace(tmp, path)   # as a Secret volume swaps its files


def bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    keys = tmp_path_factory.mktemp("auth") / "keys"
    write_keys(keys, ("alice", ALICE), ("bob", BOB))
    s = Stack(tiny_checkpoint, "--queue-size", "2", "--grace-s", "10", "--api-keys-file", str(keys),
              "--jobs-dir", str(keys.parent / "jobs"))   # durable: a finished job is read back from the store
    s.keys = keys
    yield s
    assert s.stop() == 0


def test_http_matrix(keyed):
    http = keyed.http
    for key, why in ((None, "missing API key"), ("nope", "unknown API key")):
        r = httpx.get(f"{http}/v1/videos", headers=bearer(key), timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == "unauthenticated" and why in r.json()["error"]["message"]
    r = httpx.post(f"{http}/v1/videos", headers={"Authorization": "Basic YTpi"}, json=REQUEST, timeout=10)
    assert r.status_code == 401 and "Bearer KEY" in r.json()["error"]["message"]
    # probes and the API description need no key
    assert httpx.get(f"{http}/health", timeout=10).status_code == 200
    assert httpx.get(f"{http}/openapi.json", timeout=10).status_code == 200

    job = httpx.post(f"{http}/v1/videos", headers=bearer(ALICE), json=REQUEST, timeout=30).json()
    vid = job["id"]
    end = time.monotonic() + 120
    while httpx.get(f"{http}/v1/videos/{vid}", headers=bearer(ALICE), timeout=10).json()["status"] != "completed":
        assert time.monotonic() < end
        time.sleep(0.2)
    assert httpx.get(f"{http}/v1/videos/{vid}/content", headers=bearer(ALICE), timeout=30).status_code == 200

    # bob sees none of it
    assert httpx.get(f"{http}/v1/videos", headers=bearer(BOB), timeout=10).json()["data"] == []
    for method, path in (("GET", ""), ("GET", "/content"), ("POST", "/cancel"), ("DELETE", "")):
        r = httpx.request(method, f"{http}/v1/videos/{vid}{path}", headers=bearer(BOB), timeout=10)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "permission_denied" and "another caller" in r.json()["error"]["message"]
    assert [j["id"] for j in httpx.get(f"{http}/v1/videos", headers=bearer(ALICE), timeout=10).json()["data"]] \
        == [vid]

    # rotation: alice's second key added, then the first removed — no restart, her job stays hers
    write_keys(keyed.keys, ("alice", ALICE), ("alice", ALICE2), ("bob", BOB))
    end = time.monotonic() + 10
    while httpx.get(f"{http}/v1/videos/{vid}", headers=bearer(ALICE2), timeout=10).status_code != 200:
        assert time.monotonic() < end
        time.sleep(0.2)
    write_keys(keyed.keys, ("alice", ALICE2), ("bob", BOB))
    end = time.monotonic() + 10
    while httpx.get(f"{http}/v1/videos/{vid}", headers=bearer(ALICE), timeout=10).status_code != 401:
        assert time.monotonic() < end
        time.sleep(0.2)
    assert httpx.get(f"{http}/v1/videos/{vid}", headers=bearer(ALICE2), timeout=10).json()["status"] == "completed"
    assert httpx.delete(f"{http}/v1/videos/{vid}", headers=bearer(ALICE2), timeout=30).json()["deleted"] is True


def test_grpc_matrix(keyed):
    write_keys(keyed.keys, ("alice", ALICE2), ("bob", BOB))
    time.sleep(1.1)   # the file is looked at once a second
    for key, why in ((None, "missing API key"), ("nope", "unknown API key")):
        ch = grpc.insecure_channel(keyed.grpc)
        from h3serve._proto import gateway_pb2, gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayStub(ch)
        md = (("authorization", f"Bearer {key}"),) if key else ()
        with pytest.raises(grpc.RpcError) as info:
            stub.Info(gateway_pb2.InfoRequest(), metadata=md, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in info.value.details()
        ch.close()
        with Client(keyed.grpc, api_key=key or "") as client, pytest.raises(Unauthenticated):
            client.validate("a kite", seconds=5)
    with Client(keyed.grpc, api_key=BOB) as client:
        assert client.validate("a kite", seconds=5).num_frames == 124
        client.wait_ready(10)          # gRPC health needs no key
    # bob cannot cancel alice's live request; alice can
    fields = {k: v for k, v in REQUEST.items() if k != "prompt"} | {"seconds": 14}
    with Client(keyed.grpc, api_key=ALICE2) as alice, Client(keyed.grpc, api_key=BOB) as bob:
        gen = alice.stream("a kite", **fields)
        events = iter(gen)
        accepted = next(events)
        with pytest.raises(PermissionDenied, match="another caller"):
            bob.cancel(accepted.request_id)
        assert alice.cancel(accepted.request_id).cancelled
        with pytest.raises(H3Error):
            gen.result()


def test_another_callers_job_id_cannot_be_taken_to_delete_it(keyed):
    """Bob sends a gRPC request with the id of Alice's finished HTTP job (held only in the store): refused,
    ALREADY_EXISTS naming request_id; his DELETE and cancel of it are 403; her job and MP4 stay hers."""
    write_keys(keyed.keys, ("alice", ALICE2), ("bob", BOB))
    time.sleep(1.1)
    http = keyed.http
    vid = httpx.post(f"{http}/v1/videos", headers=bearer(ALICE2), json=REQUEST, timeout=30).json()["id"]
    end = time.monotonic() + 120
    while httpx.get(f"{http}/v1/videos/{vid}", headers=bearer(ALICE2), timeout=10).json()["status"] != "completed":
        assert time.monotonic() < end
        time.sleep(0.2)
    mp4 = httpx.get(f"{http}/v1/videos/{vid}/content", headers=bearer(ALICE2), timeout=30).content
    fields = {k: v for k, v in REQUEST.items() if k != "prompt"}
    with Client(keyed.grpc, api_key=BOB) as bob:
        with pytest.raises(AlreadyExists) as info:
            bob.generate_sync("a kite", request_id=vid, **fields)
        assert info.value.field == "request_id" and vid in str(info.value) and "alice" not in str(info.value)
        with pytest.raises(PermissionDenied):
            bob.cancel(vid)
    for method, path in (("DELETE", ""), ("POST", "/cancel")):
        r = httpx.request(method, f"{http}/v1/videos/{vid}{path}", headers=bearer(BOB), timeout=10)
        assert r.status_code == 403, r.text
    assert httpx.get(f"{http}/v1/videos/{vid}/content", headers=bearer(ALICE2), timeout=30).content == mp4
    assert httpx.delete(f"{http}/v1/videos/{vid}", headers=bearer(ALICE2), timeout=30).json()["deleted"] is True


def test_key_from_the_environment(keyed, monkeypatch):
    monkeypatch.setenv("H3SERVE_API_KEY", BOB)
    with Client(keyed.grpc) as client:
        assert client.validate("a kite", seconds=5).num_frames == 124


def test_keys_file_lines_and_reload(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sha256:" + "0" * 63 + "\n")
    with pytest.raises(KeysFileError, match=r"keys:1: expected 'NAME sha256:HEX'"):
        Authenticator(str(path))
    with pytest.raises(KeysFileError, match="No such file"):
        Authenticator(str(tmp_path / "missing"))
    write_keys(path, ("alice", ALICE))
    auth = Authenticator(str(path))
    assert auth.caller(f"Bearer {ALICE}") == "alice" and auth.caller(f"bearer  {ALICE} ") == "alice"
    path.write_text("not a key line\n")      # a broken edit keeps the keys read before
    auth._checked = 0.0
    assert auth.caller(f"Bearer {ALICE}") == "alice"
    assert Authenticator(None).caller(None) is None


def test_a_gateway_without_keys_listens_on_loopback_only(tmp_path):
    check_exposure(None, False, ("127.0.0.1", "::1", "localhost"))
    check_exposure(None, True, ("0.0.0.0",))
    check_exposure("keys", False, ("0.0.0.0",))
    with pytest.raises(H3Error, match=r"would listen on 0.0.0.0 without authentication: give --api-keys-file"):
        check_exposure(None, False, ("127.0.0.1", "0.0.0.0"))
    # the real process refuses to start, with that one line
    argv = [sys.executable, "-m", "h3serve.cli", "serve", "--stages", "gateway", "--host", "0.0.0.0", "--port", "0",
            "--http-port", "0", "--encoder", "127.0.0.1:9", "--dit", "127.0.0.1:9", "--vae", "127.0.0.1:9",
            "--muxer", "127.0.0.1:9"]
    env = {k: v for k, v in os.environ.items() if k != "H3SERVE_API_KEYS_FILE"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode != 0 and "without authentication" in out.stderr and "Traceback" not in out.stderr
