"""The denoising loop: one DiT forward per step, then one Euler step per modality on the generated rows only.

Random draws come from the request's one generator and their order is part of what a seed reproduces
(H3_REFERENCE §5, §7.8):

    1. condition noise, one draw per visual condition in packed order (fl2va keyframes first then last; ref2va image
       and video references in request order): `noise_condition_rows`;
    2. target video noise, randn (1, 24, T, h, w) float32;
    3. target audio noise, randn (2A, 32) float32, already in row layout.

2 and 3 are `prepare_noise`; the caller runs 1 before it, then puts the condition rows in front of the generated
video rows (and clean reference-audio rows in front of the generated audio rows, for ref2va).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from h3serve.errors import Cancelled

from .layout import AUDIO_CHANNELS, CONDITION_ROW_TIMESTEP, PATCH_SIZE, PackedLayout, patchify, row_timesteps
from .scheduler import FlowSchedule

__all__ = ["Cancelled", "denoise", "noise_condition_rows", "prepare_noise"]

def _randn(shape, generator: torch.Generator | None, device: torch.device | str | None) -> torch.Tensor:
    # Draw on the generator's device, then move: a CPU generator gives the same numbers whatever device runs the model.
    draw_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=draw_device, dtype=torch.float32).to(device)


def prepare_noise(
    generator: torch.Generator | None,
    latent_frames: int,
    latent_h: int,
    latent_w: int,
    audio_latents: int,
    *,
    device: torch.device | str | None = None,
    latent_channels: int = 24,
    audio_latent_channels: int = 32,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target noise rows: video (T*h/2*w/2, 96) drawn first as a (1, 24, T, h, w) latent, then audio (2A, 32).

    Draw any condition noise (`noise_condition_rows`) from the same generator *before* calling this.
    """
    video = _randn((1, latent_channels, latent_frames, latent_h, latent_w), generator, device)
    audio = _randn((AUDIO_CHANNELS * audio_latents, audio_latent_channels), generator, device)
    return patchify(video, patch_size), audio


def noise_condition_rows(
    generator: torch.Generator | None,
    condition_latents: Sequence[torch.Tensor],
    *,
    t: float = CONDITION_ROW_TIMESTEP,
    device: torch.device | str | None = None,
    latent_channels: int = 24,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> torch.Tensor:
    """Visual conditions (each (1, C, T_i, h_i, w_i), normalized latents) noised to clean-time t and packed.

    One randn draw of each condition's shape, in order, then x = t*z + (1-t)*noise; returns (sum rows_i, 96).
    """
    rows = []
    for z in condition_latents:
        noise = _randn(tuple(z.shape), generator, device)
        noised = FlowSchedule.add_noise(z.to(device=noise.device, dtype=torch.float32), noise, t)
        rows.append(patchify(noised, patch_size))  # mixing before patchify is the same: patchify only permutes
    if not rows:
        return torch.zeros(0, latent_channels * patch_size[0] * patch_size[1] * patch_size[2], device=device)
    return torch.cat(rows)


@torch.no_grad()
def denoise(
    model: torch.nn.Module,
    *,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    text_states: torch.Tensor,
    layout: PackedLayout,
    video_schedule: FlowSchedule,
    audio_schedule: FlowSchedule,
    num_condition_video_rows: int,
    num_condition_audio_rows: int,
    condition_row_timestep: float = CONDITION_ROW_TIMESTEP,
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_x0: Callable[[int, torch.Tensor], None] | None = None,
    x0_every: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the whole schedule; return the final (Nv, 96) video and (Na, 32) audio rows, float32, conditions included.

    video_rows (Nv, 96) / audio_rows (Na, 32): condition (or reference) rows first, then the generated noise. The
    condition rows are fed at `condition_row_timestep` (max with the video t), reference audio rows at 1.0, and
    neither is ever written. `should_stop()` is polled before every step and raises `Cancelled`; `on_step(done, total)`
    is called after every step with the number of steps done so far (1..total). `on_x0(done, rows)` gets the
    generated video rows' x0 estimate (Nv - conditions, 96) after every `x0_every`-th step (previews; 0: never); it is
    computed only then and changes nothing else. The inputs are not modified.
    """
    n = video_schedule.num_steps
    if audio_schedule.num_steps != n:
        raise ValueError(f"video and audio schedules must have the same length, got {n} and {audio_schedule.num_steps}")
    if video_rows.shape[0] != layout.num_video_rows or audio_rows.shape[0] != layout.num_audio_rows:
        raise ValueError(
            f"got {video_rows.shape[0]} video / {audio_rows.shape[0]} audio rows, the layout has "
            f"{layout.num_video_rows} / {layout.num_audio_rows}"
        )
    if (num_condition_video_rows, num_condition_audio_rows) != (
        layout.num_condition_video_rows, layout.num_condition_audio_rows,
    ):
        raise ValueError(
            f"condition rows ({num_condition_video_rows} video, {num_condition_audio_rows} audio) disagree with the "
            f"layout ({layout.num_condition_video_rows}, {layout.num_condition_audio_rows})"
        )
    device = video_rows.device
    layout_on_device = layout.to(device)  # moved once, not per step
    video = video_rows.to(torch.float32).clone()  # latents stay fp32 throughout
    audio = audio_rows.to(device=device, dtype=torch.float32).clone()
    ncv, nca = num_condition_video_rows, num_condition_audio_rows

    for i in range(n):
        if should_stop is not None and should_stop():
            raise Cancelled(f"cancelled before denoising step {i + 1} of {n}")
        video_t = float(video_schedule.timesteps[i])
        audio_t = float(audio_schedule.timesteps[i])
        timesteps, timestep_indices = row_timesteps(layout, video_t, audio_t, condition_t=condition_row_timestep)
        # timesteps stay on the host: the model moves them, and an AdaLN table looks its rows up by their values
        video_v, audio_v = model(video[None], audio[None], text_states, timesteps, timestep_indices, layout_on_device)
        if on_x0 is not None and x0_every > 0 and (i + 1) % x0_every == 0:
            on_x0(i + 1, video_schedule.x0_estimate(video_v[0, ncv:].float(), i, video[ncv:]))
        video[ncv:] = video_schedule.step(video_v[0, ncv:].float(), i, video[ncv:])
        audio[nca:] = audio_schedule.step(audio_v[0, nca:].float(), i, audio[nca:])
        if on_step is not None:
            on_step(i + 1, n)
    return video, audio
