"""The gateway's watchdog: a stage that stops answering its gRPC health checks (each with a deadline, stages.py) for
HUNG_AFTER_S is hung (a stopped or wedged process keeps its TCP port open, so its calls would wait out their whole
deadline). The jobs that still need it fail at once with StageUnavailable naming it (UNAVAILABLE / 503,
retryable); new requests are already refused while it is not SERVING. A stage that answers NOT_SERVING is alive:
it drains (a pod being deleted, a rolling update) or loads, and the jobs it holds finish there."""

from __future__ import annotations

import logging
import threading
import time

from h3serve.errors import StageUnavailable

from .jobs import JobTable
from .stages import UNREACHABLE, StageClients

log = logging.getLogger("h3serve.gateway")

HUNG_AFTER_S = 3.0       # several missed health deadlines in a row, not one slow answer
WATCH_INTERVAL_S = 0.25
DONE_AFTER = {"encoder": "encoder_s", "dit": "dit_s"}   # a job past these stages no longer needs them


class Watchdog:
    def __init__(self, stages: StageClients, jobs: JobTable, hung_after_s: float = HUNG_AFTER_S):
        self.stages = stages
        self.jobs = jobs
        self.hung_after_s = hung_after_s
        self.down_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="h3serve-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for stage, health in list(self.stages.status.items()):
            if health != UNREACHABLE:
                self.down_since.pop(stage, None)
                continue
            since = self.down_since.setdefault(stage, now)
            if now - since < self.hung_after_s:
                continue
            for job in list(self.jobs.running.values()):
                if DONE_AFTER.get(stage) in job.timings or job.finished:
                    continue
                log.warning("request %s: stage %s not answering health checks for %.1fs: failing it", job.id,
                            stage, now - since)
                job.abort(StageUnavailable(stage, f"not answering its health checks for {now - since:.1f}s "
                                                  f"(health: {health}); the request cannot finish there"))
