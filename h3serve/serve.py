"""`h3serve serve`: run stage servers, one per process, and supervise them on one host.

    h3serve serve --checkpoint DIR --stages all --port 50051 --http-port 8000
        launcher: starts encoder, dit, vae, muxer and gateway as separate processes on loopback, waits until each
        reports SERVING on gRPC health checking, prints the endpoints, restarts a stage that dies, and on SIGTERM
        drains the gateway first, then stops the stages; exits 0.
    h3serve serve --checkpoint DIR --stages dit --port 50053
        one stage in this process (what a container of the disaggregated layout runs).

Ports with `--stages all`: gateway gRPC = --port, then encoder, dit, vae, muxer = --port + 1 .. + 4 (or free
ports when --port is 0); HTTP = --http-port (a free port when 0).

The stage runtime lives here too: `StageConfig` (every knob), `StageBase` (what a stage servicer shares: one
engine worker thread, status counters, drain and cancel), `RequestScope` (one request's cancel flag and deadline,
wired to its gRPC context) and `run_stage` (bind, health NOT_SERVING, load + warm up, SERVING, wait for SIGTERM,
drain within the grace period, exit 0).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from h3serve.errors import Cancelled, H3Error

log = logging.getLogger("h3serve.serve")

STAGES = ("encoder", "dit", "vae", "muxer", "gateway")
MODEL_STAGES = ("encoder", "dit", "vae")
SERVICE_NAMES = {"encoder": "h3serve.v1.Encoder", "dit": "h3serve.v1.DiT", "vae": "h3serve.v1.VAE",
                 "muxer": "h3serve.v1.Muxer", "gateway": "h3serve.v1.Gateway"}
PORT_OFFSETS = {"gateway": 0, "encoder": 1, "dit": 2, "vae": 3, "muxer": 4}
START_ORDER = ("muxer", "vae", "dit", "encoder", "gateway")
EXIT_LOAD_FAILED = 3
NO_DEADLINE = 1e8   # grpc reports "no deadline" as a time_remaining of years


@dataclass
class StageConfig:
    """Every knob of every stage (a stage reads the ones it uses; see docs/services.md)."""

    stage: str = "gateway"
    checkpoint: str | None = None
    profile: str = "base"
    adapter: str | None = None
    adapter_sha256: str | None = None
    dtype: str = "fp32"
    device: str | None = None
    threads: int = 0                 # torch intra-op threads of the engine (0: torch's default)
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None     # address peers should use for this process (default host:port)
    grace_s: float = 30.0
    rpc_workers: int = 32
    warmup: bool = True
    # gateway
    encoder: str | None = None
    dit: str | None = None
    vae: str | None = None
    muxer: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None     # None: no HTTP API
    queue_size: int = 8
    max_inflight: int = 1
    request_timeout_s: float = 3600.0
    jobs_dir: str | None = None
    job_ttl_s: float = 3600.0
    max_jobs: int = 1000
    max_sync_bytes: int = 64 << 20
    transport: str = "grpc"
    model_name: str | None = None
    # parallel degrees of the model stages (encoder TP, DiT Ulysses x Ring, VAE patch parallel); see stage_ranks
    encoder_tp: int = 1
    ulysses: int = 1
    ring: int = 1
    vae_pp: int = 1
    # vae
    frame_format: str = "yuv420p"    # what the VAE sends the muxer: yuv420p planes (1.5 B/px) or rgb24 (3 B/px)
    # muxer
    mux_threads: int = 16  # x264 frame threads (fixed: the MP4 bytes depend on it)
    crf: int = 18
    preset: str = "veryfast"
    session_ttl_s: float = 600.0
    tmp_dir: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The address peers use: --advertise, else host:port (loopback when bound to every interface)."""
        return self.advertise or f"{connect_host(self.host)}:{self.port}"


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


# ---------------------------------------------------------------------------------------------------------------
# Stage runtime

