"""Request fields as the callers spell them (the gRPC GenerateRequest, the videos API's JSON or form body) mapped
onto the one request validator, `h3serve.config.request.validate_request`.

Every refusal is a `RequestError` naming the caller's field (`num_inference_steps`, `extra_params.task`, ...), never
the validator's internal name, and a value of the wrong JSON type is refused the same way, never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from h3serve._proto import gateway_pb2
from h3serve.config.request import (
    FASTH3_STEPS,
    FIELD_TYPES,
    REQUEST_FIELDS,
    GenerationRequest,
    Upload,
    snap_canvas,
    validate_request,
)
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import TASKS
from h3serve.errors import RequestError

from .uploads import Conditions, decode_conditions, from_data_url

# model ids a deployment accepts per profile; the first is the one it reports
MODEL_IDS = {"base": ("MiniMax-H3", "h3", "base"), "fasth3": ("FastH3", "fasth3")}
REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# The gateway's fields, from the request's field table (config/request.py) and gRPC's GenerateRequest.
_PROTO = gateway_pb2.GenerateRequest.DESCRIPTOR.fields
_PROTO_NAMES = {fd.name for fd in _PROTO}
_HTTP = [row for row in REQUEST_FIELDS if row.metadata["http"] is not None]
# caller's name -> the request field it feeds, for every request field of the videos API or GenerateRequest
API_FIELDS = {row.metadata["json"]: row.name for row in REQUEST_FIELDS if row.metadata["request"]
              and (row.metadata["http"] is not None or row.metadata["json"] in _PROTO_NAMES)}
TYPES = {row.metadata["json"]: FIELD_TYPES[row.name] for row in REQUEST_FIELDS}   # caller's name -> type
MAX_LENGTH = {row.metadata["json"]: row.metadata["schema"]["maxLength"] for row in REQUEST_FIELDS
              if "maxLength" in row.metadata["schema"]}
NUMERIC_FIELDS = tuple(name for name, tp in TYPES.items() if tp in (int, float))
# GenerateRequest's optional scalars that are request fields, and its files (prompt and the references are read
# by name; request_id and validate_only are the call's, not the request's)
PROTO_FIELDS = tuple(fd.name for fd in _PROTO if fd.has_presence and fd.type != fd.TYPE_BYTES and fd.name in TYPES)
PROTO_FILES = tuple(fd.name for fd in _PROTO if fd.has_presence and fd.type == fd.TYPE_BYTES)

# The videos API (HTTP): top-level fields, fields refused with the reason, and extra_params.
# Media fields (a file upload, a data URL, or a list of them where repeatable): input_reference is OpenAI's (the
# first frame: fl2va; an image reference when the task is ref2va); the *_reference fields are vLLM-Omni's (ref2va,
# in the order given); first_image / last_image are H3's keyframes (fl2va).
MEDIA_FIELDS = tuple(row.metadata["json"] for row in _HTTP if row.metadata["media"])
REPEATABLE = tuple(row.metadata["json"] for row in _HTTP if row.metadata["media"] == "many")
# what the videos API calls a missing keyframe / missing references (errors name these)
HTTP_NAMES = {"first_image": "input_reference", "references": "image_reference"}
REFERENCE_KIND = {"image_reference": "image", "audio_reference": "audio", "video_reference": "video"}
VIDEO_PARAMS = ("width", "height", "num_frames", "fps")   # vLLM-Omni's video_params block
# Fields other APIs define whose only value H3 can honour is the one it always runs (anything else is refused).
FIXED = {"guidance_scale": (1.0, "H3 is guidance-distilled (one forward per step, no CFG): only 1.0"),
         "generate_sound": (True, "H3 always generates the soundtrack with the video: only true"),
         "enable_frame_interpolation": (False, "the MP4 holds the model's 24 fps frames: only false")}
TOP_LEVEL = (*(row.metadata["json"] for row in _HTTP if not row.metadata["media"]), *FIXED, *MEDIA_FIELDS)
GUIDANCE_FREE = "H3 is guidance-distilled (no negative branch, no CFG)"
UNSUPPORTED = {
    "negative_prompt": f"{GUIDANCE_FREE}, so a negative prompt has nothing to steer",
    "true_cfg_scale": GUIDANCE_FREE,
    "guidance_scale_2": GUIDANCE_FREE,
    "boundary_ratio": "H3 has one DiT (no high/low-noise split)",
    "flow_shift": "the flow shift is the checkpoint's (scheduler/ config; 12 video / 3 audio released), part of the trained schedule",
    "sound_duration": "the soundtrack always spans the video (A = round(F / 24 * 40) latents)",
    "frame_interpolation_exp": "no frame interpolation: the MP4 holds the model's 24 fps frames",
    "frame_interpolation_scale": "no frame interpolation: the MP4 holds the model's 24 fps frames",
    "frame_interpolation_model_path": "no frame interpolation: the MP4 holds the model's 24 fps frames",
    "lora": "per-request LoRA is not supported (FastH3's adapter is fused at load; see profile fasth3)",
    "input_references": "give one input_reference (the first frame), or image_reference / audio_reference for "
                        "ref2va",
}
EXTRA_PARAMS = ("task", "duration")
EXTRA_UNSUPPORTED = {"audio_flow_shift": "the audio flow shift is the checkpoint's"}


@dataclass(frozen=True)
class Validated:
    """A caller's fields validated into the request this deployment runs."""

    request: GenerationRequest
    names: dict[str, str]        # request field -> the caller's field name
    model: str                   # the model id reported back
    conditions: Conditions | None = None   # fl2va / ref2va: the decoded keyframes / references
    requested_size: str | None = None      # the caller's size when it was mapped onto H3's canvas
    user: str | None = None                # OpenAI's end-user id, reported on the job


