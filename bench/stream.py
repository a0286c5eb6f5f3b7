"""Streaming output: time to the first playable fragment of `GET /v1/videos/{id}/content?stream=true` vs time to
the finished MP4, against a real gateway (`h3serve serve --stages all`). Prints one JSON line.

All times are seconds after the POST that created the job. "Playable": the stream holds ftyp, moov and one whole
moof + mdat (a player can show its frames). The stream is also decoded and compared with the finished MP4 (frames
and audio samples), and the last progress event's time is read from the job's own record for reference.

    python bench/stream.py --checkpoint .cache/tiny-ckpt                    # tiny checkpoint, CPU
    python bench/stream.py --checkpoint .cache/tiny-ckpt --size 320x256 --seconds 5 --steps 4
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import httpx
import numpy as np


def playable_end(data: bytes) -> int | None:
    """The byte offset where the first moof + mdat pair ends (None while it is incomplete)."""
    pos, seen = 0, []
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if size < 8 or pos + size > len(data):
            return None
        seen.append(kind)
        pos += size
        if kind == b"mdat" and b"moof" in seen:
            return pos
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=".cache/tiny-ckpt")
    ap.add_argument("--size", default="320x256")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from h3serve.media.fragments import decoded_media
    from h3serve.testing.serve import ServeProcess
    from h3serve.testing.tiny import init_tiny_checkpoint

    if not Path(args.checkpoint, "modular_model_index.json").exists():
        init_tiny_checkpoint(args.checkpoint)
    serve = ServeProcess("--checkpoint", str(args.checkpoint), "--port", "0", "--http-port", "0", "--json",
                         threads=args.threads)
    try:
        http_url = serve.wait("serving", 300)["gateway"]["http"]
        body = dict(prompt="a kite over the sea", seconds=args.seconds, size=args.size, seed=0,
                    num_inference_steps=args.steps)
        with httpx.Client(base_url=http_url, timeout=600) as http:
            t0 = time.perf_counter()
            job = http.post("/v1/videos", json=body).json()
            live = bytearray()
            t_first_byte = t_playable = None
            with http.stream("GET", f"/v1/videos/{job['id']}/content", params={"stream": "true"}) as r:
                assert r.headers.get("x-h3-stream") == "fmp4", r.headers
                for data in r.iter_bytes():
                    now = time.perf_counter() - t0
                    t_first_byte = t_first_byte if t_first_byte is not None else now
                    live += data
                    if t_playable is None and playable_end(bytes(live)) is not None:
                        t_playable = now
            t_stream_end = time.perf_counter() - t0
            while (rec := http.get(f"/v1/videos/{job['id']}").json())["status"] not in ("completed", "failed"):
                time.sleep(0.01)
            t_completed = time.perf_counter() - t0
            mp4 = http.get(f"/v1/videos/{job['id']}/content").content
            t_mp4 = time.perf_counter() - t0
        frames, audio = decoded_media(mp4)
        live_frames, live_audio = decoded_media(bytes(live))
        same = (len(frames) == len(live_frames) and all(np.array_equal(a, b) for a, b in zip(frames, live_frames))
                and audio.shape == live_audio.shape and np.array_equal(audio, live_audio))
        print(json.dumps({
            "bench": "stream", "checkpoint": str(args.checkpoint), "request": body, "status": rec["status"],
            "frames": len(frames), "t_first_byte_s": round(t_first_byte, 3),
            "t_first_playable_fragment_s": round(t_playable, 3), "t_stream_end_s": round(t_stream_end, 3),
            "t_completed_s": round(t_completed, 3), "t_finished_mp4_s": round(t_mp4, 3),
            "ahead_of_finished_mp4_s": round(t_mp4 - t_playable, 3),
            "fragments": bytes(live).count(b"moof"), "stream_bytes": len(live), "mp4_bytes": len(mp4),
            "same_frames_and_audio": same}))
    finally:
        serve.stop(90)


if __name__ == "__main__":
    main()
