"""kopf handlers for H3Deployment: read, render (pure), apply (server-side), prune, write status, post Events.

Run with `h3serve operator` or `kopf run -m h3serve.operator.handlers` (or the file path).

- Every event of an H3Deployment or of one of its children wakes that H3Deployment's worker, which reconciles it
  (debounced) and again every RESYNC_SECONDS: drift is repaired, the status follows the pods.
- No finalizer: the workers are plain tasks of this process, not kopf daemons (which need one), so deleting an
  H3Deployment never waits for the operator; its children carry owner references and the garbage collector removes
  them. An object left with the finalizer of an older operator version loses it at the operator's first look.
- Ownership: the operator only applies objects it created (an owner reference to this H3Deployment's uid) and only
  deletes those. An object in the way (a child's name, not ours) is left untouched: Degraded=ForeignObject and a
  Warning Event name it.
- With leader election (`h3serve operator` turns it on), only the holder of the Lease reconciles; the others
  watch and wait.
Reconciles of one H3Deployment never overlap (a lock per object), and every write is idempotent (server-side
apply of deterministic names), so the operator can be killed and restarted at any point.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import threading
from dataclasses import dataclass, field

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from h3serve.config.spec import (
    GROUP,
    PLURAL,
    VERSION,
    AdmissionPolicy,
    H3DeploymentSpec,
    SpecError,
    policy_issues,
    validate,
)
from h3serve.operator import kube
from h3serve.operator import manifests as M
from h3serve.operator import status as S
from h3serve.operator.leader import LostLease

RESYNC_SECONDS = float(os.environ.get("H3SERVE_RESYNC_SECONDS", "60"))
DEBOUNCE_SECONDS = float(os.environ.get("H3SERVE_DEBOUNCE_SECONDS", "0.5"))
RESOURCE = (GROUP, VERSION, PLURAL)
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
log = logging.getLogger("h3serve.operator")


@dataclass
class Settings:
    """What `h3serve operator` decides before kopf starts (the defaults serve `kopf run`)."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    leader: object | None = None  # h3serve.operator.leader.Leader, when leader election is on


SETTINGS = Settings()

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_triggers: dict[tuple[str, str], asyncio.Event] = {}
_workers: dict[tuple[str, str], asyncio.Task] = {}
_loop: asyncio.AbstractEventLoop | None = None
_posted: dict[tuple[str, str, str], str] = {}  # (uid, reason, subject) -> message last posted


def _lock(key: tuple[str, str]) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event(cr: dict, etype: str, reason: str, message: str, subject: str = "", once: bool = False) -> None:
    """Post an Event; with `once`, only when this (reason, subject) says something new for this object."""
    key = (cr["metadata"]["uid"], reason, subject)
    if once and _posted.get(key) == message:
        return
    _posted[key] = message
    try:
        kube.post_event(cr, etype, reason, message)
    except LostLease:
        raise
    except Exception as e:  # noqa: BLE001 - an Event is best effort; the status says the same
        log.warning("could not post Event %s: %s", reason, _short(e))


def _leading() -> bool:
    return SETTINGS.leader is None or SETTINGS.leader.is_leader()


def reconcile(namespace: str, name: str, logger: logging.Logger) -> dict | None:
    """One pass: desired objects from the current spec, applied; extras pruned; status written. Every write is
    fenced by the leader's term the pass began in (a replica deposed mid-pass writes nothing more)."""
    with _lock((namespace, name)):
        if not _leading():
            return None
        leader = SETTINGS.leader
        if leader is None:
            return _reconcile(namespace, name, logger)
        term = leader.term
        with kube.fenced(lambda: leader.check(term)):
            return _reconcile(namespace, name, logger)


