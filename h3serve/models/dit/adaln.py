"""The AdaLN table: every AdaLN projection's output for a known schedule, computed once and read instead of projecting.

Each of the DiT's L blocks projects silu(temb) (n_t, E) with its `adaln_proj` (E -> 3*6*D: 260,209,152 parameters a
block in the release, 24.2 GiB of the 61.9 GiB bf16 DiT), and norm_out projects it with `norm_out.linear`
(E -> 2*D); both outputs depend on the forward's timesteps alone. For a known schedule they are a table, one entry
per distinct timesteps vector (one per step and task variant):

    entry(ts):  ts      (n_t,)              float32, the forward's `timesteps` exactly
                blocks  (L, 3*n_t, 6, D)    adaln_proj_j(silu(temb(ts))) for every block j
                out     (n_t, 2*D)          norm_out.linear(silu(temb(ts)))

Exactness: an entry is computed by the same module call, on the same (n_t, E) input tensor, on the device the forward
runs on (a GEMM's result can depend on its batch shape and its kernel: never another shape, never per timestep);
the forward then reads its rows from the entry, bit for bit what projecting would have given.

Where the weights are: `AdaLNTable.detach` takes the projections out of the model (every block's `adaln_proj` and
`norm_out.linear` become None), so they are in no device-resident parameter, not packed or streamed by the layerwise
offload (offload.py) and not in the FP8 plan (which never quantized them: quant.DIT_FP8_LINEARS). The table keeps
their host copy (pinned on CUDA). A forward whose timesteps have no entry (another step count, a variant not
enumerated) is computed when it comes, by staging each projection on the device one at a time for the same call on
the same input, and kept (the MAX_COMPUTED most recent): lossless, never wrong, only slower the first time.

The file, `<dir>/adaln-<component>-<key digest>.safetensors`, holds the entries and, in its header metadata, the key
(format, component, the sha256 of the table's input weights as loaded - time embedder, every AdaLN projection,
norm_out.linear, after the adapter fusion and the cast -, their dtype, the device and torch build that computed it,
every timesteps vector) and the sha256 of its tensors. A file whose key is not the expected one or whose tensors do
not hash to the recorded sha256 is refused, naming the file: the directory is meant to be mounted read-only and shared
by pods, so a bad file is the operator's to remove (a pod could not replace it, and must not serve from it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from h3serve.errors import AdaLNTableError, H3Error
from h3serve.models.offload import host_buffer
from h3serve.weights.headers import open_file
from h3serve.weights.safetensors import write_safetensors

from .layout import distinct_timesteps
from .scheduler import FlowSchedule

log = logging.getLogger("h3serve.dit.adaln")

FORMAT = 1
# The weights the table replaces (load patterns, `weights.load.name_matches`): they are loaded to the host only.
ADALN_WEIGHTS = ("adaln_proj", "norm_out.linear")
# Segment kinds beyond text / video / audio in each task's layouts: t2va none, fl2va its keyframes, ref2va its visual
# references always (a request is never audio-only) and reference audio or not.
TASK_KINDS = {
    "t2va": ((),),
    "fl2va": (("condition_video",),),
    "ref2va": (("condition_video",), ("condition_video", "reference_audio")),
}
BASE_KINDS = ("text", "video", "audio")
MAX_COMPUTED = 128  # entries computed on a miss, kept in host memory (least recently used out): one long schedule
KEY_META, SHA_META = "h3serve.adaln.key", "h3serve.adaln.sha256"


@dataclass(frozen=True)
class Entry:
    timesteps: torch.Tensor  # (n_t,) float32, host
    blocks: torch.Tensor  # (L, 3*n_t, 6, D), host
    out: torch.Tensor  # (n_t, 2*D), host


def timesteps_key(timesteps: torch.Tensor) -> bytes:
    """The exact float32 bytes of a forward's timesteps (one host sync if they are on a device)."""
    return timesteps.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def schedule_inputs(video: FlowSchedule, audio: FlowSchedule, tasks: Sequence[str]) -> list[torch.Tensor]:
    """Every distinct timesteps vector the loop feeds the model over a schedule for the given tasks, in step order
    (`layout.distinct_timesteps`: the same values `row_timesteps` gives any layout of those tasks)."""
    seen: dict[bytes, torch.Tensor] = {}
    for video_t, audio_t in zip(video.timesteps.tolist(), audio.timesteps.tolist()):
        for task in tasks:
            for extra in TASK_KINDS[task]:
                ts = distinct_timesteps((*BASE_KINDS, *extra), video_t, audio_t)
                seen.setdefault(timesteps_key(ts), ts)
    return list(seen.values())


