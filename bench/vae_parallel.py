"""Video VAE patch parallel (h3serve/models/vae/parallel.py) over --world ranks vs one rank, same weights and latents.

Prints one JSON line. Spawns the ranks itself (NCCL on CUDA, gloo on CPU). Rank 0 first times the 1-rank tiled decode
(VideoVAE.iter_decode, clip by clip), then all ranks time PatchParallelVAE.iter_decode; frames are compared bitwise.

    python bench/vae_parallel.py --preset tiny --device cpu --world 2
    python bench/vae_parallel.py --preset full --device cuda --dtype bf16 --latents 72x48x84 --world 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _decode_all(vae, z):
    frames = [clip for clip in vae.iter_decode(z)]
    return torch.cat(frames) if frames else None


def _rank(rank: int, args, port: int) -> None:
    from h3serve.models.vae.parallel import PatchParallelVAE
    from h3serve.models.vae.video import VideoVAE
    from h3serve.runtime.device import TORCH_DTYPES
    from h3serve.testing.modules import random_video_vae

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world, device_id=device if cuda else None)
    dtype = TORCH_DTYPES[args.dtype]
    vae = VideoVAE(random_video_vae(args.preset, dtype, device, seed=0))
    t, h, w = (int(x) for x in args.latents.split("x"))
    z = torch.randn(1, 24, t, h, w, generator=torch.Generator().manual_seed(1)).to(device)

    def timed(fn, collective=True):
        out = None
        times = []
        for i in range(args.warmup + args.iters):
            if collective:
                dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        return out, statistics.median(times)

    result = {}
    if rank == 0:
        ref, t1 = timed(lambda: _decode_all(vae, z), collective=False)
        result.update(one_rank_s=t1, frames=int(ref.shape[0]))
        if cuda:
            result["one_rank_peak_hbm_gib"] = torch.cuda.max_memory_allocated() / 2**30
    dist.barrier()
    pp = PatchParallelVAE(vae, dist.group.WORLD, rank, args.world)
    out, tw = timed(lambda: _decode_all(pp, z))
    if rank == 0:
        result.update(world=args.world, pp_s=tw, speedup=result["one_rank_s"] / tw,
                      identical=bool(torch.equal(out, ref)), max_abs_diff=int((out.int() - ref.int()).abs().max()))
        if cuda:
            result["pp_peak_hbm_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
        print(json.dumps({"bench": "vae_parallel", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                          "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype,
                          "latents": args.latents, "iters": args.iters, **result}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--latents", default="12x8x12")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
