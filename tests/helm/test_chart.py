"""The operator chart, through the real helm binary: lint, template for every values example, strict validation."""

from __future__ import annotations

import json
import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from h3serve.config.spec import AdmissionPolicy
from h3serve.operator import crd

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "h3serve-operator"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S = "1.37.0"


def template(helm, *args: str) -> list[dict]:
    out = helm("template", "h3op", str(CHART), "--namespace", "ops", "--kube-version", K8S, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint_strict(helm):
    out = helm("lint", "--strict", str(CHART), "--kube-version", K8S)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
    for v in VALUES:
        helm("lint", "--strict", str(CHART), "-f", str(v), "--kube-version", K8S)


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_template_passes_kubernetes_validate_strict(helm, values):
    docs = template(helm, "-f", str(values), "--include-crds")
    assert docs
    for d in docs:
        kubernetes_validate.validate(d, K8S, strict=True)


def test_crd_ships_in_crds_dir(helm):
    docs = template(helm, "--include-crds")
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert crds == [crd.crd()]
    assert not [d for d in template(helm) if d["kind"] == "CustomResourceDefinition"]  # not a template: never deleted


def by_kind(docs):
    out = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_namespaced_by_default(helm):
    k = by_kind(template(helm, "--set", "crd.manage=false"))
    assert "ClusterRole" not in k and "ClusterRoleBinding" not in k
    assert [r["metadata"]["namespace"] for r in k["Role"]] == ["ops", "ops"]  # the watched one, the Lease's
    args = k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ops" in args and "--all-namespaces" not in args


def test_watch_namespaces_get_a_role_each(helm):
    k = by_kind(template(helm, "--set", "watchNamespaces={a,b}"))
    assert sorted(r["metadata"]["namespace"] for r in k["Role"]) == ["a", "b", "ops"]  # ops: the Lease
    assert sorted(b["metadata"]["namespace"] for b in k["RoleBinding"]) == ["a", "b", "ops"]
    for b in k["RoleBinding"]:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "h3op-h3serve-operator", "namespace": "ops"}]
    args = k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args and "--namespace=b" in args


def test_cluster_scope_is_opt_in(helm):
    k = by_kind(template(helm, "--set", "clusterScope=true", "--set", "crd.manage=false"))
    assert [r["metadata"]["name"] for r in k["Role"]] == ["h3op-h3serve-operator-leader"]
    assert len(k["ClusterRole"]) == 1 and len(k["ClusterRoleBinding"]) == 1
    assert "--all-namespaces" in k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_rbac_is_least_privilege(helm):
    rules = [r for r in by_kind(template(helm))["Role"] if not r["metadata"]["name"].endswith("-leader")][0]["rules"]
    granted = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    assert not any(r in ("secrets", "pods/exec", "nodes", "roles", "rolebindings") for _, r in granted)
    # read: to explain unready stages; delete: to restart a gang whole (never create or change a pod)
    assert granted[("", "pods")] == {"list", "watch", "delete"}
    assert granted[("h3serve.io", "h3deployments")] == {"get", "list", "watch", "patch"}
    # what the operator sends is server-side apply (patch) and merge patches: no update anywhere but the one the
    # blockOwnerDeletion admission check asks for (the operator e2e test compares the rest with the audit log)
    assert [k for k, v in granted.items() if "update" in v] == [("h3serve.io", "h3deployments/finalizers")]
    assert "create" not in granted[("h3serve.io", "h3deployments")]


def test_operator_deployment(helm):
    dep = by_kind(template(helm))["Deployment"][0]
    spec = dep["spec"]
    # leader election (a Lease) keeps a rolling update from having two reconciling replicas
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "RollingUpdate"
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["h3serve", "operator"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}  # Ready once it applied its CRD
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert c["image"] == "registry.example/h3serve:0.1.0"
    assert "--leader-election-namespace=ops" in c["args"] and "--apply-crd" in c["args"]
    policy = chart_policy(c["args"])
    assert policy["allowedVolumeKinds"] == ["persistentVolumeClaim", "csi", "ephemeral", "image"]
    assert policy["allowedImages"] == ["registry.example/h3serve"]  # the chart's own image, and nothing else
    assert AdmissionPolicy.from_values(policy) == AdmissionPolicy(images=("registry.example/h3serve",))
    env = {e["name"] for e in c["env"]}
    assert "POD_NAME" in env


def chart_policy(args: list[str]) -> dict:
    """The --policy JSON the chart passes the operator."""
    [arg] = [a for a in args if a.startswith("--policy=")]
    return json.loads(arg.removeprefix("--policy="))


