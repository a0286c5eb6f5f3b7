"""Every domain error of h3serve (the error table `h3serve.errortable` maps them to gRPC / HTTP status)."""

from __future__ import annotations


class H3Error(Exception):
    """Base of every error h3serve reports to a user: one line, no traceback."""


class RequestError(H3Error, ValueError):
    """A request field is out of range. Names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")


class CheckpointError(H3Error):
    """A checkpoint folder or adapter file is incomplete, corrupt or does not match the model."""


class AdapterError(CheckpointError):
    """A FastH3 adapter is refused (checksum, format, VSA-only tensors, wrong target)."""


class ProfileError(H3Error):
    """A request or option is not allowed under the chosen profile (e.g. FastH3 is T2VA only)."""


class MediaError(H3Error):
    """An MP4 failed a media check (codec, sample rate, frame count, silence, ...)."""


class Cancelled(H3Error):
    """The caller cancelled a request (or its deadline passed) before it finished; no partial result is returned."""


class TransportError(H3Error):
    """A transfer failed: peer gone, timeout, malformed header. `edge` names the hop (e.g. "vae->muxer")."""

    def __init__(self, message: str, *, edge: str = ""):
        self.edge = edge
        super().__init__(f"{edge}: {message}" if edge else message)


class MalformedStream(TransportError):
    """A tensor stream that breaks its own protocol (a chunk's dtype, shape, offset, size or meta; the end marker's
    count; a message out of place): the sender's mistake, not a broken link. `field` names the part, as
    RequestError does; a servicer receiving such a stream refuses it as the caller's bad input."""

    def __init__(self, field: str, value: object, message: str, *, edge: str = ""):
        self.field, self.value = field, value
        super().__init__(message, edge=edge)


class SenderStopped(TransportError):
    """The sender ended its stream without the end marker: it gave up (its abort) or died mid-stream."""


class RankFailed(H3Error):
    """A rank of a parallel stage died or stopped answering; the stage is unhealthy until restarted (a stage server
    reports it as `StageUnavailable`)."""
