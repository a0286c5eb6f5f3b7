"""Weights integrity: `h3serve checkpoint manifest DIR` (per-file sha256, parallel, streamed), a stage pinned to it
checks the files it loads before loading, and a warm-up that computes NaN / Inf keeps the stage up NOT_SERVING
with the reason in its status — on real `h3serve serve` processes and the tiny checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve._proto import common_pb2, dit_pb2_grpc
from h3serve.testing.serve import ServeProcess
from h3serve.weights.manifest import MANIFEST_FILE, IntegrityError, verify_manifest

from .conftest import REPO

ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def manifest(ckpt) -> str:
    out = subprocess.run([sys.executable, "-m", "h3serve.cli", "checkpoint", "manifest", str(ckpt)], cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=120, check=True)
    return re.search(r"^sha256 ([0-9a-f]{64})$", out.stdout, re.M).group(1)


def corrupt(path, offset_from_end: int = 8192, n: int = 4096) -> None:
    """4 KiB of random bytes written into a file's data (past its safetensors header)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - offset_from_end)
        f.write(os.urandom(n))


def test_manifest_lists_every_file_and_pins(copy_checkpoint):
    ckpt = copy_checkpoint()
    pin = manifest(ckpt)
    data = (ckpt / MANIFEST_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == pin
    files = json.loads(data)["files"]
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(files) == on_disk
    st = "transformer/diffusion_pytorch_model.safetensors"
    assert files[st]["sha256"] == hashlib.sha256((ckpt / st).read_bytes()).hexdigest()
    assert verify_manifest(ckpt, pin) == len(files)

    corrupt(ckpt / st)
    with pytest.raises(IntegrityError, match=r"transformer/diffusion_pytorch_model.safetensors: sha256 .* the "
                                             r"manifest says"):
        verify_manifest(ckpt, pin, stage="dit")
    assert verify_manifest(ckpt, pin, stage="vae") > 0          # the VAE does not load the transformer
    with pytest.raises(IntegrityError, match="the pinned manifest is"):
        verify_manifest(ckpt, "0" * 64, stage="vae")
    (ckpt / "vae" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(IntegrityError, match="extra.safetensors: not in the manifest"):
        verify_manifest(ckpt, pin, stage="vae")


class LoneDiT(ServeProcess):
    def __init__(self, ckpt, *argv):
        super().__init__("--stages", "dit", "--checkpoint", str(ckpt), "--port", "0", *argv, cwd=REPO,
                         stderr=subprocess.PIPE)

    def wait(self, name, timeout=120):
        return super().wait(name, timeout)

    def stop(self):
        return super().stop(30, strict=False)


def _assert_not_serving_with(dit: LoneDiT, pattern: str) -> None:
    failed = dit.wait("load_failed")
    assert re.search(pattern, failed["reason"]), failed
    address = dit.wait("listening")["address"]
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        status = dit_pb2_grpc.DiTStub(ch).Status(common_pb2.StatusRequest(), timeout=5)
        assert not status.ready and re.search(pattern, json.loads(status.info_json)["load_error"])


def test_a_pinned_stage_refuses_corrupt_weights_and_stays_not_serving(copy_checkpoint):
    ckpt = copy_checkpoint()
    pin = manifest(ckpt)
    corrupt(ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    dit = LoneDiT(ckpt, "--checkpoint-manifest-sha256", pin)
    try:
        _assert_not_serving_with(dit, r"transformer/diffusion_pytorch_model.safetensors: sha256 [0-9a-f]{64}, "
                                      r"the manifest says")
    finally:
        assert dit.stop() != 0


def test_a_warm_up_with_nan_keeps_the_stage_not_serving(copy_checkpoint):
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint()
    st = ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(st)
    name = next(k for k, v in tensors.items() if v.ndim == 2 and v.is_floating_point())
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, st)
    dit = LoneDiT(ckpt)
    try:
        _assert_not_serving_with(dit, r"dit: warm-up video_latents has \d+ NaN / Inf values")
    finally:
        dit.stop()
