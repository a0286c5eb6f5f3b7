"""Several outputs per prompt (`n`): would one batched DiT forward of the n latents beat n forwards of one? Prints
one JSON line.

The gateway runs a job of n outputs as n denoising runs (the encoder once), so output i is byte for byte the
single request with seed + i. Batching the n latents into one forward (B = n) changes the GEMM shapes, so its
outputs differ from the single ones by rounding (reported as `max_abs_dev`); this measures whether the batch would
buy any throughput for that.

    python bench/n_outputs.py --preset tiny --n 3                                   # CPU
    python bench/n_outputs.py --preset full --layers 4 --dtype bf16 --device cuda --n 2 \\
        --frames 124 --height 768 --width 1344                                    # one GPU (5 s)

Times: median of --iters, CUDA events on a GPU; the model is random-weight H3 at the preset's width with --layers
blocks (the per-forward ratio does not depend on the depth beyond the fixed embed/head cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dit_layer import _Timer  # noqa: E402  (bench/dit_layer.py: CUDA events on a GPU, else the wall clock)

from h3serve.models.dit import layout as L  # noqa: E402
from h3serve.models.dit.model import FP32_MODULES, H3DiT, H3DiTConfig  # noqa: E402
from h3serve.runtime.device import TORCH_DTYPES  # noqa: E402
from h3serve.testing.presets import transformer_config  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    p.add_argument("--layers", type=int, help="transformer blocks (default: the preset's)")
    p.add_argument("--n", type=int, default=3, help="outputs per prompt (the batch)")
    p.add_argument("--frames", type=int, default=124, help="pixel frames, 17k+5")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--text-len", type=int, default=32)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args()


def main() -> None:
    a = _parse()
    if a.frames % 17 != 5 or a.height % 32 or a.width % 32:
        raise SystemExit(f"need 17k+5 frames and sides multiple of 32, got {a.frames} frames, {a.height}x{a.width}")
    device, dtype, cuda = torch.device(a.device), TORCH_DTYPES[a.dtype], a.device == "cuda"
    timer = _Timer(device)
    cfg = transformer_config(a.preset)
    if a.layers is not None:
        cfg["num_layers"] = a.layers
    torch.manual_seed(0)
    with torch.device(device):
        model = H3DiT(H3DiTConfig.from_dict(cfg))
    model.to(dtype)
    for name in FP32_MODULES:
        getattr(model, name).float()
    model.init_buffers(device).eval()

    latent_frames = (a.frames - 5) // 17 * 5 + 2
    audio_latents = int(round(a.frames / 24 * 40))
    layout = L.build_t2va_layout(a.text_len, latent_frames, a.height // 16, a.width // 16, audio_latents)
    g = torch.Generator().manual_seed(1)
    video = torch.randn(a.n, layout.num_video_rows, cfg["in_channels"] * 4, generator=g).to(device)
    audio = torch.randn(a.n, layout.num_audio_rows, cfg["audio_in_channels"], generator=g).to(device)
    text = torch.randn(1, a.text_len, cfg["text_dim"], generator=g).to(device, dtype)
    timesteps, indices = L.row_timesteps(layout, 0.5, 0.5)
    layout = layout.to(device)

    out: dict[str, object] = {}
    with torch.no_grad():
        def singles():
            out["singles"] = [model(video[i:i + 1], audio[i:i + 1], text, timesteps, indices, layout)
                              for i in range(a.n)]

        def batched():
            out["batched"] = model(video, audio, text.expand(a.n, -1, -1), timesteps, indices, layout)

        times: dict[str, list[float]] = {"singles": [], "batched": []}
        for it in range(a.warmup + a.iters):
            for name, fn in (("singles", singles), ("batched", batched)):
                t = timer(fn)
                if it >= a.warmup:
                    times[name].append(t)
        dev = max(max((s[0][0] - out["batched"][0][i]).abs().max().item(),
                      (s[1][0] - out["batched"][1][i]).abs().max().item())
                  for i, s in enumerate(out["singles"]))
    singles_ms, batched_ms = statistics.median(times["singles"]), statistics.median(times["batched"])
    print(json.dumps({
        "bench": "n_outputs", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "preset": a.preset, "layers": cfg["num_layers"], "dtype": a.dtype, "n": a.n, "seq_len": layout.seq_len,
        "geometry": f"{a.frames}x{a.height}x{a.width}", "singles_ms": round(singles_ms, 2),
        "batched_ms": round(batched_ms, 2), "batch_gain": round(singles_ms / batched_ms, 3),
        "max_abs_dev": dev, "bitwise_equal": dev == 0.0,
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
    }))


if __name__ == "__main__":
    main()
