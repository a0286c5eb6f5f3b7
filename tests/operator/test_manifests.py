"""The pure renderer: golden files, `kubernetes-validate --strict` on every object, and the properties that matter.

Regenerate the golden files after an intended change with:  H3SERVE_UPDATE_GOLDEN=1 pytest tests/operator/test_manifests.py
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from h3serve.config.levers import Levers
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.vocab import FASTH3_DIT
from h3serve.operator import manifests as M
from h3serve.config.spec import H3DeploymentSpec, ServiceConfig, SpecError, parse_and_validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
OWNER = {"name": "", "uid": "6f1c1a57-0000-4000-8000-000000000001"}
K8S_VERSION = "1.37.0"
CRD_KINDS = ("Certificate",)  # cert-manager's


def render_example(path: pathlib.Path, namespace: str = "h3") -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    name = doc["metadata"]["name"]
    spec = parse_and_validate(doc["spec"], name)
    return M.render(spec, name, namespace, owner={**OWNER, "name": name})


def pods(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o, o["spec"]["template"]["spec"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden(path):
    got = M.to_yaml(render_example(path))
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("H3SERVE_UPDATE_GOLDEN") or not golden.exists():
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
        if not os.environ.get("H3SERVE_UPDATE_GOLDEN"):
            pytest.fail(f"wrote missing golden file {golden}; review and commit it")
    assert got == golden.read_text(), f"{golden.name} differs; if intended, rerun with H3SERVE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_object_passes_kubernetes_validate_strict(path):
    for obj in render_example(path):
        if obj["kind"] in CRD_KINDS:  # not Kubernetes' own: kubernetes-validate has no schema for it
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kubernetes_validate_cli_strict(tmp_path):
    files = []
    for path in EXAMPLES:
        f = tmp_path / path.name
        f.write_text(M.to_yaml([o for o in render_example(path) if o["kind"] not in CRD_KINDS]))
        files.append(str(f))
    exe = pathlib.Path(sys.executable).with_name("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "--quiet", "-k", K8S_VERSION, *files], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_render_is_deterministic_and_pure():
    p = EXAMPLES[0]
    a, b = render_example(p), render_example(p)
    assert a == b
    doc = yaml.safe_load(p.read_text())
    spec = H3DeploymentSpec.from_dict(doc["spec"])
    before = copy.deepcopy(spec.to_dict())
    M.render(spec, "x", "ns")
    assert spec.to_dict() == before


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_owner_references_labels_and_namespace_on_every_object(path):
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    for o in render_example(path, namespace="apps"):
        md = o["metadata"]
        assert md["namespace"] == "apps"
        assert md["ownerReferences"] == [{"apiVersion": "h3serve.io/v1alpha1", "kind": "H3Deployment", "name": name,
                                          "uid": OWNER["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert md["labels"][M.LABEL_INSTANCE] == name and md["labels"][M.LABEL_MANAGED_BY] == "h3serve-operator"
        assert len(md["name"]) <= 63


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_pods_meet_restricted_pod_security(path):
    spec = H3DeploymentSpec.from_dict(yaml.safe_load(path.read_text())["spec"])
    for w, pod in pods(render_example(path)):
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
            for kind in ("startupProbe", "readinessProbe"):  # SERVING = loaded + warmed up; NOT_SERVING: draining
                p = c[kind]
                if "grpc" in p:  # plaintext: the kubelet's own gRPC probe
                    assert p["grpc"] == {"port": 50051, "service": ""}
                else:  # TLS: the exec probe with the pod's certificate
                    cmd = p["exec"]["command"]
                    assert cmd[:3] == M.PROBE and "--live" not in cmd and "--tls-cert" in cmd, cmd
            live = c["livenessProbe"]["exec"]["command"]  # a draining server (NOT_SERVING) is alive; a hung one not
            assert live[:3] == M.PROBE and "--live" in live
            # killed for liveness = hung: no drain to wait for (the pod's grace would be spent on a stopped process)
            assert c["livenessProbe"]["terminationGracePeriodSeconds"] < pod["terminationGracePeriodSeconds"]
        for v in pod["volumes"]:  # restricted: only these volume types
            assert set(v) - {"name"} <= {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected",
                                         "csi", "downwardAPI", "ephemeral"}
        assert pod["terminationGracePeriodSeconds"] == spec.drain_seconds + 30  # a long request drains


def test_colocated_one_pod_per_replica_with_every_stage():
    d = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())
    d["spec"]["replicas"] = 3
    spec = parse_and_validate(d["spec"], "h3")
    objs = M.render(spec, "h3", "ns")
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    assert set(deps) == {"h3-engine"}  # the gateway runs in each replica pod
    eng = deps["h3-engine"]
    assert eng["spec"]["replicas"] == 3
    c = eng["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 == c["resources"]["requests"]["nvidia.com/gpu"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["WORLD_SIZE"] == "8" and env["MASTER_ADDR"] == "127.0.0.1" and env["RANK"] == "0"
    assert c["command"][:4] == ["h3serve", "serve", "--stages", "all"]
    shm = [v for v in eng["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert not any(o["kind"] == "StatefulSet" for o in objs)
    # the front door selects the engine pods; the stages talk over loopback inside the pod
    svc = [o for o in objs if o["kind"] == "Service"]
    assert [x["metadata"]["name"] for x in svc] == ["h3-gateway"]
    assert svc[0]["spec"]["selector"][M.LABEL_COMPONENT] == "engine"
    assert [p["port"] for p in svc[0]["spec"]["ports"]] == [50051, 8000]
    cfg = ServiceConfig.from_dict(yaml.safe_load([o for o in objs if o["kind"] == "ConfigMap"][0]["data"]["h3serve.yaml"]))
    assert cfg.endpoints == {"encoder": "127.0.0.1:50052", "dit": "127.0.0.1:50053", "vae": "127.0.0.1:50054",
                             "muxer": "127.0.0.1:50055", "gateway": "h3-gateway.ns.svc:50051"}


def test_disaggregated_one_workload_and_service_per_stage():
    objs = render_example(ROOT / "examples" / "base-disaggregated.yaml", "ns")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for st in ("encoder", "dit", "vae", "muxer", "gateway"):
        assert ("Deployment", f"h3-split-{st}") in kinds and ("Service", f"h3-split-{st}") in kinds
        # a PDB only where it protects something: more than one replica
        assert (("PodDisruptionBudget", f"h3-split-{st}") in kinds) == (st == "gateway")
    gpus = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
            .get("nvidia.com/gpu") for o in objs if o["kind"] == "Deployment"}
    assert gpus == {"h3-split-encoder": 2, "h3-split-dit": 8, "h3-split-vae": 8, "h3-split-muxer": None,
                    "h3-split-gateway": None}


def test_gang_statefulset_headless_service_and_rank_wiring():
    objs = render_example(ROOT / "examples" / "fasth3-disaggregated.yaml", "ns")
    sts = [o for o in objs if o["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sts] == ["fasth3-split-dit-0"]
    s = sts[0]
    assert s["spec"]["replicas"] == 2 and s["spec"]["podManagementPolicy"] == "Parallel"
    headless = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == s["spec"]["serviceName"]][0]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    c = s["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["MASTER_ADDR"] == "fasth3-split-dit-0-0.fasth3-split-dit-0.ns.svc"
    assert env["WORLD_SIZE"] == "8" and env["NNODES"] == "2" and env["NPROC_PER_NODE"] == "4"
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "RANK=$((NODE_RANK * NPROC_PER_NODE))" in c["command"][2]
    assert c["args"][:4] == ["h3serve", "serve", "--stages", "dit"]
    # the stage Service reaches gang leaders only (ordinal 0)
    svc = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "fasth3-split-dit"][0]
    assert svc["spec"]["selector"][M.LABEL_POD_INDEX] == "0"


def test_gang_shell_computes_the_rank():
    objs = render_example(ROOT / "examples" / "fasth3-disaggregated.yaml", "ns")
    c = [o for o in objs if o["kind"] == "StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]
    argv = c["command"] + ["sh", "-c", 'echo "$RANK"']  # the container's args replaced by a probe
    r = subprocess.run(argv, env={"NODE_RANK": "1", "NPROC_PER_NODE": "4", "PATH": os.environ["PATH"]},
                       capture_output=True, text=True)
    assert r.stdout.strip() == "4", r.stderr


def test_scaling_gangs_adds_statefulsets():
    d = yaml.safe_load((ROOT / "examples" / "fasth3-disaggregated.yaml").read_text())
    d["spec"]["dit"]["replicas"] = 3
    objs = M.render(parse_and_validate(d["spec"], "f"), "f", "ns")
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"] == ["f-dit-0", "f-dit-1", "f-dit-2"]




def test_a_gangs_podgroup_carries_its_size_and_priority_and_a_new_spec_is_a_new_podgroup():
    """The scheduler places a group only at its pods' priority, and a PodGroup's spec is immutable: each gang's pods
    name a PodGroup of their priority class, and a new gang size or class is a PodGroup of another name."""
    d = yaml.safe_load((ROOT / "examples" / "fasth3-disaggregated.yaml").read_text())

    def groups(**spec):
        objs = M.render(parse_and_validate({**d["spec"], **spec}, "f"), "f", "ns")
        dit = [o for o in objs if o["metadata"]["labels"].get(M.LABEL_COMPONENT) == "dit"]
        sts = [o for o in dit if o["kind"] == "StatefulSet"]
        pgs = {o["metadata"]["name"]: o["spec"] for o in dit if o["kind"] == "PodGroup"}
        assert [s["spec"]["template"]["spec"]["schedulingGroup"]["podGroupName"] for s in sts] == list(pgs)
        assert all(g.startswith(f"{s['metadata']['name']}-") for g, s in zip(pgs, sts))
        return pgs

    plain, prio, smaller = groups(), groups(priorityClassName="batch"), groups(gpusPerNode=2)
    assert [g["schedulingPolicy"]["gang"]["minCount"] for g in plain.values()] == [2]
    assert [g.get("priorityClassName") for g in (*plain.values(), *prio.values())] == [None, "batch"]
    assert [g["schedulingPolicy"]["gang"]["minCount"] for g in smaller.values()] == [4]
    assert len(set(plain) | set(prio) | set(smaller)) == 3
    assert groups() == plain  # named by its spec alone


def test_a_surge_gang_is_one_more_gang_of_its_own_and_counts_in_the_budget():
    """dit.rollout.maxSurge 1: a rolling update may render `<name>-dit-s`, a gang like the others (its own
    headless Service, PodGroup and world, the same pod template but for its name); the budget counts it, so a drain
    can never take an old whole gang for it. maxSurge 0, a one-node replica or no surge asked: nothing more."""
    d = yaml.safe_load((ROOT / "examples" / "fasth3-disaggregated.yaml").read_text())["spec"]
    d["dit"]["replicas"] = 2
    spec = parse_and_validate(d, "f")
    plain, objs = M.render(spec, "f", "ns"), M.render(spec, "f", "ns", surge=frozenset({"dit"}))
    keys = lambda objs: {(o["kind"], o["metadata"]["name"]) for o in objs}  # noqa: E731
    extra = keys(objs) - keys(plain)
    group = next(n for k, n in extra if k == "PodGroup")
    assert extra == {("StatefulSet", "f-dit-s"), ("Service", "f-dit-s"), ("PodGroup", group)}
    sts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    s, g0 = sts["f-dit-s"], sts["f-dit-0"]
    assert s["metadata"]["labels"][M.LABEL_SURGE] == "true" and M.LABEL_SURGE not in g0["metadata"]["labels"]
    assert s["spec"]["template"]["spec"]["schedulingGroup"]["podGroupName"] == group
    assert json.loads(json.dumps(g0["spec"]).replace("f-dit-0", "f-dit-s")) == s["spec"]  # the PodGroup's too
    pdb = lambda objs: next(o["spec"]["minAvailable"] for o in objs  # noqa: E731
                            if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "f-dit")
    assert (pdb(plain), pdb(objs)) == (3, 5)  # one pod of 2 or of 3 gangs of 2 may go
    d["dit"]["replicas"] = 1  # one replica: no budget but while the surge gang runs beside it
    one = parse_and_validate(d, "f")
    assert not [o for o in M.render(one, "f", "ns") if o["kind"] == "PodDisruptionBudget"
                and o["metadata"]["name"] == "f-dit"]
    assert pdb(M.render(one, "f", "ns", surge=frozenset({"dit"}))) == 3
    for other in (parse_and_validate({**d, "dit": {**d["dit"], "rollout": {"maxSurge": 0}}}, "f"),
                  parse_and_validate({**d, "gpusPerNode": 8}, "f")):
        assert M.render(other, "f", "ns", surge=frozenset({"dit"})) == M.render(other, "f", "ns")
    # the fasth3 pool's surge gang fits the name limit its gangs are checked against
    d = {**_spec_doc("base-disaggregated"), "gpusPerNode": 2, "fasth3": {**FAST, "replicas": 10},
         "dit": {"ulysses": 2, "ring": 1}, "vae": {"patchParallel": 1}}
    name = "a" * 39
    names = [o["metadata"]["name"] for o in M.render(parse_and_validate(d, name), name, "ns",
                                                     surge=frozenset({FASTH3_DIT})) if o["kind"] == "StatefulSet"]
    assert f"{name}-{FASTH3_DIT}-s" in names and max(map(len, names)) == 52


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_pods_read_their_stage_config_from_the_mounted_service_config(path, tmp_path):
    """Every container's argv parses with the real CLI; with the rendered ServiceConfig mounted, each process it
    starts gets the StageConfig it needs (degrees, profile, adapter, dtype, ports, peer addresses)."""
    from h3serve.cli import build_parser
    from h3serve.config.stage import COMPONENT_ENV, CONFIG_ENV
    from h3serve.runtime.prechecks import config_from_args, parse_stages

    parser = build_parser()
    doc = yaml.safe_load(path.read_text())
    name = doc["metadata"]["name"]
    spec = parse_and_validate(doc["spec"], name)
    objs = render_example(path)
    cfg = tmp_path / "h3serve.yaml"
    cfg.write_text([o for o in objs if o["kind"] == "ConfigMap"][0]["data"]["h3serve.yaml"])
    colocated = spec.placement == "colocated"
    for w, pod in pods(objs):
        c = pod["containers"][0]
        argv = c.get("args") or c["command"]
        assert argv[:2] == ["h3serve", "serve"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[CONFIG_ENV] == M.CONFIG_PATH
        environ = {CONFIG_ENV: str(cfg), COMPONENT_ENV: env[COMPONENT_ENV]}
        # the FastH3 pool's pods run a DiT process of profile fasth3 with the pool's adapter and degrees
        pool = spec.fasth3 if env[COMPONENT_ENV] == "dit-fasth3" else None
        assert not {"--ulysses", "--ring", "--encoder-tp", "--vae-pp", "--profile", "--dtype"} & set(argv)
        ns = parser.parse_args(argv[1:])
        comp = w["metadata"]["labels"][M.LABEL_COMPONENT]
        # the processes of this pod: one stage, or (colocated) every stage under the launcher
        for stage in parse_stages(ns.stages):
            sc = config_from_args(ns, stage, environ)
            assert (sc.stage, sc.server.host, sc.model.profile, sc.server.grace_s) == (
                stage, "0.0.0.0", "fasth3" if pool else spec.profile, spec.drain_seconds)
            assert spec.drain_seconds <= pod["terminationGracePeriodSeconds"] - 30
            assert sc.server.port == 50051 + (M.PORT_OFFSETS[stage] if colocated else 0)
            if pool is not None:
                assert (sc.model.checkpoint, sc.model.dtype, sc.model.device) == (spec.model.path, "bf16", "cuda")
                assert sc.degrees == ParallelDegrees(ulysses=pool.ulysses, ring=pool.ring)
                assert (sc.model.adapter, sc.model.adapter_sha256) == (pool.adapter.path, pool.adapter.sha256)
                # the base DiT's lossless levers, none of the lossy ones FastH3 refuses
                dit = spec.dit.levers
                assert sc.levers == Levers(resident_blocks=dit.resident_blocks, offload_mode=dit.offload_mode,
                                           adaln_table=dit.adaln_table)
            elif colocated or stage in ("encoder", "dit", "vae"):
                assert (sc.model.checkpoint, sc.model.dtype, sc.model.device) == (spec.model.path, M.DEVICE_DTYPES[spec.device],
                                                                 spec.device)
                # each stage reads its own degrees (the VAE also the DiT group its patch parallel is checked
                # against); the others keep their defaults of 1
                own = {"encoder": ("encoder_tp",), "dit": ("ulysses", "ring"), "vae": ("vae_pp", "ulysses", "ring")}
                spec_degrees = {"encoder_tp": spec.encoder.tensor_parallel, "ulysses": spec.dit.ulysses,
                                "ring": spec.dit.ring, "vae_pp": spec.vae.patch_parallel}
                for k, v in spec_degrees.items():
                    assert getattr(sc.degrees, k) == (v if colocated or k in own[stage] else 1), (stage, k)
            if (colocated or stage == "dit") and spec.profile == "fasth3" and pool is None:
                assert (sc.model.adapter, sc.model.adapter_sha256) == (spec.model.adapter.path, spec.model.adapter.sha256)
            if colocated or stage == "muxer":
                assert sc.media.mux_threads == spec.muxer.workers
            # every end of a tensor edge (and the gateway, which picks the plan) runs the deployment's transport
            assert sc.server.transport == (spec.transport if stage != "encoder" else "grpc")
            if stage == "gateway":
                assert (sc.gateway.http_host, sc.gateway.http_port, sc.gateway.queue_size) == ("0.0.0.0", 8000, spec.gateway.queue_size)
                want = (f"127.0.0.1:{50051 + M.PORT_OFFSETS['dit']}" if colocated else f"dns:///{name}-dit-headless.h3.svc:50051")
                assert sc.gateway.dit == want
                assert sc.gateway.fasth3_dit == (f"dns:///{name}-dit-fasth3-headless.h3.svc:50051" if spec.fasth3 else None)
            if not colocated and stage != "gateway":  # peers reach this very pod
                assert sc.server.advertise == "$(POD_IP):50051"
        if comp == "engine":
            assert ns.stages == "all"


def test_stage_config_is_a_slice_of_the_rendered_service_config():
    from h3serve.config.stage import StageConfig

    doc = yaml.safe_load((ROOT / "examples" / "fasth3-disaggregated.yaml").read_text())
    spec = parse_and_validate(doc["spec"], "f")
    d = M.service_config(spec, "f", "ns").to_dict()
    common = dict(host="0.0.0.0", port=50051, profile="fasth3", grace_s=900.0)
    fenced = dict(common, no_peer_auth=True)   # no spec.tls: the NetworkPolicies fence the stages' ports
    model = dict(checkpoint="/models/MiniMax-H3", dtype="bf16", device="cuda")
    assert StageConfig.from_service_config(d, "encoder") == StageConfig.from_knobs(stage="encoder", **fenced, **model,
                                                                        degrees=ParallelDegrees(encoder_tp=4))
    assert StageConfig.from_service_config(d, "dit") == StageConfig.from_knobs(
        stage="dit", **fenced, **model, degrees=ParallelDegrees(ulysses=4, ring=2), adapter=spec.model.adapter.path,
        adapter_sha256=spec.model.adapter.sha256, transport="nixl")
    assert StageConfig.from_service_config(d, "vae") == StageConfig.from_knobs(stage="vae", **fenced, **model,
                                                                    degrees=ParallelDegrees(ulysses=4, ring=2),
                                                                    transport="nixl")
    assert StageConfig.from_service_config(d, "muxer") == StageConfig.from_knobs(stage="muxer", **fenced, mux_threads=8,
                                                                       transport="nixl")
    assert StageConfig.from_service_config(d, "gateway") == StageConfig.from_knobs(
        stage="gateway", **common, transport="nixl", http_host="0.0.0.0", http_port=8000, queue_size=16,
        api_keys_file="/etc/h3serve-keys/keys", job_store="s3://h3-jobs/h3-fast",
        **{st: f"dns:///f-{st}-headless.ns.svc:50051" for st in ("encoder", "dit", "vae", "muxer")})


def test_without_the_service_config_argv_alone_configures_the_stage():
    from h3serve.cli import build_parser
    from h3serve.runtime.prechecks import config_from_args

    ns = build_parser().parse_args(["serve", "--stages", "dit", "--checkpoint", "/c", "--ulysses", "2"])
    sc = config_from_args(ns, "dit", {})
    assert (sc.model.checkpoint, sc.degrees.ulysses, sc.model.dtype, sc.server.port) == ("/c", 2, "fp32", 50051)


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ('{"spec":', "cannot read"),
                                           ('{"name": "x"}', "not a ServiceConfig")])
def test_an_unreadable_service_config_is_one_line_naming_the_variable(tmp_path, content, says):
    from h3serve.cli import build_parser
    from h3serve.config.stage import CONFIG_ENV
    from h3serve.errors import H3Error
    from h3serve.runtime.prechecks import config_from_args

    path = tmp_path / "service.json"
    if content is not None:
        path.write_text(content)
    ns = build_parser().parse_args(["serve", "--stages", "dit"])
    with pytest.raises(H3Error, match=f"{CONFIG_ENV}={path}: {says}"):
        config_from_args(ns, "dit", {CONFIG_ENV: str(path)})


def test_network_policies_expose_only_the_gateway():
    objs = render_example(ROOT / "examples" / "base-disaggregated.yaml", "ns")
    nps = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    stages, gw = nps["h3-split-stages"], nps["h3-split-gateway"]
    assert stages["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        M.LABEL_NAME: "h3serve", M.LABEL_INSTANCE: "h3-split"}}}]}]
    assert {"key": M.LABEL_COMPONENT, "operator": "NotIn", "values": ["gateway", "engine"]} in \
        stages["podSelector"]["matchExpressions"]
    assert {"key": M.LABEL_COMPONENT, "operator": "In", "values": ["gateway", "engine"]} in \
        gw["podSelector"]["matchExpressions"]
    open_rule = [r for r in gw["ingress"] if "from" not in r][0]
    assert sorted(p["port"] for p in open_rule["ports"]) == [8000, 50051]


def test_config_change_rolls_pods():
    d = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())
    a = M.render(parse_and_validate(d["spec"], "h3"), "h3", "ns")
    d["spec"]["muxer"]["workers"] = 3
    b = M.render(parse_and_validate(d["spec"], "h3"), "h3", "ns")
    h = lambda objs: [o["spec"]["template"]["metadata"]["annotations"][M.ANN_CONFIG_HASH]  # noqa: E731
                      for o in objs if o["kind"] == "Deployment"]
    assert all(x != y for x, y in zip(h(a), h(b)))


def test_cli_render(tmp_path):
    r = subprocess.run([sys.executable, "-m", "h3serve.operator.cli", "render", "-f",
                        str(ROOT / "examples" / "fasth3-colocated.yaml"), "-n", "apps", "--crd"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert docs[0]["kind"] == "CustomResourceDefinition"
    assert all(d["metadata"].get("namespace") == "apps" for d in docs[1:])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "h3serve.io/v1alpha1", "kind": "H3Deployment",
                                   "metadata": {"name": "b"}, "spec": {"image": "i", "model": {"path": "/m"},
                                                                       "dit": {"ulysses": 3}}}))
    r = subprocess.run([sys.executable, "-m", "h3serve.operator.cli", "render", "-f", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "dit.ulysses=3 must divide" in r.stderr and not r.stdout


def _templates(spec_doc: dict, name: str = "h3") -> dict[str, dict]:
    """workload name -> its pod template (what the workload controller compares to decide on a rollout)."""
    objs = M.render(parse_and_validate(spec_doc, name), name, "ns")
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")}


def _changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if k in b and a[k] != b[k]}


ROLLOUT_CASES = {  # spec change on the disaggregated example -> the workloads whose pods must roll
    "dit-replicas": ({"dit": {"replicas": 3}}, set()),
    "every-replica-count": ({"encoder": {"replicas": 2}, "vae": {"replicas": 4}, "muxer": {"replicas": 3},
                             "gateway": {"replicas": 5}, "dit": {"replicas": 2}}, set()),
    "vae-resources": ({"vae": {"resources": {"requests": {"cpu": "4"}}}}, {"h3-split-vae"}),
    "muxer-workers": ({"muxer": {"workers": 4}}, {"h3-split-muxer"}),
    "gateway-queue": ({"gateway": {"queueSize": 64}}, {"h3-split-gateway"}),
    "dit-tolerations": ({"dit": {"tolerations": []}}, {"h3-split-dit"}),
    # a stage reads its own degrees; the VAE also the DiT group (its patch parallel is 1 or the whole group)
    "ulysses": ({"dit": {"ulysses": 2}, "vae": {"patchParallel": 4}}, {"h3-split-dit", "h3-split-vae"}),
    "encoder-tp": ({"encoder": {"tensorParallel": 4}}, {"h3-split-encoder"}),  # no DiT weight reload
    "transport": ({"transport": "nixl"}, {"h3-split-dit", "h3-split-vae", "h3-split-muxer", "h3-split-gateway"}),
    "image": ({"image": "registry.example/h3serve:0.2.0"}, {"h3-split-encoder", "h3-split-dit", "h3-split-vae",
                                                            "h3-split-muxer", "h3-split-gateway"}),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
def test_a_change_rolls_only_the_stages_that_consume_it(case):
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    patch, want = ROLLOUT_CASES[case]
    e = copy.deepcopy(d)
    for k, v in patch.items():
        e[k] = {**e[k], **v} if isinstance(v, dict) else v
    assert _changed(_templates(d, "h3-split"), _templates(e, "h3-split")) == want


def test_colocated_replicas_restart_nothing():
    d = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())["spec"]
    e = {**d, "replicas": 4}
    assert _changed(_templates(d), _templates(e)) == set()


def _pdbs(doc_spec: dict, name: str = "h3") -> dict[str, dict]:
    objs = M.render(parse_and_validate(doc_spec, name), name, "ns")
    return {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "PodDisruptionBudget"}


def test_pdbs_only_where_replicas_exceed_one_with_min_available():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    assert set(_pdbs(d)) == {"h3-gateway"} and _pdbs(d)["h3-gateway"]["minAvailable"] == 1
    d["dit"]["replicas"], d["gpusPerNode"] = 3, 4  # a DiT replica = a gang of 2 pods: one pod of one gang may go
    p = _pdbs(d)
    assert p["h3-dit"]["minAvailable"] == 5 and "maxUnavailable" not in p["h3-dit"]
    c = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())["spec"]
    assert _pdbs(c) == {}
    assert _pdbs({**c, "replicas": 2})["h3-engine"]["minAvailable"] == 1


def test_cpu_stages_do_not_take_the_gpu_tolerations():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    d["nodeSelector"] = {"pool": "gpu"}
    t = _templates(d, "h3-split")
    for st in ("encoder", "dit", "vae"):
        assert t[f"h3-split-{st}"]["spec"]["tolerations"] == d["tolerations"]
        assert t[f"h3-split-{st}"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    for st in ("muxer", "gateway"):
        assert "tolerations" not in t[f"h3-split-{st}"]["spec"] and "nodeSelector" not in t[f"h3-split-{st}"]["spec"]
    d["gateway"]["tolerations"] = [{"key": "edge", "operator": "Exists"}]
    assert _templates(d, "h3-split")["h3-split-gateway"]["spec"]["tolerations"] == [{"key": "edge", "operator": "Exists"}]


def _gateway_policy(doc_spec: dict) -> dict:
    objs = M.render(parse_and_validate(doc_spec, "h3"), "h3", "ns")
    return next(o["spec"] for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "h3-gateway")


def test_gateway_ingress_limited_to_namespaces_and_cidrs():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    assert _gateway_policy(d)["ingress"][0] == {"ports": [{"port": 50051, "protocol": "TCP"},
                                                          {"port": 8000, "protocol": "TCP"}]}  # anyone
    d["gateway"]["ingressFrom"] = {"namespaces": ["web", "api"], "cidrs": ["10.1.0.0/16"]}
    door = _gateway_policy(d)["ingress"][0]
    assert door["from"] == [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["api", "web"]}]}},
        {"ipBlock": {"cidr": "10.1.0.0/16"}}]
    d["gateway"]["ingressFrom"] = {}  # nobody from outside the instance
    assert _gateway_policy(d)["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        M.LABEL_NAME: "h3serve", M.LABEL_INSTANCE: "h3"}}}]}]
    d["gateway"]["ingressFrom"] = {"cidrs": ["10.1.0.0/99"], "namespaces": ["Bad_NS"]}
    with pytest.raises(SpecError) as e:
        parse_and_validate(d, "h3")
    assert [f for f, _ in e.value.issues] == ["spec.gateway.ingressFrom.cidrs[0]", "spec.gateway.ingressFrom.namespaces[0]"]
    assert "'10.1.0.0/99' is not an IP range such as 10.0.0.0/16" in str(e.value)


def test_autoscaled_stage_gets_an_hpa_on_its_signal_and_no_replica_count():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    d["dit"] = {**d["dit"], "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "target": "90"}}
    d["gateway"] = {**d["gateway"], "autoscaling": {"maxReplicas": 4, "scaleDownStabilizationSeconds": 30}}
    del d["gateway"]["replicas"]
    objs = M.render(parse_and_validate(d, "h3"), "h3", "ns")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert "replicas" not in by[("Deployment", "h3-dit")]["spec"]  # the HPA owns it
    assert by[("Deployment", "h3-vae")]["spec"]["replicas"] == 1
    hpa = by[("HorizontalPodAutoscaler", "h3-dit")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "h3-dit"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": "h3serve_dit_queued_step_seconds"},
                                                        "target": {"type": "AverageValue", "averageValue": "90"}}}]
    gw = by[("HorizontalPodAutoscaler", "h3-gateway")]["spec"]
    assert [m["pods"]["metric"]["name"] for m in gw["metrics"]] == ["h3serve_queue_depth", "h3serve_rtf"]
    assert gw["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 30}}
    assert by[("PodDisruptionBudget", "h3-dit")]["spec"]["minAvailable"] == 1  # minReplicas - 1
    assert ("HorizontalPodAutoscaler", "h3-vae") not in by
    for o in objs:
        if o["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_autoscaling_refused_for_a_multi_node_gang():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    d["gpusPerNode"] = 4
    d["dit"] = {"ulysses": 4, "ring": 2, "autoscaling": {"maxReplicas": 3}}
    with pytest.raises(SpecError) as e:
        parse_and_validate(d, "h3")
    assert ("spec.dit.autoscaling", "dit.autoscaling needs a dit replica on one node (dit needs 8 GPUs, gpusPerNode=4): "
            "a multi-node gang scales by dit.replicas") in e.value.issues


def test_every_pod_is_scrapable_and_the_monitoring_namespace_may_scrape():
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    t = _templates(d, "h3-split")
    for st, port in (("encoder", 9401), ("dit", 9402), ("vae", 9403), ("muxer", 9404), ("gateway", 8000)):
        ann = t[f"h3-split-{st}"]["metadata"]["annotations"]
        assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == (
            "true", str(port), "/metrics"), st
        c = t[f"h3-split-{st}"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("H3SERVE_METRICS_PORT") == (None if st == "gateway" else "9400")
        if st != "gateway":
            assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    engine = _templates(yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())["spec"], "h3-base")
    ports = {p["name"]: p["containerPort"] for p in engine["h3-base-engine"]["spec"]["containers"][0]["ports"]}
    assert {k: v for k, v in ports.items() if k.startswith("metrics")} == {
        "metrics-enc": 9401, "metrics-dit": 9402, "metrics-vae": 9403, "metrics-mux": 9404}
    objs = M.render(parse_and_validate({**d, "metrics": {"monitoringNamespace": "monitoring"}}, "h3"), "h3", "ns")
    nps = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    mon = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    stage_rule = [r for r in nps["h3-stages"]["ingress"] if r["from"] == [mon]]
    assert [p["port"] for p in stage_rule[0]["ports"]] == [9401, 9402, 9403, 9404]
    gw_rule = [r for r in nps["h3-gateway"]["ingress"] if r.get("from") == [mon]]
    assert [p["port"] for p in gw_rule[0]["ports"]] == [8000, 9401, 9402, 9403, 9404]
    for o in objs:
        if o["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example,gpus_per_node", [("base-disaggregated", 8), ("fasth3-disaggregated", 8),
                                                   ("base-disaggregated", 4)], ids=["base", "fasth3", "gangs"])
def test_gateway_targets_are_headless_services_balanced_per_call(example, gpus_per_node):
    """Disaggregated, the gateway dials every stage as `dns:///` of a headless Service that selects the stage's
    (leader) pods, so its round_robin channel resolves and balances over every ready replica; the Service exists
    whatever the replica count, so scaling renders the same targets (no config change, no restart)."""
    from h3serve.config.stage import StageConfig

    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    doc["spec"]["gpusPerNode"] = gpus_per_node  # 4: the DiT and the VAE are gangs of 2 pods
    objs = M.render(parse_and_validate(doc["spec"], "h3"), "h3", "apps")
    assert (gpus_per_node == 4) == any(o["kind"] == "StatefulSet" for o in objs)
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    cfg = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["h3serve.yaml"])
    gw = StageConfig.from_service_config(cfg, "gateway")
    for st in ("encoder", "dit", "vae", "muxer"):
        target = getattr(gw.gateway, st)
        assert target == f"dns:///h3-{st}-headless.apps.svc:50051", target
        host, port = target.removeprefix("dns:///").rsplit(":", 1)
        svc = svcs[host.split(".")[0]]
        assert svc["spec"]["clusterIP"] == "None" and "publishNotReadyAddresses" not in svc["spec"]
        assert [p["port"] for p in svc["spec"]["ports"]] == [int(port)]
        assert svc["spec"]["selector"] == svcs[f"h3-{st}"]["spec"]["selector"]  # the pods that serve gRPC
        assert svc["spec"]["selector"][M.LABEL_COMPONENT] == st
        # the selected pods are the stage's workload pods (a gang: its leaders)
        for w in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                  and o["metadata"]["labels"][M.LABEL_COMPONENT] == st):
            pod_labels = w["spec"]["template"]["metadata"]["labels"]
            sel = dict(svc["spec"]["selector"])
            if sel.pop(M.LABEL_POD_INDEX, None) is not None:
                assert w["kind"] == "StatefulSet"
            assert sel.items() <= pod_labels.items()
    # a replica change renders the same targets and gateway config hash
    d = copy.deepcopy(doc["spec"])
    for st in ("encoder", "dit", "vae", "muxer"):
        d[st]["replicas"] = 3
    scaled = M.render(parse_and_validate(d, "h3"), "h3", "apps")
    hashes = lambda os: {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][M.ANN_CONFIG_HASH]  # noqa: E731
                         for o in os if o["kind"] in ("Deployment", "StatefulSet")}
    assert {k: v for k, v in hashes(scaled).items() if k in hashes(objs)} == hashes(objs)
    assert sorted(n for n in svcs if n.endswith("-headless")) == sorted(
        f"h3-{st}-headless" for st in ("dit", "encoder", "muxer", "vae"))


def test_colocated_stages_stay_on_loopback_without_headless_services():
    doc = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())
    objs = M.render(parse_and_validate(doc["spec"], "h3"), "h3", "apps")
    assert not [o for o in objs if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"]
    cfg = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["h3serve.yaml"])
    assert all(v.startswith("127.0.0.1:") for k, v in cfg["endpoints"].items() if k != "gateway")


@pytest.mark.parametrize("example", ["base-disaggregated", "base-colocated"])
def test_service_monitor_only_when_asked_and_served(example):
    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    spec = parse_and_validate(doc["spec"], "h3")
    kinds = lambda objs: [o["kind"] for o in objs]  # noqa: E731
    assert "ServiceMonitor" not in kinds(M.render(spec, "h3", "apps"))  # off by default
    d = copy.deepcopy(doc["spec"])
    d.setdefault("metrics", {})["serviceMonitor"] = True
    spec = parse_and_validate(d, "h3")
    assert "ServiceMonitor" not in kinds(M.render(spec, "h3", "apps", service_monitors=False))  # API not served
    objs = M.render(spec, "h3", "apps")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    gw, stages = by[("ServiceMonitor", "h3-gateway")], by[("ServiceMonitor", "h3-stages")]
    svc = by[("Service", "h3-metrics")]
    assert svc["spec"]["clusterIP"] == "None"
    # every metrics port a container names is a Service port (by name) and a ServiceMonitor endpoint
    pods = [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    named = {p["name"] for t in pods for c in t["spec"]["containers"] for p in c["ports"]
             if p["name"].startswith("metrics")}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == named
    assert [e["port"] for e in stages["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    assert gw["spec"]["endpoints"] == [{"port": "http", "path": "/metrics"}]
    # the selectors pick the Services carrying those ports: the metrics Service, the front door
    sel = stages["spec"]["selector"]["matchLabels"]
    assert sel.items() <= svc["metadata"]["labels"].items()
    front = by[("Service", "h3-gateway")]
    for e in gw["spec"]["selector"]["matchExpressions"]:
        assert front["metadata"]["labels"][e["key"]] in e["values"]
    assert "http" in {p["name"] for p in front["spec"]["ports"]}
    for o in (gw, stages):
        assert o["apiVersion"] == "monitoring.coreos.com/v1" and o["spec"]["namespaceSelector"] == {
            "matchNames": ["apps"]}
    # the pod selector of the metrics Service covers every workload pod of the instance
    for t in pods:
        assert svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()


# ---- the front door's Secrets: API keys and the job store ----------------------------------------------------------

def _spec_doc(example: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())["spec"]


def _front_and_others(objs):
    front, others = [], []
    for o, pod in pods(objs):
        (front if o["metadata"]["labels"][M.LABEL_COMPONENT] in (M.GATEWAY, M.ENGINE) else others).append(pod)
    return front, others


def _gateway_config(spec, name="h3") -> "object":
    from h3serve.config.stage import StageConfig

    return StageConfig.from_service_config(M.service_config(spec, name, "ns").to_dict(), "gateway")


@pytest.mark.parametrize("example", ["base-colocated", "base-disaggregated"])
def test_the_api_keys_secret_is_mounted_into_the_front_door_only_and_named_in_its_config(example):
    spec = parse_and_validate(_spec_doc(example), "h3")
    front, others = _front_and_others(M.render(spec, "h3", "ns"))
    assert front and others or example == "base-colocated"
    cfg = _gateway_config(spec)
    assert cfg.gateway.api_keys_file and not cfg.gateway.no_auth
    for pod in front:
        vol = next(v for v in pod["volumes"] if v["name"] == "api-keys")
        assert vol["secret"]["secretName"] == "h3-api-keys"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
        # a whole-volume mount (no subPath): the Secret's update reaches the file, the gateway re-reads it
        assert mount["readOnly"] is True and "subPath" not in mount
        item = vol["secret"]["items"][0]
        assert cfg.gateway.api_keys_file == f"{mount['mountPath']}/{item['path']}"
    for pod in others:
        assert all(v["name"] != "api-keys" for v in pod["volumes"])


@pytest.mark.parametrize("example", ["base-colocated", "base-disaggregated"])
def test_webhooks_are_the_gateways_config_and_their_secrets_are_mounted_into_the_front_door_only(example):
    d = _spec_doc(example)
    d["gateway"]["webhooks"] = {"allow": ["*.hooks.example.com", "10.20.0.0/16"], "secretsSecret": "h3-hooks",
                                "url": "https://a.hooks.example.com/h3"}
    spec = parse_and_validate(d, "h3")
    cfg = _gateway_config(spec)
    assert (cfg.gateway.webhook_allow, cfg.gateway.webhook_url, cfg.gateway.webhook_attempts) == (
        "*.hooks.example.com,10.20.0.0/16", "https://a.hooks.example.com/h3", 6)
    from h3serve.services.gateway.webhooks import Policy
    assert Policy(cfg.gateway.webhook_allow).networks   # the rendered list is one the gateway parses
    front, others = _front_and_others(M.render(spec, "h3", "ns"))
    for pod in front:
        vol = next(v for v in pod["volumes"] if v["name"] == "webhook-secrets")
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "webhook-secrets")
        assert vol["secret"]["secretName"] == "h3-hooks" and mount["readOnly"] is True and "subPath" not in mount
        assert cfg.gateway.webhook_secrets_file == f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
    for pod in others:
        assert all(v["name"] != "webhook-secrets" for v in pod["volumes"])
    d["gateway"]["auth"]["adminCallers"] = ["ops", "billing"]
    assert _gateway_config(parse_and_validate(d, "h3")).gateway.admin_callers == "ops,billing"
    d["gateway"]["callers"] = [{"name": "*", "maxQueued": 4}, {"name": "ops", "share": 2, "videoSecondsPerHour": 600}]
    from h3serve.config.callers import parse_caller_limits
    limits = parse_caller_limits(_gateway_config(parse_and_validate(d, "h3")).gateway.caller_limits)
    assert (limits["*"].max_queued, limits["ops"].share, limits["ops"].video_seconds_per_hour) == (4, 2.0, 600.0)
    d["gateway"]["callers"] = [{"name": "ops", "share": 0}]
    with pytest.raises(SpecError, match=r"ops.share=0: a number in \[0.01"):
        parse_and_validate(d, "h3")
    del d["gateway"]["callers"]
    assert _gateway_config(parse_and_validate(d, "h3")).gateway.max_previews == 10
    d["gateway"]["maxPreviews"] = 0   # previews refused by this deployment's gateways
    assert _gateway_config(parse_and_validate(d, "h3")).gateway.max_previews == 0
    d["gateway"]["maxPreviews"] = -1
    with pytest.raises(SpecError, match="gateway.maxPreviews"):
        parse_and_validate(d, "h3")
    del d["gateway"]["maxPreviews"]
    d["gateway"]["webhooks"]["url"] = "file:///etc/passwd"
    with pytest.raises(SpecError, match="gateway.webhooks.url"):
        parse_and_validate(d, "h3")


def test_auth_disabled_renders_no_auth_and_mounts_nothing(tmp_path):
    d = _spec_doc("fasth3-colocated")
    d["gateway"]["auth"] = {"disabled": True}
    spec = parse_and_validate(d, "h3")
    cfg = _gateway_config(spec)
    assert cfg.gateway.no_auth is True and cfg.gateway.api_keys_file is None
    front, _ = _front_and_others(M.render(spec, "h3", "ns"))
    assert all(v["name"] != "api-keys" for pod in front for v in pod["volumes"])
    # and a launcher's gateway child runs with it
    from h3serve.testing.serve import launched_config
    assert launched_config(cfg, "gateway", 50051, {}, 8000, tmp_path).gateway.no_auth is True


def test_the_job_store_is_the_gateways_config_and_its_credentials_come_from_the_secret():
    spec = parse_and_validate(_spec_doc("base-disaggregated"), "h3")
    cfg = _gateway_config(spec)
    assert cfg.gateway.job_store == "s3://h3-jobs/h3-split"
    objs = M.render(spec, "h3", "ns")
    front, others = _front_and_others(objs)
    gw = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "h3-gateway")
    assert gw["spec"]["replicas"] == 2  # two gateways: they share the store
    env = {e["name"]: e for e in front[0]["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
    assert env["AWS_REGION"]["value"] == "us-east-1"
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[k]["valueFrom"] == {"secretKeyRef": {"name": "h3-jobs-s3", "key": k}}
    for pod in others:  # the stages never see the store's credentials
        assert not any(e["name"].startswith("AWS_") for e in pod["containers"][0]["env"])
    # no store: one gateway, and asking for more is refused with the rule's message
    d = _spec_doc("base-disaggregated")
    del d["gateway"]["jobStore"]
    with pytest.raises(SpecError, match=r"spec.gateway.jobStore: more than one gateway"):
        parse_and_validate(d, "h3")
    del d["gateway"]["replicas"]
    spec = parse_and_validate(d, "h3")
    assert spec.stage_replicas("gateway") == 1 and _gateway_config(spec).gateway.job_store is None


@pytest.mark.parametrize("example", ["base-colocated", "base-disaggregated"])
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "no-tls"])
def test_every_stage_process_may_start_on_its_pod_address(example, tls):
    """Stages listen on 0.0.0.0 in a pod: with spec.tls they require mTLS; without it their ports are fenced by
    the instance's NetworkPolicies and the config says so (--no-peer-auth), so no stage refuses to start."""
    from h3serve.config.stage import StageConfig
    from h3serve.config.vocab import PIPELINE_STAGES
    from h3serve.runtime.prechecks import check_stage_exposure

    d = _spec_doc(example)
    if not tls:
        d.pop("tls", None)
    elif "tls" not in d:
        d["tls"] = _spec_doc("base-disaggregated")["tls"]
    spec = parse_and_validate(d, "h3")
    cfg = M.service_config(spec, "h3", "ns").to_dict()
    for stage in (*PIPELINE_STAGES, "gateway"):
        sc = StageConfig.from_service_config(cfg, stage)
        assert sc.server.host == "0.0.0.0"
        assert sc.server.no_peer_auth is (not tls and stage != "gateway"), stage
        check_stage_exposure(sc)
    assert any(o["kind"] == "NetworkPolicy" for o in M.render(spec, "h3", "ns"))


