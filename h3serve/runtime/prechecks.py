"""What `h3serve serve` will run, and every mistake a user can make on it, checked before torch is imported.

`check_serve(args)` parses the stages and the StageConfig, then checks the TLS files, who may reach each listener
(a stage beyond loopback needs mTLS; the gateway needs API keys or --no-auth), the checkpoint and the components of
the stages served here, the parallel degrees against the checkpoint's heads, the stage addresses a gateway needs and
every port it will bind. A mistake is one `H3Error` line (exit 2) within a fraction of a second, not after the
2-9 s torch takes to import; the launcher (`h3serve.runtime.launcher`, torch, grpc, the models) is imported after.

Nothing here imports torch or grpc, but for counting CUDA devices when a degree is above 1 (`check_serve`).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import os
import socket
from dataclasses import dataclass, fields
from typing import Mapping

from h3serve.config.levers import from_args as levers_from_args
from h3serve.config.parallel import ParallelDegrees
from h3serve.config.stage import (API_KEYS_ENV, COMPONENT_ENV, CONFIG_ENV, KNOB_PART, STAGE_CONFIG_ENV, StageConfig,
                                  service_config_values)
from h3serve.config.vocab import (COMPONENT_FOR_TASK, FASTH3_DIT, HTTP_PORT, MODEL_STAGES, PORT_OFFSETS, STAGES,
                                  START_ORDER)
from h3serve.errors import CheckpointError, H3Error, RequestError
from h3serve.weights.folder import CheckpointFolder

log = logging.getLogger("h3serve.gateway")   # its one message, --no-auth's warning, is the gateway's

# The checkpoint components each model stage cannot start without (the DiT's ref2va partition is optional: a
# checkpoint without transformer_ref/ serves the other tasks), checked before any stage loads.
STAGE_COMPONENTS = {"encoder": ("text_encoder", "tokenizer"), "dit": (COMPONENT_FOR_TASK["t2va"],),
                    "vae": ("vae", "audio_vae")}


# ---------------------------------------------------------------------------------------------------------------------
# The stages and their config


def parse_stages(text: str) -> list[str]:
    if text.strip() == "all":
        return list(STAGES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STAGES]
    if bad or not names:
        raise RequestError("stages", text, "all, or a comma list of " + ", ".join(STAGES))
    return [s for s in STAGES if s in names]


def serve_order(config: StageConfig, stages: list[str]) -> list[str]:
    """The processes a launcher starts for `stages`, in start order: with a FastH3 adapter beside a base DiT, the
    FastH3 DiT pool (`FASTH3_DIT`, the gateway's --fasth3-dit) right after the DiT."""
    order = [s for s in START_ORDER if s in stages]
    if config.model.fasth3_adapter and "dit" in stages and config.model.profile == "base":
        order.insert(order.index("dit") + 1, FASTH3_DIT)
    return order


def config_from_args(args: argparse.Namespace, stage: str, environ: Mapping[str, str] = os.environ) -> StageConfig:
    """The StageConfig of `stage` from argv and, when `$H3SERVE_CONFIG` names one, the operator's service config.

    The file wins: what it sets (degrees, profile, adapter, dtype, ports, peer addresses) is the deployment's truth;
    argv fills the knobs it does not carry (threads, warm-up, --advertise, ...). A child of the launcher reads the
    launcher's knobs from `$H3SERVE_STAGE_CONFIG` instead of argv (`child_config`), then the mounted file the same.
    """
    child = environ.get(STAGE_CONFIG_ENV)
    if child:
        try:
            config = StageConfig.from_dict(_read_config(child, STAGE_CONFIG_ENV, "the launcher's stage config"))
        except TypeError as exc:  # a key no StageConfig has: a file of another version
            raise H3Error(f"{STAGE_CONFIG_ENV}={child}: not a StageConfig ({exc})") from None
    else:
        config = StageConfig.from_knobs(
            **{name: getattr(args, name) for name in KNOB_PART if getattr(args, name, None) is not None},
            levers=levers_from_args(args),
            degrees=ParallelDegrees(**{f.name: getattr(args, f.name) for f in fields(ParallelDegrees)}))
    config = config.replace(stage=stage)
    path = environ.get(CONFIG_ENV)
    if path:
        doc = _read_config(path, CONFIG_ENV, "the mounted ServiceConfig")
        try:
            pool = FASTH3_DIT if stage == "dit" and environ.get(COMPONENT_ENV) == FASTH3_DIT else stage
            config = config.replace(**service_config_values(doc, pool))
        except (KeyError, TypeError, ValueError) as exc:   # not a ServiceConfig the operator rendered
            raise H3Error(f"{CONFIG_ENV}={path}: not a ServiceConfig ({type(exc).__name__}: {exc})") from None
    return config


def _read_config(path: str, env: str, what: str) -> dict:
    """A config file a process is pointed at by `env`: JSON (the renderer and the launcher write JSON, which is
    YAML), one object."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise H3Error(f"{env}={path}: cannot read {what}: {exc}") from None
    if not isinstance(doc, dict):
        raise H3Error(f"{env}={path}: {what} is not one JSON object")
    return doc


# ---------------------------------------------------------------------------------------------------------------------
# Who may reach a listener


def is_loopback(host: str) -> bool:
    """A bind address only this host can reach (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_tls_files(config: StageConfig) -> None:
    """The certificate flags that go together (`Tls.of` makes the credentials from them)."""
    if (config.server.tls_cert is None) != (config.server.tls_key is None):
        raise H3Error("--tls-cert and --tls-key go together: give both or neither")
    if config.server.tls_ca is not None and config.server.tls_cert is None:
        raise H3Error("--tls-ca needs --tls-cert and --tls-key (this process's certificate for mTLS)")


def check_stage_exposure(config: StageConfig) -> None:
    """A stage other than the gateway listens beyond loopback only with mTLS, or with --no-peer-auth (its port
    fenced by a network policy): otherwise one line saying how to fix it."""
    if config.stage == "gateway" or is_loopback(config.server.host) or config.server.no_peer_auth:
        return
    check_tls_files(config)
    if config.server.tls_cert is not None and config.server.tls_ca is not None:
        return
    raise H3Error(f"the {config.stage} would listen on {config.server.host} without mTLS, open to anyone who reaches it: "
                  "give --tls-cert FILE --tls-key FILE --tls-ca FILE (peers then need a certificate of that CA), "
                  "listen on loopback (--host 127.0.0.1), or give --no-peer-auth where a network policy fences "
                  "the port")


def check_exposure(keys_file: str | None, no_auth: bool, hosts: tuple[str, ...]) -> None:
    """A gateway without keys listens only on loopback unless --no-auth says it may listen wider."""
    if keys_file is not None and no_auth:
        raise H3Error("--api-keys-file and --no-auth contradict each other: give one")
    if no_auth:
        log.warning("--no-auth: the gateway serves every caller who can reach %s without an API key, and every "
                    "job is everyone's", ", ".join(sorted(set(hosts))))
        return
    if keys_file is not None:
        return
    wide = [h for h in hosts if not is_loopback(h)]
    if wide:
        raise H3Error(f"the gateway would listen on {', '.join(sorted(set(wide)))} without authentication: give "
                      f"--api-keys-file FILE (or ${API_KEYS_ENV}), or --no-auth to serve anyone who can reach it")


def check_gateway_exposure(config: StageConfig) -> None:
    """`check_exposure` for the gateway of `config`: its gRPC host and, when it serves HTTP, its HTTP host."""
    check_exposure(config.gateway.api_keys_file, config.gateway.no_auth,
                   (config.server.host,) + ((config.gateway.http_host,) if config.gateway.http_port is not None else ()))


# ---------------------------------------------------------------------------------------------------------------------
# Ports


def port_in_use(host: str, port: int) -> bool:
    """Whether a listener holds host:port: a bind as our servers bind (SO_REUSEADDR, no SO_REUSEPORT) fails."""
    if not port:
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False   # an unknown host: the bind itself says so
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a port in TIME_WAIT is free to our servers
            try:
                s.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def check_ports(ports: list[tuple[str, int, str]]) -> None:
    """(host, port, what sets it) each: the first port another program holds is one line naming it and its flag."""
    for host, port, flag in ports:
        if port_in_use(host, port):
            raise H3Error(f"{flag}: {host}:{port} is in use (another h3serve serve, or another program); stop it "
                          "or choose another port (0: a free one)")


def planned_ports(config: StageConfig, stages: list[str]) -> list[tuple[str, int, str]]:
    """(host, port, the flag that sets it) of every port `serve` will bind for `stages` (a port 0 is a free one)."""
    base = config.server.port
    if len(stages) == 1:
        out = [(config.server.host, base, f"--port {base}")]
    else:   # the launcher's children: the gateway on --port, each stage on --port + its offset
        out = [(config.server.host, base + PORT_OFFSETS[s], f"--port {base}" if s == "gateway" else
                f"--port {base} (+{PORT_OFFSETS[s]}: the {s} stage)") for s in serve_order(config, stages) if base]
    if "gateway" in stages and config.gateway.http_port:
        out.append((config.gateway.http_host, config.gateway.http_port, f"--http-port {config.gateway.http_port}"))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint and degrees


def check_checkpoint(checkpoint: str, stages: list[str]) -> None:
    """The folder exists and holds every component (config and weight files) the stages served here load."""
    components = [c for s in stages for c in STAGE_COMPONENTS.get(s, ())]
    if components:
        try:
            CheckpointFolder(checkpoint, components=components)
        except CheckpointError as exc:
            text = str(exc)
            raise H3Error(f"--checkpoint {text if text.startswith(str(checkpoint)) else f'{checkpoint}: {text}'}") \
                from None


def stage_degree(degrees: ParallelDegrees, stage: str) -> int:
    return {"encoder": degrees.encoder_tp, "dit": degrees.dit_world, "vae": degrees.vae_pp}.get(stage, 1)


def validate_degrees(degrees: ParallelDegrees, checkpoint: str | None) -> ParallelDegrees:
    """The one check (`ParallelDegrees.validate`), against the checkpoint's head counts when it can be read."""
    if degrees.trivial:
        return degrees
    heads: dict[str, int] = {}
    if checkpoint:
        try:
            folder = CheckpointFolder(checkpoint)
            text = folder.config("text_encoder").get("text_config", {})
            heads = dict(dit_heads=int(folder.config("transformer")["num_attention_heads"]),
                         encoder_heads=int(text["num_attention_heads"]),
                         encoder_kv_heads=int(text["num_key_value_heads"]),
                         encoder_intermediate=int(text["intermediate_size"]))
        except (H3Error, OSError, KeyError, ValueError):
            heads = {}   # the stage's load reports an unreadable checkpoint itself
    return degrees.validate(**heads)


def dist_env() -> dict[str, int] | None:
    """The torchrun / operator environment when this process must join a world rather than launch one."""
    env = os.environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    nnodes = int(env.get("NNODES", "1") or 1)
    if world <= 1 or ("LOCAL_RANK" not in env and nnodes <= 1):
        return None   # one node and no per-rank processes: launch the ranks here
    return {"rank": int(env["RANK"]), "world": world, "nnodes": nnodes,
            "nproc": int(env.get("NPROC_PER_NODE", "1") or 1), "torchrun": int("LOCAL_RANK" in env)}


# ---------------------------------------------------------------------------------------------------------------------
# `h3serve serve`


@dataclass(frozen=True)
class ServePlan:
    """What `serve` runs, checked: the stages, this process's config (the gateway's when it launches several), the
    validated degrees, and the world it joins (`dist_env`; None: it launches its ranks itself)."""

    stages: list[str]
    config: StageConfig
    degrees: ParallelDegrees
    env: dict[str, int] | None

    @property
    def peer(self) -> bool:
        """A joined rank other than 0: it runs its part of the model and binds no port."""
        return self.env is not None and self.env["rank"] != 0


def check_serve(args: argparse.Namespace) -> ServePlan:
    """Every mistake a user can make on `h3serve serve`, before any process starts, any model loads or torch is
    imported: one `H3Error` line (exit 2)."""
    stages = parse_stages(args.stages)
    config = config_from_args(args, stages[0] if len(stages) == 1 else "gateway")
    check_tls_files(config)
    for s in stages:   # a stage beyond loopback needs mTLS (or --no-peer-auth)
        check_stage_exposure(config if s == config.stage else config_from_args(args, s))
    if config.gateway.http_port is None and "gateway" in stages:
        config = config.replace(http_port=HTTP_PORT)
    if "gateway" in stages:   # with several stages, `config` is the gateway's
        check_gateway_exposure(config)
    if any(s in MODEL_STAGES for s in stages) and not config.model.checkpoint:
        raise H3Error("--checkpoint DIR is required to serve " + ", ".join(s for s in stages if s in MODEL_STAGES))
    if config.model.checkpoint:
        check_checkpoint(config.model.checkpoint, stages)
    degrees = validate_degrees(config.degrees, config.model.checkpoint)
    env = dist_env() if any(stage_degree(degrees, s) > 1 for s in stages) else None
    if env is not None and len(stages) > 1:
        raise H3Error(f"--stages {args.stages} with RANK/WORLD_SIZE of a multi-node or torchrun world: each model "
                      "stage is its own world there; run one stage per process (--stages encoder|dit|vae)")
    plan = ServePlan(stages, config, degrees, env)
    if stages == ["gateway"]:
        missing = [s for s in MODEL_STAGES + ("muxer",) if not getattr(config.gateway, s)]
        if missing:
            raise H3Error("a lone gateway needs the stage addresses: " +
                          " ".join(f"--{s} HOST:PORT" for s in missing))
    elif "gateway" in stages:
        missing = [s for s in MODEL_STAGES + ("muxer",) if s not in stages and not getattr(config.gateway, s)]
        if missing:
            raise H3Error("the gateway needs every stage: serve them here or give " +
                          " ".join(f"--{s} HOST:PORT" for s in missing))
    if not plan.peer:   # before any child starts: a busy port is one line, not a restart loop
        check_ports(planned_ports(config, stages))
    if env is None and not degrees.trivial:   # launched here: rank r of each stage on cuda:r
        # lazy: counting CUDA devices needs torch, and only a degree above 1 asks for it (the last check)
        from h3serve.runtime.device import check_ranks_fit

        check_ranks_fit(degrees, config.model.device, [s for s in stages if s in MODEL_STAGES])
    return plan
