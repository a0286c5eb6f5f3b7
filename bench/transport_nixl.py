"""Frame-edge transport benchmark: VAE -> muxer clips through NIXL vs through a gRPC byte stream, same run.

Prints one JSON object. Two processes on this host: a receiver (the muxer side: one gRPC server) and a sender (the
VAE side: a gRPC client). Every method moves the same clips (17x768x1344x3 uint8 = 52.6 MB each) and is timed on the
sender from the first byte to the receiver's acknowledgement that it holds every clip as a tensor:

  nixl_zero_copy  NIXL WRITEs into the receiver's registered pool (K slots), control (handshake, headers, credits)
                  on a gRPC bidi stream through `QueuePipe`; the receiver gets views of its slots (the muxer mode).
  nixl_copy       the same, the receiver copies each clip out of its slot (the safe default).
  grpc            the baseline: a client stream of h3serve.v1.TensorChunk messages (<= 4 MiB - 64 KiB of data
                  each) that the receiver reassembles into a tensor, as a gRPC-only deployment moves frames.
  nixl_fallback   NixlSender/NixlReceiver with transport="grpc": the bytes inline on the bidi control stream
                  (1 MiB chunks), what `nixl` degrades to when NIXL cannot connect.

Also reports CPU seconds per GB on each side (user + sys of the whole process).

Then (`--tail-requests N`, default 3; 0 skips) the tail of a request through the services, with each transport in the
same run: two stacks (`h3serve serve --transport grpc` and `--transport nixl`, separate stage processes on
loopback, the tiny checkpoint unless `--checkpoint`) serve the same request alternately; reported per transport:
the gateway's `tail_s` (last latent in -> MP4 ready), `mux_tail_s` (last byte sent -> MP4 closed), `vae_s`,
`fetch_s`, frame-edge bytes, and whether the MP4s are byte-identical.

    python bench/transport_nixl.py --clips 20 --repeats 3
    python bench/transport_nixl.py --methods "" --tail-requests 5 --size 640x384 --seconds 5   # the tail only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from h3serve._proto import common_pb2
from h3serve.client import Client
from h3serve.testing.serve import ServeProcess
from h3serve.testing.tiny import init_tiny_checkpoint
from h3serve.transport.nixl.probe import nixl_version
from h3serve.transport.nixl.receiver import NixlReceiver
from h3serve.transport.nixl.sender import NixlSender
from h3serve.transport.pipes import QueuePipe

CLIP = (17, 768, 1344, 3)
SERVICE = "h3serve.bench.FrameEdge"
CHUNK = (4 << 20) - (64 << 10)
GRPC_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ----------------------------------------------------------------------------------------------------------------
# Receiver process: one gRPC server with a bidi "Pipe" (NIXL control / inline bytes) and a client-stream "Push"


def receiver_main(port_q, opts: dict) -> None:
    torch.set_num_threads(1)

    def run_pipe(pipe: QueuePipe, mode: str) -> None:
        cpu0 = _cpu()
        n = 0
        info = {}
        try:
            with NixlReceiver("vae->muxer", pipe, pool_buffers=opts["slots"], buffer_bytes=opts["slot_bytes"],
                              zero_copy=(mode == "nixl_zero_copy"),
                              transport="grpc" if mode == "nixl_fallback" else "nixl") as rx:
                pipe.send(rx.handshake())
                while (msg := rx.recv(timeout=120)) is not None:
                    n += msg.tensor.numel()
                info = rx.transport_info
        finally:
            pipe.send(json.dumps({"bytes": n, "cpu_s": _cpu() - cpu0, "transport": info}).encode())
            pipe.close()

    def pipe_handler(request_iterator, context):
        pipe = QueuePipe()
        pipe.pump(request_iterator)
        mode = dict(context.invocation_metadata()).get("mode", "nixl_copy")
        threading.Thread(target=run_pipe, args=(pipe, mode), daemon=True).start()
        return pipe.outgoing()

    def push_handler(request_iterator, context):
        cpu0 = _cpu()
        n = 0
        buf = None
        for chunk in request_iterator:
            if chunk.offset == 0:
                buf = np.empty(chunk.total_bytes, dtype=np.uint8)
            buf[chunk.offset:chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, dtype=np.uint8)
            if chunk.last:
                t = torch.from_numpy(buf).reshape(tuple(CLIP))   # the clip as a tensor, as the muxer gets it
                n += t.numel()
        return json.dumps({"bytes": n, "cpu_s": _cpu() - cpu0, "transport": {"chosen": "grpc"}}).encode()

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Pipe": grpc.stream_stream_rpc_method_handler(pipe_handler),
        "Push": grpc.stream_unary_rpc_method_handler(push_handler,
                                                     request_deserializer=common_pb2.TensorChunk.FromString),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(port)
    server.wait_for_termination()


# ----------------------------------------------------------------------------------------------------------------
# Sender process


def sender_main(port: int, result_q, opts: dict) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, CLIP, generator=g, dtype=torch.uint8)
    clips = [base, base + 1]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    pipe_call = channel.stream_stream(f"/{SERVICE}/Pipe")
    push_call = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=common_pb2.TensorChunk.SerializeToString)

    def via_pipe(mode: str) -> dict:
        pipe = QueuePipe()
        responses = pipe_call(pipe.outgoing(), metadata=(("mode", mode),))
        pipe.pump(responses)
        tx = NixlSender("vae->muxer", pipe, transport="grpc" if mode == "nixl_fallback" else "nixl")
        tx.connect(pipe.recv(60))
        cpu0, t0 = _cpu(), time.perf_counter()
        for i in range(opts["clips"]):
            tx.send("frames", clips[i % 2], {"index": i})
        tx.close(timeout=120)
        wall = time.perf_counter() - t0
        cpu = _cpu() - cpu0
        rx = json.loads(pipe.recv(60))
        pipe.close()
        return {"wall_s": wall, "tx_cpu_s": cpu, "rx_cpu_s": rx["cpu_s"], "bytes": rx["bytes"],
                "transport": tx.transport_info, "receiver_transport": rx["transport"],
                "max_in_flight": tx.stats.get("max_in_flight", 0), "credit_wait_s": tx.stats.get("credit_wait_s", 0)}

    def via_grpc() -> dict:
        def chunks():
            for i in range(opts["clips"]):
                data = memoryview(clips[i % 2].numpy()).cast("B")
                total = len(data)
                for off in range(0, total, CHUNK):
                    piece = data[off:off + CHUNK]
                    first = off == 0
                    yield common_pb2.TensorChunk(
                        name="frames", dtype="uint8" if first else "", shape=list(CLIP) if first else [],
                        offset=off, total_bytes=total if first else 0, data=bytes(piece),
                        last=off + len(piece) >= total, meta_json=json.dumps({"index": i}) if first else "")
        cpu0, t0 = _cpu(), time.perf_counter()
        reply = push_call(chunks(), timeout=600)
        wall = time.perf_counter() - t0
        cpu = _cpu() - cpu0
        rx = json.loads(reply)
        return {"wall_s": wall, "tx_cpu_s": cpu, "rx_cpu_s": rx["cpu_s"], "bytes": rx["bytes"],
                "transport": {"chosen": "grpc"}}

    methods = {"nixl_zero_copy": lambda: via_pipe("nixl_zero_copy"), "nixl_copy": lambda: via_pipe("nixl_copy"),
               "grpc": via_grpc, "nixl_fallback": lambda: via_pipe("nixl_fallback")}
    runs: dict[str, list] = {m: [] for m in opts["methods"]}
    for m in opts["methods"]:   # warm-up: agents, connections, page faults
        methods[m]()
    for _ in range(opts["repeats"]):
        for m in opts["methods"]:   # interleaved, so drift on a shared machine hits every method alike
            runs[m].append(methods[m]())
    result_q.put(runs)


# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# The tail through the services: one stack per transport, same requests


class _Stack(ServeProcess):
    def __init__(self, checkpoint: str, transport: str, threads: int):
        super().__init__("--checkpoint", checkpoint, "--port", "0", "--http-port", "0", "--json", "--transport",
                         transport, threads=threads)
        self.grpc = self.wait("serving", 600)["gateway"]["grpc"]

    def stop(self) -> int:
        return super().stop(60)


def services_tail(args) -> dict:
    checkpoint = args.checkpoint
    tmp = None
    if checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="h3bench-ckpt-")
        checkpoint = str(init_tiny_checkpoint(os.path.join(tmp.name, "tiny")))
    request = {"prompt": "a kite over the sea", "seconds": args.seconds, "size": args.size, "seed": 0,
               "num_inference_steps": args.steps}
    stacks = {}
    try:
        for t in ("grpc", "nixl"):
            stacks[t] = _Stack(checkpoint, t, args.threads)
        keys = ("tail_s", "mux_tail_s", "vae_s", "vae_video_s", "vae_audio_s", "fetch_s", "transfer_bytes")
        samples: dict = {t: [] for t in stacks}
        digests: dict = {t: set() for t in stacks}
        for i in range(args.tail_requests + 1):         # request 0 of each stack is a warm-up, not reported
            for t, st in stacks.items():
                with Client(st.grpc, timeout=600) as client:
                    r = client.generate(**request)
                digests[t].add(hashlib.sha256(r.mp4).hexdigest())
                if i:
                    samples[t].append({k: r.timings[k] for k in keys if k in r.timings})
        out = {"checkpoint": "tiny" if tmp else checkpoint, "request": request, "threads": args.threads,
               "requests": args.tail_requests, "mp4_identical": len(digests["grpc"] | digests["nixl"]) == 1,
               "transports": {}}
        for t, rs in samples.items():
            out["transports"][t] = {f"{k}_median": round(statistics.median(r[k] for r in rs), 4)
                                    for k in keys if k != "transfer_bytes"}
            out["transports"][t]["tail_s_runs"] = [round(r["tail_s"], 4) for r in rs]
            out["transports"][t]["frame_edge_bytes"] = int(rs[0].get("transfer_bytes", 0))
        g, n = out["transports"]["grpc"], out["transports"]["nixl"]
        out["tail_nixl_vs_grpc"] = round(n["tail_s_median"] / g["tail_s_median"], 3)
        return out
    finally:
        for st in stacks.values():
            st.stop()
        if tmp is not None:
            tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=20, help="clips per run (20 x 52.6 MB = 1.05 GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=3, help="K: receiver pool slots (parts in flight)")
    ap.add_argument("--slot-mib", type=int, default=64, help="B: slot size in MiB")
    ap.add_argument("--methods", default="nixl_zero_copy,nixl_copy,grpc,nixl_fallback")
    ap.add_argument("--tail-requests", type=int, default=3, help="services tail: requests per transport (0: skip)")
    ap.add_argument("--checkpoint", default=None, help="services tail: checkpoint (default a fresh tiny one)")
    ap.add_argument("--size", default="640x384", help="services tail: WxH")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--steps", type=int, default=4, help="services tail: num_inference_steps")
    ap.add_argument("--threads", type=int, default=1, help="services tail: torch threads per stage")
    args = ap.parse_args()
    opts = {"clips": args.clips, "repeats": args.repeats, "slots": args.slots, "slot_bytes": args.slot_mib << 20,
            "methods": [m for m in args.methods.split(",") if m]}

    runs = {}
    if opts["methods"]:
        ctx = mp.get_context("spawn")
        port_q, result_q = ctx.Queue(), ctx.Queue()
        rx = ctx.Process(target=receiver_main, args=(port_q, opts), daemon=True)
        rx.start()
        port = port_q.get(timeout=120)
        tx = ctx.Process(target=sender_main, args=(port, result_q, opts))
        tx.start()
        runs = result_q.get(timeout=3600)
        tx.join()
        rx.kill()
        rx.join()

    clip_bytes = 1
    for s in CLIP:
        clip_bytes *= s
    total = clip_bytes * args.clips
    out = {"bench": "transport_nixl", "edge": "vae->muxer (frames)", "host": platform.node(),
           "cpus": os.cpu_count(), "nixl": nixl_version(), "clip_shape": list(CLIP), "clip_bytes": clip_bytes,
           "clips": args.clips, "bytes_per_run": total, "repeats": args.repeats, "slots": args.slots,
           "slot_bytes": opts["slot_bytes"], "grpc_chunk_bytes": CHUNK, "methods": {}}
    for m, rs in runs.items():
        assert all(r["bytes"] == total for r in rs), f"{m}: receiver got {[r['bytes'] for r in rs]} of {total}"
        mbps = [total / r["wall_s"] / 1e6 for r in rs]
        gb = total / 1e9
        out["methods"][m] = {
            "MBps_median": round(statistics.median(mbps), 1), "MBps_best": round(max(mbps), 1),
            "MBps_runs": [round(x, 1) for x in mbps],
            "sender_cpu_s_per_GB": round(statistics.median(r["tx_cpu_s"] for r in rs) / gb, 3),
            "receiver_cpu_s_per_GB": round(statistics.median(r["rx_cpu_s"] for r in rs) / gb, 3),
            "transport": rs[0]["transport"],
            **({"max_in_flight": max(r["max_in_flight"] for r in rs)} if "max_in_flight" in rs[0] else {}),
        }
    meth = out["methods"]
    if "grpc" in meth:
        for m in ("nixl_zero_copy", "nixl_copy", "nixl_fallback"):
            if m in meth:
                meth[m]["vs_grpc"] = round(meth[m]["MBps_median"] / meth["grpc"]["MBps_median"], 2)
    if args.tail_requests > 0:
        out["services_tail"] = services_tail(args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
