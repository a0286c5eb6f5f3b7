"""A per-request LoRA file: diffusers / PEFT LoRA safetensors for the H3 transformer, read after its sha256 checks.

Keys (what diffusers' `save_lora_weights` / `MiniMaxH3LoraLoaderMixin` read for the `transformer` partition):

    transformer.<module>.lora_A.weight  [r, in]      (also bare `<module>.…` and PEFT's `base_model.model.<module>.…`,
    transformer.<module>.lora_B.weight  [out, r]      and PEFT's `.default.` infix)
    transformer.<module>.alpha          []          optional per-module alpha: scale alpha / r

Scale per module, as diffusers applies it: a per-module `.alpha` (alpha / r); else the safetensors metadata
`lora_adapter_metadata` (diffusers' LoraConfig: lora_alpha / r); else a metadata `alpha` (alpha / r, the H3 Turbo
convention); else 1 (alpha == rank). DoRA, rank / alpha patterns and rsLoRA are refused, as are `transformer_ref.`
keys (a LoRA for the ref2va partition).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.errors import AdapterError
from h3serve.weights.headers import sha256_file

_PREFIXES = ("transformer.", "base_model.model.")
_ROLES = (".lora_A.weight", ".lora_B.weight", ".alpha")


@dataclass
class LoraModule:
    """One Linear's factors (float32, CPU) and its scale: y += (x @ A^T) @ B^T * scale."""

    a: torch.Tensor   # (r, in)
    b: torch.Tensor   # (out, r)
    scale: float


def _split(path: Path, key: str) -> tuple[str, str]:
    name = key.replace(".default.", ".")
    if name.startswith("transformer_ref."):
        raise AdapterError(f"{path}: tensor '{key}' is for the ref2va partition (transformer_ref); per-request LoRA "
                           "applies to transformer/ (t2va, fl2va)")
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    for role in _ROLES:
        if name.endswith(role) and len(name) > len(role):
            return name[: -len(role)], role
    raise AdapterError(f"{path}: tensor '{key}' is not a LoRA key (expected <module>.lora_A.weight, "
                       "<module>.lora_B.weight or <module>.alpha; DoRA and full-rank diffs are not served)")


def _config_scale(path: Path, text: str) -> float:
    try:
        cfg = json.loads(text)
    except ValueError:
        raise AdapterError(f"{path}: metadata lora_adapter_metadata is not JSON") from None
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{path}: lora_adapter_metadata has a {key}; per-module ranks / alphas are not served")
    if cfg.get("use_dora") or cfg.get("use_rslora"):
        raise AdapterError(f"{path}: DoRA / rsLoRA adapters are not served (plain LoRA only)")
    try:
        return float(cfg["lora_alpha"]) / float(cfg["r"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise AdapterError(f"{path}: lora_adapter_metadata needs numbers r and lora_alpha") from None


def read_lora(path: str | Path, sha256: str) -> dict[str, LoraModule]:
    """Module name -> its factors and scale, from a file whose sha256 must be `sha256` (checked before reading)."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(f"{path}: LoRA file does not exist")
    actual = sha256_file(path)
    if actual != sha256.lower():
        raise AdapterError(f"{path}: sha256 mismatch: expected {sha256.lower()}, actual {actual}; refusing the LoRA")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise AdapterError(f"{path}: not a readable safetensors file: {exc}") from exc
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterError(f"{path}: tensor '{key}' has dtype {tensor.dtype}, expected a float")
        module, role = _split(path, key)
        parts.setdefault(module, {})[role] = tensor
    if not parts:
        raise AdapterError(f"{path}: holds no LoRA tensors")
    config_scale = _config_scale(path, metadata["lora_adapter_metadata"]) \
        if "lora_adapter_metadata" in metadata else None
    try:
        network_alpha = float(metadata["alpha"]) if "alpha" in metadata else None
    except ValueError:
        raise AdapterError(f"{path}: metadata alpha={metadata['alpha']!r} is not a number") from None
    out: dict[str, LoraModule] = {}
    for module, p in sorted(parts.items()):
        a, b = p.get(".lora_A.weight"), p.get(".lora_B.weight")
        if a is None or b is None:
            missing = "lora_B" if a is not None else "lora_A"
            raise AdapterError(f"{path}: module '{module}' has no {missing}.weight for its low-rank pair")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: module '{module}' has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                               "expected [r, in] and [out, r]")
        rank = a.shape[0]
        if ".alpha" in p:
            scale = float(p[".alpha"]) / rank
        elif config_scale is not None:
            scale = config_scale
        elif network_alpha is not None:
            scale = network_alpha / rank
        else:
            scale = 1.0
        out[module] = LoraModule(a.float(), b.float(), scale)
    return out
