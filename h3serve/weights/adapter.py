"""The FastH3 adapter: FastVideo's `fastvideo-lora-v2` safetensors, fused into the DiT as its weights stream in.

Format (H3_REFERENCE §4.2), keys in the diffusers namespace of `MiniMaxH3Transformer3DModel`:

    <module>.lora_A.weight  [r, in]     low-rank factors, applied with scale 1 (no alpha):  W += B @ A
    <module>.lora_B.weight  [out, r]
    <module>.diff           full-rank weight delta:                                   W += diff
    <module>.diff_b         bias delta:                                               b += diff_b
    <module>.set_weight     a replacement tensor, assigned last (only VSA compression gates use it)

Metadata: format "fastvideo-lora-v2", base_model, finetuned_model, rank, application, and the counts
low_rank_tensors (lora_A + lora_B tensors), diff_tensors (diff + diff_b) and set_weight_tensors, which must equal
what the file holds. Fusion runs in float32 and casts back to the base tensor's stored dtype.

h3serve runs dense attention, so an adapter carrying VSA compression gates (`attn.to_gate_compress.set_weight`)
is refused when it is opened: those variants are distilled for video sparse attention and are wrong when run
densely. Only the dense-datafree adapter is served.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from h3serve.errors import AdapterError
from h3serve.weights.headers import sha256_file
from h3serve.weights.safetensors import DTYPE_CODES, FLOAT_DTYPES

FORMAT = "fastvideo-lora-v2"
BASE_MODEL = "MiniMaxAI/MiniMax-H3"
COUNT_KEYS = ("low_rank_tensors", "diff_tensors", "set_weight_tensors")

# Suffix -> role. `.diff_b` is tested before `.diff`.
_ROLES = (
    (".lora_A.weight", "lora_A"),
    (".lora_B.weight", "lora_B"),
    (".diff_b", "diff_b"),
    (".diff", "diff"),
    (".set_weight", "set_weight"),
)
VSA_GATE_MODULE = "to_gate_compress"
_FLOAT_CODES = tuple(DTYPE_CODES[d] for d in FLOAT_DTYPES)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def split_key(key: str) -> tuple[str, str] | None:
    """`'transformer_blocks.0.attn.to_q.lora_A.weight'` -> `('transformer_blocks.0.attn.to_q', 'lora_A')`."""
    for suffix, role in _ROLES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], role
    return None


@dataclass
class ModulePatch:
    """What the adapter holds for one module: tensor keys by role, and their header shapes."""

    module: str
    keys: dict[str, str] = field(default_factory=dict)  # role -> adapter tensor key
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # role -> shape

    def targets(self) -> dict[str, tuple[str, ...]]:
        """Base tensor name -> roles applied to it."""
        out: dict[str, tuple[str, ...]] = {}
        weight_roles = tuple(r for r in ("lora_A", "lora_B", "diff", "set_weight") if r in self.keys)
        if weight_roles:
            out[f"{self.module}.weight"] = weight_roles
        if "diff_b" in self.keys:
            out[f"{self.module}.bias"] = ("diff_b",)
        return out


def _normalize_sha(sha256: str) -> str:
    value = str(sha256).strip().lower().removeprefix("sha256:")
    if not _HEX64.match(value):
        raise AdapterError(f"adapter sha256 {sha256!r} is not a 64-digit hex digest")
    return value


class Adapter:
    """An opened, checksum-verified `fastvideo-lora-v2` adapter. Tensors are read lazily, per module, in `fuse`."""

    def __init__(self, path: Path, sha256: str, metadata: dict[str, str], patches: dict[str, ModulePatch],
                 rank: int, counts: dict[str, int]):
        self.path = path
        self.sha256 = sha256
        self.metadata = metadata
        self.patches = patches
        self.rank = rank
        self.counts = counts
        self._targets: dict[str, tuple[str, str]] = {}  # base tensor -> (module, "weight"|"bias")
        for module, patch in patches.items():
            for target in patch.targets():
                self._targets[target] = (module, target.rsplit(".", 1)[1])
        self._used: set[str] = set()
        self._file = None

    # -- opening ---------------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, sha256: str) -> Adapter:
        """Verify the file's sha256 (before any tensor is read), then its metadata, keys, counts and shapes."""
        path = Path(path)
        expected = _normalize_sha(sha256)
        if not path.is_file():
            raise AdapterError(f"{path}: adapter file does not exist")
        actual = sha256_file(path)
        if actual != expected:
            raise AdapterError(
                f"{path}: sha256 mismatch: expected {expected}, actual {actual}; refusing to load the adapter"
            )

        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:
            raise AdapterError(f"{path}: not a readable safetensors file: {exc}") from exc
        with handle as f:
            metadata = dict(f.metadata() or {})
            keys = list(f.keys())
            headers = {k: (tuple(int(s) for s in f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                       for k in keys}

        fmt = metadata.get("format")
        if fmt != FORMAT:
            raise AdapterError(f"{path}: metadata format is {fmt!r}, expected {FORMAT!r}")
        base = metadata.get("base_model")
        if base is not None and base.casefold() != BASE_MODEL.casefold():
            raise AdapterError(f"{path}: adapter is for base_model {base!r}, not {BASE_MODEL!r}")

        patches: dict[str, ModulePatch] = {}
        counts = dict.fromkeys(COUNT_KEYS, 0)
        for key in keys:
            split = split_key(key)
            if split is None:
                raise AdapterError(
                    f"{path}: tensor '{key}' is not a {FORMAT} key "
                    "(expected .lora_A.weight / .lora_B.weight / .diff / .diff_b / .set_weight)"
                )
            module, role = split
            patch = patches.setdefault(module, ModulePatch(module))
            patch.keys[role] = key
            patch.shapes[role] = headers[key][0]
            counts["low_rank_tensors" if role.startswith("lora") else
                   "diff_tensors" if role.startswith("diff") else "set_weight_tensors"] += 1
            if headers[key][1] not in _FLOAT_CODES:
                raise AdapterError(f"{path}: tensor '{key}' has dtype {headers[key][1]}, "
                                   f"expected {' / '.join(_FLOAT_CODES)}")

        gates = sorted(k for k in keys if split_key(k)[0].rsplit(".", 1)[-1] == VSA_GATE_MODULE)
        if gates:
            raise AdapterError(
                f"{path}: {len(gates)} VSA-only tensors (e.g. '{gates[0]}') need video sparse attention; "
                "h3serve runs dense attention; use the dense-datafree adapter"
            )

        for name in COUNT_KEYS:
            declared = metadata.get(name)
            if declared is None:
                raise AdapterError(f"{path}: metadata does not declare {name} (the file holds {counts[name]})")
            try:
                declared_n = int(declared)
            except ValueError:
                raise AdapterError(f"{path}: metadata {name}={declared!r} is not a number") from None
            if declared_n != counts[name]:
                raise AdapterError(
                    f"{path}: metadata declares {name}={declared_n} but the file holds {counts[name]}; "
                    "the adapter is incomplete or was re-exported"
                )

        try:
            rank = int(metadata.get("rank", ""))
        except ValueError:
            raise AdapterError(f"{path}: metadata rank={metadata.get('rank')!r} is not a number") from None
        for module, patch in patches.items():
            has_a, has_b = "lora_A" in patch.keys, "lora_B" in patch.keys
            if has_a != has_b:
                missing = "lora_B" if has_a else "lora_A"
                raise AdapterError(f"{path}: module '{module}' has no {missing}.weight for its low-rank pair")
            if has_a:
                a, b = patch.shapes["lora_A"], patch.shapes["lora_B"]
                if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                    raise AdapterError(
                        f"{path}: module '{module}' has lora_A {list(a)} and lora_B {list(b)}; expected [r, in] and "
                        "[out, r]"
                    )
                if a[0] != rank:
                    raise AdapterError(f"{path}: module '{module}' has rank {a[0]}, metadata declares rank {rank}")
        return cls(path, actual, metadata, patches, rank, counts)

    # -- fusion ----------------------------------------------------------------------------------------------------

    def _get(self, key: str) -> torch.Tensor:
        if self._file is None:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
        return self._file.get_tensor(key)

    def close(self) -> None:
        self._file = None

    def __enter__(self) -> Adapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def targets(self) -> dict[str, tuple[str, ...]]:
        """Base tensor name -> roles the adapter applies to it."""
        out: dict[str, tuple[str, ...]] = {}
        for patch in self.patches.values():
            out.update(patch.targets())
        return out

    def check_targets(self, base_tensors: Mapping[str, torch.Tensor] | Iterable[str], *, component: str = "") -> None:
        """Refuse an adapter that patches tensors the model lacks, or whose delta shapes do not fit (headers only)."""
        shapes = ({n: tuple(t.shape) for n, t in base_tensors.items()} if isinstance(base_tensors, Mapping)
                  else dict.fromkeys(base_tensors))
        missing = []
        for target, roles in self.targets().items():
            if target not in shapes:
                missing.append(f"{target} ({'/'.join(roles)})")
                continue
            shape = shapes[target]
            if shape is not None:
                self._check_shapes(target, shape)
        if missing:
            where = f" {component}" if component else ""
            raise AdapterError(
                f"{self.path}: {len(missing)} adapter targets are not tensors of the{where} model "
                f"(adapter for a different model?): {', '.join(sorted(missing)[:8])}"
            )

    def _check_shapes(self, target: str, shape: tuple[int, ...]) -> None:
        module, leaf = self._targets[target]
        patch = self.patches[module]
        if leaf == "bias":
            got = {"diff_b": patch.shapes["diff_b"]}
        else:
            got = {r: patch.shapes[r] for r in ("diff", "set_weight") if r in patch.keys}
            if "lora_A" in patch.keys:
                got["lora_B @ lora_A"] = (patch.shapes["lora_B"][0], patch.shapes["lora_A"][1])
        for role, s in got.items():
            if tuple(s) != tuple(shape):
                raise AdapterError(
                    f"{self.path}: {module} {role} has shape {list(s)} but '{target}' has shape {list(shape)}"
                )

    def fuse(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The base tensor with the adapter applied (fp32 math, returned in `tensor`'s dtype).

        Weight: W + B @ A + diff, or set_weight when given. Bias: b + diff_b. Returns `tensor` itself (same object)
        when the adapter has nothing for `param_name`.
        """
        hit = self._targets.get(param_name)
        if hit is None:
            return tensor
        module, leaf = hit
        self._check_shapes(param_name, tuple(tensor.shape))
        patch = self.patches[module]
        out = tensor.to(torch.float32, copy=True)
        dev = out.device  # the base tensor's: a synthetic checkpoint's is generated on the GPU

        def get(role: str) -> torch.Tensor:
            return self._get(patch.keys[role]).to(dev, torch.float32)

        if leaf == "bias":
            out += get("diff_b")
        else:
            if "lora_A" in patch.keys:
                out.addmm_(get("lora_B"), get("lora_A"))
            if "diff" in patch.keys:
                out += get("diff")
            if "set_weight" in patch.keys:
                out = get("set_weight")
        self._used.add(param_name)
        return out.to(tensor.dtype)

    def reset_usage(self) -> None:
        self._used.clear()

    def unused(self) -> list[str]:
        """Adapter modules (with the roles left over) that matched no base tensor since the last `reset_usage`."""
        left: dict[str, list[str]] = {}
        for target, roles in self.targets().items():
            if target not in self._used:
                module, _ = self._targets[target]
                left.setdefault(module, []).extend(roles)
        return [f"{m} ({'/'.join(r)})" for m, r in sorted(left.items())]

    def __repr__(self) -> str:
        return (f"Adapter({str(self.path)!r}, rank={self.rank}, modules={len(self.patches)}, "
                f"{', '.join(f'{k}={v}' for k, v in self.counts.items())})")

