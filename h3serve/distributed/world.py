"""The runtime of a stage with N parallel ranks: one process per rank, one `torch.distributed` world.

This module holds the world (`Runtime`, `launch`, `join_from_env`) and rank 0's side (`StageHandle`); the other
ranks' command loop is `h3serve.distributed.commands`, rank 0's stand-ins for the models `h3serve.distributed.proxies`.

    rank 0 (owns the request; in services, the gRPC server)         ranks 1..N-1 (peers)
    ───────────────────────────────────────────────────────         ─────────────────────────────────
    handle.call(op, payload) ──store: h3/cmd/<seq> = op──────────►  wait for h3/cmd/<seq> (polled, never times out)
                             ──broadcast_object_list(payload)────►  receive the payload
    handlers[op](payload, Local(should_stop, on_step))              handlers[op](payload, None)
       └── collectives inside the handler (all ranks, same order) ──┘
    collect h3/done/<seq>/<rank> ◄──────────────────────────────────  post "ok" or "<Error>: message"

* Every rank runs the same `build(runtime, *args) -> {op: handler}` (SPMD): it loads its part of the model and creates
  its process groups in the same order on every rank.
* Cancellation: `Runtime.agreed_stop(local_fn, control)` is a collective: every rank calls it at the same step
  boundary, rank 0 contributes its caller's flag, and all ranks stop at the same step (an all_reduce(MAX) of a flag
  on a gloo group). No rank is ever left waiting in a collective for a peer that stopped.
* Failure: every rank writes a heartbeat to the store; a watchdog on rank 0 watches them (and the processes it
  spawned). A dead peer makes the request in flight fail with an `H3Error` naming the rank, the stage reports
  unhealthy (`handle.healthy`) and refuses further requests; collectives also carry a timeout (`timeout_s`), so
  nothing hangs past it. On NCCL the watchdog aborts the process group to unblock a collective that would wait.
* Two ways in: `launch(world_size, build, ...)` makes the calling process rank 0 and spawns ranks 1..N-1
  (`h3serve generate`, tests), or `join_from_env(build, ...)` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT /
  LOCAL_RANK (what torchrun or the operator set in pods): rank 0 gets the handle, the other ranks serve until shutdown.
* Devices: rank r uses cuda:LOCAL_RANK when CUDA is present (NCCL for tensors), else the CPU (gloo). Control traffic
  (commands, stop flags) always goes over a gloo group so that it never touches the accelerator.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3serve.config.parallel import DegreeError, ParallelDegrees
from h3serve.distributed.commands import (
    CMD,
    DONE,
    HEARTBEAT,
    HEARTBEAT_S,
    READY,
    SHUTDOWN,
    Handler,
    Local,
    peer_main,
    serve,
)
from h3serve.errors import Cancelled, H3Error, RankFailed

log = logging.getLogger("h3serve.distributed.world")

__all__ = [
    "Runtime", "StageHandle", "launch", "join_from_env", "spawn_peers", "free_port", "weights_digest",
    "check_identical",
]

# What a spawned rank inherits from this process's environment.
INHERITED_ENV = ("H3SERVE", "HF_", "TRANSFORMERS", "OMP_")


# ---------------------------------------------------------------------------------------------------------------------
# Per-process runtime


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Runtime:
    """This process's place in the stage: rank, device, the store, the world and control groups."""

    def __init__(self, rank: int, world_size: int, *, master_addr: str, master_port: int, local_rank: int,
                 timeout_s: float, backend: str | None = None, device: str | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.master_addr, self.master_port, self.timeout_s = master_addr, master_port, timeout_s
        # device: None (cuda:LOCAL_RANK when CUDA is present, else cpu), "cpu", "cuda" (= cuda:LOCAL_RANK).
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                                   wait_for_workers=False)
        # No `device_id`: binding one makes torch create every later subgroup by ncclCommSplit, where a rank outside
        # the new group must join the split too. torch does that on every non-member `new_group` call, even for a
        # gloo group, while members split only for NCCL groups; the counts then differ and a non-member blocks
        # forever (seen with the stage's single-rank encoder / VAE groups next to Ulysses 2 on 2 GPUs). Unbound, each
        # NCCL communicator is created on its group's first collective, by its members only.
        dist.init_process_group(self.backend, store=self.store, rank=rank, world_size=world_size, timeout=timeout)
        # Commands and stop flags travel on gloo whatever the tensor backend is.
        self.control = dist.new_group(backend="gloo", timeout=timeout) if self.backend != "gloo" else dist.group.WORLD
        self._stop_heartbeat = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat, name=f"h3-heartbeat-{rank}", daemon=True)
        self._hb_thread.start()

    # -- groups -------------------------------------------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> tuple[Any, Any]:
        """(tensor group, gloo control group) over `ranks`; every rank of the world must call this, in the same order.

        Non-members get (None, None).
        """
        ranks = sorted(int(r) for r in ranks)
        timeout = timedelta(seconds=self.timeout_s)
        if ranks == list(range(self.world_size)):
            data = dist.group.WORLD
            control = self.control
        else:
            data = dist.new_group(ranks, timeout=timeout)
            control = dist.new_group(ranks, backend="gloo", timeout=timeout) if self.backend != "gloo" else data
        if self.rank not in ranks:
            return None, None
        return data, control

    # -- collectives the stages share ---------------------------------------------------------------------------

    def agreed_stop(self, local: Callable[[], bool] | None, control=None) -> Callable[[], bool]:
        """A `should_stop` that every rank of `control` must poll at the same step boundary: True on all of them as
        soon as one (in practice rank 0, from its caller) says stop."""
        group = control if control is not None else self.control

        def should_stop() -> bool:
            flag = torch.tensor([1 if (local is not None and local()) else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return bool(flag.item())

        return should_stop

    def broadcast_object(self, obj: Any, src: int = 0, control=None) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=control if control is not None else self.control)
        return box[0]

    # -- liveness -----------------------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        try:
            store = dist.TCPStore(self.master_addr, self.master_port, is_master=False,
                                  timeout=timedelta(seconds=max(5.0, self.timeout_s)))
        except Exception:  # noqa: BLE001 - rank 0 already gone
            return
        while not self._stop_heartbeat.is_set():
            try:
                store.set(f"{HEARTBEAT}{self.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001 - the store (rank 0) is gone; the command loop notices too
                return
            self._stop_heartbeat.wait(HEARTBEAT_S)

    def last_heartbeat(self, rank: int) -> float | None:
        try:
            if not self.store.check([f"{HEARTBEAT}{rank}"]):
                return None
            return float(self.store.get(f"{HEARTBEAT}{rank}").decode())
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        self._stop_heartbeat.set()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on a broken group
            pass


# ---------------------------------------------------------------------------------------------------------------------
# Rank 0: the handle


class StageHandle:
    """Rank 0's view of the stage: `call` one op on every rank, `healthy`, `close`."""

    def __init__(self, runtime: Runtime, handlers: dict[str, Handler], processes: Sequence = ()):
        self.runtime = runtime
        self.handlers = handlers
        self.processes = list(processes)  # spawned peers (index i = rank i+1); empty when joined from env
        self.world_size = runtime.world_size
        self.last_outcomes: dict[int, str] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._dead: tuple[int, str] | None = None
        self._closed = False
        self._watch_stop = threading.Event()
        self._started = time.time()
        self._watchdog = threading.Thread(target=self._watch, name="h3-watchdog", daemon=True)
        self._watchdog.start()

    # -- health -------------------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._closed

    @property
    def failure(self) -> str | None:
        return None if self._dead is None else f"rank {self._dead[0]} {self._dead[1]}"

    def _check_peers(self) -> tuple[int, str] | None:
        for i, p in enumerate(self.processes):
            if not p.is_alive():
                return i + 1, f"exited (exit code {p.exitcode}){peer_error(p)}"
        limit = max(5.0, 10 * HEARTBEAT_S)
        now = time.time()
        for r in range(1, self.world_size):
            hb = self.runtime.last_heartbeat(r)
            if hb is None:
                if now - self._started > self.runtime.timeout_s:
                    return r, f"never sent a heartbeat in {self.runtime.timeout_s:.0f} s"
            elif now - hb > limit:
                return r, f"sent no heartbeat for {now - hb:.1f} s"
        return None

    def _watch(self) -> None:
        while not self._watch_stop.wait(HEARTBEAT_S / 2):
            if self._dead is not None or self._closed:
                continue
            found = self._check_peers()
            if found is not None:
                self._dead = found
                log.error("stage unhealthy: rank %d %s", *found)
                if self.runtime.backend == "nccl":  # a NCCL collective would otherwise wait for its timeout
                    try:
                        dist.distributed_c10d._abort_process_group()
                    except Exception:  # noqa: BLE001
                        pass

    def _failed(self, op: str, exc: BaseException | None) -> RankFailed:
        # Give the watchdog a moment to name the culprit: a collective fails as soon as a peer's socket closes.
        deadline = time.time() + 4 * HEARTBEAT_S + 1.0
        while self._dead is None and time.time() < deadline:
            found = self._check_peers()
            if found is not None:
                self._dead = found
                break
            time.sleep(HEARTBEAT_S / 4)
        if self._dead is None:
            self._dead = (-1, f"a collective failed ({type(exc).__name__}: {exc})")
        r, why = self._dead
        who = f"rank {r} of {self.world_size} {why}" if r >= 0 else why
        return RankFailed(f"{op} failed: {who}; the stage is unhealthy and must be restarted")

    # -- calls --------------------------------------------------------------------------------------------------

    def call(self, op: str, payload: Any = None, *, should_stop: Callable[[], bool] | None = None,
             on_step: Callable[[int, int], None] | None = None) -> Any:
        """Run `op` on every rank with the same `payload`; returns rank 0's result (an iterator for streaming ops,
        which the caller must exhaust). Raises `RankFailed` if a rank died, `Cancelled` if stopped."""
        if self._closed:
            raise H3Error("this parallel stage is closed")
        if self._dead is not None:
            raise RankFailed(f"{op} refused: the stage is unhealthy (rank {self._dead[0]} {self._dead[1]}); "
                              "restart it")
        self._lock.acquire()
        release = True
        try:
            self._seq += 1
            seq = self._seq
            self.runtime.store.set(f"{CMD}{seq}", op)
            self.runtime.broadcast_object(payload)
            result = self.handlers[op](payload, Local(should_stop, on_step))
            if isinstance(result, Iterator):
                release = False
                return self._stream(seq, op, result)
            self._collect(seq, op)
            return result
        except RankFailed:
            raise
        except (Cancelled, H3Error):
            self._collect(seq, op)  # the peers stopped at the same boundary; learn their outcome
            raise
        except BaseException as exc:
            if self._dead is not None or self._check_peers() is not None or _is_comm_error(exc):
                raise self._failed(op, exc) from exc
            raise
        finally:
            if release:
                self._lock.release()

    def _stream(self, seq: int, op: str, it: Iterator) -> Iterator:
        try:
            yield from it
        except (Cancelled, H3Error):
            self._collect(seq, op)
            raise
        except BaseException as exc:
            if self._dead is not None or self._check_peers() is not None or _is_comm_error(exc):
                raise self._failed(op, exc) from exc
            raise
        else:
            self._collect(seq, op)
        finally:
            self._lock.release()

    def _collect(self, seq: int, op: str) -> None:
        """Each peer's outcome of call `seq` ("ok" or "<Error>: message") into `last_outcomes`."""
        outcomes = {}
        for r in range(1, self.world_size):
            key = f"{DONE}{seq}/{r}"
            deadline = time.time() + self.runtime.timeout_s
            while True:
                exc = None
                try:
                    if self.runtime.store.check([key]):
                        outcomes[r] = self.runtime.store.get(key).decode()
                        break
                except Exception as e:  # noqa: BLE001
                    exc = e
                if exc is not None or self._dead is not None or self._check_peers() is not None \
                        or time.time() > deadline:
                    raise self._failed(op, exc or TimeoutError(f"no outcome from rank {r}")) from None
                time.sleep(0.005)
        self.last_outcomes = outcomes

    def close(self) -> None:
        """Shut the peers down (they exit their loop), then this rank's process group."""
        if self._closed:
            return
        self._watch_stop.set()
        try:
            if self._dead is None:
                self.runtime.store.set(f"{CMD}{self._seq + 1}", SHUTDOWN)
        except Exception:  # noqa: BLE001
            pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._closed = True
        self.runtime.close()

    def __enter__(self) -> "StageHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_comm_error(exc: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe"))


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def _wait_ready(handle: StageHandle, deadline_s: float) -> None:
    t0 = time.time()
    for r in range(1, handle.world_size):
        while True:
            if handle.runtime.store.check([f"{READY}{r}"]):
                break
            found = handle._check_peers()
            if found is not None or time.time() - t0 > deadline_s:
                why = found[1] if found else f"not ready after {deadline_s:.0f} s"
                handle._dead = (r, why)
                handle.close()
                raise RankFailed(f"starting the stage failed: rank {r} of {handle.world_size} {why}")
            time.sleep(0.05)


