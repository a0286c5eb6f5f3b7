"""The typed `H3Deployment` spec: one definition for the operator, the CLI and the services.

A spec is parsed from the custom resource's `.spec` (camelCase keys, as users write them) into frozen
dataclasses with snake_case attributes, and validated in one place (`validate`). Every message names the
field, the value and what to change.

The field table below is also the source of the CRD's OpenAPI schema (`h3serve.operator.crd`): each field's
JSON name, documentation, default and bounds live in its `dataclasses.field(metadata=...)` (`codec.f`; the
camelCase codec is `h3serve.config.codec`). The cross-field
rules live in `h3serve.config.rules`, once: `validate` runs them here and the CRD carries them as CEL (tests
compare their messages against a real API server).

No kopf, grpc, av or torch imports here.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Optional

from h3serve.config.callers import callers_json, parse_caller_limits
from h3serve.config.levers import levers_spec_class
from h3serve.config.codec import dump, f, parse
from h3serve.config.lora import LORA_CACHE_BYTES, NAME_PATTERN, SHA256_PATTERN, LoraEntry
from h3serve.config.rules import RULES
from h3serve.config.vocab import (
    DEFAULT_TASKS,
    DEVICES,
    ENCODER_CACHE_BYTES,
    MAX_ENCODER_CACHE_BYTES,
    TASKS_PATTERN,
    DIST_PORT,
    DIT_HEADS,
    ENCODER_HEADS,
    ENCODER_KV_HEADS,
    FASTH3_DIT,
    GRPC_PORT,
    HEALTH_SERVICE,
    HTTP_PORT,
    MAX_PREVIEWS,
    PIPELINE_STAGES,
    PROFILES,
    GRPC,
    TRANSPORTS,
)
from h3serve.errors import H3Error

GROUP = "h3serve.io"
VERSION = "v1alpha1"
KIND = "H3Deployment"
PLURAL = "h3deployments"
API_VERSION = f"{GROUP}/{VERSION}"

PLACEMENTS = ("colocated", "disaggregated")
MAX_REPLICA_GPUS = 1024  # a bound for the schema: GPUs of one stage replica (Ring has no head limit)

NAME_MAX = 40  # leaves room for "-encoder-12" suffixes and StatefulSet pod / revision-hash labels (<= 63)
STATEFULSET_NAME_MAX = 52  # its pods' controller-revision-hash label is the name + "-" + a 10-character hash
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_QUANTITY_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[mkMGTPE]|[numk])?$")
_SIZE_RE = re.compile(r"^[0-9]+(Ki|Mi|Gi|Ti)?$")


class SpecError(H3Error, ValueError):
    """An H3Deployment spec is invalid. `issues` lists every problem as (field, message)."""

    def __init__(self, issues: list[tuple[str, str]]):
        self.issues = list(issues)
        super().__init__("; ".join(f"{f}: {m}" for f, m in self.issues))


# Shared OpenAPI fragments for Kubernetes core types we pass through untouched.
QUANTITY_SCHEMA = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
RESOURCES_SCHEMA = {
    "type": "object",
    "properties": {
        "requests": {"type": "object", "additionalProperties": QUANTITY_SCHEMA},
        "limits": {"type": "object", "additionalProperties": QUANTITY_SCHEMA},
    },
}
TOLERATION_SCHEMA = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
    },
}


# ---- the spec ----------------------------------------------------------------------------------------------------

AUTOSCALING_DOC = ("Scale this stage with a HorizontalPodAutoscaler on its diffusion signal (disaggregated placement, "
                   "a replica on one node; instead of replicas: the operator then leaves the replica count to the "
                   "autoscaler).")


@dataclass(frozen=True)
class AutoscalingSpec:
    max_replicas: int = f("maxReplicas", "Most replicas the HorizontalPodAutoscaler may run.", minimum=1,
                          maximum=1024)
    min_replicas: int = f("minReplicas", "Fewest replicas.", 1, minimum=1, maximum=1024)
    target: Optional[str] = f("target", "Per-pod average of the stage's diffusion signal to hold (dit: queued denoise "
                              "step-seconds, default 120; vae: queued clips, 2; encoder: queued prompts, 8; muxer: open "
                              "sessions, 4; gateway: queue depth, 8, and real-time factor 1).", None, maxLength=32,
                              pattern=r"^[0-9]+(\.[0-9]+)?(m|k)?$")
    scale_down_stabilization_seconds: int = f(
        "scaleDownStabilizationSeconds", "How long the signal must stay low before replicas are removed.", 300,
        minimum=0, maximum=3600)


@dataclass(frozen=True)
class AdapterSpec:
    path: str = f("path", "Path of the FastH3 adapter file (fastvideo-lora-v2 safetensors), inside model.mountPath.",
                  minLength=1, maxLength=1024)
    sha256: Optional[str] = f("sha256", "Lower-case hex sha256 of the adapter file; the service refuses a file "
                              "that does not match.", None, pattern="^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelSpec:
    path: str = f("path", "Diffusers-format MiniMax-H3 folder, inside model.mountPath when model.volume is set.",
                  minLength=1, maxLength=1024)
    volume: Optional[dict] = f("volume", "A Kubernetes volume source that holds the weights, e.g. "
                               "{persistentVolumeClaim: {claimName: h3-weights}}; mounted read-only at "
                               "model.mountPath. Omit when the weights are in the image.", None)
    mount_path: str = f("mountPath", "Where model.volume is mounted in every pod.", "/models",
                        pattern="^/.*", maxLength=512)
    adapter: Optional[AdapterSpec] = f("adapter", "The FastH3 4-step adapter; required by profile fasth3.", None)
    manifest_sha256: Optional[str] = f("manifestSha256", "Lower-case hex sha256 of the checkpoint's "
                                       "h3serve-manifest.json (`h3serve checkpoint manifest DIR` prints it): each model "
                                       "stage checks the manifest, then every file it loads, before loading any "
                                       "tensor (`--checkpoint-manifest-sha256`).", None, pattern="^[0-9a-f]{64}$")


# The levers' CRD objects: one field a row of the lever table (config/levers.py).
EncoderLeversSpec = levers_spec_class("encoder", "EncoderLeversSpec")
VaeLeversSpec = levers_spec_class("vae", "VaeLeversSpec")
DitLeversSpec = levers_spec_class("dit", "DitLeversSpec")


@dataclass(frozen=True)
class EncoderSpec:
    tensor_parallel: int = f("tensorParallel", "Tensor-parallel degree of the Qwen3-VL encoder (GPUs per encoder "
                             f"replica); must divide the {ENCODER_HEADS} query heads, and divide the "
                             f"{ENCODER_KV_HEADS} KV heads or be a multiple of them.", 1,
                             minimum=1, maximum=ENCODER_HEADS)
    replicas: Optional[int] = f("replicas", "Encoder replicas (disaggregated placement only; default 1).",
                                None, minimum=0, maximum=1024)
    autoscaling: Optional[AutoscalingSpec] = f("autoscaling", AUTOSCALING_DOC, None)
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of an encoder pod; the GPU "
                                  "count is set from tensorParallel.", None, **RESOURCES_SCHEMA)
    node_selector: Optional[dict] = f("nodeSelector", "Replaces spec.nodeSelector for this stage.", None)
    tolerations: Optional[list] = f("tolerations", "Replaces spec.tolerations for this stage.", None)
    cache_bytes: int = f("cacheBytes", "Bytes of encodings each encoder keeps in host memory for repeated prompts "
                         "and references (least recently used first out; 0: no cache).", ENCODER_CACHE_BYTES,
                         minimum=0, maximum=MAX_ENCODER_CACHE_BYTES, format="int64")
    levers: EncoderLeversSpec = f("levers", "Capacity levers of the text encoder, off by default; profile fasth3 "
                                  "takes the lossless one (FP8 of its decoder is dit.levers.fp8).",
                                  factory=EncoderLeversSpec)

    @property
    def gpus(self) -> int:
        return self.tensor_parallel


@dataclass(frozen=True)
class DitRolloutSpec:
    max_surge: int = f("maxSurge", "Extra DiT gangs (replicas of several pods, one per node) a pod template change "
                       "starts before an old gang rolls, as LeaderWorkerSet's rolloutStrategy.rollingUpdateConfiguration"
                       ".maxSurge: with 1, every old gang keeps serving until the extra gang runs the new template whole "
                       "and Ready, then the old gangs roll one at a time and the extra one goes. Where the extra gang "
                       "cannot be placed (its pods are unschedulable, or it is not whole within its pods' startup "
                       "allowance) the gangs roll in place, one at a time, as with 0. 0 never asks for spare GPUs. "
                       "Single-pod replicas ignore it (their Deployment rolls one pod at a time).", 1,
                       minimum=0, maximum=1)


# One entry of dit.loras (a list of objects: the codec passes it through; `validate` and the CRD check each entry).
LORA_STEPS_RANGE = (2, 1000)
LORA_ITEM_SCHEMA = {
    "type": "object", "required": ["name", "path", "sha256"],
    "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN, "maxLength": 63,
                 "description": "What a request's lora names (lower-case letters, digits, '.', '_', '-')."},
        "path": {"type": "string", "minLength": 2, "maxLength": 1024, "pattern": "^/",
                 "description": "The LoRA file (diffusers / PEFT LoRA safetensors for the transformer), inside "
                                "model.mountPath when model.volume is set."},
        "sha256": {"type": "string", "pattern": SHA256_PATTERN,
                   "description": "Lower-case hex sha256 of the file; the DiT refuses a file that does not match."},
        "steps": {"type": "integer", "minimum": LORA_STEPS_RANGE[0], "maximum": LORA_STEPS_RANGE[1],
                  "description": "A few-step (Turbo) adapter: the sigma grid points it was distilled for (N -> N-1 "
                                 "steps); a request naming it runs them."},
    },
}


@dataclass(frozen=True)
class DitSpec:
    ulysses: int = f("ulysses", "Ulysses (head-split) sequence-parallel degree of the DiT; divides its "
                     f"{DIT_HEADS} heads.", 1, minimum=1, maximum=DIT_HEADS)
    ring: int = f("ring", "Ring-attention sequence-parallel degree of the DiT (any; GPUs per DiT replica = ulysses x "
                  "ring).", 1, minimum=1, maximum=MAX_REPLICA_GPUS)
    replicas: Optional[int] = f("replicas", "DiT replicas (disaggregated placement only; default spec.replicas, "
                                "which the /scale subresource sets: set here, the DiT count is no longer scalable "
                                "through /scale).", None,
                                minimum=0, maximum=1024)
    autoscaling: Optional[AutoscalingSpec] = f("autoscaling", AUTOSCALING_DOC, None)
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of a DiT pod (colocated: of the "
                                  "engine pod that runs every stage); the GPU count is set from ulysses x ring.", None, **RESOURCES_SCHEMA)
    node_selector: Optional[dict] = f("nodeSelector", "Replaces spec.nodeSelector for this stage.", None)
    tolerations: Optional[list] = f("tolerations", "Replaces spec.tolerations for this stage.", None)
    levers: DitLeversSpec = f("levers", "Capacity and speed levers of the DiT, every one off by default; profile "
                              "fasth3 (and the fasth3 pool, which runs the ones set here) takes the lossless ones.",
                              factory=DitLeversSpec)
    rollout: DitRolloutSpec = f("rollout", "How a pod template change rolls the DiT's multi-node replicas (also "
                                "the colocated engine's and the FastH3 pool's).", factory=DitRolloutSpec)
    loras: Optional[list] = f("loras", "Per-request LoRA adapters (profile base): a request's lora names one, "
                              "applied to that request only; the DiT loads each once, checked against its sha256.",
                              None, items=LORA_ITEM_SCHEMA, maxItems=64,
                              **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    lora_cache_bytes: int = f("loraCacheBytes", "Bytes of LoRA factors each DiT keeps on its device (least recently "
                              "used dropped first); an adapter larger than this is refused.", LORA_CACHE_BYTES,
                              minimum=1 << 20, maximum=1 << 40, format="int64")

    def lora_entries(self) -> tuple[LoraEntry, ...]:
        return tuple(LoraEntry(x["name"], x["path"], x["sha256"], x.get("steps")) for x in self.loras or ())

    @property
    def sp(self) -> int:
        """The sequence-parallel group size: one GPU (and one rank) per member."""
        return self.ulysses * self.ring


@dataclass(frozen=True)
class FastH3PoolSpec:
    adapter: AdapterSpec = f("adapter", "The FastH3 4-step adapter this pool loads (path inside model.mountPath, and "
                             "its sha256, required).")
    ulysses: int = f("ulysses", "Ulysses degree of the FastH3 DiT (as dit.ulysses).", 1, minimum=1, maximum=DIT_HEADS)
    ring: int = f("ring", "Ring degree of the FastH3 DiT (GPUs per FastH3 replica = ulysses x ring).", 1, minimum=1,
                  maximum=MAX_REPLICA_GPUS)
    replicas: int = f("replicas", "FastH3 DiT replicas.", 1, minimum=0, maximum=1024)
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of a FastH3 DiT pod; the GPU count is "
                                  "set from ulysses x ring.", None, **RESOURCES_SCHEMA)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


@dataclass(frozen=True)
class VaeSpec:
    patch_parallel: int = f("patchParallel", "Patch-parallel degree of the VAE decode (tiles over ranks): 1 or "
                            "the whole DiT group (dit.ulysses x dit.ring).", 1, minimum=1, maximum=MAX_REPLICA_GPUS)
    replicas: Optional[int] = f("replicas", "VAE replicas (disaggregated placement only; default 1).", None,
                                minimum=0, maximum=1024)
    autoscaling: Optional[AutoscalingSpec] = f("autoscaling", AUTOSCALING_DOC, None)
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of a VAE pod; the GPU count is "
                                  "set from patchParallel.", None, **RESOURCES_SCHEMA)
    node_selector: Optional[dict] = f("nodeSelector", "Replaces spec.nodeSelector for this stage.", None)
    tolerations: Optional[list] = f("tolerations", "Replaces spec.tolerations for this stage.", None)
    levers: VaeLeversSpec = f("levers", "Capacity levers of the VAEs, off by default (lossless: profile fasth3 "
                              "takes them).", factory=VaeLeversSpec)

    @property
    def gpus(self) -> int:
        return self.patch_parallel


@dataclass(frozen=True)
class MuxerSpec:
    replicas: Optional[int] = f("replicas", "Muxer replicas (disaggregated placement only; default 1).", None,
                                minimum=0, maximum=1024)
    autoscaling: Optional[AutoscalingSpec] = f("autoscaling", AUTOSCALING_DOC, None)
    workers: int = f("workers", "H.264 encoder threads per muxer (`h3serve serve --mux-threads`; colocated: per "
                     "replica pod). Default 16, as `h3serve serve`: the 10 s clip's tail was measured there.", 16,
                     minimum=1, maximum=256)
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of a muxer pod (CPU only).", None,
                                  **RESOURCES_SCHEMA)
    node_selector: Optional[dict] = f("nodeSelector", "Node labels the muxer pods require (CPU only: "
                                      "spec.nodeSelector, meant for GPU pods, does not apply).", None)
    tolerations: Optional[list] = f("tolerations", "Tolerations of the muxer pods (CPU only: spec.tolerations, "
                                    "meant for GPU nodes, does not apply).", None)


@dataclass(frozen=True)
class IngressFromSpec:
    namespaces: Optional[list] = f("namespaces", "Namespaces (by name) whose pods may reach the front door's gRPC and "
                                   "HTTP ports.", None, items={"type": "string", "maxLength": 63}, maxItems=64)
    cidrs: Optional[list] = f("cidrs", "IP ranges (CIDR, e.g. a load balancer's 10.0.0.0/16) that may reach the front "
                              "door's gRPC and HTTP ports.", None, items={"type": "string", "maxLength": 43},
                              maxItems=64)


_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


@dataclass(frozen=True)
class AuthSpec:
    api_keys_secret: Optional[str] = f("apiKeysSecret", "Secret whose key `keys` is the callers' API keys file (one "
                                       "`NAME sha256:HEX` line per key, docs/security.md); mounted read-only into the "
                                       "front door's pods and re-read within a second when the Secret changes.", None,
                                       maxLength=253, pattern=_DNS_SUBDOMAIN)
    disabled: bool = f("disabled", "No authentication (`--no-auth`): the front door serves anyone who can reach it.",
                       False)
    admin_callers: Optional[list] = f("adminCallers", "Caller names (of API keys) that may read every caller's usage "
                                      "(`--admin-callers`; GET /v1/usage).", None, maxItems=64,
                                      items={"type": "string", "minLength": 1, "maxLength": 128,
                                             "pattern": r"^[A-Za-z0-9][A-Za-z0-9._@-]*$"})


@dataclass(frozen=True)
class WebhooksSpec:
    allow: list = f("allow", "Where a job's webhook_url may point (`--webhook-allow`): host names (hooks.example.com, "
                    "*.example.com; their public addresses only) and networks (10.20.0.0/16; any address inside).",
                    minItems=1, maxItems=64, items={"type": "string", "minLength": 1, "maxLength": 253})
    secrets_secret: str = f("secretsSecret", "Secret whose key `webhook-secrets` is the callers' signing secrets "
                            "(one `NAME whsec_BASE64` line per caller, `*` for the rest; docs/api.md, Webhooks); "
                            "mounted read-only into the front door's pods and re-read when it changes.",
                            minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN)
    url: Optional[str] = f("url", "The webhook of jobs that name none.", None, maxLength=2048,
                           pattern=r"^https?://\S+$")
    attempts: int = f("attempts", "Deliveries tried per event (with a jittered, doubling backoff from 2 s).", 6,
                      minimum=1, maximum=20)


CALLER_ITEM = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "description": "An API key's NAME, or * for every caller without an entry.",
             "minLength": 1, "maxLength": 128, "pattern": r"^(\*|[A-Za-z0-9][A-Za-z0-9._@-]*)$"},
    "share": {"type": "number", "description": "Its weight in the fair queue (share 2 gets twice the DiT time of "
              "share 1 while both wait); default 1.", "minimum": 0.01, "maximum": 1000},
    "maxRunning": {"type": "integer", "description": "Its jobs running at once (more wait).", "minimum": 1,
                   "maximum": 10000},
    "maxQueued": {"type": "integer", "description": "Its jobs waiting (more are refused 429).", "minimum": 1,
                  "maximum": 100000},
    "videoSecondsPerHour": {"type": "number", "description": "Seconds of video admitted in any hour (more are "
                            "refused 429 with Retry-After).", "minimum": 1}}}


@dataclass(frozen=True)
class S3JobStoreSpec:
    bucket: str = f("bucket", "Bucket of the job records and finished MP4s (it must exist).", minLength=3,
                    maxLength=63, pattern=r"^[a-z0-9][-a-z0-9.]{1,61}[a-z0-9]$")
    credentials_secret: str = f("credentialsSecret", "Secret with the keys AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY (passed to the gateway as environment variables).",
                                minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN)
    prefix: str = f("prefix", "Key prefix inside the bucket (jobs/, videos/ and gateways/ go below it).", "h3serve",
                    minLength=1, maxLength=512, pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$")
    endpoint: Optional[str] = f("endpoint", "URL of the S3-compatible server (AWS_ENDPOINT_URL), e.g. "
                                "http://minio.storage.svc:9000; omitted: AWS S3.", None, maxLength=1024,
                                pattern=r"^https?://[^/?#\s]+/?$")
    region: Optional[str] = f("region", "Region of the bucket (AWS_REGION).", None, maxLength=64,
                              pattern=r"^[a-z0-9-]+$")


@dataclass(frozen=True)
class JobStoreSpec:
    s3: S3JobStoreSpec = f("s3", "An S3-compatible object store (`--job-store s3://BUCKET/PREFIX`).")


@dataclass(frozen=True)
class GatewaySpec:
    replicas: Optional[int] = f("replicas", "Gateway replicas (the gRPC + HTTP front door, CPU only; "
                                "disaggregated placement only; default 2 with a jobStore, else 1: more than one needs the "
                                "shared jobStore. A colocated replica runs its own gateway).",
                                None, minimum=0, maximum=1024)
    autoscaling: Optional[AutoscalingSpec] = f("autoscaling", AUTOSCALING_DOC, None)
    queue_size: int = f("queueSize", "Requests a gateway admits before it answers RESOURCE_EXHAUSTED.", 16,
                        minimum=1, maximum=100000)
    max_previews: int = f("maxPreviews", "Previews one request may ask for (its preview_every; `--max-previews`); 0: "
                          "previews are refused.", MAX_PREVIEWS, minimum=0, maximum=1000)
    service_type: str = f("serviceType", "Type of the gateway Service.", "ClusterIP",
                          enum=["ClusterIP", "NodePort", "LoadBalancer"])
    resources: Optional[dict] = f("resources", "CPU/memory requests and limits of a gateway pod.", None,
                                  **RESOURCES_SCHEMA)
    node_selector: Optional[dict] = f("nodeSelector", "Node labels the gateway pods require (CPU only: "
                                      "spec.nodeSelector, meant for GPU pods, does not apply).", None)
    tolerations: Optional[list] = f("tolerations", "Tolerations of the gateway pods (CPU only: spec.tolerations, "
                                    "meant for GPU nodes, does not apply).", None)
    ingress_from: Optional[IngressFromSpec] = f("ingressFrom", "Who may reach the front door's gRPC and HTTP ports "
                                                "(its NetworkPolicy): these namespaces and IP ranges, plus the pods of "
                                                "this H3Deployment. Omitted: anyone.", None)
    auth: AuthSpec = f("auth", "Who may call the front door: API keys from a Secret (apiKeysSecret) or explicitly "
                       "nobody checked (disabled: true); one of the two is required.", factory=AuthSpec)
    job_store: Optional[JobStoreSpec] = f("jobStore", "Where HTTP jobs and finished MP4s live, shared by every gateway "
                                          "(they survive restarts and rolling updates). Required for more than one "
                                          "gateway; omitted: one gateway keeps them in a temporary folder, lost when it "
                                          "restarts.", None)
    callers: Optional[list] = f("callers", "Per-caller share and limits of the fair queue (`--caller-limits`; "
                                "docs/api.md, Scheduling); callers not listed get the * entry, else share 1 and no "
                                "limits.", None, maxItems=1000, items=CALLER_ITEM)
    webhooks: Optional[WebhooksSpec] = f("webhooks", "Signed POSTs to a caller's URL when its job ends (a job's "
                                         "webhook_url, or url here). Omitted: webhook_url is refused.", None)


@dataclass(frozen=True)
class IssuerRefSpec:
    name: str = f("name", "The cert-manager Issuer or ClusterIssuer that signs the deployment's certificate.",
                  minLength=1, maxLength=253, pattern=_DNS_SUBDOMAIN)
    kind: str = f("kind", "Issuer (in this namespace) or ClusterIssuer.", "Issuer", enum=["Issuer", "ClusterIssuer"])
    group: str = f("group", "API group of the issuer.", "cert-manager.io", minLength=1, maxLength=253)


@dataclass(frozen=True)
class CertManagerSpec:
    issuer_ref: IssuerRefSpec = f("issuerRef", "Who signs the certificate (its ca.crt becomes the deployment's CA).")


@dataclass(frozen=True)
class TlsSpec:
    secret_name: str = f("secretName", "kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt, mounted read-only into "
                         "every pod: each server listens for TLS only, the stages require client certificates the CA "
                         "signed (mTLS), every channel verifies its peer. It must name the deployment's Service DNS "
                         "names and 127.0.0.1 (colocated stages talk over loopback).", minLength=1, maxLength=253,
                         pattern=_DNS_SUBDOMAIN)
    cert_manager: Optional[CertManagerSpec] = f("certManager", "Render a cert-manager Certificate that writes secretName "
                                                "(the Service DNS names and 127.0.0.1); omitted: you provide the "
                                                "Secret.", None)


@dataclass(frozen=True)
class MetricsSpec:
    monitoring_namespace: Optional[str] = f("monitoringNamespace", "Namespace of the Prometheus that scrapes the pods: "
                                            "the NetworkPolicies let it reach every pod's metrics ports.", None,
                                            maxLength=63, pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    service_monitor: bool = f("serviceMonitor", "Render a monitoring.coreos.com/v1 ServiceMonitor (the Prometheus "
                              "Operator's) over every metrics port, where the API server serves that API; where it "
                              "does not, a Warning Event NoServiceMonitor says it was skipped.", False)


@dataclass(frozen=True)
class H3DeploymentSpec:
    model: ModelSpec = f("model", "Where the weights are and how they are loaded.")
    image: str = f("image", "The h3serve image every pod runs.", minLength=1, maxLength=1024)
    profile: str = f("profile", "base: H3, 49 steps, every workflow; fasth3: the 4-step student (T2VA only, needs "
                     "model.adapter).", "base", enum=list(PROFILES))
    tasks: str = f("tasks", "The tasks served, a comma list of t2va, fl2va, ref2va (ref2va loads the DiT's second "
                   "partition, transformer_ref/, as large as the first; profile fasth3 serves t2va only).",
                   DEFAULT_TASKS, pattern=TASKS_PATTERN, maxLength=64)
    placement: str = f("placement", "colocated: every stage of a replica in one pod on the same GPUs; "
                       "disaggregated: one workload per stage.", "colocated", enum=list(PLACEMENTS))
    transport: str = f("transport", "How tensors move between stages: grpc (always works) or nixl (UCX: RDMA, "
                       "shared memory or TCP).", GRPC, enum=list(TRANSPORTS))
    replicas: int = f("replicas", "Replicas of the DiT pool, the one the /scale subresource (kubectl scale, an HPA "
                      "on the H3Deployment) sets: colocated, the engine replicas (each runs every stage); "
                      "disaggregated, the DiT replicas unless dit.replicas or dit.autoscaling sets them (the other "
                      "stages keep their own replicas).", 1, minimum=0, maximum=1024)
    gpus_per_node: int = f("gpusPerNode", "GPUs of one node. A stage (or colocated replica) that needs more is a "
                           "gang of pods, one per node.", 8, minimum=1, maximum=64)
    gpu_resource_name: str = f("gpuResourceName", "Extended resource that counts GPUs.", "nvidia.com/gpu",
                               minLength=1, maxLength=253)
    device: str = f("device", "cuda: the model stages run in bf16 on GPUs, each pod requesting its GPUs as "
                    "gpuResourceName; cpu: fp32 on the CPU and no GPU resources (a laptop or CI cluster with a "
                    "tiny checkpoint: examples/cpu-tiny.yaml).", "cuda", enum=list(DEVICES))
    encoder: EncoderSpec = f("encoder", "The text/image encoder stage.", factory=EncoderSpec)
    dit: DitSpec = f("dit", "The diffusion transformer stage.", factory=DitSpec)
    vae: VaeSpec = f("vae", "The video + audio decoder stage.", factory=VaeSpec)
    muxer: MuxerSpec = f("muxer", "The MP4 muxer stage (CPU).", factory=MuxerSpec)
    gateway: GatewaySpec = f("gateway", "The front door.", factory=GatewaySpec)
    fasth3: Optional[FastH3PoolSpec] = f("fasth3", "A FastH3 DiT pool beside the base one (profile base, "
                                         "disaggregated placement): its own workload dit-fasth3 with its adapter, "
                                         "degrees and replicas, sharing the encoder, VAE and muxer; the gateway "
                                         "routes a request to it by model.", None)
    image_pull_policy: str = f("imagePullPolicy", "Pull policy of every container.", "IfNotPresent",
                               enum=["Always", "IfNotPresent", "Never"])
    image_pull_secrets: Optional[list] = f("imagePullSecrets", "Names of Secrets to pull the image with.", None)
    node_selector: Optional[dict] = f("nodeSelector", "Node labels every GPU pod requires (a stage may replace it; "
                                      "the CPU-only gateway and muxer use only their own).", None)
    tolerations: Optional[list] = f("tolerations", "Tolerations of every GPU pod (a stage may replace them; the "
                                    "CPU-only gateway and muxer use only their own, so GPU taints keep them off GPU "
                                    "nodes).", None)
    priority_class_name: Optional[str] = f("priorityClassName", "PriorityClass of every pod.", None, maxLength=253)
    shm_size: str = f("shmSize", "Size of the in-memory /dev/shm of GPU pods (NCCL and NIXL buffers).", "16Gi",
                      pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$")
    metrics: MetricsSpec = f("metrics", "Prometheus scraping: every pod carries prometheus.io/scrape, port and path "
                             "annotations; stage processes serve /metrics on port 9400 plus their offset (encoder 9401, "
                             "dit 9402, vae 9403, muxer 9404), the gateway on its HTTP port.", factory=MetricsSpec)
    tls: Optional[TlsSpec] = f("tls", "TLS on the front door and mTLS between the stages, from a Secret. Omitted: "
                               "plaintext.", None)
    drain_seconds: int = f("drainSeconds", "How long a pod that is asked to stop keeps serving the requests it "
                           "admitted; the pod's termination grace period is this plus 30 s.", 900,
                           minimum=0, maximum=86400)

    # -- derived sizes ---------------------------------------------------------------------------------------
    def stage_gpus(self, stage: str) -> int:
        """GPUs (= ranks) of one replica of a stage; for colocated placement, the GPUs of one replica pod group."""
        if self.placement == "colocated":
            return 0 if stage == "muxer" else self.dit.sp
        return {"encoder": self.encoder.gpus, "dit": self.dit.sp, "vae": self.vae.gpus, "muxer": 0}[stage]

    def stage_replicas(self, stage: str) -> int:
        """Replicas of a stage; for an autoscaled one, its fewest (the autoscaler sets the live count)."""
        if self.placement == "colocated":
            return self.replicas
        if getattr(self, stage).autoscaling is not None:
            return getattr(self, stage).autoscaling.min_replicas
        r = getattr(self, stage).replicas
        if r is None:  # the DiT pool defaults to spec.replicas (the /scale subresource); gateways share their jobs
            # only through a job store: 2 with one, else a single gateway
            return {"dit": self.replicas, "gateway": 2 if self.gateway.job_store is not None else 1}.get(stage, 1)
        return r

    def pods_per_replica(self, gpus: int) -> int:
        """1 when a replica's GPUs fit one node, else the gang size (one pod per node)."""
        return max(1, math.ceil(gpus / self.gpus_per_node))

    # -- (de)serialisation --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "H3DeploymentSpec":
        """Parse a custom resource's `.spec` (camelCase). Raises SpecError for unknown fields or wrong types."""
        issues: list[tuple[str, str]] = []
        obj = parse(cls, d, "spec", issues)
        if issues:
            raise SpecError(issues)
        return obj

    def to_dict(self) -> dict:
        """camelCase dict with defaults filled in and unset optionals left out (round-trips through from_dict)."""
        return dump(self)


