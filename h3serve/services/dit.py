"""DiT stage server: a thin gRPC adapter over `DiTEngine`.

Generate reads the parameters and the encoder's tensors from the client stream, runs the engine on the stage's
engine thread with `should_stop` wired to the call (client cancel, deadline, server stop), and streams one
progress event per denoising step, then the latents.
"""

from __future__ import annotations

import logging
import time

import torch

from h3serve._proto import common_pb2, dit_pb2, dit_pb2_grpc, vae_pb2, vae_pb2_grpc
from h3serve.config.geometry import check_latents
from h3serve.config.lora import find_lora, lora_choice, lora_steps, parse_loras
from h3serve.config.request import BASE_STEPS_RANGE, FASTH3_STEPS, dit_fields
from h3serve.media.preview import preview_jpeg
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import COMPONENT_FOR_TASK, DEFAULT_QUALITY, NIXL, QUALITIES
from h3serve.distributed.proxies import DiTEngineProxy
from h3serve.errors import RequestError
from h3serve.errortable import grpc_method
from h3serve.models import conditions as cond
from h3serve.models.dit import kernels
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.runtime.device import TORCH_DTYPES, pick_device
from h3serve.runtime.stage import StageBase, first_message
from h3serve.transport.control import LATENTS_EDGE, ControlSender
from h3serve.transport.grpc import GrpcStreamReceiver, iter_tensor_chunks
from h3serve.weights.folder import CheckpointFolder

log = logging.getLogger("h3serve.dit")

def served_tasks(config: StageConfig) -> tuple[str, ...]:
    """--tasks within the profile, whose DiT partition the checkpoint holds (ref2va needs `transformer_ref/`)."""
    entries = set(CheckpointFolder(config.model.checkpoint, components=[]).components)
    return tuple(t for t in config.model.tasks_for() if COMPONENT_FOR_TASK[t] in entries)


def _unwrap(msg):
    kind = msg.WhichOneof("input")
    return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)


def check_geometry(p) -> None:
    """The request geometry the gateway's validation produces, checked again for a direct caller (the geometry
    module's rule), and the steps of its profile."""
    check_latents(p.latent_frames, p.audio_latents, p.latent_height, p.latent_width)
    lo, hi = BASE_STEPS_RANGE
    if p.steps and not (p.steps == FASTH3_STEPS if p.profile == "fasth3" else lo <= p.steps <= hi):
        raise RequestError("steps", p.steps, f"{FASTH3_STEPS} (fasth3)" if p.profile == "fasth3" else
                           f"grid points in [{lo}, {hi}], or 0 for the default")


def check_text(states, tags, text_dim: int | None) -> None:
    """text_states (1, L, D) float with the model's D, text_tags (L,) integer."""
    if states.ndim != 3 or states.shape[0] != 1 or not states.is_floating_point() or \
            (text_dim is not None and states.shape[2] != text_dim):
        raise RequestError("text_states", tuple(states.shape), f"(1, L, {text_dim or 'D'}) floating point")
    if tags.ndim != 1 or tags.shape[0] != states.shape[1] or tags.is_floating_point():
        raise RequestError("text_tags", tuple(tags.shape), f"({states.shape[1]},) integer, one tag per token")


