"""The safetensors file format with torch: dtype codes and reproducible writes (headers and checksums, which need no
torch, are read by `h3serve.weights.headers`).

A file is an 8-byte little-endian header length, a JSON header (`__metadata__` plus, per tensor, its dtype code,
shape and data offsets) padded to 8 bytes, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# Stored dtypes a float weight (of a checkpoint or an adapter) may have.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def st_dtype(code: str) -> torch.dtype | str:
    """The torch dtype of a header's dtype code; an unknown code is returned as is (for messages)."""
    return SAFETENSORS_DTYPES.get(code, code)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The bytes before the data: header length, then the JSON header of `(name, dtype, shape)` tensors stored back
    to back in the order given, metadata keys sorted, padded to 8 bytes."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(metadata[k]) for k in sorted(metadata)}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPE_CODES:
            raise TypeError(f"tensor '{name}': dtype {dtype} cannot be stored in safetensors")
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= int(s)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file byte-for-byte reproducibly (sorted names, sorted metadata), one tensor at a time.

    `safetensors.torch.save_file` orders `__metadata__` by a hash map, so two identical saves can differ in bytes.
    """
    names = sorted(tensors)
    head = encode_header(((n, tensors[n].dtype, tensors[n].shape) for n in names), metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
