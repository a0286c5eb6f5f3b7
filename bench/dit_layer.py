"""Per-layer H3 DiT forward time, ours vs diffusers, with the same weights and inputs. Prints one JSON line.

    python bench/dit_layer.py --preset tiny --layers 2                      # CPU smoke run
    python bench/dit_layer.py --preset full --layers 2 --dtype bf16 --device cuda \\
        --seq-video-frames 243 --height 768 --width-px 1344                 # one H200

Times (median of --iters, CUDA events on GPU):
  * blocks: the transformer block stack alone on the same packed hidden states -> ms per layer;
  * forward: the whole model call (refiner, packing, blocks, norm_out, heads).
FLOPs per layer = S * (2 * (4*D*inner + 3*D*ffn)) + 4 * S^2 * inner (770,703,360 * S + 4*S^2*7168 at full width);
on CUDA the FLOP-limit ratio is achieved TFLOP/s over --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from h3serve.testing.presets import transformer_config
from h3serve.models.dit import kernels
from h3serve.models.dit import layout as L
from h3serve.models.dit.model import FP32_MODULES, H3DiT, H3DiTConfig
from h3serve.runtime.device import TORCH_DTYPES


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    p.add_argument("--width", type=int, help="hidden size D (overrides the preset)")
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--layers", type=int, default=2, help="number of transformer blocks to build")
    p.add_argument("--seq-video-frames", type=int, help="pixel frames, 17n+5 (default 22 tiny / 243 full)")
    p.add_argument("--height", type=int, help="pixel height, multiple of 32 (default 64 tiny / 768 full)")
    p.add_argument("--width-px", type=int, help="pixel width, multiple of 32 (default 96 tiny / 1344 full)")
    p.add_argument("--rows", type=int, help="raw target video rows instead of a pixel geometry (one latent frame)")
    p.add_argument("--audio-latents", type=int, help="audio latents per channel (default: from the frame count)")
    p.add_argument("--text-len", type=int, help="text tokens (default 7 tiny / 256 full)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=770.0, help="dense bf16 peak used for the FLOP-limit ratio")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="",
                   help="comma list of ATTENTION:FUSED variants of ours, e.g. 'fa3:1,fa3:0,cudnn:1,cudnn:0'; the "
                        "first is the one the forward and the main fields use (default: the process default)")
    p.add_argument("--no-forward", action="store_true", help="skip the whole-model forward timings")
    return p.parse_args()


def _geometry(a: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """(text_len, latent_frames, latent_h, latent_w, audio_latents)."""
    full = a.preset == "full"
    text_len = a.text_len if a.text_len is not None else (256 if full else 7)
    if a.rows is not None:
        audio = a.audio_latents if a.audio_latents is not None else 20
        return text_len, 1, 2, 2 * a.rows, audio  # one frame of 1 x rows patches
    frames = a.seq_video_frames or (243 if full else 22)
    height, width = a.height or (768 if full else 64), a.width_px or (1344 if full else 96)
    if frames % 17 != 5 or height % 32 or width % 32:
        raise SystemExit(f"need 17n+5 frames and sides multiple of 32, got {frames} frames, {height}x{width}")
    latent_frames = (frames - 5) // 17 * 5 + 2
    audio = a.audio_latents if a.audio_latents is not None else int(round(frames / 24 * 40))
    return text_len, latent_frames, height // 16, width // 16, audio


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        """Milliseconds for one call of fn()."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def main() -> None:
    a = _parse()
    from diffusers import MiniMaxH3Transformer3DModel  # the oracle; imported late so --help works without it
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the fp32-module casting notice: we restore those modules below

    device = torch.device(a.device)
    dtype = TORCH_DTYPES[a.dtype]
    cfg = transformer_config(a.preset)
    for key, value in (("hidden_size", a.width), ("num_attention_heads", a.heads),
                       ("attention_head_dim", a.head_dim), ("ffn_dim", a.ffn)):
        if value is not None:
            cfg[key] = value
    if a.width is not None and a.preset == "tiny":
        cfg["time_embed_hidden_dim"] = a.width
    cfg["num_layers"] = a.layers
    text_len, frames, lh, lw, audio_latents = _geometry(a)

    # diffusers model on the device, cast like the released checkpoint (bf16 + fp32 modules + fp32 rope buffer).
    torch.manual_seed(a.seed)
    with torch.device(device):
        ref = MiniMaxH3Transformer3DModel(**cfg).eval()
    inv_freq = ref.rope.inv_freq.clone()
    ref.to(dtype)
    for name in FP32_MODULES:
        getattr(ref, name).float()
    ref.rope.inv_freq = inv_freq
    # ours shares the very same tensors (assign=True): no second copy of the weights.
    with torch.device("meta"):
        ours = H3DiT(H3DiTConfig.from_dict(dict(ref.config)))
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    ours.init_buffers(device).eval()

    layout = L.build_t2va_layout(text_len, frames, lh, lw, audio_latents)
    g = torch.Generator().manual_seed(a.seed + 1)
    video = torch.randn(1, layout.num_video_rows, cfg["in_channels"] * 4, generator=g).to(device)
    audio = torch.randn(1, layout.num_audio_rows, cfg["audio_in_channels"], generator=g).to(device)
    text = torch.randn(1, text_len, cfg["text_dim"], generator=g).to(device, dtype)
    timesteps, timestep_indices = L.row_timesteps(layout, 0.0271674, 0.1004804)
    layout_dev = layout.to(device)
    timesteps_dev = timesteps.to(device)
    ti_dev = timestep_indices.to(device)

    variants = [tuple(v.split(":")) for v in a.variants.split(",") if v] or [(None, None)]

    def use_variant(v) -> None:
        for key, value in zip(("H3SERVE_ATTENTION", "H3SERVE_FUSED"), v):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        kernels.reset_attention_choice()

    use_variant(variants[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
        weights_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    timer = _Timer(device)
    res: dict[str, list[float]] = {k: [] for k in ("ours_blocks", "ref_blocks", "ours_fwd", "ref_fwd")}
    with torch.no_grad():
        # shared block-stack inputs
        x0, ctx, plan = ours.embed(video, audio, text, timesteps_dev, timestep_indices, layout_dev)
        temb = ref.time_embedder(ref.time_proj(timesteps_dev).to(torch.float32))
        adaln_indices = ti_dev * 3 + layout_dev.token_tags
        rotary = ref.rope(layout_dev.position_ids)

        def ref_blocks(h=x0):
            for block in ref.transformer_blocks:
                h = block(h, temb, adaln_indices, rotary)
            return h

        def ref_forward():
            return ref(video, audio, text, timesteps_dev, ti_dev, layout_dev.token_tags, layout_dev.position_ids,
                       layout_dev.video_indices, layout_dev.audio_indices, layout_dev.text_indices, return_dict=False)

        def ours_forward():
            return ours(video, audio, text, timesteps_dev, timestep_indices, layout_dev)

        out = {}
        for it in range(a.warmup + a.iters):
            keep = it >= a.warmup
            x = x0.clone()  # our blocks update the residual stream in place
            t = timer(lambda: out.__setitem__("ours_blocks", ours.run_blocks(x, ctx)))
            keep and res["ours_blocks"].append(t)
            t = timer(lambda: out.__setitem__("ref_blocks", ref_blocks()))
            keep and res["ref_blocks"].append(t)
            if a.no_forward:
                continue
            t = timer(lambda: out.__setitem__("ours_fwd", ours_forward()))
            keep and res["ours_fwd"].append(t)
            t = timer(lambda: out.__setitem__("ref_fwd", ref_forward()))
            keep and res["ref_fwd"].append(t)

        diff_blocks = (out["ours_blocks"].float() - out["ref_blocks"].float()).abs().max().item()
        if not a.no_forward:
            diff_video = (out["ours_fwd"][0] - out["ref_fwd"][0]).abs().max().item()
            diff_audio = (out["ours_fwd"][1] - out["ref_fwd"][1]).abs().max().item()
            scale_video = out["ref_fwd"][0].abs().max().item()
        else:
            diff_video = diff_audio = scale_video = None
        peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

        # the other variants of ours: blocks only, same input; max|delta| vs diffusers and vs the first variant
        variant_results = []
        for v in variants if len(variants) > 1 else []:
            use_variant(v)
            times = []
            for it in range(a.warmup + a.iters):
                x = x0.clone()
                t = timer(lambda: out.__setitem__("v", ours.run_blocks(x, ctx)))
                it >= a.warmup and times.append(t)
            ms = statistics.median(times) / a.layers
            variant_results.append({
                "attention": kernels.chosen_attention(device)[0], "fused": kernels.use_fused(x0),
                "ms_per_layer": round(ms, 4), "ratio_diffusers_over_ours": round(statistics.median(
                    res["ref_blocks"]) / a.layers / ms, 4),
                "max_abs_diff_vs_diffusers": (out["v"].float() - out["ref_blocks"].float()).abs().max().item(),
                "max_abs_diff_vs_first": (out["v"].float() - out["ours_blocks"].float()).abs().max().item(),
            })
        use_variant(variants[0])

    med = {k: statistics.median(v) if v else float("nan") for k, v in res.items()}
    s, d = layout.seq_len, cfg["hidden_size"]
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    linear_flops_per_row = 2 * (4 * d * inner + 3 * d * cfg["ffn_dim"])
    flops_per_layer = s * linear_flops_per_row + 4 * s * s * inner
    ours_layer_ms = med["ours_blocks"] / a.layers
    ref_layer_ms = med["ref_blocks"] / a.layers
    ours_tflops = flops_per_layer / (ours_layer_ms * 1e-3) / 1e12
    ref_tflops = flops_per_layer / (ref_layer_ms * 1e-3) / 1e12
    on_gpu = device.type == "cuda"
    result = {
        "bench": "dit_layer",
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "dtype": a.dtype,
        "preset": a.preset,
        "config": {"width": d, "heads": cfg["num_attention_heads"], "head_dim": cfg["attention_head_dim"],
                   "ffn": cfg["ffn_dim"], "layers": a.layers},
        "seq": {"S": s, "text": text_len, "video_rows": layout.num_video_rows, "audio_rows": layout.num_audio_rows,
                "latent": [frames, lh, lw], "audio_latents": audio_latents},
        "iters": a.iters,
        "attention": kernels.chosen_attention(device)[0],
        "fused": kernels.use_fused(x0),
        "ours_ms_per_layer": round(ours_layer_ms, 4),
        "diffusers_ms_per_layer": round(ref_layer_ms, 4),
        "ratio_diffusers_over_ours": round(ref_layer_ms / ours_layer_ms, 4),
        "ours_forward_ms": round(med["ours_fwd"], 4),
        "diffusers_forward_ms": round(med["ref_fwd"], 4),
        "forward_ratio_diffusers_over_ours": round(med["ref_fwd"] / med["ours_fwd"], 4),
        "max_abs_diff": {"blocks": diff_blocks, "video": diff_video, "audio": diff_audio,
                         "video_output_max_abs": scale_video},
        "flops_per_layer": flops_per_layer,
        "linear_flops_per_row": linear_flops_per_row,
        "ours_tflops": round(ours_tflops, 3),
        "diffusers_tflops": round(ref_tflops, 3),
        "peak_tflops": a.peak_tflops if on_gpu else None,
        "ours_flop_limit_ratio": round(ours_tflops / a.peak_tflops, 4) if on_gpu else None,
        "diffusers_flop_limit_ratio": round(ref_tflops / a.peak_tflops, 4) if on_gpu else None,
        "flop_limit_ms_per_layer": round(flops_per_layer / (a.peak_tflops * 1e12) * 1e3, 4),
        "weights_gib": round(weights_bytes / 2**30, 3) if on_gpu else None,
        "peak_hbm_gib": round(peak_bytes / 2**30, 3) if on_gpu else None,
        "variants": variant_results,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
