"""gRPC transport benchmark: frames VAE -> muxer throughput, and the tail (last latent in -> MP4 ready) of the
services vs the embedded pipeline. Prints one JSON line.

    python bench/transport_grpc.py --checkpoint .cache/tiny-ckpt

throughput: a sink server in its own process implements Muxer.Push with the transport's receiver and drops what
  it gets; this process sends clips of 17 frames through `GrpcStreamSender` (the VAE's sender) as the VAE cuts
  them (whole frames per message of at most 4 MiB). MB/s = payload bytes / (first send -> the sink's reply), for
  yuv420p planes (what the VAE sends by default) and rgb24, at the full canvas 1344x768.
tail: the same latents (from the embedded pipeline's DiT) are turned into an MP4 (a) in process by
  `Pipeline.write_mp4` (decode clip by clip while a thread encodes) and (b) by the services: OpenSession on the
  muxer, VAE.Decode streaming frames to the muxer, Fetch of the MP4, as the gateway does after the DiT. Stage
  processes are started with `h3serve serve --stages vae,muxer`; both sides use the same torch thread count. The
  MP4 bytes of (a) and (b) are compared.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # runnable from a checkout without installing

from h3serve._proto import common_pb2, muxer_pb2, muxer_pb2_grpc, vae_pb2, vae_pb2_grpc
from h3serve.config.request import validate_request
from h3serve.models.vae.yuv import rgb_to_yuv420p
from h3serve.pipeline import Pipeline
from h3serve.testing.serve import ServeProcess
from h3serve.testing.tiny import init_tiny_checkpoint
from h3serve.transport.grpc import (
    CHUNK_BYTES,
    GrpcStreamReceiver,
    GrpcStreamSender,
    channel_options,
    iter_tensor_chunks,
    server_options,
)

# ---------------------------------------------------------------------------------------------------------------
# throughput: a sink Push server

def run_sink(port_file: str) -> None:
    def unwrap(msg):
        kind = msg.WhichOneof("item")
        return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)

    class Sink(muxer_pb2_grpc.MuxerServicer):
        def Push(self, request_iterator, context):
            next(request_iterator)
            frames = 0
            for msg in GrpcStreamReceiver(request_iterator, unwrap, edge="vae->muxer"):
                frames += int(msg.tensor.shape[0]) if msg.header.name in ("frames", "y") else 0
            return muxer_pb2.PushResult(frames=frames)

    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options())
    muxer_pb2_grpc.add_MuxerServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(0)


def clip_parts(fmt: str, clip_rgb: torch.Tensor, planes) -> list[tuple[str, torch.Tensor]]:
    n = clip_rgb.shape[0]
    if fmt == "rgb24":
        per = max(1, CHUNK_BYTES // clip_rgb[0].numel())
        return [("frames", clip_rgb[s:s + per]) for s in range(0, n, per)]
    y, u, v = planes
    per = max(1, CHUNK_BYTES // y[0].numel())
    return list(itertools.chain.from_iterable(
        [("y", y[s:s + per]), ("u", u[s:s + per]), ("v", v[s:s + per])] for s in range(0, n, per)))


def throughput(width: int, height: int, clips: int, repeats: int) -> dict:
    port_file = tempfile.mktemp()
    sink = subprocess.Popen([sys.executable, __file__, "--sink", port_file])
    try:
        end = time.monotonic() + 60
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            if time.monotonic() > end or sink.poll() is not None:
                raise RuntimeError("the sink server did not start")
            time.sleep(0.05)
        address = f"127.0.0.1:{Path(port_file).read_text()}"
        clip = torch.randint(0, 256, (17, height, width, 3), dtype=torch.uint8)
        planes = rgb_to_yuv420p(clip)
        out = {}
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = muxer_pb2_grpc.MuxerStub(channel)
            for fmt in ("yuv420p", "rgb24"):
                parts = clip_parts(fmt, clip, planes)
                payload = sum(t.numel() * t.element_size() for _, t in parts) * clips
                rates = []
                for _ in range(repeats + 1):   # the first run warms the connection and is dropped
                    sender = GrpcStreamSender(
                        lambda chunk=None, end=None: muxer_pb2.PushMessage(chunk=chunk) if chunk is not None
                        else muxer_pb2.PushMessage(end=end),
                        first=muxer_pb2.PushMessage(open=muxer_pb2.PushOpen(session_id="bench")), edge="vae->muxer")
                    t0 = time.perf_counter()
                    call = stub.Push.future(sender.requests(), timeout=300)
                    sender.attach(call)
                    for _ in range(clips):
                        for name, t in parts:
                            sender.send(name, t)
                    sender.close()
                    result = call.result()
                    seconds = time.perf_counter() - t0
                    assert result.frames == 17 * clips, result
                    rates.append(payload / seconds / 1e6)
                rates = rates[1:]
                out[fmt] = {"mb_per_s": round(statistics.median(rates), 1), "runs_mb_per_s": [round(r, 1) for r in rates],
                            "payload_mb": round(payload / 1e6, 1), "messages_per_clip": len(parts)}
        return {"width": width, "height": height, "clips": clips, "frames_per_clip": 17, **out}
    finally:
        sink.send_signal(signal.SIGTERM)
        sink.wait(10)


# ---------------------------------------------------------------------------------------------------------------
# tail: last latent in -> MP4 ready

def start_stages(checkpoint: str, threads: int, dtype: str, frame_format: str) -> tuple[ServeProcess, dict]:
    stages = ServeProcess("--checkpoint", checkpoint, "--stages", "vae,muxer", "--port", "0", "--dtype", dtype,
                          "--frame-format", frame_format, "--json", "--no-restart", threads=threads, cwd=REPO)
    event = stages.wait("serving", 600)
    return stages, {s: e["address"] for s, e in event["stages"].items()}


def services_tail(addresses: dict, req, latents) -> tuple[float, bytes, dict]:
    with grpc.insecure_channel(addresses["muxer"], options=channel_options()) as mc, \
            grpc.insecure_channel(addresses["vae"], options=channel_options()) as vc:
        mux, vae = muxer_pb2_grpc.MuxerStub(mc), vae_pb2_grpc.VAEStub(vc)
        t0 = time.perf_counter()
        session = mux.OpenSession(muxer_pb2.OpenSessionRequest(
            request_id="bench", width=req.width, height=req.height, fps=req.fps, sample_rate=32000, channels=2,
            expected_frames=req.num_frames), timeout=60)
        inputs = itertools.chain(
            [vae_pb2.DecodeInput(params=vae_pb2.DecodeParams(
                request_id="bench", sink=common_pb2.Sink(address=session.address, session_id=session.session_id,
                                                         transport="grpc"),
                num_frames=req.num_frames, width=req.width, height=req.height))],
            (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("video_latents", latents.video)),
            (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("audio_latents", latents.audio)),
            [vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=2))])
        done = None
        for ev in vae.Decode(inputs, timeout=600):
            if ev.WhichOneof("event") == "done":
                done = ev.done
        data = b"".join(c.data for c in mux.Fetch(muxer_pb2.FetchRequest(session_id=session.session_id),
                                                  timeout=60))
        seconds = time.perf_counter() - t0
    return seconds, data, {"vae_video_s": done.video_seconds, "vae_audio_s": done.audio_seconds,
                           "mux_tail_s": done.sink_tail_seconds, "bytes_sent_mb": done.bytes_sent / 1e6}


def tail(checkpoint: str, size: str, seconds: str, threads: int, repeats: int, frame_format: str) -> dict:
    torch.set_num_threads(threads)
    req = validate_request(prompt="a red kite over a windy beach", seconds=seconds, size=size, seed=0, steps=3,
                           dtype="fp32")
    pipe = Pipeline.load(checkpoint, dtype="fp32", device="cpu")
    latents = pipe.generate_latents(req)
    out = Path(tempfile.mkdtemp()) / "embedded.mp4"
    pipe.write_mp4(req, latents, out)   # warm-up
    embedded = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pipe.write_mp4(req, latents, out)
        embedded.append(time.perf_counter() - t0)
    embedded_bytes = out.read_bytes()

    stages, addresses = start_stages(checkpoint, threads, "fp32", frame_format)
    try:
        services_tail(addresses, req, latents)   # warm-up
        runs = [services_tail(addresses, req, latents) for _ in range(repeats)]
    finally:
        stages.stop(60)
    services = [r[0] for r in runs]
    return {
        "size": size, "frames": req.num_frames, "threads": threads, "frame_format": frame_format,
        "embedded_s": round(statistics.median(embedded), 4), "services_s": round(statistics.median(services), 4),
        "services_over_embedded": round(statistics.median(services) / statistics.median(embedded), 3),
        "embedded_runs_s": [round(x, 4) for x in embedded], "services_runs_s": [round(x, 4) for x in services],
        "services_parts_s": {k: round(v, 4) for k, v in runs[-1][2].items()},
        "same_mp4_bytes": all(r[1] == embedded_bytes for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(REPO / ".cache" / "tiny-ckpt"))
    ap.add_argument("--size", default="320x256", help="tail: canvas")
    ap.add_argument("--seconds", default="5", help="tail: requested duration")
    ap.add_argument("--threads", type=int, default=1, help="tail: torch threads on both sides")
    ap.add_argument("--frame-format", default="yuv420p", choices=("yuv420p", "rgb24"), help="tail: VAE -> muxer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clips", type=int, default=8, help="throughput: 17-frame clips per stream")
    ap.add_argument("--canvas", default="1344x768", help="throughput: frame size")
    ap.add_argument("--sink", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.sink:
        run_sink(args.sink)
        return
    if not Path(args.checkpoint, "modular_model_index.json").exists():
        init_tiny_checkpoint(args.checkpoint)
    w, h = (int(x) for x in args.canvas.split("x"))
    result = {"bench": "transport_grpc", "torch": torch.__version__, "cpus": os.cpu_count(),
              "throughput": throughput(w, h, args.clips, args.repeats),
              "tail": tail(args.checkpoint, args.size, args.seconds, args.threads, args.repeats, args.frame_format)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
