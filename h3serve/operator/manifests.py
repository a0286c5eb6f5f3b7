"""The pure renderer: an H3Deployment spec + its metadata -> the Kubernetes objects that should exist.

No I/O, no clock, no randomness: the same input gives the same list, in the same order (golden tests rely on it).

What it renders for an H3Deployment `<name>`:
- ServiceAccount `<name>` (no API token mounted: the pods never call the API server).
- ConfigMap `<name>-config` holding the service config (`h3serve.config.spec.ServiceConfig`) every process reads.
- Workloads. `colocated`: component `engine`, one pod per replica running every stage (gateway included) on the
  same GPUs (`h3serve serve --stages all`: the stages talk over loopback inside the pod). `disaggregated`: one
  workload per stage (`encoder`, `dit`, `vae`, `muxer`; with spec.fasth3 also `dit-fasth3`, a second DiT pool of
  profile fasth3 the gateway routes to by model) plus the gateway Deployment. A replica whose GPUs fit one
  node is one pod with N GPUs and N ranks (a Deployment); a replica larger than a node is a gang: a StatefulSet per
  replica `<name>-<component>-<r>` with one pod per node, a headless Service of the same name, leader = ordinal 0.
- A Service per component, selecting leaders only: `<name>-<stage>` and the front door `<name>-gateway` (which
  selects the gateway pods, or the engine pods when colocated); disaggregated, each stage also gets a headless
  Service `<name>-<stage>-headless`, the `dns:///` target the gateway balances its calls over.
- A PodDisruptionBudget per component; NetworkPolicies: the front door takes traffic from anywhere on its gRPC and
  HTTP ports, everything else only from pods of the same H3Deployment.

Every container runs `h3serve serve --stages <its stages>`; everything else a process needs (degrees, profile,
adapter, dtype, ports, peer addresses) it reads from the service config mounted at `$H3SERVE_CONFIG`
(`h3serve.config.stage.StageConfig.from_service_config`). Only the pod's own address travels in argv
(`--advertise $(POD_IP):port`, expanded by the kubelet) and, for the DiT pools and the VAE, the peers they may dial
(`--peers` = the headless Service of the stage they stream to). torch.distributed is wired by environment
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES, NPROC_PER_NODE, NODE_RANK, RANK = the first global rank of the pod).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import yaml

from h3serve.config.metrics import METRICS_PORT, SIGNALS
from h3serve.config.spec import API_VERSION, KIND, H3DeploymentSpec, ServiceConfig
from h3serve.config.stage import (API_KEYS_DIR, API_KEYS_KEY, COMPONENT_ENV, CONFIG_ENV, TLS_DIR, TLS_FILES,
                                  WEBHOOK_SECRETS_DIR, WEBHOOK_SECRETS_KEY, service_config_values, tls_peer_name)
from h3serve.config.vocab import (
    DEVICE_DTYPES,
    DIST_PORT,
    FASTH3_DIT,
    GRPC_PORT,
    HEALTH_SERVICE,
    HTTP_PORT,
    MODEL_STAGES,
    PIPELINE_STAGES,
    PORT_OFFSETS,
    SINKS,
    SURGE_GANG,
)

MANAGER = "h3serve-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "h3serve.io/role"  # "leader" on single-pod replicas; gang leaders are pod-index 0
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller on every pod
ANN_CONFIG_HASH = "h3serve.io/config-hash"
ANN_GANG = "h3serve.io/gang-size"
ANN_TEMPLATE_HASH = "h3serve.io/template-hash"  # on a gang's StatefulSet: its pod template, rendered
LABEL_SURGE = "h3serve.io/surge"  # "true" on the extra gang StatefulSet a rolling update starts first (dit.rollout)
ANN_WORLD = "h3serve.io/world"  # on a gang's StatefulSet, by the operator: the UIDs of the members that run together
# A gang member's readiness gate: the operator sets it True once the member is in its gang's recorded world, False
# before it restarts the gang, so a member counts for the disruption budget and the Services only while its world holds.
GATE_WORLD = "h3serve.io/in-gang-world"
CONFIG_PATH = "/etc/h3serve/h3serve.yaml"
RUN_AS = 65532
GATEWAY = "gateway"
ENGINE = "engine"

# Kinds the renderer may emit, with the API path pieces the operator applies and prunes them by.
KINDS: dict[str, tuple[str, str]] = {  # kind -> (apiVersion, plural)
    "ServiceAccount": ("v1", "serviceaccounts"),
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "StatefulSet": ("apps/v1", "statefulsets"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "PodGroup": ("scheduling.k8s.io/v1beta1", "podgroups"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitors"),
    "Certificate": ("cert-manager.io/v1", "certificates"),
}
# PodGroup (gang scheduling, Kubernetes 1.37 beta behind the GenericWorkload feature gate) may be missing: the operator
# renders it only where the API server serves it.
# ServiceMonitor (the Prometheus Operator's CRD) likewise, when spec.metrics.serviceMonitor asks for it.
# A Certificate (cert-manager, spec.tls.certManager) is rendered only when asked; where cert-manager is not installed
# its apply fails and says so (ApplyFailed).
OPTIONAL_KINDS = ("PodGroup", "ServiceMonitor", "Certificate")


def labels(name: str, component: str | None = None) -> dict[str, str]:
    out = {LABEL_NAME: "h3serve", LABEL_INSTANCE: name, LABEL_PART_OF: "h3serve", LABEL_MANAGED_BY: MANAGER}
    if component:
        out[LABEL_COMPONENT] = component
    return out


def selector(name: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: "h3serve", LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def components(spec: H3DeploymentSpec) -> list[str]:
    """The workload components of a spec: the engine (colocated), or each stage (and the FastH3 DiT pool, when
    declared) then the gateway."""
    if spec.placement == "colocated":
        return [ENGINE]
    return [*PIPELINE_STAGES, *([FASTH3_DIT] if spec.fasth3 is not None else []), GATEWAY]


def component_gpus(spec: H3DeploymentSpec, component: str) -> int:
    """GPUs (= ranks) of one replica of a component."""
    if component == ENGINE:
        return spec.dit.sp
    if component == FASTH3_DIT:
        return spec.fasth3.sp
    if component in MODEL_STAGES:
        return spec.stage_gpus(component)
    return 0


def component_replicas(spec: H3DeploymentSpec, component: str) -> int:
    if component == ENGINE:
        return spec.stage_replicas("dit")
    if component == FASTH3_DIT:
        return spec.fasth3.replicas
    return spec.stage_replicas(component)


def autoscaling(spec: H3DeploymentSpec, component: str):
    """The component's AutoscalingSpec, or None (the colocated engine scales by spec.replicas)."""
    return None if component in (ENGINE, FASTH3_DIT) else getattr(spec, component).autoscaling


