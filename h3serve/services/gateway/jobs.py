"""Jobs and the job table: ids, deadlines, states, admission into a bounded queue, cancel, and the eviction of
finished jobs (TTL, max_jobs).

    new ──► admit: running < max_inflight, else a queue of queue_size, else QueueFull at once
        ──► take (a worker) ──► finish: completed | failed (the error classified through h3serve.errortable)

A job's state: queued -> in_progress -> completed | failed. Live jobs are in the table. HTTP jobs are also records
in the job store (store.py: a directory or an S3 bucket every gateway replica shares), written when admitted,
started and finished; a finished HTTP job is read back from the store, where it stays until it expires (job_ttl_s,
or the oldest past max_jobs) with its MP4. A job in flight on a gateway that restarted or stopped ends `failed`.
Each job belongs to its caller (`owner`, the API key's name): another caller gets PermissionDenied.

Ids. An HTTP job's id is the gateway's to mint (`video_` + 128 random bits); HTTP ids and the store's records are
one namespace. A gRPC caller may choose its request's id (`request_id`): it names the job within that caller's
own namespace (the table's key `OWNER/ID`, `Job.key`), so another caller choosing the same id, on this replica or
another, neither blocks nor meets it; and it is refused (AlreadyExists, naming `request_id`) when the job store
holds a job (an HTTP job) of that id, whoever's it is. The HTTP verbs (get, content, cancel, delete, list) act on
HTTP jobs only — this process's live ones and the store's records — and delete checks the owner against the stored
record too.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from dataclasses import fields as dc_fields
from typing import Callable

import grpc

from h3serve.config.callers import parse_caller_limits
from h3serve.config.lora import LoraChoice
from h3serve.config.request import GenerationRequest, ReferenceSpec
from h3serve.config.stage import StageConfig
from h3serve.errors import (AlreadyExists, Cancelled, DeadlineExceeded, Draining, H3Error, NotFound, PermissionDenied,
                            QueueFull, RequestError, StageUnavailable)
from h3serve.errortable import Classified, TABLE, INTERNAL, classify, error_object, from_grpc

from .fields import REQUEST_ID, Validated
from .metrics import GatewayMetrics
from .scheduling import FairQueue
from .sinks import Sink, unlink
from .store import HEARTBEAT_STALE_S, JobStore, Mp4, StoreError, entry_id, index_entry, open_store, output_id

log = logging.getLogger("h3serve.gateway")

EVENTS_BEHIND = 256        # events a live caller may lag before the job waits for it
# A gRPC stream job is watchable by id (Attach) from its first event: its events are kept with it, and once it has
# finished it stays in the table this long / at most this many / holding at most this many event bytes (the
# oldest go first). A caller that asked to keep its job (the SDK does) may drop its stream for ATTACH_GRACE_S
# before the job, with nobody watching, is cancelled.
KEEP_FINISHED_S = 600.0
KEEP_FINISHED_JOBS = 256
KEEP_FINISHED_BYTES = 1 << 30
ATTACH_GRACE_S = 30.0
SWEEP_INTERVAL_S = 5.0
SHUTDOWN_REASON = "the server is shutting down"
FINISHED = ("completed", "failed")


@dataclass(eq=False)
class Job:
    id: str
    kind: str                      # stream | sync | http
    validated: Validated
    deadline: float                # time.monotonic()
    sink: Sink | None = None
    created_at: float = field(default_factory=time.time)
    t_admitted: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    completed_at: float | None = None
    status: str = "queued"         # queued | in_progress | completed | failed
    progress: float = 0.0
    stage: str = "queue"
    queue_position: int = 0
    cost: float = 0.0              # denoise row-forwards (scheduling.job_cost), set when queued
    timings: dict = field(default_factory=dict)
    error: Classified | None = None
    exc: BaseException | None = None
    mp4_bytes: int = 0
    sha256: str = ""
    output_path: str | None = None
    owner: str | None = None       # the caller's key name (None: auth off)
    chosen_id: bool = False        # the caller chose the id (gRPC request_id): checked against the store
    gateway: str = ""              # the instance running it (host:port) and its boot id, as stored
    boot: str = ""
    cancel_stored: bool = False    # a cancel asked through another replica's record
    upload_pending: bool = False   # finished, its MP4 kept on local disk until the store takes it
    upload_since: float = 0.0      # time.monotonic() of the first failed upload
    upload_error: BaseException | None = None
    persisted: bool = True         # the store holds the job's latest state
    deleted: bool = False          # deleted through another replica: never written again
    aborted: H3Error | None = None # why the gateway gave up on it (a hung stage): its error, not "cancelled"
    webhook: dict | None = None    # url, state, event_id, deliveries (webhooks.py), stored with the job
    outputs: list = field(default_factory=list)   # n > 1: per output {index, seed, mp4_bytes, sha256}
    history: list | None = None    # a stream job's events so far (Attach replays them); None: not watchable
    history_bytes: int = 0
    opening: Callable[["Job"], object] | None = None   # the first event, made when the job is admitted
    watchers: dict = field(default_factory=dict)       # watcher id -> events it has read
    ended: bool = False            # no event follows (its outcome is on the job)
    _watch: threading.Condition = field(default_factory=threading.Condition)
    live: Callable | None = None   # () -> the live fMP4's chunks (Stream of the muxer session), while it exists
    preview: bytes = b""           # the latest preview (JPEG), when the request asked for them
    live_ready: threading.Event = field(default_factory=threading.Event)   # live is set
    done: threading.Event = field(default_factory=threading.Event)
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    _call: grpc.Call | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> str:
        """The job's key in the table: an HTTP job's id (the store's namespace); a gRPC job's id in its caller's
        namespace ('/' is in neither an id nor a caller's name)."""
        return self.id if self.kind == "http" else f"{self.owner or ''}/{self.id}"

    @property
    def request(self) -> GenerationRequest:
        return self.validated.request

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def emit(self, event) -> None:
        """An event for the job's watchers (gRPC Generate, Attach), kept in its history; blocks while the slowest
        watcher is EVENTS_BEHIND events behind (a job nobody watches runs on: its events wait for an Attach)."""
        if self.history is None:
            return
        with self._watch:
            while self.watchers and len(self.history) - min(self.watchers.values()) >= EVENTS_BEHIND:
                if self.cancel_requested.is_set():
                    raise self.cancelled()
                if time.monotonic() >= self.deadline:
                    raise DeadlineExceeded("the caller stopped reading before the deadline")
                self._watch.wait(0.1)
            if self.cancel_requested.is_set():
                raise self.cancelled()
            self.history.append(event)
            self.history_bytes += event.ByteSize() if hasattr(event, "ByteSize") else 0
            self._watch.notify_all()

    def end_events(self) -> None:
        with self._watch:
            self.ended = True
            self._watch.notify_all()

    def watch(self, wid: object, active: Callable[[], bool]):
        """The job's events from its first, then live ones until it ends (its outcome is then on the job), as
        watcher `wid`; stops early once `active()` is False (the watcher's call ended)."""
        pos = 0
        with self._watch:
            self.watchers[wid] = 0
        try:
            while True:
                with self._watch:
                    while pos >= len(self.history) and not self.ended:
                        if not active():
                            return
                        self._watch.wait(0.1)
                    batch = self.history[pos:]
                    ended = self.ended
                for event in batch:
                    yield event
                    pos += 1
                    with self._watch:
                        self.watchers[wid] = pos
                        self._watch.notify_all()
                if ended and pos >= len(self.history):
                    return
        finally:
            self.unwatch(wid)

    def unwatch(self, wid: object) -> int:
        """Forget watcher `wid`; the watchers left."""
        with self._watch:
            self.watchers.pop(wid, None)
            self._watch.notify_all()
            return len(self.watchers)

    def cancel_unwatched(self, reason: str) -> None:
        """Cancel the job if nobody watches it (a dropped caller that did not come back within the grace)."""
        with self._watch:
            watched = bool(self.watchers)
        if not watched:
            self.cancel(reason)

    def attach(self, call) -> None:
        """The stage call in flight: cancelling the job cancels it."""
        with self._lock:
            self._call = call
            cancelled = self.cancel_requested.is_set()
        if cancelled:
            call.cancel()

    def detach(self) -> None:
        with self._lock:
            self._call = None

    def cancel(self, reason: str = "cancelled by the caller") -> bool:
        if self.finished:
            return False
        with self._lock:
            if not self.cancel_requested.is_set():
                self.cancel_reason = reason
                self.cancel_requested.set()
            call = self._call
        if call is not None:
            call.cancel()
        return True

    def abort(self, exc: H3Error) -> bool:
        """Stop the job with `exc` as its outcome (the watchdog: a stage it needs is hung)."""
        with self._lock:
            if self.aborted is None:
                self.aborted = exc
        return self.cancel(str(exc))

    def cancelled(self) -> Cancelled:
        return Cancelled(self.cancel_reason or "cancelled")

    def check(self) -> None:
        if self.cancel_requested.is_set():
            raise self.cancelled()
        if time.monotonic() >= self.deadline:
            raise DeadlineExceeded("the request's deadline passed")

    def record(self) -> dict:
        """The job as the store keeps it (JSON)."""
        err = None
        if self.error is not None:
            err = {**error_object(self.error), "grpc": self.error.kind.grpc.name}
        return {"id": self.id, "owner": self.owner, "status": self.status, "progress": self.progress,
                "stage": self.stage, "created_at": self.created_at, "started_at": self.started_at,
                "completed_at": self.completed_at, "request": self.request.to_dict(), "names": self.validated.names,
                "model": self.validated.model, "timings": self.timings, "error": err, "mp4_bytes": self.mp4_bytes,
                "sha256": self.sha256, "gateway": self.gateway, "boot": self.boot,
                "cancel_requested": self.cancel_stored, "webhook": self.webhook, "outputs": self.outputs,
                "n": self.validated.n}

    @classmethod
    def from_record(cls, rec: dict) -> "Job":
        """A job read back from the store (not run by this process: its events are the store's)."""
        req = dict(rec["request"])
        req["references"] = tuple(ReferenceSpec(**r) for r in req.get("references", ()))
        if req.get("lora") is not None:
            req["lora"] = LoraChoice(**req["lora"])
        init = {f.name for f in dc_fields(GenerationRequest) if f.init}
        request = GenerationRequest(**{k: v for k, v in req.items() if k in init})
        job = cls(id=rec["id"], kind="http", validated=Validated(request, dict(rec.get("names") or {}), rec["model"],
                                                                 n=int(rec.get("n") or 1)),
                  deadline=0.0, created_at=rec["created_at"], started_at=rec.get("started_at"),
                  completed_at=rec.get("completed_at"), status=rec["status"], progress=rec.get("progress", 0.0),
                  stage=rec.get("stage", ""), timings=dict(rec.get("timings") or {}),
                  mp4_bytes=rec.get("mp4_bytes", 0), sha256=rec.get("sha256", ""), owner=rec.get("owner"),
                  gateway=rec.get("gateway", ""), boot=rec.get("boot", ""),
                  cancel_stored=bool(rec.get("cancel_requested")), webhook=rec.get("webhook"),
                  outputs=list(rec.get("outputs") or []))
        if rec.get("error"):
            job.error = classified(rec["error"])
        if job.status in FINISHED:
            job.done.set()
        return job


def classified(err: dict) -> Classified:
    """A stored error object back as the table's classification (its kind found by code and gRPC status)."""
    kinds = [k for _, k in TABLE] + [INTERNAL]
    kind = next((k for k in kinds if k.code == err.get("code") and k.grpc.name == err.get("grpc")),
                next((k for k in kinds if k.code == err.get("code")), INTERNAL))
    return Classified(kind=kind, message=err.get("message", ""), field=err.get("field"), stage=err.get("stage"))


class JobTable:
    """Every live job, the admission queue and the running set; HTTP jobs also in the job store."""

    def __init__(self, config: StageConfig, metrics: GatewayMetrics, store: JobStore | None = None):
        self.config = config
        self.metrics = metrics
        self.draining = False
        self.cond = threading.Condition()
        self.queue = FairQueue(parse_caller_limits(config.gateway.caller_limits), config.gateway.starvation_s)
        self.running: dict[str, Job] = {}
        self.jobs: dict[str, Job] = {}
        self.admitting: dict[str, Job] = {}   # slots reserved while their records are written (no lock held)
        self.kept: collections.OrderedDict[str, Job] = collections.OrderedDict()   # finished stream jobs, oldest first
        self.refused: dict[str, int] = {}     # ids whose first record failed -> sweeps that found it settled
        self.store_error: str | None = None   # the last store write's error; None once one succeeds (/ready)
        self._index_ready = False             # the store's job index checked (built once if it had none)
        # a private temp dir only when nothing durable is configured (then jobs live as long as the process)
        self._own_dir = config.gateway.jobs_dir is None and config.gateway.job_store is None
        self.dir = config.gateway.jobs_dir or tempfile.mkdtemp(prefix="h3serve-jobs-")   # MP4s (spooled, or kept)
        os.makedirs(self.dir, exist_ok=True)
        self.store = store or open_store(config.gateway.job_store or config.gateway.jobs_dir, self.dir)
        self.instance = f"{socket.gethostname()}:{config.server.port}"
        self.boot = uuid.uuid4().hex
        self.on_concluded: Callable[[Job], None] = lambda job: None   # the gateway's usage record and webhook
        self.on_sweep: Callable[[], None] = lambda: None                # usage records the store did not take
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="h3serve-job-sweeper", daemon=True)

    def start(self) -> None:
        self.store.beat(self.instance, self.boot)   # before any record names this boot
        if not self.store.durable:
            log.warning("jobs are kept in %s only while this process runs: set --jobs-dir or --job-store for "
                        "jobs that survive a restart", self.dir)
        self._sweeper.start()

    def new(self, validated: Validated, *, kind: str, sink_factory: Callable[[Job], Sink] | None = None,
            timeout: float | None = None, request_id: str | None = None, owner: str | None = None) -> Job:
        """A job of `owner` for a validated request, its deadline `timeout` from now (at most the server's
        request timeout). Not admitted yet."""
        limit = self.config.gateway.request_timeout_s
        timeout = limit if timeout is None or timeout <= 0 else min(timeout, limit)
        job = Job(id=request_id or f"video_{uuid.uuid4().hex}", kind=kind, validated=validated,
                  deadline=time.monotonic() + timeout, gateway=self.instance, boot=self.boot, owner=owner,
                  chosen_id=request_id is not None)
        if kind == "stream":
            job.history = []
        job.sink = sink_factory(job) if sink_factory else None
        return job

    def mp4_path(self, job: Job) -> str:
        """Where an HTTP job's sink writes its MP4 (in place on disk, or spooled for the object store)."""
        job.output_path = self.store.spool_path(job.id)
        return job.output_path

    def publish_output(self, job: Job, index: int, path: str) -> None:
        """Output `index` > 0 of a job of several (its first is the job's own MP4, published when it finishes)."""
        self.store.publish(output_id(job.id, index), path)

    def admit(self, job: Job, down: dict[str, str]) -> Job:
        """Queue a job or refuse it at once: Draining, StageUnavailable (`down`: stage -> health of the stages
        not SERVING; or the job store could not take the record), AlreadyExists (id in use), QueueFull.

        In three steps, so that a slow or hung store holds up only this admission, never the lock every queue
        operation takes: (1) under the lock the checks and a reserved slot (capacity counts it, the id is taken);
        (2) outside it an HTTP job's record written; (3) under the lock again the job queued. If the write fails
        the slot is given back and the caller gets the StoreError; a record the store took after all reads failed
        with that reason (_orphan). A drain during the write fails the job as it fails a queued one."""
        try:
            with self.cond:
                self._check_admit(job, down)
                self.admitting[job.key] = job
            try:
                if job.kind == "http":
                    self._write_admitted(job)
                elif job.chosen_id and self._record(job.id) is not None:
                    raise AlreadyExists("request_id", job.id)
            except BaseException:
                with self.cond:
                    self.admitting.pop(job.key, None)
                raise
        except H3Error as exc:
            if not isinstance(exc, RequestError):   # request errors are counted by the API layer
                self.metrics.requests.labels(outcome=classify(exc).kind.code).inc()
            raise
        with self.cond:
            self.admitting.pop(job.key, None)
            self.jobs[job.key] = job
            self.kept.pop(job.key, None)   # a failed try of the same id: this one replaces it
            if not self.draining:
                job.t_admitted = time.monotonic()
                if job.opening is not None:
                    job.emit(job.opening(job))
                self.queue.append(job)
                self.queue.admitted(job)
                self.metrics.queue_depth.set(len(self.queue))
                self.cond.notify()
                return job
        self.finish(job, Draining("the server shut down before the request started; retry elsewhere"))
        return job

    def _check_admit(self, job: Job, down: dict[str, str]) -> None:
        """The admission checks on the table (the caller holds the lock); sets the job's queue position."""
        if self.draining:
            raise Draining("the server is shutting down and admits no new requests; retry elsewhere")
        if down:
            stage, health = next(iter(down.items()))
            raise StageUnavailable(stage, f"not ready (health: {health})")
        if job.key in self.jobs or job.key in self.admitting:
            raise AlreadyExists("request_id", job.id)
        kept = self.kept.get(job.key)
        if kept is not None and kept.status == "completed":   # its result can still be watched (Attach)
            raise AlreadyExists("request_id", job.id)
        busy = len(self.running) + len(self.queue) + len(self.admitting)
        capacity = self.config.gateway.max_inflight + self.config.gateway.queue_size
        if busy >= capacity:
            raise QueueFull(f"queue full: {len(self.running)} running and {len(self.queue) + len(self.admitting)} "
                            f"waiting (queue size {self.config.gateway.queue_size}); retry later")
        self.queue.check(job, self.queue.of(job.owner) + sum(j.owner == job.owner for j in self.admitting.values()))
        job.queue_position = max(0, busy - self.config.gateway.max_inflight + 1) if busy >= self.config.gateway.max_inflight else 0

    def _write_admitted(self, job: Job) -> None:
        """An admitted HTTP job's first record (no lock held): refused if the id is stored already, StoreError if
        the store cannot take it (a write that timed out may land later: the sweeper reads such ids back)."""
        rec = self.store.get_record(job.id)
        retried = rec is not None and job.id in self.refused and rec.get("status") not in FINISHED \
            and (rec.get("gateway"), rec.get("boot")) == (self.instance, self.boot)   # its refused try's record
        if rec is not None and not retried:
            raise AlreadyExists("request_id", job.id)
        try:
            self.store.put_record(job.record())
        except StoreError as exc:
            self.refused[job.id] = 0
            self._store_failed(exc)
            raise
        self._store_ok()
        self.refused.pop(job.id, None)

    def take(self) -> Job | None:
        """The next queued job, now running (blocks); None once the table is closed."""
        with self.cond:
            while not self._stop.is_set():
                job = self.queue.take(self.running) if self.queue else None   # None: every waiting caller at its
                if job is not None:                                          # max_running
                    break
                self.cond.wait(0.5)
            else:
                return None
            self.running[job.key] = job
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.inflight.set(len(self.running))
        job.status, job.started_at = "in_progress", time.time()
        if job.kind == "http":
            self._save(job)
        return job

    def _save(self, job: Job) -> None:
        """Write the job's record; a store that cannot take it now gets it again from the sweeper."""
        if job.deleted:
            return
        try:
            self.store.put_record(job.record())
            job.persisted = True
            self._store_ok()
        except StoreError as exc:
            job.persisted = False
            self._store_failed(exc)
            log.warning("request %s: %s (retried)", job.id, exc)

    def save_webhook(self, job: Job) -> None:
        """A finished job's webhook log written back, unless the job was deleted (or expired) meanwhile."""
        if job.key in self.jobs or self._record(job.id) is not None:
            self._save(job)

    def _store_failed(self, exc: StoreError) -> None:
        if self.store_error is None:
            log.warning("job store failing: %s", exc)
        self.store_error = str(exc)

    def _store_ok(self) -> None:
        if self.store_error is not None:
            log.info("job store writable again")
        self.store_error = None

    def finish(self, job: Job, exc: BaseException | None) -> None:
        """The job's outcome: completed (the sink commits, an HTTP job's MP4 is published to the store) or failed
        with `exc` classified (the sink aborts)."""
        with self.cond:
            self.running.pop(job.key, None)
            self.metrics.inflight.set(len(self.running))
            self.cond.notify_all()   # a worker may wait for this caller's max_running
            if job.kind != "http":
                self.jobs.pop(job.key, None)
            if job.history is not None:
                self.kept[job.key] = job
                self._evict_kept()
        job.completed_at = time.time()
        if exc is None and job.sink is not None:
            try:
                job.sink.commit()
            except BaseException as e:  # noqa: BLE001 - the MP4 could not be kept: the job failed
                exc = e
            else:
                if job.kind == "http" and job.output_path and not self._publish(job):
                    return   # the MP4 kept here; the sweeper retries its upload, then concludes the job
        self._conclude(job, exc)

    def _publish(self, job: Job) -> bool:
        """Publish an HTTP job's finished MP4 to the store. A store that cannot take it now (StoreError) keeps the
        job in progress (stage `upload`) with its MP4 on local disk: the sweeper tries again every sweep."""
        try:
            self.store.publish(job.id, job.output_path)
        except StoreError as exc:
            self._store_failed(exc)
            if not job.upload_pending:
                job.upload_pending, job.upload_since, job.stage = True, time.monotonic(), "upload"
                log.warning("request %s: its MP4 is kept on local disk and its upload retried: %s", job.id, exc)
                self._save(job)
            job.upload_error = exc
            return False
        job.upload_pending = False
        return True

    def _retry_upload(self, job: Job) -> None:
        """A finished MP4 whose upload failed: uploaded now (the job completes), or the job fails once cancelled or
        after job_ttl_s of trying (the last StoreError: retryable, naming job-store)."""
        if job.cancel_requested.is_set() or job.deleted:
            job.upload_pending = False
            self._conclude(job, job.cancelled())
        elif time.monotonic() - job.upload_since > self.config.gateway.job_ttl_s:
            job.upload_pending = False
            self._conclude(job, StoreError(f"the MP4 could not be uploaded for {self.config.gateway.job_ttl_s:g}s "
                                           f"({job.upload_error}); submit the job again"))
        elif self._publish(job):
            self._conclude(job, None)

    def _conclude(self, job: Job, exc: BaseException | None) -> None:
        """The rest of `finish`: the outcome classified, the record written, waiters woken."""
        if exc is None:
            job.status, job.progress = "completed", 100.0
            outcome = "completed"
        else:
            if job.aborted is not None:
                exc = job.aborted
            if isinstance(exc, grpc.RpcError):
                exc = from_grpc(exc, cancelled=job.cancel_requested.is_set())
            if job.cancel_requested.is_set() and not isinstance(exc, (Cancelled, Draining)) and job.aborted is None:
                exc = job.cancelled()
            if isinstance(exc, Cancelled) and job.cancel_reason == SHUTDOWN_REASON:
                exc = Draining("the server shut down before the request finished; retry elsewhere")
            job.exc = exc
            job.error = classify(exc)
            job.status = "failed"
            outcome = job.error.kind.code
            if job.sink is not None:
                job.sink.abort()
            if job.error.kind.code == "internal":
                log.error("request %s failed", job.id, exc_info=exc)
        if job.kind == "http":
            self._save(job)
            if job.persisted and self.store.durable:
                with self.cond:   # read back from the store from now on
                    if self.jobs.get(job.id) is job:
                        self.jobs.pop(job.id)
        self.metrics.requests.labels(outcome=outcome).inc()
        if exc is None:
            self.metrics.observe(job.timings)
            log.info("request %s completed: %d bytes, t_client %.3fs, rtf %.3f", job.id, job.mp4_bytes,
                     job.timings.get("t_client", 0.0), job.timings.get("rtf_client", 0.0))
        else:
            log.info("request %s failed: %s: %s", job.id, outcome, job.error.message)
        try:
            self.on_concluded(job)
        except Exception:  # noqa: BLE001 - its usage and webhook never keep a job from ending
            log.exception("request %s: usage / webhook", job.id)
        job.done.set()
        job.end_events()

    def _evict_kept(self) -> None:
        """Finished stream jobs past KEEP_FINISHED_S, KEEP_FINISHED_JOBS or KEEP_FINISHED_BYTES go, oldest first
        (the caller holds the lock)."""
        now = time.time()
        total = sum(j.history_bytes for j in self.kept.values())
        while self.kept:
            key, oldest = next(iter(self.kept.items()))
            if (now - (oldest.completed_at or now) <= KEEP_FINISHED_S and len(self.kept) <= KEEP_FINISHED_JOBS
                    and total <= KEEP_FINISHED_BYTES):
                break
            self.kept.pop(key)
            total -= oldest.history_bytes

    def grpc_job(self, job_id: str, owner: str | None) -> Job | None:
        """The caller's gRPC job of that id, live or kept after it finished (None: none). Another caller's live job
        of that id raises PermissionDenied."""
        key = f"{owner or ''}/{job_id}"
        with self.cond:
            self._evict_kept()
            job = self.jobs.get(key) or self.kept.get(key)
        if job is None and any(j.id == job_id and j.kind != "http" for j in list(self.jobs.values())):
            raise PermissionDenied(f"request {job_id!r} belongs to another caller")
        return job

    def watchable(self, job_id: str, owner: str | None) -> Job:
        """The caller's stream job of that id whose events can be watched (Attach), or NotFound saying why not."""
        job = self.grpc_job(job_id, owner) if REQUEST_ID.match(job_id) else None
        if job is None or job.history is None:
            raise NotFound(f"no request {job_id!r} of this caller to attach to: attach to a Generate request by its "
                           f"request_id, while it runs or for {KEEP_FINISHED_S:g}s after it finished")
        return job

    # -- reading jobs back ---------------------------------------------------------------------------------
    def _orphan(self, rec: dict) -> StageUnavailable | None:
        """Why a stored job still queued / in progress will never finish, or None while its gateway runs it."""
        if rec.get("status") in FINISHED:
            return None
        was = rec.get("status")
        if (rec.get("gateway"), rec.get("boot")) == (self.instance, self.boot):
            if rec["id"] in self.jobs or rec["id"] in self.admitting:
                return None
            return StoreError(f"the job store did not confirm this job's record when it was submitted, so it was "
                              f"refused (503) and never ran; the record the store took late was {was}: submit "
                              f"it again")
        beat = self.store.heartbeat(rec.get("gateway", ""))
        if beat is None or beat.get("boot") != rec.get("boot"):
            reason = f"the gateway running it ({rec.get('gateway')}) restarted before it finished"
        elif time.time() - float(beat.get("at", 0)) > HEARTBEAT_STALE_S:
            reason = (f"the gateway running it ({rec.get('gateway')}) stopped: no heartbeat for more than "
                      f"{HEARTBEAT_STALE_S:g}s")
        else:
            return None
        return StageUnavailable("gateway", f"{reason}; the job was {was} and nothing of it was kept: submit it again")

    def _load(self, rec: dict) -> Job:
        job = Job.from_record(rec)
        orphan = self._orphan(rec)
        if orphan is not None:   # fail it for good, once, with the reason
            job.status, job.completed_at = "failed", time.time()
            job.error = classify(orphan)
            job.done.set()
            self._save(job)
        return job

    def _check_owner(self, job: Job, owner: str | None) -> Job:
        if owner is not None and job.owner != owner:
            raise PermissionDenied(f"video {job.id!r} belongs to another caller")
        return job

    def _record(self, job_id: str) -> dict | None:
        """The stored record of an id (an id no job can have is not looked up: the store sees only valid names)."""
        return self.store.get_record(job_id) if REQUEST_ID.match(job_id) else None

    def _live_http(self, job_id: str) -> Job | None:
        """This process's live HTTP job of that id (a gRPC job's key has a '/', which no valid id has)."""
        job = self.jobs.get(job_id) if REQUEST_ID.match(job_id) else None
        return job if job is not None and job.kind == "http" else None

    def get(self, job_id: str, owner: str | None = None) -> Job:
        """An HTTP job by id: a live one of this process, else the store's record. `owner`: the caller's key name
        (None: auth off) — another caller's job raises PermissionDenied."""
        job = self._live_http(job_id)
        if job is None:
            rec = self._record(job_id)
            if rec is None:
                raise NotFound(f"no video {job_id!r}")
            job = self._load(rec)
        return self._check_owner(job, owner)

    def mp4(self, job: Job, index: int = 0) -> Mp4 | None:
        """The stored MP4 of a completed job, or of its output `index` (None if the store has none)."""
        return self.store.open_mp4(output_id(job.id, index))

    def cancel(self, job_id: str, reason: str = "cancelled by the caller", owner: str | None = None,
               grpc_jobs: bool = False) -> bool:
        """Cancel a job: a queued one fails at once, a running one stops within one step or one clip. A job
        another replica runs is asked through its record (that replica reads it within a sweep). `grpc_jobs`
        (the gRPC Cancel): the caller's own live gRPC job of that id first, then its HTTP job."""
        job = self.grpc_job(job_id, owner) if grpc_jobs and REQUEST_ID.match(job_id) else None
        if job is not None and job.finished:   # idempotent: a finished request stays as it ended
            return False
        job = job or self._live_http(job_id)
        if job is None:
            if self._record(job_id) is None:
                raise NotFound(f"no request {job_id!r} of this caller (a finished gRPC request is known for "
                               f"{KEEP_FINISHED_S:g}s after it ended)")
            job = self.get(job_id, owner)
            if job.finished:
                return False
            job.cancel_stored = True
            self.store.put_record(job.record())
            return True
        self._check_owner(job, owner)
        with self.cond:   # out of the queue under the lock (no worker takes it); its record written outside
            queued = job in self.queue
            if queued:
                self.queue.remove(job)
                self.metrics.queue_depth.set(len(self.queue))
                job.cancel(reason)
        if queued:
            self.finish(job, Cancelled(reason))
            return True
        return job.cancel(reason)

    def delete(self, job_id: str, owner: str | None = None) -> Job:
        """Cancel a job if unfinished, then forget it and its MP4 (here and in the store). The owner is checked
        against the stored record too, before anything is cancelled or deleted."""
        job = self.get(job_id, owner)
        rec = self._record(job_id)
        if rec is not None and owner is not None and rec.get("owner") != owner:
            raise PermissionDenied(f"video {job_id!r} belongs to another caller")
        if not job.finished and self._live_http(job_id) is job:
            self.cancel(job_id, "deleted by the caller")
            job.done.wait(30.0)
        job.deleted = True          # a job still stopping writes no record again
        try:
            self.store.delete(job_id)   # first: until it is gone from memory a reader sees the live job
        except StoreError:
            job.deleted = False
            raise
        with self.cond:
            self.jobs.pop(job_id, None)
        if job.output_path:
            unlink(job.output_path)
        return job

    def page(self, owner: str | None, limit: int, after: str | None = None,
             order: str = "desc") -> tuple[list[Job], bool]:
        """A page of the caller's HTTP jobs (every one's when `owner` is None), newest first (`order` asc: oldest),
        after the job `after`, and whether more follow. From the store's index: entry names are listed, and only
        the records of the page (and of `after`) are read; a live job of this process is its live state."""
        if not self._index_ready:
            self.store.ensure_index()   # a store written before the index: indexed once, from its records
            self._index_ready = True
        start = None
        if after is not None:
            rec = self._record(after)
            if rec is None or (owner is not None and rec.get("owner") != owner):
                return [], False   # a cursor past the end (expired, deleted, or never this caller's): an empty page
            start = index_entry(rec)
        out: list[Job] = []
        for entry in self.store.index_entries(owner, start, reverse=order == "asc"):
            job_id = entry_id(entry)
            job = self._live_http(job_id)
            if job is None:
                rec = self._record(job_id)
                if rec is None:   # admitted and refused, or deleted meanwhile: not a job
                    continue
                job = self._load(rec)
            if owner is not None and job.owner != owner:
                continue
            out.append(job)
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit

    def list(self, owner: str | None = None) -> list[Job]:
        """The caller's HTTP jobs (every one when `owner` is None), oldest first."""
        return self.page(owner, limit=1 << 62, order="asc")[0]

    def busy(self) -> bool:
        return bool(self.running) or bool(self.queue)

    def drain(self) -> None:
        """Stop admitting; queued jobs that have not started fail with Draining (UNAVAILABLE)."""
        with self.cond:
            self.draining = True
            queued = list(self.queue)
            self.queue.clear()
            self.metrics.queue_depth.set(0)
        for job in queued:
            self.finish(job, Draining("the server shut down before the request started; retry elsewhere"))

    def cancel_running(self, reason: str = SHUTDOWN_REASON) -> None:
        for job in list(self.running.values()):
            job.cancel(reason)

    def close(self) -> None:
        """Stop the sweeper; a durable store keeps every finished job and MP4 (only a private temp dir goes)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._sweeper.is_alive():
            self._sweeper.join(SWEEP_INTERVAL_S + 5)
        self.store.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- the sweeper: heartbeat, stored cancels, unsaved records, retention -------------------------------------
    def _sweep(self) -> None:
        """Every SWEEP_INTERVAL_S until closed; nothing a sweep meets stops the sweeper."""
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                self.sweep_once()
            except StoreError as exc:
                self._store_failed(exc)
                log.warning("job sweep: %s (retried)", exc)
            except Exception:  # noqa: BLE001 - logged; the next sweep tries again
                log.exception("job sweep failed (retried)")

    @property
    def store_healthy(self) -> bool:
        return self.store_error is None

    def sweep_once(self) -> None:
        with self.cond:
            self._evict_kept()
        self.store.beat(self.instance, self.boot)
        self._store_ok()
        self.on_sweep()
        with self.cond:
            mine = [j for j in self.jobs.values() if j.kind == "http"]
        for job in mine:
            if not job.persisted:
                self._save(job)
                if job.persisted and job.finished and self.store.durable:
                    with self.cond:
                        self.jobs.pop(job.id, None)
            elif not job.finished:
                rec = self.store.get_record(job.id)
                if rec is None:
                    job.deleted = True
                    job.cancel("deleted by the caller")
                elif rec.get("cancel_requested"):
                    self.cancel(job.id)
        for job in mine:
            if job.upload_pending:
                self._retry_upload(job)
        for job_id in list(self.refused):   # a refused admission's record that landed late: failed, with why
            rec = self.store.get_record(job_id)
            settled = rec is None or rec.get("status") in FINISHED
            if not settled:
                self._load(rec)              # ours and not live: written failed, with the reason
            # watched for two settled sweeps in a row: a put the store still held may land after the first
            self.refused[job_id] = self.refused[job_id] + 1 if settled else 0
            if self.refused[job_id] >= 2:
                self.refused.pop(job_id, None)
        now = time.time()
        finished = sorted((r for r in self.store.records() if r.get("status") in FINISHED),
                          key=lambda r: r.get("completed_at") or 0)
        expired = [r for r in finished if now - (r.get("completed_at") or now) > self.config.gateway.job_ttl_s]
        excess = len(finished) - len(expired) - self.config.gateway.max_jobs
        if excess > 0:
            expired += [r for r in finished if r not in expired][:excess]
        for r in expired:
            self.store.delete(r["id"])
        self._sweep_parts(mine)

    def _sweep_parts(self, mine: list[Job]) -> None:
        """MP4s half-written by a process that died (its .part files) go once their job is finished or gone."""
        live = {j.output_path + ".part" for j in mine if j.output_path and not j.finished}
        folder = os.path.dirname(self.store.spool_path("x"))
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if not name.endswith(".mp4.part") or path in live:
                continue
            rec = self._record(name[: -len(".mp4.part")])
            if rec is None or rec.get("status") in FINISHED or self._orphan(rec):
                unlink(path)
