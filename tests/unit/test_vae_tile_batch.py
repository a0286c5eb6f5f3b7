"""Decoding a window's tiles as one batch equals decoding them one by one (the ViT decoder treats batch items
independently); and the yuv420p stream equals the muxer's conversion of the uint8 stream."""

from __future__ import annotations

import torch

from h3serve.models.vae.yuv import rgb_to_yuv420p
from h3serve.models.vae.video import VideoVAE
from h3serve.testing.tiny import build_video_vae


def _vae(tile_batch):
    return VideoVAE(build_video_vae(0), tile=32, min_overlap=16, tile_batch=tile_batch)


def test_tile_batch_equals_one_by_one():
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 24, 7, 4, 6, generator=g)
    one = torch.cat(list(_vae(1).iter_decode_float(latents)))
    many = torch.cat(list(_vae(4).iter_decode_float(latents)))
    assert len(_vae(1).plan_tiles(64, 96)) > 4  # several batches, and several tiles per batch
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


def test_yuv_stream_matches_muxer_conversion():
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 24, 7, 4, 6, generator=g)
    vae = _vae(None)
    for (planes, event), clip in zip(vae.iter_decode_yuv420p(latents), vae.iter_decode(latents)):
        assert event is None
        for p, q in zip(planes, rgb_to_yuv420p(clip)):
            assert torch.equal(p, q)
