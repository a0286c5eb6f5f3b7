"""Encoder layerwise offload and VAE staging (h3serve.models.offload) against the resident path: the same states,
frames, PCM and MP4 bytes, the weights off the device between requests, and every surface's checks of the two
levers (CLI, spec, the one combination rule)."""

from __future__ import annotations

import json

import pytest
import torch

from h3serve.config.levers import CLI_NAMES, LEVERS_MESSAGE, SPEC_NAMES, STAGED_VAE_MESSAGE, LeverError, Levers
from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, SpecError, validate
from h3serve.config.stage import StageConfig
from h3serve.models.encoder.model import TextEncoder
from h3serve.models.vae.audio import AudioVAE
from h3serve.models.vae.video import VideoVAE

SHA = "0" * 64


def _spec(**kw) -> dict:
    d = {"model": {"path": "/models/H3"}, "image": "img:1", "gateway": {"auth": {"disabled": True}}}
    d.update(kw)
    return d


def test_encoder_offload_streams_every_layer_and_matches_resident(tiny_checkpoint):
    enc = TextEncoder.load(tiny_checkpoint, dtype=torch.float32)
    layers = enc.model.language_model.layers
    want = [enc.encode(p, task="t2va").states for p in ("a red kite", "waves at dusk")]
    off = enc.offload(2)
    n = len(layers)
    assert off.report()["streamed_blocks"] == n  # r = 2: both slots stream, no layer stays resident
    got = [enc.encode(p, task="t2va").states for p in ("a red kite", "waves at dusk")]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert off.copies == 2 * n + 1  # every layer once per call, plus the next call's first layer prefetched
    # between calls each streamed layer's weights are its host copy's views, not a slot's
    w = layers[n - 1].mlp.down_proj.weight
    host = off.host[n - 1]
    assert host.data_ptr() <= w.data_ptr() < host.data_ptr() + host.numel()
    for h in off.handles:  # the hooks undo: the same layers run as plain modules again
        h.remove()


def test_encoder_streamed_layers_are_read_into_host_memory_never_onto_the_device(tiny_checkpoint):
    # The device is `meta` here: a tensor that reached it would hold no data. With --encoder-resident-layers the
    # layers the offload streams are read into host memory, so a GPU never holds the whole decoder while loading.
    enc = TextEncoder.load(tiny_checkpoint, dtype=torch.float32, device="meta", host_layers=range(1, 50))
    layers = enc.model.language_model.layers
    assert all(p.is_meta for p in layers[0].parameters())
    assert all(p.device.type == "cpu" for j in range(1, 50) for p in layers[j].parameters())
    assert all(p.is_meta for n, p in enc.model.named_parameters() if not n.startswith("language_model.layers."))
    assert all(b.is_meta for n, b in enc.model.named_buffers() if not n.startswith("language_model.layers."))
    # load_with_levers: the same states as the resident encoder (r = 4: two resident layers, the rest streamed)
    want = TextEncoder.load(tiny_checkpoint, dtype=torch.float32).encode("a red kite", task="t2va").states
    got = TextEncoder.load_with_levers(tiny_checkpoint, dtype=torch.float32, device="cpu", resident_layers=4)
    assert torch.equal(got.encode("a red kite", task="t2va").states, want)


def test_vae_staging_decodes_and_encodes_the_same_and_copies_once_per_request(tiny_checkpoint):
    vae = VideoVAE.load(tiny_checkpoint, dtype=torch.float32)
    audio = AudioVAE.load(tiny_checkpoint)
    g = torch.Generator().manual_seed(3)
    lat = torch.randn(1, vae.latent_channels, 7, 4, 4, generator=g)
    alat = torch.randn(2, audio.latent_channels, 6, generator=g)
    frames = torch.randint(0, 256, (1, 64, 64, 3), generator=g, dtype=torch.uint8)
    want = (vae.decode_float(lat), [c.clone() for c in vae.iter_decode(lat)], vae.encode_condition(frames),
            audio.decode(alat))
    staged, astaged = vae.stage(), audio.stage()
    got = (vae.decode_float(lat), [c.clone() for c in vae.iter_decode(lat)], vae.encode_condition(frames),
           audio.decode(alat))
    assert torch.equal(want[0], got[0]) and torch.equal(want[2], got[2]) and torch.equal(want[3], got[3])
    assert len(want[1]) == len(got[1]) and all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
    # one stage-in per call (a clip-by-clip decode stays staged across its clips), weights at the host copy after
    assert (staged.copies, astaged.copies) == (3, 1)
    it = vae.iter_decode(lat)
    next(it)
    assert staged._depth == 1  # still staged between clips
    it.close()
    assert staged._depth == 0
    p = vae.model.post_quant_conv.weight
    assert staged.host.data_ptr() <= p.data_ptr() < staged.host.data_ptr() + staged.host.numel()


