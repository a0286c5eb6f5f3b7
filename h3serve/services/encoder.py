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
from h3serve.models.encoder.model import TextEncoder
from h3serve.runtime.device import DTYPES, pick_device
from h3serve.runtime.stage import StageBase
from h3serve.transport.grpc import iter_tensor_chunks

log = logging.getLogger("h3serve.encoder")

SERVED_TASKS = ("t2va",)


class EncoderServicer(StageBase):
    stage = "encoder"
    checks_modules = True   # a prompt is one forward: a caller's cancel or deadline stops it between layers

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.encoder = None

    def register(self, server) -> None:
        encoder_pb2_grpc.add_EncoderServicer_to_server(self, server)

    def load(self) -> None:
        def load():
            device = pick_device(self.config.device)
            if self.start_ranks() is not None:   # --encoder-tp: the decoder sharded over the stage's ranks
                self.encoder = EncoderProxy(self.parallel)
                device = self.encoder.device
            else:
                self.encoder = TextEncoder.load(self.config.checkpoint, dtype=DTYPES[self.config.dtype],
                                                device=device)
            if self.config.warmup:
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
        scope = self.scope(context, request.request_id)
        try:
            t0 = time.perf_counter()
            encoded = self.run_engine(scope, lambda: self.encoder.encode(request.prompt, task=request.task))
            seconds = time.perf_counter() - t0
            scope.unit_done()
            for chunk in iter_tensor_chunks("text_states", encoded.states):
                yield encoder_pb2.EncodeEvent(chunk=chunk)
            for chunk in iter_tensor_chunks("text_tags", encoded.tags):
                yield encoder_pb2.EncodeEvent(chunk=chunk)
            yield encoder_pb2.EncodeEvent(done=encoder_pb2.EncodeDone(tokens=int(encoded.tags.shape[0]),
                                                                      seconds=seconds,
                                                                      peak_memory_mb=scope.peak_memory_mb))
        except BaseException as exc:
            self.finish(scope, exc)
            raise
        self.finish(scope)
