"""The h3serve SDK: talk to a gateway over gRPC, synchronously or with asyncio.

    from h3serve.client import Client

    with Client("127.0.0.1:50051") as client:
        result = client.generate("a kite over the sea", seconds=5, size="1344x768", seed=7, output="kite.mp4",
                                 timeout=600, on_progress=lambda p: print(p.stage, p.done, p.total))
        print(result.path, result.timings["rtf_client"])

        with client.stream("a kite over the sea", seconds=5) as gen:   # leaving the block unfinished cancels
            for event in gen:                                           # Accepted, then Progress events
                ...
            mp4 = gen.result().mp4

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("a kite", seconds=5)            # cancelling the task cancels the call
        gen = client.stream("a kite"); async for event in gen: ...; await gen.result(); await gen.cancel()

Request fields (keyword arguments): seconds, size, width, height, num_frames, fps, seed, num_inference_steps
(alias steps), task, quality (lossless | high: step reuse, profile base), model, request_id; fl2va keyframes
first_image / last_image and ref2va references (a list, in model order) as bytes or paths (a reference as
"kind:path", (kind, bytes) or a path whose extension says the kind):

    client.generate("the kite lands", first_image="kite.png", last_image=Path("beach.jpg").read_bytes())
    client.generate("she sings", references=["subject.png", "audio:voice.wav"])
 `timeout` is the call's deadline in seconds; the gateway passes
what remains of it to every stage. Failures raise typed errors (all `H3Error`): `RequestError` (its `.field`
names the field; `AlreadyExists`, a RequestError, for a `request_id` a job already has), `QueueFull`,
`Draining`, `StageUnavailable` (`.stage`), `DeadlineExceeded`, `Cancelled`, `NotFound`, `TooLarge`,
`StageFailed`, `Unauthenticated`, `PermissionDenied`.

`api_key` (default: $H3SERVE_API_KEY) is sent as `authorization: Bearer KEY` on every call of a gateway that
checks keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
from google.protobuf.json_format import MessageToDict
from grpc import aio

from h3serve._proto import gateway_pb2, gateway_pb2_grpc
from h3serve.config.stage import API_KEY_ENV
from h3serve.errors import (AlreadyExists, Cancelled, DeadlineExceeded, Draining, H3Error, NotFound, PermissionDenied,
                            QueueFull, RequestError, StageFailed, StageUnavailable, TooLarge, Unauthenticated)
from h3serve.errortable import from_grpc
from h3serve.transport.grpc import channel_options, wait_serving

__all__ = ["Client", "AsyncClient", "Generation", "AsyncGeneration", "GenerationResult", "Accepted", "Progress",
           "H3Error", "RequestError", "AlreadyExists", "QueueFull", "Draining", "StageUnavailable", "DeadlineExceeded",
           "Cancelled", "NotFound", "TooLarge", "StageFailed", "Unauthenticated", "PermissionDenied"]

MAX_RECEIVE = 256 << 20   # the largest GenerateSync response this client accepts
# The request's keywords are GenerateRequest's fields (prompt and validate_only are arguments of their own); its
# media are its bytes fields (files) and the references.
_REQUEST = gateway_pb2.GenerateRequest.DESCRIPTOR.fields
_FILES = tuple(fd.name for fd in _REQUEST if fd.type == fd.TYPE_BYTES)
MEDIA = (*_FILES, "references")
FIELDS = tuple(fd.name for fd in _REQUEST if fd.name not in ("prompt", "validate_only"))


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


@dataclass
class GenerationResult:
    request_id: str
    accepted: Accepted | None
    mp4: bytes | None            # the MP4, unless it was written to `path`
    path: Path | None
    mp4_bytes: int
    sha256: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def forwards_computed(self) -> int | None:
        """DiT forwards whose whole block stack ran (the steps for quality lossless; fewer when high reused some)."""
        value = self.timings.get("dit_forwards_computed")
        return None if value is None else int(value)


def build_request(prompt: str, *, validate_only: bool = False, **fields: Any):
    if "steps" in fields:
        if fields.get("num_inference_steps") is not None:
            raise TypeError("give steps or num_inference_steps, not both")
        fields["num_inference_steps"] = fields.pop("steps")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown request fields {unknown}; allowed: {', '.join(FIELDS)}")
    media = {k: fields.pop(k) for k in MEDIA if k in fields}
    msg = gateway_pb2.GenerateRequest(prompt=prompt, validate_only=validate_only)
    for name in _FILES:
        if media.get(name) is not None:
            setattr(msg, name, _media_bytes(name, media[name])[0])
    for i, ref in enumerate(media.get("references") or ()):
        kind = ""
        if isinstance(ref, tuple) and len(ref) == 2:
            kind, ref = ref
        elif isinstance(ref, str):
            head, sep, tail = ref.partition(":")
            if sep and head.lower() in ("image", "audio", "video"):
                kind, ref = head.lower(), tail
        data, filename = _media_bytes(f"references[{i}]", ref)
        msg.references.add(kind=kind, data=data, filename=filename)
    for name, value in fields.items():
        if value is None:
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
    return msg


def _accepted(msg) -> Accepted:
    return Accepted(request_id=msg.request_id, num_frames=msg.num_frames, width=msg.width, height=msg.height,
                    fps=msg.fps, seed=msg.seed, num_inference_steps=msg.num_inference_steps, task=msg.task,
                    profile=msg.profile, media_seconds=msg.media_seconds, queue_position=msg.queue_position)


def _progress(msg) -> Progress:
    return Progress(stage=msg.stage, done=msg.done, total=msg.total, elapsed_s=msg.elapsed_s, percent=msg.percent)


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


class Generation:
    """One streaming generation. Iterate for `Accepted` and `Progress` events; `result()` waits for the MP4.
    `cancel()`, leaving a `with` block early, or dropping the object cancels the request everywhere."""

    def __init__(self, call, output=None):
        self._call = call
        self._collector = _Collector(output)
        self._cancelled = False
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.accepted: Accepted | None = None
        self._events = self._run()

    @property
    def request_id(self) -> str | None:
        return self.accepted.request_id if self.accepted else None

    def _run(self) -> Iterator[Accepted | Progress]:
        try:
            for ev in self._call:
                kind = ev.WhichOneof("event")
                if kind == "accepted":
                    self.accepted = _accepted(ev.accepted)
                    yield self.accepted
                elif kind == "progress":
                    yield _progress(ev.progress)
                elif kind == "mp4":
                    self._collector.write(ev.mp4.offset, ev.mp4.data)
                elif kind == "done":
                    self._result = self._collector.finish(ev.done, self.accepted)
            if self._result is None:
                raise StageFailed("gateway", "the stream ended without a result")
        except grpc.RpcError as err:
            self._collector.abort()
            self._error = from_grpc(err, stage="gateway", cancelled=self._cancelled)
            raise self._error from None
        except BaseException as exc:
            self._collector.abort()
            self._error = exc
            raise

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
        if self._result is None and self._error is None:
            self._cancelled = True
            self._call.cancel()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Synchronous gateway client. `timeout` is the default deadline (seconds) of each generation."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: grpc.ChannelCredentials | None = None,
                 options: list | None = None, api_key: str | None = None):
        opts = channel_options(MAX_RECEIVE) + list(options or [])
        self.target = target
        self.timeout = timeout
        self.channel = grpc.secure_channel(target, credentials, opts) if credentials else \
            grpc.insecure_channel(target, opts)
        if metadata := _key_metadata(api_key):
            self.channel = grpc.intercept_channel(self.channel, _WithKey(metadata))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str, *, output: str | os.PathLike | None = None, timeout: float | None = None,
               **fields: Any) -> Generation:
        """Start a generation; iterate the returned `Generation` for progress, then call `result()`."""
        check_output(output)
        call = self.stub.Generate(build_request(prompt, **fields), timeout=self._timeout(timeout))
        return Generation(call, output)

    def generate(self, prompt: str, *, output: str | os.PathLike | None = None, timeout: float | None = None,
                 on_progress: Callable[[Progress], None] | None = None, **fields: Any) -> GenerationResult:
        """Generate and return the result: `result.mp4` (bytes), or `result.path` when `output` is given."""
        with self.stream(prompt, output=output, timeout=timeout, **fields) as gen:
            for event in gen:
                if on_progress is not None and isinstance(event, Progress):
                    on_progress(event)
            return gen.result()

    def generate_sync(self, prompt: str, *, timeout: float | None = None, **fields: Any) -> GenerationResult:
        """One unary call (GenerateSync): the whole MP4 in one response, no progress."""
        try:
            r = self.stub.GenerateSync(build_request(prompt, **fields), timeout=self._timeout(timeout))
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None
        return GenerationResult(request_id=r.done.request_id, accepted=_accepted(r.accepted), mp4=r.mp4, path=None,
                                mp4_bytes=len(r.mp4), sha256=r.done.sha256, timings=dict(r.done.timings))

    def validate(self, prompt: str, *, timeout: float | None = 30.0, **fields: Any) -> Accepted:
        """Validate and align a request without generating (raises RequestError naming the field)."""
        try:
            for ev in self.stub.Generate(build_request(prompt, validate_only=True, **fields), timeout=timeout):
                if ev.WhichOneof("event") == "accepted":
                    return _accepted(ev.accepted)
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None
        raise StageFailed("gateway", "no answer to a validation")

    def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> bool:
        """Cancel a request by id (e.g. from another process); True if it was queued or running."""
        try:
            return self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=timeout).cancelled
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None

    def info(self, *, timeout: float | None = 10.0) -> dict:
        try:
            return MessageToDict(self.stub.Info(gateway_pb2.InfoRequest(), timeout=timeout),
                                 preserving_proto_field_name=True)
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the gateway's health check says SERVING (every stage ready)."""
        if not wait_serving(self.target, timeout):
            raise StageUnavailable("gateway", f"not SERVING within {timeout:g}s")


