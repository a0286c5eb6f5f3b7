"""Per-request LoRA on the tiny checkpoint: the request with it changes, the requests without it keep their bytes,
the cache loads once and stays within its byte bound, a few-step adapter sets the steps, and what cannot be served
is refused naming the field or the lever."""

from __future__ import annotations

import pytest
import torch

from h3serve.config.levers import Levers
from h3serve.config.lora import FP8_REFUSAL, LoraEntry, find_lora, format_loras, lora_choice, parse_loras
from h3serve.config.request import validate_request
from h3serve.errors import AdapterError, H3Error, ProfileError, RequestError
from h3serve.models.dit.engine import DiTEngine, DiTRequest
from h3serve.testing.adapters import init_lora
from h3serve.testing.presets import TINY_TRANSFORMER


@pytest.fixture(scope="module")
def loras(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    style = LoraEntry("style", str(d / "style.safetensors"), init_lora(tiny_checkpoint, d / "style.safetensors"))
    turbo = LoraEntry("turbo", str(d / "turbo.safetensors"),
                      init_lora(tiny_checkpoint, d / "turbo.safetensors", seed=1, alpha=2.0), steps=3)
    return style, turbo


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return DiTEngine.load(tiny_checkpoint)   # no LoRA configured at all: today's engine


@pytest.fixture
def engine(tiny_checkpoint, loras, plain):
    engine = DiTEngine(plain.models, device=plain.device, profile="base", shifts=plain.shifts)   # same weights
    engine.use_loras(loras)
    return engine


def _req(**kw) -> DiTRequest:
    g = torch.Generator().manual_seed(5)
    return DiTRequest(text_states=torch.randn(1, 6, TINY_TRANSFORMER["text_dim"], generator=g),
                      text_tags=torch.ones(6, dtype=torch.long), latent_frames=2, latent_h=2, latent_w=4,
                      audio_latents=4, seed=3, steps=kw.pop("steps", 3), **kw)


def _bytes(out) -> tuple[bytes, bytes]:
    return out.video.numpy().tobytes(), out.audio.numpy().tobytes()


def test_a_request_without_lora_after_one_with_lora_gives_todays_bytes(tiny_checkpoint, loras):
    today = _bytes(DiTEngine.load(tiny_checkpoint).generate(_req()))   # a fresh process's engine
    engine = DiTEngine.load(tiny_checkpoint, loras=loras)
    styled = engine.generate(_req(lora="style"))
    after = engine.generate(_req())
    assert _bytes(after) == today
    assert (styled.video - after.video).abs().max() > 1e-3   # the LoRA did change its own request
    half = engine.generate(_req(lora="style", lora_scale=0.5))
    assert 0 < (half.video - after.video).abs().max() < (styled.video - after.video).abs().max()
    assert _bytes(engine.generate(_req(lora="style"))) == _bytes(styled)   # the cached adapter: same bytes again
    assert _bytes(engine.generate(_req())) == today
    assert not any(m._forward_hooks for m in engine.models["transformer"].modules())


def test_turbo_lora_sets_its_steps_and_refuses_others(engine):
    out = engine.generate(_req(lora="turbo", steps=None))
    assert out.steps == 2   # 3 grid points -> 2 forwards
    with pytest.raises(RequestError, match=r"steps=4 .*few-step adapter distilled for 3"):
        engine.generate(_req(lora="turbo", steps=4))


def test_cache_loads_once_and_keeps_within_its_byte_bound(engine):
    cache = engine.loras
    engine.generate(_req(lora="style", steps=2))
    engine.generate(_req(lora="style", steps=2))
    assert cache.loads == 1 and cache.held() == ["style"]
    one = cache.nbytes
    cache.max_bytes = one   # room for one adapter: the least recently used goes
    engine.generate(_req(lora="turbo", steps=None))
    assert cache.held() == ["turbo"] and cache.nbytes <= cache.max_bytes and cache.loads == 2
    cache.max_bytes = one - 1
    cache._held.clear()
    with pytest.raises(RequestError, match=r"more than the LoRA cache's bound .*dit.loraCacheBytes"):
        engine.generate(_req(lora="style", steps=2))


def test_refusals_name_the_field_or_the_lever(tiny_checkpoint, loras, engine, plain, tmp_path):
    with pytest.raises(RequestError, match=r"lora.name='nope' .*one of the deployment's adapters \(style, turbo\)"):
        engine.generate(_req(lora="nope"))
    with pytest.raises(RequestError, match="lists no LoRA adapters"):
        plain.generate(_req(lora="style"))
    with pytest.raises(AdapterError, match="sha256 mismatch"):   # at the start, not at the first request
        engine.use_loras([LoraEntry("bad", loras[0].path, "0" * 64)])
    with pytest.raises(ProfileError, match=r"turn dit.levers.fp8 \(--fp8\) off to serve dit.loras"):
        DiTEngine.load(tiny_checkpoint, loras=loras, levers=Levers(fp8=True))
    adaln = tmp_path / "adaln.safetensors"
    entry = LoraEntry("adaln", str(adaln), init_lora(tiny_checkpoint, adaln, modules=("adaln_proj.linear",)))
    table = DiTEngine.load(tiny_checkpoint, levers=Levers(adaln_table=True))
    with pytest.raises(RequestError, match=r"adalnTable lever .*turn dit.levers.adalnTable"):
        table.use_loras([entry])
    table.use_loras(loras)   # attention / FFN adapters are served beside the table
    assert table.generate(_req(lora="style", steps=2)).steps == 1
    with pytest.raises(ProfileError, match="per-request LoRA"):
        engine.profile = "fasth3"
        engine.use_loras(loras)


def test_request_field_and_knob():
    assert validate_request(prompt="x", seed=1, lora="style").lora.name == "style"
    assert lora_choice({"name": "style", "scale": 0.5}).scale == 0.5
    assert lora_choice({"name": "style", "local_path": "/m/s"}).path == "/m/s"
    with pytest.raises(RequestError, match="lora.path='/etc/passwd' .*cannot choose a file"):
        find_lora([LoraEntry("style", "/m/s", "a" * 64)], "style", "/etc/passwd")
    for value, field in (({"name": "style", "path": 3}, "lora.path"), ({"name": "s", "scale": 9}, "lora.scale"),
                         ({"name": "s", "int_id": 1}, "lora.int_id"), (3, "lora"), ("Bad Name", "lora.name")):
        with pytest.raises(RequestError) as exc:
            validate_request(prompt="x", lora=value)
        assert exc.value.field == field
    with pytest.raises(RequestError, match="profile fasth3 runs its own"):
        validate_request(prompt="x", profile="fasth3", lora="style")
    with pytest.raises(RequestError, match="ref2va runs transformer_ref/"):
        validate_request(prompt="x", task="ref2va", references=[{"kind": "audio", "path": "a.wav"}], lora="style")
    entries = (LoraEntry("a", "/m/a@x.safetensors", "a" * 64), LoraEntry("b", "/m/b.safetensors", "b" * 64, 5))
    assert parse_loras(format_loras(entries)) == entries
    with pytest.raises(H3Error, match="NAME=PATH@SHA256"):
        parse_loras("a=/m/a.safetensors")


def _spec(loras, **over) -> dict:
    d = {"image": "img:1", "model": {"path": "/models/MiniMax-H3",
                                     "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
         "gateway": {"auth": {"disabled": True}}, "dit": {"loras": loras}}
    d.update(over)
    return d


def test_spec_lists_loras_and_the_dit_and_gateway_get_them():
    from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, validate
    from h3serve.config.stage import service_config_values

    good = [{"name": "turbo", "path": "/models/loras/turbo.safetensors", "sha256": "a" * 64, "steps": 9},
            {"name": "style", "path": "/models/loras/style.safetensors", "sha256": "b" * 64}]
    spec = H3DeploymentSpec.from_dict(_spec(good, placement="disaggregated"))
    assert validate(spec, "h3") == []
    sc = ServiceConfig("h3", "ns", spec, {s: f"{s}:1" for s in ("encoder", "dit", "vae", "muxer")}, "bf16",
                       "cuda").to_dict()
    for stage in ("dit", "gateway"):   # the gateway resolves a few-step adapter's steps, the DiT loads them
        assert parse_loras(service_config_values(sc, stage)["loras"]) == spec.dit.lora_entries()
    assert "loras" not in service_config_values(sc, "encoder")
    bad = [{"name": "Bad", "path": "/models/../etc/x", "sha256": "z", "steps": 1, "extra": 1},
           {"name": "dup", "path": "/elsewhere/x.safetensors", "sha256": "c" * 64},
           {"name": "dup", "path": "/models/y.safetensors", "sha256": "c" * 64}]
    found = dict(validate(H3DeploymentSpec.from_dict(_spec(bad)), "h3"))
    for field in ("spec.dit.loras[0].name", "spec.dit.loras[0].sha256", "spec.dit.loras[0].steps",
                  "spec.dit.loras[0].extra", "spec.dit.loras[2].name"):
        assert field in found, (field, found)
    rules = " ".join(m for f, m in validate(H3DeploymentSpec.from_dict(_spec(bad)), "h3") if f == "spec.dit.loras")
    assert "normalised absolute path" in rules and "inside model.mountPath /models" in rules
    fast = validate(H3DeploymentSpec.from_dict(_spec(good, profile="fasth3",
                                                      model={"path": "/m", "adapter": {"path": "/m/a", "sha256": "a" * 64}})), "h3")
    assert any("dit.loras (per-request LoRA) needs profile base" in m for _, m in fast)
    fp8 = validate(H3DeploymentSpec.from_dict(_spec(good, dit={"loras": good, "levers": {"fp8": True}})), "h3")
    assert ("spec.dit.loras", FP8_REFUSAL) in fp8
