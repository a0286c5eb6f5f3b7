"""The stage runtime every servicer shares.

`StageBase` (one engine worker thread, status counters and the Status RPC, the transport choice, drain and
cancel, `request`: the scope of one request, finished however it ends), `RequestScope` (one request's cancel flag
and deadline, wired to its gRPC context), `first_message` (a request stream's opening message, checked) and
`HealthHandle` (the gRPC health status of the server and its service together). A stage's servicer class is its factory:
`XServicer(config, health)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import grpc
import torch
from grpc_health.v1 import health_pb2

from h3serve._proto import common_pb2
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import GRPC, SINKS
from h3serve.errors import Cancelled, DeadlineExceeded, RequestError
from h3serve.errortable import abort
from h3serve.runtime.device import PeakMemory
from h3serve.runtime.prechecks import stage_degree
from h3serve.runtime.ranks import ParallelStage
from h3serve.runtime.tls import Tls, authenticated_peer, check_peer, parse_peers
from h3serve.weights.manifest import IntegrityError
from h3serve.transport.choice import TransportChoice

log = logging.getLogger("h3serve.runtime.stage")
MODULE_CHECK_S = 0.05   # how often a checked forward looks at cancel and deadline
DEADLINE_SKEW_S = 0.5   # a call ended this close to its deadline ended by it, not by a cancel

HIDDEN = "hidden"   # a request id in the Status answered to a caller that is not an authenticated peer
NO_DEADLINE = 1e8   # grpc reports "no deadline" as a time_remaining of years


def first_message(requests: Iterator, name: str, allowed: str):
    """The first message of a request stream; refused naming `name` (with `allowed`) unless it carries `name`:
    the oneof member of that name, or a non-empty field."""
    first = next(requests, None)
    field = None if first is None else first.DESCRIPTOR.fields_by_name[name]
    if field is None or not (first.HasField(name) if field.message_type is not None else getattr(first, name)):
        raise RequestError(name, None, allowed)
    return first


class HealthHandle:
    """Sets the gRPC health status of the server ("") and of the stage's service together."""

    def __init__(self, servicer, names: list[str]):
        self.servicer = servicer
        self.names = names
        self.serving = False

    def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.serving = serving
        for name in ["", *self.names]:
            self.servicer.set(name, status)


