"""Per-request LoRA on the DiT: adapters loaded once into a byte-bounded LRU cache, applied to one request only.

How it is applied: an unfused low-rank add in the target Linears' forwards, y = x W^T (+ b) + (x A^T) B^T * scale,
by forward hooks that exist only while that request's denoising runs. The base weights are never written, so a
request without LoRA runs exactly today's kernels on exactly today's weights: its bytes cannot change, whatever ran
before it (a fused W + BA restored afterwards would also be exact, but costs a weight copy per request and a
window in which a failure could leave W patched). The add computes in the target weight's dtype, as PEFT's LoRA
Linear does.

What cannot take a hook is refused, naming the lever: FP8 linears (their GEMM takes quantized rows, `levers.fp8`;
refused with the deployment, `FP8_REFUSAL`), and AdaLN projections replaced by a table (`levers.adaln_table`; an
adapter patching them is refused when it loads). Layerwise offload moves only the base weights, so it needs nothing
here. One request at a time per model (the engine thread): the hooks are the model's while that request runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.config.lora import FP8_REFUSAL, LoraEntry, find_lora
from h3serve.errors import RequestError
from h3serve.models.dit.adaln import ADALN_WEIGHTS
from h3serve.weights.lora import read_lora

log = logging.getLogger("h3serve.dit")

# modules whose outputs the AdaLN table holds (timestep -> modulation), so a hook there would never run
ADALN_PATH = ("time_embedder", *ADALN_WEIGHTS)


@dataclass
class LoadedLora:
    """One adapter on the DiT's device: module name -> (A (r, in), B (out, r), scale), in the weight's dtype."""

    entry: LoraEntry
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    nbytes: int


def _lever_refusal(entry: LoraEntry, module_name: str, module: nn.Module | None, adaln_table: bool) -> str | None:
    if adaln_table and any(part in module_name for part in ADALN_PATH):
        return (f"LoRA {entry.name!r} patches {module_name}, whose outputs the adalnTable lever replaced by a table; "
                "turn dit.levers.adalnTable (--adaln-table) off to serve it")
    if module is not None and not isinstance(module, nn.Linear):
        if "FP8" in type(module).__name__:
            return FP8_REFUSAL
        return f"LoRA {entry.name!r} patches {module_name}, a {type(module).__name__}, not a Linear"
    return None


def load_lora(model: nn.Module, entry: LoraEntry, device: torch.device, *, adaln_table: bool = False) -> LoadedLora:
    """Read `entry`'s file (sha256 checked), check every target against `model`, and place the factors."""
    modules = dict(model.named_modules())
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    nbytes = 0
    for name, m in read_lora(entry.path, entry.sha256).items():
        target = modules.get(name)
        refusal = _lever_refusal(entry, name, target, adaln_table)   # the table detaches what it replaces
        if refusal is not None:
            raise RequestError("lora.name", entry.name, refusal)
        if target is None:
            raise RequestError("lora.name", entry.name, f"its file {entry.path} patches '{name}', which the H3 "
                                                        "transformer does not have (a LoRA for another model?)")
        if (m.a.shape[1], m.b.shape[0]) != (target.in_features, target.out_features):
            raise RequestError("lora.name", entry.name,
                               f"its {name} factors map {m.a.shape[1]} -> {m.b.shape[0]} features but the Linear maps "
                               f"{target.in_features} -> {target.out_features}")
        dtype = target.weight.dtype
        a, b = m.a.to(device, dtype), m.b.to(device, dtype)
        factors[name] = (a, b, m.scale)
        nbytes += a.nbytes + b.nbytes
    return LoadedLora(entry, factors, nbytes)


@contextlib.contextmanager
def applied(model: nn.Module, lora: LoadedLora | None, scale: float = 1.0) -> Iterator[None]:
    """`lora` at `scale` on `model`'s Linears for the body only (hooks removed on every path)."""
    if lora is None:
        yield
        return
    modules = dict(model.named_modules())
    handles = []

    def hook_for(a: torch.Tensor, b: torch.Tensor, s: float):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            return out + F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype) * s
        return hook

    try:
        for name, (a, b, s) in lora.factors.items():
            handles.append(modules[name].register_forward_hook(hook_for(a, b, s * scale)))
        yield
    finally:
        for h in handles:
            h.remove()


class LoraCache:
    """The deployment's adapters, loaded on first use and kept on the device up to `max_bytes` (least recently used
    dropped first). An adapter larger than the whole bound is refused, naming the knob."""

    def __init__(self, entries: Sequence[LoraEntry], max_bytes: int, device: torch.device):
        self.entries = tuple(entries)
        self.max_bytes = int(max_bytes)
        self.device = device
        self._held: OrderedDict[str, LoadedLora] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0   # files read (a hit reads none)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self._held.values())

    def held(self) -> list[str]:
        """Names on the device, least recently used first."""
        return list(self._held)

    def verify(self, model: nn.Module, *, adaln_table: bool = False) -> None:
        """Read and check every listed file against `model` on the CPU, keeping nothing (a service's start)."""
        for entry in self.entries:
            load_lora(model, entry, torch.device("cpu"), adaln_table=adaln_table)

    def get(self, name: str, model: nn.Module, *, adaln_table: bool = False) -> LoadedLora:
        entry = find_lora(self.entries, name)
        with self._lock:
            hit = self._held.get(name)
            if hit is not None:
                self._held.move_to_end(name)
                return hit
            loaded = load_lora(model, entry, self.device, adaln_table=adaln_table)
            self.loads += 1
            if loaded.nbytes > self.max_bytes:
                raise RequestError("lora.name", name, f"the adapter needs {loaded.nbytes:,} bytes on the device, more "
                                                      f"than the LoRA cache's bound ({self.max_bytes:,} bytes: "
                                                      "dit.loraCacheBytes / --lora-cache-bytes)")
            while self._held and self.nbytes + loaded.nbytes > self.max_bytes:
                dropped, _ = self._held.popitem(last=False)
                log.info("LoRA cache: dropped %s (least recently used)", dropped)
            self._held[name] = loaded
            log.info("LoRA cache: loaded %s (%d modules, %d bytes; %d of %d bytes held)", name,
                     len(loaded.factors), loaded.nbytes, self.nbytes, self.max_bytes)
            return loaded