# ---- the service config the operator renders into each deployment's ConfigMap -----------------------------------

@dataclass(frozen=True)
class ServiceConfig:
    """What every h3serve process of one H3Deployment reads from the file named by `$H3SERVE_CONFIG` (JSON, which
    is YAML); each stage takes its slice with `StageConfig.from_service_config`."""

    name: str
    namespace: str
    spec: H3DeploymentSpec
    endpoints: dict  # stage -> gRPC target of the stage (disaggregated: dns:/// of its headless Service)
    dtype: str       # the model stages' engine dtype and device (the operator's choice for GPU pods)
    device: str

    def to_dict(self) -> dict:
        return {
            "apiVersion": API_VERSION, "kind": "ServiceConfig", "name": self.name, "namespace": self.namespace,
            "ports": {"grpc": GRPC_PORT, "http": HTTP_PORT, "dist": DIST_PORT},
            "health": {"service": HEALTH_SERVICE},
            "engine": {"dtype": self.dtype, "device": self.device},
            "endpoints": dict(self.endpoints), "spec": self.spec.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ServiceConfig":
        return cls(name=d["name"], namespace=d["namespace"], spec=H3DeploymentSpec.from_dict(d["spec"]),
                   endpoints=dict(d.get("endpoints", {})), dtype=d["engine"]["dtype"], device=d["engine"]["device"])


# ---- what the operator's administrator allows (chart values -> operator flags) --------------------------------

# Volume kinds a model.volume may use unless the administrator says otherwise: read-only weight sources that grant
# no access to the node (hostPath) or to credentials (secret, projected service account tokens).
DEFAULT_VOLUME_KINDS = ("persistentVolumeClaim", "csi", "ephemeral", "image")


# Taint and label keys of control-plane nodes: no H3Deployment pod tolerates or selects them unless allowed.
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# PriorityClasses Kubernetes reserves for the node's and cluster's own pods (they preempt everything else).
SYSTEM_PRIORITY_CLASSES = ("system-node-critical", "system-cluster-critical")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
_BINARY = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}
_DECIMAL = {"k": 10 ** 3, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}
_BYTES_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E)?$")


