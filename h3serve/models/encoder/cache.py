"""The encoder's cache of encodings: prompt (+ conditions) -> text states and token roles, bounded in bytes, LRU.

The key is a sha256 over everything the output depends on: the checkpoint's identity (the text encoder's,
tokenizer's and processor's files: names, sizes, modification times; the pipeline config), the dtype, the layer
read, the reference short edge, the task, the canvas, the prompt, the condition kinds and each condition image's
bytes and shape. A hit returns the very tensors a miss stored (on the CPU), so the bytes sent are the miss's.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

IDENTITY_PARTS = ("text_encoder", "tokenizer", "processor")
PIPELINE_FILES = ("modular_model_index.json", "model_index.json")


def checkpoint_identity(root: str | os.PathLike) -> str:
    """sha256 of the encoder-relevant files of a checkpoint folder (relative name, size, mtime in ns)."""
    root = Path(root).resolve()
    h = hashlib.sha256(str(root).encode())
    files = [root / name for name in PIPELINE_FILES if (root / name).is_file()]
    for part in IDENTITY_PARTS:
        if (root / part).is_dir():
            files += sorted(p for p in (root / part).rglob("*") if p.is_file())
    for path in files:
        st = path.stat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _update(h, *parts) -> None:
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


def cache_key(*, identity: str, dtype: str, layer: int, short_edge: int, task: str, prompt: str, width: int = 0,
              height: int = 0, kinds: Sequence[str] = (), images: Sequence[torch.Tensor] = ()) -> str:
    """The key of one encoding; `images` are the visual conditions as sent ((H, W, 3) uint8, before the resize)."""
    h = hashlib.sha256()
    _update(h, "h3serve-encoder-cache-v1", identity, dtype, layer, short_edge, task, width, height, prompt,
            ",".join(kinds))
    for image in images:
        t = image.detach().cpu().contiguous()
        _update(h, str(t.dtype), "x".join(map(str, t.shape)), hashlib.sha256(t.numpy().tobytes()).digest())
    return h.hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class EncodeCache:
    """Byte-bounded LRU of (states, tags) on the CPU. Thread-safe. A capacity of 0 disables it."""

    def __init__(self, capacity_bytes: int):
        self.capacity = max(0, int(capacity_bytes))
        self._items: OrderedDict[str, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats(capacity_bytes=self.capacity)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0], item[1]

    def put(self, key: str, states: torch.Tensor, tags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store CPU copies (what is sent on a hit and on this miss alike); entries larger than the whole cache
        are not kept. Returns the stored tensors."""
        states, tags = states.detach().cpu().contiguous(), tags.detach().cpu().contiguous()
        size = states.numel() * states.element_size() + tags.numel() * tags.element_size()
        if size > self.capacity:
            return states, tags
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[2]
            self._items[key] = (states, tags, size)
            self.stats.bytes += size
            while self.stats.bytes > self.capacity:
                _, (_, _, freed) = self._items.popitem(last=False)
                self.stats.bytes -= freed
                self.stats.evictions += 1
            self.stats.entries = len(self._items)
        return states, tags

    def snapshot(self) -> dict:
        with self._lock:
            return self.stats.as_dict()
