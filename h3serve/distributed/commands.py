"""The peer side of a stage's world (the whole exchange is drawn in `h3serve.distributed.world`): ranks 1..N-1
wait for rank 0's command in the store, run the same handler on the same broadcast payload, and post their outcome.

A build is `build(runtime, *args) -> {op: handler}`, the same on every rank (SPMD); a handler gets the payload and
`Local` on rank 0, None on the other ranks. The store keys and the heartbeat period below are the protocol both
sides share.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch.distributed as dist

from h3serve.errors import H3Error

log = logging.getLogger("h3serve.distributed.commands")

__all__ = ["Local", "Handler", "serve", "peer_main"]

HEARTBEAT_S = 0.5
CMD, DONE, HEARTBEAT, READY, SHUTDOWN = "h3/cmd/", "h3/done/", "h3/hb/", "h3/ready/", "__shutdown__"


@dataclass
class Local:
    """What only rank 0 has for a call: the caller's cancellation flag and progress callback."""

    should_stop: Callable[[], bool] | None = None
    on_step: Callable[[int, int], None] | None = None


Handler = Callable[[Any, "Local | None"], Any]


def _command_loop(runtime, handlers: dict[str, Handler]) -> None:
    """Execute rank 0's commands until shutdown, or return when rank 0 (the store) disappears."""
    # A client of its own that may block forever: an idle stage waits for requests without polling or timing out;
    # if rank 0 (the store's server) dies, the connection breaks and the wait raises.
    waiter = dist.TCPStore(runtime.master_addr, runtime.master_port, is_master=False,
                           timeout=timedelta(days=3650))
    seq = 0
    while True:
        seq += 1
        key = f"{CMD}{seq}"
        try:
            waiter.wait([key])
        except Exception as exc:  # noqa: BLE001
            log.error("rank %d: lost rank 0 (%s); exiting", runtime.rank, exc)
            return
        op = runtime.store.get(key).decode()
        if op == SHUTDOWN:
            return
        status = "ok"
        try:
            payload = runtime.broadcast_object(None)
            result = handlers[op](payload, None)
            if isinstance(result, Iterator):
                for _ in result:  # a streaming op: rank 0 consumes it, peers just run it
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported to rank 0, the loop goes on
            status = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (H3Error, ValueError)):
                log.exception("rank %d: %s failed", runtime.rank, op)
        try:
            runtime.store.set(f"{DONE}{seq}/{runtime.rank}", status)
        except Exception:  # noqa: BLE001
            return


def serve(runtime, build: Callable, build_args: tuple, on_ready: Callable[[], None] | None = None) -> None:
    """A rank other than 0: build its part, tell rank 0 it is ready (then `on_ready`), run rank 0's commands until
    shutdown; the runtime is closed on the way out."""
    try:
        handlers = build(runtime, *build_args)
        runtime.store.set(f"{READY}{runtime.rank}", "1")
        if on_ready is not None:
            on_ready()
        _command_loop(runtime, handlers)
    finally:
        runtime.close()


def peer_main(make_runtime: Callable, build: Callable, build_args: tuple, env: dict, report=None) -> None:
    """A spawned rank's process: its Runtime is made here (the store client and the process group belong to this
    process), `make_runtime` being `Runtime` with this rank's arguments bound. An error before it serves (a device
    it cannot open, a build that fails) goes to rank 0 through `report` (a pipe), which ends the start with it."""
    os.environ.update(env)
    try:
        runtime = make_runtime()
    except BaseException as exc:
        _report(report, exc)
        raise
    try:
        serve(runtime, build, build_args, on_ready=lambda: _report(report, None))
    except BaseException as exc:
        _report(report, exc)
        raise


def _report(conn, exc: BaseException | None) -> None:
    if conn is None or conn.closed:
        return
    try:
        if exc is not None:
            conn.send(f"{type(exc).__name__}: {exc}")
        conn.close()   # ready (or reported): nothing more to say
    except OSError:
        pass