def quantity_bytes(q) -> int | None:
    """Bytes of a Kubernetes storage quantity such as 200Gi or 1T; None when it is not one."""
    m = _BYTES_RE.match(str(q).strip())
    if not m:
        return None
    return int(float(m.group(1)) * (_BINARY.get(m.group(2)) or _DECIMAL.get(m.group(2)) or 1))


@dataclass(frozen=True)
class AdmissionPolicy:
    """Limits the custom resource cannot widen: a user who may create H3Deployments gets no more than this.

    Built from the chart's `policy` values (`from_values`, the same camelCase keys); the defaults are the chart's.
    """

    volume_kinds: tuple[str, ...] = DEFAULT_VOLUME_KINDS
    # Image references allowed, for spec.image and image volumes: "repo" allows repo:tag and repo@digest; an entry
    # ending in "/" allows everything below it; "*" allows any image. Empty: any image (the chart always sets one).
    images: tuple[str, ...] = ()
    # CSI drivers a csi or ephemeral volume may use; "*" any. Empty: none (a driver can expose anything on a node).
    csi_drivers: tuple[str, ...] = ()
    # The largest ephemeral volume (a PVC created per pod) an H3Deployment may ask for.
    max_volume_size: str = "1Ti"
    # Secrets an H3Deployment may name (API keys, S3 credentials, TLS, image pull), as glob patterns; "*" any.
    secret_names: tuple[str, ...] = ("*",)
    # PriorityClasses allowed; empty: any but the system ones.
    priority_classes: tuple[str, ...] = ()
    # Node label / taint keys no nodeSelector or toleration may name (nor may a toleration with no key, which
    # tolerates every taint).
    denied_node_keys: tuple[str, ...] = CONTROL_PLANE_KEYS
    service_types: tuple[str, ...] = SERVICE_TYPES
    # A NodePort or LoadBalancer front door with gateway.auth.disabled serves anyone who reaches the node or the
    # load balancer: refused unless the administrator allows it.
    allow_unauthenticated_external: bool = False

    _KEYS = {"allowedVolumeKinds": "volume_kinds", "allowedImages": "images", "allowedCsiDrivers": "csi_drivers",
             "maxVolumeSize": "max_volume_size", "allowedSecretNames": "secret_names",
             "allowedPriorityClasses": "priority_classes", "deniedNodeKeys": "denied_node_keys",
             "allowedServiceTypes": "service_types", "allowUnauthenticatedExternal": "allow_unauthenticated_external"}

    @classmethod
    def from_values(cls, values: dict) -> "AdmissionPolicy":
        """The chart's `policy` values (camelCase, as in values.yaml); a key left out keeps its default. Raises
        H3Error naming an unknown key or a bad value."""
        unknown = sorted(set(values) - set(cls._KEYS))
        if unknown:
            raise H3Error(f"policy: unknown key(s) {', '.join(unknown)} (known: {', '.join(cls._KEYS)})")
        kw = {}
        for key, attr in cls._KEYS.items():
            if key not in values or values[key] is None:
                continue
            v = values[key]
            if attr == "allow_unauthenticated_external":
                if not isinstance(v, bool):
                    raise H3Error(f"policy.{key} must be true or false, not {v!r}")
            elif attr == "max_volume_size":
                if quantity_bytes(v) is None:
                    raise H3Error(f"policy.{key} {v!r} is not a size such as 500Gi or 2Ti")
                v = str(v)
            else:
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise H3Error(f"policy.{key} must be a list of strings, not {v!r}")
                v = tuple(x.strip() for x in v if x.strip())
            kw[attr] = v
        bad = sorted(set(kw.get("service_types", ())) - set(SERVICE_TYPES))
        if bad:
            raise H3Error(f"policy.allowedServiceTypes: {', '.join(bad)} is not a Service type "
                          f"({', '.join(SERVICE_TYPES)})")
        return cls(**kw)

    def image_allowed(self, image: str) -> bool:
        if not self.images or "*" in self.images:
            return True
        return any(image == p or (p.endswith("/") and image.startswith(p)) or
                   image.startswith(p + ":") or image.startswith(p + "@") for p in self.images)

    def secret_allowed(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.secret_names)


