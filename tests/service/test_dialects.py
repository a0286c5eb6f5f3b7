"""The videos API as vLLM-Omni's and SGLang's H3 clients speak it, unchanged (issue 23, items 1-3).

What the clients send and parse is rewritten here from their sources (no code copied), pinned to what was read:

- vLLM-Omni, github.com/vllm-project/vllm-omni:
  `vllm_omni/entrypoints/openai/protocol/videos.py` @ 48e60262553e3b7d28a95e05fbcdd431c4ef04f0
  (VideoGenerationRequest, VideoResponse, VideoListResponse) and
  `vllm_omni/entrypoints/openai/video/generation/helpers.py` @ 57ff671eac28f61e772e4aa72a4cf6dd43afcf50
  (`_parse_video_form`: the multipart fields, `input_references` with the kind by content type, reference objects
  as JSON text).
- SGLang, github.com/sgl-project/sglang: `python/sglang/multimodal_gen/runtime/entrypoints/openai/protocol.py`,
  the revision that defines MiniMaxH3VideoGenerationsRequest / MiniMaxH3Condition / MiniMaxH3Target (the stored
  index lists that file at 97728fb79f2548753de296367c1852f83077cd33, a revision before them; the H3 revision was
  read by content) and its H3 client's recipe (t2va JSON: task, target {short_edge 736, aspect_ratio 16:9,
  duration_seconds 7.29}, flow_shift 12, audio_flow_shift 3, num_inference_steps, seed).

Field tables run at the validation level (no processes); the recipes, the strict response parsing and the property
test over form / body shapes run against a real gateway over the tiny checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import time
from typing import Annotated, Any, Literal, Optional
from urllib.parse import urlencode

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import BaseModel, StringConstraints

from h3serve.config.request import Upload
from h3serve.config.stage import StageConfig
from h3serve.errors import RequestError
from h3serve.services.gateway.fields import fields_from_http, validate_fields

from .conftest import finished_job


pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
CONFIG = StageConfig.from_knobs(profile="base", dtype="fp32", tasks="t2va,fl2va,ref2va")


def png(width: int = 96, height: int = 64, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float = 1.0, rate: int = 32000) -> bytes:
    n = int(seconds * rate)
    samples = struct.pack(f"<{n}h", *((i * 97) % 2000 - 1000 for i in range(n)))
    return (b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
            rate * 2, 2, 16) + b"data" + struct.pack("<I", len(samples)) + samples)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMG, VOICE = data_url(png(), "image/png"), data_url(wav(), "audio/wav")
MP4 = data_url(b"\x00\x00\x00\x18ftypmp42", "video/mp4")


# -- the clients' response models, rebuilt --------------------------------------------------------------------------

SecondStr = Annotated[str, StringConstraints(pattern=r"^[1-9]\d*$")]
SizeStr = Annotated[str, StringConstraints(pattern=r"^\d+x\d+$")]


class OmniVideoError(BaseModel):
    code: int | str
    message: str


class OmniVideoResponse(BaseModel):
    """vLLM-Omni's VideoResponse (its job object): `seconds` a whole positive number as text, `peak_memory_mb` a
    number, `status` one of four."""
    model: str
    prompt: str
    id: str
    object: Literal["video"]
    status: Literal["queued", "in_progress", "completed", "failed"]
    size: Optional[SizeStr] = None
    progress: int = 0
    seconds: SecondStr = "4"
    quality: str = "default"
    completed_at: Optional[int] = None
    created_at: int
    remixed_from_video_id: Optional[str] = None
    error: Optional[OmniVideoError] = None
    media_type: Literal["video/mp4"] = "video/mp4"
    expires_at: Optional[int] = None
    file_name: Optional[str] = None
    inference_time_s: Optional[float] = None
    stage_durations: dict[str, float] = {}
    peak_memory_mb: float = 0.0


class OmniVideoList(BaseModel):
    first_id: Optional[str]
    last_id: Optional[str]
    has_more: bool
    data: list[OmniVideoResponse]
    object: Literal["list"]


class SglVideoResponse(BaseModel):
    """SGLang's VideoResponse: `size`, `seconds`, `quality` strings (never null), `error` an object."""
    id: str
    object: str = "video"
    model: Optional[str] = None
    status: str = "queued"
    progress: int = 0
    created_at: int
    size: str = ""
    seconds: str = "4"
    quality: str = "standard"
    url: Optional[str] = None
    remixed_from_video_id: Optional[str] = None
    completed_at: Optional[int] = None
    expires_at: Optional[int] = None
    error: Optional[dict[str, Any]] = None
    file_path: Optional[str] = None
    file_paths: Optional[list[str]] = None
    num_outputs: Optional[int] = None
    peak_memory_mb: Optional[float] = None
    inference_time_s: Optional[float] = None


