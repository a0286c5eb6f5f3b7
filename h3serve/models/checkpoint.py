"""The config values h3serve reads from a checkpoint, and the ones it refuses at load.

Read, as the reference reads them: the schedulers' shifts (`scheduler/`, `audio_scheduler/`), the DiT's geometry
(`H3DiTConfig`: heads, widths, layers, freq_dim, rope), the latent channels (the DiT's `in_channels` /
`audio_in_channels`), the VAEs' own configs (diffusers' classes build them), the reference image short edge.

Refused at load, naming the file, the key, the value and what is supported: the values that the request geometry of
`config/geometry.py` fixes for every stage (the gateway validates requests without a checkpoint): the video VAE's
`clip_length` 17 / `token_drop` 3 and its 16x spatial / 4x temporal compression, the DiT's patch (1, 2, 2), the
audio VAE's hop 800 at 32 kHz, the canvas values of `modular_model_index.json`; and components that disagree with one
another (the DiT's channels against the VAEs', its text width against the text encoder's). A refusal is a
`CheckpointError`: the checkpoint's fault, the CLI's input-error exit code, before any request runs.

Configs only: no tensor is read here.
"""

from __future__ import annotations

import math
from pathlib import Path

from h3serve.config.geometry import (
    AUDIO_HOP,
    CANVAS_MAX_PIXELS,
    CANVAS_SHORT_EDGE,
    FRAMES_PER_CLIP,
    SAMPLE_RATE,
    TEMPORAL_RATIO,
    TOKEN_DROP,
    VAE_SPATIAL,
)
from h3serve.errors import CheckpointError
from h3serve.models.dit.layout import PATCH_SIZE
from h3serve.models.dit.model import H3DiTConfig
from h3serve.models.dit.scheduler import DEFAULT_SHIFT, FlowShifts
from h3serve.weights.folder import INDEX_FILE, CheckpointFolder

TRANSFORMERS = ("transformer", "transformer_ref")
FIXED_BY_REQUEST = "the request geometry (config/geometry.py) is the released model's"


def refusal(where: str, key: str, value, supported: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={value!r} is not supported: {supported}")


def _config(folder: CheckpointFolder, component: str) -> tuple[dict, str]:
    """(config dict, its path relative to the checkpoint root, as messages name it)."""
    return folder.config(component), folder.rel(folder.config_file(component))


def transformer_config(folder: CheckpointFolder, component: str) -> H3DiTConfig:
    """The DiT's typed config; a value our DiT cannot build is refused naming the file."""
    data, where = _config(folder, component)
    try:
        config = H3DiTConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if config.patch_size != PATCH_SIZE:
        raise refusal(where, "patch_size", list(config.patch_size),
                      f"{list(PATCH_SIZE)} ({FIXED_BY_REQUEST}: canvas sides multiples of 32, the row layout)")
    return config


def flow_shifts(folder: CheckpointFolder) -> FlowShifts:
    """The shifts of `scheduler/` (video) and `audio_scheduler/` (audio), as diffusers' MiniMaxH3Scheduler reads
    them (a config without `shift` gets the class default, 12.0)."""
    shifts = []
    for component in ("scheduler", "audio_scheduler"):
        data, where = _config(folder, component)
        shift = data.get("shift", DEFAULT_SHIFT)
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise refusal(where, "shift", shift, "a positive number")
        shifts.append(float(shift))
    return FlowShifts(video=shifts[0], audio=shifts[1])


def _check_video_vae(folder: CheckpointFolder) -> None:
    data, where = _config(folder, "vae")
    # (key, the class default when the key is absent, the value h3serve supports); defaults = released values
    for key, got, want in (
        ("clip_length", data.get("clip_length", FRAMES_PER_CLIP), FRAMES_PER_CLIP),
        ("token_drop", data.get("token_drop", TOKEN_DROP), TOKEN_DROP),
        ("spatial_downsample_factors", data.get("spatial_downsample_factors"), VAE_SPATIAL),
        ("temporal_downsample_factors", data.get("temporal_downsample_factors"), TEMPORAL_RATIO),
    ):
        if key.endswith("_factors"):
            if got is None:
                continue  # the class default: the released 16x / 4x
            if math.prod(int(f) for f in got) != want:
                raise refusal(where, key, list(got), f"factors whose product is {want} ({FIXED_BY_REQUEST})")
        elif got != want:
            raise refusal(where, key, got, f"{want} ({FIXED_BY_REQUEST}: 17n+5 frames -> 5n+2 latents)")


def _check_audio_vae(folder: CheckpointFolder) -> None:
    data, where = _config(folder, "audio_vae")
    rate = data.get("sampling_rate", SAMPLE_RATE)
    if rate != SAMPLE_RATE:
        raise refusal(where, "sampling_rate", rate, f"{SAMPLE_RATE} ({FIXED_BY_REQUEST})")
    rates = data.get("encoder_rates")
    if rates is not None and math.prod(int(r) for r in rates) != AUDIO_HOP:
        raise refusal(where, "encoder_rates", list(rates),
                      f"strides whose product (the hop) is {AUDIO_HOP}: 40 latents/s at {SAMPLE_RATE} Hz "
                      f"({FIXED_BY_REQUEST})")


def _check_channels(folder: CheckpointFolder, component: str, config: H3DiTConfig) -> None:
    """The DiT's channels and text width must be the VAEs' and the text encoder's (diffusers fails mid-request)."""
    where = folder.rel(folder.config_file(component))
    pairs = (("in_channels", config.in_channels, "vae", lambda d: d.get("latent_channels")),
             ("audio_in_channels", config.audio_in_channels, "audio_vae", lambda d: d.get("latent_channels")),
             ("text_dim", config.text_dim, "text_encoder", lambda d: d.get("text_config", {}).get("hidden_size")))
    for key, ours, other, read in pairs:
        if other not in folder.entries:
            continue
        data, other_where = _config(folder, other)
        theirs = read(data)
        if theirs is not None and theirs != ours:
            other_key = "text_config.hidden_size" if other == "text_encoder" else "latent_channels"
            raise refusal(where, key, ours, f"equal to {other_where} {other_key} = {theirs!r}")


def check_checkpoint(folder: CheckpointFolder) -> None:
    """Refuse what h3serve cannot serve, reading every config the index lists (cheap: JSON only). Each loader calls
    this, so a stage refuses a checkpoint at load whichever of its components it loads itself."""
    for key, want in (("canvas_short_edge", CANVAS_SHORT_EDGE), ("canvas_max_pixels", CANVAS_MAX_PIXELS)):
        got = folder.pipeline_config.get(key, want)
        if got != want:
            raise refusal(INDEX_FILE, key, got, f"{want} ({FIXED_BY_REQUEST}: the canvas rule)")
    if "vae" in folder.entries:
        _check_video_vae(folder)
    if "audio_vae" in folder.entries:
        _check_audio_vae(folder)
    for component in TRANSFORMERS:
        if component in folder.entries:
            _check_channels(folder, component, transformer_config(folder, component))
    if {"scheduler", "audio_scheduler"} <= set(folder.entries):
        flow_shifts(folder)


def checked_folder(checkpoint: str | Path, components) -> CheckpointFolder:
    """The checkpoint folder, validated for `components` and checked by `check_checkpoint`."""
    folder = CheckpointFolder(Path(checkpoint), components=list(components))
    check_checkpoint(folder)
    return folder


__all__ = ["check_checkpoint", "checked_folder", "flow_shifts", "refusal", "transformer_config"]
