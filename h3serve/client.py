"""The h3serve SDK: talk to a gateway over gRPC, synchronously (`Client`) or with asyncio (`AsyncClient`).

    from h3serve.client import Client, VideoRequest

    with Client("127.0.0.1:50051") as client:
        result = client.generate("a kite over the sea", seconds=5, size="1344x768", seed=7, output="kite.mp4",
                                 timeout=600, on_progress=lambda p: print(p.stage, p.done, p.total))
        print(result.path, result.timings["rtf_client"])
        result = client.generate(VideoRequest(prompt="a kite", seconds=5, seed=7))   # the same, typed

Both clients have the same methods with the same arguments (AsyncClient's are coroutines, its generations async
iterators); docs/sdk.md shows each. The request's fields are `VideoRequest`'s, made from the one request field table
(h3serve/config/request.py): give a `VideoRequest`, keyword arguments, or both (keywords win).

Retries: a call the gateway could not take (UNAVAILABLE: unreachable, draining, a stage down; RESOURCE_EXHAUSTED
meaning a full queue) is tried again after a jittered exponential backoff, within `Retry`'s attempts and deadline.
`generate` gives each request an id (`request_id`) before its first try, so a retry never makes a second job: a
stream that dropped is re-attached to its job (`attach`), a job that failed on a stage that went down is submitted
again under the same id (the gateway replaces a failed try), and a try whose job the gateway already has re-attaches
to it. Failures raise typed errors (all `H3Error`): `RequestError` (its `.field` names the field; `AlreadyExists`),
`QueueFull`, `Draining`, `StageUnavailable` (`.stage`), `DeadlineExceeded`, `Cancelled`, `NotFound`, `TooLarge`
(a request over the gateway's gRPC message limit: refused before sending, naming the size and the limit),
`StageFailed`, `Unauthenticated`, `PermissionDenied`.

`api_key` (default: $H3SERVE_API_KEY) is sent as `authorization: Bearer KEY` on every call of a gateway that
checks keys. This module imports no torch (tests/unit/test_sdk.py checks it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence, Union  # noqa: F401 - Sequence: in annotations

import grpc
from google.protobuf.json_format import MessageToDict
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve._proto import gateway_pb2, gateway_pb2_grpc
from h3serve.config.request import FIELD_TYPES, REQUEST_FIELDS
from h3serve.config.stage import API_KEY_ENV, GatewayConfig
from h3serve.errors import (AlreadyExists, Cancelled, DeadlineExceeded, Draining, H3Error, NotFound, PermissionDenied,
                            QueueFull, RequestError, StageFailed, StageUnavailable, TooLarge, Unauthenticated)
from h3serve.errortable import from_grpc, named_code, too_large_message
from h3serve.transport.channel import KEEP_ON_DISCONNECT_METADATA, channel_options

__all__ = ["Client", "AsyncClient", "VideoRequest", "Retry", "JobState", "Generation", "AsyncGeneration",
           "GenerationResult", "Accepted", "Progress", "H3Error", "RequestError", "AlreadyExists", "QueueFull",
           "Draining", "StageUnavailable", "DeadlineExceeded", "Cancelled", "NotFound", "TooLarge", "StageFailed",
           "Unauthenticated", "PermissionDenied"]

MAX_RECEIVE = 256 << 20   # the largest GenerateSync response this client accepts
# The largest request a gateway with default settings takes; a gateway's own is in info()["max_message_bytes"]
MAX_SEND = GatewayConfig().max_message_bytes

# ---------------------------------------------------------------------------------------------------------------
# The request: the rows of the request field table that GenerateRequest carries (validate_only is an argument)

_PROTO_FIELDS = {fd.name for fd in gateway_pb2.GenerateRequest.DESCRIPTOR.fields} - {"validate_only"}
_ROWS = [row for row in REQUEST_FIELDS if row.metadata["json"] in _PROTO_FIELDS]
FIELDS = tuple(row.metadata["json"] for row in _ROWS if row.metadata["json"] != "prompt")
_FILES = tuple(row.metadata["json"] for row in _ROWS if row.metadata["media"] == "one")
MEDIA = tuple(row.metadata["json"] for row in _ROWS if row.metadata["media"])

Media = Union[bytes, str, os.PathLike]
"""A file: its bytes, or a path to it."""
Reference = Union[Media, "tuple[str, bytes]"]
"""A ref2va reference: a path whose extension says its kind, "kind:path", (kind, bytes) or bytes."""


def _annotation(row) -> str:
    media = row.metadata["media"]
    if media:
        return "Media | None" if media == "one" else "Sequence[Reference] | None"
    return f"{FIELD_TYPES[row.name].__name__}" + ("" if row.metadata["required"] else " | None")


def _video_request_doc() -> str:
    lines = ["One generation request, the fields of the request field table that gRPC carries (unset: the",
             "server's default). Keyword arguments of the clients' calls are these fields.", ""]
    for row in _ROWS:
        doc = row.metadata["doc"] or ""
        if row.metadata["media"]:   # the table's text says how HTTP carries a file; here it is bytes or a path
            doc = (doc.split(" (")[0] + ": " if doc else "") + ("bytes or a path" if row.metadata["media"] == "one"
                                                               else "a list of Reference, in model order")
        lines.append(f"{row.metadata['json']} ({_annotation(row)}){': ' + doc if doc else ''}")
    return "\n".join(lines)


VideoRequest = dataclasses.make_dataclass(
    "VideoRequest",
    [(row.metadata["json"], _annotation(row),
      field(metadata=row.metadata) if row.metadata["required"] else field(default=None, metadata=row.metadata))
     for row in sorted(_ROWS, key=lambda r: not r.metadata["required"])],
    frozen=True, kw_only=True)
VideoRequest.__module__ = __name__
VideoRequest.__doc__ = _video_request_doc()


def _request(request: "str | VideoRequest | None", fields: dict[str, Any]) -> "VideoRequest":
    """The VideoRequest of a call: `request` (a prompt or a VideoRequest) with `fields` over it."""
    fields = dict(fields)
    if "steps" in fields:   # the CLI's and the embedded pipeline's name for num_inference_steps
        if fields.get("num_inference_steps") is not None:
            raise TypeError("give steps or num_inference_steps, not both")
        fields["num_inference_steps"] = fields.pop("steps")
    unknown = sorted(set(fields) - {"prompt", *FIELDS})
    if unknown:
        raise TypeError(f"unknown request fields {unknown}; allowed: prompt, {', '.join(FIELDS)}")
    if isinstance(request, str):
        if fields.get("prompt") is not None:
            raise TypeError("give the prompt once: as the first argument or as prompt=")
        fields["prompt"] = request
    elif isinstance(request, VideoRequest):
        return dataclasses.replace(request, **fields)
    elif request is not None:
        raise TypeError(f"request: a prompt (str) or a VideoRequest, got {type(request).__name__}")
    if fields.get("prompt") is None:
        raise RequestError("prompt", None, "a prompt (1..20,000 characters)")
    return VideoRequest(**fields)


def _media_bytes(name: str, value: Any) -> tuple[bytes, str]:
    """(bytes, file name) of a media argument: bytes as given, or the file at a path."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), ""
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        try:
            return path.read_bytes(), path.name
        except OSError as exc:
            raise RequestError(name, str(value), f"a readable file ({exc.strerror})") from None
    raise RequestError(name, type(value).__name__, "bytes or a path to a file")


