from h3serve._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConditionParams(_message.Message):
    __slots__ = ("request_id", "task", "width", "height", "kinds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task: str
    width: int
    height: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., task: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class ConditionInput(_message.Message):
    __slots__ = ("params", "chunk", "end")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    params: ConditionParams
    chunk: _common_pb2.TensorChunk
    end: _common_pb2.StreamEnd
    def __init__(self, params: _Optional[_Union[ConditionParams, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class ConditionDone(_message.Message):
    __slots__ = ("seconds", "peak_memory_mb")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    peak_memory_mb: float
    def __init__(self, seconds: _Optional[float] = ..., peak_memory_mb: _Optional[float] = ...) -> None: ...

class ConditionEvent(_message.Message):
    __slots__ = ("chunk", "done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorChunk
    done: ConditionDone
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[ConditionDone, _Mapping]] = ...) -> None: ...

class DecodeParams(_message.Message):
    __slots__ = ("request_id", "sink", "num_frames", "width", "height", "latents_transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENTS_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sink: _common_pb2.Sink
    num_frames: int
    width: int
    height: int
    latents_transport: str
    def __init__(self, request_id: _Optional[str] = ..., sink: _Optional[_Union[_common_pb2.Sink, _Mapping]] = ..., num_frames: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., latents_transport: _Optional[str] = ...) -> None: ...

class LatentsSession(_message.Message):
    __slots__ = ("address", "session_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    session_id: str
    def __init__(self, address: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class LatentsControl(_message.Message):
    __slots__ = ("session_id", "transport", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transport: str
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., transport: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class DecodeInput(_message.Message):
    __slots__ = ("params", "chunk", "end")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    params: DecodeParams
    chunk: _common_pb2.TensorChunk
    end: _common_pb2.StreamEnd
    def __init__(self, params: _Optional[_Union[DecodeParams, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class ClipSent(_message.Message):
    __slots__ = ("index", "first_frame", "frames", "clips", "bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    CLIPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    first_frame: int
    frames: int
    clips: int
    bytes: int
    def __init__(self, index: _Optional[int] = ..., first_frame: _Optional[int] = ..., frames: _Optional[int] = ..., clips: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DecodeDone(_message.Message):
    __slots__ = ("frames", "pcm_samples", "video_seconds", "audio_seconds", "sink_tail_seconds", "bytes_sent", "transport", "latents_transport", "peak_memory_mb")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PCM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VIDEO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SINK_TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LATENTS_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    frames: int
    pcm_samples: int
    video_seconds: float
    audio_seconds: float
    sink_tail_seconds: float
    bytes_sent: int
    transport: _common_pb2.TransportInfo
    latents_transport: _common_pb2.TransportInfo
    peak_memory_mb: float
    def __init__(self, frames: _Optional[int] = ..., pcm_samples: _Optional[int] = ..., video_seconds: _Optional[float] = ..., audio_seconds: _Optional[float] = ..., sink_tail_seconds: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., transport: _Optional[_Union[_common_pb2.TransportInfo, _Mapping]] = ..., latents_transport: _Optional[_Union[_common_pb2.TransportInfo, _Mapping]] = ..., peak_memory_mb: _Optional[float] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("clip", "done", "latents")
    CLIP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    clip: ClipSent
    done: DecodeDone
    latents: LatentsSession
    def __init__(self, clip: _Optional[_Union[ClipSent, _Mapping]] = ..., done: _Optional[_Union[DecodeDone, _Mapping]] = ..., latents: _Optional[_Union[LatentsSession, _Mapping]] = ...) -> None: ...