def _ask_admin(key: str) -> str:
    return f"an administrator can change the chart's policy.{key}"


def _placements(s: H3DeploymentSpec):
    """(field, nodeSelector, tolerations) of every place a pod's placement is written."""
    yield "spec", s.node_selector, s.tolerations
    for st in (*PIPELINE_STAGES, "gateway"):
        yield f"spec.{st}", getattr(s, st).node_selector, getattr(s, st).tolerations


def policy_issues(spec: H3DeploymentSpec, policy: AdmissionPolicy) -> list[tuple[str, str]]:
    """What `policy` forbids in `spec`, as (field, message)."""
    issues = []
    volume = spec.model.volume or {}
    for kind in sorted(volume):
        if kind not in policy.volume_kinds:
            issues.append(("spec.model.volume", f"model.volume kind {kind} is not allowed by this operator (allowed: "
                                                f"{', '.join(sorted(policy.volume_kinds)) or 'none'}); "
                                                + _ask_admin("allowedVolumeKinds")))
    src = volume.get("csi") if isinstance(volume.get("csi"), dict) else None
    claim = ((volume.get("ephemeral") or {}).get("volumeClaimTemplate") or {}).get("spec") or {} \
        if isinstance(volume.get("ephemeral"), dict) else {}
    driver = (src or {}).get("driver")
    if src is not None and "*" not in policy.csi_drivers and driver not in policy.csi_drivers:
        issues.append(("spec.model.volume.csi.driver", f"CSI driver {driver!r} is not allowed by this operator "
                                                       f"(allowed: {', '.join(policy.csi_drivers) or 'none'}); "
                                                       + _ask_admin("allowedCsiDrivers")))
    size = ((claim.get("resources") or {}).get("requests") or {}).get("storage") if isinstance(claim, dict) else None
    if size is not None and (quantity_bytes(size) is None or
                             quantity_bytes(size) > quantity_bytes(policy.max_volume_size)):
        issues.append(("spec.model.volume.ephemeral.volumeClaimTemplate.spec.resources.requests.storage",
                       f"an ephemeral volume of {size} is more than this operator allows "
                       f"({policy.max_volume_size}); " + _ask_admin("maxVolumeSize")))
    ref = (volume.get("image") or {}).get("reference") if isinstance(volume.get("image"), dict) else None
    for field, image in (("spec.image", spec.image), ("spec.model.volume.image.reference", ref)):
        if image is not None and not policy.image_allowed(str(image)):
            issues.append((field, f"image {image!r} is not allowed by this operator (allowed: "
                                  f"{', '.join(policy.images)}); " + _ask_admin("allowedImages")))
    secrets = [("spec.gateway.auth.apiKeysSecret", spec.gateway.auth.api_keys_secret),
               ("spec.tls.secretName", spec.tls.secret_name if spec.tls else None),
               ("spec.gateway.jobStore.s3.credentialsSecret",
                spec.gateway.job_store.s3.credentials_secret if spec.gateway.job_store else None),
               ("spec.gateway.webhooks.secretsSecret",
                spec.gateway.webhooks.secrets_secret if spec.gateway.webhooks else None)]
    secrets += [(f"spec.imagePullSecrets[{i}]", n if isinstance(n, str) else (n or {}).get("name"))
                for i, n in enumerate(spec.image_pull_secrets or [])]
    for field, name in secrets:
        if name is not None and not policy.secret_allowed(str(name)):
            issues.append((field, f"Secret {name!r} is not one this operator may use (allowed: "
                                  f"{', '.join(policy.secret_names) or 'none'}); " + _ask_admin("allowedSecretNames")))
    pc = spec.priority_class_name
    if pc is not None and (pc not in policy.priority_classes if policy.priority_classes
                           else pc in SYSTEM_PRIORITY_CLASSES):
        issues.append(("spec.priorityClassName", f"priorityClassName {pc!r} is not allowed by this operator (allowed: "
                                                 + (", ".join(policy.priority_classes) if policy.priority_classes else
                                                    f"any but {', '.join(SYSTEM_PRIORITY_CLASSES)}")
                                                 + "); " + _ask_admin("allowedPriorityClasses")))
    denied = set(policy.denied_node_keys)
    for field, selector, tolerations in _placements(spec):
        for key in sorted(set(selector or {}) & denied):
            issues.append((f"{field}.nodeSelector", f"nodeSelector {key} places pods on nodes this operator keeps "
                                                    f"them off; " + _ask_admin("deniedNodeKeys")))
        for i, t in enumerate(tolerations or []):
            key = (t or {}).get("key") if isinstance(t, dict) else None
            if key in denied or (not key and denied):
                what = f"the taint {key}" if key else "every taint (a toleration without a key)"
                issues.append((f"{field}.tolerations[{i}]", f"a toleration of {what} places pods on nodes this "
                                                            f"operator keeps them off; " + _ask_admin("deniedNodeKeys")))
    st = spec.gateway.service_type
    if st not in policy.service_types:
        issues.append(("spec.gateway.serviceType", f"gateway.serviceType {st} is not allowed by this operator "
                                                   f"(allowed: {', '.join(policy.service_types) or 'none'}); "
                                                   + _ask_admin("allowedServiceTypes")))
    elif st != "ClusterIP" and spec.gateway.auth.disabled and not policy.allow_unauthenticated_external:
        issues.append(("spec.gateway.auth.disabled", f"a {st} front door with auth disabled serves anyone who reaches "
                                                     f"it from outside the cluster: set gateway.auth.apiKeysSecret or "
                                                     f"serviceType ClusterIP; "
                                                     + _ask_admin("allowUnauthenticatedExternal")))
    return issues


