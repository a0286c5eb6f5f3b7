"""Muxer stage server: a thin gRPC adapter over `Mp4Writer`, organised in sessions.

    gateway: OpenSession(geometry) -> session id + this replica's address
    vae:     Push(open, frames..., pcm..., end)   encoded as the chunks arrive; returns when the MP4 is closed
             or, with --transport nixl, Control(session, control-pipe bytes...): the frames and PCM arrive by NIXL
             WRITEs into a pool this process registered, the stream carries handshake, headers, credits and end
    gateway: Fetch(session id) -> the MP4 in chunks of at most 4 MiB; the file is deleted afterwards
    gateway: Stream(session id) -> the same packets as a fragmented MP4, fragment by fragment while Push runs
             (a remux, no second encode: `h3serve/media/fragments.py`)

A reader thread drains the network stream into a short queue while the handler thread encodes, so receiving the
next clip overlaps encoding this one. A Push stream that ends without its end marker (the VAE died or was
cancelled) fails the session; Fetch then reports the VAE as unavailable. Unfetched sessions expire after their TTL
(the session table: `h3serve/services/sessions.py`).

Bounds: at most --max-sessions sessions at once, and at most --max-sessions-per-peer of them opened by one caller (by
its address: one gateway replica, or whoever else reaches the port, cannot take them all); then RESOURCE_EXHAUSTED.
A TTL of at most --max-session-ttl-s. On
SIGTERM only a Push in progress, or an MP4 finished less than FETCH_GRACE_S ago, holds the drain: a session opened
and never pushed does not.
"""

from __future__ import annotations

import io
import logging
import math
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from h3serve._proto import muxer_pb2, muxer_pb2_grpc
from h3serve.config.geometry import FRAMES_PER_CLIP, MAX_DURATION, MAX_SIDE
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import GRPC, NIXL, TRANSPORTS
from h3serve.errors import (
    Cancelled,
    RequestError,
    SenderStopped,
    StageFailed,
    StageUnavailable,
    TransportError,
)
from h3serve.errortable import grpc_method
from h3serve.media.fragments import Fmp4Tap, FragmentLog
from h3serve.media.mux import Mp4Writer
from h3serve.models.vae.yuv import rgb_to_yuv420p
from h3serve.runtime.stage import StageBase, first_message
from h3serve.runtime.tls import peer_identity
from h3serve.services.sessions import Session, SessionTable
from h3serve.transport.control import FRAMES_EDGE, ControlReceiver
from h3serve.transport.frames import session_offer
from h3serve.transport.grpc import CHUNK_BYTES, GrpcStreamReceiver
from h3serve.transport.nixl.probe import counters
from h3serve.transport.nixl.receiver import DEFAULT_SLOT_BYTES

log = logging.getLogger("h3serve.muxer")

FETCH_GRACE_S = 10.0   # a finished MP4 holds SIGTERM this long for its Fetch
RECEIVE_DEPTH = 4    # messages buffered between the network reader and the encoder (<= 16 MiB)
NIXL_SLOTS = 3       # K: clips the VAE may run ahead of the encoder over NIXL


def _unwrap(msg):
    kind = msg.WhichOneof("item")
    return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)


@dataclass(kw_only=True)
class MuxSession(Session):
    """One MP4 in the making. `state`: open | pushing (a Push or Control claimed it) | done | failed | aborted."""

    request_id: str
    width: int
    height: int
    fps: int
    sample_rate: int
    channels: int
    expected_frames: int
    transport: str
    path: str
    finished: float | None = None   # time.monotonic() when the MP4 was closed
    result: object = None
    # the frame edge as it was used for this session: {requested, chosen, reason}
    transport_info: dict | None = None
    live: FragmentLog | None = None   # the fMP4 written beside the MP4 while it is pushed


