from h3serve._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "task")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    task: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class EncodeParams(_message.Message):
    __slots__ = ("request_id", "prompt", "task", "width", "height", "kinds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    task: str
    width: int
    height: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., task: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class EncodeInput(_message.Message):
    __slots__ = ("params", "chunk", "end")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    params: EncodeParams
    chunk: _common_pb2.TensorChunk
    end: _common_pb2.StreamEnd
    def __init__(self, params: _Optional[_Union[EncodeParams, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class EncodeEvent(_message.Message):
    __slots__ = ("chunk", "done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorChunk
    done: EncodeDone
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[EncodeDone, _Mapping]] = ...) -> None: ...

class EncodeDone(_message.Message):
    __slots__ = ("tokens", "seconds", "peak_memory_mb", "cache_hit")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    seconds: float
    peak_memory_mb: float
    cache_hit: bool
    def __init__(self, tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., peak_memory_mb: _Optional[float] = ..., cache_hit: _Optional[bool] = ...) -> None: ...
