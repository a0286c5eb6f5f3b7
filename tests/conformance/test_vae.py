"""Our video / audio VAE services against diffusers' H3 blocks on the tiny random checkpoint (CPU, fp32).

The oracle is diffusers' own modular blocks (decode steps, keyframe / reference encode steps) run on the same
checkpoint folder our services load.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.models.vae.tiling import plan_tiles, split_axis, stitch_tiles
from h3serve.models.vae.video import VideoVAE, plan_windows

torch.set_num_threads(min(2, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint)


@pytest.fixture(scope="module")
def ref_vae(ckpt):
    from diffusers import AutoencoderKLMiniMaxH3

    return AutoencoderKLMiniMaxH3.from_pretrained(ckpt / "vae", torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref_audio_vae(ckpt):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    return AutoencoderKLMiniMaxH3Audio.from_pretrained(ckpt / "audio_vae", torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vae(ckpt):
    return VideoVAE.load(ckpt, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def audio_vae(ckpt):
    from h3serve.models.vae.audio import AudioVAE

    return AudioVAE.load(ckpt, dtype=torch.float32, device="cpu")


def _block_pipeline(block, **components):
    pipe = block.init_pipeline()
    pipe.update_components(**components)
    return pipe


def _reference_decode(ref_vae, latents):
    """diffusers' MiniMaxH3VideoDecodeStep, output_type 'np': (F, H, W, 3) float32, plus its 'pil' frames."""
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep

    pipe = _block_pipeline(MiniMaxH3VideoDecodeStep(), vae=ref_vae)
    video = pipe(latents=latents, output_type="np").get("videos")[0]
    # output_type="pil" is postprocess -> pt_to_numpy -> numpy_to_pil: the same floats, then numpy_to_pil.
    pil = pipe.video_processor.numpy_to_pil(video)
    return video, np.stack([np.asarray(im) for im in pil])


# ---------------------------------------------------------------------------------------------------- pure plans
def test_plan_tiles_release_canvas_matches_reference_values():
    tiles = plan_tiles(768, 1344)
    ys, _, oy = split_axis(768)
    xs, _, ox = split_axis(1344)
    assert (ys, oy) == ([0, 160, 336, 512], [96, 80, 80])
    assert (xs, ox) == ([0, 176, 352, 528, 704, 896, 1088], [80, 80, 80, 80, 64, 64])
    assert len(tiles) == 4 * 7
    assert sorted({t.y0 for t in tiles}) == ys and sorted({t.x0 for t in tiles}) == xs
    assert all(t.height == 256 and t.width == 256 for t in tiles)
    t = next(t for t in tiles if (t.row, t.col) == (1, 5))
    assert (t.blend_top, t.blend_left, t.crop_bottom, t.crop_right) == (96, 64, 80, 64)
    # the kept (cropped) parts tile the frame exactly
    assert sum(t.height - t.crop_bottom for t in tiles if t.col == 0) == 768
    assert sum(t.width - t.crop_right for t in tiles if t.row == 0) == 1344
    # one tile when the frame fits; tile edges on the latent grid
    assert [(t.y0, t.y1, t.x0, t.x1) for t in plan_tiles(256, 192)] == [(0, 256, 0, 192)]
    assert all(v % 16 == 0 for t in plan_tiles(384, 512) for v in (t.y0, t.x0, t.blend_top, t.blend_left))


def test_stitch_tiles_matches_diffusers_stitch(ref_vae):
    tiles = plan_tiles(384, 512)
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1, 3, 2, t.height, t.width, generator=gen) for t in tiles]
    rows = [[p for t, p in zip(tiles, parts) if t.row == r] for r in range(1 + max(t.row for t in tiles))]
    _, _, oy = split_axis(384)
    _, _, ox = split_axis(512)
    assert torch.equal(stitch_tiles(tiles, parts), ref_vae._stitch_tiles(rows, oy, ox))


def test_plan_windows_frame_counts():
    assert (plan_windows(37).num_windows, plan_windows(37).num_frames) == (7, 124)
    assert (plan_windows(72).num_windows, plan_windows(72).num_frames) == (14, 243)
    assert (plan_windows(7).num_windows, plan_windows(7).num_frames) == (1, 22)
    p = plan_windows(37)
    assert (p.window(6), p.window_latents, p.frame_pre_padding, p.main_frames, p.overlap_frames) == \
        ((30, 37), 7, 3, 17, 5)


# ---------------------------------------------------------------------------------------------------- video decode
def test_decode_multi_tile_non_square_matches_diffusers(ref_vae, vae):
    latents = torch.randn(1, 24, 7, 24, 32, generator=torch.Generator().manual_seed(0))  # 384x512 px: 2x3 tiles
    assert len(vae.plan_tiles(384, 512)) == 6
    ref, ref_u8 = _reference_decode(ref_vae, latents)
    clips = list(vae.iter_decode(latents))
    assert [c.shape[0] for c in clips] == [17, 5]
    assert all(c.dtype == torch.uint8 and c.shape[1:] == (384, 512, 3) for c in clips)
    ours = vae.decode_float(latents)
    assert ours.shape == ref.shape == (22, 384, 512, 3)
    assert (ours - torch.from_numpy(ref)).abs().max().item() <= 1e-4
    assert np.array_equal(torch.cat(clips).numpy(), ref_u8)


