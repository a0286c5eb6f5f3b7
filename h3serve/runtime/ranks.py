"""Parallel degrees behind the stage servers: a model stage with degree N is a world of N ranks.

    h3serve serve --stages dit --ulysses 2 --ring 1 ...        (or --stages all: every model stage gets its own world)

    rank 0 (this process: gRPC, health, the engine thread)        ranks 1..N-1 (no gRPC)
    ──────────────────────────────────────────────────────        ──────────────────────────────────────
    servicer.engine / encoder / video_vae = a proxy whose          the same build(): its part of the model,
    calls run as StageHandle.call(op, payload) on every rank  ──►  then h3serve.distributed.world's command loop

Degrees per stage: encoder = encoder_tp, DiT = ulysses x ring, VAE = vae_pp (each stage process is its own world; a
colocated replica runs three worlds on the same GPUs, rank r of each on cuda:r). They are validated once, against the
checkpoint's head counts, by `ParallelDegrees.validate` (`validate_degrees`).

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

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Iterator

import torch

from h3serve.config.parallel import DegreeError, ParallelDegrees
from h3serve.config.vocab import DIST_PORT
from h3serve.distributed.world import StageHandle
from h3serve.distributed.world import StageFailed as RankFailed
from h3serve.errors import H3Error

log = logging.getLogger("h3serve.runtime.ranks")

EXIT_RANK_FAILED = 4
LINGER_S = 3.0          # NOT_SERVING is visible this long before a failed stage exits
DEGREE_FLAGS = ("encoder_tp", "ulysses", "ring", "vae_pp")


# ---------------------------------------------------------------------------------------------------------------------
# Degrees


def degrees_of(config) -> ParallelDegrees:
    return ParallelDegrees(**{k: int(getattr(config, k, 1) or 1) for k in DEGREE_FLAGS})


def stage_degree(degrees: ParallelDegrees, stage: str) -> int:
    return {"encoder": degrees.encoder_tp, "dit": degrees.dit_world, "vae": degrees.vae_pp}.get(stage, 1)


def validate_degrees(degrees: ParallelDegrees, checkpoint: str | None) -> ParallelDegrees:
    """The one check (`ParallelDegrees.validate`), against the checkpoint's head counts when it can be read."""
    if degrees.trivial:
        return degrees
    heads: dict[str, int] = {}
    if checkpoint:
        from h3serve.weights.folder import CheckpointFolder

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


def check_joinable(stage: str, degrees: ParallelDegrees, env: dict[str, int]) -> None:
    n = stage_degree(degrees, stage)
    if env["world"] != n:
        raise DegreeError(f"WORLD_SIZE={env['world']} but the {stage} stage has {n} ranks with these degrees "
                          f"(encoder_tp={degrees.encoder_tp}, ulysses={degrees.ulysses}, ring={degrees.ring}, "
                          f"vae_pp={degrees.vae_pp}); start {n} ranks for it or change the degrees")


# ---------------------------------------------------------------------------------------------------------------------
# What every rank builds (importable by name: spawned ranks import it)


def _threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)


def build_encoder(runtime, checkpoint: str, dtype: str, threads: int, tp: int) -> dict:
    from h3serve.pipeline import DTYPES
    from h3serve.models.encoder.model import TextEncoder
    from h3serve.models.encoder.parallel import parallelize_encoder

    _threads(threads)
    group, _ = runtime.new_group(range(tp))
    encoder = parallelize_encoder(TextEncoder.load(checkpoint, dtype=DTYPES[dtype], device=runtime.device), group,
                                  runtime.rank, tp)

    def encode(payload, local):
        prompt, task = payload
        return encoder.encode(prompt, task=task)

    return {"encode": encode, "_local": lambda payload, local: encoder}


