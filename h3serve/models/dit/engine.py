"""The DiT stage engine: one request's conditions + geometry + seed -> final video and audio latents.

Used in-process by the embedded pipeline and, behind a servicer, by the DiT service. It owns the model (loaded
once, the FastH3 adapter fused while the weights stream in), the noise draw order and the denoising loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from h3serve.config.levers import CLI_NAMES, REQUEST_NAMES, Levers, lever_conflict
from h3serve.config.lora import (
    FP8_REFUSAL,
    LORA_CACHE_BYTES,
    LORA_TASKS,
    REF2VA_REFUSAL,
    LoraEntry,
    find_lora,
    lora_steps,
)
from h3serve.config.request import DEFAULT_STEPS
from h3serve.config.vocab import COMPONENT_FOR_TASK, PROFILE_TASKS
from h3serve.errors import ProfileError, RequestError
from h3serve.models.dit.layout import (
    AudioRef,
    ImageRef,
    PackedLayout,
    build_ref2va_layout,
    build_t2va_layout,
    rows_to_audio,
    unpatchify,
)
from h3serve.models.dit.lora import LoraCache, applied
from h3serve.models.dit.loop import denoise, noise_condition_rows, prepare_noise
from h3serve.models.dit import kernels
from h3serve.models.dit.adaln import ADALN_WEIGHTS, AdaLNTable, attach_adaln_table, schedule_inputs
from h3serve.models.dit.model import FP32_MODULES, H3DiT
from h3serve.models.dit.quant import quantize_dit
from h3serve.models.dit.reuse import ReuseConfig, StepReuse
from h3serve.models.dit.sparse import SparseConfig, attach_sparse, density_of
from h3serve.models.dit.scheduler import FlowShifts, schedules_for
from h3serve.models.checkpoint import checked_folder, flow_shifts, transformer_config
from h3serve.models.offload import attach_offload
from h3serve.weights.adapter import Adapter
from h3serve.weights.load import load_module_weights

log = logging.getLogger("h3serve.dit")


@dataclass
class DiTRequest:
    """Everything the DiT needs for one request; tensors on any device (moved once).

    text_states (1, L, text_dim) and text_tags (L,) come from the encoder. condition_latents: visual conditions
    (normalized, each (1, 24, t_i, h_i, w_i)) in packed order - fl2va keyframes, or ref2va visual references.
    reference_audio_rows: ref2va clean audio rows (2*A_ref, 32) per audio reference, in request order.
    references: ref2va geometry in request order (ImageRef / AudioRef), matching the two lists above.
    """

    text_states: torch.Tensor
    text_tags: torch.Tensor
    latent_frames: int
    latent_h: int
    latent_w: int
    audio_latents: int
    seed: int
    task: str = "t2va"
    profile: str = "base"
    steps: int | None = DEFAULT_STEPS["base"]  # grid points; checked against the profile by `schedules_for`
    anchors: tuple[str, ...] = ()
    condition_latents: Sequence[torch.Tensor] = ()
    references: Sequence[ImageRef | AudioRef] = ()
    reference_audio_rows: Sequence[torch.Tensor] = ()
    quality: str = "lossless"  # "high": step reuse (models/dit/reuse.py); "lossless": every block of every step
    preview_every: int = 0  # on_preview after every k-th step (0: none)
    lora: str | None = None    # a deployment LoRA (`DiTEngine.use_loras`), applied to this request only
    lora_scale: float = 1.0


@dataclass
class DiTResult:
    video: torch.Tensor  # (1, 24, T, h, w) float32, normalized latents
    audio: torch.Tensor  # (2, 32, A) float32, normalized latents
    seconds: float = 0.0
    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)
    forwards_computed: int = 0  # steps whose whole block stack ran (= steps unless quality=high reused some)
    block_evaluations: int = 0


class DiTEngine:
    """One DiT partition (or two: t2va/fl2va and ref2va) on one device."""

    def __init__(self, models: dict[str, H3DiT], *, device: torch.device, profile: str,
                 reuse: ReuseConfig = ReuseConfig(), shifts: FlowShifts = FlowShifts()):
        self.models = models
        self.device = device
        self.profile = profile
        self.shifts = shifts  # the checkpoint's scheduler/ and audio_scheduler/ shifts
        self.reuse = reuse
        self.levers = Levers()
        self.adaln_tables: dict[str, AdaLNTable] = {}  # component -> its AdaLN table (`use_adaln_table`)
        self.loras: LoraCache | None = None  # the deployment's per-request LoRAs (`use_loras`)

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        *,
        components: Sequence[str] = ("transformer",),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        profile: str = "base",
        adapter: str | Path | None = None,
        adapter_sha256: str | None = None,
        levers: Levers = Levers(),
        offload: bool = True,
        adaln_dir: str | Path | None = None,
        adaln_steps: int | None = None,
        loras: Sequence[LoraEntry] = (),
        lora_cache_bytes: int = LORA_CACHE_BYTES,
    ) -> "DiTEngine":
        """Build each partition on the meta device and stream its weights in; the adapter file (profile fasth3,
        checked against its sha256) is fused tensor by tensor before the cast, i.e. before any later sharding sees
        the weights, and closed on every path. `levers`: FP8 linears are made here, FP8 attention is chosen here,
        block-sparse attention attached here, offload applied here unless `offload=False` (USP: after the cross-rank weight check, `apply_offload`).

        `levers.adaln_table`: the AdaLN projections' weights are read into host memory only and replaced by a table
        of their outputs for the profile's schedule (`adaln_steps` grid points; default the profile's), read from or
        written to `adaln_dir` (None: kept in memory only; `use_adaln_table`). Lossless for every request."""
        device = torch.device(device)
        conflict = lever_conflict(profile, levers, names=CLI_NAMES)
        if conflict is not None:
            raise ProfileError(conflict)
        levers.check()
        fused = Adapter.open(adapter, adapter_sha256) if profile == "fasth3" else None
        try:
            engine = cls._load(checkpoint, components, dtype, device, profile, fused, levers,
                               host=ADALN_WEIGHTS if levers.adaln_table else ())
        finally:
            if fused is not None:
                fused.close()
        if levers.adaln_table:
            engine.use_adaln_table(adaln_dir, steps=adaln_steps)
        if offload:
            engine.apply_offload(levers)
        if loras:
            engine.use_loras(loras, lora_cache_bytes)
        return engine

    def use_loras(self, entries: Sequence[LoraEntry], max_bytes: int = LORA_CACHE_BYTES) -> LoraCache:
        """Serve these per-request LoRAs (models/dit/lora.py): each file is checked now (sha256, keys, targets,
        levers), so a deployment listing a wrong one does not start; each is placed on the device on first use.
        Profile base only: FastH3's own adapter is fused into its weights."""
        if entries and self.profile == "fasth3":
            raise ProfileError("profile fasth3 serves its fused 4-step adapter only; per-request LoRA (--loras) is "
                               "for profile base")
        if entries and self.levers.fp8:
            raise ProfileError(FP8_REFUSAL)
        cache = LoraCache(entries, max_bytes, self.device)
        model = self.models.get("transformer")   # the partition LoRAs patch (LORA_TASKS)
        if model is not None:
            cache.verify(getattr(model, "model", model), adaln_table=bool(self.adaln_tables))
        self.loras = cache
        return cache

    def _lora_for(self, req: DiTRequest, model):
        """The request's LoRA (loaded or from the cache) and the steps it runs; (None, req.steps) without one."""
        if req.lora is None:
            return None, req.steps
        if req.task not in LORA_TASKS:
            raise RequestError("lora", req.lora, REF2VA_REFUSAL)
        if self.loras is None or not self.loras.entries:
            raise RequestError("lora", req.lora, "this DiT lists no LoRA adapters (the deployment's dit.loras / "
                                                 "--loras)")
        steps = lora_steps(find_lora(self.loras.entries, req.lora), req.steps, field="steps")
        return self.loras.get(req.lora, model, adaln_table=bool(self.adaln_tables)), steps

    @classmethod
    def _load(cls, checkpoint, components: Sequence[str], dtype: torch.dtype, device: torch.device, profile: str,
              adapter: Adapter | None, levers: Levers, host: Sequence[str] = ()) -> "DiTEngine":
        folder = checked_folder(checkpoint, components)  # refuses what we cannot serve, before any weight
        shifts = flow_shifts(folder)
        models = {}
        for component in components:
            config = transformer_config(folder, component)
            with torch.device("meta"):
                model = H3DiT(config)
            report = load_module_weights(
                model, folder, component, adapter=adapter if component == "transformer" else None,
                dtype=dtype, keep_fp32=FP32_MODULES, device=device, host=host,
            )
            model.init_buffers(device).eval().requires_grad_(False)
            log.info("%s: %s", component, report.summary())
            if levers.fp8:
                log.info("%s: %d linear layers in FP8", component, len(quantize_dit(model)))
            density = density_of(levers.sparse_attention)
            if density is not None:
                attach_sparse(model, SparseConfig(density))
                log.info("%s: block-sparse attention at %s%% density", component, levers.sparse_attention)
            models[component] = model
        if levers.fp8_attention:
            kernels.choose_attention(device, "fp8", "the fp8_attention lever is on")
        engine = cls(models, device=device, profile=profile, shifts=shifts)
        engine.levers = levers
        return engine

    def use_adaln_table(self, directory: str | Path | None, *, steps: int | None = None) -> dict[str, AdaLNTable]:
        """Replace every partition's AdaLN projections by a table of their outputs (models/dit/adaln.py) for this
        profile's schedule at `steps` grid points (default: the profile's) and the profile's tasks on the partition,
        read from `directory` when its file is there (refused if changed), else computed on this device and written
        there (None: computed, kept in memory only). A forward outside the table (another step count) is computed on first use, exactly. Call before
        `apply_offload`."""
        video, audio = schedules_for(self.profile, steps if steps is not None else DEFAULT_STEPS[self.profile],
                                     self.shifts)
        for component, model in self.models.items():
            inner = getattr(model, "model", model)
            tasks = [task for task in PROFILE_TASKS[self.profile] if COMPONENT_FOR_TASK[task] == component]
            table = attach_adaln_table(inner, directory, component, schedule_inputs(video, audio, tasks), self.device)
            self.adaln_tables[component] = table
            log.info("%s: AdaLN table %s", component, table.report())
        return self.adaln_tables

    def apply_offload(self, levers: Levers, group=None) -> None:
        """Layerwise offload of every partition's blocks (`levers.resident_blocks`; no-op when unset). `group`: the
        DiT ranks (allgather mode shards the host copies over them)."""
        if levers.resident_blocks is None:
            return
        for name, model in self.models.items():
            inner = getattr(model, "model", model)
            off = attach_offload(inner, levers.resident_blocks, self.device, mode=levers.offload_mode, group=group)
            log.info("%s: layerwise offload %s", name, off.report())

    def layout_for(self, req: DiTRequest) -> PackedLayout:
        text_len = int(req.text_states.shape[1])
        if req.task == "ref2va":
            return build_ref2va_layout(text_len, list(req.references), req.latent_frames, req.latent_h,
                                       req.latent_w, req.audio_latents, text_token_tags=req.text_tags)
        return build_t2va_layout(text_len, req.latent_frames, req.latent_h, req.latent_w, req.audio_latents,
                                 anchors=tuple(req.anchors), text_token_tags=req.text_tags)

    @torch.no_grad()
    def generate(
        self,
        req: DiTRequest,
        *,
        on_step: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_preview: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> DiTResult:
        if req.profile != self.profile:
            raise ProfileError(f"this DiT is loaded for profile={self.profile!r}, the request asks {req.profile!r}")
        component = COMPONENT_FOR_TASK[req.task]
        if component not in self.models:
            raise ProfileError(f"task={req.task!r} needs the {component}/ partition, which this DiT did not load")
        model = self.models[component]
        t0 = time.perf_counter()
        layout = self.layout_for(req)
        inner = getattr(model, "model", model)  # the H3DiT under a sequence-parallel wrapper
        lora, steps = self._lora_for(req, inner)
        video_schedule, audio_schedule = schedules_for(req.profile, steps, self.shifts)

        # Draw order is part of what a seed reproduces: each visual condition, then video noise, then audio noise.
        generator = torch.Generator("cpu").manual_seed(req.seed)
        config = getattr(model, "model", model).config  # the H3DiT's, under a sequence-parallel wrapper too
        condition_rows = noise_condition_rows(generator, list(req.condition_latents), device=self.device,
                                              latent_channels=config.in_channels)
        video_noise, audio_noise = prepare_noise(generator, req.latent_frames, req.latent_h, req.latent_w,
                                                 req.audio_latents, device=self.device,
                                                 latent_channels=config.in_channels,
                                                 audio_latent_channels=config.audio_in_channels)
        video_rows = torch.cat([condition_rows, video_noise])
        ref_audio = [r.to(self.device, torch.float32) for r in req.reference_audio_rows]
        audio_rows = torch.cat([*ref_audio, audio_noise]) if ref_audio else audio_noise

        step_times: list[float] = []
        last = [time.perf_counter()]

        def _on_step(done: int, total: int) -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now
            if on_step is not None:
                on_step(done, total)

        text_states = req.text_states.to(self.device, model.dtype)
        layers = inner.config.num_layers
        policy = None
        conflict = lever_conflict(req.profile, quality=req.quality, names=REQUEST_NAMES)
        if conflict is not None:
            raise ProfileError(conflict)
        if req.quality == "high":
            groups = getattr(model, "groups", None)  # every sequence-parallel rank must take the same decision
            policy = StepReuse(layers, self.reuse.fitted(layers), group=groups.data if groups is not None else None)
            policy.begin(video_schedule.num_steps)
            inner.step_policy = policy
        if inner.sparse is not None:
            inner.sparse.begin(video_schedule.num_steps)  # the router counts this request's steps
        try:
            on_x0 = None
            if on_preview is not None and req.preview_every > 0:
                def on_x0(done: int, rows: torch.Tensor) -> None:   # the estimate as (1, C, T, h, w) latents
                    on_preview(done, video_schedule.num_steps,
                               unpatchify(rows, req.latent_frames, req.latent_h, req.latent_w))
            with applied(inner, lora, req.lora_scale):
                video_out, audio_out = self._denoise(model, video_rows, audio_rows, text_states, layout,
                                                     video_schedule, audio_schedule, _on_step, should_stop, on_x0,
                                                     req.preview_every)
        finally:
            if policy is not None:
                inner.step_policy = None
                policy.end()
            if inner.sparse is not None:
                log.info("sparse attention: %s", inner.sparse.end())  # a forward outside a request runs dense
        n = video_schedule.num_steps
        computed = policy.forwards_computed if policy is not None else n
        evaluations = policy.block_evaluations if policy is not None else n * layers
        video = unpatchify(video_out[layout.num_condition_video_rows:], req.latent_frames, req.latent_h,
                           req.latent_w)
        audio = rows_to_audio(audio_out[layout.num_condition_audio_rows:])
        return DiTResult(video=video, audio=audio, seconds=time.perf_counter() - t0, steps=n,
                         step_seconds=step_times, forwards_computed=computed, block_evaluations=evaluations)

    @staticmethod
    def _denoise(model, video_rows, audio_rows, text_states, layout, video_schedule, audio_schedule, on_step,
                 should_stop, on_x0=None, x0_every=0):
        return denoise(
            model, video_rows=video_rows, audio_rows=audio_rows, text_states=text_states, layout=layout,
            video_schedule=video_schedule, audio_schedule=audio_schedule,
            num_condition_video_rows=layout.num_condition_video_rows,
            num_condition_audio_rows=layout.num_condition_audio_rows,
            on_step=on_step, should_stop=should_stop, on_x0=on_x0, x0_every=x0_every,
        )
