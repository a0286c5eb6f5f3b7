"""The HTTP API of the gateway (FastAPI): the videos API users know from vLLM-Omni / OpenAI, plus health, readiness
and Prometheus metrics. A thin adapter over `Gateway` (orchestrate.py); errors leave through h3serve.errortable.

    POST   /v1/videos                 create a job (JSON or multipart/form fields)       -> job object
    GET    /v1/videos                 list jobs (limit, after, order)                      -> list object
    GET    /v1/videos/{id}            one job                                              -> job object
    GET    /v1/videos/{id}/content    the MP4 of a completed job                           -> video/mp4
    DELETE /v1/videos/{id}            cancel it if unfinished, and delete it and its MP4   -> deletion object
    POST   /v1/videos/{id}/cancel     cancel, keep the job (status failed, code cancelled) -> job object
    POST   /v1/videos/sync            create and wait; the MP4 is the response body        -> video/mp4
    GET    /v1/videos/{id}/content?variant=thumbnail   the first frame as JPEG
    GET    /v1/videos/{id}/content?variant=preview     the latest preview (preview_every) as JPEG, while it runs
    GET    /v1/videos/{id}/content?stream=true   while it runs: a fragmented MP4, fragment by fragment as its clips
                                      are encoded (chunked; X-H3-Stream: fmp4); once completed, the MP4 (mp4)
    GET    /v1/models                 the model ids served                                 -> list object
    POST   /v1/videos/{id}/remix, /v1/videos/edits, /v1/videos/extensions, /v1/videos/characters
                                      refused by name (400 unsupported): H3 has no edit path
    GET    /health  /ready  /metrics  liveness, readiness (every stage SERVING, not draining), Prometheus

Request fields: prompt, seconds, size | width + height, num_frames, fps, seed, num_inference_steps, quality,
lora, model, extra_params {task, duration}, video_params, user, and the media fields input_reference, first_image,
last_image, image_reference, audio_reference (docs/api.md; the OpenAI / vLLM-Omni mapping: docs/openai-compat.md). `?validate_only=true` validates and aligns without generating. The header
`X-Request-Timeout: SECONDS` sets the request's deadline (default and upper bound: the server's request timeout).
With API keys (auth.py) every /v1 call carries `Authorization: Bearer KEY` (checked before the body is read) and
sees only its caller's jobs; health, readiness, metrics and the OpenAPI document stay open.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import re
import tempfile
import time
from typing import Any

from fastapi import FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.routing import Match

from h3serve.config.lora import parse_loras
from h3serve.config.request import (FIELD_TYPES, MAX_MEDIA_BYTES, MAX_REFERENCES, MAX_REFERENCES_PER_KIND,
                                    REQUEST_FIELDS, Upload, reference_kind)
from h3serve.errors import H3Error, NotFound, NotReady, PermissionDenied, RequestError, TooLarge, Unauthenticated
from h3serve.errortable import error_object, http_error
from h3serve.media.thumbnail import first_frame_jpeg

from .auth import Authenticator
from .fields import MEDIA_FIELDS, REFERENCE_KIND, REPEATABLE, fields_from_http, served_pools, short
from .jobs import Job
from .orchestrate import live_content
from .realtime import serve_session
from .gateway import Gateway
from .sinks import FileSink
from .uploads import MIME_EXTENSION, decode_caller
from .usage import DEFAULT_RANGE_S, MAX_RANGE_S

FILE = {"type": "string", "format": "binary"}
JSON_TYPES = {str: "string", int: "integer", float: "number", dict: "object", bytes: "string", list: "array"}


STREAM_HEADER = "X-H3-Stream"   # what a ?stream=true response carries: fmp4 (live fragments) or mp4 (finished)


def _property(row) -> dict:
    """A request field's JSON schema: its type (the table's keyword, else its Python type's), its keywords, its
    description."""
    schema = dict(row.metadata["schema"])
    out = {"type": schema.pop("type") if "type" in schema else JSON_TYPES[FIELD_TYPES[row.name]], **schema}
    if row.metadata["doc"]:
        out["description"] = row.metadata["doc"]
    return out


def _form_property(row) -> dict:
    """Its multipart schema: a file, a list of files, or the field's own `form`."""
    return row.metadata["form"] or (FILE if row.metadata["media"] == "one" else {"type": "array", "items": FILE})


