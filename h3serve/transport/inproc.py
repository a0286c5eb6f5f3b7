"""In-process transport: a bounded queue between two threads of one process (the embedded pipeline)."""

from __future__ import annotations

import queue

from h3serve.errors import TransportError
from h3serve.transport.base import Message, TensorHeader, TensorReceiver, TensorSender

_END = object()


class InProcChannel:
    """One ordered stream; `depth` bounds how many messages may wait (a slow consumer slows the producer)."""

    def __init__(self, depth: int = 4, edge: str = "inproc"):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.edge = edge
        self.sender = _Sender(self)
        self.receiver = _Receiver(self)


class _Sender(TensorSender):
    def __init__(self, ch: InProcChannel):
        self.ch = ch

    def send(self, name, tensor, meta=None, *, timeout=None):
        header = TensorHeader.of(name, tensor) if tensor is not None else None
        try:
            self.ch.queue.put(Message(header, tensor, dict(meta or {})), timeout=timeout)
        except queue.Full:
            raise TransportError(f"receiver did not drain within {timeout}s", edge=self.ch.edge) from None

    def close(self):
        self.ch.queue.put(_END)


class _Receiver(TensorReceiver):
    def __init__(self, ch: InProcChannel):
        self.ch = ch

    def recv(self, *, timeout=None):
        try:
            item = self.ch.queue.get(timeout=timeout)
        except queue.Empty:
            raise TransportError(f"no message within {timeout}s", edge=self.ch.edge) from None
        return None if item is _END else item
