"""What crosses the control pipe: the receiver's handshake (agent metadata + slot descriptors), the control
messages (a JSON head plus an optional inline payload), and tensor headers; plus the byte views both ends use."""

from __future__ import annotations

import json
import struct

import torch

from h3serve.errors import TransportError
from h3serve.transport.base import WIRE_DTYPES, TensorHeader

_HS_MAGIC = b"H3NX"
_HS_VERSION = 1
_LEN = struct.Struct("!I")


def encode_handshake(info: dict, metadata: bytes = b"") -> bytes:
    head = json.dumps(info, separators=(",", ":")).encode()
    return b"".join((_HS_MAGIC, bytes([_HS_VERSION]), _LEN.pack(len(head)), head, metadata))


def decode_handshake(data: bytes) -> tuple[dict, bytes]:
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:4]) != _HS_MAGIC:
        raise ValueError("not an h3serve NIXL handshake")
    if data[4] != _HS_VERSION:
        raise ValueError(f"handshake version {data[4]} (this side speaks {_HS_VERSION})")
    (n,) = _LEN.unpack_from(data, 5)
    info = json.loads(bytes(data[9:9 + n]))
    return info, bytes(data[9 + n:])


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes on its own device (contiguous copy only if needed)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def from_bytes(header: TensorHeader, flat: torch.Tensor) -> torch.Tensor:
    return flat.view(WIRE_DTYPES[header.dtype]).reshape(header.shape)


def header_json(h: TensorHeader) -> list:
    return [h.name, h.dtype, list(h.shape)]


def header_from(obj, edge: str) -> TensorHeader:
    try:
        name, dtype, shape = obj
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype {dtype!r}")
        return TensorHeader(str(name), dtype, tuple(int(s) for s in shape))
    except Exception as e:
        raise TransportError(f"malformed tensor header {obj!r}: {e}", edge=edge) from None


def pack_message(obj: dict, payload: bytes | memoryview = b"") -> bytes:
    head = json.dumps(obj, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, payload))


def unpack_message(data: bytes) -> tuple[dict, memoryview]:
    try:
        (n,) = _LEN.unpack_from(data)
        obj = json.loads(bytes(data[4:4 + n]))
        if not isinstance(obj, dict) or "t" not in obj:
            raise ValueError("not a control message")
    except Exception as e:
        raise ValueError(f"malformed control message: {e}") from None
    return obj, memoryview(data)[4 + n:]
