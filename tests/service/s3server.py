"""A real S3-compatible server on loopback for the job-store tests: versitygw (posix backend) built once by
tests/service/s3tools.sh and cached outside the repo. `S3Server` starts it on a free port over a directory and can
stop and start it again on the same port and data (the restart tests)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACCESS_KEY, SECRET_KEY = "h3serve-test", "h3serve-test-secret"


def versitygw_binary() -> str:
    out = subprocess.run(["bash", str(REPO / "tests/service/s3tools.sh")], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: Path):
        self.binary = versitygw_binary()
        self.root = root
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def env(self) -> dict[str, str]:
        """What a gateway reads to reach it (the standard S3 client variables)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 20.0) -> None:
        log = open(self.root / "versitygw.log", "ab")
        self.proc = subprocess.Popen([self.binary, "--access", ACCESS_KEY, "--secret", SECRET_KEY,
                                      "--port", f"127.0.0.1:{self.port}", "posix", str(self.root / "data")],
                                     stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"versitygw exited with {self.proc.returncode}: "
                                   f"{(self.root / 'versitygw.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"versitygw did not listen on {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root / "data", ignore_errors=True)


def with_env(env: dict[str, str]):
    """os.environ plus `env` (for a gateway process)."""
    return {**os.environ, **env}