def _reconcile(namespace: str, name: str, logger: logging.Logger) -> dict | None:
    cr = kube.get_h3deployment(namespace, name)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return None
    md = cr["metadata"]
    uid, generation = md["uid"], int(md.get("generation") or 0)
    spec: H3DeploymentSpec | None = None
    try:
        spec = H3DeploymentSpec.from_dict(cr.get("spec") or {})
        issues = validate(spec, name) + policy_issues(spec, SETTINGS.policy)
    except SpecError as e:
        issues = e.issues
    if issues:
        logger.warning("invalid spec (generation %s): %s", generation, "; ".join(m for _, m in issues))
        _event(cr, "Warning", "InvalidSpec", f"generation {generation} not rolled out: "
               + "; ".join(f"{f}: {m}" for f, m in issues), once=True)

    apply_error = None
    foreign: list[str] = []
    roll = S.GangRoll()
    workloads: list[dict] = []
    kinds = [k for k in M.KINDS if k not in M.OPTIONAL_KINDS or kube.served(k)]
    owned = {(kind, o["metadata"]["name"]): o for kind in kinds
             for o in kube.list_children(namespace, name, kind) if kube.owned_by(o, uid)}
    if spec is not None and not issues:
        gangs = kube.served("PodGroup")
        monitors = kube.served("ServiceMonitor")
        # A surge gang only where gangs are placed whole: one placed pod by pod could hold GPUs an old gang needs.
        surge = frozenset(c for c in M.components(spec) if gangs and M.surge_capable(spec, c))
        render = lambda surge: M.render(spec, name, namespace, owner={"name": name, "uid": uid},  # noqa: E731
                                        gang_scheduling=gangs, service_monitors=monitors, surge=surge)
        desired = render(surge)
        roll = S.gang_roll(desired, owned, _surge_pods(namespace, name, owned), _now())
        if roll.surge != surge:
            desired = render(roll.surge)
        for comp, why in sorted(roll.gave_up.items()):
            logger.warning("%s: %s; rolling in place", comp, why)
            _event(cr, "Warning", "RollingInPlace", f"{comp}: {why}; its gangs roll in place, one at a time",
                   subject=comp)
        if spec.metrics.service_monitor and not monitors:
            _event(cr, "Warning", "NoServiceMonitor", "spec.metrics.serviceMonitor is skipped: the API server "
                   "serves no monitoring.coreos.com/v1 ServiceMonitor (install the Prometheus Operator's CRDs, "
                   "then restart the operator); the pods keep their prometheus.io scrape annotations", once=True)
        if not gangs and any(M.gang_size(spec, c) > 1 for c in M.components(spec)):
            _event(cr, "Warning", "NoGangScheduling", "the API server serves no scheduling.k8s.io/v1beta1 "
                   "PodGroup (feature gate GenericWorkload): multi-node replicas are placed pod by pod, and a "
                   "partly placed one holds its GPUs", once=True)
        keep = {(o["kind"], o["metadata"]["name"]) for o in desired}
        for obj in desired:  # first the objects in the way: a pod would mount or run as them
            key = (obj["kind"], obj["metadata"]["name"])
            if key not in owned and not (obj["kind"] in M.OPTIONAL_KINDS and not kube.served(obj["kind"])):
                other = kube.get(key[0], namespace, key[1])
                if other is not None and not kube.owned_by(other, uid):
                    foreign.append("/".join(key))
        for obj in desired:
            key = (obj["kind"], obj["metadata"]["name"])
            if obj["kind"] in M.OPTIONAL_KINDS and not kube.served(obj["kind"]):  # asked for, not installed
                apply_error = (f"{obj['kind']}/{key[1]}: the API server does not serve {obj['apiVersion']} "
                               f"{obj['kind']} (spec.tls.certManager needs cert-manager installed)")
                logger.error("apply failed: %s", apply_error)
                break
            before = owned.get(key)
            if "/".join(key) in foreign:
                continue
            if key[1] in roll.held and obj["kind"] == "StatefulSet":  # rolls after the gang rolling now
                workloads.append(before)
                continue
            if foreign and obj["kind"] in WORKLOAD_KINDS:
                # No pod is created or replaced while a foreign object stands in a child's place: it would
                # mount that ConfigMap, run as that ServiceAccount or serve behind that Service.
                if before is not None:
                    workloads.append(before)
                continue
            try:
                if before is not None and obj["kind"] == "Deployment" and "replicas" not in obj["spec"]:
                    kube.hand_over_replicas(obj, before)
                out = kube.apply(obj)
            except LostLease:  # not an apply failure: this replica must not write its status either
                raise
            except Exception as e:  # noqa: BLE001 - reported in status, retried by the caller
                apply_error = f"{obj['kind']}/{obj['metadata']['name']}: {_short(e)}"
                logger.error("apply failed: %s", apply_error)
                break
            _report_change(cr, key, before, out)
            if obj["kind"] in WORKLOAD_KINDS:
                workloads.append(out)
        if foreign:
            msg = (f"not adopted: {', '.join(foreign)} exist(s) and were not created by this H3Deployment; "
                   f"left untouched (delete or rename them); no pod is created or replaced until then")
            logger.warning(msg)
            _event(cr, "Warning", "ForeignObject", msg, once=True)
        if apply_error is None:
            _prune(cr, owned, keep | S.podgroups_in_use(workloads), logger)
        else:
            _event(cr, "Warning", "ApplyFailed", apply_error, once=True)
    else:  # keep what runs; describe it
        workloads = [o for (kind, _), o in owned.items() if kind in WORKLOAD_KINDS]

    _restart_gangs(cr, workloads, logger)
    pods = _pods_if_unready(namespace, name, workloads, logger)
    new = S.compute(name=name, namespace=namespace, generation=generation,
                    spec=spec if not issues else None, issues=issues, workloads=workloads,
                    previous=cr.get("status"), now=_now(), apply_error=apply_error, pods=pods, foreign=foreign,
                    roll=roll, gangs_refused=_gangs_refused(namespace, workloads, logger))
    old = cr.get("status") or {}
    _report_conditions(cr, old, new)
    if not S.same(old, new):
        patch = dict(new)
        gone = {k: None for k in (old.get("stages") or {}) if k not in new["stages"]}
        if gone:
            patch["stages"] = {**new["stages"], **gone}
        kube.patch_status(namespace, name, patch)
    if apply_error:
        raise kopf.TemporaryError(f"apply failed: {apply_error}", delay=10)
    return new