# The request body of POST /v1/videos and /v1/videos/sync, generated from the request's field table
_BODY = [row for row in REQUEST_FIELDS if row.metadata["http"] == "body"]
JSON_BODY = {
    "type": "object",
    "required": [row.metadata["json"] for row in _BODY if row.metadata["required"]],
    "properties": {row.metadata["json"]: _property(row) for row in _BODY},
}
REQUEST_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": JSON_BODY},
    "multipart/form-data": {"schema": {**JSON_BODY, "properties": {
        **JSON_BODY["properties"], **{row.metadata["json"]: _form_property(row) for row in _BODY
                                      if row.metadata["form"] or row.metadata["media"]}}}},
}}}

# Every 4xx / 5xx answer is this error object (errortable.error_object + `type`), declared so clients can rely on it.
ERROR_RESPONSE = {"description": "The error object", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message", "type", "retryable"], "properties": {
            "code": {"type": "string"}, "message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
            "field": {"type": ["string", "null"]}, "param": {"type": ["string", "null"]},
            "stage": {"type": ["string", "null"]}, "retryable": {"type": "boolean"}}},
        "detail": {"type": "string", "description": "the message again, as SGLang's clients read it"}}}}}}


# OpenAI's error `type` by HTTP status (the SDK reads `error.type`, `error.param`, `error.code`, `error.message`)
def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


# A JSON or urlencoded body (a 20,000-character prompt is at most 80 kB of UTF-8; data URLs of a few images) is
# read into memory, so its bound is small; larger media go as multipart uploads, which are spooled, not buffered.
MAX_JSON_BODY_BYTES = 16 << 20


async def _stream(request: Request):
    """The body's chunks; a client gone before its end is the caller's incomplete body (a 4xx nobody reads), not a
    traceback."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise RequestError("body", "incomplete", "the whole body (the client left, or sent nothing for "
                                                 "--http-body-timeout-s)") from None


async def _capped_body(request: Request) -> bytes:
    """The body, refused with 413 once it passes MAX_JSON_BODY_BYTES (announced or while it streams in)."""
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > MAX_JSON_BODY_BYTES:
        raise TooLarge(f"body: {int(length):,} bytes; a JSON or form body is at most {MAX_JSON_BODY_BYTES:,} bytes "
                       "(send larger media as multipart uploads)")
    buf = bytearray()
    async for chunk in _stream(request):
        buf += chunk
        if len(buf) > MAX_JSON_BODY_BYTES:
            raise TooLarge(f"body: more than {MAX_JSON_BODY_BYTES:,} bytes; a JSON or form body is at most "
                           f"{MAX_JSON_BODY_BYTES:,} bytes (send larger media as multipart uploads)")
    request._body = bytes(buf)   # what request.body() / form() read from now on
    return request._body


# How long a client told "retry" (429 queue full, 503 draining / a stage down) waits first.
RETRY_AFTER_S = {429: 1, 503: 5}


def _error_response(exc: BaseException) -> JSONResponse:
    status, body = http_error(exc)
    body["error"]["type"] = error_type(status)
    body["detail"] = body["error"]["message"]   # SGLang's error body (VideoHTTPError) beside OpenAI's
    retry = (getattr(exc, "retry_after_s", None) or RETRY_AFTER_S.get(status)) if body["error"].get("retryable") \
        else None
    return JSONResponse(body, status_code=status, headers={"Retry-After": str(retry)} if retry else None)


def _allowed(request: Request) -> str:
    """The methods the app serves at the request's path (a 405's Allow)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def _refusal(status: int, code: str, param: str | None, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": error_type(status), "code": code, "message": message, "field": param,
                                   "param": param, "stage": None, "retryable": False}, "detail": message},
                        status_code=status)


NO_EDITS = ("H3 generates from a prompt and keyframes / references; it has no video-to-video edit path, so {what} "
            "is not served")
VARIANTS = ("video", "thumbnail", "preview")


# A multipart body's bound: every reference at its largest (the most a request's references can weigh: the kinds'
# counts within their caps, largest files first) and 1 MiB of form fields. Counted on the bytes received, chunked
# or not (a Content-Length is only a claim: with Transfer-Encoding: chunked the server ignores it).
MAX_FORM_FILES = MAX_REFERENCES
MAX_FIELDS_BYTES = 1 << 20


