"""What the operator's administrator allows (AdmissionPolicy): a custom resource cannot widen it."""

from __future__ import annotations

import re

import pytest

from h3serve.config.spec import DEFAULT_VOLUME_KINDS, AdmissionPolicy, H3DeploymentSpec, policy_issues, validate
from h3serve.errors import H3Error


def spec(**over) -> H3DeploymentSpec:
    d = {"image": "registry.example/h3serve:0.1.0", "model": {"path": "/models/H3",
                                                                 "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
         "gateway": {"auth": {"apiKeysSecret": "keys"}}}
    d.update(over)
    return H3DeploymentSpec.from_dict(d)


@pytest.mark.parametrize("kind", ["hostPath", "secret", "projected", "configMap", "emptyDir", "nfs"])
def test_volume_kinds_outside_the_default_are_refused(kind):
    s = spec(model={"path": "/models/H3", "volume": {kind: {}}})
    issues = policy_issues(s, AdmissionPolicy())
    assert issues == [("spec.model.volume", f"model.volume kind {kind} is not allowed by this operator (allowed: "
                                            f"csi, ephemeral, image, persistentVolumeClaim); an administrator can "
                                            f"change the chart's policy.allowedVolumeKinds")]
    assert policy_issues(s, AdmissionPolicy(volume_kinds=(*DEFAULT_VOLUME_KINDS, kind))) == []


@pytest.mark.parametrize("image,ok", [
    ("registry.example/h3serve:0.1.0", True), ("registry.example/h3serve@sha256:" + "a" * 64, True),
    ("registry.example/h3serve", True), ("registry.example/h3serve-evil:1", False),
    ("mirror.example/team/h3:2", True), ("mirror.example/teamx/h3:2", False), ("docker.io/library/busybox", False),
])
def test_image_allow_list(image, ok):
    policy = AdmissionPolicy(images=("registry.example/h3serve", "mirror.example/team/"))
    assert (policy_issues(spec(image=image), policy) == []) == ok
    assert policy_issues(spec(image=image), AdmissionPolicy()) == []  # no list: any image
    assert policy_issues(spec(image=image), AdmissionPolicy(images=("*",))) == []


@pytest.mark.parametrize("path,mount", [
    ("/models/../etc/ssl", "/models"), ("/models/./H3", "/models"), ("/models//H3", "/models"),
    ("/models/H3/..", "/models"), ("/models/H3", "/models/../etc"),
])
def test_paths_must_be_normal_before_the_prefix_check(path, mount):
    s = spec(model={"path": path, "mountPath": mount, "volume": {"persistentVolumeClaim": {"claimName": "w"}}})
    msgs = [m for _, m in validate(s, "h3")]
    assert any("must be a normalised absolute path (no '.', '..' or empty segments)" in m for m in msgs), msgs


def test_normal_paths_pass():
    assert validate(spec(model={"path": "/models/H3.v2/..x", "volume": {"csi": {"driver": "d"}}}), "h3") == []


def refused(s: H3DeploymentSpec, policy: AdmissionPolicy = AdmissionPolicy()) -> dict[str, str]:
    return dict(policy_issues(s, policy))


def test_csi_drivers_only_those_listed():
    s = spec(model={"path": "/models/H3", "volume": {"csi": {"driver": "hostpath.csi.k8s.io"}}})
    assert refused(s)["spec.model.volume.csi.driver"] == (
        "CSI driver 'hostpath.csi.k8s.io' is not allowed by this operator (allowed: none); an administrator can "
        "change the chart's policy.allowedCsiDrivers")
    assert refused(s, AdmissionPolicy(csi_drivers=("hostpath.csi.k8s.io",))) == {}
    assert refused(s, AdmissionPolicy(csi_drivers=("*",))) == {}
    assert "spec.model.volume.csi.driver" in refused(s, AdmissionPolicy(csi_drivers=("other.csi",)))


def ephemeral(size: str) -> H3DeploymentSpec:
    return spec(model={"path": "/models/H3", "volume": {"ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}}}}})


@pytest.mark.parametrize("size,ok", [("500Ti", False), ("1Ti", True), ("1100G", False), ("1000G", True),
                                     ("200Gi", True), ("lots", False)])
def test_ephemeral_volumes_are_capped(size, ok):
    issues = refused(ephemeral(size))
    field = "spec.model.volume.ephemeral.volumeClaimTemplate.spec.resources.requests.storage"
    assert (field not in issues) == ok, issues
    if not ok:
        assert issues[field] == (f"an ephemeral volume of {size} is more than this operator allows (1Ti); an "
                                 f"administrator can change the chart's policy.maxVolumeSize")
    assert field not in refused(ephemeral("500Ti"), AdmissionPolicy(max_volume_size="600Ti"))


def test_image_volumes_obey_the_image_allow_list():
    s = spec(model={"path": "/models/H3", "volume": {"image": {"reference": "docker.io/attacker/weights:1"}}})
    policy = AdmissionPolicy(images=("registry.example/",))
    assert refused(s, policy)["spec.model.volume.image.reference"].startswith(
        "image 'docker.io/attacker/weights:1' is not allowed by this operator (allowed: registry.example/)")
    ok = spec(model={"path": "/models/H3", "volume": {"image": {"reference": "registry.example/h3-weights:1"}}})
    assert refused(ok, policy) == {}


def test_secrets_only_by_the_allowed_patterns():
    s = spec(gateway={"auth": {"apiKeysSecret": "h3-api-keys"},
                      "jobStore": {"s3": {"bucket": "jobs", "credentialsSecret": "payroll-s3",
                                          "endpoint": "http://attacker.example:9000"}}},
             tls={"secretName": "h3-tls"}, imagePullSecrets=[{"name": "h3-pull"}, {"name": "ci-registry"}])
    policy = AdmissionPolicy(secret_names=("h3-*",))
    assert sorted(refused(s, policy)) == ["spec.gateway.jobStore.s3.credentialsSecret", "spec.imagePullSecrets[1]"]
    assert refused(s, policy)["spec.gateway.jobStore.s3.credentialsSecret"] == (
        "Secret 'payroll-s3' is not one this operator may use (allowed: h3-*); an administrator can change the "
        "chart's policy.allowedSecretNames")
    assert refused(s) == {}  # the default: any Secret of the namespace


@pytest.mark.parametrize("pc,allowed,ok", [
    ("system-node-critical", (), False), ("system-cluster-critical", (), False), ("batch-high", (), True),
    ("batch-high", ("h3-serving",), False), ("h3-serving", ("h3-serving",), True),
    ("system-node-critical", ("system-node-critical",), True)])
def test_priority_classes(pc, allowed, ok):
    issues = refused(spec(priorityClassName=pc), AdmissionPolicy(priority_classes=allowed))
    assert ("spec.priorityClassName" not in issues) == ok, issues


@pytest.mark.parametrize("over,field", [
    ({"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}, "spec.nodeSelector"),
    ({"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                       "effect": "NoSchedule"}]}, "spec.tolerations[0]"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}, {"operator": "Exists"}]},
     "spec.tolerations[1]"),
    ({"dit": {"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}},
     "spec.dit.tolerations[0]"),
    ({"gateway": {"auth": {"apiKeysSecret": "k"}, "nodeSelector": {"node-role.kubernetes.io/master": "true"}}},
     "spec.gateway.nodeSelector"),
])
def test_control_plane_nodes_are_out_of_reach(over, field):
    s = spec(**over)
    assert list(refused(s)) == [field], refused(s)
    assert "policy.deniedNodeKeys" in refused(s)[field]
    assert refused(s, AdmissionPolicy(denied_node_keys=())) == {}


def test_gpu_tolerations_pass():
    s = spec(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
             nodeSelector={"nvidia.com/gpu.product": "H200"})
    assert refused(s) == {}


def test_service_types_and_an_open_front_door():
    lb = spec(gateway={"auth": {"disabled": True}, "serviceType": "LoadBalancer"})
    assert refused(lb) == {"spec.gateway.auth.disabled": (
        "a LoadBalancer front door with auth disabled serves anyone who reaches it from outside the cluster: set "
        "gateway.auth.apiKeysSecret or serviceType ClusterIP; an administrator can change the chart's "
        "policy.allowUnauthenticatedExternal")}
    assert refused(lb, AdmissionPolicy(allow_unauthenticated_external=True)) == {}
    assert refused(spec(gateway={"auth": {"disabled": True}})) == {}  # ClusterIP: inside the cluster only
    keyed = spec(gateway={"auth": {"apiKeysSecret": "k"}, "serviceType": "NodePort"})
    assert refused(keyed) == {}
    assert list(refused(keyed, AdmissionPolicy(service_types=("ClusterIP",)))) == ["spec.gateway.serviceType"]


@pytest.mark.parametrize("values,msg", [
    ({"allowedImage": ["x"]}, "policy: unknown key(s) allowedImage"),
    ({"maxVolumeSize": "big"}, "policy.maxVolumeSize 'big' is not a size such as 500Gi or 2Ti"),
    ({"allowedServiceTypes": ["ExternalName"]}, "policy.allowedServiceTypes: ExternalName is not a Service type"),
    ({"allowUnauthenticatedExternal": "yes"}, "policy.allowUnauthenticatedExternal must be true or false"),
    ({"allowedCsiDrivers": "csi.example"}, "policy.allowedCsiDrivers must be a list of strings"),
])
def test_bad_policy_values_are_named(values, msg):
    with pytest.raises(H3Error, match=re.escape(msg)):
        AdmissionPolicy.from_values(values)
