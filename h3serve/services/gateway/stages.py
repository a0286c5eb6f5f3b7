"""The gateway's view of the four stages: channels and stubs, a health monitor that keeps each stage's serving
status (readiness = every stage SERVING), and the transport each NIXL-capable edge used last.

A stage's address may name several replicas: `dns:///h3-encoder.ns.svc:50052` (a headless Service: every pod's
address), `ipv4:10.0.0.1:50052,10.0.0.2:50052`, or one host:port. Each channel balances per call (round_robin over
every resolved address) and health-checks each replica (gRPC client-side health checking on the standard Health
service), so a replica that turns NOT_SERVING (draining) or goes away stops receiving calls while the others keep
serving."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve._proto import common_pb2, dit_pb2_grpc, encoder_pb2_grpc, muxer_pb2_grpc, vae_pb2_grpc
from h3serve.config.stage import StageConfig
from h3serve.config.vocab import FASTH3_DIT, GRPC, PIPELINE_STAGES
from h3serve.runtime.tls import Tls

from .metrics import GatewayMetrics

log = logging.getLogger("h3serve.gateway")

HEALTH_INTERVAL_S = 0.5
HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
# A stage whose health check got no answer within its deadline: hung (a stopped or wedged process keeps its port
# open), or its host is unreachable. Not the same as one that answers NOT_SERVING (alive: loading, or draining the
# requests it holds), nor as UNAVAILABLE: no replica to ask (refused, or none resolved: a pod being replaced),
# where a call in flight on a replica that died breaks by itself (its socket closes).
UNREACHABLE, UNAVAILABLE = "UNREACHABLE", "UNAVAILABLE"
# A stage SERVING to its health checks whose fresh request channel has not connected yet: not ready. Its health
# channel may still reach the replica by an old address (a restarted container keeps its pod IP) while the fresh
# channel's DNS answer is still the cached "no such name" of the moment the replica was not ready (CoreDNS caches
# denials; found on the real cluster: the first job after a VAE container restart failed resolving its Service).
CONNECTING = "CONNECTING"
UNBOUND_HOSTS = ("", "0.0.0.0", "[::]")
# Edges whose transport the stages choose per request (grpc, or nixl when both ends can); `edge` of a
# TransportInfo that names none is the frame edge.
EDGES = {"vae->muxer": "the VAE and the muxer", "dit->vae": "the DiT and the VAE"}
FRAME_EDGE = "vae->muxer"
# per-call round robin over the resolved replicas, each health-checked (service "" = the server's overall status)
BALANCED = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})
# How soon a channel may ask DNS again after a replica went away (gRPC's default is 30 s): a pod replaced by its
# Deployment has a new IP, and until the channel resolves again every call fails (found on the real cluster).
RERESOLVE_MS = 1_000


def balanced_channel(target: str, tls: Tls) -> grpc.Channel:
    """A channel to every replica `target` resolves to, balanced per call over the SERVING ones."""
    return tls.channel(target, extra=(("grpc.service_config", BALANCED),
                                      ("grpc.dns_min_time_between_resolutions_ms", RERESOLVE_MS)))


def unbound(address: str) -> bool:
    """An address a stage reported without saying where it is reachable (empty, or an any-interface bind)."""
    return not address or address.rsplit(":", 1)[0] in UNBOUND_HOSTS


class StageClients:
    """Channels and stubs to the stages, and a health monitor that keeps each stage's serving status."""

    def __init__(self, config: StageConfig, on_change: Callable[[], None] = lambda: None):
        self.addresses = {s: getattr(config.gateway, s) for s in PIPELINE_STAGES}
        if config.gateway.fasth3_dit and config.model.profile != "fasth3":   # a FastH3 DiT pool beside the base one
            self.addresses[FASTH3_DIT] = config.gateway.fasth3_dit
        self.tls = Tls.of(config)   # mTLS to the stages when configured
        self.profile = config.model.profile
        self.channels: dict[str, grpc.Channel] = {}
        self.dits: dict[str, dit_pb2_grpc.DiTStub] = {}   # the DiT pool per profile (the FastH3 one when configured)
        for s in self.addresses:
            self._bind(s)
        # the health monitor's own channels: its Checks must not advance the request channels' round robin
        self._health_channels = {s: balanced_channel(a, self.tls) for s, a in self.addresses.items()}
        # request channels replaced while calls may still run on them: closed once no call can (its deadline)
        self._retired: list[tuple[float, grpc.Channel]] = []
        self._retire_after_s = config.gateway.request_timeout_s + 60.0
        self._extra: dict[str, grpc.Channel] = {}
        self._connecting: dict[str, grpc.Future] = {}   # stage -> its renewed request channel's connect
        self._lock = threading.Lock()
        self.status = {s: "UNKNOWN" for s in self.addresses}
        self.gpus: dict[str, int] = {}   # GPUs a request occupies per stage (its Status, read when it serves)
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="h3serve-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _bind(self, stage: str) -> None:
        """A new request channel to `stage` and its stub (the calls read the stubs at call time)."""
        channel = self.channels[stage] = balanced_channel(self.addresses[stage], self.tls)
        if stage == "encoder":
            self.encoder = encoder_pb2_grpc.EncoderStub(channel)
        elif stage in ("dit", FASTH3_DIT):
            stub = self.dits[self.profile if stage == "dit" else "fasth3"] = dit_pb2_grpc.DiTStub(channel)
            if stage == "dit":
                self.dit = stub
        elif stage == "vae":
            self.vae = vae_pb2_grpc.VAEStub(channel)
        elif stage == "muxer":
            self.muxer = muxer_pb2_grpc.MuxerStub(channel)

    def _renew(self, stage: str) -> None:
        """A stage that was not SERVING is again (its replicas replaced): a fresh request channel. The old one,
        idle meanwhile, may still hold only the gone replicas' addresses (it re-resolves only once its connect to
        them fails, and a vanished pod IP answers nothing), while the health channel already reaches the new ones;
        found on the real cluster: the first job after a DiT pod was replaced failed. Calls still running on the
        old one (a replica draining) keep it until their deadline."""
        with self._lock:
            self._retired.append((time.monotonic() + self._retire_after_s, self.channels[stage]))
            self._bind(stage)
            self.gpus.pop(stage, None)   # new replicas: read their GPUs again
            old = self._connecting.pop(stage, None)
            if old is not None:
                old.cancel()
            # keeps connecting (and resolving again, with gRPC's backoff) until it is READY
            self._connecting[stage] = grpc.channel_ready_future(self.channels[stage])

    def _connected(self, stage: str) -> bool:
        """Whether the stage's request channel connected since it was renewed (True when it never was)."""
        future = self._connecting.get(stage)
        if future is None or future.done():
            self._connecting.pop(stage, None)
            return True
        return False

    def _close_retired(self, everything: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            done = [c for t, c in self._retired if everything or t <= now]
            self._retired = [(t, c) for t, c in self._retired if not (everything or t <= now)]
        for c in done:
            c.close()

    def reachable(self, stage: str, address: str) -> str:
        """The address to give peers for a stage replica: the one it reported, else the configured one."""
        return self.addresses[stage] if unbound(address) else address

    def muxer_at(self, address: str) -> muxer_pb2_grpc.MuxerStub:
        """The muxer replica that holds a session (its address may differ from the service address)."""
        if unbound(address) or address == self.addresses["muxer"]:
            return self.muxer
        with self._lock:
            channel = self._extra.get(address)
            if channel is None:
                channel = self._extra[address] = self.tls.channel(address)
        return muxer_pb2_grpc.MuxerStub(channel)

    def ready(self) -> bool:
        return all(v == "SERVING" for v in self.status.values())

    def not_ready(self, profile: str | None = None) -> dict[str, str]:
        """stage -> health, of the stages not SERVING (of those a request of `profile` uses, when given)."""
        dit = FASTH3_DIT if profile == "fasth3" and FASTH3_DIT in self.status else "dit"
        used = None if profile is None else {*PIPELINE_STAGES, dit} - ({"dit"} if dit != "dit" else set())
        return {s: v for s, v in self.status.items() if v != "SERVING" and (used is None or s in used)}

    def _monitor(self) -> None:
        stubs = {s: health_pb2_grpc.HealthStub(c) for s, c in self._health_channels.items()}
        while not self._stop.is_set():
            changed = False
            for stage, stub in stubs.items():
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    value = HEALTH_NAMES.get(r.status, "UNKNOWN")
                except grpc.RpcError as e:
                    value = UNREACHABLE if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else UNAVAILABLE
                if self.status[stage] != value:
                    if value == "SERVING" and self.status[stage] not in ("UNKNOWN", CONNECTING):
                        self._renew(stage)
                    if value == "SERVING" and not self._connected(stage):
                        value = CONNECTING
                if self.status[stage] != value:
                    log.info("stage %s: %s -> %s", stage, self.status[stage], value)
                    self.status[stage] = value
                    changed = True
                if value == "SERVING" and stage not in self.gpus:
                    self._learn(stage)
            if changed:
                self.on_change()
            self._close_retired()
            self._stop.wait(HEALTH_INTERVAL_S)

    def _learn(self, stage: str) -> None:
        """The stage's GPUs per request (its ranks on CUDA, 0 on CPU; read from its Status) for the usage record."""
        stub = {"encoder": self.encoder, "vae": self.vae, "muxer": self.muxer, "dit": self.dit,
                FASTH3_DIT: self.dits.get("fasth3")}[stage]
        try:
            info = json.loads(stub.Status(common_pb2.StatusRequest(), timeout=2.0).info_json or "{}")
            self.gpus[stage] = int(info.get("gpus", 0))
        except (grpc.RpcError, ValueError, TypeError) as exc:
            log.debug("stage %s: Status not read (%s); asked again next check", stage, exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():   # its Check (1 s deadline) ends before the channels close under it
            self._thread.join(HEALTH_INTERVAL_S + 2.0)
        self._close_retired(everything=True)
        for future in self._connecting.values():
            future.cancel()
        for c in [*self.channels.values(), *self._health_channels.values(), *self._extra.values()]:
            c.close()


class EdgeTransports:
    """Per edge: the transport requested (--transport), the one the last request used, and why; kept in the
    metrics too (h3serve_transport_*)."""

    def __init__(self, requested: str, metrics: GatewayMetrics):
        self.metrics = metrics
        self._lock = threading.Lock()
        pending = requested != GRPC
        self.edges = {edge: {"requested": requested, "chosen": "pending" if pending else requested,
                             "reason": f"decided per request by {ends} (no request yet)" if pending else "requested"}
                      for edge, ends in EDGES.items()}
        for edge, t in self.edges.items():
            metrics.set_transport(edge, t["requested"], t["chosen"], t["reason"], request=False)

    def details(self) -> dict:
        with self._lock:
            return {edge: dict(t) for edge, t in self.edges.items()}

    def record(self, info) -> None:
        """A stage's TransportInfo for the request that just used the edge."""
        edge = info.edge or FRAME_EDGE
        t = {"requested": info.requested, "chosen": info.chosen, "reason": info.reason}
        with self._lock:
            changed = self.edges.get(edge, {}).get("chosen") != t["chosen"]
            self.edges[edge] = t
        self.metrics.set_transport(edge, t["requested"], t["chosen"], t["reason"])
        if changed:
            log.info("transport %s: requested %s, chosen %s (%s)", edge, t["requested"], t["chosen"], t["reason"])
