"""`h3serve serve`: run stage servers, one per process, and supervise them on one host.

    h3serve serve --checkpoint DIR --stages all --port 50051 --http-port 8000
        launcher: starts encoder, dit, vae, muxer and gateway as separate processes on loopback, waits until each
        reports SERVING on gRPC health checking, prints the endpoints, restarts a stage that dies, and on SIGTERM
        drains the gateway first, then stops the stages; exits 0.
    h3serve serve --checkpoint DIR --stages dit --port 50053
        one stage in this process (what a container of the disaggregated layout runs).

Ports with `--stages all`: gateway gRPC = --port, then encoder, dit, vae, muxer = --port + 1 .. + 4 (or free
ports when --port is 0); HTTP = --http-port (a free port when 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve._proto import common_pb2
from h3serve.config.levers import fasth3_levers
from h3serve.config.stage import STAGE_CONFIG_ENV, StageConfig, connect_host
from h3serve.config.vocab import EXIT_USER_ERROR, FASTH3_DIT, MODEL_STAGES, PORT_OFFSETS, SERVICE_NAMES
from h3serve.distributed.world import free_port
from h3serve.runtime import ranks
from h3serve.runtime.prechecks import ServePlan, serve_order
from h3serve.runtime.process import EXIT_LOAD_FAILED, ServicerFactory, announce, run_stage
from h3serve.runtime.tls import Tls
from h3serve.transport.channel import wait_serving

# the launcher's liveness probe: a child SERVING once and then silent (health deadline exceeded) this long is hung
LIVENESS_INTERVAL_S = 1.0
LIVENESS_S = 10.0
# `serve` stopped, but a stage had to be killed (past its grace, or a second Ctrl-C) or exited non-zero
EXIT_UNCLEAN_STOP = 5


def child_config(config: StageConfig, stage: str, port: int, addresses: dict[str, str],
                 http_port: int | None) -> StageConfig:
    """What a child of the launcher runs with: the launcher's config, as one stage on its port. It dials only the
    stages started here and those given (a `dns:///` target: its name, by its addresses); the gateway also gets
    their addresses and the HTTP port; the FastH3 pool beside a base DiT is the launcher's to start, not a child's."""
    gateway = stage == "gateway"
    return config.replace(
        stage=stage, port=port, advertise=None, peers=",".join(sorted({a.removeprefix("dns:///")
                                                                       for a in addresses.values()})),
        http_port=http_port if gateway else None, fasth3_adapter=None, fasth3_adapter_sha256=None,
        fasth3_dit=addresses.get(FASTH3_DIT, config.gateway.fasth3_dit) if gateway else config.gateway.fasth3_dit,
        **{s: addresses.get(s) if gateway else None for s in MODEL_STAGES + ("muxer",)})


def write_child_config(config: StageConfig, folder: str) -> str:
    """`config` as the JSON file a child reads at `$H3SERVE_STAGE_CONFIG` (written whole, then renamed)."""
    path = os.path.join(folder, f"{config.stage}-{config.server.port}.json")
    with open(path + ".part", "w") as fh:
        json.dump(asdict(config), fh, sort_keys=True)
    os.replace(path + ".part", path)
    return path


def child_argv(stage: str, log_level: str) -> list[str]:
    """A child's argv: its stage alone; every knob is in its config file."""
    return [sys.executable, "-m", "h3serve.cli", "--log-level", log_level, "serve", "--stages", stage]


