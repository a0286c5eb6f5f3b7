"""H3 video VAE: streaming clip-by-clip decode and the conditioning encode (H3_REFERENCE §3.1, §5).

The network is diffusers' ``AutoencoderKLMiniMaxH3`` (encoder CNN, ``quant_conv``, ``post_quant_conv``, ViT
decoder). Everything around it is ours, so that frames leave the VAE one temporal window at a time:

* latent (de)normalization with the checkpoint's ``latents_mean`` / ``latents_std``;
* temporal chunking of the decode: 7-latent windows every 5 latents, each decoded to 28 frames, of which frames
  [3, 20) are the window's 17 new frames (3-frame pre-pad dropped) and frames [23, 28) are the 5-frame overlap that
  is linearly cross-faded into the next window's first 5 frames (weights 1, .8, .6, .4, .2 for the older one);
* spatial tiling of every window and of the encode (``h3serve.models.vae.tiling``);
* ImageNet de-normalization, clamp to [0, 1] and the uint8 conversion, on the device.

A (1, 24, T = 5n+2, h, w) latent is decoded in ``n = (T + 3) / 5 − 1`` windows; the stream yields one 17-frame clip
per window as soon as it is decoded, then the final 5-frame overlap: 17n + 5 frames (37 latents → 7 × 17 + 5 = 124).
Other T are padded by repeating the last latent and the padding frames are dropped from the end, as the reference does.

uint8 conversion: ``(x * 255).round()`` on float32 x in [0, 1] (round half to even), exactly what diffusers'
``VaeImageProcessor.numpy_to_pil`` does for ``output_type="pil"`` (``(images * 255).round().astype("uint8")``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from h3serve.models.offload import StagedModule, on_device
from h3serve.models.checkpoint import checked_folder
from h3serve.weights.load import KEEP_FP32, load_module_weights

from .tiling import Tile, blend, plan_tiles, stitch_tiles
from .yuv import rgb_to_yuv420p

__all__ = ["VideoVAE", "WindowPlan", "plan_windows", "to_uint8", "yuv420p_to_host", "PIXEL_MEAN", "PIXEL_STD",
           "KEYFRAME_ENCODE_SEED"]

log = logging.getLogger("h3serve.vae")

# The VAE's pixel convention: ImageNet normalization over [0, 1].
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
# The conditioning posterior is sampled under a fresh CPU generator with this seed, independent of the request.
KEYFRAME_ENCODE_SEED = 42


@dataclass(frozen=True)
class WindowPlan:
    """Temporal chunking of a decode of ``num_latents`` latent frames (all counts derived from the VAE config)."""

    num_latents: int          # T, the latents given
    pad_latents: int          # copies of the last latent appended so that T + token_drop is whole windows
    num_windows: int          # decoder calls
    window_stride: int        # latents between window starts (tokens_chunk_size, 5)
    window_latents: int       # latents per decoder call (stride + token_overlap, 7)
    frames_per_latent: int    # temporal ratio (4)
    frame_pre_padding: int    # frames dropped at the start of each window's main part (3)
    main_frames: int          # frames a window contributes (stride·ratio − pre_padding, 17)
    overlap_frames: int       # frames cross-faded into the next window (5); 0 when token_drop is 0
    num_frames: int           # frames of the whole video after the padding frames are dropped

    def window(self, index: int) -> tuple[int, int]:
        """Latent range [start, stop) of window ``index`` (in the padded latent sequence)."""
        start = index * self.window_stride
        return start, start + self.window_latents


def plan_windows(num_latents: int, *, clip_length: int = 17, token_drop: int = 3, temporal_ratio: int = 4) -> WindowPlan:
    """The reference's decode chunking for ``num_latents`` latent frames (H3_REFERENCE §3.1)."""
    if num_latents < 1:
        raise ValueError(f"need at least one latent frame, got {num_latents}")
    pre_pad = (-clip_length) % temporal_ratio
    stride = math.ceil(clip_length / temporal_ratio)
    token_overlap = (-token_drop) % stride
    overlap_frames = max(token_overlap * temporal_ratio - pre_pad, 0)
    n_tok = num_latents + token_drop
    pad = (-n_tok) % stride
    num_windows = (n_tok + pad) // stride - int(token_drop > 0)
    if num_windows < 1:
        raise ValueError(f"{num_latents} latent frames make no complete decode window")
    main = stride * temporal_ratio - pre_pad
    total = num_windows * main + (overlap_frames if token_drop > 0 else 0)
    if pad:
        # A pad latent at a window boundary covers clip_length % ratio frames, any other covers `ratio`.
        tail = clip_length % temporal_ratio
        total -= sum(tail if tail and (num_latents + k) % stride == 0 else temporal_ratio for k in range(pad))
    return WindowPlan(num_latents, pad, num_windows, stride, stride + token_overlap, temporal_ratio, pre_pad, main,
                      overlap_frames if token_drop > 0 else 0, total)


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """[0, 1] float frames → uint8 with the reference's rounding, ``(x * 255).round()`` (half to even), on the
    frames' device; the result is contiguous (for (F, H, W, 3) frames: packed rgb24)."""
    return (frames.float() * 255).round().to(torch.uint8).contiguous()