class SglVideoList(BaseModel):
    data: list[SglVideoResponse]
    object: str = "list"


class SglHTTPError(BaseModel):
    detail: str


# -- every field of each dialect: accepted, accepted at H3's value, or refused naming the field -------------------

def _validate(body: dict):
    fields, names = fields_from_http(body)
    return validate_fields(fields, config=CONFIG, names=names, http=True)


def _field(body: dict) -> str:
    with pytest.raises(RequestError) as info:
        _validate({"prompt": "a kite", **body})
    assert info.value.field in str(info.value)
    return info.value.field


# vLLM-Omni's VideoGenerationRequest and _parse_video_form, field by field: (body, what the request becomes | the
# field a refusal names). Each row sends the field as its client does (a form sends text).
OK = "accepted"
VLLM_OMNI = {
    "model": [({"model": "MiniMax-H3"}, OK), ({"model": "sora-2"}, "model")],
    "prompt": [({"prompt": ""}, "prompt")],
    "seconds": [({"seconds": "5"}, lambda r: r.num_frames == 124), ({"seconds": "99"}, "seconds")],
    "size": [({"size": "320x256"}, lambda r: (r.width, r.height) == (320, 256))],
    "image_reference": [({"image_reference": json.dumps({"image_url": IMG}), "extra_params": {"task": "ref2va"}},
                         lambda r: [s.kind for s in r.references] == ["image"]),
                        ({"image_reference": [{"image_url": IMG}, {"image_url": IMG}],
                          "extra_params": {"task": "fl2va"}},
                         lambda r: r.first_image is not None and r.last_image is not None),
                        ({"image_reference": {"file_id": "file_1"}, "extra_params": {"task": "ref2va"}},
                         "image_reference")],
    "video_reference": [({"video_reference": {"video_url": MP4}, "image_reference": {"image_url": IMG},
                          "extra_params": {"task": "ref2va"}}, "video_reference")],
    "audio_reference": [({"audio_reference": json.dumps({"audio_url": VOICE}), "image_reference": {"image_url": IMG},
                          "extra_params": {"task": "ref2va"}},
                         lambda r: [s.kind for s in r.references] == ["audio", "image"])],   # as given
    "input_reference": [({"input_reference": IMG}, lambda r: r.task == "fl2va" and r.first_image is not None)],
    "input_references": [({"input_references": [Upload(png(), "input_references", "a.png"),
                                                Upload(wav(), "input_references", "v.wav")],
                           "extra_params": {"task": "ref2va"}},
                          lambda r: [s.kind for s in r.references] == ["image", "audio"]),
                         ({"input_references": [Upload(png(), "input_references", "a.png")],
                           "input_reference": IMG}, "input_references")],
    "video_params": [({"video_params": {"width": 320, "height": 256}}, lambda r: r.width == 320),
                     ({"video_params": {"colour": 1}}, "video_params.colour")],
    "user": [({"user": "u-1"}, OK), ({"user": 5}, "user")],
    "width": [({"width": "320", "height": "256"}, lambda r: (r.width, r.height) == (320, 256))],
    "height": [({"height": 250, "width": 320}, "height")],
    "fps": [({"fps": "24.0"}, lambda r: r.fps == 24), ({"fps": 30}, "fps")],
    "num_frames": [({"num_frames": 124}, lambda r: r.num_frames == 124)],
    "aspect_ratio": [({"aspect_ratio": "9:16"}, lambda r: (r.width, r.height) == (768, 1344)),
                     ({"aspect_ratio": "9:0"}, "aspect_ratio")],
    "short_edge": [({"short_edge": "256", "aspect_ratio": "5:4"}, lambda r: (r.width, r.height) == (320, 256)),
                   ({"short_edge": "abc"}, "short_edge")],
    "num_outputs_per_prompt": [({"num_outputs_per_prompt": "1"}, OK), ({"num_outputs_per_prompt": 2}, OK),
                               ({"num_outputs_per_prompt": 11}, "num_outputs_per_prompt")],
    "start_time_seconds": [({"start_time_seconds": 0}, OK), ({"start_time_seconds": 2.5}, "start_time_seconds")],
    "quality": [({"quality": "lossless"}, OK), ({"quality": "ultra"}, "quality")],
    # h3serve counts sigma grid points incl. the terminal 0 (the diffusers reference's meaning): N -> N-1 forwards
    "num_inference_steps": [({"num_inference_steps": 20}, lambda r: r.steps == 20 and r.num_forwards == 19),
                            ({"num_inference_steps": 1}, "num_inference_steps")],
    "guidance_scale": [({"guidance_scale": "1.0"}, OK), ({"guidance_scale": 5}, "guidance_scale")],
    "guidance_scale_2": [({"guidance_scale_2": 3}, "guidance_scale_2")],
    "boundary_ratio": [({"boundary_ratio": 0.9}, "boundary_ratio")],
    "flow_shift": [({"flow_shift": "12.0"}, OK), ({"flow_shift": 5}, "flow_shift")],
    "true_cfg_scale": [({"true_cfg_scale": 4}, "true_cfg_scale")],
    "seed": [({"seed": -1}, OK), ({"seed": "7"}, lambda r: r.seed == 7), ({"seed": -2}, "seed")],
    "generate_sound": [({"generate_sound": "false"}, OK), ({"generate_sound": True}, OK),
                       ({"generate_sound": "maybe"}, "generate_sound")],
    "sound_duration": [({"sound_duration": 3}, "sound_duration")],
    "negative_prompt": [({"negative_prompt": ""}, OK), ({"negative_prompt": "blurry"}, "negative_prompt")],
    "enable_frame_interpolation": [({"enable_frame_interpolation": "false"}, OK),
                                   ({"enable_frame_interpolation": True}, "enable_frame_interpolation")],
    "frame_interpolation_exp": [({"frame_interpolation_exp": 1}, OK),
                                ({"frame_interpolation_exp": 2}, "frame_interpolation_exp")],
    "frame_interpolation_scale": [({"frame_interpolation_scale": "1.0"}, OK),
                                  ({"frame_interpolation_scale": 0.5}, "frame_interpolation_scale")],
    "frame_interpolation_model_path": [({"frame_interpolation_model_path": "x/rife"},
                                        "frame_interpolation_model_path")],
    "lora": [({"lora": {"name": "a", "path": "b"}}, "lora.name")],   # CONFIG lists no adapters
    "extra_params": [({"extra_params": json.dumps({"task": "t2va", "aspect_ratio": "16:9", "flow_shift": 12.0,
                                                   "audio_flow_shift": 3.0, "duration": 5})},
                      lambda r: (r.width, r.height, r.num_frames) == (1344, 768, 124)),
                     ({"extra_params": {"audio_flow_shift": 6}}, "extra_params.audio_flow_shift"),
                     ({"extra_params": {"sampler": "euler"}}, "extra_params.sampler"),
                     ({"extra_params": "[1]"}, "extra_params")],
    "return_stage_metrics": [({"return_stage_metrics": "true"}, OK)],
    "timeline_guides": [({"timeline_guides": [{"start": 0}]}, "timeline_guides")],
    "guide_files": [({"guide_files": ["g.png"]}, "guide_files")],
    "control_reference": [({"control_reference": IMG}, "control_reference")],
    "control_type": [({"control_type": "depth"}, "control_type")],
}
# the request / form fields of the pinned sources: every one has a row above
VLLM_OMNI_FIELDS = (
    "model prompt seconds size image_reference video_reference audio_reference input_reference input_references "
    "video_params user width height fps num_frames aspect_ratio short_edge num_outputs_per_prompt "
    "start_time_seconds quality num_inference_steps guidance_scale guidance_scale_2 boundary_ratio flow_shift "
    "true_cfg_scale seed generate_sound sound_duration negative_prompt enable_frame_interpolation "
    "frame_interpolation_exp frame_interpolation_scale frame_interpolation_model_path lora extra_params").split()

