"""Pure status computation: what the operator writes into an H3Deployment's `.status`.

Input: the generation being reconciled, the validation result, the live workloads (Deployments / StatefulSets
with their `.status`), the previous status and the time. Output: the new status. No I/O.

Conditions (reasons are CamelCase):
- SpecValid    True  SpecAccepted | False InvalidSpec (message: every problem, with what to change)
- Progressing  True  RollingOut (message: the workloads still rolling out) | False RolloutComplete | False InvalidSpec
- Ready        True  AllStagesReady | False StagesNotReady | False ScaledToZero | False InvalidSpec
- Ready        False ForeignObject (the pods would mount / run as / serve behind an object not created here)
- Degraded     True  ForeignObject (message: the objects in the way, by kind/name) | ApplyFailed |
                     PodCreationFailed (a quota or admission refused the pods) |
                     PodsUnschedulable | PodsFailing | RolloutStalled | StagesUnavailable
               False AsExpected
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

from h3serve.config.spec import H3DeploymentSpec
from h3serve.config.vocab import PIPELINE_STAGES
from h3serve.operator import manifests as M


@dataclass(frozen=True)
class Expected:
    component: str
    kind: str  # Deployment | StatefulSet
    name: str
    pods: int  # Deployment: replicas; StatefulSet: the gang size


def expected_workloads(spec: H3DeploymentSpec, name: str) -> list[Expected]:
    out = []
    for comp in M.components(spec):
        for kind, wname in M.workload_names(spec, name, comp):
            pods = M.component_replicas(spec, comp) if kind == "Deployment" else M.gang_size(spec, comp)
            out.append(Expected(comp, kind, wname, pods))
    return out


def expected_from_live(workloads: list[dict]) -> list[Expected]:
    """When the spec is invalid the operator keeps the children it has: describe them by themselves."""
    out = []
    for w in workloads:
        if (w["metadata"].get("labels") or {}).get(M.LABEL_SURGE):  # an extra gang of a roll, not a replica
            continue
        comp = (w["metadata"].get("labels") or {}).get(M.LABEL_COMPONENT, "?")
        out.append(Expected(comp, w["kind"], w["metadata"]["name"], int((w.get("spec") or {}).get("replicas", 1))))
    return sorted(out, key=lambda e: (e.component, e.name))


def _rolled_out(w: dict | None, pods: int) -> tuple[bool, bool, int]:
    """(rolled out, stalled, ready pods) of one live workload."""
    if w is None:
        return False, False, 0
    md, st = w["metadata"], w.get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    current = int(st.get("observedGeneration") or 0) >= int(md.get("generation") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    total = int(st.get("replicas") or 0)
    if w["kind"] == "Deployment":
        stalled = any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                      for c in st.get("conditions") or [])
        done = current and updated >= pods and total <= pods and int(st.get("availableReplicas") or 0) >= pods
        return done, stalled, ready
    same_rev = st.get("currentRevision") == st.get("updateRevision") or updated >= pods
    done = current and same_rev and updated >= pods and ready >= pods and total <= pods
    return done, False, ready


_FAILING = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
            "CreateContainerError", "InvalidImageName", "RunContainerError")


def pod_problems(pods: list[dict]) -> list[tuple[str, str]]:
    """(reason, "pod: what") for pods that cannot make progress on their own: unschedulable or failing."""
    out = []
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, st = p["metadata"]["name"], p.get("status") or {}
        if p["metadata"].get("deletionTimestamp"):
            continue
        why = _unschedulable(p)
        if why is not None:
            out.append(("PodsUnschedulable", f"{name}: {why}"))
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            w = (cs.get("state") or {}).get("waiting") or {}
            if w.get("reason") in _FAILING:
                out.append(("PodsFailing", f"{name}: {w['reason']}: {w.get('message', '')}".rstrip(": ")))
    return out


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int, previous: dict, now: str) -> dict:
    status = "True" if ok else "False"
    prev = next((c for c in previous.get("conditions") or [] if c.get("type") == ctype), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get("lastTransitionTime") else now
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def compute(*, name: str, namespace: str, generation: int, spec: H3DeploymentSpec | None,
            issues: list[tuple[str, str]], workloads: list[dict], previous: dict | None, now: str,
            apply_error: str | None = None, pods: list[dict] | None = None,
            foreign: list[str] | None = None, roll: GangRoll | None = None,
            gangs_refused: list[str] | tuple = ()) -> dict:
    """`foreign`: "Kind/name" of objects in the way: they have a child's name but this H3Deployment did not create
    them, so the operator leaves them alone (never adopts, changes or deletes them). `roll`: how the gangs roll
    this pass (`gang_roll`). `gangs_refused`: what refuses gangs' pods at creation (`gang_create_failure`, from
    their StatefulSets' Events)."""
    roll = roll or GangRoll()
    previous = previous or {}
    refused = [*create_failures(workloads), *gangs_refused]
    live = {(w["kind"], w["metadata"]["name"]): w for w in workloads}
    expected = expected_workloads(spec, name) if spec is not None else expected_from_live(workloads)

    # per component: desired / ready replicas (a gang counts once, when all its pods are ready)
    comp_desired: dict[str, int] = {}
    comp_ready: dict[str, int] = {}
    rolling, stalled = [], []
    autoscaled = {c for c in M.components(spec) if M.autoscaling(spec, c) is not None} if spec is not None else set()
    for e in expected:
        w = live.get((e.kind, e.name))
        if e.component in autoscaled and w is not None:  # the autoscaler's count, not the spec's
            e = Expected(e.component, e.kind, e.name, int((w.get("spec") or {}).get("replicas") or 0))
        done, stall, ready_pods = _rolled_out(w, e.pods)
        if e.kind == "Deployment":
            comp_desired[e.component] = comp_desired.get(e.component, 0) + e.pods
            comp_ready[e.component] = comp_ready.get(e.component, 0) + min(ready_pods, e.pods)
        else:
            comp_desired[e.component] = comp_desired.get(e.component, 0) + 1
            comp_ready[e.component] = comp_ready.get(e.component, 0) + int(ready_pods >= e.pods and e.pods > 0)
        if not done or e.name in roll.held:  # held: a gang waiting for its turn to roll
            rolling.append(e.name)
        if stall:
            stalled.append(e.name)

    stages: dict[str, dict] = {}
    for comp in sorted(comp_desired, key=_order):
        entry = {"ready": comp_ready[comp], "desired": comp_desired[comp]}
        for st in ((*PIPELINE_STAGES, M.GATEWAY) if comp == M.ENGINE else (comp,)):
            stages[st] = dict(entry)

    valid = spec is not None and not issues
    conds = []
    if valid:
        conds.append(_condition("SpecValid", True, "SpecAccepted", "the spec is valid", generation, previous, now))
    else:
        msg = "; ".join(f"{f}: {m}" for f, m in issues)
        conds.append(_condition("SpecValid", False, "InvalidSpec", msg, generation, previous, now))

    not_ready = [f"{s} {v['ready']}/{v['desired']}" for s, v in stages.items() if v["ready"] < v["desired"]]
    all_counts = ", ".join(f"{s} {v['ready']}/{v['desired']}" for s, v in stages.items())
    in_the_way = (f"not adopted: {', '.join(foreign)} already exist(s) and not created by this H3Deployment; "
                  f"delete or rename them, or rename the H3Deployment") if foreign else ""
    if foreign:  # the pods would mount / run as / serve behind someone else's object
        ready = (False, "ForeignObject", in_the_way)
    elif not stages:
        ready = (False, "InvalidSpec" if not valid else "StagesNotReady", "no workloads exist yet")
    elif any(v["desired"] == 0 for v in stages.values()):
        zero = [s for s, v in stages.items() if v["desired"] == 0]
        ready = (False, "ScaledToZero", f"scaled to zero: {', '.join(zero)}")
    elif not_ready:
        problems = pod_problems(pods or [])
        why = "; ".join([*refused[:1], *(t for _, t in problems[:3])])
        ready = (False, "StagesNotReady", "waiting for " + ", ".join(not_ready) + (f" ({why})" if why else ""))
    else:
        ready = (True, "AllStagesReady", all_counts)
    conds.append(_condition("Ready", ready[0], ready[1], ready[2], generation, previous, now))

    if not valid:
        prog = (False, "InvalidSpec", f"generation {generation} is not rolled out until the spec is fixed "
                                      f"(see SpecValid); the previous workloads keep serving")
    elif rolling:
        prog = (True, "RollingOut", "rolling out " + ", ".join(rolling)
                + "".join(f"; {c}: {n}" for c, n in sorted(roll.notes.items())))
    else:
        prog = (False, "RolloutComplete", f"generation {generation} is rolled out")
    conds.append(_condition("Progressing", prog[0], prog[1], prog[2], generation, previous, now))

    problems = pod_problems(pods or []) if not_ready else []
    if foreign:
        deg = (True, "ForeignObject", in_the_way)
    elif apply_error:
        deg = (True, "ApplyFailed", apply_error)
    elif refused:  # a quota or an admission webhook refused the pods: none exists to explain itself
        deg = (True, "PodCreationFailed", "; ".join(refused[:3]))
    elif problems:
        deg = (True, problems[0][0], "; ".join(t for _, t in problems[:5]))
    elif stalled:
        deg = (True, "RolloutStalled", "progress deadline exceeded: " + ", ".join(stalled))
    elif valid and not rolling and not_ready:
        deg = (True, "StagesUnavailable", "rolled out but not ready: " + ", ".join(not_ready))
    else:
        deg = (False, "AsExpected", "no problem detected")
    conds.append(_condition("Degraded", deg[0], deg[1], deg[2], generation, previous, now))

    scale_comp = M.ENGINE if (spec is not None and spec.placement == "colocated") else "dit"
    if spec is None and M.ENGINE in comp_desired:
        scale_comp = M.ENGINE
    ready_stages = sum(1 for v in stages.values() if v["ready"] >= v["desired"] > 0)
    return {
        "observedGeneration": generation,
        "conditions": conds,
        "stages": stages,
        "endpoint": M.public_endpoints(name, namespace, tls=spec is not None and spec.tls is not None),
        "replicas": comp_ready.get(scale_comp, 0),
        "selector": ",".join(f"{k}={v}" for k, v in M.selector(name, scale_comp).items()),
        "summary": f"{ready_stages}/{len(stages)}",
    }