def _sha256_tensor(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashlib drops the GIL on large buffers
    return h.hexdigest()


def tensors_sha256(named: Sequence[tuple[str, torch.Tensor]], workers: int = 8) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in the order given; tensors hashed in parallel."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda nt: _sha256_tensor(nt[1]), named))
    h = hashlib.sha256()
    for (name, _), d in zip(named, digests):
        h.update(f"{name}:{d};".encode())
    return h.hexdigest()


def kernel_identity(device: torch.device) -> str:
    """What decides a projection's bits besides its inputs: the device model and the torch build (and on the CPU the
    instruction set and thread count, which choose the GEMM's blocking)."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"cuda {p.name} sm{p.major}{p.minor} x{p.multi_processor_count} torch {torch.__version__} " \
               f"cuda {torch.version.cuda}"
    if device.type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()} threads {torch.get_num_threads()} " \
               f"torch {torch.__version__}"
    return f"{device.type} torch {torch.__version__}"


def _host_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_buffer(math.prod(shape) * dtype.itemsize, pin=pin).view(dtype).view(tuple(shape))


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t` of its own (pinned when `pin`, without the caching allocator's power-of-two rounding): never
    a view of a file's mapping, which a file changed in place would pull from under it."""
    t = t.detach()
    if not pin:
        return t.to("cpu", copy=True)
    return _host_empty(t.shape, t.dtype, pin=True).copy_(t)


class AdaLNTable:
    """The table of one H3DiT (its `adaln_table` lever); build with `detach`, then `build` or `load`."""

    def __init__(self, projections: list[nn.Module], out_projection: nn.Linear, device: torch.device):
        self.projections = projections  # per block, H3AdaLNModulation with host weights
        self.out_projection = out_projection  # norm_out.linear, host weights
        self.device = device
        self.entries: dict[bytes, Entry] = {}  # the schedule's (built or read), never evicted
        self.computed: OrderedDict[bytes, Entry] = OrderedDict()  # misses, least recently used first
        self.misses = 0
        self.key: dict | None = None  # what the entries were computed for (`attach_adaln_table`)
        self.path: Path | None = None
        self.build_seconds = 0.0

    @classmethod
    def detach(cls, model: nn.Module, device: torch.device | str) -> "AdaLNTable":
        """Take every AdaLN projection and norm_out.linear out of `model` (an H3DiT) into a new table, which becomes
        the model's `adaln_table`. Their weights move to host memory (pinned for a CUDA device) wherever they were."""
        device = torch.device(device)
        if model.block_runner is not None:
            raise ValueError("attach the AdaLN table before the layerwise offload: it packs every block's weights")
        if model.adaln_table is not None:
            raise ValueError("this model's AdaLN projections are already in a table")
        pin = device.type == "cuda"
        projections = []
        for block in model.transformer_blocks:
            projections.append(block.adaln_proj)
            block.adaln_proj = None
        out = model.norm_out.linear
        model.norm_out.linear = None
        for module in (*projections, out):
            for p in module.parameters():
                p.data = _to_host(p.data, pin)
        table = cls(projections, out, device)
        model.adaln_table = table
        if pin:
            torch.cuda.empty_cache()  # any device copies they had are gone
        return table

    # -- what the table is keyed by ---------------------------------------------------------------------------------

    def named_weights(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Every weight an entry depends on: the time embedder's, each projection's, norm_out.linear's."""
        named = [(f"time_embedder.{n}", p) for n, p in model.time_embedder.named_parameters()]
        for j, proj in enumerate(self.projections):
            named += [(f"transformer_blocks.{j}.adaln_proj.{n}", p) for n, p in proj.named_parameters()]
        return named + [(f"norm_out.linear.{n}", p) for n, p in self.out_projection.named_parameters()]

    def make_key(self, model: nn.Module, component: str, inputs: Sequence[torch.Tensor]) -> dict:
        return {
            "format": FORMAT,
            "component": component,
            "weights_sha256": tensors_sha256(self.named_weights(model)),
            "dtype": str(self.out_projection.weight.dtype).removeprefix("torch."),
            "kernel": kernel_identity(self.device),
            "layers": len(self.projections),
            "timesteps": [[float(v).hex() for v in ts.tolist()] for ts in inputs],
        }

    @staticmethod
    def file_name(component: str, key: dict) -> str:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return f"adaln-{component}-{digest[:32]}.safetensors"

    # -- entries -----------------------------------------------------------------------------------------------------

    def _stage(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's weights on the device (the host tensors themselves on the CPU), for `functional_call`."""
        return {n: p.to(self.device, non_blocking=True) for n, p in module.named_parameters()}

    def compute(self, temb_acts: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host entries (blocks (L, 3*n_t, 6, D), out (n_t, 2*D)) for each temb_act (n_t, E) on the device - each the
        forward's own silu(temb(timesteps)) - by the forward's own calls on it: H3AdaLNModulation.forward, and
        H3OutputNorm.project's linear on the input cast to its weight's dtype. Each projection is staged on the
        device once for all of them (its 0.48 GiB copied once, not once per entry)."""
        pin = self.device.type == "cuda"
        blocks: list[torch.Tensor | None] = [None] * len(temb_acts)
        with torch.no_grad():
            for j, proj in enumerate(self.projections):
                staged = self._stage(proj)
                for k, x in enumerate(temb_acts):
                    y = functional_call(proj, staged, (x,))  # (3*n_t, 6, D)
                    if blocks[k] is None:
                        blocks[k] = _host_empty((len(self.projections), *y.shape), y.dtype, pin)
                    blocks[k][j].copy_(y)
                del staged
            staged = self._stage(self.out_projection)
            outs = [_to_host(functional_call(self.out_projection, staged, (x.to(self.out_projection.weight.dtype),)),
                             pin) for x in temb_acts]
        return list(zip(blocks, outs))

    def build(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
        """Compute an entry for each timesteps vector of `inputs` with `model`'s time embedder on the device."""
        t0 = time.perf_counter()
        with torch.no_grad():
            temb_acts = [model.temb_act(ts.to(self.device)) for ts in inputs]
        for ts, (blocks, out) in zip(inputs, self.compute(temb_acts)):
            self.entries[timesteps_key(ts)] = Entry(ts.clone(), blocks, out)
        self.build_seconds = time.perf_counter() - t0

    def lookup(self, timesteps: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's rows on the device: blocks (L, 3*n_t, 6, D), out (n_t, 2*D); a miss is computed here from
        `temb_act` (n_t, E), the forward's own input, and kept."""
        key = timesteps_key(timesteps)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.computed.get(key)
            if entry is not None:
                self.computed.move_to_end(key)
        if entry is None:
            self.misses += 1
            (blocks, out), = self.compute([temb_act])
            entry = self.computed[key] = Entry(timesteps.detach().to("cpu", torch.float32), blocks, out)
            if len(self.computed) > MAX_COMPUTED:
                self.computed.popitem(last=False)
        return entry.blocks.to(self.device, non_blocking=True), entry.out.to(self.device, non_blocking=True)

    # -- the file ----------------------------------------------------------------------------------------------------

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for i, e in enumerate(self.entries.values()):
            tensors.update({f"{i:05d}.timesteps": e.timesteps, f"{i:05d}.blocks": e.blocks, f"{i:05d}.out": e.out})
        return tensors

    def save(self, path: Path, key: dict) -> None:
        """Write the schedule's entries atomically (a temp file renamed: ranks writing the same file at once are
        safe, a reader never sees half a file)."""
        tensors = self._tensors()
        meta = {KEY_META: json.dumps(key, sort_keys=True), SHA_META: tensors_sha256(sorted(tensors.items()))}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_safetensors(tmp, tensors, meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.path = path

    def load(self, path: Path, key: dict) -> None:
        """Read the entries of `path`, refusing a file made for another key or whose tensors were changed."""
        pin = self.device.type == "cuda"
        try:
            with open_file(path) as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except H3Error as exc:
            raise AdaLNTableError(f"AdaLN table {path}: {exc}; remove it to have it rebuilt") from None
        want = json.dumps(key, sort_keys=True)
        if meta.get(KEY_META) != want:
            raise AdaLNTableError(
                f"AdaLN table {path} was made for another checkpoint, schedule, dtype or device (its header's key "
                f"differs from this model's); it is refused: remove it to have it rebuilt")
        if tensors_sha256(sorted(tensors.items())) != meta.get(SHA_META):
            raise AdaLNTableError(
                f"AdaLN table {path}: its tensors do not match the sha256 recorded in its header (the file was "
                f"changed or is damaged); it is refused: remove it to have it rebuilt")
        for i in range(len(tensors) // 3):
            ts = tensors[f"{i:05d}.timesteps"].clone()
            self.entries[timesteps_key(ts)] = Entry(ts, _to_host(tensors[f"{i:05d}.blocks"], pin),
                                                    _to_host(tensors[f"{i:05d}.out"], pin))
        self.path = path

    def report(self) -> dict:
        entry_bytes = [e.blocks.nbytes + e.out.nbytes for e in self.entries.values()]
        return {"entries": len(self.entries), "table_bytes": sum(entry_bytes),
                "largest_entry_bytes": max(entry_bytes, default=0),
                "host_weight_bytes": sum(p.nbytes for m in (*self.projections, self.out_projection)
                                         for p in m.parameters()),
                "computed_on_miss": self.misses, "file": str(self.path) if self.path else None,
                "build_s": round(self.build_seconds, 3)}


def attach_adaln_table(model: nn.Module, directory: str | os.PathLike | None, component: str,
                       inputs: Sequence[torch.Tensor], device: torch.device | str) -> AdaLNTable:
    """Detach `model`'s AdaLN projections into a table for `inputs` (timesteps vectors, `schedule_inputs`): read from
    `directory` when its file for this key is there (refused if changed), else built and written there (a directory
    that cannot be written keeps the table in memory only, with a warning; None: built, in memory only). The key is
    made either way: sequence-parallel ranks compare its weight digest."""
    table = AdaLNTable.detach(model, device)
    key = table.key = table.make_key(model, component, inputs)
    if directory is None:
        table.build(model, inputs)
        log.info("%s: AdaLN table built in %.2f s (in memory)", component, table.build_seconds)
        return table
    path = Path(directory) / AdaLNTable.file_name(component, key)
    if path.exists():
        table.load(path, key)
        log.info("%s: AdaLN table read from %s (%d entries)", component, path, len(table.entries))
        return table
    table.build(model, inputs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table.save(path, key)
        log.info("%s: AdaLN table built in %.2f s and written to %s", component, table.build_seconds, path)
    except OSError as exc:
        log.warning("%s: AdaLN table built but not written to %s (%s); it is kept in memory only", component, path,
                    exc)
    return table