SGLANG = {
    "task": [({"task": "t2va"}, OK), ({"task": "i2v"}, "task")],
    "target": [({"target": {"short_edge": 736, "aspect_ratio": "16:9", "duration_seconds": 7.29}},
                lambda r: (r.width, r.height, r.num_frames) == (1312, 736, 175)),
               ({"target": {"short_edge": 256, "aspect_ratio": "5:4", "duration_seconds": 99}},
                "target.duration_seconds"),
               ({"target": {"short_edge": 736, "aspect_ratio": "16:9", "fps": 30}}, "target.fps"),
               ({"target": "736"}, "target")],
    "conditions": [({"task": "fl2va", "conditions": [{"type": "image", "uri": IMG, "role": "keyframe",
                                                      "frame_index": 0},
                                                     {"type": "image", "uri": IMG, "role": "keyframe",
                                                      "frame_index": -1}]},
                    lambda r: r.first_image is not None and r.last_image is not None),
                   ({"task": "ref2va", "conditions": [{"type": "image", "uri": IMG, "role": "reference"},
                                                      {"type": "audio", "uri": VOICE, "role": "reference"}]},
                    lambda r: [s.kind for s in r.references] == ["image", "audio"]),
                   ({"task": "fl2va", "conditions": [{"type": "image", "uri": IMG, "role": "keyframe",
                                                      "frame_index": 60}]}, "conditions[0].frame_index"),
                   ({"task": "ref2va", "conditions": [{"type": "image", "uri": "https://x/a.png",
                                                       "role": "reference"}]}, "conditions[0].uri"),
                   ({"task": "ref2va", "conditions": [{"type": "video_audio", "uri": MP4, "role": "reference"},
                                                      {"type": "image", "uri": IMG, "role": "reference"}]},
                    "conditions[0].uri"),
                   ({"conditions": [{"type": "image", "uri": IMG, "role": "mask"}]}, "conditions[0].role"),
                   ({"conditions": [{"type": "image", "uri": IMG, "role": "reference",
                                     "start_time_seconds": 3}]}, "conditions[0].start_time_seconds"),
                   ({"conditions": {"type": "image"}}, "conditions")],
    "audio_flow_shift": [({"audio_flow_shift": 3.0}, OK), ({"audio_flow_shift": 6.0}, "audio_flow_shift")],
    "n": [({"n": 1}, OK), ({"n": 4}, OK), ({"n": 0}, "n")],
}


