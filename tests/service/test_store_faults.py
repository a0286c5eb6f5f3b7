"""The job store failing under a running gateway (issue 21 item 3): a full `--jobs-dir` (a small tmpfs this test
mounts and unmounts) and an S3 server that stops while a job finishes. A store error never stops a worker or the
sweeper: the job fails retryable naming `job-store` (503, as the S3 store's), admission answers the same 503, the
store's health is reported, and once space is back everything works again; a finished MP4 whose upload fails is
kept and uploaded when the store is back."""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import threading
import time

import pytest

from h3serve.config.stage import StageConfig
from h3serve.errortable import classify
from h3serve.services.gateway import jobs as jobs_module
from h3serve.services.gateway.jobs import JobTable
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.sinks import FileSink
from h3serve.services.gateway.store import S3Store, StoreError

from .s3server import S3Server


def _validated():
    from h3serve.config.request import validate_request
    from h3serve.services.gateway.fields import Validated

    return Validated(validate_request(prompt="p", seconds=5, width=320, height=256, steps=4), {}, "m")


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, mounted for this test and always unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> str:
    """Fill the file system of `path` to the last byte; the filler's path."""
    filler = os.path.join(path, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (65536, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def _write_mp4(job, data: bytes) -> None:
    job.sink.begin(len(data))
    job.sink.write(0, data)


def test_a_full_jobs_dir_fails_jobs_retryably_and_stops_nothing(small_disk, monkeypatch):
    monkeypatch.setattr(jobs_module, "SWEEP_INTERVAL_S", 0.2)
    config = StageConfig.from_knobs(jobs_dir=str(small_disk / "jobs"), port=3001)
    table = JobTable(config, GatewayMetrics())
    table.start()
    try:
        def new():
            return table.new(_validated(), kind="http", owner="alice",
                             sink_factory=lambda j: FileSink(table.mp4_path(j)))

        running = table.admit(new(), {})
        queued = table.admit(new(), {})
        assert table.take() is running
        filler = fill(small_disk)

        # admission: the same retryable 503 naming job-store the S3 store gives, not a 500
        with pytest.raises(StoreError) as info:
            table.admit(new(), {})
        c = classify(info.value)
        assert (c.kind.http, c.kind.retryable, c.stage) == (503, True, "job-store"), c
        assert "No space left on device" in c.message and "errno 28" in c.message
        assert table.admitting == {} and table.store_healthy is False

        # the running job cannot write its MP4: it fails retryable naming job-store; its record waits
        with pytest.raises(StoreError) as info:
            _write_mp4(running, b"x" * 4096 * 64)
        table.finish(running, info.value)
        assert running.finished and running.status == "failed" and not running.persisted
        assert (running.error.kind.http, running.error.stage, running.error.kind.retryable) == (503, "job-store",
                                                                                                True)
        assert not os.path.exists(running.output_path + ".part")   # what it had written is given back
        # the next job is taken (its started record cannot be written either) and ends the same way
        assert table.take() is queued and queued.status == "in_progress"
        table.finish(queued, StoreError("x"))
        time.sleep(0.6)                                            # sweeps fail against the full disk
        assert table._sweeper.is_alive() and table.store_error and "No space left" in table.store_error

        # space is back: the next sweep writes the waiting records, the store is healthy, a job completes
        os.unlink(filler)
        end = time.monotonic() + 5
        while not (table.store_healthy and running.persisted and queued.persisted):
            assert time.monotonic() < end, table.store_error
            time.sleep(0.05)
        rec = table.store.get_record(running.id)
        assert rec["status"] == "failed" and rec["error"]["stage"] == "job-store" and rec["error"]["retryable"]
        job = table.admit(new(), {})
        assert table.take() is job
        _write_mp4(job, b"an mp4")
        table.finish(job, None)
        assert table.get(job.id, "alice").status == "completed" and table.mp4(job).size == 6
    finally:
        table.close()


def test_a_finished_mp4_is_kept_and_uploaded_when_the_s3_store_is_back(tmp_path):
    s3 = S3Server(tmp_path / "s3")
    try:
        config = StageConfig.from_knobs(job_store="s3://h3serve-jobs/kept", jobs_dir=str(tmp_path / "sp"), port=3002)
        store = S3Store(config.gateway.job_store, config.gateway.jobs_dir, env=s3.env, timeout_s=(1.0, 1.0))
        table = JobTable(config, GatewayMetrics(), store=store)
        table.store.beat(table.instance, table.boot)
        job = table.admit(table.new(_validated(), kind="http", owner="alice",
                                    sink_factory=lambda j: FileSink(table.mp4_path(j))), {})
        assert table.take() is job
        data = os.urandom(200_000)
        _write_mp4(job, data)
        s3.stop()                                    # the outage lands as the job finishes
        t0 = time.monotonic()
        table.finish(job, None)
        assert time.monotonic() - t0 < 15
        assert not job.finished and job.upload_pending and job.stage == "upload"
        with open(job.output_path, "rb") as f:       # kept, whole
            assert f.read() == data
        assert table.get(job.id, "alice").status == "in_progress" and not table.store_healthy
        with pytest.raises(StoreError):
            table.sweep_once()                       # still down: nothing lost, tried again later
        assert job.upload_pending and os.path.exists(job.output_path)
        s3.start()
        table.sweep_once()
        assert job.finished and job.status == "completed" and not job.upload_pending
        assert not os.path.exists(job.output_path)   # the spooled copy goes once uploaded
        mp4 = table.mp4(table.get(job.id, "alice"))
        assert mp4.size == len(data) and b"".join(mp4.chunks) == data
        assert table.store.get_record(job.id)["status"] == "completed" and table.store_healthy
        table.close()
    finally:
        s3.close()


def test_a_cancelled_upload_ends_the_job_and_frees_its_mp4(tmp_path, monkeypatch):
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), port=3003)
    table = JobTable(config, GatewayMetrics())
    table.store.beat(table.instance, table.boot)
    job = table.admit(table.new(_validated(), kind="http", sink_factory=lambda j: FileSink(table.mp4_path(j))), {})
    table.take()
    _write_mp4(job, b"mp4")
    monkeypatch.setattr(table.store, "publish", lambda *a: (_ for _ in ()).throw(StoreError("down")))
    table.finish(job, None)
    assert job.upload_pending
    waiter = threading.Thread(target=table.delete, args=(job.id,))
    waiter.start()
    time.sleep(0.2)
    table.sweep_once()
    waiter.join(10)
    assert job.finished and job.error.kind.code == "cancelled" and not os.path.exists(job.output_path)
    assert table.store.get_record(job.id) is None
    table.close()


def test_ready_reports_the_job_stores_health():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from h3serve.services.gateway.http import create_app

    jobs = SimpleNamespace(queue=[], running={}, store_error=None)
    gateway = SimpleNamespace(metrics=GatewayMetrics(), ready=lambda: True,
                              store_ready=lambda: jobs.store_error is None,
                              stages=SimpleNamespace(status={"dit": "SERVING"}), draining=False, jobs=jobs,
                              transports=SimpleNamespace(details=lambda: {}), config=StageConfig())
    client = TestClient(create_app(gateway))
    r = client.get("/ready")
    assert r.status_code == 200 and r.json()["job_store"] == "ok"
    jobs.store_error = "job-store: stage unavailable: could not write a job record in /j: No space left on device"
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "not_ready"
    assert "No space left" in r.json()["job_store"]
