"""The mistakes a newcomer makes first, each against real processes and real ports on 127.0.0.1: a clear error
(exit 2, one line naming the flag and the value) before anything loads, or a stop that says what it does.
Each test prints its "time to a clear error" (docs/services.md, "Mistakes and how fast they are reported")."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from h3serve.config.parallel import DegreeError, ParallelDegrees
from h3serve.config.stage import StageConfig
from h3serve.runtime.launcher import Launcher
from h3serve.runtime.process import HealthPid
from h3serve.testing.serve import ServeProcess
from h3serve.transport.channel import wait_serving

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 120, entry: tuple[str, ...] = ("-m", "h3serve.cli"),
            **kw) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, *entry, *args], text=True, timeout=timeout, env=env, cwd=REPO,
                       **(kw or {"capture_output": True}))
    return r, time.monotonic() - t0


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


# the CLI, then a last stdout line naming the heavy modules it imported ("heavy:" alone: none)
HEAVY_PROBE = ("import sys; from h3serve.cli import main; code = main(sys.argv[1:]); "
               "print('heavy:', *(m for m in ('torch', 'grpc') if m in sys.modules)); sys.exit(code)")


def refused_before_torch(*args: str) -> tuple[str, float]:
    """`h3serve serve ARGS`: exit 2 and one line, told before torch or grpc is imported (a torch import alone takes
    2-9 s); the line and the seconds it took."""
    r, took = run_cli("serve", *args, entry=("-c", HEAVY_PROBE))
    line = one_line(r)
    assert r.stdout.strip().splitlines()[-1:] == ["heavy:"], (line, r.stdout)
    return line, took


@pytest.fixture
def held_port():
    """A port another program listens on (a plain socket, as any server holds one)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def free_base() -> int:
    """A base port whose +0..+5 are free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 6 < 65535 and all(_free(base + i) for i in range(6)):
            return base


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# -- ports ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gateway", "dit", "http"])
def test_a_busy_port_is_one_line_before_anything_loads(tiny_checkpoint, held_port, which):
    # before: a false ready banner (a second serve) or, after ~60 s of loading, exit 3 "internal error"
    port = {"gateway": held_port, "dit": held_port - 2, "http": 0}[which]
    http = str(held_port) if which == "http" else "0"
    line, took = refused_before_torch("--checkpoint", str(tiny_checkpoint), "--port", str(port), "--http-port", http)
    flag = {"gateway": f"--port {port}:", "dit": f"--port {port} (+2: the dit stage)",
            "http": f"--http-port {held_port}:"}[which]
    assert flag in line and f"127.0.0.1:{held_port} is in use" in line, line
    print(f"busy {which} port: exit 2 in {took:.2f} s: {line}")


def test_health_counts_only_our_own_childs_answer():
    # another server on the port answered the launcher's health checks: the ready banner came from it
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=(HealthPid(),))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert wait_serving(address, 5.0, pid=os.getpid())
        assert not wait_serving(address, 1.5, pid=os.getpid() + 1)   # SERVING, but not the child we started
        assert wait_serving(address, 5.0)                            # without a pid: any SERVING (probes, tools)
    finally:
        server.stop(0)


def test_a_stage_that_cannot_bind_ends_serve_with_its_error(held_port, capfd):
    # the port is taken after the launcher's own check (a race): the child's exit 2 ends the start, no restart loop
    launcher = Launcher(StageConfig.from_knobs(threads=1), ["muxer"], base_port=held_port - 4, http_port=None,
                        start_timeout=120, restart=True, log_level="WARNING", json_output=False)
    t0 = time.monotonic()
    try:
        code = launcher.start()
    finally:
        launcher.stop()
    took = time.monotonic() - t0
    assert code == 2 and launcher.procs["muxer"].returncode == 2
    err = capfd.readouterr().err
    assert f"--port {held_port}: 127.0.0.1:{held_port} is in use" in err, err
    print(f"stage bind failure ended serve in {took:.2f} s")


# -- serve's other mistakes, before any model loads ----------------------------------------------------------------

def test_serve_mistakes_are_one_line_before_anything_loads(tiny_checkpoint, tmp_path):
    broken = tmp_path / "no-vae"
    shutil.copytree(tiny_checkpoint, broken)
    shutil.rmtree(broken / "vae")
    base = str(free_base())
    cases = {
        "missing checkpoint": (["--checkpoint", str(tmp_path / "nope")], "checkpoint folder does not exist"),
        "missing component": (["--checkpoint", str(broken)], "vae/: component folder of 'vae' is missing"),
        "0.0.0.0 without keys": (["--checkpoint", str(tiny_checkpoint), "--host", "0.0.0.0", "--no-peer-auth"],
                                 "would listen on 0.0.0.0 without authentication"),
        "a stage beyond loopback without mTLS": (["--checkpoint", str(tiny_checkpoint), "--stages", "dit",
                                                  "--host", "0.0.0.0"], "the dit would listen on 0.0.0.0 without mTLS"),
        "--tls-cert without --tls-key": (["--checkpoint", str(tiny_checkpoint), "--tls-cert", "c.pem"],
                                         "--tls-cert and --tls-key go together"),
        "a degree the checkpoint's heads refuse": (["--checkpoint", str(tiny_checkpoint), "--ulysses", "3"],
                                                   "ulysses=3 must divide the DiT's 2 attention heads"),
        "a lone gateway without stage addresses": (["--stages", "gateway"],
                                                   "a lone gateway needs the stage addresses: --encoder HOST:PORT"),
    }
    for name, (argv, expected) in cases.items():
        line, took = refused_before_torch("--port", base, "--http-port", "0", *argv)
        assert expected in line, (name, line)
        print(f"serve, {name}: exit 2 in {took:.2f} s: {line}")


@pytest.mark.parametrize("output", ["/proc/x.mp4", "missing-dir/x.mp4"])
def test_generate_output_that_cannot_be_written_is_refused_first(tiny_checkpoint, tmp_path, output):
    # before: /proc passed os.access and failed after the whole generation
    path = output if output.startswith("/") else str(tmp_path / output)
    r, took = run_cli("generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "x", "--size", "256x256",
                      "--steps", "4", "--seconds", "5", "-o", path)
    line = one_line(r)
    assert f"--output {path}" in line, line
    print(f"generate -o {output}: exit 2 in {took:.2f} s: {line}")


def test_checkpoint_info_into_a_closed_pipe_is_quiet(tiny_checkpoint):
    # `h3serve checkpoint info DIR | head` where head has gone: no "internal error: BrokenPipeError"
    read, write = os.pipe()
    os.close(read)
    try:
        r, _ = run_cli("checkpoint", "info", str(tiny_checkpoint), stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert r.stderr == "" and r.returncode == 141, (r.returncode, r.stderr)


# -- ranks and devices ------------------------------------------------------------------------------------------------

def test_more_ranks_than_devices_is_refused_naming_the_degree_and_the_count():
    assert ParallelDegrees(ulysses=2).check_devices(2)
    with pytest.raises(DegreeError, match=r"^--ulysses 2 x --ring 1 = 2 ranks, one per CUDA device, but 1 CUDA "
                                          r"device visible: lower the degree to at most 1, or use --device cpu$"):
        ParallelDegrees(ulysses=2).check_devices(1)
    with pytest.raises(DegreeError, match=r"^--encoder-tp 8 = 8 ranks, .* but 4 CUDA devices visible"):
        ParallelDegrees(encoder_tp=8, ulysses=2).check_devices(4)
    ParallelDegrees(encoder_tp=8, ulysses=2).check_devices(4, stages=("dit",))   # the encoder is served elsewhere


# -- Ctrl-C -----------------------------------------------------------------------------------------------------------

class Launched(ServeProcess):
    """`h3serve serve --stages vae,muxer`: two children, quick to load; stderr collected line by line."""

    def __init__(self, checkpoint: Path, *extra: str):
        super().__init__("--checkpoint", str(checkpoint), "--stages", "vae,muxer", "--port", "0", "--json",
                         "--no-warmup", *extra, stderr=subprocess.PIPE, cwd=REPO)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._errors, daemon=True).start()
        self.serving = self.wait("serving", 240)

    def _errors(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.strip()))

    def line(self, text: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in self.lines:
                if text in line:
                    return t
            time.sleep(0.02)
        raise AssertionError(f"no stderr line with {text!r} in {timeout}s: {self.lines}")


def test_ctrl_c_says_what_it_stops_and_a_second_one_stops_at_once(tiny_checkpoint):
    s = Launched(tiny_checkpoint, "--grace-s", "30")
    muxer = s.serving["stages"]["muxer"]["pid"]
    os.kill(muxer, signal.SIGSTOP)   # a stage that will not stop by itself
    try:
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        said = s.line("stopping: muxer, vae stop; Ctrl-C again", 5) - t0
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(10)
        took = time.monotonic() - t0
        assert code == 130
        print(f"first Ctrl-C answered in {said:.2f} s, the second stopped serve in {took:.2f} s")
    finally:
        s.stop(strict=False)
    with pytest.raises(ProcessLookupError):   # the whole group went (os.kill raises once it is reaped)
        for _ in range(100):
            os.kill(muxer, 0)
            time.sleep(0.05)


def test_a_stage_killed_past_its_grace_is_a_non_zero_exit(tiny_checkpoint):
    s = Launched(tiny_checkpoint, "--grace-s", "0")
    os.kill(s.serving["stages"]["muxer"]["pid"], signal.SIGSTOP)
    try:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 5
        s.line("muxer did not stop within 15s; killing", 1)
    finally:
        s.stop(strict=False)


def test_the_gateways_health_thread_is_joined_on_close():
    from h3serve.services.gateway.stages import StageClients

    dead = "127.0.0.1:9"   # nothing listens: the monitor's Checks fail fast
    clients = StageClients(StageConfig.from_knobs(stage="gateway", encoder=dead, dit=dead, vae=dead, muxer=dead))
    clients.start()
    time.sleep(0.3)
    clients.close()
    assert not clients._thread.is_alive()
