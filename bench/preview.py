"""Previews (`preview_every`): their cost against the DiT's own time, on one DiT engine in this process. Prints one
JSON line.

Runs the same request without previews and with one after every denoising step (the most a request can ask for),
`--repeats` times each, interleaved; reports the render time summed over the previews (the x0 estimate's latents
-> JPEG, `h3serve/media/preview.py`) against the DiT's time, and the wall-time difference of the two runs.

    python bench/preview.py --checkpoint .cache/tiny-ckpt                    # tiny checkpoint, CPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=".cache/tiny-ckpt")
    ap.add_argument("--size", default="320x256")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from h3serve.config.request import validate_request
    from h3serve.media.preview import preview_jpeg
    from h3serve.models.dit.engine import DiTEngine, DiTRequest
    from h3serve.testing.tiny import init_tiny_checkpoint

    torch.set_num_threads(args.threads)
    if not Path(args.checkpoint, "modular_model_index.json").exists():
        init_tiny_checkpoint(args.checkpoint)
    engine = DiTEngine.load(args.checkpoint, components=("transformer",), dtype=torch.float32, device=args.device)
    req = validate_request(prompt="a kite over the sea", seconds=args.seconds, size=args.size, seed=0,
                           steps=args.steps, dtype="fp32")
    text = torch.randn(1, 5, engine.models["transformer"].config.text_dim, generator=torch.Generator().manual_seed(0))

    def request(every: int) -> DiTRequest:
        return DiTRequest(text_states=text, text_tags=torch.ones(5, dtype=torch.long), latent_frames=req.latent_frames,
                          latent_h=req.latent_height, latent_w=req.latent_width, audio_latents=req.audio_latents,
                          seed=0, steps=args.steps, preview_every=every)

    preview_jpeg(engine.generate(request(0)).video)   # warm: kernels, numpy, PIL (the DiT stage's warmup does this)
    plain_s, shown_s, render_s, sizes = [], [], [], []

    def on_preview(done, total, latents):
        t0 = time.perf_counter()
        sizes.append(len(preview_jpeg(latents)))
        render_s.append(time.perf_counter() - t0)

    for _ in range(args.repeats):
        plain_s.append(engine.generate(request(0)).seconds)
        shown_s.append(engine.generate(request(1), on_preview=on_preview).seconds)
    steps = args.steps - 1
    per_run_render = sum(render_s) / args.repeats
    print(json.dumps({
        "bench": "preview", "checkpoint": str(args.checkpoint), "device": args.device, "threads": args.threads,
        "geometry": f"{req.latent_frames}x{req.latent_height}x{req.latent_width} latents ({args.size}, "
                    f"{req.num_frames} frames)", "denoising_steps": steps, "previews_per_run": steps,
        "dit_s_without": round(min(plain_s), 4), "dit_s_with": round(min(shown_s), 4),
        "render_s_per_preview": round(per_run_render / steps, 5), "render_s_per_run": round(per_run_render, 5),
        "cost_ratio_render": round(per_run_render / min(plain_s), 5),
        "cost_ratio_wall": round(min(shown_s) / min(plain_s) - 1, 5), "jpeg_bytes": max(sizes)}))


if __name__ == "__main__":
    main()
