"""The typed H3Deployment spec: parsing, defaults, and validation messages that say what to change."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from h3serve.config.parallel import DegreeError, ParallelDegrees, encoder_tp_choices, ulysses_choices
from h3serve.config.rules import RULES
from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, SpecError, parse_and_validate, validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SHA = "4ce198c83132251b7fd0de2503823aa49c53983f068318f66cb19eaefb7fcc12"


def base(**over) -> dict:
    d = {"image": "img:1", "model": {"path": "/models/MiniMax-H3",
                                     "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
         "gateway": {"auth": {"disabled": True}}}
    for k, v in over.items():
        d[k] = v
    return d


def messages(d: dict, name: str | None = "h3") -> list[str]:
    return [m for _, m in validate(H3DeploymentSpec.from_dict(d), name)]


def fields(d: dict) -> list[str]:
    return [f for f, _ in validate(H3DeploymentSpec.from_dict(d), "h3")]


def test_defaults_and_round_trip():
    s = H3DeploymentSpec.from_dict(base())
    assert (s.profile, s.placement, s.transport, s.gpus_per_node, s.gpu_resource_name) == \
        ("base", "colocated", "grpc", 8, "nvidia.com/gpu")
    assert (s.encoder.tensor_parallel, s.dit.ulysses, s.dit.ring, s.vae.patch_parallel) == (1, 1, 1, 1)
    assert s.stage_replicas("dit") == 1 and s.gateway.replicas is None and s.model.mount_path == "/models"
    # one gateway unless a job store lets several share their jobs
    assert H3DeploymentSpec.from_dict(base(placement="disaggregated")).stage_replicas("gateway") == 1
    shared = base(placement="disaggregated",
                  gateway={"auth": {"disabled": True}, "jobStore": {"s3": {"bucket": "b1b", "credentialsSecret": "c"}}})
    assert H3DeploymentSpec.from_dict(shared).stage_replicas("gateway") == 2 and validate(
        H3DeploymentSpec.from_dict(shared), "h3") == []
    assert validate(s, "h3") == []
    again = H3DeploymentSpec.from_dict(s.to_dict())
    assert again == s
    assert s.to_dict()["replicas"] == 1  # always present: the CRD's /scale reads and writes it


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(path):
    doc = yaml.safe_load(path.read_text())
    spec = parse_and_validate(doc["spec"], doc["metadata"]["name"])
    assert spec.profile in ("base", "fasth3") and spec.placement in ("colocated", "disaggregated")


def test_examples_cover_each_profile_and_placement():
    seen = {(yaml.safe_load(p.read_text())["spec"]["profile"], yaml.safe_load(p.read_text())["spec"]["placement"])
            for p in EXAMPLES}
    assert seen == {(p, q) for p in ("base", "fasth3") for q in ("colocated", "disaggregated")}


def _runtime_accepts(**degrees) -> bool:
    try:
        ParallelDegrees(**degrees).validate()
    except DegreeError:
        return False
    return True


@pytest.mark.parametrize("tp", range(1, 65))
def test_encoder_tp_is_the_runtime_rule(tp):
    # divides the 64 query heads, and divides the 8 KV heads or is a multiple of them: what the runtime accepts
    d = base(placement="disaggregated", gpusPerNode=64, encoder={"tensorParallel": tp})
    msgs = [m for m in messages(d) if m.startswith(f"encoder.tensorParallel={tp} cannot split")]
    assert (not msgs) == _runtime_accepts(encoder_tp=tp) == (64 % tp == 0 and (8 % tp == 0 or tp % 8 == 0))
    if msgs:
        assert msgs == [f"encoder.tensorParallel={tp} cannot split the encoder's 64 query heads / 8 KV heads (it must "
                        f"divide the heads, and divide the KV heads or be a multiple of them): use 1, 2, 4, 8, 16, 32 "
                        f"or 64"]
    assert encoder_tp_choices() == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("u,r", [(u, r) for u in (1, 2, 3, 4, 7, 8, 14) for r in (1, 2, 4, 5)])
def test_dit_ulysses_divides_56_heads_and_ring_is_free(u, r):
    d = base(placement="disaggregated", gpusPerNode=64, dit={"ulysses": u, "ring": r})
    bad = [m for m in messages(d) if "56 attention heads" in m]
    assert (not bad) == _runtime_accepts(ulysses=u, ring=r) == (56 % u == 0)
    if bad:
        assert bad == [f"dit.ulysses={u} must divide the DiT's 56 attention heads (Ulysses gives each rank whole "
                       f"heads): use 1, 2, 4, 7, 8, 14, 28 or 56 and put the rest of the DiT's GPUs into dit.ring "
                       f"(dit.ulysses x dit.ring = GPUs of the DiT)"]
    assert ulysses_choices() == [1, 2, 4, 7, 8, 14, 28, 56]


def test_ulysses_8_ring_2_is_a_16_gpu_dit():
    s = parse_and_validate(base(placement="disaggregated", dit={"ulysses": 8, "ring": 2}, vae={"patchParallel": 16}))
    assert s.stage_gpus("dit") == 16 and s.pods_per_replica(16) == 2
    assert _runtime_accepts(ulysses=8, ring=2, vae_pp=16)


@pytest.mark.parametrize("pp,ok", [(1, True), (8, True), (2, False), (4, False), (16, False)])
def test_vae_pp_is_one_or_the_whole_dit_group(pp, ok):
    d = base(placement="disaggregated", dit={"ulysses": 8}, vae={"patchParallel": pp})
    msgs = messages(d)
    want = f"vae.patchParallel={pp} must be 1 or the whole DiT group (dit.ulysses x dit.ring = 8)"
    assert (want not in msgs) if ok else (want in msgs)
    assert ok == _runtime_accepts(ulysses=8, vae_pp=pp)


def test_fasth3_needs_an_adapter_with_a_checksum():
    need = ("profile fasth3 needs model.adapter with path and sha256 (the FastH3 4-step adapter file and its "
            "checksum)")
    assert need in messages(base(profile="fasth3"))
    m = base(profile="fasth3")
    m["model"]["adapter"] = {"path": "/models/a.safetensors"}
    assert need in messages(m)
    m["model"]["adapter"]["sha256"] = SHA
    assert messages(m) == []


@pytest.mark.parametrize("gone", [("model", "offload"), ("model", "allowRequestLora"), ("dit", "gpus")])
def test_fields_nothing_acts_on_are_gone(gone):
    d = base()
    d.setdefault(gone[0], {})[gone[1]] = True if gone[1] != "gpus" else 8
    with pytest.raises(SpecError, match=f"unknown field spec.{gone[0]}.{gone[1]}"):
        H3DeploymentSpec.from_dict(d)


def test_replicas_belong_to_their_placement():
    # disaggregated, spec.replicas (the /scale subresource) is the DiT pool's count unless dit.replicas sets it
    s = H3DeploymentSpec.from_dict(base(placement="disaggregated", replicas=2))
    assert fields(s.to_dict()) == [] and [s.stage_replicas(st) for st in ("encoder", "dit", "vae", "muxer")] == [
        1, 2, 1, 1]
    assert H3DeploymentSpec.from_dict(base(placement="disaggregated", replicas=2, dit={"replicas": 3})
                                      ).stage_replicas("dit") == 3
    assert "spec.placement" in fields(base(placement="colocated", dit={"replicas": 2}))
    assert "spec.placement" in fields(base(placement="colocated", gateway={"replicas": 2}))
    assert fields(base(placement="colocated", replicas=3)) == ["spec.gateway.jobStore"]  # three gateways
    store = {"s3": {"bucket": "jobs", "credentialsSecret": "s3"}}
    assert fields(base(placement="colocated", replicas=3, gateway={"auth": {"disabled": True},
                                                                   "jobStore": store})) == []
    s = H3DeploymentSpec.from_dict(base(placement="disaggregated", dit={"replicas": 3}))
    assert s.stage_replicas("dit") == 3 and s.stage_replicas("encoder") == 1


def test_colocated_encoder_fits_the_replica_gpus():
    msgs = messages(base(encoder={"tensorParallel": 8}, dit={"ulysses": 4}))
    assert "encoder.tensorParallel=8 must divide the 4 GPUs of a colocated replica (dit.ulysses x dit.ring)" in msgs
    assert messages(base(encoder={"tensorParallel": 4}, dit={"ulysses": 8})) == []


def test_stage_larger_than_a_node_spans_whole_nodes():
    msgs = messages(base(placement="disaggregated", gpusPerNode=4, dit={"ulysses": 7, "ring": 2}))
    assert ("dit needs 14 GPUs, more than gpusPerNode=4: a stage larger than a node must span whole nodes (a multiple "
            "of gpusPerNode)") in msgs
    assert messages(base(placement="disaggregated", gpusPerNode=4, dit={"ulysses": 4, "ring": 2})) == []
    assert messages(base(placement="disaggregated", gpusPerNode=4, encoder={"tensorParallel": 8})) == []


def test_model_paths_inside_the_mount():
    d = base()
    d["model"]["path"] = "/weights/H3"
    assert "model.path /weights/H3 must be inside model.mountPath /models, where model.volume is mounted" in messages(d)
    d["model"].pop("volume")
    assert messages(d) == []  # weights baked into the image: any path


def test_unknown_fields_and_types_are_named():
    with pytest.raises(SpecError) as e:
        H3DeploymentSpec.from_dict({"image": "i", "model": {"path": "/m"}, "dit": {"ulyses": 2, "ring": "2"},
                                    "placement": "spread"})
    text = str(e.value)
    assert "unknown field spec.dit.ulyses (did you mean ulysses?)" in text
    assert "spec.dit.ring must be an integer" in text
    assert "spec.placement='spread' must be one of colocated, disaggregated" in text
    with pytest.raises(SpecError, match="spec.image is required"):
        H3DeploymentSpec.from_dict({"model": {"path": "/m"}})


def test_operator_only_rules():
    d = base(dit={"resources": {"limits": {"nvidia.com/gpu": 8}}})
    assert ("remove nvidia.com/gpu from dit.resources.limits: the operator sets the GPU count from the stage's "
            "parallel sizes") in messages(d)
    d = base()
    d["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "a"}, "nfs": {"server": "x", "path": "/"}}
    assert any(m.startswith("model.volume must name exactly one volume source") for m in messages(d))
    d = base(encoder={"resources": {"requests": {"cpu": "lots"}}})
    assert "'lots' is not a Kubernetes quantity (e.g. 4, 500m, 64Gi)" in messages(d)


@pytest.mark.parametrize("name,ok", [("h3", True), ("a" * 40, True), ("a" * 41, False), ("H3", False),
                                     ("3h", False), ("h3-", False)])
def test_names(name, ok):
    assert (messages(base(), name) == []) == ok


def test_every_rule_fires():
    # Each rule must fire for at least one spec of this table, reported on its field.
    bad_specs = [
        base(placement="disaggregated", encoder={"tensorParallel": 3}),
        base(dit={"ulysses": 3}),
        base(vae={"patchParallel": 2}, dit={"ulysses": 4}),
        base(profile="fasth3"),
        base(profile="fasth3", dit={"levers": {"fp8": True}}),
        base(dit={"ulysses": 2}, vae={"patchParallel": 2, "levers": {"staged": True}}),
        base(placement="disaggregated", replicas=1),
        base(vae={"replicas": 1}),
        base(encoder={"tensorParallel": 2}),
        base(gpusPerNode=4, dit={"ulysses": 7, "ring": 2}),
        base(placement="disaggregated", gpusPerNode=3, encoder={"tensorParallel": 4}, dit={"ulysses": 7}),
        base(model={"path": "/x", "volume": {"emptyDir": {}}}),
        base(model={"path": "/models/x", "volume": {"emptyDir": {}}, "adapter": {"path": "/y", "sha256": SHA}}),
        base(model={"path": "/models/x", "mountPath": "/models/./w"}),
        base(placement="disaggregated", **{st: {"replicas": 1, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
                                           for st in ("encoder", "dit", "vae", "muxer", "gateway")}),
        base(**{st: {"autoscaling": {"maxReplicas": 2}} for st in ("encoder", "dit", "vae", "muxer", "gateway")}),
        base(fasth3={"adapter": {"path": "/models/../f"}, "ulysses": 3, "ring": 3}),  # profile-free rules
        base(profile="fasth3", fasth3={"adapter": {"path": "/f", "sha256": SHA}}),
        base(dit={"loras": [{"name": "a", "path": "/elsewhere/../a", "sha256": SHA}]}),
    ]
    fired = set()
    for d in bad_specs:
        fired |= set(fields(copy.deepcopy(d)))
    wanted = {f"spec.{r.field}" for r in RULES}
    assert wanted <= fired, wanted - fired


def test_service_config_round_trip():
    s = H3DeploymentSpec.from_dict(base())
    c = ServiceConfig(name="h3", namespace="ns", spec=s, endpoints={"dit": "h3-engine.ns.svc:50051"}, dtype="bf16",
                      device="cuda")
    d = c.to_dict()
    assert ServiceConfig.from_dict(d) == c
    assert d["ports"]["grpc"] == 50051 and d["health"] == {"service": ""}


def test_spec_module_imports_no_serving_stack():
    import subprocess
    import sys

    code = ("import sys, h3serve.config.spec, h3serve.config.stage; bad = [m for m in ('kopf', 'grpc', 'av', 'torch', 'kubernetes') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_tasks_and_the_encoder_cache_reach_the_stages_that_read_them(placement):
    from h3serve.config.stage import StageConfig
    from h3serve.config.vocab import DEFAULT_TASKS, ENCODER_CACHE_BYTES

    spec = H3DeploymentSpec.from_dict(base(placement=placement, tasks="t2va,ref2va", encoder={"cacheBytes": 0}))
    sc = ServiceConfig("h3", "ns", spec, {s: f"{s}:1" for s in ("encoder", "dit", "vae", "muxer")}, "bf16",
                       "cuda").to_dict()
    dit, gateway, encoder = (StageConfig.from_service_config(sc, s) for s in ("dit", "gateway", "encoder"))
    assert dit.model.tasks == gateway.model.tasks == "t2va,ref2va"
    assert dit.model.tasks_for() == ("t2va", "ref2va") and encoder.model.encoder_cache_bytes == 0
    if placement == "disaggregated":  # a stage reads only its own knobs
        assert encoder.model.tasks == DEFAULT_TASKS and dit.model.encoder_cache_bytes == ENCODER_CACHE_BYTES
    assert H3DeploymentSpec.from_dict(base()).tasks == DEFAULT_TASKS


@pytest.mark.parametrize("tasks", ["t2va,foo", "", "t2va,,fl2va", "T2VA"])
def test_bad_tasks_are_refused_naming_the_field(tasks):
    with pytest.raises(SpecError, match=r"spec\.tasks="):
        H3DeploymentSpec.from_dict(base(tasks=tasks))