class MuxerServicer(StageBase):
    stage = "muxer"
    uses_device = False   # x264 on the host's cores

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.sessions: SessionTable[MuxSession] = SessionTable(
            "muxer", unknown_hint=" (unknown, expired or already fetched)", claimed_state="pushing",
            cap=config.media.max_sessions, cap_flag="--max-sessions",
            peer_cap=config.media.max_sessions_per_peer, peer_cap_flag="--max-sessions-per-peer")
        self.tmp_dir = config.media.tmp_dir or tempfile.mkdtemp(prefix="h3serve-mux-")
        self._own_tmp = config.media.tmp_dir is None
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._sweeper = threading.Thread(target=self._sweep, name="h3serve-mux-sweeper", daemon=True)
        self.writer_options = dict(crf=config.media.crf, preset=config.media.preset, threads=config.media.mux_threads)
        self.last_transport: dict | None = None   # the frame edge's last stream

    def register(self, server) -> None:
        muxer_pb2_grpc.add_MuxerServicer_to_server(self, server)

    def load(self) -> None:
        self.choose_transport()   # what this replica can offer on the frame edge
        if self.config.model.warmup:   # PyAV, x264 and AAC present and working
            with Mp4Writer(io.BytesIO(), 64, 64, tmp_dir=self.tmp_dir, **self.writer_options) as writer:
                writer.add_frames(tuple(np.zeros((2, s, s), np.uint8) for s in (64, 32, 32)))   # Y, U, V
                writer.add_audio(np.zeros((2, 2048), np.float32))
        self._sweeper.start()

    def close(self) -> None:
        super().close()
        for s in self.sessions.close(StageUnavailable("muxer", "shutting down")):
            _discard(s)
        if self._own_tmp:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def busy(self) -> bool:
        now = time.monotonic()
        return bool(self.active) or any(
            s.state == "pushing" or (s.state == "done" and os.path.exists(s.path) and s.finished is not None
                                     and now - s.finished < FETCH_GRACE_S)
            for s in self.sessions)

    def info(self) -> dict:
        return {**super().info(), "sessions": len(self.sessions), "writer": self.writer_options,
                "transport": self.transport.details(FRAMES_EDGE, self.last_transport), "nixl": counters()}

    def _sweep(self) -> None:
        def expiring(s: MuxSession) -> None:
            log.warning("session %s (request %s) expired after %.0fs in state %s", s.id, s.request_id, s.ttl_s,
                        s.state)

        while not self.stopping.wait(1.0):
            for s in self.sessions.sweep(before_fail=expiring):
                _discard(s)

    def _writer(self, session: MuxSession) -> Mp4Writer:
        return Mp4Writer(session.path, session.width, session.height, fps=session.fps,
                         sample_rate=session.sample_rate, channels=session.channels, **self.writer_options,
                         tap=Fmp4Tap(session.live) if session.live is not None else None)

    def _get(self, session_id: str, field: str = "session_id") -> MuxSession:
        if not session_id:
            raise RequestError(field, session_id, "the session id OpenSession returned")
        return self.sessions.get(session_id)

    # -- RPCs -----------------------------------------------------------------------------------------------
    @grpc_method("muxer")
    def OpenSession(self, request, context):
        r = request
        for name, value, lo, hi in (("width", r.width, 2, MAX_SIDE), ("height", r.height, 2, MAX_SIDE),
                                    ("fps", r.fps, 1, 240), ("sample_rate", r.sample_rate, 8000, 192000),
                                    ("channels", r.channels, 1, 2)):
            if not lo <= value <= hi:
                raise RequestError(name, value, f"an integer in [{lo}, {hi}]")
        if r.width % 2 or r.height % 2:
            raise RequestError("width" if r.width % 2 else "height", r.width if r.width % 2 else r.height,
                               "even (yuv420p)")
        most = math.ceil(MAX_DURATION * r.fps) + FRAMES_PER_CLIP
        if not 0 <= r.expected_frames <= most:
            raise RequestError("expected_frames", r.expected_frames, f"frames in [0, {most}] (0: not checked; "
                                                                     f"{MAX_DURATION:g} s at {r.fps} fps at most)")
        _transport("transport", r.transport)
        limit = self.config.media.max_session_ttl_s
        if not (r.ttl_s == 0 or (math.isfinite(r.ttl_s) and 0 < r.ttl_s <= limit)):
            raise RequestError("ttl_s", r.ttl_s, f"seconds in (0, {limit:g}] (0: the default, "
                                                 f"{self.config.media.session_ttl_s:g})")
        transport = r.transport or GRPC
        sid = secrets.token_hex(12)
        # nixl: what this replica offers (the pool is registered when the VAE connects); grpc needs nothing
        metadata = session_offer(self.transport.chosen, self.transport.reason) if transport == NIXL else b""
        session = MuxSession(id=sid, request_id=r.request_id, width=r.width, height=r.height, fps=r.fps,
                             sample_rate=r.sample_rate, channels=r.channels, expected_frames=r.expected_frames,
                             transport=transport, ttl_s=r.ttl_s if r.ttl_s > 0 else self.config.media.session_ttl_s,
                             path=os.path.join(self.tmp_dir, f"{sid}.mp4"), peer=peer_identity(context),
                             live=FragmentLog(os.path.join(self.tmp_dir, f"{sid}.fmp4")))
        self.sessions.add(session)
        return muxer_pb2.OpenSessionResponse(session_id=sid, address=self.config.address,
                                             transport_metadata=metadata, max_chunk_bytes=CHUNK_BYTES)

    @grpc_method("muxer")
    def Push(self, request_iterator, context):
        first = first_message(request_iterator, "open", "the first message of a Push stream names the session")
        session = self._get(first.open.session_id, "open.session_id")
        _transport("open.transport", first.open.transport)
        self.sessions.claim(session)
        with self.request(context, session.request_id) as scope:
            writer = None
            try:
                receiver = GrpcStreamReceiver(request_iterator, _unwrap, edge=FRAMES_EDGE)   # Push carries the bytes
                # a nixl session pushed here fell back: the VAE sends the reason along
                reason = first.open.transport_metadata.decode(errors="replace") if session.transport != GRPC else ""
                session.transport_info = {"edge": FRAMES_EDGE, "requested": session.transport, "chosen": GRPC,
                                          "reason": reason or "requested"}
                self.last_transport = session.transport_info
                inbox: queue.Queue = queue.Queue(maxsize=RECEIVE_DEPTH)
                reader = threading.Thread(target=_read_into, args=(receiver, inbox, scope), daemon=True,
                                          name=f"h3serve-mux-read-{session.id[:6]}")
                reader.start()
                planes: dict = {}
                writer = self._writer(session)
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
                    _add(writer, planes, session, item, scope)
                return _close(writer, session)
            except BaseException as exc:
                raise _failed(writer, session, exc) from None

    @grpc_method("muxer")
    def Fetch(self, request, context):
        session = self._get(request.session_id)
        remaining = context.time_remaining()
        end = None if remaining is None or remaining > 1e8 else time.monotonic() + remaining
        if not self.sessions.wait(session, lambda: context.is_active() and (end is None or time.monotonic() < end)):
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
        self.sessions.pop(session.id)
        _discard(session)

    @grpc_method("muxer")
    def Stream(self, request, context):
        session = self._get(request.session_id)
        live = session.live
        if live is None:
            raise StageUnavailable("muxer", "this session keeps no live stream")
        with live.reader() as reader:   # an open file: the log may be discarded (fetched) while it is read
            offset = 0
            while context.is_active():
                data = reader.read(offset, CHUNK_BYTES, 0.1)
                if data is None:
                    yield muxer_pb2.Mp4Chunk(offset=offset, data=b"", last=True)
                    return
                if data:
                    yield muxer_pb2.Mp4Chunk(offset=offset, data=data)
                    offset += len(data)

    @grpc_method("muxer")
    def Abort(self, request, context):
        if not request.session_id:
            raise RequestError("session_id", "", "the session id OpenSession returned")
        session = self.sessions.pop(request.session_id)
        if session is None:
            return muxer_pb2.AbortResponse(existed=False)
        session.fail(StageUnavailable("muxer", f"session aborted: {request.reason or 'by the caller'}"), "aborted")
        if session.live is not None:   # its readers hear why; the file goes now, even while a Push still writes
            session.live.fail(session.error)
            session.live.discard()
        if session.state != "pushing":
            _discard(session)
        return muxer_pb2.AbortResponse(existed=True)

    @grpc_method("muxer")
    def Control(self, request_iterator, context):
        """The control pipe of a NIXL stream into a session: the producer's first message names the session; then
        each message carries one control-pipe message (handshake, hello, put headers, credits, end, closed).
        A worker thread runs the NixlReceiver (zero copy: the planes are wrapped where NIXL wrote them) and the
        encoder; the response stream ends when the MP4 is closed, or with the session's error."""
        first = first_message(request_iterator, "session_id",
                              "the first message of a Control stream names the session")
        if (first.transport or NIXL) != NIXL:
            raise RequestError("transport", first.transport, "nixl (the grpc transport uses Push)")
        session = self.sessions.claim(self._get(first.session_id))
        scope = self.scope(context, session.request_id)
        slot = min(DEFAULT_SLOT_BYTES, max(1 << 20, FRAMES_PER_CLIP * session.width * session.height * 3))
        stream = ControlReceiver(FRAMES_EDGE, first.data, (m.data for m in request_iterator), context,
                                 transport=self.transport.chosen, pool_buffers=NIXL_SLOTS, buffer_bytes=slot,
                                 zero_copy=True)
        yield from stream.serve(lambda: self._control_receive(session, scope, stream),
                                lambda data: muxer_pb2.ControlMessage(data=data))

    def _control_receive(self, session: MuxSession, scope, stream: ControlReceiver) -> None:
        """Worker of a Control stream: the NIXL stream's messages -> Mp4Writer."""
        writer = None
        with self.finishing(scope):
            try:
                writer = self._writer(session)
                planes: dict = {}
                for msg in stream.messages():
                    if session.state == "aborted":
                        raise session.error or StageUnavailable("muxer", "session aborted")
                    _add(writer, planes, session, msg, scope, copy=True)
                session.transport_info = self.last_transport = stream.info
                _close(writer, session)
            except BaseException as exc:  # noqa: BLE001 - reported on the response stream and to Fetch
                raise _failed(writer, session, exc) from None