def test_tls_secret_is_mounted_into_every_pod_and_every_process_reads_it():
    from h3serve.config.stage import StageConfig, tls_peer_name

    d = _spec_doc("base-disaggregated")
    d["tls"]["certManager"] = {"issuerRef": {"name": "h3-ca", "kind": "ClusterIssuer"}}
    spec = parse_and_validate(d, "h3")
    objs = M.render(spec, "h3", "ns")
    cfg = M.service_config(spec, "h3", "ns").to_dict()
    for o, pod in pods(objs):
        vol = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert vol["secret"]["secretName"] == "h3-split-tls"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")
        assert mount["readOnly"] is True and "subPath" not in mount
        files = {f"{mount['mountPath']}/{i['path']}" for i in vol["secret"]["items"]}
        comp = o["metadata"]["labels"][M.LABEL_COMPONENT]
        sc = StageConfig.from_service_config(cfg, comp)
        assert {sc.server.tls_cert, sc.server.tls_key, sc.server.tls_ca} == files, comp
        assert sc.server.tls_peer_name == tls_peer_name("h3", "ns"), comp   # peers are dialled by pod IP
    # cert-manager: one Certificate, before the workloads, naming every Service the pods are dialled by
    certs = [o for o in objs if o["kind"] == "Certificate"]
    assert len(certs) == 1 and objs.index(certs[0]) < min(objs.index(o) for o, _ in pods(objs))
    c = certs[0]["spec"]
    assert c["secretName"] == "h3-split-tls" and c["issuerRef"] == {"name": "h3-ca", "kind": "ClusterIssuer",
                                                                   "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(c["usages"]) and c["ipAddresses"] == ["127.0.0.1"]
    for host in M.endpoints(spec, "h3", "ns").values():
        assert host.removeprefix("dns:///").rsplit(":", 1)[0] in c["dnsNames"]  # the name a channel verifies
    assert tls_peer_name("h3", "ns") in c["dnsNames"]                               # and the one pod IPs are checked for
    # without certManager nothing but the mount; without tls nothing at all
    del d["tls"]["certManager"]
    assert not [o for o in M.render(parse_and_validate(d, "h3"), "h3", "ns") if o["kind"] == "Certificate"]
    del d["tls"]
    plain = M.render(parse_and_validate(d, "h3"), "h3", "ns")
    assert all(v["name"] != "tls" for _, pod in pods(plain) for v in pod["volumes"])
    assert StageConfig.from_service_config(M.service_config(parse_and_validate(d, "h3"), "h3", "ns").to_dict(),
                                           "dit").server.tls_cert is None


def test_the_manifest_pin_reaches_every_model_stage_and_only_those(tmp_path):
    from h3serve.config.stage import StageConfig
    from h3serve.testing.serve import launched_config

    d = _spec_doc("base-disaggregated")
    pin = d["model"]["manifestSha256"]
    spec = parse_and_validate(d, "h3")
    cfg = M.service_config(spec, "h3", "ns").to_dict()
    for st in ("encoder", "dit", "vae"):
        sc = StageConfig.from_service_config(cfg, st)
        assert sc.model.checkpoint_manifest_sha256 == pin
        assert launched_config(sc, st, 50051, {}, None, tmp_path).model.checkpoint_manifest_sha256 == pin  # a child too
    assert StageConfig.from_service_config(cfg, "muxer").model.checkpoint_manifest_sha256 is None
    # colocated: every process of the engine pod reads it
    c = _spec_doc("fasth3-colocated")
    c["model"]["manifestSha256"] = pin
    ccfg = M.service_config(parse_and_validate(c, "h3"), "h3", "ns").to_dict()
    assert StageConfig.from_service_config(ccfg, "gateway").model.checkpoint_manifest_sha256 == pin
    # a pin that is not a sha256 is refused naming the field
    c["model"]["manifestSha256"] = "ABC"
    with pytest.raises(SpecError, match=r"spec.model.manifestSha256"):
        parse_and_validate(c, "h3")


# ---- a FastH3 DiT pool beside the base one (spec.fasth3) -----------------------------------------------------------

FAST = {"adapter": {"path": "/models/FastH3/adapter.safetensors", "sha256": "ab" * 32}, "ulysses": 2, "ring": 2,
        "replicas": 3}


@pytest.mark.parametrize("gpus_per_node", [8, 2], ids=["one-node", "gangs"])
def test_fasth3_pool_is_a_second_dit_workload_with_services_and_the_gateways_target(gpus_per_node):
    from h3serve.config.stage import StageConfig

    d = {**_spec_doc("base-disaggregated"), "gpusPerNode": gpus_per_node, "fasth3": FAST}
    d["dit"] = {**d["dit"], "ring": 1} if gpus_per_node == 2 else d["dit"]  # 4 GPUs: a gang of 2 pods
    d["vae"] = {**d["vae"], "patchParallel": 1}
    objs = M.render(parse_and_validate(d, "h3"), "h3", "apps")
    fast = [o for o in objs if o["metadata"]["labels"].get(M.LABEL_COMPONENT) == "dit-fasth3"]
    base = [o for o in objs if o["metadata"]["labels"].get(M.LABEL_COMPONENT) == "dit"]
    # the same kinds of objects as the base DiT (Services, workloads, gang Services and PodGroups), under its name
    assert {o["kind"] for o in fast} == {o["kind"] for o in base} | {"PodDisruptionBudget"}
    svcs = {o["metadata"]["name"]: o for o in fast if o["kind"] == "Service"}
    assert svcs["h3-dit-fasth3-headless"]["spec"]["clusterIP"] == "None"
    assert svcs["h3-dit-fasth3-headless"]["spec"]["selector"] == svcs["h3-dit-fasth3"]["spec"]["selector"]
    workloads = [o for o in fast if o["kind"] in ("Deployment", "StatefulSet")]
    if gpus_per_node == 8:
        assert [(w["kind"], w["spec"]["replicas"]) for w in workloads] == [("Deployment", 3)]
    else:  # 4 GPUs over 2-GPU nodes: one StatefulSet (a gang of 2 pods) per replica, like the DiT's
        assert [(w["kind"], w["metadata"]["name"], w["spec"]["replicas"]) for w in workloads] == [
            ("StatefulSet", f"h3-dit-fasth3-{r}", 2) for r in range(3)]
        groups = sorted(o["metadata"]["name"] for o in fast if o["kind"] == "PodGroup")  # <gang>-<hash of its spec>
        assert [g.rsplit("-", 1)[0] for g in groups] == [f"h3-dit-fasth3-{r}" for r in range(3)]
        assert [w["spec"]["template"]["spec"]["schedulingGroup"]["podGroupName"] for w in workloads] == groups
    for w in workloads:
        c = w["spec"]["template"]["spec"]["containers"][0]
        argv = c.get("args") or c["command"]
        assert argv[:4] == ["h3serve", "serve", "--stages", "dit"]
        assert {e["name"]: e.get("value") for e in c["env"]}["H3SERVE_COMPONENT"] == "dit-fasth3"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 // (1 if gpus_per_node == 8 else 2)
        sel = {k: v for k, v in svcs["h3-dit-fasth3"]["spec"]["selector"].items() if k != M.LABEL_POD_INDEX}
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    assert [o["spec"]["minAvailable"] for o in fast if o["kind"] == "PodDisruptionBudget"] == [
        3 * (1 if gpus_per_node == 8 else 2) - 1]
    cfg = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["h3serve.yaml"])
    gw = StageConfig.from_service_config(cfg, "gateway")
    assert gw.gateway.fasth3_dit == "dns:///h3-dit-fasth3-headless.apps.svc:50051"
    assert gw.gateway.dit == "dns:///h3-dit-headless.apps.svc:50051"
    pool = StageConfig.from_service_config(cfg, "dit-fasth3")
    assert (pool.stage, pool.model.profile, pool.degrees.ulysses, pool.degrees.ring, pool.model.adapter, pool.model.adapter_sha256) == (
        "dit", "fasth3", 2, 2, FAST["adapter"]["path"], FAST["adapter"]["sha256"])
    # no spec.fasth3: no such key for the gateway, and the pool's slice cannot be asked for
    plain = M.service_config(parse_and_validate(_spec_doc("base-disaggregated"), "h3"), "h3", "apps").to_dict()
    assert StageConfig.from_service_config(plain, "gateway").gateway.fasth3_dit is None
    with pytest.raises(ValueError, match="declares no fasth3 pool"):
        StageConfig.from_service_config(plain, "dit-fasth3")


