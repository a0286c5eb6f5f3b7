"""Muxer stage server: a thin gRPC adapter over `Mp4Writer`, organised in sessions.

    gateway: OpenSession(geometry) -> session id + this replica's address
    vae:     Push(open, frames..., pcm..., end)   encoded as the chunks arrive; returns when the MP4 is closed
    gateway: Fetch(session id) -> the MP4 in chunks of at most 4 MiB; the file is deleted afterwards

A reader thread drains the network stream into a short queue while the handler thread encodes, so receiving the
next clip overlaps encoding this one. A Push stream that ends without its end marker (the VAE died or was
cancelled) fails the session; Fetch then reports the VAE as unavailable. Unfetched sessions expire after their TTL.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from h3serve.errors import MediaError, RequestError
from h3serve.errortable import NotFound, StageUnavailable, grpc_method
from h3serve.serve import StageBase, StageConfig
from h3serve.transport.base import TransportError
from h3serve.transport.grpc import CHUNK_BYTES, GrpcStreamReceiver, handshake, make_receiver, receiver_metadata

log = logging.getLogger("h3serve.muxer")

RECEIVE_DEPTH = 4    # messages buffered between the network reader and the encoder (<= 16 MiB)


def _unwrap(msg):
    kind = msg.WhichOneof("item")
    return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)


@dataclass
class Session:
    id: str
    request_id: str
    width: int
    height: int
    fps: int
    sample_rate: int
    channels: int
    expected_frames: int
    transport: str
    ttl_s: float
    path: str
    created: float = field(default_factory=time.monotonic)
    state: str = "open"      # open | pushing | done | failed | aborted
    error: BaseException | None = None
    result: object = None
    done: threading.Event = field(default_factory=threading.Event)

    def fail(self, exc: BaseException, state: str = "failed") -> None:
        if self.state not in ("done",):
            self.state, self.error = state, exc
        self.done.set()


class MuxerServicer(StageBase):
    stage = "muxer"

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.sessions: dict[str, Session] = {}
        self.sessions_lock = threading.Lock()
        self.tmp_dir = config.tmp_dir or tempfile.mkdtemp(prefix="h3serve-mux-")
        self._own_tmp = config.tmp_dir is None
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._sweeper = threading.Thread(target=self._sweep, name="h3serve-mux-sweeper", daemon=True)
        self.writer_options = dict(crf=config.crf, preset=config.preset, threads=config.mux_threads)

    def register(self, server) -> None:
        from h3serve._proto import muxer_pb2_grpc

        muxer_pb2_grpc.add_MuxerServicer_to_server(self, server)

    def load(self) -> None:
        import io

        import numpy as np

        from h3serve.services.muxer.mux import Mp4Writer

        if self.config.warmup:   # PyAV, x264 and AAC present and working
            with Mp4Writer(io.BytesIO(), 64, 64, tmp_dir=self.tmp_dir, **self.writer_options) as writer:
                writer.add_frames(np.zeros((2, 64, 64, 3), np.uint8))
                writer.add_audio(np.zeros((2, 2048), np.float32))
        self._sweeper.start()

    def close(self) -> None:
        super().close()
        with self.sessions_lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            s.fail(StageUnavailable("muxer", "shutting down"), "aborted")
            _unlink(s.path)
        if self._own_tmp:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def busy(self) -> bool:
        return bool(self.active) or any(s.state in ("open", "pushing") or (s.state == "done" and
                                                                         os.path.exists(s.path))
                                        for s in list(self.sessions.values()))

    def info(self) -> dict:
        return {**super().info(), "sessions": len(self.sessions), "writer": self.writer_options}

    def _sweep(self) -> None:
        while not self.stopping.wait(1.0):
            now = time.monotonic()
            with self.sessions_lock:
                expired = [s for s in self.sessions.values() if now - s.created > s.ttl_s]
                for s in expired:
                    del self.sessions[s.id]
            for s in expired:
                log.warning("session %s (request %s) expired after %.0fs in state %s", s.id, s.request_id,
                            s.ttl_s, s.state)
                s.fail(NotFound(f"muxer: session {s.id} expired"), "aborted")
                _unlink(s.path)

    def _get(self, session_id: str) -> Session:
        with self.sessions_lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"muxer: no session {session_id!r} (unknown, expired or already fetched)", stage="muxer")
        return session

    # -- RPCs -----------------------------------------------------------------------------------------------
    @grpc_method("muxer")
    def OpenSession(self, request, context):
        from h3serve._proto import muxer_pb2

        r = request
        for name, value, lo, hi in (("width", r.width, 2, 8192), ("height", r.height, 2, 8192),
                                    ("fps", r.fps, 1, 240), ("sample_rate", r.sample_rate, 8000, 192000),
                                    ("channels", r.channels, 1, 2)):
            if not lo <= value <= hi:
                raise RequestError(name, value, f"an integer in [{lo}, {hi}]")
        if r.width % 2 or r.height % 2:
            raise RequestError("width" if r.width % 2 else "height", r.width if r.width % 2 else r.height,
                               "even (yuv420p)")
        transport = r.transport or "grpc"
        sid = secrets.token_hex(12)
        metadata = receiver_metadata(transport, sid)
        session = Session(id=sid, request_id=r.request_id, width=r.width, height=r.height, fps=r.fps,
                          sample_rate=r.sample_rate, channels=r.channels, expected_frames=r.expected_frames,
                          transport=transport, ttl_s=r.ttl_s if r.ttl_s > 0 else self.config.session_ttl_s,
                          path=os.path.join(self.tmp_dir, f"{sid}.mp4"))
        with self.sessions_lock:
            self.sessions[sid] = session
        return muxer_pb2.OpenSessionResponse(session_id=sid, address=self.config.address,
                                             transport_metadata=metadata, max_chunk_bytes=CHUNK_BYTES)

    @grpc_method("muxer")
    def Handshake(self, request, context):
        from h3serve._proto import common_pb2

        self._get(request.session_id)
        md = handshake(request.transport, request.session_id, request.transport_metadata)
        return common_pb2.TransportHandshake(transport=request.transport, session_id=request.session_id,
                                             transport_metadata=md)

    @grpc_method("muxer")
    def Push(self, request_iterator, context):
        from h3serve._proto import muxer_pb2
        from h3serve.services.muxer.mux import Mp4Writer

        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "open":
            raise RequestError("open", None, "the first message of a Push stream names the session")
        session = self._get(first.open.session_id)
        with self.sessions_lock:
            if session.state != "open":
                raise RequestError("session_id", session.id, f"a session that is open, not {session.state}")
            session.state = "pushing"
        scope = self.scope(context, session.request_id)
        writer = None
        try:
            control = GrpcStreamReceiver(request_iterator, _unwrap, edge="vae->muxer")
            receiver = make_receiver(first.open.transport or session.transport, control, session.id)
            inbox: queue.Queue = queue.Queue(maxsize=RECEIVE_DEPTH)
            reader = threading.Thread(target=_read_into, args=(receiver, inbox, scope), daemon=True,
                                      name=f"h3serve-mux-read-{session.id[:6]}")
            reader.start()
            planes: dict = {}
            writer = Mp4Writer(session.path, session.width, session.height, fps=session.fps,
                               sample_rate=session.sample_rate, channels=session.channels, **self.writer_options)
            while True:
                try:
                    item = inbox.get(timeout=0.1)
                except queue.Empty:
                    if session.state == "aborted":
                        raise session.error or StageUnavailable("muxer", "session aborted")
                    scope.check("while receiving")
                    continue
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                if session.state == "aborted":
                    raise session.error or StageUnavailable("muxer", "session aborted")
                name = item.header.name if item.header else ""
                if name == "frames":
                    writer.add_frames(item.tensor.numpy())
                    scope.unit_done()
                elif name in ("y", "u", "v"):
                    planes[name] = item.tensor.numpy()
                    if name == "v":
                        if set(planes) != {"y", "u", "v"}:
                            raise RequestError("chunk", name, "planes in the order y, u, v")
                        writer.add_yuv(planes.pop("y"), planes.pop("u"), planes.pop("v"))
                        scope.unit_done()
                elif name == "pcm":
                    writer.add_audio(item.tensor.numpy())
                else:
                    raise RequestError("chunk", name, "frames (n, H, W, 3) uint8, y/u/v planes, or pcm (C, N) "
                                                      "float32")
            t_end = time.perf_counter()
            stats = writer.close()
            if session.expected_frames and stats.frames != session.expected_frames:
                raise MediaError(f"muxer: received {stats.frames} frames, the session expects "
                                 f"{session.expected_frames}")
            result = muxer_pb2.PushResult(frames=stats.frames, audio_samples=stats.audio_samples,
                                          mp4_bytes=stats.bytes, encode_seconds=stats.encode_seconds,
                                          tail_seconds=time.perf_counter() - t_end)
            session.result = result
            session.state = "done"
            session.done.set()
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            if isinstance(exc, TransportError):   # the producer's stream broke: the VAE died or gave up
                exc = StageUnavailable("vae", f"the frame stream broke ({exc})")
            session.fail(exc if isinstance(exc, Exception) else StageUnavailable("muxer", "push interrupted"))
            self.finish(scope, exc)
            raise exc from None
        self.finish(scope)
        return result

    @grpc_method("muxer")
    def Fetch(self, request, context):
        from h3serve._proto import muxer_pb2

        session = self._get(request.session_id)
        remaining = context.time_remaining()
        end = None if remaining is None or remaining > 1e8 else time.monotonic() + remaining
        while not session.done.wait(0.1):
            if not context.is_active() or (end is not None and time.monotonic() >= end):
                return
        if session.error is not None:
            raise session.error
        total = os.path.getsize(session.path)
        with open(session.path, "rb") as f:
            offset = 0
            while True:
                data = f.read(CHUNK_BYTES)
                if not data and offset:
                    break
                yield muxer_pb2.Mp4Chunk(offset=offset, data=data, total_bytes=total,
                                         last=offset + len(data) >= total)
                offset += len(data)
                if offset >= total:
                    break
        with self.sessions_lock:
            self.sessions.pop(session.id, None)
        _unlink(session.path)

    @grpc_method("muxer")
    def Abort(self, request, context):
        from h3serve._proto import muxer_pb2

        with self.sessions_lock:
            session = self.sessions.pop(request.session_id, None)
        if session is None:
            return muxer_pb2.AbortResponse(existed=False)
        session.fail(StageUnavailable("muxer", f"session aborted: {request.reason or 'by the caller'}"), "aborted")
        if session.state != "pushing":
            _unlink(session.path)
        return muxer_pb2.AbortResponse(existed=True)

    def Control(self, request_iterator, context):
        import grpc

        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "muxer: no transport with a control pipe is plugged in (the grpc transport uses Push)")

    @grpc_method("muxer")
    def Status(self, request, context):
        return self.status()


def _read_into(receiver, inbox: queue.Queue, scope) -> None:
    """Network side of a Push: messages into `inbox`, then None (end) or the exception."""
    def put(item) -> bool:
        while not scope.cancelled.is_set():
            try:
                inbox.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for msg in receiver:
            if not put(msg):
                return
        put(None)
    except BaseException as exc:  # noqa: BLE001 - handed to the encoder thread
        put(exc)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create(config: StageConfig, health=None) -> MuxerServicer:
    return MuxerServicer(config, health)