def _transport(field: str, value: str) -> None:
    if value and value not in TRANSPORTS:
        raise RequestError(field, value, " | ".join(TRANSPORTS) + " (empty: grpc)")


def _failed(writer: Mp4Writer | None, session: MuxSession, exc: BaseException) -> BaseException:
    """A session's stream failed with `exc`: drop the partial MP4, fail the session with what Fetch reports; return
    what the producer's call answers."""
    answer, reported = _outcome(exc)
    if session.live is not None:   # live readers get what Fetch reports
        session.live.fail(reported)
    if writer is not None:
        writer.abort()
    session.fail(reported)
    return answer


def _outcome(exc: BaseException) -> tuple[BaseException, BaseException]:
    """(what the producer's Push / Control call answers, what the session's Fetch reports) for a failed stream."""
    if isinstance(exc, SenderStopped):   # the producer's abort ends its stream without `end`: it gave up
        return (Cancelled(f"muxer: {exc}; the session is aborted"),
                StageUnavailable("vae", f"the frame stream stopped before its end ({exc})"))
    if isinstance(exc, TransportError):   # the producer died or its call broke
        exc = StageUnavailable("vae", f"the frame stream broke ({exc})")
        return exc, exc
    if isinstance(exc, RequestError):     # the producer sent what the session cannot take: the producer's fault
        return exc, StageFailed("vae", f"the muxer refused its frame stream: {exc}")
    if not isinstance(exc, Exception):
        exc = StageUnavailable("muxer", "push interrupted")
    return exc, exc


