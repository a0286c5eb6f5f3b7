"""Our H3 DiT and denoising loop against diffusers' MiniMaxH3Transformer3DModel and its modular denoise blocks."""

from __future__ import annotations

import json

import pytest
import torch

from h3serve.errors import Cancelled, H3Error
from h3serve.testing.presets import FULL_TRANSFORMER, TINY_TRANSFORMER
from h3serve.models.dit import layout as L
from h3serve.models.dit import model as M
from h3serve.models.dit.loop import denoise, noise_condition_rows, prepare_noise
from h3serve.models.dit.model import FP32_MODULES, H3DiT, H3DiTConfig
from h3serve.config.request import FASTH3_STEPS
from h3serve.models.dit.scheduler import FlowSchedule, fasth3_grid, schedules_for

diffusers = pytest.importorskip("diffusers")
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel  # noqa: E402

# Deliberately odd: 3 heads, head_dim 16 with 12 rotated channels, width 40 != heads*head_dim, one refiner layer.
ODD = dict(
    num_attention_heads=3, attention_head_dim=16, hidden_size=40, num_layers=2, num_refiner_layers=1, ffn_dim=72,
    in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=24, freq_dim=16, time_embed_hidden_dim=32,
    time_embed_dim=20, rope_freq_dim=2, rope_theta=10000.0,
)
TEXT_LEN = 7
TEXT_TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1])  # a 3-token vision block inside the text is tagged video
T, H, W, A = 3, 4, 6, 5  # 3 latent frames of a 2x3 patch grid, 5 audio latents per channel
VIDEO_T, AUDIO_T = 0.0271674, 0.1004804  # FastH3 step 1 (video / audio)


def _perturbed_reference(cfg: dict, seed: int = 1) -> MiniMaxH3Transformer3DModel:
    torch.manual_seed(0)
    ref = MiniMaxH3Transformer3DModel(**cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return ref


@pytest.fixture(scope="module")
def ref_model():
    return _perturbed_reference(ODD)


@pytest.fixture(scope="module")
def our_model(ref_model):
    ours = H3DiT(H3DiTConfig.from_dict(dict(ref_model.config))).eval()
    ours.load_state_dict(ref_model.state_dict(), strict=True)
    return ours


LAYOUTS = {
    "t2va": lambda: L.build_t2va_layout(TEXT_LEN, T, H, W, A, text_token_tags=TEXT_TAGS),
    "fl2va_first": lambda: L.build_t2va_layout(TEXT_LEN, T, H, W, A, ("first",), text_token_tags=TEXT_TAGS),
    "fl2va_last": lambda: L.build_t2va_layout(TEXT_LEN, T, H, W, A, ("last",), text_token_tags=TEXT_TAGS),
    "fl2va_first_last": lambda: L.build_t2va_layout(TEXT_LEN, T, H, W, A, ("first", "last"), text_token_tags=TEXT_TAGS),
    "ref2va_image_audio": lambda: L.build_ref2va_layout(
        TEXT_LEN, [L.ImageRef(2, 4), L.AudioRef(3)], T, H, W, A, text_token_tags=TEXT_TAGS
    ),
    "ref2va_mixed": lambda: L.build_ref2va_layout(
        TEXT_LEN, [L.VideoRef(2, 4, 2, audio_latents=4), L.ImageRef(6, 2), L.AudioRef(2), L.VideoRef(1, 2, 2)],
        T, H, W, A, text_token_tags=TEXT_TAGS,
    ),
}


def _inputs(layout: L.PackedLayout, batch: int = 1, seed: int = 2, text_dim: int = 24):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, layout.num_video_rows, 96, generator=g)
    a = torch.randn(batch, layout.num_audio_rows, 32, generator=g)
    txt = torch.randn(batch, layout.text_len, text_dim, generator=g)
    return v, a, txt


def _ref_forward(ref, v, a, txt, timesteps, indices, layout):
    return ref(
        v, a, txt, timesteps, indices, layout.token_tags, layout.position_ids, layout.video_indices,
        layout.audio_indices, layout.text_indices, return_dict=False,
    )


# -- weights -------------------------------------------------------------------------------------------------------


