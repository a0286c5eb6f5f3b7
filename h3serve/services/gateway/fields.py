"""Request fields as the callers spell them (the gRPC GenerateRequest, the videos API's JSON or form body) mapped
onto the one request validator, `h3serve.config.request.validate_request`.

Every refusal is a `RequestError` naming the caller's field (`num_inference_steps`, `extra_params.task`, ...), never
the validator's internal name, and a value of the wrong JSON type is refused the same way, never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from h3serve._proto import gateway_pb2
from h3serve.config.lora import find_lora, lora_choice, lora_steps, parse_loras
from h3serve.config.request import (
    FASTH3_STEPS,
    FIELD_TYPES,
    MAX_OUTPUTS,
    MAX_SEED,
    REQUEST_FIELDS,
    GenerationRequest,
    Upload,
    canvas_for_aspect,
    reference_kind,
    snap_canvas,
    validate_request,
)
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import TASKS
from h3serve.errors import H3Error, RequestError
from h3serve.models.checkpoint import flow_shifts
from h3serve.models.dit.scheduler import FlowShifts
from h3serve.weights.folder import CheckpointFolder

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
PROTO_FIELDS = tuple(fd.name for fd in _PROTO if fd.has_presence and fd.type not in (fd.TYPE_BYTES, fd.TYPE_MESSAGE)
                     and fd.name in TYPES)
PROTO_FILES = tuple(fd.name for fd in _PROTO if fd.has_presence and fd.type == fd.TYPE_BYTES)

# The videos API (HTTP): top-level fields, fields refused with the reason, and extra_params.
# Media fields (a file upload, a data URL, or a list of them where repeatable): input_reference is OpenAI's (the
# first frame: fl2va; an image reference when the task is ref2va); the *_reference fields and input_references are
# vLLM-Omni's (ref2va, in the order given; with task fl2va a [first, last] list is the two keyframes); first_image /
# last_image are H3's keyframes (fl2va); SGLang's `conditions` carry the same media by role.
MEDIA_FIELDS = tuple(row.metadata["json"] for row in _HTTP if row.metadata["media"])
REPEATABLE = tuple(row.metadata["json"] for row in _HTTP if row.metadata["media"] == "many")
# what the videos API calls a missing keyframe / missing references (errors name these)
HTTP_NAMES = {"first_image": "input_reference", "references": "image_reference", "aspect": "aspect_ratio"}
REFERENCE_KIND = {"image_reference": "image", "audio_reference": "audio", "video_reference": "video"}
VIDEO_PARAMS = ("width", "height", "num_frames", "fps")   # vLLM-Omni's video_params block
NO_INTERPOLATION = "no frame interpolation: the MP4 holds the model's 24 fps frames"
# Fields other APIs define whose only value H3 can honour is the one it always runs (anything else is refused),
# each with the values accepted: vLLM-Omni's client sends its defaults unasked (model_dump(exclude_none=True)).
FIXED = {"guidance_scale": ((1.0,), "H3 is guidance-distilled (one forward per step, no CFG): only 1.0"),
         # vLLM-Omni's default false ("no audio requested") is accepted: H3 generates the soundtrack in the same
         # forwards as the video, and the MP4 always carries it
         "generate_sound": ((True, False), "a boolean (the MP4 always carries H3's soundtrack)"),
         "enable_frame_interpolation": ((False,), NO_INTERPOLATION + ": only false"),
         "frame_interpolation_exp": ((1,), NO_INTERPOLATION + ": only vLLM-Omni's default 1 (interpolation off)"),
         "frame_interpolation_scale": ((1.0,), NO_INTERPOLATION + ": only vLLM-Omni's default 1.0"),
         "start_time_seconds": ((0.0,), "the clip is generated from its start: only 0"),
         # the job object always reports stage_durations and peak_memory_mb, asked or not
         "return_stage_metrics": ((True, False), "a boolean (stage metrics are always on the job)")}
TOP_LEVEL = (*(row.metadata["json"] for row in _HTTP if not row.metadata["media"]), *FIXED, *MEDIA_FIELDS)
GUIDANCE_FREE = "H3 is guidance-distilled (no negative branch, no CFG)"
UNSUPPORTED = {
    "negative_prompt": f"{GUIDANCE_FREE}, so a negative prompt has nothing to steer",
    "true_cfg_scale": GUIDANCE_FREE,
    "guidance_scale_2": GUIDANCE_FREE,
    "boundary_ratio": "H3 has one DiT (no high/low-noise split)",
    "sound_duration": "the soundtrack always spans the video (A = round(F / 24 * 40) latents)",
    "frame_interpolation_model_path": NO_INTERPOLATION,
    "timeline_guides": "timeline guides are not served: H3 here conditions on keyframes (fl2va) and references "
                       "(ref2va) only",
    "guide_files": "timeline guides are not served: H3 here conditions on keyframes (fl2va) and references "
                   "(ref2va) only",
    "control_reference": "no control (transfer) path: H3 generates from a prompt, keyframes and references",
    "control_type": "no control (transfer) path: H3 generates from a prompt, keyframes and references",
}
# extra_params' members: the extra_params row's properties (config/request.py)
EXTRA_PARAMS = tuple(next(row for row in REQUEST_FIELDS if row.name == "extra_params").metadata["schema"]["properties"])
CONDITION_KEYS = ("type", "uri", "role", "frame_index", "start_time_seconds")
CONDITION_TYPES = {"image": "image", "audio": "audio", "video": "video", "video_audio": "video"}
# SGLang's target member -> (the field it gives, the request field an error about it names)
TARGET_KEYS = {"short_edge": ("short_edge", "short_edge"), "aspect_ratio": ("aspect_ratio", "aspect"),
               "duration_seconds": ("seconds", "seconds")}


@dataclass(frozen=True)
class Validated:
    """A caller's fields validated into the request this deployment runs."""

    request: GenerationRequest
    names: dict[str, str]        # request field -> the caller's field name
    model: str                   # the model id reported back
    conditions: Conditions | None = None   # fl2va / ref2va: the decoded keyframes / references
    requested_size: str | None = None      # the caller's size when it was mapped onto H3's canvas
    user: str | None = None                # OpenAI's end-user id, reported on the job
    webhook_url: str | None = None         # where the job's end is POSTed (checked by the gateway's webhooks)
    n: int = 1                             # videos from this prompt: output i has seed + i


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
    if msg.HasField("lora"):   # LoraRef: the videos API's {"name", "scale"}
        out["lora"] = {"name": msg.lora.name, **({"scale": msg.lora.scale} if msg.lora.HasField("scale") else {})}
    if msg.references:
        out["references"] = [{"kind": r.kind or None, "path": Upload(r.data, f"references[{i}]", r.filename)}
                             for i, r in enumerate(msg.references)]
    return out


