"""fl2va and ref2va through the services: keyframes and image / audio references as gRPC bytes (our SDK), HTTP
multipart uploads (OpenAI's `input_reference`, vLLM-Omni's `*_reference`) and JSON data URLs. The served MP4 is the
embedded pipeline's, byte for byte, for the same request and seed; bad uploads are a 4xx / INVALID_ARGUMENT naming
the field, before any model work.

The stack runs on a copy of the tiny checkpoint whose pipeline config sets the reference short edge to 256 (2048
released), which both the stages and the embedded pipeline read: the same rule at a CPU-friendly size.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from h3serve.client import Client
from h3serve.errors import RequestError
from h3serve.testing.mp4check import check_mp4, ffprobe_report

from .conftest import embedded_maker, embedded_request

BASE = dict(prompt="the kite lands on the beach", seconds=5, size="320x256", seed=3, num_inference_steps=3)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, rate: int = 32000, channels: int = 1) -> bytes:
    import av

    t = np.arange(int(seconds * rate)) / rate
    data = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)[None].repeat(channels, 0)
    buf = io.BytesIO()
    layout = "stereo" if channels == 2 else "mono"
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(data.T.reshape(1, -1).copy(), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def clip(frames: int = 26, fps: float = 24, size: tuple[int, int] = (32, 32), sound_rate: int | None = 32000,
         seed: int = 4) -> bytes:
    """A small MP4 video reference (H.264, with an AAC soundtrack at `sound_rate` unless None)."""
    from h3serve.testing.clips import write_video

    rng = np.random.default_rng(seed)
    pcm = None
    if sound_rate is not None:
        t = np.arange(int(frames / fps * sound_rate)) / sound_rate
        pcm = (0.3 * np.sin(2 * np.pi * 220 * t))[None].repeat(2, 0)
    buf = io.BytesIO()
    write_video(buf, rng.integers(0, 255, (frames, size[1], size[0], 3), dtype=np.uint8), fps, pcm,
                sample_rate=sound_rate or 32000)
    return buf.getvalue()


FIRST, LAST, SUBJECT, VOICE = png(96, 64, 1), png(64, 80, 2), png(48, 64, 3), wav(1.3)
CLIP = clip()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    paths = {}
    for name, data in (("first.png", FIRST), ("last.png", LAST), ("subject.png", SUBJECT), ("voice.wav", VOICE)):
        (root / name).write_bytes(data)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="module")
def ckpt(cond_ckpt):
    return cond_ckpt


@pytest.fixture(scope="module")
def embedded_cond(ckpt, tmp_path_factory):
    """`make(**validate_request fields) -> bytes` from the embedded pipeline (fp32, cpu, 1 thread)."""
    from h3serve.pipeline import Pipeline

    pipe = Pipeline.load(ckpt, dtype="fp32", device="cpu", tasks=("t2va", "fl2va", "ref2va"))
    yield embedded_maker(pipe, tmp_path_factory.mktemp("embedded-cond"))
    pipe.close()


def _check(mp4: bytes, tmp_path, name: str, width: int = 320, height: int = 256) -> None:
    path = tmp_path / name
    path.write_bytes(mp4)
    check_mp4(path, expect_frames=124, fps=24, width=width, height=height, sample_rate=32000, channels=2)
    probe = ffprobe_report(path)   # the system ffprobe, a decoder independent of our writer
    assert (probe.video_codec, probe.pix_fmt, probe.width, probe.height, probe.frames) == \
        ("h264", "yuv420p", width, height, 124), probe
    assert (probe.audio_codec, probe.sample_rate, probe.channels) == ("aac", 32000, 2), probe


def test_fl2va_grpc_multipart_and_data_urls_equal_embedded(cond_stack, embedded_cond, media, tmp_path):
    expected = embedded_cond(**BASE, first_image=media["first.png"], last_image=media["last.png"])
    with Client(cond_stack.grpc, timeout=120) as client:
        gen = client.stream(**BASE, first_image=FIRST, last_image=media["last.png"])   # bytes and a path
        events = list(gen)
        result = gen.result()
    assert result.mp4 == expected
    assert events[0].task == "fl2va"
    _check(result.mp4, tmp_path, "grpc.mp4")
    form = {k: str(v) for k, v in BASE.items()}
    with httpx.Client(base_url=cond_stack.http, timeout=120) as http:
        r = http.post("/v1/videos/sync", data=form,
                      files={"input_reference": ("first.png", FIRST, "image/png"),
                             "last_image": ("last.png", LAST, "image/png")})
        assert r.status_code == 200, r.text[:300]
        assert r.content == expected
        body = dict(BASE, input_reference=data_url(FIRST, "image/png"), last_image=data_url(LAST, "image/png"))
        r = http.post("/v1/videos/sync", json=body)
        assert r.status_code == 200, r.text[:300]
        assert r.content == expected


def test_fl2va_canvas_follows_the_keyframe(cond_stack, embedded_cond, media):
    """With no size, the canvas follows the first keyframe's aspect (3:2 here), as the embedded request does."""
    fields = {k: v for k, v in BASE.items() if k != "size"}
    with Client(cond_stack.grpc, timeout=30) as client:
        accepted = client.validate(**fields, first_image=FIRST)
    from h3serve.config.request import validate_request

    want = validate_request(**embedded_request(**fields, first_image=media["first.png"]))
    assert (accepted.width, accepted.height) == (want.width, want.height) == (1152, 768)


