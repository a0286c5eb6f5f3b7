"""Segment-parallel MP4: every chunk of frames is encoded as an independent H.264 segment (IDR first) on a pool of
threads, and the segments are joined, in order, into one MP4 (H.264 + AAC) as soon as each one is done.

Why: x264 keeps a chunk's last frames in flight (frame threads + lookahead) until it is flushed, so with one
encoder the frames that arrive last are encoded after the decode ends. Independent segments are flushed as soon as
they are complete and run side by side on the host's cores, so only the last segment's encode remains at the end.

Joining: all segments come from identically configured encoders, so their SPS/PPS (the stream's avcC) are the same;
the output video stream is made from the first segment's, and every segment's packets are copied with their
timestamps shifted by the frames before it. Decode timestamps are renumbered over the whole file as
(decode index − REORDER_DELAY) frames: a short segment may have a smaller B-frame delay than the one before it, and
this keeps dts strictly increasing and never above pts (x264's reorder delay is at most 2 frames for its presets'
B-pyramids; REORDER_DELAY = 4 leaves room).
Each segment is written to an in-memory MP4 first, so the FFmpeg muxer does the Annex B -> avcC conversion.

The bytes depend on where segments start (one IDR per segment), so they differ from `Mp4Writer`'s single stream;
for a fixed chunking they are deterministic (bitexact flags, fixed thread counts). Colour: the same exact integer
yuv420p planes, as `Mp4Writer`.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import av
import numpy as np
from av.codec.context import Flags, ThreadType

from h3serve.config.geometry import SAMPLE_RATE

from .mux import _create_temp, _planes

__all__ = ["SegmentedMp4Writer", "encode_segment", "REORDER_DELAY"]

REORDER_DELAY = 4  # frames; >= any segment's B-frame reorder delay


def encode_segment(y: np.ndarray, u: np.ndarray, v: np.ndarray, width: int, height: int, *, fps: int = 24,
                   crf: int = 18, preset: str = "veryfast", threads: int = 4, thread_type: str = "frame") -> bytes:
    """yuv420p planes of n frames -> an MP4 (bytes) holding them as one H.264 stream starting at pts 0."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as c:
        s = c.add_stream("libx264", rate=fps, options={"crf": str(crf), "preset": preset})
        cc = s.codec_context
        cc.width, cc.height, cc.pix_fmt = width, height, "yuv420p"
        cc.time_base = Fraction(1, fps)
        cc.thread_count = threads
        cc.thread_type = {"frame": ThreadType.FRAME, "slice": ThreadType.SLICE}[thread_type]
        cc.flags |= Flags.bitexact
        cc.color_range, cc.colorspace, cc.color_primaries, cc.color_trc = 1, 6, 6, 6
        for i in range(y.shape[0]):
            frame = av.VideoFrame(width, height, "yuv420p")
            for plane, src in zip(frame.planes, (y[i], u[i], v[i])):
                rows, cols = src.shape
                view = np.frombuffer(plane, np.uint8, count=rows * plane.line_size).reshape(rows, plane.line_size)
                view[:, :cols] = src
            frame.pts = i
            frame.time_base = Fraction(1, fps)
            c.mux(s.encode(frame))
        c.mux(s.encode(None))
    return buf.getvalue()


