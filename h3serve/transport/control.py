"""Where the VAE's frames and PCM go: a muxer session, over one of two paths.

* `PushSink` (transport `grpc`, and the fallback of `nixl`): `Muxer.Push`, the bytes inside the gRPC stream as
  `TensorChunk`s of at most 4 MiB, y/u/v planes as three messages.
* `NixlSink` (transport `nixl`): `Muxer.Control` is the control pipe of a `NixlSender`; each clip's yuv420p planes
  are packed into one message ("yuv", meta {"n": frames}) and written by NIXL into a slot of the pool the muxer
  registered for the session, where the muxer wraps them without a copy. At most K clips are in flight; a slow
  muxer blocks `send` (and so the decode) instead of growing memory. If the NIXL connection cannot be made, the
  sender carries the bytes inline on the same stream (chosen "grpc", with the reason).

Both: `send(name, tensor, scope)`, `finish(scope) -> seconds from the last byte to the muxer's MP4`, `abort()`,
`info` = {edge, requested, chosen, reason}. Every wait is bounded by the request's deadline and `WAIT_S`; a broken
stream raises `StageUnavailable` naming the muxer (or what the muxer said, when it ended the call with an error).
"""

from __future__ import annotations

import logging
import time

import torch

from h3serve.errortable import StageUnavailable, from_grpc
from h3serve.transport.base import TransportError
from h3serve.transport.grpc import CHUNK_BYTES, GrpcStreamSender, make_sender

log = logging.getLogger("h3serve.vae")

EDGE = "vae->muxer"
SEND_DEPTH = 4          # gRPC frame messages the VAE may run ahead of the muxer (<= 16 MiB in flight)
WAIT_S = 60.0           # longest single wait of a NIXL stream (bounded by the request's deadline too)
CONNECT_S = 10.0        # NIXL connect probe


def wait_s(scope, cap: float = WAIT_S) -> float:
    left = scope.remaining()
    return cap if left is None else max(0.1, min(cap, left))


def _push_message(chunk=None, end=None):
    from h3serve._proto import muxer_pb2

    return muxer_pb2.PushMessage(chunk=chunk) if chunk is not None else muxer_pb2.PushMessage(end=end)


def _call_error(call, wait: float = 2.0) -> BaseException | None:
    """What the muxer said when it ended `call` with an error (waits up to `wait` s for the call to end)."""
    end = time.monotonic() + wait
    while not call.done() and time.monotonic() < end:
        time.sleep(0.01)
    if call.done() and not call.cancelled():
        exc = call.exception()
        if exc is not None:
            return from_grpc(exc, stage="muxer")
    return None


class PushSink:
    """Frames + PCM inside a `Muxer.Push` stream."""

    whole_clips = False                  # clips cut into messages of <= 4 MiB
    pcm_chunk_bytes = CHUNK_BYTES

    def __init__(self, stub, session_id: str, scope, info: dict, transport: str = "grpc",
                 transport_metadata: bytes = b""):
        from h3serve._proto import muxer_pb2

        self.info = info
        fallback = info["requested"] != info["chosen"]
        self.control = GrpcStreamSender(
            _push_message, depth=SEND_DEPTH, edge=EDGE,
            first=muxer_pb2.PushMessage(open=muxer_pb2.PushOpen(
                session_id=session_id, transport=transport,
                transport_metadata=info["reason"].encode() if fallback else b"")))
        self.push = stub.Push.future(self.control.requests(), timeout=scope.remaining())
        self.control.attach(self.push)
        try:
            self.sender = make_sender(transport, self.control, transport_metadata)
        except BaseException:
            self.abort()
            raise

    def send(self, name: str, tensor, scope, meta: dict | None = None) -> None:
        try:
            self.sender.send(name, tensor, timeout=scope.remaining())
        except TransportError:
            scope.check("while sending")
            self._raise_push_error()
            raise

    def finish(self, scope) -> float:
        try:
            self.sender.close(timeout=scope.remaining())
        except TransportError:
            self._raise_push_error()
            raise
        t = time.perf_counter()
        try:
            self.push.result()
        except Exception as exc:  # noqa: BLE001 - grpc.RpcError
            raise from_grpc(exc, stage="muxer") from None
        return time.perf_counter() - t

    def abort(self) -> None:
        self.control.abort()
        self.push.cancel()

    def _raise_push_error(self) -> None:
        """If the muxer ended the Push call, raise what it said (with the muxer named)."""
        if self.push.done() and not self.push.cancelled():
            exc = self.push.exception()
            if exc is not None:
                raise from_grpc(exc, stage="muxer") from None
        raise StageUnavailable("muxer", "the frame stream broke")


