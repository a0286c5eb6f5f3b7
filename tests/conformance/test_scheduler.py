"""Our flow schedules against diffusers' MiniMaxH3Scheduler and the tabulated grids of H3_REFERENCE §4."""

from __future__ import annotations

import pytest
import torch

from h3serve.errors import ProfileError
from h3serve.models.dit.scheduler import (
    AUDIO_SHIFT,
    VIDEO_SHIFT,
    FlowSchedule,
    fasth3_grid,
    schedules_for,
    sigma_grid,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import MiniMaxH3Scheduler  # noqa: E402

# H3_REFERENCE §4.1, sigma(N=50), printed to 8 decimals.
SIGMAS_50_SHIFT_12 = [
    1.00000000, 0.99826688, 0.99646646, 0.99459463, 0.99264705, 0.99061912, 0.98850578, 0.98630130, 0.98400003,
    0.98159504, 0.97907943, 0.97644538, 0.97368413, 0.97078645, 0.96774185, 0.96453899, 0.96116507, 0.95760596,
    0.95384616, 0.94986808, 0.94565219, 0.94117647, 0.93641621, 0.93134326, 0.92592597, 0.92012775, 0.91390723,
    0.90721643, 0.89999998, 0.89219326, 0.88372087, 0.87449390, 0.86440682, 0.85333329, 0.84112155, 0.82758617,
    0.81249994, 0.79558009, 0.77647054, 0.75471693, 0.72972971, 0.70072991, 0.66666663, 0.62608695, 0.57692301,
    0.51612902, 0.43902439, 0.33802816, 0.20000000, 0.0,
]
SIGMAS_50_SHIFT_3 = [
    1.00000000, 0.99310344, 0.98601401, 0.97872341, 0.97122294, 0.96350360, 0.95555550, 0.94736838, 0.93893123,
    0.93023252, 0.92125976, 0.91199994, 0.90243900, 0.89256191, 0.88235289, 0.87179482, 0.86086953, 0.84955758,
    0.83783793, 0.82568812, 0.81308419, 0.80000007, 0.78640789, 0.77227724, 0.75757575, 0.74226803, 0.72631574,
    0.70967740, 0.69230765, 0.67415726, 0.65517235, 0.63529408, 0.61445785, 0.59259260, 0.56962031, 0.54545450,
    0.51999998, 0.49315068, 0.46478871, 0.43478256, 0.40298504, 0.36923078, 0.33333331, 0.29508197, 0.25423726,
    0.21052632, 0.16363637, 0.11320755, 0.05882353, 0.0,
]
# §4.2 convention (a): the rungs 0.999, 0.749, 0.5, 0.25, 0, shifted.
FASTH3_VIDEO = dict(sigmas=[0.9999166, 0.9728326, 0.9230769, 0.8, 0.0], t=[0.0000834, 0.0271674, 0.0769231, 0.2000000])
FASTH3_AUDIO = dict(sigmas=[0.9996665, 0.8995196, 0.75, 0.5, 0.0], t=[0.0003335, 0.1004804, 0.25, 0.5])


def _diffusers(shift: float, num_points: int | None = None, sigmas=None) -> MiniMaxH3Scheduler:
    sched = MiniMaxH3Scheduler(shift=shift)
    sched.set_timesteps(num_points, sigmas=sigmas)
    return sched


@pytest.mark.parametrize("shift", [VIDEO_SHIFT, AUDIO_SHIFT])
@pytest.mark.parametrize("num_points", [2, 3, 5, 50, 997])
def test_sigma_grid_and_timesteps_equal_diffusers(shift, num_points):
    ref = _diffusers(shift, num_points)
    ours = FlowSchedule(sigma_grid(num_points, shift))
    assert ours.sigmas.dtype == torch.float32 and ours.timesteps.dtype == torch.float32
    assert torch.equal(ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert ours.num_steps == ref.num_inference_steps


def test_grids_match_the_tabulated_values():
    for shift, table in ((12.0, SIGMAS_50_SHIFT_12), (3.0, SIGMAS_50_SHIFT_3)):
        sigmas = sigma_grid(50, shift)
        assert sigmas.numel() == 50  # no float32 collisions at N = 50
        torch.testing.assert_close(sigmas, torch.tensor(table), atol=6e-9, rtol=0)
    video, audio = schedules_for("base", 50)
    assert video.num_steps == audio.num_steps == 49
    assert abs(float(video.timesteps[-1]) - 0.80000001) < 1e-7 and abs(float(audio.timesteps[-1]) - 0.94117647) < 1e-7


def test_fasth3_rungs_match_reference_values_and_diffusers():
    for shift, table in ((VIDEO_SHIFT, FASTH3_VIDEO), (AUDIO_SHIFT, FASTH3_AUDIO)):
        ours = FlowSchedule(fasth3_grid(shift))
        # 7-decimal table: half a printed digit (5e-8) plus float32 rounding of the table value. Tight enough to
        # tell a float64-evaluated shift (the published values) from a float32 one (1 ulp off on two rungs).
        torch.testing.assert_close(ours.sigmas, torch.tensor(table["sigmas"]), atol=9e-8, rtol=0)
        torch.testing.assert_close(ours.timesteps, torch.tensor(table["t"]), atol=6e-8, rtol=0)
        ref = _diffusers(shift, sigmas=fasth3_grid(shift))
        assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(ours.timesteps, ref.timesteps)
    video, audio = schedules_for("fasth3")
    assert video.num_steps == audio.num_steps == 4
    assert torch.equal(video.sigmas, fasth3_grid(12.0)) and torch.equal(audio.sigmas, fasth3_grid(3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grid", ["base12", "base3", "fasth3"])
def test_step_sequence_equals_diffusers(grid, dtype):
    sigmas = {"base12": sigma_grid(6, 12.0), "base3": sigma_grid(6, 3.0), "fasth3": fasth3_grid(12.0)}[grid]
    ours, ref = FlowSchedule(sigmas), _diffusers(12.0, sigmas=sigmas)
    g = torch.Generator().manual_seed(0)
    x_ours = torch.randn(17, 96, generator=g).to(dtype)
    x_ref = x_ours.clone()
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(17, 96, generator=g).to(dtype)
        x_ours = ours.step(v, i, x_ours)
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        assert x_ours.dtype == dtype
        assert torch.equal(x_ours, x_ref), f"step {i}"


def test_add_noise_equals_scale_noise():
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 24, 1, 4, 6, generator=g), torch.randn(2, 24, 1, 4, 6, generator=g)
    ref = MiniMaxH3Scheduler(shift=12.0)
    for t in (0.999, 0.5, 1.0, torch.tensor(0.25)):
        assert torch.equal(FlowSchedule.add_noise(x0, noise, t), ref.scale_noise(x0, t, noise))


def test_schedule_validation_and_profiles():
    with pytest.raises(ValueError):
        sigma_grid(1, 12.0)
    with pytest.raises(ValueError):
        FlowSchedule(torch.tensor([1.0, 0.5, 0.5, 0.0]))
    with pytest.raises(ValueError):
        FlowSchedule(torch.tensor([1.0, 0.5]))
    with pytest.raises(ProfileError, match="fasth3"):
        schedules_for("fasth3", 50)
    with pytest.raises(ProfileError):
        schedules_for("turbo", 5)
    with pytest.raises(ValueError):
        schedules_for("base")
    with pytest.raises(IndexError):
        FlowSchedule(sigma_grid(3, 12.0)).step(torch.zeros(1), 2, torch.zeros(1))