def _json_text(key: str, value: Any) -> Any:
    """A form field that carries an object or a list as JSON text (vLLM-Omni's `image_reference`, `extra_params`,
    SGLang's `conditions` / `target` in a form) decoded; any other value as it is."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            raise RequestError(key, short(value), "valid JSON (an object or a list)") from None
    return value


def _uploads(key: str, value: Any) -> list[Upload]:
    """A media field's value (an Upload, a data URL, a {"image_url" | "audio_url" | "video_url": data URL} object,
    JSON text of these, or a list of them where repeatable) as Uploads named after the caller's field
    (`image_reference[1]` for the second of a list)."""
    value = _json_text(key, value)
    items = []
    for item in value if isinstance(value, list) else [value]:
        item = _json_text(key, item)   # a repeated form field may carry a JSON list of its own
        items += item if isinstance(item, list) else [item]
    if len(items) > 1 and key not in REPEATABLE:
        raise RequestError(key, f"{len(items)} files", "one file")
    indexed = key in REPEATABLE and (isinstance(value, list) or len(items) > 1)
    out = []
    for i, item in enumerate(items):
        name = f"{key}[{i}]" if indexed else key
        if isinstance(item, Upload):
            out.append(Upload(item.data, name, item.filename))
        else:
            out.append(from_data_url(name, item))
    return out


def _media(fields: dict[str, Any], media: list[tuple[str, Any]], task: Any) -> None:
    """The media fields, in the order given, into first_image / last_image / references. Video references become
    references of kind "video" like the others (decode_conditions answers for them)."""
    references = fields.pop("references", [])
    task = task.strip().lower() if isinstance(task, str) else None
    keys = {key for key, _ in media}
    if "input_references" in keys and keys & {"input_reference", "image_reference", "video_reference"}:
        both = sorted(keys & {"input_reference", "image_reference", "video_reference"})[0]
        raise RequestError("input_references", "given", f"input_references alone, without {both} (vLLM-Omni's rule)")
    for key, value in media:
        uploads = _uploads(key, value)
        if task == "fl2va" and key in ("image_reference", "input_references"):
            # vLLM-Omni's [first, last] list: the two keyframes
            if len(uploads) > 2:
                raise RequestError(key, f"{len(uploads)} files", "task fl2va: [first, last], at most two images")
            for name, upload in zip(("first_image", "last_image"), uploads):
                _keyframe(fields, name, key, upload)
        elif key in REFERENCE_KIND or key == "input_references" or (key == "input_reference" and task == "ref2va"):
            references += [{"kind": _kind(key, u), "path": u} for u in uploads]
        else:
            _keyframe(fields, "first_image" if key == "input_reference" else key, key, uploads[0])
    if references:
        fields["references"] = references


def _kind(key: str, upload: Upload) -> str:
    """A reference's kind: its field's; for input_references the file's content type / name, as vLLM-Omni reads
    them (image/*, audio/*, else a video)."""
    if key == "input_references":
        return reference_kind(upload.filename) or "video"
    return REFERENCE_KIND.get(key, "image")


def _keyframe(fields: dict[str, Any], name: str, key: str, upload: Upload) -> None:
    if name in fields:
        raise RequestError(key, repr(upload), f"{name} given twice (input_reference, first_image, a keyframe "
                                              "condition and a [first, last] list each give it)")
    fields[name] = upload


def _fixed(key: str, value: Any) -> None:
    """A field whose only honoured values are the ones H3 runs (a form sends them as text)."""
    allowed, reason = FIXED[key]
    if value is None:
        return
    text = value.strip().lower() if isinstance(value, str) else value
    ok = False
    for want in allowed:
        if isinstance(want, bool):
            ok |= text is want or text == str(want).lower()
        else:
            try:
                ok |= not isinstance(text, (bool, list, dict)) and float(text) == want
            except (TypeError, ValueError):
                pass
    if not ok:
        raise RequestError(key, short(value), "not supported: " + reason)


def _shift(name: str, value: Any, want: float, what: str) -> None:
    """A flow shift: accepted at the checkpoint's value (the trained schedule), refused otherwise naming it."""
    if value is None:
        return
    try:
        ok = not isinstance(value, (bool, list, dict)) and math.isclose(float(value), want, rel_tol=1e-6)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise RequestError(name, short(value), f"only {want:g}: the {what} shift is the checkpoint's, part of its "
                                               "trained schedule")


def _conditions(fields: dict[str, Any], value: Any) -> None:
    """SGLang's conditions [{type, uri, role, frame_index, start_time_seconds}] -> media entries: a keyframe at
    frame 0 (or none given) is the first frame, one at -1 or the clip's last frame the last; references keep
    their order."""
    value = _json_text("conditions", value)
    if value is None:
        return
    if not isinstance(value, list):
        raise RequestError("conditions", short(value), "a list of {type, uri, role, frame_index, start_time_seconds}")
    keyframes = []
    for i, cond in enumerate(value):
        where = f"conditions[{i}]"
        cond = _json_text(where, cond)
        if not isinstance(cond, dict):
            raise RequestError(where, short(cond), "an object {type, uri, role, frame_index, start_time_seconds}")
        for k in cond:
            if k not in CONDITION_KEYS:
                raise RequestError(f"{where}.{k}", short(cond[k]), "unknown; allowed: " + ", ".join(CONDITION_KEYS))
        kind = CONDITION_TYPES.get(cond.get("type")) if isinstance(cond.get("type"), str) else None
        if kind is None:
            raise RequestError(f"{where}.type", short(cond.get("type")), " | ".join(CONDITION_TYPES))
        role = cond.get("role")
        if role not in ("keyframe", "reference"):
            raise RequestError(f"{where}.role", short(role), "keyframe | reference")
        start = cond.get("start_time_seconds")
        if start is not None:
            try:
                ok = not isinstance(start, (bool, list, dict)) and float(start) == 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise RequestError(f"{where}.start_time_seconds", short(start),
                                   "only 0: references are read from their start")
        upload = from_data_url(f"{where}.uri", cond.get("uri"))
        if role == "keyframe":
            if kind != "image":
                raise RequestError(f"{where}.type", cond["type"], "a keyframe is an image")
            index = cond.get("frame_index")
            if isinstance(index, str) and re.fullmatch(r"\s*-?\d{1,9}\s*", index):   # a form's text
                index = int(index)
            if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
                raise RequestError(f"{where}.frame_index", short(index), "an integer: 0 (first) or -1 / N-1 (last)")
            keyframes.append((index, where, upload))
        else:
            if cond.get("frame_index") is not None:
                raise RequestError(f"{where}.frame_index", short(cond["frame_index"]),
                                   "only for keyframes (a reference has no frame)")
            refs = fields.setdefault("references", [])
            refs.append({"kind": kind, "path": upload})
    for index, where, upload in keyframes:
        name = "first_image" if index in (None, 0) else "last_image"
        if name == "last_image":
            fields["_last_frame_index"] = (f"{where}.frame_index", index)
        _keyframe(fields, name, where, upload)


def _target(fields: dict[str, Any], names: dict[str, str], value: Any) -> None:
    """SGLang's target {short_edge, aspect_ratio, duration_seconds}."""
    value = _json_text("target", value)
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError("target", short(value), "an object {short_edge, aspect_ratio, duration_seconds}")
    for k, v in value.items():
        name = f"target.{k}"
        if k not in TARGET_KEYS:
            raise RequestError(name, short(v), "unknown; allowed: " + ", ".join(TARGET_KEYS))
        if v is None:
            continue
        key, internal = TARGET_KEYS[k]
        if key in fields:
            raise RequestError(name, short(v), f"given both as {key} and {name}")
        fields[key], names[internal] = v, name


def _canvas_edge(fields: dict[str, Any], names: dict[str, str]) -> None:
    """aspect_ratio -> the request's aspect; short_edge -> the canvas's short side (the other follows the aspect,
    rounded to 32 as the validator rounds one given side)."""
    if "aspect_ratio" in fields:
        fields["aspect"] = fields.pop("aspect_ratio")
    edge = fields.pop("short_edge", None)
    if edge is None:
        return
    name = names.pop("short_edge", "short_edge")
    if isinstance(edge, bool) or not isinstance(edge, (int, str)) or not str(edge).strip().isdigit():
        raise RequestError(name, short(edge), "a positive integer, a multiple of 32 (the canvas's short side)")
    if any(k in fields for k in ("size", "width", "height")):
        raise RequestError(name, short(edge), "give short_edge or size / width / height, not both")
    aspect = fields.get("aspect")
    if aspect is None:
        if fields.get("first_image") is not None or fields.get("last_image") is not None:
            raise RequestError(name, short(edge), "with keyframes give aspect_ratio too (which side is short)")
        aspect = "16:9"   # the validator's default aspect
    landscape = canvas_for_aspect(aspect, field_name=names.get("aspect", "aspect_ratio"))
    fields["height" if landscape.width >= landscape.height else "width"] = int(str(edge).strip())
    names[API_FIELDS["height" if landscape.width >= landscape.height else "width"]] = name


def fields_from_http(body: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """A videos-API body (decoded JSON or form) in any of its dialects (OpenAI, vLLM-Omni, SGLang) -> (fields,
    request field -> the caller's field name where it is not the API name: `extra_params.task`, `target.short_edge`,
    ...)."""
    if not isinstance(body, dict):
        raise RequestError("body", short(body), "a JSON object of request fields")
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}
    media: list[tuple[str, Any]] = []
    shifts: list[tuple[str, Any, str]] = []
    for key, value in body.items():
        if not isinstance(key, str) or not key:
            raise RequestError("body", short(key), "non-empty string field names")
        if key in UNSUPPORTED:
            if value is None or value == "" or value == [] or value == {}:
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
        elif key in ("n", "num_outputs_per_prompt"):   # OpenAI's / SGLang's name, vLLM-Omni's
            if "n" in fields:
                raise RequestError(key, short(value), f"given both as {key} and {names.get('n', 'n')}")
            fields["n"], names["n"] = value, key
        elif key == "webhook_url":
            if value is not None and not isinstance(value, str):
                raise RequestError(key, short(value), "an http(s) URL (a string)")
            fields["webhook_url"] = value or None
        elif key == "video_params":
            _video_params(fields, names, value)
        elif key == "conditions":
            _conditions(fields, value)
        elif key == "target":
            _target(fields, names, value)
        elif key in ("flow_shift", "audio_flow_shift"):
            shifts.append((key, value, "video" if key == "flow_shift" else "audio"))
        elif key == "seed" and isinstance(value, (int, str)) and str(value).strip() == "-1":
            continue   # vLLM-Omni's / diffusers' "random": drawn and reported on the job
        elif key == "fps" and isinstance(value, str) and re.fullmatch(r"\s*\d{1,4}(\.0*)?\s*", value):
            fields[key] = int(float(value))   # vLLM-Omni's form types fps as a float: "24.0"
        elif key != "extra_params" and value is not None:
            if key in fields:
                raise RequestError(key, short(value), f"given both as {key} and {names.get(key, 'another field')}")
            fields[key] = value
    extra = _json_text("extra_params", body.get("extra_params"))
    if isinstance(extra, str) and not extra.strip():
        extra = None
    if extra is not None:
        if not isinstance(extra, dict):
            raise RequestError("extra_params", short(extra), "a JSON object")
        for key, value in extra.items():
            name = f"extra_params.{key}"
            if key not in EXTRA_PARAMS:
                raise RequestError(name, short(value), "unknown; allowed: " + ", ".join(EXTRA_PARAMS))
            if value is None:
                continue
            if key in ("flow_shift", "audio_flow_shift"):
                shifts.append((name, value, "video" if key == "flow_shift" else "audio"))
                continue
            target = {"duration": "seconds"}.get(key, key)
            if target in fields:
                raise RequestError(name, short(value), f"given both as {names.get(target, target)} and {name}")
            fields[target], names[{"aspect_ratio": "aspect"}.get(target, target)] = value, name
    if shifts:
        fields["_shifts"] = shifts   # checked against the deployment's checkpoint (validate_fields)
    _media(fields, media, fields.get("task"))
    _canvas_edge(fields, names)
    return fields, names


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


@functools.lru_cache(maxsize=8)
def checkpoint_shifts(checkpoint: str | None) -> FlowShifts:
    """The flow shifts of the deployment's checkpoint (`scheduler/`, `audio_scheduler/`), read where the gateway
    sees the checkpoint; else the released values the DiT's scheduler defaults to (12 video, 3 audio)."""
    if checkpoint and os.path.isdir(checkpoint):
        try:
            return flow_shifts(CheckpointFolder(checkpoint, components=["scheduler", "audio_scheduler"]))
        except H3Error:
            pass   # the DiT stage reports an unreadable checkpoint; the released values stand here
    return FlowShifts()


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
    for name, value, what in fields.get("_shifts", ()):
        _shift(name, value, getattr(checkpoint_shifts(config.model.checkpoint), what), what)
    raw = {internal: fields[api] for api, internal in API_FIELDS.items()
           if api in fields and fields[api] is not None}
    if fields.get("aspect") is not None:   # vLLM-Omni's / SGLang's aspect_ratio
        raw["aspect"] = fields["aspect"]
    requested = _snap_size(raw) if http else None
    if (profile == "fasth3" and http and "steps" in raw
            and str(raw["steps"]).strip() == str(FASTH3_STEPS - 1)):
        raw["steps"] = FASTH3_STEPS   # vLLM-Omni counts FastH3's 4 denoising steps; here 5 grid points
    raw["profile"] = profile
    raw["dtype"] = config.model.dtype
    if raw.get("lora") is not None and profile != "fasth3":   # a few-step adapter's steps, before the defaults
        try:
            choice = lora_choice(raw["lora"])
            raw["steps"] = lora_steps(find_lora(parse_loras(config.model.loras), choice.name, choice.path),
                                      raw.get("steps"), field="steps")
        except RequestError as exc:
            raise _renamed(exc, api_names) from None
    if "prompt" not in raw:
        raise RequestError("prompt", None, "a prompt is required")
    try:
        req = validate_request(**raw)
    except RequestError as exc:
        raise _renamed(exc, api_names) from None
    if req.task not in served_tasks:
        raise RequestError(api_names.get("task", "task"), req.task, not_served)
    if "_last_frame_index" in fields:   # SGLang's keyframe condition: the last frame of the aligned clip
        name, index = fields["_last_frame_index"]
        if index not in (-1, req.num_frames - 1):
            raise RequestError(name, index, f"0 (the first frame) or -1 / {req.num_frames - 1} (the last of the "
                                            f"{req.num_frames} frames): H3 conditions on the first and last frames")
    _check_previews(req, config.gateway.max_previews, api_names.get("preview_every", "preview_every"))
    return Validated(req, api_names, model_id, decode_conditions(req), requested, fields.get("user"),
                     fields.get("webhook_url"), _outputs(fields.get("n"), req.seed, api_names.get("n", "n")))


def _outputs(n: Any, seed: int, name: str) -> int:
    """`n`: how many videos (a form sends it as text); their seeds seed..seed+n-1 must all be valid seeds."""
    if n is None:
        return 1
    try:
        value = int(n) if not isinstance(n, bool) and float(n) == int(float(n)) else None
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or not 1 <= value <= MAX_OUTPUTS:
        raise RequestError(name, short(n), f"an integer in [1, {MAX_OUTPUTS}]")
    if seed + value - 1 > MAX_SEED:
        raise RequestError(name, value, f"at most {MAX_SEED - seed + 1} with seed {seed} (output i has seed + i, "
                                        f"at most {MAX_SEED})")
    return value


def _check_previews(req, most: int, name: str) -> None:
    """A preview costs a small render on the DiT: at most `most` (the deployment's --max-previews) per request."""
    if req.preview_every <= 0:
        return
    forwards = req.steps - 1
    if most <= 0:
        raise RequestError(name, req.preview_every, "0: this deployment serves no previews (--max-previews 0)")
    least = -(-forwards // most)
    if forwards // req.preview_every > most:
        raise RequestError(name, req.preview_every, f"0 (none) or an integer >= {least}: {forwards} denoising steps "
                                                     f"and at most {most} previews a request (--max-previews)")


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
