"""SIGTERM to `h3serve serve`: the gateway stops admitting (UNAVAILABLE / 503), finishes the request in flight
within the grace period, the stages stop after it, and the launcher exits 0. A stack of its own."""

from __future__ import annotations

import signal
import time

import httpx

from h3serve.client import Client, Draining, Progress
from h3serve.testing.mp4check import check_mp4

from .conftest import REQUEST, Stack


def test_sigterm_drains_and_exits_zero(tiny_checkpoint):
    stack = Stack(tiny_checkpoint, "--grace-s", "60", "--queue-size", "2")
    try:
        with Client(stack.grpc, timeout=120, retry=None) as client:   # the refusal itself, not its retries
            gen = client.stream(**dict(REQUEST, num_inference_steps=30))
            for event in gen:
                if isinstance(event, Progress) and event.stage == "dit":
                    break
            stack.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 10
            while time.monotonic() < end:   # readiness turns off as the gateway starts draining
                if httpx.get(f"{stack.http}/ready", timeout=2).status_code == 503:
                    break
                time.sleep(0.05)
            assert httpx.get(f"{stack.http}/ready", timeout=2).json()["draining"] is True
            r = httpx.post(f"{stack.http}/v1/videos", json={"prompt": "x", "size": "320x256"}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            t0 = time.monotonic()
            try:
                client.generate(**REQUEST)
                raise AssertionError("a request was admitted while draining")
            except Draining:
                assert time.monotonic() - t0 < 2.0
            result = gen.result()      # the request in flight completes
        assert check_mp4(result.mp4, expect_frames=124, fps=24, width=320, height=256).frames == 124
        assert stack.proc.wait(90) == 0
    finally:
        stack.stop()


def test_sigterm_cancels_what_the_grace_period_cannot_finish(tiny_checkpoint):
    stack = Stack(tiny_checkpoint, "--grace-s", "3", "--queue-size", "2")
    try:
        with Client(stack.grpc, timeout=120) as client:
            running = client.stream(**dict(REQUEST, num_inference_steps=400))   # far longer than the grace
            for event in running:
                if isinstance(event, Progress) and event.stage == "dit":
                    break
            queued = client.stream(**REQUEST)
            next(iter(queued))                                                   # accepted, waiting
            t0 = time.monotonic()
            stack.proc.send_signal(signal.SIGTERM)
            try:
                queued.result()
                raise AssertionError("a queued request ran after SIGTERM")
            except Draining:
                assert time.monotonic() - t0 < 2.0       # not started: refused at once
            try:
                running.result()
                raise AssertionError("the long request finished within a 3 s grace period")
            except Draining:
                assert time.monotonic() - t0 < 3.0 + 5.0   # cancelled after the grace period
        assert stack.proc.wait(60) == 0
        assert time.monotonic() - t0 < 30.0
    finally:
        stack.stop()
