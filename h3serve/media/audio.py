"""Audio references in: decode a file to float PCM with PyAV (FFmpeg's decoders)."""

from __future__ import annotations

import av
import torch

from h3serve.errors import H3Error


def read_audio_reference(path: str, max_samples: int, sample_rate: int) -> torch.Tensor:
    """An audio reference as (2, N) float32 at `sample_rate`, truncated to `max_samples` (mono duplicated).

    Samples are converted to planar float by FFmpeg's resampler at the file's own rate and layout (a format change
    only); other rates are refused rather than resampled differently from the reference.
    """
    try:
        with av.open(path) as container:
            if not container.streams.audio:
                raise H3Error(f"references: {path} has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate)
            if rate != sample_rate:
                raise H3Error(f"references: audio {path} is {rate} Hz; audio references must be {sample_rate} Hz")
            resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks = [torch.from_numpy(r.to_ndarray()) for f in container.decode(stream) for r in resampler.resample(f)]
            chunks += [torch.from_numpy(r.to_ndarray()) for r in resampler.resample(None)]
    except av.error.FFmpegError as exc:
        raise H3Error(f"references: cannot decode audio {path}: {exc}") from None
    pcm = torch.cat(chunks, dim=-1).to(torch.float32)[:, :max_samples]
    if pcm.shape[0] == 1:
        pcm = pcm.repeat(2, 1)
    if pcm.shape[0] != 2:
        raise H3Error(f"references: audio {path} has {pcm.shape[0]} channels; mono or stereo only")
    return pcm.contiguous()


def audio_seconds(source) -> float:
    """Seconds of the first audio stream of a file (path or file object), from its header where it says, else by
    counting the decoded samples."""
    try:
        with av.open(source) as container:
            if not container.streams.audio:
                raise H3Error("no audio stream")
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return container.duration / 1e6
            rate = int(stream.codec_context.sample_rate) or 1
            return sum(f.samples for f in container.decode(stream)) / rate
    except av.error.FFmpegError as exc:
        raise H3Error(f"cannot decode audio: {exc}") from None