class ControlUnavailable(Exception):
    """The muxer does not answer `Control` (an older replica): use Push."""


class NixlSink:
    """Frames + PCM by NIXL into the muxer session's pool; `Muxer.Control` carries the control pipe."""

    whole_clips = True                   # one message per clip (a slot holds a clip)
    pcm_chunk_bytes = 1 << 62            # PCM in one message (split into slot-sized parts by the sender if needed)

    def __init__(self, stub, session_id: str, scope, staging_device: str = "cpu"):
        import grpc

        from h3serve._proto import muxer_pb2
        from h3serve.transport.nixl import NixlSender, QueuePipe

        self.pipe = pipe = QueuePipe()
        first = muxer_pb2.ControlMessage(session_id=session_id, transport="nixl")

        def requests():
            yield first
            for data in pipe.outgoing():
                yield muxer_pb2.ControlMessage(data=data)

        self.call = stub.Control(requests(), timeout=scope.remaining())
        self.pump = pipe.pump(m.data for m in self.call)
        self.tx = None
        self._planes: dict = {}
        try:
            try:
                handshake = pipe.recv(wait_s(scope))
            except (TimeoutError, EOFError) as e:
                err = _call_error(self.call)
                if self.call.done() and not self.call.cancelled() and \
                        self.call.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise ControlUnavailable("muxer: Control is not implemented by this replica") from None
                if err is not None:
                    raise err from None
                raise StageUnavailable("muxer", f"no NIXL handshake on {EDGE}: {e}") from None
            self.tx = NixlSender(EDGE, pipe, timeout=wait_s(scope), connect_timeout=min(CONNECT_S, wait_s(scope)),
                                 staging_device=staging_device)
            try:
                self.tx.connect(handshake)
            except TransportError:
                self._raise_call_error()
                raise
        except BaseException:
            self.abort()
            raise
        self.info = {"edge": EDGE, **self.tx.transport_info}

    def send(self, name: str, tensor, scope, meta: dict | None = None) -> None:
        if name in ("y", "u"):
            self._planes[name] = tensor
            return
        if name == "v":   # one clip of planes -> one message, so the muxer can wrap them in place
            y, u = self._planes.pop("y"), self._planes.pop("u")
            n = int(y.shape[0])
            tensor = torch.cat([y.reshape(-1), u.reshape(-1), tensor.reshape(-1)])
            name, meta = "yuv", {"n": n}
        try:
            self.tx.send(name, tensor, meta, timeout=wait_s(scope))
        except TransportError:
            scope.check("while sending")
            self._raise_call_error()
            raise

    def finish(self, scope) -> float:
        try:
            self.tx.close(timeout=wait_s(scope))
        except TransportError:
            self._raise_call_error()
            raise
        t = time.perf_counter()
        self.pipe.close()                # half-close: the muxer ends the call once the MP4 is closed
        self.pump.join(scope.remaining())
        if self.pump.is_alive():
            raise StageUnavailable("muxer", f"the MP4 was not closed within the deadline ({EDGE})")
        err = _call_error(self.call, wait=0.0)
        if err is not None:
            raise err
        self.info = {"edge": EDGE, **self.tx.transport_info}
        return time.perf_counter() - t

    def abort(self) -> None:
        if self.tx is not None:
            self.tx.abort("the VAE gave up on the request")
        self.pipe.close()
        self.call.cancel()

    def _raise_call_error(self) -> None:
        err = _call_error(self.call)
        if err is not None:
            raise err from None
