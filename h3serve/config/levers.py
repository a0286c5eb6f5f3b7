"""The capacity and speed levers: one table, and their one combination rule.

Each lever is one field of `Levers`, declared with `lever(...)`: its flag on `h3serve serve` / `generate`, its path
in the CRD, how a request-time message spells it, the stages that read it, its bounds or choices, whether it changes
outputs (lossy) and whether profile fasth3 may use it. Everything else reads the table: the CLI's flags
(`add_flags`, `from_args`), the CRD's lever objects (`levers_spec_class`, used by config/spec.py), what a stage gets from a
mounted ServiceConfig (`stage_levers`), the range checks (`Levers.check`), the FastH3 rule and its message in each
spelling (`LEVERS_MESSAGE`, `CLI_NAMES`, `SPEC_NAMES`, `REQUEST_NAMES`) and the CRD's CEL rule (config/rules.py).

The levers today: DiT layerwise offload (a window of `resident_blocks` DiT blocks on the device, the rest streamed
from pinned host memory; `offload_mode` with several ranks), the text decoder's layerwise offload
(`encoder_resident_layers`), VAE staging (`vae_staged`: both VAEs in pinned host memory, on the device only for the
request that decodes), FP8 linear layers (the DiT blocks and the text decoder), FP8 attention, block-sparse attention
(`sparse_attention`, a density in percent). Lever of a request:
`quality` (`high` = step reuse). Every lever is off by default; offload and staging change no output.

The rule: profile fasth3 takes the lossless ones only (offload, staging, the AdaLN table: bitwise the same output,
tested on the student too); the lossy ones (FP8, sparse attention, step reuse) stay refused until the student's own
deviation is measured (the published work has not certified the student with caching or quantization). A row with
`fasth3=True` is one a FastH3 deployment may use.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from h3serve.config.codec import at_path, f
from h3serve.errors import H3Error
from h3serve.config.vocab import (
    DEFAULT_QUALITY,
    DIT_LAYERS,
    ENCODER_LAYERS,
    MIN_RESIDENT_BLOCKS,
    OFFLOAD_MODES,
    SPARSE_DENSITIES,
)


def on_off(text: str) -> bool:
    """A lever's on|off flag value."""
    value = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} must be on or off")
    return value


def lever(default: Any, *, flag: str, spec: str, request: str, stages: tuple[str, ...], help: str, doc: str,
          bounds: tuple[int, int] | None = None, choices: tuple[str, ...] | None = None, lossy: bool = False,
          fasth3: bool = False, setting_of: str | None = None, why: str = "", of: str = "") -> Any:
    """One row of the lever table (see the module docstring); `setting_of`: not a lever alone but a setting of that
    one (it turns nothing on); `why` and `of`: what the bounds stand for, said when a value is refused."""
    return field(default=default, metadata=dict(
        flag=flag, spec=spec, request=request, stages=stages, help=help, doc=doc, bounds=bounds, choices=choices,
        lossy=lossy, fasth3=fasth3, setting_of=setting_of, why=why, of=of))


