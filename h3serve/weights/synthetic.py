"""Synthetic shards: safetensors files whose random tensors are generated when read instead of stored.

A full-size random checkpoint (`h3serve.testing.fullsize`, for benchmarks without the real weights) is ~131 GB; a
one-GPU machine with a 64 GiB disk cannot hold it. A synthetic shard keeps the real header (names, shapes, dtypes,
offsets: everything the loader validates) and the real bytes of every tensor with a fixed value (norm weights,
biases, buffers), while the bytes of its N(0, std) tensors are a hole (a sparse file: the length is right, no disk
is used). Its `__metadata__` names those tensors under `SYNTHETIC_META`, with the seed; `iter_tensors` generates
each on read: float32 N(0, std) from a generator seeded by (seed, component, name), cast to the stored dtype.

The values are generated on the current CUDA device when one is visible (fast: 131 GB in seconds), else on the CPU,
whatever device the tensor is loaded to: every load of a checkpoint on one machine sees the same values, but a CUDA
machine's values differ from a CPU's (CUDA and CPU generators differ), and from a written (non-synthetic)
checkpoint of the same seed. Nothing but a synthetic checkpoint's writer puts `SYNTHETIC_META` in a file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import torch

SYNTHETIC_META = "h3serve.synthetic"


def synthetic_metadata(seed: int, component: str, std: float, generated: Iterable[str]) -> str:
    """The `SYNTHETIC_META` value of a shard whose `generated` tensors are holes."""
    return json.dumps({"seed": int(seed), "component": component, "std": float(std), "generated": sorted(generated)},
                      separators=(",", ":"))


def generated_tensors(metadata: dict[str, str] | None) -> tuple[dict, frozenset[str]]:
    """(recipe, names) of a shard's generated tensors; ({}, empty) for an ordinary file."""
    raw = (metadata or {}).get(SYNTHETIC_META)
    if raw is None:
        return {}, frozenset()
    recipe = json.loads(raw)
    return recipe, frozenset(recipe["generated"])


def tensor_seed(seed: int, component: str, name: str) -> int:
    digest = hashlib.sha256(f"synthetic/{seed}/{component}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generation_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def generate(recipe: dict, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A generated tensor's value (on `generation_device()`)."""
    device = generation_device()
    gen = torch.Generator(device).manual_seed(tensor_seed(recipe["seed"], recipe["component"], name))
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    # one float32 row block at a time: no float32 copy of a multi-GiB tensor
    flat, step = out.view(-1), 1 << 26
    for start in range(0, flat.numel(), step):
        n = min(step, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=gen, device=device).mul_(recipe["std"])
    return out
