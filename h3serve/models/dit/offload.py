"""The DiT's block stack under layerwise offload (h3serve.models.offload): `run_blocks` then streams."""

from __future__ import annotations

import torch
import torch.distributed as dist

from h3serve.models.offload import LayerwiseOffload, OffloadPlan


def attach_offload(model, resident_blocks: int, device: torch.device | str, *, mode: str = "local",
                   group=None) -> LayerwiseOffload:
    """Put an H3DiT's block stack under layerwise offload; its `run_blocks` then streams."""
    world = dist.get_world_size(group) if group is not None else 1
    plan = OffloadPlan(len(model.transformer_blocks), resident_blocks, mode, world)
    off = LayerwiseOffload(model.transformer_blocks, plan, device, group=group)
    model.block_runner = off
    return off
