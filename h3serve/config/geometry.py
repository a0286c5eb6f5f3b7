"""Canvas, frame and latent arithmetic of the released model (H3_REFERENCE §3.1, §5), in one place.

  * 24 fps; the video VAE encodes 17n+5 pixel frames into 5n+2 latent frames, so a requested duration is raised
    to the next 17n+5 frames: 5 / 10 / 14 s -> 124 / 243 / 345 frames.
  * Durations are the reference's (diffusers' setup block): the frame count *after* that rounding must lie in
    [120, 360] (5..15 s at 24 fps), so 124..345 frames are generated, for 108..345 requested frames (4.5..14.375 s).
  * Audio latents: A = round(F / 24 * 40) (the audio VAE hops 800 samples at 32 kHz, 40 latents/s), stereo.
  * Canvas: the reference's rule, sides multiples of 32 (VAE 16x times the DiT patch 2, and at least 32); h3serve
    adds an area cap, the checkpoint's canvas_max_pixels (1,032,192 = 1344x768: the model's pixel budget, which
    bounds a request's work), and a side cap of 8192 (the MP4 writer's). A canvas derived from an aspect ratio
    follows the reference exactly. Latent sides are H/16, W/16.
  * A checkpoint whose VAEs or DiT would change this arithmetic is refused at load (models/checkpoint.py).

The request validator (`config/request.py`) turns a caller's values into this geometry; the DiT checks a direct
caller's latent geometry with `check_latents`. No torch, grpc or av imports here.
"""

from __future__ import annotations

from typing import NamedTuple

from h3serve.errors import RequestError

FPS = 24
FRAMES_PER_CLIP = 17            # video VAE clip_length
LATENTS_PER_CLIP = 5            # latent frames a clip keeps; 17n+5 frames -> 5n+2 latents
TOKEN_DROP = 3                  # video VAE token_drop: latents dropped after the clips (5n+5 -> 5n+2)
TEMPORAL_RATIO = 4              # video VAE temporal compression
AUDIO_LATENTS_PER_SECOND = 40   # 32 kHz / hop 800
AUDIO_HOP = 800
AUDIO_CHANNELS = 2              # stereo
SAMPLE_RATE = 32000
VAE_SPATIAL = 16
CANVAS_MULTIPLE = 32            # VAE 16x times the DiT patch 2
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344  # 1,032,192
MIN_SIDE, MAX_SIDE = CANVAS_MULTIPLE, 8192   # the reference's smallest side; the MP4 writer's largest
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0        # of an aspect ratio a canvas is derived from (resolve_canvas_size)
MIN_DURATION, MAX_DURATION = 5.0, 15.0     # seconds of the frame count after rounding up to 17n+5 (the reference)


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


def within_reference_duration(num_frames: int, fps: int = FPS) -> bool:
    """Whether an aligned (17n+5) frame count is a duration we generate: 5 s <= F/24 <= 15 s, i.e. 120..360
    frames, as the reference checks it after rounding (so 124..345 frames)."""
    return MIN_DURATION <= num_frames / fps <= MAX_DURATION


# Requested frame counts whose rounding lands within the durations (108..345): messages say them.
REQUESTED_FRAMES = (min(f for f in range(1, 400) if within_reference_duration(frames_for_seconds(f / FPS))),
                    max(f for f in range(1, 400) if within_reference_duration(frames_for_seconds(f / FPS))))
# The aligned frame counts generated (124..345).
FRAMES_RANGE = tuple(frames_for_seconds(f / FPS) for f in REQUESTED_FRAMES)


def check_latents(latent_frames: int, audio_latents: int, latent_height: int, latent_width: int) -> None:
    """The latent geometry a validated request produces: latent frames 5n+2 of a video of FRAMES_RANGE frames, the
    audio latents of those frames, latent sides of a canvas side in range. Raises RequestError naming the field."""
    lo, hi = (num_frames_to_latents(f) for f in FRAMES_RANGE)
    if not (lo <= latent_frames <= hi and (latent_frames - 2) % LATENTS_PER_CLIP == 0):
        raise RequestError("latent_frames", latent_frames,
                           f"5n+2 in [{lo}, {hi}] (a video of {FRAMES_RANGE[0]}..{FRAMES_RANGE[1]} frames)")
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


def canvas_for_ratio(ratio: float, short_edge: int = CANVAS_SHORT_EDGE, max_pixels: int = CANVAS_MAX_PIXELS) -> Canvas:
    """The generation canvas for a display aspect ratio W/H, as the reference's resolve_canvas_size computes it.

    Short edge 768; if the area then exceeds 1,032,192 it is scaled down to that area; each side is rounded to the
    nearest multiple of 32 (so the rounded area can end up slightly above the cap: 9:5 -> 1376x768).
    16:9 -> 1344x768, 1:1 -> 768x768, 9:16 -> 768x1344, 4:1 -> 2016x512.
    """
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    m = CANVAS_MULTIPLE
    return Canvas(max(m, round(width / m) * m), max(m, round(height / m) * m))


DEFAULT_CANVAS = canvas_for_ratio(16 / 9)   # 1344x768


CANVAS_RULE = (f"sides multiples of {CANVAS_MULTIPLE} within [{MIN_SIDE}, {MAX_SIDE}], area W*H at most "
               f"{CANVAS_MAX_PIXELS:,} pixels (the canvas max, 1344x768)")


def check_canvas(width: int, height: int, source: str | None = None) -> None:
    """An explicit canvas: CANVAS_RULE. The reference asks only multiples of 32; the area cap is the checkpoint's
    canvas_max_pixels (it bounds a request's work), the side cap the MP4 writer's. `source` names the caller's
    field the sides came from (size, or the side given); None: width / height."""
    for name, side in (("width", width), ("height", height)):
        if side % CANVAS_MULTIPLE or not MIN_SIDE <= side <= MAX_SIDE:
            raise RequestError(source or name, side if source is None else f"{width}x{height}",
                               f"{name} must be a multiple of {CANVAS_MULTIPLE} within [{MIN_SIDE}, {MAX_SIDE}] "
                               f"({CANVAS_RULE})")
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
