"""The gateway: validation, the job table, the stage clients and the workers that run each job's plan
(`orchestrate.py`). The gRPC server (`server.py`) and the HTTP API (`http.py`) both serve through one `Gateway`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from h3serve.config.stage import StageConfig
from h3serve.config.vocab import GRPC

from .fields import check_request_id, validate_fields, without_media
from .jobs import SHUTDOWN_REASON, Job, JobTable
from .store import output_id
from .metrics import GatewayMetrics
from .orchestrate import StageCalls, choose_plan
from .sinks import FileSink, Sink
from .stages import EdgeTransports, StageClients
from .uploads import DecodePool, unmap_large_buffers
from .usage import Usage
from .webhooks import Webhooks

log = logging.getLogger("h3serve.gateway")


class Gateway:
    """Validation, the job table, the stages and the workers that run each job's plan. Thread-based; the HTTP API
    calls it from its event loop."""

    def __init__(self, config: StageConfig, *, on_health: Callable[[bool], None] = lambda ok: None):
        self.config = config
        self.metrics = GatewayMetrics()
        self.transports = EdgeTransports(config.server.transport or GRPC, self.metrics)
        self.on_health = on_health
        self.stages = StageClients(config, on_change=self._health_changed)
        self.jobs = JobTable(config, self.metrics)
        self.webhooks = Webhooks(config, on_attempt=self.jobs.save_webhook, metrics=self.metrics)
        self.usage = Usage(self.jobs, self.stages.gpus, self.metrics)
        self.jobs.on_concluded = self._concluded
        self.jobs.on_sweep = self.usage.flush
        self.decoder = DecodePool(config.gateway.decode_workers, config.gateway.decode_per_caller)   # uploads, off the API's pool
        unmap_large_buffers()   # what an upload used goes back to the system once freed
        self.workers = [threading.Thread(target=self._worker, name=f"h3serve-job-{i}", daemon=True)
                        for i in range(max(1, config.gateway.max_inflight))]

    def start(self) -> None:
        self.stages.start()
        for w in self.workers:
            w.start()
        self.jobs.start()
        self.webhooks.start()

    @property
    def draining(self) -> bool:
        return self.jobs.draining

    def ready(self) -> bool:
        return self.stages.ready() and not self.draining

    def store_ready(self) -> bool:
        """The job store took the last write (HTTP jobs need it; gRPC requests do not)."""
        return self.jobs.store_healthy

    def _health_changed(self) -> None:
        for s, v in self.stages.status.items():
            self.metrics.stage_up.labels(stage=s).set(1 if v == "SERVING" else 0)
        self.on_health(self.ready())

    def new_job(self, fields: dict[str, Any], *, kind: str, sink_factory: Callable[[Job], Sink] | None = None,
                timeout: float | None = None, request_id: str | None = None,
                names: dict[str, str] | None = None, owner: str | None = None) -> Job:
        """Validate; raise RequestError naming the caller's field. The job (of `owner`) is not admitted yet."""
        validated = validate_fields(fields, config=self.config, names=names, http=kind == "http")
        check_request_id(request_id)
        hook = self.webhooks.for_job(validated.webhook_url, owner) if kind == "http" else None
        job = self.jobs.new(validated, kind=kind, sink_factory=sink_factory, timeout=timeout, request_id=request_id,
                            owner=owner)
        job.webhook = hook
        return job

    def submit(self, job: Job) -> Job:
        """Admit a job or refuse it at once: Draining, StageUnavailable (a stage not ready), QueueFull."""
        return self.jobs.admit(job, self.stages.not_ready(job.request.profile))

    def _concluded(self, job: Job) -> None:
        self.usage.record(job)
        self.webhooks.enqueue(job)

    def _run_outputs(self, job: Job, plan, calls: StageCalls) -> None:
        """n > 1: the plan once per output, the others first and the job's own MP4 (output 0) last, so that the
        job's sink, committed by `finish`, is output 0's; each other output is published as soon as it is done.
        Seconds add up over the outputs (the usage record bills them all); the encoder runs once."""
        seed, n = job.request.seed, job.validated.n
        outputs: list[dict | None] = [None] * n
        for i in [*range(1, n), 0]:
            calls.variant, calls.t = i, {}
            sink = job.sink if i == 0 else FileSink(self.jobs.store.spool_path(output_id(job.id, i)))
            calls.sink = sink
            try:
                plan.run(calls)
                if i:
                    sink.commit()
                    self.jobs.publish_output(job, i, sink.path)
            except BaseException:
                if i:
                    sink.abort()
                raise
            finally:
                for k, v in calls.t.items():
                    t = job.timings
                    t[k] = max(t.get(k, 0.0), v) if k == "peak_memory_mb" else t.get(k, 0.0) + v
                job.outputs = [o for o in outputs if o is not None]
            outputs[i] = {"index": i, "seed": seed + i, "mp4_bytes": job.mp4_bytes, "sha256": job.sha256}
        job.outputs = outputs

    def drain(self) -> None:
        """Stop admitting; queued jobs fail with Draining; health NOT_SERVING."""
        self.jobs.drain()
        self.on_health(False)

    def cancel_all(self) -> None:
        self.jobs.cancel_running(SHUTDOWN_REASON)

    def close(self) -> None:
        self.webhooks.close()
        self.decoder.close()
        self.jobs.close()
        self.stages.close()

    def _worker(self) -> None:
        while (job := self.jobs.take()) is not None:
            exc = None
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - every failure is reported through the table
                exc = e
            job.validated = without_media(job.validated)   # a finished job keeps no uploads for its TTL
            try:
                self.jobs.finish(job, exc)
            except BaseException:  # noqa: BLE001 - one job's ending never stops the worker
                log.exception("request %s: could not be finished cleanly; the worker goes on", job.id)
                job.done.set()

    def _run(self, job: Job) -> None:
        plan = choose_plan(self.config.server.transport)
        t = job.timings
        job.started_at = time.time()
        job.status = "in_progress"
        t["queue_s"] = time.monotonic() - job.t_admitted
        job.check()
        calls = StageCalls(job, self.stages, self.transports, self.metrics, self.config.server.transport)
        log.debug("request %s: plan %s", job.id, plan.name)
        if job.validated.n == 1:
            plan.run(calls)
        else:
            self._run_outputs(job, plan, calls)
        t["tail_s"] = time.perf_counter() - calls.t_latents
        t["mp4_bytes"] = float(job.mp4_bytes)
        t["t_client"] = time.monotonic() - job.t_admitted
        t["t_media"] = job.request.num_frames / job.request.fps
        t["rtf_client"] = t["t_client"] / t["t_media"]
