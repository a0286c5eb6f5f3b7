"""The levers' vocabulary and their one combination rule, on every surface: off by default everywhere, one message
(spelled with each surface's field names) from the CLI, the spec, the request and the DiT engine, and the deployment
spec's dit.levers reaching the DiT stage's config and the launcher's child processes."""

from __future__ import annotations

import pytest

from h3serve.config.levers import (CLI_NAMES, LEVERS_MESSAGE, REQUEST_NAMES, SPEC_NAMES, LeverError, Levers,
                                   check_combination, lever_conflict)
from h3serve.config.request import validate_request
from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, SpecError, validate
from h3serve.config.stage import StageConfig
from h3serve.errors import ProfileError, RequestError

SHA = "0" * 64


def spec_doc(**kw) -> dict:
    d = {"model": {"path": "/models/H3"}, "image": "img:1", "gateway": {"auth": {"disabled": True}}}
    d.update(kw)
    return d


def test_every_lever_is_off_by_default():
    assert not Levers().any and not Levers().lossy()
    assert StageConfig().levers == Levers()
    s = H3DeploymentSpec.from_dict(spec_doc())
    lv = s.dit.levers
    assert (lv.resident_blocks, lv.offload_mode, lv.fp8, lv.fp8_attention) == (None, "local", False, False)
    assert validate_request(prompt="a kite").quality == "lossless"


def test_one_message_for_the_combination_on_every_surface(capsys):
    for names in (CLI_NAMES, SPEC_NAMES, REQUEST_NAMES):
        assert lever_conflict("fasth3", Levers(fp8=True), names=names) == LEVERS_MESSAGE.format(**names)
        assert lever_conflict("fasth3", quality="high", names=names) == LEVERS_MESSAGE.format(**names)
        assert lever_conflict("base", Levers(resident_blocks=2, offload_mode="allgather", fp8=True, fp8_attention=True), "high", names=names) is None
        assert lever_conflict("fasth3", names=names) is None
        lossless = Levers(resident_blocks=2, encoder_resident_layers=2, vae_staged=True, adaln_table=True)
        assert lever_conflict("fasth3", lossless, names=names) is None
    # spec (and, through the same rule, the CRD's CEL)
    d = spec_doc(profile="fasth3", model={"path": "/models/H3", "adapter": {"path": "/models/a", "sha256": SHA}},
                 dit={"levers": {"fp8": True}})
    assert validate(H3DeploymentSpec.from_dict(d)) == [("spec.dit.levers", LEVERS_MESSAGE.format(**SPEC_NAMES))]
    d["dit"]["levers"] = {"residentBlocks": 4, "adalnTable": True}   # lossless: allowed on the student
    assert validate(H3DeploymentSpec.from_dict(d)) == []
    # request
    with pytest.raises(RequestError, match="profile fasth3 takes no fp8") as e:
        validate_request(prompt="a kite", profile="fasth3", quality="high")
    assert LEVERS_MESSAGE.format(**REQUEST_NAMES) in str(e.value)
    # CLI: one line, exit 2, before anything starts
    from h3serve.cli import main

    assert main(["serve", "--profile", "fasth3", "--fp8", "on", "--checkpoint", "/nowhere"]) == 2
    assert LEVERS_MESSAGE.format(**CLI_NAMES) in capsys.readouterr().err
    # the DiT engine, before it touches the checkpoint
    from h3serve.models.dit.engine import DiTEngine

    with pytest.raises(ProfileError) as e:
        DiTEngine.load("/nowhere", profile="fasth3", levers=Levers(resident_blocks=8, fp8=True))
    assert str(e.value) == LEVERS_MESSAGE.format(**CLI_NAMES)


