"""The tail of a request: last DiT step -> MP4 ready. Prints one JSON line.

The stream measured is the pipeline's: audio PCM handed to the writer first (the audio VAE takes 0.04 s), then the
video VAE decodes clip by clip; each clip is converted to uint8 and yuv420p planes on the GPU, copied to pinned host
memory asynchronously, and encoded by x264 on a writer thread while the next clip decodes; the MP4 is finalized
(faststart) after the last clip. It is compared with the decode alone (same model, same latents):

    overhead_s = mp4_ready_s - decode_only_s           (target: <= 0.3 s)

    python bench/tail.py --preset tiny --device cpu                                   # CPU smoke run
    python bench/tail.py --preset full --device cuda --dtype bf16 --latents 72x48x84 --x264-threads 8
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time

import numpy as np
import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_only(vae, latents) -> tuple[float, int]:
    """Seconds to decode every clip (float frames, on the device), and the frame count."""
    dev = vae.device
    _sync(dev)
    t0 = time.perf_counter()
    n = 0
    for clip in vae.iter_decode_float(latents):
        n += int(clip.shape[0])
    _sync(dev)
    return time.perf_counter() - t0, n


def synthetic_clips(vae, latents):
    """The decode stream with its pixels replaced by a smooth moving picture (same shapes, same device work plus a
    few element-wise ops), as yuv420p planes in pinned memory with their copy events: a stand-in for natural video,
    whose encode cost differs from the random-weight decoder's noise."""
    from h3serve.models.vae.video import yuv420p_to_host

    done = 0
    for clip in vae.iter_decode(latents):
        n, h, w, _ = clip.shape
        t = torch.arange(done, done + n, device=clip.device, dtype=torch.float32)[:, None, None]
        yy = torch.arange(h, device=clip.device, dtype=torch.float32)[None, :, None]
        xx = torch.arange(w, device=clip.device, dtype=torch.float32)[None, None, :]
        chans = [torch.sin((xx + 3 * t) / (40 + 9 * c)) * torch.cos((yy - 2 * t) / (31 + 7 * c)) for c in range(3)]
        rgb = ((torch.stack(chans, -1) * 0.5 + 0.5) * 255).round().to(torch.uint8)
        done += n
        yield yuv420p_to_host(rgb)


def stream_to_mp4(vae, latents, pcm: np.ndarray, out_path: str, width: int, height: int, *, threads: int = 8,
                  preset: str = "veryfast", thread_type: str = "frame", faststart: bool = True,
                  depth: int = 3, workers: int = 0, segment_frames: int = 0, content: str = "decoded",
                  x264_params: str | None = None) -> dict:
    """Decode -> yuv420p on the device -> pinned D2H -> x264 on a writer thread; returns timings (s from start).

    thread_type 'seg': segment-parallel writer (`workers` segments at once, `threads` x264 threads each, segments of
    at most `segment_frames` frames, 0 = one per clip)."""
    from h3serve.media.mux import Mp4Writer
    from h3serve.media.segments import SegmentedMp4Writer

    dev = vae.device
    _sync(dev)
    t0 = time.perf_counter()
    if thread_type == "seg":
        writer = SegmentedMp4Writer(out_path, width, height, threads=threads, preset=preset, workers=workers,
                                    segment_frames=segment_frames or None, faststart=faststart)
    else:
        writer = Mp4Writer(out_path, width, height, threads=threads, preset=preset, thread_type=thread_type,
                           faststart=faststart, x264_params=x264_params)
    q: queue.Queue = queue.Queue(maxsize=depth)
    err: list[BaseException] = []
    busy = [0.0]

    def consume() -> None:
        while (item := q.get()) is not None:
            if err:
                continue
            planes, event = item
            try:
                if event is not None and event != "audio":
                    event.synchronize()
                s = time.perf_counter()
                writer.add_audio(planes) if event == "audio" else writer.add_frames(planes)
                busy[0] += time.perf_counter() - s
            except BaseException as exc:  # noqa: BLE001
                err.append(exc)

    thread = threading.Thread(target=consume, name="tail-mux", daemon=True)
    thread.start()
    q.put((pcm, "audio"))  # encoded on the writer thread while the first clip decodes
    frames = 0
    first = None
    source = synthetic_clips(vae, latents) if content == "synthetic" else vae.iter_decode_yuv420p(latents)
    for planes, event in source:
        frames += int(planes[0].shape[0])
        q.put((planes, event))
        if first is None:
            first = time.perf_counter() - t0
    _sync(dev)
    t_decoded = time.perf_counter() - t0
    q.put(None)
    thread.join()
    if err:
        raise err[0]
    t_encoded = time.perf_counter() - t0
    stats = writer.close()
    t_ready = time.perf_counter() - t0
    return {"frames": frames, "first_clip_s": round(first, 4), "decode_done_s": round(t_decoded, 4),
            "encode_done_s": round(t_encoded, 4), "mp4_ready_s": round(t_ready, 4),
            "tail_after_decode_s": round(t_ready - t_decoded, 4), "writer_busy_s": round(busy[0], 4),
            "mp4_bytes": os.path.getsize(out_path), "stats_frames": getattr(stats, "frames", None)}


