"""Synthetic FastH3 adapters: `fastvideo-lora-v2` files shaped for a checkpoint's DiT, with random deltas.

For tests and benchmarks (and `h3serve checkpoint init-adapter`); the reader is `h3serve.weights.adapter`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from h3serve.errors import CheckpointError
from h3serve.weights.adapter import BASE_MODEL, FORMAT, VSA_GATE_MODULE
from h3serve.weights.folder import CheckpointFolder
from h3serve.weights.headers import sha256_file
from h3serve.weights.safetensors import write_safetensors

# The `application` metadata the published adapters carry (the reader does not use it).
APPLICATION = "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned"

# Modules given a low-rank pair: every linear of each block and of each refiner block.
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2",
                 "adaln_proj.linear")
REFINER_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
# Full-rank residuals: (module, with bias delta).
DIFF_MODULES = (("proj_in", True), ("proj_out", True), ("norm_out.linear", True), ("norm_out.norm", False),
                ("token_refiner.final_norm", False), ("transformer_blocks.0.norm1", False),
                ("audio_proj_out", True))


def init_adapter(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    rank: int = 4,
    seed: int = 0,
    component: str = "transformer",
    vsa: bool = False,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Write a synthetic `fastvideo-lora-v2` adapter for a checkpoint's DiT and return its sha256.

    lora_A/lora_B (rank `rank`) on every block linear (to_q/k/v, to_out.0, ff.net.0.proj, ff.net.2,
    adaln_proj.linear) and every refiner linear; `.diff` / `.diff_b` full-rank deltas on proj_in, proj_out,
    audio_proj_out, norm_out.linear and on the norm weights norm_out.norm, token_refiner.final_norm and
    transformer_blocks.0.norm1. `vsa=True` adds `attn.to_gate_compress.set_weight` gates per block (such a file
    is refused by `Adapter.open`; it exists to test that). Shapes come from the checkpoint's headers.
    Deterministic for a seed; written atomically.
    """
    ck = CheckpointFolder(checkpoint_dir, components=[component])
    infos = ck.tensor_infos(component)
    gen = torch.Generator().manual_seed(seed)
    n_blocks = len({n.split(".")[1] for n in infos if n.startswith("transformer_blocks.")})
    n_refiner = len({n.split(".")[2] for n in infos if n.startswith("token_refiner.refiner_blocks.")})

    lora_modules = [f"transformer_blocks.{i}.{m}" for i in range(n_blocks) for m in BLOCK_LINEARS]
    lora_modules += [f"token_refiner.refiner_blocks.{i}.{m}" for i in range(n_refiner) for m in REFINER_LINEARS]

    tensors: dict[str, torch.Tensor] = {}
    touched: set[str] = set()
    for module in lora_modules:
        weight = f"{module}.weight"
        if weight not in infos:
            raise CheckpointError(f"{ck.weights_label(component)}: tensor '{weight}' is missing")
        out_f, in_f = infos[weight].shape
        tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).to(dtype)
        tensors[f"{module}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.02).to(dtype)
        touched.add(weight)
    for module, with_bias in DIFF_MODULES:
        weight = f"{module}.weight"
        if weight not in infos:
            raise CheckpointError(f"{ck.weights_label(component)}: tensor '{weight}' is missing")
        tensors[f"{module}.diff"] = (torch.randn(infos[weight].shape, generator=gen) * 0.01).to(dtype)
        touched.add(weight)
        if with_bias:
            tensors[f"{module}.diff_b"] = (torch.randn(infos[f"{module}.bias"].shape, generator=gen) * 0.01).to(dtype)
            touched.add(f"{module}.bias")
    n_gates = 0
    if vsa:
        for i in range(n_blocks):
            inner, hidden = infos[f"transformer_blocks.{i}.attn.to_q.weight"].shape
            tensors[f"transformer_blocks.{i}.attn.{VSA_GATE_MODULE}.set_weight"] = (
                torch.randn(inner, hidden, generator=gen) * 0.02).to(dtype)
            n_gates += 1

    metadata = {
        "format": FORMAT,
        "base_model": BASE_MODEL,
        "finetuned_model": "FastVideo/FastH3-synthetic",
        "base_revision": "",
        "finetuned_revision": "",
        "rank": str(rank),
        "application": APPLICATION,
        "low_rank_tensors": str(2 * len(lora_modules)),
        "diff_tensors": str(sum(2 if b else 1 for _, b in DIFF_MODULES)),
        "set_weight_tensors": str(n_gates),
        "dropped_unchanged": str(len(set(infos) - touched)),
        "finalized_from": f"synthetic seed={seed} component={component}",
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent)
    os.close(fd)
    try:
        write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sha256_file(out_path)


# Per-request LoRA (models/dit/lora.py): the block linears diffusers' H3 LoRAs target, AdaLN projections left out.
LORA_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")


def init_lora(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *, rank: int = 4, seed: int = 0,
              alpha: float | None = None, modules: tuple[str, ...] = LORA_LINEARS, magnitude: float = 0.05) -> str:
    """Write a synthetic per-request LoRA in the diffusers key format (`transformer.<module>.lora_A.weight` [r, in],
    `.lora_B.weight` [out, r]) on `modules` of every block of a checkpoint's transformer; `alpha` is recorded as the
    file's metadata alpha (scale alpha / r), absent: scale 1. Deterministic for a seed; returns its sha256."""
    ck = CheckpointFolder(checkpoint_dir, components=["transformer"])
    infos = ck.tensor_infos("transformer")
    gen = torch.Generator().manual_seed(seed)
    n_blocks = len({n.split(".")[1] for n in infos if n.startswith("transformer_blocks.")})
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n_blocks):
        for m in modules:
            out_f, in_f = infos[f"transformer_blocks.{i}.{m}.weight"].shape
            key = f"transformer.transformer_blocks.{i}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * magnitude
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_path, tensors, {"alpha": str(alpha)} if alpha is not None else None)
    return sha256_file(out_path)
