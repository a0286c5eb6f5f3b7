"""A checkpoint's manifest: the sha256 and size of every file, hashed in parallel and streamed (never a whole file in
memory), so that a stage loads only the bytes that were published.

    h3serve checkpoint manifest DIR          writes DIR/h3serve-manifest.json, prints the manifest's own sha256
    h3serve serve --checkpoint DIR --checkpoint-manifest-sha256 HEX
                                             each model stage checks the manifest against HEX, then the files it
                                             loads against the manifest, before loading; a mismatch names the file

The manifest's sha256 is the pin (a deployment states it once); the files are checked through it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from h3serve.errors import CheckpointError
from h3serve.weights.headers import sha256_file

class IntegrityError(CheckpointError):
    """The weights are not the published ones (a file differs from its manifest) or they compute NaN / Inf: the
    stage stays NOT_SERVING with this as the reason in its status."""


MANIFEST_FILE = "h3serve-manifest.json"
# The folders each model stage loads (files at the top of the checkpoint belong to every stage).
STAGE_FOLDERS = {
    "encoder": ("text_encoder", "tokenizer", "processor"),
    "dit": ("transformer", "transformer_ref", "scheduler", "audio_scheduler"),
    "vae": ("vae", "audio_vae"),
}


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST_FILE and not name.startswith("."):
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _hash_all(root: Path, rels: list[str], workers: int) -> dict[str, dict]:
    def one(rel: str) -> tuple[str, dict]:
        path = root / rel
        return rel, {"size": path.stat().st_size, "sha256": sha256_file(path)}

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return dict(pool.map(one, rels))


def write_manifest(root: str | os.PathLike, *, workers: int | None = None) -> tuple[Path, str]:
    """Hash every file of `root` into root/MANIFEST_FILE; returns (its path, its sha256)."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    files = _hash_all(root, _files(root), workers or min(16, os.cpu_count() or 1))
    data = json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True).encode() + b"\n"
    path = root / MANIFEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path, hashlib.sha256(data).hexdigest()


def verify_manifest(root: str | os.PathLike, expected_sha256: str, *, stage: str | None = None,
                    workers: int | None = None) -> int:
    """Check the manifest against its pin, then the files `stage` loads (all, for None) against the manifest:
    each listed file present with its size and sha256, no unlisted file in those folders. Returns the files
    checked; raises CheckpointError naming the first file that differs."""
    root = Path(root)
    path = root / MANIFEST_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}; write it with `h3serve checkpoint manifest {root}`") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256.lower():
        raise IntegrityError(f"{path}: sha256 {digest}, the pinned manifest is {expected_sha256}")
    try:
        listed: dict[str, dict] = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: not a manifest (expected {{'files': {{PATH: {{size, sha256}}}}}})") from None
    folders = STAGE_FOLDERS.get(stage) if stage is not None else None

    def mine(rel: str) -> bool:
        return folders is None or "/" not in rel or rel.split("/", 1)[0] in folders

    wanted = sorted(r for r in listed if mine(r))
    unlisted = [r for r in _files(root) if mine(r) and r not in listed]
    if unlisted:
        raise IntegrityError(f"{root / unlisted[0]}: not in the manifest ({len(unlisted)} unlisted file(s))")
    for rel in wanted:
        p = root / rel
        if not p.is_file():
            raise IntegrityError(f"{p}: listed in the manifest but missing")
        if p.stat().st_size != listed[rel]["size"]:
            raise IntegrityError(f"{p}: {p.stat().st_size} bytes, the manifest says {listed[rel]['size']}")
    got = _hash_all(root, wanted, workers or min(16, os.cpu_count() or 1))
    for rel in wanted:
        if got[rel]["sha256"] != listed[rel]["sha256"]:
            raise IntegrityError(f"{root / rel}: sha256 {got[rel]['sha256']}, the manifest says "
                                  f"{listed[rel]['sha256']} (the file changed after the manifest was written)")
    return len(wanted)
