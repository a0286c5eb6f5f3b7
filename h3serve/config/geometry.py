"""Canvas, frame and latent arithmetic of the released model (H3_REFERENCE §3.1, §5), in one place.

  * 24 fps; the video VAE encodes 17n+5 pixel frames into 5n+2 latent frames, so a requested duration is raised
    to the next 17n+5 frames: 5 / 10 / 15 s -> 124 / 243 / 362 frames, 4 s -> 107.
  * Audio latents: A = round(F / 24 * 40) (the audio VAE hops 800 samples at 32 kHz, 40 latents/s), stereo.
  * Canvas sides are multiples of 32 (VAE 16x times the DiT patch 2); latent sides are H/16, W/16.

The request validator (`config/request.py`) turns a caller's values into this geometry; the DiT checks a direct
caller's latent geometry with `check_latents`. No torch, grpc or av imports here.
"""

from __future__ import annotations

from typing import NamedTuple

from h3serve.errors import RequestError

FPS = 24
FRAMES_PER_CLIP = 17            # video VAE clip length
LATENTS_PER_CLIP = 5            # latent frames a clip keeps; 17n+5 frames -> 5n+2 latents
AUDIO_LATENTS_PER_SECOND = 40   # 32 kHz / hop 800
AUDIO_HOP = 800
AUDIO_CHANNELS = 2              # stereo
SAMPLE_RATE = 32000
VAE_SPATIAL = 16
CANVAS_MULTIPLE = 32            # VAE 16x times the DiT patch 2
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344  # 1,032,192
MIN_SIDE, MAX_SIDE = 256, 2048
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
MIN_SECONDS, MAX_SECONDS = 4.0, 15.0


# ---------------------------------------------------------------------------------------------------------------
# Frames and latents

