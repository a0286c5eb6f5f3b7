"""Durable jobs (DESIGN §7): HTTP job records and finished MP4s in a real S3-compatible server (versitygw on
loopback) or on local disk. A kill -9 of the gateway loses no finished job and fails the in-flight one with its
reason; a graceful stop keeps every MP4; the S3 server restarting makes calls fail with 503 naming the job store,
never 500, and they work again once it is back; retention deletes expired jobs from the store."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import httpx
import pytest

from h3serve.config.stage import StageConfig
from h3serve.services.gateway.jobs import JobTable
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.store import S3Store, StoreError

from .conftest import REQUEST, Stack
from .s3server import S3Server


@pytest.fixture
def s3(tmp_path):
    server = S3Server(tmp_path / "s3")
    yield server
    server.close()


def wait_status(http: str, vid: str, want: set[str], timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = httpx.get(f"{http}/v1/videos/{vid}", timeout=10)
        if r.status_code == 200 and r.json()["status"] in want:
            return r.json()
        time.sleep(0.1)
    raise TimeoutError(f"{vid} not {want} within {timeout}s: {r.status_code} {r.text[:300]}")


def stack_on(checkpoint, store_args, env_extra):
    old = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        return Stack(checkpoint, "--queue-size", "2", "--grace-s", "10", *store_args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_jobs_survive_gateway_kill9_and_graceful_restart(tiny_checkpoint, s3, tmp_path):
    store = ["--job-store", "s3://h3serve-jobs/run1", "--jobs-dir", str(tmp_path / "spool")]
    stack = stack_on(tiny_checkpoint, store, s3.env)
    try:
        done = httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30).json()
        job = wait_status(stack.http, done["id"], {"completed"})
        mp4 = httpx.get(f"{stack.http}/v1/videos/{done['id']}/content", timeout=30).content
        assert hashlib.sha256(mp4).hexdigest() == job["sha256"] and len(mp4) == job["mp4_bytes"]

        # a long job in flight, then kill -9 of the gateway: the launcher restarts it on the same ports
        pid = stack.events[0]["stages"]["gateway"]["pid"]
        running = httpx.post(f"{stack.http}/v1/videos", json=dict(REQUEST, seconds=15), timeout=30).json()
        wait_status(stack.http, running["id"], {"in_progress"})
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while not any(e.get("event") == "restarted" and e.get("stage") == "gateway" for e in stack.events):
            assert time.monotonic() < end, stack.events
            time.sleep(0.1)
        stack.wait_ready()

        again = wait_status(stack.http, done["id"], {"completed"}, timeout=10)
        assert again["sha256"] == job["sha256"]
        assert httpx.get(f"{stack.http}/v1/videos/{done['id']}/content", timeout=30).content == mp4
        lost = wait_status(stack.http, running["id"], {"failed"}, timeout=10)
        assert lost["error"]["code"] == "stage_unavailable" and lost["error"]["stage"] == "gateway"
        assert "restarted" in lost["error"]["message"] and "in_progress" in lost["error"]["message"]
        assert httpx.get(f"{stack.http}/v1/videos/{running['id']}/content", timeout=10).status_code == 409
        listed = {j["id"]: j["status"] for j in httpx.get(f"{stack.http}/v1/videos", timeout=10).json()["data"]}
        assert listed == {done["id"]: "completed", running["id"]: "failed"}
    finally:
        assert stack.stop() == 0

    # a graceful stop (drain) deletes nothing: a new gateway on the same store serves the same MP4
    stack = stack_on(tiny_checkpoint, store, s3.env)
    try:
        assert httpx.get(f"{stack.http}/v1/videos/{done['id']}/content", timeout=30).content == mp4
    finally:
        assert stack.stop() == 0


def test_s3_server_restart_gives_503_naming_the_store_then_recovers(tiny_checkpoint, s3, tmp_path):
    stack = stack_on(tiny_checkpoint, ["--job-store", "s3://h3serve-jobs/run2"], s3.env)
    try:
        first = httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30).json()
        wait_status(stack.http, first["id"], {"completed"})
        s3.stop()
        for call in (lambda: httpx.get(f"{stack.http}/v1/videos/{first['id']}", timeout=30),
                     lambda: httpx.get(f"{stack.http}/v1/videos", timeout=30),
                     lambda: httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30)):
            t0 = time.monotonic()
            r = call()
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["stage"] == "job-store" and err["retryable"] and "could not" in err["message"]
            assert time.monotonic() - t0 < 15
        s3.start()
        assert httpx.get(f"{stack.http}/v1/videos/{first['id']}", timeout=30).json()["status"] == "completed"
        second = httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30).json()
        assert wait_status(stack.http, second["id"], {"completed"})["mp4_bytes"] > 0
        assert httpx.get(f"{stack.http}/v1/videos/{second['id']}/content", timeout=30).status_code == 200
    finally:
        assert stack.stop() == 0


def _finished_record(jid: str, completed_at: float) -> dict:
    from h3serve.config.request import validate_request

    req = validate_request(prompt="p", seconds=4, width=320, height=256, steps=4)
    return {"id": jid, "owner": None, "status": "completed", "progress": 100.0, "stage": "", "created_at": 1.0,
            "started_at": 1.0, "completed_at": completed_at, "request": req.to_dict(), "names": {}, "model": "m",
            "timings": {}, "error": None, "mp4_bytes": 3, "sha256": "", "gateway": "h:1", "boot": "b",
            "cancel_requested": False}


@pytest.mark.parametrize("backend", ["s3", "disk"])
def test_retention_deletes_expired_and_excess_jobs_from_the_store(s3, tmp_path, backend):
    config = StageConfig(job_ttl_s=100.0, max_jobs=2,
                         **({"job_store": "s3://h3serve-jobs/ttl", "jobs_dir": str(tmp_path / "spool")}
                            if backend == "s3" else {"jobs_dir": str(tmp_path / "jobs")}))
    store = S3Store(config.job_store, config.jobs_dir, env=s3.env) if backend == "s3" else None
    table = JobTable(config, GatewayMetrics(), store=store)
    now = time.time()
    for i, age in enumerate((1000, 50, 40, 30)):   # one past the TTL; three recent, one past max_jobs
        rec = _finished_record(f"video_{i}", now - age)
        table.store.put_record(rec)
        path = table.store.spool_path(rec["id"])
        with open(path, "wb") as f:
            f.write(b"mp4")
        table.store.publish(rec["id"], path)
    table.sweep_once()
    left = sorted(r["id"] for r in table.store.records())
    assert left == ["video_2", "video_3"]
    assert table.store.open_mp4("video_0") is None and table.store.open_mp4("video_1") is None
    assert table.store.open_mp4("video_3").size == 3
    table.close()
    if backend == "disk":   # an explicit --jobs-dir is durable: closing keeps it
        assert sorted(os.listdir(tmp_path / "jobs" / "jobs")) == ["video_2.json", "video_3.json"]


def test_unreachable_store_is_a_store_error_in_seconds(tmp_path):
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="job-store: stage unavailable: could not reach the bucket"):
        S3Store("s3://h3serve-jobs", str(tmp_path), env=env)
    assert time.monotonic() - t0 < 10