class AsyncGeneration:
    """The asyncio twin of `Generation`: `async for event in gen`, `await gen.result()`, `gen.cancel()`."""

    def __init__(self, call, output=None):
        self._call = call
        self._collector = _Collector(output)
        self._cancelled = False
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self.accepted: Accepted | None = None
        self._events = self._run()

    @property
    def request_id(self) -> str | None:
        return self.accepted.request_id if self.accepted else None

    async def _run(self) -> AsyncIterator[Accepted | Progress]:
        try:
            async for ev in self._call:
                kind = ev.WhichOneof("event")
                if kind == "accepted":
                    self.accepted = _accepted(ev.accepted)
                    yield self.accepted
                elif kind == "progress":
                    yield _progress(ev.progress)
                elif kind == "mp4":
                    self._collector.write(ev.mp4.offset, ev.mp4.data)
                elif kind == "done":
                    self._result = self._collector.finish(ev.done, self.accepted)
            if self._result is None:
                raise StageFailed("gateway", "the stream ended without a result")
        except asyncio.CancelledError:
            self._cancelled = True
            self._call.cancel()
            self._collector.abort()
            raise
        except grpc.RpcError as err:
            self._collector.abort()
            self._error = from_grpc(err, stage="gateway", cancelled=self._cancelled)
            raise self._error from None
        except BaseException as exc:
            self._collector.abort()
            self._error = exc
            raise

    def __aiter__(self) -> AsyncIterator[Accepted | Progress]:
        return self._events

    async def result(self) -> GenerationResult:
        async for _ in self._events:
            pass
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        if self._result is None and self._error is None:
            self._cancelled = True
            self._call.cancel()

    async def __aenter__(self) -> "AsyncGeneration":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncClient:
    """asyncio gateway client (grpc.aio); the same methods as `Client`, as coroutines."""

    def __init__(self, target: str, *, timeout: float | None = None, credentials: grpc.ChannelCredentials | None = None,
                 options: list | None = None, api_key: str | None = None):
        opts = channel_options(MAX_RECEIVE) + list(options or [])
        self.target = target
        self.timeout = timeout
        metadata = _key_metadata(api_key)
        interceptors = [_AsyncWithKey(metadata)] if metadata else None
        self.channel = aio.secure_channel(target, credentials, opts, interceptors=interceptors) if credentials else \
            aio.insecure_channel(target, opts, interceptors=interceptors)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str, *, output: str | os.PathLike | None = None, timeout: float | None = None,
               **fields: Any) -> AsyncGeneration:
        check_output(output)
        call = self.stub.Generate(build_request(prompt, **fields), timeout=self._timeout(timeout))
        return AsyncGeneration(call, output)

    async def generate(self, prompt: str, *, output: str | os.PathLike | None = None, timeout: float | None = None,
                       on_progress: Callable[[Progress], Any] | None = None, **fields: Any) -> GenerationResult:
        gen = self.stream(prompt, output=output, timeout=timeout, **fields)
        try:
            async for event in gen:
                if on_progress is not None and isinstance(event, Progress):
                    out = on_progress(event)
                    if inspect.isawaitable(out):
                        await out
            return await gen.result()
        finally:
            gen.cancel()

    async def generate_sync(self, prompt: str, *, timeout: float | None = None, **fields: Any) -> GenerationResult:
        try:
            r = await self.stub.GenerateSync(build_request(prompt, **fields), timeout=self._timeout(timeout))
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None
        return GenerationResult(request_id=r.done.request_id, accepted=_accepted(r.accepted), mp4=r.mp4, path=None,
                                mp4_bytes=len(r.mp4), sha256=r.done.sha256, timings=dict(r.done.timings))

    async def validate(self, prompt: str, *, timeout: float | None = 30.0, **fields: Any) -> Accepted:
        try:
            async for ev in self.stub.Generate(build_request(prompt, validate_only=True, **fields), timeout=timeout):
                if ev.WhichOneof("event") == "accepted":
                    return _accepted(ev.accepted)
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None
        raise StageFailed("gateway", "no answer to a validation")

    async def cancel(self, request_id: str, *, timeout: float | None = 10.0) -> bool:
        try:
            r = await self.stub.Cancel(gateway_pb2.CancelRequest(request_id=request_id), timeout=timeout)
        except grpc.RpcError as err:
            raise from_grpc(err, stage="gateway") from None
        return r.cancelled
