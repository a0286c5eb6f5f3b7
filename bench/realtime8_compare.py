"""Checks of the 8-rank dry run (bench/realtime8_dryrun.sh): media checks of its MP4s, their decoded frames against
the degree-1 MP4, and the embedded pipeline's latents and float frames at degrees 8 against degrees 1 (the
tolerance of docs/parallelism.md: max|Δ| <= 1e-5, uint8 frames within one level).

    python bench/realtime8_compare.py --checkpoint CKPT --adapter FILE --adapter-sha256 HEX REF.mp4 OTHER.mp4 ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

TOL = 1e-5


def frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--adapter-sha256", required=True)
    ap.add_argument("--size", default="320x256")
    ap.add_argument("--seconds", default="5")
    ap.add_argument("mp4", nargs="+", type=Path, help="the degree-1 MP4 first, then the ones to compare with it")
    a = ap.parse_args()

    from h3serve.testing.mp4check import check_mp4
    from h3serve.pipeline import Pipeline
    from h3serve.config.request import validate_request

    req = validate_request(prompt="a kite over the sea at dusk", seconds=a.seconds, size=a.size, seed="7",
                           profile="fasth3")
    ref = frames(a.mp4[0])
    for path in a.mp4:
        rep = check_mp4(path, expect_frames=req.num_frames, fps=24, width=req.width, height=req.height)
        f = frames(path)
        diff = np.abs(f.astype(np.int16) - ref.astype(np.int16))
        print(json.dumps({"mp4": path.name, "check_mp4": "ok", "frames": rep.frames, "size": f"{rep.width}x{rep.height}",
                          "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
                          "decoded_vs_degree1_max_levels": int(diff.max()),
                          "decoded_vs_degree1_mean_levels": round(float(diff.mean()), 4)}))

    out = {}
    for name, degrees in (("degrees-1", {}), ("degrees-8", dict(encoder_tp=8, ulysses=8, ring=1, vae_pp=8))):
        t0 = time.perf_counter()
        pipe = Pipeline.load(a.checkpoint, profile="fasth3", adapter=a.adapter, adapter_sha256=a.adapter_sha256,
                             device="cpu", **degrees)
        try:
            lat = pipe.generate_latents(req)
            out[name] = (lat, pipe.decode_video_float(lat.video))
        finally:
            pipe.close()
        print(json.dumps({"pipeline": name, "seconds": round(time.perf_counter() - t0, 1)}))
    (l1, f1), (l8, f8) = out["degrees-1"], out["degrees-8"]
    u8 = lambda f: (f * 255).round().to(torch.int16)  # noqa: E731
    res = {"latents_video_max_abs": (l8.video - l1.video).abs().max().item(),
           "latents_audio_max_abs": (l8.audio - l1.audio).abs().max().item(),
           "frames_float_max_abs": (f8 - f1).abs().max().item(),
           "frames_uint8_max_levels": int((u8(f8) - u8(f1)).abs().max().item())}
    res["within_tolerance"] = (max(res["latents_video_max_abs"], res["latents_audio_max_abs"],
                                   res["frames_float_max_abs"]) <= TOL and res["frames_uint8_max_levels"] <= 1)
    print(json.dumps(res))
    if not res["within_tolerance"]:
        raise SystemExit("degrees 8 differ from degrees 1 beyond the tolerance")


if __name__ == "__main__":
    main()
