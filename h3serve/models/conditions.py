"""The fl2va / ref2va condition recipe, written once for the embedded pipeline and the stages.

A request's conditions are a list of kinds in the order the model reads them:

    fl2va    "first" and/or "last"          keyframes, stretched / cover-cropped onto the canvas
    ref2va   "image" | "audio" | "video" (each "video" with a soundtrack right after its "soundtrack"), in request
             order: images at the reference short edge; audio and soundtracks as (2, N) 32 kHz PCM; videos as
             uint8 (F, H, W, 3) already normalized (24 fps, truncated, on their own canvas: h3serve.media.video)

The encoder turns the resized images into vision blocks (`encoder_inputs`); the VAE encodes each image into its
condition latents (a video's frames first cut down to 17n+5) and each audio reference or soundtrack into clean
audio rows (the VAE stage, or the pipeline in process); the
DiT gets those in the same order (`dit_conditions`). The same PIL resize runs in every process, so the encoder's and
the VAE's inputs are the embedded pipeline's, pixel for pixel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from h3serve.config.request import MIN_VIDEO_FRAMES, PCM_KINDS
from h3serve.errors import RequestError
from h3serve.config.geometry import CANVAS_MULTIPLE, FRAMES_PER_CLIP, LATENTS_PER_CLIP
from h3serve.models.dit.layout import AudioRef, ImageRef, VideoRef
from h3serve.models.encoder import presentation as pres

KEYFRAME_KINDS = ("first", "last")
VISUAL_KINDS = ("first", "last", "image", "video")
AUDIO_KINDS = PCM_KINDS   # (2, N) PCM; a soundtrack belongs to the video right after it
CONDITION_KINDS = ("first", "last", "image", "video", "audio", "soundtrack")
DEFAULT_REFERENCE_SHORT_EDGE = 2048   # the released pipeline config's reference_image_short_edge


def reference_short_edge(pipeline_config: dict) -> int:
    """ref2va image references are encoded at this short edge (the checkpoint's pipeline config)."""
    return int(pipeline_config.get("reference_image_short_edge", DEFAULT_REFERENCE_SHORT_EDGE))


def requested_kinds(kinds: Sequence[str], task: str, field: str) -> list[str]:
    """A request's kinds as a list, checked for its task (`check_kinds`); RequestError naming the request's field."""
    kinds = list(kinds)
    try:
        check_kinds(kinds, task)
    except ValueError as exc:
        raise RequestError(field, kinds, str(exc)) from None
    return kinds


def check_kinds(kinds: Sequence[str], task: str) -> None:
    """Kinds allowed for a task, in a valid order (ValueError otherwise)."""
    bad = [k for k in kinds if k not in CONDITION_KINDS]
    if bad:
        raise ValueError(f"condition kinds must be among {CONDITION_KINDS}, got {bad}")
    if task == "fl2va" and (not kinds or any(k not in KEYFRAME_KINDS for k in kinds)
                            or list(kinds) not in (["first"], ["last"], ["first", "last"])):
        raise ValueError(f"fl2va conditions are first and/or last keyframes (in that order), got {list(kinds)}")
    if task == "ref2va" and (not kinds or any(k in KEYFRAME_KINDS for k in kinds)):
        raise ValueError(f"ref2va conditions are image / video / audio references, got {list(kinds)}")
    if any(k == "soundtrack" and (i + 1 == len(kinds) or kinds[i + 1] != "video") for i, k in enumerate(kinds)):
        raise ValueError(f"a soundtrack is followed by its video, got {list(kinds)}")
    if task == "t2va" and kinds:
        raise ValueError("t2va takes no conditions")


def resize(kinds: Sequence[str], images: Sequence[Any], height: int, width: int, short_edge: int) -> list[Image.Image]:
    """The visual conditions (one PIL / uint8 (H, W, 3) per visual kind, in order) resized as the model reads them:
    the first keyframe (or a last one alone) stretched onto the canvas, a last one beside a first cover-cropped,
    an image reference at `short_edge`."""
    visual = [k for k in kinds if k in VISUAL_KINDS]
    if len(visual) != len(images):
        raise ValueError(f"{len(visual)} visual conditions, {len(images)} images")
    out = []
    for kind, image in zip(visual, images):
        if kind == "video":
            out.append(check_video(image))
            continue
        img = pres.to_pil(image).convert("RGB")
        if kind == "image":
            out.append(pres.resize_reference_image(img, short_edge=short_edge))
        elif kind == "last" and "first" in kinds:
            out.append(pres.resize_keyframe_last(img, height, width))
        else:
            out.append(pres.resize_keyframe_first(img, height, width))
    return out


def encoder_inputs(kinds: Sequence[str], resized: Sequence[Image.Image], task: str):
    """(images, references) for `TextEncoder.encode`: fl2va keyframes as images, ref2va references in order."""
    if task == "fl2va":
        return list(resized), None
    if task != "ref2va":
        return [], None
    refs, it = [], iter(resized)
    for i, kind in enumerate(kinds):
        if kind == "image":
            refs.append(pres.Reference(kind="image", image=next(it)))
        elif kind == "video":
            refs.append(pres.Reference(kind="video", frames=next(it), has_audio=i > 0 and kinds[i - 1] == "soundtrack"))
        elif kind == "audio":
            refs.append(pres.Reference(kind="audio", has_audio=True))
    return [], refs


def check_video(frames: Any) -> np.ndarray:
    """A normalized reference video as uint8 (F, H, W, 3) on the canvas of its own aspect (ValueError otherwise):
    normalizing is the front door's (h3serve.media.video), done once per request."""
    arr = frames.numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[3] != 3 or arr.shape[0] < MIN_VIDEO_FRAMES:
        raise ValueError(f"a reference video is uint8 (F, H, W, 3) with F >= {MIN_VIDEO_FRAMES}, got {arr.dtype} "
                         f"{tuple(arr.shape)}")
    if arr.shape[1] % CANVAS_MULTIPLE or arr.shape[2] % CANVAS_MULTIPLE:
        raise ValueError(f"a reference video is on a canvas with sides multiples of {CANVAS_MULTIPLE}, got "
                         f"{arr.shape[2]}x{arr.shape[1]}")
    return arr


def vae_video_frames(frames: np.ndarray) -> np.ndarray:
    """The frames of a reference video the VAE encodes: cut *down* to 17n+5 (n >= 1), so no clip is padded."""
    n = max(1, (frames.shape[0] - LATENTS_PER_CLIP) // FRAMES_PER_CLIP)
    return frames[: n * FRAMES_PER_CLIP + LATENTS_PER_CLIP]


def encode_conditions(kinds: Sequence[str], resized: Sequence[Any], pcms: Sequence[torch.Tensor], video_vae,
                      audio_vae) -> list[torch.Tensor]:
    """Each condition encoded, in the order of `kinds`: visual ones (`resized`, in order) through the video VAE's
    condition recipe, PCM ones (`pcms`, in order) through the audio VAE."""
    visual, audio, out = iter(resized), iter(pcms), []
    for kind in kinds:
        if kind in AUDIO_KINDS:
            out.append(audio_vae.encode_reference(next(audio).to(audio_vae.device)))
        elif kind == "video":
            out.append(video_vae.encode_video(vae_video_frames(next(visual))))
        else:
            out.append(video_vae.encode_keyframe(next(visual)))
    return out


@dataclass
class DiTConditions:
    """What `DiTRequest` takes from the encoded conditions."""

    anchors: tuple[str, ...]
    condition_latents: list[torch.Tensor]      # (1, 24, t, h, w) each, visual conditions in order
    references: list                           # ImageRef / VideoRef / AudioRef in request order (ref2va)
    reference_audio_rows: list[torch.Tensor]   # (2 * A_ref, 32) each, audio references and soundtracks in order


def dit_conditions(kinds: Sequence[str], encoded: Sequence[torch.Tensor], task: str) -> DiTConditions:
    """The VAE's encodings (one per kind, in order: latents for a visual kind, rows for audio) as DiT inputs."""
    if len(encoded) != len(kinds):
        raise ValueError(f"{len(kinds)} conditions, {len(encoded)} encodings")
    anchors = tuple(k for k in kinds if k in KEYFRAME_KINDS)
    latents, refs, rows = [], [], []
    soundtrack = 0   # audio latents of the soundtrack waiting for its video
    for kind, z in zip(kinds, encoded):
        if kind in AUDIO_KINDS:
            if z.ndim != 2 or z.shape[0] % 2:
                raise ValueError(f"audio reference rows must be (2*A, C), got {tuple(z.shape)}")
            rows.append(z)
            if kind == "audio":
                refs.append(AudioRef(audio_latents=int(z.shape[0]) // 2))
            else:
                soundtrack = int(z.shape[0]) // 2
        else:
            if z.ndim != 5 or z.shape[0] != 1:
                raise ValueError(f"condition latents must be (1, C, t, h, w), got {tuple(z.shape)}")
            latents.append(z)
            if kind == "image":
                refs.append(ImageRef(latent_h=int(z.shape[-2]), latent_w=int(z.shape[-1])))
            elif kind == "video":
                refs.append(VideoRef(latent_frames=int(z.shape[2]), latent_h=int(z.shape[-2]),
                                     latent_w=int(z.shape[-1]), audio_latents=soundtrack))
                soundtrack = 0
    return DiTConditions(anchors, latents, refs if task == "ref2va" else [], rows)
