"""check_mp4 against files written directly with PyAV (not with our muxer): each defect names its property."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest

from h3serve.errors import MediaError
from h3serve.testing.mp4check import check_mp4, ffprobe_report, have_ffprobe, probe_mp4

SIDE = 64


def _write(path, *, frames=29, fps=24, sample_rate=32000, layout="stereo", seconds=None, constant=False,
           silent=False, audio=True):
    """A small MP4 written with plain PyAV: moving noise video and a 440 Hz tone (or the requested defect)."""
    rng = np.random.default_rng(1)
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width = video.height = SIDE
        video.pix_fmt = "yuv420p"
        video.codec_context.thread_count = 1
        stream = container.add_stream("aac", rate=sample_rate, layout=layout) if audio else None
        for i in range(frames):
            rgb = np.full((SIDE, SIDE, 3), 90, np.uint8) if constant else \
                rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if stream is None:
            return path
        channels = 2 if layout == "stereo" else 1
        total = round((seconds if seconds is not None else frames / fps) * sample_rate)
        t = np.arange(total) / sample_rate
        pcm = np.zeros((channels, total), np.float32) if silent else \
            np.tile(0.3 * np.sin(2 * np.pi * 440 * t), (channels, 1)).astype(np.float32)
        for start in range(0, total, 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, start:start + 1024]), format="fltp",
                                               layout=layout)
            frame.sample_rate, frame.pts = sample_rate, start
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("media") / "good.mp4")


def test_good_file_passes(good):
    report = check_mp4(good, expect_frames=29, width=SIDE, height=SIDE)
    assert report.codecs == ("h264", "aac")
    assert (report.frames, report.fps, report.sample_rate, report.channels) == (29, 24.0, 32000, 2)
    assert report.video_std > 10 and report.audio_rms > 0.1
    assert report.bytes == good.stat().st_size
    assert probe_mp4(good.read_bytes()) == report        # bytes and path give the same report


@pytest.mark.skipif(not have_ffprobe(), reason="ffprobe not installed")
def test_ffprobe_agrees(good):
    ours, theirs = probe_mp4(good), ffprobe_report(good)
    for name in ("video_codec", "pix_fmt", "width", "height", "frames", "fps", "audio_codec", "sample_rate",
                 "channels", "bytes"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.audio_seconds == pytest.approx(theirs.audio_seconds, abs=1e-3)


@pytest.mark.parametrize(
    "defect, write_kwargs, check_kwargs, prop",
    [
        ("silent audio", dict(silent=True), {}, "audio_rms"),
        ("constant colour", dict(constant=True), {}, "video_std"),
        ("wrong frame count", {}, dict(expect_frames=30), "frames"),
        ("mono", dict(layout="mono"), {}, "channels"),
        ("44.1 kHz", dict(sample_rate=44100), {}, "sample_rate"),
        ("25 fps", dict(fps=25, frames=30), {}, "fps"),
        ("wrong size", {}, dict(width=128), "width"),
        ("audio twice as long", dict(seconds=29 / 12), {}, "duration"),
        ("no audio stream", dict(audio=False), {}, "audio_codec"),
    ],
)
def test_defects_are_named(defect, write_kwargs, check_kwargs, prop, tmp_path):
    path = _write(tmp_path / "bad.mp4", **write_kwargs)
    with pytest.raises(MediaError) as info:
        check_mp4(path, **check_kwargs)
    message = str(info.value)
    assert f"{prop}" in message and str(path) in message, message
    # only the defect is reported
    assert message.count(";") == 0, message


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(MediaError, match="no such file"):
        check_mp4(tmp_path / "absent.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not an mp4 at all" * 10)
    with pytest.raises(MediaError):
        check_mp4(junk)
