"""Encoder stage server: a thin gRPC adapter over `TextEncoder` (prompt -> text hidden states + token roles)."""

from __future__ import annotations

import logging
import time

import torch

from h3serve._proto import encoder_pb2, encoder_pb2_grpc
from h3serve.config.stage import StageConfig
from h3serve.distributed.proxies import EncoderProxy
from h3serve.errors import RequestError
from h3serve.errortable import grpc_method
from h3serve.models import conditions as cond
from h3serve.models.encoder.cache import EncodeCache, cache_key, checkpoint_identity
from h3serve.models.encoder.model import ATTENTION, DEFAULT_LAYER, TextEncoder
from h3serve.runtime.device import TORCH_DTYPES, pick_device
from h3serve.runtime.stage import StageBase, first_message
from h3serve.transport.grpc import GrpcStreamReceiver, iter_tensor_chunks
from h3serve.weights.folder import CheckpointFolder

log = logging.getLogger("h3serve.encoder")

SERVED_TASKS = ("t2va",)              # Encode
CONDITIONED_TASKS = ("fl2va", "ref2va")  # EncodeConditioned


def _unwrap(msg):
    kind = msg.WhichOneof("input")
    return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)


class EncoderServicer(StageBase):
    stage = "encoder"
    checks_modules = True   # a prompt is one forward: a caller's cancel or deadline stops it between layers

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.encoder = None
        self.short_edge = cond.DEFAULT_REFERENCE_SHORT_EDGE
        self.cache = EncodeCache(config.model.encoder_cache_bytes)
        self.identity = ""

    def register(self, server) -> None:
        encoder_pb2_grpc.add_EncoderServicer_to_server(self, server)

    def load(self) -> None:
        self.choose_transport(probe=False)   # its tensors go to the gateway over gRPC

        def load():
            self.short_edge = cond.reference_short_edge(
                CheckpointFolder(self.config.model.checkpoint, components=[]).pipeline_config)
            self.identity = checkpoint_identity(self.config.model.checkpoint)
            device = pick_device(self.config.model.device)
            if self.start_ranks() is not None:   # --encoder-tp: the decoder sharded over the stage's ranks
                self.encoder = EncoderProxy(self.parallel)
                device = self.encoder.device
            else:
                self.encoder = TextEncoder.load_with_levers(
                    self.config.model.checkpoint, dtype=TORCH_DTYPES[self.config.model.dtype], device=device,
                    fp8=self.config.levers.fp8, resident_layers=self.config.levers.encoder_resident_layers)
            if self.config.model.warmup:
                self.check_finite(text_states=self.encoder.encode("warm-up", task="t2va").states)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        self.executor.submit(load).result()

    @grpc_method("encoder")
    def Encode(self, request, context):
        if request.task not in SERVED_TASKS:
            raise RequestError("task", request.task, "the encoder service presents t2va")
        if not request.prompt:
            raise RequestError("prompt", request.prompt, "a non-empty prompt")
        with self.request(context, request.request_id) as scope:
            key = self._key(task=request.task, prompt=request.prompt)
            yield from self._encode(scope, lambda: self.encoder.encode(request.prompt, task=request.task), key)

    @grpc_method("encoder")
    def EncodeConditioned(self, request_iterator, context):
        p = first_message(request_iterator, "params",
                          "the first message of an EncodeConditioned stream carries the parameters").params
        if p.task not in CONDITIONED_TASKS:
            raise RequestError("task", p.task, "fl2va or ref2va (t2va: Encode)")
        if not p.prompt:
            raise RequestError("prompt", p.prompt, "a non-empty prompt")
        kinds = cond.requested_kinds(p.kinds, p.task, "kinds")
        tensors = {m.header.name: m.tensor for m in GrpcStreamReceiver(request_iterator, _unwrap,
                                                                       edge="gateway->encoder")}
        visual = [i for i, k in enumerate(kinds) if k in cond.VISUAL_KINDS]
        missing = [f"condition.{i}" for i in visual if f"condition.{i}" not in tensors]
        if missing:
            raise RequestError(missing[0], None, "(H, W, 3) uint8 RGB, one per visual condition")

        def run():
            images = cond.resize(kinds, [tensors[f"condition.{i}"].numpy() for i in visual], p.height, p.width,
                                 self.short_edge)
            images, refs = cond.encoder_inputs(kinds, images, p.task)
            return self.encoder.encode(p.prompt, images=images, task=p.task, references=refs)

        with self.request(context, p.request_id) as scope:
            key = self._key(task=p.task, prompt=p.prompt, width=p.width, height=p.height, kinds=kinds,
                            images=[tensors[f"condition.{i}"] for i in visual])
            yield from self._encode(scope, run, key)

    def attention(self) -> dict:
        return {"kernel": ATTENTION, "reason": "fixed: the Qwen3-VL encoder runs transformers' "
                                                f"{ATTENTION!r} attention"}

    def info(self) -> dict:
        return {**super().info(), "cache": self.cache.snapshot()}

    def _key(self, **parts) -> str:
        return cache_key(identity=self.identity, dtype=self.config.model.dtype, layer=DEFAULT_LAYER,
                         short_edge=self.short_edge, **parts)

    def _encode(self, scope, work, key: str):
        """The cached encoding for `key`, else run `work` (-> EncodedText) on the engine thread and keep it; stream
        the two tensors and EncodeDone (inside the request's `scope`)."""
        t0 = time.perf_counter()
        cached = self.cache.get(key) if self.cache.capacity else None
        if cached is None:
            encoded = self.run_engine(scope, work)
            states, tags = (self.cache.put(key, encoded.states, encoded.tags) if self.cache.capacity
                            else (encoded.states, encoded.tags))
        else:
            states, tags = cached
        seconds = time.perf_counter() - t0
        scope.unit_done()
        for chunk in iter_tensor_chunks("text_states", states):
            yield encoder_pb2.EncodeEvent(chunk=chunk)
        for chunk in iter_tensor_chunks("text_tags", tags):
            yield encoder_pb2.EncodeEvent(chunk=chunk)
        yield encoder_pb2.EncodeEvent(done=encoder_pb2.EncodeDone(tokens=int(tags.shape[0]), seconds=seconds,
                                                                  peak_memory_mb=scope.peak_memory_mb,
                                                                  cache_hit=cached is not None))
