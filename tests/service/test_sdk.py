"""The SDK against a real gateway and stages: a dropped stream re-attached to its job, a generation that survives a
stage killed mid-job (retried under the same request_id: one MP4, the embedded pipeline's), idempotent cancel, an
oversize request refused as TooLarge (not a retryable QueueFull), and docs/sdk.md's examples run as written."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from h3serve.client import (AsyncClient, Cancelled, Client, NotFound, Progress, Retry, TooLarge, VideoRequest)
from h3serve.testing.faults import wait_replaced

from .conftest import REPO, REQUEST

PATIENT = Retry(attempts=30, initial_backoff_s=0.2, max_backoff_s=2.0, deadline_s=150.0)


def _drop(gen) -> None:
    """Drop a stream as a lost connection does: the call ends; the SDK is not told to cancel the request."""
    gen._call.cancel()


def test_a_dropped_stream_is_reattached_and_gets_the_whole_mp4(stack, embedded):
    stack.wait_ready()
    with Client(stack.grpc, timeout=120) as client:
        gen = client.stream(**dict(REQUEST, request_id="drop-me"))
        for event in gen:
            if isinstance(event, Progress) and event.stage == "dit":
                break
        _drop(gen)
        time.sleep(0.5)   # the gateway has seen the call end; the job runs on
        again = client.attach("drop-me")
        events = list(again)
        result = again.result()
        assert result.mp4 == embedded(**REQUEST)
        assert events[0].request_id == "drop-me"                      # replayed from the start (Accepted)
        assert [e.done for e in events if isinstance(e, Progress) and e.stage == "dit"] == [1, 2, 3]
        # finished: attached again it replays the same MP4; cancel answers its state, no NotFound
        assert client.attach("drop-me").result().sha256 == result.sha256
        state = client.cancel("drop-me")
        assert (state.cancelled, state.status) == (False, "completed"), state
        with pytest.raises(NotFound, match="to attach to"):
            list(client.attach("no-such-request"))


def test_async_attach_and_the_same_methods(stack, embedded):
    async def run():
        async with AsyncClient(stack.grpc, timeout=120) as client:
            await client.wait_ready(30)
            assert (await client.info())["max_message_bytes"] == str(65 << 20)
            gen = client.stream(VideoRequest(**REQUEST, request_id="async-drop"))
            async for event in gen:
                if isinstance(event, Progress) and event.stage == "dit":
                    break
            _drop(gen)
            return await client.attach("async-drop").result()

    assert asyncio.run(run()).mp4 == embedded(**REQUEST)


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_generate_survives_the_dit_killed_mid_job(stack, embedded, flavour):
    """kill -9 of the DiT at its first step: the job fails UNAVAILABLE naming the dit, the SDK submits it again
    under the same request_id (refused while the launcher restarts the DiT, retried with backoff) and returns the
    one MP4, byte for byte the embedded pipeline's."""
    stack.wait_ready()
    pid = stack.status("dit").pid
    killed = []
    rid = f"survive-kill-{flavour}"

    def on_progress(p: Progress) -> None:
        if p.stage == "dit" and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    if flavour == "sync":
        with Client(stack.grpc, timeout=240, retry=PATIENT) as client:
            result = client.generate(**dict(REQUEST, request_id=rid), on_progress=on_progress)
            state = client.cancel(rid)
    else:
        async def run():
            async with AsyncClient(stack.grpc, timeout=240, retry=PATIENT) as client:
                return (await client.generate(VideoRequest(**REQUEST, request_id=rid), on_progress=on_progress),
                        await client.cancel(rid))
        result, state = asyncio.run(run())
    assert killed, "the DiT was never killed"
    assert result.mp4 == embedded(**REQUEST)
    assert result.attempts >= 2 and result.request_id == rid
    assert state.status == "completed"                                    # one job of that id, and it completed
    assert wait_replaced(lambda: stack.status("dit"), pid, timeout_s=5)   # it really was a new DiT process
    print("FIGURES", {"flavour": flavour, "sdk_attempts_after_dit_kill": result.attempts,
                      "recovered_after_s": round(time.monotonic() - killed[0], 2)})


