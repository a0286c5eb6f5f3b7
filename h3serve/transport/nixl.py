"""NIXL transport: tensor bytes move by one-sided NIXL (UCX) WRITEs into a bounded pool the receiver registered;
a small control pipe (the stage's gRPC stream in the services) carries handshake, headers, credits and end.

    receiver (e.g. muxer)                                   sender (e.g. VAE)
    NixlReceiver(edge, pipe)  -- registers K slots of B bytes
      .handshake() -> bytes   ───────── over gRPC ────────►  NixlSender(edge, pipe).connect(handshake)
                                                               add_remote_agent + probe WRITE; on failure falls
                                                               back to bytes inside the pipe ("grpc")
                              ◄── control: hello ──────────
                                                             send(): per part of <= B bytes
                                                               take a credit (a free slot), copy into a registered
                                                               staging buffer (pinned host / VRAM), WRITE it into
                              ◄══ NIXL WRITE + notif "seq:part"  the slot with a NIXL notification,
                              ◄── control: put(seq, part, slot, header, meta)
    recv(): waits for the notification of each part, copies out (or returns a view), credits the slot back
                              ─── control: credit(slot) ──►
                              ◄── control: end ────────────  close()
                              ─── control: closed ────────►  (the sender keeps its agent until this ack)

Back-pressure: the sender holds at most K credits, so at most K parts are in flight or waiting in the receiver's
pool; a slow consumer blocks `send` (the VAE) instead of growing memory. Defaults: K = 3 slots of 64 MiB, so a
clip of frames (1344x768x17x3 uint8 = 52.6 MB) is one part; larger messages are split into slot-sized parts and
reassembled. Sender staging: 2 buffers of B bytes (double buffering), pinned when CUDA is available.

Control pipe: anything with `send(data: bytes, timeout=None)` and `recv(timeout) -> bytes` (see `ControlPipe`);
`SocketPipe` (a stream socket, used by the tests) and `QueuePipe` (two queues, to sit on a gRPC bidi stream) are
provided. The pipe carries no tensor bytes unless NIXL is not usable, in which case the same stream carries them
inline in chunks of at most `inline_chunk_bytes` (the gRPC fallback).

Failures: every wait has a timeout (`timeout=` per object, overridable per call); a peer that dies surfaces as
`TransportError(edge=...)` (control pipe EOF, NIXL disconnect, or the timeout), after which this side has already
released its transfers, deregistered its memory and dropped its agent. `counters()` reports live agents and
registered regions so that leaks are visible.

NIXL's own progress thread busy-polls a core (`pthrDelay` 0 in the Python wrapper), so agents are created without
it; this module drives progress itself whenever it waits (`check_xfer_state`, `get_new_notifs`). Same-host (CMA)
and RDMA transfers need no target-side progress; UCX's TCP transport moves bytes only while a side polls.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import queue
import socket
import struct
import threading
import time
import uuid
from typing import Any, Iterable, Iterator, Protocol

import torch

from h3serve.transport.base import DTYPES, Message, TensorHeader, TensorReceiver, TensorSender, TransportError

log = logging.getLogger("h3serve.transport.nixl")

TRANSPORTS = ("grpc", "nixl")
DEFAULT_SLOT_BYTES = 64 << 20       # one 1344x768x17 RGB clip (52.6 MB) per slot
DEFAULT_SLOTS = 3                   # K: parts in flight per stream
DEFAULT_STAGING = 2                 # sender staging buffers (double buffering)
DEFAULT_TIMEOUT = 60.0              # seconds, any single wait
DEFAULT_CONNECT_TIMEOUT = 10.0      # seconds, connect probe
INLINE_CHUNK_BYTES = 1 << 20        # fallback: payload bytes per control message (below gRPC's 4 MiB limit)
DISABLE_ENV = "H3SERVE_NIXL_DISABLE"

_HS_MAGIC = b"H3NX"
_HS_VERSION = 1
_LEN = struct.Struct("!I")



def _import_nixl():
    """`nixl._api` (the CUDA-variant wheel the meta package picks), with its INFO chatter turned down."""
    import nixl  # noqa: F401  (selects nixl_cu12 / nixl_cu13 and aliases it as nixl._api)
    from nixl import _api

    if not os.environ.get("NIXL_LOG_LEVEL"):
        # nixl configures its logger at import (INFO on stdout, one line per agent); keep warnings and errors.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


# ---------------------------------------------------------------------------------------------------------------
# Availability and selection


_available: tuple[bool, str] | None = None
_available_lock = threading.Lock()


def nixl_available() -> tuple[bool, str]:
    """(True, description) when NIXL imports and a UCX backend can be created here, else (False, reason).

    The probe (one throwaway agent) runs once per process; `H3SERVE_NIXL_DISABLE=1` is checked on every call.
    """
    global _available
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False, f"NIXL disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    with _available_lock:
        if _available is None:
            _available = _probe_nixl()
        return _available


def _probe_nixl() -> tuple[bool, str]:
    try:
        api = _import_nixl()
    except Exception as e:  # ImportError, missing shared libraries, CUDA variant mismatch
        return False, f"cannot import nixl: {type(e).__name__}: {e}"
    try:
        agent = api.nixl_agent(f"h3-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                               api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in agent.backends:
            return False, f"NIXL has no UCX backend (plugins: {', '.join(agent.get_plugin_list()) or 'none'})"
        mems = agent.get_backend_mem_types("UCX")
        del agent
    except Exception as e:
        return False, f"NIXL UCX backend cannot start: {type(e).__name__}: {e}"
    return True, f"NIXL {_nixl_version()} with UCX ({'/'.join(m.replace('_SEG', '') for m in mems)})"


def _nixl_version() -> str:
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:
        return "?"


def select_transport(requested: str, *, probe=None) -> tuple[str, str]:
    """The transport a deployment asked for (`grpc` | `nixl`) and the one it gets, with the reason.

    `nixl` falls back to `grpc` with a warning when NIXL cannot be loaded here or `probe()` (optional: e.g. a test
    connection to the peer) raises. The reason is meant for the logs, the health details and the metrics.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"transport={requested!r} is invalid: use one of {', '.join(TRANSPORTS)}")
    if requested == "grpc":
        return "grpc", "requested"
    ok, reason = nixl_available()
    if ok and probe is not None:
        try:
            probe()
        except Exception as e:
            ok, reason = False, f"peer cannot connect: {e}"
    if not ok:
        log.warning("transport nixl requested, using grpc: %s", reason)
        _count("fallbacks_total")
        return "grpc", reason
    log.info("transport nixl: %s", reason)
    return "nixl", reason


