"""The pure status computation."""

from __future__ import annotations

import pathlib

import yaml

from h3serve.operator import manifests as M
from h3serve.operator import status as S
from h3serve.config.spec import parse_and_validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def spec_of(example: str):
    d = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    return d["metadata"]["name"], parse_and_validate(d["spec"], d["metadata"]["name"])


def live(spec, name, ready: bool = True, generation: int = 1, observed: int = 1, missing=(), overrides=None,
         surge=frozenset()):
    """Workload objects as the API server returns them (status filled in)."""
    out = []
    for o in M.render(spec, name, "ns", surge=surge):
        if o["kind"] not in ("Deployment", "StatefulSet") or o["metadata"]["name"] in missing:
            continue
        n = o["spec"]["replicas"]
        o["metadata"]["generation"] = generation
        o["metadata"]["creationTimestamp"] = T0
        st = {"observedGeneration": observed, "replicas": n, "updatedReplicas": n,
              "readyReplicas": n if ready else 0, "availableReplicas": n if ready else 0}
        if o["kind"] == "StatefulSet":
            st.update(currentRevision="r1", updateRevision="r1")
        st.update((overrides or {}).get(o["metadata"]["name"], {}))
        o["status"] = st
        out.append(o)
    return out


def cond(status, t):
    return next(c for c in status["conditions"] if c["type"] == t)


def compute(name, spec, workloads, previous=None, issues=(), now=T0, generation=1, apply_error=None, **kw):
    return S.compute(name=name, namespace="ns", generation=generation, spec=spec, issues=list(issues),
                     workloads=workloads, previous=previous, now=now, apply_error=apply_error, **kw)


def test_all_ready():
    name, spec = spec_of("base-disaggregated")
    st = compute(name, spec, live(spec, name))
    assert cond(st, "Ready")["status"] == "True" and cond(st, "Ready")["reason"] == "AllStagesReady"
    assert cond(st, "Progressing")["status"] == "False" and cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert cond(st, "Degraded")["status"] == "False" and cond(st, "SpecValid")["status"] == "True"
    assert st["stages"] == {"encoder": {"ready": 1, "desired": 1}, "dit": {"ready": 1, "desired": 1},
                            "vae": {"ready": 1, "desired": 1}, "muxer": {"ready": 1, "desired": 1},
                            "gateway": {"ready": 2, "desired": 2}}
    assert st["endpoint"] == {"grpc": "h3-split-gateway.ns.svc:50051", "http": "https://h3-split-gateway.ns.svc:8000"}  # spec.tls: HTTPS
    assert st["observedGeneration"] == 1 and st["summary"] == "5/5" and st["replicas"] == 1
    assert st["selector"] == "app.kubernetes.io/name=h3serve,app.kubernetes.io/instance=h3-split,app.kubernetes.io/component=dit"


def test_colocated_stages_report_the_engine():
    name, spec = spec_of("base-colocated")
    st = compute(name, spec, live(spec, name, ready=False))
    assert set(st["stages"]) == {"encoder", "dit", "vae", "muxer", "gateway"}
    assert st["stages"]["dit"] == {"ready": 0, "desired": 1}
    assert cond(st, "Ready")["reason"] == "StagesNotReady"
    assert cond(st, "Progressing")["reason"] == "RollingOut"
    assert "engine" in st["selector"]


def test_missing_children_mean_progressing():
    name, spec = spec_of("base-disaggregated")
    st = compute(name, spec, live(spec, name, missing={"h3-split-vae"}))
    assert cond(st, "Progressing")["status"] == "True" and "h3-split-vae" in cond(st, "Progressing")["message"]
    assert st["stages"]["vae"] == {"ready": 0, "desired": 1}
    assert "vae 0/1" in cond(st, "Ready")["message"]


def test_new_generation_not_yet_observed_is_progressing():
    name, spec = spec_of("base-disaggregated")
    st = compute(name, spec, live(spec, name, generation=2, observed=1), generation=2)
    assert cond(st, "Progressing")["status"] == "True"
    assert all(c["observedGeneration"] == 2 for c in st["conditions"])


def test_lost_pods_after_rollout_is_degraded():
    name, spec = spec_of("base-disaggregated")
    # a finished rollout (updated, available) whose pod went unready later
    w = live(spec, name, overrides={"h3-split-dit": {"readyReplicas": 0}})
    st = compute(name, spec, w)
    assert cond(st, "Ready")["status"] == "False"
    assert cond(st, "Degraded")["status"] == "True" and cond(st, "Degraded")["reason"] == "StagesUnavailable"


