"""`StageConfig`: every knob of every stage process, one dataclass (a stage reads the ones it uses).

A process the operator starts finds its deployment's `ServiceConfig` at the path in `$H3SERVE_CONFIG`;
`StageConfig.from_service_config` takes a stage's slice of it (`h3serve serve` on a laptop uses argv alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from h3serve.config.levers import Levers
from h3serve.config.spec import ServiceConfig
from h3serve.config.vocab import (
    DEFAULT_DTYPE,
    DEFAULT_TASKS,
    ENCODER_CACHE_BYTES,
    FASTH3_DIT,
    GRPC,
    MODEL_STAGES,
    PIPELINE_STAGES,
    PORT_OFFSETS,
    PROFILE_TASKS,
    TASKS,
)
from h3serve.errors import H3Error

CONFIG_ENV = "H3SERVE_CONFIG"  # path of the mounted ServiceConfig
STAGE_CONFIG_ENV = "H3SERVE_STAGE_CONFIG"  # path of a launcher child's StageConfig (runtime/launcher.py)
COMPONENT_ENV = "H3SERVE_COMPONENT"  # the pod's component; dit-fasth3: a DiT process of the FastH3 pool
API_KEYS_ENV = "H3SERVE_API_KEYS_FILE"  # the gateway's API keys file (the default of --api-keys-file)
API_KEY_ENV = "H3SERVE_API_KEY"         # a client's API key (the default of the SDK's and the CLI's key)
# Where the operator mounts Secrets into the pods (read-only; a Secret volume swaps its files atomically on change).
API_KEYS_DIR = "/etc/h3serve-keys"       # spec.gateway.auth.apiKeysSecret
API_KEYS_KEY = "keys"                    # the Secret's key that holds the API keys file
API_KEYS_PATH = f"{API_KEYS_DIR}/{API_KEYS_KEY}"
TLS_DIR = "/etc/h3serve-tls"             # spec.tls.secretName: a kubernetes.io/tls Secret (+ ca.crt)
TLS_FILES = {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"}  # StageConfig field -> Secret key


@dataclass
class StageConfig:
    """Every knob of every stage (a stage reads the ones it uses; see docs/services.md)."""

    stage: str = "gateway"
    checkpoint: str | None = None
    profile: str = "base"
    adapter: str | None = None
    adapter_sha256: str | None = None
    checkpoint_manifest_sha256: str | None = None   # pin: the checkpoint's files are checked before loading
    dtype: str = DEFAULT_DTYPE
    device: str | None = None
    threads: int = 0                 # torch intra-op threads of the engine (0: torch's default)
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None     # address peers should use for this process (default host:port)
    grace_s: float = 30.0
    rpc_workers: int = 32
    tls_cert: str | None = None      # this process's certificate (PEM): gRPC and HTTPS servers, mTLS client
    tls_key: str | None = None
    tls_ca: str | None = None        # the deployment's CA: stage servers require client certs it signed (mTLS)
    tls_peer_name: str | None = None  # the name a peer's certificate is checked for (peers are dialled by pod IP)
    peers: str | None = None         # what a stage may dial when a request names an address (runtime/tls.py)
    warmup: bool = True
    # gateway
    encoder: str | None = None
    dit: str | None = None
    vae: str | None = None
    muxer: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None     # None: no HTTP API
    http_max_connections: int = 1024   # HTTP connections held at once (more: 503 and closed; frontdoor.py)
    http_header_timeout_s: float = 10.0   # a request's head must arrive within this (408 and closed)
    http_body_timeout_s: float = 30.0     # a request's body must send some bytes this often (else closed)
    decode_workers: int = 2          # threads that decode uploads (their own pool, not the API's; uploads.py)
    decode_per_caller: int = 1       # ... of which one caller may use at most this many at once
    queue_size: int = 8
    max_inflight: int = 1
    request_timeout_s: float = 3600.0
    jobs_dir: str | None = None      # HTTP jobs on local disk (and the spool of an object store)
    job_store: str | None = None     # s3://BUCKET/PREFIX: HTTP jobs in an object store every replica shares
    job_ttl_s: float = 3600.0
    max_jobs: int = 1000
    max_sync_bytes: int = 64 << 20
    api_keys_file: str | None = None  # callers' hashed bearer keys (services/gateway/auth.py); None: no auth
    no_auth: bool = False             # allow a gateway without keys on a non-loopback address
    no_peer_auth: bool = False        # allow a stage without mTLS on a non-loopback address (a network fences it)
    transport: str = GRPC
    model_name: str | None = None
    fasth3_dit: str | None = None    # gateway of a base deployment: a FastH3 DiT pool, routed to by `model`
    fasth3_adapter: str | None = None         # `h3serve serve` of a base deployment: also run that pool here
    fasth3_adapter_sha256: str | None = None
    # parallel degrees of the model stages (encoder TP, DiT Ulysses x Ring, VAE patch parallel): config/parallel.py
    encoder_tp: int = 1
    ulysses: int = 1
    ring: int = 1
    vae_pp: int = 1
    tasks: str = DEFAULT_TASKS       # comma list the DiT loads partitions for and the gateway admits
    # encoder: bytes of encodings kept for repeated prompts / references (0: no cache)
    encoder_cache_bytes: int = ENCODER_CACHE_BYTES
    # DiT capacity / speed levers (config/levers.py), all off by default
    dit_resident_blocks: int | None = None
    dit_offload_mode: str = "local"
    fp8: bool = False
    fp8_attention: bool = False
    encoder_resident_layers: int | None = None  # encoder: text decoder layers on the device (None: all)
    vae_staged: bool = False                    # vae: both VAEs in pinned host memory between requests
    # vae
    frame_format: str = "yuv420p"    # what the VAE sends the muxer: yuv420p planes (1.5 B/px) or rgb24 (3 B/px)
    # muxer
    mux_threads: int = 16  # x264 frame threads (fixed: the MP4 bytes depend on it)
    crf: int = 18
    preset: str = "veryfast"
    session_ttl_s: float = 600.0     # the TTL of a session that asks for none
    max_session_ttl_s: float = 7200.0   # the largest it may ask for (the gateway asks its deadline + a margin)
    max_sessions: int = 64           # sessions a muxer holds at once (open, pushing or unfetched)
    max_sessions_per_peer: int = 16  # ... of which one caller (by its address) may hold at most this many
    tmp_dir: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_service_config(cls, service_config: dict, stage: str) -> "StageConfig":
        """The StageConfig of `stage` in a deployment rendered as `service_config` (`ServiceConfig.to_dict()`)."""
        return cls(**service_config_values(service_config, stage))

    def tasks_for(self, profile: str | None = None) -> tuple[str, ...]:
        """The tasks served for `profile` (default: this config's): --tasks within what the profile can run."""
        wanted = [t.strip().lower() for t in self.tasks.split(",") if t.strip()]
        bad = [t for t in wanted if t not in TASKS]
        if bad or not wanted:
            raise H3Error(f"--tasks={self.tasks!r} is invalid: a comma list of {', '.join(TASKS)}")
        allowed = PROFILE_TASKS.get(profile or self.profile, ("t2va",))
        return tuple(t for t in TASKS if t in wanted and t in allowed) or ("t2va",)

    @property
    def levers(self) -> Levers:
        return Levers(self.dit_resident_blocks, self.dit_offload_mode, bool(self.fp8), bool(self.fp8_attention),
                      self.encoder_resident_layers, bool(self.vae_staged))

    @property
    def address(self) -> str:
        """The address peers use: --advertise, else host:port (loopback when bound to every interface)."""
        return self.advertise or f"{connect_host(self.host)}:{self.port}"


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def tls_peer_name(name: str, namespace: str) -> str:
    """The name every stage's certificate carries and every channel to a peer checks: disaggregated stages dial
    each other by pod IP, which no shared certificate can name. Never resolved, only matched."""
    return f"{name}.{namespace}.h3serve-peer"


def service_config_values(service_config: dict, stage: str) -> dict[str, Any]:
    """The knobs of `stage` that a ServiceConfig sets (and only those: argv may fill the rest).

    A colocated replica pod runs every stage (`--stages all`): each of its processes gets the model knobs, and the
    stages listen on the pod's gRPC port + their offset. Disaggregated, a pod runs one stage on the gRPC port.
    `stage` FASTH3_DIT: a DiT process of the spec's FastH3 pool (profile fasth3, its adapter and degrees).
    """
    if stage == FASTH3_DIT:
        out = service_config_values(service_config, "dit")
        pool = ServiceConfig.from_dict(service_config).spec.fasth3
        if pool is None:
            raise ValueError(f"{FASTH3_DIT}: this ServiceConfig declares no fasth3 pool")
        # the levers are base-only; vae_pp belongs to the VAE (1: it must not be checked against this pool's group)
        out.update(profile="fasth3", adapter=pool.adapter.path, adapter_sha256=pool.adapter.sha256,
                   ulysses=pool.ulysses, ring=pool.ring, vae_pp=1, dit_resident_blocks=None,
                   dit_offload_mode="local", fp8=False, fp8_attention=False)
        return out
    sc = ServiceConfig.from_dict(service_config)
    spec, grpc_port = sc.spec, int(service_config["ports"]["grpc"])
    colocated = spec.placement == "colocated"
    port = grpc_port + PORT_OFFSETS[stage] if colocated else grpc_port
    out: dict[str, Any] = {"stage": stage, "host": "0.0.0.0", "port": port, "profile": spec.profile,
                           "grace_s": float(spec.drain_seconds)}
    if colocated or stage in MODEL_STAGES:
        out.update(checkpoint=spec.model.path, dtype=sc.dtype, device=sc.device)
        # A stage reads only its own degrees, so changing one stage's restarts no other: the encoder its TP, the DiT
        # ulysses x ring, the VAE its patch parallel plus the DiT group it is checked against (1 or the whole group).
        # A colocated pod runs every stage.
        degrees = {"encoder_tp": spec.encoder.tensor_parallel, "ulysses": spec.dit.ulysses, "ring": spec.dit.ring,
                   "vae_pp": spec.vae.patch_parallel}
        own = {"encoder": ("encoder_tp",), "dit": ("ulysses", "ring"), "vae": ("vae_pp", "ulysses", "ring")}
        out.update({k: v for k, v in degrees.items() if colocated or k in own.get(stage, ())})
        if spec.model.manifest_sha256 is not None:
            out["checkpoint_manifest_sha256"] = spec.model.manifest_sha256
    if spec.tls is not None:  # every process: its servers, and the channels to its peers
        out.update({k: f"{TLS_DIR}/{v}" for k, v in TLS_FILES.items()})
        if not colocated:
            out["tls_peer_name"] = tls_peer_name(service_config["name"], service_config["namespace"])
    elif stage != "gateway":  # no mTLS: the stages' ports are fenced by the instance's NetworkPolicies instead
        out["no_peer_auth"] = True
    lv = spec.dit.levers
    if colocated or stage == "dit":
        out.update(dit_resident_blocks=lv.resident_blocks, dit_offload_mode=lv.offload_mode, fp8=lv.fp8,
                   fp8_attention=lv.fp8_attention)
    elif stage == "encoder":
        out.update(fp8=lv.fp8)  # FP8 covers the text decoder's projections too
    if colocated or stage in ("dit", "gateway"):  # the DiT loads the tasks' partitions, the gateway admits them
        out["tasks"] = spec.tasks
    if colocated or stage == "encoder":
        out.update(encoder_resident_layers=spec.encoder.levers.resident_layers,
                   encoder_cache_bytes=spec.encoder.cache_bytes)
    if colocated or stage == "vae":
        out["vae_staged"] = spec.vae.levers.staged
    if (colocated or stage == "dit") and spec.model.adapter is not None:
        out.update(adapter=spec.model.adapter.path, adapter_sha256=spec.model.adapter.sha256)
    if stage != "encoder":  # every end of a tensor edge (dit -> vae, vae -> muxer) and the gateway's plan
        out["transport"] = spec.transport
    if colocated or stage == "muxer":
        out["mux_threads"] = spec.muxer.workers
    if stage == "gateway":
        out.update(http_host="0.0.0.0", http_port=int(service_config["ports"]["http"]),
                   queue_size=spec.gateway.queue_size, **{s: sc.endpoints[s] for s in PIPELINE_STAGES})
        if FASTH3_DIT in sc.endpoints:
            out["fasth3_dit"] = sc.endpoints[FASTH3_DIT]
        auth, store = spec.gateway.auth, spec.gateway.job_store
        if auth.api_keys_secret is not None:
            out["api_keys_file"] = API_KEYS_PATH
        elif auth.disabled:
            out["no_auth"] = True
        if store is not None:  # endpoint, region and credentials come from the pod's AWS_* environment
            out["job_store"] = f"s3://{store.s3.bucket}/{store.s3.prefix}"
    return out
