"""Four-rank stages against one rank, for real: several processes, gloo on the CPU, tiny models.

Reference first (1 rank, in this process), then the same op on every rank of a launched stage, then compare.
DiT / encoder in fp32 within max|Δ| <= 1e-5 (Ring and TP re-associate fp32 sums; Ulysses and patch parallel are
bitwise in practice); VAE patch parallel bitwise.
"""

from __future__ import annotations

import pytest
import torch

from h3serve.distributed.world import launch

from .workers import build_suite, dit_inputs, load_vae, tiny_dit

TOL = 1e-5
# (text_len, latent_frames, latent_h, latent_w, audio_latents), extra kwargs
GEOMETRIES = {
    "S28": ((10, 2, 4, 6, 3), {}),  # 10 + 6 + 12 rows: divides 2 and 4
    "S25": ((7, 2, 4, 6, 3), {}),  # divides neither: the last rank pads
    "S5": ((2, 1, 2, 2, 1), {}),  # 4 ranks: 2 + 2 + 1 + 0 rows, a rank of pure padding
    "fl2va": ((7, 2, 4, 6, 3), {"anchors": ("first",)}),  # condition rows, 3 timesteps
    "per-row-t": ((7, 2, 4, 6, 3), {"per_row_timesteps": True}),  # the model's gather path (no segment runs)
}


def _maxdiff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def stage4(tiny_checkpoint):
    with launch(4, build_suite, (str(tiny_checkpoint), [(4, 1), (2, 2), (1, 4)], (2, 4)), timeout_s=60) as h:
        yield h


@pytest.mark.parametrize("geometry", ["S28", "S25", "S5", "per-row-t"])
@pytest.mark.parametrize("plan", [(4, 1), (2, 2), (1, 4)], ids=["ulysses4", "ulysses2xring2", "ring4"])
def test_dit_four_ranks_match_one(stage4, plan, geometry):
    geo, kw = GEOMETRIES[geometry]
    ref = tiny_dit()(*dit_inputs(*geo, **kw))
    out = stage4.call("forward", (plan, geo, kw))
    assert _maxdiff(out, ref) <= TOL


# -- VAE patch parallel -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vae_reference(tiny_checkpoint):
    latents = torch.randn(1, 24, 7, 16, 24, generator=torch.Generator().manual_seed(0))  # 2 windows, 12 tiles
    return latents, load_vae(tiny_checkpoint).decode_float(latents)


@pytest.mark.parametrize("pp", [2, 4])
def test_vae_pp_on_four_ranks_equal_pp1(stage4, vae_reference, pp):
    latents, ref = vae_reference
    assert torch.equal(stage4.call("vae_decode", (pp, latents)), ref)