def test_decode_124_frames_streams_17_frame_clips(ref_vae, vae):
    latents = torch.randn(1, 24, 37, 16, 16, generator=torch.Generator().manual_seed(1))  # 256x256 px
    ref, ref_u8 = _reference_decode(ref_vae, latents)
    clips = list(vae.iter_decode(latents))
    assert [c.shape[0] for c in clips] == [17] * 7 + [5]
    stream = torch.cat(clips)
    assert stream.shape == (124, 256, 256, 3) and ref.shape == (124, 256, 256, 3)
    assert np.array_equal(stream.numpy(), ref_u8)
    ours = vae.decode_float(latents)
    assert (ours - torch.from_numpy(ref)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("num_latents", [4, 8, 10])
def test_decode_padded_latent_counts_match_diffusers(ref_vae, vae, num_latents):
    """T + 3 not a multiple of 5: the last latent is repeated and the padding frames are cut from the stream."""
    latents = torch.randn(1, 24, num_latents, 4, 4, generator=torch.Generator().manual_seed(num_latents))
    ref, _ = _reference_decode(ref_vae, latents)
    ours = vae.decode_float(latents)
    assert ours.shape[0] == ref.shape[0] == plan_windows(num_latents).num_frames
    assert (ours - torch.from_numpy(ref)).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------------- video encode
def test_encode_keyframes_match_diffusers_keyframe_step(ref_vae, vae):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 256, (384, 512, 3), dtype=np.uint8)),  # 2x3 encode tiles
              Image.fromarray(rng.integers(0, 256, (128, 96, 3), dtype=np.uint8))]
    pipe = _block_pipeline(MiniMaxH3KeyframeVaeEncoderStep(), vae=ref_vae)
    ref = pipe(keyframes=frames).get("condition_latents")
    for image, expected in zip(frames, ref):
        ours = vae.encode_keyframe(np.asarray(image))
        assert ours.shape == expected.shape and ours.dtype == torch.float32
        assert (ours - expected).abs().max().item() <= 1e-5
    assert ref[0].shape == (1, 24, 1, 24, 32)


def test_encode_video_reference_matches_encode_vae_condition(ref_vae, vae):
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    frames = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (22, 64, 64, 3), dtype=np.uint8))
    ref = encode_vae_condition(ref_vae, frames.permute(3, 0, 1, 2)[None], (0.485, 0.456, 0.406),
                               (0.229, 0.224, 0.225), 42)
    ours = vae.encode_video(frames)
    assert ours.shape == ref.shape == (1, 24, 7, 4, 4)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_bf16_load_and_decode_follow_reference_dtype_policy(ckpt):
    from diffusers import AutoencoderKLMiniMaxH3

    ours = VideoVAE.load(ckpt, dtype=torch.bfloat16).model
    ref = AutoencoderKLMiniMaxH3.from_pretrained(ckpt / "vae", torch_dtype=torch.bfloat16)
    ref_dtypes = {n: p.dtype for n, p in ref.named_parameters()}
    assert {n: p.dtype for n, p in ours.named_parameters()} == ref_dtypes
    assert ref_dtypes["encoder.conv_in.weight"] == torch.float32
    assert ref_dtypes["decoder.proj_out.weight"] == torch.bfloat16
    # bf16 decode (bf16 tile / temporal blends, fp32 post-processing) equals the bf16 reference pipeline
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep

    latents = torch.randn(1, 24, 12, 20, 6, generator=torch.Generator().manual_seed(9))  # 320x96 px, padded T
    expected = _block_pipeline(MiniMaxH3VideoDecodeStep(), vae=ref)(latents=latents, output_type="np").get("videos")
    got = VideoVAE(ours).decode_float(latents)
    assert got.shape == expected[0].shape == (39, 320, 96, 3)
    assert (got - torch.from_numpy(expected[0])).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------------- audio
def test_audio_decode_matches_diffusers(ref_audio_vae, audio_vae):
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep

    latents = torch.randn(2, 32, 20, generator=torch.Generator().manual_seed(5))
    ref = _block_pipeline(MiniMaxH3AudioDecodeStep(), audio_vae=ref_audio_vae)(audio_latents=latents).get("audio")
    pcm = audio_vae.decode(latents)
    assert pcm.shape == (2, 20 * 800) and pcm.dtype == torch.float32
    assert ref.shape == (1, 2, 20 * 800)
    assert (pcm - ref[0]).abs().max().item() <= 1e-5
    assert pcm.abs().max().item() <= 1.0


def test_audio_reference_rows_match_diffusers(ref_audio_vae, audio_vae):
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep

    pcm = 0.3 * torch.randn(2, 12_345, generator=torch.Generator().manual_seed(6))  # not a multiple of the hop
    pipe = _block_pipeline(MiniMaxH3Ref2VAReferenceEncoderStep(), audio_vae=ref_audio_vae)
    state = pipe(normalized_references=[MiniMaxH3AudioReference(audio=pcm, sample_rate=32000)])
    (ref,) = state.get("audio_condition_latents")
    rows = audio_vae.encode_reference(pcm)
    a_ref = -(-12_345 // 800)
    assert rows.shape == ref.shape == (2 * a_ref, 32)
    assert (rows - ref).abs().max().item() <= 1e-5
