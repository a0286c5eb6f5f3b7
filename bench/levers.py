"""The capacity and speed levers against the dense bf16 path, one H200. Prints one JSON line per part.

    python bench/levers.py --parts dlo,fp8model,layer --device cuda      # the 10 s 1344x768 geometry, 50 layers
    python bench/levers.py --parts quality --device cuda                 # whole 49-step requests, smaller geometry
    python bench/levers.py --parts fp8model --fp8-offload-r 2 --device cuda  # FP8 + FP8 attention + offload together
    python bench/levers.py --parts quality --device cpu --quality-layers 3 --quality-geometry 22x64x96 --width 64  # smoke

Parts:
  dlo       layerwise offload Pareto: one full-geometry forward per r (latency, peak HBM, max |diff| vs resident);
            r = 50 (resident) first and last, the streamed ones in between, all from one set of pinned host copies.
  fp8model  the same 50-layer DiT with its block linears in FP8 (weights on the device, peak HBM, one forward with
            bf16 FA3 and one with FP8 attention, relative L2 of the velocities vs the bf16 forward).
  layer     per-layer time of 2 blocks: bf16 | FP8 linears | FP8 attention | both; rel L2 of the block output.
  encoder   the Qwen3-VL text encoder (50 decoder layers + vision tower) in bf16 and with FP8 projections: bytes (CPU:
            counted on the meta device), HBM and one 256-token forward on CUDA, rel L2 of the states.
  quality   whole requests through DiTEngine (49 forwards, base schedule) at a smaller geometry: fp32, bf16,
            quality=high (step reuse, per threshold), FP8 linears, FP8 attention, both; final-latent relative L2 vs
            bf16 and vs fp32 on the same seed, PSNR of decoded frames (tiny random video VAE) vs the bf16 decode,
            forwards computed. Random weights: every quality figure is a proxy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from h3serve.models.dit import kernels
from h3serve.models.dit import layout as L
from h3serve.models.dit.model import FP32_MODULES, H3DiT, H3DiTConfig
from h3serve.models.offload import attach_offload
from h3serve.models.dit.quant import quantize_dit, weight_bytes
from h3serve.testing.presets import transformer_config

GIB = float(1 << 30)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def build(cfg: dict, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> H3DiT:
    """Random H3DiT built straight on the device in the checkpoint's precision (bf16 + fp32 modules): meta, cast on
    meta, to_empty, then fan-in-scaled normal weights (AdaLN projections x0.1, so gates stay small) and zero biases."""
    c = dict(cfg, num_layers=layers)
    with torch.device("meta"):
        model = H3DiT(H3DiTConfig.from_dict(c))
    for name, child in model.named_children():
        child.to(torch.float32 if name in FP32_MODULES or name == "rope" else dtype)
    model.to_empty(device=device)
    model.init_buffers(device).eval().requires_grad_(False)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            else:
                std = 1.0 / math.sqrt(p.shape[1]) * (0.1 if "adaln" in name or "norm_out" in name else 1.0)
                p.normal_(0.0, std, generator=g)
    return model


def config_for(width: int | None) -> dict:
    """The released DiT config, or (CPU smoke runs) one of hidden size `width` with 32-wide heads."""
    cfg = transformer_config("full")
    if width:
        cfg.update(hidden_size=width, num_attention_heads=max(1, width // 32), attention_head_dim=32,
                   ffn_dim=2 * width, text_dim=width, time_embed_hidden_dim=width, time_embed_dim=width // 2,
                   rope_freq_dim=4, freq_dim=16)
    return cfg


def geometry(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    latent_frames = (frames - 5) // 17 * 5 + 2
    return latent_frames, height // 16, width // 16, int(round(frames / 24 * 40))


def inputs(cfg: dict, text_len: int, frames: int, lh: int, lw: int, audio: int, device, dtype, seed: int = 1):
    layout = L.build_t2va_layout(text_len, frames, lh, lw, audio)
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, layout.num_video_rows, cfg["in_channels"] * 4, generator=g).to(device)
    aud = torch.randn(1, layout.num_audio_rows, cfg["audio_in_channels"], generator=g).to(device)
    text = torch.randn(1, text_len, cfg["text_dim"], generator=g).to(device, dtype)
    timesteps, ti = L.row_timesteps(layout, 0.5, 0.5)
    return video, aud, text, timesteps.to(device), ti, layout.to(device)


def timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b) / 1e3, out
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def alloc_gib(device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def set_attention(device, name: str | None) -> None:
    kernels.reset_attention_choice()
    if name:
        kernels.choose_attention(device, name)


# ---- parts --------------------------------------------------------------------------------------------------------


def part_dlo_and_fp8(a, cfg, device, dtype) -> None:
    lf, lh, lw, au = geometry(a.frames, a.height, a.width_px)
    t0 = time.perf_counter()
    model = build(cfg, a.layers, device, dtype)
    log(f"built {a.layers} layers in {time.perf_counter() - t0:.1f}s, {alloc_gib(device)} GiB")
    args = inputs(cfg, a.text_len, lf, lh, lw, au, device, dtype)
    seq = args[-1].seq_len
    small = inputs(cfg, 16, 2, 4, 6, 5, device, dtype)
    with torch.no_grad():
        model(*small)  # kernels compiled / loaded before anything is timed
        base = {"seq_len": seq, "layers": a.layers, "geometry": f"{a.frames}x{a.height}x{a.width_px}",
                "attention": kernels.chosen_attention(device)[0]}
        rows = []

        def measure(tag: str, r: int, ref=None):
            reset_peak(device)
            before = alloc_gib(device)
            sec, out = timed(lambda: model(*args), device)
            row = {"config": tag, "r": r, "forward_s": round(sec, 4), "weights_on_device_gib": before,
                   "peak_gib": peak_gib(device)}
            if ref is not None:
                row["max_abs_diff_vs_resident"] = max(float((o - w).abs().max()) for o, w in zip(out, ref))
            rows.append(row)
            log(row)
            return out

        ref = measure("resident", a.layers)
        ref_row = dict(rows[0])
        if "dlo" in a.parts:
            t0 = time.perf_counter()
            off = attach_offload(model, min(a.r_values), device)
            setup = time.perf_counter() - t0
            log(f"offload setup (pinned host copies of {len(off.host)} blocks) {setup:.1f}s")
            for r in sorted(a.r_values, reverse=True):
                off.resize(r)
                measure(f"dlo_r{r}", r, ref)
            off.resize(a.layers)
            measure("resident_again", a.layers, ref)
            rep = off.report()
            emit({"part": "dlo", **base, "block_bytes": rep["block_bytes"], "setup_s": round(setup, 1),
                  "host_pinned_gib": sum(t.numel() for t in off.host.values()) / GIB, "rows": rows})
            model.block_runner = None
            del off
            torch.cuda.empty_cache() if device.type == "cuda" else None
        if "fp8model" in a.parts:
            bf16_bytes = weight_bytes(model.transformer_blocks)
            names = quantize_dit(model)
            torch.cuda.empty_cache() if device.type == "cuda" else None
            fp8_bytes = weight_bytes(model.transformer_blocks)
            from h3serve.models.dit.quant import quantize_rows_fused

            for k in sorted({cfg["hidden_size"], cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]}):
                quantize_rows_fused(torch.randn(seq, k, device=device, dtype=dtype))  # compiled before the timing
            res = {"part": "fp8model", **base, "linears_quantized": len(names),
                   "blocks_bytes_bf16": bf16_bytes, "blocks_bytes_fp8": fp8_bytes,
                   "whole_dit_bytes_fp8": weight_bytes(model), "fp8_gemm": torch.cuda.is_available()}
            rows.clear()
            out = measure("fp8_linear", a.layers)
            res["fp8_linear"] = dict(rows[-1], rel_l2_video_vs_bf16=rel_l2(out[0], ref[0]),
                                     rel_l2_audio_vs_bf16=rel_l2(out[1], ref[1]))
            set_attention(device, "fp8")
            out = measure("fp8_linear_fp8_attention", a.layers)
            res["fp8_linear_fp8_attention"] = dict(rows[-1], rel_l2_video_vs_bf16=rel_l2(out[0], ref[0]),
                                                   rel_l2_audio_vs_bf16=rel_l2(out[1], ref[1]))
            if a.fp8_offload_r:  # the levers together: FP8 blocks streamed through r slots, FP8 attention
                t0 = time.perf_counter()
                off = attach_offload(model, a.fp8_offload_r, device)
                setup = time.perf_counter() - t0
                out = measure(f"fp8_both_dlo_r{a.fp8_offload_r}", a.fp8_offload_r)
                res["fp8_both_dlo"] = dict(rows[-1], setup_s=round(setup, 1), block_bytes=off.report()["block_bytes"],
                                           rel_l2_video_vs_bf16=rel_l2(out[0], ref[0]),
                                           rel_l2_audio_vs_bf16=rel_l2(out[1], ref[1]))
            set_attention(device, None)
            res["resident_bf16"] = ref_row
            emit(res)


def part_layer(a, cfg, device, dtype) -> None:
    lf, lh, lw, au = geometry(a.frames, a.height, a.width_px)
    model = build(cfg, 2, device, dtype, seed=3)
    args = inputs(cfg, a.text_len, lf, lh, lw, au, device, dtype)
    out = {"part": "layer", "seq_len": args[-1].seq_len, "variants": {}}
    with torch.no_grad():
        x0, ctx, _ = model.embed(*args)

        def run(tag):
            times = []
            for i in range(a.warmup + a.iters):
                x = x0.clone()
                sec, y = timed(lambda: model.run_blocks(x, ctx), device)
                if i >= a.warmup:
                    times.append(sec)
            times.sort()
            return times[len(times) // 2] / 2, y  # per layer

        set_attention(device, None)
        t_bf16, y_bf16 = run("bf16")
        out["variants"]["bf16"] = {"layer_s": round(t_bf16, 5), "attention": kernels.chosen_attention(device)[0]}
        set_attention(device, "fp8")
        t, y = run("fp8_attention")
        out["variants"]["fp8_attention"] = {"layer_s": round(t, 5), "rel_l2_vs_bf16": rel_l2(y, y_bf16)}
        set_attention(device, None)
        quantize_dit(model)
        from h3serve.models.dit import quant

        quant._COMPILED = quant.quantize_rows  # the activation quantization as separate eager ops
        t, y = run("fp8_linear_eager_quant")
        out["variants"]["fp8_linear_eager_quant"] = {"layer_s": round(t, 5), "rel_l2_vs_bf16": rel_l2(y, y_bf16)}
        quant._COMPILED = None  # the default: one compiled kernel
        t, y = run("fp8_linear")
        out["variants"]["fp8_linear"] = {"layer_s": round(t, 5), "rel_l2_vs_bf16": rel_l2(y, y_bf16),
                                         "quantizer": "eager" if quant._COMPILED is quant.quantize_rows else "fused"}
        act = torch.randn(args[-1].seq_len, cfg["ffn_dim"], device=device, dtype=dtype)
        for tag, fn in (("eager", quant.quantize_rows), ("fused", quant.quantize_rows_fused)):
            fn(act)
            ts = sorted(timed(lambda: fn(act), device)[0] for _ in range(5))
            out[f"act_quant_{tag}_ms_{act.shape[0]}x{act.shape[1]}"] = round(ts[2] * 1e3, 3)
        del act
        set_attention(device, "fp8")
        t, y = run("fp8_both")
        out["variants"]["fp8_linear_fp8_attention"] = {"layer_s": round(t, 5), "rel_l2_vs_bf16": rel_l2(y, y_bf16)}
        set_attention(device, None)
    emit(out)


def part_quality(a, cfg, device) -> None:
    from h3serve.models.dit.engine import DiTEngine, DiTRequest
    from h3serve.models.dit.reuse import ReuseConfig
    from h3serve.models.vae.video import VideoVAE, to_uint8
    from h3serve.testing.tiny import build_video_vae

    frames, height, width = (int(v) for v in a.quality_geometry.split("x"))
    lf, lh, lw, au = geometry(frames, height, width)
    vae = VideoVAE(build_video_vae(0).to(device))
    g = torch.Generator().manual_seed(7)
    text = torch.randn(1, a.text_len_quality, cfg["text_dim"], generator=g)
    tags = torch.ones(a.text_len_quality, dtype=torch.long)

    def request(model, dtype, quality="lossless", reuse=ReuseConfig(), attention=None):
        set_attention(device, attention)
        engine = DiTEngine({"transformer": model}, device=device, profile="base", reuse=reuse)
        req = DiTRequest(text_states=text.to(dtype), text_tags=tags, latent_frames=lf, latent_h=lh, latent_w=lw,
                         audio_latents=au, seed=11, quality=quality)
        res = engine.generate(req)
        set_attention(device, None)
        return res

    def decode(video):
        with torch.no_grad():
            return to_uint8(vae.decode_float(video.to(device))).float()

    def psnr(x, ref):
        mse = float(((x - ref) ** 2).mean())
        return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)

    runs = {}
    m32 = build(cfg, a.quality_layers, device, torch.float32, seed=5)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is the reference: no TF32
    runs["fp32"] = request(m32, torch.float32)
    del m32
    mb = build(cfg, a.quality_layers, device, torch.bfloat16, seed=5)
    runs["bf16"] = request(mb, torch.bfloat16)
    for thr in a.thresholds:
        runs[f"high_t{thr}"] = request(mb, torch.bfloat16, "high", ReuseConfig(threshold=thr))
    runs["fp8_attention"] = request(mb, torch.bfloat16, attention="fp8")
    quantize_dit(mb)
    runs["fp8_linear"] = request(mb, torch.bfloat16)
    runs["fp8_linear_fp8_attention"] = request(mb, torch.bfloat16, attention="fp8")
    ref_b, ref_f = runs["bf16"], runs["fp32"]
    frames_b = decode(ref_b.video)
    out = {"part": "quality", "note": "random weights: the deviations and PSNR are proxies", "layers": a.quality_layers,
           "geometry": a.quality_geometry, "steps": ref_b.steps, "runs": {}}
    for name, r in runs.items():
        out["runs"][name] = {
            "seconds": round(r.seconds, 3), "forwards": r.steps, "forwards_computed": r.forwards_computed,
            "block_evaluations": r.block_evaluations,
            "forward_reduction": round(r.steps / max(1, r.forwards_computed), 3),
            "rel_l2_video_vs_bf16": rel_l2(r.video, ref_b.video), "rel_l2_audio_vs_bf16": rel_l2(r.audio, ref_b.audio),
            "rel_l2_video_vs_fp32": rel_l2(r.video, ref_f.video), "rel_l2_audio_vs_fp32": rel_l2(r.audio, ref_f.audio),
            "psnr_frames_vs_bf16_db": psnr(decode(r.video), frames_b),
        }
    emit(out)


def part_encoder(a, device) -> None:
    """Qwen3-VL-32B truncated to the 50 decoder layers H3 reads (+ vision tower): weight bytes in bf16 and with the
    text decoder in FP8, counted on the built modules (meta device: no memory, exact shapes and dtypes); on CUDA also
    built for real (random weights), its HBM and one 256-token forward timed, bf16 vs FP8."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from h3serve.models.encoder.fp8 import quantize_text_decoder
    from h3serve.testing.presets import (TEXT_ENCODER_LAYER, text_encoder_text_config,
                                         text_encoder_vision_config)

    text = dict(text_encoder_text_config("full"), num_hidden_layers=TEXT_ENCODER_LAYER)
    config = Qwen3VLConfig(text_config=text, vision_config=text_encoder_vision_config("full"))
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    build_on = device if device.type == "cuda" else torch.device("meta")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built (and initialized by transformers) straight in bf16 on the device
    try:
        with torch.device(build_on):
            model = Qwen3VLModel(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(torch.float32)
    model.language_model.norm = torch.nn.Identity()
    out = {"part": "encoder", "layers": TEXT_ENCODER_LAYER, "bytes_bf16": weight_bytes(model)}
    if build_on.type == "cuda":
        ids = torch.randint(0, 150000, (1, a.text_len), generator=torch.Generator().manual_seed(1)).to(build_on)
        mask = torch.ones_like(ids)

        def fwd():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

        with torch.no_grad():
            fwd()
            out["hbm_weights_gib_bf16"] = alloc_gib(build_on)
            reset_peak(build_on)
            sec, want = timed(fwd, build_on)
            out.update(forward_s_bf16=round(sec, 4), peak_gib_bf16=peak_gib(build_on))
    names = quantize_text_decoder(model)
    out.update(linears_quantized=len(names), bytes_fp8=weight_bytes(model))
    if build_on.type == "cuda":
        torch.cuda.empty_cache()
        with torch.no_grad():
            fwd()
            out["hbm_weights_gib_fp8"] = alloc_gib(build_on)
            reset_peak(build_on)
            sec, got = timed(fwd, build_on)
        out.update(forward_s_fp8=round(sec, 4), peak_gib_fp8=peak_gib(build_on),
                   rel_l2_states_vs_bf16=rel_l2(got, want))
    emit(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="dlo,fp8model,layer,quality")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--r-values", default="35,20,8,2")
    p.add_argument("--fp8-offload-r", type=int, default=0, help="fp8model: also stream the FP8 blocks with this r")
    p.add_argument("--frames", type=int, default=243)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--width-px", type=int, default=1344)
    p.add_argument("--text-len", type=int, default=256)
    p.add_argument("--width", type=int, help="hidden size override (CPU smoke runs)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quality-layers", type=int, default=8)
    p.add_argument("--quality-geometry", default="56x256x448", help="FRAMESxHxW of the quality part")
    p.add_argument("--text-len-quality", type=int, default=64)
    p.add_argument("--thresholds", default="0.05,0.1,0.2")
    a = p.parse_args()
    a.parts = set(a.parts.split(","))
    a.r_values = [int(v) for v in a.r_values.split(",")]
    a.thresholds = [float(v) for v in a.thresholds.split(",")]
    device = torch.device(a.device)
    cfg = config_for(a.width)
    if device.type == "cuda":
        emit({"part": "env", "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "fa3": kernels.fa3_available(device)})
    if "layer" in a.parts:  # first: it also compiles the fused activation quantization at this geometry
        part_layer(a, cfg, device, torch.bfloat16)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if a.parts & {"dlo", "fp8model"}:
        part_dlo_and_fp8(a, cfg, device, torch.bfloat16)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if "quality" in a.parts:
        part_quality(a, cfg, device)
    if "encoder" in a.parts:
        part_encoder(a, device)


if __name__ == "__main__":
    main()