def test_stalled_rollout_is_degraded():
    name, spec = spec_of("base-disaggregated")
    w = live(spec, name, ready=False, overrides={"h3-split-dit": {"conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]}})
    st = compute(name, spec, w)
    assert cond(st, "Degraded")["reason"] == "RolloutStalled"


def test_gang_counts_once_when_all_pods_ready():
    name, spec = spec_of("fasth3-disaggregated")
    st = compute(name, spec, live(spec, name, overrides={"fasth3-split-dit-0": {"readyReplicas": 1}}))
    assert st["stages"]["dit"] == {"ready": 0, "desired": 1}
    st = compute(name, spec, live(spec, name))
    assert st["stages"]["dit"] == {"ready": 1, "desired": 1}
    assert cond(st, "Ready")["status"] == "True"


def test_invalid_spec_keeps_children_and_says_why():
    name, spec = spec_of("base-disaggregated")
    w = live(spec, name)
    issues = [("spec.dit.ulysses", "dit.ulysses x dit.ring = 3 must divide the DiT's 56 attention heads")]
    st = compute(name, None, w, issues=issues, generation=2)
    assert cond(st, "SpecValid") == {"type": "SpecValid", "status": "False", "reason": "InvalidSpec",
                                     "message": "spec.dit.ulysses: dit.ulysses x dit.ring = 3 must divide the DiT's "
                                                "56 attention heads", "observedGeneration": 2,
                                     "lastTransitionTime": T0}
    assert cond(st, "Progressing")["reason"] == "InvalidSpec"
    assert cond(st, "Ready")["status"] == "True"  # the previous workloads still serve
    st = compute(name, None, [], issues=issues)
    assert cond(st, "Ready")["reason"] == "InvalidSpec" and st["stages"] == {}


def test_apply_error_is_degraded():
    name, spec = spec_of("base-colocated")
    st = compute(name, spec, [], apply_error="Deployment/h3-base-engine: forbidden")
    assert cond(st, "Degraded")["reason"] == "ApplyFailed" and "forbidden" in cond(st, "Degraded")["message"]


def test_transition_times_only_move_on_change():
    name, spec = spec_of("base-colocated")
    a = compute(name, spec, live(spec, name, ready=False), now=T0)
    b = compute(name, spec, live(spec, name, ready=False), previous=a, now=T1)
    assert S.same(a, b) and cond(b, "Ready")["lastTransitionTime"] == T0
    c = compute(name, spec, live(spec, name), previous=b, now=T1)
    assert not S.same(b, c)
    assert cond(c, "Ready")["lastTransitionTime"] == T1 and cond(c, "SpecValid")["lastTransitionTime"] == T0


def test_scaled_to_zero():
    d = yaml.safe_load((ROOT / "examples" / "base-colocated.yaml").read_text())
    d["spec"]["replicas"] = 0
    spec = parse_and_validate(d["spec"], "h3")
    st = compute("h3", spec, live(spec, "h3"))
    assert cond(st, "Ready")["reason"] == "ScaledToZero"


def test_unschedulable_and_failing_pods_are_explained():
    name, spec = spec_of("base-colocated")
    w = live(spec, name, ready=False)
    pods = [
        {"metadata": {"name": "h3-base-engine-abc"}, "status": {"conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/9 nodes are available: 9 Insufficient nvidia.com/gpu."}]}},
        {"metadata": {"name": "h3-base-gateway-xyz"}, "status": {"containerStatuses": [
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}},
    ]
    st = compute(name, spec, w, previous=None)
    assert cond(st, "Degraded")["status"] == "False"  # not ready yet, no pod problem known: just progressing
    st = S.compute(name=name, namespace="ns", generation=1, spec=spec, issues=[], workloads=w, previous=None,
                   now=T0, pods=pods)
    assert cond(st, "Degraded")["reason"] == "PodsUnschedulable"
    assert "h3-base-engine-abc: 0/9 nodes are available: 9 Insufficient nvidia.com/gpu." in cond(st, "Degraded")["message"]
    assert "h3-base-gateway-xyz: ImagePullBackOff: pull access denied" in cond(st, "Degraded")["message"]
    assert "Insufficient nvidia.com/gpu" in cond(st, "Ready")["message"]


def test_foreign_objects_are_degraded_and_named():
    name, spec = spec_of("base-disaggregated")
    st = S.compute(name=name, namespace="ns", generation=1, spec=spec, issues=[], workloads=live(spec, name),
                   previous=None, now=T0, foreign=["Service/h3-split-gateway", "ConfigMap/h3-split-config"])
    c = cond(st, "Degraded")
    assert (c["status"], c["reason"]) == ("True", "ForeignObject")
    assert c["message"].startswith("not adopted: Service/h3-split-gateway, ConfigMap/h3-split-config already exist")
    # every workload ready, and still not Ready: its pods would serve behind / mount someone else's objects
    r = cond(st, "Ready")
    assert (r["status"], r["reason"], r["message"]) == ("False", "ForeignObject", c["message"])


def test_pods_refused_at_creation_are_degraded_naming_the_refusal():
    """A ResourceQuota or an admission webhook refuses the pods: none exists to explain itself, the Deployment's
    ReplicaFailure condition does."""
    name, spec = spec_of("base-disaggregated")
    quota = ('pods "h3-split-vae-5d8f-x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, '
             'used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8')
    failing = {"readyReplicas": 0, "availableReplicas": 0, "conditions": [
        {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": quota}]}
    st = compute(name, spec, live(spec, name, overrides={f"{name}-vae": failing}))
    c = cond(st, "Degraded")
    assert (c["status"], c["reason"]) == ("True", "PodCreationFailed")
    assert c["message"] == f"Deployment/{name}-vae: {quota}"
    r = cond(st, "Ready")
    assert r["status"] == "False" and "vae 0/1" in r["message"] and "exceeded quota: gpus" in r["message"]
    assert S.create_failures(live(spec, name)) == []



def test_a_gang_refused_at_creation_is_degraded_naming_the_refusal_from_its_events():
    """A gang's StatefulSet has no ReplicaFailure condition; its FailedCreate Events say it, while pods are missing
    and none was made since."""
    name, spec = spec_of("base-disaggregated")
    quota = ('create Pod g-1 in StatefulSet g failed error: pods "g-1" is forbidden: exceeded quota: gpus, '
             'requested: requests.nvidia.com/gpu=8, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8')
    event = lambda reason, t, msg="": {"reason": reason, "lastTimestamp": t, "message": msg}  # noqa: E731
    short = {"metadata": {"name": "g"}, "spec": {"replicas": 2}, "status": {"replicas": 1}}
    refused = [event("SuccessfulCreate", T0), event("FailedCreate", T1, quota)]
    assert S.gang_create_failure(short, refused) == f"StatefulSet/g: {quota}"
    assert S.gang_create_failure(short, [*refused, event("SuccessfulCreate", T5)]) is None  # made since: not now
    assert S.gang_create_failure({**short, "status": {"replicas": 2}}, refused) is None  # nothing missing
    assert S.gang_create_failure(short, [event("SuccessfulCreate", T0)]) is None
    st = compute(name, spec, live(spec, name), gangs_refused=[f"StatefulSet/g: {quota}"])
    c = cond(st, "Degraded")
    assert (c["status"], c["reason"], c["message"]) == ("True", "PodCreationFailed", f"StatefulSet/g: {quota}")

def _pod(name, created, rev="r1", deleting=False, started=None, restarts=0):
    md = {"name": name, "uid": f"uid-{name}-{created[-3:-1]}", "creationTimestamp": created,
          "labels": {"controller-revision-hash": rev}}
    if deleting:
        md["deletionTimestamp"] = created
    state = {"running": {"startedAt": started}} if started else {"waiting": {"reason": "ContainerCreating"}}
    return {"metadata": md, "status": {"containerStatuses": [{"name": "h3serve", "restartCount": restarts,
                                                              "state": state}]}}


def _gang(record=None, rev="r2", replicas=2):
    ann = {} if record is None else {M.ANN_WORLD: record}
    return {"metadata": {"name": "g", "annotations": ann}, "spec": {"replicas": replicas},
            "status": {"updateRevision": rev}}


T0, T1, T5, T60 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z", "2026-01-01T00:00:05Z", "2026-01-01T00:01:00Z"


def test_a_gang_that_runs_together_is_recorded_once():
    fresh = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T0, "r2", started=T1)]
    assert S.gang_verdict(_gang(), fresh) == ([], "uid-g-0-00,uid-g-1-00")
    assert S.gang_verdict(_gang("uid-g-0-00,uid-g-1-00"), fresh) == ([], None)  # nothing to write again
    starting = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T0, "r2")]
    assert S.gang_verdict(_gang(), starting) == ([], None)  # not a world yet


def test_a_member_replaced_restarts_the_rest_of_its_world_at_any_age():
    world = "uid-g-0-00,uid-g-1-00"
    # the worker was lost a second after the gang formed (no timing window misses it) ...
    replaced = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T1, "r2")]
    assert S.gang_verdict(_gang(world), replaced) == (
        [("g-0", "group restart: g-1 replaced a member of the gang")], "")
    # ... or is gone and not recreated yet
    gone = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T0, "r2", deleting=True, started=T1)]
    assert S.gang_verdict(_gang(world), gone) == ([("g-0", "group restart: a member of the gang is gone")], "")
    # right after the restart ("" recorded) the new members are left to form their world, in any order
    after = [_pod("g-0", T60, "r2", started="2026-01-01T00:01:02Z"), _pod("g-1", T5, "r2", started=T5)]
    assert S.gang_verdict(_gang(""), after) == ([], "uid-g-0-00,uid-g-1-05")


