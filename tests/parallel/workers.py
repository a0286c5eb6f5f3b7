"""What every rank of a test stage builds (importable by the spawned ranks)."""

from __future__ import annotations

import torch

from h3serve.distributed.world import Runtime
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.models.dit.layout import build_t2va_layout, row_timesteps
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.sparse import SparseConfig, attach_sparse
from h3serve.models.dit.parallel import (USPGroups, USPPlan, parallelize_dit, ulysses_heads_to_rows,
                                         ulysses_rows_to_heads)

TINY_DIT = dict(num_attention_heads=4, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
                ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


def tiny_dit(seed: int = 0, **overrides):
    """A 4-head H3DiT with random weights, the same on every rank for a seed."""
    torch.manual_seed(seed)
    model = H3DiT(H3DiTConfig(**{**TINY_DIT, **overrides})).eval().requires_grad_(False)
    with torch.no_grad():  # the default init leaves the AdaLN / output projections near zero: make them matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def dit_inputs(text_len: int, frames: int, h: int, w: int, audio_latents: int, *, seed: int = 1,
               anchors=(), per_row_timesteps: bool = False):
    """(video_rows, audio_rows, text_states, timesteps, timestep_indices, layout) for one forward."""
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
    groups = {tuple(p): USPGroups.build(runtime, USPPlan(*p)) for p in plans}

    def forward(payload, local):
        plan, geometry, kwargs = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        model = parallelize_dit(tiny_dit(), g)
        with torch.no_grad():
            return model(*dit_inputs(*geometry, **kwargs))

    engines = {}

    def generate(payload, local):
        plan, req = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        if plan not in engines:
            engines[plan] = DiTEngine({"transformer": parallelize_dit(tiny_dit(), g)}, device=runtime.device,
                                      profile="base")
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

    def generate_adaln(payload, local):
        """The plan's engine with an AdaLN table in `directory` (every rank reads or writes the same file)."""
        plan, req, directory = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        engine = DiTEngine({"transformer": parallelize_dit(tiny_dit(), g)}, device=runtime.device, profile="base")
        table = engine.use_adaln_table(directory, steps=req.steps)["transformer"]
        return engine.generate(req), table.report()

    def generate_sparse(payload, local):
        """The plan's engine with block-sparse attention (each rank routes its own heads): result and report."""
        plan, req, config = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        model = tiny_dit()
        state = attach_sparse(model, config)
        res = DiTEngine({"transformer": parallelize_dit(model, g)}, device=runtime.device, profile="base").generate(req)
        return res, state.last

    def generate_lora(payload, local):
        """The plan's engine serving per-request LoRAs `entries` (every rank reads and checks the file itself)."""
        plan, req, entries = payload
        g = groups[tuple(plan)]
        if g is None:
            return None
        engine = DiTEngine({"transformer": parallelize_dit(tiny_dit(), g)}, device=runtime.device, profile="base")
        engine.use_loras(entries)
        return engine.generate(req)

    return {"forward": forward, "generate": generate, "generate_adaln": generate_adaln,
            "generate_sparse": generate_sparse, "generate_lora": generate_lora}


# ---------------------------------------------------------------------------------------------------------------------
# VAE patch parallel

VAE_TILE, VAE_OVERLAP = 128, 32  # smaller than the release's 256 / 64 so that a small frame has many tiles


def load_vae(checkpoint, tile=VAE_TILE, overlap=VAE_OVERLAP):
    from h3serve.models.vae.video import VideoVAE

    vae = VideoVAE.load(checkpoint)
    vae.tile, vae.min_overlap = tile, overlap
    return vae


def build_vae(runtime: Runtime, checkpoint, sizes):
    """Op `vae_decode` (payload: (pp, latents)) for each patch-parallel size in `sizes`."""
    from h3serve.models.vae.parallel import PatchParallelVAE

    vae = load_vae(checkpoint)
    groups = {pp: runtime.new_group(range(pp))[0] for pp in sizes}

    def decode(payload, local):
        pp, latents = payload
        if runtime.rank >= pp:
            return None
        return PatchParallelVAE(vae, groups[pp], runtime.rank, pp).decode_float(latents)

    return {"vae_decode": decode}


# ---------------------------------------------------------------------------------------------------------------------
# Encoder tensor parallel

QWEN_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                      "mrope_section": [2, 3, 3]})


def tiny_qwen_text(seed: int = 0):
    """An in-process Qwen3-VL text decoder with 4 heads / 2 KV heads (the tiny checkpoint has 2 / 1)."""
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    cfg = Qwen3VLTextConfig(**QWEN_TEXT)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3VLTextModel(cfg).eval().requires_grad_(False)