def peer_error(p) -> str:
    """": <Error>: message" a spawned rank reported before it served (`peer_main`), or ""."""
    conn = getattr(p, "h3_report", None)
    if getattr(p, "h3_error", None) is None:
        p.h3_error = ""
        try:
            if conn is not None and conn.poll(0.5):   # a dead rank's last words arrive with its exit
                p.h3_error = f": {conn.recv()}"
        except (EOFError, OSError):
            pass
    return p.h3_error


def _first_dead(procs: Sequence) -> tuple[int, str] | None:
    for i, p in enumerate(procs):
        if not p.is_alive():
            return i + 1, f"exited (exit code {p.exitcode}){peer_error(p)}"
    return None


def spawn_peers(ranks: Iterable[tuple[int, int]], world_size: int, master_addr: str, master_port: int,
                build: Callable, build_args: tuple, *, timeout_s: float, backend: str | None = None,
                device: str | None = None) -> list:
    """Start one process per (rank, local rank) on this host (local rank r on cuda:r with `device` "cuda" or None
    when CUDA is present); each joins the world at master_addr:master_port and serves once built."""
    ctx = mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith(INHERITED_ENV)}
    procs = []
    for rank, local_rank in ranks:
        make_runtime = functools.partial(Runtime, rank, world_size, master_addr=master_addr, master_port=master_port,
                                         local_rank=local_rank, timeout_s=timeout_s, backend=backend, device=device)
        report, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=peer_main, name=f"h3-rank-{rank}", daemon=True,
                        args=(make_runtime, build, build_args, env, child_end))
        p.start()
        child_end.close()
        p.h3_report = report
        procs.append(p)
    return procs