class DiTServicer(StageBase):
    stage = "dit"

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.engine = None
        self.tasks: tuple[str, ...] = ("t2va",)
        self.last_transport: dict | None = None   # the latents edge's last stream
        self.device: torch.device | None = None    # the DiT's device, once loading started

    def register(self, server) -> None:
        dit_pb2_grpc.add_DiTServicer_to_server(self, server)

    def load(self) -> None:
        self.choose_transport()
        self.executor.submit(self._load).result()

    def _load(self) -> None:
        c = self.config
        device = self.device = pick_device(c.model.device)
        self.tasks = served_tasks(c)
        components = tuple(sorted({COMPONENT_FOR_TASK[t] for t in self.tasks}))
        if self.start_ranks() is not None:   # --ulysses x --ring: every rank loads (and fuses) the DiT itself
            self.engine = DiTEngineProxy(self.parallel)
            # the ranks load the t2va / fl2va partition only (runtime/ranks.py)
            self.tasks = tuple(t for t in self.tasks if COMPONENT_FOR_TASK[t] == "transformer")
        else:
            m = c.model
            self.engine = DiTEngine.load(m.checkpoint, components=components, dtype=TORCH_DTYPES[m.dtype],
                                         device=device, profile=m.profile, adapter=m.adapter,
                                         adapter_sha256=m.adapter_sha256, levers=c.levers, adaln_dir=m.adaln_dir,
                                         loras=parse_loras(m.loras), lora_cache_bytes=m.lora_cache_bytes)
        if c.model.warmup:   # one forward at the smallest geometry: kernels, allocator, lazy init
            model = self.engine.models["transformer"]
            req = DiTRequest(text_states=torch.zeros(1, 4, model.config.text_dim), text_tags=torch.ones(4, dtype=torch.long),
                             latent_frames=2, latent_h=2, latent_w=2, audio_latents=4, seed=0, task="t2va",
                             profile=c.model.profile, steps=None if c.model.profile == "fasth3" else 2)
            out = self.engine.generate(req)
            self.check_finite(video_latents=out.video, audio_latents=out.audio)
            preview_jpeg(out.video)   # numpy's SVD and PIL's JPEG encoder loaded before a request's first preview

    def attention(self) -> dict | None:
        # this process's choice; under Ulysses x Ring every rank makes the same one (same build, same levers)
        if not self.ready:
            return None
        try:
            return kernels.attention_choice(self.device)
        except ValueError as exc:   # --no-warmup with a bad $H3SERVE_ATTENTION: every forward fails the same way
            return {"kernel": "none", "reason": str(exc)}

    def info(self) -> dict:
        return {**super().info(), "tasks": list(self.tasks),
                "transport": self.transport.details(LATENTS_EDGE, self.last_transport)}

    @grpc_method("dit")
    def Generate(self, request_iterator, context):
        p = first_message(request_iterator, "params",
                          "the first message of a DiT stream carries the parameters").params
        task = p.task or "t2va"
        if task not in self.tasks:
            raise RequestError("task", p.task, f"this DiT serves {' | '.join(self.tasks)} (profile "
                                               f"{self.config.model.profile})")
        quality = p.quality or DEFAULT_QUALITY
        if quality not in QUALITIES:
            raise RequestError("quality", p.quality, "one of " + " | ".join(QUALITIES))
        kinds = cond.requested_kinds(p.condition_kinds, task, "condition_kinds")
        check_geometry(p)
        lora = self.lora_request(p)   # refused here, before any tensor is read (and before the ranks see it)
        sink = p.latents_sink   # checked (--peers) before any work; dialled when the latents are ready
        vae = self.channel(sink.address, "latents_sink.address") if sink.address and sink.session_id else None
        with self.request(context, p.request_id) as scope:
            tensors = {}
            for msg in GrpcStreamReceiver(request_iterator, _unwrap, edge="gateway->dit"):
                tensors[msg.header.name] = msg.tensor
            for name in ("text_states", "text_tags"):
                if name not in tensors:
                    raise RequestError(name, None, "the DiT needs text_states (1, L, D) and text_tags (L,)")
            if p.profile != self.config.model.profile:
                raise RequestError("profile", p.profile, f"this DiT serves profile {self.config.model.profile!r}")
            model = getattr(self.engine, "models", {}).get("transformer")
            check_text(tensors["text_states"], tensors["text_tags"], getattr(getattr(model, "config", None),
                                                                            "text_dim", None))
            missing = [f"condition.{i}" for i in range(len(kinds)) if f"condition.{i}" not in tensors]
            if missing:
                raise RequestError(missing[0], None, "one encoded condition per condition kind")
            try:
                c = cond.dit_conditions(kinds, [tensors[f"condition.{i}"] for i in range(len(kinds))], task)
            except ValueError as exc:
                raise RequestError("condition", None, str(exc)) from None
            req = DiTRequest(
                text_states=tensors["text_states"], text_tags=tensors["text_tags"], latent_frames=p.latent_frames,
                latent_h=p.latent_height, latent_w=p.latent_width, audio_latents=p.audio_latents, anchors=c.anchors,
                condition_latents=c.condition_latents, references=c.references,
                reference_audio_rows=c.reference_audio_rows,
                **{**dit_fields(p), "task": task, "quality": quality, "steps": p.steps or None, **lora})   # 0: unset
            if req.preview_every > 0 and isinstance(self.engine, DiTEngineProxy):
                raise RequestError("preview_every", req.preview_every,
                                   "0: a sequence-parallel DiT (--ulysses / --ring) serves no previews")
            t0 = time.perf_counter()

            def work(emit):
                def on_step(done: int, total: int) -> None:
                    scope.unit_done()
                    emit(common_pb2.Progress(stage="dit", done=done, total=total, elapsed_s=time.perf_counter() - t0))

                def on_preview(done: int, total: int, latents) -> None:
                    emit(common_pb2.Progress(stage="dit", done=done, total=total, elapsed_s=time.perf_counter() - t0,
                                             preview_jpeg=preview_jpeg(latents)))

                previews = {"on_preview": on_preview} if req.preview_every > 0 else {}
                return self.engine.generate(req, on_step=on_step, should_stop=scope.should_stop, **previews)

            result = yield from self.engine_events(scope, work, lambda p: dit_pb2.DiTEvent(progress=p))
            done = dit_pb2.DiTDone(steps=result.steps, seconds=result.seconds, step_seconds=result.step_seconds,
                                   peak_memory_mb=scope.peak_memory_mb, forwards_computed=result.forwards_computed,
                                   block_evaluations=result.block_evaluations)
            if vae is not None:   # the latents go straight to the VAE (dit->vae over Control)
                info = self._send_latents(scope, vae, sink, result)
                done.transport.CopyFrom(common_pb2.TransportInfo(**info))
            else:
                for chunk in iter_tensor_chunks("video_latents", result.video):
                    yield dit_pb2.DiTEvent(chunk=chunk)
                for chunk in iter_tensor_chunks("audio_latents", result.audio):
                    yield dit_pb2.DiTEvent(chunk=chunk)
            yield dit_pb2.DiTEvent(done=done)

    def lora_request(self, p) -> dict:
        """DiTRequest's lora, lora_scale and steps for DiTParams naming a LoRA ({} without): the name among --loras,
        the scale in range, a few-step adapter's steps (`config/lora.py`)."""
        if not p.lora:
            return {}
        choice = lora_choice({"name": p.lora, **({"scale": p.lora_scale} if p.HasField("lora_scale") else {})})
        entry = find_lora(parse_loras(self.config.model.loras), choice.name)
        return {"lora": choice.name, "lora_scale": choice.scale, "steps": lora_steps(entry, p.steps or None,
                                                                                   field="steps")}

    def _send_latents(self, scope, vae, sink, result) -> dict:
        """Send the latents to the VAE's latents session over `VAE.Control` (the bytes by NIXL WRITE, or inline on
        the call when NIXL cannot be used); returns the edge's transport info."""
        with ControlSender(LATENTS_EDGE, vae_pb2_grpc.VAEStub(vae).Control,
                           vae_pb2.LatentsControl(session_id=sink.session_id, transport=NIXL),
                           lambda data: vae_pb2.LatentsControl(data=data), scope,
                           transport=self.transport.chosen, local_reason=f"dit: {self.transport.reason}") as tx:
            tx.send("video_latents", result.video.float().contiguous(), scope)
            tx.send("audio_latents", result.audio.float().contiguous(), scope)
            tx.finish(scope)
        self.last_transport = tx.info
        return tx.info
