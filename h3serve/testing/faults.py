"""Killing a stage in the middle of a request, for tests: SIGKILL a process at the first progress event of a stage,
then wait for its supervisor (the launcher, the kubelet) to replace it."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from h3serve.client import Client, Progress
from h3serve.errors import StageUnavailable


def kill_mid_request(client: Client, request: dict, stage: str, pid: int) -> tuple[StageUnavailable, float]:
    """Stream `request` and SIGKILL `pid` at the first progress event of `stage`. Returns the StageUnavailable the
    stream ends with and when the kill happened (time.monotonic()); AssertionError when nothing was killed or the
    request still succeeded."""
    killed_at = None
    gen = client.stream(**request)
    try:
        for event in gen:
            if isinstance(event, Progress) and event.stage == stage and killed_at is None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        gen.result()
    except StageUnavailable as exc:
        assert killed_at is not None, f"the request failed before any {stage} progress: {exc}"
        return exc, killed_at
    raise AssertionError(f"the request succeeded although pid {pid} was killed at the {stage}'s first progress")


def wait_replaced(status: Callable[[], object], pid: int, *, ready: bool = True, timeout_s: float = 120.0) -> bool:
    """Wait until `status()` (a StageStatus) names a process other than `pid` (and, with `ready`, a ready one);
    errors while it is down are waited through. Returns whether it was replaced within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            st = status()
            if st.pid != pid and (st.ready or not ready):
                return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    return False
