"""Shared fixtures: the tiny random H3 checkpoint (built once, cached across sessions) and a synthetic adapter.

`tiny_checkpoint` lives in `$H3SERVE_TEST_CACHE/tiny-ckpt` (default `<repo>/.cache/tiny-ckpt`). It is reused when
it is a complete checkpoint of the current tiny recipe, otherwise rebuilt (about 3-15 s). Builders in concurrent
test processes are serialised by a lock file; the build itself is atomic (temp folder + rename).

Tests must not modify it: copy what you change (`copy_checkpoint`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_SEED = 0


def pytest_configure(config):
    config.addinivalue_line("markers", "diffusers: runs diffusers' reference pipeline on the tiny checkpoint "
                                       "(a few seconds on CPU)")


def test_cache_dir() -> Path:
    root = os.environ.get("H3SERVE_TEST_CACHE")
    return Path(root) if root else REPO_ROOT / ".cache"


test_cache_dir.__test__ = False  # a helper, not a test


@dataclass(frozen=True)
class TinyAdapter:
    path: Path
    sha256: str


def _build_tiny(path: Path, seed: int) -> Path:
    from h3serve.testing.tiny import init_tiny_checkpoint, is_tiny_checkpoint

    if is_tiny_checkpoint(path, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_tiny_checkpoint(path, seed):
                init_tiny_checkpoint(path, seed, overwrite=path.exists())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """Path of the tiny random H3 checkpoint (diffusers modular layout, float32, seed 0). Read-only."""
    return _build_tiny(test_cache_dir() / "tiny-ckpt", TINY_SEED)


@pytest.fixture(scope="session")
def tiny_adapter(tiny_checkpoint, tmp_path_factory) -> TinyAdapter:
    """A synthetic fastvideo-lora-v2 adapter (rank 4, seed 0) for the tiny checkpoint's transformer, + sha256."""
    from h3serve.testing.adapters import init_adapter

    path = tmp_path_factory.mktemp("adapter") / "adapter_model.safetensors"
    digest = init_adapter(tiny_checkpoint, path, rank=4, seed=0)
    return TinyAdapter(path, digest)


@pytest.fixture
def copy_checkpoint(tiny_checkpoint, tmp_path):
    """`copy_checkpoint(name="ckpt") -> Path`: a private, writable copy of the tiny checkpoint."""

    def make(name: str = "ckpt") -> Path:
        dst = tmp_path / name
        shutil.copytree(tiny_checkpoint, dst)
        return dst

    return make
