"""Encoder cache and conditioned-request overhead, through real stage processes on loopback. Prints one JSON line.

1. Encoder cache: `Encoder.Encode` wall time for a prompt seen for the first time (miss) and again (hit), and the
   same for `EncodeConditioned` with two keyframes (fl2va); medians over --repeats distinct prompts.
2. Served fl2va (first + last keyframe) vs t2va, same geometry, steps and seed, every request with a new prompt
   (cache misses on both sides): the gateway's t_client and per-stage timings, medians over --repeats.

    python bench/encoder_cache.py --checkpoint .cache/tiny-ckpt --size 320x256 --seconds 5 --steps 4

On the CPU the absolute times are not performance claims (docs: GPU only); the hit / miss ratio and the fl2va
overhead relative to t2va are what this measures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from h3serve.testing.serve import ServeProcess

REPO = Path(__file__).resolve().parents[1]


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


class Stack(ServeProcess):
    """`h3serve serve --stages all` on free loopback ports; the endpoints it prints."""

    def __init__(self, checkpoint: str, threads: int):
        super().__init__("--checkpoint", checkpoint, "--port", "0", "--http-port", "0", "--json", threads=threads,
                         cwd=REPO)
        try:
            self.serving = self.wait("serving", 600)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> int:
        return super().stop(120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=".cache/tiny-ckpt")
    ap.add_argument("--size", default="320x256")
    ap.add_argument("--seconds", default="5")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import grpc
    import torch

    from h3serve._proto import common_pb2, encoder_pb2, encoder_pb2_grpc
    from h3serve.client import Client
    from h3serve.testing.tiny import init_tiny_checkpoint
    from h3serve.transport.grpc import iter_tensor_chunks

    if not Path(args.checkpoint, "modular_model_index.json").exists():
        init_tiny_checkpoint(args.checkpoint)
    width, height = (int(v) for v in args.size.split("x"))
    first, last = _png(width // 2, height // 2, 1), _png(width // 2, height // 2, 2)
    images = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).copy()) for b in (first, last)]
    stack = Stack(args.checkpoint, args.threads)
    try:
        enc = grpc.insecure_channel(stack.serving["stages"]["encoder"]["address"])
        stub = encoder_pb2_grpc.EncoderStub(enc)

        def encode(prompt: str) -> tuple[float, bool]:
            t0 = time.perf_counter()
            events = list(stub.Encode(encoder_pb2.EncodeRequest(request_id="b", prompt=prompt, task="t2va"),
                                      timeout=120))
            return time.perf_counter() - t0, events[-1].done.cache_hit

        def encode_fl2va(prompt: str) -> tuple[float, bool]:
            params = encoder_pb2.EncodeParams(request_id="b", prompt=prompt, task="fl2va", width=width,
                                              height=height, kinds=["first", "last"])
            inputs = [encoder_pb2.EncodeInput(params=params),
                      *(encoder_pb2.EncodeInput(chunk=c) for i, t in enumerate(images)
                        for c in iter_tensor_chunks(f"condition.{i}", t)),
                      encoder_pb2.EncodeInput(end=common_pb2.StreamEnd(tensors=2))]
            t0 = time.perf_counter()
            events = list(stub.EncodeConditioned(iter(inputs), timeout=120))
            return time.perf_counter() - t0, events[-1].done.cache_hit

        cache = {}
        for name, fn in (("t2va", encode), ("fl2va", encode_fl2va)):
            miss, hit = [], []
            for i in range(args.repeats):
                prompt = f"{name} cache bench prompt {i} {time.time_ns()}"
                t, was_hit = fn(prompt)
                assert not was_hit
                miss.append(t)
                t, was_hit = fn(prompt)
                assert was_hit
                hit.append(t)
            cache[name] = {"miss_s": statistics.median(miss), "hit_s": statistics.median(hit),
                           "miss_over_hit": statistics.median(miss) / statistics.median(hit)}
        enc.close()

        served = {}
        base = dict(seconds=float(args.seconds), size=args.size, seed=0, num_inference_steps=args.steps)
        with Client(stack.serving["gateway"]["grpc"], timeout=600) as client:
            client.generate_sync(prompt="warm-up", **base)
            client.generate_sync(prompt="warm-up fl2va", first_image=first, last_image=last, **base)
            for task in ("t2va", "fl2va"):
                runs = []
                for i in range(args.repeats):
                    media = dict(first_image=first, last_image=last) if task == "fl2va" else {}
                    r = client.generate_sync(prompt=f"served {task} {i} {time.time_ns()}", **base, **media)
                    runs.append(r.timings)
                keys = sorted({k for t in runs for k in t if k.endswith("_s") or k == "t_client"})
                served[task] = {k: statistics.median(t.get(k, 0.0) for t in runs) for k in keys}
        overhead = served["fl2va"]["t_client"] - served["t2va"]["t_client"]
    finally:
        stack.stop()
    print(json.dumps({
        "bench": "encoder_cache", "device": "cpu", "threads": args.threads, "torch": torch.__version__,
        "checkpoint": str(args.checkpoint), "size": args.size, "seconds": args.seconds, "steps": args.steps,
        "repeats": args.repeats, "encoder_cache": cache, "served": served,
        "fl2va_overhead_s": overhead, "fl2va_overhead_ratio": overhead / served["t2va"]["t_client"],
    }))


if __name__ == "__main__":
    main()
