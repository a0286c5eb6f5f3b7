"""Block-sparse DiT attention (`--sparse-attention`, h3serve/models/dit/sparse.py) on a GPU: correctness, speed,
and a quality proxy. Prints one JSON line per part.

    check      FlashAttention-4's block-sparse forward against masked SDPA and fp32 attention written out, with the
               router's block mask, bf16, a few thousand rows (dense FA3 against fp32 beside it: bf16's own rounding)
    attention  the kernels alone at the 10 s 1344x768 geometry (S = 73,642, 56 x 128): dense FA3, and per block size
               and density the router and the sparse kernel (ms, median of --iters after --warmup)
    layer      full-width DiT blocks (random weights) at that geometry: ms per block, dense and each density
    quality    a full-width DiT of --layers blocks (random weights: it ranks levers, it certifies nothing) denoising
               the 10 s request for --steps grid points, lossless vs each density: final-latent rel L2 and PSNR
    route      the router alone at that geometry (128-row blocks) with --route-heads heads: its q / k cell pooling
               and the whole route per density; runs on the CPU too

    python bench/sparse_attention.py --parts check,attention,layer,quality --densities 0.5,0.25,0.125
    python bench/sparse_attention.py --parts route --device cpu --route-heads 8 --densities 0.25 --iters 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="check,attention,layer,quality")
    p.add_argument("--densities", default="0.5,0.25,0.125")
    p.add_argument("--blocks", default="64,128", help="router block sizes timed in `attention` (the lever uses 64)")
    p.add_argument("--layers", type=int, default=4, help="blocks of the `layer` / `quality` model")
    p.add_argument("--steps", type=int, default=11, help="grid points of the `quality` run (forwards = steps - 1)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--route-heads", type=int, default=56, help="heads of the `route` part (56: one rank's all)")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


GEOMETRY = dict(text_len=256, latent_frames=72, latent_h=48, latent_w=84, audio_latents=405)  # 10 s 1344x768


def _layout():
    from h3serve.models.dit.layout import build_t2va_layout

    g = GEOMETRY
    return build_t2va_layout(g["text_len"], g["latent_frames"], g["latent_h"], g["latent_w"], g["audio_latents"])


def _time(fn, iters: int, warmup: int) -> tuple[float, list[float]]:
    """ms of fn(): median and runs (CUDA events on a GPU, the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(iters):
        if not torch.cuda.is_initialized():
            t0 = time.perf_counter()
            fn()
            runs.append(round((time.perf_counter() - t0) * 1e3, 4))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        runs.append(round(a.elapsed_time(b), 4))
    return statistics.median(runs), runs


def _device_info(dev) -> dict:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": name, "torch": torch.__version__}


def part_check(a, dev) -> dict:
    from h3serve.models.dit import kernels
    from h3serve.models.dit.sparse import (SparseConfig, fa4_block_sparse, fa4_unavailable, masked_attention,
                                           reference_attention, route, row_groups)

    out = {"bench": "sparse_check", **_device_info(dev), "fa4": fa4_unavailable(dev) or "loads"}
    from h3serve.models.dit.layout import build_t2va_layout

    layout = build_t2va_layout(256, 12, 24, 32, 90)  # 2,304 video rows between 256 text and 180 audio rows
    groups = row_groups(layout).to(dev)
    n = layout.seq_len
    g = torch.Generator(dev).manual_seed(0)
    q, k, v = (torch.randn(1, n, 4, 128, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    ref_dense = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    dense = kernels.chosen_attention(dev)[1](q, k, v)
    out["rows"] = n
    out["dense_kernel"] = kernels.chosen_attention(dev)[0]
    out["dense_vs_fp32_max_abs"] = float((dense.float() - ref_dense).abs().max())
    for block in (64, 128):
        for density in (0.5, 0.125):
            mask = route(q, k, groups, SparseConfig(density, block=block))
            ref = reference_attention(q.float(), k.float(), v.float(), mask, block)
            sdpa = masked_attention(q, k, v, mask, block)
            row = {"kept": round(float(mask.float().mean()), 4),
                   "sdpa_vs_fp32_max_abs": float((sdpa.float() - ref).abs().max())}
            try:
                fa4 = fa4_block_sparse(q, k, v, mask, block)
                row["fa4_vs_fp32_max_abs"] = float((fa4.float() - ref).abs().max())
                row["fa4_vs_sdpa_max_abs"] = float((fa4.float() - sdpa.float()).abs().max())
                row["fa4_vs_dense_max_abs"] = float((fa4.float() - ref_dense).abs().max())
            except Exception as exc:  # noqa: BLE001 - report, keep going
                row["fa4_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out[f"b{block}_d{density}"] = row
    return out


def part_attention(a, dev) -> dict:
    from h3serve.models.dit import kernels
    from h3serve.models.dit.sparse import SparseConfig, fa4_block_sparse, masked_attention, route, row_groups

    layout = _layout()
    n = layout.seq_len
    groups = row_groups(layout).to(dev)
    g = torch.Generator(dev).manual_seed(0)
    q, k, v = (torch.randn(1, n, 56, 128, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    name, dense = kernels.chosen_attention(dev)
    out = {"bench": "sparse_attention", **_device_info(dev), "rows": n, "heads": 56, "head_dim": 128,
           "dense_kernel": name}
    out["dense_ms"], out["dense_runs"] = _time(lambda: dense(q, k, v), a.iters, a.warmup)
    for block in [int(b) for b in a.blocks.split(",")]:
        for density in [float(d) for d in a.densities.split(",")]:
            cfg = SparseConfig(density, block=block)
            row = {}
            mask = route(q, k, groups, cfg)
            row["kept"] = round(float(mask.float().mean()), 4)
            row["route_ms"], _ = _time(lambda: route(q, k, groups, cfg), a.iters, 1)
            try:
                t0 = time.perf_counter()
                fa4_block_sparse(q, k, v, mask, block)
                torch.cuda.synchronize()
                row["fa4_first_call_s"] = round(time.perf_counter() - t0, 3)
                row["fa4_ms"], row["fa4_runs"] = _time(lambda: fa4_block_sparse(q, k, v, mask, block), a.iters,
                                                       a.warmup)
                row["fa4_plus_route_ms"] = round(row["fa4_ms"] + row["route_ms"], 4)
                row["speedup_vs_dense"] = round(out["dense_ms"] / row["fa4_plus_route_ms"], 3)
            except Exception as exc:  # noqa: BLE001
                row["fa4_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out[f"b{block}_d{density}"] = row
            del mask
            torch.cuda.empty_cache()
    _ = masked_attention  # the fallback is far slower at this size; not timed
    return out


def _full_model(layers: int, dev):
    from h3serve.models.dit.model import H3DiT, H3DiTConfig

    torch.manual_seed(0)
    with torch.device(dev):
        model = H3DiT(H3DiTConfig(num_layers=layers))
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.02)
    return model.cast(torch.bfloat16).init_buffers(dev).eval().requires_grad_(False)


def _request(steps: int):
    from h3serve.models.dit.engine import DiTRequest

    g = torch.Generator().manual_seed(3)
    n_text = GEOMETRY["text_len"]
    return DiTRequest(text_states=torch.randn(1, n_text, 5120, generator=g), text_tags=torch.ones(n_text,
                      dtype=torch.long), latent_frames=GEOMETRY["latent_frames"], latent_h=GEOMETRY["latent_h"],
                      latent_w=GEOMETRY["latent_w"], audio_latents=GEOMETRY["audio_latents"], seed=5, steps=steps)


def _detach(model) -> None:
    from h3serve.models.dit import kernels

    model.sparse = None
    for blk in model.transformer_blocks:
        blk.attn.attention_fn = kernels.auto_attention


def part_layer_quality(a, dev, parts) -> list[dict]:
    from h3serve.models.dit.engine import DiTEngine
    from h3serve.models.dit.layout import row_timesteps
    from h3serve.models.dit.sparse import SparseConfig, attach_sparse

    model = _full_model(a.layers, dev)
    densities = [float(d) for d in a.densities.split(",")]
    results = []
    if "layer" in parts:
        layout = _layout()
        lay = layout.to(dev)
        g = torch.Generator().manual_seed(1)
        video = torch.randn(1, layout.num_video_rows, 96, generator=g).to(dev)
        audio = torch.randn(1, layout.num_audio_rows, 32, generator=g).to(dev)
        text = torch.randn(1, 256, 5120, generator=g).to(dev, torch.bfloat16)
        ts, ti = row_timesteps(layout, 0.5, 0.5)
        x, ctx, _ = model.embed(video, audio, text, ts, ti, lay)
        out = {"bench": "sparse_layer", **_device_info(dev), "rows": layout.seq_len, "layers": a.layers}

        def blocks():
            model.run_blocks(x.clone(), ctx)

        ms, runs = _time(blocks, a.iters, a.warmup)
        out["dense_ms_per_layer"] = round(ms / a.layers, 4)
        for density in densities:
            state = attach_sparse(model, SparseConfig(density))
            state.begin(50)
            for _ in range(30):
                state.forward(lay)  # step 29 of 50: past the dense steps
            ms, runs = _time(blocks, a.iters, a.warmup)
            out[f"d{density}"] = {"ms_per_layer": round(ms / a.layers, 4), "kernel": state.kernel,
                                  "speedup_vs_dense": round(out["dense_ms_per_layer"] / (ms / a.layers), 3)}
            _detach(model)
        del x, ctx
        torch.cuda.empty_cache()
        results.append(out)
    if "quality" in parts:
        engine = DiTEngine({"transformer": model}, device=dev, profile="base")
        out = {"bench": "sparse_quality", **_device_info(dev), "layers": a.layers, "steps": a.steps,
               "caveat": "random weights: ranks levers, certifies nothing"}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ref = engine.generate(_request(a.steps))
        out["lossless_s"] = round(time.perf_counter() - t0, 3)
        for density in densities:
            state = attach_sparse(model, SparseConfig(density))
            t0 = time.perf_counter()
            res = engine.generate(_request(a.steps))
            row = {"s": round(time.perf_counter() - t0, 3), **(state.last or {})}
            for name, x, r in (("video", res.video, ref.video), ("audio", res.audio, ref.audio)):
                x, r = x.double(), r.double()
                mse = float(((x - r) ** 2).mean())
                peak = float(r.max() - r.min())
                row[f"{name}_rel_l2"] = round(float((x - r).norm() / r.norm()), 5)
                row[f"{name}_psnr_db"] = round(10 * math.log10(peak ** 2 / mse), 2) if mse > 0 else None
            out[f"d{density}"] = row
            _detach(model)
        results.append(out)
    return results


def part_route(a, dev) -> dict:
    from h3serve.models.dit import sparse

    layout = _layout()
    n, heads = layout.seq_len, a.route_heads
    groups = sparse.row_groups(layout).to(dev)
    g = torch.Generator(dev).manual_seed(0)
    # as attention hands them over: (B, N, H, D) transposed to (B, H, N, D) views
    q, k = (torch.randn(1, n, heads, 128, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(2))
    cell = 128 // 4
    out = {"bench": "sparse_route", **_device_info(dev), "rows": n, "heads": heads, "block": 128}
    out["pool_qk_ms"], out["pool_qk_runs"] = _time(lambda: (sparse._pool(q, cell), sparse._pool(k, cell)), a.iters,
                                                   a.warmup)
    for density in [float(d) for d in a.densities.split(",")]:
        cfg = sparse.SparseConfig(density)
        mask = sparse.route(q, k, groups, cfg)
        out[f"d{density}"] = {"kept": round(float(mask.float().mean()), 4),
                              "route_ms": _time(lambda: sparse.route(q, k, groups, cfg), a.iters, a.warmup)[0]}
    return out


def main(argv=None) -> int:
    a = _parse(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    parts = a.parts.split(",")
    if "route" in parts:
        print(json.dumps(part_route(a, dev)), flush=True)
    if "check" in parts:
        print(json.dumps(part_check(a, dev)), flush=True)
    if "attention" in parts:
        print(json.dumps(part_attention(a, dev)), flush=True)
    if "layer" in parts or "quality" in parts:
        for r in part_layer_quality(a, dev, parts):
            print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
