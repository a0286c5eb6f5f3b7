"""The H3Deployment CustomResourceDefinition, generated from `h3serve.config.spec`.

The OpenAPI schema comes from the spec dataclasses (JSON names, docs, defaults, bounds, enums); the cross-field
rules (CEL rule, messageExpression, fieldPath) are rendered from `h3serve.config.rules.RULES`, the same objects
`validate` runs. The chart ships the output in `charts/h3serve-operator/crds/`; a test fails when
that file and this generator disagree. Regenerate with:

    python -m h3serve.operator.crd > charts/h3serve-operator/crds/h3deployments.h3serve.io.yaml
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing

import yaml

from h3serve import __version__
from h3serve.config import spec as S
from h3serve.config.codec import dump, unwrap_optional
from h3serve.config.rules import RULES

# which h3serve generated a stored CRD: named when an older operator refuses to apply its CRD over a newer one
VERSION_ANNOTATION = f"{S.GROUP}/generated-by"

def _field_schema(tp, fl: dataclasses.Field) -> dict:
    md = fl.metadata
    tp, _ = unwrap_optional(tp)
    extra = dict(md["schema"])
    if dataclasses.is_dataclass(tp):
        out = _object_schema(tp)
        if fl.default_factory is not dataclasses.MISSING:
            # the nested defaults spelled out: CEL rules on the object see them even when the user omits it
            out["default"] = dump(fl.default_factory())
    elif tp is bool:
        out = {"type": "boolean"}
    elif tp is int:
        out = {"type": "integer", "format": "int32"}
    elif tp is str:
        out = {"type": "string"}
    elif tp is dict:
        if "properties" in extra:  # e.g. resources
            out = {}
        elif md["json"] in ("nodeSelector",):
            out = {"type": "object", "additionalProperties": {"type": "string"}}
        else:  # a Kubernetes volume source: passed through as written
            out = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    elif tp is list:
        if "items" in extra:  # its items' schema is in the field's metadata
            out = {"type": "array"}
        elif md["json"] == "imagePullSecrets":
            out = {"type": "array", "items": {"type": "string"}, "maxItems": 32}
        else:
            out = {"type": "array", "items": S.TOLERATION_SCHEMA, "maxItems": 64}
    else:
        raise TypeError(f"no schema for {tp!r}")
    out.update(extra)
    out["description"] = md["doc"]
    if fl.default is not dataclasses.MISSING and fl.default is not None:
        out["default"] = fl.default
    return dict(sorted(out.items()))


def _object_schema(cls) -> dict:
    hints = typing.get_type_hints(cls)
    props, required = {}, []
    for fl in dataclasses.fields(cls):
        props[fl.metadata["json"]] = _field_schema(hints[fl.name], fl)
        if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
            required.append(fl.metadata["json"])
    out: dict = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


# A transition rule (it compares with the stored object, which the operator never sees, so only the API server
# checks it): /scale writes spec.replicas, which a disaggregated spec ignores while dit.replicas or dit.autoscaling
# sets the DiT count; a scale there is refused by name instead of silently doing nothing.
SCALE_RULE = {
    "rule": "self.replicas == oldSelf.replicas || self.placement == 'colocated' || "
            "(!has(self.dit.replicas) && !has(self.dit.autoscaling))",
    "message": "spec.replicas (the /scale subresource) cannot change while dit.replicas or dit.autoscaling sets the "
               "DiT replicas of this disaggregated H3Deployment: change dit.replicas, or remove it to scale with "
               "spec.replicas",
    "fieldPath": ".replicas", "reason": "FieldValueForbidden"}


def spec_schema() -> dict:
    schema = _object_schema(S.H3DeploymentSpec)
    schema["description"] = "The desired serving graph. See h3serve.config.spec.H3DeploymentSpec."
    # every rule sits on the spec itself and names its field: the API server reports it at spec.<field>
    schema["x-kubernetes-validations"] = [
        {"rule": r.check.cel(), "messageExpression": r.cel_message(), "fieldPath": "." + r.field,
         "reason": "FieldValueInvalid"} for r in RULES] + [SCALE_RULE]
    return schema


def status_schema() -> dict:
    stage = {"type": "object", "properties": {"ready": {"type": "integer"}, "desired": {"type": "integer"}}}
    condition = {
        "type": "object", "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"}, "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"}, "message": {"type": "string"},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
        },
    }
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64",
                                   "description": "The generation the status describes."},
            "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["type"],
                           "description": "SpecValid, Progressing, Ready and Degraded."},
            "stages": {"type": "object", "additionalProperties": stage,
                       "description": "Per stage: ready and desired replicas (a gang counts once)."},
            "endpoint": {"type": "object", "properties": {"grpc": {"type": "string"}, "http": {"type": "string"}},
                         "description": "Where clients reach the gateway."},
            "replicas": {"type": "integer", "description": "Ready replicas of the DiT pool (colocated: engine "
                         "replicas), what spec.replicas scales."},
            "selector": {"type": "string", "description": "Label selector of the pods counted in replicas."},
            "summary": {"type": "string", "description": "Ready stages / all stages."},
        },
    }


def crd() -> dict:
    printer = [
        {"name": "Profile", "type": "string", "jsonPath": ".spec.profile"},
        {"name": "Placement", "type": "string", "jsonPath": ".spec.placement"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
        {"name": "Stages", "type": "string", "jsonPath": ".status.summary", "description": "ready/total stages"},
        {"name": "Reason", "type": "string", "priority": 1,
         "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    name_rule = {
        "rule": f"self.metadata.name.size() <= {S.NAME_MAX} && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
        "message": (f"metadata.name must be at most {S.NAME_MAX} characters of a-z, 0-9 and '-', start with a letter "
                    f"and end with a letter or digit (it prefixes the names of Services and StatefulSet pods)"),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{S.PLURAL}.{S.GROUP}",
                     "labels": {"app.kubernetes.io/name": "h3serve", "app.kubernetes.io/part-of": "h3serve"},
                     "annotations": {VERSION_ANNOTATION: f"h3serve {__version__}"}},
        "spec": {
            "group": S.GROUP,
            "scope": "Namespaced",
            "names": {"kind": S.KIND, "listKind": f"{S.KIND}List", "plural": S.PLURAL, "singular": "h3deployment",
                      "shortNames": ["h3d"], "categories": ["h3serve"]},
            "versions": [{
                "name": S.VERSION, "served": True, "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": printer,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A MiniMax H3 / FastH3 serving graph.",
                    "required": ["spec"],
                    "x-kubernetes-validations": [name_rule],
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def schema_fields(crd_obj: dict) -> set[str]:
    """Every field a CRD's versions declare, as `version:path` (`v1alpha1:spec.dit.levers.fp8`)."""
    out: set[str] = set()

    def walk(node: dict, version: str, path: str) -> None:
        for name, sub in (node.get("properties") or {}).items():
            here = f"{path}.{name}" if path else name
            out.add(f"{version}:{here}")
            walk(sub, version, here)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], version, f"{path}[]")

    for v in crd_obj["spec"]["versions"]:
        out.add(f"{v['name']}:")
        walk(v["schema"]["openAPIV3Schema"], v["name"], "")
    return out


def generated_by(crd_obj: dict) -> tuple[int, ...] | None:
    """The h3serve version that generated a CRD (its annotation), or None (one from before the annotation)."""
    text = (crd_obj["metadata"].get("annotations") or {}).get(VERSION_ANNOTATION, "")
    m = re.fullmatch(r"h3serve (\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def newer_than_ours(stored: dict, ours: dict | None = None) -> list[str] | None:
    """None when applying ours over `stored` lowers nothing (stored is ours, older, or from before the annotation);
    else the fields (and versions) only `stored` declares, which that apply would prune from every stored object."""
    ours = ours or crd()
    theirs = generated_by(stored)
    if theirs is None or theirs <= generated_by(ours):
        return None
    return sorted(schema_fields(stored) - schema_fields(ours))


def to_yaml() -> str:
    head = ("# Generated by `python -m h3serve.operator.crd` from h3serve/config/spec.py and rules.py. Do not edit by "
            "hand.\n")
    return head + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main() -> int:
    sys.stdout.write(to_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
