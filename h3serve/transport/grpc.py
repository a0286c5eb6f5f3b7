"""gRPC byte-stream transport, and the gRPC settings every h3serve server and channel shares.

A tensor crosses a gRPC stream as `TensorChunk` messages (protos/h3serve/v1/common.proto): payloads of at most
`CHUNK_BYTES` (4 MiB), the first chunk carrying dtype, shape and a small JSON `meta`. `StreamEnd` closes a stream
explicitly; a stream that stops without it means the sender died or cancelled, and the receiver raises
`TransportError` rather than taking a truncated stream for a complete one.

    sender side (client-streaming call)                 receiver side (the servicer)
    s = GrpcStreamSender(wrap, first=open_msg)          r = GrpcStreamReceiver(request_iterator, unwrap)
    fut = stub.Push.future(s.requests(), timeout=t)     for msg in r:   # Message(header, tensor, meta)
    s.attach(fut); s.send("frames", t); s.close()           ...

`send` blocks when `depth` messages wait (back-pressure from the network and the receiver), and fails at once
once the call has ended. Transport code knows no model: names, dtypes and shapes are the caller's business.

The other transport, NIXL, moves the bytes out of band and uses a gRPC bidi `Control` call as its control pipe
(h3serve.transport.control).
"""

from __future__ import annotations

import json
import queue
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from h3serve._proto import common_pb2
from h3serve.errors import MalformedStream, RequestError, SenderStopped, TransportError
from h3serve.transport.base import (
    WIRE_DTYPES,
    Message,
    TensorHeader,
    TensorReceiver,
    TensorSender,
    tensor_bytes,
    tensor_from_bytes,
)
from h3serve.transport.channel import CHUNK_BYTES

DEFAULT_DEPTH = 4                     # messages a sender may queue before send() blocks
MAX_TENSOR_BYTES = 4 << 30            # a receiver refuses a header announcing more than this


# ---------------------------------------------------------------------------------------------------------------
# Tensor <-> chunks

def iter_tensor_chunks(name: str, tensor: torch.Tensor | None, meta: dict | None = None, *,
                       chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """The `TensorChunk` messages of one tensor (one empty chunk for `tensor=None`, a control-only item)."""
    if not 0 < chunk_bytes <= CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes}")
    meta_json = json.dumps(meta, separators=(",", ":")) if meta else ""
    if tensor is None:
        yield common_pb2.TensorChunk(name=name, dtype="", offset=0, total_bytes=0, last=True, meta_json=meta_json)
        return
    header = TensorHeader.of(name, tensor)
    if tensor.numel() == 0:
        yield common_pb2.TensorChunk(name=name, dtype=header.dtype, shape=header.shape, offset=0, total_bytes=0,
                                     last=True, meta_json=meta_json)
        return
    view = tensor_bytes(tensor)
    total = len(view)
    for offset in range(0, total, chunk_bytes):
        end = min(total, offset + chunk_bytes)
        first = offset == 0
        yield common_pb2.TensorChunk(
            name=name, dtype=header.dtype if first else "", shape=header.shape if first else (), offset=offset,
            total_bytes=total if first else 0, data=bytes(view[offset:end]), last=end == total,
            meta_json=meta_json if first else "")


