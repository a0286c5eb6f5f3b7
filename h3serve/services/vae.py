"""VAE stage server: a thin gRPC adapter over `VideoVAE` / `AudioVAE`.

Decode reads the latents from the caller, then decodes clip by clip and streams each clip's uint8 frames (made on
the device by `VideoVAE.iter_decode`) straight to the muxer session named in the request, followed by the PCM.
The caller receives only one small event per clip and a summary; frames never pass through it. Cancellation and
the deadline are checked before every clip.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from h3serve._proto import common_pb2, muxer_pb2_grpc, vae_pb2, vae_pb2_grpc
from h3serve.config.levers import staging_conflict
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import NIXL
from h3serve.distributed.proxies import VideoVAEProxy
from h3serve.errors import H3Error, RequestError, StageUnavailable
from h3serve.errortable import grpc_method
from h3serve.models import conditions as cond
from h3serve.models.vae.audio import AudioVAE
from h3serve.models.vae.video import VideoVAE
from h3serve.runtime.device import TORCH_DTYPES, pick_device
from h3serve.runtime.stage import StageBase, first_message
from h3serve.services.sessions import Session, SessionTable
from h3serve.transport.control import FRAMES_EDGE, LATENTS_EDGE, ControlReceiver
from h3serve.transport.frames import open_sink
from h3serve.transport.grpc import CHUNK_BYTES, GrpcStreamReceiver, iter_tensor_chunks
from h3serve.transport.nixl.probe import counters
from h3serve.weights.folder import CheckpointFolder

log = logging.getLogger("h3serve.vae")

LATENTS_SLOT_BYTES = 32 << 20   # one slot holds the full-size video latents (27.9 MB with the audio)


def _unwrap(msg):
    kind = msg.WhichOneof("input")
    return ("chunk", msg.chunk) if kind == "chunk" else ("end", msg.end) if kind == "end" else (kind, msg)


@dataclass(kw_only=True)
class LatentsSession(Session):
    """A Decode waiting for the DiT to deliver its latents over `Control` (dit->vae); a Control call claims it."""

    tensors: dict | None = None
    info: dict | None = None     # the stream's transport info


class VAEServicer(StageBase):
    stage = "vae"

    def __init__(self, config: StageConfig, health=None):
        super().__init__(config, health)
        self.video_vae = None
        self.audio_vae = None
        # the last stream of each edge (vae->muxer, dit->vae), for the Status details
        self.last_transport: dict | None = None
        self.last_latents_transport: dict | None = None
        self._warned: set[str] = set()   # frame-edge fallback reasons already logged
        # no TTL: a session lives as long as its Decode; claimed by one Control, unknown to any other
        self._latents: SessionTable[LatentsSession] = SessionTable("vae", noun="latents session", claim_hides=True)
        self.short_edge = cond.DEFAULT_REFERENCE_SHORT_EDGE

    def register(self, server) -> None:
        vae_pb2_grpc.add_VAEServicer_to_server(self, server)

    def load(self) -> None:
        self.choose_transport()
        self.executor.submit(self._load).result()

    def info(self) -> dict:
        return {**super().info(), "transport": self.transport.details(FRAMES_EDGE, self.last_transport),
                "latents_transport": self.transport.details(LATENTS_EDGE, self.last_latents_transport),
                "nixl": counters()}

    def _load(self) -> None:
        self.short_edge = cond.reference_short_edge(
            CheckpointFolder(self.config.model.checkpoint, components=[]).pipeline_config)
        device = pick_device(self.config.model.device)
        conflict = staging_conflict(self.config.levers, self.config.degrees.vae_pp)
        if conflict is not None:
            raise H3Error(conflict)
        if self.start_ranks() is not None:   # --vae-pp: tiles decoded on every rank, stitched here (rank 0)
            self.video_vae = VideoVAEProxy(self.parallel)
        else:
            self.video_vae = VideoVAE.load(self.config.model.checkpoint, dtype=TORCH_DTYPES[self.config.model.dtype],
                                           device=device, staged=self.config.levers.vae_staged)
        self.audio_vae = AudioVAE.load(self.config.model.checkpoint, dtype=torch.float32, device=device,
                                       staged=self.config.levers.vae_staged)
        if self.config.model.warmup:   # one window at the smallest size, and a short audio decode
            for clip in self.video_vae.iter_decode_float(torch.zeros(1, self.video_vae.latent_channels, 7, 2, 2)):
                self.check_finite(video=clip)
            self.check_finite(audio=self.audio_vae.decode(torch.zeros(2, self.audio_vae.latent_channels, 4)))

    @grpc_method("vae")
    def EncodeConditions(self, request_iterator, context):
        """fl2va keyframes / ref2va references -> the DiT's condition latents and audio rows, in order."""
        p = first_message(request_iterator, "params",
                          "the first message of an EncodeConditions stream carries the parameters").params
        kinds = cond.requested_kinds(p.kinds, p.task, "kinds")
        tensors = {m.header.name: m.tensor for m in GrpcStreamReceiver(request_iterator, _unwrap,
                                                                       edge="gateway->vae")}
        for i, kind in enumerate(kinds):
            t = tensors.get(f"condition.{i}")
            pcm, video = kind in cond.AUDIO_KINDS, kind == "video"
            ok = t is not None and (t.dtype == torch.float32 and t.ndim == 2 and t.shape[0] == 2 if pcm
                                    else t.dtype == torch.uint8 and t.ndim == 3 + video and t.shape[-1] == 3)
            if not ok:
                raise RequestError(f"condition.{i}", None if t is None else tuple(t.shape),
                                   "(2, N) float32 PCM" if pcm else "(F, H, W, 3) uint8 RGB" if video
                                   else "(H, W, 3) uint8 RGB")
        with self.request(context, p.request_id) as scope:
            t0 = time.perf_counter()
            encoded = self.run_engine(scope, lambda: self._encode_conditions(p, kinds, tensors))
            seconds = time.perf_counter() - t0
            for i, z in enumerate(encoded):
                for chunk in iter_tensor_chunks(f"condition.{i}", z.float().contiguous()):
                    yield vae_pb2.ConditionEvent(chunk=chunk)
            yield vae_pb2.ConditionEvent(done=vae_pb2.ConditionDone(seconds=seconds,
                                                                    peak_memory_mb=scope.peak_memory_mb))

    def _encode_conditions(self, p, kinds, tensors) -> list[torch.Tensor]:
        """On the engine thread: each image resized (models/conditions.py) and VAE-encoded, each reference video
        VAE-encoded, each PCM audio-VAE encoded; in the order of `kinds`."""
        visual = [i for i, k in enumerate(kinds) if k in cond.VISUAL_KINDS]
        images = cond.resize(kinds, [tensors[f"condition.{i}"].numpy() for i in visual], p.height, p.width,
                             self.short_edge)
        pcms = [tensors[f"condition.{i}"] for i, k in enumerate(kinds) if k in cond.AUDIO_KINDS]
        return cond.encode_conditions(kinds, images, pcms, self.video_vae, self.audio_vae)

    @grpc_method("vae")
    def Decode(self, request_iterator, context):
        p = first_message(request_iterator, "params",
                          "the first message of a Decode stream carries the parameters").params
        # the muxer sink is checked (--peers) before any work (the latents may take the DiT minutes)
        muxer = muxer_pb2_grpc.MuxerStub(self.channel(p.sink.address)) if p.sink.address else None
        latents_info = None
        with self.request(context, p.request_id) as scope:
            if p.latents_transport == NIXL:   # the DiT sends the latents to a session here over Control
                tensors, latents_info = yield from self._latents_session(scope, context)
            else:
                tensors = {m.header.name: m.tensor for m in GrpcStreamReceiver(request_iterator, _unwrap,
                                                                               edge="gateway->vae")}
            video, audio = tensors.get("video_latents"), tensors.get("audio_latents")
            if video is None or video.ndim != 5 or video.shape[0] != 1:
                raise RequestError("video_latents", None if video is None else tuple(video.shape),
                                   "(1, 24, T, h, w) float32")
            if audio is None or audio.ndim != 3:
                raise RequestError("audio_latents", None if audio is None else tuple(audio.shape), "(2, 32, A) float32")
            cv, ca = self.video_vae.latent_channels, self.audio_vae.latent_channels   # the loaded model's
            if video.shape[1] != cv or not video.is_floating_point() or min(video.shape[2:]) < 1:
                raise RequestError("video_latents", tuple(video.shape), f"(1, {cv}, T, h, w) float")
            if audio.shape[0] != 2 or audio.shape[1] != ca or audio.shape[2] < 1 or not audio.is_floating_point():
                raise RequestError("audio_latents", tuple(audio.shape), f"(2, {ca}, A) float")
            if not p.sink.address or not p.sink.session_id:
                raise RequestError("sink", p.sink.address, "a muxer address and session id")
            done = yield from self.engine_events(
                scope, lambda emit: self._decode(scope, p, muxer, video, audio, emit),
                lambda clip: vae_pb2.DecodeEvent(clip=clip))
            if latents_info is not None:
                done.latents_transport.CopyFrom(common_pb2.TransportInfo(**latents_info))
            done.peak_memory_mb = scope.peak_memory_mb   # known once the engine work has returned
            yield vae_pb2.DecodeEvent(done=done)

    def _latents_session(self, scope, context):
        """Open a latents session, announce it (DecodeEvent.latents), wait for the DiT's Control stream to deliver
        both tensors; returns (tensors, transport info of the dit->vae edge)."""
        session = self._latents.add(LatentsSession(id=uuid.uuid4().hex))

        def keep_waiting() -> bool:
            scope.check("while waiting for the latents")
            if not context.is_active():
                raise StageUnavailable("vae", "the Decode call ended while waiting for the latents")
            return True

        try:
            yield vae_pb2.DecodeEvent(latents=vae_pb2.LatentsSession(address=self.config.address,
                                                                     session_id=session.id))
            self._latents.wait(session, keep_waiting)
        finally:
            self._latents.pop(session.id)
        if session.error is not None:
            raise session.error
        return session.tensors, session.info

    @grpc_method("vae")
    def Control(self, request_iterator, context):
        """The control pipe of the latents edge: a NixlReceiver (copies out of its pool) gets "video_latents" and
        "audio_latents" for the session the DiT's first message names, and hands them to the waiting Decode."""
        first = first_message(request_iterator, "session_id",
                              "the first message of a Control stream names the latents session")
        session = self._latents.claim(self._latents.get(first.session_id))
        stream = ControlReceiver(LATENTS_EDGE, first.data, (m.data for m in request_iterator), context,
                                 transport=self.transport.chosen, pool_buffers=2, buffer_bytes=LATENTS_SLOT_BYTES)

        def receive():
            try:
                session.tensors = {m.header.name: m.tensor for m in stream.messages()}
                session.info = self.last_latents_transport = stream.info
            except BaseException as exc:  # noqa: BLE001 - handed to the Decode
                session.fail(exc if isinstance(exc, Exception) else StageUnavailable("vae", "interrupted"))
                raise session.error from None
            finally:
                session.done.set()

        yield from stream.serve(receive, lambda data: vae_pb2.LatentsControl(data=data))

    def _decode(self, scope, p, muxer, video, audio, emit):
        """On the engine thread: decode clip by clip into the muxer session; returns DecodeDone."""
        out = open_sink(muxer, p.sink, scope,
                        transport=self.transport.chosen, reason=self.transport.reason, warned=self._warned)
        ok = False
        try:
            plan = self.video_vae.plan_windows(int(video.shape[2]))
            clips = plan.num_windows + (1 if plan.overlap_frames else 0)
            frames_done = 0
            bytes_sent = 0
            # The soundtrack first (a small decode): the muxer interleaves each clip's frames with their audio as
            # they arrive, so its live fMP4 fragments are playable at once (the MP4's bytes do not depend on it).
            t1 = time.perf_counter()
            pcm = self.audio_vae.decode(audio.to(self.audio_vae.device)).float().cpu()   # (2, N) in [-1, 1]
            per = max(1, out.pcm_chunk_bytes // (pcm.shape[0] * pcm.element_size()))
            for s in range(0, pcm.shape[1], per):
                part = pcm[:, s:s + per].contiguous()
                out.send("pcm", part, scope)
                bytes_sent += part.numel() * part.element_size()
            audio_s = time.perf_counter() - t1
            t0 = time.perf_counter()
            scope.check("before clip 0")
            for index, (n, parts) in enumerate(self._clips(video, whole=out.whole_clips)):
                clip_bytes = 0
                for name, part in parts:
                    out.send(name, part, scope)
                    clip_bytes += part.numel()
                bytes_sent += clip_bytes
                scope.unit_done()
                emit(vae_pb2.ClipSent(index=index, first_frame=frames_done, frames=n, clips=clips, bytes=clip_bytes))
                frames_done += n
                scope.check(f"before clip {index + 1}")
            video_s = time.perf_counter() - t0
            if p.num_frames and frames_done != p.num_frames:
                raise RuntimeError(f"decoded {frames_done} frames, the request expects {p.num_frames}")
            tail_s = out.finish(scope)
            ok = True
            self.last_transport = dict(out.info)
            return vae_pb2.DecodeDone(frames=frames_done, pcm_samples=int(pcm.shape[1]), video_seconds=video_s,
                                      audio_seconds=audio_s, sink_tail_seconds=tail_s, bytes_sent=bytes_sent,
                                      transport=common_pb2.TransportInfo(**out.info))
        finally:
            if not ok:
                out.abort()

    def _clips(self, video, whole: bool = False):
        """(frames, [(tensor name, host tensor), ...]) per decoded clip, cut into messages of whole frames:
        "frames" (n, H, W, 3) uint8 RGB, or with frame_format yuv420p "y" (n, H, W), "u", "v" (n, H/2, W/2).
        `whole`: one message (one y/u/v triple) per clip instead of messages of <= 4 MiB."""
        latents = video.to(self.video_vae.device)
        if self.config.media.frame_format == "yuv420p":
            for (y, u, v), ready in self.video_vae.iter_decode_yuv420p(latents):
                if ready is not None:
                    ready.synchronize()
                n = int(y.shape[0])
                per = n if whole else max(1, CHUNK_BYTES // (y[0].numel()))
                parts = []
                for s in range(0, n, per):
                    parts += [("y", y[s:s + per]), ("u", u[s:s + per]), ("v", v[s:s + per])]
                yield n, parts
            return
        for clip in self.video_vae.iter_decode(latents):
            n = int(clip.shape[0])
            per = n if whole else max(1, CHUNK_BYTES // clip[0].numel())
            yield n, [("frames", clip[s:s + per] if whole else clip[s:s + per].cpu()) for s in range(0, n, per)]
