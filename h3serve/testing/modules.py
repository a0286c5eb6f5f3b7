"""Random-weight model modules built in memory (no checkpoint on disk), for benchmarks at the released geometry."""

from __future__ import annotations

import torch

from h3serve.testing import presets
from h3serve.weights.load import KEEP_FP32, name_matches


def random_video_vae(preset: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """diffusers' `AutoencoderKLMiniMaxH3` at `preset` ("tiny", or "full" = the default config, 2.42 B decoder
    params) with random weights, cast like the released checkpoint (fp32 where `KEEP_FP32["vae"]` says, else
    `dtype`); scale1 / scale2 / register tokens non-zero so every block contributes."""
    from diffusers import AutoencoderKLMiniMaxH3  # lazy: diffusers takes seconds to import

    cfg = dict(presets.TINY_VIDEO_VAE) if preset == "tiny" else {}
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoencoderKLMiniMaxH3(**cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name_matches(name, ("scale1", "scale2", "register_tokens")):
                p.normal_(0, 0.1)
            keep = name_matches(name, KEEP_FP32["vae"])
            p.data = p.data.to(torch.float32 if keep else dtype)
    return model