def build_request(request: "VideoRequest", *, validate_only: bool = False,
                  max_bytes: int = MAX_SEND) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest of a VideoRequest (files read); TooLarge when it exceeds `max_bytes` on the wire."""
    msg = gateway_pb2.GenerateRequest(prompt=request.prompt, validate_only=validate_only)
    for name in _FILES:
        if getattr(request, name) is not None:
            setattr(msg, name, _media_bytes(name, getattr(request, name))[0])
    for i, ref in enumerate(request.references or ()):
        kind = ""
        if isinstance(ref, tuple) and len(ref) == 2:
            kind, ref = ref
        elif isinstance(ref, str):
            head, sep, tail = ref.partition(":")
            if sep and head.lower() in ("image", "audio", "video"):
                kind, ref = head.lower(), tail
        data, filename = _media_bytes(f"references[{i}]", ref)
        msg.references.add(kind=kind, data=data, filename=filename)
    for name in FIELDS:
        value = getattr(request, name)
        if value is None or name in MEDIA:
            continue
        if name == "lora":   # a deployment adapter's name, or {"name", "scale"} (LoraRef)
            try:
                msg.lora.CopyFrom(gateway_pb2.LoraRef(**({"name": value} if isinstance(value, str) else value)))
            except (TypeError, ValueError) as exc:
                raise RequestError(name, value, f'a name or {{"name": NAME, "scale": number}} ({exc})') from None
            continue
        try:
            setattr(msg, name, value)
        except (TypeError, ValueError) as exc:
            raise RequestError(name, value, f"a value of the field's type ({exc})") from None
    size = msg.ByteSize()
    if size > max_bytes:
        raise TooLarge(too_large_message(size, max_bytes, "the request"), stage="gateway")
    return msg


def new_request_id() -> str:
    """An id for a request whose caller chose none (the gateway's alphabet: letters, digits, '-', '_', '.')."""
    return f"sdk-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------------------
# Retries

@dataclass(frozen=True)
class Retry:
    """When a call is tried again: on UNAVAILABLE (gateway unreachable or draining, a stage down) and on a full
    queue, at most `attempts` tries in all and none started after `deadline_s` from the first (nor after the call's
    own timeout). Between tries a full-jitter exponential backoff: uniform in [0, min(max_backoff_s,
    initial_backoff_s * multiplier**n)]. `Retry(attempts=1)` or `retry=None` turns retries off."""
    attempts: int = 5
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    multiplier: float = 2.0
    deadline_s: float | None = 120.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try `attempt + 1` (attempt 0 is the first retry)."""
        return random.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt))

    def allows(self, attempt: int, started: float, end: float | None) -> float | None:
        """The wait before try `attempt + 2` (attempt: retries so far), or None when no try is left."""
        if attempt + 1 >= self.attempts:
            return None
        wait = self.backoff(attempt)
        now = time.monotonic()
        if self.deadline_s is not None and now + wait > started + self.deadline_s:
            return None
        if end is not None and now + wait >= end:
            return None
        return wait


RETRYABLE = (StageUnavailable, Draining, QueueFull)


def _retryable(err: BaseException) -> bool:
    return isinstance(err, RETRYABLE)


# ---------------------------------------------------------------------------------------------------------------
# Events and results

def _key_metadata(api_key: str | None) -> tuple:
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


class _WithKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the caller's key to every call's metadata."""

    def __init__(self, metadata: tuple):
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _AsyncWithKey(aio.UnaryUnaryClientInterceptor, aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple):
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=aio.Metadata(*(tuple(details.metadata or ()) + self.metadata)))

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