def gang_size(spec: H3DeploymentSpec, component: str) -> int:
    """Pods per replica: 1, or one pod per node when a replica needs more GPUs than a node has."""
    return spec.pods_per_replica(component_gpus(spec, component))


def workload_names(spec: H3DeploymentSpec, name: str, component: str) -> list[tuple[str, str]]:
    """(kind, name) of each workload object of a component."""
    if gang_size(spec, component) > 1:
        return [("StatefulSet", f"{name}-{component}-{r}") for r in range(component_replicas(spec, component))]
    return [("Deployment", f"{name}-{component}")]


def surge_capable(spec: H3DeploymentSpec, component: str) -> bool:
    """The component's gangs roll with a surge gang first (dit.rollout.maxSurge: the DiT's gangs, in every
    placement); the others roll in place."""
    return component in (ENGINE, "dit", FASTH3_DIT) and gang_size(spec, component) > 1 and spec.dit.rollout.max_surge > 0


def surge_name(name: str, component: str) -> str:
    return f"{name}-{component}-{SURGE_GANG}"


def headless_name(name: str, comp: str) -> str:
    """The headless Service of a disaggregated stage: its DNS name resolves to every ready replica (leader) pod."""
    return f"{name}-{comp}-headless"


def headless_address(name: str, namespace: str, comp: str) -> str:
    """host:port of a disaggregated stage's headless Service: the gateway's `dns:///` target, and the `--peers`
    item of the pods that stream to the stage."""
    return f"{headless_name(name, comp)}.{namespace}.svc:{GRPC_PORT}"


def endpoints(spec: H3DeploymentSpec, name: str, namespace: str) -> dict[str, str]:
    """stage -> gRPC target. Disaggregated: `dns:///` of the stage's headless Service, so the dialer (the gateway)
    resolves every ready replica and balances per call (gRPC round_robin); rendered whatever the replica count, so
    that scaling (spec, /scale or an HPA) changes no config and restarts nothing. Colocated: the stage's loopback
    port inside the replica pod. The gateway's own entry is its Service."""
    if spec.placement == "colocated":
        out = {st: f"127.0.0.1:{GRPC_PORT + PORT_OFFSETS[st]}" for st in PIPELINE_STAGES}
    else:
        out = {st: f"dns:///{headless_address(name, namespace, st)}"
               for st in (*PIPELINE_STAGES, *([FASTH3_DIT] if spec.fasth3 is not None else []))}
    out[GATEWAY] = f"{name}-{GATEWAY}.{namespace}.svc:{GRPC_PORT}"
    return out


