"""The operator's only contact with the API server: server-side apply, list, delete, status patch.

Built on the official `kubernetes` client's dynamic client. Every write carries the field manager
`h3serve-operator`; applies force ownership of the fields the renderer sets (drift is repaired, fields
owned by others, e.g. an HPA's replicas on a stage we do not render, are left alone). Every write of a reconcile
first passes its fence (`fenced`): a replica that lost the leader's term mid-pass writes nothing more.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import logging
import os
import socket
import threading
import uuid
from typing import Any, Callable, Iterator

from kubernetes import client, config
from kubernetes import dynamic as kdyn
from kubernetes.dynamic.exceptions import NotFoundError

from h3serve.config.spec import GROUP, PLURAL, VERSION
from h3serve.errors import H3Error
from h3serve.operator import manifests as M

FIELD_MANAGER = "h3serve-operator"
log = logging.getLogger("h3serve.operator")

_fence: contextvars.ContextVar[Callable[[], None]] = contextvars.ContextVar("fence", default=lambda: None)


@contextlib.contextmanager
def fenced(check: Callable[[], None]) -> Iterator[None]:
    """Within: `check` runs before every write and raises to refuse it (leader.Leader.check of the pass's term)."""
    token = _fence.set(check)
    try:
        yield
    finally:
        _fence.reset(token)


def _write() -> None:
    _fence.get()()


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
    _write()
    res = _resource(obj["apiVersion"], obj["kind"])
    out = res.server_side_apply(body=obj, name=obj["metadata"]["name"], namespace=obj["metadata"]["namespace"],
                                field_manager=FIELD_MANAGER, force_conflicts=True)
    return _plain(out)


HANDOVER_MANAGER = "h3serve-handover-to-hpa"


def hand_over_replicas(obj: dict, live: dict) -> None:
    """Before the operator's apply drops spec.replicas (an autoscaler takes the count over), co-own the field at its
    live value under a second manager: server-side apply then keeps the field instead of removing it, which would
    default it to 1 and delete running pods before the autoscaler scales back up (the hand-over the Kubernetes
    server-side apply docs give for an HPA)."""
    _write()
    fields = [m for m in live["metadata"].get("managedFields") or []
              if m.get("manager") == FIELD_MANAGER and "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})]
    replicas = (live.get("spec") or {}).get("replicas")
    if not fields or replicas is None:
        return
    md = live["metadata"]
    res = _resource(obj["apiVersion"], obj["kind"])
    res.server_side_apply(body={"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                                "metadata": {"name": md["name"], "namespace": md["namespace"]},
                                "spec": {"replicas": replicas}},
                          name=md["name"], namespace=md["namespace"], field_manager=HANDOVER_MANAGER)


WORLD_MANAGER = "h3serve-gang-world"


def annotate(obj: dict, key: str, value: str) -> None:
    """Set one annotation of a live object as its own field manager, so the operator's next apply (which does not
    carry it) keeps it."""
    _write()
    md = obj["metadata"]
    _resource(obj["apiVersion"], obj["kind"]).patch(
        body={"metadata": {"annotations": {key: value}}}, name=md["name"], namespace=md["namespace"],
        content_type="application/merge-patch+json", field_manager=WORLD_MANAGER)


_served: dict[str, bool] = {}
_served_lock = threading.Lock()


def served(kind: str) -> bool:
    """Does the API server serve this child kind (API discovery, once per process)?"""
    with _served_lock:
        if kind not in _served:
            _served[kind] = _discover(kind)
    return _served[kind]


def _discover(kind: str) -> bool:
    # The group version's own discovery document, not the dynamic client's cache: a miss there invalidates and
    # rebuilds the cache, which races with the reconciles of other objects using it in other threads.
    from kubernetes.dynamic.exceptions import NotFoundError

    api_version, plural = M.KINDS[kind]
    path = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    try:
        doc = dynamic().request("GET", path).to_dict()
    except NotFoundError:
        return False
    return any(r.get("name") == plural and r.get("kind") == kind for r in doc.get("resources") or [])


def get(kind: str, namespace: str, name: str) -> dict | None:
    api_version, _ = M.KINDS[kind]
    try:
        return _plain(_resource(api_version, kind).get(name=name, namespace=namespace))
    except NotFoundError:
        return None


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


def list_events(namespace: str, kind: str, name: str) -> list[dict]:
    """The core/v1 Events about one object (what its controller reported: e.g. a StatefulSet's FailedCreate)."""
    sel = f"involvedObject.kind={kind},involvedObject.name={name}"
    return _plain(_resource("v1", "Event").get(namespace=namespace, field_selector=sel)).get("items") or []


def delete(kind: str, namespace: str, name: str) -> None:
    _write()
    api_version, _ = M.KINDS[kind] if kind in M.KINDS else ("v1", "pods")
    try:
        _resource(api_version, kind).delete(name=name, namespace=namespace,
                                            body={"propagationPolicy": "Background"})
    except NotFoundError:
        pass


def set_pod_condition(namespace: str, name: str, ctype: str, value: bool, reason: str, message: str) -> None:
    """One condition of a pod's status (a readiness gate's): a strategic merge keyed by type keeps the kubelet's."""
    _write()
    cond = {"type": ctype, "status": "True" if value else "False", "reason": reason, "message": message[:1024],
            "lastTransitionTime": _now()}
    try:
        _resource("v1", "Pod").status.patch(body={"status": {"conditions": [cond]}}, name=name, namespace=namespace,
                                            content_type="application/strategic-merge-patch+json",
                                            field_manager=FIELD_MANAGER)
    except NotFoundError:
        pass


def patch_status(namespace: str, name: str, status: dict) -> None:
    _write()
    res = _resource(f"{GROUP}/{VERSION}", "H3Deployment")
    res.status.patch(body={"status": status}, name=name, namespace=namespace,
                     content_type="application/merge-patch+json", field_manager=FIELD_MANAGER)


def owned_by(obj: dict, uid: str) -> bool:
    return any(r.get("uid") == uid for r in (obj.get("metadata") or {}).get("ownerReferences") or [])


# ---- Events ----------------------------------------------------------------------------------------------------

INSTANCE = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_event(cr: dict, etype: str, reason: str, message: str) -> None:
    """A core/v1 Event on the H3Deployment (what `kubectl describe h3d` and `kubectl get events` show)."""
    _write()
    md = cr["metadata"]
    now = _now()
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{md['name']}.{uuid.uuid4().hex[:16]}", "namespace": md["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "H3Deployment", "name": md["name"],
                           "namespace": md["namespace"], "uid": md["uid"],
                           "resourceVersion": md.get("resourceVersion")},
        "type": etype, "reason": reason, "message": message[:1024],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER, "reportingInstance": INSTANCE,
    }
    _resource("v1", "Event").create(body=body, namespace=md["namespace"])