def test_bad_lever_values_name_the_field_and_the_range(capsys):
    with pytest.raises(LeverError, match=r"--dit-resident-blocks=1 must be between 2 .* and the 50 DiT layers"):
        Levers(resident_blocks=1).check()
    from h3serve.cli import main

    assert main(["serve", "--dit-resident-blocks", "51", "--checkpoint", "/nowhere"]) == 2
    assert "--dit-resident-blocks=51 must be between 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--fp8", "maybe"])
    assert "'maybe' must be on or off" in capsys.readouterr().err
    with pytest.raises(SpecError, match=r"spec.dit.levers.residentBlocks=1 must be between 2 and 50"):
        H3DeploymentSpec.from_dict(spec_doc(dit={"levers": {"residentBlocks": 1}}))
    with pytest.raises(SpecError, match=r"spec.dit.levers.offloadMode='ring' must be one of local, allgather"):
        H3DeploymentSpec.from_dict(spec_doc(dit={"levers": {"offloadMode": "ring"}}))
    with pytest.raises(RequestError, match="one of lossless | high"):
        validate_request(prompt="a kite", quality="fast")
    check_combination("base", Levers(resident_blocks=2, fp8=True), quality="high")  # allowed: no exception


@pytest.mark.parametrize("placement,stage", [("colocated", "dit"), ("disaggregated", "dit"),
                                             ("disaggregated", "encoder")])
def test_spec_levers_reach_the_dit_stage_and_its_children(placement, stage, tmp_path):
    from h3serve.cli import build_parser
    from h3serve.testing.serve import launched_config

    spec = H3DeploymentSpec.from_dict(spec_doc(placement=placement, dit={"levers": {
        "residentBlocks": 6, "offloadMode": "allgather", "fp8": True, "fp8Attention": True}}))
    sc = ServiceConfig("h3", "ns", spec, {s: f"{s}:1" for s in ("encoder", "dit", "vae", "muxer")}, "bf16",
                       "cuda").to_dict()
    c = StageConfig.from_service_config(sc, stage)
    SPEC_LEVERS = Levers(resident_blocks=6, offload_mode="allgather", fp8=True, fp8_attention=True)
    if stage == "encoder" and placement == "disaggregated":
        assert c.levers == Levers(fp8=True)  # the encoder reads FP8 only
        return
    assert c.levers == SPEC_LEVERS
    every = build_parser().parse_args(["serve", "--json", "--queue-size", "1", "--fp8", "on", "--fp8-attention", "off"])
    assert every.json and every.queue_size == 1 and every.fp8 and not every.fp8_attention  # the other flags stay
    assert launched_config(c, "dit", 1234, {}, None, tmp_path).levers == SPEC_LEVERS  # a child


def test_a_fasth3_pool_beside_base_runs_the_dit_levers_it_may():
    from h3serve.config.levers import fasth3_levers
    from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, validate
    from h3serve.config.stage import service_config_values
    from h3serve.config.vocab import FASTH3_DIT

    levers = {"fp8": True, "fp8Attention": True, "sparseAttention": "25", "adalnTable": True, "residentBlocks": 20}
    spec = H3DeploymentSpec.from_dict({
        "image": "img:1", "model": {"path": "/models/H3", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
        "gateway": {"auth": {"disabled": True}}, "placement": "disaggregated", "dit": {"levers": levers},
        "encoder": {"levers": {"residentLayers": 4}},
        "fasth3": {"adapter": {"path": "/models/H3/fast.safetensors", "sha256": "a" * 64}}})
    assert validate(spec, "h3") == []
    sc = ServiceConfig("h3", "ns", spec, {s: f"{s}:1" for s in ("encoder", "dit", "vae", "muxer", FASTH3_DIT)},
                       "bf16", "cuda").to_dict()
    base = service_config_values(sc, "dit")["levers"]
    assert base.fp8 and base.sparse_attention == "25" and base.adaln_table
    pool = service_config_values(sc, FASTH3_DIT)
    assert pool["profile"] == "fasth3" and pool["levers"] == Levers(resident_blocks=20, adaln_table=True)
    # the embedded launcher's FastH3 child: the same rule on a whole StageConfig's levers
    assert fasth3_levers(Levers(fp8=True, encoder_resident_layers=4, vae_staged=True)) == \
        Levers(encoder_resident_layers=4, vae_staged=True)
