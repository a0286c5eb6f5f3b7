"""Whole clips in one call, for tests and benchmarks (the services stream clip by clip instead)."""

from __future__ import annotations

import io
from typing import Any

from h3serve.config.geometry import FPS, SAMPLE_RATE
from h3serve.media.mux import Mp4Writer
from h3serve.models.vae.yuv import rgb_to_yuv420p


def mux_to_bytes(frames: Any, pcm: Any, fps: int = FPS, sr: int = SAMPLE_RATE, **options: Any) -> bytes:
    """Encode all frames (uint8 (n, H, W, 3) RGB or (Y, U, V) planes) and PCM (channels, N) into MP4 bytes."""
    if not isinstance(frames, (tuple, list)):
        frames = rgb_to_yuv420p(frames)
    height, width = frames[0].shape[1:3]
    pcm_channels = pcm.shape[-2]
    out = io.BytesIO()
    with Mp4Writer(out, int(width), int(height), fps=fps, sample_rate=sr, channels=int(pcm_channels),
                   **options) as writer:
        writer.add_frames(frames)
        writer.add_audio(pcm)
    return out.getvalue()


def write_video(dst: Any, frames: Any, fps: float, pcm: Any = None, sample_rate: int = SAMPLE_RATE,
                container: str = "mp4") -> None:
    """A small video file for reference tests: uint8 (n, H, W, 3) RGB frames (even sides) at `fps` as H.264, with
    a soundtrack when `pcm` ((channels, N) float in [-1, 1]) is given, as AAC at `sample_rate`."""
    import fractions

    import av
    import numpy as np

    with av.open(dst, "w", format=container) as out:
        video = out.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = int(frames.shape[2]), int(frames.shape[1]), "yuv420p"
        audio = None
        if pcm is not None:
            layout = "stereo" if pcm.shape[0] == 2 else "mono"
            audio = out.add_stream("aac", rate=sample_rate, layout=layout)
        for frame in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        if audio is not None:
            data = np.ascontiguousarray(np.asarray(pcm, dtype=np.float32))
            step = 1024
            for start in range(0, data.shape[1], step):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(data[:, start:start + step]), format="fltp",
                                                   layout="stereo" if data.shape[0] == 2 else "mono")
                chunk.sample_rate = sample_rate
                chunk.pts = start
                for packet in audio.encode(chunk):
                    out.mux(packet)
            for packet in audio.encode(None):
                out.mux(packet)