@dataclass(frozen=True, kw_only=True)
class Levers:
    """The levers of one deployment; every one off by default. Its fields are the lever table."""

    resident_blocks: int | None = lever(
        None, flag="--dit-resident-blocks", spec="dit.levers.residentBlocks", request="resident_blocks",
        stages=("dit",), bounds=(MIN_RESIDENT_BLOCKS, DIT_LAYERS), why="a copy one block ahead needs two slots", of="DiT layers",
        fasth3=True,
        help=f"dit: layerwise offload, R DiT blocks on the GPU ({MIN_RESIDENT_BLOCKS}..{DIT_LAYERS}), the rest "
             "streamed from pinned host memory (default: all resident)",
        doc="Layerwise offload: DiT blocks kept on each GPU (the rest stream from pinned host memory one block ahead "
            f"of the compute); unset: all {DIT_LAYERS} resident.")
    offload_mode: str = lever(
        "local", flag="--dit-offload-mode", spec="dit.levers.offloadMode", request="offload_mode", stages=("dit",),
        choices=OFFLOAD_MODES, setting_of="resident_blocks",
        help="dit: with several ranks, each pins the whole host copy (local) or a shard (allgather)",
        doc="With several DiT ranks: local (each rank pins the whole host copy) or allgather (each rank pins "
            "1/ranks of it; blocks are all-gathered).")
    encoder_resident_layers: int | None = lever(
        None, flag="--encoder-resident-layers", spec="encoder.levers.residentLayers",
        request="encoder_resident_layers", stages=("encoder",), bounds=(MIN_RESIDENT_BLOCKS, ENCODER_LAYERS),
        fasth3=True, why="a copy one layer ahead needs two slots", of="text decoder layers",
        help=f"encoder: layerwise offload, R text decoder layers on the GPU ({MIN_RESIDENT_BLOCKS}..{ENCODER_LAYERS}), "
             "the rest streamed from pinned host memory (default: all resident)",
        doc="Layerwise offload of the text decoder: layers kept on each GPU (the rest stream from pinned host memory "
            f"one layer ahead); unset: all {ENCODER_LAYERS} resident.")
    vae_staged: bool = lever(
        False, flag="--vae-staged", spec="vae.levers.staged", request="vae_staged", stages=("vae",), fasth3=True,
        help="vae: both VAEs in pinned host memory, copied to the GPU for each request (default off)",
        doc="Keep both VAEs in pinned host memory and copy them to the GPU for each request's decode (one copy per "
            "request); needs patchParallel 1.")
    fp8: bool = lever(
        False, flag="--fp8", spec="dit.levers.fp8", request="fp8", stages=("dit", "encoder"), lossy=True,
        help="dit, encoder: FP8 linear layers in the DiT blocks and the text decoder (lossy; default off)",
        doc="FP8 (e4m3, row-wise scales) linear layers in the DiT blocks (attention and FFN) and the text encoder's "
            "decoder layers; lossy.")
    fp8_attention: bool = lever(
        False, flag="--fp8-attention", spec="dit.levers.fp8Attention", request="fp8_attention", stages=("dit",),
        lossy=True, help="dit: FP8 attention, FlashAttention-3's FP8 forward (lossy; default off)",
        doc="FP8 DiT attention (FlashAttention-3's FP8 forward); lossy.")

    sparse_attention: str = lever(
        "off", flag="--sparse-attention", spec="dit.levers.sparseAttention", request="sparse_attention",
        stages=("dit",), choices=SPARSE_DENSITIES, lossy=True,
        help="dit: block-sparse DiT attention keeping this percent of each query block's key blocks per modality "
             "after the first 20%% of the steps (lossy; default off)",
        doc="Block-sparse DiT attention (a training-free router over 128-row blocks, FlashAttention-4's block-sparse "
            "forward): the percent of each query block's video and audio key blocks kept, text always kept, the "
            "first 20% of the steps dense; lossy.")

    adaln_table: bool = lever(
        False, flag="--adaln-table", spec="dit.levers.adalnTable", request="adaln_table", stages=("dit",), fasth3=True,
        help="dit: the AdaLN projections' outputs for the profile's schedule as a table in host memory: their weights "
             "(about 24 GiB of the released DiT) leave the GPU, the output is bitwise the same (default off)",
        doc="Precompute the AdaLN projections' outputs for the profile's schedule into a table in host memory (their "
            "weights, about 24 GiB of the released DiT, leave the GPU); lossless, bitwise the same output; allowed "
            "for FastH3.")

    @property
    def on(self) -> tuple[str, ...]:
        """The levers turned on (a setting of another lever turns nothing on)."""
        return tuple(fl.name for fl in LEVERS
                     if fl.metadata["setting_of"] is None and getattr(self, fl.name) != fl.default)

    @property
    def any(self) -> bool:
        return bool(self.on)

    def lossy(self) -> bool:
        """Whether the deployment's outputs differ from the dense bf16 path (offload does not change them)."""
        return any(LEVER[name].metadata["lossy"] for name in self.on)

    def check(self, names: dict | None = None, **bounds: tuple[int, int]) -> "Levers":
        """Each value within its row's bounds or choices (`bounds` overrides a row's, e.g. a checkpoint's layer
        count); the error names the field as `names` spells it (default: the CLI's flags)."""
        names = names or CLI_NAMES
        for fl in LEVERS:
            v, md = getattr(self, fl.name), fl.metadata
            lo_hi = bounds.get(fl.name, md["bounds"])
            if lo_hi is not None and v is not None and not lo_hi[0] <= v <= lo_hi[1]:
                raise LeverError(names[fl.name], f"{names[fl.name]}={v} must be between {lo_hi[0]} ({md['why']}) "
                                                 f"and the {lo_hi[1]} {md['of']}")
            if md["choices"] is not None and v not in md["choices"]:
                raise LeverError(names[fl.name], f"{names[fl.name]}={v!r} must be one of {', '.join(md['choices'])}")
        return self

    def only(self, stage: str) -> "Levers":
        """The levers `stage` reads (the others at their defaults): a disaggregated pod gets only its own."""
        return Levers(**{fl.name: getattr(self, fl.name) for fl in LEVERS if stage in fl.metadata["stages"]})