class HealthHandle:
    """Sets the gRPC health status of the server ("") and of the stage's service together."""

    def __init__(self, servicer, names: list[str]):
        self.servicer = servicer
        self.names = names
        self.serving = False

    def set(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

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
        self.peak_memory_mb = 0.0   # this process's peak over the request's engine work (h3serve.memory)
        if context is not None:
            context.add_callback(self._terminated)

    def _terminated(self) -> None:
        if self.active:
            past = self.deadline is not None and time.monotonic() >= self.deadline
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
            from h3serve.errortable import DeadlineExceeded

            at = f" ({where})" if where else ""
            if self.reason == "deadline":
                raise DeadlineExceeded(f"{self.stage.stage}: deadline passed{at}", stage=self.stage.stage)
            raise Cancelled(f"{self.stage.stage}: {self.reason}{at}")

    def unit_done(self, n: int = 1) -> None:
        self.units += n
        self.stage.work_units_total += n


class StageBase:
    """What every stage servicer shares. Subclasses set `stage`, implement `register`, `load` and their RPCs."""

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
        self.ready = False
        self.parallel = None   # h3serve.stage_ranks.ParallelStage when the stage has several ranks

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _init_engine_thread(self) -> None:
        if self.config.threads:
            import torch

            torch.set_num_threads(self.config.threads)

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

    def _on_engine(self, scope: RequestScope, fn: Callable[[], Any]) -> Any:
        import torch

        from h3serve.memory import PeakMemory

        self.engine_scope = scope
        peak = PeakMemory(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            scope.check("before start")
            with peak:
                return fn()
        finally:
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

    def start_ranks(self):
        """With a degree above 1 for this stage: start its world (this process = rank 0) and return the
        `ParallelStage` (also kept as `self.parallel`); else None."""
        from h3serve.stage_ranks import ParallelStage, degrees_of, stage_degree

        degrees = degrees_of(self.config)
        if stage_degree(degrees, self.stage) <= 1:
            return None
        self.parallel = ParallelStage.start(self, degrees)
        return self.parallel

    def info(self) -> dict:
        out = {"load_seconds": round(self.load_seconds, 3), "profile": self.config.profile,
               "dtype": self.config.dtype, "threads": self.config.threads}
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

    def finish(self, scope: RequestScope, exc: BaseException | None = None) -> None:
        scope.active = False
        if exc is not None:
            from h3serve.errortable import DeadlineExceeded

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

    def status(self):
        from h3serve._proto import common_pb2

        current = next(iter(self.active.values()), None) or self.engine_scope
        last = self.last
        msg = common_pb2.StageStatus(
            stage=self.stage, ready=self.ready, pid=os.getpid(), requests_total=self.requests_total,
            cancelled_total=self.cancelled_total, work_units_total=self.work_units_total,
            current_request_id=current.request_id if current else "", info_json=json.dumps(self.info()))
        if last is not None:
            msg.last.CopyFrom(common_pb2.LastRequest(
                request_id=last.request_id, outcome=last.outcome, units_done=last.units,
                units_at_signal=last.units_at_signal, deadline_remaining_s=last.deadline_remaining_s,
                seconds=self.last_seconds))
        return msg


class StageProcess:
    """A stage's gRPC server: bind, health, reflection, load, drain. `run_stage` adds signals around it."""

    def __init__(self, config: StageConfig, servicer_factory: Callable | None = None):
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from h3serve.transport.grpc import MESSAGE_LIMIT, server_options

        self.config = config
        if servicer_factory is None:
            servicer_factory = importlib.import_module(f"h3serve.services.{config.stage}.server").create
        self.health_servicer = health.HealthServicer(experimental_non_blocking=True)
        service = SERVICE_NAMES.get(config.stage, config.stage)
        self.health = HealthHandle(self.health_servicer, [service])
        self.health.set(False)
        self.servicer = servicer_factory(config, self.health)
        max_message = max(MESSAGE_LIMIT, getattr(self.servicer, "max_message", MESSAGE_LIMIT))
        self.server = grpc.server(ThreadPoolExecutor(max_workers=config.rpc_workers,
                                                     thread_name_prefix=f"grpc-{config.stage}"),
                                  options=server_options(max_message))
        self.servicer.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, self.server)
        reflection.enable_server_reflection(
            [service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        if not self.port:
            raise H3Error(f"{config.stage}: cannot listen on {config.host}:{config.port}")
        config.port = self.port
        self.server.start()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def load(self) -> None:
        t0 = time.perf_counter()
        self.servicer.load()
        self.servicer.load_seconds = time.perf_counter() - t0
        self.servicer.ready = True
        if not self.servicer.manages_health:
            self.health.set(True)
        self.servicer.on_ready()

    def shutdown(self, grace: float | None = None) -> None:
        """Stop admitting, let in-flight work finish within `grace` seconds, cancel what is left, stop."""
        grace = self.config.grace_s if grace is None else grace
        self.health_servicer.enter_graceful_shutdown()
        self.servicer.ready = False
        self.servicer.drain()
        end = time.monotonic() + grace
        while self.servicer.busy() and time.monotonic() < end:
            time.sleep(0.05)
        if self.servicer.busy():
            log.warning("%s: grace period of %.1fs over; cancelling in-flight work", self.config.stage, grace)
        self.servicer.cancel_all()
        end = time.monotonic() + 10.0   # cancelled work stops within one step / one clip
        while self.servicer.busy() and time.monotonic() < end:
            time.sleep(0.05)
        self.server.stop(1.0).wait(5.0)
        self.servicer.close()


def announce(event: str, **fields_: Any) -> None:
    """One JSON line on stdout for supervisors and tests."""
    print(json.dumps({"event": event, **fields_}), flush=True)


def run_stage(config: StageConfig) -> int:
    """Run one stage in this process until SIGTERM / SIGINT; return the exit code (0 after a clean drain)."""
    stop = threading.Event()
    signals = []

    def on_signal(signum, _frame):
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    proc = StageProcess(config)
    announce("listening", stage=config.stage, address=proc.address, pid=os.getpid())
    try:
        proc.load()
    except Exception as exc:  # noqa: BLE001 - a stage that cannot load exits non-zero, health never SERVING
        log.error("%s: load failed: %s", config.stage, exc, exc_info=not isinstance(exc, H3Error))
        print(f"h3serve: {config.stage}: load failed: {exc}", file=sys.stderr, flush=True)
        proc.server.stop(0)
        return EXIT_LOAD_FAILED
    announce("ready", stage=config.stage, address=proc.address, pid=os.getpid(),
             load_seconds=round(proc.servicer.load_seconds, 3))
    while not stop.wait(0.5):
        pass
    log.info("%s: signal %s: draining (grace %.1fs)", config.stage, signals[:1], config.grace_s)
    proc.shutdown()
    announce("stopped", stage=config.stage, pid=os.getpid())
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Launcher

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_stages(text: str) -> list[str]:
    from h3serve.errors import RequestError

    if text.strip() == "all":
        return list(STAGES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STAGES]
    if bad or not names:
        raise RequestError("stages", text, "all, or a comma list of " + ", ".join(STAGES))
    return [s for s in STAGES if s in names]


def wait_serving(address: str, timeout: float, *, service: str = "", alive: Callable[[], bool] = lambda: True) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            if not alive():
                return False
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


_PASS = ("checkpoint", "profile", "adapter", "adapter_sha256", "dtype", "device", "threads", "host", "grace_s",
         "queue_size", "max_inflight", "request_timeout_s", "jobs_dir", "job_ttl_s", "max_jobs", "max_sync_bytes",
         "transport", "model_name", "frame_format", "mux_threads", "crf", "preset", "session_ttl_s", "tmp_dir", "http_host",
         "encoder_tp", "ulysses", "ring", "vae_pp")


def child_argv(config: StageConfig, stage: str, port: int, addresses: dict[str, str], http_port: int | None,
               log_level: str) -> list[str]:
    argv = [sys.executable, "-m", "h3serve.cli", "--log-level", log_level, "serve", "--stages", stage,
            "--port", str(port)]
    if not config.warmup:
        argv.append("--no-warmup")
    for name in _PASS:
        value = getattr(config, name)
        if value is not None and value != getattr(StageConfig, name, None):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if stage == "gateway":
        for s in MODEL_STAGES + ("muxer",):
            if s in addresses:
                argv += [f"--{s}", addresses[s]]
        if http_port is not None:
            argv += ["--http-port", str(http_port)]
    return argv


class Launcher:
    """Starts the stages as child processes, waits for health, supervises (restarts a stage that dies) and stops
    them in order on SIGTERM: the gateway first (it drains), then the stages."""

    def __init__(self, config: StageConfig, stages: list[str], *, base_port: int, http_port: int | None,
                 start_timeout: float, restart: bool, log_level: str, json_output: bool):
        self.config = config
        self.stages = stages
        self.start_timeout = start_timeout
        self.restart = restart
        self.log_level = log_level
        self.json_output = json_output
        host = config.host
        self.ports = {s: (free_port(host) if base_port == 0 else base_port + PORT_OFFSETS[s]) for s in stages}
        self.http_port = None
        if "gateway" in stages and http_port is not None:
            self.http_port = free_port(config.http_host) if http_port == 0 else http_port
        self.addresses = {s: f"{connect_host(host)}:{p}" for s, p in self.ports.items()}
        for s in MODEL_STAGES + ("muxer",):   # a gateway without local stages talks to the ones given
            if s not in self.addresses and getattr(config, s):
                self.addresses[s] = getattr(config, s)
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {s: 0 for s in stages}
        self.stopping = threading.Event()

    def spawn(self, stage: str) -> subprocess.Popen:
        argv = child_argv(self.config, stage, self.ports[stage], self.addresses, self.http_port, self.log_level)
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        self.procs[stage] = proc
        return proc

    def endpoints(self) -> dict:
        out = {"stages": {s: {"address": self.addresses[s], "pid": self.procs[s].pid} for s in self.stages}}
        if "gateway" in self.stages:
            http_host = connect_host(self.config.http_host)
            out["gateway"] = {"grpc": self.addresses["gateway"],
                              "http": f"http://{http_host}:{self.http_port}" if self.http_port else None}
        return out

    def start(self) -> bool:
        for stage in START_ORDER:
            if stage in self.stages:
                self.spawn(stage)
        end = time.monotonic() + self.start_timeout
        for stage in START_ORDER:
            if stage not in self.stages:
                continue
            proc = self.procs[stage]
            ok = wait_serving(self.addresses[stage], max(0.0, end - time.monotonic()),
                              alive=lambda p=proc: p.poll() is None)
            if not ok:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else \
                    f"not SERVING within {self.start_timeout:.0f}s"
                print(f"h3serve: {stage} {why}", file=sys.stderr, flush=True)
                return False
        return True

    def print_endpoints(self) -> None:
        eps = self.endpoints()
        if self.json_output:
            announce("serving", **eps)
            return
        if "gateway" in eps:
            print(f"gateway grpc  {eps['gateway']['grpc']}")
            if eps["gateway"]["http"]:
                print(f"gateway http  {eps['gateway']['http']}")
        for s, e in eps["stages"].items():
            if s != "gateway":
                print(f"{s:<13} {e['address']}  (pid {e['pid']})")
        sys.stdout.flush()

    def supervise(self) -> None:
        backoff = {s: 1.0 for s in self.stages}
        while not self.stopping.wait(0.25):
            for stage in self.stages:
                proc = self.procs[stage]
                if proc.poll() is None or self.stopping.is_set():
                    continue
                if not self.restart:
                    print(f"h3serve: {stage} exited with {proc.returncode}; stopping", file=sys.stderr, flush=True)
                    self.stopping.set()
                    break
                print(f"h3serve: {stage} (pid {proc.pid}) exited with {proc.returncode}; restarting in "
                      f"{backoff[stage]:.0f}s", file=sys.stderr, flush=True)
                if self.stopping.wait(backoff[stage]):
                    break
                self.restarts[stage] += 1
                new = self.spawn(stage)
                backoff[stage] = min(30.0, backoff[stage] * 2)
                if self.json_output:
                    announce("restarted", stage=stage, pid=new.pid, address=self.addresses[stage])
                threading.Thread(target=self._reset_backoff, args=(stage, new, backoff), daemon=True).start()

    def _reset_backoff(self, stage: str, proc: subprocess.Popen, backoff: dict) -> None:
        if wait_serving(self.addresses[stage], self.start_timeout, alive=lambda: proc.poll() is None):
            backoff[stage] = 1.0

    def stop(self) -> int:
        """SIGTERM the gateway, wait for it to drain, then the stages; SIGKILL what overstays."""
        self.stopping.set()
        grace = self.config.grace_s
        order = ["gateway"] + [s for s in START_ORDER if s != "gateway"]
        codes = {}
        for group in (["gateway"], [s for s in order if s != "gateway"]):
            live = [s for s in group if s in self.procs and self.procs[s].poll() is None]
            for s in live:
                self.procs[s].send_signal(signal.SIGTERM)
            end = time.monotonic() + grace + 15.0
            for s in live:
                try:
                    codes[s] = self.procs[s].wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"h3serve: {s} did not stop within {grace + 15:.0f}s; killing", file=sys.stderr)
                    self.procs[s].kill()
                    codes[s] = self.procs[s].wait()
        bad = {s: c for s, c in codes.items() if c not in (0, None)}
        if bad:
            print(f"h3serve: stages exited with {bad}", file=sys.stderr, flush=True)
        return 0


def config_from_args(args: argparse.Namespace, stage: str) -> StageConfig:
    values = {f.name: getattr(args, f.name) for f in fields(StageConfig)
              if hasattr(args, f.name) and getattr(args, f.name) is not None}
    values["stage"] = stage
    values["warmup"] = not getattr(args, "no_warmup", False)
    return StageConfig(**values)


def serve_main(args: argparse.Namespace) -> int:
    from h3serve import stage_ranks

    stages = parse_stages(args.stages)
    if any(s in MODEL_STAGES for s in stages) and not args.checkpoint:
        raise H3Error("--checkpoint DIR is required to serve " + ", ".join(s for s in stages if s in MODEL_STAGES))
    degrees = stage_ranks.validate_degrees(stage_ranks.degrees_of(args), args.checkpoint)
    env = stage_ranks.dist_env() if any(stage_ranks.stage_degree(degrees, s) > 1 for s in stages) else None
    if env is not None and len(stages) > 1:
        raise H3Error(f"--stages {args.stages} with RANK/WORLD_SIZE of a multi-node or torchrun world: each model "
                      "stage is its own world there; run one stage per process (--stages encoder|dit|vae)")
    if len(stages) == 1:
        config = config_from_args(args, stages[0])
        if env is not None and env["rank"] != 0:   # a joined rank other than 0: its part of the model, no gRPC
            return stage_ranks.run_peer(stages[0], config, degrees)
        if stages[0] == "gateway":
            missing = [s for s in MODEL_STAGES + ("muxer",) if not getattr(config, s)]
            if missing:
                raise H3Error("a lone gateway needs the stage addresses: " +
                              " ".join(f"--{s} HOST:PORT" for s in missing))
        return run_stage(config)
    if "gateway" in stages:
        missing = [s for s in MODEL_STAGES + ("muxer",) if s not in stages and not getattr(args, s, None)]
        if missing:
            raise H3Error("the gateway needs every stage: serve them here or give " +
                          " ".join(f"--{s} HOST:PORT" for s in missing))
    config = config_from_args(args, "gateway")
    launcher = Launcher(config, stages, base_port=args.port, http_port=args.http_port,
                        start_timeout=args.start_timeout, restart=not args.no_restart,
                        log_level=args.log_level, json_output=args.json)
    stop = threading.Event()

    def on_signal(_signum, _frame):
        stop.set()
        launcher.stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if not launcher.start():
            launcher.stop()
            return EXIT_LOAD_FAILED
        launcher.print_endpoints()
        launcher.supervise()
    finally:
        code = launcher.stop()
    if args.json:
        announce("stopped")
    return code


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = StageConfig()
    p.add_argument("--checkpoint", default=None, help="diffusers-format H3 folder (encoder, dit, vae stages)")
    p.add_argument("--stages", default="all", help="all, or a comma list of encoder,dit,vae,muxer,gateway")
    p.add_argument("--port", type=int, default=50051,
                   help="gRPC port: of the one stage, or of the gateway with stages at +1..+4 (0: free ports)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP API port of the gateway (0: a free port; default 8000 with the gateway, else none)")
    p.add_argument("--host", default=d.host, help="bind address (default loopback)")
    p.add_argument("--http-host", default=d.http_host)
    p.add_argument("--advertise", default=None, help="address peers use to reach this stage (default host:port)")
    p.add_argument("--profile", default=d.profile, help="base | fasth3")
    p.add_argument("--adapter", default=None, help="FastH3 adapter (profile fasth3)")
    p.add_argument("--adapter-sha256", default=None)
    p.add_argument("--dtype", default=d.dtype, help="fp32 | bf16")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per stage engine (0: default)")
    p.add_argument("--grace-s", type=float, default=d.grace_s, help="SIGTERM: seconds to finish in-flight work")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request before SERVING")
    for flag, what in (("--encoder-tp", "encoder tensor-parallel degree"),
                       ("--ulysses", "DiT Ulysses degree (divides the DiT's heads)"),
                       ("--ring", "DiT Ring degree (ulysses x ring = DiT ranks)"),
                       ("--vae-pp", "VAE patch-parallel degree (1 or ulysses x ring)")):
        p.add_argument(flag, type=int, default=1,
                       help=f"{what}; >1 runs that stage as one process per rank, rank 0 serving gRPC (default 1)")
    for s in MODEL_STAGES + ("muxer",):
        p.add_argument(f"--{s}", default=None, metavar="HOST:PORT", help=f"gateway: address of the {s} stage")
    p.add_argument("--queue-size", type=int, default=d.queue_size, help="gateway: requests that may wait")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, help="gateway: requests run at once")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="gateway: deadline of a request whose caller set none")
    p.add_argument("--jobs-dir", default=None, help="gateway: where HTTP job MP4s are kept (default a temp dir)")
    p.add_argument("--job-ttl-s", type=float, default=d.job_ttl_s, help="gateway: finished jobs kept this long")
    p.add_argument("--max-jobs", type=int, default=d.max_jobs, help="gateway: finished jobs kept at most")
    p.add_argument("--max-sync-bytes", type=int, default=d.max_sync_bytes,
                   help="gateway: largest MP4 GenerateSync returns in one message")
    p.add_argument("--transport", default=d.transport, choices=("grpc", "nixl"),
                   help="VAE -> muxer frame transport: grpc, or nixl (falls back to grpc with a warning when NIXL "
                        "cannot be loaded or the peers cannot connect)")
    p.add_argument("--model-name", default=None, help="gateway: model id reported and accepted in requests")
    p.add_argument("--frame-format", default=d.frame_format, choices=("yuv420p", "rgb24"),
                   help="vae: frames to the muxer as yuv420p planes made on the device, or rgb24")
    p.add_argument("--mux-threads", type=int, default=d.mux_threads, help="muxer: x264 threads (fixed)")
    p.add_argument("--crf", type=int, default=d.crf)
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--session-ttl-s", type=float, default=d.session_ttl_s,
                   help="muxer: an unfetched session is dropped after this long")
    p.add_argument("--tmp-dir", default=None, help="muxer: where MP4s are assembled")
    p.add_argument("--start-timeout", type=float, default=600.0, help="launcher: seconds to wait for health")
    p.add_argument("--no-restart", action="store_true", help="launcher: stop everything when a stage dies")
    p.add_argument("--json", action="store_true", help="launcher: print endpoints and events as JSON lines")


def main_from_args(args: argparse.Namespace) -> int:
    if args.http_port is None and "gateway" in parse_stages(args.stages):
        args.http_port = 8000
    return serve_main(args)