def public_endpoints(name: str, namespace: str, tls: bool = False) -> dict[str, str]:
    scheme = "https" if tls else "http"  # with spec.tls the gateway's HTTP API is HTTPS only
    return {"grpc": f"{name}-{GATEWAY}.{namespace}.svc:{GRPC_PORT}",
            "http": f"{scheme}://{name}-{GATEWAY}.{namespace}.svc:{HTTP_PORT}"}


def service_config(spec: H3DeploymentSpec, name: str, namespace: str) -> ServiceConfig:
    return ServiceConfig(name=name, namespace=namespace, spec=spec, endpoints=endpoints(spec, name, namespace),
                         dtype=DEVICE_DTYPES[spec.device], device=spec.device)


def component_stages(component: str) -> tuple[str, ...]:
    """The stages the processes of a component's pods run."""
    return (*PIPELINE_STAGES, GATEWAY) if component == ENGINE else (component,)


def config_hash(service_cfg: dict, component: str) -> str:
    """Hash of exactly the part of the service config a component's processes read (their
    `service_config_values`): a pod restarts only when its own stage's configuration changes. Replicas, and other
    stages' knobs, are not in it; the pod template itself rolls the pods when it changes."""
    consumed = {st: service_config_values(service_cfg, st) for st in component_stages(component)}
    return hashlib.sha256(_dump_yaml_like(consumed).encode()).hexdigest()[:16]


def _dump_yaml_like(d: Any) -> str:
    # JSON is YAML; sorted keys make the ConfigMap (and its hash) stable; a StageConfig's nested parts as dicts.
    return json.dumps(d, indent=2, sort_keys=True, default=dataclasses.asdict) + "\n"


def render(spec: H3DeploymentSpec, name: str, namespace: str, owner: dict | None = None,
           gang_scheduling: bool = True, service_monitors: bool = True, surge: frozenset[str] = frozenset()) -> list[dict]:
    """All desired objects, in apply order. `owner` = the H3Deployment's metadata (needs `uid`) -> ownerReferences.
    `gang_scheduling`: the cluster serves scheduling.k8s.io/v1beta1 PodGroups, so each multi-node replica is placed
    all or nothing (a PodGroup with a gang policy of the replica's pod count). `service_monitors`: the cluster serves
    monitoring.coreos.com/v1 ServiceMonitors (rendered when spec.metrics.serviceMonitor asks). `surge`: the gang
    components whose rolling update runs an extra gang now (`status.gang_roll` decides)."""
    objs: list[dict] = []
    cfg = service_config(spec, name, namespace).to_dict()
    cfg_text = _dump_yaml_like(cfg)

    objs.append(_meta({"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": False},
                      name, name, namespace, None))
    objs.append(_meta({"apiVersion": "v1", "kind": "ConfigMap", "data": {"h3serve.yaml": cfg_text}},
                      f"{name}-config", name, namespace, None))
    for comp in components(spec):
        objs += _component(spec, name, namespace, comp, config_hash(cfg, comp), gang_scheduling,
                           comp in surge and surge_capable(spec, comp))
    objs += _network_policies(spec, name, namespace)
    if spec.metrics.service_monitor and service_monitors:
        objs += _service_monitor(spec, name, namespace)
    if spec.tls is not None and spec.tls.cert_manager is not None:  # before the pods that mount its Secret
        objs.insert(2, _certificate(spec, name, namespace, objs))
    if owner is not None:
        ref = {"apiVersion": API_VERSION, "kind": KIND, "name": owner["name"], "uid": owner["uid"],
               "controller": True, "blockOwnerDeletion": True}
        for o in objs:
            o["metadata"]["ownerReferences"] = [dict(ref)]
    return objs


def _meta(obj: dict, obj_name: str, name: str, namespace: str, component: str | None) -> dict:
    md = {"name": obj_name, "namespace": namespace, "labels": labels(name, component)}
    return {"apiVersion": obj.pop("apiVersion"), "kind": obj.pop("kind"), "metadata": md, **obj}


# ---- one component: workloads + Service + PDB --------------------------------------------------------------------

def front(comp: str) -> bool:
    """The component that takes client traffic: the gateway, or the engine (its in-pod gateway) when colocated."""
    return comp in (GATEWAY, ENGINE)


