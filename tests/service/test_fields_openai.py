"""Field mapping of the videos API without processes: vLLM-Omni's FastH3 step count, OpenAI sizes, data URLs."""

from __future__ import annotations

import base64

import pytest

from h3serve.config.stage import StageConfig
from h3serve.errors import RequestError
from h3serve.services.gateway.fields import fields_from_http, validate_fields
from h3serve.services.gateway.uploads import from_data_url

BASE = StageConfig.from_knobs(profile="base", dtype="fp32")
FAST = StageConfig.from_knobs(profile="fasth3", dtype="fp32")


def _validate(body, config=BASE):
    fields, names = fields_from_http(body)
    return validate_fields(fields, config=config, names=names, http=True)


@pytest.mark.parametrize("steps", [4, 5, None])
def test_fasth3_takes_vllm_omni_step_count_and_its_grid(steps):
    body = {"prompt": "a kite", "size": "320x256"}
    if steps is not None:
        body["num_inference_steps"] = steps
    assert _validate(body, FAST).request.steps == 5


def test_fasth3_other_step_counts_are_refused_and_base_keeps_its_meaning():
    with pytest.raises(RequestError) as info:
        _validate({"prompt": "a kite", "num_inference_steps": 3}, FAST)
    assert info.value.field == "num_inference_steps"
    assert _validate({"prompt": "a kite", "num_inference_steps": 4}).request.steps == 4


def test_sizes_kept_on_the_grid_and_mapped_off_it():
    v = _validate({"prompt": "a kite", "size": "320x256"})
    assert (v.request.width, v.request.height, v.requested_size) == (320, 256, None)
    v = _validate({"prompt": "a kite", "size": "1280x720"})
    assert (v.request.width, v.request.height, v.requested_size) == (1344, 768, "1280x720")
    with pytest.raises(RequestError) as info:
        _validate({"prompt": "a kite", "size": "2000x256"})   # aspect beyond 4:1
    assert info.value.field == "size"


def test_data_urls():
    data = b"\x89PNG..."
    up = from_data_url("input_reference", "data:image/png;base64," + base64.b64encode(data).decode())
    assert (up.data, up.field, up.filename) == (data, "input_reference", "upload.png")
    up = from_data_url("x", {"image_url": "data:audio/wav;base64," + base64.b64encode(b"RIFF").decode()})
    assert up.filename == "upload.wav"
    for bad in ("https://example.com/a.png", "data:image/png,notbase64", "data:image/png;base64,@@", 5):
        with pytest.raises(RequestError) as info:
            from_data_url("input_reference", bad)
        assert info.value.field == "input_reference"


def test_tasks_follow_the_servers_tasks_and_the_profile():
    import dataclasses

    assert BASE.model.tasks_for() == ("t2va", "fl2va") and FAST.model.tasks_for() == ("t2va",)
    with pytest.raises(RequestError) as info:
        _validate({"prompt": "a kite", "extra_params": {"task": "ref2va"}})
    assert info.value.field == "extra_params.task" and "--tasks" in str(info.value)
    full = BASE.replace(tasks="t2va,fl2va,ref2va")
    assert full.model.tasks_for() == ("t2va", "fl2va", "ref2va") and full.model.tasks_for("fasth3") == ("t2va",)
    with pytest.raises(RequestError) as info:   # served now: what is missing is the references
        _validate({"prompt": "a kite", "extra_params": {"task": "ref2va"}}, full)
    assert info.value.field == "image_reference"


def test_a_finished_job_drops_its_media(tmp_path):
    import io

    from PIL import Image

    from h3serve.config.request import Upload
    from h3serve.services.gateway.fields import without_media

    buf = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buf, format="PNG")
    v = validate_fields({"prompt": "a kite", "size": "320x256", "first_image": Upload(buf.getvalue(), "first_image")},
                        config=BASE)
    assert v.conditions is not None and isinstance(v.request.first_image, Upload)
    light = without_media(v)
    assert light.conditions is None and isinstance(light.request.first_image, str)
    assert "first_image" in light.request.first_image
    assert (light.request.task, light.request.width, light.request.num_frames) == ("fl2va", 320, 124)