def _close(writer: Mp4Writer, session: MuxSession) -> muxer_pb2.PushResult:
    """Close the MP4 (the frame count checked against the session's) and mark the session done."""
    t_end = time.perf_counter()
    if not writer.frames:
        raise RequestError("frames", 0, "at least one frame before the end of the stream")
    if not writer.audio_samples:
        raise RequestError("pcm", 0, "the soundtrack (H3 output always has one) before the end of the stream")
    if session.expected_frames and writer.frames != session.expected_frames:
        raise RequestError("frames", writer.frames, f"the {session.expected_frames} frames the session expects "
                                                     "(expected_frames)")
    stats = writer.close()
    session.result = muxer_pb2.PushResult(frames=stats.frames, audio_samples=stats.audio_samples,
                                          mp4_bytes=stats.bytes, encode_seconds=stats.encode_seconds,
                                          tail_seconds=time.perf_counter() - t_end)
    session.state, session.finished = "done", time.monotonic()
    session.done.set()
    return session.result


def _tensor(item, name: str, dtype: str, shape: tuple) -> np.ndarray:
    """`item`'s tensor as numpy, refused naming `name` unless it is `dtype` with `shape` (None: any size >= 1)."""
    want = "(" + ", ".join("n" if d is None else str(d) for d in shape) + f") {dtype}"
    if item.tensor is None:
        raise RequestError(name, None, f"a tensor {want}")
    got = tuple(item.tensor.shape)
    if (item.header.dtype != dtype or len(got) != len(shape)
            or any(g < 1 if d is None else g != d for g, d in zip(got, shape))):
        raise RequestError(name, f"{got} {item.header.dtype}", want)
    return item.tensor.numpy()