def short(value: Any) -> Any:
    """A value as an error quotes it: itself, or its repr cut at 60 characters."""
    text = repr(value)
    return value if len(text) <= 60 else text[:60] + "..."


def served_models(config: StageConfig) -> tuple[str, ...]:
    """The model ids the deployment's own profile answers to in `model`; the first is the one it reports."""
    served = MODEL_IDS.get(config.model.profile, (config.model.profile,))
    return (config.gateway.model_name, *served) if config.gateway.model_name else served


def served_pools(config: StageConfig) -> dict[str, tuple[str, ...]]:
    """profile -> its model ids, for every pool behind this gateway: the deployment's profile, and a FastH3 DiT
    pool when one is configured (`--fasth3-dit`) beside a base deployment. The first pool is the default."""
    pools = {config.model.profile: served_models(config)}
    if config.gateway.fasth3_dit and config.model.profile != "fasth3":
        pools["fasth3"] = MODEL_IDS["fasth3"]
    return pools


def _pool(config: StageConfig, model: Any) -> tuple[str, str]:
    """(profile, reported model id) of the pool a request's `model` names (None: the default pool)."""
    pools = served_pools(config)
    if model is None:
        profile = next(iter(pools))
        return profile, pools[profile][0]
    for profile, ids in pools.items():
        if model in ids:
            return profile, ids[0]
    listed = ", ".join(f"{ids[0]!r} (profile {p})" for p, ids in pools.items())
    raise RequestError("model", short(model), f"this deployment serves {listed}")


def fields_from_proto(msg) -> dict[str, Any]:
    """The request fields a gRPC GenerateRequest sets (unset optional fields are left out)."""
    out = {"prompt": msg.prompt}
    for name in PROTO_FIELDS:
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    for name in PROTO_FILES:
        if msg.HasField(name):
            out[name] = Upload(getattr(msg, name), name)
    if msg.references:
        out["references"] = [{"kind": r.kind or None, "path": Upload(r.data, f"references[{i}]", r.filename)}
                             for i, r in enumerate(msg.references)]
    return out


def _uploads(key: str, value: Any) -> list[Upload]:
    """A media field's value (an Upload, a data URL, or a list of them where repeatable) as Uploads named after the
    caller's field (`image_reference[1]` for the second of a list)."""
    items = value if isinstance(value, list) else [value]
    if len(items) > 1 and key not in REPEATABLE:
        raise RequestError(key, f"{len(items)} files", "one file")
    out = []
    for i, item in enumerate(items):
        name = f"{key}[{i}]" if isinstance(value, list) and key in REPEATABLE else key
        if isinstance(item, Upload):
            out.append(Upload(item.data, name, item.filename))
        else:
            out.append(from_data_url(name, item))
    return out


