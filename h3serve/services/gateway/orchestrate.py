"""The request path: an admitted job run by a named plan over the stages (the `Gateway` that admits and runs it:
`gateway.py`).

Two plans; which one runs is chosen once per request from the deployment's transport (`choose_plan`):

    (fl2va / ref2va first: vae EncodeConditions ─► condition latents / audio rows kept here for the dit)
    relay   encoder ─► dit (latents back here) ─► muxer session ─► vae (latents sent from here) ─► fetch MP4
    direct  encoder ─► muxer session ─► vae announces a latents session ─► dit sends the latents there over
            VAE.Control (NIXL, or inline in that stream where NIXL cannot be used) ─► fetch the MP4

In both, frames go vae ─► muxer, never through here. Every stage call carries the request's remaining deadline;
cancelling a job cancels the call in flight, and the stage stops within one denoising step or one VAE clip. A stage
call that fails is turned into a domain error naming the stage (h3serve.errortable.from_grpc).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import grpc
import torch

from h3serve._proto import common_pb2, dit_pb2, encoder_pb2, gateway_pb2, muxer_pb2, muxer_pb2_grpc, vae_pb2
from h3serve.config.geometry import AUDIO_CHANNELS, SAMPLE_RATE
from h3serve.config.request import PCM_KINDS, dit_fields, lora_params
from h3serve.config.vocab import NIXL
from h3serve.errors import H3Error, StageFailed, StageUnavailable
from h3serve.errortable import from_grpc
from h3serve.transport.grpc import collect_tensors, iter_tensor_chunks

from .jobs import Job
from .metrics import GatewayMetrics
from .stages import EdgeTransports, StageClients

log = logging.getLogger("h3serve.gateway")

# progress percent: encoder done 5, DiT 5..85, VAE 85..97, MP4 fetched 100
P_ENCODER, P_DIT, P_VAE = 5.0, 80.0, 12.0
OPEN_SESSION_TIMEOUT_S = 30.0
ABORT_TIMEOUT_S = 2.0
SESSION_TTL_MARGIN_S = 60.0     # an unfetched muxer session outlives the request's deadline by this much

Tensors = dict[str, torch.Tensor]


@dataclass
class MuxSession:
    """An open muxer session: the replica that holds it, the sink the VAE writes into, the Decode writing it."""

    id: str
    muxer: muxer_pb2_grpc.MuxerStub   # of the replica that holds it
    sink: common_pb2.Sink
    decode: grpc.Call | None = None
    fetched: bool = False


@dataclass
class Decode:
    """A VAE Decode call and its responses (errors mapped to domain errors naming the VAE)."""

    call: grpc.Call
    events: Iterator


class StageCalls:
    """The stage calls a plan is made of, for one job: each records its timings and reports progress."""

    def __init__(self, job: Job, stages: StageClients, transports: EdgeTransports, metrics: GatewayMetrics,
                 transport: str):
        self.job = job
        self.stages = stages
        self.transports = transports
        self.metrics = metrics
        self.transport = transport      # the frame edge's (vae->muxer) requested transport
        self.t = job.timings
        self.t_latents: float | None = None   # the tail starts: last latent out of the DiT
        # A job of n outputs runs the plan once per output: the encoder's and the VAE's condition work once, the
        # DiT with seed + variant, the MP4 into that output's sink.
        self.variant = 0
        self.sink = job.sink
        self._conditions: list[torch.Tensor] | None = None
        self._text: Tensors | None = None

    @property
    def request(self):
        req = self.job.request
        return dataclasses.replace(req, seed=req.seed + self.variant) if self.variant else req

    def conditions(self) -> list[torch.Tensor]:
        """vae: the request's decoded keyframes / references -> condition latents and audio rows, in model order
        (nothing for t2va)."""
        job, req, conds = self.job, self.job.request, self.job.validated.conditions
        if conds is None:
            return []
        if self._conditions is not None:
            return self._conditions
        t0 = time.perf_counter()
        params = vae_pb2.ConditionParams(request_id=job.id, task=req.task, width=req.width, height=req.height,
                                         kinds=list(conds.kinds))
        inputs = itertools.chain(
            [vae_pb2.ConditionInput(params=params)],
            (vae_pb2.ConditionInput(chunk=c) for i, t in enumerate(conds.tensors)
             for c in iter_tensor_chunks(f"condition.{i}", t)),
            [vae_pb2.ConditionInput(end=common_pb2.StreamEnd(tensors=len(conds.tensors)))])
        chunks = []
        for ev in self._call("vae", lambda: self.stages.vae.EncodeConditions(inputs, timeout=job.remaining())):
            if ev.WhichOneof("event") == "chunk":
                chunks.append(ev.chunk)
            else:
                self._peak(ev.done.peak_memory_mb)
        encoded = collect_tensors(chunks, edge="vae->gateway")
        out = []
        for i in range(len(conds.kinds)):
            if f"condition.{i}" not in encoded:
                raise StageUnavailable("vae", f"the VAE returned no condition.{i}")
            out.append(encoded[f"condition.{i}"])
        self.t["conditions_s"] = time.perf_counter() - t0
        self._conditions = out
        return out

    def _encode_call(self):
        job, req, conds = self.job, self.job.request, self.job.validated.conditions
        if conds is None:
            return self.stages.encoder.Encode(
                encoder_pb2.EncodeRequest(request_id=job.id, prompt=req.prompt, task=req.task),
                timeout=job.remaining())
        params = encoder_pb2.EncodeParams(request_id=job.id, prompt=req.prompt, task=req.task, width=req.width,
                                          height=req.height, kinds=list(conds.kinds))
        visual = [(i, t) for i, (k, t) in enumerate(zip(conds.kinds, conds.tensors)) if k not in PCM_KINDS]
        inputs = itertools.chain(
            [encoder_pb2.EncodeInput(params=params)],
            (encoder_pb2.EncodeInput(chunk=c) for i, t in visual for c in iter_tensor_chunks(f"condition.{i}", t)),
            [encoder_pb2.EncodeInput(end=common_pb2.StreamEnd(tensors=len(visual)))])
        return self.stages.encoder.EncodeConditioned(inputs, timeout=job.remaining())

    def encode(self) -> Tensors:
        """encoder: prompt (+ keyframes / references) -> text states + tags."""
        if self._text is not None:
            return self._text
        t0 = time.perf_counter()
        chunks = []
        for ev in self._call("encoder", self._encode_call):
            kind = ev.WhichOneof("event")
            if kind == "chunk":
                chunks.append(ev.chunk)
            elif kind == "done":
                self._peak(ev.done.peak_memory_mb)
                self.metrics.encoder_cache.labels(result="hit" if ev.done.cache_hit else "miss").inc()
                self.t["encoder_cache_hit"] = float(ev.done.cache_hit)
        text = collect_tensors(chunks, edge="encoder->gateway")
        self.t["encoder_s"] = time.perf_counter() - t0
        self._progress("encoder", 1, 1, self.t["encoder_s"], P_ENCODER)
        self._text = text
        return text

    def denoise(self, text: Tensors, conditions: list[torch.Tensor] = (),
                latents_sink: common_pb2.Sink | None = None) -> Tensors | None:
        """dit: text (+ condition latents / audio rows) + geometry + seed -> latents, one progress event per step.
        The latents come back here, or go to `latents_sink` (a VAE latents session) when given; then this returns
        None."""
        job, req, conds = self.job, self.request, self.job.validated.conditions
        params = dit_pb2.DiTParams(
            request_id=job.id, latent_frames=req.latent_frames, latent_height=req.latent_height,
            latent_width=req.latent_width, audio_latents=req.audio_latents, latents_sink=latents_sink,
            condition_kinds=list(conds.kinds) if conds is not None else [], **dit_fields(req), **lora_params(req))
        inputs = itertools.chain(
            [dit_pb2.DiTInput(params=params)],
            (dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_states", text["text_states"])),
            (dit_pb2.DiTInput(chunk=c) for c in iter_tensor_chunks("text_tags", text["text_tags"])),
            (dit_pb2.DiTInput(chunk=c) for i, z in enumerate(conditions)
             for c in iter_tensor_chunks(f"condition.{i}", z)),
            [dit_pb2.DiTInput(end=common_pb2.StreamEnd(tensors=2 + len(conditions)))])
        t0 = time.perf_counter()
        chunks = []
        dit = self.stages.dits[req.profile]
        for ev in self._call("dit", lambda: dit.Generate(inputs, timeout=job.remaining())):
            kind = ev.WhichOneof("event")
            if kind == "progress":
                p = ev.progress
                self._progress("dit", p.done, p.total, p.elapsed_s, P_ENCODER + P_DIT * p.done / max(1, p.total),
                               p.preview_jpeg)
            elif kind == "chunk":
                chunks.append(ev.chunk)
                self.metrics.latents_relayed_bytes.inc(len(ev.chunk.data))
            elif kind == "done":
                self.t["dit_steps"] = float(ev.done.steps)
                self.t["dit_forwards_computed"] = float(ev.done.forwards_computed)   # < steps: quality=high reused
                self.t["dit_block_evaluations"] = float(ev.done.block_evaluations)
                self._peak(ev.done.peak_memory_mb)
                if ev.done.HasField("transport"):
                    self.transports.record(ev.done.transport)
        latents = None if latents_sink is not None else collect_tensors(chunks, edge="dit->gateway")
        self.t["dit_s"] = time.perf_counter() - t0
        self.t_latents = time.perf_counter()
        return latents

    @contextmanager
    def mux_session(self) -> Iterator[MuxSession]:
        """A muxer session for the MP4; unless its MP4 was fetched, leaving it cancels the Decode writing it and
        aborts it."""
        job, req = self.job, self.job.request
        try:
            opened = self.stages.muxer.OpenSession(muxer_pb2.OpenSessionRequest(
                request_id=job.id, width=req.width, height=req.height, fps=req.fps, sample_rate=SAMPLE_RATE,
                channels=AUDIO_CHANNELS, expected_frames=req.num_frames, transport=self.transport,
                ttl_s=max(SESSION_TTL_MARGIN_S, job.remaining() + SESSION_TTL_MARGIN_S)),
                timeout=min(OPEN_SESSION_TIMEOUT_S, job.remaining()))
        except grpc.RpcError as err:
            raise self._error("muxer", err) from None
        sink = common_pb2.Sink(address=self.stages.reachable("muxer", opened.address), session_id=opened.session_id,
                               transport=self.transport, transport_metadata=opened.transport_metadata)
        session = MuxSession(opened.session_id, self.stages.muxer_at(opened.address), sink)
        job.live = lambda: _muxer_stream(session, job)
        job.live_ready.set()
        try:
            yield session
        finally:
            job.live = None
            if not session.fetched:
                if session.decode is not None:
                    session.decode.cancel()
                try:
                    session.muxer.Abort(muxer_pb2.AbortRequest(session_id=session.id, reason="request failed"),
                                        timeout=ABORT_TIMEOUT_S)
                except grpc.RpcError:
                    pass

    def open_decode(self, session: MuxSession, latents: Tensors | None) -> Decode:
        """vae: open the Decode into the muxer session. With `latents` None the VAE waits for the DiT to send them
        (latents_transport nixl) and first announces where (`latents_session`)."""
        req = self.job.request
        params = vae_pb2.DecodeParams(request_id=self.job.id, sink=session.sink, num_frames=req.num_frames,
                                      width=req.width, height=req.height)
        if latents is None:
            params.latents_transport = NIXL
            inputs = iter([vae_pb2.DecodeInput(params=params),
                           vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=0))])
        else:
            inputs = itertools.chain(
                [vae_pb2.DecodeInput(params=params)],
                (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("video_latents", latents["video_latents"])),
                (vae_pb2.DecodeInput(chunk=c) for c in iter_tensor_chunks("audio_latents", latents["audio_latents"])),
                [vae_pb2.DecodeInput(end=common_pb2.StreamEnd(tensors=2))])
        call = self.stages.vae.Decode(inputs, timeout=self.job.remaining())
        session.decode = call
        return Decode(call, self._mapped("vae", call))

    def latents_session(self, decode: Decode) -> common_pb2.Sink:
        """Where the DiT sends the latents: the session the VAE's Decode announces first."""
        first = next(decode.events, None)
        if first is None or first.WhichOneof("event") != "latents":
            raise StageUnavailable("vae", "the VAE did not open a latents session")
        return common_pb2.Sink(address=self.stages.reachable("vae", first.latents.address),
                               session_id=first.latents.session_id, transport=NIXL)

    def decoded(self, decode: Decode) -> None:
        """vae: wait for the Decode to finish, one progress event per clip."""
        t0 = time.perf_counter()
        self.job.attach(decode.call)
        try:
            for ev in decode.events:
                kind = ev.WhichOneof("event")
                if kind == "clip":
                    c = ev.clip
                    self._progress("vae", c.index + 1, c.clips, time.perf_counter() - t0,
                                   P_ENCODER + P_DIT + P_VAE * (c.index + 1) / max(1, c.clips))
                elif kind == "done":
                    d = ev.done
                    self.t["vae_video_s"], self.t["vae_audio_s"] = d.video_seconds, d.audio_seconds
                    self.t["vae_s"] = d.video_seconds + d.audio_seconds
                    self.t["mux_tail_s"] = d.sink_tail_seconds
                    self.t["transfer_bytes"] = float(d.bytes_sent)
                    self._peak(d.peak_memory_mb)
                    if d.HasField("transport"):
                        self.transports.record(d.transport)
        finally:
            self.job.detach()
        self.t["vae_wall_s"] = time.perf_counter() - t0

    def fetch(self, session: MuxSession) -> None:
        """muxer: the MP4 into the job's sink, from the replica that holds the session."""
        job = self.job
        t0 = time.perf_counter()
        digest = hashlib.sha256()
        size = 0
        started, total = False, -1
        for chunk in self._call("muxer", lambda: session.muxer.Fetch(
                muxer_pb2.FetchRequest(session_id=session.id), timeout=job.remaining())):
            if not started:
                total = int(chunk.total_bytes)
                self.sink.begin(total)
                started = True
            digest.update(chunk.data)
            self.sink.write(int(chunk.offset), chunk.data)
            size += len(chunk.data)
        if size != total:   # never a short MP4 presented as done
            raise StageFailed("muxer", f"the MP4 fetched is {size} bytes, the muxer announced {total}")
        session.fetched = True
        self.t["fetch_s"] = time.perf_counter() - t0
        job.mp4_bytes, job.sha256 = size, digest.hexdigest()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _progress(self, stage: str, done: int, total: int, elapsed: float, percent: float,
                  preview: bytes = b"") -> None:
        self.job.stage, self.job.progress = stage, percent
        if preview:
            self.job.preview = preview
        self.job.emit(gateway_pb2.GenerateEvent(progress=common_pb2.Progress(
            stage=stage, done=done, total=total, elapsed_s=elapsed, percent=percent, preview_jpeg=preview)))

    def _peak(self, mb: float) -> None:
        """The request's peak_memory_mb: the largest of the stages' own peaks (each stage is its own process)."""
        if mb > 0:
            self.t["peak_memory_mb"] = max(self.t.get("peak_memory_mb", 0.0), float(mb))

    def _error(self, stage: str, err: grpc.RpcError) -> H3Error:
        return self.job.cancelled() if self.job.cancel_requested.is_set() else from_grpc(err, stage=stage)

    def _call(self, stage: str, start: Callable[[], Iterable]) -> Iterator:
        """Start and iterate a stage call attached to the job (so that cancel reaches it)."""
        self.job.check()
        try:
            call = start()
            self.job.attach(call)
            yield from call
        except grpc.RpcError as err:
            raise self._error(stage, err) from None
        finally:
            self.job.detach()

    def _mapped(self, stage: str, call: Iterable) -> Iterator:
        try:
            yield from call
        except grpc.RpcError as err:
            raise self._error(stage, err) from None