def _largest_references() -> int:
    left, total = MAX_REFERENCES, 0
    for kind in sorted(MAX_MEDIA_BYTES, key=MAX_MEDIA_BYTES.get, reverse=True):
        n = min(left, MAX_REFERENCES_PER_KIND[kind])
        total, left = total + n * MAX_MEDIA_BYTES[kind], left - n
    return total


MAX_BODY_BYTES = _largest_references() + MAX_FIELDS_BYTES
MAX_FORM_VALUE_BYTES = 1 << 20


async def _counted(request: Request, limit: int, what: str):
    """The body as it arrives, refused with 413 as soon as more than `limit` bytes were received."""
    received = 0
    async for chunk in _stream(request):
        received += len(chunk)
        if received > limit:
            raise TooLarge(f"body: more than {limit:,} bytes received; {what} is at most {limit:,} bytes")
        yield chunk


def _part_kind(part) -> str:
    """A file part's kind: its field's (video_reference, audio_reference, else an image); for input_references its
    content type or name, as vLLM-Omni reads them (image/*, audio/*, else a video)."""
    name = part.field_name.partition("[")[0]
    if name != "input_references":
        return REFERENCE_KIND.get(name, "image")
    return reference_kind(upload_name(part.file.filename, part.file.content_type)) or "video"


class CappedMultiPartParser(MultiPartParser):
    """Starlette's streaming multipart parser, with each part held to its own bound as its bytes arrive: a file
    to its kind's limit (MAX_MEDIA_BYTES), a field that takes no file refused at its header, a text value to
    MAX_FORM_VALUE_BYTES, at most MAX_FORM_FILES files. Each refusal is a RequestError naming the part's field; nothing past the bound is read."""

    def __init__(self, headers, stream):
        super().__init__(headers, stream, max_files=MAX_FORM_FILES, max_fields=1000,
                         max_part_size=MAX_FORM_VALUE_BYTES)
        self._received = 0

    def on_headers_finished(self) -> None:
        try:
            super().on_headers_finished()
        except MultiPartException:
            if self._current_files > self.max_files:
                raise RequestError(self._current_part.field_name, f"file {self._current_files}",
                                   f"at most {MAX_FORM_FILES} files in one request") from None
            raise
        part, name = self._current_part, self._current_part.field_name
        self._received = 0
        if part.file is not None and name.partition("[")[0] not in MEDIA_FIELDS:
            raise RequestError(name, part.file.filename or "file",
                               "a form field; files go in " + ", ".join(MEDIA_FIELDS))

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part, name = self._current_part, self._current_part.field_name
        self._received += end - start
        if part.file is None:
            if self._received > MAX_FORM_VALUE_BYTES:
                raise RequestError(name, f"more than {MAX_FORM_VALUE_BYTES:,} bytes",
                                   f"a form value of at most {MAX_FORM_VALUE_BYTES:,} bytes")
        else:
            kind = _part_kind(part)
            cap = MAX_MEDIA_BYTES[kind]
            if self._received > cap:
                raise RequestError(name, f"{part.file.filename or 'file'}: more than {cap:,} bytes",
                                   f"a {kind} file of at most {cap:,} bytes")
        super().on_part_data(data, start, end)


async def _form(request: Request, ctype: str):
    """The form's items, multipart parsed as it streams under its bounds; urlencoded from the capped body."""
    if ctype == "multipart/form-data":
        if "boundary=" not in request.headers.get("content-type", ""):
            raise RequestError("content-type", request.headers.get("content-type"),
                               "multipart/form-data with its boundary parameter")
        parser = CappedMultiPartParser(request.headers,
                                       _counted(request, MAX_BODY_BYTES, "a multipart body"))
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise RequestError("body", exc.message, "a well-formed multipart form") from None
        request._form = form   # its spooled files closed with the request
        return form
    return await request.form()


FORM_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")


