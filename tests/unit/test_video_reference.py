"""Video references at the front door: decoding and normalizing (24 fps by holding frames, truncated, LANCZOS onto
the canvas of the video's own aspect under the released 768 / 1,032,192 rule) equal diffusers' own decode and
normalization pixel for pixel; the bounds (bytes, frame size, frame rate, duration, length) are refused naming the
field, the value and the allowed range."""

from __future__ import annotations

import io

import numpy as np
import pytest

from h3serve.config.request import MAX_MEDIA_BYTES, Upload, validate_request
from h3serve.errors import RequestError
from h3serve.media.video import read_video_reference
from h3serve.testing.clips import write_video


def _clip(path, frames: int, fps: float, size=(40, 24), seed=0, sound=False):
    rng = np.random.default_rng(seed)
    pcm = np.zeros((2, int(frames / fps * 32000)), dtype=np.float32) if sound else None
    write_video(path, rng.integers(0, 255, (frames, size[1], size[0], 3), dtype=np.uint8), fps, pcm)
    return str(path)


def _diffusers_normalized(path, num_frames):
    import diffusers.modular_pipelines.minimax_h3.before_encoder as before
    from diffusers.modular_pipelines.minimax_h3.references import _decode_video_file

    frames, fps, _, _ = _decode_video_file(path)
    setup = next(c for c in vars(before).values() if isinstance(c, type) and hasattr(c, "_normalize_video_condition"))
    return setup._normalize_video_condition(frames, fps, num_frames, 32, 768, 768 * 1344, 24.0)


@pytest.mark.parametrize("frames,fps,num_frames,size", [
    (30, 30, 124, (40, 24)),    # 30 -> 24 fps: frames dropped; 5:3 -> 1280x768
    (14, 12, 124, (24, 40)),    # 12 -> 24 fps: each frame held twice; portrait
    (40, 24, 22, (32, 32)),     # already 24 fps, truncated to the request's frames; square 768x768
], ids=["30fps", "12fps", "24fps-truncated"])
def test_normalized_frames_equal_diffusers(tmp_path, frames, fps, num_frames, size):
    path = _clip(tmp_path / "v.mp4", frames, fps, size)
    ours = read_video_reference(path, num_frames)
    theirs = _diffusers_normalized(path, num_frames)
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_video_bytes_bound_refused_by_name(tmp_path):
    big = Upload(b"\0" * (MAX_MEDIA_BYTES["video"] + 1), "video_reference[0]", "big.mp4")
    with pytest.raises(RequestError) as info:
        validate_request(prompt="x", task="ref2va", references=[{"kind": "video", "path": big}])
    assert info.value.field == "video_reference[0]"
    assert f"{MAX_MEDIA_BYTES['video']:,} bytes" in str(info.value)


def test_video_bounds_refused_naming_value_and_range(tmp_path):
    from h3serve.services.gateway.uploads import decode_conditions

    def refused(path, match):
        data = open(path, "rb").read()
        req = validate_request(prompt="x", task="ref2va", seconds=5,
                               references=[{"kind": "video", "path": Upload(data, "video_reference[0]", "v.mp4")}])
        with pytest.raises(RequestError) as info:
            decode_conditions(req)
        assert info.value.field == "video_reference[0]", info.value
        assert match in str(info.value), info.value

    refused(_clip(tmp_path / "short.mp4", 20, 24), "length 20 frames at 24 fps")
    refused(_clip(tmp_path / "long.mp4", 62, 1, (16, 16)), "duration 62.0 s")
    refused(_clip(tmp_path / "fast.mp4", 30, 250), "frame rate 250 fps")
    refused(_clip(tmp_path / "wide.mp4", 24, 24, (96, 16)), "between 1:4 and 4:1")


def test_soundtrack_precedes_its_frames(tmp_path):
    from h3serve.services.gateway.uploads import decode_conditions

    path = _clip(tmp_path / "s.mp4", 30, 24, sound=True)
    req = validate_request(prompt="x", task="ref2va", seconds=5, references=[f"video:{path}", f"video:{path}"])
    conds = decode_conditions(req)
    assert conds.kinds == ("soundtrack", "video", "soundtrack", "video")
    assert conds.tensors[0].shape[0] == 2 and conds.tensors[1].shape == (30, 768, 1280, 3)   # 5:3 canvas


def test_video_data_url_forms(tmp_path):
    """A data URL as is or wrapped as vLLM-Omni's {"video_url": ...}; a remote URL refused (the server fetches
    nothing, as for images)."""
    import base64

    from h3serve.services.gateway.uploads import from_data_url

    data = open(_clip(tmp_path / "v.mp4", 24, 24), "rb").read()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    for value in (url, {"video_url": url}, {"video_url": {"url": url}}):
        upload = from_data_url("video_reference[0]", value)
        assert (upload.data, upload.filename) == (data, "upload.mp4")
    with pytest.raises(RequestError, match="fetches no URL"):
        from_data_url("video_reference[0]", {"video_url": "https://example.com/v.mp4"})