def test_state_dict_keys_shapes_and_order_match_diffusers(ref_model, our_model):
    ref_sd, our_sd = ref_model.state_dict(), our_model.state_dict()
    assert list(our_sd) == list(ref_sd)
    assert {k: tuple(v.shape) for k, v in our_sd.items()} == {k: tuple(v.shape) for k, v in ref_sd.items()}
    for key in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.1.attn.to_out.0.weight",
                "transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.0.ff.net.2.weight",
                "transformer_blocks.0.adaln_proj.linear.bias", "token_refiner.refiner_blocks.0.attn.norm_q.weight",
                "token_refiner.final_norm.weight", "norm_out.linear.weight", "norm_out.norm.weight",
                "time_embedder.linear_2.weight", "audio_proj_out.bias"):
        assert key in our_sd
    assert "rope.inv_freq" not in our_sd and "rope.inv_freq" in dict(our_model.named_buffers())
    assert torch.equal(our_model.rope.inv_freq, ref_model.rope.inv_freq)


def test_full_geometry_on_meta_matches_diffusers():
    with torch.device("meta"):
        ref = MiniMaxH3Transformer3DModel(**FULL_TRANSFORMER)
        ours = H3DiT(H3DiTConfig(**FULL_TRANSFORMER))
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == 33_122_992_896  # H3_REFERENCE §1.2
    fp32_params = sum(v.numel() for k, v in ours.state_dict().items() if H3DiT.is_fp32_param(k))
    assert fp32_params == 17_222_144 and sum(H3DiT.is_fp32_param(k) for k in shapes) == 12  # §1.1


def test_meta_construction_then_assign_load_runs(ref_model):
    with torch.device("meta"):
        ours = H3DiT(H3DiTConfig.from_dict(dict(ref_model.config)))
    ours.load_state_dict(ref_model.state_dict(), strict=True, assign=True)
    ours.eval()
    assert ours.rope.inv_freq.is_meta  # non-persistent: not loaded, recomputed on use
    layout = LAYOUTS["t2va"]()
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    with torch.no_grad():
        ov, oa = ours(v, a, txt, u, ti, layout)
        rv, ra = _ref_forward(ref_model, v, a, txt, u, ti, layout)
    assert (ov - rv).abs().max() <= 1e-5 and (oa - ra).abs().max() <= 1e-5
    ours.init_buffers()
    assert torch.equal(ours.rope.inv_freq, ref_model.rope.inv_freq)


def test_config_from_json_ignores_diffusers_bookkeeping(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", "_diffusers_version": "0.42.1",
                                **{**TINY_TRANSFORMER, "patch_size": [1, 2, 2]}}))
    cfg = H3DiTConfig.from_json(path)
    assert cfg == H3DiTConfig(**TINY_TRANSFORMER) and cfg.patch_size == (1, 2, 2)
    with pytest.raises(ValueError, match="unknown"):
        H3DiTConfig.from_dict({"num_layers": 2, "bogus": 1})


# -- fp32 forward vs diffusers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_matches_diffusers(ref_model, our_model, name):
    layout = LAYOUTS[name]()
    batch = 2 if name == "fl2va_first_last" else 1  # the batch axis is pure replication of the structure
    v, a, txt = _inputs(layout, batch)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    expected_nt = {"t2va": 2, "fl2va_first": 3, "fl2va_last": 3, "fl2va_first_last": 3,
                   "ref2va_image_audio": 4, "ref2va_mixed": 4}[name]
    assert u.numel() == expected_nt
    plan = our_model.plan_rows(ti, layout)
    assert plan.runs is not None  # segment path, no gathers
    with torch.no_grad():
        ov, oa = our_model(v, a, txt, u, ti, layout)
        rv, ra = _ref_forward(ref_model, v, a, txt, u, ti, layout)
    assert ov.shape == rv.shape and oa.shape == ra.shape and ov.dtype == torch.float32
    assert (ov - rv).abs().max().item() <= 1e-5
    assert (oa - ra).abs().max().item() <= 1e-5
    assert rv.abs().max() > 0.1  # non-trivial outputs


