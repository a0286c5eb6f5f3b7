"""The gateway's core, shared by its gRPC servicer and its HTTP API: request adapters, admission, jobs, and the
calls to the stages.

    submit ──► validate + align (names the caller's field) ──► admission: running < max_inflight, else a bounded
    queue of queue_size, else QueueFull at once ──► worker: encoder ─► dit (progress per step) ─► muxer session
    ─► vae (frames go vae → muxer, never through here) ─► fetch the MP4 from the muxer ─► the job's sink

Every call to a stage carries the request's remaining deadline; cancelling a job cancels the call in flight, and
the stage stops within one denoising step or one VAE clip. A stage call that fails is turned into a domain error
naming the stage (h3serve.errortable.from_grpc).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc

from h3serve.errors import Cancelled, H3Error, RequestError
from h3serve.errortable import (
    Classified,
    DeadlineExceeded,
    Draining,
    NotFound,
    QueueFull,
    StageUnavailable,
    TooLarge,
    classify,
    from_grpc,
)
from h3serve.config.request import TASKS, GenerationRequest, validate_request
from h3serve.config.stage import StageConfig
from h3serve.transport.grpc import collect_tensors, insecure_channel, iter_tensor_chunks

log = logging.getLogger("h3serve.gateway")

STAGE_NAMES = ("encoder", "dit", "vae", "muxer")
SERVED_TASKS = ("t2va",)
QUALITIES = ("lossless",)
MODEL_IDS = {"base": ("MiniMax-H3", "h3", "base"), "fasth3": ("FastH3", "fasth3")}
REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
HEALTH_INTERVAL_S = 0.5
SAMPLE_RATE = 32000
# progress percent: encoder done 5, DiT 5..85, VAE 85..97, MP4 fetched 100
P_ENCODER, P_DIT, P_VAE = 5.0, 80.0, 12.0

# Fields of the videos API and the request field each one feeds (h3serve.config.request names).
API_FIELDS = {"prompt": "prompt", "seconds": "seconds", "size": "size", "width": "width", "height": "height",
              "num_frames": "num_frames", "fps": "fps", "seed": "seed", "num_inference_steps": "steps",
              "task": "task"}
NUMERIC_FIELDS = ("seconds", "width", "height", "num_frames", "fps", "seed", "num_inference_steps")


# ---------------------------------------------------------------------------------------------------------------
# Request adapters

def _rename(exc: RequestError, names: dict[str, str]) -> RequestError:
    """The same error, naming the field as the caller spelled it (num_inference_steps, extra_params.task, ...)."""
    api = names.get(exc.field, exc.field)
    if api == exc.field:
        return exc
    renamed = RequestError(api, exc.value, exc.allowed)
    return renamed


def check_types(fields: dict[str, Any]) -> None:
    """JSON-level type checks, so that a wrong type is a RequestError naming the field, never a crash."""
    for name, value in fields.items():
        if value is None:
            continue
        if name == "prompt" and not isinstance(value, str):
            raise RequestError(name, _short(value), "a string of 1..20,000 characters")
        if name in ("size", "task", "quality", "model") and not isinstance(value, str):
            raise RequestError(name, _short(value), "a string")
        if name in NUMERIC_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
            raise RequestError(name, _short(value), "a number")


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else text[:60] + "..."


@dataclass
class Admitted:
    request: GenerationRequest
    names: dict[str, str]        # request field -> the caller's field name
    model: str


def build_request(fields: dict[str, Any], *, config: StageConfig, names: dict[str, str] | None = None) -> Admitted:
    """Validate the caller's fields (API names) into a GenerationRequest for this deployment.

    `names` maps request fields to the caller's spelling when it differs from API_FIELDS (e.g. task given as
    extra_params.task). Raises RequestError naming the caller's field."""
    names = dict(names or {})
    api_names = {internal: api for api, internal in API_FIELDS.items()}
    api_names["profile"] = "model"   # the profile is the deployment's; a caller names it through `model`
    api_names.update(names)
    check_types({k: v for k, v in fields.items()})
    model = fields.get("model")
    served = MODEL_IDS.get(config.profile, (config.profile,))
    if config.model_name:
        served = (config.model_name, *served)
    if model is not None and model not in served:
        raise RequestError("model", _short(model), f"this deployment serves {served[0]!r} (profile {config.profile})")
    quality = fields.get("quality")
    if quality is not None and quality not in QUALITIES:
        raise RequestError("quality", _short(quality),
                           "'lossless' (the only mode served: no step caching or sparse attention)")
    task = fields.get("task")
    if isinstance(task, str) and task.strip().lower() in TASKS and task.strip().lower() not in SERVED_TASKS:
        raise RequestError(api_names.get("task", "task"), task,
                           "this deployment serves t2va (fl2va / ref2va run in the embedded pipeline)")
    raw = {internal: fields[api] for api, internal in API_FIELDS.items()
           if api in fields and fields[api] is not None}
    raw["profile"] = config.profile
    raw["dtype"] = config.dtype
    if "prompt" not in raw:
        raise RequestError("prompt", None, "a prompt is required")
    try:
        req = validate_request(**raw)
    except RequestError as exc:
        raise _rename(exc, api_names) from None
    if req.task not in SERVED_TASKS:
        raise RequestError(api_names.get("task", "task"), req.task,
                           "this deployment serves t2va (fl2va / ref2va run in the embedded pipeline)")
    return Admitted(req, api_names, served[0])


