"""A NIXL stream over a gRPC `Control` call, both ends, for any edge between two stages.

The producer calls the consumer's bidi `Control` RPC; each request and response message carries one control-pipe
message in its `data` field (the producer's first request names the consumer's session). The consumer answers
with a `NixlReceiver`'s handshake, the producer's `NixlSender` connects, and the bytes move by NIXL WRITEs into the
consumer's pool, or inline on the same call when NIXL cannot be used on either side (chosen "grpc", with the
reason). The servicers pass in how to wrap their own proto messages, so nothing here knows a model.

    producer (e.g. the DiT)                                   consumer (e.g. the VAE), in its Control handler
    tx = ControlSender(edge, stub.Control, first, wrap, scope)    rx = ControlReceiver(edge, first.data,
    tx.send(name, tensor, scope) ...                                       (m.data for m in requests), context, ...)
    tail_s = tx.finish(scope)      # or tx.abort() on failure     yield from rx.serve(work, wrap)
                                                                  # work() iterates rx.messages() on a thread

Every wait is bounded by the request's deadline and `WAIT_S`. A broken stream raises what the other stage said
when it ended the call with an error, else `StageUnavailable` naming it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Iterator

import grpc
import torch

from h3serve.config.vocab import NIXL
from h3serve.errors import MalformedStream, RequestError, StageFailed, StageUnavailable, TransportError
from h3serve.errortable import from_grpc
from h3serve.transport.base import Message
from h3serve.transport.nixl.receiver import NixlReceiver
from h3serve.transport.nixl.sender import NixlSender
from h3serve.transport.pipes import QueuePipe

# The edges that run over Control, "<producer>-><consumer>"
LATENTS_EDGE = "dit->vae"
FRAMES_EDGE = "vae->muxer"

WAIT_S = 60.0           # longest single wait of a NIXL stream (bounded by the request's deadline too)
CONNECT_S = 10.0        # NIXL connect probe


def wait_s(left: float | None, cap: float = WAIT_S) -> float:
    """One wait of a stream whose request has `left` seconds (None: no deadline)."""
    return cap if left is None else max(0.1, min(cap, left))


def peer_error(exc: BaseException, stage: str) -> BaseException:
    """The domain error for a stream call `stage` failed. Its INVALID_ARGUMENT refuses what this process sent (the
    tensors it produced), not the end caller's request: a stage failure naming `stage`, never a 400."""
    err = from_grpc(exc, stage=stage)
    if isinstance(err, RequestError):
        return StageFailed(stage, f"refused the stream it was sent: {err}")
    return err


def call_error(call, stage: str, wait: float = 2.0) -> BaseException | None:
    """What `stage` said when it ended `call` with an error (waits up to `wait` s for the call to end)."""
    end = time.monotonic() + wait
    while not call.done() and time.monotonic() < end:
        time.sleep(0.01)
    if call.done() and not call.cancelled():
        exc = call.exception()
        if exc is not None:
            return peer_error(exc, stage)
    return None


def _ends(edge: str) -> tuple[str, str]:
    producer, _, consumer = edge.partition("->")
    return producer, consumer


class ControlUnavailable(StageUnavailable):
    """The consumer does not answer `Control` (an older replica)."""


