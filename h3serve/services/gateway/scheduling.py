"""Which queued job runs next, and what a caller may have admitted: fair, size-aware scheduling with per-caller
limits (`--caller-limits`, CRD `gateway.callers`).

Size. A job's cost is its denoise work: forwards x rows x (1 + rows / ATTENTION_ROWS), rows being the packed
sequence the DiT attends over (video latents, audio latents). The last factor is attention's quadratic share: at
the 10 s 1344x768 geometry (about 73.6 k rows) attention is about 2.9x the linear layers (222 of 310 ms a layer,
bench/RESULTS.md), which puts the crossover near 25 k rows.

Fairness. Weighted fair queuing over callers: each caller has a virtual time, the cost of the jobs it ran divided
by its share; the next job is the one that ends the earliest virtual time (its caller's virtual time + its cost /
share). A caller that comes back after being idle starts at the least virtual time among the callers waiting, so
idle time earns no burst. Within a caller the shortest job goes first, unless one has waited `starvation_s`: then
the oldest (so a long job is never passed over for ever, and a short one never waits behind a long one of its own
caller beyond that).

Limits, per caller (a `*` entry for every caller without one): `share` (weight, default 1), `max_running` (jobs
running at once; more wait in the queue), `max_queued` (jobs waiting; more are refused 429 `max_queued`),
`video_seconds_per_hour` (seconds of video admitted in the last hour, the refused job's included; else 429
`video_seconds_per_hour` with Retry-After the time until enough of the hour's jobs leave the window).
"""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING, Iterator

from h3serve.config.geometry import (AUDIO_CHANNELS, CANVAS_MULTIPLE, audio_latents_for_frames,
                                     num_frames_to_latents)
from h3serve.config.callers import ANY_CALLER, CallerLimits
from h3serve.errors import QuotaExceeded

if TYPE_CHECKING:
    from .jobs import Job

ATTENTION_ROWS = 25_000
HOUR_S = 3600.0


def job_cost(job: "Job") -> float:
    """The job's denoise work in row-forwards (see the module's doc)."""
    r = job.request
    rows = (num_frames_to_latents(r.num_frames) * (r.width // CANVAS_MULTIPLE) * (r.height // CANVAS_MULTIPLE)
            + AUDIO_CHANNELS * audio_latents_for_frames(r.num_frames, r.fps))
    return max(1, r.steps - 1) * rows * (1.0 + rows / ATTENTION_ROWS)


class FairQueue:
    """The queued jobs, taken in the order the module's doc describes (the caller holds the table's lock)."""

    def __init__(self, limits: dict[str, CallerLimits], starvation_s: float):
        self.limits = limits
        self.starvation_s = starvation_s
        self._jobs: list["Job"] = []
        self._vtime: dict[str | None, float] = {}
        self._admitted: dict[str | None, collections.deque] = {}   # caller -> (time, video seconds) this hour

    def limits_of(self, caller: str | None) -> CallerLimits:
        return self.limits.get(caller or ANY_CALLER, self.limits.get(ANY_CALLER, CallerLimits()))

    # -- admission -------------------------------------------------------------------------------------------
    def check(self, job: "Job", queued_of_caller: int) -> None:
        """QuotaExceeded (429) when the job's caller is at a limit."""
        caller, lim = job.owner, self.limits_of(job.owner)
        who = f"caller {caller!r}" if caller else "this deployment's callers"
        if lim.max_queued is not None and queued_of_caller >= lim.max_queued:
            raise QuotaExceeded("max_queued", f"{who} has {queued_of_caller} jobs waiting, its limit "
                                f"max_queued={lim.max_queued}; retry when one has started", retry_after_s=5)
        if lim.video_seconds_per_hour is not None:
            seconds = job.request.num_frames / job.request.fps
            now = time.monotonic()
            window = self._admitted.setdefault(caller, collections.deque())
            while window and now - window[0][0] >= HOUR_S:
                window.popleft()
            used = sum(s for _, s in window)
            if used + seconds > lim.video_seconds_per_hour:
                # the wait until enough of the window's seconds have aged out for this job
                need, freed, wait = used + seconds - lim.video_seconds_per_hour, 0.0, HOUR_S
                for t, s in window:
                    freed += s
                    if freed >= need:
                        wait = HOUR_S - (now - t)
                        break
                raise QuotaExceeded("video_seconds_per_hour",
                                    f"{who} was admitted {used:g} s of video in the last hour; this job's {seconds:g} s "
                                    f"would pass its limit video_seconds_per_hour={lim.video_seconds_per_hour:g}",
                                    retry_after_s=max(1, math.ceil(wait)))

    def admitted(self, job: "Job") -> None:
        """The job is in: its seconds count against its caller's hour."""
        if self.limits_of(job.owner).video_seconds_per_hour is not None:
            self._admitted.setdefault(job.owner, collections.deque()).append(
                (time.monotonic(), job.request.num_frames / job.request.fps))

    # -- the queue -------------------------------------------------------------------------------------------
    def append(self, job: "Job") -> None:
        job.cost = job_cost(job)
        if not any(j.owner == job.owner for j in self._jobs):   # back from idle: no credit for the idle time
            waiting = [self._vtime.get(j.owner, 0.0) for j in self._jobs]
            self._vtime[job.owner] = max(self._vtime.get(job.owner, 0.0), min(waiting, default=0.0))
        self._jobs.append(job)

    def take(self, running: dict[str, "Job"]) -> "Job | None":
        """The next job to run (removed), or None when every waiting caller is at its max_running."""
        now = time.monotonic()
        busy = collections.Counter(j.owner for j in running.values())
        best, best_end = None, math.inf
        for caller in dict.fromkeys(j.owner for j in self._jobs):
            lim = self.limits_of(caller)
            if lim.max_running is not None and busy[caller] >= lim.max_running:
                continue
            mine = [j for j in self._jobs if j.owner == caller]   # in arrival order
            oldest = mine[0]
            job = oldest if now - oldest.t_admitted >= self.starvation_s else min(mine, key=lambda j: j.cost)
            end = self._vtime.get(caller, 0.0) + job.cost / lim.share
            if end < best_end:
                best, best_end = job, end
        if best is not None:
            self._vtime[best.owner] = best_end
            self._jobs.remove(best)
        return best

    def remove(self, job: "Job") -> None:
        self._jobs.remove(job)

    def clear(self) -> None:
        self._jobs.clear()

    def of(self, caller: str | None) -> int:
        return sum(j.owner == caller for j in self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator["Job"]:
        return iter(list(self._jobs))

    def __contains__(self, job) -> bool:
        return job in self._jobs