def test_without_retries_the_kill_is_reported_and_cancel_is_idempotent(stack):
    stack.wait_ready()
    pid = stack.status("dit").pid
    with Client(stack.grpc, timeout=120, retry=None) as client:
        gen = client.stream(**dict(REQUEST, request_id="killed-once"))
        for event in gen:
            if isinstance(event, Progress) and event.stage == "dit":
                os.kill(pid, signal.SIGKILL)
                break
        with pytest.raises(Exception) as info:
            gen.result()
        assert type(info.value).__name__ == "StageUnavailable" and info.value.stage == "dit", info.value
        state = client.cancel("killed-once")
        assert (state.cancelled, state.status, state.error_code) == (False, "failed", "stage_unavailable")
        assert client.cancel("killed-once") == state                  # and again: the same answer
    assert wait_replaced(lambda: stack.status("dit"), pid, timeout_s=120)
    stack.wait_ready()


def test_oversize_is_too_large_naming_size_and_limit_and_not_retried(stack):
    big = b"\x89PNG" + bytes(66 << 20)
    with Client(stack.grpc, timeout=60) as client:
        with pytest.raises(TooLarge, match=r"the request is \d+ bytes .*limit of 68157440 bytes \(65 MiB\)"):
            client.generate("x", first_image=big)                     # refused before sending
    t0 = time.monotonic()
    with Client(stack.grpc, timeout=60, max_send_bytes=1 << 30, retry=PATIENT) as client:   # sent: the gateway
        with pytest.raises(TooLarge, match=r"\d+ bytes .*limit of 68157440 bytes") as info:  # refuses it
            client.generate("x", first_image=big)
    assert not isinstance(info.value, Cancelled) and time.monotonic() - t0 < 10   # once, not retried


def test_docs_sdk_examples_run(stack, tmp_path, monkeypatch):
    """Every python block of docs/sdk.md, in order, in one namespace, against the test gateway."""
    stack.wait_ready()
    text = (REPO / "docs" / "sdk.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4, "docs/sdk.md lost its examples"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "sdk_doc"}
    for i, block in enumerate(blocks):
        code = block.replace("127.0.0.1:50051", stack.grpc)
        exec(compile(code, f"docs/sdk.md[{i}]", "exec"), namespace)
    assert (tmp_path / "kite.mp4").stat().st_size > 0


def test_the_table_keeps_finished_stream_jobs_for_attach_within_bounds(tmp_path, monkeypatch):
    """A finished stream job stays watchable: its id is refused while it completed (a retry re-attaches), taken
    again when it failed (a retry replaces the failed try); the oldest go past KEEP_FINISHED_JOBS."""
    from h3serve.config.request import validate_request
    from h3serve.config.stage import StageConfig
    from h3serve.errors import AlreadyExists, StageUnavailable
    from h3serve.services.gateway import jobs as jobs_module
    from h3serve.services.gateway.fields import Validated
    from h3serve.services.gateway.metrics import GatewayMetrics

    table = jobs_module.JobTable(StageConfig.from_knobs(jobs_dir=str(tmp_path / "jobs"), queue_size=8),
                                 GatewayMetrics())
    validated = Validated(validate_request(prompt="p", seconds=5, width=320, height=256, steps=4), {}, "m")

    def run(rid: str, exc=None):
        job = table.new(validated, kind="stream", request_id=rid, owner="alice")
        job.opening = lambda j: f"accepted {j.id}"
        table.admit(job, {})
        assert table.take() is job
        job.emit("progress")
        table.finish(job, exc)
        return job

    try:
        done = run("done")
        assert list(table.watchable("done", "alice").watch(object(), lambda: True)) == ["accepted done", "progress"]
        with pytest.raises(AlreadyExists):
            table.admit(table.new(validated, kind="stream", request_id="done", owner="alice"), {})
        with pytest.raises(NotFound):
            table.watchable("done", "bob")                       # another caller's namespace
        failed = run("failed", StageUnavailable("dit", "killed"))
        assert table.cancel("failed", owner="alice", grpc_jobs=True) is False and failed.status == "failed"
        again = run("failed")                                    # the retry replaces the failed try
        assert table.watchable("failed", "alice") is again and again.status == "completed"
        monkeypatch.setattr(jobs_module, "KEEP_FINISHED_JOBS", 2)
        run("third")
        with pytest.raises(NotFound, match="to attach to"):
            table.watchable("done", "alice")                     # the oldest of three went
        assert done.status == "completed"
    finally:
        table.close()
