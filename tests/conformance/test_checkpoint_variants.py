"""Checkpoints that vary config values diffusers' H3 classes legally take: each either matches diffusers' pipeline
(fp32 within 1e-4; bf16 eager bitwise on CPU) or is refused at load, naming the file and the key, as the
checkpoint's fault (CheckpointError, the CLI's input-error exit code 2), never mid-request.

Every variant is built by diffusers' own classes (`h3serve.testing.tiny.write_checkpoint_variant`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.config.request import validate_request
from h3serve.errors import CheckpointError

pytest.importorskip("diffusers")

STEPS = 3                   # grid points: 2 forwards
W, H = 256, 256
PROMPT = "a kite over the sea at dusk"
SEED = 7
REPO = Path(__file__).resolve().parents[2]


def variant(tiny_checkpoint, tmp_path, name, **overrides) -> Path:
    from h3serve.testing.tiny import write_checkpoint_variant

    return write_checkpoint_variant(tiny_checkpoint, tmp_path / name, **overrides)


def reference_outputs(ckpt, dtype=torch.float32, decode=False):
    """diffusers' final (video latents, audio latents), and with `decode` its (frames, PCM) too."""
    from h3serve.testing.tiny import reference_pipeline

    pipe = reference_pipeline(ckpt, workflow="t2va", dtype=dtype)
    names = ["latents", "audio_latents"] + (["videos", "audio"] if decode else [])
    out = pipe(prompt=PROMPT, num_frames=124, height=H, width=W, num_inference_steps=STEPS,
               generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", output=names)
    return [out[n] for n in names]


def our_pipeline(ckpt, dtype="fp32"):
    from h3serve.pipeline import Pipeline

    return Pipeline.load(ckpt, dtype=dtype, device="cpu", tasks=("t2va",))


def our_latents(pipe, dtype="fp32"):
    req = validate_request(prompt=PROMPT, seconds=5, size=f"{W}x{H}", seed=SEED, steps=STEPS, dtype=dtype)
    lat = pipe.generate_latents(req)
    return lat.video, lat.audio


# ------------------------------------------------------------------------------------------------ matches diffusers

MATCHES = {
    # the schedulers' shifts are read from scheduler/ and audio_scheduler/
    "shifts 7 / 2": dict(shifts={"scheduler": 7.0, "audio_scheduler": 2.0}),
    # latent channels other than 24 / 32, the same on both sides of the DiT / VAE boundary
    "latent channels 16 / 16": dict(transformer=dict(in_channels=16, audio_in_channels=16),
                                    vae=dict(latent_channels=16), audio_vae=dict(latent_channels=16)),
    # the VAEs' geometry (diffusers' own classes decode; our clip-by-clip and tiled decode around them)
    "VAE geometry": dict(vae=dict(block_out_channels=(8, 16, 16, 8), decoder_num_layers=2,
                                  decoder_num_attention_heads=4, decoder_attention_head_dim=16,
                                  decoder_num_register_tokens=2, decoder_rope_theta=50.0, decoder_ffn_mult=2),
                         audio_vae=dict(decoder_dim=8, num_attention_heads=1, latent_dim=32)),
    # the DiT's geometry: odd freq_dim (a zero column), other heads, layers, rope, widths, eps
    "DiT geometry, odd freq_dim": dict(transformer=dict(
        num_attention_heads=4, attention_head_dim=16, num_layers=3, num_refiner_layers=1, ffn_dim=96, freq_dim=15,
        time_embed_hidden_dim=48, time_embed_dim=24, rope_freq_dim=2, rope_theta=5000.0, norm_eps=1e-6,
        qk_norm_eps=1e-6, final_norm_eps=1e-6)),
}


@pytest.mark.diffusers
@pytest.mark.parametrize("case", list(MATCHES))
def test_variant_matches_diffusers(tiny_checkpoint, tmp_path, case):
    ckpt = variant(tiny_checkpoint, tmp_path, "v", **MATCHES[case])
    decode = "vae" in MATCHES[case]   # the VAEs change: decode on both sides too
    ref = reference_outputs(ckpt, decode=decode)
    pipe = our_pipeline(ckpt)
    video, audio = our_latents(pipe)
    assert video.shape == ref[0].shape and audio.shape == ref[1].shape
    torch.testing.assert_close(video, ref[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(audio, ref[1], atol=1e-4, rtol=0)
    if decode:
        frames = pipe.decode_video_float(video)                     # (F, H, W, 3) in [0, 1]
        ref_frames = torch.as_tensor(np.asarray(ref[2][0]))
        assert frames.shape == ref_frames.shape == (124, H, W, 3)
        assert (frames - ref_frames).abs().max().item() <= 1e-4
        torch.testing.assert_close(pipe.decode_audio(audio), ref[3][0].float(), atol=1e-4, rtol=0)


def test_shifts_are_the_checkpoints(tiny_checkpoint, tmp_path):
    """Without diffusers' run: the schedules the engine builds use the configured shifts."""
    from h3serve.models.checkpoint import flow_shifts
    from h3serve.models.dit.scheduler import FlowShifts
    from h3serve.weights.folder import CheckpointFolder

    assert flow_shifts(CheckpointFolder(tiny_checkpoint)) == FlowShifts(12.0, 3.0)
    ckpt = variant(tiny_checkpoint, tmp_path, "v", **MATCHES["shifts 7 / 2"])
    assert flow_shifts(CheckpointFolder(ckpt)) == FlowShifts(7.0, 2.0)


@pytest.mark.diffusers
def test_bf16_eager_is_bitwise_diffusers(tiny_checkpoint):
    """bf16 on CPU (the eager path: no fused kernels there): the final latents equal diffusers' bit for bit."""
    ref_video, ref_audio = reference_outputs(tiny_checkpoint, dtype=torch.bfloat16)
    video, audio = our_latents(our_pipeline(tiny_checkpoint, "bf16"), "bf16")
    assert video.dtype == ref_video.dtype and audio.dtype == ref_audio.dtype
    assert torch.equal(video, ref_video), (video - ref_video).abs().max()
    assert torch.equal(audio, ref_audio), (audio - ref_audio).abs().max()


# ------------------------------------------------------------------------------------------------ refused at load

REFUSED = {
    "vae clip_length 13 / token_drop 2": (dict(vae=dict(clip_length=13, token_drop=2)),
                                          "vae/config.json: clip_length=13"),
    "vae token_drop 2": (dict(vae=dict(token_drop=2)), "vae/config.json: token_drop=2"),
    "vae temporal 2x": (dict(vae=dict(temporal_downsample_factors=(1, 2, 1, 1))),
                        "vae/config.json: temporal_downsample_factors=[1, 2, 1, 1]"),
    "vae spatial 8x": (dict(vae=dict(spatial_downsample_factors=(2, 2, 2, 1))),
                       "vae/config.json: spatial_downsample_factors=[2, 2, 2, 1]"),
    "DiT patch (1, 1, 1)": (dict(transformer=dict(patch_size=(1, 1, 1))), "transformer/config.json: patch_size="),
    "DiT channels != VAE's": (dict(transformer=dict(in_channels=16)),
                              "transformer/config.json: in_channels=16 is not supported: equal to vae/config.json"),
    "DiT audio channels != audio VAE's": (dict(audio_vae=dict(latent_channels=16)),
                                          "transformer/config.json: audio_in_channels=32"),
    "audio VAE 16 kHz": (dict(audio_vae=dict(sampling_rate=16000)), "audio_vae/config.json: sampling_rate=16000"),
    "audio VAE hop 400": (dict(audio_vae=dict(encoder_rates=(8, 10, 5), decoder_rates=(10, 5, 8),
                                              decoder_kernel_sizes=(20, 10, 16))),
                          "audio_vae/config.json: encoder_rates=[8, 10, 5]"),
    "canvas short edge 512": (dict(index=dict(canvas_short_edge=512)),
                              "modular_model_index.json: canvas_short_edge=512"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_variant_is_refused_at_load_naming_file_and_key(tiny_checkpoint, tmp_path, case):
    from h3serve.models.vae.audio import AudioVAE
    from h3serve.models.vae.video import VideoVAE
    from h3serve.pipeline import Pipeline

    overrides, message = REFUSED[case]
    ckpt = variant(tiny_checkpoint, tmp_path, "v", **overrides)
    with pytest.raises(CheckpointError) as info:
        Pipeline.load(ckpt, dtype="fp32", device="cpu", tasks=("t2va",))
    assert message in str(info.value) and "is not supported" in str(info.value), str(info.value)
    for load in (VideoVAE.load, AudioVAE.load):   # a VAE stage loaded alone refuses it too
        with pytest.raises(CheckpointError, match="is not supported"):
            load(ckpt)


def test_cli_refuses_a_variant_at_load_with_the_input_error_code(tiny_checkpoint, tmp_path):
    ckpt = variant(tiny_checkpoint, tmp_path, "v", **REFUSED["vae clip_length 13 / token_drop 2"][0])
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-m", "h3serve.cli", "generate", "--checkpoint", str(ckpt), "--prompt", "x",
                        "--size", "256x256", "--steps", "3", "--no-progress", "-o", str(tmp_path / "o.mp4")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "vae/config.json: clip_length=13 is not supported" in lines[0], r.stderr
    assert "internal" not in lines[0] and not (tmp_path / "o.mp4").exists()


def test_refusal_names_a_bad_shift(tiny_checkpoint, tmp_path):
    from h3serve.models.dit.engine import DiTEngine

    ckpt = variant(tiny_checkpoint, tmp_path, "v")
    path = ckpt / "audio_scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), shift="three")))
    with pytest.raises(CheckpointError, match=r"audio_scheduler/scheduler_config.json: shift='three'"):
        DiTEngine.load(ckpt)
