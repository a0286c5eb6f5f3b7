from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "total_bytes", "data", "last", "meta_json", "transport_metadata")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    last: bool
    meta_json: str
    transport_metadata: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., meta_json: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    def __init__(self, tensors: _Optional[int] = ...) -> None: ...

class Sink(_message.Message):
    __slots__ = ("address", "session_id", "transport", "transport_metadata")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    address: str
    session_id: str
    transport: str
    transport_metadata: bytes
    def __init__(self, address: _Optional[str] = ..., session_id: _Optional[str] = ..., transport: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ...) -> None: ...

class TransportInfo(_message.Message):
    __slots__ = ("edge", "requested", "chosen", "reason")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    edge: str
    requested: str
    chosen: str
    reason: str
    def __init__(self, edge: _Optional[str] = ..., requested: _Optional[str] = ..., chosen: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("stage", "done", "total", "elapsed_s", "percent", "preview_jpeg")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_JPEG_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done: int
    total: int
    elapsed_s: float
    percent: float
    preview_jpeg: bytes
    def __init__(self, stage: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., percent: _Optional[float] = ..., preview_jpeg: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage", "ready", "pid", "requests_total", "cancelled_total", "work_units_total", "current_request_id", "last", "info_json")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORK_UNITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    stage: str
    ready: bool
    pid: int
    requests_total: int
    cancelled_total: int
    work_units_total: int
    current_request_id: str
    last: LastRequest
    info_json: str
    def __init__(self, stage: _Optional[str] = ..., ready: _Optional[bool] = ..., pid: _Optional[int] = ..., requests_total: _Optional[int] = ..., cancelled_total: _Optional[int] = ..., work_units_total: _Optional[int] = ..., current_request_id: _Optional[str] = ..., last: _Optional[_Union[LastRequest, _Mapping]] = ..., info_json: _Optional[str] = ...) -> None: ...

class LastRequest(_message.Message):
    __slots__ = ("request_id", "outcome", "units_done", "units_at_signal", "deadline_remaining_s", "seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    UNITS_DONE_FIELD_NUMBER: _ClassVar[int]
    UNITS_AT_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: str
    units_done: int
    units_at_signal: int
    deadline_remaining_s: float
    seconds: float
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[str] = ..., units_done: _Optional[int] = ..., units_at_signal: _Optional[int] = ..., deadline_remaining_s: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...