class TensorAssembler:
    """Rebuilds tensors from their chunks, in order; one tensor at a time (chunks of tensors never interleave)."""

    def __init__(self, *, edge: str = "", max_tensor_bytes: int = MAX_TENSOR_BYTES):
        self.edge = edge
        self.max_tensor_bytes = max_tensor_bytes
        self._header: TensorHeader | None = None
        self._meta: dict = {}
        self._buf: bytearray | None = None
        self._filled = 0
        self.tensors = 0
        self.bytes = 0

    @property
    def pending(self) -> bool:
        return self._header is not None

    def add(self, chunk: Any) -> Message | None:
        """Feed one chunk; returns the completed `Message` when this chunk completes a tensor."""
        if chunk.transport_metadata and not chunk.data and chunk.total_bytes:
            raise MalformedStream("chunk.transport_metadata", chunk.transport_metadata[:64],
                                  f"tensor {chunk.name!r} arrived out of band; this receiver speaks 'grpc' only",
                                  edge=self.edge)
        if self._header is None:
            if chunk.offset != 0:
                raise MalformedStream("chunk.offset", chunk.offset, f"tensor {chunk.name!r} starts at offset "
                                      f"{chunk.offset}, not 0", edge=self.edge)
            try:
                meta = json.loads(chunk.meta_json) if chunk.meta_json else {}
            except ValueError:
                meta = None
            if not isinstance(meta, dict):
                raise MalformedStream("chunk.meta_json", chunk.meta_json[:200],
                                      f"tensor {chunk.name!r}: meta is not a JSON object", edge=self.edge)
            if not chunk.dtype:  # control-only item
                if not chunk.last:
                    raise MalformedStream("chunk.last", chunk.last, f"control item {chunk.name!r} must be one "
                                          "chunk", edge=self.edge)
                self.tensors += 1
                return Message(None, None, meta)
            try:
                header = TensorHeader(chunk.name, chunk.dtype, tuple(int(s) for s in chunk.shape))
                nbytes = header.nbytes
            except KeyError:
                raise MalformedStream("chunk.dtype", chunk.dtype, f"tensor {chunk.name!r}: unknown dtype "
                                      f"{chunk.dtype!r} (one of {', '.join(WIRE_DTYPES)})", edge=self.edge) from None
            if any(s < 0 for s in header.shape):
                raise MalformedStream("chunk.shape", header.shape, f"tensor {chunk.name!r}: a negative "
                                      f"dimension in shape {header.shape}", edge=self.edge)
            if nbytes != chunk.total_bytes:
                raise MalformedStream("chunk.total_bytes", chunk.total_bytes, f"tensor {chunk.name!r}: shape "
                                      f"{header.shape} x {header.dtype} is {nbytes} bytes, the chunk says "
                                      f"{chunk.total_bytes}", edge=self.edge)
            if nbytes > self.max_tensor_bytes:
                raise MalformedStream("chunk.total_bytes", nbytes, f"tensor {chunk.name!r}: {nbytes} bytes "
                                      f"exceeds the limit {self.max_tensor_bytes}", edge=self.edge)
            self._header, self._meta, self._filled = header, meta, 0
            if nbytes == 0 and chunk.last:
                self._header = None
                self.tensors += 1
                return Message(header, torch.empty(header.shape, dtype=WIRE_DTYPES[header.dtype]), meta)
            if chunk.last and len(chunk.data) == nbytes:   # the common single-chunk case: no extra copy
                self._header = None
                self.tensors += 1
                self.bytes += nbytes
                return Message(header, tensor_from_bytes(header, chunk.data), meta)
            self._buf = bytearray(nbytes)
        header = self._header
        if chunk.name != header.name:
            raise MalformedStream("chunk.name", chunk.name, f"chunk of {chunk.name!r} inside tensor "
                                  f"{header.name!r}", edge=self.edge)
        if chunk.offset != self._filled:
            raise MalformedStream("chunk.offset", chunk.offset, f"tensor {header.name!r}: chunk at offset "
                                  f"{chunk.offset}, expected {self._filled}", edge=self.edge)
        end = self._filled + len(chunk.data)
        if end > len(self._buf):
            raise MalformedStream("chunk.data", len(chunk.data), f"tensor {header.name!r}: {end} bytes exceed the "
                                  f"announced {len(self._buf)}", edge=self.edge)
        self._buf[self._filled:end] = chunk.data
        self._filled = end
        if not chunk.last:
            return None
        if self._filled != len(self._buf):
            raise MalformedStream("chunk.data", self._filled, f"tensor {header.name!r} ended at {self._filled} of "
                                  f"{len(self._buf)} bytes", edge=self.edge)
        buf, meta = self._buf, self._meta
        self._header, self._buf, self._meta = None, None, {}
        self.tensors += 1
        self.bytes += len(buf)
        return Message(header, tensor_from_bytes(header, memoryview(buf)), meta)


def collect_tensors(chunks: Iterable[Any], *, edge: str = "") -> dict[str, torch.Tensor]:
    """All tensors of a finite chunk sequence, by name (a later tensor of the same name replaces the earlier)."""
    asm = TensorAssembler(edge=edge)
    out = {}
    for chunk in chunks:
        msg = asm.add(chunk)
        if msg is not None and msg.header is not None:
            out[msg.header.name] = msg.tensor
    if asm.pending:
        raise TransportError("stream ended inside a tensor", edge=edge)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Sender / receiver over one gRPC stream

_END = object()


