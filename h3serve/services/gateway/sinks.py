"""Where a job's MP4 goes: into its event stream (gRPC Generate), into memory (GenerateSync), or into a file of the
jobs directory (HTTP jobs). A sink sees `begin(total)`, then `write(offset, data)` per chunk fetched from the muxer,
then `commit()` once the job completed or `abort()` once it failed."""

from __future__ import annotations

import os
from typing import Callable, Protocol

from h3serve._proto import gateway_pb2
from h3serve.errors import TooLarge

from .store import disk_error

class Sink(Protocol):
    def begin(self, total: int) -> None: ...

    def write(self, offset: int, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class StreamSink:
    """MP4 chunks into the job's event stream (gRPC Generate); `emit` is the job's (it blocks on a slow reader)."""

    def __init__(self, emit: Callable[[object], None]):
        self.emit = emit

    def begin(self, total: int) -> None:
        pass

    def write(self, offset: int, data: bytes) -> None:
        self.emit(gateway_pb2.GenerateEvent(mp4=gateway_pb2.Mp4Data(offset=offset, data=data)))

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class BytesSink:
    """The whole MP4 in memory (GenerateSync, HTTP sync), refused past `limit` bytes."""

    def __init__(self, limit: int):
        self.limit = limit
        self.buf = bytearray()

    def begin(self, total: int) -> None:
        if total > self.limit:
            raise TooLarge(f"the MP4 is {total} bytes, more than the sync limit of {self.limit}; use the streaming "
                           "call (Generate) or the async job API")

    def write(self, offset: int, data: bytes) -> None:
        self.buf += data

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self.buf = bytearray()


class FileSink:
    """The MP4 into a file of the jobs directory, written as .part and renamed when complete (HTTP jobs)."""

    def __init__(self, path: str):
        self.path = path
        self.part = path + ".part"
        self.f = None

    def begin(self, total: int) -> None:
        try:
            self.f = open(self.part, "wb")
        except OSError as exc:
            raise disk_error("write the MP4", os.path.dirname(self.path), exc) from None

    def write(self, offset: int, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as exc:   # a full disk: the job fails retryable, naming the job store
            raise disk_error("write the MP4", os.path.dirname(self.path), exc) from None

    def commit(self) -> None:
        """Flushed and fsynced before the rename: a record that says completed never names a torn MP4."""
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.part, self.path)
        except OSError as exc:
            raise disk_error("write the MP4", os.path.dirname(self.path), exc) from None

    def abort(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError:   # the buffered rest could not be written either: the file goes anyway
                pass
        for p in (self.part, self.path):
            unlink(p)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