def _rows(table):
    return [pytest.param(body, want, id=f"{name}-{i}") for name, rows in table.items()
            for i, (body, want) in enumerate(rows)]


def test_every_vllm_omni_field_has_a_row():
    assert set(VLLM_OMNI_FIELDS) <= set(VLLM_OMNI), set(VLLM_OMNI_FIELDS) - set(VLLM_OMNI)


@pytest.mark.parametrize("body,want", _rows(VLLM_OMNI) + _rows(SGLANG))
def test_dialect_field_table(body, want):
    if isinstance(want, str) and want != OK:
        assert _field(body) == want
        return
    request = _validate({"prompt": "a kite", **body}).request
    assert want == OK or want(request), request


def test_video_references_take_the_reference_path():
    """A video reference is parsed like the others (kind "video") and decoded as one: a file that is no video is
    refused naming its field."""
    fields, _ = fields_from_http({"prompt": "a kite", "video_reference": [{"video_url": MP4}],
                                  "image_reference": {"image_url": IMG}, "extra_params": {"task": "ref2va"}})
    assert [r["kind"] for r in fields["references"]] == ["video", "image"]
    with pytest.raises(RequestError) as info:
        validate_fields(fields, config=CONFIG, http=True)
    assert info.value.field == "video_reference[0]"


# -- against a real gateway ---------------------------------------------------------------------------------------

@pytest.fixture
def http(cond_stack):
    with httpx.Client(base_url=cond_stack.http, timeout=120) as client:
        yield client


