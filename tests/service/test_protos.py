"""The committed generated modules are what grpcio-tools makes of protos/h3serve/v1 today, and every tensor field
is documented with its shape, dtype and units."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

import h3serve._proto as proto_pkg

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos" / "h3serve" / "v1"


def test_generated_modules_are_current():
    try:
        tools = version("grpcio-tools")
    except PackageNotFoundError:
        tools = "no grpcio-tools"
    if tools != proto_pkg.GENERATED_WITH:
        why = f"generated with grpcio-tools {proto_pkg.GENERATED_WITH}, {tools} installed"
        if os.environ.get("CI"):  # CI must check them: a skip there would hide stale modules
            pytest.fail(f"{why}: install grpcio-tools=={proto_pkg.GENERATED_WITH}")
        pytest.skip(why)  # a developer machine without that grpcio-tools
    r = subprocess.run([sys.executable, "-m", "h3serve._proto.generate", "--check"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_test_extra_pins_the_generator_the_modules_were_made_with():
    """A fresh install takes grpcio-tools from pyproject.toml: an unpinned one drifts to a release that writes other
    bytes, and the check above then fails on a clean clone though no proto changed."""
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"grpcio-tools=={proto_pkg.GENERATED_WITH}" in extra


def test_every_proto_is_there_and_imports():
    names = {p.stem for p in PROTOS.glob("*.proto")}
    assert names == {"common", "encoder", "dit", "vae", "muxer", "gateway"}
    from h3serve._proto import dit_pb2_grpc, encoder_pb2_grpc, gateway_pb2_grpc, muxer_pb2_grpc, vae_pb2_grpc

    for module, service in ((encoder_pb2_grpc, "Encoder"), (dit_pb2_grpc, "DiT"), (vae_pb2_grpc, "VAE"),
                            (muxer_pb2_grpc, "Muxer"), (gateway_pb2_grpc, "Gateway")):
        assert hasattr(module, f"{service}Stub")


def test_tensor_fields_document_shape_dtype_and_units():
    """Each place a TensorChunk carries a named tensor says its shape ( ... ), its dtype and what the values are."""
    dtypes = ("float32", "bfloat16", "int64", "uint8")
    for path in PROTOS.glob("*.proto"):
        text = path.read_text()
        for block in re.findall(r"((?:\s*//[^\n]*\n)+)\s*TensorChunk chunk = \d+;", text):
            assert "(" in block and any(d in block for d in dtypes), (path.name, block)
            assert any(w in block for w in ("unitless", "0..255", "[-1, 1]", "roles", "token")), (path.name, block)
    common = (PROTOS / "common.proto").read_text()
    assert "4 MiB" in common
