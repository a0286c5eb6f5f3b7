"""What the operator's administrator allows (AdmissionPolicy): a custom resource cannot widen it."""

from __future__ import annotations

import pytest

from h3serve.config.spec import DEFAULT_VOLUME_KINDS, AdmissionPolicy, H3DeploymentSpec, policy_issues, validate


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
                                            f"add it to the chart's policy.allowedVolumeKinds")]
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