class ControlSender:
    """The producing end. `control(requests, timeout=...)` starts the call (a stub's `Control`); `first` is its
    first request; `wrap(data)` makes a request carrying one control-pipe message. Construction waits for the
    consumer's handshake and connects; then `send` in order, `finish` (or `abort`); `info` is the edge's
    {edge, requested, chosen, reason}.

    `transport` is what this process can use ("grpc": NIXL is not usable here, `local_reason` says why, and the
    bytes go inline on the call)."""

    def __init__(self, edge: str, control: Callable[..., Iterator[Any]], first: Any, wrap: Callable[[bytes], Any],
                 scope, *, transport: str = NIXL, local_reason: str = "",
                 staging_device: str | torch.device = "cpu"):
        self.edge = edge
        self.producer, self.consumer = _ends(edge)
        self.local_reason = local_reason
        self.pipe = pipe = QueuePipe()

        def requests():
            yield first
            for data in pipe.outgoing():
                yield wrap(data)

        self.call = control(requests(), timeout=scope.remaining())
        self.pump = pipe.pump(m.data for m in self.call)
        self.tx: NixlSender | None = None
        try:
            try:
                handshake = pipe.recv(wait_s(scope.remaining()))
            except (TimeoutError, EOFError) as e:
                err = call_error(self.call, self.consumer)
                if self.call.done() and not self.call.cancelled() and \
                        self.call.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise ControlUnavailable(self.consumer, "Control is not implemented by this replica") from None
                if err is not None:
                    raise err from None
                raise StageUnavailable(self.consumer, f"no NIXL handshake on {edge}: {e}") from None
            wait = wait_s(scope.remaining())
            self.tx = NixlSender(edge, pipe, timeout=wait, connect_timeout=min(CONNECT_S, wait), transport=transport,
                                 staging_device=staging_device)
            self._guarded(scope, "while connecting", self.tx.connect, handshake)
        except BaseException:
            self.abort()
            raise

    @property
    def info(self) -> dict:
        info = {"edge": self.edge, **self.tx.transport_info, "requested": NIXL}
        if self.tx.requested != NIXL:   # this side could not use NIXL: say why (not the pipe's "requested")
            info["reason"] = self.local_reason
        return info

    def send(self, name: str, tensor: torch.Tensor | None, scope, meta: dict | None = None) -> None:
        self._guarded(scope, "while sending", self.tx.send, name, tensor, meta, timeout=wait_s(scope.remaining()))

    def finish(self, scope) -> float:
        """End of stream; returns the seconds from the last byte to the end of the call (the consumer ends it once
        it has finished with the stream, e.g. closed the MP4)."""
        self._guarded(scope, "while closing", self.tx.close, timeout=wait_s(scope.remaining()))
        t = time.perf_counter()
        self.pipe.close()                # half-close: the consumer ends the call
        self.pump.join(scope.remaining())
        if self.pump.is_alive():
            raise StageUnavailable(self.consumer, f"the {self.edge} call did not end within the deadline")
        err = call_error(self.call, self.consumer, wait=0.0)
        if err is not None:
            raise err
        return time.perf_counter() - t

    def abort(self) -> None:
        if self.tx is not None:
            self.tx.abort(f"the {self.producer} gave up on the request")
        self.pipe.close()
        self.call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            self.abort()

    def _guarded(self, scope, where: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except TransportError as e:
            scope.check(where)
            err = call_error(self.call, self.consumer)
            if err is not None:
                raise err from None
            raise StageUnavailable(self.consumer, f"the {self.edge} stream broke: {e}") from None


class ControlReceiver:
    """The consuming end, inside a `Control` handler: `first_data` is the first request's data (may be empty),
    `incoming` the data of the requests after it, `context` the call's. `messages()` registers the pool
    (`pool_buffers` x `buffer_bytes`, views of it with `zero_copy`), sends the handshake and yields the stream's
    messages; a broken stream raises `StageUnavailable` naming the producer. `info` is the edge's
    {edge, requested, chosen, reason} once the stream ended. `transport`: what this process can use."""

    def __init__(self, edge: str, first_data: bytes, incoming: Iterable[bytes], context, *, transport: str,
                 pool_buffers: int, buffer_bytes: int, zero_copy: bool = False):
        self.edge = edge
        self.producer, _ = _ends(edge)
        self.context = context
        self.transport = transport
        self._pool = {"pool_buffers": pool_buffers, "buffer_bytes": buffer_bytes, "zero_copy": zero_copy}
        self.info: dict | None = None
        self.pipe = QueuePipe()
        if first_data:
            self.pipe.feed(first_data)
        self.pipe.pump(incoming)
        context.add_callback(lambda: self.pipe.feed_eof("gRPC call ended"))

    def _wait(self) -> float:
        return wait_s(self.context.time_remaining())

    def messages(self) -> Iterator[Message]:
        try:
            with NixlReceiver(self.edge, self.pipe, transport=self.transport, timeout=self._wait(),
                              **self._pool) as rx:
                try:
                    self.pipe.send(rx.handshake(), timeout=self._wait())
                except (EOFError, TimeoutError) as exc:
                    raise TransportError(f"the stream ended before the handshake ({exc})", edge=self.edge) from None
                while (msg := rx.recv(timeout=self._wait())) is not None:
                    yield msg
                self.info = {"edge": self.edge, **rx.transport_info, "requested": NIXL}
        except MalformedStream as exc:   # the producer's message broke the protocol: its bad input
            raise RequestError(exc.field, exc.value, str(exc)) from None
        except TransportError as exc:   # the producer died, gave up, or stalled past the timeout
            raise StageUnavailable(self.producer, f"the {self.edge} stream (nixl) broke: {exc}") from None

    def serve(self, work: Callable[[], None], wrap: Callable[[bytes], Any]) -> Iterator[Any]:
        """Run `work` (which iterates `messages()`) on a thread of its own; yield the control-pipe messages for the
        producer wrapped as the call's responses until `work` has returned; then raise what it raised."""
        outcome: dict[str, BaseException] = {}

        def run():
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised on the handler's thread below
                outcome["error"] = exc
            finally:
                self.pipe.close()        # ends the response stream

        worker = threading.Thread(target=run, daemon=True, name=f"h3serve-control-{self.edge}")
        worker.start()
        for data in self.pipe.outgoing():
            yield wrap(data)
        worker.join(5.0)
        if "error" in outcome:
            raise outcome["error"]
