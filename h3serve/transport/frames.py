"""Where the VAE's frames and PCM go: a muxer session, over one of two paths.

* `PushSink` (transport `grpc`, and the fallback of `nixl`): `Muxer.Push`, the bytes inside the gRPC stream as
  `TensorChunk`s of at most 4 MiB, y/u/v planes as three messages.
* `NixlSink` (transport `nixl`): a `ControlSender` on `Muxer.Control`; each clip's yuv420p planes are packed into
  one message ("yuv", meta {"n": frames}) and written by NIXL into a slot of the pool the muxer registered for the
  session, where the muxer wraps them without a copy. At most K clips are in flight; a slow muxer blocks `send`
  (and so the decode) instead of growing memory. If the NIXL connection cannot be made, the sender carries the
  bytes inline on the same stream (chosen "grpc", with the reason).

Both: `send(name, tensor, scope)`, `finish(scope) -> seconds from the last byte to the muxer's MP4`, `abort()`,
`info` = {edge, requested, chosen, reason}. `open_sink` picks one from what the muxer offered for the session
(`session_offer`, in its OpenSession response). A broken stream raises `StageUnavailable` naming the muxer (or what
the muxer said, when it ended the call with an error).
"""

from __future__ import annotations

import json
import logging
import time

import torch

from h3serve._proto import muxer_pb2
from h3serve.config.vocab import GRPC, NIXL
from h3serve.errors import StageUnavailable, TransportError
from h3serve.transport.control import FRAMES_EDGE, ControlSender, ControlUnavailable, call_error, peer_error
from h3serve.transport.grpc import CHUNK_BYTES, GrpcStreamSender
from h3serve.transport.nixl.probe import count

log = logging.getLogger(__name__)

SEND_DEPTH = 4          # gRPC frame messages the VAE may run ahead of the muxer (<= 16 MiB in flight)


def session_offer(chosen: str, reason: str) -> bytes:
    """What a muxer replica offers a `nixl` session (its OpenSession transport_metadata): NIXL, or why not."""
    offer = chosen == NIXL
    return json.dumps({"nixl": offer, "reason": reason if offer else f"muxer: {reason}"}).encode()


def _push_message(chunk=None, end=None):
    return muxer_pb2.PushMessage(chunk=chunk) if chunk is not None else muxer_pb2.PushMessage(end=end)


class PushSink:
    """Frames + PCM inside a `Muxer.Push` stream."""

    whole_clips = False                  # clips cut into messages of <= 4 MiB
    pcm_chunk_bytes = CHUNK_BYTES

    def __init__(self, stub, session_id: str, scope, info: dict):
        self.info = info
        fallback = info["requested"] != info["chosen"]
        self.sender = GrpcStreamSender(
            _push_message, depth=SEND_DEPTH, edge=FRAMES_EDGE,
            first=muxer_pb2.PushMessage(open=muxer_pb2.PushOpen(
                session_id=session_id, transport=GRPC,
                transport_metadata=info["reason"].encode() if fallback else b"")))
        self.push = stub.Push.future(self.sender.requests(), timeout=scope.remaining())
        self.sender.attach(self.push)

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
            raise peer_error(exc, "muxer") from None
        return time.perf_counter() - t

    def abort(self) -> None:
        self.sender.abort()
        self.push.cancel()

    def _raise_push_error(self) -> None:
        """If the muxer ended the Push call, raise what it said (with the muxer named)."""
        err = call_error(self.push, "muxer", wait=0.0)
        if err is not None:
            raise err from None
        raise StageUnavailable("muxer", "the frame stream broke")


class NixlSink:
    """Frames + PCM by NIXL into the muxer session's pool; `Muxer.Control` carries the control pipe."""

    whole_clips = True                   # one message per clip (a slot holds a clip)
    pcm_chunk_bytes = 1 << 62            # PCM in one message (split into slot-sized parts by the sender if needed)

    def __init__(self, stub, session_id: str, scope, staging_device: str = "cpu"):
        self.stream = ControlSender(FRAMES_EDGE, stub.Control,
                                    muxer_pb2.ControlMessage(session_id=session_id, transport=NIXL),
                                    lambda data: muxer_pb2.ControlMessage(data=data), scope,
                                    staging_device=staging_device)
        self._planes: dict = {}

    @property
    def info(self) -> dict:
        return self.stream.info

    def send(self, name: str, tensor, scope, meta: dict | None = None) -> None:
        if name in ("y", "u"):
            self._planes[name] = tensor
            return
        if name == "v":   # one clip of planes -> one message, so the muxer can wrap them in place
            y, u = self._planes.pop("y"), self._planes.pop("u")
            n = int(y.shape[0])
            tensor = torch.cat([y.reshape(-1), u.reshape(-1), tensor.reshape(-1)])
            name, meta = "yuv", {"n": n}
        self.stream.send(name, tensor, scope, meta)

    def finish(self, scope) -> float:
        return self.stream.finish(scope)

    def abort(self) -> None:
        self.stream.abort()


def open_sink(stub, sink, scope, *, transport: str, reason: str, warned: set[str]) -> PushSink | NixlSink:
    """The path to the muxer session `sink` (a common_pb2.Sink) for one request. `transport`, `reason`: what this
    process can use; `warned`: fallback reasons already logged (each is logged once)."""
    requested = sink.transport or GRPC
    if requested != NIXL:
        return PushSink(stub, sink.session_id, scope,
                        {"edge": FRAMES_EDGE, "requested": requested, "chosen": requested, "reason": "requested"})
    try:
        offer = json.loads(sink.transport_metadata or b"{}")
    except ValueError:
        offer = {}
    if transport != NIXL:
        why = f"vae: {reason}"
    elif not offer.get("nixl"):
        why = offer.get("reason") or "muxer: NIXL not offered for the session"
    else:
        try:
            return NixlSink(stub, sink.session_id, scope, staging_device="cpu")   # CUDA frames: pinned D2H staging
        except ControlUnavailable as e:
            why = str(e)
    if why not in warned:
        warned.add(why)
        log.warning("%s: transport nixl requested, using grpc (Push): %s", FRAMES_EDGE, why)
    count("fallbacks_total")
    return PushSink(stub, sink.session_id, scope, {"edge": FRAMES_EDGE, "requested": NIXL, "chosen": GRPC,
                                                   "reason": why})
