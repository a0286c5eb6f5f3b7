"""The parallel stage on NCCL (two CUDA devices; skipped elsewhere).

The CPU tests prove the layouts compute what one rank computes; these prove the same code creates its groups and
runs on NCCL: the embedded pipeline with Ulysses 2 next to single-rank encoder / VAE groups once blocked a non-member
rank forever in an NCCL communicator split at load.
"""

from __future__ import annotations

import pytest
import torch

from h3serve.distributed.world import launch
from h3serve.pipeline import Pipeline
from h3serve.config.request import validate_request
from . import workers

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")


def test_single_rank_subgroups_next_to_the_world_group():
    with launch(2, workers.build_subgroups, device="cuda", timeout_s=120, start_timeout_s=120) as handle:
        out = handle.call("reduce")
    assert torch.equal(out, torch.full((4,), 3.0))


@pytest.mark.parametrize("degrees", [{"ulysses": 2}, {"encoder_tp": 2, "ulysses": 2, "vae_pp": 2}],
                         ids=["ulysses2", "tp2-ulysses2-pp2"])
def test_pipeline_on_two_gpus_matches_one(tiny_checkpoint, tmp_path, degrees):
    req = validate_request(prompt="a kite over the sea at dusk", seconds="5", size="320x256", seed="7", steps="3",
                           dtype="bf16")
    out = {}
    for name, deg in (("one", {}), ("two", degrees)):
        pipe = Pipeline.load(tiny_checkpoint, device="cuda", dtype="bf16", **deg)
        try:
            out[name] = pipe.generate_latents(req)
            result = pipe.generate(req, tmp_path / f"{name}.mp4")
            assert result.num_frames == 124 and result.bytes > 0
        finally:
            pipe.close()
    # bf16 on different kernels' row / head splits: close, not bitwise (encoder TP reorders sums).
    for key in ("video", "audio"):
        a, b = getattr(out["two"], key).float(), getattr(out["one"], key).float()
        assert (a - b).abs().max().item() <= 0.1 * b.abs().max().item() + 1e-3, key