def test_a_container_restarted_in_place_restarts_every_member():
    pods = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T0, "r2", started=T60, restarts=1)]
    why = "group restart: the container of g-1 restarted in place"
    assert S.gang_verdict(_gang("uid-g-0-00,uid-g-1-00"), pods) == ([("g-0", why), ("g-1", why)], "")


def test_without_a_record_a_member_created_after_the_others_started_restarts_the_gang():
    """The gang formed while no operator ran: the state still tells a replaced member."""
    pods = [_pod("g-0", T0, "r2", started=T1), _pod("g-1", T60, "r2", started=T60)]
    why = "group restart: a member was recreated after the others started"
    assert S.gang_verdict(_gang(), pods) == ([("g-0", why), ("g-1", why)], "")


def test_pruning_spares_the_podgroups_live_gangs_still_name():
    sts = lambda group: {"kind": "StatefulSet", "spec": {"template": {"spec": (  # noqa: E731
        {"schedulingGroup": {"podGroupName": group}} if group else {})}}}
    held, rolled, plain = sts("g-0-aaaa"), sts("g-1-bbbb"), sts(None)
    assert S.podgroups_in_use([held, rolled, plain, {"kind": "Deployment", "spec": {}}, None]) == {
        ("PodGroup", "g-0-aaaa"), ("PodGroup", "g-1-bbbb")}


