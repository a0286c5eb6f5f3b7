"""The HTTP API of the gateway (FastAPI): the videos API users know from vLLM-Omni / OpenAI, plus health, readiness
and Prometheus metrics. A thin adapter over `Gateway` (orchestrate.py); errors leave through h3serve.errortable.

    POST   /v1/videos                 create a job (JSON or multipart/form fields)       -> job object
    GET    /v1/videos                 list jobs (limit, after, order)                      -> list object
    GET    /v1/videos/{id}            one job                                              -> job object
    GET    /v1/videos/{id}/content    the MP4 of a completed job                           -> video/mp4
    DELETE /v1/videos/{id}            cancel it if unfinished, and delete it and its MP4   -> deletion object
    POST   /v1/videos/{id}/cancel     cancel, keep the job (status failed, code cancelled) -> job object
    POST   /v1/videos/sync            create and wait; the MP4 is the response body        -> video/mp4
    GET    /health  /ready  /metrics  liveness, readiness (every stage SERVING, not draining), Prometheus

Request fields: prompt, seconds, size | width + height, num_frames, fps, seed, num_inference_steps, quality,
model, extra_params {task, duration}. `?validate_only=true` validates and aligns without generating. The header
`X-Request-Timeout: SECONDS` sets the request's deadline (default and upper bound: the server's request timeout).
With API keys (auth.py) every /v1 call carries `Authorization: Bearer KEY` (checked before the body is read) and
sees only its caller's jobs; health, readiness, metrics and the OpenAPI document stay open.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3serve.errors import H3Error, RequestError
from h3serve.errortable import NotFound, NotReady, TooLarge, Unauthenticated, error_object, http_error

from .auth import Authenticator
from .fields import fields_from_http, short
from .jobs import Job
from .orchestrate import Gateway
from .sinks import FileSink

JSON_BODY = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "maxLength": 20000, "description": "What to generate"},
        "seconds": {"type": ["string", "number"], "description": "Requested duration, 4..15 s (raised to 17n+5 "
                                                                  "frames at 24 fps). Not with num_frames."},
        "size": {"type": "string", "example": "1344x768", "description": "WxH, multiples of 32 in [256, 2048]"},
        "width": {"type": "integer"}, "height": {"type": "integer"},
        "num_frames": {"type": "integer", "description": "Requested frames at 24 fps (raised to 17n+5)"},
        "fps": {"type": "integer", "enum": [24]},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "num_inference_steps": {"type": "integer", "description": "Sigma grid points incl. the terminal 0 "
                                                                  "(N -> N-1 steps); base default 50, fasth3 5"},
        "quality": {"type": "string", "enum": ["lossless"]},
        "model": {"type": "string"},
        "extra_params": {"type": "object", "properties": {"task": {"type": "string", "enum": ["t2va"]},
                                                          "duration": {"type": ["string", "number"]}}},
    },
}
REQUEST_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": JSON_BODY},
    "multipart/form-data": {"schema": {**JSON_BODY, "properties": {
        **JSON_BODY["properties"], "extra_params": {"type": "string", "description": "a JSON object"}}}},
}}}


# The largest request body read (a 20,000-character prompt is at most 80 kB of UTF-8): refused before parsing.
MAX_BODY_BYTES = 1 << 20


async def _capped_body(request: Request) -> bytes:
    """The body, refused with 413 once it passes MAX_BODY_BYTES (announced or while it streams in)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise TooLarge(f"the request body is {int(length)} bytes, more than {MAX_BODY_BYTES} (field: body)")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > MAX_BODY_BYTES:
            raise TooLarge(f"the request body is more than {MAX_BODY_BYTES} bytes (field: body)")
    request._body = bytes(buf)   # what request.body() / form() read from now on
    return request._body


# How long a client told "retry" (429 queue full, 503 draining / a stage down) waits first.
RETRY_AFTER_S = {429: 1, 503: 5}


def _error_response(exc: BaseException) -> JSONResponse:
    status, body = http_error(exc)
    retry = RETRY_AFTER_S.get(status) if body["error"].get("retryable") else None
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(retry)} if retry else None)


