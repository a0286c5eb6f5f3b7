"""H3 audio VAE: latents → 32 kHz stereo PCM, and reference soundtracks → conditioning rows (H3_REFERENCE §3.2).

The network is diffusers' ``AutoencoderKLMiniMaxH3Audio`` (DAC-style encoder + BigVGAN decoder, mono, hop 800).
It always runs in float32 (the reference pins every submodule to fp32). Stereo is two batch items.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from h3serve.models.offload import StagedModule, on_device
from h3serve.models.checkpoint import checked_folder
from h3serve.weights.load import load_module_weights

__all__ = ["AudioVAE"]

log = logging.getLogger("h3serve.vae")


class AudioVAE:
    """The audio VAE behind our interface. Build with ``AudioVAE.load`` or wrap an ``AutoencoderKLMiniMaxH3Audio``."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config
        self.config = cfg
        self.hop_length = int(model.hop_length)
        self.latent_channels = int(cfg.latent_channels)
        self.sampling_rate = int(cfg.sampling_rate)
        self.staged: StagedModule | None = None  # `stage()`: weights in pinned host memory between requests
        dev = self.device
        self.latents_mean = torch.tensor(cfg.latents_mean, device=dev).view(1, -1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, device=dev).view(1, -1, 1)

    @classmethod
    def load(cls, checkpoint_dir: str | Path, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", component: str = "audio_vae", staged: bool = False) -> "AudioVAE":
        """Stream ``<checkpoint_dir>/audio_vae`` into the network. ``dtype`` is accepted for symmetry and ignored
        (logged): the audio VAE stays float32 whatever the pipeline dtype, as in the reference. ``staged``: then
        keep it in pinned host memory between requests (lever --vae-staged, `stage`)."""
        # lazy: diffusers takes seconds to import and only loading needs its module class
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLMiniMaxH3Audio

        ck = checked_folder(checkpoint_dir, [component])  # refuses what we cannot serve, before any weight
        with init_empty_weights(include_buffers=False), warnings.catch_warnings():
            # the network is built with torch's legacy weight_norm; its deprecation notice says nothing to a user
            warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
            model = AutoencoderKLMiniMaxH3Audio.from_config(ck.config(component))
        report = load_module_weights(model, ck, component, dtype=torch.float32, device=device)
        model.to(device)
        log.info("audio VAE: %s (float32 on %s; requested dtype %s ignored)", report.summary(), device, dtype)
        vae = cls(model)
        if staged:
            vae.stage()
        return vae

    def stage(self) -> StagedModule:
        """Weights in pinned host memory, on the device for each decode / encode (lever --vae-staged)."""
        self.staged = StagedModule(self.model, self.device)
        return self.staged

    @property
    def device(self) -> torch.device:
        return self.staged.device if self.staged is not None else self.model.dec_in_proj.weight.device

    @on_device
    @torch.no_grad()
    def decode(self, audio_latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (2, C, A) (stereo channels as batch) → PCM float32 (2, A·hop), clamped to [−1, 1]."""
        if audio_latents.ndim != 3 or audio_latents.shape[1] != self.latent_channels:
            raise ValueError(f"expected audio latents (2, {self.latent_channels}, A), got {tuple(audio_latents.shape)}")
        z = audio_latents.to(self.device) * self.latents_std + self.latents_mean
        dec_dtype = self.model.dec_in_proj.weight.dtype
        pcm = self.model.decoder(self.model.dec_in_proj(z.to(dec_dtype)))  # (2, 1, A·hop), clamped by the decoder
        return pcm.float()[:, 0]

    @on_device
    @torch.no_grad()
    def encode_reference(self, pcm: torch.Tensor) -> torch.Tensor:
        """A reference soundtrack, PCM (2, N) at the VAE's rate (32 kHz) → normalized rows (2·A_ref, C), channel-major.

        N is right-padded with zeros to a multiple of the hop; the posterior *mean* is used (never sampled).
        Returned float32 on the CPU, as the reference returns them.
        """
        pcm = torch.as_tensor(pcm)
        if pcm.ndim != 2 or pcm.shape[0] != 2:
            raise ValueError(f"expected stereo PCM (2, N), got {tuple(pcm.shape)}")
        x = pcm.to(self.device, torch.float32)[:, None]  # (2, 1, N)
        x = F.pad(x, (0, (-x.shape[-1]) % self.hop_length))
        m = self.model
        h = m.encoder(x.to(next(m.encoder.parameters()).dtype))
        h = m.pre_block(h.transpose(1, 2)).transpose(1, 2)
        latents = m.mean_proj(h).float().cpu().transpose(1, 2)  # (2, A, C): the posterior mean
        mean = torch.tensor(self.config.latents_mean).view(1, 1, -1)
        std = torch.tensor(self.config.latents_std).view(1, 1, -1)
        return ((latents - mean) / std).reshape(-1, self.latent_channels)
