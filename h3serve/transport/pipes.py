"""Control pipes: the ordered message pipe between the two ends of a stream that carries handshake, headers,
credits and end (and the bytes themselves when NIXL cannot be used). `SocketPipe` runs on a stream socket (the
tests), `QueuePipe` on any message stream such as a gRPC bidi call (the services)."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from typing import Iterable, Iterator, Protocol


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

