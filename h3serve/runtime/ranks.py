"""Parallel degrees behind the stage servers: a model stage with degree N is a world of N ranks.

    h3serve serve --stages dit --ulysses 2 --ring 1 ...        (or --stages all: every model stage gets its own world)

    rank 0 (this process: gRPC, health, the engine thread)        ranks 1..N-1 (no gRPC)
    ──────────────────────────────────────────────────────        ──────────────────────────────────────
    servicer.engine / encoder / video_vae = a stand-in            the same build (`build_stage_rank`: the
    (h3serve.distributed.proxies) whose calls run as               model's rank builder), then the command loop
    ParallelStage.call(op, payload) on every rank  ───────────►    of h3serve.distributed.commands

Degrees per stage: encoder = encoder_tp, DiT = ulysses x ring, VAE = vae_pp (each stage process is its own world; a
colocated replica runs three worlds on the same GPUs, rank r of each on cuda:r). They are validated once, against the
checkpoint's head counts, by `ParallelDegrees.validate` (`h3serve.runtime.prechecks.validate_degrees`, before torch
is imported).

How the ranks start (`start_stage`):
* launched (default): this process becomes rank 0 and spawns ranks 1..N-1 on this host (`distributed.launch`, a free
  loopback port). What `h3serve serve` does on one node, and what an operator Deployment pod does (one pod = one
  replica's GPUs; it sets WORLD_SIZE with NNODES=1, which needs no rendezvous).
* joined (`torchrun`-style: LOCAL_RANK set, or NNODES > 1 as the operator's gang StatefulSets set it): RANK /
  WORLD_SIZE / MASTER_ADDR / MASTER_PORT say where this process stands. WORLD_SIZE must equal the stage's degree.
  Rank 0 serves gRPC; any other rank joins and runs its part (`run_peer`); of those, the process that stands for a
  pod (its node's first rank) answers gRPC health only, for the kubelet's probes of gang followers. With NNODES > 1
  and no LOCAL_RANK (one pod per node, NPROC_PER_NODE GPUs each), the pod's process is its node's first rank (RANK)
  and spawns the node's other ranks RANK+1 .. RANK+NPROC_PER_NODE-1 on cuda:1 .. cuda:NPROC_PER_NODE-1.

Failure: when a rank dies, the call in flight raises `StageUnavailable(<stage>)` (gRPC UNAVAILABLE naming the stage),
the stage's health turns NOT_SERVING at once, and, once no request is left in it, the process exits with
`EXIT_RANK_FAILED` so that its supervisor (the launcher, the kubelet, torchrun) restarts the whole world.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent import futures
from typing import Any, Iterator

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from h3serve.config.parallel import DegreeError, ParallelDegrees
from h3serve.config.vocab import DIST_PORT
from h3serve.distributed.world import (
    StageHandle,
    join_from_env,
    launch,
    spawn_peers,
)
from h3serve.errors import H3Error, RankFailed, StageUnavailable
from h3serve.models.dit.parallel import build_dit_rank
from h3serve.models.encoder.parallel import build_encoder_rank
from h3serve.models.vae.parallel import build_vae_rank
from h3serve.runtime.device import TORCH_DTYPES, pick_device
from h3serve.runtime.prechecks import dist_env, stage_degree

log = logging.getLogger("h3serve.runtime.ranks")

EXIT_RANK_FAILED = 4
LINGER_S = 3.0          # NOT_SERVING is visible this long before a failed stage exits


# ---------------------------------------------------------------------------------------------------------------------
# Degrees


def check_joinable(stage: str, degrees: ParallelDegrees, env: dict[str, int]) -> None:
    n = stage_degree(degrees, stage)
    if env["world"] != n:
        raise DegreeError(f"WORLD_SIZE={env['world']} but the {stage} stage has {n} ranks with these degrees "
                          f"(encoder_tp={degrees.encoder_tp}, ulysses={degrees.ulysses}, ring={degrees.ring}, "
                          f"vae_pp={degrees.vae_pp}); start {n} ranks for it or change the degrees")


# ---------------------------------------------------------------------------------------------------------------------
# What every rank builds (importable by name: spawned ranks import it)


RANK_BUILDERS = {"encoder": build_encoder_rank, "dit": build_dit_rank, "vae": build_vae_rank}


def build_stage_rank(runtime, stage: str, threads: int, kwargs: dict) -> dict:
    """Every rank of a stage's world: the stage's torch threads, then its model's rank builder (groups, load)."""
    if threads:
        torch.set_num_threads(threads)
    return RANK_BUILDERS[stage](runtime, **kwargs)()