# ---- validation --------------------------------------------------------------------------------------------------

def validate(spec: H3DeploymentSpec, name: str | None = None) -> list[tuple[str, str]]:
    """Every problem with a spec as (field, message); [] when valid.

    The cross-field rules (`h3serve.config.rules.RULES`) are also enforced by the CRD (CEL), so the API server
    rejects them at `kubectl apply`; the rest only the operator checks, and reports as SpecValid=False.
    """
    doc = spec.to_dict()  # what the CEL rules see: defaults filled in, unset optionals absent
    issues = [(f"spec.{r.field}", r.format(doc)) for r in RULES if not r.holds(doc)]
    if name is not None and (len(name) > NAME_MAX or not _NAME_RE.match(name)):
        issues.append(("metadata.name", f"name {name!r} must be at most {NAME_MAX} characters of a-z, 0-9 and '-', "
                                        f"start with a letter and end with a letter or digit"))
    if name is not None and spec.fasth3 is not None and spec.pods_per_replica(spec.fasth3.sp) > 1:
        longest = f"{name}-{FASTH3_DIT}-{max(spec.fasth3.replicas - 1, 0)}"  # the pool's last gang StatefulSet
        if len(longest) > STATEFULSET_NAME_MAX:
            issues.append(("metadata.name", f"name {name!r} is too long for the fasth3 pool's multi-node replicas: "
                                            f"their StatefulSet {longest} has {len(longest)} characters, at most "
                                            f"{STATEFULSET_NAME_MAX}; use a name of at most "
                                            f"{STATEFULSET_NAME_MAX - len(longest) + len(name)} characters"))
    issues += _operator_only_checks(spec)
    return issues


