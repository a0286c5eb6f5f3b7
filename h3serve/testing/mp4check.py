"""Independent MP4 validation: decode what was written and check it against the H3 output contract.

H3 output is H.264 (yuv420p) video at 24 fps with AAC 32 kHz stereo audio. `probe_mp4` decodes every frame and
sample with PyAV (FFmpeg's decoders, not the writer's code); `ffprobe_report` asks the system `ffprobe` binary, a
second, separately built decoder; `check_mp4` raises `MediaError` naming every property that is off.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np

from h3serve.config.geometry import SAMPLE_RATE
from h3serve.errors import MediaError

AAC_FRAME = 1024        # samples per AAC-LC frame
AAC_PRIMING = 1024      # encoder delay of FFmpeg's AAC encoder (trimmed by the MP4 edit list)


@dataclass(frozen=True)
class MediaReport:
    """What a decoder found in an MP4. Durations in seconds; video_std is the largest per-plane (Y/U/V) standard
    deviation over all frames, in 8-bit levels; audio_rms is over all decoded samples of all channels, in [0, 1].
    From ffprobe, video_std and audio_rms are None (it does not decode pixel statistics)."""
    source: str                 # "pyav" | "ffprobe"
    bytes: int
    video_codec: str | None
    pix_fmt: str | None
    width: int | None
    height: int | None
    frames: int
    fps: float | None
    video_seconds: float | None
    audio_codec: str | None
    sample_rate: int | None
    channels: int | None
    audio_samples: int          # decoded samples per channel (PyAV: includes the padding of the last AAC frame)
    audio_seconds: float | None  # from the container's (edit-list trimmed) stream duration when it has one
    video_std: float | None
    audio_rms: float | None

    @property
    def codecs(self) -> tuple[str | None, str | None]:
        return self.video_codec, self.audio_codec


def _open(path_or_bytes: Any) -> tuple[Any, int, str]:
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        return av.open(io.BytesIO(data), "r", format="mp4"), len(data), "<bytes>"
    path = os.fspath(path_or_bytes)
    if not os.path.isfile(path):
        raise MediaError(f"{path}: no such file")
    return av.open(path, "r"), os.path.getsize(path), path


def _seconds(stream: Any) -> float | None:
    if stream.duration is None or stream.time_base is None:
        return None
    return float(stream.duration * stream.time_base)


def probe_mp4(path_or_bytes: Any) -> MediaReport:
    """Decode every video frame and audio sample of an MP4 (a path or its bytes) with PyAV and report on it."""
    name = "<bytes>" if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) else os.fspath(path_or_bytes)
    try:
        container, size, _ = _open(path_or_bytes)
    except av.FFmpegError as exc:
        raise MediaError(f"{name}: not a readable MP4 ({exc.strerror or exc})") from None
    with container:
        video = container.streams.video[0] if container.streams.video else None
        audio = container.streams.audio[0] if container.streams.audio else None
        frames, samples = 0, 0
        plane_sums = np.zeros((3, 3), np.float64)   # per plane: count, sum, sum of squares
        audio_sq = 0.0
        audio_count = 0
        streams = [s for s in (video, audio) if s is not None]
        if video is not None:
            video.thread_type = "AUTO"
        try:
            for packet in container.demux(*streams):
                for frame in packet.decode():
                    if packet.stream is video:
                        frames += 1
                        for k, plane in enumerate(frame.planes[:3]):
                            rows = plane.height
                            arr = np.frombuffer(plane, np.uint8, count=rows * plane.line_size)
                            arr = arr.reshape(rows, plane.line_size)[:, :plane.width].astype(np.float64)
                            plane_sums[k] += (arr.size, arr.sum(), np.square(arr).sum())
                    else:
                        pcm = frame.to_ndarray().astype(np.float64)
                        samples += frame.samples
                        audio_sq += float(np.square(pcm).sum())
                        audio_count += pcm.size
        except av.FFmpegError as exc:
            raise MediaError(f"{name}: decoding failed ({exc.strerror or exc})") from None

        video_std = None
        if video is not None and frames:
            stds = []
            for count, total, squares in plane_sums:
                if count:
                    mean = total / count
                    stds.append(max(0.0, squares / count - mean * mean) ** 0.5)
            video_std = float(max(stds))
        rate = (video.average_rate or video.guessed_rate) if video is not None else None
        video_seconds = audio_seconds = None
        if video is not None:
            video_seconds = _seconds(video)
            if video_seconds is None and rate:
                video_seconds = frames / float(rate)
        if audio is not None:
            audio_seconds = _seconds(audio)
            if audio_seconds is None:
                audio_seconds = samples / audio.codec_context.sample_rate
        return MediaReport(
            source="pyav", bytes=size,
            video_codec=video.codec_context.name if video is not None else None,
            pix_fmt=video.codec_context.pix_fmt if video is not None else None,
            width=video.codec_context.width if video is not None else None,
            height=video.codec_context.height if video is not None else None,
            frames=frames,
            fps=float(rate) if rate else None,
            video_seconds=video_seconds,
            audio_codec=audio.codec_context.name if audio is not None else None,
            sample_rate=audio.codec_context.sample_rate if audio is not None else None,
            channels=audio.codec_context.channels if audio is not None else None,
            audio_samples=samples,
            audio_seconds=audio_seconds,
            video_std=video_std,
            audio_rms=(audio_sq / audio_count) ** 0.5 if audio_count else (0.0 if audio is not None else None),
        )


def have_ffprobe() -> bool:
    return shutil.which("ffprobe") is not None


def ffprobe_report(path_or_bytes: Any, *, timeout: float = 120.0) -> MediaReport:
    """Report on an MP4 with the system `ffprobe -of json` (counting decoded frames). MediaError if it is missing."""
    exe = shutil.which("ffprobe")
    if exe is None:
        raise MediaError("ffprobe not found on PATH (install ffmpeg)")
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        with tempfile.NamedTemporaryFile(suffix=".mp4") as tmp:
            tmp.write(bytes(path_or_bytes))
            tmp.flush()
            return ffprobe_report(tmp.name, timeout=timeout)
    path = os.fspath(path_or_bytes)
    if not os.path.isfile(path):
        raise MediaError(f"{path}: no such file")
    cmd = [exe, "-v", "error", "-count_frames", "-show_streams", "-show_format", "-of", "json", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise MediaError(f"{path}: ffprobe failed: {proc.stderr.strip()[:300]}")
    info = json.loads(proc.stdout)
    streams = info.get("streams", [])
    video = next((s for s in streams if s.get("codec_type") == "video"), None)
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)

    def rate(s: dict) -> float | None:
        for key in ("avg_frame_rate", "r_frame_rate"):
            text = s.get(key, "0/0")
            num, _, den = text.partition("/")
            if den and int(den) and int(num):
                return float(Fraction(int(num), int(den)))
        return None

    def duration(s: dict | None) -> float | None:
        return float(s["duration"]) if s and s.get("duration") not in (None, "N/A") else None

    audio_samples = 0
    if audio is not None and audio.get("duration_ts") is not None \
            and audio.get("time_base") == f"1/{audio.get('sample_rate')}":
        audio_samples = int(audio["duration_ts"])   # the edit-list trimmed length, in samples
    return MediaReport(
        source="ffprobe", bytes=os.path.getsize(path),
        video_codec=video.get("codec_name") if video else None,
        pix_fmt=video.get("pix_fmt") if video else None,
        width=video.get("width") if video else None,
        height=video.get("height") if video else None,
        frames=int(video.get("nb_read_frames", 0)) if video else 0,
        fps=rate(video) if video else None,
        video_seconds=duration(video),
        audio_codec=audio.get("codec_name") if audio else None,
        sample_rate=int(audio["sample_rate"]) if audio and audio.get("sample_rate") else None,
        channels=audio.get("channels") if audio else None,
        audio_samples=audio_samples,
        audio_seconds=duration(audio),
        video_std=None,
        audio_rms=None,
    )


def check_mp4(path_or_bytes: Any, *, expect_frames: int | None = None, fps: float | None = 24,
              width: int | None = None, height: int | None = None, sample_rate: int | None = SAMPLE_RATE,
              channels: int | None = 2, pix_fmt: str | None = "yuv420p", min_video_std: float | None = 0.5,
              min_audio_rms: float | None = 1e-4, report: MediaReport | None = None) -> MediaReport:
    """Check an MP4 against the H3 output contract; return its report or raise MediaError naming every failure.

    Checked: codecs h264 + aac; pix_fmt; width/height (when given); frame count (when given); fps; sample rate;
    channels; video vs audio duration within one AAC frame + the encoder priming (2048 samples); video_std >
    min_video_std (not a constant picture); audio_rms > min_audio_rms (not silence). A None expectation skips
    that check. Pass `report` (e.g. from ffprobe_report) to check it instead of decoding with PyAV; checks that
    need a missing statistic are skipped.
    """
    rep = report if report is not None else probe_mp4(path_or_bytes)
    name = "<bytes>" if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) else os.fspath(path_or_bytes)
    problems: list[str] = []

    def expect(prop: str, got: Any, want: Any) -> None:
        if want is not None and got != want:
            problems.append(f"{prop}={got!r}, expected {want!r}")

    if rep.video_codec is None:
        problems.append("video_codec=None, expected 'h264' (no video stream)")
    else:
        expect("video_codec", rep.video_codec, "h264")
        expect("pix_fmt", rep.pix_fmt, pix_fmt)
        expect("width", rep.width, width)
        expect("height", rep.height, height)
        expect("frames", rep.frames, expect_frames)
        if fps is not None and (rep.fps is None or abs(rep.fps - fps) > 1e-6):
            problems.append(f"fps={rep.fps!r}, expected {fps!r}")
        if min_video_std is not None and rep.video_std is not None and not rep.video_std > min_video_std:
            problems.append(f"video_std={rep.video_std:.3g}, expected > {min_video_std:g} "
                            f"(constant picture: zero video variance)")
    if rep.audio_codec is None:
        problems.append("audio_codec=None, expected 'aac' (no audio stream)")
    else:
        expect("audio_codec", rep.audio_codec, "aac")
        expect("sample_rate", rep.sample_rate, sample_rate)
        expect("channels", rep.channels, channels)
        if min_audio_rms is not None and rep.audio_rms is not None and not rep.audio_rms > min_audio_rms:
            problems.append(f"audio_rms={rep.audio_rms:.3g}, expected > {min_audio_rms:g} (silent audio)")
    if rep.video_seconds is not None and rep.audio_seconds is not None and rep.sample_rate:
        tolerance = (AAC_FRAME + AAC_PRIMING) / rep.sample_rate
        drift = rep.audio_seconds - rep.video_seconds
        if abs(drift) > tolerance:
            problems.append(f"duration: audio {rep.audio_seconds:.4f} s vs video {rep.video_seconds:.4f} s "
                            f"differ by {drift:+.4f} s, more than one AAC frame + priming ({tolerance:.4f} s)")
    if problems:
        raise MediaError(f"{name}: " + "; ".join(problems))
    return rep
