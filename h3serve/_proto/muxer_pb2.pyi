from h3serve._proto import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControlMessage(_message.Message):
    __slots__ = ("session_id", "transport", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transport: str
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., transport: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "width", "height", "fps", "sample_rate", "channels", "expected_frames", "ttl_s", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    width: int
    height: int
    fps: int
    sample_rate: int
    channels: int
    expected_frames: int
    ttl_s: float
    transport: str
    def __init__(self, request_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., fps: _Optional[int] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., expected_frames: _Optional[int] = ..., ttl_s: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "address", "transport_metadata", "max_chunk_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    address: str
    transport_metadata: bytes
    max_chunk_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., address: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PushOpen(_message.Message):
    __slots__ = ("session_id", "transport", "transport_metadata")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transport: str
    transport_metadata: bytes
    def __init__(self, session_id: _Optional[str] = ..., transport: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("open", "chunk", "end")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    open: PushOpen
    chunk: _common_pb2.TensorChunk
    end: _common_pb2.StreamEnd
    def __init__(self, open: _Optional[_Union[PushOpen, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("frames", "audio_samples", "mp4_bytes", "encode_seconds", "tail_seconds")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MP4_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    frames: int
    audio_samples: int
    mp4_bytes: int
    encode_seconds: float
    tail_seconds: float
    def __init__(self, frames: _Optional[int] = ..., audio_samples: _Optional[int] = ..., mp4_bytes: _Optional[int] = ..., encode_seconds: _Optional[float] = ..., tail_seconds: _Optional[float] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Mp4Chunk(_message.Message):
    __slots__ = ("offset", "data", "total_bytes", "last")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_bytes: int
    last: bool
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
