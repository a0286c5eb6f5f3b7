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


class AdaLNTableError(CheckpointError):
    """An AdaLN table file is refused: made for another key, or its tensors do not match its recorded sha256."""


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


# Service-layer errors: a stage or the gateway refuses, sheds or loses a request

class ServiceError(H3Error):
    """A service-layer failure; `stage` names the stage it concerns, when one does."""

    def __init__(self, message: str, *, stage: str | None = None):
        self.stage = stage
        super().__init__(message)


class QueueFull(ServiceError):
    """The admission queue is full; retry later or elsewhere."""


class QuotaExceeded(QueueFull):
    """The caller is at one of its limits (`limit`, the field errors name); retry after `retry_after_s`."""

    def __init__(self, limit: str, message: str, *, retry_after_s: int):
        self.field = limit
        self.retry_after_s = retry_after_s
        super().__init__(message)


class TooLarge(ServiceError):
    """The result exceeds a configured size limit (e.g. the sync response limit)."""


class Draining(ServiceError):
    """The server is shutting down and admits nothing new."""


class StageUnavailable(ServiceError):
    """A stage is down, not ready, or died while working on the request."""

    def __init__(self, stage: str, message: str = ""):
        super().__init__(f"{stage}: stage unavailable" + (f": {message}" if message else ""), stage=stage)


class StageFailed(ServiceError):
    """A stage failed on the request for a reason other than being unavailable."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}", stage=stage)


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it finished."""


class Unauthenticated(ServiceError):
    """The call carries no API key, or one the server does not know."""


class PermissionDenied(ServiceError):
    """The caller is known but may not touch this resource (another caller's job)."""


class NotFound(ServiceError):
    """No such request / job / session."""


class NotReady(ServiceError):
    """The resource exists but is not ready yet (e.g. a job's content before it completed)."""


class AlreadyExists(RequestError):
    """An id the caller chose that a job already has (a gRPC `request_id`); names the field, never whose job it is.
    `message` rebuilds it from the wire."""

    def __init__(self, field: str, value: object,
                 allowed: str = "an id no job has: choose another, or leave it out and the gateway mints one", *,
                 message: str | None = None):
        super().__init__(field, value, allowed)
        if message is not None:
            self.args = (message,)


class InvalidRequest(RequestError):
    """A RequestError rebuilt from the wire (field and message known, value and allowed not separately)."""

    def __init__(self, field: str, message: str):
        self.field, self.value, self.allowed = field, None, message
        H3Error.__init__(self, message)
