"""Weights in host memory, on the device only while they compute: layerwise offload and whole-module staging.

`LayerwiseOffload` — a stack of layers run in order (the DiT's blocks, the text encoder's decoder layers) with `r`
slots on the device and every other layer in host memory. Layers [0, r - 2) stay resident; the rest stream through
two device slots, one layer ahead of the compute:

    copy stream:  wait free[s] -> H2D host[j] into slot s (-> all-gather of the shards) -> record ready[s]
    main stream:  wait ready[s] -> block j on slot s -> record free[s]

Neither stream blocks the host: the copy stream waits on events only. With r = num_layers nothing streams (the
plain resident path). Each block's tensors (parameters and buffers, whatever their dtype: bf16, fp32, FP8 + scales)
are packed into one flat byte buffer, so a block is one H2D copy, and a slot is one byte buffer with a typed view per
tensor; a streamed block's parameters point at its slot's views while it runs and at its host copy otherwise.

Two modes with several ranks (the same process group as the sequence-parallel plan, or any other):

* ``local``: every rank pins the whole host copy of its streamed blocks and copies it alone;
* ``allgather``: rank k pins only bytes [k*c, (k+1)*c) of each block's buffer (c = ceil(bytes / world)), copies that
  shard into its part of the slot and the group all-gathers the slot: host memory per rank / world, H2D per rank /
  world, plus one all-gather per block on the interconnect.

The DiT calls `run` (its block loop, with start / stop for step reuse; `attach_offload`); a stack called by code we
do not own (the Qwen3-VL decoder loop in transformers) gets the same schedule from forward hooks (`offload_layers`).

`StagedModule` — a module used once per request (a VAE) kept in pinned host memory and copied to the device in one
H2D copy for the span of a `with staged:` block; the device buffer is freed after it.

On the CPU (tests) the same plan runs without streams or pinning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from h3serve.config.vocab import MIN_RESIDENT_BLOCKS as MIN_STREAMING_SLOTS  # one computes, the next lands
from h3serve.config.vocab import OFFLOAD_MODES

log = logging.getLogger("h3serve.offload")
_ALIGN = 256  # byte offset of every tensor in a packed block: any dtype's view is aligned


@dataclass(frozen=True)
class _Entry:
    """One tensor of a block: where it sits in the packed byte buffer."""

    owner: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A flat uint8 host buffer of exactly `nbytes`, page-locked when `pin`. Not `pin_memory=True`: torch's caching
    host allocator rounds every block up to a power of two (a 1.29 GB DiT block takes 2 GiB), which for a whole
    model's host copies costs tens of GiB of host memory. Plain memory registered with the driver is as fast for
    asynchronous copies and takes what it holds; it is unregistered when the buffer is freed."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buf
    rt = torch.cuda.cudart()
    ptr = buf.data_ptr()
    if int(rt.cudaHostRegister(ptr, nbytes, 0)) != 0:  # 0 = cudaSuccess
        log.warning("cudaHostRegister of %d bytes failed; using the caching pinned allocator", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buf, rt.cudaHostUnregister, ptr)
    return buf


def _entries(block: nn.Module) -> tuple[list[_Entry], int]:
    """Every parameter and buffer of `block` in a fixed order, packed at _ALIGN-aligned offsets; total bytes."""
    out, off = [], 0
    for mod in block.modules():
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                n = t.numel() * t.element_size()
                out.append(_Entry(mod, name, is_param, off, n, t.dtype, tuple(t.shape)))
                off += -(-n // _ALIGN) * _ALIGN
    return out, off


def _views(buf: torch.Tensor, entries: Sequence[_Entry]) -> list[torch.Tensor]:
    """Typed views of a flat uint8 buffer, one per entry."""
    return [buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries]


def _point(entries: Sequence[_Entry], tensors: Sequence[torch.Tensor]) -> None:
    """Make each entry's parameter / buffer the given tensor (no copy)."""
    for e, t in zip(entries, tensors):
        if e.is_param:
            e.owner._parameters[e.name].data = t
        else:
            e.owner._buffers[e.name] = t


