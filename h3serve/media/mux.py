"""MP4 muxer: yuv420p planes + float PCM -> H.264 yuv420p + AAC 32 kHz stereo, with PyAV.

The VAE decodes clip by clip (17 frames at a time); `Mp4Writer.add_frames` encodes each chunk as it arrives, so
encoding overlaps the next clip's decode. Audio may arrive in chunks or once at the end.

Output is byte-identical for identical input, whatever the chunking and whatever the order of `add_frames` /
`add_audio` calls:
  * RGB -> yuv420p is done before, in exact integer arithmetic (`h3serve.models.vae.yuv`), instead of by
    libswscale, whose SIMD paths vary between CPUs.
  * x264 runs with a fixed thread count and thread type; the muxer and both encoders run with `bitexact` (no
    library version strings, no creation time: the mvhd/tkhd times are 0).
  * Encoded packets are interleaved here, by decode timestamp (video first on ties), so the file layout does not
    depend on when audio arrived relative to video.
Bytes depend on the PyAV/FFmpeg/x264 build (pinned: av==18.1.0) and on `threads`/`thread_type`/`preset`/`crf`.

The file is written to a temporary file beside the destination and renamed into place by `close()`; a failure or
an exception inside `with Mp4Writer(...)` removes the temporary file, so nothing that looks finished is left behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, BinaryIO

import av
import numpy as np
from av.codec.context import Flags, ThreadType

from h3serve.config.geometry import SAMPLE_RATE
from h3serve.errors import MediaError


# ---------------------------------------------------------------------------------------------------------------
def _to_numpy(x: Any) -> np.ndarray:
    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        return x.numpy()
    return np.asarray(x)


def _planes(frames: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Y, U, V) as numpy; anything else is refused with the way to make planes."""
    if not isinstance(frames, (tuple, list)):
        raise TypeError("frames must be yuv420p planes (Y, U, V); convert uint8 RGB with "
                        "h3serve.models.vae.yuv.rgb_to_yuv420p first")
    if len(frames) != 3:
        raise ValueError("planes must be (Y, U, V)")
    y, u, v = (_to_numpy(p) for p in frames)
    return y, u, v


# ---------------------------------------------------------------------------------------------------------------
# The writer

@dataclass(frozen=True)
class MuxStats:
    """What `Mp4Writer.close()` wrote. encode_seconds: wall time spent inside the writer (convert + encode + mux)."""
    path: str | None
    bytes: int
    frames: int
    audio_samples: int
    video_seconds: float
    audio_seconds: float
    encode_seconds: float

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.encode_seconds if self.encode_seconds > 0 else float("inf")


def _create_temp(directory: str, name: str) -> str:
    """An empty, exclusively created `.NAME.RANDOM.part` in `directory`, with the umask's usual permissions."""
    for _ in range(100):
        path = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.part")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file in {directory}")


def _cleanup(container: Any, tmp_path: str) -> None:
    try:
        container.close()
    except Exception:  # noqa: BLE001 - best effort on an abandoned or failed write
        pass
    try:
        os.unlink(tmp_path)
    except FileNotFoundError:
        pass


# x264 without lookahead or B-frames: each frame is encoded as soon as it arrives, so the MP4 is ready right after the
# last clip decodes (the tail of a request). Measured on 2 H200 + 32 cores, 10 s 1344x768 (bench/RESULTS.md): the tail
# after the decode fell from 0.59 s to 0.25 s at veryfast / CRF 18, and the file got smaller on that content.
LOW_LATENCY_X264 = "rc-lookahead=0:sync-lookahead=0:bframes=0"


