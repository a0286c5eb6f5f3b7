"""A fragmented MP4 (fMP4) of the packets `Mp4Writer` encodes, written while they are encoded.

The stream is a remux, not a second encode: every packet the progressive MP4 gets is also muxed, unchanged, into an
fMP4 (ftyp + moov with empty sample tables, then moof + mdat fragments), so its decoded frames and audio samples
are those of the finished file. The finished file's bytes do not depend on whether a tap is attached.

`FragmentLog` keeps the fMP4's bytes as they are written (in a file, so a long video costs no memory) for any
number of readers, each from its own offset; readers wait for more until the log is closed or failed.

Fragments are cut about every FRAGMENT_S of media (FFmpeg's movenc `frag_duration`): about one VAE clip, so a
fragment is out shortly after its clip is encoded. Audio packets interleave with the video by decode time, so
a fragment holds the audio of its frames when the audio is already there (the VAE decodes the soundtrack first).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import av

FRAGMENT_S = 0.5            # media seconds per fragment (a clip is 17 frames, 0.71 s at 24 fps)
FMP4_CONTENT_TYPE = "video/mp4"


class FragmentLog:
    """Append-only bytes with a writer and any number of readers; backed by `path` (removed by `discard`)."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "wb")   # noqa: SIM115 - closed by close / fail / discard
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    # -- the writer side (a file-like object for PyAV: write only, not seekable) ----------------------------
    def write(self, data: Any) -> int:
        data = bytes(data)
        self._file.write(data)
        self._file.flush()
        with self._cond:
            self._size += len(data)
            self._cond.notify_all()
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """The stream is complete."""
        self._finish(None)

    def fail(self, error: BaseException) -> None:
        """The stream stops here; readers get `error` once they have read what was written."""
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with self._cond:
            if self._done:
                return
            self._file.close()
            self._done, self._error = True, error
            self._cond.notify_all()

    def discard(self) -> None:
        self.fail(RuntimeError("stream discarded"))
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- the reader side -----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def done(self) -> bool:
        return self._done

    def reader(self) -> "FragmentReader":
        """A reader with the log's file open: it reads on after the log is discarded (the path removed)."""
        return FragmentReader(self)


class FragmentReader:
    """One reader of a FragmentLog (a context manager that holds the file open)."""

    def __init__(self, log: FragmentLog):
        self.log = log
        self._fd = os.open(log.path, os.O_RDONLY)

    def __enter__(self) -> "FragmentReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read(self, offset: int, limit: int, timeout: float) -> bytes | None:
        """Up to `limit` bytes from `offset`: waits up to `timeout` s for some; b"" if none came yet, None at the
        end of a complete stream; raises the writer's error at the end of a failed one."""
        log = self.log
        with log._cond:
            if offset >= log._size and not log._done:
                log._cond.wait(timeout)
            size, done, error = log._size, log._done, log._error
        if offset >= size:
            if not done:
                return b""
            if error is not None:
                raise error
            return None
        return os.pread(self._fd, min(limit, size - offset), offset)


class Fmp4Tap:
    """Remuxes `Mp4Writer`'s packets into an fMP4 written to `out` (a FragmentLog or any `write`-able object).

    `Mp4Writer` calls `mux(packet, video, audio)` for every packet after the progressive container took it
    (`video`/`audio`: the writer's streams, templates for this container's tracks), then `close()` or `abort()`."""

    def __init__(self, out: Any):
        self.out = out
        self._container = None
        self._streams: dict[int, Any] = {}
        self.packets = 0

    def mux(self, packet: av.Packet, video: Any, audio: Any) -> None:
        if self._container is None:
            self._container = av.open(self.out, "w", format="mp4", options={
                "fflags": "+bitexact", "use_editlist": "1", "movflags": "empty_moov+default_base_moof+frag_discont",
                "frag_duration": str(int(FRAGMENT_S * 1_000_000))})
            self._streams = {video.index: self._container.add_stream_from_template(video),
                             audio.index: self._container.add_stream_from_template(audio)}
        copy = av.Packet(bytes(packet))
        copy.pts, copy.dts, copy.time_base = packet.pts, packet.dts, packet.time_base
        copy.duration, copy.is_keyframe = packet.duration, packet.is_keyframe
        copy.stream = self._streams[packet.stream.index]
        self._container.mux(copy)
        self.packets += 1

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
        if hasattr(self.out, "close"):
            self.out.close()

    def abort(self, error: BaseException | None = None) -> None:
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - best effort on a failed write
                pass
        if hasattr(self.out, "fail"):
            self.out.fail(error or RuntimeError("the MP4 write failed"))


def decoded_media(src: Any) -> tuple[list, Any]:
    """(video frames as yuv420p arrays, audio (channels, N) float32) of an MP4 or fMP4 (a path or bytes), audio
    from presentation time 0 (an fMP4 carries the AAC priming as an edit list that the decoder does not trim)."""
    import io

    import numpy as np

    def opened():
        return av.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src)

    with opened() as c:
        frames = [f.to_ndarray() for f in c.decode(video=0)]
    with opened() as c:
        blocks = []
        for f in c.decode(audio=0):
            a = f.to_ndarray()
            skip = max(0, -int(f.pts or 0))   # priming samples before time 0 (pts in 1/sample_rate)
            blocks.append(a[:, skip:])
    return frames, np.concatenate(blocks, axis=1) if blocks else np.zeros((0, 0), np.float32)