# -- the plans -----------------------------------------------------------------------------------------------

def relay(calls: StageCalls) -> None:
    """The latents come back from the DiT and the gateway sends them to the VAE in its Decode stream."""
    conditions = calls.conditions()
    text = calls.encode()
    latents = calls.denoise(text, conditions)
    with calls.mux_session() as session:
        decode = calls.open_decode(session, latents)
        calls.decoded(decode)
        calls.fetch(session)


def direct(calls: StageCalls) -> None:
    """The DiT sends the latents to the VAE over VAE.Control; the gateway relays no latent bytes."""
    conditions = calls.conditions()
    text = calls.encode()
    with calls.mux_session() as session:
        decode = calls.open_decode(session, None)
        calls.denoise(text, conditions, latents_sink=calls.latents_session(decode))
        calls.decoded(decode)
        calls.fetch(session)


@dataclass(frozen=True)
class Plan:
    name: str
    run: Callable[[StageCalls], None]


RELAY = Plan("relay", relay)
DIRECT = Plan("direct", direct)


def choose_plan(transport: str) -> Plan:
    """direct under --transport nixl (the DiT and the VAE then settle how the latents travel), else relay."""
    return DIRECT if transport == NIXL else RELAY


def _muxer_stream(session: MuxSession, job: Job) -> Iterator[bytes]:
    """The muxer session's live fMP4, chunk by chunk, until its end (errors mapped naming the muxer)."""
    try:
        for chunk in session.muxer.Stream(muxer_pb2.FetchRequest(session_id=session.id),
                                          timeout=job.remaining() + SESSION_TTL_MARGIN_S):
            if chunk.data:
                yield chunk.data
            if chunk.last:
                return
    except grpc.RpcError as err:
        raise from_grpc(err, stage="muxer") from None


LIVE_POLL_S = 0.1


def live_content(job: Job) -> Iterator[bytes] | None:
    """A job's live fMP4 (see the gateway's StreamContent): waits until its muxer session is open; None if the job
    finished first (or its session was fetched before the stream began): serve the finished MP4 then. The first
    chunk is read here, so an error before any byte is raised here (an answer, not a broken response)."""
    while not job.live_ready.wait(LIVE_POLL_S):
        if job.finished or time.monotonic() >= job.deadline:
            return None
    live = job.live
    if live is None:
        return None
    chunks = live()
    try:
        first = next(chunks, None)
    except H3Error:
        if job.finished or job.live is None:   # the session went (fetched or failed) before the stream began
            return None
        raise
    if first is None:
        return iter(())
    return itertools.chain([first], chunks)