def _media(fields: dict[str, Any], media: list[tuple[str, Any]], task: Any) -> None:
    """The media fields, in the order given, into first_image / last_image / references."""
    references = []
    ref2va = isinstance(task, str) and task.strip().lower() == "ref2va"
    for key, value in media:
        uploads = _uploads(key, value)
        if key in REFERENCE_KIND or (key == "input_reference" and ref2va):
            kind = REFERENCE_KIND.get(key, "image")
            references += [{"kind": kind, "path": u} for u in uploads]
        else:
            name = "first_image" if key == "input_reference" else key
            if name in fields:
                raise RequestError(key, repr(uploads[0]), "input_reference is the first frame; give it or "
                                                          "first_image, not both")
            fields[name] = uploads[0]
    if references:
        fields["references"] = references


def fields_from_http(body: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A videos-API body (decoded JSON or form) -> (fields, request field -> the caller's field name where it is
    not the API name: `extra_params.task`, `extra_params.duration`)."""
    if not isinstance(body, dict):
        raise RequestError("body", short(body), "a JSON object of request fields")
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}
    media: list[tuple[str, Any]] = []
    for key, value in body.items():
        if not isinstance(key, str) or not key:
            raise RequestError("body", short(key), "non-empty string field names")
        if key in UNSUPPORTED:
            if value is None or value == "" or value == []:
                continue
            raise RequestError(key, short(value), "not supported: " + UNSUPPORTED[key])
        if key not in TOP_LEVEL:
            raise RequestError(key, short(value), "unknown field; allowed: " + ", ".join(TOP_LEVEL))
        if key in MEDIA_FIELDS:
            if value is not None and value != "" and value != []:
                media.append((key, value))
        elif key in FIXED:
            _fixed(key, value)
        elif key == "user":
            if value is not None and (not isinstance(value, str) or len(value) > 256):
                raise RequestError(key, short(value), "a string of at most 256 characters (recorded on the job)")
            fields["user"] = value
        elif key == "video_params":
            _video_params(fields, names, value)
        elif key != "extra_params" and value is not None:
            if key in fields:
                raise RequestError(key, short(value), f"given both as {key} and video_params.{key}")
            fields[key] = value
    extra = body.get("extra_params")
    if isinstance(extra, str):   # a form field carries the object as JSON text
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except ValueError:
            raise RequestError("extra_params", short(extra), "a JSON object") from None
    if extra is not None:
        if not isinstance(extra, dict):
            raise RequestError("extra_params", short(extra), "a JSON object")
        for key, value in extra.items():
            name = f"extra_params.{key}"
            if key in EXTRA_UNSUPPORTED:
                raise RequestError(name, short(value), "not supported: " + EXTRA_UNSUPPORTED[key])
            if key not in EXTRA_PARAMS:
                raise RequestError(name, short(value), "unknown; allowed: " + ", ".join(EXTRA_PARAMS))
            if value is None:
                continue
            if key == "task":
                fields["task"], names["task"] = value, name
            elif key == "duration":
                if "seconds" in fields:
                    raise RequestError(name, short(value), "give seconds or extra_params.duration, not both")
                fields["seconds"], names["seconds"] = value, name
    _media(fields, media, fields.get("task"))
    return fields, names


def _fixed(key: str, value: Any) -> None:
    """A field whose only honoured value is the one H3 always runs (a form sends it as text)."""
    want, reason = FIXED[key]
    if value is None:
        return
    text = value.strip().lower() if isinstance(value, str) else value
    if isinstance(want, bool):
        ok = text is want or text == str(want).lower()
    else:
        try:
            ok = not isinstance(text, bool) and float(text) == want
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise RequestError(key, short(value), "not supported: " + reason)


def _video_params(fields: dict[str, Any], names: dict[str, str], value: Any) -> None:
    if isinstance(value, str):   # a form field carries the object as JSON text
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise RequestError("video_params", short(value), "a JSON object") from None
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError("video_params", short(value), "a JSON object of " + ", ".join(VIDEO_PARAMS))
    for key, v in value.items():
        if key not in VIDEO_PARAMS:
            raise RequestError(f"video_params.{key}", short(v), "unknown; allowed: " + ", ".join(VIDEO_PARAMS))
        if v is None:
            continue
        if key in fields:
            raise RequestError(f"video_params.{key}", short(v), f"given both as {key} and video_params.{key}")
        fields[key] = v
        names[API_FIELDS[key]] = f"video_params.{key}"


def check_types(fields: dict[str, Any]) -> None:
    """JSON-level type checks, so that a wrong type is a RequestError naming the field, never a crash."""
    for name, value in fields.items():
        if value is None:
            continue
        tp = TYPES.get(name)
        if tp is str and not isinstance(value, str):
            limit = MAX_LENGTH.get(name)
            raise RequestError(name, short(value), f"a string of 1..{limit:,} characters" if limit else "a string")
        if name in NUMERIC_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
            raise RequestError(name, short(value), "a number")


def check_request_id(request_id: str | None) -> None:
    if request_id is not None and not REQUEST_ID.match(request_id):
        raise RequestError("request_id", short(request_id), "1..64 of letters, digits, '.', '_', '-'")


def validate_fields(fields: dict[str, Any], *, config: StageConfig,
                    names: dict[str, str] | None = None, http: bool = False) -> Validated:
    """Validate the caller's fields (API names) into a GenerationRequest for this deployment.

    `names` maps request fields to the caller's spelling when it differs from API_FIELDS (e.g. task given as
    extra_params.task). Raises RequestError naming the caller's field."""
    api_names = {internal: api for api, internal in API_FIELDS.items()}
    api_names["profile"] = "model"   # the profile is the deployment's; a caller names it through `model`
    if http:
        api_names.update(HTTP_NAMES)
    api_names.update(names or {})
    try:
        check_types(fields)
    except RequestError as exc:   # named as the caller spelled it (extra_params.task, video_params.width)
        raise _renamed(exc, {f: api_names.get(API_FIELDS.get(f, f), f) for f in fields}) from None
    profile, model_id = _pool(config, fields.get("model"))
    served_tasks = config.model.tasks_for(profile)
    not_served = f"{model_id} serves {' | '.join(served_tasks)} (profile {profile}; the server's --tasks)"
    task = fields.get("task")
    if isinstance(task, str) and task.strip().lower() in TASKS and task.strip().lower() not in served_tasks:
        raise RequestError(api_names.get("task", "task"), task, not_served)
    raw = {internal: fields[api] for api, internal in API_FIELDS.items()
           if api in fields and fields[api] is not None}
    requested = _snap_size(raw) if http else None
    if (profile == "fasth3" and http and "steps" in raw
            and str(raw["steps"]).strip() == str(FASTH3_STEPS - 1)):
        raw["steps"] = FASTH3_STEPS   # vLLM-Omni counts FastH3's 4 denoising steps; here 5 grid points
    raw["profile"] = profile
    raw["dtype"] = config.model.dtype
    if "prompt" not in raw:
        raise RequestError("prompt", None, "a prompt is required")
    try:
        req = validate_request(**raw)
    except RequestError as exc:
        raise _renamed(exc, api_names) from None
    if req.task not in served_tasks:
        raise RequestError(api_names.get("task", "task"), req.task, not_served)
    return Validated(req, api_names, model_id, decode_conditions(req), requested, fields.get("user"))


