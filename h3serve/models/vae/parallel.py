"""Patch parallelism for the H3 video VAE: the reference's spatial tiles, decoded on several ranks.

The plan (P ranks of the VAE group, clip by clip so that frames still stream out):

    per latent window (17 frames):   plan_tiles (pure, 256 px tiles, >= 64 px overlap)  — the same on every rank
                                      tile k -> rank k mod P                              (assign_tiles, pure)
                                      each rank decodes its tiles                          (VideoVAE.decode_tile)
                                      tiles sent to rank 0, which stitches them            (stitch_tiles: the
                                                                                            reference's blending)
    rank 0 then blends windows in time, post-processes and yields the clip, exactly as the 1-rank decode.

A tile's decode depends only on (latent window, tile), and the stitch is the same function on the same inputs, so
the frames are bitwise those of the 1-rank tiled decode. The audio VAE runs on rank 0 alone (it is small).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from h3serve.distributed.proxies import VideoVAEProxy
from h3serve.distributed.world import Runtime

from .tiling import Tile, stitch_tiles
from .video import VideoVAE, to_uint8

__all__ = ["assign_tiles", "PatchParallelVAE"]


def assign_tiles(tiles: Sequence[Tile], ranks: int) -> list[list[int]]:
    """Tile indices per rank, round robin (tiles are equal-sized, so this balances the work). Pure."""
    return [list(range(r, len(tiles), ranks)) for r in range(ranks)]


class PatchParallelVAE:
    """A `VideoVAE` whose windows are decoded tile-parallel over the ranks [0, P) of `group`.

    On rank 0, `iter_decode` / `iter_decode_float` / `decode_float` behave as VideoVAE's; on the other ranks they
    decode their tiles of every window and yield nothing. Every other attribute is the wrapped VAE's.
    """

    def __init__(self, vae: VideoVAE, group, rank: int, size: int):
        self.vae, self.group, self.rank, self.size = vae, group, rank, size

    def __getattr__(self, name):
        return getattr(self.vae, name)

    @torch.no_grad()
    def decode_window(self, z_window: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the stitched window (1, 3, frames, H, W); other ranks: None (after sending their tiles)."""
        vae = self.vae
        h, w = z_window.shape[-2] * vae.spatial_ratio, z_window.shape[-1] * vae.spatial_ratio
        tiles = vae.plan_tiles(h, w)
        mine = assign_tiles(tiles, self.size)
        if self.rank != 0:
            reqs, keep = [], []
            for k, t in vae.decode_tiles(z_window, tiles, mine[self.rank]).items():
                t = t.contiguous()
                keep.append(t)
                reqs.append(dist.isend(t, dst=0, group=self.group))
            for req in reqs:
                req.wait()
            return None
        decoded: list[torch.Tensor | None] = [None] * len(tiles)
        for k, t in vae.decode_tiles(z_window, tiles, mine[0]).items():
            decoded[k] = t
        ref = decoded[0]  # tile 0 is rank 0's: frames and dtype of every tile
        reqs = []
        for r in range(1, self.size):
            for k in mine[r]:
                t = tiles[k]
                buf = torch.empty(ref.shape[0], ref.shape[1], ref.shape[2], t.height, t.width, dtype=ref.dtype,
                                  device=ref.device)
                decoded[k] = buf
                reqs.append(dist.irecv(buf, src=r, group=self.group))
        for req in reqs:
            req.wait()
        return stitch_tiles(tiles, decoded)

    @torch.no_grad()
    def iter_decode_float(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        if self.rank == 0:  # VideoVAE's own loop, with our decode_window
            yield from VideoVAE.iter_decode_float(self, latents)
            return
        vae = self.vae
        plan = vae.plan_windows(latents.shape[2])
        z = vae.denormalize(latents)
        if plan.pad_latents:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, plan.pad_latents, 1, 1)], dim=2)
        for i in range(plan.num_windows):
            start, stop = plan.window(i)
            self.decode_window(z[:, :, start:stop])

    def iter_decode(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        for clip in self.iter_decode_float(latents):
            yield to_uint8(clip)

    @torch.no_grad()
    def decode_float(self, latents: torch.Tensor) -> torch.Tensor | None:
        clips = list(self.iter_decode_float(latents))
        return torch.cat(clips, dim=0) if clips else None


# ---------------------------------------------------------------------------------------------------------------------
# What every rank of a world with a VAE stage runs


def build_vae_rank(runtime: Runtime, *, checkpoint: str, dtype: torch.dtype, pp: int,
                   staged: bool = False) -> Callable[[], dict]:
    """Create the patch-parallel group over ranks [0, pp) now (every rank of the world calls this, in the same
    order) and return the load: the video VAE on the group's members (tile-parallel when pp > 1), then the ops for
    `VideoVAEProxy`: DECODE / DECODE_FLOAT latents -> on rank 0 the clips (uint8 / float), on the group's other
    ranks their tiles of every window, elsewhere nothing; PART -> this rank's VideoVAE.

    Two steps so that a world of several models creates all its groups before any rank loads."""
    group, _ = runtime.new_group(range(pp))

    def load() -> dict:
        vae = decoder = None
        if runtime.rank < pp:
            # staged only with pp == 1 (config/levers.py: staging_conflict): one whole decode per stage-in
            vae = VideoVAE.load(checkpoint, dtype=dtype, device=runtime.device, staged=staged)
            decoder = PatchParallelVAE(vae, group, runtime.rank, pp) if pp > 1 else vae

        def decode(latents, local):
            return iter(()) if decoder is None else decoder.iter_decode(latents)

        def decode_float(latents, local):
            return iter(()) if decoder is None else decoder.iter_decode_float(latents)

        return {VideoVAEProxy.DECODE: decode, VideoVAEProxy.DECODE_FLOAT: decode_float,
                VideoVAEProxy.PART: lambda payload, local: vae}

    return load
