"""The tensor transport seam between stages.

A stage hands tensors to the next one through a `TensorSender`, which the next stage drains through a
`TensorReceiver`. Implementations: in-process (`inproc.py`, a bounded queue), gRPC byte streams (always
available), NIXL (UCX: RDMA / shared memory / TCP) where peers can register memory. Transport code knows no model:
it moves named, typed, shaped byte buffers plus a small JSON-able `meta` dict, in order, with back-pressure.

Wire description of one tensor (what a gRPC message or a NIXL descriptor carries besides the bytes):
    TensorHeader(name, dtype, shape)  -- dtype is a torch dtype name without the prefix ("uint8", "float32", ...)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from h3serve.errors import TransportError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=WIRE_DTYPES[self.dtype]).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorHeader":
        if tensor.dtype not in DTYPE_NAMES:
            raise TransportError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        return cls(name, DTYPE_NAMES[tensor.dtype], tuple(int(s) for s in tensor.shape))


@dataclass
class Message:
    """One unit on a stream: a tensor (or none, for control-only items such as end-of-stream) plus metadata."""

    header: TensorHeader | None
    tensor: torch.Tensor | None
    meta: dict[str, Any] = field(default_factory=dict)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a tensor as a zero-copy memoryview of a contiguous CPU tensor (bf16 viewed as raw 16-bit)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.numel() == 0:
        return memoryview(b"")  # numpy refuses to cast a view with a zero in its shape
    return memoryview(t.numpy()).cast("B")


def tensor_from_bytes(header: TensorHeader, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """Inverse of `tensor_bytes`; validates the byte count against the header."""
    if len(data) != header.nbytes:
        raise TransportError(f"tensor {header.name!r}: got {len(data)} bytes, header says {header.nbytes}")
    dtype = WIRE_DTYPES[header.dtype]
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    t = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=raw_dtype)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(header.shape)


class TensorSender(abc.ABC):
    """Sends messages in order; `send` blocks when the receiver is `depth` messages behind (back-pressure)."""

    @abc.abstractmethod
    def send(self, name: str, tensor: torch.Tensor | None, meta: dict | None = None, *,
             timeout: float | None = None) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """End of stream: the receiver's iteration ends after the last message."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TensorReceiver(abc.ABC):
    """Yields messages in the order they were sent; raises TransportError if the sender dies or times out."""

    @abc.abstractmethod
    def recv(self, *, timeout: float | None = None) -> Message | None:
        """The next message, or None at end of stream."""

    def __iter__(self):
        while True:
            msg = self.recv()
            if msg is None:
                return
            yield msg
