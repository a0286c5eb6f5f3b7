"""Service tests: real stage processes started by `h3serve serve` on 127.0.0.1, real gRPC and HTTP clients.

The stack is started once per session (`stack`); tests that need their own processes start them. Every engine
runs with one torch thread, and the embedded reference is computed with one thread too: fp32 CPU kernels may
round differently with another thread count, and the tests compare MP4 bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from h3serve.testing.serve import ServeProcess

REPO = Path(__file__).resolve().parents[2]
THREADS = 1
# The canonical request: tiny checkpoint, 320x256, 5 s (124 frames), 4 grid points (3 denoising steps).
REQUEST = dict(prompt="a kite over the sea", seconds=5, size="320x256", seed=0, num_inference_steps=4)
STAGES = ("encoder", "dit", "vae", "muxer")


def finished_job(http, job_id: str, timeout: float = 180.0) -> dict:
    """GET /v1/videos/{id} (an httpx client of the gateway) until the job is completed or failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"{job_id} not finished in {timeout} s")


def embedded_request(**fields):
    """validate_request kwargs for an API-style request (num_inference_steps -> steps), fp32 as the servers."""
    raw = dict(fields)
    raw["steps"] = raw.pop("num_inference_steps")
    return dict(raw, dtype="fp32")


class Stack(ServeProcess):
    """A launcher process (`h3serve serve --stages all`) and the endpoints it printed."""

    def __init__(self, checkpoint: Path, *extra: str, start_timeout: float = 240.0):
        super().__init__("--checkpoint", str(checkpoint), "--port", "0", "--http-port", "0", "--json", *extra,
                         threads=THREADS, cwd=REPO)
        self._channels = {}
        try:
            serving = self.wait("serving", start_timeout)
        except RuntimeError:
            self.stop()
            raise
        self.grpc = serving["gateway"]["grpc"]
        self.http = serving["gateway"]["http"]
        self.addresses = {s: serving["stages"][s]["address"] for s in STAGES if s in serving["stages"]}

    def status(self, stage: str):
        """The stage's StageStatus (its own counters: requests, cancelled, steps / clips, last request)."""
        import grpc

        from h3serve._proto import common_pb2, dit_pb2_grpc, encoder_pb2_grpc, muxer_pb2_grpc, vae_pb2_grpc

        stubs = {"encoder": encoder_pb2_grpc.EncoderStub, "dit": dit_pb2_grpc.DiTStub, "vae": vae_pb2_grpc.VAEStub,
                 "muxer": muxer_pb2_grpc.MuxerStub}
        if stage not in self._channels:
            self._channels[stage] = grpc.insecure_channel(self.addresses[stage])
        return stubs[stage](self._channels[stage]).Status(common_pb2.StatusRequest(), timeout=5)

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.http}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready within {timeout}s")

    def wait_idle(self, stage: str, timeout: float = 30.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status(stage)
            if not st.current_request_id:
                return st
            time.sleep(0.05)
        raise TimeoutError(f"{stage} still busy after {timeout}s")

    def stop(self, timeout: float = 90.0) -> int:
        for c in self._channels.values():
            c.close()
        return super().stop(timeout)


@pytest.fixture(scope="session")
def stack(tiny_checkpoint):
    """All stages + gateway, queue size 1, one request at a time."""
    s = Stack(tiny_checkpoint, "--queue-size", "1", "--max-inflight", "1", "--grace-s", "10")
    yield s
    code = s.stop()
    assert code == 0, f"launcher exited with {code}"


@pytest.fixture(scope="session")
def cond_ckpt(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with the reference short edge at 256 (2048 released): the same rule at a CPU-friendly
    size, read by the stages and the embedded pipeline alike."""
    import shutil

    dst = tmp_path_factory.mktemp("cond") / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    index = json.loads((dst / "modular_model_index.json").read_text())
    index["reference_image_short_edge"] = 256
    (dst / "modular_model_index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="session")
def cond_stack(cond_ckpt):
    """All stages + gateway serving t2va, fl2va and ref2va (tests/service/test_conditions.py, test_dialects.py)."""
    s = Stack(cond_ckpt, "--queue-size", "2", "--max-inflight", "1", "--grace-s", "10",
              "--tasks", "t2va,fl2va,ref2va")
    yield s
    assert s.stop() == 0


def embedded_maker(pipe, out):
    """`make(**api_fields) -> bytes`: `pipe`'s MP4 for a request (1 thread), each request generated once."""
    import torch

    from h3serve.config.request import validate_request

    cache: dict = {}

    def make(**fields) -> bytes:
        key = json.dumps(fields, sort_keys=True, default=str)
        if key not in cache:
            before = torch.get_num_threads()
            torch.set_num_threads(THREADS)
            try:
                path = out / f"{len(cache)}.mp4"
                pipe.generate(validate_request(**embedded_request(**fields)), path)
                cache[key] = path.read_bytes()
            finally:
                torch.set_num_threads(before)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def embedded(tiny_checkpoint, tmp_path_factory):
    """`embedded(**api_fields) -> bytes`: the embedded pipeline's MP4 for a request (fp32, cpu, 1 thread)."""
    from h3serve.pipeline import Pipeline

    pipe = Pipeline.load(tiny_checkpoint, dtype="fp32", device="cpu")
    return embedded_maker(pipe, tmp_path_factory.mktemp("embedded"))


class LoneStage(ServeProcess):
    """One stage in its own process (`h3serve serve --stages <stage> --port 0`) with extra environment."""

    def __init__(self, stage: str, *argv: str, env: dict, timeout: float = 120.0):
        super().__init__("--stages", stage, "--port", "0", *argv, threads=THREADS, env=env, cwd=REPO)
        try:
            self.address = self.wait("ready", timeout)["address"]
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> int:
        return super().stop(30, strict=False)
