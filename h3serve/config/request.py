"""One generation request, shared by the CLI, the embedded pipeline and the services.

`validate_request(**raw)` turns loosely typed input (CLI flags, JSON, gRPC fields) into a frozen
`GenerationRequest`, or raises `RequestError` naming the field, the value and what is allowed. It runs before
any model work, so a request that would fail later (bad canvas, wrong frame count, missing keyframe) is refused
up front with a message that says what to change.

The frame / latent / canvas arithmetic it applies is `h3serve.config.geometry`'s.

No torch, grpc or av imports here: every part of the system may import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import secrets
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from PIL import Image

from h3serve.config.codec import f
from h3serve.config.geometry import (
    AUDIO_HOP,
    CANVAS_MULTIPLE,
    DEFAULT_CANVAS,
    CANVAS_RULE,
    FPS,
    FRAMES_PER_CLIP,
    FRAMES_RANGE,
    LATENTS_PER_CLIP,
    MAX_ASPECT,
    MAX_DURATION,
    MAX_SIDE,
    MIN_ASPECT,
    MIN_DURATION,
    MIN_SIDE,
    REQUESTED_FRAMES,
    VAE_SPATIAL,
    Canvas,
    audio_latents_for_frames,
    canvas_for_ratio,
    check_canvas,
    frames_for_seconds,
    num_frames_to_latents,
    other_side,
    within_reference_duration,
)
from h3serve.config.levers import REQUEST_NAMES, lever_conflict
from h3serve.config.lora import NAME_PATTERN as LORA_NAME_PATTERN
from h3serve.config.lora import SCALE_RANGE as LORA_SCALE_RANGE
from h3serve.config.lora import LORA_TASKS, REF2VA_REFUSAL, LoraChoice, lora_choice
from h3serve.config.vocab import DEFAULT_DTYPE, DEFAULT_QUALITY, DTYPES, PROFILES, QUALITIES, TASKS
from h3serve.errors import RequestError

# ---------------------------------------------------------------------------------------------------------------
# Bounds of a request beyond its geometry (config/geometry.py)

MAX_PROMPT_CHARS = 20_000
MAX_SEED = 2**63 - 1
MAX_OUTPUTS = 10   # videos one request may ask for (`n`)

DEFAULT_SECONDS = 5.0
FASTH3_STEPS = 5                           # 4 forwards over 5 sigma positions; fixed by the distillation
DEFAULT_STEPS = {"base": 50, "fasth3": FASTH3_STEPS}   # grid points incl. the terminal 0: N points -> N-1 forwards
BASE_STEPS_RANGE = (2, 1000)

MAX_REFERENCES = 12
MAX_REFERENCES_PER_KIND = {"image": 9, "video": 3, "audio": 3}
REFERENCE_KINDS = ("image", "video", "audio")
PCM_KINDS = ("audio", "soundtrack")   # conditions carried as (2, N) PCM: audio references and a video's soundtrack
_EXTENSION_KIND = {
    **{e: "image" for e in (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")},
    **{e: "video" for e in (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")},
    **{e: "audio" for e in (".wav", ".flac", ".mp3", ".m4a", ".ogg", ".opus", ".aac")},
}


def reference_kind(filename: str) -> str | None:
    """A media file's kind (image | video | audio) by its name's extension; None when the name does not say."""
    return _EXTENSION_KIND.get(os.path.splitext(filename or "")[1].lower())


_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16"}

# Media given as bytes (uploads, data URLs, gRPC bytes fields) and every media file: bounds checked before any
# model work. Audio seconds are checked where the audio is decoded (the gateway; PyAV is not imported here).
MAX_MEDIA_BYTES = {"image": 20 << 20, "audio": 20 << 20, "video": 100 << 20}
MAX_IMAGE_PIXELS = 4096 * 4096
MIN_IMAGE_SIDE = 16
MAX_AUDIO_SECONDS = 60.0
MAX_JPEG_SEGMENTS = 1000   # marker segments before a JPEG's image data (jpeg_header_segments)
# Video references: the header's claims are checked before decoding, and decoding stops once the frames the request
# uses (its duration at 24 fps) were read, so a file's length costs nothing past them.
MAX_VIDEO_SECONDS = 60.0
MAX_VIDEO_PIXELS = 3840 * 2160   # a source frame's width * height (4K UHD); each is resized to its canvas as read
MAX_VIDEO_FPS = 240.0
MIN_VIDEO_FRAMES = FRAMES_PER_CLIP + LATENTS_PER_CLIP   # 22 at 24 fps: the VAE's shortest encode (17n+5, n >= 1)



# ---------------------------------------------------------------------------------------------------------------
# The request's fields, one row each

def _row(name: str, doc: str = "", *, request: bool = True, http: str | None = "body", media: str | None = None,
         form: dict | None = None, cli: dict | None = None, required: bool = False, dit: bool = False,
         **schema: Any) -> Any:
    """One field as callers give it (codec metadata: `name` is the caller's spelling, `doc` and `schema` its
    OpenAPI description and keywords), and where it goes:

    request   a field of `validate_request`, named by the row's attribute (False: the gateway's alone)
    http      "body": a top-level field of the videos API's body, documented in its OpenAPI; "refused": accepted
              at the top level and refused by name, so left out of the document; None: not a top-level field
    media     "one" | "many": files (a data URL or upload on HTTP, bytes on gRPC, paths on the CLI)
    form      its multipart schema where that is not the JSON one (media fields: a file or a list of files)
    cli       `h3serve generate`'s flag (argparse keywords; `flag` when it is not --NAME)
    dit       sent to the DiT as is (DiTParams and DiTRequest name it as the request does)

    gRPC's GenerateRequest and the SDK's keywords are its proto fields (read from the descriptor where they are
    used); a field with no proto field and no `http` reaches the request from the CLI or Python only."""
    meta = {"request": request, "http": http, "media": media, "form": form, "cli": cli, "required": required,
            "dit": dit}
    return f(name, doc, None, meta=meta, **schema)


@dataclass(frozen=True)
class RequestFields:
    """The table of the request's fields (never instantiated), in the videos API's order. A field's Python type
    is its type check and its JSON type; `services/gateway` (field lists, type checks, the OpenAPI body),
    `cli.py` (`generate`'s flags) and the stages' DiT parameters are derived from it."""

    prompt: str = _row("prompt", "What to generate", required=True, cli={}, maxLength=MAX_PROMPT_CHARS)
    seconds: float = _row("seconds", "Requested duration, 4.5..14.375 s (raised to 17n+5 frames at 24 fps, which "
                                     "must lie in [120, 360]). Not with num_frames.", type=["string", "number"],
                          cli={"default": "5", "help": "requested duration, 4.5-14.375 s (raised to the next 17n+5 "
                                                       "frames, 124..345)"})
    size: str = _row("size", "WxH, multiples of 32 in [32, 8192], area <= 1,032,192", example="1344x768",
                     cli={"help": "WxH, sides multiples of 32 (default: 16:9 canvas 1344x768)"})
    width: int = _row("width")
    height: int = _row("height")
    aspect: object = _row("aspect", http=None)   # 'W:H', W/H or (W, H): Python callers only
    num_frames: int = _row("num_frames", "Requested frames at 24 fps (raised to 17n+5)")
    fps: int = _row("fps", enum=[FPS])
    seed: int = _row("seed", minimum=0, maximum=MAX_SEED, cli={"default": "0"}, dit=True)
    task: str = _row("task", "t2va | fl2va | ref2va (SGLang's top-level field; also extra_params.task); inferred "
                             "from the media when unset (keyframes: fl2va, references: ref2va, else t2va)",
                     enum=list(TASKS),
                     cli={"help": "t2va | fl2va | ref2va (default: fl2va with --first-image / --last-image, ref2va "
                                  "with --reference, else t2va)"}, dit=True)
    profile: str = _row("profile", http=None, cli={"default": "base", "help": " | ".join(PROFILES)}, dit=True)
    steps: int = _row("num_inference_steps", "Sigma grid points incl. the terminal 0 (N -> N-1 steps); base "
                                             "default 50, fasth3 5",
                      cli={"help": "sigma grid points incl. the terminal 0 (base default 50)"}, dit=True)
    quality: str = _row("quality", "lossless (default) | high: step reuse, profile base only", enum=list(QUALITIES),
                        cli={"help": "lossless (default) | high: step reuse (profile base)"}, dit=True)
    lora: object = _row("lora", "A LoRA adapter the deployment lists: its name, or {name, scale} (scale in "
                                "[-4, 4], default 1); a few-step adapter sets the steps. Profile base only; "
                                "docs/api.md", type=["string", "object"],
                        properties={"name": {"type": "string", "pattern": LORA_NAME_PATTERN},
                                    "scale": {"type": "number", "minimum": LORA_SCALE_RANGE[0],
                                              "maximum": LORA_SCALE_RANGE[1]}},
                        cli={"help": "a LoRA adapter --loras lists (by name, scale 1)"})
    dtype: str = _row("dtype", http=None, cli={"default": DEFAULT_DTYPE, "help": " | ".join(DTYPES)})
    preview_every: int = _row("preview_every", "A preview (a small JPEG of the current estimate) on the progress "
                                               "event of every k-th denoising step; 0 (default): none. At most the "
                                               "deployment's --max-previews per request", minimum=0, dit=True)
    model: str = _row("model", "the model id of the pool to use (e.g. FastH3); unset: the deployment's own",
                      request=False,
                      cli={"help": "with --server: the model id of the gateway's pool to use (e.g. FastH3 for a "
                                   "deployment's FastH3 pool; default: the deployment's own)"})
    request_id: str = _row("request_id", "the caller's id of the request (letters, digits, '-', '_', '.'; at most "
                                         "64): watched again (Attach) and cancelled by it; a retry with the same id "
                                         "never makes a second job", request=False, http=None)
    extra_params: dict = _row("extra_params", request=False, form={"type": "string", "description": "a JSON object"},
                              properties={"task": {"type": "string", "enum": list(TASKS)},
                                          "duration": {"type": ["string", "number"]},
                                          "aspect_ratio": {"type": "string"},
                                          "flow_shift": {"type": ["string", "number"]},
                                          "audio_flow_shift": {"type": ["string", "number"]}})
    video_params: dict = _row("video_params", "width, height, num_frames, fps (vLLM-Omni)", request=False)
    user: str = _row("user", request=False)
    # vLLM-Omni's and SGLang's H3 fields, mapped onto the fields above by the gateway (docs/openai-compat.md)
    aspect_ratio: str = _row("aspect_ratio", "the canvas for an aspect, '16:9' (also extra_params.aspect_ratio)",
                             request=False)
    short_edge: int = _row("short_edge", "the canvas's short side, a multiple of 32; the long side follows the "
                                         "aspect", request=False, type=["integer", "string"])
    target: dict = _row("target", "SGLang: {short_edge, aspect_ratio, duration_seconds}", request=False,
                        form={"type": "string", "description": "a JSON object"})
    conditions: list = _row("conditions", "SGLang: keyframes and references, [{type, uri (a data URL), role, "
                                          "frame_index, start_time_seconds}]", request=False,
                            form={"type": "string", "description": "a JSON list"})
    flow_shift: float = _row("flow_shift", "only the checkpoint's video shift (12 released; also extra_params)",
                             request=False)
    audio_flow_shift: float = _row("audio_flow_shift", "only the checkpoint's audio shift (3 released; also "
                                                       "extra_params)", request=False)
    n: int = _row("n", "Videos from this prompt, 1..10 (output i has seed + i; download ?variant=i)", request=False,
                  minimum=1, maximum=MAX_OUTPUTS)
    num_outputs_per_prompt: int = _row("num_outputs_per_prompt", "vLLM-Omni's name of n", request=False, minimum=1,
                                       maximum=MAX_OUTPUTS)
    webhook_url: str = _row("webhook_url", "POSTed a signed video.completed / video.failed event when the job ends "
                                           "(docs/api.md, Webhooks)", request=False, maxLength=2048)
    input_reference: bytes = _row("input_reference", "the first frame (fl2va): a data URL here, a file in "
                                                     "multipart; docs/api.md", request=False, media="one")
    first_image: bytes = _row("first_image", "fl2va first keyframe (data URL)", media="one",
                              cli={"help": "fl2va: first keyframe image"})
    last_image: bytes = _row("last_image", "fl2va last keyframe (data URL)", media="one",
                             cli={"help": "fl2va: last keyframe image"})
    image_reference: list = _row("image_reference", "ref2va image reference(s), data URLs", request=False,
                                 media="many", type=["string", "array"])
    audio_reference: list = _row("audio_reference", "ref2va audio reference(s) at 32 kHz", request=False,
                                 media="many", type=["string", "array"])
    video_reference: list = _row("video_reference", "ref2va video reference(s): MP4 / MOV / WebM / MKV, resampled "
                                                    "to 24 fps; a soundtrack (32 kHz) is conditioned on too",
                                 request=False, media="many", type=["string", "array"])
    input_references: list = _row("input_references", "vLLM-Omni: ref2va references in order, each's kind by its "
                                                      "content type (image/*, audio/*, else video)", request=False,
                                  media="many", type=["string", "array"])
    references: list = _row("references", http=None, media="many",
                            cli={"flag": "--reference", "action": "append", "default": [], "metavar": "KIND:PATH",
                                 "help": "ref2va reference, repeatable: image:PATH, video:PATH or audio:PATH"})


REQUEST_FIELDS = dataclasses.fields(RequestFields)
FIELD_TYPES = typing.get_type_hints(RequestFields)   # row -> its Python type
RAW_FIELDS = tuple(row.name for row in REQUEST_FIELDS if row.metadata["request"])
DIT_FIELDS = tuple(row.name for row in REQUEST_FIELDS if row.metadata["dit"])


def dit_fields(request: Any) -> dict[str, Any]:
    """The fields the DiT takes as the request names them (DiTParams, DiTRequest), from a request or DiTParams."""
    return {name: getattr(request, name) for name in DIT_FIELDS}


def lora_params(request: Any) -> dict[str, Any]:
    """The request's LoRA as DiTParams and DiTRequest carry it: `lora` (its name) and `lora_scale`; {} without."""
    return {} if request.lora is None else {"lora": request.lora.name, "lora_scale": request.lora.scale}


def _parse_aspect(aspect: Any, field_name: str) -> float:
    allowed = "an aspect ratio W/H as a number, 'W:H' or (W, H), between 1:4 and 4:1"
    try:
        if isinstance(aspect, str):
            text = aspect.strip().lower()
            for sep in (":", "x", "/"):
                if sep in text:
                    a, b = text.split(sep, 1)
                    ratio = float(a) / float(b)
                    break
            else:
                ratio = float(text)
        elif isinstance(aspect, (tuple, list)) and len(aspect) == 2:
            ratio = float(aspect[0]) / float(aspect[1])
        elif isinstance(aspect, (int, float)) and not isinstance(aspect, bool):
            ratio = float(aspect)
        else:
            raise TypeError
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        raise RequestError(field_name, _brief(aspect), allowed) from None
    if not math.isfinite(ratio) or not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise RequestError(field_name, _brief(aspect), allowed)
    return ratio


def canvas_for_aspect(aspect: Any, *, field_name: str = "aspect") -> Canvas:
    """The generation canvas (`geometry.canvas_for_ratio`) for a display aspect ratio given as W/H, a 'W:H' string
    or a (W, H) pair (e.g. an image's size). 16:9 -> 1344x768, 1:1 -> 768x768, 9:16 -> 768x1344."""
    return canvas_for_ratio(_parse_aspect(aspect, field_name))


# ---------------------------------------------------------------------------------------------------------------
# The request

class Upload:
    """Media given as bytes instead of a path: `field` is the caller's name for it (`input_reference`,
    `audio_reference[0]`, ...), used in every error about it; `filename` is what the caller called the file."""

    __slots__ = ("data", "field", "filename", "sha256")

    def __init__(self, data: bytes, field: str, filename: str = ""):
        self.data = bytes(data)
        self.field = field
        self.filename = filename
        self.sha256 = hashlib.sha256(self.data).hexdigest()

    def open(self) -> io.BytesIO:
        return io.BytesIO(self.data)

    def __repr__(self) -> str:
        return f"<{self.field}: {len(self.data)} bytes{', ' + self.filename if self.filename else ''}>"

    def __deepcopy__(self, memo):  # immutable: dataclasses.asdict keeps it as is
        return self


def media_source(value: "str | Upload"):
    """What a decoder opens: the path, or the upload's bytes as a file object."""
    return value.open() if isinstance(value, Upload) else value


@dataclass(frozen=True)
class ReferenceSpec:
    """One ref2va reference, in the order the model reads it.

    kind: image | video | audio. fps: the frame rate a video carries (None: read it from the file).
    sample_rate: the rate of an audio file or a video's soundtrack (None: read it from the file).
    """
    kind: str
    path: "str | Upload"
    fps: float | None = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request. Build it with `validate_request`; the derived fields are computed here.

    steps counts grid points including the terminal 0 (N points -> N-1 transformer forwards).
    num_frames = 17n+5 >= round(seconds*24); latent_frames = 5n+2; audio_latents = round(F/24*40);
    latent_height/width = H/16, W/16; t_media = num_frames/24 seconds of output media.
    """
    prompt: str
    task: str = "t2va"
    profile: str = "base"
    seconds: float = DEFAULT_SECONDS
    width: int = DEFAULT_CANVAS.width
    height: int = DEFAULT_CANVAS.height
    seed: int = 0
    steps: int = DEFAULT_STEPS["base"]
    fps: int = FPS
    first_image: "str | Upload | None" = None
    last_image: "str | Upload | None" = None
    references: tuple[ReferenceSpec, ...] = ()
    dtype: str = DEFAULT_DTYPE
    quality: str = DEFAULT_QUALITY  # lossless | high (step reuse, profile base): config/levers.py
    preview_every: int = 0  # a preview every k denoising steps (0: none); the deployment bounds the count
    lora: LoraChoice | None = None  # a deployment adapter applied for this request only (config/lora.py)
    # derived
    num_frames: int = field(init=False)
    latent_frames: int = field(init=False)
    audio_latents: int = field(init=False)
    latent_height: int = field(init=False)
    latent_width: int = field(init=False)
    t_media: float = field(init=False)

    def __post_init__(self) -> None:
        num_frames = frames_for_seconds(self.seconds, self.fps)
        derived = dict(
            num_frames=num_frames,
            latent_frames=num_frames_to_latents(num_frames),
            audio_latents=audio_latents_for_frames(num_frames, self.fps),
            latent_height=self.height // VAE_SPATIAL,
            latent_width=self.width // VAE_SPATIAL,
            t_media=num_frames / self.fps,
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "references", tuple(self.references))

    @property
    def num_forwards(self) -> int:
        """Transformer forwards of the denoising loop: steps - 1 (base 50 -> 49, fasth3 5 -> 4)."""
        return self.steps - 1

    @property
    def audio_samples(self) -> int:
        """PCM samples per channel the audio VAE decodes: A * 800 (at 32 kHz)."""
        return self.audio_latents * AUDIO_HOP

    def to_dict(self) -> dict:
        """JSON-ready dict of every field (derived ones included); references as dicts."""
        out = asdict(self)
        out["references"] = [asdict(r) for r in self.references]
        for r in out["references"]:
            r["path"] = repr(r["path"]) if isinstance(r["path"], Upload) else r["path"]
        for key in ("first_image", "last_image"):
            out[key] = repr(out[key]) if isinstance(out[key], Upload) else out[key]
        return out


# ---------------------------------------------------------------------------------------------------------------
# Validation

def _brief(value: Any, limit: int = 60) -> Any:
    """The value as shown in an error: long strings and containers are shortened so the message stays one line."""
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} chars)"
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = repr(value)
    return value if len(text) <= limit and "\n" not in text else f"{text[:limit]}... ({type(value).__name__})"


def _as_int(name: str, value: Any, allowed: str) -> int:
    """An int from an int, an integral float or a decimal string; anything else is a RequestError."""
    if isinstance(value, bool):
        raise RequestError(name, value, allowed)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and (text.isdigit() or (text[:1] in ("+", "-") and text[1:].isdigit())) and len(text) <= 40:
            return int(text)
    raise RequestError(name, _brief(value), allowed)


def _as_float(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool):
        raise RequestError(name, value, allowed)
    try:
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str) and len(value) <= 40:
            text = value.strip().lower()
            out = float(text[:-1] if text.endswith("s") else text)
        else:
            raise TypeError
    except (TypeError, ValueError, OverflowError):
        raise RequestError(name, _brief(value), allowed) from None
    if not math.isfinite(out):
        raise RequestError(name, value, allowed)
    return out


def _choice(name: str, value: Any, choices: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    allowed = "one of " + " | ".join(choices)
    if not isinstance(value, str):
        raise RequestError(name, _brief(value), allowed)
    key = value.strip().lower()
    key = (aliases or {}).get(key, key)
    if key not in choices:
        raise RequestError(name, _brief(value), allowed)
    return key


def _check_upload(name: str, upload: Upload, kind: str) -> Upload:
    cap = MAX_MEDIA_BYTES[kind]
    if not upload.data:
        raise RequestError(upload.field or name, repr(upload), f"a non-empty {kind} file")
    if len(upload.data) > cap:
        raise RequestError(upload.field or name, repr(upload), f"a {kind} file of at most {cap:,} bytes")
    return upload


def _path(name: str, value: Any, what: str) -> "str | Upload":
    """An existing regular file, as a str path, or an upload within the bounds of its kind."""
    if isinstance(value, Upload):
        return _check_upload(name, value, what)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\x00" in value:
        raise RequestError(name, _brief(value), f"a path to an existing {what} file")
    if not os.path.isfile(value):
        raise RequestError(name, _brief(value), f"no such file: a path to an existing {what} file")
    if os.path.getsize(value) > MAX_MEDIA_BYTES[what]:
        raise RequestError(name, _brief(value), f"a {what} file of at most {MAX_MEDIA_BYTES[what]:,} bytes")
    return value


def _check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise RequestError("prompt", _brief(prompt), "a single string (one prompt per request)")
    if not prompt.strip():
        raise RequestError("prompt", prompt, "a non-empty string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError("prompt", _brief(prompt), f"at most {MAX_PROMPT_CHARS:,} characters")
    if "\x00" in prompt:
        raise RequestError("prompt", _brief(prompt), "text without NUL characters")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("prompt", _brief(prompt), "valid Unicode text (no lone surrogates)") from None
    return prompt


def _parse_size(size: Any) -> tuple[int, int]:
    allowed = f"'WxH', e.g. '1344x768' ({CANVAS_RULE})"
    if isinstance(size, (tuple, list)) and len(size) == 2:
        return _as_int("size", size[0], allowed), _as_int("size", size[1], allowed)
    if not isinstance(size, str):
        raise RequestError("size", _brief(size), allowed)
    text = size.strip().lower().replace("\u00d7", "x").replace("*", "x")
    parts = text.split("x")
    if len(parts) != 2:
        raise RequestError("size", _brief(size), allowed)
    return _as_int("size", parts[0], allowed), _as_int("size", parts[1], allowed)


def snap_canvas(width: int, height: int) -> Canvas:
    """A requested WxH on H3's canvas: kept when it is a valid canvas (CANVAS_RULE), else the model's canvas for
    that aspect (`canvas_for_aspect`, the reference's resolve_canvas_size): OpenAI's 1280x720 -> 1344x768,
    720x1280 -> 768x1344, 1792x1024 -> 1344x768, 1024x1792 -> 768x1344. An aspect outside 1:4..4:1 raises
    RequestError naming `size`."""
    try:
        check_canvas(width, height)
        return Canvas(width, height)
    except RequestError:
        pass
    if width <= 0 or height <= 0:
        raise RequestError("size", f"{width}x{height}", "positive sides")
    return canvas_for_aspect((width, height), field_name="size")


def jpeg_header_segments(data: bytes, limit: int) -> int:
    """The marker segments of a JPEG before its first scan (SOS), counted up to `limit` + 1 (a camera's file has a
    few dozen: APPn metadata, quantisation and Huffman tables, the frame header)."""
    i, n, end = 2, 0, len(data)
    while i + 4 <= end and n <= limit:
        if data[i] != 0xFF:
            break                      # not a marker: Pillow says what is wrong
        marker = data[i + 1]
        if marker == 0xFF:             # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:   # markers without a length
            i += 2
            continue
        if marker in (0xDA, 0xD9):     # the first scan, or the end
            break
        n += 1
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return n


def _image_size(name: str, path: "str | Upload") -> tuple[int, int]:
    """The image's size from its header (the pixels are not decoded), within the pixel bounds."""
    name = path.field if isinstance(path, Upload) else name
    shown = repr(path) if isinstance(path, Upload) else _brief(path)
    if isinstance(path, Upload) and path.data.startswith(b"\xff\xd8"):
        segments = jpeg_header_segments(path.data, MAX_JPEG_SEGMENTS)
        if segments > MAX_JPEG_SEGMENTS:   # Pillow parses each one in Python: hundreds of thousands take seconds
            raise RequestError(name, f"{shown}: more than {MAX_JPEG_SEGMENTS:,} header segments",
                               f"a JPEG with at most {MAX_JPEG_SEGMENTS:,} segments before its image data")
    try:
        with Image.open(media_source(path)) as image:  # header only: Image.open does not decode the pixels
            width, height = image.size
    except Exception:  # noqa: BLE001 - any decoder failure means "not an image we can read"
        raise RequestError(name, shown, "a readable image file (PNG, JPEG, WebP, ...)") from None
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE:
        raise RequestError(name, f"{width}x{height}", f"an image with sides of at least {MIN_IMAGE_SIDE} pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestError(name, f"{width}x{height}", f"an image of at most {MAX_IMAGE_PIXELS:,} pixels "
                                                      f"(4096x4096); got {width * height:,}")
    return width, height


def _reference(index: int, item: Any) -> ReferenceSpec:
    name = "references"
    where = f"references[{index}]"
    if isinstance(item, ReferenceSpec):
        kind, path, fps, sample_rate = item.kind, item.path, item.fps, item.sample_rate
    elif isinstance(item, Mapping):
        unknown = set(item) - {"kind", "path", "fps", "sample_rate"}
        if unknown:
            raise RequestError(name, _brief(dict(item)),
                               f"{where}: unknown keys {sorted(map(str, unknown))}; "
                               "allowed kind, path, fps, sample_rate")
        kind, path = item.get("kind"), item.get("path")
        fps, sample_rate = item.get("fps"), item.get("sample_rate")
    elif isinstance(item, Upload):
        kind, path, fps, sample_rate = None, item, None, None
    elif isinstance(item, (str, os.PathLike)):
        text = os.fspath(item)
        kind = None
        if isinstance(text, str):
            head, sep, tail = text.partition(":")
            if sep and head.lower() in REFERENCE_KINDS:
                kind, text = head.lower(), tail
        path, fps, sample_rate = text, None, None
    else:
        raise RequestError(name, _brief(item), f"{where}: a path, 'kind:path' or {{kind, path, fps, sample_rate}}")
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, Upload):
        name = where = path.field
        if kind is None:
            kind = _EXTENSION_KIND.get(os.path.splitext(path.filename)[1].lower())
            if kind is None:
                raise RequestError(name, repr(path), "kind must be given (image | video | audio); the file name "
                                                     "does not say")
    elif not isinstance(path, str) or not path or "\x00" in path:
        raise RequestError(name, _brief(item), f"{where}: a path to an existing media file")
    if kind is None:
        kind = _EXTENSION_KIND.get(os.path.splitext(path)[1].lower())
        if kind is None:
            raise RequestError(name, _brief(path),
                               f"{where}: kind must be given (image | video | audio); the extension does not say")
    if not isinstance(kind, str) or kind.lower() not in REFERENCE_KINDS:
        raise RequestError(name, _brief(kind), f"{where}: kind must be one of image | video | audio")
    kind = kind.lower()
    if isinstance(path, Upload):
        _check_upload(name, path, kind)
    elif not os.path.isfile(path):
        raise RequestError(name, _brief(path), f"{where}: no such file; a path to an existing {kind} file")
    elif os.path.getsize(path) > MAX_MEDIA_BYTES[kind]:
        raise RequestError(name, _brief(path), f"{where}: a {kind} file of at most {MAX_MEDIA_BYTES[kind]:,} bytes")
    if kind == "image":
        _image_size(where, path)
    if fps is not None:
        if kind != "video":
            raise RequestError(name, _brief(item), f"{where}: fps is only for video references")
        fps = _as_float(name, fps, f"{where}: fps a number in (0, 240]")
        if not 0 < fps <= 240:
            raise RequestError(name, fps, f"{where}: fps a number in (0, 240]")
    if sample_rate is not None:
        if kind == "image":
            raise RequestError(name, _brief(item), f"{where}: sample_rate is only for audio or video references")
        sample_rate = _as_int(name, sample_rate, f"{where}: sample_rate an integer in [8000, 192000]")
        if not 8000 <= sample_rate <= 192000:
            raise RequestError(name, sample_rate, f"{where}: sample_rate an integer in [8000, 192000]")
    return ReferenceSpec(kind=kind, path=path, fps=fps, sample_rate=sample_rate)


def _check_references(references: Any) -> tuple[ReferenceSpec, ...]:
    allowed = f"a list of 1..{MAX_REFERENCES} references (at most 9 images, 3 videos, 3 audio; not audio only)"
    if isinstance(references, (str, bytes, os.PathLike, Mapping, ReferenceSpec, Upload)) \
            or not isinstance(references, (list, tuple)):
        raise RequestError("references", _brief(references), allowed)
    if not 1 <= len(references) <= MAX_REFERENCES:
        raise RequestError("references", f"{len(references)} references", allowed)
    specs = tuple(_reference(i, item) for i, item in enumerate(references))
    for kind, cap in MAX_REFERENCES_PER_KIND.items():
        count = sum(spec.kind == kind for spec in specs)
        if count > cap:
            raise RequestError("references", f"{count} {kind} references", allowed)
    if all(spec.kind == "audio" for spec in specs):
        raise RequestError("references", f"{len(specs)} audio references",
                           "audio references need at least one image or video reference beside them")
    return specs


def validate_request(**raw: Any) -> GenerationRequest:
    """Validate raw request fields and return a `GenerationRequest`; raise `RequestError` on the first bad field.

    Accepted fields (None means "not given"):
      prompt (str, required), task (t2va | fl2va | ref2va; inferred from references / images when absent),
      profile (base | fasth3), seconds (4.5..14.375 requested: 124..345 frames after rounding, the
      reference's 5..15 s; or num_frames: requested frames at 24 fps, 108..345),
      width / height (ints) or size ('WxH') or aspect ('16:9', W/H, (W, H)), seed (0..2**63-1; drawn at random
      when absent), steps (grid points incl. terminal 0; base 2..1000, default 50; fasth3 only 5),
      fps (24 only), first_image / last_image (fl2va), references (ref2va), dtype (fp32 | bf16),
      quality (lossless | high: step reuse, profile base only), lora (a deployment adapter's name or
      {name, scale}, profile base only; its steps are applied where the deployment's list is known:
      config/lora.py `lora_steps`).

    Canvas: explicit sizes follow CANVAS_RULE (multiples of 32 within [32, 8192], area <= 1,032,192, the canvas
    max; no aspect bound, as the reference). With neither side given, the canvas is canvas_for_aspect(aspect),
    where aspect is the `aspect` field, else the first keyframe's (fl2va), else 16:9. With one side given, the
    other follows that aspect, rounded to the nearest multiple of 32 (down if the nearest would exceed the area
    cap), and the pair is checked like an explicit size.
    """
    unknown = sorted(str(k) for k in raw if k not in RAW_FIELDS)
    if unknown:
        raise RequestError(unknown[0], _brief(raw[unknown[0]]), "unknown field; allowed: " + ", ".join(RAW_FIELDS))
    get = lambda key: raw.get(key)  # noqa: E731

    prompt = _check_prompt(get("prompt"))

    profile = "base" if get("profile") is None else _choice("profile", get("profile"), PROFILES)

    # task: explicit, else inferred like the reference's workflow triggers
    has_images = get("first_image") is not None or get("last_image") is not None
    if get("task") is not None:
        task = _choice("task", get("task"), TASKS)
    else:
        task = "ref2va" if get("references") is not None else "fl2va" if has_images else "t2va"
    if profile == "fasth3" and task != "t2va":
        raise RequestError("task", task, "profile fasth3 serves t2va only; use profile base for fl2va / ref2va")
    quality = DEFAULT_QUALITY if get("quality") is None else _choice("quality", get("quality"), QUALITIES)
    conflict = lever_conflict(profile, quality=quality, names=REQUEST_NAMES)
    if conflict is not None:
        raise RequestError("quality", quality, conflict)
    lora = lora_choice(get("lora"))
    if lora is not None and profile == "fasth3":
        raise RequestError("lora", lora.name, "profile fasth3 runs its own fused 4-step adapter; per-request LoRA "
                                              "is served by profile base (model MiniMax-H3)")
    if lora is not None and task not in LORA_TASKS:
        raise RequestError("lora", lora.name, REF2VA_REFUSAL)

    preview_every = 0 if get("preview_every") is None else _as_int(
        "preview_every", get("preview_every"), "an integer >= 0 (denoising steps between previews; 0: none)")
    if preview_every < 0:
        raise RequestError("preview_every", preview_every, "an integer >= 0 (denoising steps between previews; 0: none)")

    # duration: the reference's bounds, on the frame count after rounding up to 17n+5 (as it checks them)
    (lo, hi), (alo, ahi) = REQUESTED_FRAMES, FRAMES_RANGE
    duration_rule = (f"a duration whose frame count, raised to the next 17n+5 at {FPS} fps, lies in "
                     f"[{MIN_DURATION * FPS:g}, {MAX_DURATION * FPS:g}] ({MIN_DURATION:g}..{MAX_DURATION:g} s): "
                     f"{lo}..{hi} requested frames ({lo / FPS:g}..{hi / FPS:g} s) -> {alo}..{ahi} frames")
    if get("seconds") is not None and get("num_frames") is not None:
        raise RequestError("num_frames", get("num_frames"), "give seconds or num_frames, not both")
    if get("num_frames") is not None:
        name = "num_frames"
        frames = _as_int(name, get(name), f"an integer number of frames at {FPS} fps, {duration_rule}")
        seconds = frames / FPS
    else:
        name = "seconds"
        seconds = DEFAULT_SECONDS if get(name) is None else _as_float(name, get(name), duration_rule)
    aligned = frames_for_seconds(seconds)
    if not within_reference_duration(aligned):
        raise RequestError(name, get(name), f"{duration_rule}; got {aligned} frames")

    fps = FPS if get("fps") is None else _as_int("fps", get("fps"), "24 (the model's only frame rate)")
    if fps != FPS:
        raise RequestError("fps", get("fps"), "24 (the model's only frame rate)")

    # seed
    if get("seed") is None:
        seed = secrets.randbelow(MAX_SEED + 1)
    else:
        seed = _as_int("seed", get("seed"), "an integer in [0, 2**63-1]")
        if not 0 <= seed <= MAX_SEED:
            raise RequestError("seed", seed, "an integer in [0, 2**63-1]")

    # steps
    if profile == "fasth3":
        if get("steps") is not None:
            steps = _as_int("steps", get("steps"), "profile fasth3 runs a fixed 5-point grid (4 forwards): 5 or unset")
            if steps != FASTH3_STEPS:
                raise RequestError("steps", get("steps"),
                                   "profile fasth3 runs a fixed 5-point grid (4 forwards): 5 or unset")
        steps = FASTH3_STEPS
    else:
        lo, hi = BASE_STEPS_RANGE
        allowed = f"grid points incl. the terminal 0 (N points -> N-1 forwards), an integer in [{lo}, {hi}]"
        steps = DEFAULT_STEPS["base"] if get("steps") is None else _as_int("steps", get("steps"), allowed)
        if not lo <= steps <= hi:
            raise RequestError("steps", steps, allowed)

    dtype = DEFAULT_DTYPE if get("dtype") is None else _choice("dtype", get("dtype"), DTYPES, _DTYPE_ALIASES)

    # conditioning inputs
    first_image = last_image = None
    references: tuple[ReferenceSpec, ...] = ()
    if task == "fl2va":
        if not has_images:
            raise RequestError("first_image", None, "task fl2va needs first_image and/or last_image")
        if get("first_image") is not None:
            first_image = _path("first_image", get("first_image"), "image")
            _image_size("first_image", first_image)
        if get("last_image") is not None:
            last_image = _path("last_image", get("last_image"), "image")
            _image_size("last_image", last_image)
    else:
        for name in ("first_image", "last_image"):
            if get(name) is not None:
                raise RequestError(name, _brief(get(name)), f"keyframes are for task fl2va only (task is {task})")
    if task == "ref2va":
        if get("references") is None:
            raise RequestError("references", None, "task ref2va needs 1..12 references")
        references = _check_references(get("references"))
    elif get("references") is not None:
        raise RequestError("references", _brief(get("references")),
                           f"references are for task ref2va only (task is {task})")

    # canvas
    width, height = get("width"), get("height")
    if get("size") is not None:
        if width is not None or height is not None:
            raise RequestError("size", _brief(get("size")), "give size or width/height, not both")
        width, height = _parse_size(get("size"))
        source = "size"
    else:
        source = None
        side_allowed = f"an integer multiple of {CANVAS_MULTIPLE} within [{MIN_SIDE}, {MAX_SIDE}] ({CANVAS_RULE})"
        width = None if width is None else _as_int("width", width, side_allowed)
        height = None if height is None else _as_int("height", height, side_allowed)
    if width is None or height is None:
        if get("aspect") is not None:
            aspect, aspect_field = get("aspect"), "aspect"
        elif first_image or last_image:
            aspect_field = "first_image" if first_image else "last_image"
            aspect = _image_size(aspect_field, first_image or last_image)
        else:
            aspect, aspect_field = (16, 9), "aspect"
        ratio = _parse_aspect(aspect, aspect_field)
        if width is None and height is None:
            width, height = canvas_for_aspect(aspect, field_name=aspect_field)
            source = "derived"
        elif width is None:
            width, source = other_side(height, height * ratio), "height"
        else:
            height, source = other_side(width, width / ratio), "width"
    elif get("aspect") is not None:
        raise RequestError("aspect", _brief(get("aspect")), "give aspect or both width and height, not both")
    if source != "derived":
        # A derived canvas follows the reference rule exactly; its rounding may exceed the area cap by a few percent.
        check_canvas(width, height, source)

    return GenerationRequest(prompt=prompt, task=task, profile=profile, seconds=seconds, width=width, height=height,
                             seed=seed, steps=steps, fps=fps, first_image=first_image, last_image=last_image,
                             references=references, dtype=dtype, quality=quality, preview_every=preview_every,
                             lora=lora)