def _operator_only_checks(s: H3DeploymentSpec) -> list[tuple[str, str]]:
    issues = []
    try:
        parse_caller_limits(callers_json(s.gateway.callers))
    except (H3Error, AttributeError, TypeError) as exc:   # an item that is not an object
        issues.append(("spec.gateway.callers", f"gateway.callers: {exc}"))
    if s.model.volume is not None and len(s.model.volume) != 1:
        issues.append(("spec.model.volume", f"model.volume must name exactly one volume source (e.g. "
                                            f"persistentVolumeClaim), found {sorted(s.model.volume) or 'none'}"))
    for st in (*PIPELINE_STAGES, "gateway", *(["fasth3"] if s.fasth3 is not None else [])):
        gpus = s.stage_gpus(st) if st not in ("gateway", "fasth3") else 0
        if st != "fasth3" and getattr(s, st).autoscaling is not None and s.pods_per_replica(gpus) > 1:
            issues.append((f"spec.{st}.autoscaling", f"{st}.autoscaling needs a {st} replica on one node ({st} needs "
                                                     f"{gpus} GPUs, gpusPerNode={s.gpus_per_node}): a multi-node gang "
                                                     f"scales by {st}.replicas"))
        res = getattr(s, st).resources or {}
        for kind in ("requests", "limits"):
            if s.gpu_resource_name in (res.get(kind) or {}):
                issues.append((f"spec.{st}.resources.{kind}", f"remove {s.gpu_resource_name} from {st}.resources."
                               f"{kind}: the operator sets the GPU count from the stage's parallel sizes"))
            for k, q in (res.get(kind) or {}).items():
                if not _QUANTITY_RE.match(str(q)):
                    issues.append((f"spec.{st}.resources.{kind}.{k}", f"{q!r} is not a Kubernetes quantity "
                                                                      f"(e.g. 4, 500m, 64Gi)"))
    if s.model.adapter is not None and s.model.adapter.sha256 is not None and not _SHA256_RE.match(s.model.adapter.sha256):
        issues.append(("spec.model.adapter.sha256", "model.adapter.sha256 must be 64 lower-case hex digits"))
    issues += _lora_issues(s.dit.loras)
    if not _SIZE_RE.match(s.shm_size):
        issues.append(("spec.shmSize", f"shmSize {s.shm_size!r} must be a size such as 16Gi"))
    src = s.gateway.ingress_from
    for i, cidr in enumerate((src.cidrs or []) if src else []):
        try:
            ipaddress.ip_network(str(cidr), strict=False)
        except ValueError:
            issues.append((f"spec.gateway.ingressFrom.cidrs[{i}]", f"{cidr!r} is not an IP range such as "
                                                                  f"10.0.0.0/16"))
    for i, ns in enumerate((src.namespaces or []) if src else []):
        if not isinstance(ns, str) or not _DNS_LABEL_RE.match(ns):
            issues.append((f"spec.gateway.ingressFrom.namespaces[{i}]", f"{ns!r} is not a namespace name"))
    return issues