class GrpcStreamSender(TensorSender):
    """The sending side of a client stream. Iterate `requests()` as the call's request iterator.

    wrap(chunk=None, end=None) -> the RPC's request message holding a TensorChunk or a StreamEnd.
    first: an optional message sent before any tensor (e.g. the session's `open`).
    """

    def __init__(self, wrap: Callable[..., Any], *, first: Any = None, depth: int = DEFAULT_DEPTH,
                 edge: str = "grpc", chunk_bytes: int = CHUNK_BYTES):
        self.wrap = wrap
        self.edge = edge
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._first = first
        self._call = None
        self._closed = False
        self._error: BaseException | None = None
        self.tensors = 0
        self.bytes = 0
        self.messages = 0
        self.send_seconds = 0.0   # time send() spent blocked on back-pressure

    # -- the call side ---------------------------------------------------------------------------------------
    def requests(self) -> Iterator[Any]:
        if self._first is not None:
            yield self._first
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):  # abort: stop without the end marker
                return
            yield item

    def attach(self, call: Any) -> None:
        """The call (a future or a response iterator) whose end means the stream is over."""
        self._call = call
        if hasattr(call, "add_done_callback"):
            call.add_done_callback(lambda _f: self._call_done())

    def _call_done(self) -> None:
        if not self._closed and self._error is None:
            self._error = TransportError("the receiver ended the stream", edge=self.edge)

    def fail(self, exc: BaseException) -> None:
        """Mark the stream failed (e.g. the call raised); pending and later sends raise."""
        if self._error is None:
            self._error = exc

    # -- TensorSender ----------------------------------------------------------------------------------------
    def _put(self, item: Any, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise self._error if isinstance(self._error, TransportError) else \
                    TransportError(str(self._error), edge=self.edge)
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                raise TransportError(f"receiver did not drain within {timeout}s", edge=self.edge)
            try:
                self._queue.put(item, timeout=wait)
                break
            except queue.Full:
                continue
        self.send_seconds += time.perf_counter() - t0

    def send(self, name: str, tensor: torch.Tensor | None, meta: dict | None = None, *,
             timeout: float | None = None) -> None:
        if self._closed:
            raise TransportError("send after close", edge=self.edge)
        for chunk in iter_tensor_chunks(name, tensor, meta, chunk_bytes=self.chunk_bytes):
            self._put(self.wrap(chunk=chunk), timeout)
            self.messages += 1
            self.bytes += len(chunk.data)
        self.tensors += 1

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._put(self.wrap(end=common_pb2.StreamEnd(tensors=self.tensors)), timeout)
        self._put(_END, timeout)
        self._closed = True

    def abort(self) -> None:
        """End the request stream without the end marker (the receiver treats the stream as failed)."""
        self._closed = True
        try:
            self._queue.put_nowait(TransportError("aborted", edge=self.edge))
        except queue.Full:
            # make room: the receiver must not take the queued tail for a complete stream
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._queue.put_nowait(TransportError("aborted", edge=self.edge))


class GrpcStreamReceiver(TensorReceiver):
    """The receiving side of a stream: a servicer's request iterator.

    unwrap(msg) -> ("chunk", TensorChunk) | ("end", StreamEnd) | ("other", msg); "other" messages are refused.
    A stream that breaks its protocol is the caller's bad input (RequestError naming the part); one that stops
    without its end marker raises SenderStopped; one whose caller is gone, TransportError.
    """

    def __init__(self, messages: Iterable[Any], unwrap: Callable[[Any], tuple[str, Any]], *, edge: str = "grpc",
                 max_tensor_bytes: int = MAX_TENSOR_BYTES):
        self._it = iter(messages)
        self.unwrap = unwrap
        self.edge = edge
        self.assembler = TensorAssembler(edge=edge, max_tensor_bytes=max_tensor_bytes)
        self.ended = False
        self.end_tensors: int | None = None
        self.recv_seconds = 0.0

    def recv(self, *, timeout: float | None = None) -> Message | None:
        # timeout: gRPC streams are bounded by the call's deadline instead
        if self.ended:
            return None
        t0 = time.perf_counter()
        try:
            return self._recv()
        except MalformedStream as exc:
            raise RequestError(exc.field, exc.value, str(exc)) from None
        finally:
            self.recv_seconds += time.perf_counter() - t0

    def _recv(self) -> Message | None:
        while True:
            try:
                msg = next(self._it)
            except StopIteration:
                raise SenderStopped("the sender stopped before the end of the stream", edge=self.edge) from None
            except (TransportError, RequestError):   # RequestError: a message that did not parse
                raise
            except Exception as exc:  # noqa: BLE001 - grpc.RpcError and friends: the peer is gone
                detail = exc.details() if hasattr(exc, "details") else str(exc)
                raise TransportError(f"stream broken: {detail or type(exc).__name__}", edge=self.edge) from None
            kind, item = self.unwrap(msg)
            if kind == "end":
                if self.assembler.pending:
                    raise MalformedStream("end", None, "the stream ended inside a tensor", edge=self.edge)
                if item.tensors and item.tensors != self.assembler.tensors:
                    raise MalformedStream("end.tensors", item.tensors, f"the sender sent {item.tensors} tensors, "
                                          f"{self.assembler.tensors} arrived", edge=self.edge)
                self.ended, self.end_tensors = True, int(item.tensors)
                return None
            if kind != "chunk":
                raise MalformedStream(kind, None, f"unexpected {kind} message inside a tensor stream",
                                      edge=self.edge)
            out = self.assembler.add(item)
            if out is not None:
                return out

