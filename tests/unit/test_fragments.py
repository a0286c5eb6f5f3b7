"""The live fMP4 (`h3serve.media.fragments`): a remux of the packets `Mp4Writer` encodes, written while they are
encoded; the progressive MP4's bytes do not change when a tap is attached; both decode to the same frames and audio."""

from __future__ import annotations

import numpy as np
import pytest

from h3serve.media.fragments import Fmp4Tap, FragmentLog, decoded_media
from h3serve.media.mux import Mp4Writer

W, H, CLIP = 96, 64, 17


def _clips(n: int):
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, 255, (CLIP, h, w), dtype=np.uint8) for h, w in ((H, W), (H // 2, W // 2),
                                                                                  (H // 2, W // 2)))
            for _ in range(n)]


def _write(path, clips, pcm, tap=None):
    sizes = []
    with Mp4Writer(path, W, H, tap=tap) as w:
        w.add_audio(pcm)
        for c in clips:
            w.add_frames(c)
            sizes.append(tap.out.size if tap else 0)
    return sizes


def test_tap_leaves_the_mp4_unchanged_and_streams_equal_media_clip_by_clip(tmp_path):
    clips = _clips(3)
    pcm = (np.random.default_rng(1).standard_normal((2, 32000 * 3 * CLIP // 24)) * 0.1).astype(np.float32)
    _write(tmp_path / "plain.mp4", clips, pcm)
    log = FragmentLog(str(tmp_path / "live.fmp4"))
    sizes = _write(tmp_path / "tapped.mp4", clips, pcm, Fmp4Tap(log))
    assert (tmp_path / "plain.mp4").read_bytes() == (tmp_path / "tapped.mp4").read_bytes()
    live = (tmp_path / "live.fmp4").read_bytes()
    assert log.done and log.size == len(live)
    # fragments leave as the clips are encoded, not at the end
    assert 0 < sizes[0] < sizes[1] < sizes[2] < len(live)
    assert live[4:8] == b"ftyp" and b"moof" in live[:sizes[0]]
    frames, audio = decoded_media(str(tmp_path / "plain.mp4"))
    live_frames, live_audio = decoded_media(live)
    assert len(frames) == len(live_frames) == 3 * CLIP
    assert all(np.array_equal(a, b) for a, b in zip(frames, live_frames))
    assert audio.shape == live_audio.shape and np.array_equal(audio, live_audio)


def test_readers_follow_the_log_and_see_its_failure(tmp_path):
    log = FragmentLog(str(tmp_path / "x.fmp4"))
    with log.reader() as r:
        assert r.read(0, 10, 0.01) == b""
        log.write(b"abcdef")
        assert r.read(0, 4, 0.01) == b"abcd" and r.read(4, 10, 0.01) == b"ef"
        log.fail(ValueError("broken"))
        log.discard()   # the path goes; an open reader reads on
        with pytest.raises(ValueError, match="broken"):
            r.read(6, 10, 0.01)
        assert r.read(2, 2, 0.01) == b"cd"