def without_media(v: Validated) -> Validated:
    """The same validated request with its uploads and decoded conditions dropped (labels kept), so that a finished
    job kept for its TTL holds no media bytes."""
    if v.conditions is None:
        return v
    label = lambda x: repr(x) if isinstance(x, Upload) else x  # noqa: E731
    r = v.request
    refs = tuple(dataclasses.replace(spec, path=label(spec.path)) for spec in r.references)
    request = dataclasses.replace(r, first_image=label(r.first_image), last_image=label(r.last_image),
                                  references=refs)
    return dataclasses.replace(v, request=request, conditions=None)


def _snap_size(raw: dict[str, Any]) -> str | None:
    """OpenAI / vLLM-Omni sizes off H3's grid mapped onto its canvas (`snap_canvas`); returns the size asked for
    when it changed."""
    size = raw.get("size")
    if not isinstance(size, str):
        return None
    parts = size.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) <= 5 for p in parts):
        return None   # the validator names what is wrong
    width, height = int(parts[0]), int(parts[1])
    canvas = snap_canvas(width, height)
    if (canvas.width, canvas.height) == (width, height):
        return None
    raw["size"] = f"{canvas.width}x{canvas.height}"
    return f"{width}x{height}"


def _renamed(exc: RequestError, names: dict[str, str]) -> RequestError:
    """The same error, naming the field as the caller spelled it (num_inference_steps, extra_params.task, ...)."""
    api = names.get(exc.field, exc.field)
    return exc if api == exc.field else RequestError(api, exc.value, exc.allowed)
