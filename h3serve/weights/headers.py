"""Safetensors files read without torch: tensor names and data offsets from a file's header, file checksums.

A checkpoint folder is validated from these alone (`CheckpointFolder`), so `h3serve serve` checks one before torch
is imported; what reads tensors or their torch dtypes is `h3serve.weights.safetensors`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors import safe_open

from h3serve.errors import CheckpointError


def sha256_file(path: str | os.PathLike, *, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)   # hashlib releases the GIL on large buffers: files hash in parallel
    return digest.hexdigest()


def open_file(path: Path, label: str | None = None, *, framework: str = "pt"):
    """`safe_open` on the CPU; a missing or unreadable file raises CheckpointError naming `label` (default: path).
    The framework is what its tensors are read as ("pt": torch, imported by safetensors when the file opens)."""
    label = label or str(path)
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing")
    try:
        return safe_open(str(path), framework=framework, device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{label}: not a readable safetensors file: {exc}") from exc


def header_keys(path: Path, label: str | None = None) -> list[str]:
    # names only: opened as numpy, so that reading a header never imports torch
    with open_file(path, label, framework="numpy") as f:
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
