"""Audio references in: decode a file to float PCM with PyAV (FFmpeg's decoders)."""

from __future__ import annotations

import av
import torch

from h3serve.errors import H3Error


class AudioTooLong(H3Error):
    """More audio than the cap was decoded (the decoder stopped there, whatever the container's header said)."""

    def __init__(self, seconds: float, header_seconds: float | None):
        self.seconds = seconds                  # decoded before stopping: just past the cap
        self.header_seconds = header_seconds    # what the container claimed (None: it did not say)
        super().__init__(f"more than {seconds:.1f} s of audio")


def read_audio_reference(path, max_samples: int, sample_rate: int,
                         max_seconds: float | None = None) -> torch.Tensor:
    """An audio reference as (2, N) float32 at `sample_rate`, truncated to `max_samples` (mono duplicated).

    Samples are converted to planar float by FFmpeg's resampler at the file's own rate and layout (a format change
    only); other rates are refused rather than resampled differently from the reference.

    Bounded by what is decoded, not by what the container claims: only the first `max_samples` are kept, and with
    `max_seconds` decoding stops (AudioTooLong) as soon as more than that many seconds were decoded, so a file whose
    header claims 5 s and holds hours costs at most `max_seconds` of decoding and `max_samples` of memory.
    """
    try:
        with av.open(path) as container:
            if not container.streams.audio:
                raise H3Error(f"references: {path} has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate)
            if rate != sample_rate:
                raise H3Error(f"references: audio {path} is {rate} Hz; audio references must be {sample_rate} Hz")
            limit = None if max_seconds is None else int(max_seconds * rate)
            resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks: list[torch.Tensor] = []
            kept = decoded = 0

            def take(frames) -> None:
                nonlocal kept, decoded
                for r in frames:
                    decoded += r.samples
                    if limit is not None and decoded > limit:
                        raise AudioTooLong(decoded / rate, header_seconds(stream, container))
                    if kept < max_samples:
                        arr = r.to_ndarray()[:, : max_samples - kept]
                        chunks.append(torch.from_numpy(arr.copy()))
                        kept += arr.shape[-1]

            for frame in container.decode(stream):
                take(resampler.resample(frame))
            take(resampler.resample(None))
    except av.error.FFmpegError as exc:
        raise H3Error(f"references: cannot decode audio {path}: {exc}") from None
    if not chunks:
        raise H3Error(f"references: audio {path} has no samples")
    pcm = torch.cat(chunks, dim=-1).to(torch.float32)
    if pcm.shape[0] == 1:
        pcm = pcm.repeat(2, 1)
    if pcm.shape[0] != 2:
        raise H3Error(f"references: audio {path} has {pcm.shape[0]} channels; mono or stereo only")
    return pcm.contiguous()


def header_seconds(stream, container) -> float | None:
    """The duration the container's header claims for a stream (None when it does not say). A claim only: a
    file can hold more, so a cap is enforced on the decoded samples (read_audio_reference's max_seconds)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1e6
    return None


def audio_seconds(source) -> float | None:
    """Seconds of the first audio stream of a file (path or file object) as its header claims them, or None when
    it does not say. Nothing is decoded."""
    try:
        with av.open(source) as container:
            if not container.streams.audio:
                raise H3Error("no audio stream")
            return header_seconds(container.streams.audio[0], container)
    except av.error.FFmpegError as exc:
        raise H3Error(f"cannot decode audio: {exc}") from None
