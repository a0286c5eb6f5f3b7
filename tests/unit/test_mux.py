"""Mp4Writer: valid H.264/AAC output checked by independent decoders, byte stability, chunking, atomic writes."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from h3serve.errors import MediaError
from h3serve.testing.mp4check import check_mp4, ffprobe_report, have_ffprobe
from h3serve.media.mux import Mp4Writer
from h3serve.models.vae import yuv
from h3serve.models.vae.yuv import rgb_to_yuv420p
from h3serve.testing.clips import mux_to_bytes

N_FRAMES, HEIGHT, WIDTH = 124, 256, 256
N_SAMPLES = round(N_FRAMES / 24 * 40) * 800      # A * 800 = 207 * 800, what the audio VAE decodes for 124 frames


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    """Moving gradients plus noise: (124, 256, 256, 3) uint8 RGB."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    t = np.arange(N_FRAMES)[:, None, None]
    rgb = np.stack([(xx + 3 * t) % 256, (yy + 2 * t) % 256, (xx + yy + t) % 256], axis=-1)
    return np.clip(rgb + rng.integers(-12, 13, rgb.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    """A 440 Hz / 660 Hz stereo tone at 32 kHz: (2, 165600) float32."""
    t = np.arange(N_SAMPLES) / 32000
    return (0.5 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)])).astype(np.float32)


@pytest.fixture(scope="module")
def reference_mp4(frames, pcm, tmp_path_factory) -> tuple[str, bytes]:
    """One-shot write: all frames, then all audio."""
    path = str(tmp_path_factory.mktemp("mux") / "one_shot.mp4")
    with Mp4Writer(path, WIDTH, HEIGHT) as writer:
        writer.add_frames(rgb_to_yuv420p(frames))
        writer.add_audio(pcm)
        stats = writer.close()
    assert (stats.frames, stats.audio_samples, stats.bytes) == (N_FRAMES, N_SAMPLES, os.path.getsize(path))
    with open(path, "rb") as f:
        return path, f.read()


def test_output_passes_pyav_check(reference_mp4):
    path, _ = reference_mp4
    report = check_mp4(path, expect_frames=N_FRAMES, fps=24, width=WIDTH, height=HEIGHT, sample_rate=32000,
                       channels=2)
    assert report.codecs == ("h264", "aac") and report.pix_fmt == "yuv420p"
    assert report.video_seconds == pytest.approx(N_FRAMES / 24, abs=1e-3)
    assert report.audio_seconds == pytest.approx(N_SAMPLES / 32000, abs=1e-3)   # the edit list trims the priming
    assert report.video_std > 20 and report.audio_rms == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


@pytest.mark.skipif(not have_ffprobe(), reason="ffprobe not installed")
def test_output_passes_ffprobe(reference_mp4):
    path, _ = reference_mp4
    report = ffprobe_report(path)
    assert (report.video_codec, report.pix_fmt, report.frames, report.fps) == ("h264", "yuv420p", N_FRAMES, 24.0)
    assert (report.audio_codec, report.sample_rate, report.channels) == ("aac", 32000, 2)
    assert (report.width, report.height) == (WIDTH, HEIGHT)
    assert report.audio_samples == N_SAMPLES
    check_mp4(path, expect_frames=N_FRAMES, width=WIDTH, height=HEIGHT, report=report)


def test_same_input_same_bytes(frames, pcm, reference_mp4):
    assert mux_to_bytes(frames, pcm) == reference_mp4[1]


def test_chunked_equals_one_shot(frames, pcm, reference_mp4, tmp_path):
    """17 frames at a time (as the VAE decodes), audio in uneven chunks interleaved with the video."""
    path = tmp_path / "chunked.mp4"
    audio_chunks = np.array_split(pcm, 7, axis=1)
    with Mp4Writer(path, WIDTH, HEIGHT) as writer:
        for i, start in enumerate(range(0, N_FRAMES, 17)):
            writer.add_frames(rgb_to_yuv420p(frames[start:start + 17]))
            if i < len(audio_chunks):
                writer.add_audio(audio_chunks[i])
    assert path.read_bytes() == reference_mp4[1]


