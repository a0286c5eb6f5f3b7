from h3serve._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamContentRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ContentChunk(_message.Message):
    __slots__ = ("data", "offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "seconds", "size", "width", "height", "num_frames", "fps", "seed", "num_inference_steps", "task", "quality", "model", "request_id", "validate_only", "first_image", "last_image", "references", "preview_every", "lora")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    FIRST_IMAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_IMAGE_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    seconds: float
    size: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    num_inference_steps: int
    task: str
    quality: str
    model: str
    request_id: str
    validate_only: bool
    first_image: bytes
    last_image: bytes
    references: _containers.RepeatedCompositeFieldContainer[MediaReference]
    preview_every: int
    lora: LoraRef
    def __init__(self, prompt: _Optional[str] = ..., seconds: _Optional[float] = ..., size: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., seed: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., task: _Optional[str] = ..., quality: _Optional[str] = ..., model: _Optional[str] = ..., request_id: _Optional[str] = ..., validate_only: _Optional[bool] = ..., first_image: _Optional[bytes] = ..., last_image: _Optional[bytes] = ..., references: _Optional[_Iterable[_Union[MediaReference, _Mapping]]] = ..., preview_every: _Optional[int] = ..., lora: _Optional[_Union[LoraRef, _Mapping]] = ...) -> None: ...

class LoraRef(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class MediaReference(_message.Message):
    __slots__ = ("kind", "data", "filename")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    kind: str
    data: bytes
    filename: str
    def __init__(self, kind: _Optional[str] = ..., data: _Optional[bytes] = ..., filename: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "num_frames", "width", "height", "fps", "seed", "num_inference_steps", "task", "profile", "media_seconds", "queue_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_frames: int
    width: int
    height: int
    fps: int
    seed: int
    num_inference_steps: int
    task: str
    profile: str
    media_seconds: float
    queue_position: int
    def __init__(self, request_id: _Optional[str] = ..., num_frames: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., fps: _Optional[int] = ..., seed: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., task: _Optional[str] = ..., profile: _Optional[str] = ..., media_seconds: _Optional[float] = ..., queue_position: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("request_id", "mp4_bytes", "sha256", "timings")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MP4_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mp4_bytes: int
    sha256: str
    timings: _containers.ScalarMap[str, float]
    def __init__(self, request_id: _Optional[str] = ..., mp4_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., timings: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("accepted", "progress", "mp4", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MP4_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    progress: _common_pb2.Progress
    mp4: Mp4Data
    done: Done
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., mp4: _Optional[_Union[Mp4Data, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ...) -> None: ...

class Mp4Data(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("accepted", "done", "mp4")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MP4_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    done: Done
    mp4: bytes
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., mp4: _Optional[bytes] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled", "status", "error_code")
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    status: str
    error_code: str
    def __init__(self, cancelled: _Optional[bool] = ..., status: _Optional[str] = ..., error_code: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "profile", "dtype", "max_inflight", "queue_size", "max_sync_bytes", "max_message_bytes", "stages", "draining")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SYNC_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model: str
    profile: str
    dtype: str
    max_inflight: int
    queue_size: int
    max_sync_bytes: int
    max_message_bytes: int
    stages: _containers.ScalarMap[str, str]
    draining: bool
    def __init__(self, model: _Optional[str] = ..., profile: _Optional[str] = ..., dtype: _Optional[str] = ..., max_inflight: _Optional[int] = ..., queue_size: _Optional[int] = ..., max_sync_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., stages: _Optional[_Mapping[str, str]] = ..., draining: _Optional[bool] = ...) -> None: ...
