"""The safetensors file format: dtype codes, headers read without the data, reproducible writes, file checksums.

A file is an 8-byte little-endian header length, a JSON header (`__metadata__` plus, per tensor, its dtype code,
shape and data offsets) padded to 8 bytes, then the tensors' bytes back to back.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.errors import CheckpointError

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


def sha256_file(path: str | os.PathLike, *, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def open_file(path: Path, label: str | None = None):
    """`safe_open` on the CPU; a missing or unreadable file raises CheckpointError naming `label` (default: path)."""
    label = label or str(path)
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{label}: not a readable safetensors file: {exc}") from exc


def header_keys(path: Path, label: str | None = None) -> list[str]:
    with open_file(path, label) as f:
        return list(f.keys())


def data_offsets(path: Path) -> dict[str, int]:
    """Tensor name -> start offset of its data, from the raw header (to read a file front to back)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


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
