"""The videos API as the official OpenAI Python SDK and curl speak it, unchanged: create_and_poll, retrieve, list,
download_content (the MP4 and a real thumbnail), delete; OpenAI's sizes mapped onto H3's canvas and reported;
`extra_params` nested and as the SDK flattens it into form keys; `/v1/models`; OpenAI-shaped errors; remix and the
other edit endpoints refused by name."""

from __future__ import annotations

import io
import json
import shutil
import subprocess

import httpx
import openai
import pytest
from PIL import Image

from .conftest import REQUEST

# the SDK marks its videos methods deprecated (OpenAI's own service); the client code is what is under test
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
SDK_BODY = {"seed": REQUEST["seed"], "num_inference_steps": REQUEST["num_inference_steps"]}


@pytest.fixture
def sdk(stack):
    client = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def test_sdk_create_and_poll_download_list_retrieve_delete(stack, embedded, sdk):
    expected = embedded(**REQUEST)
    video = sdk.videos.create_and_poll(prompt=REQUEST["prompt"], size=REQUEST["size"], seconds="5",
                                       extra_body={**SDK_BODY, "extra_params": {"task": "t2va"}},
                                       poll_interval_ms=100)
    assert video.status == "completed", video
    assert video.size == "320x256" and video.seconds == "5" and video.progress == 100
    assert sdk.videos.download_content(video.id).read() == expected
    thumb = Image.open(io.BytesIO(sdk.videos.download_content(video.id, variant="thumbnail").read()))
    assert thumb.format == "JPEG" and thumb.size == (320, 256)
    assert sdk.videos.retrieve(video.id).id == video.id
    assert video.id in [v.id for v in sdk.videos.list(limit=100)]
    deleted = sdk.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError) as err:
        sdk.videos.retrieve(video.id)
    assert err.value.body["type"] == "not_found_error"


@pytest.mark.parametrize("size,used", [("1280x720", "1344x768"), ("720x1280", "768x1344"),
                                       ("1792x1024", "1344x768"), ("1024x1792", "768x1344")])
def test_openai_sizes_map_onto_the_canvas_and_the_job_says_so(sdk, size, used):
    video = sdk.videos.create(prompt="a kite", size=size, seconds="8", extra_query={"validate_only": "true"})
    job = video.model_dump()
    assert job["size"] == used and job["requested_size"] == size
    assert job["num_frames"] == 192   # 8 s = 192 frames, already 17n+5


def test_sdk_errors_are_openai_shaped(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.videos.create(prompt="a kite", seconds="99")
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "seconds" and body["code"]
    assert "seconds" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        sdk.videos.create(prompt="a kite", model="sora-2")
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.videos.remix("video_x", prompt="again")
    assert err.value.body["param"] == "remix" and err.value.body["code"] == "unsupported"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.videos.download_content("video_x", variant="spritesheet")
    assert err.value.body["param"] == "variant"


def test_models_lists_the_served_ids(sdk):
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["MiniMax-H3"]


@pytest.mark.parametrize("body,field", [
    ({"negative_prompt": "blurry"}, "negative_prompt"),
    ({"guidance_scale": 5}, "guidance_scale"),
    ({"generate_sound": "maybe"}, "generate_sound"),
    ({"enable_frame_interpolation": True}, "enable_frame_interpolation"),
    ({"lora": {"name": "x"}}, "lora.name"),   # a deployment that lists no adapters
    ({"flow_shift": 5}, "flow_shift"),
    ({"true_cfg_scale": 4}, "true_cfg_scale"),
    ({"video_params": {"colour": 1}}, "video_params.colour"),
    ({"video_params": {"width": 320}, "width": 320}, "width"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_vllm_omni_fields_without_meaning_are_refused_by_name(stack, body, field):
    r = httpx.post(f"{stack.http}/v1/videos", json={"prompt": "a kite", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err


def test_vllm_omni_fields_with_meaning_are_accepted(stack):
    body = {"prompt": "a kite", "video_params": {"width": 320, "height": 256, "num_frames": 124, "fps": 24},
            "guidance_scale": 1.0, "generate_sound": True, "enable_frame_interpolation": False, "user": "u-1",
            "seed": 5, "num_inference_steps": 4, "negative_prompt": ""}
    r = httpx.post(f"{stack.http}/v1/videos", params={"validate_only": "true"}, json=body, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["size"], job["num_frames"], job["seed"], job["num_inference_steps"], job["user"]) == \
        ("320x256", 124, 5, 4, "u-1")


def test_curl_multipart_with_flattened_extra_params(stack, embedded, tmp_path):
    curl = shutil.which("curl")
    assert curl, "curl is part of the test machine"
    expected = embedded(**REQUEST)
    out = tmp_path / "out.mp4"
    args = [curl, "-sS", "-o", str(out), "-w", "%{http_code}", f"{stack.http}/v1/videos/sync",
            "-F", f"prompt={REQUEST['prompt']}", "-F", "size=320x256", "-F", "seconds=5", "-F", "seed=0",
            "-F", "num_inference_steps=4", "-F", "extra_params[task]=t2va"]
    status = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
    assert status == "200", (status, out.read_bytes()[:300])
    assert out.read_bytes() == expected
    r = subprocess.run([curl, "-sS", f"{stack.http}/v1/videos", "-F", "prompt=a kite",
                        "-F", "extra_params[colour]=red"], capture_output=True, text=True, timeout=30)
    assert json.loads(r.stdout)["error"]["param"] == "extra_params.colour"


def test_a_body_past_the_bound_is_413_before_it_is_read(stack):
    import socket
    from urllib.parse import urlparse

    from h3serve.services.gateway.http import MAX_BODY_BYTES

    url = urlparse(stack.http)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n{{".encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0] if b"content-length: " in data else 1):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "too_large" and "body" in err["message"], err


def test_sdk_input_reference_object_and_flattened_video_params(sdk):
    """OpenAI's reference object `{"image_url": data URL}` (the SDK sends it as form keys `input_reference[image_url]`,
    as it flattens `video_params`)."""
    import base64

    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    video = sdk.videos.create(prompt="a kite", seconds="5",
                              extra_body={"input_reference": {"image_url": url},
                                          "video_params": {"width": 384, "height": 256}},
                              extra_query={"validate_only": "true"})
    job = video.model_dump()
    assert (job["task"], job["size"]) == ("fl2va", "384x256"), job