def _add(writer, planes: dict, session: MuxSession, item, scope, copy: bool = False) -> None:
    """Hand one received message to the writer. Names: "frames" (n, H, W, 3) uint8; "yuv" (one clip of yuv420p
    planes packed y|u|v, meta {"n": frames}); "y", "u", "v" planes in that order; "pcm" (C, N) float32.
    `copy`: the tensors are views of a transport buffer valid until the next receive (planes kept across
    messages are copied). Each is checked against the session's geometry first (the caller's bad input)."""
    if item.header is None:
        raise RequestError("chunk.dtype", "", "a tensor (frames, yuv, y/u/v or pcm); a control item carries none")
    name, h, w = item.header.name, session.height, session.width
    if name == "frames":
        writer.add_frames(rgb_to_yuv420p(_tensor(item, name, "uint8", (None, h, w, 3))))
        scope.unit_done()
    elif name == "yuv":
        n = (item.meta or {}).get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RequestError("yuv", n, 'meta {"n": frames}, an integer >= 1')
        ys, cs = n * h * w, n * (h // 2) * (w // 2)
        flat = _tensor(item, name, "uint8", (ys + 2 * cs,))
        writer.add_yuv(flat[:ys].reshape(n, h, w), flat[ys:ys + cs].reshape(n, h // 2, w // 2),
                       flat[ys + cs:].reshape(n, h // 2, w // 2))
        scope.unit_done()
    elif name in ("y", "u", "v"):
        n = None if name == "y" or "y" not in planes else planes["y"].shape[0]
        plane = _tensor(item, name, "uint8", (n, h, w) if name == "y" else (n, h // 2, w // 2))
        planes[name] = plane.copy() if copy and name != "v" else plane
        if name == "v":
            if set(planes) != {"y", "u", "v"}:
                raise RequestError("chunk.name", name, "planes in the order y, u, v")
            writer.add_yuv(planes.pop("y"), planes.pop("u"), planes.pop("v"))
            scope.unit_done()
    elif name == "pcm":
        pcm = _tensor(item, name, "float32", (session.channels, None))
        if not np.isfinite(pcm).all():
            raise RequestError("pcm", "NaN or Inf", "finite samples in [-1, 1]")
        writer.add_audio(pcm)
    else:
        raise RequestError("chunk.name", name, "frames (n, H, W, 3) uint8, yuv / y/u/v planes, or pcm (C, N) "
                                               "float32")


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


def _discard(session: MuxSession) -> None:
    """Remove a session's files (its live stream's readers keep theirs open)."""
    _unlink(session.path)
    if session.live is not None:   # a reader still waiting hears why (no-op on a complete stream)
        session.live.fail(session.error or StageUnavailable("muxer", "the session ended (aborted or expired)"))
        session.live.discard()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