def test_yuv_planes_equal_rgb(frames, pcm, reference_mp4):
    """Planes converted up front (as the GPU path does), audio first: same bytes."""
    y, u, v = rgb_to_yuv420p(frames)
    assert y.shape == (N_FRAMES, HEIGHT, WIDTH) and u.shape == v.shape == (N_FRAMES, HEIGHT // 2, WIDTH // 2)
    out = io.BytesIO()
    with Mp4Writer(out, WIDTH, HEIGHT) as writer:
        writer.add_audio(pcm)
        for start in range(0, N_FRAMES, 17):
            writer.add_yuv(y[start:start + 17], u[start:start + 17], v[start:start + 17])
    assert out.getvalue() == reference_mp4[1]


def test_torch_input_equals_numpy(frames, pcm, reference_mp4):
    torch = pytest.importorskip("torch")
    assert mux_to_bytes(torch.from_numpy(frames), torch.from_numpy(pcm)[None]) == reference_mp4[1]


def test_failure_inside_with_leaves_no_file(frames, tmp_path):
    dst = tmp_path / "out.mp4"
    with pytest.raises(RuntimeError, match="decoder died"):
        with Mp4Writer(dst, WIDTH, HEIGHT) as writer:
            writer.add_frames(rgb_to_yuv420p(frames[:17]))
            assert len(os.listdir(tmp_path)) == 1 and not dst.exists()   # only the hidden temporary file
            raise RuntimeError("decoder died")
    assert os.listdir(tmp_path) == []


def test_close_without_audio_fails_and_leaves_no_file(frames, tmp_path):
    dst = tmp_path / "out.mp4"
    writer = Mp4Writer(dst, WIDTH, HEIGHT)
    writer.add_frames(rgb_to_yuv420p(frames[:17]))
    with pytest.raises(MediaError, match="no audio"):
        writer.close()
    assert os.listdir(tmp_path) == []


def test_bad_inputs_are_refused(frames, tmp_path):
    with Mp4Writer(io.BytesIO(), WIDTH, HEIGHT) as writer:
        with pytest.raises(TypeError, match="rgb_to_yuv420p"):
            writer.add_frames(frames[:2])
        with pytest.raises(ValueError, match="planes"):
            writer.add_frames(rgb_to_yuv420p(frames[:2, :128]))
        with pytest.raises(TypeError, match="uint8"):
            rgb_to_yuv420p(frames[:2].astype(np.float32))
        with pytest.raises(ValueError, match="PCM"):
            writer.add_audio(np.zeros((1, 100), np.float32))
        with pytest.raises(ValueError, match="NaN"):
            writer.add_audio(np.full((2, 100), np.nan, np.float32))
        writer.abort()
    with pytest.raises(ValueError, match="even"):
        Mp4Writer(tmp_path / "odd.mp4", 255, 256)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------ conversion

def _reference_yuv420p(rgb: np.ndarray):
    """The same fixed-point BT.601 limited-range formula in plain int64 arithmetic."""
    x = rgb.astype(np.int64)
    cy, cu, cv = (np.array(c, np.int64) for c in (yuv.COEF_Y, yuv.COEF_U, yuv.COEF_V))
    y = (x @ cy + (16 << 16) + (1 << 15)) >> 16
    s = x[:, 0::2, 0::2] + x[:, 1::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 1::2]
    u = (s @ cu + (128 << 16) + (1 << 15)) >> 16
    v = (s @ cv + (128 << 16) + (1 << 15)) >> 16
    return y, u, v


def test_conversion_is_exact_integer_math():
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (3, 34, 50, 3), dtype=np.uint8)
    rgb[0] = 0
    rgb[1] = 255
    rgb[2, :, :25] = [255, 0, 0]
    for ours, ref in zip(rgb_to_yuv420p(rgb), _reference_yuv420p(rgb)):
        assert ours.dtype == np.uint8 and np.array_equal(ours, ref)
    y, u, v = rgb_to_yuv420p(rgb[:2])
    assert (y[0] == 16).all() and (y[1] == 235).all() and (u[:2] == 128).all() and (v[:2] == 128).all()


def test_torch_elementwise_conversion_matches_numpy():
    torch = pytest.importorskip("torch")
    rgb = np.random.default_rng(4).integers(0, 256, (2, 32, 48, 3), dtype=np.uint8)
    for a, b in zip(yuv._rgb_to_yuv420p_torch(torch.from_numpy(rgb)), rgb_to_yuv420p(rgb)):
        assert np.array_equal(a.numpy(), b)


def test_conversion_close_to_libswscale(frames):
    """Within one level of libswscale's rgb24 -> yuv420p (area scaler, the same 2x2 mean) on real-ish content."""
    import av

    rgb = frames[5]
    ours = rgb_to_yuv420p(rgb[None])
    ref = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p", interpolation="AREA")
    for k, plane in enumerate(ref.planes):
        rows, cols = ours[k].shape[1:]
        theirs = np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:rows, :cols]
        diff = np.abs(ours[k][0].astype(int) - theirs.astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.1, (k, diff.max(), diff.mean())