def check_mp4(path: str) -> dict:
    """Independent look at the file: video packets, duration, audio present."""
    import av

    with av.open(path) as c:
        v = c.streams.video[0]
        packets = sum(1 for p in c.demux(v) if p.size)
        return {"video_packets": packets, "codec": v.codec_context.name, "width": v.codec_context.width,
                "height": v.codec_context.height, "audio_streams": len(c.streams.audio)}


def parse_variants(spec: str) -> list[dict]:
    """'THREADS:frame|slice:FASTSTART(1|0)' or 'THREADS:seg:WORKERS:SEGMENT_FRAMES', each optionally followed by
    ':synthetic' (smooth stand-in pixels), ':p=PRESET' (x264 preset) and ':x=K=V+K=V' (x264-params, '+' for ':'),
    comma separated -> stream_to_mp4 keyword dicts."""
    out = []
    for v in spec.split(","):
        f = v.split(":")
        extra = {}
        for tok in [t for t in f if t.startswith(("p=", "x="))]:
            extra["preset" if tok[0] == "p" else "x264_params"] = tok[2:].replace("+", ":")
        f = [t for t in f if not t.startswith(("p=", "x="))]
        content = "synthetic" if f[-1] == "synthetic" else "decoded"
        f = f[:-1] if content == "synthetic" else f
        if f[1] == "seg":
            out.append(dict(threads=int(f[0]), thread_type="seg", workers=int(f[2]), segment_frames=int(f[3]),
                            faststart=True, content=content, **extra))
        else:
            out.append(dict(threads=int(f[0]), thread_type=f[1], faststart=f[2] == "1", content=content, **extra))
    return out


def run(vae, latents, *, threads: int, preset: str, repeats: int = 1, variants: str | None = None) -> dict:
    """decode-only vs decode+encode+MP4 on the same model and latents (the first decode also warms up).

    With `variants` (see parse_variants), every writer variant is measured too, under 'variants'."""
    width = latents.shape[-1] * vae.spatial_ratio
    height = latents.shape[-2] * vae.spatial_ratio
    frames = vae.plan_windows(latents.shape[2]).num_frames
    pcm = (np.random.default_rng(0).standard_normal((2, round(frames / 24 * 32000))) * 0.1).astype(np.float32)
    d_times, s_runs = [], []
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tail.mp4")
        for _ in range(repeats):
            d_times.append(decode_only(vae, latents)[0])
            s_runs.append(stream_to_mp4(vae, latents, pcm, out, width, height, threads=threads, preset=preset))
        check = check_mp4(out)
        more = []
        for kw in parse_variants(variants) if variants else []:
            r = stream_to_mp4(vae, latents, pcm, out, width, height, **{"preset": preset, **kw})
            more.append({**kw, **r, "overhead_s": round(r["mp4_ready_s"] - min(d_times), 4), "mp4": check_mp4(out)})
    d = min(d_times)
    s = min(s_runs, key=lambda r: r["mp4_ready_s"])
    return {"variants": more, "decode_only_s": round(d, 4), "stream": s, "overhead_s": round(s["mp4_ready_s"] - d, 4),
            "target_overhead_s": 0.3, "met": s["mp4_ready_s"] - d <= 0.3, "mp4": check,
            "x264": {"preset": preset, "threads": threads}, "size": [width, height], "frames": frames,
            "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--latents", default=None, help="T x h x w (default 12x4x6 tiny, 72x48x84 full)")
    ap.add_argument("--x264-threads", type=int, default=16)
    ap.add_argument("--x264-preset", default="veryfast")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decoder blocks first")
    ap.add_argument("--variants", default=None,
                    help="writer variants (also timed): THREADS:frame|slice:FASTSTART or "
                         "THREADS:seg:WORKERS:SEGFRAMES, each with an optional ':synthetic' suffix; comma separated")
    a = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    from h3serve.models.vae.video import VideoVAE
    from h3serve.runtime.device import TORCH_DTYPES
    from h3serve.testing.modules import random_video_vae

    device = torch.device(a.device)
    dtype = TORCH_DTYPES[a.dtype]
    t_, h_, w_ = (int(v) for v in (a.latents or ("12x4x6" if a.preset == "tiny" else "72x48x84")).split("x"))
    model = random_video_vae(a.preset, dtype, device)
    tile, overlap = (256, 64) if a.preset == "full" else (32, 16)
    vae = VideoVAE(model, tile=tile, min_overlap=overlap)
    if a.compile:
        for block in model.decoder.transformer_blocks:
            block.compile(dynamic=False)
    latents = torch.randn(1, model.config.latent_channels, t_, h_, w_,
                          generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        decode_only(vae, latents)  # warm-up (and compile)
    res = run(vae, latents, threads=a.x264_threads, preset=a.x264_preset, repeats=a.repeats, variants=a.variants)
    res = {"bench": "tail", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": a.dtype, "preset": a.preset, "latents": [t_, h_, w_],
           "compiled": a.compile, "host_cpus": os.cpu_count(), **res}
    if device.type == "cuda":
        res["peak_hbm_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
