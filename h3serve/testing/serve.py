"""`h3serve serve` as a child process for tests and benchmarks: its JSON events (one per stdout line: `ready`,
`serving`, `restarted`, `hung`, `load_failed`, ...) collected by a thread, waited for by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from h3serve.cli import build_parser
from h3serve.config.stage import STAGE_CONFIG_ENV, StageConfig
from h3serve.runtime.launcher import child_argv, child_config, write_child_config
from h3serve.runtime.prechecks import config_from_args


class ServeProcess:
    """`python -m h3serve.cli serve --threads N ARGV` with its own environment; stdout is read to the end, so a
    chatty child never blocks on a full pipe."""

    def __init__(self, *argv: str, threads: int = 1, env: dict | None = None, cwd=None, stderr=None):
        self.argv = argv
        cmd = [sys.executable, "-m", "h3serve.cli", "--log-level", "WARNING", "serve", "--threads", str(threads),
               *argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
                                              PYTHONUNBUFFERED="1", **(env or {})))
        self.events: list[dict] = []
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                with self._changed:
                    self.events.append(event)
                    self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait(self, name: str, timeout: float = 240.0) -> dict:
        """The first event called `name`; RuntimeError if the child ends or `timeout` passes without it."""
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                hit = next((e for e in self.events if e.get("event") == name), None)
                if hit is not None:
                    return hit
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._changed.wait(left)
        code = self.proc.poll()
        err = self.proc.stderr.read() if code is not None and self.proc.stderr is not None else ""
        raise RuntimeError(f"h3serve serve {' '.join(self.argv)}: no {name!r} event within {timeout}s (exit code "
                           f"{code}); last events {self.events[-5:]} {err[-2000:]}")

    def stop(self, timeout: float = 90.0, *, strict: bool = True) -> int:
        """SIGTERM, then the exit code; past `timeout` the child is killed (and, `strict`, TimeoutExpired raised)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            if strict:
                raise
            return code


def launched_config(config: StageConfig, stage: str, port: int, addresses: dict[str, str], http_port: int | None,
                    folder: str | Path) -> StageConfig:
    """The StageConfig a launcher's child runs with: its file as the launcher writes it, its argv parsed by `serve`'s
    own parser, both read by `serve`'s own path."""
    path = write_child_config(child_config(config, stage, port, addresses, http_port), str(folder))
    args = build_parser().parse_args(child_argv(stage, "info")[3:])
    return config_from_args(args, stage, {STAGE_CONFIG_ENV: path})
