"""Write the full-size random checkpoint for the end-to-end GPU benchmark, split over two file systems.

The released geometry is ~143 GB; a 2-GPU host here has a 128 GiB disk and a RAM-backed /dev/shm. The DiT
(66.3 GB) goes to `--dit-root` (e.g. /dev/shm) and is linked into the folder; the rest goes to `--root`. The text
encoder keeps `--text-layers` decoder layers (default 51): the reference reads hidden_states[50] and refuses a stack of
exactly 50 (whose last state is post-norm), while our encoder loads only the 50 it reads. Prints one JSON line.

`--synthetic` writes the whole folder to `--root` as synthetic shards (h3serve.weights.synthetic): the random
tensors are holes generated when loaded, so it takes well under 1 GB of disk: for a one-GPU host (64 GiB disk,
128 GiB RAM) that holds neither the files nor a /dev/shm copy of them.

    python bench/full_checkpoint.py --root /tmp/h3-full --dit-root /dev/shm/h3-dit --threads 24
    python bench/full_checkpoint.py --root /tmp/h3-full --synthetic --adapter /tmp/h3-full-adapter.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--dit-root", default=None, help="where the DiT goes (linked into --root); default --root")
    ap.add_argument("--synthetic", action="store_true", help="generated-on-load tensors (holes), not written ones")
    ap.add_argument("--text-layers", type=int, default=51)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapter", default=None, help="also write a synthetic FastH3 adapter (rank 64) here")
    a = ap.parse_args()

    from h3serve.testing.adapters import init_adapter
    from h3serve.weights.folder import INDEX_FILE
    from h3serve.testing.fullsize import init_full_checkpoint

    override = {"text_encoder": {"num_hidden_layers": a.text_layers}}
    times, sizes = {}, {}

    def progress(component, seconds, nbytes):
        times[component], sizes[component] = round(seconds, 2), nbytes

    t0 = time.perf_counter()
    common = dict(layers_override=override, overwrite=True, threads=a.threads, progress=progress,
                  synthetic=a.synthetic)
    if a.dit_root is None:
        root = init_full_checkpoint(a.root, a.seed, **common)
    else:
        dit = init_full_checkpoint(a.dit_root, a.seed, components=["transformer"], **common)
        root = init_full_checkpoint(a.root, a.seed, components=["text_encoder", "vae", "audio_vae", "tokenizer",
                                                                "processor", "scheduler", "audio_scheduler"], **common)
        shutil.rmtree(root / "transformer", ignore_errors=True)
        os.symlink(dit / "transformer", root / "transformer")
        index = json.loads((root / INDEX_FILE).read_text())
        index["transformer"] = json.loads((dit / INDEX_FILE).read_text())["transformer"]
        (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    on_disk = sum(f.stat().st_blocks * 512 for f in Path(root).resolve().rglob("*") if f.is_file())
    out = {"bench": "full_checkpoint", "root": str(root), "dit_root": a.dit_root, "synthetic": a.synthetic,
           "text_layers": a.text_layers, "component_s": times, "component_bytes": sizes,
           "disk_bytes_root": on_disk, "total_s": round(time.perf_counter() - t0, 2)}
    if a.adapter:
        t1 = time.perf_counter()
        out["adapter_sha256"] = init_adapter(root, a.adapter, rank=64, seed=a.seed)
        out["adapter_s"] = round(time.perf_counter() - t1, 2)
        out["adapter_bytes"] = Path(a.adapter).stat().st_size
    print(json.dumps(out))


if __name__ == "__main__":
    main()