def _component(spec: H3DeploymentSpec, name: str, namespace: str, comp: str, cfg_hash: str,
               gang_scheduling: bool = True, surge: bool = False) -> list[dict]:
    objs: list[dict] = []
    replicas = component_replicas(spec, comp)
    gang = gang_size(spec, comp)
    gpus = component_gpus(spec, comp)
    svc_name = f"{name}-{GATEWAY}" if comp == ENGINE else f"{name}-{comp}"
    ports = [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    if front(comp):
        ports.append({"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP",
                      "appProtocol": "http"})
    svc_selector = {**selector(name, comp), LABEL_ROLE: "leader"}
    if gang > 1:
        svc_selector = {**selector(name, comp), LABEL_POD_INDEX: "0"}
    svc_spec: dict = {"selector": svc_selector, "ports": ports}
    if front(comp):
        svc_spec["type"] = spec.gateway.service_type
    objs.append(_meta({"apiVersion": "v1", "kind": "Service", "spec": svc_spec}, svc_name, name, namespace, comp))
    if comp in (*PIPELINE_STAGES, FASTH3_DIT):  # disaggregated: the gateway's per-call balanced target (`endpoints`)
        objs.append(_meta({"apiVersion": "v1", "kind": "Service", "spec": {
            "clusterIP": "None", "selector": svc_selector, "ports": ports}},
            headless_name(name, comp), name, namespace, comp))

    if gang == 1:
        objs.append(_deployment(spec, name, namespace, comp, replicas, gpus, cfg_hash))
        if autoscaling(spec, comp) is not None:
            objs.append(_hpa(spec, name, namespace, comp))
    else:
        per_pod = spec.gpus_per_node
        # the surge gang last: it is a gang like the others (its own Service, PodGroup and world), serving as one
        for gname in [f"{name}-{comp}-{r}" for r in range(replicas)] + ([surge_name(name, comp)] if surge else []):
            gsel = {**selector(name, comp), "h3serve.io/gang": gname}
            objs.append(_meta({"apiVersion": "v1", "kind": "Service", "spec": {
                "clusterIP": "None", "publishNotReadyAddresses": True, "selector": gsel,
                "ports": [{"name": "dist", "port": DIST_PORT, "targetPort": "dist", "protocol": "TCP"}]}},
                gname, name, namespace, comp))
            group = None
            if gang_scheduling:  # before its pods: the scheduler holds them until the whole gang fits
                pg = {"schedulingPolicy": {"gang": {"minCount": gang}}}
                if spec.priority_class_name:  # the scheduler places a group only at its pods' priority
                    pg["priorityClassName"] = spec.priority_class_name
                # A PodGroup's spec is immutable, and one its pods still use cannot go: a new spec is a new
                # PodGroup (named by its spec) that the gang's new pods join as it rolls; the old one is pruned.
                group = f"{gname}-{_digest(pg)[:8]}"
                objs.append(_meta({"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "spec": pg},
                                  group, name, namespace, comp))
            objs.append(_statefulset(spec, name, namespace, comp, gname, gang, per_pod, gpus, cfg_hash, group))
            if gname == surge_name(name, comp):
                objs[-1]["metadata"]["labels"][LABEL_SURGE] = "true"

    if replicas + surge > 1:
        # One replica may go; a single replica gets no PDB, which could only block node drains without keeping
        # anything serving. A gang stops whole when any one of its pods goes, so its budget is one pod: with
        # (replicas - 1) x gang, two evictions in two different gangs would stop both. The gang's other pods turn
        # unready as it restarts, which holds the next eviction until it is back. A surge gang counts as one more
        # gang: a drain waits while it starts, and can never take an old whole gang for it.
        pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "spec": {
            "minAvailable": (replicas + surge) * gang - 1, "selector": {"matchLabels": selector(name, comp)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
        objs.append(_meta(pdb, f"{name}-{comp}", name, namespace, comp))
    return objs


def _stage_opts(spec: H3DeploymentSpec, comp: str):
    sub = spec.gateway if comp == GATEWAY else (spec.dit if comp in (ENGINE, FASTH3_DIT) else getattr(spec, comp))
    node_selector, tolerations = sub.node_selector, sub.tolerations  # the FastH3 pool is placed like the DiT
    if component_gpus(spec, comp):  # the spec-wide placement is for GPU pods: CPU stages do not tolerate GPU taints
        node_selector = spec.node_selector if node_selector is None else node_selector
        tolerations = spec.tolerations if tolerations is None else tolerations
    resources = sub.resources
    if comp == ENGINE:  # the engine pod runs every stage: take the DiT's resources (the largest stage)
        resources = spec.dit.resources
    if comp == FASTH3_DIT:
        resources = spec.fasth3.resources
    return node_selector, tolerations, resources


def _resources(spec: H3DeploymentSpec, base: dict | None, gpus: int) -> dict:
    out: dict = {}
    for kind in ("requests", "limits"):
        d = dict((base or {}).get(kind) or {})
        if gpus:
            d[spec.gpu_resource_name] = gpus
        if d:
            out[kind] = {k: d[k] for k in sorted(d)}
    if gpus:  # extended resources: the request must equal the limit
        out["requests"][spec.gpu_resource_name] = gpus
    return out


def _security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_security_context() -> dict:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _grpc_probe(period: int, failures: int, timeout: int = 5) -> dict:
    return {"grpc": {"port": GRPC_PORT, "service": HEALTH_SERVICE}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


PROBE = ["python", "-m", "h3serve.runtime.probe"]  # h3serve/runtime/probe.py
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 360  # a model stage may take an hour to load its weights
HUNG_KILL_GRACE_S = 10


def _probes(spec: H3DeploymentSpec, name: str, namespace: str, comp: str) -> dict[str, dict]:
    """Startup: gRPC health SERVING = weights loaded and one warm-up pass done (loading ~100 GB from a network volume
    can take long: up to an hour; the gateway only waits for its channels). Readiness: SERVING; NOT_SERVING again
    while draining, so endpoints drop the pod before it stops. Liveness: the process answers gRPC health at all,
    NOT_SERVING included (a draining server must be let finish), so a hung one (SIGSTOP) is restarted where a TCP
    check would pass. The kubelet's gRPC probe fails on NOT_SERVING and speaks no TLS: liveness, and with spec.tls
    every probe, is the exec probe `h3serve.runtime.probe` (the pod's own certificate, the Service's name)."""
    tls: list[str] = []
    if spec.tls is not None:
        svc = f"{name}-{GATEWAY}" if comp == ENGINE else f"{name}-{comp}"
        tls = [*(a for k, v in TLS_FILES.items() for a in (f"--{k.replace('_', '-')}", f"{TLS_DIR}/{v}")),
               "--server-name", f"{svc}.{namespace}.svc"]

    def probe(period: int, failures: int, live: bool = False) -> dict:
        if not tls and not live:
            return _grpc_probe(period, failures)
        cmd = [*PROBE, "--port", str(GRPC_PORT), *(["--live"] if live else []), "--timeout", "5", *tls]
        # a Python start and one check: well inside the timeout
        return {"exec": {"command": cmd}, "periodSeconds": period, "timeoutSeconds": 15, "failureThreshold": failures}

    # A container killed for liveness is hung: it cannot drain, so it gets seconds, not the pod's drain grace.
    return {"startupProbe": probe(STARTUP_PERIOD_S, STARTUP_FAILURES) if comp != GATEWAY else probe(5, 60),
            "readinessProbe": probe(5, 3),
            "livenessProbe": {**probe(20, 6, live=True), "terminationGracePeriodSeconds": HUNG_KILL_GRACE_S}}


def metrics_ports(comp: str) -> dict[str, int]:
    """stage -> the port its process serves /metrics on, for the processes of a component's pods."""
    if comp == GATEWAY:
        return {GATEWAY: HTTP_PORT}
    if comp == FASTH3_DIT:  # its pods run a DiT process
        return metrics_ports("dit")
    out = {st: METRICS_PORT + PORT_OFFSETS[st] for st in component_stages(comp) if st in PIPELINE_STAGES}
    if comp == ENGINE:
        out[GATEWAY] = HTTP_PORT
    return out


def _env(spec: H3DeploymentSpec, comp: str) -> list[dict]:
    env = [
        {"name": CONFIG_ENV, "value": CONFIG_PATH},
        {"name": COMPONENT_ENV, "value": comp},
        *([{"name": "H3SERVE_METRICS_PORT", "value": str(METRICS_PORT)}] if comp != GATEWAY else []),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
    ]
    return env


def _dist_env(world: int, per_pod: int, nnodes: int, master: str, gang: bool) -> list[dict]:
    env = [
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(DIST_PORT)},
        {"name": "WORLD_SIZE", "value": str(world)},
        {"name": "NNODES", "value": str(nnodes)},
        {"name": "NPROC_PER_NODE", "value": str(per_pod)},
    ]
    if gang:
        env.append({"name": "NODE_RANK",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_POD_INDEX}']"}}})
    else:
        env += [{"name": "NODE_RANK", "value": "0"}, {"name": "RANK", "value": "0"}]
    return env


def serve_args(name: str, namespace: str, comp: str) -> list[str]:
    """The `h3serve serve` command line of a component: its stages, the address its peers reach it at and the
    peers it may dial; the rest is in the mounted service config."""
    stage = "all" if comp == ENGINE else ("dit" if comp == FASTH3_DIT else comp)
    args = ["h3serve", "serve", "--stages", stage]
    if comp in (*PIPELINE_STAGES, FASTH3_DIT):  # peers (the VAE streaming to a muxer) reach this very pod
        args += ["--advertise", f"$(POD_IP):{GRPC_PORT}"]
    if stage in SINKS:  # a request names the sink's pod by IP: only an IP of the sink stage's headless Service
        args += ["--peers", headless_address(name, namespace, SINKS[stage])]
    # The engine's launcher gives each stage the loopback addresses of the stages it started.
    return args


def _command(name: str, namespace: str, comp: str, gang: bool) -> tuple[list[str], list[str]]:
    serve = serve_args(name, namespace, comp)
    if not gang:
        return serve, []
    # RANK = the global rank of this pod's first process (its local ranks follow); the leader (ordinal 0) is rank 0.
    return ["/bin/sh", "-c", 'export RANK=$((NODE_RANK * NPROC_PER_NODE)); exec "$@"', "--"], serve


def _pod_template(spec: H3DeploymentSpec, name: str, namespace: str, comp: str, gpus_per_pod: int,
                  cfg_hash: str, extra_labels: dict, dist_env: list[dict], gang: bool) -> dict:
    node_selector, tolerations, base_res = _stage_opts(spec, comp)
    gpu = gpus_per_pod > 0
    ports = [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}]
    if front(comp):
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    for st, port in metrics_ports(comp).items():
        if port != HTTP_PORT:
            ports.append({"name": f"metrics-{st[:3]}" if comp == ENGINE else "metrics", "containerPort": port,
                          "protocol": "TCP"})
    if gang:
        ports.append({"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"})
    mounts = [{"name": "config", "mountPath": "/etc/h3serve", "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": f"{name}-config"}},
                           {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    if gpu or comp in (ENGINE, "muxer"):
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
    if comp != GATEWAY and comp != "muxer" and spec.model.volume is not None:
        mounts.append({"name": "model", "mountPath": spec.model.mount_path, "readOnly": True})
        volumes.append({"name": "model", **_readonly_volume(spec.model.volume)})
    secret_mounts, secret_volumes = _secret_volumes(spec, comp)
    mounts += secret_mounts
    volumes += secret_volumes
    command, args = _command(name, namespace, comp, gang)
    container = {
        "name": comp,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "ports": ports,
        "env": _env(spec, comp) + dist_env + _job_store_env(spec, comp),
        "resources": _resources(spec, base_res, gpus_per_pod if spec.device == "cuda" else 0),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        **_probes(spec, name, namespace, comp),
        # Let endpoints drop the pod before SIGTERM starts the drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if args:
        container["args"] = args
    pod: dict = {
        "serviceAccountName": name,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        # Drain: the server stops admitting, finishes what it admitted (drainSeconds), then exits.
        "terminationGracePeriodSeconds": spec.drain_seconds + 30,
        "containers": [container],
        "volumes": volumes,
    }
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    tmpl_labels = {**labels(name, comp), **extra_labels}
    # Scrape annotations name one port: the stage's own (the engine: its gateway's; its stages' ports are named
    # metrics-<stage> for a PodMonitor).
    mports = metrics_ports(comp)
    scrape = mports[GATEWAY] if comp == ENGINE else next(iter(mports.values()))
    ann = {ANN_CONFIG_HASH: cfg_hash, "prometheus.io/scrape": "true", "prometheus.io/port": str(scrape),
           "prometheus.io/path": "/metrics"}
    return {"metadata": {"labels": tmpl_labels, "annotations": ann}, "spec": pod}


def _secret_volumes(spec: H3DeploymentSpec, comp: str) -> tuple[list[dict], list[dict]]:
    """The Secrets a component's pods mount read-only (whole volumes, never subPath: a Secret volume then swaps its
    files atomically on a change, and the gateway re-reads its keys without a restart)."""
    mounts: list[dict] = []
    volumes: list[dict] = []
    keys = spec.gateway.auth.api_keys_secret
    if front(comp) and keys is not None:
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": keys, "defaultMode": 0o440,
                                                       "items": [{"key": API_KEYS_KEY, "path": API_KEYS_KEY}]}})
    hooks = spec.gateway.webhooks
    if front(comp) and hooks is not None:
        mounts.append({"name": "webhook-secrets", "mountPath": WEBHOOK_SECRETS_DIR, "readOnly": True})
        volumes.append({"name": "webhook-secrets", "secret": {
            "secretName": hooks.secrets_secret, "defaultMode": 0o440,
            "items": [{"key": WEBHOOK_SECRETS_KEY, "path": WEBHOOK_SECRETS_KEY}]}})
    if spec.tls is not None:  # every pod: its servers and its channels to peers
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": spec.tls.secret_name, "defaultMode": 0o440,
                                                  "items": [{"key": k, "path": k} for k in TLS_FILES.values()]}})
    return mounts, volumes