def assign_form_key(body: dict[str, Any], key: str, value: Any) -> None:
    """One form item into the body, its key read as clients flatten objects and lists into form keys (the OpenAI
    SDK's extra_body, PHP / qs style): `x[a]` is x's member a, `x[]` appends to list x, `x[0]` is its first item,
    `x[][image_url]` a list of objects; a repeated plain key is a list where the field takes several files, else
    refused. Every shape is a value or a RequestError naming the key, never a crash."""
    m = FORM_KEY.match(key) if key else None
    if m is None:
        raise RequestError("form field name", short(key), "a field name, optionally with [member], [] or [index] "
                                                          "suffixes (e.g. extra_params[task], image_reference[])")
    path = [m.group(1), *re.findall(r"\[([^\[\]]*)\]", m.group(2))]
    if len(path) > 4:
        raise RequestError(key, short(value), "at most 3 levels of [..] in a form key")
    if len(path) == 1:
        name = path[0]
        if name in REPEATABLE:
            old = body.get(name)
            body[name] = (old if isinstance(old, list) else [] if old is None else [old]) + [value]
        elif name in body:
            raise RequestError(key, short(value), "given once")
        else:
            body[name] = value
        return
    node: Any = body
    for depth, seg in enumerate(path[:-1]):
        nxt = path[depth + 1]
        want = list if nxt == "" or nxt.isdigit() else dict
        if isinstance(node, list) and seg == "":
            # x[][a]=1&x[][b]=2: members of the list's last object until one repeats, then a new object
            reuse = want is dict and node and isinstance(node[-1], dict) and nxt not in node[-1]
            if not reuse:
                node.append(want())
            node = node[-1]
            continue
        child = _member(node, seg, key, value)
        if child is None:
            child = want()
            _put(node, seg, child, key, value)
        elif not isinstance(child, want):
            raise RequestError(key, short(value), f"{'.'.join(path[:depth + 1])} given both as a "
                                                  f"{type(child).__name__} and a {want.__name__}")
        node = child
    _put(node, path[-1], value, key, value, last=True)


def _member(node: Any, seg: str, key: str, value: Any) -> Any:
    if isinstance(node, dict):
        return node.get(seg)
    index = int(seg)
    if index > len(node):
        raise RequestError(key, short(value), f"list indexes in order from 0 (index {index} after {len(node)} items)")
    return node[index] if index < len(node) else None


def _put(node: Any, seg: str, child: Any, key: str, value: Any, last: bool = False) -> None:
    if isinstance(node, dict):
        if seg in node and last:
            raise RequestError(key, short(value), "given once")
        node[seg] = child
    elif seg == "" or int(seg) == len(node):
        node.append(child)
    elif int(seg) > len(node):
        raise RequestError(key, short(value), f"list indexes in order from 0 (index {seg} after {len(node)} items)")
    else:
        raise RequestError(key, short(value), "given once")


def upload_name(filename: str | None, content_type: str | None) -> str:
    """A file's name, given the extension of its content type when its name says none (an input_references kind
    is read from it, as vLLM-Omni reads the content type)."""
    filename = filename or ""
    if reference_kind(filename) is None and content_type:
        ext = MIME_EXTENSION.get(content_type.split(";")[0].strip().lower())
        if ext:
            return (filename or "upload") + ext
    return filename


async def read_body(request: Request) -> Any:
    length = request.headers.get("content-length")
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        # parsed as it streams (files spooled), bounded by the bytes received; an announced excess is refused first
        if length is not None and length.isascii() and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise TooLarge(f"body: {int(length):,} bytes; a multipart body is at most {MAX_BODY_BYTES:,} bytes")
    else:
        await _capped_body(request)
    if ctype == "application/x-www-form-urlencoded":
        raw = await request.body()
        if raw.lstrip().startswith(b"{"):   # JSON sent without its content type (curl -d '{...}')
            ctype = "application/json"
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await _form(request, ctype)
        except H3Error:
            raise
        except Exception as exc:  # noqa: BLE001 - malformed multipart
            raise RequestError("body", type(exc).__name__, "a well-formed form") from None
        if ctype == "application/x-www-form-urlencoded":
            try:   # the parser would replace undecodable bytes silently, altering the prompt
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError("body", f"byte {exc.start}", "UTF-8 form values") from None
        body: dict[str, Any] = {}
        for key, value in form.multi_items():
            if not isinstance(value, str):   # an uploaded file, within its kind's bound (the parser held it there)
                name = key.partition("[")[0]
                if name not in MEDIA_FIELDS:
                    raise RequestError(key, getattr(value, "filename", "file"),
                                       "a form field; files go in " + ", ".join(MEDIA_FIELDS))
                file, value = value, Upload(await value.read(), key, upload_name(value.filename, value.content_type))
                await file.close()
            assign_form_key(body, key, value)
        return body
    if ctype not in ("", "application/json"):
        raise RequestError("content-type", ctype, "application/json, multipart/form-data or "
                                                  "application/x-www-form-urlencoded")
    raw = await request.body()   # read (and bounded) by _capped_body
    try:
        return json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("body", short(raw[:60]), "a JSON object of request fields") from None