def test_a_members_gate_opens_only_inside_its_recorded_world_and_closes_before_a_restart():
    gated = lambda p, v: {**p, "status": {**p["status"], "conditions": [  # noqa: E731
        {"type": M.GATE_WORLD, "status": "True" if v else "False"}]}}
    a, b = _pod("g-0", T0, started=T1), _pod("g-1", T0, started=T1)
    record = "uid-g-0-00,uid-g-1-00"
    assert S.gang_gates([a, b], record, set()) == [("g-0", True), ("g-1", True)]
    assert S.gang_gates([gated(a, True), b], record, set()) == [("g-1", True)]
    assert S.gang_gates([gated(a, True), gated(b, True)], record, set()) == []
    # a replacement outside the record, or a record right after a restart: no gate opens
    c = _pod("g-1", T5, started=T5)
    assert S.gang_gates([gated(a, True), c], record, set()) == []
    assert S.gang_gates([a, b], "", set()) == [] and S.gang_gates([a, b], None, set()) == []
    # a restart closes the open gates of the members it deletes, first
    assert S.gang_gates([gated(a, True), c], record, {"g-0", "g-1"}) == [("g-0", False)]
    # the renderer gives every gang member the gate, and no single-pod replica one
    name, spec = spec_of("fasth3-disaggregated")  # its DiT replica is a gang
    kinds = [o["kind"] for o in M.render(spec, name, "ns")]
    assert "StatefulSet" in kinds and "Deployment" in kinds
    for o in M.render(spec, name, "ns"):
        if o["kind"] in ("StatefulSet", "Deployment"):
            gates = o["spec"]["template"]["spec"].get("readinessGates")
            assert gates == ([{"conditionType": M.GATE_WORLD}] if o["kind"] == "StatefulSet" else None), o["kind"]

