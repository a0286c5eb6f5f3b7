"""Packed layouts, row-timestep plans and (un)patchify against diffusers' own layout / set-timesteps helpers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from h3serve.models.dit import layout as L
from h3serve.models.dit.scheduler import fasth3_grid, sigma_grid

diffusers = pytest.importorskip("diffusers")
from diffusers.modular_pipelines.minimax_h3 import before_denoise as bd  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (  # noqa: E402
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_VIDEO_TAG,
)

PATCH = (1, 2, 2)
TEXT_TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1])  # a vision block inside the text is tagged video


def _reference_t2va(tags, t, h, w, a, anchors):
    return bd.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, t, h, w, a, PATCH, 2, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG, tuple(anchors)
    )


def _reference_ref2va(tags, refs, t, h, w, a):
    kinds, conds, audios = [], [], []
    for r in refs:
        if isinstance(r, L.ImageRef):
            kinds.append(SimpleNamespace(kind="image", has_audio=False))
            conds.append(torch.zeros(1, 24, 1, r.latent_h, r.latent_w))
        elif isinstance(r, L.AudioRef):
            kinds.append(SimpleNamespace(kind="audio", has_audio=True))
            audios.append(torch.zeros(2 * r.audio_latents, 32))
        else:
            kinds.append(SimpleNamespace(kind="video", has_audio=r.audio_latents > 0))
            conds.append(torch.zeros(1, 24, r.latent_frames, r.latent_h, r.latent_w))
            if r.audio_latents:
                audios.append(torch.zeros(2 * r.audio_latents, 32))
    return bd.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, kinds, conds, audios, t, h, w, a, PATCH, 2, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG
    )


def _assert_same(ours: L.PackedLayout, ref) -> None:
    pos, tags, vi, ai, ti, ncv, nca = ref
    assert ours.position_ids.dtype == torch.float64
    assert torch.equal(ours.position_ids, pos)
    assert torch.equal(ours.token_tags, tags)
    assert torch.equal(ours.video_indices, vi) and torch.equal(ours.audio_indices, ai)
    assert torch.equal(ours.text_indices, ti)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ncv, nca)
    # segments tile the sequence and agree with the tags
    assert ours.segments[0].start == 0 and ours.segments[-1].stop == ours.seq_len
    for seg in ours.segments:
        assert bool((ours.token_tags[seg.start:seg.stop] == seg.tag).all())


def _assert_same_plans(ours: L.PackedLayout) -> None:
    """Every step's row timesteps for the base (N=5, 50) and FastH3 grids equal diffusers' build_row_timesteps."""
    grids = [(sigma_grid(5, 12.0), sigma_grid(5, 3.0)), (sigma_grid(50, 12.0), sigma_grid(50, 3.0)),
             (fasth3_grid(12.0), fasth3_grid(3.0))]
    for video_sigmas, audio_sigmas in grids:
        for vt, at in zip((1.0 - video_sigmas[:-1]).tolist(), (1.0 - audio_sigmas[:-1]).tolist()):
            u, idx = L.row_timesteps(ours, vt, at)
            ru, ridx = bd.MiniMaxH3SetTimestepsStep.build_row_timesteps(
                ours.video_indices, ours.audio_indices, ours.num_condition_video_rows,
                ours.num_condition_audio_rows, ours.text_len, vt, at, max(vt, 0.999), 1.0,
            )
            assert u.dtype == torch.float32 and torch.equal(u, ru)
            assert torch.equal(idx, ridx)


GEOMETRIES = [(3, 4, 6, 5), (37, 2, 4, 3), (72, 6, 2, 7), (2, 6, 6, 0)]  # 37 / 72: pairwise-sum ulp territory


@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_t2va_fl2va_layout_equals_diffusers(anchors, geometry):
    t, h, w, a = geometry
    ours = L.build_t2va_layout(len(TEXT_TAGS), t, h, w, a, anchors, text_token_tags=TEXT_TAGS)
    _assert_same(ours, _reference_t2va(TEXT_TAGS, t, h, w, a, anchors))
    assert [s.kind for s in ours.segments if s.kind != "text"] == (
        ["condition_video"] * len(anchors) + (["audio"] if a else []) + ["video"]
    )
    _assert_same_plans(ours)


def test_t2va_without_vision_tokens_and_plain_text_tags():
    ours = L.build_t2va_layout(10, 3, 4, 6, 5)
    _assert_same(ours, _reference_t2va(torch.ones(10, dtype=torch.long), 3, 4, 6, 5, ()))
    u, idx = L.row_timesteps(ours, 0.25, 0.5)
    assert u.tolist() == [0.25, 0.5] and idx[ours.audio_indices].eq(1).all() and idx[ours.video_indices].eq(0).all()


REF2VA_CASES = {
    "image_audio": [L.ImageRef(2, 4), L.AudioRef(3)],
    "audio_first": [L.AudioRef(6), L.ImageRef(4, 4), L.ImageRef(2, 8)],
    "video_soundtrack_mix": [L.VideoRef(37, 4, 2, audio_latents=5), L.VideoRef(3, 2, 2), L.ImageRef(6, 4),
                             L.VideoRef(2, 2, 6, audio_latents=50), L.AudioRef(2)],
}


@pytest.mark.parametrize("name", list(REF2VA_CASES))
def test_ref2va_layout_equals_diffusers(name):
    refs = REF2VA_CASES[name]
    ours = L.build_ref2va_layout(len(TEXT_TAGS), refs, 3, 4, 6, 5, text_token_tags=TEXT_TAGS)
    _assert_same(ours, _reference_ref2va(TEXT_TAGS, refs, 3, 4, 6, 5))
    _assert_same_plans(ours)
    u, _ = L.row_timesteps(ours, 0.0271674, 0.1004804)
    assert torch.equal(u, torch.tensor([0.0271674, 0.1004804, 0.999, 1.0]))


def test_from_indices_rebuilds_the_same_segments():
    ours = L.build_ref2va_layout(len(TEXT_TAGS), REF2VA_CASES["image_audio"], 3, 4, 6, 5, text_token_tags=TEXT_TAGS)
    again = L.PackedLayout.from_indices(
        ours.token_tags, ours.position_ids, ours.video_indices, ours.audio_indices, ours.text_indices,
        ours.num_condition_video_rows, ours.num_condition_audio_rows,
    )
    assert [(s.start, s.stop, s.tag, s.kind) for s in again.segments] == [
        (s.start, s.stop, s.tag, s.kind) for s in ours.segments
    ]
    for vt, at in ((0.0, 0.0), (0.2, 0.5)):
        assert all(torch.equal(x, y) for x, y in zip(L.row_timesteps(ours, vt, at), L.row_timesteps(again, vt, at)))


def test_known_position_values():
    square = L.build_t2va_layout(0, 1, 16, 16, 0)  # a square canvas gives 0, 4, ..., 28
    assert square.position_ids[:8, 2].tolist() == [0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0]
    lay = L.build_t2va_layout(0, 72, 2, 2, 0, ("last",))  # last keyframe at (F-1)*5/3 = 242*5/3
    assert abs(lay.position_ids[0, 0].item() - 242 * 5 / 3) < 1e-9
    assert abs(lay.position_ids[1 + 71, 0].item() - 398.33333333333) < 1e-9  # last latent frame (§2.3)
    wide = L.frame_grid(48, 84)[1]
    assert abs(wide[0] - -5.166010) < 1e-6 and abs(wide[-1] - 36.158105) < 1e-6


def test_patchify_and_audio_rows_equal_diffusers_and_invert():
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 24, 3, 4, 6, generator=g)
    rows = L.patchify(lat)
    assert torch.equal(rows, bd.patchify_video_latents(lat, PATCH)) and rows.shape == (3 * 2 * 3, 96)
    assert torch.equal(rows[0, :4], lat[0, 0, 0, :2, :2].reshape(-1))  # channel-major: c*4 + dy*2 + dx
    assert torch.equal(L.unpatchify(rows, 3, 4, 6), lat)
    audio = torch.randn(2, 32, 5, generator=g)
    arows = L.audio_to_rows(audio)
    assert torch.equal(arows, audio.permute(0, 2, 1).reshape(-1, 32))  # the reference's prepare-latents packing
    assert torch.equal(arows[5], audio[1, :, 0])  # right channel starts after the A left rows
    assert torch.equal(L.rows_to_audio(arows), audio)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="anchor"):
        L.build_t2va_layout(3, 2, 4, 4, 2, ("middle",))
    with pytest.raises(ValueError, match="multiples"):
        L.build_t2va_layout(3, 2, 5, 4, 2)
    with pytest.raises(ValueError, match="text_token_tags"):
        L.build_t2va_layout(3, 2, 4, 4, 2, text_token_tags=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="reference"):
        L.build_ref2va_layout(3, ["image"], 2, 4, 4, 2)
