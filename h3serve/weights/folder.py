"""A diffusers-format MiniMax H3 checkpoint folder: index, configs, streaming safetensors load, checksums.

The folder is the published diffusers *modular* layout (H3_REFERENCE §1.1): `modular_model_index.json` at the root,
one subfolder per component. Weights are read with `safetensors.safe_open`, one tensor at a time, so loading a
61.7 GiB transformer never holds the state dict twice: every tensor is validated against the module from the file
headers first (names, shapes, dtypes: no data read), then read, fused with an adapter if one is given, cast, and
assigned into the module, which may have been built on the `meta` device.

Nothing here imports diffusers or transformers; the module classes are the caller's.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch
from safetensors import safe_open

from h3serve.errors import AdapterError, CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from h3serve.weights.adapter import Adapter

INDEX_FILE = "modular_model_index.json"

# Config file of a component, by the order a component folder is searched for one.
CONFIG_FILES = ("config.json", "scheduler_config.json", "preprocessor_config.json", "tokenizer_config.json")

# Classes whose folder must hold weights. Any other component holds weights iff its folder has safetensors files.
WEIGHT_CLASSES = frozenset({
    "MiniMaxH3Transformer3DModel",
    "AutoencoderKLMiniMaxH3",
    "AutoencoderKLMiniMaxH3Audio",
    "Qwen3VLForConditionalGeneration",
})

# Stored dtypes a float weight may have. Integer / bool tensors are only accepted where the module itself holds an
# integer tensor of the same dtype.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _st_dtype(code: str) -> torch.dtype | str:
    return _SAFETENSORS_DTYPES.get(code, code)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def sha256_file(path: str | os.PathLike, *, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


_DTYPE_CODES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file byte-for-byte reproducibly (sorted names, sorted metadata), one tensor at a time.

    `safetensors.torch.save_file` orders `__metadata__` by a hash map, so two identical saves can differ in bytes.
    """
    names = sorted(tensors)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(metadata[k]) for k in sorted(metadata)}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(f"tensor '{name}': dtype {t.dtype} cannot be stored in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())


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


# ------------------------------------------------------------------------------------------------------------------
# Folder


@dataclass(frozen=True)
class ComponentEntry:
    """One `[library, class, {spec}]` entry of `modular_model_index.json`."""

    name: str
    library: str
    class_name: str
    subfolder: str
    spec: dict


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its safetensors header describes it (no data read)."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype | str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        if isinstance(self.dtype, torch.dtype):
            return self.numel * self.dtype.itemsize
        return 0


class CheckpointFolder:
    """A diffusers modular checkpoint folder (`modular_model_index.json` + component subfolders).

    `components` restricts validation to the components one deployment needs (t2va needs no `transformer_ref/`);
    by default every component the index lists is checked. An incomplete folder raises `CheckpointError` naming
    the missing file or folder, relative to the checkpoint root.
    """

    def __init__(self, path: str | os.PathLike, *, components: Iterable[str] | None = None, validate: bool = True):
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint folder does not exist")
        if not index_path.is_file():
            raise CheckpointError(f"{self.path}: {INDEX_FILE} is missing (not a diffusers modular checkpoint)")
        try:
            self.index: dict = json.loads(index_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: {INDEX_FILE} is not valid JSON: {exc}") from exc
        if not isinstance(self.index, dict):
            raise CheckpointError(f"{self.path}: {INDEX_FILE} must hold a JSON object")

        self.entries: dict[str, ComponentEntry] = {}
        self.pipeline_config: dict = {}
        for key, value in self.index.items():
            if isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict):
                library, class_name, spec = value
                if library is None or class_name is None:
                    continue  # a component the index declares but the checkpoint does not ship
                self.entries[key] = ComponentEntry(key, str(library), str(class_name),
                                                   spec.get("subfolder") or key, dict(spec))
            elif not key.startswith("_"):
                self.pipeline_config[key] = value
        self.class_name = self.index.get("_class_name")
        self.blocks_class_name = self.index.get("_blocks_class_name")
        self._weight_maps: dict[str, dict[str, Path]] = {}
        if validate:
            self.validate(components)

    def __repr__(self) -> str:
        return f"CheckpointFolder({str(self.path)!r}, components={self.components})"

    # -- listing ---------------------------------------------------------------------------------------------------

    @property
    def components(self) -> list[str]:
        return list(self.entries)

    def entry(self, component: str) -> ComponentEntry:
        try:
            return self.entries[component]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: component '{component}' is not in {INDEX_FILE} (it lists {', '.join(self.entries)})"
            ) from None

    def component_path(self, component: str) -> Path:
        return self.path / self.entry(component).subfolder

    def rel(self, path: Path) -> str:
        """A path relative to the checkpoint root, as error messages print it."""
        try:
            return path.relative_to(self.path).as_posix()
        except ValueError:
            return str(path)

    def config_file(self, component: str) -> Path:
        folder = self.component_path(component)
        for name in CONFIG_FILES:
            if (folder / name).is_file():
                return folder / name
        raise CheckpointError(f"{self.rel(folder)}/: no config file ({' / '.join(CONFIG_FILES)}) in {self.path}")

    def config(self, component: str) -> dict:
        """The component's own config (config.json, scheduler_config.json, ...), as a dict."""
        path = self.config_file(component)
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{self.rel(path)}: not valid JSON: {exc}") from exc

    # -- weights ---------------------------------------------------------------------------------------------------

    def _weight_index_file(self, component: str) -> Path | None:
        indexes = sorted(self.component_path(component).glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(
                f"{self.rel(self.component_path(component))}/: several shard indexes "
                f"({', '.join(p.name for p in indexes)}); expected one"
            )
        return indexes[0] if indexes else None

    def has_weights(self, component: str) -> bool:
        folder = self.component_path(component)
        if self.entry(component).class_name in WEIGHT_CLASSES:
            return True
        return folder.is_dir() and (any(folder.glob("*.safetensors")) or self._weight_index_file(component) is not None)

    def weight_map(self, component: str) -> dict[str, Path]:
        """Tensor name -> safetensors file holding it. Reads the shard index, or the single file's header."""
        if component in self._weight_maps:
            return self._weight_maps[component]
        folder = self.component_path(component)
        if not folder.is_dir():
            raise CheckpointError(f"{self.rel(folder)}/: component folder is missing in {self.path}")
        index_file = self._weight_index_file(component)
        mapping: dict[str, Path] = {}
        if index_file is not None:
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{self.rel(index_file)}: not a safetensors shard index: {exc}") from exc
            for name, shard in weight_map.items():
                mapping[name] = folder / shard
            for shard in sorted(set(mapping.values())):
                if not shard.is_file():
                    raise CheckpointError(
                        f"{self.rel(shard)}: shard listed in {index_file.name} is missing"
                    )
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.rel(folder)}/: no *.safetensors weights in {self.path}")
            if len(files) > 1:
                raise CheckpointError(
                    f"{self.rel(folder)}/: {len(files)} safetensors files but no *.safetensors.index.json"
                )
            for name in _header_keys(files[0], self):
                mapping[name] = files[0]
        self._weight_maps[component] = mapping
        return mapping

    def weight_files(self, component: str) -> list[Path]:
        return sorted(set(self.weight_map(component).values()))

    def weights_label(self, component: str) -> str:
        """How messages name a component's weights: its single file, or its shard index."""
        index_file = self._weight_index_file(component)
        if index_file is not None:
            return self.rel(index_file)
        return self.rel(self.weight_files(component)[0])

    def tensor_infos(self, component: str) -> dict[str, TensorInfo]:
        """Name -> header info for every tensor of a component, reading headers only. Validates shard contents."""
        mapping = self.weight_map(component)
        by_file: dict[Path, list[str]] = {}
        for name, path in mapping.items():
            by_file.setdefault(path, []).append(name)
        infos: dict[str, TensorInfo] = {}
        for path, names in sorted(by_file.items()):
            with _open(path, self) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{self.rel(path)}: tensor '{name}' listed in the shard index is missing from the file"
                        )
                    sl = f.get_slice(name)
                    infos[name] = TensorInfo(name, path, tuple(int(s) for s in sl.get_shape()),
                                             _st_dtype(sl.get_dtype()))
        return infos

    # -- validation ------------------------------------------------------------------------------------------------

    def validate(self, components: Iterable[str] | None = None) -> None:
        """Raise CheckpointError naming the first missing folder / config / weight file / shard."""
        names = list(self.entries) if components is None else list(components)
        for name in names:
            entry = self.entry(name)
            folder = self.path / entry.subfolder
            if not folder.is_dir():
                raise CheckpointError(f"{entry.subfolder}/: component folder of '{name}' is missing in {self.path}")
            if not any((folder / c).is_file() for c in CONFIG_FILES):
                raise CheckpointError(
                    f"{entry.subfolder}/config.json: '{name}' has no config file "
                    f"({' / '.join(CONFIG_FILES)}) in {self.path}"
                )
            if entry.library == "transformers" and "Tokenizer" in entry.class_name:
                if not ((folder / "tokenizer.json").is_file()
                        or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())):
                    raise CheckpointError(f"{entry.subfolder}/tokenizer.json: tokenizer file missing in {self.path}")
            if self.has_weights(name):
                self.weight_map(name)