def build_dit(runtime, checkpoint: str, profile: str, adapter: str | None, adapter_sha256: str | None, dtype: str,
              threads: int, ulysses: int, ring: int) -> dict:
    from h3serve.pipeline import DTYPES
    from h3serve.models.dit.parallel import USPGroups, USPPlan, load_usp_engine

    _threads(threads)
    usp = USPGroups.build(runtime, USPPlan(ulysses, ring))
    engine = load_usp_engine(runtime, usp, checkpoint, components=("transformer",), dtype=DTYPES[dtype],
                             profile=profile, adapter=adapter, adapter_sha256=adapter_sha256)

    def generate(req, local):
        should_stop = runtime.agreed_stop(local.should_stop if local else None, usp.control)
        return engine.generate(req, on_step=local.on_step if local else None, should_stop=should_stop)

    return {"generate": generate, "_local": lambda payload, local: engine}


def build_vae(runtime, checkpoint: str, dtype: str, threads: int, pp: int) -> dict:
    from h3serve.pipeline import DTYPES
    from h3serve.models.vae.parallel import PatchParallelVAE
    from h3serve.models.vae.video import VideoVAE

    _threads(threads)
    group, _ = runtime.new_group(range(pp))
    vae = VideoVAE.load(checkpoint, dtype=DTYPES[dtype], device=runtime.device)
    parallel = PatchParallelVAE(vae, group, runtime.rank, pp)

    def decode(latents, local):
        return parallel.iter_decode(latents.to(runtime.device))   # rank 0: the clips; others: their tiles

    return {"decode": decode, "_local": lambda payload, local: vae}


def _build_args(stage: str, c, degrees: ParallelDegrees) -> tuple:
    if stage == "encoder":
        return build_encoder, (c.checkpoint, c.dtype, c.threads, degrees.encoder_tp)
    if stage == "dit":
        return build_dit, (c.checkpoint, c.profile, c.adapter, c.adapter_sha256, c.dtype, c.threads,
                           degrees.ulysses, degrees.ring)
    if stage == "vae":
        return build_vae, (c.checkpoint, c.dtype, c.threads, degrees.vae_pp)
    raise H3Error(f"the {stage} stage has no parallel ranks")


# ---------------------------------------------------------------------------------------------------------------------
# Starting a stage's world


def _spawn_node_peers(env: dict[str, int], build, args: tuple, timeout_s: float, device: str | None) -> list:
    """Operator gang pods (one pod per node, no torchrun): this process is RANK; spawn the node's other ranks."""
    import torch.multiprocessing as mp

    from h3serve.distributed.world import _peer_main

    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", DIST_PORT))
    ctx = mp.get_context("spawn")
    keep = {k: v for k, v in os.environ.items() if k.startswith(("H3SERVE", "HF_", "TRANSFORMERS", "OMP_"))}
    procs = []
    for i in range(1, env["nproc"]):
        p = ctx.Process(target=_peer_main, name=f"h3-rank-{env['rank'] + i}", daemon=True,
                        args=(env["rank"] + i, env["world"], addr, port, timeout_s, None, build, args, keep, device),
                        kwargs={"local_rank": i})
        p.start()
        procs.append(p)
    return procs


def start_stage(stage: str, config, degrees: ParallelDegrees, *, timeout_s: float = 600.0) -> StageHandle:
    """Rank 0 of the stage's world: launch the ranks here, or join the world the environment describes."""
    from h3serve.distributed.world import join_from_env, launch
    from h3serve.pipeline import pick_device

    build, args = _build_args(stage, config, degrees)
    device = pick_device(config.device).type
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
        from concurrent import futures

        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._pb = health_pb2
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
        r = self._pb.HealthCheckResponse
        self.servicer.set("", r.SERVING if serving else r.NOT_SERVING)

    def stop(self) -> None:
        self.set(False)
        self.server.stop(grace=1.0)