def _report_change(cr: dict, key: tuple[str, str], before: dict | None, after: dict) -> None:
    """Events for what an apply decided: a child created, a stage rolled (its pod template changed), scaled."""
    kind, name = key
    if before is None:
        _event(cr, "Normal", "Created", f"created {kind}/{name}")
        return
    if kind not in WORKLOAD_KINDS:
        return
    b, a = before.get("spec") or {}, after.get("spec") or {}
    comp = ((after["metadata"].get("labels") or {}).get(M.LABEL_COMPONENT)) or name
    if b.get("template") != a.get("template"):
        _event(cr, "Normal", "RollingOut", f"{kind}/{name}: the {comp} pods' configuration changed; replacing them")
    if b.get("replicas") != a.get("replicas"):
        _event(cr, "Normal", "Scaled", f"{kind}/{name}: {comp} replicas {b.get('replicas')} -> {a.get('replicas')}")


# Degraded reasons whose finding the reconcile already posted as its own Warning (with the details).
_POSTED_DIRECTLY = ("ForeignObject", "ApplyFailed", "InvalidSpec")


def _report_conditions(cr: dict, old: dict, new: dict) -> None:
    """An Event when Ready or Degraded changes (status changes that a person acts on). A Warning is for a problem:
    Degraded=True, or Ready lost; a new H3Deployment that is not Ready yet is Normal. Each condition dedups on its
    own key, so one finding is one Warning."""
    def c(st, t):
        return next(((x.get("status"), x.get("reason")) for x in st.get("conditions") or [] if x["type"] == t), None)
    for t in ("Ready", "Degraded"):
        was, now = c(old, t), c(new, t)
        if was == now:
            continue
        x = next(x for x in new["conditions"] if x["type"] == t)
        down = x["status"] == ("True" if t == "Degraded" else "False")
        if down and x["reason"] in _POSTED_DIRECTLY:  # Ready=False and Degraded=True say the same finding
            continue
        bad = down if t == "Degraded" else (down and (was or ("",))[0] == "True")
        _event(cr, "Warning" if bad else "Normal", x["reason"], f"{t}={x['status']}: {x['message']}", subject=t,
               once=True)


