"""Streaming a component's safetensors into a module: dtype policy, header validation, adapter fusion, report.

Weights are read with `safetensors.safe_open`, one tensor at a time, so loading a 61.7 GiB transformer never holds
the state dict twice: every tensor is validated against the module from the file headers first (names, shapes,
dtypes: no data read), then read, fused with an adapter if one is given, cast, and assigned into the module, which
may have been built on the `meta` device.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from h3serve.errors import AdapterError, CheckpointError
from h3serve.weights.adapter import Adapter
from h3serve.weights.folder import CheckpointFolder
from h3serve.weights.headers import data_offsets, open_file
from h3serve.weights.safetensors import FLOAT_DTYPES, dtype_name, st_dtype
from h3serve.weights.synthetic import generate, generated_tensors

# Module names that stay float32 when a component is loaded with dtype=bfloat16 (H3_REFERENCE §1.1, "dtype policy";
# the same lists as the diffusers classes' `_keep_in_fp32_modules`). Matched against dotted name components, see
# `name_matches`. The DiT's non-persistent `rope.inv_freq` is not in the state dict and is left to the module.
KEEP_FP32 = {
    "transformer": ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"),
    "transformer_ref": ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"),
    "vae": ("encoder", "quant_conv", "norm1", "norm2", "norm_out", "scale1", "scale2"),
    "audio_vae": ("*",),
    "text_encoder": (),
}


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a tensor name falls under one of `patterns`.

    A pattern with a wildcard (`*`, `?`, `[`) is an fnmatch glob over the whole name; otherwise it is a dotted module
    path that must appear as whole components of the name: `proj_in` matches `proj_in.weight` and
    `decoder.proj_in.bias` but not `audio_proj_in.weight`; `time_embedder.linear_1` matches
    `time_embedder.linear_1.weight`.
    """
    parts = name.split(".")
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            if fnmatch.fnmatchcase(name, pattern):
                return True
            continue
        want = pattern.split(".")
        n = len(want)
        if any(parts[i:i + n] == want for i in range(len(parts) - n + 1)):
            return True
    return False


def _as_folder(folder: CheckpointFolder | str | os.PathLike, component: str) -> CheckpointFolder:
    if isinstance(folder, CheckpointFolder):
        return folder
    return CheckpointFolder(folder, components=[component])


# ------------------------------------------------------------------------------------------------------------------
# Streaming


