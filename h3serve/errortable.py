"""The one error table of the service layer: domain errors <-> gRPC status codes <-> HTTP statuses.

Every servicer (stage or gateway), the HTTP API and the SDK go through this module, so a failure has the same
name everywhere:

    domain error                code (stable)       gRPC status           HTTP   retry
    AlreadyExists               already_exists      ALREADY_EXISTS        409    no    (names the id's field)
    RequestError                invalid_request     INVALID_ARGUMENT      400    no    (names the field)
    ProfileError                invalid_request     FAILED_PRECONDITION   400    no
    QuotaExceeded               quota_exceeded      RESOURCE_EXHAUSTED    429    yes   (names the caller's limit)
    QueueFull                   queue_full          RESOURCE_EXHAUSTED    429    yes   (refused at once)
    TooLarge                    too_large           RESOURCE_EXHAUSTED    413    no
    Draining                    draining            UNAVAILABLE           503    yes
    StageUnavailable            stage_unavailable   UNAVAILABLE           503    yes   (names the stage)
    TransportError              stage_unavailable   UNAVAILABLE           503    yes
    DeadlineExceeded            deadline_exceeded   DEADLINE_EXCEEDED     504    yes
    Cancelled                   cancelled           CANCELLED             499    no
    Unauthenticated             unauthenticated     UNAUTHENTICATED       401    no    (no or unknown API key)
    PermissionDenied            permission_denied   PERMISSION_DENIED     403    no    (another caller's job)
    NotFound                    not_found           NOT_FOUND             404    no
    NotReady                    not_ready           FAILED_PRECONDITION   409    yes
    StageFailed                 stage_failed        INTERNAL              500    no    (names the stage)
    MediaError                  media_error         INTERNAL              500    no
    anything else               internal            INTERNAL              500    no

On the wire a gRPC error carries its details in the status message and, machine-readably, in trailing metadata:
`h3serve-code`, `h3serve-field`, `h3serve-stage`. HTTP errors are `{"error": {"code", "message", "field",
"param", "stage", "retryable"}}` (`param` is the OpenAI spelling of the field).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any

import grpc

from h3serve.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    Draining,
    H3Error,
    InvalidRequest,
    MediaError,
    NotFound,
    NotReady,
    PermissionDenied,
    ProfileError,
    QueueFull,
    QuotaExceeded,
    RequestError,
    ServiceError,
    StageFailed,
    StageUnavailable,
    TooLarge,
    TransportError,
    Unauthenticated,
)

log = logging.getLogger("h3serve.errors")

MD_CODE, MD_FIELD, MD_STAGE = "h3serve-code", "h3serve-field", "h3serve-stage"


# ---------------------------------------------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class ErrorKind:
    code: str
    grpc: grpc.StatusCode
    http: int
    retryable: bool


_KINDS = {
    "already_exists": ErrorKind("already_exists", grpc.StatusCode.ALREADY_EXISTS, 409, False),
    "invalid_request": ErrorKind("invalid_request", grpc.StatusCode.INVALID_ARGUMENT, 400, False),
    "profile": ErrorKind("invalid_request", grpc.StatusCode.FAILED_PRECONDITION, 400, False),
    "quota_exceeded": ErrorKind("quota_exceeded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, True),
    "queue_full": ErrorKind("queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED, 429, True),
    "too_large": ErrorKind("too_large", grpc.StatusCode.RESOURCE_EXHAUSTED, 413, False),
    "draining": ErrorKind("draining", grpc.StatusCode.UNAVAILABLE, 503, True),
    "stage_unavailable": ErrorKind("stage_unavailable", grpc.StatusCode.UNAVAILABLE, 503, True),
    "deadline_exceeded": ErrorKind("deadline_exceeded", grpc.StatusCode.DEADLINE_EXCEEDED, 504, True),
    "cancelled": ErrorKind("cancelled", grpc.StatusCode.CANCELLED, 499, False),
    "unauthenticated": ErrorKind("unauthenticated", grpc.StatusCode.UNAUTHENTICATED, 401, False),
    "permission_denied": ErrorKind("permission_denied", grpc.StatusCode.PERMISSION_DENIED, 403, False),
    "not_found": ErrorKind("not_found", grpc.StatusCode.NOT_FOUND, 404, False),
    "not_ready": ErrorKind("not_ready", grpc.StatusCode.FAILED_PRECONDITION, 409, True),
    "stage_failed": ErrorKind("stage_failed", grpc.StatusCode.INTERNAL, 500, False),
    "media_error": ErrorKind("media_error", grpc.StatusCode.INTERNAL, 500, False),
    "internal": ErrorKind("internal", grpc.StatusCode.INTERNAL, 500, False),
}

# (exception class, kind); the first match wins, so subclasses come before their bases.
TABLE: list[tuple[type, ErrorKind]] = [
    (AlreadyExists, _KINDS["already_exists"]),
    (RequestError, _KINDS["invalid_request"]),
    (ProfileError, _KINDS["profile"]),
    (QuotaExceeded, _KINDS["quota_exceeded"]),
    (QueueFull, _KINDS["queue_full"]),
    (TooLarge, _KINDS["too_large"]),
    (Draining, _KINDS["draining"]),
    (StageUnavailable, _KINDS["stage_unavailable"]),
    (TransportError, _KINDS["stage_unavailable"]),
    (DeadlineExceeded, _KINDS["deadline_exceeded"]),
    (Cancelled, _KINDS["cancelled"]),
    (Unauthenticated, _KINDS["unauthenticated"]),
    (PermissionDenied, _KINDS["permission_denied"]),
    (NotFound, _KINDS["not_found"]),
    (NotReady, _KINDS["not_ready"]),
    (StageFailed, _KINDS["stage_failed"]),
    (MediaError, _KINDS["media_error"]),
]
INTERNAL = _KINDS["internal"]


@dataclass(frozen=True)
class Classified:
    kind: ErrorKind
    message: str
    field: str | None
    stage: str | None


def classify(exc: BaseException, *, stage: str | None = None) -> Classified:
    """The kind of `exc`, its one-line message, the field it names and the stage it concerns."""
    for cls, kind in TABLE:
        if isinstance(exc, cls):
            break
    else:
        kind = INTERNAL
    field = getattr(exc, "field", None)
    if kind.code == "invalid_request" and field is None and isinstance(exc, ProfileError):
        field = "profile"
    exc_stage = getattr(exc, "stage", None)
    if exc_stage is None and isinstance(exc, TransportError):
        edge = getattr(exc, "edge", "") or ""
        exc_stage = edge.split("->")[-1] or None
    message = str(exc) if kind is not INTERNAL else f"internal error: {type(exc).__name__}: {exc}"
    return Classified(kind, message, field, exc_stage or stage)


# ---------------------------------------------------------------------------------------------------------------
# gRPC side

def abort(context: grpc.ServicerContext, exc: BaseException, *, stage: str | None = None):
    """End an RPC with the status the table gives `exc` (raises, as `context.abort` does)."""
    c = classify(exc, stage=stage)
    try:
        gone = not context.is_active()   # the caller left or its deadline passed: nobody hears, nothing failed here
    except Exception:  # noqa: BLE001
        gone = False
    if gone:
        log.info("%s: %s (after the call had ended)", stage or "server", c.message)
    elif c.kind is INTERNAL or c.kind.code in ("stage_failed", "media_error"):
        log.error("%s: %s", stage or "server", c.message, exc_info=exc)
    md = [(MD_CODE, c.kind.code)]
    if c.field:
        md.append((MD_FIELD, str(c.field)))
    if c.stage:
        md.append((MD_STAGE, c.stage))
    try:
        context.set_trailing_metadata(md)
    except Exception:  # noqa: BLE001 - the call may already be gone
        pass
    context.abort(c.kind.grpc, c.message[:4000])


def grpc_method(stage: str | None):
    """Decorate a servicer method (unary or server-streaming generator) so every exception leaves through the
    table. `grpc.RpcError`s raised by `context.abort` pass through unchanged."""

    def deco(fn):
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def stream(self, request, context):
                try:
                    yield from fn(self, request, context)
                except Exception as exc:  # noqa: BLE001 - the table decides
                    if _is_abort(exc):
                        raise
                    abort(context, exc, stage=stage)
            return stream

        @functools.wraps(fn)
        def unary(self, request, context):
            try:
                return fn(self, request, context)
            except Exception as exc:  # noqa: BLE001
                if _is_abort(exc):
                    raise
                abort(context, exc, stage=stage)
        return unary

    return deco


class _Unparsed:
    """A request message whose bytes did not parse (kept to be refused inside the call)."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class RefuseUnparsable(grpc.ServerInterceptor):
    """A request whose bytes do not parse as its message is the caller's bad input: INVALID_ARGUMENT naming
    `request`, through the table (grpc itself answers INTERNAL "Exception deserializing request!"). In a request
    stream the unparsable message raises RequestError where the servicer reads it."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def safe(data):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - refused in the call, below
                return _Unparsed(exc)

        def refused(exc: BaseException) -> RequestError:
            return RequestError("request", None, f"a message of {method} in the protobuf wire format "
                                                 f"({type(exc).__name__}: {exc})")

        if handler.request_streaming:
            inner = handler.stream_unary or handler.stream_stream

            def checked(requests):
                for msg in requests:
                    if isinstance(msg, _Unparsed):
                        raise refused(msg.exc)
                    yield msg

            def behavior(requests, context):
                return inner(checked(requests), context)
        else:
            inner = handler.unary_unary or handler.unary_stream

            def behavior(request, context):
                if isinstance(request, _Unparsed):
                    abort(context, refused(request.exc))
                return inner(request, context)

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                      handler.response_streaming)]
        return make(behavior, request_deserializer=safe, response_serializer=handler.response_serializer)


def _is_abort(exc: BaseException) -> bool:
    # grpc's context.abort() raises a bare `Exception()` after recording the status: let it through untouched
    return type(exc) is Exception and not exc.args


def _metadata(err: grpc.RpcError) -> dict[str, str]:
    try:
        md = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001
        md = ()
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in md}


def named_code(err: grpc.RpcError) -> str | None:
    """The table's code a failed call's callee named (its trailing metadata), or None: the status came from gRPC
    itself (no connection, a dropped stream, a message over a limit)."""
    return _metadata(err).get(MD_CODE)


# gRPC's own refusal of a message over its limit ("Sent message larger than max (N vs. M)" or "Received ...")
_OVER_LIMIT = re.compile(r"(Sent|Received) message larger than max \((\d+) vs\. (\d+)\)")


def too_large_message(size: int, limit: int, what: str) -> str:
    return (f"{what} is {size} bytes ({size / (1 << 20):.1f} MiB), more than the gRPC message limit of "
            f"{limit} bytes ({limit / (1 << 20):.0f} MiB); send large files through the HTTP API (docs/api.md)")


def from_grpc(err: grpc.RpcError, *, stage: str | None = None, cancelled: bool = False) -> H3Error:
    """The domain error for a failed call. `stage` names the callee (used when the status does not name one);
    `cancelled` says the caller itself cancelled the call (then the result is `Cancelled`, whatever the code)."""
    try:
        code, details = err.code(), err.details() or ""
    except Exception:  # noqa: BLE001 - not a call error
        return StageFailed(stage or "server", str(err))
    md = _metadata(err)
    named = md.get(MD_CODE)
    field = md.get(MD_FIELD)
    where = md.get(MD_STAGE) or stage
    if cancelled:
        return Cancelled(details or "cancelled by the caller")
    if named == "cancelled":   # the callee says the request was cancelled (e.g. by id, by another caller)
        return Cancelled(details or "cancelled")
    if named == "already_exists" or code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(field or "request_id", None, message=details)
    if named == "invalid_request" and code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(field or "request", details)
    if named == "invalid_request":
        return ProfileError(details)
    if named == "quota_exceeded":   # the caller's limit (its Retry-After is HTTP's)
        return QuotaExceeded(field or "quota", details, retry_after_s=0)
    if named == "queue_full":
        return QueueFull(details, stage=where)
    if named == "too_large":
        return TooLarge(details, stage=where)
    if named == "draining":
        return Draining(details, stage=where)
    if named == "not_found":
        return NotFound(details, stage=where)
    if named == "unauthenticated" or code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details or "unauthenticated", stage=where)
    if named == "permission_denied" or code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(details or "permission denied", stage=where)
    if named == "not_ready":
        return NotReady(details, stage=where)
    if named in ("stage_failed", "media_error", "internal"):
        return _keep_message(StageFailed(where or "server", details), details)
    if named == "stage_unavailable" or code == grpc.StatusCode.UNAVAILABLE:
        return _keep_message(StageUnavailable(where or "server", details), details, where)
    if named == "deadline_exceeded" or code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(details or "deadline exceeded", stage=where)
    if code == grpc.StatusCode.CANCELLED:
        # the callee went away or gave up without us asking: to the caller it is unavailable
        return StageUnavailable(where or "server", details or "the call was cancelled by the server")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(field or "request", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        over = _OVER_LIMIT.search(details)
        if over:   # not a full queue: the message itself is too large, and sending it again cannot help
            return TooLarge(too_large_message(int(over.group(2)), int(over.group(3)), "the message"), stage=where)
        return QueueFull(details, stage=where)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details, stage=where)
    return StageFailed(where or "server", f"{code.name}: {details}")


def _keep_message(exc: ServiceError, details: str, where: str | None = None) -> ServiceError:
    """Use the callee's message as is when it already starts with the stage's name (no 'vae: vae: ...')."""
    stage = exc.stage
    if details and stage and details.startswith(f"{stage}:"):
        exc.args = (details,)
    return exc


# ---------------------------------------------------------------------------------------------------------------
# HTTP side

def http_error(exc: BaseException, *, stage: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) for `exc`."""
    c = classify(exc, stage=stage)
    if c.kind is INTERNAL:
        log.error("http: %s", c.message, exc_info=exc)
    return c.kind.http, {"error": error_object(c)}


def error_object(c: Classified) -> dict[str, Any]:
    return {"code": c.kind.code, "message": c.message, "field": c.field, "param": c.field, "stage": c.stage,
            "retryable": c.kind.retryable}