class Launcher:
    """Starts the stages as child processes, waits for health, supervises (restarts a stage that dies) and stops
    them in order on SIGTERM: the gateway first (it drains), then the stages."""

    def __init__(self, config: StageConfig, stages: list[str], *, base_port: int, http_port: int | None,
                 start_timeout: float, restart: bool, log_level: str, json_output: bool):
        self.config = config
        self.order = serve_order(config, stages)   # with the FastH3 DiT pool beside a base one (--fasth3-dit)
        stages = self.stages = [*stages, *(s for s in self.order if s not in stages)]
        self.start_timeout = start_timeout
        self.restart = restart
        self.log_level = log_level
        self.json_output = json_output
        host = config.server.host
        self.ports = {s: (free_port(host) if base_port == 0 else base_port + PORT_OFFSETS[s]) for s in stages}
        self.http_port = None
        if "gateway" in stages and http_port is not None:
            self.http_port = free_port(config.gateway.http_host) if http_port == 0 else http_port
        self.addresses = {s: f"{connect_host(host)}:{p}" for s, p in self.ports.items()}
        for s in MODEL_STAGES + ("muxer",):   # a gateway without local stages talks to the ones given
            if s not in self.addresses and getattr(config.gateway, s):
                self.addresses[s] = getattr(config.gateway, s)
        tls = Tls.of(config)
        self.credentials = tls.channel_credentials() if tls.enabled else None   # its health checks
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {s: 0 for s in stages}
        self.stopping = threading.Event()
        self.exit_code = 0   # a child's user error (EXIT_USER_ERROR) ends `serve` with it
        self.killed = False   # a second Ctrl-C killed the children
        self._threads: list[threading.Thread] = []
        self.folder = tempfile.mkdtemp(prefix="h3serve-stages-", dir=config.media.tmp_dir)  # the children's config files

    def spawn(self, stage: str) -> subprocess.Popen:
        if stage == FASTH3_DIT:
            fast = self.config.replace(profile="fasth3", adapter=self.config.model.fasth3_adapter,
                                       adapter_sha256=self.config.model.fasth3_adapter_sha256,
                                       levers=fasth3_levers(self.config.levers))
            config = child_config(fast, "dit", self.ports[stage], self.addresses, None)
        else:
            config = child_config(self.config, stage, self.ports[stage], self.addresses, self.http_port)
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        env[STAGE_CONFIG_ENV] = write_child_config(config, self.folder)
        proc = subprocess.Popen(child_argv(config.stage, self.log_level), env=env, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs[stage] = proc
        return proc

    def endpoints(self) -> dict:
        out = {"stages": {s: {"address": self.addresses[s], "pid": self.procs[s].pid} for s in self.stages}}
        if "gateway" in self.stages:
            http_host = connect_host(self.config.gateway.http_host)
            out["gateway"] = {"grpc": self.addresses["gateway"],
                              "http": f"{'https' if self.credentials else 'http'}://{http_host}:{self.http_port}"
                              if self.http_port else None}
        return out

    def start(self) -> int:
        """Start the children; 0 once each answered SERVING itself, else the exit code `serve` ends with."""
        for stage in self.order:
            self.spawn(stage)
        end = time.monotonic() + self.start_timeout
        for stage in self.order:
            proc = self.procs[stage]
            failed: list[str] = []
            asked = [0.0]

            def alive(p=proc, s=stage) -> bool:
                if p.poll() is not None:
                    return False
                if s != "gateway" and time.monotonic() - asked[0] >= 1.0:   # a child up but failed its load
                    asked[0] = time.monotonic()
                    failed[:] = [self.load_error(s)]
                return not (failed and failed[0])

            # only this child's own SERVING counts (its pid rides on the answer): another server on the port
            # must not make a ready banner
            ok = wait_serving(self.addresses[stage], max(0.0, end - time.monotonic()), alive=alive,
                              credentials=self.credentials, pid=proc.pid)
            if not ok:
                if self.stopping.is_set():
                    return EXIT_LOAD_FAILED
                why = f"exited with {proc.returncode}" if proc.poll() is not None else \
                    f"load failed: {failed[0]}" if failed and failed[0] else \
                    f"not SERVING within {self.start_timeout:.0f}s"
                print(f"h3serve: {stage} {why}", file=sys.stderr, flush=True)
                return EXIT_USER_ERROR if proc.poll() == EXIT_USER_ERROR else EXIT_LOAD_FAILED
        return 0

    def load_error(self, stage: str) -> str:
        """The reason a child stays up NOT_SERVING (its Status' load_error), or ""."""
        ch = grpc.secure_channel(self.addresses[stage], self.credentials) if self.credentials else \
            grpc.insecure_channel(self.addresses[stage])
        try:
            service = SERVICE_NAMES["dit" if stage == FASTH3_DIT else stage]   # the FastH3 pool is a DiT
            status = ch.unary_unary(f"/{service}/Status",
                                    request_serializer=common_pb2.StatusRequest.SerializeToString,
                                    response_deserializer=common_pb2.StageStatus.FromString)(
                common_pb2.StatusRequest(), timeout=1.0)
            return json.loads(status.info_json or "{}").get("load_error", "")
        except (grpc.RpcError, ValueError):
            return ""
        finally:
            ch.close()

    def print_endpoints(self) -> None:
        eps = self.endpoints()
        if self.json_output:
            announce("serving", **eps)
            return
        if "gateway" in eps:
            print(f"gateway grpc  {eps['gateway']['grpc']}")
            if eps["gateway"]["http"]:
                print(f"gateway http  {eps['gateway']['http']}")
        for s, e in eps["stages"].items():
            if s != "gateway":
                print(f"{s:<13} {e['address']}  (pid {e['pid']})")
        sys.stdout.flush()

    def _liveness(self) -> None:
        """A child that stops answering gRPC health (a deadline per check) for LIVENESS_S is hung (SIGSTOP, a
        wedged interpreter): kill it, and `supervise` restarts it — the launcher's liveness probe."""
        channels = {s: grpc.secure_channel(a, self.credentials) if self.credentials else grpc.insecure_channel(a)
                    for s, a in self.addresses.items() if s in self.stages}
        stubs = {s: health_pb2_grpc.HealthStub(c) for s, c in channels.items()}
        silent_since: dict[str, float] = {}
        # stage -> the pid seen SERVING (a process still loading is never judged); `start` saw every one SERVING
        served: dict[str, int] = {s: self.procs[s].pid for s in stubs}
        while not self.stopping.wait(LIVENESS_INTERVAL_S):
            for stage, stub in stubs.items():
                proc = self.procs[stage]
                if proc.poll() is not None:
                    silent_since.pop(stage, None)
                    continue
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=LIVENESS_INTERVAL_S)
                    silent_since.pop(stage, None)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        served[stage] = proc.pid
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or served.get(stage) != proc.pid:
                        continue   # refused or reset (starting or dying: `supervise` sees it), or still loading
                    since = silent_since.setdefault(stage, time.monotonic())
                    if time.monotonic() - since >= LIVENESS_S and not self.stopping.is_set():
                        print(f"h3serve: {stage} (pid {proc.pid}) has not answered health checks for "
                              f"{LIVENESS_S:.0f}s; killing it", file=sys.stderr, flush=True)
                        if self.json_output:
                            announce("hung", stage=stage, pid=proc.pid)
                        proc.kill()
                        silent_since.pop(stage, None)
        for c in channels.values():
            c.close()

    def supervise(self) -> None:
        liveness = threading.Thread(target=self._liveness, name="h3serve-liveness", daemon=True)
        liveness.start()
        self._threads.append(liveness)
        backoff = {s: 1.0 for s in self.stages}
        while not self.stopping.wait(0.25):
            for stage in self.stages:
                proc = self.procs[stage]
                if proc.poll() is None or self.stopping.is_set():
                    continue
                if proc.returncode == EXIT_USER_ERROR:   # its one line said why; a restart would say it again
                    print(f"h3serve: {stage} exited with {EXIT_USER_ERROR} (its error above); stopping",
                          file=sys.stderr, flush=True)
                    self.exit_code = EXIT_USER_ERROR
                    self.stopping.set()
                    break
                if not self.restart:
                    print(f"h3serve: {stage} exited with {proc.returncode}; stopping", file=sys.stderr, flush=True)
                    self.stopping.set()
                    break
                print(f"h3serve: {stage} (pid {proc.pid}) exited with {proc.returncode}; restarting in "
                      f"{backoff[stage]:.0f}s", file=sys.stderr, flush=True)
                if self.stopping.wait(backoff[stage]):
                    break
                self.restarts[stage] += 1
                new = self.spawn(stage)
                backoff[stage] = min(30.0, backoff[stage] * 2)
                if self.json_output:
                    announce("restarted", stage=stage, pid=new.pid, address=self.addresses[stage])
                threading.Thread(target=self._reset_backoff, args=(stage, new, backoff), daemon=True).start()

    def _reset_backoff(self, stage: str, proc: subprocess.Popen, backoff: dict) -> None:
        if wait_serving(self.addresses[stage], self.start_timeout,
                        alive=lambda: proc.poll() is None and not self.stopping.is_set(),
                        credentials=self.credentials, pid=proc.pid):
            backoff[stage] = 1.0

    def kill(self) -> None:
        """SIGKILL every child's process group (a stage and its ranks) at once: the second Ctrl-C."""
        self.stopping.set()
        self.killed = True
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # start_new_session: the group is the stage's
                except OSError:
                    pass

    def what_stops(self) -> str:
        """The line printed at the first Ctrl-C / SIGTERM: what is stopped, in which order, how long at most."""
        rest = [s for s in self.order if s != "gateway" and s in self.procs]
        first = f"the gateway drains (up to {self.config.server.grace_s:.0f}s), then " if "gateway" in self.procs else ""
        return (f"h3serve: stopping: {first}{', '.join(rest) or 'nothing else'} stop; Ctrl-C again to kill "
                "them at once")

    def stop(self) -> int:
        """SIGTERM the gateway, wait for it to drain, then the stages; SIGKILL what overstays. The exit code: 0 when
        every child stopped cleanly, `EXIT_UNCLEAN_STOP` when one had to be killed or exited non-zero."""
        self.stopping.set()
        grace = self.config.server.grace_s
        order = ["gateway"] + [s for s in self.order if s != "gateway"]
        codes = {}
        for group in (["gateway"], [s for s in order if s != "gateway"]):
            live = [s for s in group if s in self.procs and self.procs[s].poll() is None]
            for s in live:
                self.procs[s].send_signal(signal.SIGTERM)
            end = time.monotonic() + grace + 15.0
            for s in live:
                try:
                    codes[s] = self.procs[s].wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"h3serve: {s} did not stop within {grace + 15:.0f}s; killing", file=sys.stderr)
                    try:
                        os.killpg(self.procs[s].pid, signal.SIGKILL)   # the stage and its ranks
                    except OSError:
                        pass
                    codes[s] = self.procs[s].wait()
        for t in self._threads:
            t.join(LIVENESS_INTERVAL_S * 2 + 1.0)
        shutil.rmtree(self.folder, ignore_errors=True)
        bad = {s: c for s, c in codes.items() if c not in (0, None)}
        if bad:
            print(f"h3serve: stages exited with {bad}", file=sys.stderr, flush=True)
        if self.killed:
            return 130
        return EXIT_UNCLEAN_STOP if bad else 0