async def read_body(request: Request) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    await _capped_body(request)
    if ctype == "application/x-www-form-urlencoded":
        raw = await request.body()
        if raw.lstrip().startswith(b"{"):   # JSON sent without its content type (curl -d '{...}')
            ctype = "application/json"
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form()
        except Exception as exc:  # noqa: BLE001 - malformed multipart
            raise RequestError("body", type(exc).__name__, "a well-formed form") from None
        if ctype == "application/x-www-form-urlencoded":
            try:   # the parser would replace undecodable bytes silently, altering the prompt
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError("body", f"byte {exc.start}", "UTF-8 form values") from None
        body: dict[str, Any] = {}
        for key, value in form.multi_items():
            if not key:
                raise RequestError("form field name", "", "a named form field (a field with an empty name)")
            if not isinstance(value, str):   # an uploaded file
                raise RequestError(key, getattr(value, "filename", "file"),
                                   "file inputs are not supported over the API yet")
            if key in body:
                raise RequestError(key, value, "given once")
            body[key] = value
        return body
    if ctype not in ("", "application/json"):
        raise RequestError("content-type", ctype, "application/json, multipart/form-data or "
                                                  "application/x-www-form-urlencoded")
    raw = await request.body()
    try:
        return json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("body", short(raw[:60]), "a JSON object of request fields") from None


def _timeout(request: Request) -> float | None:
    value = request.headers.get("x-request-timeout")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise RequestError("X-Request-Timeout", short(value), "seconds, a positive number")
    return seconds


def job_object(job: Job, gateway: Gateway) -> dict:
    r = job.request
    t = job.timings
    durations = {k: round(float(v), 6) for k, v in t.items() if k.endswith("_s") or k in ("t_client", "t_media")}
    return {
        "id": job.id, "object": "video", "model": job.validated.model, "status": job.status,
        "progress": int(job.progress), "created_at": int(job.created_at),
        "started_at": int(job.started_at) if job.started_at else None,
        "completed_at": int(job.completed_at) if job.completed_at else None,
        "expires_at": int(job.completed_at + gateway.config.job_ttl_s) if job.completed_at else None,
        "prompt": r.prompt, "seconds": f"{r.seconds:g}", "size": f"{r.width}x{r.height}", "width": r.width,
        "height": r.height, "num_frames": r.num_frames, "fps": r.fps, "seed": r.seed, "num_inference_steps": r.steps,
        "quality": "lossless", "task": r.task, "profile": r.profile, "queue_position": job.queue_position,
        "error": error_object(job.error) if job.error else None,
        "inference_time_s": round(t["t_client"], 6) if job.status == "completed" and "t_client" in t else None,
        "stage_durations": durations, "rtf": round(t["rtf_client"], 6) if "rtf_client" in t else None,
        "mp4_bytes": job.mp4_bytes or None, "sha256": job.sha256 or None,
        # the largest of the stages' peaks (device allocator on a GPU, RSS on the CPU; each stage is a process)
        "peak_memory_mb": round(t["peak_memory_mb"], 1) if t.get("peak_memory_mb") else None,
    }


def mp4_response(gateway: Gateway, job: Job, headers: dict, filename: str | None = None) -> Response:
    """A completed job's MP4 from the job store: a file (with ranges) or streamed from the object store."""
    mp4 = gateway.jobs.mp4(job)
    if mp4 is None:
        raise NotFound(f"video {job.id} is completed but its MP4 is no longer in the job store (deleted or expired)")
    if mp4.path is not None:
        return FileResponse(mp4.path, media_type="video/mp4", headers=headers, filename=filename)
    if filename:
        headers = {**headers, "Content-Disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(mp4.chunks, media_type="video/mp4",
                             headers={**headers, "Content-Length": str(mp4.size)})


