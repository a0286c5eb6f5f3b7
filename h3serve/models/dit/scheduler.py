"""H3's rectified-flow Euler schedules (H3_REFERENCE §4).

Conventions: sigma is the noise level, t = 1 - sigma is the "clean time" the DiT is fed (t = 1 means clean). The model
predicts a data-ward velocity, so x0_hat = x + sigma * v with sigma taken as 1 - t from the fed (float32) timestep,
while the Euler ratio uses the sigma grid itself; the two differ in float32 for sigma < 0.5 and the reference keeps
them apart, so we do too.

Video and audio each have a schedule of the same length; the loop takes step i of both. Their shifts are the
checkpoint's (`scheduler/` and `audio_scheduler/` configs, read by `models/checkpoint.py`): 12 and 3 released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from h3serve.config.request import FASTH3_STEPS
from h3serve.errors import ProfileError

VIDEO_SHIFT = 12.0   # the released scheduler/ config
AUDIO_SHIFT = 3.0    # the released audio_scheduler/ config
DEFAULT_SHIFT = 12.0  # diffusers' MiniMaxH3Scheduler default, for a config without `shift`
# FastH3's DMD2 rungs [999, 749, 500, 250] on a 1000-step clock plus the terminal 0, as pre-shift positions
# (H3_REFERENCE §4.2, convention (a)): FASTH3_STEPS points, the count the request validator enforces.
FASTH3_POSITIONS = (0.999, 0.749, 0.5, 0.25, 0.0)
assert len(FASTH3_POSITIONS) == FASTH3_STEPS

Profile = Literal["base", "fasth3"]


def shift_sigmas(base: torch.Tensor, shift: float) -> torch.Tensor:
    """Exponential shift sigma' = s*sigma / (1 + (s-1)*sigma), evaluated in the dtype of `base` (float32)."""
    return shift * base / (1 + (shift - 1) * base)


def sigma_grid(num_points: int, shift: float) -> torch.Tensor:
    """Base-profile sigmas (<= num_points, float32): linspace(1, 0, N) shifted, float32 duplicates collapsed.

    N counts the terminal 0, so N points drive N - 1 forwards.
    """
    if int(num_points) < 2:
        raise ValueError(f"num_points must be >= 2 (it counts the terminal sigma 0), got {num_points}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    return torch.unique_consecutive(shift_sigmas(base, float(shift)))


def fasth3_grid(shift: float) -> torch.Tensor:
    """FastH3 sigmas (5, float32): the rung positions 0.999, 0.749, 0.5, 0.25, 0, each shifted once.

    The shift is evaluated in float64 and rounded once to float32: that reproduces the published rung values
    (video sigma[1] = 0.9728326, t[1] = 0.0271674); shifting in float32 lands 1 ulp lower on two rungs.
    """
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    return shift_sigmas(torch.tensor(FASTH3_POSITIONS, dtype=torch.float64), float(shift)).to(torch.float32)


@dataclass(frozen=True, eq=False)
class FlowSchedule:
    """A strictly decreasing float32 sigma grid ending at 0, and its timesteps t = 1 - sigma[:-1] (float32)."""

    sigmas: torch.Tensor  # (N,) float32, CPU
    timesteps: torch.Tensor = field(init=False)  # (N-1,) float32

    def __post_init__(self) -> None:
        sigmas = torch.as_tensor(self.sigmas, dtype=torch.float32).flatten().cpu()
        if sigmas.numel() < 2 or not bool((sigmas[1:] < sigmas[:-1]).all()) or float(sigmas[-1]) != 0.0:
            raise ValueError("sigmas must hold at least two strictly decreasing values ending at 0.0")
        object.__setattr__(self, "sigmas", sigmas)
        object.__setattr__(self, "timesteps", 1.0 - sigmas[:-1])

    @property
    def num_steps(self) -> int:
        """Number of model forwards (= len(sigmas) - 1)."""
        return int(self.timesteps.numel())

    def step(self, velocity: torch.Tensor, i: int, x: torch.Tensor) -> torch.Tensor:
        """One Euler step (eta 0) from sigma[i] to sigma[i+1]: returns r*x + (1-r)*x0_hat, evaluated in float32.

        `velocity` is the model output at timesteps[i] for the rows in `x` (same shape). Returns a new tensor.
        """
        x0_hat = self.x0_estimate(velocity, i, x)
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        ratio = self.sigmas[i + 1].to(compute) / self.sigmas[i].to(compute)
        x_next = ratio * x.to(compute) + (1.0 - ratio) * x0_hat.to(compute)
        return x_next.to(x.dtype)

    def x0_estimate(self, velocity: torch.Tensor, i: int, x: torch.Tensor) -> torch.Tensor:
        """The clean sample the model predicts at step i (what `step` moves towards; previews show it)."""
        if not 0 <= i < self.num_steps:
            raise IndexError(f"step {i} is outside the schedule's {self.num_steps} steps")
        t = self.timesteps[i]  # 0-dim float32 (CPU scalars mix with tensors on any device)
        return x + (1 - t.to(x.dtype)) * velocity  # data-ward velocity: x0 = x + sigma_t * v

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
        """Forward process at clean-time t: t*x0 + (1-t)*noise (t = 1 returns x0). Used to hold conditions at 0.999."""
        t = torch.as_tensor(t, dtype=x0.dtype, device=x0.device)
        while t.ndim < x0.ndim:
            t = t.unsqueeze(-1)
        return t * x0 + (1.0 - t) * noise


@dataclass(frozen=True)
class FlowShifts:
    """The exponential shifts of the video and the audio schedule."""

    video: float = VIDEO_SHIFT
    audio: float = AUDIO_SHIFT


def schedules_for(profile: Profile, num_points: int | None = None,
                  shifts: FlowShifts = FlowShifts()) -> tuple[FlowSchedule, FlowSchedule]:
    """(video, audio) schedules with the checkpoint's `shifts` (12 and 3 released).

    "base": `num_points` grid points (terminal 0 included; the released default is 50, i.e. 49 forwards).
    "fasth3": the fixed FASTH3_STEPS-point rung grid (5 points, 4 forwards); `num_points` must be None or that.
    This is where a profile's step count is checked: callers pass the request's steps through as they are.
    """
    if profile == "base":
        if num_points is None:
            raise ValueError("the base profile needs num_points (grid points including the terminal 0, e.g. 50)")
        return FlowSchedule(sigma_grid(num_points, shifts.video)), FlowSchedule(sigma_grid(num_points, shifts.audio))
    if profile == "fasth3":
        if num_points not in (None, FASTH3_STEPS):
            raise ProfileError(
                f"fasth3 runs a fixed {FASTH3_STEPS}-point grid ({FASTH3_STEPS - 1} forwards); "
                f"num_points={num_points} cannot be honoured: leave it unset or pass {FASTH3_STEPS}"
            )
        return FlowSchedule(fasth3_grid(shifts.video)), FlowSchedule(fasth3_grid(shifts.audio))
    raise ProfileError(f"profile must be 'base' or 'fasth3', got {profile!r}")