def _build_args(stage: str, c, degrees: ParallelDegrees) -> tuple:
    """(build, build args) of the stage's world, from its StageConfig: the rank builder's keyword arguments."""
    common = {"checkpoint": c.model.checkpoint, "dtype": TORCH_DTYPES[c.model.dtype]}
    if stage == "encoder":
        kwargs = dict(common, tp=degrees.encoder_tp, fp8=c.levers.fp8,
                      resident_layers=c.levers.encoder_resident_layers)
    elif stage == "dit":
        m = c.model
        kwargs = dict(common, components=("transformer",), profile=m.profile, adapter=m.adapter,
                      adapter_sha256=m.adapter_sha256, ulysses=degrees.ulysses, ring=degrees.ring, levers=c.levers,
                      adaln_dir=m.adaln_dir, loras=m.loras, lora_cache_bytes=m.lora_cache_bytes)
    elif stage == "vae":
        kwargs = dict(common, pp=degrees.vae_pp)
    else:
        raise H3Error(f"the {stage} stage has no parallel ranks")
    return build_stage_rank, (stage, c.model.threads, kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Starting a stage's world


def _spawn_node_peers(env: dict[str, int], build, args: tuple, timeout_s: float, device: str | None) -> list:
    """Operator gang pods (one pod per node, no torchrun): this process is RANK; spawn the node's other ranks."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", DIST_PORT))
    return spawn_peers(((env["rank"] + i, i) for i in range(1, env["nproc"])), env["world"], addr, port, build, args,
                       timeout_s=timeout_s, device=device)


def start_stage(stage: str, config, degrees: ParallelDegrees, *, timeout_s: float = 600.0) -> StageHandle:
    """Rank 0 of the stage's world: launch the ranks here, or join the world the environment describes."""
    build, args = _build_args(stage, config, degrees)
    device = pick_device(config.model.device).type
    env = dist_env()
    if env is None:
        return launch(stage_degree(degrees, stage), build, args, device=device, timeout_s=timeout_s)
    check_joinable(stage, degrees, env)
    if env["rank"] != 0:
        raise H3Error(f"internal: rank {env['rank']} of the {stage} stage does not serve gRPC")
    procs = [] if env["torchrun"] or env["nproc"] <= 1 else _spawn_node_peers(env, build, args, timeout_s, device)
    handle = join_from_env(build, args, timeout_s=timeout_s)
    handle.processes = procs
    return handle


class FollowerHealth:
    """gRPC health (service "") of a pod whose process is a rank other than 0 (a gang follower): the kubelet probes
    every pod of the gang's StatefulSet, and its rollout counts them. NOT_SERVING while this rank's part loads,
    SERVING once it is in the world, NOT_SERVING and then gone when it leaves. No stage service is served here."""

    def __init__(self, host: str, port: int):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="h3-follower-health"))
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:   # grpcio raises on a port in use
            self.port = 0
        if not self.port:
            raise H3Error(f"--port {port}: cannot bind {host}:{port} for this rank's gRPC health (in use?); give "
                          "the pod's stage port")
        self.set(False)
        self.server.start()

    def set(self, serving: bool) -> None:
        r = health_pb2.HealthCheckResponse
        self.servicer.set("", r.SERVING if serving else r.NOT_SERVING)

    def stop(self) -> None:
        self.set(False)
        self.server.stop(grace=1.0)