def _instant(name: str, value: str | None) -> float | None:
    """A time as the usage API takes it: unix seconds or ISO 8601 (UTC unless it says otherwise)."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise RequestError(name, short(value), "unix seconds or an ISO 8601 time (2026-12-01T00:00:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


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
        "expires_at": int(job.completed_at + gateway.config.gateway.job_ttl_s) if job.completed_at else None,
        # seconds: whole seconds as OpenAI's and vLLM-Omni's models type it (a positive integer string); the exact
        # duration of the aligned clip is duration_s (num_frames / fps)
        "prompt": r.prompt, "seconds": str(max(1, round(r.num_frames / r.fps))),
        "duration_s": round(r.num_frames / r.fps, 6), "size": f"{r.width}x{r.height}", "width": r.width,
        "height": r.height, "num_frames": r.num_frames, "fps": r.fps, "seed": r.seed, "num_inference_steps": r.steps,
        "quality": r.quality, "task": r.task, "profile": r.profile, "queue_position": job.queue_position,
        "lora": {"name": r.lora.name, "scale": r.lora.scale} if r.lora is not None else None,
        "error": error_object(job.error) if job.error else None,
        "inference_time_s": round(t["t_client"], 6) if job.status == "completed" and "t_client" in t else None,
        "stage_durations": durations, "rtf": round(t["rtf_client"], 6) if "rtf_client" in t else None,
        "mp4_bytes": job.mp4_bytes or None, "sha256": job.sha256 or None,
        "requested_size": job.validated.requested_size, "media_type": "video/mp4", "remixed_from_video_id": None,
        "user": job.validated.user,
        # where the job's end is POSTed, and each attempt (webhooks.py)
        "webhook": job.webhook,
        # n > 1: each output's seed and MP4 (GET .../content?variant=INDEX)
        "n": job.validated.n, "outputs": job.outputs or None,
        # the largest of the stages' peaks (device allocator on a GPU, RSS on the CPU; each stage is a process)
        # 0.0 until measured (vLLM-Omni's model requires a number)
        "peak_memory_mb": round(t["peak_memory_mb"], 1) if t.get("peak_memory_mb") else 0.0,
        "file_name": f"{job.id}.mp4" if job.status == "completed" else None,
        # DiT forwards whose whole block stack ran (= the steps for lossless; fewer when quality=high reused some)
        "dit_forwards_computed": int(t["dit_forwards_computed"]) if "dit_forwards_computed" in t else None,
        "dit_block_evaluations": int(t["dit_block_evaluations"]) if "dit_block_evaluations" in t else None,
    }


def thumbnail(gateway: Gateway, job: Job) -> bytes:
    """A completed job's first frame as JPEG, read from the job store (a local file, or the object copied to one)."""
    mp4 = gateway.jobs.mp4(job)
    if mp4 is None:
        raise NotFound(f"video {job.id} is completed but its MP4 is no longer in the job store (deleted or expired)")
    if mp4.path is not None:
        return first_frame_jpeg(mp4.path)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        for chunk in mp4.chunks:
            f.write(chunk)
        f.flush()
        return first_frame_jpeg(f.name)


def mp4_response(gateway: Gateway, job: Job, headers: dict, filename: str | None = None,
                 index: int = 0) -> Response:
    """A completed job's MP4 (or its output `index`) from the job store: a file (with ranges) or streamed from the
    object store."""
    mp4 = gateway.jobs.mp4(job, index)
    if mp4 is None:
        raise NotFound(f"video {job.id} is completed but its MP4 is no longer in the job store (deleted or expired)")
    if mp4.path is not None:
        return Mp4FileResponse(mp4.path, media_type="video/mp4", headers=headers, filename=filename,
                               stat_result=os.stat(mp4.path))
    if filename:
        headers = {**headers, "Content-Disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(mp4.chunks, media_type="video/mp4",
                             headers={**headers, "Content-Length": str(mp4.size)})