def run_peer(stage: str, config, degrees: ParallelDegrees, *, timeout_s: float = 600.0) -> int:
    """A rank other than 0 of a joined world: build its part, run rank 0's commands until shutdown.

    It serves no stage over gRPC; the process that stands for its pod (the node's first rank: no LOCAL_RANK, or
    LOCAL_RANK 0) answers gRPC health on the stage's port, so that a gang follower pod's probes see it."""
    from h3serve.distributed.world import join_from_env
    from h3serve.pipeline import pick_device

    env = dist_env()
    assert env is not None and env["rank"] != 0
    check_joinable(stage, degrees, env)
    build, args = _build_args(stage, config, degrees)
    health = FollowerHealth(config.host, config.port) if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0 else None
    try:
        procs = [] if env["torchrun"] or env["nproc"] <= 1 else \
            _spawn_node_peers(env, build, args, timeout_s, pick_device(config.device).type)
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
        self.local = handle.handlers["_local"](None, None)
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"h3serve-{self.stage}-ranks", daemon=True)
        self._watcher.start()

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
        from h3serve.errortable import StageUnavailable

        self._not_serving()   # before the caller hears of it
        return StageUnavailable(self.stage, str(exc))

    def _not_serving(self) -> None:
        s = self.servicer
        s.ready = False
        if s.health is not None and s.health.serving:
            s.health.set(False)

    def call(self, op: str, payload: Any = None, **kw) -> Any:
        try:
            return self.handle.call(op, payload, **kw)
        except RankFailed as exc:
            raise self._unavailable(exc) from None

    def stream(self, op: str, payload: Any = None) -> Iterator:
        """A streaming op. A consumer that stops early still runs the op out on rank 0, so that the other ranks
        (which decode their share of every window) stay in step with it."""
        it = self.call(op, payload)
        try:
            yield from it
        except RankFailed as exc:
            raise self._unavailable(exc) from None
        finally:
            try:
                for _ in it:
                    pass
            except Exception:  # noqa: BLE001 - already reported (or the stage is broken and says so next call)
                pass

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
                  flush=True, file=__import__("sys").stderr)
            os._exit(EXIT_RANK_FAILED)

    def close(self) -> None:
        self._closed.set()
        self.handle.close()


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


class ParallelDiTEngine:
    """The DiT servicer's engine when the DiT has several ranks: `generate` runs on all of them."""

    def __init__(self, stage: ParallelStage):
        self.stage = stage
        self.engine = stage.local

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, req, *, on_step=None, should_stop=None):
        req = dataclasses.replace(req, text_states=_cpu(req.text_states), text_tags=_cpu(req.text_tags),
                                  condition_latents=[_cpu(t) for t in req.condition_latents],
                                  reference_audio_rows=[_cpu(t) for t in req.reference_audio_rows])
        return self.stage.call("generate", req, should_stop=should_stop, on_step=on_step)


class ParallelEncoder:
    """The encoder servicer's encoder under tensor parallelism."""

    def __init__(self, stage: ParallelStage):
        self.stage = stage
        self.encoder = stage.local

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def encode(self, prompt: str, *, task: str = "t2va", **kw):
        if kw.get("images") or kw.get("references"):
            raise H3Error("the parallel encoder service encodes text prompts only")
        return self.stage.call("encode", (prompt, task))


class ParallelVideoVAE:
    """The VAE servicer's VideoVAE whose decode runs patch parallel; everything else is rank 0's own VAE."""

    def __init__(self, stage: ParallelStage):
        self.stage = stage
        self.vae = stage.local

    def __getattr__(self, name):
        return getattr(self.vae, name)

    def iter_decode(self, latents):
        return self.stage.stream("decode", _cpu(latents))

    def iter_decode_yuv420p(self, latents):
        from h3serve.models.vae.video import VideoVAE

        return VideoVAE.iter_decode_yuv420p(self, latents)   # its colour conversion over our iter_decode

    def iter_decode_float(self, latents):
        raise H3Error("the patch-parallel VAE service streams uint8 frames (iter_decode) only")