def test_vllm_omni_recipes_run_unchanged(http):
    """vLLM-Omni's client: multipart with its model_dump(exclude_none=True) defaults; ref2va with input_references
    (kind by content type), fl2va with a [first, last] image_reference list, t2va with extra_params.aspect_ratio and
    the checkpoint's shifts (validated at the recipe's 16:9 canvas), then one real generation through /sync."""
    defaults = {"num_outputs_per_prompt": "1", "generate_sound": "false", "enable_frame_interpolation": "false",
                "frame_interpolation_exp": "1", "frame_interpolation_scale": "1.0", "fps": "24.0"}
    extra = {"aspect_ratio": "16:9", "flow_shift": 12.0, "audio_flow_shift": 3.0}
    files = [("input_references", ("subject.png", png(), "image/png")),
             ("input_references", ("voice", wav(), "audio/wav"))]
    r = http.post("/v1/videos", params={"validate_only": "true"}, files=files,
                  data={"prompt": "a kite", **defaults, "extra_params": json.dumps({"task": "ref2va", **extra})})
    assert r.status_code == 200, r.text
    job = OmniVideoResponse.model_validate({**r.json(), "object": "video", "status": "queued"})
    assert (job.size, r.json()["task"]) == ("1344x768", "ref2va")
    r = http.post("/v1/videos", params={"validate_only": "true"},
                  data={"prompt": "a kite", **defaults, "extra_params": json.dumps({"task": "fl2va", **extra}),
                        "image_reference": json.dumps([{"image_url": IMG}, {"image_url": IMG}])})
    assert r.status_code == 200 and r.json()["task"] == "fl2va", r.text

    t0 = time.monotonic()
    r = http.post("/v1/videos/sync", data={"prompt": "a kite", **defaults, "seed": "-1", "num_inference_steps": "4",
                                           "short_edge": "256", "seconds": "5",
                                           "extra_params": json.dumps({"task": "t2va", "aspect_ratio": "5:4",
                                                                       "flow_shift": 12.0,
                                                                       "audio_flow_shift": 3.0})})
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"] == "video/mp4" and r.content[4:8] == b"ftyp"
    assert 0 < float(r.headers["x-inference-time-s"]) <= time.monotonic() - t0
    listed = OmniVideoList.model_validate(http.get("/v1/videos").json())
    done = next(j for j in listed.data if j.id == r.headers["x-request-id"])
    assert (done.status, done.seconds, done.size, done.file_name) == ("completed", "5", "320x256",
                                                                      f"{done.id}.mp4")
    assert done.peak_memory_mb > 0 and done.inference_time_s > 0


def test_sglang_recipe_runs_unchanged(http):
    """SGLang's H3 client: JSON task / target / shifts, polled until completed; job, list and errors parse with
    SGLang's models. Its published 736-px 16:9 canvas is validated; the generation runs at 320x256."""
    recipe = {"model": "MiniMax-H3", "prompt": "a kite", "task": "t2va", "num_inference_steps": 20,
              "flow_shift": 12.0, "audio_flow_shift": 3.0, "seed": 1101,
              "target": {"short_edge": 736, "aspect_ratio": "16:9", "duration_seconds": 7.29}}
    r = http.post("/v1/videos", params={"validate_only": "true"}, json=recipe)
    assert r.status_code == 200, r.text
    assert (r.json()["size"], r.json()["num_frames"], r.json()["seconds"]) == ("1312x736", 175, "7")
    run = {**recipe, "num_inference_steps": 4, "target": {"short_edge": 256, "aspect_ratio": "5:4",
                                                           "duration_seconds": 5}}
    r = http.post("/v1/videos", json=run)
    assert r.status_code == 200, r.text
    queued = SglVideoResponse.model_validate(r.json())
    OmniVideoResponse.model_validate(r.json())   # a queued job: peak_memory_mb a number, seconds whole
    job = SglVideoResponse.model_validate(finished_job(http, queued.id))
    assert (job.status, job.size, job.seconds) == ("completed", "320x256", "5"), job
    assert http.get(f"/v1/videos/{job.id}/content").content[4:8] == b"ftyp"
    SglVideoList.model_validate(http.get("/v1/videos").json())
    bad = http.post("/v1/videos", json={**recipe, "flow_shift": 6.0})
    assert bad.status_code == 400 and "flow_shift" in SglHTTPError.model_validate(bad.json()).detail


