"""Per-request LoRA: the adapters a deployment allows, and what a request may say about them.

A deployment lists its adapters (name, file, sha256, and for a few-step "Turbo" adapter its step count); a request
names one (`lora`: the name, or {"name", "scale"} as vLLM-Omni spells it). A request never chooses a file: the DiT
opens only the files the deployment lists, each checked against its sha256. vLLM-Omni's request also carries the
adapter's `path` / `local_path`; one equal to the listed file of that name is accepted, any other refused.

The list travels as one knob (`--loras`), entries separated by commas:  NAME=PATH@SHA256[@STEPS]

No torch here: the gateway, the CLI and the operator read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from h3serve.errors import H3Error, RequestError

LORA_CACHE_BYTES = 1 << 30          # adapters kept on the DiT's device, least recently used dropped first
NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
SCALE_RANGE = (-4.0, 4.0)           # a LoRA's strength; 1.0 = as trained, 0 = off
_NAME, _SHA = re.compile(NAME_PATTERN), re.compile(SHA256_PATTERN)
# H3's two DiT partitions share module names, and a LoRA trained on one degrades the other: ours patch transformer/
LORA_TASKS = ("t2va", "fl2va")
REF2VA_REFUSAL = ("per-request LoRA applies to the t2va / fl2va partition (transformer/); ref2va runs transformer_ref/, "
                  "which a LoRA trained on transformer/ would degrade")
# The one lever LoRA cannot run beside (the spec's CEL rule, `h3serve serve` and the DiT engine say it the same way)
FP8_REFUSAL = ("per-request LoRA adds (x A^T) B^T beside each Linear, which the FP8 GEMMs (taking quantized rows) "
               "cannot: turn dit.levers.fp8 (--fp8) off to serve dit.loras (--loras)")
_PATH_KEYS = ("path", "local_path")
_REQUEST_KEYS = ("name", "scale", *_PATH_KEYS)


@dataclass(frozen=True)
class LoraEntry:
    """One adapter the deployment allows: diffusers / PEFT LoRA safetensors (`transformer.<module>.lora_A.weight`)."""

    name: str
    path: str
    sha256: str
    steps: int | None = None   # a few-step (Turbo) adapter: the sigma grid points it was distilled for

    def knob(self) -> str:
        return f"{self.name}={self.path}@{self.sha256}" + (f"@{self.steps}" if self.steps is not None else "")


@dataclass(frozen=True)
class LoraChoice:
    """What a request asks: one allowed adapter at a strength (and the file a vLLM-Omni caller named with it)."""

    name: str
    scale: float = 1.0
    path: str | None = None


def parse_loras(text: str | None) -> tuple[LoraEntry, ...]:
    """`--loras`: NAME=PATH@SHA256[@STEPS], comma separated; a mistake names the entry and the expected form."""
    entries: list[LoraEntry] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        form = f"--loras entry {item!r} must be NAME=PATH@SHA256[@STEPS]"
        name, eq, rest = item.partition("=")
        parts = rest.rsplit("@", 2) if eq else []
        if len(parts) == 3 and not parts[2].isdigit():
            parts = rest.rsplit("@", 1)
        if len(parts) < 2 or not parts[0]:
            raise H3Error(form)
        path, sha, steps = parts[0], parts[1].lower(), int(parts[2]) if len(parts) == 3 else None
        if not _NAME.match(name):
            raise H3Error(f"{form}: NAME {name!r} must match {NAME_PATTERN}")
        if not _SHA.match(sha):
            raise H3Error(f"{form}: SHA256 {parts[1]!r} must be 64 lower-case hex digits")
        if steps is not None and steps < 2:
            raise H3Error(f"{form}: STEPS {steps} must be >= 2 (sigma grid points incl. the terminal 0)")
        if any(e.name == name for e in entries):
            raise H3Error(f"--loras names {name!r} twice")
        entries.append(LoraEntry(name, path, sha, steps))
    return tuple(entries)


def format_loras(entries: Sequence[LoraEntry]) -> str | None:
    return ",".join(e.knob() for e in entries) or None


def lora_choice(value: Any) -> LoraChoice | None:
    """The request's `lora`: a name, or {"name", "scale"}. Paths are refused: only the deployment's files load."""
    if value is None:
        return None
    allowed = ('an adapter name, or {"name": NAME, "scale": number in [-4, 4]} naming one of the deployment\'s '
               "adapters (GET /v1/models lists them)")
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise RequestError("lora", value, allowed)
    unknown = sorted(str(k) for k in value if k not in _REQUEST_KEYS)
    if unknown:
        raise RequestError(f"lora.{unknown[0]}", value[unknown[0]], "unknown key; allowed: " + ", ".join(_REQUEST_KEYS))
    paths = [k for k in _PATH_KEYS if value.get(k) is not None]
    if len(paths) > 1 or (paths and not isinstance(value[paths[0]], str)):
        raise RequestError(f"lora.{paths[-1]}", value[paths[-1]], "one path, a string (the listed file of lora.name)")
    name = value.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError("lora.name", name, allowed)
    scale = value.get("scale", 1.0)
    lo, hi = SCALE_RANGE
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or not lo <= scale <= hi:
        raise RequestError("lora.scale", scale, f"a number in [{lo:g}, {hi:g}] (1 = as trained)")
    return LoraChoice(name, float(scale), value[paths[0]] if paths else None)


def find_lora(entries: Sequence[LoraEntry], name: str, path: str | None = None) -> LoraEntry:
    """The allowed adapter `name`, or a RequestError listing the allowed ones; a `path` the caller gave must be its
    listed file (the request never chooses a file)."""
    for entry in entries:
        if entry.name == name:
            if path is not None and path != entry.path:
                raise RequestError("lora.path", path, f"the deployment's file for lora.name {name!r}, or left out: a "
                                                      "request cannot choose a file")
            return entry
    names = ", ".join(e.name for e in entries) or "none: this deployment lists no LoRA adapters"
    raise RequestError("lora.name", name, f"one of the deployment's adapters ({names})")


def lora_steps(entry: LoraEntry, steps: int | None, *, field: str = "num_inference_steps") -> int | None:
    """The steps a request with `entry` runs: a few-step adapter's own count (a request giving another is refused),
    else the request's."""
    if entry.steps is None or steps is None:
        return entry.steps if steps is None else steps
    if steps != entry.steps:
        raise RequestError(field, steps, f"LoRA {entry.name!r} is a few-step adapter distilled for {entry.steps} "
                                         f"sigma grid points: {entry.steps} or unset")
    return steps
