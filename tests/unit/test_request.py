"""GenerationRequest validation: frame/latent/audio arithmetic, canvas rules, profile rules, error fields."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from h3serve.config.vocab import DEFAULT_DTYPE
from h3serve.errors import ProfileError, RequestError
from h3serve.config.geometry import (
    CANVAS_MAX_PIXELS,
    Canvas,
    audio_latents_for_frames,
    check_latents,
    frames_for_seconds,
    latents_to_num_frames,
    num_frames_to_latents,
    within_reference_duration,
)
from h3serve.config.request import GenerationRequest, ReferenceSpec, canvas_for_aspect, validate_request


@pytest.fixture(scope="module")
def media_files(tmp_path_factory):
    """A 300x200 PNG, a second PNG, a (fake) video and a (fake) audio file; references are checked for existence."""
    from PIL import Image

    root = tmp_path_factory.mktemp("media")
    wide, tall = root / "wide.png", root / "tall.png"
    Image.new("RGB", (300, 200), (10, 200, 30)).save(wide)
    Image.new("RGB", (200, 400), (200, 10, 30)).save(tall)
    video, audio, junk = root / "clip.mp4", root / "voice.wav", root / "notes.txt"
    for path in (video, audio, junk):
        path.write_bytes(b"\0" * 16)
    return dict(wide=str(wide), tall=str(tall), video=str(video), audio=str(audio), junk=str(junk),
                missing=str(root / "missing.png"))


# ------------------------------------------------------------------------------------------------ arithmetic

@pytest.mark.parametrize(
    "seconds, frames, latents, audio_latents",
    [
        (5, 124, 37, 207),      # 124/24*40 = 206.67
        (10, 243, 72, 405),     # 243/24*40 = 405.00
        (14, 345, 102, 575),    # 336 -> 345; 345/24*40 = 575.00
        (14.375, 345, 102, 575),  # 345 frames: the longest the reference generates
        (4.5, 124, 37, 207),    # 108 -> next 17n+5 is 124: the shortest request
        (7.1, 175, 52, 292),    # round(170.4) = 170 -> 175; 175/24*40 = 291.67
    ],
)
def test_good_durations(seconds, frames, latents, audio_latents):
    request = validate_request(prompt="a red fox runs through snow", seconds=seconds, seed=7)
    assert (request.num_frames, request.latent_frames, request.audio_latents) == (frames, latents, audio_latents)
    assert request.num_frames % 17 == 5
    assert request.audio_latents == round(frames / 24 * 40)
    assert request.audio_samples == audio_latents * 800
    assert request.t_media == pytest.approx(frames / 24)
    assert request.seconds == seconds
    assert frames_for_seconds(seconds) == frames
    assert num_frames_to_latents(frames) == latents
    assert audio_latents_for_frames(frames) == audio_latents


def test_one_dtype_default():
    import inspect

    from h3serve.cli import build_parser
    from h3serve.config.stage import StageConfig
    from h3serve.pipeline import Pipeline

    parser = build_parser()
    assert validate_request(prompt="p").dtype == GenerationRequest(prompt="p").dtype == DEFAULT_DTYPE
    assert StageConfig().model.dtype == inspect.signature(Pipeline.load).parameters["dtype"].default == DEFAULT_DTYPE
    assert parser.parse_args(["serve"]).dtype == DEFAULT_DTYPE
    assert parser.parse_args(["generate", "--prompt", "p", "-o", "x.mp4"]).dtype == DEFAULT_DTYPE


def test_defaults():
    request = validate_request(prompt="a cat", seed=1)
    assert request == GenerationRequest(prompt="a cat", seed=1)
    assert (request.task, request.profile, request.dtype, request.fps) == ("t2va", "base", DEFAULT_DTYPE, 24)
    assert (request.width, request.height) == (1344, 768)
    assert (request.latent_width, request.latent_height) == (84, 48)
    assert (request.steps, request.num_forwards) == (50, 49)
    assert (request.num_frames, request.latent_frames, request.audio_latents) == (124, 37, 207)
    random_seed = validate_request(prompt="a cat").seed
    assert 0 <= random_seed <= 2**63 - 1
    assert request.to_dict()["num_frames"] == 124


def test_num_frames_to_latents_rejects_unaligned():
    with pytest.raises(RequestError) as info:
        num_frames_to_latents(120)
    assert info.value.field == "num_frames"


def test_latent_geometry_is_checked_by_the_geometry_module():
    for seconds in (5, 10, 14):
        frames = frames_for_seconds(seconds)
        latents = num_frames_to_latents(frames)
        assert latents_to_num_frames(latents) == frames
        check_latents(latents, audio_latents_for_frames(frames), 48, 84)
    for args, field in (((36, 207, 48, 84), "latent_frames"), ((32, 178, 48, 84), "latent_frames"),
                        ((37, 206, 48, 84), "audio_latents"), ((37, 207, 1, 84), "latent_height"),
                        ((37, 207, 48, 513), "latent_width")):
        with pytest.raises(RequestError) as info:
            check_latents(*args)
        assert info.value.field == field


@pytest.mark.parametrize(
    "aspect, canvas",
    [((16, 9), (1344, 768)), ("9:16", (768, 1344)), (1.0, (768, 768)), ("4:3", (1024, 768)),
     ((4, 1), (2016, 512)), ("1:4", (512, 2016)), ((9, 5), (1376, 768)), ((300, 200), (1152, 768)),
     ((200, 400), (704, 1440))],
)
def test_canvas_for_aspect(aspect, canvas):
    assert canvas_for_aspect(aspect) == Canvas(*canvas)


def test_canvas_matches_reference_resolve_canvas_size():
    reference = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.modular_pipeline")
    for w in range(1, 40):
        for h in range(1, 40):
            if not 0.25 <= w / h <= 4:
                continue
            ref_h, ref_w = reference.resolve_canvas_size(w, h, 32, 768, 768 * 1344)
            assert canvas_for_aspect((w, h)) == (ref_w, ref_h), (w, h)
    pipeline = reference.MiniMaxH3ModularPipeline
    low, high = pipeline.min_duration.fget(None), pipeline.max_duration.fget(None)
    for frames in (107, 124, 243, 345, 362):
        assert within_reference_duration(frames) == (low <= frames / 24 <= high), frames
    assert [within_reference_duration(f) for f in (107, 124, 345, 362)] == [False, True, True, False]
    for requested in range(1, 400):
        aligned = reference.align_num_frames(requested, 17, 5)
        accepted = low <= aligned / 24 <= high   # the reference's check, on the rounded count
        try:
            validate_request(prompt="p", num_frames=requested, seed=0)
            ours = True
        except RequestError:
            ours = False
        assert ours == accepted, requested
    for requested in range(96, 361):
        assert frames_for_seconds(requested / 24) == reference.align_num_frames(requested, 17, 5)
        frames = reference.align_num_frames(requested, 17, 5)
        assert num_frames_to_latents(frames) == reference.video_latent_num_frames(frames, 17, 5)
        assert audio_latents_for_frames(frames) == reference.audio_latent_num_frames(frames)


def test_canvas_for_aspect_rejects_extreme():
    with pytest.raises(RequestError) as info:
        canvas_for_aspect("5:1")
    assert info.value.field == "aspect"


# ------------------------------------------------------------------------------------------------ good requests

def test_size_forms():
    a = validate_request(prompt="p", size="768x1344", seed=0)
    b = validate_request(prompt="p", width=768, height=1344, seed=0)
    c = validate_request(prompt="p", size=" 768X1344 ", seed=0)
    d = validate_request(prompt="p", width="768", height="1344", seed=0)
    assert a == b == c == d and (a.width, a.height, a.latent_width, a.latent_height) == (768, 1344, 48, 84)
    e = validate_request(prompt="p", size="2016x512", seed=0)                    # 4:1, area exactly the cap
    assert (e.width, e.height) == (2016, 512)

def test_one_side_and_aspect():
    assert (validate_request(prompt="p", width=768).height) == 448            # 768 / (16/9) = 432 -> 448
    assert (validate_request(prompt="p", height=768).width) == 1344           # 1365.3 -> 1376 is over the cap
    assert (validate_request(prompt="p", height=512).width) == 896            # 512 * 16/9 = 910.2 -> 896
    r = validate_request(prompt="p", aspect="9:16")
    assert (r.width, r.height) == (768, 1344)


def test_steps_and_profiles():
    assert validate_request(prompt="p", steps=2).num_forwards == 1
    assert validate_request(prompt="p", steps="1000").steps == 1000
    fast = validate_request(prompt="p", profile="fasth3")
    assert (fast.steps, fast.num_forwards, fast.task) == (5, 4, "t2va")
    assert validate_request(prompt="p", profile="FastH3", steps=5).steps == 5
    assert validate_request(prompt="p", dtype="float32").dtype == "fp32"
    assert validate_request(prompt="p", num_frames=240).num_frames == 243


def test_fl2va(media_files):
    r = validate_request(prompt="p", first_image=media_files["wide"])
    assert r.task == "fl2va" and (r.width, r.height) == (1152, 768)            # canvas from the 3:2 keyframe
    r = validate_request(prompt="p", task="fl2va", last_image=media_files["tall"])
    assert (r.width, r.height) == (704, 1440) and r.first_image is None       # 1:2, capped to the canvas max
    r = validate_request(prompt="p", first_image=media_files["wide"], last_image=media_files["tall"], size="1344x768")
    assert (r.width, r.height) == (1344, 768)


def test_ref2va(media_files):
    r = validate_request(prompt="p", references=[media_files["wide"], {"kind": "video", "path": media_files["video"],
                                                                     "fps": 30}, "audio:" + media_files["audio"]])
    assert r.task == "ref2va" and (r.width, r.height) == (1344, 768)
    assert r.references == (ReferenceSpec("image", media_files["wide"]),
                            ReferenceSpec("video", media_files["video"], fps=30.0),
                            ReferenceSpec("audio", media_files["audio"]))
    assert len(validate_request(prompt="p", references=[media_files["wide"]] * 9 + [media_files["video"]] * 3)
               .references) == 12


# ------------------------------------------------------------------------------------------------ bad requests

BAD = [
    ("seconds 3.9", dict(seconds=3.9), "seconds"),
    ("seconds 4 (107 frames)", dict(seconds=4), "seconds"),
    ("seconds 15 (362 frames)", dict(seconds=15), "seconds"),
    ("seconds 15.1", dict(seconds=15.1), "seconds"),
    ("seconds 0", dict(seconds=0), "seconds"),
    ("seconds -5", dict(seconds=-5), "seconds"),
    ("num_frames 107", dict(num_frames=107), "num_frames"),
    ("num_frames 346", dict(num_frames=346), "num_frames"),
    ("seconds abc", dict(seconds="abc"), "seconds"),
    ("seconds nan", dict(seconds=float("nan")), "seconds"),
    ("seconds bool", dict(seconds=True), "seconds"),
    ("num_frames 361", dict(num_frames=361), "num_frames"),
    ("seconds and num_frames", dict(seconds=5, num_frames=124), "num_frames"),
    ("size 250x256", dict(size="250x256"), "size"),
    ("size 256x250", dict(size="256x250"), "size"),
    ("size 4096x256", dict(size="4096x256"), "size"),
    ("size 0x256", dict(size="0x256"), "size"),
    ("size 8224x32", dict(size="8224x32"), "size"),
    ("size area", dict(size="1376x768"), "size"),
    ("size garbage", dict(size="1344by768"), "size"),
    ("size and width", dict(size="768x768", width=768), "size"),
    ("width 250", dict(width=250, height=256), "width"),
    ("height 8224", dict(width=32, height=8224), "height"),
    ("width float", dict(width=512.5, height=512), "width"),
    ("one side too big", dict(width=2048), "width"),
    ("prompt empty", dict(prompt=""), "prompt"),
    ("prompt blank", dict(prompt="   \n"), "prompt"),
    ("prompt list", dict(prompt=["a", "b"]), "prompt"),
    ("prompt missing", dict(prompt=None), "prompt"),
    ("prompt too long", dict(prompt="x" * 20_001), "prompt"),
    ("prompt NUL", dict(prompt="a\x00b"), "prompt"),
    ("seed -1", dict(seed=-1), "seed"),
    ("seed 2**63", dict(seed=2**63), "seed"),
    ("seed text", dict(seed="lucky"), "seed"),
    ("seed bool", dict(seed=True), "seed"),
    ("steps 1", dict(steps=1), "steps"),
    ("steps 1001", dict(steps=1001), "steps"),
    ("fasth3 steps 10", dict(profile="fasth3", steps=10), "steps"),
    ("fasth3 fl2va", dict(profile="fasth3", task="fl2va", first_image="IMAGE"), "task"),
    ("fasth3 ref2va", dict(profile="fasth3", references=["IMAGE"]), "task"),
    ("profile turbo", dict(profile="turbo"), "profile"),
    ("task i2v", dict(task="i2v"), "task"),
    ("fps 30", dict(fps=30), "fps"),
    ("dtype fp16", dict(dtype="fp16"), "dtype"),
    ("fl2va without images", dict(task="fl2va"), "first_image"),
    ("fl2va missing image", dict(first_image="MISSING"), "first_image"),
    ("fl2va missing last image", dict(first_image="IMAGE", last_image="MISSING"), "last_image"),
    ("fl2va not an image", dict(first_image="JUNK"), "first_image"),
    ("t2va with keyframe", dict(task="t2va", first_image="IMAGE"), "first_image"),
    ("ref2va without references", dict(task="ref2va"), "references"),
    ("ref2va empty", dict(references=[]), "references"),
    ("ref2va 13", dict(references=["IMAGE"] * 9 + ["VIDEO"] * 3 + ["AUDIO"]), "references"),
    ("ref2va 10 images", dict(references=["IMAGE"] * 10), "references"),
    ("ref2va 4 videos", dict(references=["VIDEO"] * 4), "references"),
    ("ref2va audio only", dict(references=["AUDIO"]), "references"),
    ("ref2va missing", dict(references=["MISSING"]), "references"),
    ("ref2va unknown kind", dict(references=["JUNK"]), "references"),
    ("ref2va fps on image", dict(references=[{"kind": "image", "path": "IMAGE", "fps": 24}]), "references"),
    ("ref2va string", dict(references="IMAGE"), "references"),
    ("references on t2va", dict(task="t2va", references=["IMAGE"]), "references"),
    ("unknown field", dict(guidance_scale=5.0), "guidance_scale"),
]


@pytest.mark.parametrize("raw, field", [pytest.param(raw, field, id=name) for name, raw, field in BAD])
def test_bad_requests(raw, field, media_files):
    tokens = {"IMAGE": media_files["wide"], "VIDEO": media_files["video"], "AUDIO": media_files["audio"],
              "MISSING": media_files["missing"], "JUNK": media_files["junk"]}

    def resolve(value):
        if isinstance(value, str):
            return tokens.get(value, value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    raw = {"prompt": "a lighthouse at dusk", **{k: resolve(v) for k, v in raw.items()}}
    with pytest.raises(RequestError) as info:
        validate_request(**raw)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field}=") and "\n" not in message and len(message) < 400


def test_canvas_is_the_references_multiple_of_32():
    """The reference accepts any multiple of 32 (320x192, 2048x256, 32x32); we add only the area and side caps."""
    for size in ("320x192", "2048x256", "32x32", "192x320", "8192x96"):
        w, h = map(int, size.split("x"))
        r = validate_request(prompt="p", size=size, seed=0)
        assert (r.width, r.height) == (w, h)
        assert (r.latent_width, r.latent_height) == (w // 16, h // 16)
    with pytest.raises(RequestError, match="multiple of 32"):
        validate_request(prompt="p", size="336x192")


def test_area_message_names_the_canvas_max():
    with pytest.raises(RequestError, match="1,032,192.*canvas max"):
        validate_request(prompt="p", size="1376x768")
    assert 1376 * 768 > CANVAS_MAX_PIXELS >= 1344 * 768


# ------------------------------------------------------------------------------------------------ property

_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-5, 3000), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=4),
    st.sampled_from(["t2va", "fl2va", "ref2va", "base", "fasth3", "bf16", "fp32", "1344x768", "768x768", "16:9",
                     "5", "15.5", "abc", "x", "IMAGE", "AUDIO", "image:IMAGE", 5, 10.0, 24, 50, 768, 1344]),
    st.lists(st.one_of(st.sampled_from(["IMAGE", "VIDEO", "AUDIO", "nope.png"]), st.integers(), st.none(),
                       st.fixed_dictionaries({"kind": st.sampled_from(["image", "video", "audio", "x"]),
                                              "path": st.sampled_from(["IMAGE", "VIDEO", "AUDIO"])})),
             max_size=14),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


_sides = st.sampled_from([256, 512, 768, 1024, 1344, 1376, 2048, 250, 4096])
_plausible = {
    "prompt": st.sampled_from(["a quiet harbour at dawn", "x" * 300, "", "\x00"]),
    "task": st.sampled_from(["t2va", "fl2va", "ref2va", "T2VA"]),
    "profile": st.sampled_from(["base", "fasth3"]),
    "seconds": st.floats(3.5, 15.5),
    "num_frames": st.integers(90, 370),
    "width": _sides,
    "height": _sides,
    "size": st.builds(lambda w, h: f"{w}x{h}", _sides, _sides),
    "aspect": st.sampled_from(["16:9", "9:16", "1:1", "5:1", (4, 3), 2.0]),
    "seed": st.integers(-1, 2**64),
    "steps": st.integers(0, 1100),
    "fps": st.sampled_from([24, 25, "24"]),
    "first_image": st.sampled_from(["IMAGE", "nope.png"]),
    "last_image": st.sampled_from(["IMAGE", "nope.png"]),
    "references": st.lists(st.sampled_from(["IMAGE", "VIDEO", "AUDIO"]), max_size=13),
    "dtype": st.sampled_from(["bf16", "fp32", "fp16"]),
    "bogus": st.just(1),
}


@st.composite
def _raw(draw):
    """A few fields, each either a plausible value (mostly) or an arbitrary one."""
    keys = draw(st.lists(st.sampled_from(sorted(set(_plausible) - {"bogus"})), max_size=6, unique=True))
    raw = {key: draw(st.one_of(_plausible[key], _plausible[key], _plausible[key], _values)) for key in keys}
    if draw(st.integers(0, 9)) == 0:
        raw["bogus"] = draw(_values)
    if "prompt" not in raw and draw(st.integers(0, 9)) > 0:
        raw["prompt"] = "a quiet harbour at dawn"
    return raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=_raw())
def test_any_dict_is_a_request_or_a_request_error(raw, media_files):
    tokens = {"IMAGE": media_files["wide"], "VIDEO": media_files["video"], "AUDIO": media_files["audio"]}

    def resolve(value):
        if isinstance(value, str):
            return tokens.get(value, value.replace("IMAGE", media_files["wide"]))
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    raw = {k: resolve(v) for k, v in raw.items()}
    try:
        request = validate_request(**raw)
    except (RequestError, ProfileError) as err:
        assert "\n" not in str(err)
        event(f"refused: {getattr(err, 'field', 'profile')}")
        return
    event(f"valid: {request.task}")
    assert isinstance(request, GenerationRequest)
    assert request.num_frames % 17 == 5 and 124 <= request.num_frames <= 345
    assert request.latent_frames == num_frames_to_latents(request.num_frames)
    assert request.audio_latents == round(request.num_frames / 24 * 40)
    assert request.width % 32 == 0 and request.height % 32 == 0
    assert 32 <= request.width <= 8192 and 32 <= request.height <= 8192
    assert request.width * request.height <= 1.1 * CANVAS_MAX_PIXELS   # a derived canvas rounds a little over
    assert 0 <= request.seed <= 2**63 - 1 and math.isfinite(request.seconds)
    assert request.task in ("t2va", "fl2va", "ref2va") and request.profile in ("base", "fasth3")
    if request.profile == "fasth3":
        assert request.task == "t2va" and request.steps == 5
    else:
        assert 2 <= request.steps <= 1000