def _pil_or_array_to_uint8(image) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.cpu().numpy()
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected a uint8 (H, W, 3) RGB image, got {arr.dtype} {tuple(arr.shape)}")
    return arr


def yuv420p_to_host(rgb: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], object]:
    """uint8 (F, H, W, 3) RGB -> (yuv420p planes in pinned host memory, the CUDA event that marks their copy done).

    The colour conversion runs where the frames are; the device-to-host copy is asynchronous. Off CUDA: the planes
    and None."""
    planes = rgb_to_yuv420p(rgb)
    if not rgb.is_cuda:
        return planes, None
    host = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in planes)
    for h, p in zip(host, planes):
        h.copy_(p, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class VideoVAE:
    """The video VAE behind our interface. Build with ``VideoVAE.load`` or wrap an ``AutoencoderKLMiniMaxH3``."""

    def __init__(self, model, *, tile: int = 256, min_overlap: int = 64, tile_batch: int | None = None):
        self.model = model.eval()
        # Tiles of one window decoded per decoder call (same-shape tiles are stacked on the batch axis; the ViT
        # decoder treats batch items independently). None: all of them on CUDA, one at a time elsewhere.
        self.tile_batch = tile_batch
        self.staged: StagedModule | None = None  # `stage()`: weights in pinned host memory between requests
        cfg = model.config
        self.config = cfg
        self.spatial_ratio = int(math.prod(cfg.spatial_downsample_factors))
        self.temporal_ratio = int(math.prod(cfg.temporal_downsample_factors))
        self.latent_channels = int(cfg.latent_channels)
        self.tile = tile
        self.min_overlap = min_overlap
        dev = self.device
        self.latents_mean = torch.tensor(cfg.latents_mean, device=dev).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, device=dev).view(1, -1, 1, 1, 1)
        self.pixel_mean = torch.tensor(PIXEL_MEAN, device=dev).view(1, -1, 1, 1, 1)
        self.pixel_std = torch.tensor(PIXEL_STD, device=dev).view(1, -1, 1, 1, 1)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, checkpoint_dir: str | Path, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", component: str = "vae", staged: bool = False) -> "VideoVAE":
        """Build the network on the meta device and stream ``<checkpoint_dir>/vae`` into it tensor by tensor;
        ``staged``: then keep it in pinned host memory between requests (lever --vae-staged, `stage`).

        With ``dtype=bfloat16`` the encoder, quant_conv, the decoder norms, layer scales and norm_out stay float32
        (the dtype policy of the reference, H3_REFERENCE §1.1); everything else is cast to ``dtype``.
        """
        # lazy: diffusers takes seconds to import and only loading needs its module class
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLMiniMaxH3

        ck = checked_folder(checkpoint_dir, [component])  # refuses what we cannot serve, before any weight
        with init_empty_weights(include_buffers=False):
            model = AutoencoderKLMiniMaxH3.from_config(ck.config(component))
        report = load_module_weights(model, ck, component, dtype=dtype, keep_fp32=KEEP_FP32["vae"], device=device)
        model.to(device)  # non-persistent buffers (decoder rotary inv_freq) follow the weights
        log.info("video VAE: %s (%s on %s)", report.summary(), dtype, device)
        vae = cls(model)
        if staged:
            vae.stage()
        return vae

    def stage(self) -> StagedModule:
        """Keep the weights in pinned host memory and copy them to the device for each decode / encode (lever
        --vae-staged): the device holds them only while a request uses them."""
        self.staged = StagedModule(self.model, self.device)
        return self.staged

    @property
    def device(self) -> torch.device:
        return self.staged.device if self.staged is not None else self.model.post_quant_conv.weight.device

    # ------------------------------------------------------------------ geometry
    def plan_windows(self, num_latents: int) -> WindowPlan:
        return plan_windows(num_latents, clip_length=int(self.config.clip_length),
                            token_drop=int(self.config.token_drop), temporal_ratio=self.temporal_ratio)

    def plan_tiles(self, height_px: int, width_px: int) -> list[Tile]:
        """Pixel-space tiles of a frame (decode and encode share the plan)."""
        return plan_tiles(height_px, width_px, self.tile, self.min_overlap, self.spatial_ratio)

    # ------------------------------------------------------------------ decode
    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (1, C, T, h, w) → the VAE's latent space (z·std + mean), in the decoder input dtype."""
        z = latents.to(self.device) * self.latents_std + self.latents_mean
        return z.to(self.model.post_quant_conv.weight.dtype)

    @torch.no_grad()
    def decode_tile(self, z_window: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Decode one pixel-space ``tile`` of one latent window (denormalized): (1, 3, frames, tile_h, tile_w)."""
        r = self.spatial_ratio
        part = z_window[..., tile.y0 // r: tile.y1 // r, tile.x0 // r: tile.x1 // r]
        return self.model.decoder(self.model.post_quant_conv(part))

    @torch.no_grad()
    def decode_tiles(self, z_window: torch.Tensor, tiles: list[Tile], which: list[int] | None = None
                     ) -> dict[int, torch.Tensor]:
        """Decode tiles `which` (default all) of one window: {index: (1, 3, frames, th, tw)}. On CUDA, tiles of one
        shape go through the decoder as one batch (one launch sequence instead of one per tile)."""
        which = list(range(len(tiles))) if which is None else list(which)
        batch = self.tile_batch or (len(which) if z_window.is_cuda else 1)
        if batch <= 1 or z_window.shape[0] != 1:
            return {i: self.decode_tile(z_window, tiles[i]) for i in which}
        r = self.spatial_ratio
        decoded: dict[int, torch.Tensor] = {}
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i in which:
            by_shape.setdefault((tiles[i].height, tiles[i].width), []).append(i)
        for idx in by_shape.values():
            for k in range(0, len(idx), batch):
                part = idx[k:k + batch]
                z = torch.cat([z_window[..., tiles[i].y0 // r: tiles[i].y1 // r, tiles[i].x0 // r: tiles[i].x1 // r]
                               for i in part])
                out = self.model.decoder(self.model.post_quant_conv(z))
                for j, i in enumerate(part):
                    decoded[i] = out[j:j + 1]
        return decoded

    def decode_window(self, z_window: torch.Tensor) -> torch.Tensor:
        """Decode one latent window (denormalized), all tiles, stitched: (1, 3, frames, H, W) in VAE pixel space."""
        h, w = z_window.shape[-2] * self.spatial_ratio, z_window.shape[-1] * self.spatial_ratio
        tiles = self.plan_tiles(h, w)
        decoded = self.decode_tiles(z_window, tiles)
        return stitch_tiles(tiles, [decoded[i] for i in range(len(tiles))])

    def _postprocess(self, clip: torch.Tensor) -> torch.Tensor:
        """(1, 3, F, H, W) VAE pixel space → (F, H, W, 3) float32 in [0, 1] (ImageNet de-normalize, clamp)."""
        x = (clip.float() * self.pixel_std + self.pixel_mean).clamp(0, 1)
        return x[0].permute(1, 2, 3, 0)

    @on_device
    @torch.no_grad()
    def iter_decode_float(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Stream (F_clip, H, W, 3) float32 frames in [0, 1]: one 17-frame clip per window, then the final overlap."""
        if latents.ndim != 5 or latents.shape[0] != 1 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"expected latents (1, {self.latent_channels}, T, h, w), got {tuple(latents.shape)}")
        plan = self.plan_windows(latents.shape[2])
        z = self.denormalize(latents)
        if plan.pad_latents:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, plan.pad_latents, 1, 1)], dim=2)
        chunk_frames = plan.window_stride * plan.frames_per_latent
        remaining = plan.num_frames
        overlap = None
        for i in range(plan.num_windows):
            start, stop = plan.window(i)
            clip = self.decode_window(z[:, :, start:stop])
            main = clip[:, :, plan.frame_pre_padding:chunk_frames]
            if overlap is not None:
                main = blend(overlap, main, plan.overlap_frames, dim=-3)
            if plan.overlap_frames:
                # keep only the 5 overlap frames alive, not the whole 28-frame window
                overlap = clip[:, :, chunk_frames:2 * chunk_frames][:, :, plan.frame_pre_padding:].clone()
            out = self._postprocess(main)[:remaining]
            remaining -= out.shape[0]
            if out.shape[0]:
                yield out
        if overlap is not None and remaining > 0:
            yield self._postprocess(overlap)[:remaining]

    def iter_decode(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Stream uint8 (F_clip, H, W, 3) frames on the VAE's device, clip by clip (see ``iter_decode_float``)."""
        for clip in self.iter_decode_float(latents):
            yield to_uint8(clip)

    def iter_decode_yuv420p(self, latents: torch.Tensor) -> Iterator[tuple[tuple[torch.Tensor, ...], object]]:
        """Stream yuv420p planes (Y (F,H,W), U, V (F,H/2,W/2)) in pinned host memory, clip by clip, each with the
        CUDA event that marks its copy done (None off CUDA): uint8 and the colour conversion run on the device, the
        device-to-host copy is asynchronous, so the consumer (an encoder thread) waits on the event, not the stream.
        """
        for clip in self.iter_decode(latents):
            yield yuv420p_to_host(clip)

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor) -> torch.Tensor:
        """All frames, (F, H, W, 3) float32 in [0, 1]: the concatenated stream, before uint8."""
        return torch.cat(list(self.iter_decode_float(latents)), dim=0)

    # ------------------------------------------------------------------ encode
    @torch.no_grad()
    def encode_moments_clip(self, pixels: torch.Tensor) -> torch.Tensor:
        """Spatially tiled encode of one clip of ImageNet-normalized pixels (1, 3, F, H, W) → moments (1, 2C, t, h, w)."""
        enc_dtype = self.model.encoder.conv_in.weight.dtype
        pixels = pixels.to(enc_dtype)
        tiles = self.plan_tiles(pixels.shape[-2], pixels.shape[-1])
        outs = [self.model.quant_conv(self.model.encoder(pixels[..., t.y0:t.y1, t.x0:t.x1])) for t in tiles]
        return stitch_tiles([t.scaled(self.spatial_ratio) for t in tiles], outs)

    @torch.no_grad()
    def encode_moments(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode normalized pixels (1, 3, F, H, W): one frame spatially only; otherwise 17-frame clips (last frame
        repeated to a whole clip), concatenated, and the last ``token_drop`` latents dropped (17n+5 → 5n+2)."""
        clip_length, drop = int(self.config.clip_length), int(self.config.token_drop)
        f = pixels.shape[2]
        if f == 1:
            return self.encode_moments_clip(pixels)
        if f % clip_length:
            pixels = torch.cat([pixels, pixels[:, :, -1:].repeat(1, 1, (-f) % clip_length, 1, 1)], dim=2)
        moments = torch.cat([self.encode_moments_clip(pixels[:, :, s:s + clip_length])
                             for s in range(0, pixels.shape[2], clip_length)], dim=2)
        return moments[:, :, :-drop] if drop > 0 else moments

    @on_device
    @torch.no_grad()
    def encode_condition(self, frames_u8: torch.Tensor, *, seed: int = KEYFRAME_ENCODE_SEED) -> torch.Tensor:
        """The conditioning recipe for uint8 frames (F, H, W, 3): ImageNet-normalize, tiled encode, posterior
        *sample* under a fresh CPU generator seeded ``seed``, float16 rounding, latent normalization.

        Returns normalized latents (1, C, t, h, w), float32 on the CPU (as the reference returns them).
        """
        if frames_u8.dtype != torch.uint8 or frames_u8.ndim != 4 or frames_u8.shape[-1] != 3:
            raise ValueError(f"expected uint8 frames (F, H, W, 3), got {frames_u8.dtype} {tuple(frames_u8.shape)}")
        r = self.spatial_ratio
        if frames_u8.shape[1] % r or frames_u8.shape[2] % r:
            raise ValueError(f"frame size {tuple(frames_u8.shape[1:3])} must be a multiple of {r}")
        pixels = frames_u8.to(self.device).permute(3, 0, 1, 2)[None]  # (1, 3, F, H, W)
        pixels = (pixels.to(torch.float32).div(255.0) - self.pixel_mean) / self.pixel_std
        moments = self.encode_moments(pixels)
        mean, logvar = torch.chunk(moments, 2, dim=1)
        std = torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))
        noise = torch.randn(mean.shape, generator=torch.Generator("cpu").manual_seed(seed), device="cpu",
                            dtype=moments.dtype).to(moments.device)
        z = (mean + std * noise).to(torch.float16).float().cpu()
        mean_c = torch.tensor(self.config.latents_mean).view(1, -1, 1, 1, 1)
        std_c = torch.tensor(self.config.latents_std).view(1, -1, 1, 1, 1)
        return (z - mean_c) / std_c

    def encode_keyframe(self, image, *, seed: int = KEYFRAME_ENCODE_SEED) -> torch.Tensor:
        """A keyframe or image reference, uint8 (H, W, 3) (PIL or array, already on the canvas) → (1, C, 1, h, w)."""
        arr = _pil_or_array_to_uint8(image)
        return self.encode_condition(torch.from_numpy(np.array(arr, copy=True))[None], seed=seed)

    def encode_video(self, frames_u8, *, seed: int = KEYFRAME_ENCODE_SEED) -> torch.Tensor:
        """A ref2va video reference, uint8 (F, H, W, 3) with F = 17n+5 → (1, C, 5n+2, h, w)."""
        frames = torch.as_tensor(np.asarray(frames_u8)) if not isinstance(frames_u8, torch.Tensor) else frames_u8
        return self.encode_condition(frames, seed=seed)
