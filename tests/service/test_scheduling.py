"""Fair, size-aware scheduling and per-caller limits (scheduling.py) on the gateway's job table: a mixed load of
long and short jobs from two callers of different shares, run by the table's own admission and take() with a worker
whose run time is each job's cost (a stand-in for the stages: what is measured is the order the table chooses), the
same load under first-come-first-served in the same run for comparison; and the 429s of each limit."""

from __future__ import annotations

import json
import threading
import time

import pytest

from h3serve.config.request import validate_request
from h3serve.config.stage import StageConfig
from h3serve.errors import H3Error, QuotaExceeded
from h3serve.errortable import classify
from h3serve.services.gateway.fields import Validated
from h3serve.services.gateway.jobs import JobTable
from h3serve.services.gateway.metrics import GatewayMetrics
from h3serve.config.callers import parse_caller_limits
from h3serve.services.gateway.scheduling import job_cost

LONG = dict(seconds=14, width=1344, height=768, steps=50)   # 10+ s at the full canvas
SHORT = dict(seconds=5, width=320, height=256, steps=5)


def _table(tmp_path, limits=None, **knobs):
    knobs = {"max_inflight": 1, **knobs}
    config = StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), queue_size=100,
                                    caller_limits=json.dumps(limits) if limits else None, **knobs)
    table = JobTable(config, GatewayMetrics())
    table.store.beat(table.instance, table.boot)
    return table


def _job(table, owner, geometry):
    v = Validated(validate_request(prompt="p", **geometry), {}, "MiniMax-H3")
    return table.admit(table.new(v, kind="stream", owner=owner), {})


def _run(table, jobs, unit_s):
    """A worker: each job taken runs cost x unit_s seconds. -> [(job, started, ended)] in the order run."""
    order = []
    t0 = time.monotonic()
    for _ in jobs:
        job = table.take()
        start = time.monotonic() - t0
        time.sleep(job_cost(job) * unit_s)
        table.finish(job, None)
        order.append((job, start, time.monotonic() - t0))
    return order


def test_costs_grow_with_frames_canvas_and_steps():
    t = lambda **g: job_cost(type("J", (), {"request": validate_request(prompt="p", **g)})())  # noqa: E731
    base = t(**SHORT)
    assert t(**{**SHORT, "steps": 9}) == pytest.approx(2 * base)       # 8 forwards against 4
    assert t(**{**SHORT, "seconds": 10}) > 1.9 * base                   # rows double, attention more than that
    assert t(**LONG) / base > 1000


def test_short_jobs_pass_long_ones_and_callers_get_their_shares(tmp_path):
    """alice (share 3) and bob (share 1) each queue 3 long jobs, then each 3 short ones, behind a job already
    running. Fair: the short jobs run before the queued long ones; the long ones alternate 3:1 in alice's favour.
    FIFO (the table before this change) makes every short job wait for all six long ones."""
    limits = {"alice": {"share": 3}, "bob": {"share": 1}}
    unit = 0.05 / job_cost(type("J", (), {"request": validate_request(prompt="p", **LONG)})())   # a long job: 50 ms
    table = _table(tmp_path, limits)
    try:
        first = _job(table, "alice", LONG)
        assert table.take() is first   # running: everything else queues behind it
        jobs = [_job(table, who, LONG) for who in ("alice", "bob") for _ in range(3)]
        jobs += [_job(table, who, SHORT) for who in ("alice", "bob") for _ in range(3)]
        table.finish(first, None)
        order = _run(table, jobs, unit)
    finally:
        table.close()
    kinds = ["short" if j.request.steps == 5 else "long" for j, _, _ in order]
    assert kinds[:6] == ["short"] * 6 and kinds[6:] == ["long"] * 6, kinds
    longs = [j.owner for j, _, _ in order if j.request.steps == 50]
    # alice's three long jobs cost a third of bob's each in her virtual time: all of hers run before bob's second
    assert longs.index("bob") >= 1 and longs[:4].count("alice") == 3, longs
    short_wait = max(s for j, s, _ in order if j.request.steps == 5)
    fifo_wait = 6 * 0.05   # under FIFO the last short job starts after the six long ones
    # while both callers had long work waiting (the first four long jobs), alice's part of it: her share 3 of 4
    alice_part = longs[:4].count("alice") / 4
    print("FIGURES", json.dumps({"short_job_max_wait_s": round(short_wait, 4), "fifo_short_wait_s": fifo_wait,
                                 "long_order": longs, "alice_part_while_both_wait": alice_part}))
    assert alice_part == 0.75
    assert short_wait < fifo_wait / 5