def test_ref2va_grpc_and_multipart_equal_embedded(cond_stack, embedded_cond, media, tmp_path):
    expected = embedded_cond(**BASE, references=[f"image:{media['subject.png']}", f"audio:{media['voice.wav']}"])
    with Client(cond_stack.grpc, timeout=120) as client:
        result = client.generate_sync(**BASE, references=[("image", SUBJECT), ("audio", VOICE)])
    assert result.mp4 == expected
    assert result.timings["conditions_s"] > 0
    _check(result.mp4, tmp_path, "ref.mp4")
    form = {k: str(v) for k, v in BASE.items()}
    with httpx.Client(base_url=cond_stack.http, timeout=120) as http:
        r = http.post("/v1/videos", data=form, files=[("image_reference", ("s.png", SUBJECT, "image/png")),
                                                      ("audio_reference", ("v.wav", VOICE, "audio/wav"))])
        assert r.status_code == 200, r.text[:300]
        job = r.json()
        assert job["task"] == "ref2va"
        import time

        end = time.monotonic() + 120
        while job["status"] not in ("completed", "failed") and time.monotonic() < end:
            time.sleep(0.1)
            job = http.get(f"/v1/videos/{job['id']}").json()
        assert job["status"] == "completed", job
        assert http.get(f"/v1/videos/{job['id']}/content").content == expected


def _big_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4100, 4100)).save(buf, format="PNG")   # 16.8 MP > the 4096x4096 bound; compresses small
    return buf.getvalue()


BAD_UPLOADS = [
    ("corrupt image", {"input_reference": ("a.png", b"\x89PNG not really", "image/png")}, {}, "input_reference"),
    ("truncated image", {"input_reference": ("a.png", FIRST[:200], "image/png")}, {}, "input_reference"),
    ("too many pixels", {"input_reference": ("big.png", _big_png(), "image/png")}, {}, "input_reference"),
    ("tiny image", {"input_reference": ("t.png", png(8, 8, 0), "image/png")}, {}, "input_reference"),
    ("audio 44.1 kHz", {"image_reference": ("s.png", SUBJECT, "image/png"),
                        "audio_reference": ("v.wav", wav(1.0, rate=44100), "audio/wav")}, {}, "audio_reference"),
    ("audio too long", {"image_reference": ("s.png", SUBJECT, "image/png"),
                        "audio_reference": ("v.wav", wav(61.0), "audio/wav")}, {}, "audio_reference"),
    ("audio only", {"audio_reference": ("v.wav", VOICE, "audio/wav")}, {}, "references"),
    ("not audio", {"image_reference": ("s.png", SUBJECT, "image/png"),
                   "audio_reference": ("v.wav", b"RIFFnope", "audio/wav")}, {}, "audio_reference"),
    ("corrupt video", {"video_reference": ("c.mp4", b"\x00" * 64, "video/mp4")}, {}, "video_reference"),
    ("video too short", {"video_reference": ("c.mp4", clip(frames=20), "video/mp4")}, {}, "video_reference"),
    ("video frame too large", {"video_reference": ("c.mp4", clip(frames=1, size=(4096, 2176), sound_rate=None),
                                                   "video/mp4")}, {}, "video_reference"),
    ("video too long", {"video_reference": ("c.mp4", clip(frames=62, fps=1, size=(16, 16), sound_rate=None),
                                            "video/mp4")}, {}, "video_reference"),
    ("video fps too high", {"video_reference": ("c.mp4", clip(frames=30, fps=250, sound_rate=None),
                                                "video/mp4")}, {}, "video_reference"),
    ("soundtrack 44.1 kHz", {"video_reference": ("c.mp4", clip(sound_rate=44100), "video/mp4")}, {},
     "video_reference"),
    ("file in a text field", {"prompt": ("p.txt", b"a kite", "text/plain")}, {"seconds": "5"}, "prompt"),
    ("keyframe with task t2va", {"input_reference": ("a.png", FIRST, "image/png")},
     {"extra_params": '{"task": "t2va"}'}, "input_reference"),
]


@pytest.mark.parametrize("name,files,extra,field", BAD_UPLOADS, ids=[b[0] for b in BAD_UPLOADS])
def test_bad_uploads_are_4xx_naming_the_field(cond_stack, name, files, extra, field):
    form = {k: str(v) for k, v in BASE.items() if k not in extra and k not in files}
    form.update(extra)
    before = cond_stack.status("vae").requests_total
    with httpx.Client(base_url=cond_stack.http, timeout=60) as http:
        r = http.post("/v1/videos", data=form, files=list(files.items()))
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert field in (err["param"] or "") or field in err["message"], err
    assert cond_stack.status("vae").requests_total == before   # refused before any model work


