"""`StageConfig`: every knob of every stage process, one dataclass (a stage reads the ones it uses).

A process the operator starts finds its deployment's `ServiceConfig` at the path in `$H3SERVE_CONFIG`;
`StageConfig.from_service_config` takes a stage's slice of it (`h3serve serve` on a laptop uses argv alone).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from h3serve.config.callers import callers_json
from h3serve.config.levers import Levers, fasth3_levers, stage_levers
from h3serve.config.lora import LORA_CACHE_BYTES, format_loras
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.spec import ServiceConfig
from h3serve.config.vocab import (
    DEFAULT_DTYPE,
    DEFAULT_TASKS,
    ENCODER_CACHE_BYTES,
    FASTH3_DIT,
    GRPC,
    GRPC_PORT,
    HTTP_PORT,
    MAX_PREVIEWS,
    MODEL_STAGES,
    PIPELINE_STAGES,
    PORT_OFFSETS,
    PROFILE_TASKS,
    TASKS,
    TRANSPORTS,
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
WEBHOOK_SECRETS_DIR = "/etc/h3serve-webhooks"   # spec.gateway.webhooks.secretsSecret
WEBHOOK_SECRETS_KEY = "webhook-secrets"
WEBHOOK_SECRETS_PATH = f"{WEBHOOK_SECRETS_DIR}/{WEBHOOK_SECRETS_KEY}"
TLS_DIR = "/etc/h3serve-tls"             # spec.tls.secretName: a kubernetes.io/tls Secret (+ ca.crt)
TLS_FILES = {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"}  # StageConfig field -> Secret key


def knob(default: Any = None, help: str | None = None, *, flag: str | None = "", metavar: str | None = None,
         choices: tuple[str, ...] | None = None, env: str | None = None, cli_default: Any = None,
         factory: Any = None) -> Any:
    """A StageConfig field and its `h3serve serve` flag (`--name-with-dashes` unless `flag` names it; None: no flag).
    A bool's flag turns it on (`--no-x` on a field whose default is True: off); `env` names the variable whose value
    is the flag's default; `cli_default` a flag default other than the field's."""
    md = dict(flag=flag, help=help, metavar=metavar, choices=choices, env=env, cli_default=cli_default)
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass
class ModelConfig:
    """What a model stage loads and how it runs it (the encoder's cache of encodings too)."""

    checkpoint: str | None = knob(None, "diffusers-format H3 folder (encoder, dit, vae stages)")
    profile: str = knob("base", "base | fasth3")
    adapter: str | None = knob(None, "FastH3 adapter (profile fasth3)")
    adapter_sha256: str | None = knob(None)
    checkpoint_manifest_sha256: str | None = knob(
        None, "pin: the sha256 of the checkpoint's h3serve-manifest.json (h3serve checkpoint manifest); each model "
              "stage checks the files it loads before loading", metavar="HEX")
    dtype: str = knob(DEFAULT_DTYPE, "fp32 | bf16")
    device: str | None = knob(None, "cpu | cuda | cuda:N")
    threads: int = knob(0, "torch threads per stage engine (0: default)")
    tasks: str = knob(DEFAULT_TASKS, "tasks served: a comma list of t2va, fl2va, ref2va (ref2va: the DiT also loads "
                                     "transformer_ref/, as large as transformer/)")
    warmup: bool = knob(True, "skip the warm-up request before SERVING", flag="--no-warmup")
    fasth3_adapter: str | None = knob(None, "launcher of a base deployment: also run a FastH3 DiT pool with this "
                                            "adapter on this host")
    fasth3_adapter_sha256: str | None = knob(None)
    loras: str | None = knob(None, "dit and gateway (profile base): the LoRA adapters a request may name (`lora`), "
                                   "comma separated; STEPS for a few-step adapter (docs/api.md)",
                             metavar="NAME=PATH@SHA256[@STEPS],...")
    lora_cache_bytes: int = knob(LORA_CACHE_BYTES, "dit: bytes of LoRA factors kept on the device, least recently "
                                                   "used dropped first")
    encoder_cache_bytes: int = knob(ENCODER_CACHE_BYTES, "encoder: bytes of encodings cached for repeated prompts / "
                                                         "references (0: off)")

    adaln_dir: str | None = knob(None, "dit, with --adaln-table on: where AdaLN tables are read (when there) or "
                                       "written; a folder of tables made once can be shared read-only by every "
                                       "replica (default: built at each load, kept in memory)", metavar="DIR")

    def tasks_for(self, profile: str | None = None) -> tuple[str, ...]:
        """The tasks served for `profile` (default: this config's): --tasks within what the profile can run."""
        wanted = [t.strip().lower() for t in self.tasks.split(",") if t.strip()]
        bad = [t for t in wanted if t not in TASKS]
        if bad or not wanted:
            raise H3Error(f"--tasks={self.tasks!r} is invalid: a comma list of {', '.join(TASKS)}")
        allowed = PROFILE_TASKS.get(profile or self.profile, ("t2va",))
        return tuple(t for t in TASKS if t in wanted and t in allowed) or ("t2va",)


@dataclass
class ServerConfig:
    """How a stage process listens, and the peers it may reach."""

    host: str = knob("127.0.0.1", "bind address (default loopback)")
    port: int = knob(0, "gRPC port: of the one stage, or of the gateway with stages at +1..+4 (0: free ports)",
                     cli_default=GRPC_PORT)
    advertise: str | None = knob(None, "address peers use to reach this stage (default host:port)")
    grace_s: float = knob(30.0, "SIGTERM: seconds to finish in-flight work")
    rpc_workers: int = knob(32, flag=None)   # the gRPC server's threads
    tls_cert: str | None = knob(None, "this process's certificate: TLS on its gRPC server (and the gateway's HTTPS); "
                                      "plaintext is then refused", metavar="PEM")
    tls_key: str | None = knob(None, "the key of --tls-cert", metavar="PEM")
    tls_ca: str | None = knob(None, "the deployment's CA: stages require peer certificates it signed (mTLS) and "
                                    "verify theirs", metavar="PEM")
    tls_peer_name: str | None = knob(None, "the name checked in a peer's certificate instead of the host dialled "
                                           "(pods dialled by IP)", metavar="NAME")
    peers: str | None = knob(None, "what a stage may dial when a request names an address: IP:PORT, NAME:PORT (an IP "
                                   "the name resolves to, that port) or NET/LEN, comma separated (the launcher and the "
                                   "operator set it; unset: any)", metavar="LIST")
    no_peer_auth: bool = knob(False, "encoder, dit, vae, muxer: listen on a non-loopback address without mTLS (only "
                                     "where a network policy fences the port; otherwise give --tls-cert, --tls-key and "
                                     "--tls-ca)")
    transport: str = knob(GRPC, "VAE -> muxer frame transport: grpc, or nixl (falls back to grpc with a warning when "
                                "NIXL cannot be loaded or the peers cannot connect)", choices=TRANSPORTS)


@dataclass
class GatewayConfig:
    """The gateway: the stages it calls, its HTTP front door, its queue, its jobs and its callers."""

    encoder: str | None = knob(None, "gateway: address of the encoder stage", metavar="HOST:PORT")
    dit: str | None = knob(None, "gateway: address of the dit stage", metavar="HOST:PORT")
    vae: str | None = knob(None, "gateway: address of the vae stage", metavar="HOST:PORT")
    muxer: str | None = knob(None, "gateway: address of the muxer stage", metavar="HOST:PORT")
    http_host: str = knob("127.0.0.1")
    http_port: int | None = knob(None, f"HTTP API port of the gateway (0: a free port; default {HTTP_PORT} with the "
                                       "gateway, else none)")
    http_max_connections: int = knob(1024, "gateway: HTTP connections held at once (more are answered 503 and "
                                           "closed)")
    http_header_timeout_s: float = knob(10.0, "gateway: seconds a request's HTTP headers may take to arrive (then "
                                              "408, closed)")
    http_body_timeout_s: float = knob(30.0, "gateway: seconds a request body may go without a byte (then the "
                                            "connection is closed)")
    decode_workers: int = knob(2, "gateway: threads that decode uploaded images and audio (a pool of their own)")
    decode_per_caller: int = knob(1, "gateway: of those, how many one caller's uploads may use at once")
    queue_size: int = knob(8, "gateway: requests that may wait")
    max_inflight: int = knob(1, "gateway: requests run at once")
    request_timeout_s: float = knob(3600.0, "gateway: deadline of a request whose caller set none")
    jobs_dir: str | None = knob(None, "gateway: HTTP jobs (records and MP4s) kept in this directory across restarts; "
                                      "with --job-store, where MP4s are spooled (default: a temp dir, removed at exit)")
    job_store: str | None = knob(None, "gateway: HTTP jobs in an S3 bucket shared by every replica (endpoint and "
                                       "credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                                       "AWS_REGION)", metavar="s3://BUCKET/PREFIX")
    job_ttl_s: float = knob(3600.0, "gateway: finished jobs kept this long")
    max_jobs: int = knob(1000, "gateway: finished jobs kept at most")
    max_sync_bytes: int = knob(64 << 20, "gateway: largest MP4 GenerateSync returns in one message")
    max_previews: int = knob(MAX_PREVIEWS, "gateway: previews one request may ask for (preview_every); 0: previews "
                                           "refused")
    api_keys_file: str | None = knob(None, "gateway: callers' API keys, one 'NAME sha256:HEX' a line, re-read when it "
                                           f"changes (default ${API_KEYS_ENV}; see docs/security.md)",
                                     metavar="FILE", env=API_KEYS_ENV)
    no_auth: bool = knob(False, "gateway: serve without API keys even on a non-loopback address (without keys the "
                                "gateway otherwise listens on loopback only)")
    caller_limits: str | None = knob(None, "gateway: per-caller share and limits, JSON {NAME or *: {share, "
                                           "max_running, max_queued, video_seconds_per_hour}} (docs/api.md, "
                                           "Scheduling)", metavar="JSON")
    starvation_s: float = knob(600.0, "gateway: a job waiting this long goes before its caller's shorter ones")
    admin_callers: str | None = knob(None, "gateway: API key names (a comma list) that may read every caller's "
                                           "usage (GET /v1/usage)", metavar="NAMES")
    webhook_allow: str | None = knob(None, "gateway: where webhooks may point, a comma list of host names "
                                           "(hooks.example.com, *.example.com: public addresses only) and networks "
                                           "(10.20.0.0/16); empty: webhook_url is refused", metavar="LIST")
    webhook_secrets_file: str | None = knob(None, "gateway: the callers' webhook signing secrets, one 'NAME "
                                                  "whsec_BASE64' a line ('*' for the rest), re-read when it changes",
                                            metavar="FILE")
    webhook_url: str | None = knob(None, "gateway: the webhook of HTTP jobs that give no webhook_url", metavar="URL")
    webhook_attempts: int = knob(6, "gateway: deliveries tried per event (jittered backoff between them)")
    webhook_backoff_s: float = knob(2.0, "gateway: seconds before a webhook's second attempt (doubling, up to 300)")
    webhook_timeout_s: float = knob(10.0, "gateway: seconds a webhook's receiver has to answer")
    model_name: str | None = knob(None, "gateway: model id reported and accepted in requests")
    fasth3_dit: str | None = knob(None, "gateway of a base deployment: a FastH3 DiT pool (profile fasth3), used for "
                                        "model FastH3", metavar="HOST:PORT")

    @property
    def max_message_bytes(self) -> int:
        """The gateway's gRPC message limit, each way: a GenerateSync response of max_sync_bytes and its envelope
        (the SDK refuses a larger request before sending it)."""
        return self.max_sync_bytes + (1 << 20)


@dataclass
class MediaConfig:
    """The VAE's frames and the muxer's MP4s and sessions."""

    frame_format: str = knob("yuv420p", "vae: frames to the muxer as yuv420p planes made on the device, or rgb24",
                             choices=("yuv420p", "rgb24"))
    mux_threads: int = knob(16, "muxer: x264 threads (fixed)")   # fixed: the MP4 bytes depend on it
    crf: int = knob(18)
    preset: str = knob("veryfast")
    session_ttl_s: float = knob(600.0, "muxer: an unfetched session is dropped after this long")
    max_session_ttl_s: float = knob(7200.0, "muxer: the largest TTL a session may ask for")   # the gateway asks
    max_sessions: int = knob(64, "muxer: sessions held at once (more are refused as RESOURCE_EXHAUSTED)")
    max_sessions_per_peer: int = knob(16, "muxer: sessions one caller (by its address: a gateway replica) holds at "
                                          "once")
    tmp_dir: str | None = knob(None, "muxer: where MP4s are assembled")


@dataclass
class StageConfig:
    """Every knob of every stage process, in parts (a stage reads the ones it uses; see docs/services.md).

    Each knob is declared once, with its flag (`knob`): `h3serve serve`'s flags are generated from the parts
    (`cli.py`), whose knob names are unique, so `from_knobs` and `replace` take them flat. A launcher's child reads its
    config back whole from the file the launcher writes (`asdict` / `from_dict`), an operator's pod from its mounted
    ServiceConfig (`service_config_values`)."""

    stage: str = "gateway"   # the one stage this process runs (--stages picks it)
    model: ModelConfig = field(default_factory=ModelConfig)
    # parallel degrees of the model stages (encoder TP, DiT Ulysses x Ring, VAE patch parallel): config/parallel.py;
    # flags: cli.py's degree flags
    degrees: ParallelDegrees = field(default_factory=ParallelDegrees)
    levers: Levers = field(default_factory=Levers)   # capacity / speed levers, all off; flags: the lever table
    server: ServerConfig = field(default_factory=ServerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    media: MediaConfig = field(default_factory=MediaConfig)

    @classmethod
    def from_knobs(cls, **knobs: Any) -> "StageConfig":
        """A StageConfig from knobs named as their flags are (`port=`, `queue_size=`, ...; `stage`, `degrees` and
        `levers` as themselves): each goes to its part."""
        return cls().replace(**knobs)

    def replace(self, **knobs: Any) -> "StageConfig":
        """This config with the knobs given (named as in `from_knobs`) changed."""
        parts: dict[str, dict[str, Any]] = {}
        for name, value in knobs.items():
            if name in PART_TYPES or name == "stage":
                parts.setdefault("", {})[name] = value
            elif name in KNOB_PART:
                parts.setdefault(KNOB_PART[name], {})[name] = value
            else:
                raise TypeError(f"StageConfig has no knob {name!r}")
        top = parts.pop("", {})
        top.update({part: dataclasses.replace(getattr(self, part), **values) for part, values in parts.items()})
        return dataclasses.replace(self, **top)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "StageConfig":
        """A StageConfig from its `asdict` form (a launcher child's file)."""
        return cls(**{k: PART_TYPES[k](**v) if k in PART_TYPES else v for k, v in values.items()})

    @classmethod
    def from_service_config(cls, service_config: dict, stage: str) -> "StageConfig":
        """The StageConfig of `stage` in a deployment rendered as `service_config` (`ServiceConfig.to_dict()`)."""
        return cls.from_knobs(**service_config_values(service_config, stage))

    @property
    def address(self) -> str:
        """The address peers use: --advertise, else host:port (loopback when bound to every interface)."""
        return self.server.advertise or f"{connect_host(self.server.host)}:{self.server.port}"


# StageConfig's parts, and the part each knob belongs to (knob names are unique across the parts: they are flags)
PART_TYPES: dict[str, type] = {name: tp for name, tp in typing.get_type_hints(StageConfig).items() if name != "stage"}
KNOB_PARTS = ("model", "server", "gateway", "media")   # the parts made of knobs (each with its flag)
KNOB_PART: dict[str, str] = {fl.name: part for part in KNOB_PARTS for fl in dataclasses.fields(PART_TYPES[part])}
KNOBS: dict[str, dataclasses.Field] = {fl.name: fl for part in KNOB_PARTS for fl in dataclasses.fields(PART_TYPES[part])}
KNOB_TYPES: dict[str, Any] = {name: tp for part in KNOB_PARTS
                              for name, tp in typing.get_type_hints(PART_TYPES[part]).items()}




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
        spec = ServiceConfig.from_dict(service_config).spec
        pool = spec.fasth3
        if pool is None:
            raise ValueError(f"{FASTH3_DIT}: this ServiceConfig declares no fasth3 pool")
        # the DiT's lossless levers; vae_pp belongs to the VAE (1: it must not be checked against this pool's group)
        out.pop("loras", None)   # per-request LoRA is the base pool's
        out.pop("lora_cache_bytes", None)
        out.update(profile="fasth3", adapter=pool.adapter.path, adapter_sha256=pool.adapter.sha256,
                   degrees=replace(out["degrees"], ulysses=pool.ulysses, ring=pool.ring, vae_pp=1),
                   levers=fasth3_levers(stage_levers(spec, "dit", colocated=False)))
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
        out["degrees"] = ParallelDegrees(**{k: v for k, v in degrees.items()
                                            if colocated or k in own.get(stage, ())})
        if spec.model.manifest_sha256 is not None:
            out["checkpoint_manifest_sha256"] = spec.model.manifest_sha256
    if spec.tls is not None:  # every process: its servers, and the channels to its peers
        out.update({k: f"{TLS_DIR}/{v}" for k, v in TLS_FILES.items()})
        if not colocated:
            out["tls_peer_name"] = tls_peer_name(service_config["name"], service_config["namespace"])
    elif stage != "gateway":  # no mTLS: the stages' ports are fenced by the instance's NetworkPolicies instead
        out["no_peer_auth"] = True
    out["levers"] = stage_levers(spec, stage, colocated)
    if colocated or stage in ("dit", "gateway"):  # the DiT loads the tasks' partitions, the gateway admits them
        out["tasks"] = spec.tasks
    if colocated or stage == "encoder":
        out["encoder_cache_bytes"] = spec.encoder.cache_bytes
    if (colocated or stage in ("dit", "gateway")) and spec.dit.loras:   # the gateway resolves a LoRA's steps
        out["loras"] = format_loras(spec.dit.lora_entries())
    if (colocated or stage == "dit") and spec.dit.loras:
        out["lora_cache_bytes"] = spec.dit.lora_cache_bytes
    if (colocated or stage == "dit") and spec.model.adapter is not None:
        out.update(adapter=spec.model.adapter.path, adapter_sha256=spec.model.adapter.sha256)
    if stage != "encoder":  # every end of a tensor edge (dit -> vae, vae -> muxer) and the gateway's plan
        out["transport"] = spec.transport
    if colocated or stage == "muxer":
        out["mux_threads"] = spec.muxer.workers
    if stage == "gateway":
        out.update(http_host="0.0.0.0", http_port=int(service_config["ports"]["http"]),
                   queue_size=spec.gateway.queue_size, max_previews=spec.gateway.max_previews,
                   **{s: sc.endpoints[s] for s in PIPELINE_STAGES})
        if FASTH3_DIT in sc.endpoints:
            out["fasth3_dit"] = sc.endpoints[FASTH3_DIT]
        auth, store = spec.gateway.auth, spec.gateway.job_store
        if auth.api_keys_secret is not None:
            out["api_keys_file"] = API_KEYS_PATH
            if auth.admin_callers:
                out["admin_callers"] = ",".join(auth.admin_callers)
        elif auth.disabled:
            out["no_auth"] = True
        if store is not None:  # endpoint, region and credentials come from the pod's AWS_* environment
            out["job_store"] = f"s3://{store.s3.bucket}/{store.s3.prefix}"
        if spec.gateway.callers:
            out["caller_limits"] = callers_json(spec.gateway.callers)
        hooks = spec.gateway.webhooks
        if hooks is not None:
            out.update(webhook_allow=",".join(hooks.allow), webhook_secrets_file=WEBHOOK_SECRETS_PATH,
                       webhook_url=hooks.url, webhook_attempts=hooks.attempts)
    return out