def test_a_long_job_waiting_past_the_starvation_bound_goes_first(tmp_path):
    table = _table(tmp_path, starvation_s=0.2)
    try:
        running = _job(table, "alice", SHORT)
        assert table.take() is running
        long_job = _job(table, "alice", LONG)
        shorts = [_job(table, "alice", SHORT) for _ in range(3)]
        table.finish(running, None)
        assert table.take() in shorts       # not starved yet: the shortest first
        time.sleep(0.25)
        assert table.take() is long_job     # waited past the bound: the oldest first
    finally:
        table.close()


def test_max_running_keeps_a_callers_extra_jobs_waiting(tmp_path):
    table = _table(tmp_path, {"alice": {"max_running": 1}}, max_inflight=2)
    try:
        a1, a2, b1 = _job(table, "alice", SHORT), _job(table, "alice", SHORT), _job(table, "bob", LONG)
        assert table.take() in (a1, a2)
        assert table.take() is b1           # alice is at max_running 1: bob's long job goes, though it is long
        got = []
        t = threading.Thread(target=lambda: got.append(table.take()))
        t.start()
        time.sleep(0.3)
        assert not got                      # alice's second waits for her first to finish
        table.finish(next(j for j in (a1, a2) if j.key in table.running), None)
        t.join(5)
        assert got and got[0] in (a1, a2)
    finally:
        table.close()


def test_max_queued_and_video_seconds_per_hour_are_429_naming_the_limit(tmp_path):
    table = _table(tmp_path, {"*": {"max_queued": 2}, "bob": {"video_seconds_per_hour": 11}})
    try:
        _job(table, "alice", SHORT)
        _job(table, "alice", SHORT)
        with pytest.raises(QuotaExceeded, match="max_queued=2") as e:
            _job(table, "alice", SHORT)
        c = classify(e.value)
        assert (c.kind.code, c.kind.http, c.kind.retryable, c.field) == ("quota_exceeded", 429, True, "max_queued")
        _job(table, "carol", SHORT)          # another caller is not held by alice's queue
        _job(table, "bob", SHORT)
        _job(table, "bob", SHORT)            # 2 x 124 frames = 10.33 s of 11
        with pytest.raises(QuotaExceeded, match="video_seconds_per_hour=11") as e:
            _job(table, "bob", dict(SHORT, seconds=5))
        assert e.value.field == "video_seconds_per_hour" and 3590 <= e.value.retry_after_s <= 3600
    finally:
        table.close()


@pytest.mark.parametrize("text, says", [
    ("[]", "a JSON object"), ("{", "not JSON"), ('{"a": 3}', "a: an object"),
    ('{"a": {"speed": 1}}', "a.speed: unknown"), ('{"a": {"share": 0}}', r"a.share=0: a number in \[0.01, 1000.0\]"),
    ('{"a": {"max_running": 1.5}}', r"a.max_running=1.5: an integer in \[1, 10000\]"),
    ('{"*": {"max_queued": true}}', r"\*.max_queued=True"),
])
def test_bad_caller_limits_are_refused_naming_the_caller_and_key(text, says):
    with pytest.raises(H3Error, match=says):
        parse_caller_limits(text)