class Authenticate:
    """Every /v1 call's `Authorization` checked before anything of it is read; the caller's key name in
    `request.state.owner`. Passes receive and send through untouched (the client's disconnect stays visible)."""

    def __init__(self, app, keys: Authenticator):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"].startswith("/v1/"):
            given = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
            try:
                if len(given) > 1:   # which one counts would depend on the proxy in front: none does
                    raise Unauthenticated(f"{len(given)} Authorization headers: send exactly one")
                owner = self.keys.caller(given[0] if given else None)
            except Unauthenticated as exc:
                if scope["type"] == "websocket":   # refused before the handshake completes: an HTTP 403
                    await send({"type": "websocket.close", "code": 1008, "reason": str(exc)[:120]})
                    return
                response = _error_response(exc)
                response.headers["WWW-Authenticate"] = 'Bearer realm="h3serve"'
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)


class Mp4FileResponse(FileResponse):
    """A FileResponse whose Range refusals are the error object (Starlette answers them as plain text): 416 with
    `Content-Range: bytes */SIZE` for a range past the end, 400 naming `Range` for a malformed one."""

    async def __call__(self, scope, receive, send):
        http_range = Headers(scope=scope).get("range")
        if_range = Headers(scope=scope).get("if-range")
        if (http_range is not None and self.stat_result is not None and self.status_code == 200
                and scope["method"].upper() in ("GET", "HEAD")
                and (if_range is None or self._should_use_range(if_range))):
            size = self.stat_result.st_size
            try:
                self._parse_range_header(http_range, size)
            except MalformedRangeHeader as exc:
                detail = exc.content if isinstance(exc.content, str) and exc.content else "malformed"
                await _refusal(400, "invalid_request", "Range",
                               f"Range={short(http_range)!r} is invalid: {detail}; give bytes=START-END within "
                               f"the {size:,} bytes of the MP4")(scope, receive, send)
                return
            except RangeNotSatisfiable:
                response = _refusal(416, "range_not_satisfiable", "Range",
                                    f"Range={short(http_range)!r} is not satisfiable: the MP4 has {size:,} bytes "
                                    f"(bytes 0-{size - 1})")
                response.headers["Content-Range"] = f"bytes */{size}"
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(gateway: Gateway, auth: Authenticator | None = None) -> FastAPI:
    app = FastAPI(title="h3serve", version="0.1.0",
                  description="MiniMax H3 text -> video + audio. Videos API compatible with vLLM-Omni / OpenAI "
                              "where the fields apply.",
                  responses={"4XX": ERROR_RESPONSE, "5XX": ERROR_RESPONSE})

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
        response = _refusal(exc.status_code, code, None, str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:   # every method of the path (Starlette names only its first route's)
            response.headers["Allow"] = _allowed(request)
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error_response(exc)

    # A plain ASGI middleware, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hands the app a receive
    # of its own that never reports the client gone, so `/v1/videos/sync` could not see its caller leave.
    app.add_middleware(Authenticate, keys=auth or Authenticator(None))

    async def new_job(request: Request, kind: str) -> Job:
        """The request's body read (bounded), its fields validated and its uploads decoded: on the decode pool,
        within the caller's share, when it carries media (else on a thread: validation alone is quick)."""
        body = await read_body(request)
        timeout = _timeout(request)
        owner = request.state.owner

        def sink(job: Job):
            return FileSink(gateway.jobs.mp4_path(job))

        def make() -> Job:
            fields, names = fields_from_http(body)
            return gateway.new_job(fields, kind=kind, sink_factory=sink, timeout=timeout, names=names, owner=owner)

        if isinstance(body, dict) and any(k in body for k in (*MEDIA_FIELDS, "conditions")):   # SGLang's media
            caller = decode_caller(owner, request.client.host if request.client else None)
            return await gateway.decoder.arun(caller, make)
        return await asyncio.to_thread(make)

    @app.post("/v1/videos", openapi_extra=REQUEST_BODY, summary="Create a video job")
    async def create_video(request: Request, validate_only: bool = False):
        job = await new_job(request, "http")
        if validate_only:
            obj = job_object(job, gateway)
            obj["status"], obj["object"] = "validated", "video.validation"
            return obj
        await asyncio.to_thread(gateway.submit, job)   # its record written off the loop
        return job_object(job, gateway)

    @app.post("/v1/videos/sync", openapi_extra=REQUEST_BODY, summary="Create a video and wait for the MP4",
              responses={200: {"content": {"video/mp4": {}, "application/json": {}}}})
    async def create_video_sync(request: Request, validate_only: bool = False):
        job = await new_job(request, "http")
        if job.validated.n > 1:
            raise RequestError(job.validated.names.get("n", "n"), job.validated.n,
                               "1 here (one MP4 per response); POST /v1/videos makes several")
        if validate_only:   # as POST /v1/videos?validate_only=true: the aligned job, nothing run
            obj = job_object(job, gateway)
            obj["status"], obj["object"] = "validated", "video.validation"
            return obj
        await asyncio.to_thread(gateway.submit, job)
        while not job.done.is_set():
            if await request.is_disconnected():   # nobody to answer: cancel quietly, no error logged
                await asyncio.to_thread(gateway.jobs.cancel, job.id, "the HTTP client disconnected")
                return Response(status_code=499)
            await asyncio.to_thread(job.done.wait, 0.25)
        if job.exc is not None:
            return _error_response(job.exc)
        headers = {"X-Request-Id": job.id,
                   "X-Inference-Time-S": f"{job.timings.get('t_client', 0.0):.6f}",   # vLLM-Omni's sync header
                   "X-Stage-Durations": json.dumps({k: round(v, 4) for k, v in job.timings.items()
                                                    if k.endswith("_s")}, separators=(",", ":"))}
        return await asyncio.to_thread(mp4_response, gateway, job, headers)

    @app.get("/v1/videos", summary="List video jobs")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        if not 0 <= limit <= 100:
            raise RequestError("limit", limit, "an integer in [0, 100] (0: no items, has_more says whether any)")
        if order not in ("asc", "desc"):
            raise RequestError("order", order, "asc or desc")
        page, more = await asyncio.to_thread(gateway.jobs.page, request.state.owner, limit, after, order)
        return {"object": "list", "data": [job_object(j, gateway) for j in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": more}

    @app.get("/v1/videos/{video_id}", summary="Get a video job")
    async def get_video(request: Request, video_id: str):
        return job_object(await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner), gateway)

    @app.get("/v1/usage", summary="Usage records of finished jobs, and their totals")
    async def get_usage(request: Request, caller: str | None = None, from_: str | None = Query(None, alias="from"),
                        to: str | None = None):
        owner = request.state.owner
        admins = {n.strip() for n in (gateway.config.gateway.admin_callers or "").split(",") if n.strip()}
        admin = owner is None or owner in admins   # authentication off: one operator, who sees everything
        if caller is not None and caller != owner and not admin:
            raise PermissionDenied(f"caller {owner!r} may read its own usage only (an admin key reads any caller's: "
                                   "--admin-callers)")
        end, start = _instant("to", to), _instant("from", from_)
        end = time.time() if end is None else end
        start = end - DEFAULT_RANGE_S if start is None else start
        if not 0 <= end - start <= MAX_RANGE_S:
            raise RequestError("from", from_, f"a time at most {MAX_RANGE_S // 86400} days before `to` "
                                              f"({_iso(end)}) and not after it")
        everyone = admin and caller is None
        return await asyncio.to_thread(gateway.usage.read, owner if caller is None else caller, everyone, start, end)

    def model_objects() -> list[dict]:
        return [{"id": ids[0], "object": "model", "created": int(app.state.started), "owned_by": "h3serve",
                 "profile": profile, "tasks": list(gateway.config.model.tasks_for(profile)), "aliases": list(ids[1:]),
                 # the LoRA adapters a request's `lora` may name (profile base: FastH3 runs its fused adapter only)
                 "loras": [] if profile == "fasth3" else [{"name": e.name, **({"steps": e.steps} if e.steps else {})}
                                                         for e in parse_loras(gateway.config.model.loras)]}
                for profile, ids in served_pools(gateway.config).items()]

    @app.get("/v1/models", summary="The model ids served")
    async def list_models():
        return {"object": "list", "data": model_objects()}

    @app.get("/v1/models/{model_id:path}", summary="One served model (by its id or an alias)")
    async def get_model(model_id: str):
        for obj in model_objects():
            if model_id == obj["id"] or model_id in obj["aliases"]:
                return obj
        served = ", ".join(o["id"] for o in model_objects())
        raise NotFound(f"model {short(model_id)!r} is not served here (served: {served}; GET /v1/models)")

    @app.post("/v1/videos/{video_id}/remix", summary="Refused: H3 has no edit path")
    async def remix(video_id: str):
        return _refusal(400, "unsupported", "remix", NO_EDITS.format(what="remix"))

    for path, what in (("/v1/videos/edits", "edits"), ("/v1/videos/extensions", "extensions"),
                       ("/v1/videos/characters", "characters")):
        async def refuse(what=what):
            return _refusal(400, "unsupported", what, NO_EDITS.format(what=what))

        app.post(path, summary=f"Refused: {what}")(refuse)

    @app.get("/v1/videos/characters/{character_id}", summary="Refused: characters")
    async def get_character(character_id: str):
        return _refusal(400, "unsupported", "characters", NO_EDITS.format(what="characters"))

    @app.get("/v1/videos/{video_id}/content", summary="Download the MP4 (or its thumbnail)",
             response_class=FileResponse,
             responses={200: {"content": {"video/mp4": {}, "image/jpeg": {}}}})
    async def get_content(request: Request, video_id: str, variant: str = "video", stream: bool = False):
        index = int(variant) if variant.isdigit() and len(variant) <= 2 else 0   # output INDEX of a job of n
        if variant not in VARIANTS and not variant.isdigit():
            return _refusal(400, "unsupported", "variant",
                            f"variant={variant!r} is not served: {' or '.join(VARIANTS)} (no spritesheet), or an "
                            "output's index 0..n-1")
        if stream and variant != "video":
            return _refusal(400, "unsupported", "stream", f"stream=true streams the video, not variant={variant!r}")
        job = await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner)
        if variant.isdigit() and not (0 <= index < job.validated.n and len(variant) <= 2):
            raise RequestError("variant", variant, f"an output index in [0, {job.validated.n - 1}] (the job's n is "
                                                   f"{job.validated.n})")
        if variant == "preview":
            if not job.preview:
                raise NotReady(f"video {video_id} has no preview (yet): create it with preview_every to get them "
                               "while it is denoised")
            return Response(job.preview, media_type="image/jpeg")
        if stream and job.status not in ("completed", "failed"):
            chunks = await asyncio.to_thread(live_content, job)
            if chunks is not None:
                return StreamingResponse(chunks, media_type="video/mp4", headers={STREAM_HEADER: "fmp4"})
            job = await asyncio.to_thread(gateway.jobs.get, video_id, request.state.owner)
            if job.status not in ("completed", "failed"):   # fetched, not yet recorded as completed
                await asyncio.to_thread(job.done.wait, 5.0)
        if job.status == "failed":
            raise NotReady(f"video {video_id} failed ({job.error.kind.code}): no content")
        if job.status != "completed":
            raise NotReady(f"video {video_id} is {job.status} ({int(job.progress)}%); content is ready when "
                           "status is completed")
        if variant == "thumbnail":
            return Response(await asyncio.to_thread(thumbnail, gateway, job), media_type="image/jpeg")
        name = f"{video_id}.mp4" if index == 0 else f"{video_id}-{index}.mp4"
        return await asyncio.to_thread(mp4_response, gateway, job, {STREAM_HEADER: "mp4"} if stream else {},
                                       filename=name, index=index)

    @app.websocket("/v1/realtime/video")
    async def realtime_video(websocket: WebSocket):
        owner = websocket.scope.get("state", {}).get("owner")

        def make(body: dict) -> Job:
            fields, names = fields_from_http(body)
            return gateway.new_job(fields, kind="http", sink_factory=lambda job: FileSink(gateway.jobs.mp4_path(job)),
                                   names=names, owner=owner)

        await serve_session(websocket, gateway, make, lambda job: job_object(job, gateway))

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

    @app.get("/ready", summary="Readiness: every stage SERVING, the job store writable, and not draining",
             responses={503: {"description": "Not ready: the same object, status not_ready"}})
    async def ready():
        ok = gateway.ready() and gateway.store_ready()
        body = {"status": "ready" if ok else "not_ready", "stages": dict(gateway.stages.status),
                "job_store": gateway.jobs.store_error or "ok",
                "draining": gateway.draining, "queue_depth": len(gateway.jobs.queue),
                "inflight": len(gateway.jobs.running), "transport": gateway.transports.details()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)   # declared text/plain
    async def metrics():
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.gateway = gateway
    app.state.started = time.time()
    return app
