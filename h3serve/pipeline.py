"""The embedded pipeline: encoder -> DiT -> VAE -> muxer in one process, the same stage engines the services run.

    request ──► TextEncoder.encode ──► DiTEngine.generate ──► VideoVAE.iter_decode ──► Mp4Writer (own thread)
                 (+ keyframes / refs      (+ progress per step)    clip by clip ───────►  encodes while the
                  through the VAE encoder)                         AudioVAE.decode ───►  next clip decodes
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

from h3serve.config.levers import LeverError, Levers, check_combination, staging_conflict
from h3serve.config.lora import format_loras, parse_loras
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.geometry import SAMPLE_RATE
from h3serve.config.request import GenerationRequest, dit_fields, lora_params, media_source
from h3serve.config.vocab import COMPONENT_FOR_TASK, DEFAULT_DTYPE, PROFILES
from h3serve.distributed.proxies import DiTEngineProxy, EncoderProxy, VideoVAEProxy
from h3serve.distributed.world import launch
from h3serve.errors import CheckpointError, H3Error, ProfileError, RequestError
from h3serve.media.audio import read_audio_reference
from h3serve.media.mux import Mp4Writer
from h3serve.media.video import VideoOutOfBounds, has_audio, read_video_reference
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.models import conditions as cond
from h3serve.models.dit.parallel import build_dit_rank
from h3serve.models.encoder.model import TextEncoder
from h3serve.models.encoder.parallel import build_encoder_rank
from h3serve.models.vae.audio import AudioVAE
from h3serve.models.vae.parallel import build_vae_rank
from h3serve.models.vae.video import VideoVAE
from h3serve.runtime.device import TORCH_DTYPES, PeakMemory, pick_device, process_memory
from h3serve.weights.folder import CheckpointFolder

log = logging.getLogger("h3serve.pipeline")



@dataclass
class Latents:
    video: torch.Tensor  # (1, 24, T, h, w) float32, normalized
    audio: torch.Tensor  # (2, 32, A) float32, normalized
    timings: dict = field(default_factory=dict)


# x264 frame threads: fixed (the MP4 bytes depend on it), sized for a GPU host's cores; the 10 s 1344x768 clip's
# tail after the decode was measured with 16 (bench/RESULTS.md).
X264_THREADS = 16


@dataclass
class GenerationResult:
    path: Path
    num_frames: int
    size: str
    bytes: int
    timings: dict


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _MuxThread:
    """Runs the MP4 writer on its own thread so x264 encodes one clip while the VAE decodes the next."""

    def __init__(self, writer, depth: int = 2):
        self.writer = writer
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.busy = 0.0
        self.thread = threading.Thread(target=self._run, name="h3serve-mux", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain: the producer learns of the error on its next put
            kind, payload = item
            t0 = time.perf_counter()
            try:
                if kind == "frames":
                    planes, ready = payload  # yuv420p planes in pinned memory, ready once their copy is done
                    if ready is not None:
                        ready.synchronize()
                    self.writer.add_frames(planes)
                else:
                    self.writer.add_audio(payload)
            except BaseException as exc:  # noqa: BLE001 - reported to the producer
                self.error = exc
            self.busy += time.perf_counter() - t0

    def put(self, kind: str, payload) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((kind, payload))

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class Pipeline:
    """All stages of one replica in this process. Build with `Pipeline.load`."""

    def __init__(self, *, checkpoint: Path, profile: str, dtype: str, device: torch.device, encoder, dit,
                 video_vae, audio_vae, load_seconds: float, stage=None):
        self.checkpoint = checkpoint
        self.profile = profile
        self.dtype = dtype
        self.device = device
        self.encoder = encoder
        self.dit = dit
        self.video_vae = video_vae
        self.audio_vae = audio_vae
        self.load_seconds = load_seconds
        self.stage = stage  # the parallel ranks' StageHandle (None with all degrees 1)

    def close(self) -> None:
        """Stop the parallel ranks, if any (a no-op with all degrees 1)."""
        if self.stage is not None:
            self.stage.close()
            self.stage = None

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        *,
        profile: str = "base",
        adapter: str | None = None,
        adapter_sha256: str | None = None,
        dtype: str = DEFAULT_DTYPE,
        device: str | None = None,
        tasks: Sequence[str] = ("t2va",),
        encoder_tp: int = 1,
        ulysses: int = 1,
        ring: int = 1,
        vae_pp: int = 1,
        levers: Levers = Levers(),
        loras: str | None = None,
    ) -> "Pipeline":
        """`levers` (config/levers.py, all off by default): DiT offload and FP8, the text decoder's offload (and FP8
        with `levers.fp8`), VAE staging; checked here as the CLI checks them. `loras`: the LoRA adapters a request
        may name (`lora`), NAME=PATH@SHA256[@STEPS] comma separated as `--loras` (profile base)."""
        t0 = time.perf_counter()
        if dtype not in TORCH_DTYPES:
            raise H3Error(f"dtype={dtype!r} is invalid: one of {', '.join(TORCH_DTYPES)}")
        if profile not in PROFILES:
            raise ProfileError(f"profile={profile!r} is invalid: base or fasth3")
        if profile == "fasth3":
            if not adapter or not adapter_sha256:
                raise ProfileError("profile=fasth3 needs the FastH3 adapter file and its sha256")
            if set(tasks) - {"t2va"}:
                raise ProfileError(f"profile=fasth3 serves t2va only, not {sorted(set(tasks) - {'t2va'})}")
        elif adapter:
            raise ProfileError("an adapter is only fused for profile=fasth3 (a per-request LoRA is listed in loras)")
        if loras and profile == "fasth3":
            raise ProfileError("loras: per-request LoRA is profile base's (fasth3 runs its own fused adapter)")
        lora_entries = parse_loras(loras)   # a mistake names the entry, before any weight is read
        levers.check()
        check_combination(profile, levers)
        if staging_conflict(levers, vae_pp) is not None:
            raise LeverError("--vae-staged", staging_conflict(levers, vae_pp))
        root = Path(checkpoint)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint folder {root} does not exist")
        folder = CheckpointFolder(root)  # fails early, naming what is missing
        dev = pick_device(device)
        torch_dtype = TORCH_DTYPES[dtype]
        components = sorted({COMPONENT_FOR_TASK[t] for t in tasks})
        degrees = ParallelDegrees(encoder_tp=encoder_tp, ulysses=ulysses, ring=ring, vae_pp=vae_pp)
        if not degrees.trivial:
            text = folder.config("text_encoder").get("text_config", {})
            degrees.validate(dit_heads=int(folder.config("transformer")["num_attention_heads"]),
                             encoder_heads=int(text["num_attention_heads"]),
                             encoder_kv_heads=int(text["num_key_value_heads"]),
                             encoder_intermediate=int(text["intermediate_size"]))
            # This process is rank 0; ranks 1..N-1 are spawned, and every rank loads its own part (_replica_rank).
            handle = launch(degrees.world_size, _replica_rank, (str(root), torch_dtype, components, profile, adapter,
                            adapter_sha256, degrees, levers, format_loras(lora_entries)), device=dev.type)
            try:
                audio_vae = AudioVAE.load(root, dtype=torch.float32, device=handle.runtime.device,  # rank 0 only
                                          staged=levers.vae_staged)
            except BaseException:
                handle.close()
                raise
            return cls(checkpoint=root, profile=profile, dtype=dtype, device=handle.runtime.device,
                       encoder=EncoderProxy(handle), dit=DiTEngineProxy(handle), video_vae=VideoVAEProxy(handle),
                       audio_vae=audio_vae, load_seconds=time.perf_counter() - t0, stage=handle)

        dit = DiTEngine.load(root, components=components, dtype=torch_dtype, device=dev, profile=profile,
                             adapter=adapter, adapter_sha256=adapter_sha256, levers=levers, loras=lora_entries)
        encoder = TextEncoder.load_with_levers(root, dtype=torch_dtype, device=dev, fp8=levers.fp8,
                                               resident_layers=levers.encoder_resident_layers)
        video_vae = VideoVAE.load(root, dtype=torch_dtype, device=dev, staged=levers.vae_staged)
        audio_vae = AudioVAE.load(root, dtype=torch.float32, device=dev, staged=levers.vae_staged)
        _sync(dev)
        return cls(checkpoint=root, profile=profile, dtype=dtype, device=dev, encoder=encoder, dit=dit,
                   video_vae=video_vae, audio_vae=audio_vae, load_seconds=time.perf_counter() - t0)

    @property
    def reference_short_edge(self) -> int:
        """ref2va image references are encoded at this short edge (the checkpoint's pipeline config; 2048 released)."""
        return cond.reference_short_edge(CheckpointFolder(self.checkpoint, components=[]).pipeline_config)

    # -- stages -------------------------------------------------------------------------------------------------

    def _conditions(self, req: GenerationRequest):
        """Encoder inputs and DiT conditions for fl2va / ref2va (models/conditions.py: resized, VAE-encoded)."""
        kinds, visual, pcms = [], [], []
        if req.task == "fl2va":
            for kind, source in (("first", req.first_image), ("last", req.last_image)):
                if source:
                    kinds.append(kind)
                    visual.append(Image.open(media_source(source)).convert("RGB"))
        elif req.task == "ref2va":
            max_samples = int(req.num_frames / req.fps * SAMPLE_RATE)  # as the reference truncates
            for i, spec in enumerate(req.references):
                if spec.kind == "image":
                    visual.append(Image.open(media_source(spec.path)).convert("RGB"))
                elif spec.kind == "audio":
                    pcms.append(read_audio_reference(media_source(spec.path), max_samples, SAMPLE_RATE))
                else:   # a video: its soundtrack (if any) first, as the model packs it
                    if has_audio(media_source(spec.path)):
                        pcms.append(read_audio_reference(media_source(spec.path), max_samples, SAMPLE_RATE))
                        kinds.append("soundtrack")
                    try:
                        visual.append(read_video_reference(media_source(spec.path), req.num_frames, fps=spec.fps))
                    except VideoOutOfBounds as exc:
                        raise RequestError(f"references[{i}]", f"{spec.path}: {exc.what} {exc.value}",
                                           exc.allowed) from None
                kinds.append(spec.kind)
        # the checkpoint's short edge is read only when an image reference is resized to it
        short_edge = self.reference_short_edge if "image" in kinds else cond.DEFAULT_REFERENCE_SHORT_EDGE
        resized = cond.resize(kinds, visual, req.height, req.width, short_edge)
        images, refs = cond.encoder_inputs(kinds, resized, req.task)
        encoded = cond.encode_conditions(kinds, resized, pcms, self.video_vae, self.audio_vae)
        return images, refs, cond.dit_conditions(kinds, encoded, req.task)

    def generate_latents(self, req: GenerationRequest, *, progress: bool | Callable[[int, int], None] = False,
                         should_stop: Callable[[], bool] | None = None) -> Latents:
        if req.profile != self.profile:
            raise ProfileError(f"this pipeline is loaded for profile={self.profile!r}, the request asks "
                               f"{req.profile!r}")
        timings = {}
        t0 = time.perf_counter()
        images, refs, c = self._conditions(req)
        encoded = self.encoder.encode(req.prompt, images=images, task=req.task, references=refs)
        _sync(self.device)
        timings["encoder_s"] = time.perf_counter() - t0

        bar = None
        if progress is True:
            bar = tqdm(total=req.num_forwards, desc="denoise", unit="step", leave=False)
            on_step = lambda done, total: bar.update(1)  # noqa: E731
        else:
            on_step = progress or None
        t1 = time.perf_counter()
        try:
            result = self.dit.generate(
                DiTRequest(
                    text_states=encoded.states, text_tags=encoded.tags, latent_frames=req.latent_frames,
                    latent_h=req.latent_height, latent_w=req.latent_width, audio_latents=req.audio_latents,
                    anchors=c.anchors, condition_latents=c.condition_latents, references=c.references,
                    reference_audio_rows=c.reference_audio_rows, **dit_fields(req), **lora_params(req),
                ),
                on_step=on_step, should_stop=should_stop,
            )
        finally:
            if bar is not None:
                bar.close()
        timings["dit_s"] = time.perf_counter() - t1
        timings["dit_steps"] = result.steps
        timings["dit_forwards_computed"] = result.forwards_computed  # < steps when quality=high reused some
        return Latents(video=result.video, audio=result.audio, timings=timings)

    def decode_video_float(self, video: torch.Tensor) -> torch.Tensor:
        """(1, 24, T, h, w) -> (F, H, W, 3) float32 in [0, 1] on the CPU (conformance path)."""
        return self.video_vae.decode_float(video.to(self.device)).float().cpu()

    def decode_audio(self, audio: torch.Tensor) -> torch.Tensor:
        """(2, 32, A) -> (2, A*800) float32 PCM in [-1, 1] on the CPU."""
        return self.audio_vae.decode(audio.to(self.device)).float().cpu()

    def write_mp4(self, req: GenerationRequest, latents: Latents, out_path: str | Path) -> dict:
        """Decode clip by clip into the MP4 writer (encoding overlaps decoding); audio first (it is short and then
        encodes while the video decodes; the file does not depend on the order). Returns timings."""
        t0 = time.perf_counter()
        timings = {}
        frames = 0
        with Mp4Writer(out_path, req.width, req.height, fps=req.fps, sample_rate=SAMPLE_RATE,
                       threads=X264_THREADS) as writer:
            mux = _MuxThread(writer)
            try:
                pcm = self.decode_audio(latents.audio)
                timings["vae_audio_s"] = time.perf_counter() - t0
                mux.put("audio", pcm.numpy())
                t1 = time.perf_counter()
                # uint8 + yuv420p on the device, pinned asynchronous copies; the mux thread waits on each clip's event
                for planes, ready in self.video_vae.iter_decode_yuv420p(latents.video.to(self.device)):
                    frames += int(planes[0].shape[0])
                    mux.put("frames", (planes, ready))
                _sync(self.device)
                timings["vae_video_s"] = time.perf_counter() - t1
                t2 = time.perf_counter()
            finally:
                mux.finish()
            stats = writer.close()
        if frames != req.num_frames:
            raise H3Error(f"internal: decoded {frames} frames, expected {req.num_frames}")
        timings["mux_tail_s"] = time.perf_counter() - t2  # encoding left after the last decode
        timings["mux_busy_s"] = mux.busy
        timings["vae_s"] = timings["vae_video_s"] + timings["vae_audio_s"]
        timings["pcm_samples"] = int(pcm.shape[-1])
        timings["mp4_bytes"] = int(getattr(stats, "bytes", 0) or Path(out_path).stat().st_size)
        return timings

    def generate(self, req: GenerationRequest, out_path: str | Path, *,
                 progress: bool | Callable[[int, int], None] = False,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        t0 = time.perf_counter()
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with PeakMemory(self.device) as peak:   # this process (rank 0 under parallel degrees)
            latents = self.generate_latents(req, progress=progress, should_stop=should_stop)
            tail = self.write_mp4(req, latents, out_path)
        t_client = time.perf_counter() - t0
        t_video = req.num_frames / req.fps
        t_audio = tail.pop("pcm_samples") / SAMPLE_RATE
        t_media = max(t_video, t_audio)
        timings = {**latents.timings, **tail, "t_client": t_client, "t_media": t_media,
                   "rtf_client": t_client / t_media, "peak_memory_mb": peak.mb}
        size = out_path.stat().st_size
        return GenerationResult(path=out_path, num_frames=req.num_frames, size=f"{req.width}x{req.height}",
                                bytes=size, timings=timings)


# -- parallel degrees: what every rank builds ------------------------------------------------------------------------


def _replica_rank(runtime, checkpoint: str, dtype: torch.dtype, components: Sequence[str], profile: str,
                  adapter: str | None, adapter_sha256: str | None, degrees: ParallelDegrees,
                  levers: Levers = Levers(), loras: str | None = None) -> dict:
    """Every rank: the groups of the three models first (in the same order on every rank), then its part of each
    (DiT under USP, encoder shard, VAE tiles); returns the ops rank 0's stand-ins call, and "memory"."""
    encoder = build_encoder_rank(runtime, checkpoint=checkpoint, dtype=dtype, tp=degrees.encoder_tp, fp8=levers.fp8,
                                 resident_layers=levers.encoder_resident_layers)
    dit = build_dit_rank(runtime, checkpoint=checkpoint, dtype=dtype, components=components, profile=profile,
                         adapter=adapter, adapter_sha256=adapter_sha256, ulysses=degrees.ulysses, ring=degrees.ring,
                         levers=levers, loras=loras)
    vae = build_vae_rank(runtime, checkpoint=checkpoint, dtype=dtype, pp=degrees.vae_pp, staged=levers.vae_staged)

    def memory(payload, local):
        """Every rank's `process_memory` (read-only), gathered on the control group; rank 0 gets the list by rank."""
        stats: list = [None] * runtime.world_size
        dist.all_gather_object(stats, {"rank": runtime.rank, **process_memory(runtime.device)}, group=runtime.control)
        return stats

    return {**dit(), **encoder(), **vae(), "memory": memory}