@dataclass(frozen=True)
class OffloadPlan:
    """Which blocks stay resident and which stream; pure arithmetic, for any rank count."""

    num_layers: int
    resident_blocks: int  # r: block slots on the device (resident blocks + streaming slots)
    mode: str = "local"
    world: int = 1

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"offload mode {self.mode!r} must be one of {', '.join(OFFLOAD_MODES)}")
        if not MIN_STREAMING_SLOTS <= self.resident_blocks <= self.num_layers:
            raise ValueError(f"resident blocks {self.resident_blocks} must be between {MIN_STREAMING_SLOTS} (a copy "
                             f"one block ahead needs two slots) and the {self.num_layers} layers")
        if self.world < 1:
            raise ValueError(f"world {self.world} must be at least 1")

    @property
    def streaming(self) -> bool:
        return self.resident_blocks < self.num_layers

    @property
    def resident(self) -> range:
        """Blocks kept on the device: the first r - 2 (their compute hides the first streamed copy)."""
        return range(self.num_layers if not self.streaming else self.resident_blocks - MIN_STREAMING_SLOTS)

    @property
    def streamed(self) -> range:
        return range(len(self.resident), self.num_layers)

    def shard_bytes(self, block_bytes: int) -> int:
        """Bytes of one block's host copy a rank holds (allgather: a 1/world shard, rounded up to _ALIGN)."""
        if self.mode == "local" or self.world == 1:
            return block_bytes
        return -(-block_bytes // (self.world * _ALIGN)) * _ALIGN

    def host_bytes_per_rank(self, block_bytes: int) -> int:
        return len(self.streamed) * self.shard_bytes(block_bytes)

    def device_block_bytes(self, block_bytes: int) -> int:
        """Block weight bytes on the device: resident blocks plus the two slots (padded for the all-gather)."""
        slot = self.shard_bytes(block_bytes) * (self.world if self.mode == "allgather" else 1)
        return len(self.resident) * block_bytes + (MIN_STREAMING_SLOTS * slot if self.streaming else 0)


class LayerwiseOffload:
    """Runs `blocks` under an `OffloadPlan`; `run(x, ctx, start, stop)` is `H3DiT.run_blocks`' body.

    Build it on a model whose blocks are on `device` (or on the host: they are moved); the streamed blocks' weights
    move to (pinned) host memory, the device copies of them are freed.
    """

    def __init__(self, blocks: nn.ModuleList, plan: OffloadPlan, device: torch.device | str, *, group=None):
        self.blocks, self.plan, self.device = blocks, plan, torch.device(device)
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1
        if world != plan.world:
            raise ValueError(f"offload plan for world {plan.world}, the group has {world} ranks")
        self.cuda = self.device.type == "cuda"
        for i in plan.resident:
            blocks[i].to(self.device)
        self.entries: dict[int, list[_Entry]] = {}
        self.host: dict[int, torch.Tensor] = {}  # block -> flat uint8 host copy (allgather: this rank's shard)
        self.host_views: dict[int, list[torch.Tensor]] = {}
        self.block_bytes = 0
        pin = self.cuda
        for j in plan.streamed:
            entries, nbytes = _entries(blocks[j])
            self.block_bytes = nbytes
            local = plan.mode == "local" or plan.world == 1
            full = host_buffer(nbytes, pin=pin and local)  # device -> pinned: one fast copy
            for e, v in zip(entries, _views(full, entries)):
                t = e.owner._parameters[e.name] if e.is_param else e.owner._buffers[e.name]
                v.copy_(t.detach())
            shard = plan.shard_bytes(nbytes)
            if plan.mode == "allgather" and plan.world > 1:
                a = self.rank * shard
                mine = host_buffer(shard, pin=pin).zero_()
                n = max(0, min(nbytes, a + shard) - a)
                mine[:n].copy_(full[a : a + n])
                self.host[j] = mine
                # the block's own tensors are not on this rank: empty placeholders until it runs
                _point(entries, self._placeholders(entries))
            else:
                self.host[j] = full
                self.host_views[j] = _views(self.host[j], entries)
                _point(entries, self.host_views[j])
            self.entries[j] = entries
            del full
        self.slots: list[torch.Tensor] = []
        self.slot_views: list[list[torch.Tensor]] = []
        if plan.streaming:
            slot_bytes = plan.shard_bytes(self.block_bytes) * (plan.world if plan.mode == "allgather" else 1)
            first = self.entries[plan.streamed[0]]
            for _ in range(MIN_STREAMING_SLOTS):
                buf = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                self.slots.append(buf)
                self.slot_views.append(_views(buf, first))
        if self.cuda:
            torch.cuda.empty_cache()  # the streamed blocks' device copies are gone
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda and plan.streaming else None
        self.ready = [torch.cuda.Event() for _ in self.slots] if self.copy_stream else []
        self.free = [torch.cuda.Event() for _ in self.slots] if self.copy_stream else []
        self._in_slot: list[int | None] = [None] * len(self.slots)  # which block each slot holds (or is fetching)
        self.copies = 0  # blocks copied host -> device so far

    @staticmethod
    def _placeholders(entries: Sequence[_Entry]) -> list[torch.Tensor]:
        """What a streamed block's tensors are between its runs when this rank holds only a shard of them."""
        return [torch.empty(0, dtype=e.dtype) for e in entries]

    def resize(self, resident_blocks: int) -> None:
        """Change r in place (local mode): blocks entering the resident range get device copies of their host copy,
        blocks leaving it point at their host copy again. Every block keeps its host copy, so r can go either way
        without reloading; only blocks streamed at construction can move."""
        if self.plan.mode != "local" and self.plan.world > 1:
            raise ValueError("resize is for local mode (an allgather rank holds only shards)")
        new = OffloadPlan(self.plan.num_layers, resident_blocks, self.plan.mode, self.plan.world)
        if not set(new.streamed) <= set(self.host):
            raise ValueError(f"r={resident_blocks} would stream blocks this offload keeps no host copy of: build it "
                             f"with the smallest r (here {self.plan.resident_blocks})")
        for j in self.host:
            if j in new.resident:
                _point(self.entries[j], [v.to(self.device, non_blocking=True) for v in self.host_views[j]])
            else:
                _point(self.entries[j], self.host_views[j])
        self.plan = new
        self._in_slot = [None] * len(self.slots)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- copies ---------------------------------------------------------------------------------------------------

    def _slot_of(self, j: int) -> int:
        return (j - self.plan.streamed.start) % MIN_STREAMING_SLOTS

    def _fetch(self, j: int) -> None:
        """Start bringing streamed block j into its slot (no-op if it is there or on its way)."""
        s = self._slot_of(j)
        if self._in_slot[s] == j:
            return
        self._in_slot[s] = j
        self.copies += 1
        buf, src = self.slots[s], self.host[j]
        if self.copy_stream is None:
            self._copy_into(buf, src)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.free[s])  # the slot's previous block has finished computing
            self._copy_into(buf, src)
            self.ready[s].record(self.copy_stream)

    def _copy_into(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        if self.plan.mode == "allgather" and self.plan.world > 1:
            shard = src.numel()
            mine = buf[self.rank * shard : (self.rank + 1) * shard]
            mine.copy_(src, non_blocking=True)
            if dist.get_backend(self.group) == "nccl":
                dist.all_gather_into_tensor(buf, mine, group=self.group)
            else:  # gloo has no all_gather_into_tensor: gather into the shard views of the slot
                parts = list(buf.split(shard))
                dist.all_gather(parts, mine.clone(), group=self.group)
        else:
            buf[: src.numel()].copy_(src, non_blocking=True)

    def _next_streamed(self, j: int, stop: int) -> int | None:
        nxt = j + 1 if j + 1 < stop else None
        if nxt is None or nxt not in self.plan.streamed:
            return None
        return nxt

    # -- the block loop -------------------------------------------------------------------------------------------

    def _enter(self, j: int, stop: int) -> None:
        """Before streamed block j computes: start the next one's copy, wait for j's, point j at its slot."""
        s = self._slot_of(j)
        nxt = self._next_streamed(j, stop)
        if nxt is not None:
            self._fetch(nxt)  # one block ahead, into the other slot
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[s])
        _point(self.entries[j], self.slot_views[s])

    def _leave(self, j: int, last: bool) -> None:
        """After streamed block j computed: free its slot for the copy stream, point j back at its host copy."""
        entries = self.entries[j]
        if self.copy_stream is not None:
            self.free[self._slot_of(j)].record(torch.cuda.current_stream(self.device))
        _point(entries, self.host_views[j] if j in self.host_views else self._placeholders(entries))
        if last:
            self._fetch(self.plan.streamed.start)  # the next call's first streamed block, under what follows

    def run(self, x: torch.Tensor, ctx, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = len(self.blocks) if stop is None else stop
        streamed = self.plan.streamed
        first = next((j for j in range(start, stop) if j in streamed), None)
        if first is not None:
            self._fetch(first)  # hides under the resident blocks' compute (or was prefetched last forward)
        for j in range(start, stop):
            if j not in streamed:
                x = self.blocks[j](x, ctx)
                continue
            self._enter(j, stop)
            x = self.blocks[j](x, ctx)
            self._leave(j, last=stop == len(self.blocks) and j == stop - 1)
        return x

    def hook_layers(self) -> list:
        """The same schedule for a stack whose loop is someone else's (called in order 0..n-1 once per call):
        forward hooks on each streamed layer. Returns the hook handles (`.remove()` undoes them)."""
        n, streamed, handles = len(self.blocks), self.plan.streamed, []
        if not self.plan.streaming:
            return handles

        def pre(j):
            def hook(module, args, kwargs=None):
                if j == streamed.start:
                    self._fetch(j)  # a no-op when the previous call prefetched it
                self._enter(j, n)
            return hook

        def post(j):
            def hook(module, args, output):
                self._leave(j, last=j == n - 1)
            return hook

        for j in streamed:
            handles.append(self.blocks[j].register_forward_pre_hook(pre(j)))
            handles.append(self.blocks[j].register_forward_hook(post(j)))
        return handles

    def report(self) -> dict:
        p = self.plan
        return {"resident_blocks": p.resident_blocks, "mode": p.mode, "world": p.world,
                "streamed_blocks": len(p.streamed), "block_bytes": self.block_bytes,
                "host_bytes_per_rank": p.host_bytes_per_rank(self.block_bytes),
                "device_block_bytes": p.device_block_bytes(self.block_bytes), "copies": self.copies}


class StagedModule:
    """A module's weights packed into one pinned host buffer; `with staged:` copies them to the device in one H2D
    copy and points the module at the copy; on leaving, the module points at the host copy again and the device
    buffer is released (stream-ordered: kernels still queued keep it). Re-entrant: nested blocks copy once."""

    def __init__(self, module: nn.Module, device: torch.device | str):
        self.module, self.device = module, torch.device(device)
        self.entries, self.nbytes = _entries(module)
        cuda = self.device.type == "cuda"
        self.host = host_buffer(self.nbytes, pin=cuda)
        self.host_views = _views(self.host, self.entries)
        for e, v in zip(self.entries, self.host_views):
            v.copy_((e.owner._parameters[e.name] if e.is_param else e.owner._buffers[e.name]).detach())
        _point(self.entries, self.host_views)
        if cuda:
            torch.cuda.empty_cache()  # the module's device copies are gone
        self._depth = 0
        self.copies = 0  # stage-ins so far

    def __enter__(self) -> "StagedModule":
        if self._depth == 0:
            buf = self.host.to(self.device, non_blocking=True)  # ordered before the kernels that read it
            _point(self.entries, _views(buf, self.entries))
            self.copies += 1
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            _point(self.entries, self.host_views)

    def report(self) -> dict:
        return {"staged_bytes": self.nbytes, "copies": self.copies}


def offload_layers(layers: nn.ModuleList, resident: int, device: torch.device | str) -> LayerwiseOffload:
    """Layerwise offload of a stack another library's loop runs (forward hooks): `resident` slots on the device."""
    off = LayerwiseOffload(layers, OffloadPlan(len(layers), resident), device)
    off.handles = off.hook_layers()
    return off


def attach_offload(model, resident_blocks: int, device: torch.device | str, *, mode: str = "local",
                   group=None) -> LayerwiseOffload:
    """Put an H3DiT's block stack under layerwise offload; its `run_blocks` then streams."""
    world = dist.get_world_size(group) if group is not None else 1
    plan = OffloadPlan(len(model.transformer_blocks), resident_blocks, mode, world)
    off = LayerwiseOffload(model.transformer_blocks, plan, device, group=group)
    model.block_runner = off
    return off


def on_device(method):
    """Decorate a method of an object with a `staged` attribute (a StagedModule or None): its weights are on the
    device for the call, or, for a generator, until it is exhausted or closed (a clip-by-clip decode stays staged
    across its clips)."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def gen(self, *args, **kwargs):
            with self.staged or contextlib.nullcontext():
                yield from method(self, *args, **kwargs)
        return gen

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.staged or contextlib.nullcontext():
            return method(self, *args, **kwargs)
    return call
