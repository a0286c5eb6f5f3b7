"""Client loop of the real-time measurement (docs/realtime8.md): against a running gateway, for each clip length one
excluded warm-up, then N timed requests; median end-to-end seconds, T_media, RTF_client, the per-stage timings the
gateway reports, media checks of every MP4, and (with --gpus) the peak HBM per GPU sampled by nvidia-smi.

    python bench/realtime8_client.py --server 127.0.0.1:50051 --seconds 5 10 14 --size 1344x768 --repeats 3 \
        --out results/ [--gpus]

Prints one JSON line per clip length, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path


class HbmSampler:
    """Peak memory.used per GPU (MiB) from `nvidia-smi -lms`, over the lifetime of the sampler."""

    def __init__(self, period_ms: int = 100):
        self.peak: dict[int, int] = {}
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                i, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak[i] = max(self.peak.get(i, 0), used)

    def take(self) -> dict[int, int]:
        out, self.peak = dict(self.peak), {}
        return out

    def close(self) -> None:
        self.proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--seconds", nargs="+", default=["5", "10", "14"])   # 14 s = 345 frames, the longest
    ap.add_argument("--size", default="1344x768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="a paper kite over a windy beach at dusk, waves and gulls")
    ap.add_argument("--out", type=Path, default=Path("realtime8-out"))
    ap.add_argument("--gpus", action="store_true", help="sample peak HBM per GPU with nvidia-smi")
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args()

    from h3serve.client import Client
    from h3serve.testing.mp4check import check_mp4

    a.out.mkdir(parents=True, exist_ok=True)
    sampler = HbmSampler() if a.gpus else None
    rows = []
    with Client(a.server, timeout=a.timeout) as client:
        for seconds in a.seconds:
            def one(tag: str) -> dict:
                path = a.out / f"{seconds}s-{tag}.mp4"
                t0 = time.perf_counter()
                r = client.generate(a.prompt, output=path, seconds=float(seconds), size=a.size, seed=a.seed)
                wall = time.perf_counter() - t0
                acc = r.accepted
                rep = check_mp4(path, expect_frames=acc.num_frames, fps=acc.fps, width=acc.width, height=acc.height)
                t_media = max(acc.num_frames / acc.fps, rep.audio_seconds or 0.0)
                return {"wall_s": wall, "t_media": t_media, "rtf_client": wall / t_media, "frames": acc.num_frames,
                        "size": f"{acc.width}x{acc.height}", "profile": acc.profile, "timings": r.timings,
                        "mp4": str(path), "mp4_bytes": r.mp4_bytes, "media_check": "ok"}

            one("warmup")                     # excluded: kernels, allocator, lazy init at this geometry
            if sampler is not None:
                sampler.take()
            runs = [one(str(i)) for i in range(a.repeats)]
            med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
            keys = sorted(set().union(*(r["timings"] for r in runs)))
            row = {"seconds": seconds, "frames": runs[0]["frames"], "size": runs[0]["size"],
                   "profile": runs[0]["profile"], "repeats": a.repeats, "end_to_end_s": med("wall_s"),
                   "t_media": runs[0]["t_media"], "rtf_client": med("rtf_client"),
                   "rtf_client_runs": [round(r["rtf_client"], 4) for r in runs],
                   "stages_median": {k: statistics.median(r["timings"].get(k, 0.0) for r in runs) for k in keys},
                   "media_checks": "ok"}
            if sampler is not None:
                row["peak_hbm_mib_per_gpu"] = sampler.take()
            print(json.dumps(row), flush=True)
            rows.append(row)
    if sampler is not None:
        sampler.close()
    print(json.dumps({"summary": {r["seconds"]: round(r["rtf_client"], 3) for r in rows},
                      "all_rtf_le_1": all(r["rtf_client"] <= 1.0 for r in rows)}))


if __name__ == "__main__":
    main()
