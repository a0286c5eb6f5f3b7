from __future__ import annotations

import pytest

from h3serve.testing.rankcases import vae_latents

from .workers import load_vae


@pytest.fixture(scope="module")
def vae_reference(tiny_checkpoint):
    """(latents, their one-rank decode) for the patch-parallel comparisons."""
    latents = vae_latents()
    return latents, load_vae(tiny_checkpoint).decode_float(latents)