def fields_from_proto(msg) -> dict[str, Any]:
    out = {"prompt": msg.prompt}
    for name in ("seconds", "size", "width", "height", "num_frames", "fps", "seed", "num_inference_steps", "task",
                 "quality", "model"):
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Sinks: where a job's MP4 goes

class StreamSink:
    """MP4 chunks into the job's event stream (gRPC Generate)."""

    def __init__(self, job: "Job"):
        self.job = job

    def begin(self, total: int) -> None:
        pass

    def write(self, offset: int, data: bytes) -> None:
        from h3serve._proto import gateway_pb2

        self.job.emit(gateway_pb2.GenerateEvent(mp4=gateway_pb2.Mp4Data(offset=offset, data=data)))

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class BytesSink:
    """The whole MP4 in memory (GenerateSync, HTTP sync), refused past `limit` bytes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.buf = bytearray()

    def begin(self, total: int) -> None:
        if total > self.limit:
            raise TooLarge(f"the MP4 is {total} bytes, more than the sync limit of {self.limit}; use the streaming "
                           "call (Generate) or the async job API")

    def write(self, offset: int, data: bytes) -> None:
        self.buf += data

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self.buf = bytearray()


class FileSink:
    """The MP4 into a file of the jobs directory, written as .part and renamed when complete (HTTP jobs)."""

    def __init__(self, path: str):
        self.path = path
        self.part = path + ".part"
        self.f = None

    def begin(self, total: int) -> None:
        self.f = open(self.part, "wb")

    def write(self, offset: int, data: bytes) -> None:
        self.f.write(data)

    def commit(self) -> None:
        self.f.close()
        os.replace(self.part, self.path)

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
        for p in (self.part, self.path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------------------------------------------------------
# Jobs

_END = object()


@dataclass(eq=False)
class Job:
    id: str
    kind: str                      # stream | sync | http
    admitted: Admitted
    deadline: float                # time.monotonic()
    sink: Any = None
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
    _call: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def request(self) -> GenerationRequest:
        return self.admitted.request

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def emit(self, event) -> None:
        """An event for the live caller (gRPC Generate); blocks while the caller is 256 events behind."""
        if self.events is None:
            return
        while True:
            if self.cancel_requested.is_set():
                raise Cancelled(self.cancel_reason or "cancelled")
            try:
                self.events.put(event, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() >= self.deadline:
                    raise DeadlineExceeded("the caller stopped reading before the deadline")

    def attach(self, call) -> None:
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

    def check(self) -> None:
        if self.cancel_requested.is_set():
            raise Cancelled(self.cancel_reason or "cancelled")
        if time.monotonic() >= self.deadline:
            raise DeadlineExceeded("the request's deadline passed")


class StageClients:
    """Channels and stubs to the stages, and a health monitor that keeps each stage's serving status."""

    def __init__(self, config: StageConfig, on_change: Callable[[], None] = lambda: None):
        from h3serve._proto import dit_pb2_grpc, encoder_pb2_grpc, muxer_pb2_grpc, vae_pb2_grpc

        self.addresses = {s: getattr(config, s) for s in STAGE_NAMES}
        self.channels = {s: insecure_channel(a) for s, a in self.addresses.items()}
        self.encoder = encoder_pb2_grpc.EncoderStub(self.channels["encoder"])
        self.dit = dit_pb2_grpc.DiTStub(self.channels["dit"])
        self.vae = vae_pb2_grpc.VAEStub(self.channels["vae"])
        self.muxer = muxer_pb2_grpc.MuxerStub(self.channels["muxer"])
        self._extra: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.status = {s: "UNKNOWN" for s in STAGE_NAMES}
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="h3serve-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def muxer_at(self, address: str):
        """The muxer replica that holds a session (its address may differ from the service address)."""
        from h3serve._proto import muxer_pb2_grpc

        if not address or address == self.addresses["muxer"] or address.rsplit(":", 1)[0] in ("0.0.0.0", "[::]", ""):
            return self.muxer
        with self._lock:
            channel = self._extra.get(address)
            if channel is None:
                channel = self._extra[address] = insecure_channel(address)
        return muxer_pb2_grpc.MuxerStub(channel)

    def ready(self) -> bool:
        return all(v == "SERVING" for v in self.status.values())

    def not_ready(self) -> list[str]:
        return [s for s, v in self.status.items() if v != "SERVING"]

    def _monitor(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stubs = {s: health_pb2_grpc.HealthStub(c) for s, c in self.channels.items()}
        names = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
        while not self._stop.is_set():
            changed = False
            for stage, stub in stubs.items():
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    value = names.get(r.status, "UNKNOWN")
                except grpc.RpcError:
                    value = "NOT_SERVING"
                if self.status[stage] != value:
                    log.info("stage %s: %s -> %s", stage, self.status[stage], value)
                    self.status[stage] = value
                    changed = True
            if changed:
                self.on_change()
            self._stop.wait(HEALTH_INTERVAL_S)

    def close(self) -> None:
        self._stop.set()
        for c in [*self.channels.values(), *self._extra.values()]:
            c.close()


class GatewayCore:
    """Admission, jobs and the stage pipeline. Thread-based; the HTTP API calls it from its event loop."""

    def __init__(self, config: StageConfig, *, on_health: Callable[[bool], None] = lambda ok: None):
        from .metrics import GatewayMetrics

        self.config = config
        self.metrics = GatewayMetrics()
        # transport per edge: requested (--transport), chosen (what the last request used), reason
        requested = config.transport or "grpc"
        self.transport = {
            "vae->muxer": {"requested": requested, "chosen": requested if requested == "grpc" else "pending",
                           "reason": "requested" if requested == "grpc" else "decided per request by the VAE and "
                                                                              "the muxer (no request yet)"},
            "dit->vae": {"requested": requested, "chosen": requested if requested == "grpc" else "pending",
                         "reason": "requested" if requested == "grpc" else "decided per request by the DiT and "
                                                                            "the VAE (no request yet)"},
        }
        self._transport_lock = threading.Lock()
        for edge, t in self.transport.items():
            self.metrics.set_transport(edge, t["requested"], t["chosen"], t["reason"], request=False)
        self.on_health = on_health
        self.stages = StageClients(config, on_change=self._health_changed)
        self.draining = False
        self.cond = threading.Condition()
        self.queue: collections.deque[Job] = collections.deque()
        self.running: dict[str, Job] = {}
        self.jobs: dict[str, Job] = {}          # every live job, and finished HTTP jobs until they expire
        self.jobs_dir = config.jobs_dir or tempfile.mkdtemp(prefix="h3serve-jobs-")
        self._own_jobs_dir = config.jobs_dir is None
        os.makedirs(self.jobs_dir, exist_ok=True)
        self._stop = threading.Event()
        self.workers = [threading.Thread(target=self._worker, name=f"h3serve-job-{i}", daemon=True)
                        for i in range(max(1, config.max_inflight))]
        self._sweeper = threading.Thread(target=self._sweep, name="h3serve-job-sweeper", daemon=True)

    def transport_details(self) -> dict:
        with self._transport_lock:
            return {edge: dict(t) for edge, t in self.transport.items()}

    @staticmethod
    def _peak(t: dict, mb: float) -> None:
        """The request's peak_memory_mb: the largest of the stages' own peaks (each stage is its own process)."""
        if mb > 0:
            t["peak_memory_mb"] = max(t.get("peak_memory_mb", 0.0), float(mb))

    def _record_transport(self, info) -> None:
        edge = info.edge or "vae->muxer"
        t = {"requested": info.requested, "chosen": info.chosen, "reason": info.reason}
        with self._transport_lock:
            changed = self.transport.get(edge, {}).get("chosen") != t["chosen"]
            self.transport[edge] = t
        self.metrics.set_transport(edge, t["requested"], t["chosen"], t["reason"])
        if changed:
            log.info("transport %s: requested %s, chosen %s (%s)", edge, t["requested"], t["chosen"], t["reason"])

    def start(self) -> None:
        self.stages.start()
        for w in self.workers:
            w.start()
        self._sweeper.start()

    def ready(self) -> bool:
        return self.stages.ready() and not self.draining

    def _health_changed(self) -> None:
        for s, v in self.stages.status.items():
            self.metrics.stage_up.labels(stage=s).set(1 if v == "SERVING" else 0)
        self.on_health(self.ready())

    # -- admission ------------------------------------------------------------------------------------------
    def new_job(self, fields: dict[str, Any], *, kind: str, sink_factory: Callable[[Job], Any] | None = None,
                timeout: float | None = None, request_id: str | None = None,
                names: dict[str, str] | None = None) -> Job:
        """Validate; raise RequestError naming the caller's field. The job is not admitted yet."""
        admitted = build_request(fields, config=self.config, names=names)
        if request_id is not None and not REQUEST_ID.match(request_id):
            raise RequestError("request_id", _short(request_id), "1..64 of letters, digits, '.', '_', '-'")
        limit = self.config.request_timeout_s
        timeout = limit if timeout is None or timeout <= 0 else min(timeout, limit)
        job = Job(id=request_id or f"video_{uuid.uuid4().hex}", kind=kind, admitted=admitted,
                  deadline=time.monotonic() + timeout)
        if kind == "stream":
            job.events = queue.Queue(maxsize=256)
        job.sink = sink_factory(job) if sink_factory else None
        return job

    def submit(self, job: Job) -> Job:
        """Admit a job or refuse it at once: Draining, StageUnavailable (a stage not ready), QueueFull."""
        with self.cond:
            try:
                if self.draining:
                    raise Draining("the server is shutting down and admits no new requests; retry elsewhere")
                down = self.stages.not_ready()
                if down:
                    raise StageUnavailable(down[0], f"not ready (health: {self.stages.status[down[0]]})")
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

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no video {job_id!r}")
        return job

    def cancel(self, job_id: str, reason: str = "cancelled by the caller") -> bool:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no request {job_id!r}")
        with self.cond:
            if job in self.queue:
                self.queue.remove(job)
                self.metrics.queue_depth.set(len(self.queue))
                job.cancel(reason)
                self._finish(job, Cancelled(reason))
                return True
        return job.cancel(reason)

    def delete(self, job_id: str) -> Job:
        job = self.get(job_id)
        if not job.finished:
            self.cancel(job_id, "deleted by the caller")
            job.done.wait(30.0)
        with self.cond:
            self.jobs.pop(job_id, None)
        if job.output_path:
            _unlink(job.output_path)
        return job

    def list(self) -> list[Job]:
        with self.cond:
            jobs = [j for j in self.jobs.values() if j.kind == "http"]
        return sorted(jobs, key=lambda j: j.created_at)

    def busy(self) -> bool:
        return bool(self.running) or bool(self.queue)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Stop admitting; queued jobs that have not started fail with Draining (UNAVAILABLE)."""
        with self.cond:
            self.draining = True
            queued = list(self.queue)
            self.queue.clear()
            self.metrics.queue_depth.set(0)
        for job in queued:
            self._finish(job, Draining("the server shut down before the request started; retry elsewhere"))
        self.on_health(False)

    def cancel_all(self, reason: str = "the server is shutting down") -> None:
        for job in list(self.running.values()):
            job.cancel(reason)

    def close(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        self.stages.close()
        if self._own_jobs_dir:
            shutil.rmtree(self.jobs_dir, ignore_errors=True)

    def _worker(self) -> None:
        while not self._stop.is_set():
            with self.cond:
                while not self.queue and not self._stop.is_set():
                    self.cond.wait(0.5)
                if self._stop.is_set():
                    return
                job = self.queue.popleft()
                self.running[job.id] = job
                self.metrics.queue_depth.set(len(self.queue))
                self.metrics.inflight.set(len(self.running))
            exc = None
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - every failure is reported through the table
                exc = e
            self._finish(job, exc)

    def _finish(self, job: Job, exc: BaseException | None) -> None:
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
                exc = Cancelled(job.cancel_reason or "cancelled")
            if isinstance(exc, Cancelled) and job.cancel_reason == "the server is shutting down":
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
                job.events.put_nowait(_END)
            except queue.Full:
                threading.Thread(target=job.events.put, args=(_END,), daemon=True).start()
        job.done.set()

    def _sweep(self) -> None:
        while not self._stop.wait(5.0):
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
                    _unlink(j.output_path)

    # -- the pipeline over the stages -------------------------------------------------------------------------
    def _progress(self, job: Job, stage: str, done: int, total: int, elapsed: float, percent: float) -> None:
        from h3serve._proto import common_pb2, gateway_pb2

        job.stage, job.progress = stage, percent
        job.emit(gateway_pb2.GenerateEvent(progress=common_pb2.Progress(
            stage=stage, done=done, total=total, elapsed_s=elapsed, percent=percent)))

    def _call(self, job: Job, stage: str, fn: Callable[[], Iterable]) -> Iterable:
        """Iterate a stage call, attached to the job (so that cancel reaches it), errors mapped to domain errors."""
        job.check()
        try:
            call = fn()
            job.attach(call)
            yield from call
        except grpc.RpcError as err:
            if job.cancel_requested.is_set():
                raise Cancelled(job.cancel_reason or "cancelled") from None
            raise from_grpc(err, stage=stage) from None
        finally:
            job.detach()

    def _run(self, job: Job) -> None:
        from h3serve._proto import common_pb2, dit_pb2, encoder_pb2, muxer_pb2, vae_pb2

        req = job.request
        t = job.timings
        job.started_at = time.time()
        job.status = "in_progress"
        t_start = time.monotonic()
        t["queue_s"] = t_start - job.t_admitted
        job.check()

        # encoder: prompt -> text states + roles
        t0 = time.perf_counter()
        events = self._call(job, "encoder", lambda: self.stages.encoder.Encode(
            encoder_pb2.EncodeRequest(request_id=job.id, prompt=req.prompt, task=req.task), timeout=job.remaining()))
        chunks = []
        for ev in events:
            if ev.WhichOneof("event") == "chunk":
                chunks.append(ev.chunk)
            elif ev.WhichOneof("event") == "done":
                self._peak(t, ev.done.peak_memory_mb)
        text = collect_tensors(chunks, edge="encoder->gateway")
        t["encoder_s"] = time.perf_counter() - t0
        self._progress(job, "encoder", 1, 1, t["encoder_s"], P_ENCODER)

        # dit: conditions + geometry + seed -> latents, one progress event per step. Under --transport nixl the
        # latents go from the DiT straight to the VAE (dit->vae over VAE.Control): the muxer session and the VAE's
        # Decode (which announces a latents session) are opened first, the DiT is told where to send the latents.
        direct = self.config.transport == "nixl"
        t0 = time.perf_counter()
        params = dit_pb2.DiTParams(
            request_id=job.id, latent_frames=req.latent_frames, latent_height=req.latent_height,
            latent_width=req.latent_width, audio_latents=req.audio_latents, seed=req.seed, task=req.task,
            profile=req.profile, steps=req.steps)
        latents = None
        t_latents = None

        def run_dit():
            nonlocal latents, t_latents
            chunks = []
            inputs = itertools.chain(   # built here: params may have gained the latents sink
                [dit_pb2.DiTInput(params=params)],
                (dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_states", text["text_states"])),
                (dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_tags", text["text_tags"])),
                [dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=2))])
            for ev in self._call(job, "dit", lambda: self.stages.dit.Generate(inputs, timeout=job.remaining())):
                kind = ev.WhichOneof("event")
                if kind == "progress":
                    p = ev.progress
                    self._progress(job, "dit", p.done, p.total, p.elapsed_s,
                                   P_ENCODER + P_DIT * p.done / max(1, p.total))
                elif kind == "chunk":
                    chunks.append(ev.chunk)
                    self.metrics.latents_relayed_bytes.inc(len(ev.chunk.data))
                elif kind == "done":
                    t["dit_steps"] = float(ev.done.steps)
                    self._peak(t, ev.done.peak_memory_mb)
                    if ev.done.HasField("transport"):
                        self._record_transport(ev.done.transport)
            if not direct:
                latents = collect_tensors(chunks, edge="dit->gateway")
            t["dit_s"] = time.perf_counter() - t0
            t_latents = time.perf_counter()   # the tail starts: last latent out of the DiT -> MP4 ready

        if not direct:
            run_dit()

        # muxer session, then the VAE decodes into it
        session = None
        fetched = False
        decode = None
        mux = self.stages.muxer
        try:
            try:
                session = mux.OpenSession(muxer_pb2.OpenSessionRequest(
                    request_id=job.id, width=req.width, height=req.height, fps=req.fps, sample_rate=SAMPLE_RATE,
                    channels=2, expected_frames=req.num_frames, transport=self.config.transport,
                    ttl_s=max(60.0, job.remaining() + 60.0)), timeout=min(30.0, job.remaining()))
            except grpc.RpcError as err:
                raise from_grpc(err, stage="muxer", cancelled=job.cancel_requested.is_set()) from None
            mux = self.stages.muxer_at(session.address)
            where = session.address
            if not where or where.rsplit(":", 1)[0] in ("0.0.0.0", "[::]"):
                where = self.stages.addresses["muxer"]   # a replica that did not say where it is reachable
            sink = common_pb2.Sink(address=where,
                                   session_id=session.session_id, transport=self.config.transport,
                                   transport_metadata=session.transport_metadata)
            decode_params = vae_pb2.DecodeParams(request_id=job.id, sink=sink, num_frames=req.num_frames,
                                                 width=req.width, height=req.height)
            if direct:
                decode_params.latents_transport = "nixl"
                inputs_vae = iter([vae_pb2.DecodeInput(params=decode_params),
                                   vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=0))])
            else:
                inputs_vae = itertools.chain(
                    [vae_pb2.DecodeInput(params=decode_params)],
                    (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("video_latents",
                                                                              latents["video_latents"])),
                    (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("audio_latents",
                                                                              latents["audio_latents"])),
                    [vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=2))])
            decode = self.stages.vae.Decode(inputs_vae, timeout=job.remaining())
            events = _mapped(job, "vae", decode)
            if direct:
                first = next(events, None)
                if first is None or first.WhichOneof("event") != "latents":
                    raise StageUnavailable("vae", "the VAE did not open a latents session")
                vae_at = first.latents.address
                if not vae_at or vae_at.rsplit(":", 1)[0] in ("0.0.0.0", "[::]"):
                    vae_at = self.stages.addresses["vae"]
                params.latents_sink.CopyFrom(common_pb2.Sink(address=vae_at, session_id=first.latents.session_id,
                                                             transport="nixl"))
                run_dit()
            t0 = time.perf_counter()
            job.attach(decode)
            try:
                for ev in events:
                    if ev.WhichOneof("event") == "clip":
                        c = ev.clip
                        self._progress(job, "vae", c.index + 1, c.clips, time.perf_counter() - t0,
                                       P_ENCODER + P_DIT + P_VAE * (c.index + 1) / max(1, c.clips))
                    elif ev.WhichOneof("event") == "done":
                        d = ev.done
                        t["vae_video_s"], t["vae_audio_s"] = d.video_seconds, d.audio_seconds
                        t["vae_s"] = d.video_seconds + d.audio_seconds
                        t["mux_tail_s"] = d.sink_tail_seconds
                        t["transfer_bytes"] = float(d.bytes_sent)
                        self._peak(t, d.peak_memory_mb)
                        if d.HasField("transport"):
                            self._record_transport(d.transport)
            finally:
                job.detach()
            t["vae_wall_s"] = time.perf_counter() - t0

            # the MP4, from the muxer replica that holds the session
            t0 = time.perf_counter()
            digest = hashlib.sha256()
            size = 0
            started = False
            for chunk in self._call(job, "muxer", lambda: mux.Fetch(
                    muxer_pb2.FetchRequest(session_id=session.session_id), timeout=job.remaining())):
                if not started:
                    job.sink.begin(int(chunk.total_bytes))
                    started = True
                digest.update(chunk.data)
                job.sink.write(int(chunk.offset), chunk.data)
                size += len(chunk.data)
            fetched = True
            t["fetch_s"] = time.perf_counter() - t0
        finally:
            if decode is not None and not fetched:
                decode.cancel()
            if session is not None and not fetched:
                try:
                    mux.Abort(muxer_pb2.AbortRequest(session_id=session.session_id, reason="request failed"),
                              timeout=2.0)
                except grpc.RpcError:
                    pass
        job.mp4_bytes, job.sha256 = size, digest.hexdigest()
        t_end = time.monotonic()
        t["tail_s"] = time.perf_counter() - t_latents
        t["mp4_bytes"] = float(size)
        t["t_client"] = t_end - job.t_admitted
        t["t_media"] = req.num_frames / req.fps
        t["rtf_client"] = t["t_client"] / t["t_media"]


def _mapped(job: Job, stage: str, call) -> Iterable:
    """Iterate a stage call's responses, errors mapped to domain errors naming `stage`."""
    try:
        yield from call
    except grpc.RpcError as err:
        if job.cancel_requested.is_set():
            raise Cancelled(job.cancel_reason or "cancelled") from None
        raise from_grpc(err, stage=stage) from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
