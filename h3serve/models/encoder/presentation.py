"""What the H3 text encoder reads: prompt presentation, token roles, image preprocessing (H3_REFERENCE §1.6, §5).

There is no chat template and no system prompt. Every text segment is tokenized on its own with
``add_special_tokens=False`` and the segments are concatenated:

* ``t2va``   — the prompt, verbatim.
* ``fl2va``  — per keyframe in packed order (first, then last): ``"<Picture i>: "`` + a vision block, then the prompt.
* ``ref2va`` — per reference in request order, numbered per modality: ``"<Audio j>: "`` first if it carries sound;
  an image adds ``"<Picture i>: "`` + an image block; a video adds ``"<Video k>: "`` then, per merged frame pair,
  ``"<{t:.1f} seconds>"`` + a video block; then the prompt.

A vision block is ``<|vision_start|>`` + N pads + ``<|vision_end|>`` with N = prod(grid_thw) / merge² for an image
and grid_h·grid_w / merge² per block of a video. Token roles (the DiT's ``text_token_tags``): 1 for every label and
prompt token, 0 for every token of a vision block including its start and end.

Images reach the vision tower through transformers' ``Qwen2VLImageProcessorPil`` (PIL resize), configured from the
checkpoint's ``processor/preprocessor_config.json``; reference videos through Qwen3-VL's own video processor
(torchvision), from ``processor/video_preprocessor_config.json`` (both: ``processor.load_processor``).

The fl2va before-encode resize rules (``resize_keyframe_first``, ``resize_keyframe_last``) and the ref2va image rule
(``resize_reference_image``) also live here: both the encoder and the VAE consume their output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from PIL import Image

__all__ = [
    "TEXT_TAG", "VIDEO_TAG", "Reference", "Presentation",
    "build_t2va", "build_fl2va", "build_ref2va", "mm_token_type_ids",
    "preprocess_images", "sample_video_frames",
    "to_pil", "resize_keyframe_first", "resize_keyframe_last", "resize_reference_image",
]

TEXT_TAG = 1   # label and prompt tokens
VIDEO_TAG = 0  # every token of a vision block, incl. <|vision_start|> / <|vision_end|>

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass
class Reference:
    """A ref2va reference as the encoder sees it (already normalized by the request's before-encode step).

    ``kind``: "image" (``image``: PIL / uint8 (H, W, 3)), "video" (``frames``: uint8 (F, H, W, 3) at 24 fps) or
    "audio" (a soundtrack alone: only its label reaches the encoder). ``has_audio``: the reference carries sound
    (always true for "audio"; a video may carry a soundtrack).
    """

    kind: str
    image: Any = None
    frames: Any = None
    has_audio: bool = False

    def __post_init__(self):
        if self.kind not in ("image", "video", "audio"):
            raise ValueError(f"reference kind must be 'image', 'video' or 'audio', got {self.kind!r}")
        if self.kind == "audio":
            self.has_audio = True


@dataclass
class Presentation:
    """A tokenized presentation: token ids, their roles, and the vision inputs by the encoder's argument names."""

    token_ids: list[int] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)
    vision_inputs: dict = field(default_factory=dict)

    def add(self, ids: Sequence[int], tag: int) -> None:
        self.token_ids.extend(ids)
        self.tags.extend([tag] * len(ids))


# ---------------------------------------------------------------------------------------------- tokenization
def _text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _vision_block(tokenizer, pad_token: str, n: int) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids([VISION_START, pad_token, VISION_END])
    return [ids[0]] + [ids[1]] * n + [ids[2]]


def build_t2va(tokenizer, prompt: str) -> Presentation:
    p = Presentation()
    p.add(_text(tokenizer, prompt), TEXT_TAG)
    return p


def build_fl2va(tokenizer, prompt: str, image_token_counts: Sequence[int]) -> Presentation:
    """``"<Picture i>: "`` + image block per keyframe (packed order), then the prompt."""
    p = Presentation()
    for i, n in enumerate(image_token_counts):
        p.add(_text(tokenizer, f"<Picture {i + 1}>: "), TEXT_TAG)
        p.add(_vision_block(tokenizer, IMAGE_PAD, n), VIDEO_TAG)
    p.add(_text(tokenizer, prompt), TEXT_TAG)
    return p


