"""The CRD is generated from h3serve.config.spec; the chart ships exactly that file."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import string
import typing

import jsonschema
import kubernetes_validate
import pytest
import yaml

from h3serve.config import spec as S
from h3serve.config.codec import unwrap_optional
from h3serve.config.rules import RULES, Expr
from h3serve.operator import crd

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts" / "h3serve-operator" / "crds" / "h3deployments.h3serve.io.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_chart_crd_is_the_generated_one():
    assert CHART_CRD.read_text() == crd.to_yaml(), (
        "regenerate: python -m h3serve.operator.crd > charts/h3serve-operator/crds/h3deployments.h3serve.io.yaml")


def test_crd_is_a_valid_object():
    kubernetes_validate.validate(crd.crd(), "1.37.0", strict=True)


def test_crd_shape():
    c = crd.crd()
    v = c["spec"]["versions"][0]
    assert c["spec"]["group"] == "h3serve.io" and v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert c["spec"]["names"]["shortNames"] == ["h3d"]
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    cols = [col["name"] for col in v["additionalPrinterColumns"]]
    assert {"Profile", "Placement", "Ready", "Age"} <= set(cols)


def _walk(cls, schema, path=""):
    hints = typing.get_type_hints(cls)
    props = schema["properties"]
    assert set(props) == {f.metadata["json"] for f in dataclasses.fields(cls)}, path
    for f in dataclasses.fields(cls):
        sub = props[f.metadata["json"]]
        assert sub["description"], path + f.name
        if f.default not in (dataclasses.MISSING, None):
            assert sub["default"] == f.default, path + f.name
        tp, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            _walk(tp, sub, f"{path}{f.metadata['json']}.")


def test_schema_mirrors_every_spec_field_and_default():
    _walk(S.H3DeploymentSpec, crd.spec_schema())


def test_every_rule_is_in_the_schema():
    rules = []

    def collect(node):
        rules.extend(node.get("x-kubernetes-validations", []))
        for sub in (node.get("properties") or {}).values():
            collect(sub)

    collect(crd.spec_schema())
    assert rules == [{"rule": r.check.cel(), "messageExpression": r.cel_message(), "fieldPath": "." + r.field,
                      "reason": "FieldValueInvalid"} for r in RULES] + [crd.SCALE_RULE]
    schema = crd.spec_schema()
    for r in RULES:  # each fieldPath names a field of the schema
        node = schema
        for part in r.field.split("."):
            node = node["properties"][part]


def _eval_message_expression(r, doc: dict) -> str:
    """Evaluate a generated messageExpression, `"<text>".format([<args>])` or a bare literal, the way CEL does."""
    text, end = json.JSONDecoder().raw_decode(r.cel_message())
    args = [a for _, name, _, _ in string.Formatter().parse(r.message) if name is not None
            for a in [r.args[name]] if isinstance(a, Expr)]
    tail = r.cel_message()[end:]
    assert tail == (f".format([{', '.join(a.cel() for a in args)}])" if args else ""), tail
    return text % tuple(a.value(doc) for a in args)  # %d / %s / %% mean the same in CEL's format


def test_message_expressions_say_what_python_says():
    doc = S.H3DeploymentSpec.from_dict({
        "image": "i", "profile": "fasth3", "model": {"path": "/m/H3", "adapter": {"path": "/x/a", "sha256": "0" * 64}},
        "encoder": {"tensorParallel": 3}, "dit": {"ulysses": 3, "ring": 2}, "vae": {"patchParallel": 5},
        "fasth3": {"adapter": {"path": "/x/b"}, "ulysses": 3, "ring": 3}}).to_dict()
    for r in RULES:
        assert _eval_message_expression(r, doc) == r.format(doc), r.field


def _plain_jsonschema(node):
    if isinstance(node, dict):
        return {k: _plain_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if isinstance(node, list):
        return [_plain_jsonschema(v) for v in node]
    return node


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_match_the_openapi_schema(path):
    doc = yaml.safe_load(path.read_text())
    jsonschema.validate(doc["spec"], _plain_jsonschema(crd.spec_schema()))


def test_openapi_schema_rejects_what_the_parser_rejects():
    bad = {"image": "i", "model": {"path": "/m"}, "placement": "spread"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _plain_jsonschema(crd.spec_schema()))
    with pytest.raises(S.SpecError):
        S.H3DeploymentSpec.from_dict(bad)


def _newer(version: str, extra: dict | None = None) -> dict:
    c = crd.crd()
    c["metadata"]["annotations"][crd.VERSION_ANNOTATION] = f"h3serve {version}"
    c["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"].update(extra or {})
    return c


def test_an_older_operator_never_lowers_a_newer_crd():
    """A rollback or an older replica of a mixed rollout: the stored CRD of a later h3serve is left alone, naming
    the fields only it declares; ours, an older one's or one from before the annotation is applied over."""
    assert crd.generated_by(crd.crd()) is not None and crd.newer_than_ours(crd.crd()) is None
    later = _newer("99.0.0", {"security": {"type": "object", "properties": {"mode": {"type": "string"}}}})
    assert crd.newer_than_ours(later) == ["v1alpha1:spec.security", "v1alpha1:spec.security.mode"]
    assert crd.newer_than_ours(_newer("99.0.0")) == []  # newer with no new field: still not lowered
    assert crd.newer_than_ours(_newer("0.0.1", {"gone": {"type": "string"}})) is None  # older: a field it dropped
    unannotated = crd.crd()
    del unannotated["metadata"]["annotations"]
    assert crd.newer_than_ours(unannotated) is None
