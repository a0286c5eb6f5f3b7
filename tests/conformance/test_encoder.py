"""Our text encoder service against diffusers' H3 text-encoder steps on the tiny random checkpoint (CPU, fp32).

The oracle is diffusers' own blocks (MiniMaxH3TextEncoderStep, MiniMaxH3FL2VATextEncoderStep,
MiniMaxH3Ref2VATextEncoderStep, MiniMaxH3ResizeStep) with the full 51-layer Qwen3-VL loaded by transformers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.errors import CheckpointError
from h3serve.models.encoder import presentation as pres
from h3serve.models.encoder.model import TextEncoder

torch.set_num_threads(min(2, os.cpu_count() or 1))

PROMPT = ("integrated_multimodal_description A red fox runs across a snowy field at dawn. "
          "<d>[English] Hello there, how are you today?</d>")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint)


@pytest.fixture(scope="module")
def ref_components(ckpt):
    from transformers import Qwen2TokenizerFast, Qwen3VLForConditionalGeneration

    from h3serve.models.encoder.processor import load_processor

    te = Qwen3VLForConditionalGeneration.from_pretrained(ckpt / "text_encoder", dtype=torch.float32).eval()
    return dict(text_encoder=te, tokenizer=Qwen2TokenizerFast.from_pretrained(ckpt / "tokenizer"),
                processor=load_processor(ckpt))


@pytest.fixture(scope="module")
def encoder(ckpt):
    return TextEncoder.load(ckpt, dtype=torch.float32, device="cpu")


def _run_block(block, components, **inputs):
    pipe = block.init_pipeline()
    pipe.update_components(**components)
    state = pipe(**inputs)
    return state.get("prompt_embeds"), state.get("text_token_tags")


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (224, 288, 3), dtype=np.uint8))]  # non-square


def _assert_same(ours, ref_states, ref_tags):
    assert ours.states.shape == ref_states.shape and ours.states.dtype == ref_states.dtype
    assert (ours.states - ref_states).abs().max().item() <= 1e-6
    assert ours.tags.dtype == torch.int64 and torch.equal(ours.tags, ref_tags)


# ---------------------------------------------------------------------------------------------------- model
def test_t2va_matches_diffusers_text_encoder_step(encoder, ref_components):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    ref_states, ref_tags = _run_block(MiniMaxH3TextEncoderStep(), ref_components, prompt=PROMPT)
    ours = encoder.encode(PROMPT, task="t2va")
    _assert_same(ours, ref_states, ref_tags)
    assert ours.tags.tolist() == [1] * ours.states.shape[1]
    assert ours.token_ids == ref_components["tokenizer"](PROMPT, add_special_tokens=False)["input_ids"]


def test_fl2va_two_keyframes_match_diffusers(encoder, ref_components):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    images = _images()
    ref_states, ref_tags = _run_block(MiniMaxH3FL2VATextEncoderStep(), ref_components, prompt=PROMPT,
                                      keyframes=images)
    ours = encoder.encode(PROMPT, images=images, task="fl2va")
    _assert_same(ours, ref_states, ref_tags)
    # <Picture 1>: + 64 pads + start/end, <Picture 2>: + a 256x320-resized block (80 pads) + start/end
    tok = ref_components["tokenizer"]
    label = len(tok("<Picture 1>: ", add_special_tokens=False)["input_ids"])
    assert ours.tags.tolist()[: label + 66] == [1] * label + [0] * 66
    assert int((ours.tags == 0).sum()) == 66 + 82
    # uint8 arrays are accepted as well as PIL images
    again = encoder.encode(PROMPT, images=[np.asarray(im) for im in images], task="fl2va")
    assert torch.equal(again.states, ours.states)


def test_ref2va_image_and_audio_references_match_diffusers(encoder, ref_components):
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    img = _images()[1]
    audio = torch.zeros(2, 3200)
    refs = [MiniMaxH3AudioReference(audio=audio, sample_rate=32000), MiniMaxH3ImageReference(image=img)]
    ref_states, ref_tags = _run_block(MiniMaxH3Ref2VATextEncoderStep(), ref_components, prompt=PROMPT,
                                      normalized_references=refs)
    ours = encoder.encode(PROMPT, task="ref2va",
                          references=[pres.Reference("audio"), pres.Reference("image", image=img)])
    _assert_same(ours, ref_states, ref_tags)


def test_bf16_fl2va_matches_diffusers_bf16(ckpt, ref_components):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep
    from transformers import Qwen3VLForConditionalGeneration

    te = Qwen3VLForConditionalGeneration.from_pretrained(ckpt / "text_encoder", dtype=torch.bfloat16).eval()
    images = _images()[:1]
    ref_states, ref_tags = _run_block(MiniMaxH3FL2VATextEncoderStep(), dict(ref_components, text_encoder=te),
                                      prompt=PROMPT, keyframes=images)
    ours = TextEncoder.load(ckpt, dtype=torch.bfloat16).encode(PROMPT, images=images, task="fl2va")
    assert ours.states.dtype == ref_states.dtype == torch.bfloat16
    _assert_same(ours, ref_states, ref_tags)


def test_only_50_decoder_layers_are_loaded(ckpt, caplog):
    total = json.loads((ckpt / "text_encoder" / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert total >= 51
    with caplog.at_level(logging.INFO, logger="h3serve.encoder"):
        enc = TextEncoder.load(ckpt, dtype=torch.float32)
    assert enc.num_layers == 50 and len(enc.model.language_model.layers) == 50
    assert isinstance(enc.model.language_model.norm, torch.nn.Identity)
    assert not any(n.startswith("lm_head") for n, _ in enc.model.named_parameters())
    assert enc.model.visual is not None
    assert f"loaded 50 of {total} decoder layers" in caplog.text


def test_encoder_with_50_layers_is_refused(copy_checkpoint):
    ck = copy_checkpoint()
    cfg_path = ck / "text_encoder" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["num_hidden_layers"] = 50
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"hidden_states\[50\].*more than 50 decoder layers.*has 50"):
        TextEncoder.load(ck, dtype=torch.float32)


def test_bad_requests_are_refused(encoder):
    with pytest.raises(TypeError, match="single str"):
        encoder.encode(["a", "b"])
    with pytest.raises(ValueError, match="task"):
        encoder.encode("a", task="i2v")
    with pytest.raises(ValueError, match="t2va takes"):
        encoder.encode("a", images=_images())
    with pytest.raises(ValueError, match="at least 13 frames"):
        encoder.present("a", task="ref2va", references=[pres.Reference("video", frames=np.zeros((12, 64, 64, 3),
                                                                                              np.uint8))])


def test_video_reference_reaches_qwen3vl_video_processor(encoder):
    """24 frames at 24 fps: samples 0 and 12, one merged block of (64/16)^2 / 4 = 4 video pads, "<0.2 seconds>"."""
    frames = np.random.default_rng(0).integers(0, 255, (24, 64, 64, 3), dtype=np.uint8)
    p = encoder.present("a", task="ref2va", references=[pres.Reference("video", frames=frames)])
    assert p.token_ids.count(encoder.video_pad_id) == 4
    assert p.vision_inputs["video_grid_thw"].tolist() == [[1, 4, 4]]
    assert "<0.2 seconds>" in encoder.tokenizer.decode(p.token_ids)
    assert encoder.encode("a", task="ref2va", references=[pres.Reference("video", frames=frames)]).states.shape[1] \
        == len(p.token_ids)


# ---------------------------------------------------------------------------------------------------- presentation
def test_ref2va_presentation_with_video_matches_diffusers(ref_components):
    """Token ids and roles of a mixed ref2va presentation (video blocks included)."""
    from diffusers.modular_pipelines.minimax_h3 import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                        MiniMaxH3VideoReference)
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    tok = ref_components["tokenizer"]
    frames = np.zeros((30, 32, 32, 3), np.uint8)
    theirs = [MiniMaxH3ImageReference(image=None), MiniMaxH3VideoReference(frames=frames, audio=torch.zeros(2, 8)),
              MiniMaxH3AudioReference(audio=torch.zeros(2, 8)), MiniMaxH3ImageReference(image=None)]
    ours = [pres.Reference("image"), pres.Reference("video", frames=frames, has_audio=True),
            pres.Reference("audio"), pres.Reference("image")]
    _, ts = pres.sample_video_frames(len(frames))
    assert ts == [0.25, 1.0]  # samples 0, 12, 24 (+ the last repeated) -> blocks (0, .5), (1, 1)
    ids, tags = MiniMaxH3Ref2VATextEncoderStep._build_presentation(tok, PROMPT, theirs, [5, 7], [3], [ts])
    p = pres.build_ref2va(tok, PROMPT, ours, [5, 7], [3], [ts])
    assert (p.token_ids, p.tags) == (ids, tags)
    assert tok.decode(p.token_ids).startswith(
        "<Picture 1>: <|vision_start|>" + "<|image_pad|>" * 5 + "<|vision_end|><Audio 1>: <Video 1>: <0.2 seconds>")


@pytest.mark.parametrize("num_frames", [13, 24, 124, 245])
def test_video_frame_sampling_matches_diffusers(num_frames):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    frames = np.arange(num_frames).reshape(num_frames, 1, 1, 1)
    sampled, ts = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(frames, 24.0, 2.0, 2)
    indices, ours_ts = pres.sample_video_frames(num_frames)
    assert [int(f[0, 0, 0]) for f in sampled] == indices and ts == ours_ts


def test_keyframe_resize_rules_match_diffusers_resize_step():
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    rng = np.random.default_rng(1)
    first = Image.fromarray(rng.integers(0, 256, (90, 170, 3), dtype=np.uint8))
    last = Image.fromarray(rng.integers(0, 256, (200, 130, 3), dtype=np.uint8))
    pipe = MiniMaxH3ResizeStep().init_pipeline()
    kf = pipe(image=first, last_image=last, height=224, width=288).get("keyframes")
    ours = [pres.resize_keyframe_first(first, 224, 288), pres.resize_keyframe_last(last, 224, 288)]
    for a, b in zip(ours, kf):
        assert a.size == b.size == (288, 224)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    (alone,) = pipe(last_image=last, height=224, width=288).get("keyframes")  # last_image alone is stretched
    assert np.array_equal(np.asarray(pres.resize_keyframe_first(last, 224, 288)), np.asarray(alone))
