"""The cases the multi-rank tests share: DiT geometries (what each one exercises in the row split), the tolerance of
an fp32 comparison against one rank, and the VAE latents a patch-parallel decode is checked on."""

from __future__ import annotations

import torch

TOL = 1e-5   # Ring and TP re-associate fp32 sums; Ulysses and patch parallel are bitwise in practice
# (text_len, latent_frames, latent_h, latent_w, audio_latents), extra kwargs
GEOMETRIES = {
    "S28": ((10, 2, 4, 6, 3), {}),  # 10 + 6 + 12 rows: divides 2 and 4
    "S25": ((7, 2, 4, 6, 3), {}),  # divides neither: the last rank pads
    "S5": ((2, 1, 2, 2, 1), {}),  # 4 ranks: 2 + 2 + 1 + 0 rows, a rank of pure padding
    "fl2va": ((7, 2, 4, 6, 3), {"anchors": ("first",)}),  # condition rows, 3 timesteps
    "per-row-t": ((7, 2, 4, 6, 3), {"per_row_timesteps": True}),  # the model's gather path (no segment runs)
}


def maxdiff(a, b) -> float:
    """The largest |a - b| over pairs of tensors."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def vae_latents() -> torch.Tensor:
    """Tiny-checkpoint video latents of 2 decode windows and 12 tiles."""
    return torch.randn(1, 24, 7, 16, 24, generator=torch.Generator().manual_seed(0))