def _certificate(spec: H3DeploymentSpec, name: str, namespace: str, objs: list[dict]) -> dict:
    """A cert-manager Certificate for every Service the deployment renders (each name as peers and clients dial
    it) and 127.0.0.1 (colocated stages talk over loopback); both server and client auth (mTLS)."""
    services = sorted({o["metadata"]["name"] for o in objs if o["kind"] == "Service"})
    dns = [d for s in services for d in (s, f"{s}.{namespace}", f"{s}.{namespace}.svc",
                                         f"{s}.{namespace}.svc.cluster.local")]
    ref = spec.tls.cert_manager.issuer_ref
    cert = {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "spec": {
        "secretName": spec.tls.secret_name, "dnsNames": [*dns, tls_peer_name(name, namespace), "localhost"],
        "ipAddresses": ["127.0.0.1"],
        "usages": ["server auth", "client auth", "digital signature"],  # an ECDSA key: no key encipherment
        "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
        "issuerRef": {"name": ref.name, "kind": ref.kind, "group": ref.group}}}
    return _meta(cert, f"{name}-tls", name, namespace, None)


def _job_store_env(spec: H3DeploymentSpec, comp: str) -> list[dict]:
    """The object store's endpoint, region and credentials, as the gateway's S3 client reads them (AWS_*)."""
    store = spec.gateway.job_store
    if not front(comp) or store is None:
        return []
    s3 = store.s3
    env = [{"name": "AWS_ENDPOINT_URL", "value": s3.endpoint}] if s3.endpoint else []
    env += [{"name": "AWS_REGION", "value": s3.region}] if s3.region else []
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": k}}}
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    return env


