"""Step reuse (quality=high) against the plain path, through the DiT engine: the counts it reports, that a zero
threshold is the plain path bit for bit, that the default policy computes >= 1.5x fewer forwards over the 49-forward
base schedule, and that FastH3 refuses it with the one lever message."""

from __future__ import annotations

import pytest
import torch

from h3serve.config.levers import LEVERS_MESSAGE, REQUEST_NAMES
from h3serve.errors import ProfileError
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.models.dit.model import H3DiT, H3DiTConfig
from h3serve.models.dit.reuse import ReuseConfig, StepReuse

TINY = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=6, num_refiner_layers=1,
            ffn_dim=64, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)


@pytest.fixture(scope="module")
def model() -> H3DiT:
    torch.manual_seed(0)
    m = H3DiT(H3DiTConfig(**TINY)).eval().requires_grad_(False)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _request(**kw) -> DiTRequest:
    g = torch.Generator().manual_seed(3)
    return DiTRequest(text_states=torch.randn(1, 5, TINY["text_dim"], generator=g),
                      text_tags=torch.ones(5, dtype=torch.long), latent_frames=2, latent_h=4, latent_w=6,
                      audio_latents=3, seed=5, **kw)


def _rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lossless_is_the_reference_and_reports_every_forward(model):
    engine = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base")
    res = engine.generate(_request())
    assert res.steps == 49 and res.forwards_computed == 49 and res.block_evaluations == 49 * 6
    assert model.step_policy is None


def test_zero_threshold_reuses_nothing_and_matches_lossless_bitwise(model):
    plain = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base").generate(_request(steps=12))
    engine = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base",
                       reuse=ReuseConfig(threshold=0.0))
    res = engine.generate(_request(steps=12, quality="high"))
    assert res.forwards_computed == 11 and res.block_evaluations == 11 * 6
    assert torch.equal(res.video, plain.video) and torch.equal(res.audio, plain.audio)
    assert model.step_policy is None  # detached after the request


def test_default_policy_computes_at_least_1_5x_fewer_forwards(model):
    engine = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="base")
    plain = engine.generate(_request())
    res = engine.generate(_request(quality="high"))
    assert res.steps == 49 and 49 / res.forwards_computed >= 1.5, res.forwards_computed
    c = ReuseConfig()
    reused = 49 - res.forwards_computed
    assert res.block_evaluations == 49 * 6 - reused * (6 - c.front_blocks - c.back_blocks)
    # a proxy on random weights: the final latents stay close to the lossless ones
    assert 0 < _rel_l2(res.video, plain.video) < 0.05


def test_policy_never_reuses_in_warmup_final_steps_or_too_long(model):
    from h3serve.models.dit.layout import build_t2va_layout
    from h3serve.models.dit.loop import denoise
    from h3serve.models.dit.scheduler import schedules_for

    policy = StepReuse(6, ReuseConfig(threshold=float("inf"), warmup_steps=3, final_steps=2, max_reuse_run=2))
    policy.begin(20)
    layout = build_t2va_layout(5, 2, 4, 6, 3)
    v, a = schedules_for("base", 21)
    g = torch.Generator().manual_seed(0)
    model.step_policy = policy
    try:
        denoise(model, video_rows=torch.randn(layout.num_video_rows, 96, generator=g),
                audio_rows=torch.randn(layout.num_audio_rows, 32, generator=g),
                text_states=torch.randn(1, 5, TINY["text_dim"], generator=g), layout=layout, video_schedule=v,
                audio_schedule=a, num_condition_video_rows=0, num_condition_audio_rows=0)
    finally:
        model.step_policy = None
    assert policy.step == 20
    # steps 0-2 warm-up, then reuse 2 / compute 1 from step 3, the last 2 computed: 0,1,2,5,8,11,14,17,18,19
    assert policy.forwards_computed == 10, policy.report()
    unmeasured = [i for i, c in enumerate(policy.changes) if c is None]
    assert unmeasured == [0, 1, 2, 5, 8, 11, 14, 17, 18, 19]


def test_fasth3_refuses_step_reuse_with_the_lever_message(model):
    engine = DiTEngine({"transformer": model}, device=torch.device("cpu"), profile="fasth3")
    with pytest.raises(ProfileError) as e:
        engine.generate(_request(profile="fasth3", steps=5, quality="high"))
    assert str(e.value) == LEVERS_MESSAGE.format(**REQUEST_NAMES)


def test_bad_policy_config_is_refused():
    with pytest.raises(ValueError, match="front blocks"):
        StepReuse(4, ReuseConfig(front_blocks=3, back_blocks=1))


def test_a_shallow_stack_keeps_one_middle_block_to_skip():
    c = ReuseConfig()
    assert c.fitted(50) is c and c.fitted(4) is c
    assert (c.fitted(3).front_blocks, c.fitted(3).back_blocks) == (1, 1)
    assert (c.fitted(2).front_blocks, c.fitted(2).back_blocks) == (1, 0)
    with pytest.raises(ValueError, match="front blocks"):
        StepReuse(1, c.fitted(1))   # one block: nothing to skip