FAST_ROLLOUTS = {  # change of the FastH3 pool -> the workloads whose pods roll
    "add-the-pool": (None, FAST, {"h3-split-gateway"}),  # the gateway gains its target; the new pool just starts
    "adapter": (FAST, {**FAST, "adapter": {"path": "/models/FastH3/v2.safetensors", "sha256": "cd" * 32}},
                {"h3-split-dit-fasth3"}),
    "degrees": (FAST, {**FAST, "ulysses": 4, "ring": 1}, {"h3-split-dit-fasth3"}),
    "resources": (FAST, {**FAST, "resources": {"requests": {"cpu": "4"}}}, {"h3-split-dit-fasth3"}),
    "replicas": (FAST, {**FAST, "replicas": 5}, set()),
    "remove-the-pool": (FAST, None, {"h3-split-gateway"}),
}


@pytest.mark.parametrize("case", sorted(FAST_ROLLOUTS))
def test_changing_the_fasth3_pool_restarts_only_its_pods_and_the_gateway(case):
    before, after, want = FAST_ROLLOUTS[case]
    d = _spec_doc("base-disaggregated")
    a = {**d, **({"fasth3": before} if before else {})}
    b = {**d, **({"fasth3": after} if after else {})}
    assert _changed(_templates(a, "h3-split"), _templates(b, "h3-split")) == want


