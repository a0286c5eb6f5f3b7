"""Previews (`preview_every`): the DiT's x0 estimate drawn as a small JPEG every k steps, on the tiny checkpoint on
CPU. Their cost is measured against the DiT's own time (bounded: <= 5 %), and they change nothing in the output."""

from __future__ import annotations

import io
import time

import pytest
import torch
from PIL import Image

from h3serve.config.request import validate_request
from h3serve.errors import RequestError
from h3serve.media.preview import PREVIEW_FRAMES, preview_jpeg
from h3serve.models.dit.engine import DiTEngine, DiTRequest

MAX_PREVIEW_COST = 0.05   # of the DiT's time, with a preview after every step


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return DiTEngine.load(tiny_checkpoint, components=("transformer",), dtype=torch.float32)


def _request(engine, preview_every: int) -> DiTRequest:
    g = torch.Generator().manual_seed(0)
    text_dim = engine.models["transformer"].config.text_dim
    req = validate_request(prompt="a kite over the sea", seconds=5, size="320x256", seed=0, steps=4, dtype="fp32")
    return DiTRequest(text_states=torch.randn(1, 5, text_dim, generator=g), text_tags=torch.ones(5, dtype=torch.long),
                      latent_frames=req.latent_frames, latent_h=req.latent_height, latent_w=req.latent_width,
                      audio_latents=req.audio_latents, seed=0, steps=4, preview_every=preview_every)


def test_previews_cost_at_most_5_percent_of_the_dit_and_change_nothing(engine):
    torch.set_num_threads(1)
    plain = engine.generate(_request(engine, 0))
    preview_jpeg(plain.video)   # as the DiT stage's warmup does: numpy's SVD and PIL's JPEG encoder loaded
    previews, render_s = [], []

    def on_preview(done, total, latents):
        t0 = time.perf_counter()
        previews.append((done, total, preview_jpeg(latents)))
        render_s.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    shown = engine.generate(_request(engine, 1), on_preview=on_preview)
    wall = time.perf_counter() - t0
    assert torch.equal(shown.video, plain.video) and torch.equal(shown.audio, plain.audio)
    assert [(d, t) for d, t, _ in previews] == [(1, 3), (2, 3), (3, 3)]
    image = Image.open(io.BytesIO(previews[-1][2]))
    req = _request(engine, 1)
    assert image.format == "JPEG" and image.width == image.height // req.latent_h * req.latent_w * PREVIEW_FRAMES
    cost = sum(render_s) / wall
    print(f"preview cost: {sum(render_s):.4f} s of {wall:.3f} s DiT = {cost:.4f}")
    assert cost <= MAX_PREVIEW_COST, (render_s, wall)


def test_preview_every_is_checked_naming_the_field():
    with pytest.raises(RequestError, match="preview_every"):
        validate_request(prompt="x", seconds=5, size="320x256", steps=4, preview_every=-1)
    assert validate_request(prompt="x", seconds=5, size="320x256", steps=4, preview_every=2).preview_every == 2
