"""Usage: a record per finished job (completed or failed, HTTP or gRPC) of who ran what and what it occupied — the
figures a paid API bills by — kept in the job store (usage/CALLER/DAY/, not deleted with the job), counted per
caller in Prometheus, and read back with `GET /v1/usage`.

GPU-seconds of a stage = its seconds on the request x the GPUs a request occupies there (its ranks on CUDA, 0 on the
CPU and for the muxer; each stage's Status says, stages.py). A failed job is billed nothing for video but its
GPU-seconds are recorded: they were spent.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from h3serve.config.vocab import FASTH3_DIT

from .store import StoreError

if TYPE_CHECKING:
    from .jobs import Job, JobTable

log = logging.getLogger("h3serve.gateway")

# the stage -> its seconds on a request (the job's timings, orchestrate.py)
STAGE_SECONDS = {"encoder": "encoder_s", "dit": "dit_s", "vae": "vae_wall_s", "muxer": "mux_tail_s"}
MAX_RANGE_S = 93 * 86400      # one read spans at most this (a quarter)
DEFAULT_RANGE_S = 30 * 86400


def usage_record(job: "Job", gpus: dict[str, int]) -> dict:
    """A finished job's usage record."""
    r, t = job.request, job.timings
    dit = FASTH3_DIT if r.profile == "fasth3" and FASTH3_DIT in gpus else "dit"
    seconds = {stage: round(float(t.get(key, 0.0)), 6) for stage, key in STAGE_SECONDS.items()}
    gpu_seconds = {stage: round(s * gpus.get(dit if stage == "dit" else stage, 0), 6) for stage, s in seconds.items()}
    done = job.status == "completed"
    videos = job.validated.n if done else 0   # n outputs: n videos delivered
    return {"id": job.id, "object": "usage.record", "caller": job.owner, "model": job.validated.model,
            "task": r.task, "profile": r.profile, "kind": job.kind, "status": job.status,
            "outcome": "completed" if done else job.error.kind.code if job.error else "failed",
            "outputs": videos, "video_seconds": round(videos * r.num_frames / r.fps, 6), "frames": videos * r.num_frames,
            "width": r.width, "height": r.height, "steps": r.steps,
            "queue_s": round(float(t.get("queue_s", 0.0)), 6), "stage_seconds": seconds,
            "gpu_seconds": gpu_seconds, "gpu_seconds_total": round(sum(gpu_seconds.values()), 6),
            "created_at": job.created_at, "completed_at": job.completed_at or time.time()}


def totals(records: list[dict]) -> dict:
    stages = {s: round(sum(r["gpu_seconds"].get(s, 0.0) for r in records), 6) for s in STAGE_SECONDS}
    return {"jobs": len(records), "completed": sum(r["status"] == "completed" for r in records),
            "video_seconds": round(sum(r["video_seconds"] for r in records), 6),
            "frames": sum(r["frames"] for r in records), "gpu_seconds": stages,
            "gpu_seconds_total": round(sum(stages.values()), 6),
            "queue_s": round(sum(r["queue_s"] for r in records), 6)}


class Usage:
    """Writes each finished job's record (a store that cannot take it now gets it again on later tries) and
    counts it per caller."""

    def __init__(self, jobs: "JobTable", gpus: dict[str, int], metrics):
        self.jobs, self.gpus, self.metrics = jobs, gpus, metrics
        self._pending: list[dict] = []
        self._lock = threading.Lock()

    def record(self, job: "Job") -> dict:
        rec = usage_record(job, self.gpus)
        caller = rec["caller"] or "-"
        m = self.metrics
        m.usage_jobs.labels(caller=caller, outcome=rec["outcome"]).inc()
        m.usage_video_seconds.labels(caller=caller, model=rec["model"]).inc(rec["video_seconds"])
        for stage, s in rec["gpu_seconds"].items():
            if s:
                m.usage_gpu_seconds.labels(caller=caller, stage=stage).inc(s)
        with self._lock:
            self._pending.append(rec)
        self.flush()
        return rec

    def flush(self) -> None:
        """Write the records not yet in the store (called per job and by the job table's sweeper)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for i, rec in enumerate(pending):
            try:
                self.jobs.store.put_usage(rec)
            except StoreError as exc:
                log.warning("usage of request %s not written yet (retried): %s", rec["id"], exc)
                with self._lock:
                    self._pending[:0] = pending[i:]
                return

    def read(self, caller: str | None, everyone: bool, start: float, end: float) -> dict:
        records = sorted(self.jobs.store.usage(caller, start, end, everyone=everyone),
                         key=lambda r: (r["completed_at"], r["id"]))
        return {"object": "usage", "caller": None if everyone else caller, "from": start, "to": end,
                "totals": totals(records), "data": records}
