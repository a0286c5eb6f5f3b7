"""The gateway's watchdog fails the jobs of a stage that stops answering its health checks (hung), and only those: a
stage that answers NOT_SERVING drains (a pod being deleted in a rolling update) and finishes the jobs it holds."""

from __future__ import annotations

from types import SimpleNamespace

from h3serve.services.gateway.stages import UNAVAILABLE, UNREACHABLE
from h3serve.services.gateway.watchdog import HUNG_AFTER_S, Watchdog


class RunningJob:
    def __init__(self):
        self.id, self.timings, self.finished, self.aborted = "video_1", {}, False, None

    def abort(self, exc):
        self.aborted = exc


def watch(health: str) -> RunningJob:
    job = RunningJob()
    status = {"encoder": "SERVING", "dit": health, "vae": "SERVING", "muxer": "SERVING"}
    dog = Watchdog(SimpleNamespace(status=status), SimpleNamespace(running={job.id: job}))
    for t in (0.0, HUNG_AFTER_S / 2, HUNG_AFTER_S + 0.1, 10 * HUNG_AFTER_S):
        dog.check(t)
    return job


def test_a_draining_stage_keeps_its_jobs():
    assert watch("NOT_SERVING").aborted is None
    # its Service lists no ready replica while its replacement starts: the job's own call goes on (or breaks)
    assert watch(UNAVAILABLE).aborted is None


def test_a_stage_that_does_not_answer_fails_its_jobs_naming_it():
    job = watch(UNREACHABLE)
    assert job.aborted is not None and job.aborted.stage == "dit"
    assert "not answering its health checks" in str(job.aborted)