def _lora_issues(items) -> list[tuple[str, str]]:
    """dit.loras entry by entry, by the CRD's item schema (the API server checks the same)."""
    issues: list[tuple[str, str]] = []
    props, names = LORA_ITEM_SCHEMA["properties"], set()
    for i, item in enumerate(items or ()):
        where = f"spec.dit.loras[{i}]"
        if not isinstance(item, dict):
            issues.append((where, f"dit.loras[{i}] must be a mapping of name, path, sha256 and optional steps"))
            continue
        for key in item:
            if key not in props:
                issues.append((f"{where}.{key}", f"unknown field dit.loras[{i}].{key}; known: {', '.join(props)}"))
        for key in LORA_ITEM_SCHEMA["required"]:
            v = item.get(key)
            if not isinstance(v, str) or not re.match(props[key].get("pattern", ""), v) or \
                    len(v) < props[key].get("minLength", 0) or len(v) > props[key].get("maxLength", 1 << 10):
                issues.append((f"{where}.{key}", f"dit.loras[{i}].{key}={v!r}: {props[key]['description']}"))
        steps = item.get("steps")
        lo, hi = LORA_STEPS_RANGE
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not lo <= steps <= hi):
            issues.append((f"{where}.steps", f"dit.loras[{i}].steps={steps!r} must be an integer in [{lo}, {hi}]"))
        if item.get("name") in names:
            issues.append((f"{where}.name", f"dit.loras names {item['name']!r} twice"))
        names.add(item.get("name"))
    return issues


def parse_and_validate(d: dict, name: str | None = None) -> H3DeploymentSpec:
    """from_dict + validate; raises SpecError listing every problem."""
    spec = H3DeploymentSpec.from_dict(d)
    issues = validate(spec, name)
    if issues:
        raise SpecError(issues)
    return spec
