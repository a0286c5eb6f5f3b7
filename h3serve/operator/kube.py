"""The operator's only contact with the API server: server-side apply, list, delete, status patch.

Built on the official `kubernetes` client's dynamic client. Every write carries the field manager
`h3serve-operator`; applies force ownership of the fields the renderer sets (drift is repaired, fields
owned by others, e.g. an HPA's replicas on a stage we do not render, are left alone).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kubernetes import client, config
from kubernetes import dynamic as kdyn
from kubernetes.dynamic.exceptions import NotFoundError

from h3serve.config.spec import GROUP, PLURAL, VERSION
from h3serve.operator import manifests as M

FIELD_MANAGER = "h3serve-operator"
log = logging.getLogger("h3serve.operator")

_client_lock = threading.Lock()
_dyn = None


def load_config() -> None:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config()
            return
        except config.ConfigException:
            pass
    config.load_kube_config()


def dynamic():
    global _dyn
    with _client_lock:
        if _dyn is None:
            load_config()
            _dyn = kdyn.DynamicClient(client.ApiClient())
        return _dyn


def _resource(api_version: str, kind: str):
    return dynamic().resources.get(api_version=api_version, kind=kind)


def _plain(obj: Any) -> dict:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def get_h3deployment(namespace: str, name: str) -> dict | None:
    try:
        return _plain(_resource(f"{GROUP}/{VERSION}", "H3Deployment").get(name=name, namespace=namespace))
    except NotFoundError:
        return None


def apply(obj: dict) -> dict:
    res = _resource(obj["apiVersion"], obj["kind"])
    out = res.server_side_apply(body=obj, name=obj["metadata"]["name"], namespace=obj["metadata"]["namespace"],
                                field_manager=FIELD_MANAGER, force_conflicts=True)
    return _plain(out)


def list_children(namespace: str, name: str, kind: str) -> list[dict]:
    api_version, _ = M.KINDS[kind]
    sel = f"{M.LABEL_INSTANCE}={name},{M.LABEL_MANAGED_BY}={M.MANAGER}"
    items = _plain(_resource(api_version, kind).get(namespace=namespace, label_selector=sel)).get("items") or []
    for it in items:  # list items carry no apiVersion/kind
        it.setdefault("kind", kind)
        it.setdefault("apiVersion", api_version)
    return items


def list_pods(namespace: str, name: str) -> list[dict]:
    sel = f"{M.LABEL_INSTANCE}={name},{M.LABEL_MANAGED_BY}={M.MANAGER}"
    return _plain(_resource("v1", "Pod").get(namespace=namespace, label_selector=sel)).get("items") or []


def delete(kind: str, namespace: str, name: str) -> None:
    api_version, _ = M.KINDS[kind]
    try:
        _resource(api_version, kind).delete(name=name, namespace=namespace,
                                            body={"propagationPolicy": "Background"})
    except NotFoundError:
        pass


def patch_status(namespace: str, name: str, status: dict) -> None:
    res = _resource(f"{GROUP}/{VERSION}", "H3Deployment")
    res.status.patch(body={"status": status}, name=name, namespace=namespace,
                     content_type="application/merge-patch+json", field_manager=FIELD_MANAGER)


def owned_by(obj: dict, uid: str) -> bool:
    return any(r.get("uid") == uid for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


__all__ = ["FIELD_MANAGER", "PLURAL", "apply", "delete", "dynamic", "get_h3deployment", "list_children",
           "list_pods", "load_config", "owned_by", "patch_status"]
