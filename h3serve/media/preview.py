"""Previews of a video while it is denoised: the DiT's current estimate of the clean latents, drawn small.

A low-cost stand-in for a VAE decode (the VAE lives in another stage): a few latent frames, evenly spaced, with the
latent channels projected on their first three principal components (one projection for all frames, so colours
are comparable across them) and stretched to 0..255, scaled up by whole pixels and put side by side in one JPEG.
The colours are false colours: the picture shows layout and motion, not the final colours.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

PREVIEW_FRAMES = 3        # latent frames shown (first, middle, last)
PREVIEW_HEIGHT = 96       # pixels, about (whole-pixel upscaling of the latent grid)
PREVIEW_QUALITY = 80      # JPEG


def preview_jpeg(latents) -> bytes:
    """latents (C, T, h, w) (or (1, C, T, h, w)), numpy or torch -> JPEG bytes."""
    if type(latents).__module__.split(".")[0] == "torch":
        latents = latents.detach().float().cpu().numpy()
    z = np.asarray(latents, np.float32)
    if z.ndim == 5:
        z = z[0]
    c, t, h, w = z.shape
    picks = np.unique(np.linspace(0, t - 1, min(PREVIEW_FRAMES, t)).round().astype(int))
    x = z[:, picks].reshape(c, -1).T                      # (pixels, C)
    x = x - x.mean(axis=0)
    sample = x[:: max(1, x.shape[0] // 4096)]
    # principal axes from the C x C covariance (small; einsum stays off the multi-threaded BLAS, whose thread start
    # costs more than this whole picture on a busy host)
    _, vecs = np.linalg.eigh(np.einsum("pi,pj->ij", sample, sample))
    axes = vecs[:, ::-1][:, :3]                           # (C, <=3), largest variance first
    rgb = np.einsum("pc,ck->pk", x, axes)                 # (pixels, <=3)
    if rgb.shape[1] < 3:
        rgb = np.pad(rgb, ((0, 0), (0, 3 - rgb.shape[1])))
    lo, hi = np.percentile(rgb, 1, axis=0), np.percentile(rgb, 99, axis=0)
    rgb = np.clip((rgb - lo) / np.maximum(hi - lo, 1e-6), 0, 1) * 255
    frames = rgb.reshape(len(picks), h, w, 3).astype(np.uint8)
    scale = max(1, PREVIEW_HEIGHT // h)
    strip = np.concatenate(list(frames), axis=1).repeat(scale, axis=0).repeat(scale, axis=1)
    out = io.BytesIO()
    Image.fromarray(strip).save(out, format="JPEG", quality=PREVIEW_QUALITY)
    return out.getvalue()
