"""Rank 0's stand-ins for the model stages of a parallel world: one family, for the embedded pipeline and for the
stage servers.

A stand-in has the methods of the model object it replaces (`TextEncoder.encode`, `DiTEngine.generate`, the
`VideoVAE` decodes); each runs as one op on every rank through `stage.call` and returns rank 0's result. Any other
attribute is rank 0's own object (its encoder shard, DiT engine, VideoVAE), so local work such as a keyframe encode
or a window plan stays on rank 0. `stage` is the world's `StageHandle`, or a stage server's `ParallelStage` over it.

The stand-ins know the ops by name only. What each rank runs under these names is the model's rank builder
(`h3serve.models.<model>.parallel`), which also registers, under `PART`, a handler that returns the rank's own
object (never called as an op).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

__all__ = ["StandIn", "EncoderProxy", "DiTEngineProxy", "VideoVAEProxy"]


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


class StandIn:
    """Base of the stand-ins: `stage` runs the ops, `part` is rank 0's own object."""

    PART: str

    def __init__(self, stage):
        self.stage = stage
        self.part = stage.handlers[self.PART](None, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.part, name)


class EncoderProxy(StandIn):
    """A `TextEncoder` sharded by tensor parallelism."""

    PART, ENCODE = "encoder", "encode"

    def encode(self, prompt: str, *, images: Sequence = (), task: str = "t2va", references=None):
        return self.stage.call(self.ENCODE, (prompt, list(images), task, references))


class DiTEngineProxy(StandIn):
    """A `DiTEngine` under Ulysses x Ring."""

    PART, GENERATE = "dit", "generate"

    def generate(self, req, *, on_step=None, should_stop=None):
        # The peers unpickle the request: tensors travel on the CPU and each rank moves them to its own device.
        req = dataclasses.replace(req, text_states=_cpu(req.text_states), text_tags=_cpu(req.text_tags),
                                  condition_latents=[_cpu(t) for t in req.condition_latents],
                                  reference_audio_rows=[_cpu(t) for t in req.reference_audio_rows])
        return self.stage.call(self.GENERATE, req, should_stop=should_stop, on_step=on_step)


class VideoVAEProxy(StandIn):
    """A `VideoVAE` whose decodes run patch parallel; encodes and plans are rank 0's own VAE."""

    PART, DECODE, DECODE_FLOAT = "video_vae", "decode", "decode_float"

    def iter_decode(self, latents) -> Iterator[torch.Tensor]:
        return self._stream(self.DECODE, _cpu(latents))

    def iter_decode_float(self, latents) -> Iterator[torch.Tensor]:
        return self._stream(self.DECODE_FLOAT, _cpu(latents))

    # The VAE's own methods over the decodes above (its class, not rank 0's object, which would decode alone).
    def iter_decode_yuv420p(self, latents):
        return type(self.part).iter_decode_yuv420p(self, latents)

    def decode_float(self, latents) -> torch.Tensor:
        return type(self.part).decode_float(self, latents)

    def _stream(self, op: str, payload) -> Iterator[torch.Tensor]:
        """A streaming op, started at the first clip asked for. A consumer that stops early still runs it out on
        rank 0, so that the other ranks (which decode their share of every window) stay in step with it."""
        clips = self.stage.call(op, payload)
        try:
            for clip in clips:   # not `yield from`: closing this generator would close `clips` before it ran out
                yield clip
        finally:
            try:
                for _ in clips:
                    pass
            except Exception:  # noqa: BLE001 - already reported, or the broken stage says so on the next call
                pass
