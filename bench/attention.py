"""Dense attention kernels alone at the DiT's geometry: which one is fastest on this GPU, and how far from each other.

One call = softmax(q kᵀ / sqrt(Dh)) v over the whole packed sequence, no mask, bf16, q/k/v as the model holds them:
(B, N, H, Dh) buffers (the project's kernels see them as (B, H, N, Dh) transposed views). FLOPs = 4·B·N²·H·Dh.
Kernels: the project's (`h3serve/models/dit/kernels.py`: cudnn, flash, fa3, sdpa) and, when importable, FlashAttention-4
(`flash-attn-4`, CuTe DSL; its Hopper path JIT-compiles on first call, timed separately as compile_s).

Prints one JSON line: per kernel ms (median of --iters after --warmup), TFLOP/s, max|Δ| against the first kernel.

    python bench/attention.py --device cuda --kernels cudnn,fa3,fa4      # 10 s 1344x768: N = 73,642, 56 x 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _fa4():
    from flash_attn.cute.interface import flash_attn_func  # PyPI flash-attn-4

    def attention(q, k, v):  # (B, H, N, Dh) views of (B, N, H, Dh) buffers, like the project's kernels
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=73642, help="packed rows N (default: the 10 s 1344x768 request)")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kernels", default="cudnn,fa3,fa4", help="comma separated; the first is the reference")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from h3serve.models.dit import kernels

    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(dev).manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2) for _ in range(3))
    flops = 4 * args.batch * args.seq ** 2 * args.heads * args.head_dim
    result: dict = {"bench": "attention", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "shape_bnhd": list(shape), "flop": flops, "kernels": {}}
    ref, ref_name = None, None
    for name in dict.fromkeys(n for n in args.kernels.split(",") if n):  # each once, in the order given
        try:
            fn = _fa4() if name == "fa4" else kernels.resolve_attention(dev, name)[1]
            t0 = time.perf_counter()
            out = fn(q, k, v)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            first_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a kernel that is missing or fails is reported, the rest still run
            result["kernels"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        for _ in range(args.warmup):
            fn(q, k, v)
        times = []
        for _ in range(args.iters):
            if dev.type != "cuda":  # a smoke run
                t0 = time.perf_counter()
                fn(q, k, v)
                times.append((time.perf_counter() - t0) * 1e3)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(q, k, v)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        entry = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "first_call_s": round(first_s, 3),
                 "ms_runs": [round(t, 4) for t in times]}
        if ref is None:
            ref, ref_name, entry["reference"] = out, name, True
        else:
            entry[f"max_abs_diff_vs_{ref_name}"] = float((out.float() - ref.float()).abs().max())
        result["kernels"][name] = entry
        del out
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