def _readonly_volume(source: dict) -> dict:
    src = json.loads(json.dumps(source))
    for k in ("persistentVolumeClaim", "nfs", "csi", "iscsi", "rbd", "cephfs", "azureFile", "fc"):
        if isinstance(src.get(k), dict):
            src[k]["readOnly"] = True
    return src


def _deployment(spec: H3DeploymentSpec, name: str, namespace: str, comp: str, replicas: int, gpus: int,
                cfg_hash: str) -> dict:
    dist = _dist_env(gpus, gpus, 1, "127.0.0.1", False) if gpus else []
    tmpl = _pod_template(spec, name, namespace, comp, gpus, cfg_hash, {LABEL_ROLE: "leader"}, dist, False)
    # GPU workloads roll one pod at a time without a surge (a surge pod would need spare GPUs that rarely exist);
    # CPU workloads (spec.device cpu: the model stages too) surge so that they never drop below their replica count.
    on_gpus = gpus and spec.device == "cuda"
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}} if on_gpus else
                {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}})
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {
        "replicas": replicas, "revisionHistoryLimit": 5, "strategy": strategy,
        "selector": {"matchLabels": selector(name, comp)}, "template": tmpl}}
    if autoscaling(spec, comp) is not None:
        # The autoscaler owns the count: the operator's apply leaves the field out, so it never fights the HPA.
        del dep["spec"]["replicas"]
    return _meta(dep, f"{name}-{comp}", name, namespace, comp)