def test_gather_fallback_for_non_uniform_rows(ref_model, our_model, monkeypatch):
    layout = LAYOUTS["ref2va_image_audio"]()
    v, a, txt = _inputs(layout)
    u = torch.tensor([0.1, 0.4, 0.999, 1.0])
    ti = torch.randint(0, 4, (layout.seq_len,), generator=torch.Generator().manual_seed(5))
    assert our_model.plan_rows(ti, layout).runs is None
    with torch.no_grad():
        ov, oa = our_model(v, a, txt, u, ti, layout)
        rv, ra = _ref_forward(ref_model, v, a, txt, u, ti, layout)
        assert (ov - rv).abs().max() <= 1e-5 and (oa - ra).abs().max() <= 1e-5
        # uniform rows but too many runs for the loop: the gather path must give the same answer
        u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
        monkeypatch.setattr(M, "MAX_MODULATION_RUNS", 1)
        assert our_model.plan_rows(ti, layout).runs is None
        gv, ga = our_model(v, a, txt, u, ti, layout)
        rv, ra = _ref_forward(ref_model, v, a, txt, u, ti, layout)
    assert (gv - rv).abs().max() <= 1e-5 and (ga - ra).abs().max() <= 1e-5


def test_heads_run_only_on_their_rows_and_attention_is_replaceable(our_model):
    layout = LAYOUTS["fl2va_first_last"]()
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    seen = {}
    hooks = [our_model.proj_out.register_forward_hook(lambda m, i, o: seen.__setitem__("video", i[0].shape[1])),
             our_model.audio_proj_out.register_forward_hook(lambda m, i, o: seen.__setitem__("audio", i[0].shape[1]))]
    calls = []

    def counting_sdpa(q, k, v):
        calls.append(q.shape)
        return M.sdpa_attention(q, k, v)

    try:
        with torch.no_grad():
            base = our_model(v, a, txt, u, ti, layout)
            for block in our_model.transformer_blocks:
                block.attn.attention_fn = counting_sdpa
            swapped = our_model(v, a, txt, u, ti, layout)
    finally:
        for h in hooks:
            h.remove()
        for block in our_model.transformer_blocks:
            block.attn.attention_fn = M.sdpa_attention
    assert seen == {"video": layout.num_video_rows, "audio": layout.num_audio_rows}
    assert len(calls) == ODD["num_layers"] and calls[0] == (1, 3, layout.seq_len, 16)  # (B, H, N, Dh)
    assert torch.equal(base[0], swapped[0]) and torch.equal(base[1], swapped[1])


def test_block_context_shard_matches_full_sequence(our_model):
    """A sequence shard's blocks see exactly the rows of the full context (what a sequence-parallel plan relies on)."""
    layout = LAYOUTS["ref2va_image_audio"]()
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    with torch.no_grad():
        x, ctx, _ = our_model.embed(v, a, txt, u, ti, layout)
        d = x.shape[-1]
        shift, scale1 = torch.randn(12, d), torch.randn(12, d)
        full = M._modulate_(x.clone(), shift, scale1, ctx)
        start, stop = 5, 23
        part = M._modulate_(x[:, start:stop].clone(), shift, scale1, ctx.shard(start, stop))
        gathered = M._modulate_(x.clone(), shift, scale1, M.BlockContext(
            ctx.temb_act, ctx.cos, ctx.sin, None, (ti * 3 + layout.token_tags)))
    assert torch.equal(part, full[:, start:stop]) and torch.equal(full, gathered)
    assert torch.equal(ctx.shard(start, stop).cos, ctx.cos[start:stop])