def test_openai_sdk_models_cursor_and_characters(cond_stack):
    sdk = openai.OpenAI(base_url=f"{cond_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        assert sdk.models.retrieve("MiniMax-H3").id == "MiniMax-H3"
        assert sdk.models.retrieve("h3").id == "MiniMax-H3"   # an alias answers with the model it names
        with pytest.raises(openai.NotFoundError) as err:
            sdk.models.retrieve("sora-2")
        assert err.value.body["type"] == "not_found_error" and "sora-2" in err.value.body["message"]
        page = sdk.videos.list(after="video_unknown")
        assert (page.data, page.has_more) == ([], False)
        assert sdk.videos.list(limit=0).data == []
        with pytest.raises(openai.BadRequestError) as err:
            sdk.videos.get_character("char_1")
        assert (err.value.body["param"], err.value.body["code"]) == ("characters", "unsupported")
        # with a file the SDK sends multipart and flattens extra_body: image_reference[] items, extra_params[task]
        video = sdk.videos.create(prompt="a kite", seconds="5", input_reference=("a.png", png(), "image/png"),
                                  extra_body={"image_reference": [IMG, IMG], "extra_params": {"task": "ref2va"}},
                                  extra_query={"validate_only": "true"})
        assert (video.model_dump()["task"], video.model_dump()["status"]) == ("ref2va", "validated")
    finally:
        sdk.close()


# -- no 500 from any form or body shape ---------------------------------------------------------------------------

NAMES = ["prompt", "image_reference", "audio_reference", "video_reference", "input_reference", "input_references",
         "extra_params", "video_params", "target", "conditions", "seed", "size", "task", "lora", "x"]
SUFFIXES = ["", "[]", "[0]", "[1]", "[image_url]", "[][image_url]", "[task]", "[0][uri]", "[a][b]", "[", "]",
            "[][]", "[9]"]
TEXT = st.one_of(st.sampled_from(["abc", "", "a kite", IMG, VOICE, "-1", "1", "t2va", "ref2va", "fl2va", "{",
                                  '{"image_url": "x"}', json.dumps({"image_url": IMG}), "[1, 2]", "null",
                                  json.dumps([{"type": "image", "uri": IMG, "role": "keyframe"}])]),
                 st.text(max_size=8))
form_items = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(SUFFIXES), TEXT), max_size=6)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 1000), st.floats(-1, 20), TEXT),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["image_url", "audio_url", "video_url", "task", "type",
                                                        "uri", "role", "frame_index", "short_edge",
                                                        "aspect_ratio", "duration_seconds", "file_id", "x"]),
                                                       inner, max_size=3)), max_leaves=6)
json_bodies = st.dictionaries(st.sampled_from(NAMES), json_values, max_size=5)
SHAPES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _named(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        err = body["error"]
        assert err["field"] and err["field"] in err["message"] and body["detail"] == err["message"], body


@SHAPES
@given(items=form_items, multipart=st.booleans())
def test_form_shapes_never_5xx(http, items, multipart):
    pairs = [("prompt", "a kite")] + [(name + suffix, value) for name, suffix, value in items]
    if multipart:
        r = http.post("/v1/videos", params={"validate_only": "true"},
                      files=[(k, (None, v)) for k, v in pairs])
    else:
        r = http.post("/v1/videos", params={"validate_only": "true"}, content=urlencode(pairs),
                      headers={"content-type": "application/x-www-form-urlencoded"})
    _named(r)


@SHAPES
@given(body=json_bodies)
def test_json_shapes_never_5xx(http, body):
    _named(http.post("/v1/videos", params={"validate_only": "true"}, json={"prompt": "a kite", **body}))


def test_curl_bracketed_reference_is_not_a_500(http):
    r = http.post("/v1/videos", files=[("prompt", (None, "x")), ("image_reference[]", (None, "abc"))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_reference[0]", r.text
    r = http.post("/v1/videos", params={"validate_only": "true"},
                  files=[("prompt", (None, "x")), ("extra_params[task]", (None, "ref2va")),
                         ("image_reference[][image_url]", (None, IMG)), ("image_reference[][image_url]", (None, IMG))])
    assert r.status_code == 200 and r.json()["task"] == "ref2va", r.text
