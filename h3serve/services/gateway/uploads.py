"""Media a caller sends (multipart files, base64 data URLs, gRPC bytes fields): read into `Upload`s, then decoded
here, at the front door, before the request is admitted, so that a file that cannot be decoded or is out of bounds
is a 4xx / INVALID_ARGUMENT naming the caller's field, never a stage failure.

What leaves here for the stages (`Conditions`): the kinds in the order the model reads them and one tensor per kind,
an image as (H, W, 3) uint8 RGB (the decoded file; each stage applies the same resize, models/conditions.py), an
audio reference as (2, N) float32 PCM at 32 kHz cut to the request's duration (as the embedded pipeline reads it).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from h3serve.config.request import (
    MAX_AUDIO_SECONDS,
    MAX_MEDIA_BYTES,
    SAMPLE_RATE,
    GenerationRequest,
    Upload,
    media_source,
)
from h3serve.errors import H3Error, RequestError
from h3serve.media.audio import audio_seconds, read_audio_reference

DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                      re.I)
MIME_EXTENSION = {"image/png": ".png", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/webp": ".webp",
                  "image/bmp": ".bmp", "image/gif": ".gif", "audio/wav": ".wav", "audio/x-wav": ".wav",
                  "audio/wave": ".wav", "audio/flac": ".flac", "audio/mpeg": ".mp3", "audio/mp4": ".m4a",
                  "audio/ogg": ".ogg", "video/mp4": ".mp4", "video/quicktime": ".mov", "video/webm": ".webm"}
LARGEST = max(MAX_MEDIA_BYTES.values())
VIDEO_REFUSED = ("video references are not served: they need Qwen3-VL's video processor, which needs torchvision "
                 "(not a dependency of this server); send the frames as image references or the soundtrack as an "
                 "audio reference")


def from_data_url(field: str, value: Any) -> Upload:
    """`data:<mime>;base64,<bytes>` (or {"url": ...} / {"image_url": ...} as some clients wrap it) -> Upload.
    Remote URLs are refused: the server fetches nothing."""
    if isinstance(value, dict):
        inner = value.get("image_url", value.get("url", value.get("data")))
        if isinstance(inner, dict):
            inner = inner.get("url")
        value = inner
    allowed = "a data URL (data:<mime>;base64,<file bytes>) or a file upload (multipart); the server fetches no URL"
    if not isinstance(value, str):
        raise RequestError(field, _short(value), allowed)
    m = DATA_URL.match(value[:200])
    if m is None or not m.group("b64"):
        raise RequestError(field, _short(value), allowed)
    payload = value[m.end():]
    if len(payload) > LARGEST * 4 // 3 + 8:
        raise RequestError(field, f"{len(payload)} base64 characters", f"a file of at most {LARGEST:,} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(field, _short(value), "valid base64 after 'base64,'") from None
    mime = (m.group("mime") or "").lower()
    return Upload(data, field, "upload" + MIME_EXTENSION.get(mime, ""))


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else text[:60] + "..."


@dataclass(frozen=True)
class Conditions:
    """A request's decoded conditions: kinds in model order and one tensor per kind (see the module doc)."""

    kinds: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _name(source: Any, default: str) -> str:
    return source.field if isinstance(source, Upload) else default


def _image(source: Any, field: str) -> torch.Tensor:
    try:
        with Image.open(media_source(source)) as image:
            arr = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
    except Exception:  # noqa: BLE001 - a truncated or corrupt file fails in the decode, after its header was read
        raise RequestError(field, repr(source) if isinstance(source, Upload) else source,
                           "a readable image file (PNG, JPEG, WebP, ...)") from None
    return torch.from_numpy(arr.copy())


def _audio(source: Any, field: str, max_samples: int) -> torch.Tensor:
    shown = repr(source) if isinstance(source, Upload) else source
    try:
        seconds = audio_seconds(media_source(source))
        if seconds > MAX_AUDIO_SECONDS:
            raise RequestError(field, f"{seconds:.1f} s", f"audio of at most {MAX_AUDIO_SECONDS:g} seconds")
        pcm = read_audio_reference(media_source(source), max_samples, SAMPLE_RATE)
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed file fails anywhere in the demuxer or decoder
        reason = str(exc).removeprefix("references: ") if isinstance(exc, H3Error) else \
            f"the decoder failed: {type(exc).__name__}"
        raise RequestError(field, shown, f"a readable audio file at {SAMPLE_RATE} Hz, mono or stereo ({reason})") \
            from None
    if not bool(torch.isfinite(pcm).all()):   # float WAVs can carry NaN / Inf
        raise RequestError(field, shown, "audio with finite samples (this one has NaN or Inf)")
    return pcm


def decode_conditions(req: GenerationRequest) -> Conditions | None:
    """The request's keyframes / references decoded and bounded (None for t2va). Raises RequestError naming the
    field of the first bad file."""
    kinds, tensors = [], []
    if req.task == "fl2va":
        for kind, source in (("first", req.first_image), ("last", req.last_image)):
            if source is not None:
                kinds.append(kind)
                tensors.append(_image(source, _name(source, f"{kind}_image")))
    elif req.task == "ref2va":
        max_samples = int(req.num_frames / req.fps * SAMPLE_RATE)   # as the reference truncates
        for i, spec in enumerate(req.references):
            field = _name(spec.path, f"references[{i}]")
            if spec.kind == "video":
                raise RequestError(field, repr(spec.path) if isinstance(spec.path, Upload) else spec.path,
                                   VIDEO_REFUSED)
            kinds.append(spec.kind)
            tensors.append(_image(spec.path, field) if spec.kind == "image"
                           else _audio(spec.path, field, max_samples))
    else:
        return None
    return Conditions(tuple(kinds), tuple(tensors))
