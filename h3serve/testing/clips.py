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