def _restart_gangs(cr: dict, workloads: list[dict], logger) -> None:
    """A gang is one torch.distributed world: restart it whole when a member left it, and never run two configs in
    it (S.gang_verdict decides from pod and container state; the StatefulSet recreates the pods deleted here)."""
    gangs = [w for w in workloads if w["kind"] == "StatefulSet"]
    if not gangs:
        return
    md = cr["metadata"]
    pods = kube.list_pods(md["namespace"], md["name"])
    for sts in gangs:
        gname = sts["metadata"]["name"]
        members = [p for p in pods if (p["metadata"].get("labels") or {}).get("h3serve.io/gang") == gname]
        stale, world = S.gang_verdict(sts, members)
        if world is not None:  # first, so that a restart is never decided twice from the old record
            kube.annotate(sts, M.ANN_WORLD, world)
        record = world if world is not None else (sts["metadata"].get("annotations") or {}).get(M.ANN_WORLD)
        for pod, value in S.gang_gates(members, record, {p for p, _ in stale}):  # before the deletes: see gang_gates
            kube.set_pod_condition(md["namespace"], pod, M.GATE_WORLD, value,
                                   "InGangWorld" if value else "GroupRestart",
                                   f"in the recorded world of StatefulSet/{gname}" if value
                                   else f"StatefulSet/{gname} restarts whole ({stale[0][1]})")
        for pod, _ in stale:
            kube.delete("Pod", md["namespace"], pod)
        if stale:
            msg = f"StatefulSet/{gname}: deleted {', '.join(p for p, _ in stale)} ({stale[0][1]})"
            logger.info(msg)
            _event(cr, "Normal", "GroupRestart", msg)


def _surge_pods(namespace: str, name: str, owned: dict) -> list[dict]:
    """The pods, when a surge gang stands (S.gang_roll reads whether the scheduler can place it); no request else."""
    if not any((o["metadata"].get("labels") or {}).get(M.LABEL_SURGE) for (kind, _), o in owned.items()
               if kind == "StatefulSet"):
        return []
    return kube.list_pods(namespace, name)


def _gangs_refused(namespace: str, workloads: list[dict], logger) -> list[str]:
    """What refuses the pods of the gangs that lack some (their StatefulSets' Events: S.gang_create_failure); read
    only for such a gang, so a healthy reconcile costs no request."""
    out = []
    for w in workloads:
        if w["kind"] != "StatefulSet" or not S.gang_short(w):
            continue
        try:
            events = kube.list_events(namespace, "StatefulSet", w["metadata"]["name"])
        except Exception as e:  # noqa: BLE001 - e.g. RBAC without events: list; the status just says less
            logger.warning("cannot list the events of StatefulSet/%s: %s", w["metadata"]["name"], _short(e))
            continue
        found = S.gang_create_failure(w, events)
        if found:
            out.append(found)
    return out


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


def _prune(cr: dict, owned: dict, keep: set, logger: logging.Logger) -> None:
    """Delete what this H3Deployment created and no longer needs; never anything it did not create."""
    for key in owned:
        if key not in keep:
            logger.info("pruning %s/%s (no longer in the spec)", *key)
            kube.delete(key[0], cr["metadata"]["namespace"], key[1])
            _event(cr, "Normal", "Deleted", f"deleted {key[0]}/{key[1]} (no longer in the spec)")