LEVERS: tuple[dataclasses.Field, ...] = fields(Levers)
LEVER = {fl.name: fl for fl in LEVERS}
TYPES = typing.get_type_hints(Levers)
_OTHERS = {"quality": ("quality", "quality", "quality"), "vae_pp": ("--vae-pp", "vae.patchParallel", "vae_pp")}
CLI_NAMES = {**{fl.name: fl.metadata["flag"] for fl in LEVERS}, **{k: v[0] for k, v in _OTHERS.items()}}
SPEC_NAMES = {**{fl.name: fl.metadata["spec"] for fl in LEVERS}, **{k: v[1] for k, v in _OTHERS.items()}}
REQUEST_NAMES = {**{fl.name: fl.metadata["request"] for fl in LEVERS}, **{k: v[2] for k, v in _OTHERS.items()}}
FASTH3_REFUSED = tuple(fl.name for fl in LEVERS if not fl.metadata["fasth3"] and fl.metadata["setting_of"] is None)
LEVERS_MESSAGE = ("profile fasth3 takes no " + ", ".join("{%s}" % name for name in FASTH3_REFUSED) +
                  " or {quality}=high: FP8, sparse attention and step reuse are lossy and certified for profile base "
                  "only (the lossless offload, staging and AdaLN table levers are allowed)")
# Staging copies the whole VAE once per request; patch parallel calls its decoder tile by tile on several ranks.
STAGED_VAE_MESSAGE = "{vae_staged} needs {vae_pp}=1 (got {pp:d}): patch-parallel ranks keep their VAE resident"


class LeverError(H3Error, ValueError):
    """A lever value or combination is refused; `field` names it as the caller spelled it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The levers' flags, the same for `serve` and the embedded `generate`."""
    for fl in LEVERS:
        md = fl.metadata
        if TYPES[fl.name] is bool:
            p.add_argument(md["flag"], type=on_off, default=fl.default, metavar="on|off", help=md["help"])
        elif md["choices"] is not None:
            p.add_argument(md["flag"], default=fl.default, choices=md["choices"], help=md["help"])
        else:
            p.add_argument(md["flag"], type=int, default=fl.default, metavar="R", help=md["help"])


def from_args(args: argparse.Namespace) -> Levers:
    """The levers the flags of `add_flags` ask for."""
    return Levers(**{fl.name: getattr(args, _dest(fl.metadata["flag"])) for fl in LEVERS})


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def levers_spec_class(stage: str, name: str) -> type:
    """The CRD object `<stage>.levers`: one field a row whose spec path is under it (config/spec.py)."""
    prefix = f"{stage}.levers."
    rows = [fl for fl in LEVERS if fl.metadata["spec"].startswith(prefix)]
    return dataclasses.make_dataclass(name, [(fl.name, TYPES[fl.name], _spec_field(fl, prefix)) for fl in rows],
                                      frozen=True)


def _spec_field(fl: dataclasses.Field, prefix: str) -> Any:
    md, schema = fl.metadata, {}
    if md["bounds"] is not None:
        schema.update(minimum=md["bounds"][0], maximum=md["bounds"][1])
    if md["choices"] is not None:
        schema["enum"] = list(md["choices"])
    return f(md["spec"].removeprefix(prefix), md["doc"], fl.default, **schema)


def stage_levers(spec: Any, stage: str, colocated: bool) -> Levers:
    """The levers a stage of a deployment runs with: every lever it reads, from the typed spec at the row's path."""
    return Levers(**{fl.name: at_path(spec, fl.metadata["spec"]) for fl in LEVERS
                     if colocated or stage in fl.metadata["stages"]})


def lever_conflict(profile: str, levers: Levers = Levers(), quality: str = DEFAULT_QUALITY,
                   names: dict = CLI_NAMES) -> str | None:
    """The combination rule: None when allowed, else LEVERS_MESSAGE in the caller's spelling."""
    if profile == "fasth3" and (any(n in FASTH3_REFUSED for n in levers.on) or quality == "high"):
        return LEVERS_MESSAGE.format(**names)
    return None


def fasth3_levers(levers: Levers) -> Levers:
    """A base deployment's levers as its FastH3 DiT pool runs them: the lossless ones it sets, every lever profile
    fasth3 refuses back at its default."""
    return dataclasses.replace(levers, **{name: LEVER[name].default for name in FASTH3_REFUSED})


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