@dataclass(frozen=True)
class DtypePolicy:
    """Target dtype of each tensor: float tensors become `dtype`, except names matching `keep_fp32` (float32).

    `dtype=None` keeps the stored dtype (still upcasting `keep_fp32` names). Non-float tensors are never cast.
    """

    dtype: torch.dtype | None = None
    keep_fp32: tuple[str, ...] = ()

    def __call__(self, name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point:
            return stored
        if self.keep_fp32 and name_matches(name, self.keep_fp32):
            return torch.float32
        return stored if self.dtype is None else self.dtype


DtypePolicyLike = Union[DtypePolicy, torch.dtype, Callable[[str, torch.dtype], torch.dtype], None]


def _policy(p: DtypePolicyLike) -> Callable[[str, torch.dtype], torch.dtype] | None:
    if p is None or callable(p) and not isinstance(p, torch.dtype):
        return p  # type: ignore[return-value]
    if isinstance(p, torch.dtype):
        return DtypePolicy(p)
    raise TypeError(f"dtype_policy must be a DtypePolicy, a torch.dtype or a callable, got {type(p).__name__}")


def iter_tensors(
    folder: CheckpointFolder | str | os.PathLike,
    component: str,
    *,
    dtype_policy: DtypePolicyLike = None,
    names: Iterable[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for a component's weights, one tensor at a time, file by file, in on-disk order.

    Single-file and sharded (`*.safetensors.index.json`) components both work. Each tensor is read on its own with
    `safe_open`, so at most one tensor (plus its cast) is alive beyond what the caller keeps. `dtype_policy` casts
    float tensors (a `DtypePolicy`, a dtype, or `f(name, stored_dtype) -> dtype`); `names` restricts the tensors.
    A synthetic shard's generated tensors are made, not read (`h3serve.weights.synthetic`).
    """
    ck = _as_folder(folder, component)
    policy = _policy(dtype_policy)
    mapping = ck.weight_map(component)
    wanted = None if names is None else set(names)
    if wanted is not None:
        missing = sorted(wanted - set(mapping))
        if missing:
            raise CheckpointError(f"{ck.weights_label(component)}: tensor '{missing[0]}' is missing")
    by_file: dict[Path, list[str]] = {}
    for name, path in mapping.items():
        if wanted is None or name in wanted:
            by_file.setdefault(path, []).append(name)
    for path in sorted(by_file):
        with open_file(path, ck.rel(path)) as f:
            present = set(f.keys())
            offsets = data_offsets(path)
            recipe, generated = generated_tensors(f.metadata())
            for name in sorted(by_file[path], key=lambda n: (offsets.get(n, 0), n)):
                if name not in present:
                    raise CheckpointError(
                        f"{ck.rel(path)}: tensor '{name}' listed in the shard index is missing from the file"
                    )
                if name in generated:  # a synthetic shard's hole (h3serve.weights.synthetic)
                    view = f.get_slice(name)
                    tensor = generate(recipe, name, view.get_shape(), st_dtype(view.get_dtype()))
                else:
                    tensor = f.get_tensor(name)
                if policy is not None:
                    target = policy(name, tensor.dtype)
                    if target != tensor.dtype:
                        tensor = tensor.to(target)
                yield name, tensor


# ------------------------------------------------------------------------------------------------------------------
# Loading into a module


@dataclass
class LoadReport:
    """What `load_module_weights` did."""

    component: str
    tensors: int = 0
    bytes_read: int = 0
    fused: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    stored_dtypes: dict[str, int] = field(default_factory=dict)  # dtype name -> tensor count, as stored
    loaded_dtypes: dict[str, int] = field(default_factory=dict)  # dtype name -> tensor count, as assigned
    untouched_buffers: list[str] = field(default_factory=list)  # non-persistent buffers, left to the module

    def summary(self) -> str:
        return (f"{self.component}: {self.tensors} tensors, {self.bytes_read / 2**20:.1f} MiB read, "
                f"{self.fused} fused, {self.seconds:.2f} s")


def _expected_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers, by state-dict name (what the checkpoint must hold)."""
    return dict(module.state_dict(keep_vars=True))


def _assign(module: torch.nn.Module, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if isinstance(old, torch.nn.Parameter):
        if old.is_meta or old.dtype != new.dtype or old.device != new.device:
            owner._parameters[leaf] = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        else:
            with torch.no_grad():
                old.copy_(new)
    else:
        if old.is_meta or old.dtype != new.dtype or old.device != new.device:
            owner._buffers[leaf] = new
        else:
            old.copy_(new)


def load_module_weights(
    module: torch.nn.Module,
    folder: CheckpointFolder | str | os.PathLike,
    component: str,
    *,
    adapter: Adapter | None = None,
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    device: str | torch.device = "cpu",
    host: Iterable[str] = (),
) -> LoadReport:
    """Fill `module` (built normally or on the `meta` device) from a component's safetensors, tensor by tensor.

    1. From the headers alone: every parameter / persistent buffer of the module must be stored, nothing else may
       be, shapes must be equal and the stored dtype allowed (float32 / bfloat16 / float16; integer only where the
       module holds the same integer dtype). Errors name the file and tensor. An adapter must target only tensors
       the module has.
    2. Stream: read one tensor, fuse the adapter into it (fp32, back to the stored dtype), cast to `dtype` (names
       matching `keep_fp32` become float32 instead; `dtype=None` keeps the stored dtype), move to `device` and put
       it in the module (in place when dtype/device already agree, else as a new Parameter); names matching `host`
       (`name_matches` patterns) stay on the CPU instead, never reaching `device`. No second copy of the state dict
       is ever made.
    3. Every adapter module must have been used.

    Non-persistent buffers (e.g. the DiT's `rope.inv_freq`) are not in checkpoints and are left as the module
    built them; the report lists them.
    """
    start = time.perf_counter()
    ck = _as_folder(folder, component)
    keep, on_host = tuple(keep_fp32), tuple(host)
    device = torch.device(device)
    label = ck.weights_label(component)
    expected = _expected_tensors(module)
    infos = ck.tensor_infos(component)

    problems: list[str] = []
    for name in expected:
        if name not in infos:
            problems.append(f"{label}: tensor '{name}' is missing (the module expects it)")
    for name, info in infos.items():
        if name not in expected:
            problems.append(f"{ck.rel(info.file)}: unexpected tensor '{name}' (the module has no such parameter)")
    for name, info in infos.items():
        if name not in expected:
            continue
        want = expected[name]
        if tuple(want.shape) != info.shape:
            problems.append(f"{ck.rel(info.file)}: tensor '{name}' has shape {_shape_str(info.shape)}, "
                            f"expected {_shape_str(want.shape)}")
        stored = info.dtype
        if want.dtype.is_floating_point:
            if stored not in FLOAT_DTYPES:
                problems.append(f"{ck.rel(info.file)}: tensor '{name}' has dtype {dtype_name(stored)}, expected "
                                f"one of {', '.join(dtype_name(d) for d in FLOAT_DTYPES)}")
        elif stored != want.dtype:
            problems.append(f"{ck.rel(info.file)}: tensor '{name}' has dtype {dtype_name(stored)}, "
                            f"expected {dtype_name(want.dtype)}")
    if problems:
        more = f" (and {len(problems) - 5} more problems)" if len(problems) > 5 else ""
        raise CheckpointError("; ".join(problems[:5]) + more)

    if adapter is not None:
        adapter.reset_usage()
        adapter.check_targets(expected, component=component)

    report = LoadReport(component=component, files=[ck.rel(p) for p in ck.weight_files(component)])
    persistent = set(expected)
    report.untouched_buffers = [n for n, _ in module.named_buffers() if n not in persistent]
    policy = DtypePolicy(dtype, keep)
    for name, tensor in iter_tensors(ck, component):
        stored = tensor.dtype
        report.tensors += 1
        report.bytes_read += tensor.numel() * tensor.element_size()
        report.stored_dtypes[dtype_name(stored)] = report.stored_dtypes.get(dtype_name(stored), 0) + 1
        if adapter is not None:
            fused = adapter.fuse(name, tensor)
            if fused is not tensor:
                report.fused += 1
                tensor = fused
        target = policy(name, stored)
        where = torch.device("cpu") if on_host and name_matches(name, on_host) else device
        if tensor.dtype != target or tensor.device != where:
            tensor = tensor.to(device=where, dtype=target)
        _assign(module, name, expected[name], tensor)
        report.loaded_dtypes[dtype_name(target)] = report.loaded_dtypes.get(dtype_name(target), 0) + 1
        del tensor

    if adapter is not None:
        unused = adapter.unused()
        if unused:
            raise AdapterError(
                f"{adapter.path}: {len(unused)} adapter modules matched no tensor of {label} "
                f"(adapter for a different model?): {', '.join(unused[:8])}"
            )
    report.seconds = time.perf_counter() - start
    return report