def frames_for_seconds(seconds: float, fps: int = FPS) -> int:
    """Pixel frames for a requested duration: the next 17n+5 >= round(seconds * fps). 5 s -> 124, 15 s -> 362."""
    target = round(seconds * fps)
    n = max(0, -(-(target - LATENTS_PER_CLIP) // FRAMES_PER_CLIP))   # ceil((target - 5) / 17)
    return FRAMES_PER_CLIP * n + LATENTS_PER_CLIP


def num_frames_to_latents(num_frames: int) -> int:
    """Latent frames of the video VAE for F = 17n+5 pixel frames: 5n+2 (124 -> 37, 243 -> 72, 362 -> 107)."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < LATENTS_PER_CLIP \
            or num_frames % FRAMES_PER_CLIP != LATENTS_PER_CLIP:
        raise RequestError("num_frames", num_frames, "must be of the form 17n+5 (e.g. 124, 243, 362)")
    return (num_frames - LATENTS_PER_CLIP) // FRAMES_PER_CLIP * LATENTS_PER_CLIP + 2


def latents_to_num_frames(latent_frames: int) -> int:
    """Pixel frames of 5n+2 latent frames: 17n+5 (37 -> 124); the inverse of `num_frames_to_latents`."""
    return (latent_frames - 2) // LATENTS_PER_CLIP * FRAMES_PER_CLIP + LATENTS_PER_CLIP


def audio_latents_for_frames(num_frames: int, fps: int = FPS) -> int:
    """Audio latents covering F video frames: A = round(F / fps * 40) (124 -> 207, 243 -> 405, 362 -> 603)."""
    return int(round(num_frames / fps * AUDIO_LATENTS_PER_SECOND))


# The reference pipeline (diffusers) refuses an *aligned* duration outside [5, 15] s: 124..345 frames. Requests of
# 4..4.9 s (107 frames) and of 14.4..15 s (362 frames) are served by h3serve but cannot be compared against it.
REFERENCE_DURATION = (5.0, 15.0)


def within_reference_duration(num_frames: int, fps: int = FPS) -> bool:
    """Whether the reference pipeline accepts this aligned frame count (5 s <= F/24 <= 15 s: 124..345 frames)."""
    return REFERENCE_DURATION[0] <= num_frames / fps <= REFERENCE_DURATION[1]


def check_latents(latent_frames: int, audio_latents: int, latent_height: int, latent_width: int) -> None:
    """The latent geometry a validated request produces: latent frames 5n+2 of a 4..15 s video, the audio latents
    of those frames, latent sides of a canvas side in range. Raises RequestError naming the field."""
    lo, hi = (num_frames_to_latents(frames_for_seconds(s)) for s in (MIN_SECONDS, MAX_SECONDS))
    if not (lo <= latent_frames <= hi and (latent_frames - 2) % LATENTS_PER_CLIP == 0):
        raise RequestError("latent_frames", latent_frames, f"5n+2 in [{lo}, {hi}] (a 4..15 s video)")
    frames = latents_to_num_frames(latent_frames)
    if audio_latents != audio_latents_for_frames(frames):
        raise RequestError("audio_latents", audio_latents,
                           f"{audio_latents_for_frames(frames)} (the audio of {frames} frames)")
    for name, value in (("latent_height", latent_height), ("latent_width", latent_width)):
        if not MIN_SIDE // VAE_SPATIAL <= value <= MAX_SIDE // VAE_SPATIAL:
            raise RequestError(name, value, f"an integer in [{MIN_SIDE // VAE_SPATIAL}, {MAX_SIDE // VAE_SPATIAL}]")


# ---------------------------------------------------------------------------------------------------------------
# The canvas

class Canvas(NamedTuple):
    width: int
    height: int


def canvas_for_ratio(ratio: float) -> Canvas:
    """The generation canvas for a display aspect ratio W/H, as the reference's resolve_canvas_size computes it.

    Short edge 768; if the area then exceeds 1,032,192 it is scaled down to that area; each side is rounded to the
    nearest multiple of 32 (so the rounded area can end up slightly above the cap: 9:5 -> 1376x768).
    16:9 -> 1344x768, 1:1 -> 768x768, 9:16 -> 768x1344, 4:1 -> 2016x512.
    """
    if ratio >= 1.0:
        width, height = CANVAS_SHORT_EDGE * ratio, float(CANVAS_SHORT_EDGE)
    else:
        width, height = float(CANVAS_SHORT_EDGE), CANVAS_SHORT_EDGE / ratio
    area = width * height
    if area > CANVAS_MAX_PIXELS:
        scale = (CANVAS_MAX_PIXELS / area) ** 0.5
        width, height = width * scale, height * scale
    m = CANVAS_MULTIPLE
    return Canvas(max(m, round(width / m) * m), max(m, round(height / m) * m))


DEFAULT_CANVAS = canvas_for_ratio(16 / 9)   # 1344x768


def check_canvas(width: int, height: int, source: str | None = None) -> None:
    """Sides multiples of 32 within [256, 2048], aspect 1:4..4:1, area <= the canvas max (1,032,192 = 1344x768).
    `source` names the caller's field the sides came from (size, or the side given); None: width / height."""
    for name, side in (("width", width), ("height", height)):
        if side % CANVAS_MULTIPLE or not MIN_SIDE <= side <= MAX_SIDE:
            raise RequestError(source or name, side if source is None else f"{width}x{height}",
                               f"{name} must be a multiple of {CANVAS_MULTIPLE} within [{MIN_SIDE}, {MAX_SIDE}]")
    ratio = width / height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise RequestError(source or "size", f"{width}x{height}", "aspect ratio W:H between 1:4 and 4:1")
    if width * height > CANVAS_MAX_PIXELS:
        raise RequestError(source or "size", f"{width}x{height}",
                           f"area W*H at most {CANVAS_MAX_PIXELS:,} pixels, the canvas max (1344x768); "
                           f"got {width * height:,}")


def other_side(given: int, exact: float) -> int:
    """The side that follows from the given one and the aspect: the nearest multiple of 32, or the one below when
    the nearest would push the area over the canvas max (height 768 at 16:9 -> 1344, not 1376)."""
    m = CANVAS_MULTIPLE
    side = max(m, round(exact / m) * m)
    if given * side > CANVAS_MAX_PIXELS and side - m >= m and given * (side - m) <= CANVAS_MAX_PIXELS:
        side -= m
    return side