# ---------------------------------------------------------------------------------------------------------------
# Counters (for metrics and leak checks)

_counters_lock = threading.Lock()
_counters: dict[str, int] = collections.defaultdict(int)


def _count(name: str, n: int = 1) -> None:
    with _counters_lock:
        _counters[name] += n


def counters() -> dict[str, int]:
    """Process-wide counts: agents_live, regions_registered, bytes_registered, fallbacks_total,
    streams_failed_total, xfers_leaked (handles NIXL refused to release; should stay 0)."""
    with _counters_lock:
        keys = ("agents_live", "regions_registered", "bytes_registered", "fallbacks_total",
                "streams_failed_total", "xfers_leaked")
        return {k: int(_counters[k]) for k in keys}


# ---------------------------------------------------------------------------------------------------------------
# Control pipes


class ControlPipe(Protocol):
    """An ordered, reliable, message-preserving byte pipe between the two peers of one stream.

    `send` raises TimeoutError if the message could not be queued in time, EOFError/OSError if the pipe is broken.
    `recv` returns the next message, raises TimeoutError if none arrived in time (the pipe stays usable), and
    EOFError (or OSError) once the peer has gone or closed its end.
    """

    def send(self, data: bytes, timeout: float | None = None) -> None: ...

    def recv(self, timeout: float | None) -> bytes: ...


class SocketPipe:
    """ControlPipe over a connected stream socket (socketpair or loopback TCP); 8-byte length-prefixed frames."""

    _HDR = struct.Struct("!Q")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._closed = False

    @classmethod
    def pair(cls) -> tuple["SocketPipe", "SocketPipe"]:
        a, b = socket.socketpair()
        return cls(a), cls(b)

    def send(self, data: bytes, timeout: float | None = None) -> None:
        if self._closed:
            raise EOFError("pipe closed")
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(self._HDR.pack(len(data)))
            self.sock.sendall(data)
        except socket.timeout:
            raise TimeoutError(f"control pipe: send blocked for {timeout}s") from None

    def recv(self, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(self._buf) >= 8:
                (n,) = self._HDR.unpack_from(self._buf)
                if len(self._buf) >= 8 + n:
                    data = bytes(self._buf[8:8 + n])
                    del self._buf[:8 + n]
                    return data
            if self._closed:
                raise EOFError("pipe closed")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("control pipe: nothing received")
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(1 << 20)
            except socket.timeout:
                raise TimeoutError("control pipe: nothing received") from None
            if not chunk:
                raise EOFError("control pipe: peer closed")
            self._buf += chunk

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class QueuePipe:
    """ControlPipe over two queues, for a gRPC bidi stream (or any message stream):

        pipe = QueuePipe()
        # client side:  responses = stub.Transfer(pipe.outgoing())          # generator of bytes
        #               pipe.pump(r.data for r in responses)                 # thread feeding `recv`
        # server side:  pipe.pump(r.data for r in request_iterator); return (Frame(data=b) for b in pipe.outgoing())

    `outgoing()` ends when `close()` is called; `recv` raises EOFError once the pumped iterator ends or fails.
    `maxsize` bounds what `send` may queue before it blocks (then times out).
    """

    _EOF = object()

    def __init__(self, maxsize: int = 64):
        self._in: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue(maxsize=maxsize)
        self._closed = False
        self._eof_reason = ""

    def send(self, data: bytes, timeout: float | None = None) -> None:
        if self._closed:
            raise EOFError("pipe closed")
        if self._eof_reason:
            raise EOFError(self._eof_reason)
        try:
            self._out.put(bytes(data), timeout=timeout)
        except queue.Full:
            raise TimeoutError(f"control pipe: send blocked for {timeout}s") from None

    def recv(self, timeout: float | None) -> bytes:
        try:
            item = self._in.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("control pipe: nothing received") from None
        if item is self._EOF:
            self._in.put(item)
            raise EOFError(self._eof_reason or "control pipe: peer closed")
        return item

    def feed(self, data: bytes) -> None:
        self._in.put(bytes(data))

    def feed_eof(self, reason: str = "control pipe: peer closed") -> None:
        self._eof_reason = reason
        self._in.put(self._EOF)

    def pump(self, iterator: Iterable[bytes]) -> threading.Thread:
        """Feed `recv` from `iterator` on a daemon thread; its end (or error) becomes EOF."""

        def run():
            try:
                for data in iterator:
                    self.feed(data)
                self.feed_eof()
            except Exception as e:  # grpc.RpcError when the peer dies or cancels
                self.feed_eof(f"control pipe: stream broke: {type(e).__name__}: {e}")

        t = threading.Thread(target=run, name="h3-pipe-pump", daemon=True)
        t.start()
        return t

    def outgoing(self) -> Iterator[bytes]:
        while True:
            item = self._out.get()
            if item is self._EOF:
                return
            yield item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._out.put(self._EOF)


def _pack(obj: dict, payload: bytes | memoryview = b"") -> bytes:
    head = json.dumps(obj, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, payload))