@pytest.mark.parametrize("patch,says", [
    ({"placement": "colocated", "dit": {"ulysses": 4, "ring": 2}, "vae": {"patchParallel": 1}, "encoder": {},
      "muxer": {}, "gateway": {"auth": {"disabled": True}}},
     "fasth3 needs placement disaggregated: a colocated replica is one engine pod"),
    ({"profile": "fasth3", "model": {"path": "/models/MiniMax-H3", "adapter": FAST["adapter"]}},
     "fasth3 (a FastH3 pool beside the base one) needs profile base, got profile fasth3"),
    ({"fasth3": {**FAST, "adapter": {"path": FAST["adapter"]["path"]}}}, "fasth3.adapter needs sha256"),
    ({"fasth3": {**FAST, "ulysses": 3}}, "fasth3.ulysses=3 must divide the DiT's 56 attention heads"),
    ({"fasth3": {**FAST, "ulysses": 4, "ring": 3}}, "fasth3 needs 12 GPUs, more than gpusPerNode=8"),
    ({"fasth3": {**FAST, "adapter": {**FAST["adapter"], "path": "/elsewhere/a.safetensors"}}},
     "fasth3.adapter.path /elsewhere/a.safetensors must be a normalised absolute path"),
    ({"fasth3": {**FAST, "resources": {"limits": {"nvidia.com/gpu": 2}}}}, "remove nvidia.com/gpu from fasth3"),
])
def test_fasth3_pool_rules_name_the_field(patch, says):
    d = {**_spec_doc("base-disaggregated"), "fasth3": FAST, **patch}
    with pytest.raises(SpecError) as e:
        parse_and_validate(d, "h3")
    assert says in str(e.value), str(e.value)