@pytest.mark.parametrize("profile", ["base", "fasth3"])
def test_embedded_pipeline_with_every_lossless_lever_writes_the_same_mp4(profile, tiny_checkpoint, tiny_adapter,
                                                                         tmp_path, capsys):
    """`h3serve generate` with DiT offload, encoder offload, VAE staging and the AdaLN table: the MP4 bytes of the
    plain path, for the base model and for the student (the lossless levers are allowed on FastH3 for this)."""
    from h3serve.cli import main

    base = ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red kite", "--seconds", "5",
            "--size", "256x256", "--seed", "5", "--no-progress", "--json", "--profile", profile,
            *(["--steps", "2"] if profile == "base" else
              ["--adapter", str(tiny_adapter.path), "--adapter-sha256", tiny_adapter.sha256])]
    assert main([*base, "-o", str(tmp_path / "plain.mp4")]) == 0
    assert main([*base, "-o", str(tmp_path / "levers.mp4"), "--dit-resident-blocks", "2",
                 "--encoder-resident-layers", "2", "--vae-staged", "on", "--adaln-table", "on"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(out) == 2
    assert (tmp_path / "plain.mp4").read_bytes() == (tmp_path / "levers.mp4").read_bytes()


def test_staging_levers_are_checked_on_every_surface(capsys):
    from h3serve.cli import main

    # CLI: range, the VAE degree, the combination rule; exit 2, one line, before anything loads
    assert main(["serve", "--encoder-resident-layers", "1", "--checkpoint", "/nowhere"]) == 2
    assert "--encoder-resident-layers=1 must be between 2" in capsys.readouterr().err
    assert main(["serve", "--vae-staged", "on", "--vae-pp", "2", "--checkpoint", "/nowhere"]) == 2
    assert STAGED_VAE_MESSAGE.format(pp=2, **CLI_NAMES) in capsys.readouterr().err
    assert main(["serve", "--profile", "fasth3", "--vae-staged", "on", "--fp8", "on", "--checkpoint", "/nowhere"]) == 2
    assert LEVERS_MESSAGE.format(**CLI_NAMES) in capsys.readouterr().err   # FP8 (lossy), not the staging
    with pytest.raises(LeverError):
        Levers(encoder_resident_layers=51).check()
    # spec (the same rules give the CRD's CEL)
    with pytest.raises(SpecError, match=r"spec.encoder.levers.residentLayers=1 must be between 2 and 50"):
        H3DeploymentSpec.from_dict(_spec(encoder={"levers": {"residentLayers": 1}}))
    s = H3DeploymentSpec.from_dict(_spec(dit={"ulysses": 2}, vae={"patchParallel": 2, "levers": {"staged": True}}))
    assert validate(s) == [("spec.vae.levers.staged", STAGED_VAE_MESSAGE.format(pp=2, **SPEC_NAMES))]
    s = H3DeploymentSpec.from_dict(_spec(profile="fasth3", model={"path": "/models/H3", "adapter": {
        "path": "/models/a", "sha256": SHA}}, encoder={"levers": {"residentLayers": 4}},
        vae={"levers": {"staged": True}}))
    assert validate(s) == []   # lossless: allowed on the student


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_spec_staging_levers_reach_their_stages(placement):
    spec = H3DeploymentSpec.from_dict(_spec(placement=placement, encoder={"levers": {"residentLayers": 3}},
                                            vae={"levers": {"staged": True}}))
    sc = ServiceConfig("h3", "ns", spec, {s: f"{s}:1" for s in ("encoder", "dit", "vae", "muxer")}, "bf16",
                       "cuda").to_dict()
    enc, vae, dit = (StageConfig.from_service_config(sc, s) for s in ("encoder", "vae", "dit"))
    assert enc.levers.encoder_resident_layers == 3 and vae.levers.vae_staged
    if placement == "disaggregated":  # each stage reads only its own
        assert dit.levers.encoder_resident_layers is None and not dit.levers.vae_staged and not enc.levers.vae_staged
