"""Whose job is it (DESIGN §7, issue 21 item 1): a gRPC caller's chosen `request_id` names a job in that caller's
own namespace and is refused when the durable store holds a job of that id; the HTTP verbs act on HTTP jobs only and
check the owner against the store, on every replica. Two gateway job tables on one real S3 server (versitygw on
loopback) or one `--jobs-dir`, two callers."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from h3serve.config.stage import StageConfig
from h3serve.errors import AlreadyExists, NotFound, PermissionDenied
from h3serve.errortable import classify
from h3serve.services.gateway.jobs import JobTable
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.services.gateway.store import S3Store

from .s3server import S3Server


@pytest.fixture(params=["s3", "disk"])
def replicas(request, tmp_path):
    """Two job tables (gateway replicas) on one store."""
    s3 = S3Server(tmp_path / "s3") if request.param == "s3" else None
    if s3 is not None:
        config = StageConfig.from_knobs(job_store="s3://h3serve-jobs/owners", jobs_dir=str(tmp_path / "spool"), queue_size=64)
    else:
        config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), queue_size=64)
    tables = []
    for port in (2001, 2002):
        c = config.replace(port=port)
        store = S3Store(c.gateway.job_store, c.gateway.jobs_dir + f"-{port}", env=s3.env) if s3 is not None else None
        t = JobTable(c, GatewayMetrics(), store=store)
        t.store.beat(t.instance, t.boot)
        tables.append(t)
    yield tables
    for t in tables:
        t.close()
    if s3 is not None:
        s3.close()


def _validated():
    from h3serve.config.request import validate_request
    from h3serve.services.gateway.fields import Validated

    return Validated(validate_request(prompt="p", seconds=5, width=320, height=256, steps=4), {}, "m")


def _completed(table: JobTable, owner: str):
    """An HTTP job of `owner`, run to completion with an MP4: afterwards held only in the store."""
    job = table.admit(table.new(_validated(), kind="http", owner=owner), {})
    assert table.take() is job
    with open(table.mp4_path(job), "wb") as f:
        f.write(b"alice's mp4")
    table.store.publish(job.id, job.output_path)   # what the sink's commit leads to
    table.finish(job, None)
    assert job.key not in table.jobs and table.store.get_record(job.id)["owner"] == owner
    return job


def test_another_callers_stored_job_id_is_refused_and_stays_theirs(replicas):
    """Bob submits gRPC requests with the id of Alice's finished job (in the store only) on either replica: refused
    409 / ALREADY_EXISTS naming request_id, not saying whose; he cannot get, download, cancel or delete it
    anywhere, and Alice still can."""
    a, b = replicas
    done = _completed(a, "alice")
    for table in (a, b):
        for kind in ("stream", "sync"):
            with pytest.raises(AlreadyExists) as info:
                table.admit(table.new(_validated(), kind=kind, request_id=done.id, owner="bob"), {})
            c = classify(info.value)
            assert (c.field, c.kind.http, c.kind.grpc.name) == ("request_id", 409, "ALREADY_EXISTS")
            assert done.id in c.message and "alice" not in c.message
        assert table.admitting == {} and table.jobs == {}
        for verb in (lambda: table.get(done.id, "bob"), lambda: table.delete(done.id, "bob"),
                     lambda: table.cancel(done.id, owner="bob"),
                     lambda: table.cancel(done.id, owner="bob", grpc_jobs=True)):
            with pytest.raises(PermissionDenied, match="another caller"):
                verb()
        assert [j.id for j in table.list("bob")] == [] and [j.id for j in table.list("alice")] == [done.id]
    # Alice's own gRPC request may not take the id either: it is an HTTP job's
    with pytest.raises(AlreadyExists):
        b.admit(b.new(_validated(), kind="stream", request_id=done.id, owner="alice"), {})
    assert b.get(done.id, "alice").status == "completed" and b.mp4(b.get(done.id, "alice")).size == 11
    assert b.delete(done.id, "alice").id == done.id and a.store.get_record(done.id) is None


def test_a_running_job_on_one_replica_is_not_cancelled_through_another(replicas):
    """Alice's HTTP job runs on A. Bob, on B, cannot take its id, cancel or delete it; A's sweep leaves it
    running."""
    a, b = replicas
    job = a.admit(a.new(_validated(), kind="http", owner="alice"), {})
    assert a.take() is job
    with pytest.raises(AlreadyExists):
        b.admit(b.new(_validated(), kind="stream", request_id=job.id, owner="bob"), {})
    with pytest.raises(AlreadyExists):   # on A too, where the id is live
        a.admit(a.new(_validated(), kind="stream", request_id=job.id, owner="bob"), {})
    for verb in (lambda: b.delete(job.id, "bob"), lambda: b.cancel(job.id, owner="bob", grpc_jobs=True),
                 lambda: a.delete(job.id, "bob")):
        with pytest.raises(PermissionDenied):
            verb()
    a.sweep_once()
    assert not job.cancel_requested.is_set() and not job.deleted
    assert a.store.get_record(job.id)["status"] == "in_progress"
    assert b.get(job.id, "alice").status == "in_progress"
    a.finish(job, None)


def test_two_callers_racing_the_same_ids_on_two_replicas(replicas):
    """Alice and Bob choose the same request ids at the same moment, on both replicas: every request is admitted
    (each id names a job in its caller's namespace), each cancel reaches only its caller's job, an id a caller
    reuses while its job lives is refused, and no gRPC job is an HTTP video."""
    a, b = replicas
    ids = [f"race-{i}" for i in range(8)]
    start = threading.Barrier(4)
    admitted: dict = {}
    errors: list = []

    def submit(table: JobTable, owner: str):
        start.wait()
        for rid in ids:
            try:
                admitted[(table.instance, owner, rid)] = table.admit(
                    table.new(_validated(), kind="stream", request_id=rid, owner=owner), {})
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((table.instance, owner, rid, exc))

    threads = [threading.Thread(target=submit, args=(t, o)) for t in (a, b) for o in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(admitted) == 4 * len(ids)
    with pytest.raises(AlreadyExists):
        a.admit(a.new(_validated(), kind="stream", request_id="race-0", owner="alice"), {})
    # Bob cancels his race-3 on A: Alice's race-3 on A and both on B go on
    assert a.cancel("race-3", owner="bob", grpc_jobs=True) is True
    for (instance, owner, rid), job in admitted.items():
        assert job.cancel_requested.is_set() == ((instance, owner, rid) == (a.instance, "bob", "race-3")), job.key
    # a caller with no job of that id is told it is another caller's; HTTP verbs see no gRPC job
    with pytest.raises(PermissionDenied):
        a.cancel("race-5", owner="carol", grpc_jobs=True)
    for verb in (lambda: a.get("race-5", "alice"), lambda: a.delete("race-5", "alice"),
                 lambda: b.cancel("race-5", owner="alice"), lambda: a.get("alice/race-5", "alice")):
        with pytest.raises(NotFound):
            verb()
    assert a.list("alice") == [] and b.list() == []
    a.drain()
    b.drain()
    assert all(job.finished for job in admitted.values()) and a.store.records() == []