class RequestScope:
    """One request inside a stage: a cancel flag set by the RPC's termination (client cancel, deadline, server
    stop), the deadline the caller sent, and counters of work units (steps, clips) for the stage's status."""

    def __init__(self, stage: "StageBase", context, request_id: str):
        self.stage = stage
        self.context = context
        self.request_id = request_id or "-"
        self.cancelled = threading.Event()
        self.reason = ""
        self.units = 0
        self.units_at_signal = -1
        self.started = time.monotonic()
        remaining = context.time_remaining() if context is not None else None
        self.deadline = None if remaining is None or remaining > NO_DEADLINE else self.started + remaining
        self.deadline_remaining_s = -1.0 if self.deadline is None else float(remaining)
        self.active = True
        self.outcome = "ok"
        self.peak_memory_mb = 0.0   # this process's peak over the request's engine work (h3serve.runtime.device)
        if context is not None:
            context.add_callback(self._terminated)

    def _terminated(self) -> None:
        if self.active:
            # the deadline here was taken when the scope began, a little after gRPC's own: allow for that
            past = self.deadline is not None and time.monotonic() >= self.deadline - DEADLINE_SKEW_S
            self.signal("deadline" if past else "cancelled")

    def signal(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.reason = reason
            self.units_at_signal = self.units
            self.cancelled.set()

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def should_stop(self) -> bool:
        if self.cancelled.is_set():
            return True
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.signal("deadline")
        elif self.context is not None and not self.context.is_active():
            self.signal("cancelled")
        elif self.stage.stopping.is_set():
            self.signal("server stopping")
        return self.cancelled.is_set()

    def check(self, where: str = "") -> None:
        """Raise if the request must stop (the table maps the error)."""
        if self.should_stop():
            at = f" ({where})" if where else ""
            if self.reason == "deadline":
                raise DeadlineExceeded(f"{self.stage.stage}: deadline passed{at}", stage=self.stage.stage)
            raise Cancelled(f"{self.stage.stage}: {self.reason}{at}")

    def unit_done(self, n: int = 1) -> None:
        self.units += n
        self.stage.work_units_total += n


class StageBase:
    """What every stage servicer shares. Subclasses set `stage`, implement `register`, `load` and their RPCs."""

    checks_modules = False   # a stage whose unit of work is one long forward checks cancel / deadline per module
    uses_device = True       # its work runs on the configured device (the muxer's on the host's cores)

    stage = "stage"
    manages_health = False

    def __init__(self, config: StageConfig, health: HealthHandle | None = None):
        self.config = config
        self.health = health
        self.stopping = threading.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"h3serve-{self.stage}",
                                           initializer=self._init_engine_thread)
        self.lock = threading.Lock()
        self.requests_total = 0
        self.cancelled_total = 0
        self.work_units_total = 0
        self.active: dict[int, RequestScope] = {}
        # The request whose work is on the engine thread right now. A cancelled RPC can return before the engine
        # finishes its current step; the stage is busy until then (its counters still move).
        self.engine_scope: RequestScope | None = None
        self.last: RequestScope | None = None
        self.last_seconds = 0.0
        self.load_seconds = 0.0
        self.load_error = ""   # why load failed when the stage stays up NOT_SERVING (IntegrityError)
        self.ready = False
        self.parallel = None   # h3serve.runtime.ranks.ParallelStage when the stage has several ranks
        self.transport = TransportChoice.undecided(config.server.transport or GRPC)   # decided at load: choose_transport
        self._channels: dict[str, grpc.Channel] = {}   # to the stages this one streams to, by address
        self._channels_lock = threading.Lock()
        self.tls = Tls.of(config)
        self.peers = parse_peers(config.server.peers)
        if self.peers is None and self.stage in SINKS:
            log.warning("%s: --peers not set: this stage dials any address a request names as its sink",
                        self.stage)

    def check_finite(self, **tensors: torch.Tensor) -> None:
        """Warm-up output must be finite: weights that compute NaN / Inf keep the stage NOT_SERVING."""
        for name, t in tensors.items():
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise IntegrityError(f"{self.stage}: warm-up {name} has {bad} NaN / Inf values of {t.numel()}: the "
                                     "weights are corrupt or do not match the model")

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _init_engine_thread(self) -> None:
        if self.config.model.threads:
            torch.set_num_threads(self.config.model.threads)

    def register(self, server) -> None:
        raise NotImplementedError

    def load(self) -> None:
        """Load the engine and warm it up (health stays NOT_SERVING until this returns)."""

    def on_ready(self) -> None:
        """Called once `load` returned and the stage is marked ready."""

    def drain(self) -> None:
        """Stop admitting new requests (the gateway); stages rely on the gateway and on health."""

    def busy(self) -> bool:
        return bool(self.active) or self.engine_scope is not None

    def choose_transport(self, *, probe: bool = True) -> None:
        """Decide, once at load, the transport of this stage's edges (`TransportChoice.decide`)."""
        self.transport = TransportChoice.decide(self.transport.requested, self.stage, probe=probe)

    def _on_engine(self, scope: RequestScope, fn: Callable[[], Any]) -> Any:
        self.engine_scope = scope
        peak = PeakMemory(self.device_type)
        hook = None
        # one long forward (a huge prompt): stop between modules (one rank only: ranks must not part mid-forward)
        if self.checks_modules and self.parallel is None:
            last = [time.monotonic()]

            def between_modules(_module, _args):
                now = time.monotonic()
                if now - last[0] >= MODULE_CHECK_S:
                    last[0] = now
                    scope.check("mid-forward")

            hook = torch.nn.modules.module.register_module_forward_pre_hook(between_modules)
        try:
            scope.check("before start")
            with peak:
                return fn()
        finally:
            if hook is not None:
                hook.remove()
            scope.peak_memory_mb = max(scope.peak_memory_mb, peak.mb)
            self.engine_scope = None

    def cancel_all(self) -> None:
        self.stopping.set()
        for scope in list(self.active.values()):
            scope.signal("server stopping")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.parallel is not None:   # the other ranks leave their command loop
            self.parallel.close()
        for channel in self._channels.values():
            channel.close()

    def channel(self, address: str, field: str = "sink.address") -> grpc.Channel:
        """The channel to another stage at `address` (one per address, for the life of this stage). The address
        comes in a request (a sink, its `field`): refused unless the deployment declares it (--peers), and with
        --tls-ca the peer must prove a certificate of the deployment's CA. Taken when the request arrives (before
        any work, and while the peer is still among the names' addresses: a draining one leaves them); a channel
        connects at its first call."""
        check_peer(self.peers, address, field)
        with self._channels_lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self.tls.channel(address)
        return channel

    def start_ranks(self):
        """With a degree above 1 for this stage: start its world (this process = rank 0) and return the
        `ParallelStage` (also kept as `self.parallel`); else None."""
        degrees = self.config.degrees
        if stage_degree(degrees, self.stage) <= 1:
            return None
        self.parallel = ParallelStage.start(self, degrees)
        return self.parallel

    def attention(self) -> dict | None:
        """The attention kernel this stage's model runs and why, {"kernel", "reason"}; None: no attention (or not
        loaded yet)."""
        return None

    @property
    def device_type(self) -> str:
        return self.config.model.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def gpus(self) -> int:
        """GPUs a request's work here occupies (every rank's): what its seconds are billed by."""
        if not self.uses_device or not self.device_type.startswith("cuda"):
            return 0
        return self.parallel.handle.world_size if self.parallel is not None else 1

    def info(self) -> dict:
        """The Status details (`StageStatus.info_json`). Every stage: `transport` ({requested, chosen, reason},
        stages with NIXL edges add `edge` and `last_stream`); stages with attention: `attention`."""
        out = {"load_seconds": round(self.load_seconds, 3), "profile": self.config.model.profile,
               "dtype": self.config.model.dtype, "threads": self.config.model.threads, "transport": self.transport.summary(),
               "gpus": self.gpus()}
        attention = self.attention()
        if attention is not None:
            out["attention"] = attention
        if self.load_error:
            out["load_error"] = self.load_error
        if self.parallel is not None:
            out.update(self.parallel.info())
        return out

    # -- requests -------------------------------------------------------------------------------------------
    def scope(self, context, request_id: str) -> RequestScope:
        scope = RequestScope(self, context, request_id)
        with self.lock:
            self.requests_total += 1
            self.active[id(scope)] = scope
        return scope

    @contextlib.contextmanager
    def request(self, context, request_id: str) -> Iterator[RequestScope]:
        """`with self.request(context, id) as scope:` around one request's work: the scope, finished when the
        block ends with the outcome its exception gives (none: ok)."""
        with self.finishing(self.scope(context, request_id)) as scope:
            yield scope

    @contextlib.contextmanager
    def finishing(self, scope: RequestScope) -> Iterator[RequestScope]:
        """Finish `scope` when the block ends: for a scope opened on one thread and worked on another."""
        try:
            yield scope
        except BaseException as exc:
            self.finish(scope, exc)
            raise
        self.finish(scope)

    def finish(self, scope: RequestScope, exc: BaseException | None = None) -> None:
        scope.active = False
        if exc is not None:
            if isinstance(exc, DeadlineExceeded) or scope.reason == "deadline":
                scope.outcome = "deadline"
            elif isinstance(exc, Cancelled) or scope.cancelled.is_set():
                scope.outcome = "cancelled"
            else:
                scope.outcome = "error"
        with self.lock:
            self.active.pop(id(scope), None)
            if scope.outcome in ("cancelled", "deadline"):
                self.cancelled_total += 1
            self.last = scope
            self.last_seconds = time.monotonic() - scope.started

    def run_engine(self, scope: RequestScope, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the stage's engine thread (one request at a time), giving up if the request stops while it
        waits for its turn. Exceptions propagate."""
        future = self.executor.submit(self._on_engine, scope, fn)
        while True:
            try:
                return future.result(timeout=0.1)
            except TimeoutError:
                if scope.should_stop() and future.cancel():
                    scope.check("while waiting for the engine")

    def engine_events(self, scope: RequestScope, work: Callable[[Callable[[Any], None]], Any],
                      wrap: Callable[[Any], Any] = lambda item: item):
        """Run `work(emit)` on the engine thread; yield `wrap(item)` for what it emits, as it emits it; return its
        result.

        Use as `result = yield from self.engine_events(scope, work)` inside a streaming RPC. A request that stops
        while waiting for the engine never starts; `Cancelled` from the engine is re-raised as the scope's reason
        (cancel or deadline)."""
        events: queue.Queue = queue.Queue()
        done = object()

        def job():
            try:
                return self._on_engine(scope, lambda: work(events.put))
            finally:
                events.put(done)

        future = self.executor.submit(job)
        while True:
            try:
                item = events.get(timeout=0.1)
            except queue.Empty:
                if scope.should_stop() and future.cancel():
                    scope.check("while waiting for the engine")
                continue
            if item is done:
                break
            yield wrap(item)
        try:
            return future.result()
        except Cancelled:
            scope.check(f"after {scope.units} units")
            raise

    def Status(self, request, context):
        """The Status RPC of every stage. Request ids (the gateway's job ids) only to an authenticated peer
        (mTLS) or a caller on this host: with --no-peer-auth anyone else the network lets through reads HIDDEN."""
        try:
            return self.status(ids=authenticated_peer(context))
        except Exception as exc:  # noqa: BLE001 - the table decides
            abort(context, exc, stage=self.stage)

    def status(self, ids: bool = True):
        current = next(iter(self.active.values()), None) or self.engine_scope
        last = self.last
        msg = common_pb2.StageStatus(
            stage=self.stage, ready=self.ready, pid=os.getpid(), requests_total=self.requests_total,
            cancelled_total=self.cancelled_total, work_units_total=self.work_units_total,
            current_request_id=(current.request_id if ids else HIDDEN) if current else "",
            info_json=json.dumps(self.info()))
        if last is not None:
            msg.last.CopyFrom(common_pb2.LastRequest(
                request_id=last.request_id if ids else HIDDEN, outcome=last.outcome, units_done=last.units,
                units_at_signal=last.units_at_signal, deadline_remaining_s=last.deadline_remaining_s,
                seconds=self.last_seconds))
        return msg
