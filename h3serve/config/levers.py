"""The capacity and speed levers and their one combination rule, written once.

Levers of a deployment (CLI `h3serve serve` / `generate` flags, the CRD's `dit.levers`, `encoder.levers`,
`vae.levers`): DiT layerwise offload (a window of `resident_blocks` DiT blocks on the device, the rest streamed from
pinned host memory, `offload_mode` with several ranks), the text decoder's layerwise offload
(`encoder_resident_layers`), VAE staging (`vae_staged`: both VAEs in pinned host memory, on the device only for the
request that decodes), FP8 linear layers (the DiT blocks and the text decoder), FP8 attention. Lever of a request:
`quality` (`high` = step reuse). Every lever is off by default; offload and staging change no output.

The rule: profile fasth3 takes none of them (the published work has not certified the student with offload, caching
or quantization). `LEVERS_MESSAGE` is its one message; each surface fills in its own spelling of the fields
(`CLI_NAMES`, `SPEC_NAMES`, `REQUEST_NAMES`), so the CLI, the request validation, the engine and the CRD's CEL rule
say the same sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.errors import H3Error
from h3serve.config.vocab import (
    DEFAULT_QUALITY,
    DIT_LAYERS,
    ENCODER_LAYERS,
    MIN_RESIDENT_BLOCKS,
    OFFLOAD_MODES,
)

LEVERS_MESSAGE = ("profile fasth3 takes no {offload}, {encoder_offload}, {vae_staged}, {fp8}, {fp8_attention} or "
                  "{quality}=high: offload, staging, FP8 and step reuse are certified for profile base only")
# Staging copies the whole VAE once per request; patch parallel calls its decoder tile by tile on several ranks.
STAGED_VAE_MESSAGE = "{vae_staged} needs {vae_pp}=1 (got {pp:d}): patch-parallel ranks keep their VAE resident"
CLI_NAMES = dict(offload="--dit-resident-blocks", encoder_offload="--encoder-resident-layers",
                 vae_staged="--vae-staged", fp8="--fp8", fp8_attention="--fp8-attention", quality="quality",
                 vae_pp="--vae-pp")
SPEC_NAMES = dict(offload="dit.levers.residentBlocks", encoder_offload="encoder.levers.residentLayers",
                  vae_staged="vae.levers.staged", fp8="dit.levers.fp8", fp8_attention="dit.levers.fp8Attention",
                  quality="quality", vae_pp="vae.patchParallel")
REQUEST_NAMES = dict(offload="resident_blocks", encoder_offload="encoder_resident_layers", vae_staged="vae_staged",
                     fp8="fp8", fp8_attention="fp8_attention", quality="quality", vae_pp="vae_pp")


class LeverError(H3Error, ValueError):
    """A lever value or combination is refused; `field` names it as the caller spelled it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Levers:
    resident_blocks: int | None = None  # None: every DiT block resident (no offload)
    offload_mode: str = "local"
    fp8: bool = False
    fp8_attention: bool = False
    encoder_resident_layers: int | None = None  # None: every text decoder layer resident
    vae_staged: bool = False

    @property
    def any(self) -> bool:
        return (self.resident_blocks is not None or self.fp8 or self.fp8_attention
                or self.encoder_resident_layers is not None or self.vae_staged)

    def lossy(self) -> bool:
        """Whether the deployment's outputs differ from the dense bf16 path (offload does not change them)."""
        return self.fp8 or self.fp8_attention

    def check(self, num_layers: int = DIT_LAYERS, names: dict = CLI_NAMES) -> "Levers":
        if self.resident_blocks is not None and not MIN_RESIDENT_BLOCKS <= self.resident_blocks <= num_layers:
            raise LeverError(names["offload"], f"{names['offload']}={self.resident_blocks} must be between "
                             f"{MIN_RESIDENT_BLOCKS} (a copy one block ahead needs two slots) and the {num_layers} "
                             f"DiT layers")
        if self.encoder_resident_layers is not None and not (
                MIN_RESIDENT_BLOCKS <= self.encoder_resident_layers <= ENCODER_LAYERS):
            raise LeverError(names["encoder_offload"], f"{names['encoder_offload']}={self.encoder_resident_layers} "
                             f"must be between {MIN_RESIDENT_BLOCKS} (a copy one layer ahead needs two slots) and the "
                             f"{ENCODER_LAYERS} text decoder layers")
        if self.offload_mode not in OFFLOAD_MODES:
            raise LeverError("offload_mode", f"offload mode {self.offload_mode!r} must be one of "
                             f"{', '.join(OFFLOAD_MODES)}")
        return self


def lever_conflict(profile: str, levers: Levers = Levers(), quality: str = DEFAULT_QUALITY,
                   names: dict = CLI_NAMES) -> str | None:
    """The combination rule: None when allowed, else LEVERS_MESSAGE in the caller's spelling."""
    if profile == "fasth3" and (levers.any or quality == "high"):
        return LEVERS_MESSAGE.format(**names)
    return None


def staging_conflict(levers: Levers, vae_pp: int, names: dict = CLI_NAMES) -> str | None:
    """None when VAE staging (if on) fits the VAE's degree, else STAGED_VAE_MESSAGE in the caller's spelling."""
    if levers.vae_staged and vae_pp != 1:
        return STAGED_VAE_MESSAGE.format(pp=vae_pp, **names)
    return None


def check_combination(profile: str, levers: Levers = Levers(), quality: str = DEFAULT_QUALITY,
                      names: dict = CLI_NAMES, field: str = "profile") -> None:
    msg = lever_conflict(profile, levers, quality, names)
    if msg is not None:
        raise LeverError(field, msg)