def test_a_gang_runs_one_config():
    rolling = [_pod("g-0", T0, "r1", started=T1), _pod("g-1", T60, "r2")]
    assert S.gang_verdict(_gang("uid-g-0-00,uid-g-1-00"), rolling) == (
        [("g-0", "one config per gang: a member already runs the new revision")], None)


def test_gangs_roll_one_at_a_time():
    """Three DiT gangs whose template changed: the first rolls while the others serve; while one is down or rolling
    the others wait; a gang that is down anyway takes its new template at once."""
    name, spec = spec_of("base-disaggregated")
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    d.update(replicas=3, gpusPerNode=4)
    new = parse_and_validate(d, name)
    d["dit"]["resources"] = {"requests": {"cpu": "31"}}
    old = parse_and_validate(d, name)
    desired = M.render(new, name, "ns")
    gangs = [f"{name}-dit-{r}" for r in range(3)]

    def live_with(new_ones=(), down=()):
        out = {}
        for w in live(old, name, overrides={g: {"readyReplicas": 0} for g in down}):
            if w["metadata"]["name"] in new_ones:
                w = next(o for o in live(new, name) if o["metadata"]["name"] == w["metadata"]["name"])
            out[(w["kind"], w["metadata"]["name"])] = w
        return out
    assert S.gang_roll(desired, live_with(), [], T0).held == {gangs[1], gangs[2]}  # gang 0 rolls
    rolling = live_with(new_ones=[gangs[0]], down=[gangs[0]])
    rolling[("StatefulSet", gangs[0])]["status"]["readyReplicas"] = 0
    assert S.gang_roll(desired, rolling, [], T0).held == {gangs[1], gangs[2]}  # gang 0 not back yet: both wait
    assert S.gang_roll(desired, live_with(new_ones=[gangs[0]]), [], T0).held == {gangs[2]}  # gang 0 whole: gang 1 rolls
    assert S.gang_roll(desired, live_with(down=[gangs[2]]), [], T0).held == {gangs[0], gangs[1]}  # gang 2 down: it rolls
    assert S.gang_roll(desired, live_with(new_ones=gangs), [], T0).held == set()
    st = S.compute(name=name, namespace="ns", generation=1, spec=new, issues=[], workloads=list(live_with().values()),
                   previous=None, now=T0, roll=S.GangRoll(held=frozenset({gangs[1], gangs[2]})))
    assert cond(st, "Progressing")["status"] == "True" and gangs[1] in cond(st, "Progressing")["message"]


def _roll_specs(**dit):
    """A DiT of three 2-pod gangs, before and after a pod template change."""
    name, _ = spec_of("base-disaggregated")
    d = yaml.safe_load((ROOT / "examples" / "base-disaggregated.yaml").read_text())["spec"]
    d.update(replicas=3, gpusPerNode=4)
    d["dit"].update(dit)
    new = parse_and_validate(d, name)
    d["dit"]["resources"] = {"requests": {"cpu": "31"}}
    return name, parse_and_validate(d, name), new