class SegmentedMp4Writer:
    """Streams chunks of yuv420p planes and float PCM into one MP4, encoding the chunks as
    independent segments in parallel. Feed from one thread; `close()` returns the number of frames written.

    segment_frames: a chunk longer than this is cut into segments of at most this many frames (None: one segment
    per `add_frames` call). workers: segments encoded at once; threads: x264 threads per segment.
    """

    def __init__(self, dst: str | os.PathLike, width: int, height: int, *, fps: int = 24, sample_rate: int = SAMPLE_RATE,
                 channels: int = 2, crf: int = 18, preset: str = "veryfast", threads: int = 4, workers: int = 4,
                 segment_frames: int | None = None, audio_bitrate: int = 128_000, faststart: bool = True):
        if width % 2 or height % 2:
            raise ValueError(f"yuv420p needs an even width and height, got {width}x{height}")
        self.width, self.height, self.fps = int(width), int(height), int(fps)
        self.sample_rate, self.channels = int(sample_rate), int(channels)
        self._enc = dict(fps=self.fps, crf=crf, preset=preset, threads=threads)
        self._segment_frames = segment_frames
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="h3-segment")
        self._pending: list[tuple[int, Future]] = []  # (first frame index, encoded segment), in order
        self._frames = 0
        self._decoded = 0  # video packets written (decode order)
        self._pcm: np.ndarray | None = None
        self._audio_bitrate = int(audio_bitrate)
        self._dst = os.path.abspath(os.fspath(dst))
        directory, name = os.path.split(self._dst)
        self._tmp = _create_temp(directory, name)
        options = {"fflags": "+bitexact"}
        if faststart:
            options["movflags"] = "+faststart"
        self._options = options
        self._out = None  # opened when the first segment is done (its stream is the template)
        self._video = self._audio = None
        self._closed = False

    # -- input ----------------------------------------------------------------------------------------------------
    def add_frames(self, frames: Any) -> None:
        y, u, v = _planes(frames)
        n = y.shape[0]
        step = self._segment_frames or n
        for a in range(0, n, step):
            b = min(n, a + step)
            fut = self._pool.submit(encode_segment, y[a:b], u[a:b], v[a:b], self.width, self.height, **self._enc)
            self._pending.append((self._frames + a, fut))
        self._frames += n
        self._join(block=False)

    def add_yuv(self, y: Any, u: Any, v: Any) -> None:
        self.add_frames((y, u, v))

    def add_audio(self, pcm: Any) -> None:
        """Float PCM (channels, N) or (1, channels, N) in [-1, 1], once (encoded when the file is opened)."""
        pcm = np.asarray(pcm, dtype=np.float32)
        if pcm.ndim == 3 and pcm.shape[0] == 1:
            pcm = pcm[0]
        if pcm.ndim != 2 or pcm.shape[0] != self.channels:
            raise ValueError(f"PCM must be ({self.channels}, N), got {pcm.shape}")
        self._pcm = np.clip(pcm, -1.0, 1.0)
        if self._out is not None:
            self._write_audio()

    # -- joining --------------------------------------------------------------------------------------------------
    def _open(self, first: av.container.InputContainer) -> None:
        self._out = av.open(self._tmp, "w", format="mp4", options=self._options)
        self._video = self._out.add_stream_from_template(first.streams.video[0])
        self._audio = self._out.add_stream("aac", rate=self.sample_rate,
                                           layout="stereo" if self.channels == 2 else "mono")
        self._audio.codec_context.bit_rate = self._audio_bitrate
        self._audio.codec_context.flags |= Flags.bitexact
        if self._pcm is not None:
            self._write_audio()

    def _write_audio(self) -> None:
        pcm, size = self._pcm, 1024
        self._pcm = None
        layout = "stereo" if self.channels == 2 else "mono"
        for k, a in enumerate(range(0, pcm.shape[1], size)):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, a:a + size]), format="fltp", layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = self.sample_rate, a, Fraction(1, self.sample_rate)
            self._out.mux(self._audio.encode(frame))
        self._out.mux(self._audio.encode(None))

    def _join(self, block: bool) -> None:
        while self._pending and (block or self._pending[0][1].done()):
            start, fut = self._pending.pop(0)
            with av.open(io.BytesIO(fut.result()), "r", format="mp4") as seg:
                if self._out is None:
                    self._open(seg)
                src = seg.streams.video[0]
                tb = src.time_base
                tick = Fraction(1, self.fps) / tb
                if tick.denominator != 1:
                    raise ValueError(f"segment time base {tb} does not hold whole frames at {self.fps} fps")
                tick = int(tick)
                for p in seg.demux(src):
                    if p.size == 0:
                        continue
                    p.pts = p.pts + start * tick
                    p.dts = (self._decoded - REORDER_DELAY) * tick
                    if p.dts > p.pts:
                        raise ValueError(f"a segment's reorder delay exceeds {REORDER_DELAY} frames")
                    self._decoded += 1
                    p.stream = self._video
                    self._out.mux(p)

    def close(self) -> int:
        if self._closed:
            return self._frames
        self._closed = True
        try:
            self._join(block=True)
            if self._out is None:
                raise ValueError("no frames were written")
            self._out.close()
            os.replace(self._tmp, self._dst)
        except BaseException:
            if self._out is not None:
                try:
                    self._out.close()
                except Exception:  # noqa: BLE001
                    pass
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)
            raise
        finally:
            self._pool.shutdown(wait=True)
        return self._frames

    def __enter__(self) -> "SegmentedMp4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._out is not None:
                self._out.close()
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)
