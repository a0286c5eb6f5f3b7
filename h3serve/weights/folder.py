"""A diffusers-format MiniMax H3 checkpoint folder: the index, component configs, weight maps and header infos.

The folder is the published diffusers *modular* layout (H3_REFERENCE §1.1): `modular_model_index.json` at the root,
one subfolder per component, each with its config and its weights (one safetensors file, or shards plus a
`*.safetensors.index.json`). Everything here reads indexes, configs and safetensors headers only, never tensor data;
`h3serve.weights.load` streams the tensors into modules.

Nothing here imports diffusers or transformers; the module classes are the caller's. Nor torch, but for the tensors'
dtypes (`tensor_infos`, `describe`): `h3serve serve` validates a folder before torch is imported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from h3serve.errors import CheckpointError
from h3serve.weights.headers import header_keys, open_file

if TYPE_CHECKING:
    import torch

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
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if isinstance(self.dtype, str):   # a code without a torch dtype (`st_dtype`)
            return 0
        return self.numel * self.dtype.itemsize


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
            for name in header_keys(files[0], self.rel(files[0])):
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
        from h3serve.weights.safetensors import st_dtype   # torch's dtypes (see the module's docstring)

        mapping = self.weight_map(component)
        by_file: dict[Path, list[str]] = {}
        for name, path in mapping.items():
            by_file.setdefault(path, []).append(name)
        infos: dict[str, TensorInfo] = {}
        for path, names in sorted(by_file.items()):
            with open_file(path, self.rel(path)) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{self.rel(path)}: tensor '{name}' listed in the shard index is missing from the file"
                        )
                    sl = f.get_slice(name)
                    infos[name] = TensorInfo(name, path, tuple(int(s) for s in sl.get_shape()),
                                             st_dtype(sl.get_dtype()))
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


# ------------------------------------------------------------------------------------------------------------------
# Description (`h3serve checkpoint info`)


def describe(path: str | os.PathLike) -> dict:
    """Components, classes, tensor / element counts, stored dtypes and bytes, from headers only (no data read)."""
    from h3serve.weights.safetensors import dtype_name   # torch's dtypes (see the module's docstring)

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
                d = dtypes.setdefault(dtype_name(t.dtype), {"tensors": 0, "params": 0, "bytes": 0})
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

