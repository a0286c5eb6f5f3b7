"""The embedded pipeline against diffusers' MiniMaxH3ModularPipeline on the same tiny checkpoint and seed (fp32).

Final video + audio latents of T2VA (base), FL2VA (first + last keyframe), REF2VA (image + audio; videos with and
without a soundtrack beside an image) and FastH3 within 1e-4, and decoded frames within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.config.request import validate_request

STEPS = 4  # grid points incl. the terminal 0 -> 3 forwards; enough to exercise every schedule path
W, H = 320, 256  # deliberately non-square: two VAE tiles across the width


def reference_pipeline(ckpt, workflow):
    from h3serve.testing.tiny import reference_pipeline as build

    return build(ckpt, workflow=workflow)


def reference_fuse_into(transformer, adapter_path):
    """W + B.A + diff, b + diff_b in fp32, written independently of h3serve.weights.adapter."""
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_path))
    params = dict(transformer.named_parameters())
    modules = {k.rsplit(".lora_A.weight", 1)[0] for k in tensors if k.endswith(".lora_A.weight")}
    modules |= {k[: -len(".diff")] for k in tensors if k.endswith(".diff")}
    modules |= {k[: -len(".diff_b")] for k in tensors if k.endswith(".diff_b")}
    with torch.no_grad():
        for m in modules:
            w = params[f"{m}.weight"]
            delta = torch.zeros_like(w, dtype=torch.float32)
            if f"{m}.lora_A.weight" in tensors:
                delta += tensors[f"{m}.lora_B.weight"].float() @ tensors[f"{m}.lora_A.weight"].float()
            if f"{m}.diff" in tensors:
                delta += tensors[f"{m}.diff"].float()
            w.copy_((w.float() + delta).to(w.dtype))
            if f"{m}.diff_b" in tensors:
                b = params[f"{m}.bias"]
                b.copy_((b.float() + tensors[f"{m}.diff_b"].float()).to(b.dtype))


def run_reference(pipe, **kwargs):
    out = pipe(num_frames=124, height=H, width=W, generator=torch.Generator("cpu").manual_seed(7),
               output_type="np", output=["latents", "audio_latents", "videos", "audio"], **kwargs)
    return out


@pytest.fixture(scope="module")
def ours_base(tiny_checkpoint):
    from h3serve.pipeline import Pipeline

    return Pipeline.load(tiny_checkpoint, profile="base", dtype="fp32", device="cpu", tasks=("t2va", "fl2va"))


def _request(**kw):
    base = dict(prompt="a kite over the sea at dusk", seconds=5, size=f"{W}x{H}", seed=7, steps=STEPS)
    base.update(kw)
    return validate_request(**base)


def test_t2va_latents_and_frames_match_reference(tiny_checkpoint, ours_base):
    ref = run_reference(reference_pipeline(tiny_checkpoint, "t2va"), prompt="a kite over the sea at dusk",
                        num_inference_steps=STEPS)
    req = _request()
    lat = ours_base.generate_latents(req)
    assert lat.video.shape == ref["latents"].shape
    torch.testing.assert_close(lat.video, ref["latents"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lat.audio, ref["audio_latents"], atol=1e-4, rtol=0)
    frames = ours_base.decode_video_float(lat.video)          # (F, H, W, 3) in [0, 1]
    ref_frames = torch.as_tensor(np.asarray(ref["videos"][0]))
    assert frames.shape == ref_frames.shape == (124, H, W, 3)
    assert (frames - ref_frames).abs().max().item() <= 1e-4
    pcm = ours_base.decode_audio(lat.audio)                   # (2, N)
    torch.testing.assert_close(pcm, ref["audio"][0].float(), atol=1e-4, rtol=0)


def test_fl2va_latents_match_reference(tiny_checkpoint, ours_base, tmp_path):
    rng = np.random.default_rng(3)
    first = Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    last = Image.fromarray(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8))  # other aspect: cover-cropped
    first.save(tmp_path / "first.png")
    last.save(tmp_path / "last.png")
    ref = run_reference(reference_pipeline(tiny_checkpoint, "fl2va"), prompt="a kite over the sea at dusk",
                        image=first, last_image=last, num_inference_steps=STEPS)
    req = _request(task="fl2va", first_image=str(tmp_path / "first.png"), last_image=str(tmp_path / "last.png"))
    lat = ours_base.generate_latents(req)
    torch.testing.assert_close(lat.video, ref["latents"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lat.audio, ref["audio_latents"], atol=1e-4, rtol=0)


def test_fasth3_latents_match_reference(tiny_checkpoint, tiny_adapter):
    from h3serve.pipeline import Pipeline
    from h3serve.models.dit.scheduler import fasth3_grid

    adapter_path, sha = tiny_adapter.path, tiny_adapter.sha256
    ours = Pipeline.load(tiny_checkpoint, profile="fasth3", adapter=adapter_path, adapter_sha256=sha,
                         dtype="fp32", device="cpu", tasks=("t2va",))
    pipe = reference_pipeline(tiny_checkpoint, "t2va")
    reference_fuse_into(pipe.transformer, adapter_path)  # independent W + B.A + diff
    for sched, shift in ((pipe.scheduler, 12.0), (pipe.audio_scheduler, 3.0)):
        sigmas = fasth3_grid(shift)
        original = sched.set_timesteps
        sched.set_timesteps = lambda n=None, device=None, _o=original, _s=sigmas: _o(sigmas=_s, device=device)
    ref = run_reference(pipe, prompt="a kite over the sea at dusk", num_inference_steps=5)
    lat = ours.generate_latents(_request(profile="fasth3", steps=None))
    torch.testing.assert_close(lat.video, ref["latents"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lat.audio, ref["audio_latents"], atol=1e-4, rtol=0)


def _write_wav(path, pcm, rate=32000):
    """(C, N) float in [-1, 1] -> 16-bit PCM WAV, with PyAV."""
    import av

    data = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    with av.open(str(path), "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout="stereo" if data.shape[0] == 2 else "mono")
        frame = av.AudioFrame.from_ndarray(data.T.reshape(1, -1).copy(), format="s16",
                                           layout="stereo" if data.shape[0] == 2 else "mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def test_ref2va_latents_match_reference(copy_checkpoint, tmp_path):
    """An image reference (encoded at its own short-edge canvas) and a mono 32 kHz voice reference.

    The checkpoint's pipeline config sets the reference short edge (2048 released); this copy says 512, which both
    sides read, so the test exercises the same rule at a CPU-friendly size.
    """
    import json

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    from h3serve.pipeline import Pipeline

    tiny_checkpoint = copy_checkpoint()
    index_path = tiny_checkpoint / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    index["reference_image_short_edge"] = 512
    index_path.write_text(json.dumps(index))

    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "subject.png")
    t = np.arange(int(1.3 * 32000)) / 32000
    _write_wav(tmp_path / "voice.wav", (0.3 * np.sin(2 * np.pi * 220 * t))[None])

    refs = [MiniMaxH3ImageReference.from_file(str(tmp_path / "subject.png")),
            MiniMaxH3AudioReference.from_file(str(tmp_path / "voice.wav"))]
    ref = run_reference(reference_pipeline(tiny_checkpoint, "ref2va"), prompt="the subject sings",
                        references=refs, num_inference_steps=3)
    ours = Pipeline.load(tiny_checkpoint, dtype="fp32", device="cpu", tasks=("ref2va",))
    req = _request(prompt="the subject sings", task="ref2va", steps=3,
                   references=[f"image:{tmp_path / 'subject.png'}", f"audio:{tmp_path / 'voice.wav'}"])
    lat = ours.generate_latents(req)
    torch.testing.assert_close(lat.video, ref["latents"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lat.audio, ref["audio_latents"], atol=1e-4, rtol=0)



# The canvas rule reference videos are put on, scaled down 12x from 768 / 768x1344 so that their VAE encode runs
# in seconds on a CPU; both sides read it (diffusers from its pipeline config, h3serve from media.video). The rule
# itself at its released values is checked against diffusers in tests/unit/test_video_reference.py.
SMALL_CANVAS_RULE = (64, 64 * 112)


def test_ref2va_video_references_match_reference(copy_checkpoint, tmp_path, monkeypatch):
    """Two video references - one 30 fps with a stereo 32 kHz soundtrack (resampled onto 24 fps by holding frames),
    one 24 fps without sound - and an image reference between them, against diffusers' modular pipeline with
    Qwen3-VL's own video processor. Each side decodes the files with its own decoder (diffusers' `from_file`).
    """
    import json

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference, MiniMaxH3VideoReference

    import h3serve.media.video as media_video
    from h3serve.pipeline import Pipeline
    from h3serve.testing.clips import write_video

    tiny_checkpoint = copy_checkpoint()
    index_path = tiny_checkpoint / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    index["reference_image_short_edge"] = 128   # the image reference's own rule, CPU-sized (see above)
    index_path.write_text(json.dumps(index))
    monkeypatch.setattr(media_video, "CANVAS_RULE", SMALL_CANVAS_RULE)

    rng = np.random.default_rng(11)
    t = np.arange(int(1.2 * 32000)) / 32000
    sound = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)])
    write_video(tmp_path / "dance.mp4", rng.integers(0, 255, (36, 48, 48, 3), dtype=np.uint8), 30, sound)
    write_video(tmp_path / "pan.mp4", rng.integers(0, 255, (26, 48, 96, 3), dtype=np.uint8), 24)
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "subject.png")

    refs = [MiniMaxH3VideoReference.from_file(str(tmp_path / "dance.mp4")),
            MiniMaxH3ImageReference.from_file(str(tmp_path / "subject.png")),
            MiniMaxH3VideoReference.from_file(str(tmp_path / "pan.mp4"))]
    assert refs[0].audio is not None and refs[2].audio is None
    pipe = reference_pipeline(tiny_checkpoint, "ref2va")
    pipe.register_to_config(canvas_short_edge=SMALL_CANVAS_RULE[0], canvas_max_pixels=SMALL_CANVAS_RULE[1])
    assert type(pipe.processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    ref = run_reference(pipe, prompt="the subject dances", references=refs, num_inference_steps=3)

    ours = Pipeline.load(tiny_checkpoint, dtype="fp32", device="cpu", tasks=("ref2va",))
    req = _request(prompt="the subject dances", task="ref2va", steps=3,
                   references=[str(tmp_path / "dance.mp4"), f"image:{tmp_path / 'subject.png'}",
                               str(tmp_path / "pan.mp4")])
    images, refs_in, c = ours._conditions(req)
    assert [type(r).__name__ for r in c.references] == ["VideoRef", "ImageRef", "VideoRef"]
    assert c.references[0].audio_latents > 0 and c.references[2].audio_latents == 0   # sound, then none
    lat = ours.generate_latents(req)
    assert lat.video.shape == ref["latents"].shape
    print("FIGURES", {"max_abs_video": (lat.video - ref["latents"]).abs().max().item(),
                      "max_abs_audio": (lat.audio - ref["audio_latents"]).abs().max().item(),
                      "video_rows": tuple(lat.video.shape), "audio": tuple(lat.audio.shape)})
    torch.testing.assert_close(lat.video, ref["latents"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lat.audio, ref["audio_latents"], atol=1e-4, rtol=0)

    # The MP4 of the video-referenced request, read back by the MP4 checker and the system ffprobe.
    from h3serve.testing.mp4check import check_mp4, ffprobe_report

    out = tmp_path / "ref2va-video.mp4"
    ours.write_mp4(req, lat, out)
    check_mp4(out, expect_frames=124, fps=24, width=W, height=H, sample_rate=32000, channels=2)
    probe = ffprobe_report(out)   # the system ffprobe, a decoder independent of our writer
    assert (probe.video_codec, probe.width, probe.height, probe.frames) == ("h264", W, H, 124), probe
    assert (probe.audio_codec, probe.sample_rate, probe.channels) == ("aac", 32000, 2), probe