@dataclass(frozen=True)
class Accepted:
    """The request as the gateway aligned it (frames 17n+5, sides multiples of 32, the seed it drew)."""
    request_id: str
    num_frames: int
    width: int
    height: int
    fps: int
    seed: int
    num_inference_steps: int
    task: str
    profile: str
    media_seconds: float
    queue_position: int


@dataclass(frozen=True)
class Progress:
    """stage: queue | encoder | dit | vae; done/total: steps (dit), clips (vae); percent: overall 0..100."""
    stage: str
    done: int
    total: int
    elapsed_s: float
    percent: float
    preview_jpeg: bytes = b""   # with preview_every: a small JPEG of the current estimate (false colour)


@dataclass(frozen=True)
class JobState:
    """A request's state as `cancel` leaves it: status queued | in_progress (stopping) | completed | failed;
    `cancelled`: this call stopped it; `error_code`: a failed request's code (e.g. cancelled)."""
    request_id: str
    status: str
    cancelled: bool
    error_code: str = ""


@dataclass
class GenerationResult:
    request_id: str
    accepted: Accepted | None
    mp4: bytes | None            # the MP4, unless it was written to `path`
    path: Path | None
    mp4_bytes: int
    sha256: str
    timings: dict[str, float] = field(default_factory=dict)
    attempts: int = 1            # tries it took (retries and re-attaches count)

    @property
    def forwards_computed(self) -> int | None:
        """DiT forwards whose whole block stack ran (the steps for quality lossless; fewer when high reused some)."""
        value = self.timings.get("dit_forwards_computed")
        return None if value is None else int(value)


