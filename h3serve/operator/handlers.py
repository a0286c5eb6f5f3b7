"""kopf handlers for H3Deployment: read, render (pure), apply (server-side), prune, write status.

Run with `h3serve operator` or `kopf run -m h3serve.operator.handlers` (or the file path).

- create / update / resume: reconcile now.
- A daemon per H3Deployment reconciles again when one of its children changes (child watches below) and every
  RESYNC_SECONDS: drift (a child edited or deleted) is repaired, and the status follows the pods.
- delete: nothing to do; every child carries an owner reference, the garbage collector removes them.
Reconciles of one H3Deployment never overlap (a lock per object), and every write is idempotent (server-side
apply of deterministic names), so the operator can be killed and restarted at any point.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import threading

import kopf

from h3serve.config.spec import GROUP, PLURAL, VERSION, H3DeploymentSpec, SpecError, validate
from h3serve.operator import kube
from h3serve.operator import manifests as M
from h3serve.operator import status as S

RESYNC_SECONDS = float(os.environ.get("H3SERVE_RESYNC_SECONDS", "60"))
DEBOUNCE_SECONDS = float(os.environ.get("H3SERVE_DEBOUNCE_SECONDS", "0.5"))
RESOURCE = (GROUP, VERSION, PLURAL)

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_triggers: dict[tuple[str, str], asyncio.Event] = {}


def _lock(key: tuple[str, str]) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(namespace: str, name: str, logger: logging.Logger) -> dict | None:
    """One pass: desired objects from the current spec, applied; extras pruned; status written."""
    with _lock((namespace, name)):
        cr = kube.get_h3deployment(namespace, name)
        if cr is None or cr["metadata"].get("deletionTimestamp"):
            return None
        md = cr["metadata"]
        generation = int(md.get("generation") or 0)
        spec: H3DeploymentSpec | None = None
        try:
            spec = H3DeploymentSpec.from_dict(cr.get("spec") or {})
            issues = validate(spec, name)
        except SpecError as e:
            issues = e.issues
        if issues:
            logger.warning("invalid spec (generation %s): %s", generation, "; ".join(m for _, m in issues))

        apply_error = None
        workloads: list[dict] = []
        if spec is not None and not issues:
            desired = M.render(spec, name, namespace, owner={"name": name, "uid": md["uid"]})
            keep = {(o["kind"], o["metadata"]["name"]) for o in desired}
            for obj in desired:
                try:
                    out = kube.apply(obj)
                except Exception as e:  # noqa: BLE001 - reported in status, retried by the caller
                    apply_error = f"{obj['kind']}/{obj['metadata']['name']}: {_short(e)}"
                    logger.error("apply failed: %s", apply_error)
                    break
                if obj["kind"] in ("Deployment", "StatefulSet"):
                    workloads.append(out)
            if apply_error is None:
                _prune(namespace, name, md["uid"], keep, logger)
        else:  # keep what runs; describe it
            workloads = [w for kind in ("Deployment", "StatefulSet")
                         for w in kube.list_children(namespace, name, kind) if kube.owned_by(w, md["uid"])]

        pods = _pods_if_unready(namespace, name, workloads, logger)
        new = S.compute(name=name, namespace=namespace, generation=generation,
                        spec=spec if not issues else None, issues=issues, workloads=workloads,
                        previous=cr.get("status"), now=_now(), apply_error=apply_error, pods=pods)
        old = cr.get("status") or {}
        if not S.same(old, new):
            patch = dict(new)
            gone = {k: None for k in (old.get("stages") or {}) if k not in new["stages"]}
            if gone:
                patch["stages"] = {**new["stages"], **gone}
            kube.patch_status(namespace, name, patch)
        if apply_error:
            raise kopf.TemporaryError(f"apply failed: {apply_error}", delay=10)
        return new


def _pods_if_unready(namespace: str, name: str, workloads: list[dict], logger) -> list[dict]:
    """The pods, when some are not ready (their conditions explain why); [] if they may not be read."""
    if not any(int((w.get("status") or {}).get("readyReplicas") or 0) < int((w.get("spec") or {}).get("replicas") or 0)
               for w in workloads):
        return []
    try:
        return kube.list_pods(namespace, name)
    except Exception as e:  # noqa: BLE001 - e.g. RBAC without pods: list; the status just says less
        logger.warning("cannot list pods to explain unready stages: %s", _short(e))
        return []


def _prune(namespace: str, name: str, uid: str, keep: set, logger: logging.Logger) -> None:
    for kind in M.KINDS:
        for obj in kube.list_children(namespace, name, kind):
            key = (kind, obj["metadata"]["name"])
            if key not in keep and kube.owned_by(obj, uid):
                logger.info("pruning %s/%s (no longer in the spec)", *key)
                kube.delete(kind, namespace, key[1])


def _short(e: Exception) -> str:
    body = getattr(e, "body", None) or getattr(e, "summary", lambda: None)()
    return str(body or e).strip().splitlines()[0][:400]


async def _reconcile(namespace: str, name: str, logger) -> None:
    await asyncio.to_thread(reconcile, namespace, name, logger)


# ---- handlers ---------------------------------------------------------------------------------------------------

@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # Keep kopf's bookkeeping in annotations: the CRD's status schema has no room for it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Serve exactly the namespaces given and the resources present at startup: no cluster-wide list/watch of
    # namespaces and CRDs, so a namespaced operator needs no ClusterRole at all. (The chart installs the CRD first.)
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # Events on the H3Deployment for warnings and errors only
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    kube.dynamic()  # fail fast on bad credentials


@kopf.on.login()
def login(**kwargs):
    return kopf.login_via_client(**kwargs)


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
@kopf.on.resume(*RESOURCE)
async def on_change(name: str, namespace: str, logger, **_) -> None:
    await _reconcile(namespace, name, logger)


@kopf.on.delete(*RESOURCE, optional=True)
def on_delete(name: str, namespace: str, logger, **_) -> None:
    logger.info("deleted; the garbage collector removes the children through their owner references")
    _triggers.pop((namespace, name), None)


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def keep_in_sync(name: str, namespace: str, stopped, logger, **_) -> None:
    key = (namespace, name)
    trigger = _triggers.setdefault(key, asyncio.Event())
    while not stopped:
        try:
            await asyncio.wait_for(trigger.wait(), timeout=RESYNC_SECONDS)
        except asyncio.TimeoutError:
            pass
        if stopped:
            break
        await asyncio.sleep(DEBOUNCE_SECONDS)  # coalesce a burst of child events into one pass
        trigger.clear()
        try:
            await _reconcile(namespace, name, logger)
        except kopf.TemporaryError as e:
            logger.warning("%s; retrying", e)
            trigger.set()
            await asyncio.sleep(e.delay or 10)
        except Exception as e:  # noqa: BLE001 - keep the daemon alive; the next pass retries
            logger.exception("reconcile failed: %s", e)
            await asyncio.sleep(5)
    _triggers.pop(key, None)


def _child_changed(body, namespace: str, **_) -> None:
    md = body.get("metadata") or {}
    owners = [r.get("name") for r in md.get("ownerReferences") or []
              if r.get("kind") == "H3Deployment" and r.get("apiVersion", "").startswith(GROUP + "/")]
    for owner in owners or [(md.get("labels") or {}).get(M.LABEL_INSTANCE)]:  # pods: owned by ReplicaSets
        ev = _triggers.get((namespace, owner))
        if ev is not None:
            ev.set()


_OURS = {M.LABEL_MANAGED_BY: M.MANAGER}
for _kind, (_api_version, _plural) in {**M.KINDS, "Pod": ("v1", "pods")}.items():
    kopf.on.event(_api_version, _plural, labels=_OURS, id=f"child-{_plural}")(_child_changed)
