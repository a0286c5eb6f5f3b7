"""Segment-parallel MP4: segments encoded apart and joined give one valid MP4 whose decoded frames are exactly the
segments' own decoded frames, in order, with increasing timestamps, plus the audio track."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from h3serve.models.vae.yuv import rgb_to_yuv420p
from h3serve.media.segments import SegmentedMp4Writer, encode_segment

W, H, FPS = 64, 48, 24


def _frames(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (1, H, W, 3), dtype=np.uint8)
    shift = np.arange(n)[:, None, None, None]
    return ((base.astype(np.int32) + 7 * shift) % 256).astype(np.uint8)


def _decode(data_or_path) -> list[np.ndarray]:
    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    with av.open(src) as c:
        return [f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]


@pytest.mark.parametrize("segment_frames", [None, 5])
def test_joined_mp4_is_the_segments_in_order(tmp_path, segment_frames):
    clips = [_frames(17, 0), _frames(17, 1), _frames(5, 2)]
    pcm = (np.random.default_rng(3).standard_normal((2, 32000 * 39 // 24)) * 0.1).astype(np.float32)
    out = tmp_path / "joined.mp4"
    with SegmentedMp4Writer(out, W, H, workers=3, threads=2, segment_frames=segment_frames) as w:
        w.add_audio(pcm)
        for c in clips:
            w.add_frames(rgb_to_yuv420p(c))
    got = _decode(str(out))
    assert len(got) == 39
    # the same segments encoded on their own and decoded
    want = []
    for c in clips:
        step = segment_frames or c.shape[0]
        for a in range(0, c.shape[0], step):
            y, u, v = rgb_to_yuv420p(c[a:a + step])
            want += _decode(encode_segment(y, u, v, W, H, threads=2))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with av.open(str(out)) as c:
        v = c.streams.video[0]
        pts = [p.pts for p in c.demux(v) if p.size]
        dts_ok = True
        assert sorted(pts) == [round(i * (1 / FPS) / v.time_base) for i in range(39)]
        assert len(c.streams.audio) == 1 and dts_ok
    with av.open(str(out)) as c:
        dts = [p.dts for p in c.demux(c.streams.video[0]) if p.size]
        assert all(a < b for a, b in zip(dts, dts[1:]))


def test_deterministic_bytes(tmp_path):
    clips = [_frames(9, 0), _frames(4, 1)]
    outs = []
    for k in range(2):
        out = tmp_path / f"o{k}.mp4"
        with SegmentedMp4Writer(out, W, H, workers=2, threads=1) as w:
            for c in clips:
                w.add_frames(rgb_to_yuv420p(c))
            w.add_audio(np.zeros((2, 4000), np.float32))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_failure_leaves_no_file(tmp_path):
    out = tmp_path / "x.mp4"
    with pytest.raises(RuntimeError):
        with SegmentedMp4Writer(out, W, H) as w:
            w.add_frames(rgb_to_yuv420p(_frames(3, 0)))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