def test_a_surge_gang_serves_before_any_old_gang_rolls_and_goes_at_the_end():
    name, old, new = _roll_specs()
    gangs, extra = [f"{name}-dit-{r}" for r in range(3)], M.surge_name(name, "dit")
    desired = M.render(new, name, "ns", surge=frozenset({"dit"}))

    def live_with(new_ones=(), down=(), surge=None):
        """surge: None (no surge gang), "starting" or "whole" (on the new template)."""
        downs = {g: {"readyReplicas": 0} for g in down}
        ws = {w["metadata"]["name"]: w for w in live(old, name, overrides=downs)}
        fresh = {w["metadata"]["name"]: w for w in live(new, name, surge=frozenset({"dit"}), overrides={
            **downs, extra: {"readyReplicas": 0 if surge == "starting" else 2}})}
        ws.update({g: fresh[g] for g in new_ones})
        if surge:
            ws[extra] = fresh[extra]
        return {(w["kind"], w["metadata"]["name"]): w for w in ws.values()}

    roll = S.gang_roll(desired, live_with(), [], T0)  # no surge gang yet: it is made, every old gang waits
    assert roll.surge == {"dit"} and roll.held == set(gangs) and not roll.gave_up
    assert "surge gang" in roll.notes["dit"]
    roll = S.gang_roll(desired, live_with(surge="starting"), [], T1)
    assert roll.surge == {"dit"} and roll.held == set(gangs)
    roll = S.gang_roll(desired, live_with(surge="starting", down=[gangs[2]]), [], T1)
    assert roll.held == {gangs[0], gangs[1]}  # a gang down anyway takes the new template at once
    roll = S.gang_roll(desired, live_with(surge="whole"), [], T1)  # whole: the old gangs roll one at a time
    assert roll.surge == {"dit"} and roll.held == {gangs[1], gangs[2]}
    rolling = live_with(new_ones=[gangs[0]], down=[gangs[0]], surge="whole")
    assert S.gang_roll(desired, rolling, [], T1).held == {gangs[1], gangs[2]}
    roll = S.gang_roll(desired, live_with(new_ones=gangs[:2], surge="whole"), [], T1)
    assert roll.surge == {"dit"} and roll.held == set()  # the last old gang rolls
    roll = S.gang_roll(desired, live_with(new_ones=gangs, down=[gangs[2]], surge="whole"), [], T1)
    assert roll.surge == {"dit"} and roll.held == set()  # the last one took the new template, not back yet
    roll = S.gang_roll(desired, live_with(new_ones=gangs, surge="whole"), [], T1)
    assert roll.surge == set() and roll.held == set() and not roll.notes  # every gang new: the surge gang goes
    st = S.compute(name=name, namespace="ns", generation=1, spec=new, issues=[], previous=None, now=T0,
                   workloads=list(live_with(surge="starting").values()),
                   roll=S.gang_roll(desired, live_with(surge="starting"), [], T1))
    msg = cond(st, "Progressing")["message"]
    assert cond(st, "Progressing")["status"] == "True" and extra in msg and gangs[0] in msg, msg
    assert st["stages"]["dit"] == {"ready": 3, "desired": 3}  # the surge gang is no replica


def _unplaced(name: str, gang: str) -> dict:
    return {"metadata": {"name": f"{gang}-0", "labels": {"h3serve.io/gang": gang}},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                       "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}


def test_a_surge_gang_that_cannot_be_placed_or_is_late_is_given_up_for_an_in_place_roll():
    name, old, new = _roll_specs()
    gangs, extra = [f"{name}-dit-{r}" for r in range(3)], M.surge_name(name, "dit")
    desired = M.render(new, name, "ns", surge=frozenset({"dit"}))
    ws = {(w["kind"], w["metadata"]["name"]): w for w in live(old, name)}
    starting = next(w for w in live(new, name, surge=frozenset({"dit"}), overrides={extra: {"readyReplicas": 0}})
                    if w["metadata"]["name"] == extra)
    ws[("StatefulSet", extra)] = starting
    roll = S.gang_roll(desired, ws, [_unplaced(name, extra)], T1)  # unschedulable: given up, gang 0 rolls in place
    assert roll.surge == set() and roll.held == {gangs[1], gangs[2]}
    assert "Insufficient nvidia.com/gpu" in roll.gave_up["dit"] and "in place" in roll.notes["dit"]
    assert not S.gang_roll(desired, ws, [_unplaced(name, f"{name}-dit-0")], T1).gave_up  # another gang's pod
    late = "2026-01-01T01:00:01Z"  # one second past the deadline (an hour: the startup probes' allowance)
    assert S.SURGE_DEADLINE_S == 3600
    roll = S.gang_roll(desired, ws, [], late)
    assert roll.surge == set() and "not whole 3600 s after its creation" in roll.gave_up["dit"]
    assert S.gang_roll(desired, ws, [], "2026-01-01T01:00:00Z").surge == {"dit"}
    # the next pass: the surge gang is gone and gang 0 runs the new template; the roll goes on in place
    del ws[("StatefulSet", extra)]
    ws[("StatefulSet", gangs[0])] = next(w for w in live(new, name) if w["metadata"]["name"] == gangs[0])
    roll = S.gang_roll(desired, ws, [], late)
    assert roll.surge == set() and roll.held == {gangs[2]} and not roll.gave_up and "in place" in roll.notes["dit"]


def test_max_surge_0_rolls_in_place_as_before():
    name, old, new = _roll_specs(rollout={"maxSurge": 0})
    gangs = [f"{name}-dit-{r}" for r in range(3)]
    desired = M.render(new, name, "ns", surge=frozenset({"dit"}))
    assert not any(o["metadata"]["labels"].get(M.LABEL_SURGE) for o in desired)
    roll = S.gang_roll(desired, {(w["kind"], w["metadata"]["name"]): w for w in live(old, name)}, [], T0)
    assert roll == S.GangRoll(held=frozenset(gangs[1:]))
