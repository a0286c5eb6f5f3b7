"""Video VAE decode: ours (clip-by-clip stream, tiles of a window batched, optionally compiled blocks) vs diffusers'
``AutoencoderKLMiniMaxH3.decode`` on the same weights and latents. Prints one JSON line.

    python bench/vae.py --preset tiny --device cpu                                  # CPU smoke run
    python bench/vae.py --preset full --device cuda --dtype bf16 --latents 72x48x84 --compile

Full = diffusers' default config (2.42 B decoder params), random weights (scale1/scale2/register tokens non-zero so
every block contributes), cast like the released checkpoint: bf16 except encoder, quant_conv, the decoder norms,
layer scales and norm_out (fp32). Times: wall clock with a device sync, median of --iters after --warmup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from h3serve.testing.modules import random_video_vae


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--latents", default=None, help="T x h x w latent grid (default 12x4x6 tiny, 72x48x84 full)")
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ref-warmup", type=int, default=None, help="diffusers' warm-up calls (default: --warmup)")
    ap.add_argument("--compile", action="store_true", help="also time ours with torch.compile'd decoder blocks")
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tail", action="store_true",
                    help="then run bench/tail.py's measurement on this model (compiled if --compile): 'tail' key")
    ap.add_argument("--x264-threads", type=int, default=8)
    ap.add_argument("--tail-variants", default=None, help="bench/tail.py writer variants, e.g. 16:frame:1,16:slice:0")
    a = ap.parse_args()

    from diffusers.utils import logging as diffusers_logging

    from h3serve.models.vae.video import VideoVAE
    from h3serve.runtime.device import TORCH_DTYPES

    diffusers_logging.set_verbosity_error()
    device = torch.device(a.device)
    dtype = TORCH_DTYPES[a.dtype]
    t_, h_, w_ = (int(v) for v in (a.latents or ("12x4x6" if a.preset == "tiny" else "72x48x84")).split("x"))
    model = random_video_vae(a.preset, dtype, device, a.seed)
    tile = 256 if a.preset == "full" else 32
    overlap = 64 if a.preset == "full" else 16
    model.enable_tiling(tile, tile, overlap, overlap)
    ours = VideoVAE(model, tile=tile, min_overlap=overlap)
    g = torch.Generator().manual_seed(a.seed + 1)
    latents = torch.randn(1, model.config.latent_channels, t_, h_, w_, generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def run_ours():
        clips, first = [], None
        t0 = time.perf_counter()
        for clip in ours.iter_decode_float(latents):
            clips.append(clip)
            if first is None:
                _sync(device)
                first = time.perf_counter() - t0
        _sync(device)
        return torch.cat(clips), first

    def timed(fn, n_warm, n_iter):
        out, times, extra = None, [], []
        for i in range(n_warm + n_iter):
            _sync(device)
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            if i >= n_warm:
                times.append(time.perf_counter() - t0)
                if isinstance(out, tuple):
                    extra.append(out[1])
        return out, times, extra

    result = {"bench": "vae_decode", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": a.dtype, "preset": a.preset, "latents": [t_, h_, w_],
              "decoder_params": sum(p.numel() for p in model.decoder.parameters()), "tile": tile, "overlap": overlap,
              "iters": a.iters}
    with torch.no_grad():
        (o_frames, _), times, first = timed(run_ours, a.warmup, a.iters)
        result["frames"] = int(o_frames.shape[0])
        result["ours_s"] = round(statistics.median(times), 4)
        result["ours_first_clip_s"] = round(statistics.median(first), 4)
        result["ours_tile_batch"] = ours.tile_batch or ("all" if device.type == "cuda" else 1)
        if device.type == "cuda":
            result["ours_peak_hbm_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        if not a.no_diffusers:
            z = ours.denormalize(latents)
            ref_warm = a.warmup if a.ref_warmup is None else a.ref_warmup
            ref, times, _ = timed(lambda: model.decode(z).sample, ref_warm, a.iters)
            ref_frames = ours._postprocess(ref)
            result["diffusers_s"] = round(statistics.median(times), 4)
            result["ratio_diffusers_over_ours"] = round(result["diffusers_s"] / result["ours_s"], 4)
            result["max_abs_diff_01"] = (o_frames - ref_frames).abs().max().item()
            u8 = (o_frames * 255).round() - (ref_frames * 255).round()
            result["max_abs_diff_u8_levels"] = u8.abs().max().item()
            del ref, ref_frames
        if a.compile:
            for block in model.decoder.transformer_blocks:
                block.compile(dynamic=False)
            t0 = time.perf_counter()
            (c_frames, _), _, _ = timed(run_ours, 0, 1)  # compiles
            result["compile_first_call_s"] = round(time.perf_counter() - t0, 3)
            (c_frames, _), times, first = timed(run_ours, 0, a.iters)
            result["ours_compiled_s"] = round(statistics.median(times), 4)
            result["ours_compiled_first_clip_s"] = round(statistics.median(first), 4)
            result["max_abs_diff_compiled_vs_eager_01"] = (c_frames - o_frames).abs().max().item()
            if "diffusers_s" in result:
                result["ratio_diffusers_over_ours_compiled"] = round(result["diffusers_s"] / result["ours_compiled_s"],
                                                                     4)
    if a.tail:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tail import run as run_tail  # bench/tail.py

        result["tail"] = run_tail(ours, latents, threads=a.x264_threads, preset="veryfast", repeats=a.iters,
                                  variants=a.tail_variants)
    if device.type == "cuda":
        result["peak_hbm_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
