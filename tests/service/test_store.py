"""Durable jobs (DESIGN §7): HTTP job records and finished MP4s in a real S3-compatible server (versitygw on
loopback) or on local disk. A kill -9 of the gateway loses no finished job and fails the in-flight one with its
reason; a graceful stop keeps every MP4; the S3 server restarting makes calls fail with 503 naming the job store,
never 500, and they work again once it is back; retention deletes expired jobs from the store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from h3serve.config.stage import StageConfig
from h3serve.errors import QueueFull
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
        running = httpx.post(f"{stack.http}/v1/videos", json=dict(REQUEST, seconds=14), timeout=30).json()
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

        # the server paused while a POST writes its record: that call waits, the gateway's event loop does not
        # (liveness and store-free calls answer), and the POST goes through once the server resumes
        posted: dict = {}
        os.kill(s3.proc.pid, signal.SIGSTOP)
        try:
            poster = threading.Thread(daemon=True, target=lambda: posted.update(
                r=httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=60)))
            poster.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            for path in ("/health", "/v1/models"):
                assert httpx.get(f"{stack.http}{path}", timeout=5).status_code == 200
            loop_s = time.monotonic() - t0
            assert loop_s < 1.0 and poster.is_alive(), (loop_s, posted)
        finally:
            os.kill(s3.proc.pid, signal.SIGCONT)
        poster.join(60)
        assert posted["r"].status_code == 200, posted["r"].text
        wait_status(stack.http, posted["r"].json()["id"], {"completed"})
        s3.stop()
        for call in (lambda: httpx.get(f"{stack.http}/v1/videos/{first['id']}", timeout=30),
                     lambda: httpx.get(f"{stack.http}/v1/videos", timeout=30),
                     lambda: httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30)):
            t0 = time.monotonic()
            r = call()
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["stage"] == "job-store" and err["retryable"] and "could not" in err["message"]
            assert r.headers["retry-after"] == "5"
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

    req = validate_request(prompt="p", seconds=5, width=320, height=256, steps=4)
    return {"id": jid, "owner": None, "status": "completed", "progress": 100.0, "stage": "", "created_at": 1.0,
            "started_at": 1.0, "completed_at": completed_at, "request": req.to_dict(), "names": {}, "model": "m",
            "timings": {}, "error": None, "mp4_bytes": 3, "sha256": "", "gateway": "h:1", "boot": "b",
            "cancel_requested": False}


@pytest.mark.parametrize("backend", ["s3", "disk"])
def test_retention_deletes_expired_and_excess_jobs_from_the_store(s3, tmp_path, backend):
    config = StageConfig.from_knobs(job_ttl_s=100.0, max_jobs=2,
                         **({"job_store": "s3://h3serve-jobs/ttl", "jobs_dir": str(tmp_path / "spool")}
                            if backend == "s3" else {"jobs_dir": str(tmp_path / "jobs")}))
    store = S3Store(config.gateway.job_store, config.gateway.jobs_dir, env=s3.env) if backend == "s3" else None
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


def _table(config: StageConfig, s3: S3Server | None, port: int) -> JobTable:
    from dataclasses import replace

    config = config.replace(port=port)
    store = S3Store(config.gateway.job_store, config.gateway.jobs_dir, env=s3.env) if s3 is not None else None
    table = JobTable(config, GatewayMetrics(), store=store)
    table.store.beat(table.instance, table.boot)
    return table


def _validated():
    from h3serve.config.request import validate_request
    from h3serve.services.gateway.fields import Validated

    return Validated(validate_request(prompt="p", seconds=5, width=320, height=256, steps=4), {}, "m")


def test_replicas_share_the_store_see_and_cancel_each_others_jobs(s3, tmp_path):
    """Two gateway replicas on one bucket: B lists and reads the job A runs, a cancel sent to B reaches A through
    the record, and a job of a replica that stops beating ends failed with the reason when B reads it."""
    config = StageConfig.from_knobs(job_store="s3://h3serve-jobs/replicas", jobs_dir=str(tmp_path / "spool"))
    a, b = _table(config, s3, 1001), _table(config, s3, 1002)
    job = a.admit(a.new(_validated(), kind="http"), {})
    assert a.take() is job
    seen = b.get(job.id)
    assert seen.status == "in_progress" and [j.id for j in b.list()] == [job.id]
    assert b.cancel(job.id) is True
    a.sweep_once()                                   # A reads the cancel from the record
    assert job.cancel_requested.is_set()
    a.finish(job, job.cancelled())
    assert b.get(job.id).status == "failed" and b.get(job.id).error.kind.code == "cancelled"

    # a replica that stopped: its heartbeat goes stale, its in-flight job fails for good when read
    stale = a.admit(a.new(_validated(), kind="http"), {})
    a.take()
    a.store.beat(a.instance, a.boot)
    rec = a.store.get_record(stale.id)
    a.store._put_json(a.store._key("gateways", a.instance, ".json"), {"boot": a.boot, "at": time.time() - 600})
    failed = b.get(stale.id)
    assert failed.status == "failed" and "no heartbeat" in failed.error.message and rec["status"] == "in_progress"
    assert b.store.get_record(stale.id)["status"] == "failed"    # written back once
    a.close()
    b.close()


def test_disk_store_keeps_jobs_across_a_restart_and_fails_the_orphans(tmp_path):
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), port=1003)
    first = _table(config, None, 1003)
    done = first.admit(first.new(_validated(), kind="http"), {})
    first.take()
    path = first.mp4_path(done)
    with open(path, "wb") as f:
        f.write(b"an mp4")
    first.finish(done, None)
    inflight = first.admit(first.new(_validated(), kind="http"), {})
    first.take()
    # no close(): the process died. A new one on the same directory and port has another boot id.
    second = _table(config, None, 1003)
    assert second.get(done.id).status == "completed" and second.mp4(second.get(done.id)).size == 6
    lost = second.get(inflight.id)
    assert lost.status == "failed" and "restarted" in lost.error.message and lost.error.stage == "gateway"
    second.close()
    assert os.path.exists(path)


def test_half_written_mp4s_of_a_dead_process_are_swept(tmp_path):
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), port=1004)
    dead = _table(config, None, 1004)
    job = dead.admit(dead.new(_validated(), kind="http"), {})
    dead.take()
    part = dead.mp4_path(job) + ".part"
    with open(part, "wb") as f:
        f.write(b"half an mp4")
    alive = _table(config, None, 1004)                  # restarted: the job is an orphan
    alive.sweep_once()
    assert not os.path.exists(part) and alive.get(job.id).status == "failed"
    alive.close()


def test_a_hung_gateway_is_restarted_and_its_jobs_end_failed_not_lost(tiny_checkpoint, tmp_path):
    """SIGSTOP of the gateway (disk store, --jobs-dir): the launcher's liveness probe kills and restarts it; the
    finished job is served again, the in-flight one reads failed with the reason."""
    stack = Stack(tiny_checkpoint, "--queue-size", "2", "--grace-s", "10", "--jobs-dir", str(tmp_path / "jobs"))
    try:
        done = httpx.post(f"{stack.http}/v1/videos", json=REQUEST, timeout=30).json()
        first = wait_status(stack.http, done["id"], {"completed"})
        pid = stack.events[0]["stages"]["gateway"]["pid"]
        running = httpx.post(f"{stack.http}/v1/videos", json=dict(REQUEST, seconds=14), timeout=30).json()
        wait_status(stack.http, running["id"], {"in_progress"})
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        end = t0 + 60
        while not any(e.get("event") == "restarted" and e.get("stage") == "gateway" for e in stack.events):
            assert time.monotonic() < end, stack.events
            time.sleep(0.1)
        restarted = time.monotonic() - t0
        assert any(e.get("event") == "hung" and e.get("pid") == pid for e in stack.events)
        stack.wait_ready()
        assert wait_status(stack.http, done["id"], {"completed"}, timeout=10)["sha256"] == first["sha256"]
        lost = wait_status(stack.http, running["id"], {"failed"}, timeout=10)
        assert lost["error"]["stage"] == "gateway" and "restarted" in lost["error"]["message"]
    finally:
        assert stack.stop() == 0
    print("FIGURES", json.dumps({"gateway_sigstop_restarted_after_s": round(restarted, 2)}))


def test_a_hung_store_holds_up_only_the_admissions_writing_to_it(s3, tmp_path, monkeypatch):
    """The S3 server paused (SIGSTOP) while two HTTP jobs' admissions write their records and a queued HTTP job's
    cancel writes its record: those alone wait. Meanwhile a gRPC job is admitted and taken by the worker, the slots the stuck ones reserved still count (the
    next is refused at once), a running job is cancelled and read — each at once, where a lock held across the
    write made them wait the whole bound. The stuck ones end with a 503 naming the job store within the client's
    bound (read timeout 1 s, two retries) and their slots are free again. A record the server took late (once
    resumed) is written failed with the reason by the next sweep, never left queued; a caller retrying its
    request_id is admitted; the cancelled job's record is written by the sweep."""
    config = StageConfig.from_knobs(job_store="s3://h3serve-jobs/hung", jobs_dir=str(tmp_path / "spool"), max_inflight=1,
                         queue_size=3)
    config = config.replace(port=1005)
    store = S3Store(config.gateway.job_store, config.gateway.jobs_dir, env=s3.env, timeout_s=(1.0, 1.0))
    table = JobTable(config, GatewayMetrics(), store=store)
    table.store.beat(table.instance, table.boot)
    running = table.admit(table.new(_validated(), kind="http"), {})
    assert table.take() is running
    queued = table.admit(table.new(_validated(), kind="http"), {})
    stuck = [table.new(_validated(), kind="http"), table.new(_validated(), kind="http", request_id="retried-1")]
    ids = {j.id for j in stuck}
    real_get = store.get_record   # the id check reads nothing for these: the pause lands on their writes
    monkeypatch.setattr(store, "get_record", lambda jid: None if jid in ids else real_get(jid))
    outcome: dict = {}

    def admit(job):
        t0 = time.monotonic()
        try:
            table.admit(job, {})
        except StoreError as exc:
            outcome[job.id] = (exc, time.monotonic() - t0)

    pid = s3.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        writers = [threading.Thread(target=admit, args=(j,), daemon=True) for j in stuck]
        writers.append(threading.Thread(target=table.cancel, args=(queued.id,), daemon=True))
        for w in writers:
            w.start()
        time.sleep(0.3)                                   # inside their puts now
        assert all(w.is_alive() for w in writers), outcome
        t0 = time.monotonic()
        grpc_job = table.admit(table.new(_validated(), kind="stream"), {})
        admitted_s = time.monotonic() - t0
        assert admitted_s < 0.5, f"a store-free admission waited {admitted_s:.2f}s"
        assert queued not in table.queue and not queued.finished, "the cancel of a queued job did not take it out"
        with pytest.raises(QueueFull):                    # 1 running + 2 reserved + 1 queued = capacity 4
            table.admit(table.new(_validated(), kind="stream"), {})
        assert table.take() is grpc_job                   # the worker takes the next job
        assert table.cancel(running.id) is True and running.cancel_requested.is_set()
        assert table.get(running.id) is running and [j.id for j in table.queue] == []
        others_s = time.monotonic() - t0
        still_stuck = all(w.is_alive() for w in writers)
        for w in writers:
            w.join(15)                                    # the store stays paused for the whole bound
    finally:
        os.kill(pid, signal.SIGCONT)
    assert others_s < 0.5 and still_stuck, (others_s, outcome)
    for job in stuck:
        exc, took = outcome[job.id]
        assert exc.stage == "job-store" and "could not write a job record" in str(exc), exc
        assert 1.0 < took < 10.0, outcome
        assert job.id not in table.admitting and job.id not in table.jobs and job.id in table.refused

    # the server, resumed, may still apply the PUTs it had buffered
    monkeypatch.undo()
    end = time.monotonic() + 5
    while not all(late := [real_get(j.id) for j in stuck]) and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(0.3)                                       # its retries' PUTs too
    retry = table.admit(table.new(_validated(), kind="http", request_id="retried-1"), {})
    assert queued.finished and not queued.persisted      # its cancel's write failed: the sweep writes it
    table.sweep_once()
    assert real_get(queued.id)["status"] == "failed" and real_get(queued.id)["error"]["code"] == "cancelled"
    assert list(table.refused) == [stuck[0].id]           # watched until two sweeps find it settled
    table.sweep_once()
    table.sweep_once()
    assert table.refused == {}
    rec = real_get(stuck[0].id)
    if late[0] is not None:
        assert late[0]["status"] == "queued" and rec["status"] == "failed", rec
        assert rec["error"]["stage"] == "job-store" and "refused (503) and never ran" in rec["error"]["message"]
    else:
        assert rec is None
    assert real_get("retried-1")["status"] == "queued" and table.get("retried-1") is retry
    print("FIGURES", json.dumps({"hung_store_other_ops_s": round(others_s, 3),
                                 "hung_store_admission_503_after_s": [round(outcome[j.id][1], 2) for j in stuck],
                                 "late_records_landed": [r is not None for r in late]}))

    # nothing lost: the running job ends cancelled, the gRPC one completed
    table.finish(running, running.cancelled())
    table.finish(grpc_job, None)
    assert table.get(running.id).status == "failed" and table.get(running.id).error.kind.code == "cancelled"
    assert grpc_job.status == "completed"
    table.close()