def build_ref2va(tokenizer, prompt: str, references: Sequence[Reference], image_token_counts: Sequence[int],
                 video_block_tokens: Sequence[int], video_block_timestamps: Sequence[Sequence[float]]) -> Presentation:
    """Labels numbered per modality in request order; a sound-carrying reference is labelled ``<Audio j>`` first."""
    p = Presentation()
    n_img = n_vid = n_aud = 0
    for ref in references:
        if ref.has_audio:
            n_aud += 1
            p.add(_text(tokenizer, f"<Audio {n_aud}>: "), TEXT_TAG)
        if ref.kind == "image":
            n_img += 1
            p.add(_text(tokenizer, f"<Picture {n_img}>: "), TEXT_TAG)
            p.add(_vision_block(tokenizer, IMAGE_PAD, image_token_counts[n_img - 1]), VIDEO_TAG)
        elif ref.kind == "video":
            n_vid += 1
            p.add(_text(tokenizer, f"<Video {n_vid}>: "), TEXT_TAG)
            for ts in video_block_timestamps[n_vid - 1]:
                # str.format rounds half to even: the first 2 fps pair (0.0 s, 0.5 s) reads "<0.2 seconds>".
                p.add(_text(tokenizer, f"<{ts:.1f} seconds>"), TEXT_TAG)
                p.add(_vision_block(tokenizer, VIDEO_PAD, video_block_tokens[n_vid - 1]), VIDEO_TAG)
    p.add(_text(tokenizer, prompt), TEXT_TAG)
    return p


def mm_token_type_ids(token_ids: Sequence[int], image_pad_id: int, video_pad_id: int) -> list[int]:
    """Qwen3-VL's own per-token modality ids (0 text, 1 image pad, 2 video pad; start/end tokens are text)."""
    return [1 if t == image_pad_id else 2 if t == video_pad_id else 0 for t in token_ids]


# ---------------------------------------------------------------------------------------------- vision inputs
def to_pil(image) -> Image.Image:
    """PIL as is (converted to RGB); uint8 (H, W, 3) array / tensor → PIL."""
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if hasattr(image, "detach"):
        image = image.detach().cpu().numpy()
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected a PIL image or uint8 (H, W, 3) array, got {arr.dtype} {tuple(arr.shape)}")
    return Image.fromarray(arr)


def preprocess_images(image_processor, images: Sequence) -> tuple[dict, list[int]]:
    """Batch the images through the processor: ({pixel_values, image_grid_thw}, vision tokens per image)."""
    if not images:
        return {}, []
    feats = image_processor(images=[to_pil(im) for im in images], return_tensors="pt")
    grid = feats["image_grid_thw"]
    merge = image_processor.merge_size ** 2
    counts = [int(g.prod()) // merge for g in grid]
    return {"pixel_values": feats["pixel_values"], "image_grid_thw": grid}, counts


def sample_video_frames(num_frames: int, fps: float = 24.0, sample_fps: float = 2.0,
                        temporal_patch: int = 2) -> tuple[list[int], list[float]]:
    """Frames the encoder reads from a normalized reference video and the timestamp of each merged block.

    Every ``fps / sample_fps``-th frame (Python ``round`` of an accumulating float cursor, deduplicated); blocks
    merge ``temporal_patch`` consecutive samples, the last timestamp repeated to fill the final block, and a block's
    timestamp is the mean of its first and last sample's.
    """
    stride = fps / sample_fps
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < num_frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise ValueError(f"a reference video needs at least {minimum} frames at {fps:g} fps, got {num_frames}")
    ts = [i / sample_fps for i in range(len(indices))]
    ts += [ts[-1]] * (-len(ts) % temporal_patch)
    blocks = [(ts[i] + ts[i + temporal_patch - 1]) / 2 for i in range(0, len(ts), temporal_patch)]
    return indices, blocks


# ---------------------------------------------------------------------------------------------- before-encode resize
def resize_keyframe_first(image, height: int, width: int) -> Image.Image:
    """fl2va first keyframe (or ``last_image`` alone): *stretched* onto the canvas, PIL LANCZOS; untouched if it
    already has the canvas size. (diffusers' ``VaeImageProcessor.resize`` default mode is exactly this.)"""
    image = to_pil(image)
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def resize_keyframe_last(image, height: int, width: int) -> Image.Image:
    """fl2va last keyframe when a first one is given: *cover-cropped*. scale = max(W/w, H/h); resized to
    (max(W, round(w·scale)), max(H, round(h·scale))) with LANCZOS, cropped at ((sw − W)//2, (sh − H)//2)."""
    image = to_pil(image)
    if image.size == (width, height):
        return image
    w, h = image.size
    scale = max(width / w, height / h)
    sw, sh = max(width, round(w * scale)), max(height, round(h * scale))
    left, top = max(0, (sw - width) // 2), max(0, (sh - height) // 2)
    return image.resize((sw, sh), Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))


def resize_reference_image(image, short_edge: int = 2048, multiple: int = 32) -> Image.Image:
    """ref2va image reference: short edge → ``short_edge`` (upscaling included, no area cap), each side rounded to a
    multiple of ``multiple``, PIL LANCZOS stretch; untouched if already at that size. Aspect must be within 1:4..4:1."""
    image = to_pil(image)
    w, h = image.size
    if w > 4 * h or h > 4 * w:
        raise ValueError(f"a reference image must be within 1:4 and 4:1, got {w}x{h}")
    scale = short_edge / min(w, h)
    th = max(multiple, round(h * scale / multiple) * multiple)
    tw = max(multiple, round(w * scale / multiple) * multiple)
    if (w, h) == (tw, th):
        return image
    return image.resize((tw, th), resample=Image.Resampling.LANCZOS)

