"""A video's thumbnail: its first frame as a JPEG (the videos API's `variant=thumbnail`)."""

from __future__ import annotations

import io

import av

from h3serve.errors import MediaError

JPEG_QUALITY = 90


def first_frame_jpeg(path: str) -> bytes:
    """The first decoded frame of the MP4 at `path`, RGB, as JPEG bytes (same width and height as the video)."""
    try:
        with av.open(path) as container:
            frame = next(container.decode(video=0), None)
            if frame is None:
                raise MediaError(f"{path} has no video frame")
            image = frame.to_image()
    except av.error.FFmpegError as exc:
        raise MediaError(f"cannot decode {path}: {exc}") from None
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()