def test_a_drain_during_an_admissions_write_fails_the_job_with_its_record(tmp_path, monkeypatch):
    """SIGTERM's drain lands while an admission writes its record (no lock held then): the job is not queued; it
    ends failed (draining) as a queued one does, and its record says so."""
    table = _table(StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs")), None, 1006)
    real_put = table.store.put_record
    monkeypatch.setattr(table.store, "put_record", lambda rec: (table.drain(), real_put(rec)))
    job = table.admit(table.new(_validated(), kind="http"), {})
    assert job.finished and job.status == "failed" and job.error.kind.code == "draining", job.error
    assert list(table.queue) == [] and table.admitting == {}
    rec = table.store.get_record(job.id)
    assert rec["status"] == "failed" and rec["error"]["code"] == "draining"
    table.close()


@pytest.mark.parametrize("backend", ["s3", "disk"])
def test_listing_pages_from_the_index_on_both_stores(s3, tmp_path, backend):
    """Issue 21: listing read every record on every call. Now a page is read from the index (entry names, newest
    first), and only its records are fetched; deleted and expired jobs leave it; records written before the index
    existed are indexed once, on first use."""
    config = StageConfig.from_knobs(job_ttl_s=100.0, max_jobs=1000,
                         **({"job_store": "s3://h3serve-jobs/index", "jobs_dir": str(tmp_path / "spool")}
                            if backend == "s3" else {"jobs_dir": str(tmp_path / "jobs")}))
    store = S3Store(config.gateway.job_store, config.gateway.jobs_dir, env=s3.env) if backend == "s3" else None
    table = JobTable(config, GatewayMetrics(), store=store)
    now = time.time()
    recs = [{**_finished_record(f"video_{i:03d}", now - (500 if i == 3 else 10)), "owner": "ab"[i % 2],
             "created_at": now - 100 + i} for i in range(30)]
    for rec in recs:
        table.store.put_record(rec)
    mine = [r["id"] for r in recs if r["owner"] == "a"]
    read = []
    real = table.store.get_record
    table.store.get_record = lambda jid: (read.append(jid), real(jid))[1]
    page, more = table.page("a", 4)
    assert [j.id for j in page] == mine[::-1][:4] and more and len(read) <= 5, read
    page, more = table.page("a", 100, after=mine[-5], order="desc")
    assert [j.id for j in page] == mine[::-1][5:] and not more
    page, _ = table.page("a", 3, after=mine[1], order="asc")
    assert [j.id for j in page] == mine[2:5]
    assert [j.id for j in table.page(None, 100, order="asc")[0]] == [r["id"] for r in recs]
    table.store.get_record = real
    table.delete(mine[0], "a")
    table.sweep_once()                      # video_003 (Bob's) expired
    assert [j.id for j in table.list("a")] == mine[1:]
    assert "video_003" not in [j.id for j in table.list("b")]
    entries = list(table.store.index_entries(None))
    assert len(entries) == 28 and mine[0] not in str(entries) and "video_003" not in str(entries)
    table.close()