@pytest.mark.parametrize("world", [4, 12], ids=["padded", "pure-padding-shard"])
@pytest.mark.parametrize("per_row", [False, True], ids=["runs", "per-row"])
def test_shard_embed_and_heads_are_the_full_sequence_rows(our_model, world, per_row):
    """With a RowShard, embed packs the full sequence's rows [start, stop) then zero padding, with the matching context,
    and the heads return the shard's own video / audio rows: all that a sequence-parallel plan adds is attention."""
    layout = LAYOUTS["ref2va_mixed"]()  # S = 55: 4 ranks pad the last one, 12 leave one rank of pure padding
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    if per_row:  # the per-row gather path
        ti = torch.randint(0, u.shape[0], ti.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        x, ctx, plan = our_model.embed(v, a, txt, u, ti, layout)
        video, audio = our_model.heads(x, ctx, plan, ti, layout)
        shards = L.row_shards(layout, world)
        assert shards[-1].stop - shards[-1].start < shards[-1].rows
        for sh in shards:
            n = sh.stop - sh.start
            xs, cs, _ = our_model.embed(v, a, txt, u, ti, layout, sh)
            assert xs.shape[1] == cs.cos.shape[0] == sh.rows and not xs[:, n:].any() and not cs.cos[n:].any()
            torch.testing.assert_close(xs[:, :n], x[:, sh.start:sh.stop])
            assert torch.equal(cs.sin[:n], ctx.sin[sh.start:sh.stop])
            xs[:, :n] = x[:, sh.start:sh.stop]  # the heads on exactly the full sequence's hidden rows
            vs, aus = our_model.heads(xs, cs, plan, ti, layout, sh)
            torch.testing.assert_close(vs, video[:, sh.video[0]:sh.video[1]])
            torch.testing.assert_close(aus, audio[:, sh.audio[0]:sh.audio[1]])
        assert sum(s.video[1] - s.video[0] for s in shards) == layout.num_video_rows


# -- bf16 ----------------------------------------------------------------------------------------------------------


def test_bf16_cast_keeps_fp32_modules_and_tracks_diffusers(ref_model, tmp_path):
    ref_model.save_pretrained(tmp_path)
    ref_bf16 = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    ours = H3DiT(H3DiTConfig.from_dict(dict(ref_model.config))).eval()
    ours.load_state_dict(ref_model.state_dict(), strict=True)
    ours.cast(torch.bfloat16)
    # same per-tensor dtypes as diffusers' own mixed-precision load
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in ref_bf16.state_dict().items()}
    for name in FP32_MODULES:
        assert all(p.dtype == torch.float32 for p in getattr(ours, name).parameters())
    assert ours.rope.inv_freq.dtype == torch.float32 and torch.equal(ours.rope.inv_freq, ref_model.rope.inv_freq)
    assert ours.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16
    assert ours.norm_out.linear.weight.dtype == torch.bfloat16

    layout = LAYOUTS["ref2va_image_audio"]()
    v, a, txt = _inputs(layout)
    u, ti = L.row_timesteps(layout, VIDEO_T, AUDIO_T)
    with torch.no_grad():
        ov, oa = ours(v, a, txt.bfloat16(), u, ti, layout)
        rv, ra = _ref_forward(ref_bf16, v, a, txt.bfloat16(), u, ti, layout)
        fv, fa = _ref_forward(ref_model, v, a, txt, u, ti, layout)
    assert ov.dtype == torch.float32 and oa.dtype == torch.float32  # heads are fp32
    assert (ov - rv).abs().max() <= 3e-2 and (oa - ra).abs().max() <= 3e-2
    assert (ov - fv).abs().max() <= 5e-2 and (oa - fa).abs().max() <= 5e-2


# -- the loop ------------------------------------------------------------------------------------------------------