def test_a_name_too_long_for_the_fasth3_pools_gangs_is_refused_naming_the_limit():
    d = {**_spec_doc("base-disaggregated"), "gpusPerNode": 2, "fasth3": {**FAST, "replicas": 10},
         "dit": {"ulysses": 2, "ring": 1}, "vae": {"patchParallel": 1}}
    parse_and_validate(d, "a" * 39)  # a...a-dit-fasth3-9: 52 characters
    with pytest.raises(SpecError, match=r"StatefulSet a{40}-dit-fasth3-9 has 53 characters, at most 52; use a name of "
                                        r"at most 39 characters"):
        parse_and_validate(d, "a" * 40)
    parse_and_validate({**d, "gpusPerNode": 8}, "a" * 40)  # one-node replicas: a Deployment, no such label


@pytest.mark.parametrize("example,gpus_per_node", [("base-disaggregated", 8), ("base-with-fasth3-disaggregated", 8),
                                                   ("base-disaggregated", 4), ("base-colocated", 8)],
                         ids=["base", "fasth3-pool", "gangs", "colocated"])
def test_pods_that_dial_a_request_named_sink_declare_exactly_its_headless_service(example, gpus_per_node,
                                                                                   tmp_path):
    """A DiT (either pool) streams latents to a VAE pod and the VAE frames to a muxer pod, at the pod IP a request
    names: their pods get `--peers` = the headless Service of that stage (the name the gateway dials, whose
    addresses are its ready leader pods) and nothing else; no other pod gets any. The colocated engine's launcher
    gives its stages the loopback addresses of the stages it started."""
    from h3serve.cli import build_parser
    from h3serve.config.stage import StageConfig
    from h3serve.runtime.tls import PeerName, parse_peers
    from h3serve.testing.serve import launched_config

    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    doc["spec"]["gpusPerNode"] = gpus_per_node
    objs = M.render(parse_and_validate(doc["spec"], "h3"), "h3", "apps")
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    cfg = yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["h3serve.yaml"])
    sink_of = {"dit": "vae", "dit-fasth3": "vae", "vae": "muxer"}
    seen = set()
    for w, pod in pods(objs):
        comp = w["metadata"]["labels"][M.LABEL_COMPONENT]
        c = pod["containers"][0]
        argv = c.get("args") or c["command"]
        assert argv.count("--peers") == (1 if comp in sink_of else 0), (comp, argv)
        if comp not in sink_of:
            continue
        seen.add(comp)
        peers = build_parser().parse_args(argv[1:]).peers
        sink = sink_of[comp]
        assert peers == f"h3-{sink}-headless.apps.svc:50051"
        assert cfg["endpoints"][sink] == f"dns:///{peers}"   # the very name the gateway balances over
        assert parse_peers(peers).items == (PeerName(f"h3-{sink}-headless.apps.svc", 50051),)
        svc = svcs[f"h3-{sink}-headless"]
        assert svc["spec"]["clusterIP"] == "None" and "publishNotReadyAddresses" not in svc["spec"]  # ready pods
        assert svc["spec"]["selector"] == svcs[f"h3-{sink}"]["spec"]["selector"]   # leaders: the IPs advertised
        assert [p["port"] for p in svc["spec"]["ports"]] == [50051]
    if example == "base-colocated":
        assert seen == set()
        engine = StageConfig.from_service_config(cfg, "vae")
        addresses = {st: f"127.0.0.1:{50051 + M.PORT_OFFSETS[st]}" for st in ("gateway", *M.PIPELINE_STAGES)}
        child = launched_config(engine, "vae", engine.server.port, addresses, None, tmp_path)
        assert child.server.peers == ",".join(sorted(addresses.values()))
    else:
        assert seen == {"dit", "vae"} | ({"dit-fasth3"} if "fasth3" in example else set())


