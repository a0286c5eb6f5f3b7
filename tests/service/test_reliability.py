"""Cancel, deadlines, overload, a stage dying mid-request: every failure is prompt, typed, names what failed,
stops the work in every stage within one denoising step or one VAE clip, and the next request is served."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from h3serve.client import Accepted, Cancelled, Client, DeadlineExceeded, Progress, QueueFull
from h3serve.testing.faults import kill_mid_request, wait_replaced
from h3serve.testing.mp4check import check_mp4

from .conftest import REQUEST

LONG = dict(REQUEST, num_inference_steps=300)     # ~300 DiT steps: far longer than any test waits


def _assert_next_request_served(stack, embedded) -> None:
    stack.wait_ready()
    with Client(stack.grpc, timeout=120) as client:
        assert client.generate(**REQUEST).mp4 == embedded(**REQUEST)


def test_cancel_stops_the_dit_within_one_step(stack, embedded):
    before = stack.wait_idle("dit")    # a job cancelled by an earlier test may still be leaving the DiT
    with Client(stack.grpc, timeout=120) as client:
        gen = client.stream(**LONG)
        for event in gen:
            if isinstance(event, Progress) and event.stage == "dit" and event.done >= 3:
                break
        gen.cancel()
        with pytest.raises(Cancelled):
            gen.result()
    st = stack.wait_idle("dit")
    assert st.last.outcome == "cancelled", st
    assert st.last.units_at_signal >= 3
    assert st.last.units_done - st.last.units_at_signal <= 1, st.last   # stopped within one step
    assert st.last.units_done < 50
    assert st.cancelled_total == before.cancelled_total + 1
    steps = st.work_units_total
    time.sleep(0.5)
    assert stack.status("dit").work_units_total == steps   # the step counter no longer moves
    _assert_next_request_served(stack, embedded)


def test_deadline_stops_the_dit_within_one_step(stack, embedded):
    t0 = time.monotonic()
    with Client(stack.grpc) as client:
        with pytest.raises(DeadlineExceeded):
            client.generate(timeout=3.0, **LONG)
    assert time.monotonic() - t0 < 4.5
    st = stack.wait_idle("dit")
    assert st.last.outcome in ("deadline", "cancelled"), st.last
    # the gateway passed the remaining deadline on (grpc-timeout rounds up, by at most 10 ms a hop below 10 s)
    assert 0 < st.last.deadline_remaining_s <= 3.05
    assert st.last.units_done - st.last.units_at_signal <= 1, st.last
    steps = st.work_units_total
    time.sleep(0.5)
    assert stack.status("dit").work_units_total == steps
    _assert_next_request_served(stack, embedded)


def test_every_stage_call_carries_the_remaining_deadline(stack):
    # 9 s, not more: gRPC core encodes grpc-timeout lossily, in 10 ms units below 10 s but in whole seconds from
    # 100 s on, where the encoder's and the VAE's calls (a fraction of a second apart) round to the same value.
    with Client(stack.grpc) as client:
        client.generate(timeout=9.0, **REQUEST)
    remaining = {}
    for stage in ("encoder", "dit", "vae", "muxer"):
        remaining[stage] = stack.status(stage).last.deadline_remaining_s
        # rounding up adds at most 10 ms per hop; a stage that got no deadline, or its own default, fails this
        assert 0 < remaining[stage] <= 9.1, (stage, remaining[stage])
    # what is left of it: the VAE is called after the encoder and the DiT have run
    assert remaining["vae"] < remaining["encoder"], remaining
    assert remaining["muxer"] < remaining["encoder"], remaining


def test_overload_refuses_the_k_plus_2th_at_once_and_the_admitted_complete(stack):
    medium = dict(REQUEST, num_inference_steps=30)
    with Client(stack.grpc, timeout=180, retry=None) as client:   # the refusal itself, not its retries
        info = client.info()
        k = info["queue_size"]
        assert info["max_inflight"] == 1
        admitted = []
        for i in range(k + 1):                       # one running + k queued
            gen = client.stream(**dict(medium, seed=i))
            first = next(iter(gen))
            assert isinstance(first, Accepted) and first.queue_position == i
            admitted.append(gen)
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            client.generate(**REQUEST)
        assert time.monotonic() - t0 < 1.0          # refused at once, not after waiting
        t0 = time.monotonic()
        r = httpx.post(f"{stack.http}/v1/videos", json={"prompt": "x", "size": "320x256", "num_inference_steps": 3},
                       timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert time.monotonic() - t0 < 1.0
        results = [gen.result() for gen in admitted]
    for result in results:
        assert check_mp4(result.mp4, expect_frames=124, fps=24, width=320, height=256).frames == 124
    assert len({r.sha256 for r in results}) == k + 1   # different seeds, different videos


# 20,000 characters (the tiny encoder's forward takes ~15 s), a prompt of its own: never encoded whole, so
# never a cache hit
HUGE_PROMPT = "a kite over the dead sea " * 800
KILLED_MID_JOB = {"encoder": dict(REQUEST, prompt=HUGE_PROMPT),   # killed inside its one long forward
                  "dit": LONG,                                    # killed while it denoises
                  "vae": dict(REQUEST, seconds=14)}               # 345 frames: 21 clips, killed between two


def _wait_restarted(stack, stage: str, pid: int, timeout: float = 120.0) -> None:
    if not wait_replaced(lambda: stack.status(stage), pid, timeout_s=timeout):
        raise TimeoutError(f"{stage} not restarted within {timeout}s")


@pytest.mark.parametrize("stage", list(KILLED_MID_JOB))
def test_a_stage_killed_mid_job_fails_it_unavailable_naming_it(stack, embedded, stage):
    """kill -9 of a stage while an HTTP job is inside it: the job record ends failed, code stage_unavailable
    naming the stage, within seconds; no MP4 is downloadable; the launcher restarts the stage and the next
    request is served."""
    pid = stack.status(stage).pid
    with httpx.Client(base_url=stack.http, timeout=30) as http:
        r = http.post("/v1/videos", json=KILLED_MID_JOB[stage])
        assert r.status_code == 200, r.text
        vid = r.json()["id"]
        end = time.monotonic() + 60
        while not stack.status(stage).current_request_id:      # the job is inside the stage now
            assert time.monotonic() < end and http.get(f"/v1/videos/{vid}").json()["status"] != "failed"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while (job := http.get(f"/v1/videos/{vid}").json())["status"] not in ("completed", "failed"):
            assert time.monotonic() - killed_at < 30, job     # well before any deadline: nothing hangs
            time.sleep(0.05)
        failed_after = time.monotonic() - killed_at
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "stage_unavailable" and job["error"]["stage"] == stage, job["error"]
        assert stage in job["error"]["message"] and job["error"]["retryable"] is True
        assert http.get(f"/v1/videos/{vid}/content").status_code == 409   # nothing half-written served
        assert not job.get("sha256") and not job.get("mp4_bytes")
        assert failed_after < 10.0
        listed = {j["id"]: j["status"] for j in http.get("/v1/videos?limit=100").json()["data"]}
        jobs_lost = int(listed.get(vid) != "failed")       # the record is there and says why it ended
        assert jobs_lost == 0, listed
        http.delete(f"/v1/videos/{vid}")
    _wait_restarted(stack, stage, pid)
    _assert_next_request_served(stack, embedded)
    assert not stack.status("muxer").current_request_id   # a broken session was dropped, not left open
    print("FIGURES", json.dumps({"killed": stage, "job_failed_after_s": round(failed_after, 2),
                                 "jobs_lost": jobs_lost}))


def test_muxer_killed_while_the_vae_streams_fails_unavailable_naming_it(stack, embedded):
    pid = stack.status("muxer").pid
    with Client(stack.grpc, timeout=60) as client:
        err, killed_at = kill_mid_request(client, dict(REQUEST, seconds=14), "vae", pid)
    assert time.monotonic() - killed_at < 10.0
    assert err.stage == "muxer" and "muxer" in str(err)
    vae = stack.wait_idle("vae")
    assert vae.last.outcome == "error" and vae.last.units_done < 22   # the VAE stopped decoding
    wait_replaced(lambda: stack.status("muxer"), pid, ready=False)
    _assert_next_request_served(stack, embedded)
