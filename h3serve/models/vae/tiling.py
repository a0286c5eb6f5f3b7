"""Spatial tiling of the H3 video VAE: a pure tile plan and the stitcher that blends tiles back together.

The released frames are the tiled ones (H3_REFERENCE §3.1), so tiling is part of the model, not an optimization:

* tiles are ``tile`` px squares laid out in pixel space, with a minimum overlap of ``min_overlap`` px;
* per axis, n = ceil(len / tile), incremented until ``tile·n − min_overlap·(n−1) ≥ len``; the slack is then handed
  out round-robin onto the overlaps in ``step`` px increments (``step`` = the VAE's spatial ratio, 16), so every
  tile edge stays on the latent grid;
* stitching blends every tile with its *raw* upper neighbour along H (weights ``1 − k/ext`` and ``k/ext``), then
  with its *raw* left neighbour along W, and crops the trailing overlap of every non-last row / column.

``plan_tiles`` is pure (no torch) so that a patch-parallel plan can hand tiles to ranks; a tile's decode depends
only on (latent window, tile), and ``stitch_tiles`` needs each tile plus its raw upper and left neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Tile", "split_axis", "plan_tiles", "blend", "stitch_tiles"]


@dataclass(frozen=True)
class Tile:
    """One spatial tile, in the coordinate space it was planned in (pixels, or latents after ``scaled``).

    ``blend_top`` / ``blend_left``: how many leading rows / columns are blended with the upper / left neighbour
    (0 on the first row / column). ``crop_bottom`` / ``crop_right``: how many trailing rows / columns are cut off
    after blending (the next tile's overlap; 0 on the last row / column).
    """

    row: int
    col: int
    y0: int
    y1: int
    x0: int
    x1: int
    blend_top: int
    blend_left: int
    crop_bottom: int
    crop_right: int

    @property
    def height(self) -> int:
        return self.y1 - self.y0

    @property
    def width(self) -> int:
        return self.x1 - self.x0

    def scaled(self, factor: int, *, down: bool = True) -> "Tile":
        """The same tile on a grid ``factor`` times coarser (``down``) or finer. Coordinates must divide."""
        def f(v: int) -> int:
            if down:
                if v % factor:
                    raise ValueError(f"tile coordinate {v} is not a multiple of {factor}")
                return v // factor
            return v * factor

        return Tile(self.row, self.col, f(self.y0), f(self.y1), f(self.x0), f(self.x1),
                    f(self.blend_top), f(self.blend_left), f(self.crop_bottom), f(self.crop_right))


def split_axis(length: int, tile: int = 256, min_overlap: int = 64, step: int = 16) -> tuple[list[int], list[int], list[int]]:
    """Lay ``tile``-long tiles over ``length``: returns (starts, sizes, overlaps between consecutive tiles).

    One tile of size ``length`` when ``tile >= length``.
    """
    if length <= 0:
        raise ValueError(f"length must be positive, got {length}")
    if tile >= length:
        return [0], [length], []
    n = math.ceil(length / tile)
    while tile * n - min_overlap * (n - 1) < length:
        n += 1
    overlaps = [min_overlap] * (n - 1)
    slack = tile * n - sum(overlaps) - length
    for i in range(slack // step):
        overlaps[i % (n - 1)] += step
    starts = [0]
    for ov in overlaps:
        starts.append(starts[-1] + tile - ov)
    return starts, [tile] * n, overlaps


def plan_tiles(height_px: int, width_px: int, tile: int = 256, min_overlap: int = 64, step: int = 16) -> list[Tile]:
    """Row-major list of the tiles covering a ``height_px × width_px`` frame (H3_REFERENCE §3.1 split rule)."""
    ys, hs, oys = split_axis(height_px, tile, min_overlap, step)
    xs, ws, oxs = split_axis(width_px, tile, min_overlap, step)
    tiles = []
    for i, (y0, h) in enumerate(zip(ys, hs)):
        for j, (x0, w) in enumerate(zip(xs, ws)):
            tiles.append(Tile(
                row=i, col=j, y0=y0, y1=y0 + h, x0=x0, x1=x0 + w,
                blend_top=oys[i - 1] if i > 0 else 0,
                blend_left=oxs[j - 1] if j > 0 else 0,
                crop_bottom=oys[i] if i < len(ys) - 1 else 0,
                crop_right=oxs[j] if j < len(xs) - 1 else 0,
            ))
    return tiles


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the trailing ``extent`` slices of ``a`` into the leading ones of ``b`` along ``dim``.

    Weights are ``1 − k/extent`` for ``a`` and ``k/extent`` for ``b`` (k = 0..extent−1), computed in ``b``'s dtype;
    the rest of ``b`` is kept. Used for the spatial seams and for the temporal cross-fade between windows.
    """
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    k = torch.arange(extent, device=b.device, dtype=b.dtype)
    shape = [1] * b.ndim
    shape[dim] = extent
    w_b = (k / extent).view(shape)
    w_a = (1 - k / extent).view(shape)
    mixed = a.narrow(dim, a.shape[dim] - extent, extent) * w_a + b.narrow(dim, 0, extent) * w_b
    if extent == b.shape[dim]:
        return mixed
    return torch.cat([mixed, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def stitch_tiles(tiles: Sequence[Tile], decoded: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blend and assemble per-tile outputs (``decoded[k]`` belongs to ``tiles[k]``, spatial dims last).

    ``tiles`` must be in the coordinate space of ``decoded`` (use ``Tile.scaled`` for latent-space tiles).
    """
    by_pos = {(t.row, t.col): (t, x) for t, x in zip(tiles, decoded)}
    n_rows = 1 + max(t.row for t in tiles)
    n_cols = 1 + max(t.col for t in tiles)
    rows = []
    for i in range(n_rows):
        pieces = []
        for j in range(n_cols):
            t, x = by_pos[(i, j)]
            if i > 0:
                x = blend(by_pos[(i - 1, j)][1], x, t.blend_top, dim=-2)
            if j > 0:
                x = blend(by_pos[(i, j - 1)][1], x, t.blend_left, dim=-1)
            if t.crop_bottom:
                x = x[..., : x.shape[-2] - t.crop_bottom, :]
            if t.crop_right:
                x = x[..., : x.shape[-1] - t.crop_right]
            pieces.append(x)
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)