def _accepted(msg) -> Accepted:
    return Accepted(request_id=msg.request_id, num_frames=msg.num_frames, width=msg.width, height=msg.height,
                    fps=msg.fps, seed=msg.seed, num_inference_steps=msg.num_inference_steps, task=msg.task,
                    profile=msg.profile, media_seconds=msg.media_seconds, queue_position=msg.queue_position)


def _progress(msg) -> Progress:
    return Progress(stage=msg.stage, done=msg.done, total=msg.total, elapsed_s=msg.elapsed_s, percent=msg.percent,
                    preview_jpeg=msg.preview_jpeg)


def _sync_result(r) -> GenerationResult:
    return GenerationResult(request_id=r.done.request_id, accepted=_accepted(r.accepted), mp4=r.mp4, path=None,
                            mp4_bytes=len(r.mp4), sha256=r.done.sha256, timings=dict(r.done.timings))


def _job_state(request_id: str, r) -> JobState:
    return JobState(request_id=request_id, status=r.status, cancelled=r.cancelled, error_code=r.error_code)


def check_output(output: str | os.PathLike | None, name: str = "output") -> None:
    """Refuse, before any work, an output whose folder is missing or not writable (nothing is created)."""
    if output is None:
        return
    path = Path(output)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise RequestError(name, str(output), "a file path in an existing, writable folder")


class _Collector:
    """MP4 chunks into memory or into `output` (written as .part, renamed when the stream is complete)."""

    def __init__(self, output: str | os.PathLike | None):
        self.path = Path(output) if output is not None else None
        self.part = self.path.with_name(f".{self.path.name}.part") if self.path else None
        self.buf = bytearray() if self.path is None else None
        self.f = None
        self.size = 0
        self.digest = hashlib.sha256()

    def write(self, offset: int, data: bytes) -> None:
        if offset != self.size:
            raise StageFailed("gateway", f"MP4 chunk at offset {offset}, expected {self.size}")
        if self.path is not None:
            if self.f is None:
                self.f = open(self.part, "wb")
            self.f.write(data)
        else:
            self.buf += data
        self.size += len(data)
        self.digest.update(data)

    def finish(self, done, accepted: Accepted | None) -> GenerationResult:
        if done.sha256 and done.sha256 != self.digest.hexdigest():
            self.abort()
            raise StageFailed("gateway", "the MP4 received does not match its sha256")
        if self.path is not None:
            if self.f is None:
                self.f = open(self.part, "wb")
            self.f.close()
            os.replace(self.part, self.path)
        return GenerationResult(request_id=done.request_id, accepted=accepted,
                                mp4=bytes(self.buf) if self.buf is not None else None, path=self.path,
                                mp4_bytes=self.size, sha256=self.digest.hexdigest(), timings=dict(done.timings))

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.part is not None:
            try:
                os.unlink(self.part)
            except FileNotFoundError:
                pass


class _Events:
    """What a generation's stream says, event by event (shared by the sync and asyncio generations)."""

    def __init__(self, call, output, request_id: str | None, cancel_by_id):
        self._call = call
        self._collector = _Collector(output)
        self._cancel_by_id = cancel_by_id
        self._cancelled = False
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.dropped = False   # the stream ended with a status gRPC itself gave (no answer of the gateway's)
        self.accepted: Accepted | None = None
        self._request_id = request_id

    @property
    def request_id(self) -> str | None:
        """The request's id (known before the gateway answers when the caller or the client chose it)."""
        return self.accepted.request_id if self.accepted else self._request_id

    def _take(self, ev) -> Accepted | Progress | None:
        kind = ev.WhichOneof("event")
        if kind == "accepted":
            self.accepted = _accepted(ev.accepted)
            return self.accepted
        if kind == "progress":
            return _progress(ev.progress)
        if kind == "mp4":
            self._collector.write(ev.mp4.offset, ev.mp4.data)
        elif kind == "done":
            self._result = self._collector.finish(ev.done, self.accepted)
        return None

    def _ended(self) -> None:
        if self._result is None:
            raise StageFailed("gateway", "the stream ended without a result")

    def _failed(self, exc: BaseException) -> BaseException:
        self._collector.abort()
        if isinstance(exc, grpc.RpcError):
            self.dropped = named_code(exc) is None and not self._cancelled
            exc = from_grpc(exc, stage="gateway", cancelled=self._cancelled)
        self._error = exc
        return exc

    @property
    def running(self) -> bool:
        return self._result is None and self._error is None