def launch(world_size: int, build: Callable, build_args: tuple = (), *, timeout_s: float = 600.0,
           backend: str | None = None, master_port: int | None = None, start_timeout_s: float = 600.0,
           device: str | None = None) -> StageHandle:
    """Make this process rank 0 of a new `world_size` world and spawn ranks 1..N-1 on this host (rank r on
    cuda:r with `device` "cuda" or None when CUDA is present; every rank on the CPU with "cpu").

    `build(runtime, *build_args) -> {op: handler}` runs on every rank (it must be importable: spawned processes
    import it by name). Returns once every rank has built its handlers.
    """
    if world_size < 1:
        raise DegreeError(f"world_size={world_size} is invalid: at least 1 rank")
    if dist.is_initialized():
        raise H3Error("this process already is a rank of a parallel stage (one per process); close that stage "
                      "(StageHandle.close / Pipeline.close) before launching another")
    addr = "127.0.0.1"
    port = master_port or free_port(addr)
    procs = spawn_peers(((r, r) for r in range(1, world_size)), world_size, addr, port, build, build_args,
                        timeout_s=timeout_s, backend=backend, device=device)
    # Rank 0 joins and builds in a thread while this one watches the peers: a rank that dies before it joins (no
    # device for it, a failed load) would leave rank 0 in the rendezvous or a group's barrier until timeout_s.
    started: dict[str, Any] = {}

    def start_rank0() -> None:
        try:
            started["runtime"] = Runtime(0, world_size, master_addr=addr, master_port=port, local_rank=0,
                                         timeout_s=timeout_s, backend=backend, device=device)
            started["handlers"] = build(started["runtime"], *build_args)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            started["error"] = exc

    starter = threading.Thread(target=start_rank0, name="h3-rank0-start", daemon=True)
    starter.start()
    try:
        while starter.is_alive():
            starter.join(0.1)
            dead = _first_dead(procs) if starter.is_alive() else None
            if dead is not None:
                raise RankFailed(f"starting the stage failed: rank {dead[0]} of {world_size} {dead[1]}")
    except BaseException:   # a dead rank, or Ctrl-C: the others go too; rank 0's thread is left to the exit
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    if "error" in started:
        if "runtime" in started:
            StageHandle(started["runtime"], {}, procs).close()
        else:
            for p in procs:
                p.kill()
        raise started["error"]
    handle = StageHandle(started["runtime"], started["handlers"], procs)
    _wait_ready(handle, start_timeout_s)
    return handle


