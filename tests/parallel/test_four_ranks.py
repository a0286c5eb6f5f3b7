"""Four-rank stages against one rank, as tests/parallel/test_two_ranks.py compares two: the plans that need four
ranks (Ulysses x Ring, a rank of pure padding, patch parallel 4)."""

from __future__ import annotations

import pytest
import torch

from h3serve.distributed.world import launch
from h3serve.testing.rankcases import GEOMETRIES, TOL, maxdiff

from .workers import build_suite, dit_inputs, tiny_dit


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
    assert maxdiff(out, ref) <= TOL


# -- VAE patch parallel -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4])
def test_vae_pp_on_four_ranks_equal_pp1(stage4, vae_reference, pp):
    latents, ref = vae_reference
    assert torch.equal(stage4.call("vae_decode", (pp, latents)), ref)