# ---- start-up checks -------------------------------------------------------------------------------------------

def check_access(namespaces: list[str]) -> None:
    """One read of H3Deployments where the operator will watch them: bad credentials or missing RBAC fail here, at
    once and by name, instead of in retried watches."""
    load_config()
    api = client.CustomObjectsApi()
    for ns in namespaces or [None]:
        try:
            if ns:
                api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, limit=1, _request_timeout=30)
            else:
                api.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1, _request_timeout=30)
        except client.exceptions.ApiException as e:
            server = api.api_client.configuration.host
            if e.status == 401:
                raise H3Error(f"operator: the API server {server} rejected the credentials (401 Unauthorized); "
                              f"check the token or client certificate in use") from None
            if e.status == 403:
                raise H3Error(f"operator: not allowed to list {PLURAL}.{GROUP} in "
                              f"{'namespace ' + ns if ns else 'all namespaces'} (403 Forbidden): {_reason(e)}") from None
            if e.status == 404:
                raise H3Error(f"operator: the API server {server} does not serve {PLURAL}.{GROUP}/{VERSION}; "
                              f"install the CRD first (the chart does)") from None
            raise


def _reason(e: Exception) -> str:
    import json

    try:
        return json.loads(e.body)["message"]
    except Exception:  # noqa: BLE001 - any body
        return str(e)


def get_crd(name: str) -> dict | None:
    try:
        return _plain(_resource("apiextensions.k8s.io/v1", "CustomResourceDefinition").get(name=name))
    except NotFoundError:
        return None


def apply_crd(crd: dict) -> None:
    """Server-side apply of the operator's own CRD (so `helm upgrade` upgrades it: Helm never touches crds/)."""
    res = _resource("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    res.server_side_apply(body=crd, name=crd["metadata"]["name"], field_manager=FIELD_MANAGER, force_conflicts=True)


__all__ = ["FIELD_MANAGER", "PLURAL", "annotate", "apply", "apply_crd", "check_access", "delete", "dynamic",
           "fenced", "get", "get_crd", "get_h3deployment", "hand_over_replicas", "list_children", "list_pods",
           "load_config", "owned_by", "patch_status", "post_event", "served"]
