from h3serve._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DiTParams(_message.Message):
    __slots__ = ("request_id", "latent_frames", "latent_height", "latent_width", "audio_latents", "seed", "task", "profile", "steps", "latents_sink", "condition_kinds", "quality", "preview_every", "lora", "lora_scale")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LATENT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LATENT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    AUDIO_LATENTS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LATENTS_SINK_FIELD_NUMBER: _ClassVar[int]
    CONDITION_KINDS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_SCALE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    seed: int
    task: str
    profile: str
    steps: int
    latents_sink: _common_pb2.Sink
    condition_kinds: _containers.RepeatedScalarFieldContainer[str]
    quality: str
    preview_every: int
    lora: str
    lora_scale: float
    def __init__(self, request_id: _Optional[str] = ..., latent_frames: _Optional[int] = ..., latent_height: _Optional[int] = ..., latent_width: _Optional[int] = ..., audio_latents: _Optional[int] = ..., seed: _Optional[int] = ..., task: _Optional[str] = ..., profile: _Optional[str] = ..., steps: _Optional[int] = ..., latents_sink: _Optional[_Union[_common_pb2.Sink, _Mapping]] = ..., condition_kinds: _Optional[_Iterable[str]] = ..., quality: _Optional[str] = ..., preview_every: _Optional[int] = ..., lora: _Optional[str] = ..., lora_scale: _Optional[float] = ...) -> None: ...

class DiTInput(_message.Message):
    __slots__ = ("params", "chunk", "end")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    params: DiTParams
    chunk: _common_pb2.TensorChunk
    end: _common_pb2.StreamEnd
    def __init__(self, params: _Optional[_Union[DiTParams, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class DiTEvent(_message.Message):
    __slots__ = ("progress", "chunk", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.Progress
    chunk: _common_pb2.TensorChunk
    done: DiTDone
    def __init__(self, progress: _Optional[_Union[_common_pb2.Progress, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ..., done: _Optional[_Union[DiTDone, _Mapping]] = ...) -> None: ...

class DiTDone(_message.Message):
    __slots__ = ("steps", "seconds", "step_seconds", "transport", "peak_memory_mb", "forwards_computed", "block_evaluations")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    seconds: float
    step_seconds: _containers.RepeatedScalarFieldContainer[float]
    transport: _common_pb2.TransportInfo
    peak_memory_mb: float
    forwards_computed: int
    block_evaluations: int
    def __init__(self, steps: _Optional[int] = ..., seconds: _Optional[float] = ..., step_seconds: _Optional[_Iterable[float]] = ..., transport: _Optional[_Union[_common_pb2.TransportInfo, _Mapping]] = ..., peak_memory_mb: _Optional[float] = ..., forwards_computed: _Optional[int] = ..., block_evaluations: _Optional[int] = ...) -> None: ...