def join_from_env(build: Callable, build_args: tuple = (), *, timeout_s: float = 600.0,
                  degrees: ParallelDegrees | None = None,
                  on_ready: Callable[[], None] | None = None) -> StageHandle | None:
    """Join the world described by RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (default 29500), LOCAL_RANK.

    Rank 0 gets the `StageHandle`; any other rank serves rank 0's commands until shutdown and returns None (calling
    `on_ready` once its part is built and it is in the world).
    """
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr = os.environ["MASTER_ADDR"]
    except KeyError as exc:
        raise H3Error(f"joining a parallel stage needs RANK, WORLD_SIZE and MASTER_ADDR in the environment; "
                      f"{exc.args[0]} is missing") from None
    port = int(os.environ.get("MASTER_PORT", "29500"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if degrees is not None:
        degrees.validate(world_size=world)
    runtime = Runtime(rank, world, master_addr=addr, master_port=port, local_rank=local_rank, timeout_s=timeout_s)
    if rank != 0:
        serve(runtime, build, build_args, on_ready)
        return None
    handle = StageHandle(runtime, build(runtime, *build_args))
    _wait_ready(handle, timeout_s)
    return handle


def weights_digest(named_tensors) -> str:
    """A fingerprint of (name, dtype, shape, every bit) of each tensor, computed where the tensors live.

    Per tensor, an exact int64 sum of its bytes weighted by position (mod 65521) on its own device, so a multi-GB
    model is fingerprinted without copying it to the host; the per-tensor numbers are then hashed with sha256.
    """
    h = hashlib.sha256()
    chunk = 1 << 24
    for name, t in named_tensors:
        t = t.detach().contiguous()
        data = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        acc = torch.zeros((), dtype=torch.int64, device=t.device)
        for off in range(0, data.numel(), chunk):
            part = data[off:off + chunk].to(torch.int64)
            pos = torch.arange(off, off + part.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
            acc += (part * pos).sum()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{int(acc)};".encode())
    return h.hexdigest()


def check_identical(runtime: Runtime, digest: str, what: str, control=None) -> None:
    """All ranks of `control` must hold the same `digest` (e.g. of the fused weights); raises on every rank if not."""
    group = control if control is not None else runtime.control
    size = dist.get_world_size(group)
    digests: list = [None] * size
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise H3Error(f"{what} differ between ranks (sha256 per rank: {digests}); every rank must load the same "
                      "checkpoint and adapter")