def test_device_cpu_requests_no_gpus_and_runs_fp32_on_the_cpu():
    for ex in ("cpu-tiny", "base-disaggregated"):
        d = yaml.safe_load((ROOT / "examples" / f"{ex}.yaml").read_text())
        d["spec"]["device"] = "cpu"
        objs = M.render(H3DeploymentSpec.from_dict(d["spec"]), "t", "apps")
        assert pods(objs)
        for w, pod in pods(objs):
            for c in pod["containers"]:
                for kind in ("requests", "limits"):
                    assert "nvidia.com/gpu" not in c.get("resources", {}).get(kind, {}), (ex, w["metadata"]["name"])
        cfg = next(o for o in objs if o["kind"] == "ConfigMap")
        engine = yaml.safe_load(next(iter(cfg["data"].values())))["engine"]
        assert engine == {"device": "cpu", "dtype": "fp32"}
        # no GPU to keep free: every Deployment surges (a rolling update never drops below its replicas)
        for o in objs:
            if o["kind"] == "Deployment":
                assert o["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}, o["metadata"]
        d["spec"]["device"] = "cuda"  # the default: GPUs requested, bf16
        objs = M.render(H3DeploymentSpec.from_dict(d["spec"]), "t", "apps")
        assert any("nvidia.com/gpu" in c["resources"].get("limits", {}) for _, p in pods(objs) for c in p["containers"])
        assert {"maxSurge": 0, "maxUnavailable": 1} in [o["spec"]["strategy"]["rollingUpdate"] for o in objs
                                                         if o["kind"] == "Deployment"]