class Mp4Writer:
    """Streams uint8 frames and float PCM into an MP4 (H.264 yuv420p + AAC-LC).

    dst: a path (written via a temporary file beside it, renamed on success) or a writable binary file object
    (written via a temporary file in tmp_dir, copied into it on success; nothing is written to it before).
    Not thread-safe: one writer per output, fed from one thread.
    width/height: even; fps: 24 for H3; sample_rate/channels: 32000/2 for H3.
    crf/preset/threads/thread_type/x264_params: x264 settings; the output bytes depend on them (threads is fixed,
    never 'auto', so that the bytes do not depend on the machine's core count). x264_params default: low latency
    (LOW_LATENCY_X264); None = x264's own lookahead and B-frames for the preset.
    """

    def __init__(self, dst: str | os.PathLike | BinaryIO, width: int, height: int, *, fps: int = 24,
                 sample_rate: int = SAMPLE_RATE, channels: int = 2, crf: int = 18, preset: str = "veryfast",
                 threads: int = 4, thread_type: str = "frame", audio_bitrate: int = 128_000,
                 faststart: bool = True, x264_params: str | None = LOW_LATENCY_X264, tmp_dir: str | None = None,
                 tap: Any = None):
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise ValueError(f"width and height must be positive and even for yuv420p, got {width}x{height}")
        if channels not in (1, 2):
            raise ValueError(f"channels must be 1 or 2, got {channels}")
        if threads < 1:
            raise ValueError("threads must be >= 1 (a fixed count keeps the output byte-stable)")
        if thread_type not in ("frame", "slice"):
            raise ValueError(f"thread_type must be 'frame' or 'slice', got {thread_type!r}")
        self.width, self.height, self.fps = int(width), int(height), int(fps)
        self.sample_rate, self.channels = int(sample_rate), int(channels)
        self._dst_path: str | None = None
        self._dst_file: BinaryIO | None = None
        if isinstance(dst, (str, os.PathLike)):
            self._dst_path = os.path.abspath(os.fspath(dst))
            directory, name = os.path.split(self._dst_path)
        else:
            self._dst_file = dst
            directory, name = tmp_dir or tempfile.gettempdir(), "h3mux"
        self._tmp_path = _create_temp(directory, name)

        container_options = {"fflags": "+bitexact"}
        if faststart:
            container_options["movflags"] = "+faststart"
        try:
            self._container = av.open(self._tmp_path, "w", format="mp4", options=container_options)
        except BaseException:
            os.unlink(self._tmp_path)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._container, self._tmp_path)
        try:
            video_options = {"crf": str(crf), "preset": preset}
            if x264_params:
                video_options["x264-params"] = x264_params
            self._video = self._container.add_stream("libx264", rate=self.fps, options=video_options)
            cc = self._video.codec_context
            cc.width, cc.height, cc.pix_fmt = self.width, self.height, "yuv420p"
            cc.time_base = Fraction(1, self.fps)
            cc.thread_count = int(threads)
            cc.thread_type = {"frame": ThreadType.FRAME, "slice": ThreadType.SLICE}[thread_type]
            cc.flags |= Flags.bitexact
            # Tag what the pixels are: BT.601 limited range (untagged HD is read as BT.709 by most players).
            cc.color_range, cc.colorspace, cc.color_primaries, cc.color_trc = 1, 6, 6, 6  # MPEG, SMPTE170M x3
            self._audio = self._container.add_stream("aac", rate=self.sample_rate,
                                                     layout="stereo" if channels == 2 else "mono")
            self._audio.codec_context.bit_rate = int(audio_bitrate)
            self._audio.codec_context.flags |= Flags.bitexact
        except Exception:
            self._finalizer()
            raise
        self._audio_frame_size = 1024
        self._pcm_pending = np.zeros((self.channels, 0), np.float32)
        self._video_packets: list[av.Packet] = []
        self._audio_packets: list[av.Packet] = []
        self._frames = 0
        self._samples = 0
        self._busy = 0.0
        self._closed = False
        self._tap = tap

    # -- context manager ------------------------------------------------------------------------------------
    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()

    # -- input ----------------------------------------------------------------------------------------------
    def add_frames(self, frames: Any) -> None:
        """Encode a chunk of yuv420p planes (Y (n,H,W), U (n,H/2,W/2), V (n,H/2,W/2)), numpy or torch (any device).

        RGB is converted by the caller, once, with `h3serve.models.vae.yuv.rgb_to_yuv420p` (where the frames are).
        """
        self._check_open()
        start = time.perf_counter()
        y, u, v = _planes(frames)
        n = self._check_planes(y, u, v)
        for i in range(n):
            frame = av.VideoFrame(self.width, self.height, "yuv420p")
            for plane, src in zip(frame.planes, (y[i], u[i], v[i])):
                rows, cols = src.shape
                view = np.frombuffer(plane, np.uint8, count=rows * plane.line_size).reshape(rows, plane.line_size)
                view[:, :cols] = src
            frame.pts = self._frames
            frame.time_base = Fraction(1, self.fps)
            self._video_packets.extend(self._video.encode(frame))
            self._frames += 1
        self._interleave()
        self._busy += time.perf_counter() - start

    def add_yuv(self, y: Any, u: Any, v: Any) -> None:
        """Encode a chunk of yuv420p planes (see `add_frames`)."""
        self.add_frames((y, u, v))

    def add_audio(self, pcm: Any) -> None:
        """Encode float PCM (channels, N) in [-1, 1] (values outside are clipped); once at the end or in chunks.

        A leading batch dimension of 1 ((1, channels, N), the pipeline's output) is accepted.
        """
        self._check_open()
        start = time.perf_counter()
        pcm = _to_numpy(pcm)
        if pcm.ndim == 3 and pcm.shape[0] == 1:
            pcm = pcm[0]
        if pcm.ndim != 2 or pcm.shape[0] != self.channels:
            raise ValueError(f"PCM must be ({self.channels}, N), got shape {pcm.shape}")
        if not np.issubdtype(pcm.dtype, np.floating):
            raise TypeError(f"PCM must be floating point in [-1, 1], got {pcm.dtype}")
        pcm = pcm.astype(np.float32, copy=False)
        if not np.isfinite(pcm).all():
            raise ValueError("PCM contains NaN or Inf")
        pcm = np.clip(pcm, -1.0, 1.0)
        pending = np.concatenate([self._pcm_pending, pcm], axis=1) if self._pcm_pending.shape[1] else pcm
        whole = pending.shape[1] // self._audio_frame_size * self._audio_frame_size
        self._encode_audio(pending[:, :whole])
        self._pcm_pending = np.ascontiguousarray(pending[:, whole:])
        self._interleave()
        self._busy += time.perf_counter() - start

    def _encode_audio(self, pcm: np.ndarray) -> None:
        size = self._audio_frame_size
        layout = "stereo" if self.channels == 2 else "mono"
        for s in range(0, pcm.shape[1], size):
            block = np.ascontiguousarray(pcm[:, s:s + size])
            frame = av.AudioFrame.from_ndarray(block, format="fltp", layout=layout)
            frame.sample_rate = self.sample_rate
            frame.pts = self._samples
            frame.time_base = Fraction(1, self.sample_rate)
            self._audio_packets.extend(self._audio.encode(frame))
            self._samples += block.shape[1]

    def _check_planes(self, y: np.ndarray, u: np.ndarray, v: np.ndarray) -> int:
        h, w = self.height, self.width
        n = y.shape[0] if y.ndim == 3 else -1
        want = ((n, h, w), (n, h // 2, w // 2), (n, h // 2, w // 2))
        if n < 0 or (y.shape, u.shape, v.shape) != want:
            raise ValueError(f"planes must be Y (n,{h},{w}), U/V (n,{h // 2},{w // 2}); "
                             f"got {y.shape}, {u.shape}, {v.shape}")
        if not (y.dtype == u.dtype == v.dtype == np.uint8):
            raise TypeError(f"planes must be uint8, got {y.dtype}, {u.dtype}, {v.dtype}")
        return n

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Mp4Writer is closed")

    # -- muxing ---------------------------------------------------------------------------------------------
    @staticmethod
    def _dts_seconds(packet: av.Packet) -> Fraction:
        ts = packet.dts if packet.dts is not None else packet.pts
        return Fraction(ts) * packet.time_base

    def _interleave(self, final: bool = False) -> None:
        """Mux pending packets in decode-time order while both streams have some (or all of them when final)."""
        v, a = self._video_packets, self._audio_packets
        vi = ai = 0
        while (vi < len(v) and ai < len(a)) or (final and (vi < len(v) or ai < len(a))):
            if ai >= len(a) or (vi < len(v) and self._dts_seconds(v[vi]) <= self._dts_seconds(a[ai])):
                packet = v[vi]
                vi += 1
            else:
                packet = a[ai]
                ai += 1
            self._container.mux(packet)
            if self._tap is not None:
                self._tap.mux(packet, self._video, self._audio)
        del v[:vi], a[:ai]

    @property
    def frames(self) -> int:
        """Video frames added so far."""
        return self._frames

    @property
    def audio_samples(self) -> int:
        """Audio samples (per channel) added so far, encoded or pending."""
        return self._samples + self._pcm_pending.shape[1]

    # -- finish ---------------------------------------------------------------------------------------------
    def close(self) -> MuxStats:
        """Flush both encoders, write the trailer and move the file into place. Returns what was written."""
        self._check_open()
        start = time.perf_counter()
        try:
            if self._frames == 0:
                raise MediaError("no video frames were added")
            if self._samples + self._pcm_pending.shape[1] == 0:
                raise MediaError("no audio was added (H3 output always has a soundtrack)")
            self._video_packets.extend(self._video.encode(None))
            if self._pcm_pending.shape[1]:
                self._encode_audio(self._pcm_pending)   # a short last frame; AAC-LC accepts it
                self._pcm_pending = self._pcm_pending[:, :0]
            self._audio_packets.extend(self._audio.encode(None))
            self._interleave(final=True)
            self._container.close()
            if self._tap is not None:
                self._tap.close()
            size = os.path.getsize(self._tmp_path)
            if self._dst_path is not None:
                os.replace(self._tmp_path, self._dst_path)
            else:
                with open(self._tmp_path, "rb") as src:
                    shutil.copyfileobj(src, self._dst_file, 1 << 20)
                os.unlink(self._tmp_path)
        except BaseException:
            self.abort()
            raise
        self._finalizer.detach()
        self._closed = True
        self._busy += time.perf_counter() - start
        return MuxStats(path=self._dst_path, bytes=size, frames=self._frames, audio_samples=self._samples,
                        video_seconds=self._frames / self.fps, audio_seconds=self._samples / self.sample_rate,
                        encode_seconds=self._busy)

    def abort(self) -> None:
        """Drop the output: close the container and remove the temporary file. The destination is not touched."""
        self._closed = True
        if self._tap is not None:
            self._tap.abort()
        self._finalizer()