def _hpa(spec: H3DeploymentSpec, name: str, namespace: str, comp: str) -> dict:
    """An autoscaling/v2 HPA on the stage Deployment, on the stage's diffusion signals (h3serve.config.metrics)."""
    a = autoscaling(spec, comp)
    metrics = []
    for i, sig in enumerate(SIGNALS[comp]):
        target = a.target if (a.target is not None and i == 0) else sig.target
        metrics.append({"type": "Pods", "pods": {"metric": {"name": sig.metric},
                                                 "target": {"type": "AverageValue", "averageValue": target}}})
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "spec": {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{name}-{comp}"},
        "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas, "metrics": metrics,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds}}}}
    return _meta(hpa, f"{name}-{comp}", name, namespace, comp)


def _statefulset(spec: H3DeploymentSpec, name: str, namespace: str, comp: str, gname: str, gang: int,
                 per_pod: int, gpus: int, cfg_hash: str, group: str | None) -> dict:
    master = f"{gname}-0.{gname}.{namespace}.svc"
    dist = _dist_env(gpus, per_pod, gang, master, True)
    tmpl = _pod_template(spec, name, namespace, comp, per_pod, cfg_hash, {"h3serve.io/gang": gname}, dist, True)
    tmpl["metadata"]["annotations"][ANN_GANG] = str(gang)
    if group:
        tmpl["spec"]["schedulingGroup"] = {"podGroupName": group}
    tmpl["spec"]["readinessGates"] = [{"conditionType": GATE_WORLD}]
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "spec": {
        "replicas": gang, "serviceName": gname, "podManagementPolicy": "Parallel", "revisionHistoryLimit": 5,
        "updateStrategy": {"type": "RollingUpdate"},
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete"},
        "selector": {"matchLabels": {**selector(name, comp), "h3serve.io/gang": gname}}, "template": tmpl}}
    out = _meta(sts, gname, name, namespace, comp)
    # what the live object is compared with to roll one gang at a time (the API server fills in defaults, so the
    # live template never equals the rendered one)
    out["metadata"]["annotations"] = {ANN_TEMPLATE_HASH: _digest(tmpl)}
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _service_monitor(spec: H3DeploymentSpec, name: str, namespace: str) -> list[dict]:
    """A ServiceMonitor over every metrics port: the gateway's (`http` of the front-door Service) and each stage
    process' (`metrics[-<stage>]`), through a headless Service `<name>-metrics` that selects every pod of the
    instance by its named metrics ports (Prometheus scrapes each pod, gang workers too)."""
    # Named target ports: each pod's EndpointSlice entry carries only the ports its container names, so a stage pod
    # is scraped on its own metrics port (disaggregated: "metrics", a different number per stage) and nowhere else.
    if spec.placement == "colocated":
        ports = {f"metrics-{st[:3]}": p for st, p in metrics_ports(ENGINE).items() if p != HTTP_PORT}
    else:
        ports = {"metrics": METRICS_PORT}
    svc_ports = [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports.items()]
    svc = _meta({"apiVersion": "v1", "kind": "Service", "spec": {
        "clusterIP": "None", "selector": {LABEL_NAME: "h3serve", LABEL_INSTANCE: name}, "ports": svc_ports}},
        f"{name}-metrics", name, namespace, None)
    svc["metadata"]["labels"]["h3serve.io/metrics"] = "true"
    endpoints = [{"port": n, "path": "/metrics"} for n in ports]
    gw = {"port": "http", "path": "/metrics"}
    mon = _meta({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "spec": {
        "selector": {"matchExpressions": [
            {"key": LABEL_INSTANCE, "operator": "In", "values": [name]},
            {"key": LABEL_NAME, "operator": "In", "values": ["h3serve"]},
            {"key": LABEL_COMPONENT, "operator": "In", "values": [GATEWAY, ENGINE]}]},
        "namespaceSelector": {"matchNames": [namespace]}, "endpoints": [gw]}}, f"{name}-gateway", name, namespace,
        None)
    stages = _meta({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "spec": {
        "selector": {"matchLabels": {LABEL_INSTANCE: name, "h3serve.io/metrics": "true"}},
        "namespaceSelector": {"matchNames": [namespace]}, "endpoints": endpoints}}, f"{name}-stages", name,
        namespace, None)
    return [svc, mon, stages]