def serve_main(args: argparse.Namespace, plan: ServePlan, servicers: Callable[[str], ServicerFactory]) -> int:
    """`h3serve serve`: one stage in this process, or the launcher for several (see the module docstring), as
    `plan` says: `check_serve` found no mistake in it before this module (torch, grpc, the models) was imported."""
    stages, config, degrees = plan.stages, plan.config, plan.degrees
    if len(stages) == 1:
        if plan.peer:   # a joined rank other than 0: its part of the model, no gRPC
            return ranks.run_peer(stages[0], config, degrees)
        return run_stage(config, servicers(stages[0]))
    launcher = Launcher(config, stages, base_port=config.server.port, http_port=config.gateway.http_port,
                        start_timeout=args.start_timeout, restart=not args.no_restart,
                        log_level=args.log_level, json_output=args.json)
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)
        if len(signals) == 1:
            launcher.stopping.set()
            os.write(2, (launcher.what_stops() + "\n").encode())   # at once, not after the drain
        elif signum == signal.SIGINT:
            os.write(2, b"h3serve: killing every stage now\n")
            launcher.kill()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    started = EXIT_LOAD_FAILED
    try:
        started = launcher.start()
        if started == 0:
            launcher.print_endpoints()
            launcher.supervise()
    finally:
        code = launcher.stop()
    if args.json:
        announce("stopped")
    if started != 0 and not signals:
        return started
    return launcher.exit_code or code
