"""Gateway server: the gRPC front door (Generate, GenerateSync, Attach, Cancel, Info) and, in the same process, the HTTP
API (h3serve/services/gateway/http.py). Both are thin adapters over `Gateway` (orchestrate.py); errors leave through
the one table.

Health: NOT_SERVING until every stage reports SERVING, and again while draining (SIGTERM).
Callers: with an API keys file every gRPC call but health and reflection carries `authorization: Bearer KEY`
(auth.py's interceptor refuses others before reading them); each job belongs to its caller.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import uvicorn

from h3serve._proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from h3serve.config.stage import StageConfig
from h3serve.errors import NotFound, NotReady, RequestError
from h3serve.errortable import grpc_method
from h3serve.runtime.prechecks import check_gateway_exposure
from h3serve.runtime.stage import NO_DEADLINE, StageBase
from h3serve.runtime.tls import Tls
from h3serve.transport.channel import KEEP_ON_DISCONNECT_METADATA

from .auth import AuthInterceptor, Authenticator
from .fields import fields_from_proto, served_models
from .frontdoor import uvicorn_config
from .http import create_app
from .jobs import ATTACH_GRACE_S, Job
from .orchestrate import live_content
from .gateway import Gateway
from .sinks import BytesSink, StreamSink
from .uploads import decode_caller
from .watchdog import Watchdog

log = logging.getLogger("h3serve.gateway")


def accepted_proto(job: Job) -> gateway_pb2.Accepted:
    r = job.request
    return gateway_pb2.Accepted(request_id=job.id, num_frames=r.num_frames, width=r.width, height=r.height, fps=r.fps,
                                seed=r.seed, num_inference_steps=r.steps, task=r.task, profile=r.profile,
                                media_seconds=r.t_media, queue_position=job.queue_position)


def done_proto(job: Job) -> gateway_pb2.Done:
    return gateway_pb2.Done(request_id=job.id, mp4_bytes=job.mp4_bytes, sha256=job.sha256,
                            timings={k: float(v) for k, v in job.timings.items()})


class GatewayServicer(StageBase):
    stage = "gateway"
    manages_health = True

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.max_message = config.gateway.max_message_bytes
        self.gateway = Gateway(config, on_health=self._on_health)
        self.auth = Authenticator(config.gateway.api_keys_file)
        self.interceptors = (AuthInterceptor(self.auth),)
        self.watchdog = Watchdog(self.gateway.stages, self.gateway.jobs)
        self.http_server = None
        self.http_thread = None
        self.http_port = None

    def _on_health(self, ok: bool) -> None:
        if self.health is not None:
            self.health.set(bool(ok and self.ready))

    def register(self, server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self, server)

    def load(self) -> None:
        check_gateway_exposure(self.config)
        self.choose_transport(probe=False)   # nixl: chosen (or fallen back from) by the DiT, the VAE and the muxer
        self.gateway.start()
        self.watchdog.start()
        if self.config.gateway.http_port is not None:
            self.start_http()

    def start_http(self) -> None:
        app = create_app(self.gateway, self.auth)
        tls = Tls.of(self.config)   # HTTPS with the gateway's certificate when configured (then no plaintext)
        cfg = uvicorn_config(app, self.config, ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        self.http_server = uvicorn.Server(cfg)
        self.http_thread = threading.Thread(target=self.http_server.run, name="h3serve-http", daemon=True)
        self.http_thread.start()
        end = time.monotonic() + 30
        while not self.http_server.started:
            if not self.http_thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the HTTP API could not start on {self.config.gateway.http_host}:{self.config.gateway.http_port}")
            time.sleep(0.02)
        sockets = [s for srv in (self.http_server.servers or []) for s in srv.sockets]
        self.http_port = sockets[0].getsockname()[1] if sockets else self.config.gateway.http_port

    # -- lifecycle ------------------------------------------------------------------------------------------
    def on_ready(self) -> None:
        self._on_health(self.gateway.ready())

    def drain(self) -> None:
        self.gateway.drain()

    def busy(self) -> bool:
        return self.gateway.jobs.busy()

    def cancel_all(self) -> None:
        super().cancel_all()
        self.gateway.cancel_all()

    def close(self) -> None:
        if self.http_server is not None:
            self.http_server.should_exit = True
            self.http_thread.join(10)
        self.watchdog.close()
        self.gateway.close()
        super().close()

    def info(self) -> dict:
        return {**super().info(), "stages": dict(self.gateway.stages.status), "http_port": self.http_port,
                "transport": self.gateway.transports.details()}

    # -- RPCs -----------------------------------------------------------------------------------------------
    def _timeout(self, context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None or remaining > NO_DEADLINE else remaining

    def _new_job(self, request, context, kind: str, sink_factory):
        rid = request.request_id if request.HasField("request_id") else None
        owner = self.auth.caller_of(context.invocation_metadata())
        fields, timeout = fields_from_proto(request), self._timeout(context)

        def make() -> Job:
            return self.gateway.new_job(fields, kind=kind, sink_factory=sink_factory, timeout=timeout,
                                        request_id=rid, owner=owner)

        try:
            if any(k in fields for k in ("first_image", "last_image", "references")):   # uploads: decoded on
                return self.gateway.decoder.run(decode_caller(owner, context.peer()), make)   # the bounded pool
            return make()
        except RequestError:
            self.gateway.metrics.requests.labels(outcome="invalid_request").inc()
            raise

    def _submit(self, job: Job) -> None:
        try:
            self.gateway.submit(job)
        except RequestError:   # e.g. a request id already in use (AlreadyExists)
            self.gateway.metrics.requests.labels(outcome="invalid_request").inc()
            raise

    @grpc_method("gateway")
    def Generate(self, request, context):
        job = self._new_job(request, context, "stream", lambda j: StreamSink(j.emit))
        if request.validate_only:
            yield gateway_pb2.GenerateEvent(accepted=accepted_proto(job))
            yield gateway_pb2.GenerateEvent(done=done_proto(job))
            return
        job.opening = lambda j: gateway_pb2.GenerateEvent(accepted=accepted_proto(j))
        self._submit(job)
        keep = dict(context.invocation_metadata()).get(KEEP_ON_DISCONNECT_METADATA) == "1"
        yield from self._watch(job, context, keep=keep)

    @grpc_method("gateway")
    def Attach(self, request, context):
        owner = self.auth.caller_of(context.invocation_metadata())
        yield from self._watch(self.gateway.jobs.watchable(request.request_id, owner), context, keep=True)

    def _watch(self, job: Job, context, *, keep: bool):
        """A stream job's events from its first (accepted) to its end (done, or its error). A caller that goes away
        cancels the job, unless it asked to keep it (`keep`, the SDK, and every Attach): then a job nobody watches
        any more is cancelled ATTACH_GRACE_S later, unless someone attached again meanwhile."""
        wid = object()

        def gone() -> None:
            if job.finished or job.unwatch(wid):
                return
            if not keep:
                job.cancel("cancelled by the client")
                return
            timer = threading.Timer(ATTACH_GRACE_S, job.cancel_unwatched,
                                    args=(f"the caller went away and nobody attached within {ATTACH_GRACE_S:g}s",))
            timer.daemon = True
            timer.start()

        context.add_callback(gone)
        yield from job.watch(wid, context.is_active)
        if not context.is_active():
            return
        job.done.wait()
        if job.exc is not None:
            raise job.exc
        yield gateway_pb2.GenerateEvent(done=done_proto(job))

    @grpc_method("gateway")
    def GenerateSync(self, request, context):
        job = self._new_job(request, context, "sync", lambda j: BytesSink(self.config.gateway.max_sync_bytes))
        if request.validate_only:
            return gateway_pb2.GenerateResponse(accepted=accepted_proto(job), done=done_proto(job))
        self._submit(job)
        context.add_callback(lambda: job.cancel("cancelled by the client"))
        while not job.done.wait(0.1):
            if not context.is_active():
                job.cancel("cancelled by the client")
                job.done.wait(5.0)
                break
        if job.exc is not None:
            raise job.exc
        return gateway_pb2.GenerateResponse(accepted=accepted_proto(job), done=done_proto(job),
                                            mp4=bytes(job.sink.buf))

    @grpc_method("gateway")
    def Cancel(self, request, context):
        owner = self.auth.caller_of(context.invocation_metadata())
        jobs = self.gateway.jobs
        cancelled = jobs.cancel(request.request_id, owner=owner, grpc_jobs=True)
        job = jobs.grpc_job(request.request_id, owner) or jobs.get(request.request_id, owner)
        return gateway_pb2.CancelResponse(cancelled=cancelled, status=job.status,
                                          error_code=job.error.kind.code if job.error else "")

    @grpc_method("gateway")
    def StreamContent(self, request, context):
        owner = self.auth.caller_of(context.invocation_metadata())
        if not request.request_id:
            raise RequestError("request_id", "", "the request_id of a running Generate call")
        job = self.gateway.jobs.jobs.get(f"{owner or ''}/{request.request_id}")
        if job is None or job.kind == "http":
            raise NotFound(f"no running request {request.request_id!r}")
        chunks = live_content(job)
        if chunks is None:
            raise NotReady(f"request {request.request_id} is {job.status}: its MP4 was delivered by its Generate "
                           "call; the live stream exists while it runs")
        offset = 0
        for data in chunks:
            if not context.is_active():
                return
            yield gateway_pb2.ContentChunk(data=data, offset=offset)
            offset += len(data)

    @grpc_method("gateway")
    def Info(self, request, context):
        c = self.config
        dtype = c.model.dtype
        try:   # the dtype the DiT actually loaded
            st = self.gateway.stages.dit.Status(common_pb2.StatusRequest(), timeout=2.0)
            dtype = json.loads(st.info_json or "{}").get("dtype", dtype)
        except Exception:  # noqa: BLE001 - the stage is down: report the gateway's setting
            pass
        return gateway_pb2.InfoResponse(
            model=served_models(c)[0], profile=c.model.profile, dtype=dtype, max_inflight=c.gateway.max_inflight,
            queue_size=c.gateway.queue_size, max_sync_bytes=c.gateway.max_sync_bytes, max_message_bytes=self.max_message,
            stages=dict(self.gateway.stages.status), draining=self.gateway.draining)