def _network_policies(spec: H3DeploymentSpec, name: str, namespace: str) -> list[dict]:
    same_instance = {"podSelector": {"matchLabels": {LABEL_NAME: "h3serve", LABEL_INSTANCE: name}}}
    mine = [{"key": LABEL_INSTANCE, "operator": "In", "values": [name]},
            {"key": LABEL_NAME, "operator": "In", "values": ["h3serve"]}]
    stages = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "spec": {
        "podSelector": {"matchExpressions": [
            *mine, {"key": LABEL_COMPONENT, "operator": "NotIn", "values": [GATEWAY, ENGINE]}]},
        "policyTypes": ["Ingress"],
        # Any port: gRPC, torch.distributed / NCCL and UCX pick ports of their own between peers.
        "ingress": [{"from": [same_instance]}]}}
    door: dict = {"ports": [{"port": GRPC_PORT, "protocol": "TCP"}, {"port": HTTP_PORT, "protocol": "TCP"}]}
    src = spec.gateway.ingress_from
    if src is not None:  # only these namespaces and ranges (and the instance's own pods, below); an empty one: none
        door["from"] = [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(src.namespaces)}]}}
            ] if src.namespaces else []
        door["from"] += [{"ipBlock": {"cidr": c}} for c in src.cidrs or []]
    ingress = [door, {"from": [same_instance]}] if door.get("from", True) else [{"from": [same_instance]}]
    mon = spec.metrics.monitoring_namespace
    if mon:  # the monitoring namespace may scrape every pod's metrics ports (only those)
        scrape_from = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": mon}}}]
        stage_ports = sorted({p for c in (*PIPELINE_STAGES, ENGINE) for p in metrics_ports(c).values()
                              if p != HTTP_PORT})
        stages["spec"]["ingress"].append({"from": scrape_from, "ports": [
            {"port": p, "protocol": "TCP"} for p in stage_ports]})
        ingress.append({"from": scrape_from, "ports": [{"port": HTTP_PORT, "protocol": "TCP"}] + [
            {"port": p, "protocol": "TCP"} for p in stage_ports]})
    gateway = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "spec": {
        "podSelector": {"matchExpressions": [
            *mine, {"key": LABEL_COMPONENT, "operator": "In", "values": [GATEWAY, ENGINE]}]},
        "policyTypes": ["Ingress"],
        "ingress": ingress}}
    return [_meta(stages, f"{name}-stages", name, namespace, None),
            _meta(gateway, f"{name}-gateway", name, namespace, None)]


def to_yaml(objs: list[dict]) -> str:
    return "".join("---\n" + yaml.safe_dump(o, sort_keys=False, width=120) for o in objs)
