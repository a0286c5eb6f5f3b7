"""Jobs and the job table: ids, deadlines, states, admission into a bounded queue, cancel, and the eviction of
finished jobs (TTL, max_jobs).

    new ──► admit: running < max_inflight, else a queue of queue_size, else QueueFull at once
        ──► take (a worker) ──► finish: completed | failed (the error classified through h3serve.errortable)

A job's state: queued -> in_progress -> completed | failed. Live jobs are in the table; finished HTTP jobs stay
until they expire (job_ttl_s, or the oldest past max_jobs), and their MP4 files with them.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import grpc

from h3serve.config.request import GenerationRequest
from h3serve.config.stage import StageConfig
from h3serve.errors import Cancelled, H3Error, RequestError
from h3serve.errortable import (
    Classified,
    DeadlineExceeded,
    Draining,
    NotFound,
    QueueFull,
    StageUnavailable,
    classify,
    from_grpc,
)

from .fields import Validated
from .metrics import GatewayMetrics
from .sinks import END, Sink, unlink

log = logging.getLogger("h3serve.gateway")

EVENTS_BEHIND = 256        # events a live caller may lag before the job waits for it
SWEEP_INTERVAL_S = 5.0
SHUTDOWN_REASON = "the server is shutting down"


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
    timings: dict = field(default_factory=dict)
    error: Classified | None = None
    exc: BaseException | None = None
    mp4_bytes: int = 0
    sha256: str = ""
    output_path: str | None = None
    events: queue.Queue | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    _call: grpc.Call | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def request(self) -> GenerationRequest:
        return self.validated.request

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def emit(self, event) -> None:
        """An event for the live caller (gRPC Generate); blocks while the caller is EVENTS_BEHIND events behind."""
        if self.events is None:
            return
        while True:
            if self.cancel_requested.is_set():
                raise self.cancelled()
            try:
                self.events.put(event, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() >= self.deadline:
                    raise DeadlineExceeded("the caller stopped reading before the deadline")

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

    def cancelled(self) -> Cancelled:
        return Cancelled(self.cancel_reason or "cancelled")

    def check(self) -> None:
        if self.cancel_requested.is_set():
            raise self.cancelled()
        if time.monotonic() >= self.deadline:
            raise DeadlineExceeded("the request's deadline passed")


class JobTable:
    """Every live job and the finished HTTP jobs until they expire, the admission queue and the running set."""

    def __init__(self, config: StageConfig, metrics: GatewayMetrics):
        self.config = config
        self.metrics = metrics
        self.draining = False
        self.cond = threading.Condition()
        self.queue: collections.deque[Job] = collections.deque()
        self.running: dict[str, Job] = {}
        self.jobs: dict[str, Job] = {}
        self.dir = config.jobs_dir or tempfile.mkdtemp(prefix="h3serve-jobs-")   # HTTP jobs' MP4s
        self._own_dir = config.jobs_dir is None
        os.makedirs(self.dir, exist_ok=True)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="h3serve-job-sweeper", daemon=True)

    def start(self) -> None:
        self._sweeper.start()

    def new(self, validated: Validated, *, kind: str, sink_factory: Callable[[Job], Sink] | None = None,
            timeout: float | None = None, request_id: str | None = None) -> Job:
        """A job for a validated request, its deadline `timeout` from now (at most the server's request
        timeout). Not admitted yet."""
        limit = self.config.request_timeout_s
        timeout = limit if timeout is None or timeout <= 0 else min(timeout, limit)
        job = Job(id=request_id or f"video_{uuid.uuid4().hex}", kind=kind, validated=validated,
                  deadline=time.monotonic() + timeout)
        if kind == "stream":
            job.events = queue.Queue(maxsize=EVENTS_BEHIND)
        job.sink = sink_factory(job) if sink_factory else None
        return job

    def admit(self, job: Job, down: dict[str, str]) -> Job:
        """Queue a job or refuse it at once: Draining, StageUnavailable (`down`: stage -> health of the stages
        not SERVING), RequestError (id in use), QueueFull."""
        with self.cond:
            try:
                if self.draining:
                    raise Draining("the server is shutting down and admits no new requests; retry elsewhere")
                if down:
                    stage, health = next(iter(down.items()))
                    raise StageUnavailable(stage, f"not ready (health: {health})")
                if job.id in self.jobs:
                    raise RequestError("request_id", job.id, "an id not already in use")
                busy = len(self.running) + len(self.queue)
                capacity = self.config.max_inflight + self.config.queue_size
                if busy >= capacity:
                    raise QueueFull(f"queue full: {len(self.running)} running and {len(self.queue)} waiting "
                                    f"(queue size {self.config.queue_size}); retry later")
            except H3Error as exc:
                if not isinstance(exc, RequestError):   # request errors are counted by the API layer
                    self.metrics.requests.labels(outcome=classify(exc).kind.code).inc()
                raise
            job.queue_position = max(0, busy - self.config.max_inflight + 1) if busy >= self.config.max_inflight else 0
            job.t_admitted = time.monotonic()
            self.jobs[job.id] = job
            self.queue.append(job)
            self.metrics.queue_depth.set(len(self.queue))
            self.cond.notify()
        return job

    def take(self) -> Job | None:
        """The next queued job, now running (blocks); None once the table is closed."""
        with self.cond:
            while not self.queue and not self._stop.is_set():
                self.cond.wait(0.5)
            if self._stop.is_set():
                return None
            job = self.queue.popleft()
            self.running[job.id] = job
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.inflight.set(len(self.running))
        return job

    def finish(self, job: Job, exc: BaseException | None) -> None:
        """The job's outcome: completed (the sink commits) or failed with `exc` classified (the sink aborts)."""
        with self.cond:
            self.running.pop(job.id, None)
            self.metrics.inflight.set(len(self.running))
            if job.kind != "http":
                self.jobs.pop(job.id, None)
        job.completed_at = time.time()
        if exc is None:
            job.status, job.progress = "completed", 100.0
            outcome = "completed"
            if job.sink is not None:
                job.sink.commit()
        else:
            if isinstance(exc, grpc.RpcError):
                exc = from_grpc(exc, cancelled=job.cancel_requested.is_set())
            if job.cancel_requested.is_set() and not isinstance(exc, (Cancelled, Draining)):
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
        self.metrics.requests.labels(outcome=outcome).inc()
        if exc is None:
            self.metrics.observe(job.timings)
            log.info("request %s completed: %d bytes, t_client %.3fs, rtf %.3f", job.id, job.mp4_bytes,
                     job.timings.get("t_client", 0.0), job.timings.get("rtf_client", 0.0))
        else:
            log.info("request %s failed: %s: %s", job.id, outcome, job.error.message)
        if job.events is not None:
            try:
                job.events.put_nowait(END)
            except queue.Full:
                threading.Thread(target=job.events.put, args=(END,), daemon=True).start()
        job.done.set()

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no video {job_id!r}")
        return job

    def cancel(self, job_id: str, reason: str = "cancelled by the caller") -> bool:
        """Cancel a job: a queued one fails at once, a running one stops within one step or one clip."""
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no request {job_id!r}")
        with self.cond:
            if job in self.queue:
                self.queue.remove(job)
                self.metrics.queue_depth.set(len(self.queue))
                job.cancel(reason)
                self.finish(job, Cancelled(reason))
                return True
        return job.cancel(reason)

    def delete(self, job_id: str) -> Job:
        """Cancel a job if unfinished, then forget it and its MP4."""
        job = self.get(job_id)
        if not job.finished:
            self.cancel(job_id, "deleted by the caller")
            job.done.wait(30.0)
        with self.cond:
            self.jobs.pop(job_id, None)
        if job.output_path:
            unlink(job.output_path)
        return job

    def list(self) -> list[Job]:
        """The HTTP jobs, oldest first."""
        with self.cond:
            jobs = [j for j in self.jobs.values() if j.kind == "http"]
        return sorted(jobs, key=lambda j: j.created_at)

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
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            now = time.time()
            with self.cond:
                finished = sorted((j for j in self.jobs.values() if j.finished), key=lambda j: j.completed_at or 0)
                expired = [j for j in finished if now - (j.completed_at or now) > self.config.job_ttl_s]
                excess = len(finished) - len(expired) - self.config.max_jobs
                if excess > 0:
                    expired += [j for j in finished if j not in expired][:excess]
                for j in expired:
                    self.jobs.pop(j.id, None)
            for j in expired:
                if j.output_path:
                    unlink(j.output_path)