def _unpack(data: bytes) -> tuple[dict, memoryview]:
    try:
        (n,) = _LEN.unpack_from(data)
        obj = json.loads(bytes(data[4:4 + n]))
        if not isinstance(obj, dict) or "t" not in obj:
            raise ValueError("not a control message")
    except Exception as e:
        raise ValueError(f"malformed control message: {e}") from None
    return obj, memoryview(data)[4 + n:]


# ---------------------------------------------------------------------------------------------------------------
# Agents


def _agent_name(edge: str, role: str) -> str:
    safe = "".join(c if c.isalnum() else "-" for c in edge) or "edge"
    return f"h3-{safe}-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _device_mem(device: torch.device) -> tuple[str, int]:
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    raise ValueError(f"device={device} is invalid: NIXL buffers live in cpu (DRAM) or cuda (VRAM) memory")


def _alloc(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed (pages touched) buffer; pinned host memory when CUDA is present, so D2H copies into it are DMA."""
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


class _Agent:
    """One NIXL agent (UCX backend, no progress thread) with its registered buffers; `close` never raises."""

    def __init__(self, edge: str, role: str):
        api = _import_nixl()
        self.name = _agent_name(edge, role)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL UCX backend not available")
        _count("agents_live")
        self._regs: list[tuple[Any, torch.Tensor]] = []
        self._remotes: list[str] = []
        self._xfers: list[Any] = []
        self.closed = False

    def register(self, buf: torch.Tensor) -> None:
        reg = self.agent.register_memory(buf)
        if reg is None:
            raise RuntimeError("register_memory returned no descriptors")
        self._regs.append((reg, buf))
        _count("regions_registered")
        _count("bytes_registered", buf.numel() * buf.element_size())

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.append(name)
        return name

    def track(self, handle) -> None:
        self._xfers.append(handle)

    def release(self, handle) -> bool:
        try:
            handle.release()
        except Exception as e:
            log.debug("xfer release failed: %s", e)
            return False
        try:
            self._xfers.remove(handle)
        except ValueError:
            pass
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Transfers first (an active one is cancelled), then memory, then peers, then the agent itself.
        deadline = time.monotonic() + 2.0
        pending = list(self._xfers)
        while pending:
            pending = [h for h in pending if not self.release(h)]
            if not pending or time.monotonic() > deadline:
                break
            for h in pending:
                try:
                    self.agent.check_xfer_state(h)
                except Exception:
                    pass
            time.sleep(0.01)
        if pending:
            # NIXL would not cancel them: keep the memory they may touch alive rather than free it under UCX.
            _count("xfers_leaked", len(pending))
            log.error("%s: %d NIXL transfers could not be released; their buffers are kept", self.name, len(pending))
            _quarantine.append((self.agent, list(self._regs), pending))
            self._regs.clear()
        for reg, buf in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception as e:
                log.warning("%s: deregister failed: %s", self.name, e)
            _count("regions_registered", -1)
            _count("bytes_registered", -(buf.numel() * buf.element_size()))
        self._regs.clear()
        for name in self._remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass
        self._remotes.clear()
        self._xfers.clear()
        self.agent = None
        _count("agents_live", -1)


_quarantine: list = []


# ---------------------------------------------------------------------------------------------------------------
# Handshake


def _encode_handshake(info: dict, metadata: bytes = b"") -> bytes:
    head = json.dumps(info, separators=(",", ":")).encode()
    return b"".join((_HS_MAGIC, bytes([_HS_VERSION]), _LEN.pack(len(head)), head, metadata))


def _decode_handshake(data: bytes) -> tuple[dict, bytes]:
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:4]) != _HS_MAGIC:
        raise ValueError("not an h3serve NIXL handshake")
    if data[4] != _HS_VERSION:
        raise ValueError(f"handshake version {data[4]} (this side speaks {_HS_VERSION})")
    (n,) = _LEN.unpack_from(data, 5)
    info = json.loads(bytes(data[9:9 + n]))
    return info, bytes(data[9 + n:])


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes on its own device (contiguous copy only if needed)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _from_bytes(header: TensorHeader, flat: torch.Tensor) -> torch.Tensor:
    return flat.view(DTYPES[header.dtype]).reshape(header.shape)


def _header_json(h: TensorHeader) -> list:
    return [h.name, h.dtype, list(h.shape)]


def _header_from(obj, edge: str) -> TensorHeader:
    try:
        name, dtype, shape = obj
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}")
        return TensorHeader(str(name), dtype, tuple(int(s) for s in shape))
    except Exception as e:
        raise TransportError(f"malformed tensor header {obj!r}: {e}", edge=edge) from None


class _Backoff:
    """Short sleeps that grow while nothing happens (polling without burning a shared core)."""

    def __init__(self, first: float = 20e-6, cap: float = 1e-3):
        self.first, self.cap, self.t = first, cap, first

    def reset(self):
        self.t = self.first

    def next(self) -> float:
        t = self.t
        self.t = min(self.cap, self.t * 2)
        return t


# ---------------------------------------------------------------------------------------------------------------
# Shared endpoint logic


class _Endpoint:
    role = "?"

    def __init__(self, edge: str, pipe: ControlPipe, timeout: float):
        self.edge = edge
        self.pipe = pipe
        self.timeout = float(timeout)
        self.transport = "grpc"
        self.reason = ""
        self.requested = "nixl"
        self.failed: str | None = None
        self._agent: _Agent | None = None
        self._backlog: collections.deque = collections.deque()
        self.stats: dict[str, float] = collections.defaultdict(float)

    @property
    def transport_info(self) -> dict:
        """{requested, chosen, reason}: for the logs, the health details and the metrics."""
        return {"requested": self.requested, "chosen": self.transport, "reason": self.reason}

    def _error(self, message: str, cause: BaseException | None = None) -> TransportError:
        err = TransportError(message, edge=self.edge)
        if self.failed is None:
            self.failed = message
            _count("streams_failed_total")
            log.warning("%s %s failed: %s", self.edge, self.role, message)
        self._teardown()
        if cause is not None:
            err.__cause__ = cause
        return err

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        t = self.timeout if timeout is None else float(timeout)
        return time.monotonic() + t, t

    def _send_ctrl(self, obj: dict, payload: bytes | memoryview = b"", *, deadline: float | None = None) -> None:
        left = self.timeout if deadline is None else max(0.001, deadline - time.monotonic())
        try:
            self.pipe.send(_pack(obj, payload), timeout=left)
        except TimeoutError as e:
            raise self._error(f"control pipe blocked for {left:.1f}s (peer not reading)", e) from None
        except Exception as e:  # EOFError, BrokenPipeError, ConnectionResetError, grpc errors
            raise self._error(f"control pipe to peer broken ({type(e).__name__}: {e}): peer gone", e) from None

    def _poll_ctrl(self, wait: float) -> dict | None:
        """One control message into the backlog if one arrives within `wait` seconds; raises on EOF."""
        try:
            data = self.pipe.recv(wait)
        except TimeoutError:
            return None
        except Exception as e:
            raise self._error(f"control pipe closed ({type(e).__name__}: {e}): peer gone", e) from None
        try:
            obj, payload = _unpack(data)
        except ValueError as e:
            raise self._error(str(e)) from None
        if obj["t"] == "err":
            raise self._error(f"peer aborted: {obj.get('reason', '?')}")
        self._backlog.append((obj, payload))
        return obj

    def _next_ctrl(self, deadline: float, what: str) -> tuple[dict, memoryview]:
        # The pipe wait returns as soon as a message arrives; the cap only bounds how often NIXL is polled meanwhile.
        back = _Backoff(cap=5e-3)
        while not self._backlog:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"timed out waiting for {what}")
            if self._agent is not None and self._progress():
                back.reset()
                continue
            # With an agent, keep progressing it (UCX connection wire-up and TCP need both sides to poll).
            self._poll_ctrl(min(left, back.next()) if self._agent is not None else left)
        return self._backlog.popleft()

    def _progress(self) -> bool:
        """Drive NIXL once; True if something moved (a notification arrived, a transfer is still running)."""
        return False

    def _teardown(self) -> None:
        if self._agent is not None:
            agent, self._agent = self._agent, None
            agent.close()
        self._drop_buffers()

    def _drop_buffers(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------
# Receiver


class NixlReceiver(_Endpoint, TensorReceiver):
    """The receiving end of one stream (one request's frames on one edge).

    Registers `pool_buffers` (K) slots of `buffer_bytes` (B) on `device` ("cpu" -> DRAM, "cuda:N" -> VRAM) with a
    fresh NIXL agent. `handshake()` returns what the sender's `connect` needs (agent metadata + slot descriptors, or
    the reason NIXL is not usable here); send it to the sender over the service's gRPC call.

    `recv()` returns tensors on `device`:
      - zero_copy=False (default, safe): each tensor is a fresh copy; its slot is credited back at once.
      - zero_copy=True: a single-part tensor is a view of the slot, valid only until the next `recv()` or `close()`
        (the slot is credited back then); a message larger than B is reassembled into a fresh tensor either way.
    Attributes `transport` ("nixl" | "grpc"), `reason`, `transport_info`, `stats` say what was used and why.
    """

    role = "receiver"

    def __init__(self, edge: str, pipe: ControlPipe, *, pool_buffers: int = DEFAULT_SLOTS,
                 buffer_bytes: int = DEFAULT_SLOT_BYTES, device: str | torch.device = "cpu", zero_copy: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, transport: str = "nixl", fallback: bool = True):
        super().__init__(edge, pipe, timeout)
        if pool_buffers < 1:
            raise ValueError(f"pool_buffers={pool_buffers} is invalid: need at least 1 slot")
        if buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes={buffer_bytes} is invalid: need at least 4096")
        self.k = int(pool_buffers)
        self.slot_bytes = -(-int(buffer_bytes) // 4096) * 4096
        self.device = torch.device(device)
        self.mem, self.dev_id = _device_mem(self.device)
        self.zero_copy = zero_copy
        self.requested = transport
        self._pool: torch.Tensor | None = None
        self._held: int | None = None
        self._notifs: set[bytes] = set()
        self._ended = False
        self._closed = False
        self._hello = False
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is invalid: use one of {', '.join(TRANSPORTS)}")
        if transport == "grpc":
            self.transport, self.reason = "grpc", "requested"
            return
        ok, why = nixl_available()
        if ok:
            try:
                self._setup_nixl()
                self.transport, self.reason = "nixl", why
            except Exception as e:
                self._teardown()
                ok, why = False, f"NIXL receiver setup failed: {type(e).__name__}: {e}"
        if not ok:
            if not fallback:
                raise TransportError(why, edge=edge)
            self.transport, self.reason = "grpc", why
            _count("fallbacks_total")
            log.warning("%s receiver: transport nixl unavailable, using grpc: %s", edge, why)

    def _setup_nixl(self) -> None:
        self._agent = _Agent(self.edge, "rx")
        self._pool = _alloc(self.k * self.slot_bytes, self.device)
        self._agent.register(self._pool)

    def handshake(self) -> bytes:
        """Serialized agent metadata + pool descriptors (or the reason NIXL is not offered) for `connect`."""
        info = {"edge": self.edge, "k": self.k, "slot_bytes": self.slot_bytes, "nixl": self.transport == "nixl",
                "reason": self.reason}
        if self.transport != "nixl":
            return _encode_handshake(info)
        base = self._pool.data_ptr()
        info.update(agent=self._agent.name, mem=self.mem, dev=self.dev_id,
                    slots=[[base + i * self.slot_bytes, self.slot_bytes] for i in range(self.k)])
        return _encode_handshake(info, self._agent.agent.get_agent_metadata())

    # -- receiving --------------------------------------------------------------------------------------------

    def recv(self, *, timeout: float | None = None) -> Message | None:
        if self.failed:
            raise TransportError(f"stream already failed: {self.failed}", edge=self.edge)
        if self._closed:
            raise TransportError("receiver is closed", edge=self.edge)
        self._release_held()
        if self._ended:
            return None
        deadline, t = self._deadline(timeout)
        while True:
            obj, payload = self._next_ctrl(deadline, f"the next message (no message within {t:.1f}s)")
            kind = obj["t"]
            if kind == "hello":
                self._on_hello(obj)
            elif kind == "msg":
                self.stats["messages"] += 1
                return Message(None, None, dict(obj.get("meta") or {}))
            elif kind == "put":
                return self._recv_nixl(obj, deadline)
            elif kind == "data":
                return self._recv_inline(obj, payload, deadline)
            elif kind == "end":
                self._ended = True
                self._credit_quiet({"t": "closed", "messages": int(self.stats["messages"])})
                return None
            elif kind == "credit":
                raise self._error("protocol error: receiver got a credit")
            # unknown kinds are ignored (forward compatibility)

    def _on_hello(self, obj: dict) -> None:
        self._hello = True
        chosen = obj.get("transport", "grpc")
        if chosen == "nixl" and self.transport != "nixl":
            raise self._error("protocol error: sender chose nixl but this receiver offered none")
        if chosen != "nixl" and self.transport == "nixl":
            # The sender could not use our pool: free it now, the bytes come inline.
            self.transport, self.reason = "grpc", obj.get("reason") or "sender fell back"
            self._teardown()
            (log.info if self.reason == "requested" else log.warning)(
                "%s receiver: sender uses grpc: %s", self.edge, self.reason)
        elif chosen != "nixl" and obj.get("reason"):
            self.reason = obj["reason"]

    def _recv_nixl(self, first: dict, deadline: float) -> Message:
        if self._agent is None:
            raise self._error("protocol error: NIXL put but no NIXL pool")
        header = _header_from(first.get("hdr"), self.edge)
        meta = dict(first.get("meta") or {})
        total, nparts, seq = int(first["total"]), int(first["nparts"]), int(first["seq"])
        if total != header.nbytes:
            raise self._error(f"tensor {header.name!r}: {total} bytes announced, header says {header.nbytes}")
        out = None
        single = nparts == 1 and self.zero_copy
        if not single:
            out = torch.empty(total, dtype=torch.uint8, device=self.device)
        obj, off = first, 0
        for part in range(nparts):
            if part:
                obj, _ = self._next_ctrl(deadline, f"part {part} of {header.name!r}")
                if obj.get("t") != "put" or int(obj["seq"]) != seq or int(obj["part"]) != part:
                    raise self._error(f"protocol error: expected part {part} of message {seq}, got {obj}")
            slot, n = int(obj["slot"]), int(obj["n"])
            if not (0 <= slot < self.k) or not (0 <= n <= self.slot_bytes) or off + n > total:
                raise self._error(f"protocol error: bad put {obj}")
            self._wait_notif(f"{seq}:{part}".encode(), deadline, header.name)
            view = self._pool[slot * self.slot_bytes: slot * self.slot_bytes + n]
            if single:
                flat = view
                self._held = slot
            else:
                t0 = time.perf_counter()
                out[off:off + n].copy_(view)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the slot is read before it is reused
                self.stats["copy_s"] += time.perf_counter() - t0
                self._credit(slot)
            off += n
        if off != total:
            raise self._error(f"tensor {header.name!r}: got {off} of {total} bytes")
        self.stats["messages"] += 1
        self.stats["bytes"] += total
        return Message(header, _from_bytes(header, out if out is not None else flat), meta)

    def _progress(self) -> bool:
        try:
            new = self._agent.agent.get_new_notifs()
        except Exception as e:
            raise self._error(f"NIXL notifications failed: {type(e).__name__}: {e}", e) from None
        got = False
        for msgs in new.values():
            for m in msgs:
                if m != b"probe":
                    self._notifs.add(bytes(m))
                got = True
        return got

    def _wait_notif(self, tag: bytes, deadline: float, what: str) -> None:
        back = _Backoff()
        t0 = time.perf_counter()
        while tag not in self._notifs:
            if self._progress():
                back.reset()
                continue
            if time.monotonic() > deadline:
                raise self._error(f"timed out waiting for the NIXL completion of {what!r}")
            # Sleep by waiting on the control pipe: a dead or aborting peer surfaces at once.
            if self._poll_ctrl(back.next()) is not None:
                back.reset()
        self._notifs.discard(tag)
        self.stats["notif_wait_s"] += time.perf_counter() - t0

    def _recv_inline(self, first: dict, payload: memoryview, deadline: float) -> Message:
        if not self._hello:
            raise self._error("protocol error: data before hello")
        header = _header_from(first.get("hdr"), self.edge)
        meta = dict(first.get("meta") or {})
        total, seq, slot = int(first["total"]), int(first["seq"]), int(first.get("slot", -1))
        if total != header.nbytes:
            raise self._error(f"tensor {header.name!r}: {total} bytes announced, header says {header.nbytes}")
        buf = bytearray(total)
        obj, off = first, 0
        while True:
            n = len(payload)
            if int(obj.get("off", -1)) != off or off + n > total:
                raise self._error(f"protocol error: bad inline chunk {obj}")
            buf[off:off + n] = payload
            off += n
            if obj.get("last"):
                break
            obj, payload = self._next_ctrl(deadline, f"the rest of {header.name!r}")
            if obj.get("t") != "data" or int(obj["seq"]) != seq:
                raise self._error(f"protocol error: expected data of message {seq}, got {obj}")
        if off != total:
            raise self._error(f"tensor {header.name!r}: got {off} of {total} bytes")
        flat = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        self._credit(slot)
        self.stats["messages"] += 1
        self.stats["bytes"] += total
        return Message(header, _from_bytes(header, flat), meta)

    def _credit(self, slot: int) -> None:
        if slot >= 0:
            self._credit_quiet({"t": "credit", "slot": slot})

    def _credit_quiet(self, obj: dict) -> None:
        # A credit the sender can no longer read is not an error here; a dead sender surfaces on the next wait.
        try:
            self.pipe.send(_pack(obj), timeout=self.timeout)
        except Exception as e:
            log.debug("%s receiver: could not send %s: %s", self.edge, obj.get("t"), e)

    def _release_held(self) -> None:
        if self._held is not None:
            slot, self._held = self._held, None
            self._credit(slot)

    def close(self) -> None:
        """Release the pool and the agent; tell a sender that is still sending that this end is gone."""
        if self._closed:
            return
        self._closed = True
        if not self._ended and not self.failed:
            self._credit_quiet({"t": "err", "reason": "receiver closed before end of stream"})
        self._held = None
        self._teardown()

    def _drop_buffers(self) -> None:
        self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# Sender


class NixlSender(_Endpoint, TensorSender):
    """The sending end of one stream. `connect(handshake)` must come first; then `send` in order; then `close`.

    `send` returns once the tensor's bytes have been copied into a registered staging buffer and its WRITE is
    posted (the caller may reuse the tensor at once); it blocks while all K receiver slots are taken (back-pressure)
    or both staging buffers are still being written, each wait bounded by `timeout`.
    CUDA tensors are copied device-to-host into pinned staging (or device-to-device when `staging_device` is CUDA).
    If NIXL cannot be used (here, on the receiver, or the probe WRITE fails) and `fallback` is true, the bytes
    travel inline in the control pipe instead (`transport == "grpc"`, `reason` says why).
    """

    role = "sender"

    def __init__(self, edge: str, pipe: ControlPipe, *, staging_buffers: int = DEFAULT_STAGING,
                 staging_device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, transport: str = "nixl", fallback: bool = True,
                 inline_chunk_bytes: int = INLINE_CHUNK_BYTES):
        super().__init__(edge, pipe, timeout)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} is invalid: use one of {', '.join(TRANSPORTS)}")
        self.requested = transport
        self.n_staging = max(1, int(staging_buffers))
        self.staging_device = torch.device(staging_device)
        self.connect_timeout = float(connect_timeout)
        self.fallback = fallback
        self.inline_chunk_bytes = max(4096, int(inline_chunk_bytes))
        self.k = 0
        self.slot_bytes = 0
        self._free: collections.deque[int] = collections.deque()
        self._staging: torch.Tensor | None = None
        self._pending: list = []
        self._next_staging = 0
        self._remote = ""
        self._slots: list[list[int]] = []
        self._rmem, self._rdev = "DRAM", 0
        self._lmem, self._ldev = "DRAM", 0
        self._seq = 0
        self._connected = False
        self._closed = False

    # -- connecting -------------------------------------------------------------------------------------------

    def connect(self, handshake: bytes) -> str:
        """Join the receiver described by `handshake`; returns the transport chosen ("nixl" or "grpc")."""
        if self._connected:
            raise TransportError("already connected", edge=self.edge)
        try:
            info, metadata = _decode_handshake(handshake)
        except Exception as e:
            raise TransportError(f"bad handshake from receiver: {e}", edge=self.edge) from None
        self.k = int(info.get("k", DEFAULT_SLOTS))
        self.slot_bytes = int(info.get("slot_bytes", DEFAULT_SLOT_BYTES))
        self._free = collections.deque(range(self.k))
        reason = ""
        if self.requested == "grpc":
            reason = "requested"
        elif not info.get("nixl"):
            reason = f"receiver: {info.get('reason') or 'NIXL not offered'}"
        else:
            ok, why = nixl_available()
            if not ok:
                reason = why
            else:
                try:
                    self._connect_nixl(info, metadata)
                    self.transport, self.reason = "nixl", why
                except Exception as e:
                    self._teardown()
                    reason = f"peer cannot connect over NIXL: {type(e).__name__}: {e}"
        if reason:
            if self.requested == "nixl":
                if not self.fallback:
                    raise self._error(reason)
                _count("fallbacks_total")
                log.warning("%s sender: transport nixl -> grpc: %s", self.edge, reason)
            self.transport, self.reason = "grpc", reason
        else:
            log.info("%s sender: transport nixl, %d slots x %d MiB: %s", self.edge, self.k, self.slot_bytes >> 20,
                     self.reason)
        self._connected = True
        self._send_ctrl({"t": "hello", "transport": self.transport, "reason": self.reason})
        return self.transport

    def _connect_nixl(self, info: dict, metadata: bytes) -> None:
        self._slots = [[int(a), int(n)] for a, n in info["slots"]]
        if len(self._slots) != self.k or any(n < self.slot_bytes for _, n in self._slots):
            raise ValueError("slot descriptors do not match the pool size")
        self._rmem, self._rdev = str(info.get("mem", "DRAM")), int(info.get("dev", 0))
        self._agent = _Agent(self.edge, "tx")
        self._staging = _alloc(self.n_staging * self.slot_bytes, self.staging_device)
        self._lmem, self._ldev = _device_mem(self.staging_device)
        self._agent.register(self._staging)
        self._pending = [None] * self.n_staging
        self._remote = self._agent.add_remote(metadata)
        if self._remote != info.get("agent"):
            raise ValueError(f"metadata names agent {self._remote!r}, handshake says {info.get('agent')!r}")
        # Probe: one small WRITE into slot 0 (free: nothing was sent yet) proves the data path end to end.
        handle = self._post(0, 0, 64, b"probe")
        deadline = time.monotonic() + self.connect_timeout
        back = _Backoff()
        while True:
            state = self._agent.agent.check_xfer_state(handle)
            if state == "DONE":
                break
            if state == "ERR":
                raise RuntimeError("probe WRITE failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe WRITE not done within {self.connect_timeout:.1f}s")
            time.sleep(back.next())
        self._agent.release(handle)

    def _post(self, staging: int, slot: int, n: int, notif: bytes):
        ag = self._agent.agent
        local = ag.get_xfer_descs([(self._staging.data_ptr() + staging * self.slot_bytes, n, self._ldev)],
                                  self._lmem)
        remote = ag.get_xfer_descs([(self._slots[slot][0], n, self._rdev)], self._rmem)
        handle = ag.initialize_xfer("WRITE", local, remote, self._remote, notif)
        self._agent.track(handle)
        state = ag.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL WRITE failed to post")
        return handle

    # -- sending ----------------------------------------------------------------------------------------------

    def send(self, name: str, tensor: torch.Tensor | None, meta: dict | None = None, *,
             timeout: float | None = None) -> None:
        self._check_usable()
        deadline, _ = self._deadline(timeout)
        seq, self._seq = self._seq, self._seq + 1
        meta = dict(meta or {})
        if tensor is None:
            self._send_ctrl({"t": "msg", "seq": seq, "meta": meta}, deadline=deadline)
            self.stats["messages"] += 1
            return
        header = TensorHeader.of(name, tensor)
        src = _byte_view(tensor)
        total = src.numel()
        if self.transport == "nixl" and total > 0:
            self._send_nixl(seq, header, meta, src, total, deadline)
        else:
            self._send_inline(seq, header, meta, src, total, deadline)
        self.stats["messages"] += 1
        self.stats["bytes"] += total

    def _send_nixl(self, seq, header, meta, src, total, deadline) -> None:
        nparts = math.ceil(total / self.slot_bytes)
        for part in range(nparts):
            lo, hi = part * self.slot_bytes, min(total, (part + 1) * self.slot_bytes)
            slot = self._take_credit(deadline)
            j = self._take_staging(deadline)
            t0 = time.perf_counter()
            dst = self._staging[j * self.slot_bytes: j * self.slot_bytes + (hi - lo)]
            piece = src[lo:hi]
            if piece.device.type == "cuda" or dst.device.type == "cuda":
                dst.copy_(piece, non_blocking=True)
                torch.cuda.current_stream(piece.device if piece.device.type == "cuda" else dst.device).synchronize()
            else:
                dst.copy_(piece)
            self.stats["copy_s"] += time.perf_counter() - t0
            try:
                self._pending[j] = self._post(j, slot, hi - lo, f"{seq}:{part}".encode())
            except Exception as e:
                raise self._error(f"NIXL WRITE failed ({type(e).__name__}: {e}): peer gone?", e) from None
            obj = {"t": "put", "seq": seq, "part": part, "nparts": nparts, "slot": slot, "n": hi - lo,
                   "total": total}
            if part == 0:
                obj.update(hdr=_header_json(header), meta=meta)
            self._send_ctrl(obj, deadline=deadline)
            self.stats["parts"] += 1

    def _send_inline(self, seq, header, meta, src, total, deadline) -> None:
        slot = self._take_credit(deadline)
        data = src if src.device.type == "cpu" else src.cpu()
        view = memoryview(data.numpy()) if total else memoryview(b"")
        off = 0
        while True:
            n = min(self.inline_chunk_bytes, total - off)
            obj = {"t": "data", "seq": seq, "slot": slot, "off": off, "total": total, "last": off + n >= total}
            if off == 0:
                obj.update(hdr=_header_json(header), meta=meta)
            self._send_ctrl(obj, view[off:off + n], deadline=deadline)
            off += n
            self.stats["parts"] += 1
            if off >= total:
                return

    def _take_credit(self, deadline: float) -> int:
        t0 = time.perf_counter()
        back = _Backoff(cap=2e-3)
        while not self._free:
            self._drain_backlog()
            if self._free:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"receiver did not free a slot within the timeout ({self.k} in flight)")
            busy = self._progress()
            # While our WRITEs are in flight keep polling them (UCX TCP needs it); otherwise block on the pipe.
            self._poll_ctrl(min(left, back.next()) if busy else left)
        self.stats["credit_wait_s"] += time.perf_counter() - t0
        slot = self._free.popleft()
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.k - len(self._free))
        return slot

    def _drain_backlog(self) -> None:
        keep = collections.deque()
        while self._backlog:
            obj, payload = self._backlog.popleft()
            if obj["t"] == "credit":
                slot = int(obj["slot"])
                if not (0 <= slot < self.k) or slot in self._free:
                    raise self._error(f"protocol error: bad credit {obj}")
                self._free.append(slot)
            else:
                keep.append((obj, payload))
        self._backlog = keep

    def _progress(self) -> bool:
        """Advance and reap finished WRITEs; True while some are still in flight."""
        busy = False
        for j, h in enumerate(self._pending):
            if h is None:
                continue
            try:
                state = self._agent.agent.check_xfer_state(h)
            except Exception as e:
                raise self._error(f"NIXL WRITE failed ({type(e).__name__}: {e}): peer gone?", e) from None
            if state == "DONE":
                self._agent.release(h)
                self._pending[j] = None
            elif state == "ERR":
                raise self._error("NIXL WRITE failed: peer gone?")
            else:
                busy = True
        return busy

    def _take_staging(self, deadline: float) -> int:
        j = self._next_staging
        self._next_staging = (j + 1) % self.n_staging
        t0 = time.perf_counter()
        back = _Backoff()
        while self._pending[j] is not None:
            self._progress()
            if self._pending[j] is None:
                break
            if time.monotonic() > deadline:
                raise self._error("NIXL WRITE did not complete within the timeout")
            if self._poll_ctrl(back.next()) is not None:
                self._drain_backlog()
        self.stats["staging_wait_s"] += time.perf_counter() - t0
        return j

    def _check_usable(self) -> None:
        if self.failed:
            raise TransportError(f"stream already failed: {self.failed}", edge=self.edge)
        if self._closed:
            raise TransportError("sender is closed", edge=self.edge)
        if not self._connected:
            raise TransportError("send before connect", edge=self.edge)

    # -- ending -----------------------------------------------------------------------------------------------

    def close(self, *, timeout: float | None = None) -> None:
        """End of stream: wait for our WRITEs, send `end`, wait for the receiver's ack, release everything."""
        if self._closed or self.failed:
            self._closed = True
            self._teardown()
            return
        self._check_usable()
        deadline, t = self._deadline(timeout)
        back = _Backoff()
        if self._agent is not None:
            while self._progress():
                if time.monotonic() > deadline:
                    raise self._error("NIXL WRITEs did not complete within the timeout")
                if self._poll_ctrl(back.next()) is not None:
                    self._drain_backlog()
        self._send_ctrl({"t": "end", "messages": int(self.stats["messages"])}, deadline=deadline)
        while True:
            self._drain_backlog()
            if self._backlog:
                obj, _ = self._backlog.popleft()
                if obj["t"] == "closed":
                    break
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"receiver did not acknowledge the end of stream within {t:.1f}s")
            self._poll_ctrl(left)
        self._closed = True
        self._teardown()

    def abort(self, reason: str = "sender aborted") -> None:
        """Give up: tell the receiver (best effort) and release everything."""
        if not self._closed and not self.failed:
            try:
                self.pipe.send(_pack({"t": "err", "reason": reason}), timeout=1.0)
            except Exception:
                pass
        self._closed = True
        self._teardown()

    def _drop_buffers(self) -> None:
        self._staging = None
        self._pending = [None] * self.n_staging

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort(f"sender failed: {exc_type.__name__}")