def create_failures(workloads: list[dict]) -> list[str]:
    """What refused a workload's pods at creation (a ResourceQuota, an admission webhook or policy), from the
    Deployment's ReplicaFailure condition, which the Deployment controller copies from its ReplicaSet. (A gang's
    StatefulSet has no such condition: `gang_create_failure`.)"""
    out = []
    for w in workloads:
        for c in (w.get("status") or {}).get("conditions") or []:
            if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
                out.append(f"{w['kind']}/{w['metadata']['name']}: {c.get('message') or c.get('reason')}")
    return out


def _gate(pod: dict) -> bool:
    return any(c.get("type") == M.GATE_WORLD and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def gang_gates(pods: list[dict], record: str | None, stale: set[str]) -> list[tuple[str, bool]]:
    """(pod, value) of the members whose readiness gate (M.GATE_WORLD) must change: False for a member about to be
    deleted for a restart (its gang is broken: it must not count for the disruption budget meanwhile), True for each
    member of the recorded world once that world runs whole. A member outside the record (a replacement not yet
    restarted with the rest) never turns True, so a broken gang is never Ready whatever its containers say."""
    name = lambda p: p["metadata"]["name"]  # noqa: E731
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if stale:
        return [(name(p), False) for p in pods if name(p) in stale and _gate(p)]
    world = set(filter(None, (record or "").split(",")))
    if not world or {p["metadata"]["uid"] for p in live} != world:
        return []
    return [(name(p), True) for p in live if not _gate(p)]


def gang_short(statefulset: dict) -> bool:
    """Fewer member pods exist than the gang asks for (status.replicas counts the pods its controller created)."""
    return int((statefulset.get("status") or {}).get("replicas") or 0) < int(
        (statefulset.get("spec") or {}).get("replicas") or 0)


def _event_time(e: dict) -> _dt.datetime:
    t = ((e.get("series") or {}).get("lastObservedTime") or e.get("lastTimestamp") or e.get("eventTime")
         or (e.get("metadata") or {}).get("creationTimestamp"))
    return _time(t) if t else _dt.datetime.min.replace(tzinfo=_dt.timezone.utc)


def gang_create_failure(statefulset: dict, events: list[dict]) -> str | None:
    """What refuses a gang's pods at creation now, or None. A StatefulSet has no ReplicaFailure condition; its
    controller posts a FailedCreate Warning at each refused try (quoting the API server: "exceeded quota: ...") and a
    SuccessfulCreate for each pod made. Refused now: pods are missing and no pod was made since the newest refusal."""
    if not gang_short(statefulset):
        return None
    newest = lambda reason: max((_event_time(e) for e in events if e.get("reason") == reason), default=None)  # noqa: E731
    failed, made = newest("FailedCreate"), newest("SuccessfulCreate")
    if failed is None or (made is not None and made > failed):
        return None
    last = max((e for e in events if e.get("reason") == "FailedCreate"), key=_event_time)
    return f"StatefulSet/{statefulset['metadata']['name']}: {last.get('message') or 'FailedCreate'}"


def _order(comp: str) -> int:
    order = [M.ENGINE, *PIPELINE_STAGES, M.GATEWAY]
    return order.index(comp) if comp in order else len(order)


def same(a: dict | None, b: dict | None) -> bool:
    """Equal apart from timestamps (so an unchanged status is not written again)."""
    def strip(s):
        s = dict(s or {})
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []]
        return s
    return strip(a) == strip(b)