class Generation(_Events):
    """One streaming generation. Iterate for `Accepted` and `Progress` events; `result()` waits for the MP4.
    `cancel()` or leaving a `with` block early cancels the request everywhere. A stream that drops (network,
    gateway restart) leaves the job running for the gateway's attach grace: `Client.attach(gen.request_id)`
    watches it again."""

    def __init__(self, call, output=None, request_id: str | None = None, cancel_by_id=None):
        super().__init__(call, output, request_id, cancel_by_id)
        self._events = self._run()

    def _run(self) -> Iterator[Accepted | Progress]:
        try:
            for ev in self._call:
                event = self._take(ev)
                if event is not None:
                    yield event
            self._ended()
        except BaseException as exc:
            err = self._failed(exc)
            if err is exc:
                raise
            raise err from None

    def __iter__(self) -> Iterator[Accepted | Progress]:
        return self._events

    def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the result (raises the typed error of a failed call)."""
        for _ in self._events:
            pass
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Cancel the request (by its id at the gateway, and this stream)."""
        if self.running and not self._cancelled:
            self._cancelled = True
            if self._cancel_by_id is not None and self.request_id:
                try:
                    self._cancel_by_id(self.request_id)
                except H3Error:   # already gone: the stream's own cancel below is all there is to do
                    pass
            self._call.cancel()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncGeneration(_Events):
    """The asyncio twin of `Generation`: `async for event in gen`, `await gen.result()`, `await gen.cancel()`;
    cancelling the task that reads it cancels the request."""

    def __init__(self, call, output=None, request_id: str | None = None, cancel_by_id=None):
        super().__init__(call, output, request_id, cancel_by_id)
        self._events = self._run()

    async def _run(self) -> AsyncIterator[Accepted | Progress]:
        try:
            async for ev in self._call:
                event = self._take(ev)
                if event is not None:
                    yield event
            self._ended()
        except asyncio.CancelledError:
            await self.cancel()
            raise
        except BaseException as exc:
            err = self._failed(exc)
            if err is exc:
                raise
            raise err from None

    def __aiter__(self) -> AsyncIterator[Accepted | Progress]:
        return self._events

    async def result(self) -> GenerationResult:
        """Consume the rest of the stream and return the result (raises the typed error of a failed call)."""
        async for _ in self._events:
            pass
        if self._error is not None:
            raise self._error
        return self._result

    async def cancel(self) -> None:
        """Cancel the request (by its id at the gateway, and this stream)."""
        if self.running and not self._cancelled:
            self._cancelled = True
            self._call.cancel()
            if self._cancel_by_id is not None and self.request_id:
                try:
                    await self._cancel_by_id(self.request_id)
                except (H3Error, asyncio.CancelledError):
                    pass

    async def __aenter__(self) -> "AsyncGeneration":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.cancel()


# ---------------------------------------------------------------------------------------------------------------
# The clients

_KEEP = ((KEEP_ON_DISCONNECT_METADATA, "1"),)


class _Base:
    def __init__(self, target: str, timeout: float | None, retry: Retry | None, max_send_bytes: int | None):
        self.target = target
        self.timeout = timeout
        self.retry = retry or Retry(attempts=1)
        self.max_send_bytes = MAX_SEND if max_send_bytes is None else max_send_bytes

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _message(self, request: "VideoRequest", validate_only: bool = False) -> gateway_pb2.GenerateRequest:
        return build_request(request, validate_only=validate_only, max_bytes=self.max_send_bytes)

    def _plan(self, request, fields) -> "VideoRequest":
        """The call's request; with retries on, an id chosen now so that no retry makes a second job."""
        req = _request(request, fields)
        if req.request_id is None and self.retry.attempts > 1:
            req = dataclasses.replace(req, request_id=new_request_id())
        return req

    # what a generate try may fail with and still be tried again (a re-attach finding its job gone or already there)
    GENERATE_RETRIED = (StageUnavailable, Draining, QueueFull, AlreadyExists, NotFound)

    def _after(self, gen: "_Events | None", err: BaseException, attempt: int, started: float,
               end: float | None) -> tuple[float, bool]:
        """After a failed generate try: (the wait before the next, whether it re-attaches, else submits again);
        raises `err` when the client's `retry` allows no other try."""
        retry_it = _retryable(err) or (attempt > 0 and isinstance(err, (AlreadyExists, NotFound)))
        wait = self.retry.allows(attempt, started, end) if retry_it else None
        if wait is None:
            raise err
        if isinstance(err, AlreadyExists):   # an earlier try's job is there (running or completed): watch it
            return wait, True
        return wait, gen is not None and gen.dropped and gen.accepted is not None and not isinstance(err, NotFound)

    @staticmethod
    def _remaining(end: float | None) -> float | None:
        return None if end is None else max(0.0, end - time.monotonic())