def create_app(gateway: Gateway, auth: Authenticator | None = None) -> FastAPI:
    app = FastAPI(title="h3serve", version="0.1.0",
                  description="MiniMax H3 text -> video + audio. Videos API compatible with vLLM-Omni / OpenAI "
                              "where the fields apply.")

    @app.exception_handler(H3Error)
    async def _h3(request: Request, exc: H3Error):
        if isinstance(exc, RequestError):
            gateway.metrics.requests.labels(outcome="invalid_request").inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        gateway.metrics.requests.labels(outcome="invalid_request").inc()
        err = (exc.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path", "header")]
        return _error_response(RequestError(".".join(loc) or "request", short(err.get("input")),
                                            err.get("msg", "invalid")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail), "field": None, "param": None,
                                       "stage": None, "retryable": False}}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error_response(exc)

    keys = auth or Authenticator(None)

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            try:
                request.state.owner = keys.caller(request.headers.get("authorization"))
            except Unauthenticated as exc:
                response = _error_response(exc)
                response.headers["WWW-Authenticate"] = 'Bearer realm="h3serve"'
                return response
        return await call_next(request)

    def new_job(fields, names, request: Request, kind: str) -> Job:
        def sink(job: Job):
            return FileSink(gateway.jobs.mp4_path(job))

        job = gateway.new_job(fields, kind=kind, sink_factory=sink, timeout=_timeout(request), names=names)
        job.owner = request.state.owner
        return job

    @app.post("/v1/videos", openapi_extra=REQUEST_BODY, summary="Create a video job")
    async def create_video(request: Request, validate_only: bool = False):
        fields, names = fields_from_http(await read_body(request))
        job = new_job(fields, names, request, "http")
        if validate_only:
            obj = job_object(job, gateway)
            obj["status"], obj["object"] = "validated", "video.validation"
            return obj
        gateway.submit(job)
        return job_object(job, gateway)

    @app.post("/v1/videos/sync", openapi_extra=REQUEST_BODY, summary="Create a video and wait for the MP4",
              responses={200: {"content": {"video/mp4": {}}}})
    async def create_video_sync(request: Request):
        fields, names = fields_from_http(await read_body(request))
        job = gateway.submit(new_job(fields, names, request, "http"))
        while not job.done.is_set():
            if await request.is_disconnected():   # nobody to answer: cancel quietly, no error logged
                job.cancel("the HTTP client disconnected")
                return Response(status_code=499)
            await asyncio.to_thread(job.done.wait, 0.25)
        if job.exc is not None:
            return _error_response(job.exc)
        headers = {"X-Request-Id": job.id,
                   "X-Stage-Durations": json.dumps({k: round(v, 4) for k, v in job.timings.items()
                                                    if k.endswith("_s")}, separators=(",", ":"))}
        return await asyncio.to_thread(mp4_response, gateway, job, headers)

    @app.get("/v1/videos", summary="List video jobs")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        if not 1 <= limit <= 100:
            raise RequestError("limit", limit, "an integer in [1, 100]")
        if order not in ("asc", "desc"):
            raise RequestError("order", order, "asc or desc")
        jobs = await asyncio.to_thread(gateway.jobs.list, request.state.owner)
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise RequestError("after", after, "the id of a listed video")
            jobs = jobs[ids.index(after) + 1:]
        page = jobs[:limit]
        return {"object": "list", "data": [job_object(j, gateway) for j in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(jobs) > limit}

    @app.get("/v1/videos/{video_id}", summary="Get a video job")
    async def get_video(request: Request, video_id: str):
        return job_object(await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner), gateway)

    @app.get("/v1/videos/{video_id}/content", summary="Download the MP4", response_class=FileResponse,
             responses={200: {"content": {"video/mp4": {}}}})
    async def get_content(request: Request, video_id: str):
        job = await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner)
        if job.status == "failed":
            raise NotReady(f"video {video_id} failed ({job.error.kind.code}): no content")
        if job.status != "completed":
            raise NotReady(f"video {video_id} is {job.status} ({int(job.progress)}%); content is ready when "
                           "status is completed")
        return await asyncio.to_thread(mp4_response, gateway, job, {}, filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}", summary="Cancel (if unfinished) and delete a video job")
    async def delete_video(request: Request, video_id: str):
        job = await asyncio.to_thread(gateway.jobs.delete, video_id, request.state.owner)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{video_id}/cancel", summary="Cancel a video job and keep it")
    async def cancel_video(request: Request, video_id: str):
        job = await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner)
        await asyncio.to_thread(gateway.jobs.cancel, video_id, owner=request.state.owner)
        await asyncio.to_thread(job.done.wait, 10.0)
        return job_object(job, gateway)

    @app.get("/health", summary="Liveness")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: every stage SERVING and not draining")
    async def ready():
        body = {"status": "ready" if gateway.ready() else "not_ready", "stages": dict(gateway.stages.status),
                "draining": gateway.draining, "queue_depth": len(gateway.jobs.queue),
                "inflight": len(gateway.jobs.running), "transport": gateway.transports.details()}
        return JSONResponse(body, status_code=200 if gateway.ready() else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.gateway = gateway
    app.state.started = time.time()
    return app