def _reference_denoise(ref, layout, v, a, txt, num_points, sigmas=None):
    """diffusers' own set_timesteps + denoise blocks on a pipeline holding `ref`."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep

    blocks = SequentialPipelineBlocks.from_blocks_dict(
        {"set_timesteps": MiniMaxH3SetTimestepsStep(), "denoise": MiniMaxH3DenoiseStep()}
    )
    pipe = blocks.init_pipeline()
    scheds = [MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)]
    if sigmas is not None:  # FastH3: the rung grid through set_timesteps(sigmas=...)
        for sched, s in zip(scheds, sigmas):
            original = sched.set_timesteps
            sched.set_timesteps = lambda n=None, device=None, _o=original, _s=s: _o(sigmas=_s, device=device)
    pipe.update_components(transformer=ref, scheduler=scheds[0], audio_scheduler=scheds[1])
    pipe.set_progress_bar_config(disable=True)
    fields = dict(token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
                  audio_indices=layout.audio_indices, text_indices=layout.text_indices)
    out = pipe(num_inference_steps=num_points, latents=v.clone(), audio_latents=a.clone(), prompt_embeds=txt,
               denoiser_input_fields=fields, video_indices=layout.video_indices,
               audio_indices=layout.audio_indices, text_indices=layout.text_indices,
               num_condition_video_rows=layout.num_condition_video_rows,
               num_condition_audio_rows=layout.num_condition_audio_rows, output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


@pytest.mark.parametrize("name,profile", [("fl2va_first_last", "base"), ("ref2va_image_audio", "base"),
                                          ("t2va", "fasth3")])
def test_denoise_loop_matches_diffusers(ref_model, our_model, name, profile):
    layout = LAYOUTS[name]()
    v, a, txt = _inputs(layout, seed=7)
    v, a = v[0], a[0]
    num_points = 4 if profile == "base" else FASTH3_STEPS
    video_s, audio_s = schedules_for(profile, num_points)
    sigmas = (fasth3_grid(12.0), fasth3_grid(3.0)) if profile == "fasth3" else None
    steps = []
    ov, oa = denoise(our_model, video_rows=v, audio_rows=a, text_states=txt, layout=layout,
                     video_schedule=video_s, audio_schedule=audio_s,
                     num_condition_video_rows=layout.num_condition_video_rows,
                     num_condition_audio_rows=layout.num_condition_audio_rows,
                     on_step=lambda i, n: steps.append((i, n)))
    with torch.no_grad():
        rv, ra = _reference_denoise(ref_model, layout, v, a, txt, num_points, sigmas)
    assert steps == [(i + 1, num_points - 1) for i in range(num_points - 1)]
    assert (ov - rv).abs().max().item() <= 1e-5 and (oa - ra).abs().max().item() <= 1e-5
    ncv, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    assert torch.equal(ov[:ncv], v[:ncv]) and torch.equal(oa[:nca], a[:nca])  # conditions never written
    assert not torch.equal(ov[ncv:], v[ncv:])


def test_denoise_cancels_at_a_step_boundary(our_model):
    layout = LAYOUTS["t2va"]()
    v, a, txt = _inputs(layout)
    video_s, audio_s = schedules_for("base", 5)
    done = []
    with pytest.raises(Cancelled) as err:
        denoise(our_model, video_rows=v[0], audio_rows=a[0], text_states=txt, layout=layout,
                video_schedule=video_s, audio_schedule=audio_s, num_condition_video_rows=0,
                num_condition_audio_rows=0, on_step=lambda i, n: done.append(i), should_stop=lambda: len(done) == 2)
    assert done == [1, 2] and isinstance(err.value, H3Error) and "step 3 of 4" in str(err.value)
    with pytest.raises(ValueError, match="disagree"):
        denoise(our_model, video_rows=v[0], audio_rows=a[0], text_states=txt, layout=layout,
                video_schedule=video_s, audio_schedule=audio_s, num_condition_video_rows=1,
                num_condition_audio_rows=0)


def test_noise_draw_order_matches_diffusers_blocks():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.utils.torch_utils import randn_tensor

    conds = [torch.randn(1, 24, 1, 4, 6), torch.randn(1, 24, 2, 2, 4)]
    g = torch.Generator().manual_seed(11)
    cond_rows = noise_condition_rows(g, conds)
    video_rows, audio_rows = prepare_noise(g, T, H, W, A)

    g = torch.Generator().manual_seed(11)
    sched = MiniMaxH3Scheduler(shift=12.0)
    expected = torch.cat([
        patchify_video_latents(sched.scale_noise(c, 0.999, randn_tensor(c.shape, generator=g, dtype=torch.float32)),
                               (1, 2, 2)) for c in conds
    ])
    video = randn_tensor((1, 24, T, H, W), generator=g, dtype=torch.float32)
    audio = randn_tensor((2 * A, 32), generator=g, dtype=torch.float32)
    assert torch.equal(cond_rows, expected)
    assert torch.equal(video_rows, patchify_video_latents(video, (1, 2, 2))) and torch.equal(audio_rows, audio)
    assert torch.equal(FlowSchedule.add_noise(conds[0], conds[0] * 0, 1.0), conds[0])
