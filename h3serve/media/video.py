"""Video references in: decode a file with PyAV and normalize it as H3 reads a reference video (H3_REFERENCE §5).

Normalized means: on the 24 fps clock by holding frames (each source frame i lands in slot floor(i * 24 / fps + 0.5)
and is held until the next one's slot; frames that share a slot give way to the later one), truncated to the
request's frame count, and LANCZOS-resized to the canvas its own aspect ratio resolves to under the target's rule
(short edge 768, area at most 1,032,192, sides multiples of 32). A display-matrix rotation is undone first, in
quarter turns, as a player shows the video.

Bounded by what is decoded: the header's frame size, frame rate and duration are checked before any frame is decoded;
decoding stops at the first frame past the request's duration; each kept frame is resized as it is read, so at most
one source-sized frame is held at a time. The soundtrack is the first audio stream, read as an audio reference is
(`read_audio_reference`: 32 kHz, mono duplicated, truncated to the request's duration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from h3serve.config.geometry import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE, FPS, MAX_ASPECT, MIN_ASPECT, canvas_for_ratio
from h3serve.config.request import MAX_VIDEO_FPS, MAX_VIDEO_PIXELS, MAX_VIDEO_SECONDS, MIN_VIDEO_FRAMES
from h3serve.errors import H3Error


class VideoOutOfBounds(H3Error):
    """A video reference outside a bound: `what` names the quantity, `value` its value, `allowed` the bound."""

    def __init__(self, what: str, value, allowed: str):
        self.what, self.value, self.allowed = what, value, allowed
        super().__init__(f"{what} {value}: {allowed}")


@dataclass(frozen=True)
class VideoBounds:
    max_seconds: float     # the header's claimed duration
    max_pixels: int        # a source frame's width * height
    max_fps: float
    min_frames: int        # frames after the 24 fps resample and the truncation


# The target's canvas rule (short edge, area cap), which a reference video is put on at its own aspect.
CANVAS_RULE = (CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS)
BOUNDS = VideoBounds(max_seconds=MAX_VIDEO_SECONDS, max_pixels=MAX_VIDEO_PIXELS, max_fps=MAX_VIDEO_FPS,
                     min_frames=MIN_VIDEO_FRAMES)


def hold_slot(index: int, fps: float) -> int:
    """The 24 fps slot source frame `index` at `fps` starts in (it is held until the next kept frame's slot)."""
    return math.floor(index * (FPS / fps) + 0.5)


def video_canvas(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the canvas a reference video of this display size is put on (the target's rule)."""
    ratio = width / height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise VideoOutOfBounds("aspect ratio", f"{width}x{height}", "a video between 1:4 and 4:1")
    canvas = canvas_for_ratio(ratio, *CANVAS_RULE)
    return canvas.width, canvas.height


def to_canvas(frame: np.ndarray) -> np.ndarray:
    """One uint8 (H, W, 3) frame LANCZOS-resized to its own canvas (untouched when already there)."""
    width, height = video_canvas(frame.shape[1], frame.shape[0])
    if frame.shape[:2] == (height, width):
        return frame
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))


def _rotation_turns(frame) -> int:
    return round(float(getattr(frame, "rotation", 0) or 0) / 90.0) % 4


def read_video_reference(path, num_frames: int, bounds: VideoBounds = BOUNDS, fps: float | None = None) -> np.ndarray:
    """A video file's frames normalized (module doc): uint8 (N, H, W, 3) with N <= num_frames, on its canvas.

    `fps` overrides the container's frame rate (a file whose metadata is wrong). Raises VideoOutOfBounds for a
    header or a decode outside `bounds`, H3Error for a file that cannot be decoded."""
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise H3Error("the file has no video stream")
            stream = container.streams.video[0]
            ctx = stream.codec_context
            pixels = int(ctx.width or 0) * int(ctx.height or 0)
            if pixels > bounds.max_pixels:
                raise VideoOutOfBounds("frame size", f"{ctx.width}x{ctx.height}",
                                       f"at most {bounds.max_pixels:,} pixels a frame")
            if fps is None:
                rate = stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else 0.0
            if not 0 < fps <= bounds.max_fps:
                raise VideoOutOfBounds("frame rate", f"{fps:g} fps", f"a frame rate in (0, {bounds.max_fps:g}] fps")
            claimed = _claimed_seconds(stream, container)
            if claimed is not None and claimed > bounds.max_seconds:
                raise VideoOutOfBounds("duration", f"{claimed:.1f} s", f"at most {bounds.max_seconds:g} s")
            kept: list[np.ndarray] = []     # resized frames, each with the slot it starts in
            slots: list[int] = []
            pending = None                  # the last decoded frame and its slot: kept unless the next shares it
            count = 0
            for frame in container.decode(stream):
                if frame.width * frame.height > bounds.max_pixels:
                    raise VideoOutOfBounds("frame size", f"{frame.width}x{frame.height}",
                                           f"at most {bounds.max_pixels:,} pixels a frame")
                slot = hold_slot(count, fps)
                count += 1
                if pending is not None and pending[1] < slot:
                    kept.append(to_canvas(pending[0]))
                    slots.append(pending[1])
                if slot >= num_frames:   # every slot the request uses is filled
                    pending = None
                    end = num_frames
                    break
                arr = frame.to_ndarray(format="rgb24")
                turns = _rotation_turns(frame)
                if turns:
                    arr = np.ascontiguousarray(np.rot90(arr, k=-turns, axes=(0, 1)))
                pending = (arr, slot)
            else:
                end = min(num_frames, hold_slot(count, fps))
                if pending is not None and pending[1] < end:
                    kept.append(to_canvas(pending[0]))
                    slots.append(pending[1])
    except av.error.FFmpegError as exc:
        raise H3Error(f"cannot decode the video: {exc}") from None
    total = end if kept else 0
    if total < bounds.min_frames:
        raise VideoOutOfBounds("length", f"{total} frames at {FPS} fps ({count} decoded at {fps:g} fps)",
                               f"at least {bounds.min_frames} frames at {FPS} fps "
                               f"({bounds.min_frames / FPS:.3g} s)")
    sizes = {f.shape for f in kept}
    if len(sizes) > 1:
        raise VideoOutOfBounds("frame size", " and ".join(f"{s[1]}x{s[0]}" for s in sorted(sizes)),
                               "one frame size for the whole video")
    counts = np.diff(np.asarray(slots, dtype=np.int64), append=end)
    return np.repeat(np.stack(kept), counts, axis=0)


def _claimed_seconds(stream, container) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1e6
    return None


def has_audio(path) -> bool:
    """Whether the file carries an audio stream (its soundtrack)."""
    try:
        with av.open(path) as container:
            return bool(container.streams.audio)
    except av.error.FFmpegError as exc:
        raise H3Error(f"cannot decode the video: {exc}") from None