def _short(e: Exception) -> str:
    body = getattr(e, "body", None) or getattr(e, "summary", lambda: None)()
    return str(body or e).strip().splitlines()[0][:400]


# ---- workers: one task per H3Deployment ---------------------------------------------------------------------------

async def _worker(namespace: str, name: str) -> None:
    key = (namespace, name)
    trigger = _triggers[key]
    logger = logging.getLogger(f"h3serve.operator.{namespace}.{name}")
    while True:
        try:
            await asyncio.wait_for(trigger.wait(), timeout=RESYNC_SECONDS)
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(DEBOUNCE_SECONDS)  # coalesce a burst of events into one pass
        trigger.clear()
        try:
            await asyncio.to_thread(reconcile, namespace, name, logger)
        except LostLease as e:  # the leader loop exits the process; nothing more is written meanwhile
            logger.warning("%s", e)
        except kopf.TemporaryError as e:
            logger.warning("%s; retrying", e)
            await asyncio.sleep(e.delay or 10)
            trigger.set()
        except (ApiException, urllib3.exceptions.HTTPError) as e:
            # the API server's answer (a conflict, a race with a deletion, a timeout under load): an operational
            # fact, said in one line; the next pass retries
            logger.warning("reconcile failed: %s %s; retrying in 5 s", type(e).__name__, _short(e))
            await asyncio.sleep(5)
            trigger.set()
        except Exception as e:  # noqa: BLE001 - keep the worker alive; the next pass retries
            logger.exception("reconcile failed: %s", e)
            await asyncio.sleep(5)
            trigger.set()


def _wake(namespace: str, name: str) -> None:
    key = (namespace, name)
    if key not in _workers:
        _triggers[key] = asyncio.Event()
        _workers[key] = asyncio.get_running_loop().create_task(_worker(namespace, name), name=f"h3d-{namespace}-{name}")
    _triggers[key].set()


def _forget(namespace: str, name: str) -> None:
    task = _workers.pop((namespace, name), None)
    _triggers.pop((namespace, name), None)
    if task is not None:
        task.cancel()


def wake_all() -> None:
    """Thread-safe: reconcile every known H3Deployment now (e.g. on becoming the leader)."""
    if _loop is not None:
        for key in list(_triggers):
            _loop.call_soon_threadsafe(lambda k=key: _triggers[k].set() if k in _triggers else None)


# ---- handlers ---------------------------------------------------------------------------------------------------

@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_) -> None:
    global _loop
    _loop = asyncio.get_running_loop()
    # Serve exactly the namespaces given and the resources present at startup: no cluster-wide list/watch of
    # namespaces and CRDs, so a namespaced operator needs no ClusterRole at all. (The chart installs the CRD first.)
    settings.scanning.disabled = True
    settings.posting.enabled = False  # the operator posts its own Events, one per decision
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    kube.dynamic()


@kopf.on.cleanup()
async def stop_workers(**_) -> None:
    for key in list(_workers):
        _forget(*key)


@kopf.on.login()
def login(**kwargs):
    return kopf.login_via_client(**kwargs)


@kopf.on.event(*RESOURCE)
async def h3deployment_event(event, body, name: str, namespace: str, **_) -> None:
    if event.get("type") == "DELETED" or (body.get("metadata") or {}).get("deletionTimestamp"):
        _forget(namespace, name)
        uid = (body.get("metadata") or {}).get("uid")
        for key in [k for k in _posted if k[0] == uid]:
            del _posted[key]
        (log.info if _leading() else log.debug)(
            "%s/%s deleted; the garbage collector removes its children through their owner references",
            namespace, name)
        return
    _wake(namespace, name)


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
    if _kind in M.OPTIONAL_KINDS:  # may not be served; the resync repairs their drift
        continue
    kopf.on.event(_api_version, _plural, labels=_OURS, id=f"child-{_plural}")(_child_changed)