def _open(path: Path, folder: CheckpointFolder | None = None):
    label = folder.rel(path) if folder is not None else str(path)
    if not path.is_file():
        raise CheckpointError(f"{label}: file is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{label}: not a readable safetensors file: {exc}") from exc


def _data_offsets(path: Path) -> dict[str, int]:
    """Tensor name -> start offset of its data, from the raw header (to read a file front to back)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _header_keys(path: Path, folder: CheckpointFolder | None = None) -> list[str]:
    with _open(path, folder) as f:
        return list(f.keys())


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
        with _open(path, ck) as f:
            present = set(f.keys())
            offsets = _data_offsets(path)
            for name in sorted(by_file[path], key=lambda n: (offsets.get(n, 0), n)):
                if name not in present:
                    raise CheckpointError(
                        f"{ck.rel(path)}: tensor '{name}' listed in the shard index is missing from the file"
                    )
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
) -> LoadReport:
    """Fill `module` (built normally or on the `meta` device) from a component's safetensors, tensor by tensor.

    1. From the headers alone: every parameter / persistent buffer of the module must be stored, nothing else may
       be, shapes must be equal and the stored dtype allowed (float32 / bfloat16 / float16; integer only where the
       module holds the same integer dtype). Errors name the file and tensor. An adapter must target only tensors
       the module has.
    2. Stream: read one tensor, fuse the adapter into it (fp32, back to the stored dtype), cast to `dtype` (names
       matching `keep_fp32` become float32 instead; `dtype=None` keeps the stored dtype), move to `device` and put
       it in the module (in place when dtype/device already agree, else as a new Parameter). No second copy of the
       state dict is ever made.
    3. Every adapter module must have been used.

    Non-persistent buffers (e.g. the DiT's `rope.inv_freq`) are not in checkpoints and are left as the module
    built them; the report lists them.
    """
    start = time.perf_counter()
    ck = _as_folder(folder, component)
    keep = tuple(keep_fp32)
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
                problems.append(f"{ck.rel(info.file)}: tensor '{name}' has dtype {_dtype_name(stored)}, expected "
                                f"one of {', '.join(_dtype_name(d) for d in FLOAT_DTYPES)}")
        elif stored != want.dtype:
            problems.append(f"{ck.rel(info.file)}: tensor '{name}' has dtype {_dtype_name(stored)}, "
                            f"expected {_dtype_name(want.dtype)}")
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
        report.stored_dtypes[_dtype_name(stored)] = report.stored_dtypes.get(_dtype_name(stored), 0) + 1
        if adapter is not None:
            fused = adapter.fuse(name, tensor)
            if fused is not tensor:
                report.fused += 1
                tensor = fused
        target = policy(name, stored)
        if tensor.dtype != target or tensor.device != device:
            tensor = tensor.to(device=device, dtype=target)
        _assign(module, name, expected[name], tensor)
        report.loaded_dtypes[_dtype_name(target)] = report.loaded_dtypes.get(_dtype_name(target), 0) + 1
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


# ------------------------------------------------------------------------------------------------------------------
# Description (`h3serve checkpoint info`)


def describe(path: str | os.PathLike) -> dict:
    """Components, classes, tensor / element counts, stored dtypes and bytes, from headers only (no data read)."""
    ck = CheckpointFolder(path)
    out: dict = {
        "path": str(ck.path),
        "class_name": ck.class_name,
        "blocks_class_name": ck.blocks_class_name,
        "config": dict(ck.pipeline_config),
        "components": {},
    }
    total_bytes = 0
    for name, entry in ck.entries.items():
        folder = ck.component_path(name)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        disk = sum(p.stat().st_size for p in files)
        info: dict = {
            "library": entry.library,
            "class": entry.class_name,
            "subfolder": entry.subfolder,
            "files": [p.relative_to(folder).as_posix() for p in files],
            "disk_bytes": disk,
        }
        if ck.has_weights(name):
            tensors = ck.tensor_infos(name)
            dtypes: dict[str, dict[str, int]] = {}
            for t in tensors.values():
                d = dtypes.setdefault(_dtype_name(t.dtype), {"tensors": 0, "params": 0, "bytes": 0})
                d["tensors"] += 1
                d["params"] += t.numel
                d["bytes"] += t.nbytes
            info.update(
                tensors=len(tensors),
                params=sum(t.numel for t in tensors.values()),
                tensor_bytes=sum(t.nbytes for t in tensors.values()),
                shards=len(ck.weight_files(name)),
                dtypes=dtypes,
            )
        else:
            cfg_file = ck.config_file(name)
            info["config_file"] = cfg_file.name
        out["components"][name] = info
        total_bytes += disk
    out["disk_bytes"] = total_bytes
    return out


# ------------------------------------------------------------------------------------------------------------------
# Qwen3-VL processor without torchvision


def load_processor(path: str | os.PathLike, *, subfolder: str = "processor", tokenizer_subfolder: str = "tokenizer"):
    """Build the Qwen3-VL processor of a checkpoint without torchvision.

    `Qwen3VLProcessor.from_pretrained` needs `Qwen3VLVideoProcessor`, which needs torchvision; this builds the
    processor from the folder's files instead: the tokenizer (`processor/` if it has one, else `tokenizer/`) and a
    `Qwen2VLImageProcessorPil` with the patch / merge / temporal sizes, mean / std and pixel bounds of
    `processor/preprocessor_config.json`. The video processor is None (video references cannot be encoded);
    everything the image and text paths use (`image_processor`, `create_mm_token_type_ids`, the pad token ids)
    works. Pass the result to diffusers with `pipe.update_components(processor=...)`.
    """
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    root = Path(path)
    proc_dir = root / subfolder
    cfg_path = proc_dir / "preprocessor_config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{subfolder}/preprocessor_config.json: missing in {root}")
    cfg = json.loads(cfg_path.read_text())
    if "image_processor" in cfg and isinstance(cfg["image_processor"], dict):  # nested processor_config layout
        cfg = cfg["image_processor"]
    keys = ("do_resize", "resample", "size", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
            "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size")
    kwargs = {k: cfg[k] for k in keys if k in cfg}
    if "size" not in kwargs and ("min_pixels" in cfg or "max_pixels" in cfg):
        kwargs["size"] = {"shortest_edge": cfg.get("min_pixels"), "longest_edge": cfg.get("max_pixels")}
    image_processor = Qwen2VLImageProcessorPil(**kwargs)

    tok_dir = proc_dir if (proc_dir / "tokenizer.json").is_file() else root / tokenizer_subfolder
    if not (tok_dir / "tokenizer.json").is_file() and not (tok_dir / "vocab.json").is_file():
        raise CheckpointError(f"{tokenizer_subfolder}/tokenizer.json: missing in {root}")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    check = processor.check_argument_for_proper_class

    def _check(argument_name, argument):  # only `video_processor=None` is let through
        if argument_name == "video_processor" and argument is None:
            return None
        return check(argument_name, argument)

    processor.check_argument_for_proper_class = _check
    try:
        processor.__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    finally:
        del processor.check_argument_for_proper_class
    return processor