def podgroups_in_use(workloads: list[dict]) -> set[tuple[str, str]]:
    """The PodGroups the live gang StatefulSets' pod templates name: a gang held back from its roll keeps its old
    one (its spec cannot change, and a pod it recreates must find it), so pruning spares them."""
    return {("PodGroup", g) for w in workloads if w is not None and w.get("kind") == "StatefulSet"
            for g in [((w["spec"]["template"]["spec"].get("schedulingGroup") or {}).get("podGroupName"))] if g}


# A surge gang not whole by then is given up: its pods' startup probes would have restarted them anyway.
SURGE_DEADLINE_S = M.STARTUP_PERIOD_S * M.STARTUP_FAILURES


@dataclass(frozen=True)
class GangRoll:
    """What the rolling update of the gang components does this pass (`gang_roll`)."""

    held: frozenset[str] = frozenset()  # gang StatefulSets whose new pod template waits (the caller skips their apply)
    surge: frozenset[str] = frozenset()  # components whose surge gang is applied; any other surge gang is pruned
    gave_up: dict[str, str] = field(default_factory=dict)  # component -> why its surge gang went this pass
    notes: dict[str, str] = field(default_factory=dict)  # component -> how it rolls (the Progressing message)


def _unschedulable(pod: dict) -> str | None:
    """The scheduler's words when it found no place for the pod (PodScheduled=False, Unschedulable), else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "unschedulable"
    return None


def _surge_failure(w: dict, pods: list[dict], now: str, deadline_s: float) -> str | None:
    """Why the live surge gang `w` (not whole yet) cannot serve, or None while it may still come: a member the
    scheduler cannot place (the gang is placed whole or not at all, so it holds no GPUs meanwhile), or no whole gang
    `deadline_s` after its creation."""
    name = w["metadata"]["name"]
    members = sorted((p for p in pods if (p["metadata"].get("labels") or {}).get("h3serve.io/gang") == name
                      and not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"])
    for p in members:
        why = _unschedulable(p)
        if why is not None:
            return f"the surge gang {name} cannot be placed ({p['metadata']['name']}: {why})"
    age = (_time(now) - _time(w["metadata"]["creationTimestamp"])).total_seconds()
    if age > deadline_s:
        return f"the surge gang {name} is not whole {deadline_s:.0f} s after its creation"
    return None


def gang_roll(desired: list[dict], live: dict[tuple[str, str], dict], pods: list[dict], now: str,
              deadline_s: float = SURGE_DEADLINE_S) -> GangRoll:
    """How each gang component takes a new pod template this pass. Pure: the caller renders the surge gangs it
    names, skips the apply of the held gangs, and prunes a surge gang it does not name.

    `desired` is rendered with a surge gang for each component that may have one (M.LABEL_SURGE, dit.rollout.maxSurge
    1). While an old gang needs the new template, the surge gang (the new template) runs beside them, and every old
    gang serving the old template waits until the surge gang is whole: then they roll one at a time as without a
    surge, and the surge gang goes once every gang runs the new template whole. So the whole gangs never drop below the
    desired count. Where the surge gang cannot be placed, or is not whole by `deadline_s`, it is given up and the
    gangs roll in place; a roll under way in place (a gang already on the new template, no surge gang) goes on so.

    In place (as LeaderWorkerSet rolls groups, maxUnavailable 1): a gang that is down anyway takes its new template
    at once; otherwise one whole, settled gang rolls while every other gang serves."""
    by_comp: dict[str, list[tuple[str, bool, bool]]] = {}  # component -> (name, needs the new template, settled)
    surges: dict[str, dict] = {}  # component -> its surge gang StatefulSet, as rendered
    for obj in desired:
        if obj["kind"] != "StatefulSet":
            continue
        name, comp = obj["metadata"]["name"], obj["metadata"]["labels"][M.LABEL_COMPONENT]
        if obj["metadata"]["labels"].get(M.LABEL_SURGE):
            surges[comp] = obj
            continue
        w = live.get(("StatefulSet", name))
        if w is None:  # a new gang: nothing of it serves yet
            continue
        by_comp.setdefault(comp, []).append((name, _stale(obj, w), _rolled_out(w, int(obj["spec"]["replicas"]))[0]))
    held: set[str] = set()
    surge: set[str] = set()
    gave_up: dict[str, str] = {}
    notes: dict[str, str] = {}
    for comp, gangs in by_comp.items():
        waiting = [n for n, stale, settled in gangs if stale and settled]  # serving on the old template
        s = surges.get(comp)
        w = None if s is None else live.get(("StatefulSet", s["metadata"]["name"]))
        # under way until every gang runs the new template whole (the last one took it while still serving the old)
        if s is not None and (any(stale for _, stale, _ in gangs) or (w is not None and not all(
                settled for _, _, settled in gangs))):
            whole = w is not None and not _stale(s, w) and _rolled_out(w, int(s["spec"]["replicas"]))[0]
            why = None if w is None or whole else _surge_failure(w, pods, now, deadline_s)
            if w is None and not all(stale for _, stale, _ in gangs):
                notes[comp] = "in place, one gang at a time (a gang already rolled in place)"
            elif why is not None:
                gave_up[comp] = why
                notes[comp] = f"in place, one gang at a time ({why})"
            elif not whole:  # every old gang serves until the surge gang is whole
                surge.add(comp)
                notes[comp] = f"surge gang {s['metadata']['name']} first; the old gangs wait until it is whole"
                held |= set(waiting)
                continue
            else:
                surge.add(comp)
                notes[comp] = f"surge gang {s['metadata']['name']} whole; the old gangs roll one at a time"
        if all(settled for _, _, settled in gangs):  # none down or rolling: the first of them rolls now
            waiting = waiting[1:]
        held |= set(waiting)
    return GangRoll(frozenset(held), frozenset(surge), gave_up, notes)


def _stale(desired: dict, live: dict) -> bool:
    """The live gang StatefulSet runs another pod template than the rendered one."""
    want = desired["metadata"]["annotations"][M.ANN_TEMPLATE_HASH]
    return (live["metadata"].get("annotations") or {}).get(M.ANN_TEMPLATE_HASH) != want


def _restarts(pod: dict) -> int:
    return sum(int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def _running(pod: dict) -> bool:
    cs = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(cs) and all((c.get("state") or {}).get("running") for c in cs)


def _time(t) -> _dt.datetime:
    return _dt.datetime.fromisoformat(str(t).replace("Z", "+00:00"))


def gang_verdict(statefulset: dict, pods: list[dict]) -> tuple[list[tuple[str, str]], str | None]:
    """(pods to delete with why, the world to record or None to leave the record) for one gang.

    A gang runs one torch.distributed world, so it restarts whole, as a LeaderWorkerSet group does, and runs one
    config. Decided from pod and container state, not timing, so it holds for a member lost in the gang's first
    seconds and for what happened while the operator was down:
    - a member at another revision than the StatefulSet's update revision: the old ones go (one config per gang);
    - a container restarted in place (restartCount > 0): its rank left the world; every member goes (their new
      pods start at 0, so one failure is one restart);
    - the world record (ANN_WORLD on the StatefulSet: the member pod UIDs whose containers all ran together; "" right
      after a restart) names members no longer there: the members still from that world go, the new ones stay;
    - no record (the gang formed while no operator ran): a member whose container started before another member's
      pod was created lived in a world without that pod; every member goes, once.
    When every member runs and nothing goes, their UIDs are the world to record. Pure: the caller deletes and
    records."""
    want = (statefulset.get("status") or {}).get("updateRevision")
    replicas = int((statefulset.get("spec") or {}).get("replicas") or 0)
    record = ((statefulset.get("metadata") or {}).get("annotations") or {}).get(M.ANN_WORLD)
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    name = lambda p: p["metadata"]["name"]  # noqa: E731
    revs = {(p["metadata"].get("labels") or {}).get("controller-revision-hash") for p in live}
    if want and len(revs) > 1:
        return sorted((name(p), "one config per gang: a member already runs the new revision") for p in live
                      if (p["metadata"].get("labels") or {}).get("controller-revision-hash") != want), None
    restarted = sorted(name(p) for p in live if _restarts(p))
    if restarted:
        why = f"group restart: the container of {restarted[0]} restarted in place"
        return sorted((name(p), why) for p in live), ""
    if record:
        world = set(record.split(","))
        old = [p for p in live if p["metadata"]["uid"] in world]
        new = sorted(name(p) for p in live if p["metadata"]["uid"] not in world)
        if old and (new or len(old) < len(world)):
            why = (f"group restart: {new[0]} replaced a member of the gang" if new
                   else "group restart: a member of the gang is gone")
            return sorted((name(p), why) for p in old), ""
    elif record is None and len(live) > 1:
        newest = max(_time(p["metadata"]["creationTimestamp"]) for p in live)
        started = [c["state"]["running"]["startedAt"] for p in live
                   for c in (p.get("status") or {}).get("containerStatuses") or []
                   if ((c.get("state") or {}).get("running") or {}).get("startedAt")]
        if any(_time(t) < newest for t in started):
            return sorted((name(p), "group restart: a member was recreated after the others started")
                          for p in live), ""
    if len(live) == replicas and all(_running(p) for p in live):
        world = ",".join(sorted(p["metadata"]["uid"] for p in live))
        return [], (world if world != record else None)
    return [], None
