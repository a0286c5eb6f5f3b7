"""One stage in this process: bind gRPC, health NOT_SERVING, load + warm up, SERVING, wait for SIGTERM, drain within
the grace period, exit 0 (`run_stage`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from h3serve.config.stage import StageConfig
from h3serve.config.vocab import SERVICE_NAMES
from h3serve.errors import H3Error
from h3serve.errortable import RefuseUnparsable
from h3serve.runtime.metrics import serve_metrics
from h3serve.runtime.stage import HealthHandle
from h3serve.runtime.prechecks import check_ports, check_stage_exposure
from h3serve.runtime.tls import Tls
from h3serve.weights.manifest import STAGE_FOLDERS, IntegrityError, verify_manifest
from h3serve.transport.channel import MESSAGE_LIMIT, PID_METADATA, server_options

log = logging.getLogger("h3serve.runtime.process")

EXIT_LOAD_FAILED = 3

HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# A stage's servicer class (`XServicer(config, health) -> StageBase`); the faces above (cli) pass it in, so the
# runtime never imports a service.
ServicerFactory = Callable[[StageConfig, HealthHandle], Any]


class HealthPid(grpc.ServerInterceptor):
    """Every health Check answer carries this process's pid (`PID_METADATA`): the launcher's wait for SERVING
    counts only its own child's answer, never another server's on the same port."""

    def __init__(self) -> None:
        self.metadata = ((PID_METADATA, str(os.getpid())),)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != HEALTH_CHECK or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def check(request, context):
            context.send_initial_metadata(self.metadata)
            return inner(request, context)

        return handler._replace(unary_unary=check)


class StageProcess:
    """A stage's gRPC server: bind, health, reflection, load, drain. `run_stage` adds signals around it."""

    def __init__(self, config: StageConfig, servicer_factory: ServicerFactory):
        check_stage_exposure(config)   # before anything binds: beyond loopback a stage needs mTLS
        self.config = config
        self.health_servicer = health.HealthServicer(experimental_non_blocking=True)
        service = SERVICE_NAMES.get(config.stage, config.stage)
        self.health = HealthHandle(self.health_servicer, [service])
        self.health.set(False)
        self.servicer = servicer_factory(config, self.health)
        max_message = max(MESSAGE_LIMIT, getattr(self.servicer, "max_message", MESSAGE_LIMIT))
        self.server = grpc.server(ThreadPoolExecutor(max_workers=config.server.rpc_workers,
                                                     thread_name_prefix=f"grpc-{config.stage}"),
                                  options=server_options(max_message),
                                  interceptors=(HealthPid(), RefuseUnparsable(),
                                                *getattr(self.servicer, "interceptors", ())))
        self.servicer.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, self.server)
        reflection.enable_server_reflection(
            [service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        # TLS when configured (plaintext is then refused); stages other than the gateway require a peer certificate
        try:
            self.port = Tls.of(config).add_port(self.server, f"{config.server.host}:{config.server.port}",
                                                require_client=config.stage != "gateway")
        except RuntimeError:   # grpcio raises where older releases returned 0
            self.port = 0
        if not self.port:
            server = config.server
            check_ports([(server.host, server.port, f"--port {server.port}")])   # the usual reason, named
            raise H3Error(f"--port {server.port}: the {config.stage} stage cannot listen on {server.host}:{server.port}")
        config.server.port = self.port   # the servicer's config too: it advertises this address
        self.server.start()
        serve_metrics(self.servicer, config.server.host)  # a stage's /metrics, when $H3SERVE_METRICS_PORT is set

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def load(self) -> None:
        t0 = time.perf_counter()
        c = self.config
        if c.model.checkpoint_manifest_sha256 and c.model.checkpoint and c.stage in STAGE_FOLDERS:
            n = verify_manifest(c.model.checkpoint, c.model.checkpoint_manifest_sha256, stage=c.stage)
            log.info("%s: %d checkpoint files match the manifest %s", c.stage, n, c.model.checkpoint_manifest_sha256)
        self.servicer.load()
        self.servicer.load_seconds = time.perf_counter() - t0
        self.servicer.ready = True
        if not self.servicer.manages_health:
            self.health.set(True)
        self.servicer.on_ready()

    def shutdown(self, grace: float | None = None) -> None:
        """Stop admitting, let in-flight work finish within `grace` seconds, cancel what is left, stop."""
        grace = self.config.server.grace_s if grace is None else grace
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


def run_stage(config: StageConfig, servicer_factory: ServicerFactory) -> int:
    """Run one stage in this process until SIGTERM / SIGINT; return the exit code (0 after a clean drain)."""
    stop = threading.Event()
    signals = []

    def on_signal(signum, _frame):
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    proc = StageProcess(config, servicer_factory)
    announce("listening", stage=config.stage, address=proc.address, pid=os.getpid())
    try:
        proc.load()
    except IntegrityError as exc:   # up, NOT_SERVING, the reason in its status: no restart loop hides it
        log.error("%s: %s", config.stage, exc)
        print(f"h3serve: {config.stage}: load failed: {exc}", file=sys.stderr, flush=True)
        proc.servicer.load_error = str(exc)
        announce("load_failed", stage=config.stage, pid=os.getpid(), reason=str(exc))
        while not stop.wait(0.5):
            pass
        proc.server.stop(1.0).wait(5.0)
        return EXIT_LOAD_FAILED
    except Exception as exc:  # noqa: BLE001 - a stage that cannot load exits non-zero, health never SERVING
        log.error("%s: load failed: %s", config.stage, exc, exc_info=not isinstance(exc, H3Error))
        print(f"h3serve: {config.stage}: load failed: {exc}", file=sys.stderr, flush=True)
        proc.server.stop(0)
        return EXIT_LOAD_FAILED
    announce("ready", stage=config.stage, address=proc.address, pid=os.getpid(),
             load_seconds=round(proc.servicer.load_seconds, 3))
    while not stop.wait(0.5):
        pass
    log.info("%s: signal %s: draining (grace %.1fs)", config.stage, signals[:1], config.server.grace_s)
    proc.shutdown()
    announce("stopped", stage=config.stage, pid=os.getpid())
    return 0