def qwen_text_states(model, seed: int = 3, length: int = 11):
    ids = torch.randint(0, QWEN_TEXT["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state


def build_encoder(runtime: Runtime, checkpoint, tp):
    """Ops `encode` (the tiny checkpoint's encoder, KV head replicated) and `qwen_text` (4 heads / 2 KV heads)."""
    from h3serve.models.encoder.model import TextEncoder
    from h3serve.models.encoder.parallel import parallelize_encoder, parallelize_text_decoder

    group = runtime.new_group(range(tp))[0]
    member = runtime.rank < tp
    encoder = TextEncoder.load(checkpoint, dtype=torch.float32) if member else None
    if member:
        parallelize_encoder(encoder, group, runtime.rank, tp)
    qwen = parallelize_text_decoder(tiny_qwen_text(), group, runtime.rank, tp) if member else None

    def encode(prompt, local):
        return encoder.encode(prompt).states if member else None

    def qwen_text(payload, local):
        return qwen_text_states(qwen) if member else None

    return {"encode": encode, "qwen_text": qwen_text}


def build_suite(runtime: Runtime, checkpoint, plans=(), vae_sizes=(), tp=None):
    """Everything one test stage offers: DiT plans, VAE patch-parallel sizes, encoder TP (optional)."""
    handlers = {}
    if plans:
        handlers.update(build_dit(runtime, plans))
    if vae_sizes:
        handlers.update(build_vae(runtime, checkpoint, vae_sizes))
    if tp:
        handlers.update(build_encoder(runtime, checkpoint, tp))
    return handlers


def dit_request(steps=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return DiTRequest(text_states=torch.randn(1, 7, 24, generator=g), text_tags=torch.ones(7, dtype=torch.long),
                      latent_frames=2, latent_h=4, latent_w=6, audio_latents=3, seed=seed, steps=steps)


def sparse_request(steps=6, seed=3):
    """A request long enough to route (219 rows: 14 blocks of 16)."""
    g = torch.Generator().manual_seed(seed)
    return DiTRequest(text_states=torch.randn(1, 7, 24, generator=g), text_tags=torch.ones(7, dtype=torch.long),
                      latent_frames=3, latent_h=16, latent_w=16, audio_latents=10, seed=seed, steps=steps)


SPARSE = SparseConfig(0.25, block=16, min_rows=0)


def build_subgroups(runtime: Runtime):
    """The group pattern of the embedded pipeline with ulysses 2 on 2 ranks: single-rank (non-member on the other
    rank) NCCL + gloo groups around a whole-world group, then collectives on each."""
    import torch.distributed as dist

    from h3serve.distributed.world import check_identical

    solo_a, _ = runtime.new_group([0])
    both, both_control = runtime.new_group(range(runtime.world_size))
    solo_b, _ = runtime.new_group([1])

    def reduce(payload, local):
        x = torch.full((4,), float(runtime.rank + 1), device=runtime.device)
        dist.all_reduce(x, group=both)
        for g in (solo_a, solo_b):
            if g is not None:  # a one-rank group: a no-op reduce, but the communicator must exist and work
                dist.all_reduce(x, group=g)
        check_identical(runtime, str(x.sum().item()), "reduced", control=both_control)
        return x.cpu()

    return {"reduce": reduce}


def build_exchange(runtime: Runtime):
    """The Ulysses exchange on its own: for batch sizes 1 and 2, every rank's heads view and the round trip."""
    u = runtime.world_size

    def exchange(payload, local):
        b, h, n, d = payload
        g = torch.Generator().manual_seed(3)
        full = [torch.randn(b, h, u * n, d, generator=g) for _ in range(3)]  # (B, H, N, D), the same on every rank
        mine = [x[:, :, runtime.rank * n:(runtime.rank + 1) * n] for x in full]  # this rank's rows
        # as the model hands them over: (B, H, n, D) views of (B, n, H, D) buffers
        mine = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in mine]
        heads = ulysses_rows_to_heads(mine, None, u)
        hu = h // u
        expect = [x[:, runtime.rank * hu:(runtime.rank + 1) * hu] for x in full]
        back = ulysses_heads_to_rows(heads[0], None, u)
        if not (all(torch.equal(a, e) for a, e in zip(heads, expect)) and torch.equal(back, mine[0])):
            raise ValueError(f"rank {runtime.rank}: the exchange moved the wrong rows or heads")  # reaches rank 0
        return True

    return {"exchange": exchange}


def build_fails_on_rank_1(runtime: Runtime):
    """Rank 1 fails at start-up, before the group every rank must create (rank 0 waits in its barrier)."""
    if runtime.rank == 1:
        raise RuntimeError("CUDA error: invalid device ordinal")
    runtime.new_group([0])
    return {}
