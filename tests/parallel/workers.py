"""What every rank of a test stage builds (importable by the spawned ranks)."""

from __future__ import annotations

import torch

from h3serve.distributed import Runtime

TINY_DIT = dict(num_attention_heads=4, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
                ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


def tiny_dit(seed: int = 0, **overrides):
    """A 4-head H3DiT with random weights, the same on every rank for a seed."""
    from h3serve.services.dit.model import H3DiT, H3DiTConfig

    torch.manual_seed(seed)
    model = H3DiT(H3DiTConfig(**{**TINY_DIT, **overrides})).eval().requires_grad_(False)
    with torch.no_grad():  # the default init leaves the AdaLN / output projections near zero: make them matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def dit_inputs(text_len: int, frames: int, h: int, w: int, audio_latents: int, *, seed: int = 1,
               anchors=(), per_row_timesteps: bool = False):
    """(video_rows, audio_rows, text_states, timesteps, timestep_indices, layout) for one forward."""
    from h3serve.services.dit.layout import build_t2va_layout, row_timesteps

    layout = build_t2va_layout(text_len, frames, h, w, audio_latents, anchors=tuple(anchors))
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, layout.num_video_rows, 96, generator=g)
    audio = torch.randn(1, layout.num_audio_rows, 32, generator=g)
    text = torch.randn(1, text_len, TINY_DIT["text_dim"], generator=g)
    timesteps, ti = row_timesteps(layout, 0.7, 0.4)
    if per_row_timesteps:  # segments not uniform in timestep: the model's per-row gather path
        ti = torch.randint(0, timesteps.shape[0], ti.shape, generator=g)
    return video, audio, text, timesteps, ti, layout


def build_dit(runtime: Runtime, plans):
    """Ops over tiny DiTs under each (ulysses, ring) plan in `plans`."""
    from h3serve.services.dit.engine import DiTEngine
    from h3serve.services.dit.parallel import USPDiT, USPGroups, USPPlan

    groups = {tuple(p): USPGroups.build(runtime, USPPlan(*p)) for p in plans}

    def forward(payload, local):
        plan, geometry, kwargs = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        model = USPDiT(tiny_dit(), g)
        with torch.no_grad():
            return model(*dit_inputs(*geometry, **kwargs))

    engines = {}

    def generate(payload, local):
        plan, req = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        if plan not in engines:
            engines[plan] = DiTEngine({"transformer": USPDiT(tiny_dit(), g)}, device=runtime.device, profile="base")
        should_stop = runtime.agreed_stop(local.should_stop if local else None, g.control)
        steps = []

        def on_step(done, total):
            steps.append(done)
            if local is not None and local.on_step is not None:
                local.on_step(done, total)

        try:
            return engines[plan].generate(req, on_step=on_step, should_stop=should_stop)
        finally:
            runtime.store.set(f"test/steps/{runtime.rank}", str(len(steps)))

    return {"forward": forward, "generate": generate}
