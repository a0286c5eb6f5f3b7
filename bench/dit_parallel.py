"""Sequence-parallel DiT forward (`parallelize_dit`, h3serve/models/dit/parallel.py) vs one GPU, same weights and
inputs. Prints one JSON line.

Spawns --world ranks itself (NCCL on CUDA, gloo on CPU). Rank 0 first times the plain model on its own GPU (the
1-GPU baseline, with each --baseline-attention), then every rank times the USP forward for each plan in --plans
(ulysses x ring). Scaling efficiency = T_1gpu / (world * T_world). max|delta| is against the 1-GPU outputs computed
with the attention kernel the plan uses locally (the process's choice, e.g. FA3 on Hopper, or the plan's ':NAME').

    python bench/dit_parallel.py --preset tiny --device cpu                                   # CPU smoke run
    python bench/dit_parallel.py --preset full --dtype bf16 --device cuda --layers 2 \\
        --seq-video-frames 243 --height 768 --width-px 1344 --plans 2x1,1x2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from h3serve.distributed.world import Runtime, free_port
from h3serve.models.dit import kernels
from h3serve.models.dit import layout as L
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.parallel import USPGroups, USPPlan, parallelize_dit
from h3serve.runtime.device import TORCH_DTYPES
from h3serve.testing.presets import transformer_config


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-video-frames", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--width-px", type=int)
    p.add_argument("--text-len", type=int)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--plans", default="2x1,1x2",
                   help="ulysses x ring plans, comma separated; a ':NAME' suffix runs the plan with H3SERVE_ATTENTION="
                        "NAME (the local attention kernel, h3serve.models.dit.kernels), e.g. 2x1:cudnn; default: the "
                        "process's own choice (FA3 on Hopper when installed)")
    p.add_argument("--baseline-attention", default="sdpa,fa3",
                   help="1-GPU baselines (H3SERVE_ATTENTION values; unavailable ones are skipped)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one forward of each baseline and plan (torch.profiler) and report its N kernels "
                        "with the most device time, per rank 0")
    return p.parse_args()


def _geometry(a) -> tuple[int, int, int, int, int]:
    full = a.preset == "full"
    text_len = a.text_len if a.text_len is not None else (256 if full else 7)
    frames = a.seq_video_frames or (243 if full else 22)
    height, width = a.height or (768 if full else 64), a.width_px or (1344 if full else 96)
    latent_frames = (frames - 5) // 17 * 5 + 2
    return text_len, latent_frames, height // 16, width // 16, int(round(frames / 24 * 40))


def _worker(rank: int, a: argparse.Namespace, port: int, queue) -> None:
    rt = Runtime(rank, a.world, master_addr="127.0.0.1", master_port=port, local_rank=rank, timeout_s=600,
                 device=a.device)
    dev = rt.device
    cuda = dev.type == "cuda"
    dtype = TORCH_DTYPES[a.dtype]
    cfg = transformer_config(a.preset)
    cfg["num_layers"] = a.layers
    torch.manual_seed(a.seed)  # the same weights on every rank
    with torch.device(dev):
        model = H3DiT(H3DiTConfig.from_dict(cfg)).eval().requires_grad_(False)
    model.cast(dtype).init_buffers(dev)
    with torch.no_grad():  # make AdaLN and the heads matter (the default init leaves them near zero)
        g = torch.Generator(dev).manual_seed(a.seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype) * 0.02)
    text_len, frames, lh, lw, audio_latents = _geometry(a)
    layout = L.build_t2va_layout(text_len, frames, lh, lw, audio_latents)
    gi = torch.Generator().manual_seed(a.seed + 1)
    video = torch.randn(1, layout.num_video_rows, 96, generator=gi).to(dev)
    audio = torch.randn(1, layout.num_audio_rows, 32, generator=gi).to(dev)
    text = torch.randn(1, text_len, cfg["text_dim"], generator=gi).to(dev, dtype)
    timesteps, ti = L.row_timesteps(layout, 0.0271674, 0.1004804)
    layout_dev = layout.to(dev)
    args = (video, audio, text, timesteps.to(dev), ti, layout_dev)

    def timed(fn):
        times, out = [], None
        for i in range(a.warmup + a.iters):
            if cuda:
                torch.cuda.synchronize(dev)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize(dev)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        return out, statistics.median(times) * 1e3

    res = {"baselines": {}, "plans": {}}
    refs = {}
    with torch.no_grad():
        for name in [n for n in a.baseline_attention.split(",") if n]:
            ok = name == "sdpa" or (cuda and (name != "fa3" or kernels.fa3_available(dev)))
            if not ok:
                continue
            os.environ["H3SERVE_ATTENTION"] = name
            kernels.reset_attention_choice()
            for b in model.transformer_blocks:
                b.attn.attention_fn = kernels.auto_attention
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            if rank == 0:
                out, ms = timed_local(model, args, a, dev)
                refs[name] = out
                res["baselines"][name] = {"forward_ms": round(ms, 4), "peak_hbm_gib": _peak(dev)}
                if a.profile:
                    res["baselines"][name]["profile"] = _profile(lambda: model(*args), a.profile, dev)
            torch.distributed.barrier()
        for spec in [p for p in a.plans.split(",") if p]:
            geo, _, local = spec.partition(":")
            u, r = (int(x) for x in geo.split("x"))
            if local == "fa3" and not (cuda and kernels.fa3_available(dev)):
                continue
            if local:
                os.environ["H3SERVE_ATTENTION"] = local
            else:
                os.environ.pop("H3SERVE_ATTENTION", None)
            kernels.reset_attention_choice()
            usp = parallelize_dit(model, USPGroups.build(rt, USPPlan(ulysses=u, ring=r)))
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                out, ms = timed(lambda: usp(*args))
            except Exception as exc:  # noqa: BLE001 - recorded; both ranks fail alike (same shapes)
                res["plans"][spec] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                continue
            peaks = [None] * a.world
            torch.distributed.all_gather_object(peaks, _peak(dev))
            entry = {"ulysses": u, "ring": r, "local_attention": local or "process default",
                     "forward_ms": round(ms, 4), "peak_hbm_gib_per_gpu": peaks}
            if rank == 0:
                used = local or kernels.chosen_attention(dev)[0]   # the kernel this plan ran locally
                ref_name = used if used in refs else "sdpa" if "sdpa" in refs else next(iter(refs), None)
                if ref_name is not None:
                    rv, ra = refs[ref_name]
                    entry["max_abs_diff_vs_1gpu"] = {"baseline": ref_name,
                                                     "video": (out[0] - rv).abs().max().item(),
                                                     "audio": (out[1] - ra).abs().max().item(),
                                                     "video_output_max_abs": rv.abs().max().item()}
                for name, base in res["baselines"].items():
                    entry[f"scaling_efficiency_vs_{name}"] = round(base["forward_ms"] / (a.world * ms), 4)
            if a.profile:
                prof = _profile(lambda: usp(*args), a.profile, dev)  # every rank runs it (collectives)
                if rank == 0:
                    entry["profile_rank0"] = prof
            res["plans"][spec] = entry
    if rank == 0:
        queue.put(res)
    torch.distributed.barrier()
    rt.close()


def timed_local(model, args, a, dev):
    cuda = dev.type == "cuda"
    times, out = [], None
    for i in range(a.warmup + a.iters):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = model(*args)
        if cuda:
            torch.cuda.synchronize(dev)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return out, statistics.median(times) * 1e3


def _profile(fn, top: int, dev) -> dict:
    """One call of `fn` under torch.profiler: total device ms per kernel family and the `top` kernels."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        if dev.type != "cuda":
            t = ev.self_cpu_time_total
        if t > 0:
            rows.append((t / 1e3, ev.count, ev.key))
    rows.sort(reverse=True)
    families = {"attention": ("flash", "fmha", "attn"), "nccl": ("nccl",), "gemm": ("gemm", "nvjet", "cutlass", "xmma"),
                "triton": ("triton",), "copy": ("copy", "elementwise", "cat", "index")}
    fam = {k: 0.0 for k in families}
    fam["other"] = 0.0
    for ms, _, key in rows:
        low = key.lower()
        name = next((k for k, subs in families.items() if any(x in low for x in subs)), "other")
        fam[name] += ms
    return {"family_ms": {k: round(v, 3) for k, v in fam.items()},
            "top": [{"ms": round(ms, 3), "count": c, "kernel": key[:120]} for ms, c, key in rows[:top]]}


def _peak(dev) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if dev.type == "cuda" else None


def main() -> None:
    a = _parse()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, a, port, queue)) for r in range(a.world)]
    for p in procs:
        p.start()
    res = queue.get(timeout=3600)
    for p in procs:
        p.join(timeout=120)
    text_len, frames, lh, lw, audio_latents = _geometry(a)
    s = L.build_t2va_layout(text_len, frames, lh, lw, audio_latents).seq_len
    out = {"bench": "dit_parallel", "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": a.dtype, "preset": a.preset, "layers": a.layers, "world": a.world,
           "S": s, "iters": a.iters, **res}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