def run_peer(stage: str, config, degrees: ParallelDegrees, *, timeout_s: float = 600.0) -> int:
    """A rank other than 0 of a joined world: build its part, run rank 0's commands until shutdown.

    It serves no stage over gRPC; the process that stands for its pod (the node's first rank: no LOCAL_RANK, or
    LOCAL_RANK 0) answers gRPC health on the stage's port, so that a gang follower pod's probes see it."""
    env = dist_env()
    assert env is not None and env["rank"] != 0
    check_joinable(stage, degrees, env)
    build, args = _build_args(stage, config, degrees)
    health = FollowerHealth(config.server.host, config.server.port) if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0 else None
    try:
        procs = [] if env["torchrun"] or env["nproc"] <= 1 else \
            _spawn_node_peers(env, build, args, timeout_s, pick_device(config.model.device).type)
        log.info("%s: rank %d of %d joined (gRPC health only on this rank)", stage, env["rank"], env["world"])
        join_from_env(build, args, timeout_s=timeout_s,
                      on_ready=(lambda: health.set(True)) if health is not None else None)
        for p in procs:
            p.join()
    finally:
        if health is not None:
            health.stop()
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# Rank 0 inside a stage servicer


class ParallelStage:
    """Rank 0's hold on a stage's world, for a stage servicer: calls that fail because a rank died become
    `StageUnavailable(stage)`; a watcher turns the stage NOT_SERVING at once and exits the process when it is idle."""

    def __init__(self, servicer, handle: StageHandle):
        self.servicer = servicer
        self.stage = servicer.stage
        self.handle = handle
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"h3serve-{self.stage}-ranks", daemon=True)
        self._watcher.start()

    @property
    def handlers(self) -> dict:
        return self.handle.handlers

    @classmethod
    def start(cls, servicer, degrees: ParallelDegrees) -> "ParallelStage":
        return cls(servicer, start_stage(servicer.stage, servicer.config, degrees))

    def info(self) -> dict:
        h = self.handle
        out = {"ranks": h.world_size, "ranks_healthy": h.healthy}
        if h.processes:
            out["rank_pids"] = [os.getpid()] + [p.pid for p in h.processes]
        if h.failure:
            out["rank_failure"] = h.failure
        return out

    def _unavailable(self, exc: BaseException) -> H3Error:
        self._not_serving()   # before the caller hears of it
        return StageUnavailable(self.stage, str(exc))

    def _not_serving(self) -> None:
        s = self.servicer
        s.ready = False
        if s.health is not None and s.health.serving:
            s.health.set(False)

    def call(self, op: str, payload: Any = None, **kw) -> Any:
        """`StageHandle.call`; a rank that fails, also while a streaming op's iterator runs, is `StageUnavailable`."""
        try:
            result = self.handle.call(op, payload, **kw)
        except RankFailed as exc:
            raise self._unavailable(exc) from None
        return self._stream(result) if isinstance(result, Iterator) else result

    def _stream(self, it: Iterator) -> Iterator:
        try:
            yield from it
        except RankFailed as exc:
            raise self._unavailable(exc) from None

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            if self.handle.healthy:
                continue
            s = self.servicer
            log.error("%s: %s; NOT_SERVING, exiting once idle (the supervisor restarts the stage)",
                      self.stage, self.handle.failure)
            self._not_serving()
            end = time.monotonic() + 30.0
            while s.busy() and time.monotonic() < end:
                time.sleep(0.1)
            if self._closed.wait(LINGER_S):
                return
            for p in self.handle.processes:
                if p.is_alive():
                    p.kill()
            print(f"h3serve: {self.stage}: a rank of the stage failed ({self.handle.failure}); exiting",
                  flush=True, file=sys.stderr)
            os._exit(EXIT_RANK_FAILED)

    def close(self) -> None:
        self._closed.set()
        self.handle.close()