def test_policy_values_reach_the_operator(helm):
    c = by_kind(template(helm, "--set", "policy.allowedImages={mirror.example/h3/,other/h3}",
                         "--set", "policy.allowedVolumeKinds={persistentVolumeClaim,hostPath}",
                         "--set", "policy.allowedCsiDrivers={csi.example.com}", "--set", "policy.maxVolumeSize=300Gi",
                         "--set", "policy.allowedSecretNames={h3-*}", "--set", "policy.allowedPriorityClasses={h3}",
                         "--set", "policy.deniedNodeKeys={gpu-reserved}", "--set", "policy.allowedServiceTypes={ClusterIP}",
                         "--set", "policy.allowUnauthenticatedExternal=true"))["Deployment"][0]
    policy = AdmissionPolicy.from_values(chart_policy(c["spec"]["template"]["spec"]["containers"][0]["args"]))
    assert policy == AdmissionPolicy(
        volume_kinds=("persistentVolumeClaim", "hostPath"), images=("registry.example/h3serve", "mirror.example/h3/",
                                                                    "other/h3"),
        csi_drivers=("csi.example.com",), max_volume_size="300Gi", secret_names=("h3-*",), priority_classes=("h3",),
        denied_node_keys=("gpu-reserved",), service_types=("ClusterIP",), allow_unauthenticated_external=True)


def test_every_policy_key_of_the_chart_is_one_the_operator_reads(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["policy"]
    assert sorted(values) == sorted(AdmissionPolicy._KEYS)
    assert AdmissionPolicy.from_values(values) == AdmissionPolicy()  # the chart's defaults are the operator's


def test_the_admission_policy_carries_the_policy_values_and_can_be_turned_off(helm):
    k = by_kind(template(helm, "--set", "policy.allowedCsiDrivers={csi.example.com}", "--set",
                         "policy.maxVolumeSize=300Gi", "--set", "policy.allowedServiceTypes={ClusterIP}"))
    vap, binding = k["ValidatingAdmissionPolicy"][0], k["ValidatingAdmissionPolicyBinding"][0]
    text = "\n".join(v["expression"] for v in vap["spec"]["validations"])
    assert '["csi.example.com"]' in text and 'quantity("300Gi")' in text and '["ClusterIP"]' in text, text
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    # namespaced: only the watched namespaces' H3Deployments
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ops"]
    # "*" lets any CSI driver through: no rule for it
    k = by_kind(template(helm, "--set", "policy.allowedCsiDrivers={*}"))
    assert "CSI driver" not in json.dumps(k["ValidatingAdmissionPolicy"][0])
    assert "ValidatingAdmissionPolicy" not in by_kind(template(helm, "--set", "admissionPolicy.enabled=false"))


def test_leader_election_and_crd_rbac(helm):
    k = by_kind(template(helm))
    lease_role = next(r for r in k["Role"] if r["metadata"]["name"].endswith("-leader"))
    assert lease_role["metadata"]["namespace"] == "ops"
    assert lease_role["rules"] == [  # its own Lease only (create cannot be limited by name)
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["h3serve-operator"],
         "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    crd_role = next(r for r in k["ClusterRole"] if r["metadata"]["name"].endswith("-crd"))
    assert crd_role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                                  "resourceNames": ["h3deployments.h3serve.io"], "verbs": ["get", "patch"]}]
    k = by_kind(template(helm, "--set", "crd.manage=false"))
    assert "ClusterRole" not in k
    assert "--apply-crd" not in k["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_values_schema_rejects_bad_values(helm):
    bad = helm("template", "h3op", str(CHART), "--set", "clusterScope=maybe", check=False)
    assert bad.returncode != 0 and "clusterScope" in bad.stderr
    bad = helm("template", "h3op", str(CHART), "--set", "operator.resyncSeconds=1", check=False)
    assert bad.returncode != 0 and "resyncSeconds" in bad.stderr
    bad = helm("template", "h3op", str(CHART), "--set", "watchNamespaces={Bad_NS}", check=False)
    assert bad.returncode != 0
    bad = helm("template", "h3op", str(CHART), "--set", "typo=1", check=False)
    assert bad.returncode != 0 and "typo" in bad.stderr


def test_values_yaml_is_valid_and_documented():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    assert set(values) == set(schema["properties"])
    text = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(text):  # every top-level key is preceded by a comment
        if line and not line.startswith((" ", "#")) and ":" in line:
            assert any(text[j].startswith("#") for j in range(max(0, i - 3), i)), line


def test_kube_version_gate(helm):
    bad = helm("template", "h3op", str(CHART), "--kube-version", "1.29.0", check=False)
    assert bad.returncode != 0 and "kubeVersion" in bad.stderr


def test_an_image_tag_of_digits_is_passed_as_a_string():
    """scripts/image.sh tags the image with a content hash, which can be all digits (928727826166 was): `--set` turns
    that into a number the chart's schema refuses, so the README and the real-cluster install use `--set-string`."""
    readme = (ROOT / "README.md").read_text()
    cluster = (ROOT / "tests" / "realcluster" / "test_cluster.py").read_text()
    assert "--set-string image.tag=" in readme and "--set image.tag" not in readme
    assert '"--set-string", f"image.tag={tag}"' in cluster


def test_the_chart_refuses_a_numeric_tag_and_takes_the_same_digits_as_a_string(helm):
    r = helm("template", "h3op", str(CHART), "--set", "image.tag=928727826166", check=False)
    assert r.returncode != 0 and "/image/tag" in r.stderr and "want string" in r.stderr, r.stderr
    (dep,) = by_kind(template(helm, "--set-string", "image.tag=928727826166"))["Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":928727826166")
