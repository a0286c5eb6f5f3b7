"""End-to-end generate benchmark: our embedded pipeline vs diffusers' MiniMaxH3ModularPipeline, same run.

Prints one JSON line. Both sides run the same checkpoint, request and seed; the diffusers side is its pipeline call
(output_type "np") followed by our muxer on its frames, so both end in an MP4 of the same content.

    python bench/e2e.py --checkpoint .cache/tiny-ckpt --size 320x256 --seconds 5 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=".cache/tiny-ckpt")
    ap.add_argument("--size", default="320x256")
    ap.add_argument("--seconds", default="5")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", default="base")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-diffusers", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from h3serve.pipeline import Pipeline
    from h3serve.runtime.device import TORCH_DTYPES, pick_device
    from h3serve.config.request import validate_request
    from h3serve.media.mux import Mp4Writer
    from h3serve.models.vae.yuv import rgb_to_yuv420p
    from h3serve.testing.tiny import init_tiny_checkpoint

    if not Path(args.checkpoint, "modular_model_index.json").exists():
        init_tiny_checkpoint(args.checkpoint)
    device = pick_device(args.device)
    req = validate_request(prompt="a red kite over a windy beach", seconds=args.seconds, size=args.size, seed=0,
                           steps=args.steps, dtype=args.dtype)
    out = Path(tempfile.mkdtemp()) / "bench.mp4"

    pipe = Pipeline.load(args.checkpoint, dtype=args.dtype, device=str(device))
    pipe.generate(req, out)  # warm-up, excluded
    ours = [pipe.generate(req, out).timings for _ in range(args.repeats)]
    result = {
        "bench": "e2e", "device": str(device), "torch": torch.__version__, 
        "checkpoint": str(args.checkpoint), "size": args.size, "frames": req.num_frames, "steps": req.steps,
        "dtype": args.dtype, "repeats": args.repeats,
        "ours": {k: statistics.median(t[k] for t in ours) for k in ours[0]},
    }

    if not args.no_diffusers:
        from h3serve.testing.tiny import reference_pipeline

        ref = reference_pipeline(args.checkpoint, "t2va", dtype=TORCH_DTYPES[args.dtype])
        ref.to(device) if hasattr(ref, "to") else None

        def run_ref():
            t0 = time.perf_counter()
            state = ref(prompt=req.prompt, num_frames=req.num_frames, height=req.height, width=req.width,
                        num_inference_steps=req.steps, generator=torch.Generator("cpu").manual_seed(0),
                        output_type="np", output=["videos", "audio"])
            _sync(device)
            t1 = time.perf_counter()
            frames = (torch.as_tensor(state["videos"][0]) * 255).round().to(torch.uint8)
            with Mp4Writer(out.with_suffix(".ref.mp4"), req.width, req.height) as w:
                w.add_frames(rgb_to_yuv420p(frames))
                w.add_audio(state["audio"][0].float().cpu().numpy())
            return {"pipeline_s": t1 - t0, "t_client": time.perf_counter() - t0}

        run_ref()  # warm-up
        theirs = [run_ref() for _ in range(args.repeats)]
        result["diffusers"] = {k: statistics.median(t[k] for t in theirs) for k in theirs[0]}
        result["speedup_vs_diffusers"] = result["diffusers"]["t_client"] / result["ours"]["t_client"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