@pytest.mark.parametrize("body,field", [
    ({"input_reference": "https://example.com/a.png"}, "input_reference"),
    ({"input_reference": "data:image/png;base64,@@@"}, "input_reference"),
    ({"image_reference": [data_url(SUBJECT, "image/png")] * 10}, "image_reference"),
    ({"input_reference": data_url(FIRST, "image/png"), "extra_params": {"task": "ref2va"},
      "audio_reference": data_url(b"junk", "audio/wav")}, "audio_reference[0]"),
], ids=["remote url", "bad base64", "ten images", "bad audio data url"])
def test_bad_json_media_are_4xx_naming_the_field(cond_stack, body, field):
    with httpx.Client(base_url=cond_stack.http, timeout=60) as http:
        r = http.post("/v1/videos", json=dict(BASE, **body))
    assert 400 <= r.status_code < 500, r.text[:300]
    err = r.json()["error"]
    assert field.split("[")[0] in (err["param"] or "") + err["message"], err


def test_grpc_bad_keyframe_is_invalid_argument(cond_stack):
    with Client(cond_stack.grpc, timeout=30) as client:
        with pytest.raises(RequestError) as info:
            client.generate(**BASE, first_image=b"not an image")
        assert info.value.field == "first_image"
        with pytest.raises(RequestError) as info:
            client.generate(**BASE, references=[("image", SUBJECT), ("video", b"\x00" * 16)])
        assert info.value.field == "references[1]" and "a readable video file" in str(info.value)
        with pytest.raises(RequestError) as info:
            client.generate(**BASE, references=[("video", clip(frames=20))])
        assert info.value.field == "references[0]" and "at least 22 frames at 24 fps" in str(info.value)


def test_video_reference_admitted_from_grpc_multipart_and_data_url(cond_stack):
    """A video reference as gRPC bytes, a multipart file and a JSON data URL: decoded and bounded at the front door
    (validate_only: decoded, not generated), the request aligned as ref2va. The generated output of a video-referenced
    request is checked against diffusers and by ffprobe in tests/conformance/test_pipeline.py."""
    with Client(cond_stack.grpc, timeout=60) as client:
        accepted = client.validate(**BASE, references=[("video", CLIP), ("image", SUBJECT)])
    assert (accepted.task, accepted.num_frames) == ("ref2va", 124)
    form = {k: str(v) for k, v in BASE.items()}
    with httpx.Client(base_url=cond_stack.http, timeout=60) as http:
        r = http.post("/v1/videos", params={"validate_only": "true"}, data=form,
                      files=[("video_reference", ("c.mp4", CLIP, "video/mp4"))])
        assert r.status_code == 200, r.text[:300]
        assert r.json()["task"] == "ref2va"
        r = http.post("/v1/videos", params={"validate_only": "true"},
                      json=dict(BASE, video_reference=[data_url(CLIP, "video/mp4")],
                                image_reference=data_url(SUBJECT, "image/png")))
        assert r.status_code == 200, r.text[:300]
        assert r.json()["task"] == "ref2va"
        r = http.post("/v1/videos", json=dict(BASE, video_reference="https://example.com/c.mp4"))
        assert 400 <= r.status_code < 500 and "fetches no URL" in r.json()["error"]["message"], r.text[:300]


def test_openai_sdk_input_reference_upload_is_the_first_frame(cond_stack, embedded_cond, media):
    """The official SDK's multipart upload (`input_reference`) runs fl2va with it as the first keyframe."""
    import openai

    expected = embedded_cond(**BASE, first_image=media["first.png"])
    sdk = openai.OpenAI(base_url=f"{cond_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        with pytest.warns(DeprecationWarning):
            video = sdk.videos.create_and_poll(
                prompt=BASE["prompt"], size=BASE["size"], seconds="5",
                input_reference=("first.png", FIRST, "image/png"),
                extra_body={"seed": BASE["seed"], "num_inference_steps": BASE["num_inference_steps"]},
                poll_interval_ms=100)
            assert video.status == "completed", video
            assert sdk.videos.download_content(video.id).read() == expected
    finally:
        sdk.close()


def test_cli_generate_server_sends_the_reference_files(cond_stack, embedded_cond, media, tmp_path):
    import os
    import subprocess
    import sys

    from .conftest import REPO

    expected = embedded_cond(**BASE, references=[f"image:{media['subject.png']}", f"audio:{media['voice.wav']}"])
    out = tmp_path / "cli.mp4"
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--server", cond_stack.grpc, "--prompt",
                        BASE["prompt"], "--task", "ref2va", "--seconds", "5", "--size", "320x256", "--seed", "3",
                        "--steps", "3", "--reference", f"image:{media['subject.png']}", "--reference",
                        media["voice.wav"], "--no-progress", "--json", "-o", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == expected