class Client(_Base):
    """Synchronous gateway client. `timeout`: the default deadline (seconds) of each generation; `retry`: when a
    call is tried again (None: never); `max_send_bytes`: the largest request sent (the gateway's limit, 65 MiB by
    default; a larger one raises TooLarge before anything is sent)."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: grpc.ChannelCredentials | None = None,
                 options: list | None = None, api_key: str | None = None, retry: Retry | None = Retry(),
                 max_send_bytes: int | None = None):
        super().__init__(target, timeout, retry, max_send_bytes)
        opts = channel_options(MAX_RECEIVE) + list(options or [])
        self.channel = grpc.secure_channel(target, credentials, opts) if credentials else \
            grpc.insecure_channel(target, opts)
        if metadata := _key_metadata(api_key):
            self.channel = grpc.intercept_channel(self.channel, _WithKey(metadata))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (calls in flight end)."""
        self.channel.close()

    def _unary(self, fn: Callable[[float | None], Any], timeout: float | None) -> Any:
        """A unary call with the retry policy (each try gets what remains of `timeout`)."""
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        attempt = 0
        while True:
            try:
                return fn(self._remaining(end))
            except grpc.RpcError as exc:
                err = from_grpc(exc, stage="gateway")
            wait = self.retry.allows(attempt, started, end) if _retryable(err) else None
            if wait is None:
                raise err from None
            time.sleep(wait)
            attempt += 1

    def stream(self, request: "str | VideoRequest | None" = None, /, *, output: str | os.PathLike | None = None,
               timeout: float | None = None, **fields: Any) -> Generation:
        """Start a generation and return it at once: iterate it for `Accepted` and `Progress`, then call `result()`.
        One try (no retries: a dropped stream raises, and `attach(gen.request_id)` watches the job again)."""
        check_output(output)
        req = self._plan(request, fields)
        call = self.stub.Generate(self._message(req), timeout=self._timeout(timeout), metadata=_KEEP)
        return Generation(call, output, req.request_id, self._cancel_quietly)

    def attach(self, request_id: str, *, output: str | os.PathLike | None = None,
               timeout: float | None = None) -> Generation:
        """Watch a request again by id (after its stream dropped): its events from the start (Accepted, progress,
        the whole MP4), then the live ones. NotFound once the gateway no longer keeps it."""
        check_output(output)
        call = self.stub.Attach(gateway_pb2.AttachRequest(request_id=request_id), timeout=self._timeout(timeout))
        return Generation(call, output, request_id, self._cancel_quietly)

    def generate(self, request: "str | VideoRequest | None" = None, /, *, output: str | os.PathLike | None = None,
                 timeout: float | None = None, on_progress: Callable[[Progress], Any] | None = None,
                 **fields: Any) -> GenerationResult:
        """Generate and return the result: `result.mp4` (bytes), or `result.path` when `output` is given. Retried
        by the client's `retry`: a dropped stream is re-attached, a request refused or failed as UNAVAILABLE is
        sent again under the same request_id (never a second job)."""
        check_output(output)
        req = self._plan(request, fields)
        timeout = self._timeout(timeout)
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        attempt, reattach, gen = 0, False, None
        while True:
            gen = None
            try:
                gen = self.attach(req.request_id, output=output, timeout=self._remaining(end)) if reattach else \
                    Generation(self.stub.Generate(self._message(req), timeout=self._remaining(end), metadata=_KEEP),
                               output, req.request_id, self._cancel_quietly)
                with gen:
                    for event in gen:
                        if on_progress is not None and isinstance(event, Progress):
                            on_progress(event)
                    result = gen.result()
                result.attempts = attempt + 1
                return result
            except self.GENERATE_RETRIED as err:
                wait, reattach = self._after(gen, err, attempt, started, end)
            time.sleep(wait)
            attempt += 1

    def generate_sync(self, request: "str | VideoRequest | None" = None, /, *, timeout: float | None = None,
                      **fields: Any) -> GenerationResult:
        """One unary call (GenerateSync): the whole MP4 in one response, no progress. Retried while the gateway
        refuses it (UNAVAILABLE, a full queue) under the same request_id."""
        msg = self._message(self._plan(request, fields))
        return _sync_result(self._unary(lambda t: self.stub.GenerateSync(msg, timeout=t), self._timeout(timeout)))

    def validate(self, request: "str | VideoRequest | None" = None, /, *, timeout: float | None = 30.0,
                 **fields: Any) -> Accepted:
        """Validate and align a request without generating (raises RequestError naming the field)."""
        msg = self._message(_request(request, fields), validate_only=True)

        def once(t):
            for ev in self.stub.Generate(msg, timeout=t):
                if ev.WhichOneof("event") == "accepted":
                    return _accepted(ev.accepted)
            raise StageFailed("gateway", "no answer to a validation")
        return self._unary(once, timeout)

    def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> JobState:
        """Cancel a request by id (e.g. from another process). Idempotent: a request that already ended answers its
        state (`cancelled` False); NotFound only for an id the gateway has no request of (or no longer keeps)."""
        r = self._unary(lambda t: self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=t),
                        timeout)
        return _job_state(request_id, r)

    def _cancel_quietly(self, request_id: str) -> None:
        try:
            self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=5.0)
        except grpc.RpcError as exc:
            raise from_grpc(exc, stage="gateway") from None

    def stream_content(self, request_id: str, *, timeout: float | None = None) -> Iterator[bytes]:
        """A running request's video as a fragmented MP4, chunk by chunk as its clips are encoded (a player can
        start on the first fragment); its frames and audio are those of the MP4 its Generate call delivers."""
        try:
            for chunk in self.stub.StreamContent(gateway_pb2.StreamContentRequest(request_id=request_id),
                                                 timeout=self._timeout(timeout)):
                yield chunk.data
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None

    def info(self, *, timeout: float | None = 10.0) -> dict:
        """The deployment: model, profile, dtype, queue size, max_inflight, size limits, each stage's health."""
        return MessageToDict(self._unary(lambda t: self.stub.Info(gateway_pb2.InfoRequest(), timeout=t), timeout),
                             preserving_proto_field_name=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the gateway's health check says SERVING (every stage ready); StageUnavailable after
        `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                r = self._health.Check(health_pb2.HealthCheckRequest(), timeout=min(1.0, max(0.01, end - time.monotonic())))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise StageUnavailable("gateway", f"not SERVING within {timeout:g}s")


class AsyncClient(_Base):
    """asyncio gateway client (grpc.aio): `Client`'s methods with the same arguments, as coroutines; `stream` and
    `attach` return an `AsyncGeneration`. Cancelling the task of a call cancels its request."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: grpc.ChannelCredentials | None = None,
                 options: list | None = None, api_key: str | None = None, retry: Retry | None = Retry(),
                 max_send_bytes: int | None = None):
        super().__init__(target, timeout, retry, max_send_bytes)
        opts = channel_options(MAX_RECEIVE) + list(options or [])
        metadata = _key_metadata(api_key)
        interceptors = [_AsyncWithKey(metadata)] if metadata else None
        self.channel = aio.secure_channel(target, credentials, opts, interceptors=interceptors) if credentials else \
            aio.insecure_channel(target, opts, interceptors=interceptors)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _unary(self, fn: Callable[[float | None], Any], timeout: float | None) -> Any:
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        attempt = 0
        while True:
            try:
                return await fn(self._remaining(end))
            except grpc.RpcError as exc:
                err = from_grpc(exc, stage="gateway")
            wait = self.retry.allows(attempt, started, end) if _retryable(err) else None
            if wait is None:
                raise err from None
            await asyncio.sleep(wait)
            attempt += 1

    def stream(self, request: "str | VideoRequest | None" = None, /, *, output: str | os.PathLike | None = None,
               timeout: float | None = None, **fields: Any) -> AsyncGeneration:
        check_output(output)
        req = self._plan(request, fields)
        call = self.stub.Generate(self._message(req), timeout=self._timeout(timeout), metadata=_KEEP)
        return AsyncGeneration(call, output, req.request_id, self._cancel_quietly)

    def attach(self, request_id: str, *, output: str | os.PathLike | None = None,
               timeout: float | None = None) -> AsyncGeneration:
        check_output(output)
        call = self.stub.Attach(gateway_pb2.AttachRequest(request_id=request_id), timeout=self._timeout(timeout))
        return AsyncGeneration(call, output, request_id, self._cancel_quietly)

    async def generate(self, request: "str | VideoRequest | None" = None, /, *,
                       output: str | os.PathLike | None = None, timeout: float | None = None,
                       on_progress: Callable[[Progress], Any] | None = None, **fields: Any) -> GenerationResult:
        check_output(output)
        req = self._plan(request, fields)
        timeout = self._timeout(timeout)
        started = time.monotonic()
        end = None if timeout is None else started + timeout
        attempt, reattach, gen = 0, False, None
        while True:
            gen = None
            try:
                gen = self.attach(req.request_id, output=output, timeout=self._remaining(end)) if reattach else \
                    AsyncGeneration(self.stub.Generate(self._message(req), timeout=self._remaining(end),
                                                       metadata=_KEEP), output, req.request_id, self._cancel_quietly)
                async with gen:
                    async for event in gen:
                        if on_progress is not None and isinstance(event, Progress):
                            out = on_progress(event)
                            if inspect.isawaitable(out):
                                await out
                    result = await gen.result()
                result.attempts = attempt + 1
                return result
            except self.GENERATE_RETRIED as err:
                wait, reattach = self._after(gen, err, attempt, started, end)
            await asyncio.sleep(wait)
            attempt += 1

    async def generate_sync(self, request: "str | VideoRequest | None" = None, /, *, timeout: float | None = None,
                            **fields: Any) -> GenerationResult:
        msg = self._message(self._plan(request, fields))
        return _sync_result(await self._unary(lambda t: self.stub.GenerateSync(msg, timeout=t),
                                              self._timeout(timeout)))

    async def validate(self, request: "str | VideoRequest | None" = None, /, *, timeout: float | None = 30.0,
                       **fields: Any) -> Accepted:
        msg = self._message(_request(request, fields), validate_only=True)

        async def once(t):
            async for ev in self.stub.Generate(msg, timeout=t):
                if ev.WhichOneof("event") == "accepted":
                    return _accepted(ev.accepted)
            raise StageFailed("gateway", "no answer to a validation")
        return await self._unary(once, timeout)

    async def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> JobState:
        r = await self._unary(lambda t: self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=t),
                              timeout)
        return _job_state(request_id, r)

    async def _cancel_quietly(self, request_id: str) -> None:
        try:
            await self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=5.0)
        except grpc.RpcError as exc:
            raise from_grpc(exc, stage="gateway") from None

    async def stream_content(self, request_id: str, *, timeout: float | None = None) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.stub.StreamContent(gateway_pb2.StreamContentRequest(request_id=request_id),
                                                       timeout=self._timeout(timeout)):
                yield chunk.data
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None

    async def info(self, *, timeout: float | None = 10.0) -> dict:
        r = await self._unary(lambda t: self.stub.Info(gateway_pb2.InfoRequest(), timeout=t), timeout)
        return MessageToDict(r, preserving_proto_field_name=True)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                r = await self._health.Check(health_pb2.HealthCheckRequest(),
                                             timeout=min(1.0, max(0.01, end - time.monotonic())))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            await asyncio.sleep(0.1)
        raise StageUnavailable("gateway", f"not SERVING within {timeout:g}s")


# One set of methods and one text each: AsyncClient's public methods take Client's docstrings.
PUBLIC_METHODS = tuple(name for name, _ in inspect.getmembers(Client, inspect.isfunction) if not name.startswith("_"))
for _name in PUBLIC_METHODS:
    _doc = getattr(Client, _name).__doc__
    if getattr(AsyncClient, _name).__doc__ is None and _doc:
        getattr(AsyncClient, _name).__doc__ = _doc + ("" if _name in ("stream", "attach") else " (a coroutine)")
del _name, _doc
