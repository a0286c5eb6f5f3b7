"""The image the chart deploys: it declares what the GPU stages use, at the versions the project pins and measured.

This reads the Dockerfile (the users' image; tests/realcluster/test_container_image.py runs the test cluster's, built by
scripts/image.sh): each package the stages import at full speed is installed, pinned where the project pins it, and
the ports the renderer uses are exposed.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

from h3serve.config.metrics import METRICS_PORT
from h3serve.config.vocab import GRPC_PORT, HTTP_PORT, PIPELINE_STAGES, PORT_OFFSETS

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _runs() -> str:
    """The final stage's RUN lines, continuation lines joined."""
    final = DOCKERFILE.split("\nFROM ")[-1]
    return re.sub(r"\\\n\s*", " ", final)


def _pin(requirements: list[str], name: str) -> str:
    return next(r for r in requirements if re.match(rf"{re.escape(name)}\s*==", r))


def test_torch_is_the_pinned_build_and_installed_first():
    pin = _pin(PYPROJECT["project"]["dependencies"], "torch").replace(" ", "")
    runs = _runs()
    first = runs.index("pip install")
    assert runs[first:].startswith(f'pip install "{pin}"'), "torch alone, first"
    assert runs.count(f'"{pin}"') == 2  # named again so that nothing resolves it away


def test_gpu_stage_packages_are_installed():
    runs = _runs()
    assert "[operator,nixl]" in runs  # the nixl extra: pinned once, in pyproject.toml
    assert _pin(PYPROJECT["project"]["optional-dependencies"]["nixl"], "nixl")
    assert _pin(PYPROJECT["project"]["dependencies"], "av")  # PyAV comes with h3serve itself
    fa3 = re.search(r'"fa3-fwd==([0-9.]+)"', runs)
    assert fa3, "FlashAttention-3 forward (fa3-fwd) must be installed"
    assert f"fa3-fwd=={fa3.group(1)}" in (ROOT / "bench" / "RESULTS.md").read_text()  # the version measured
    # the build prints what it installed, and fails if one of them is missing
    assert all(f"'{p}'" in runs for p in ("torch", "av", "nixl", "fa3-fwd", "kopf"))


def test_ports_and_user():
    expose = {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()}
    want = {GRPC_PORT, HTTP_PORT, *(METRICS_PORT + PORT_OFFSETS[s] for s in PIPELINE_STAGES)}
    assert want <= expose, want - expose
    assert re.search(r"^USER 65532:65532$", DOCKERFILE, re.M)


def test_base_is_a_build_argument_defaulting_to_upstream():
    assert re.search(r"^ARG BASE=python:3\.11-slim$", DOCKERFILE, re.M)
    assert DOCKERFILE.index("ARG BASE=") < DOCKERFILE.index("\nFROM ")  # global: visible to every FROM
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    assert froms == ["${BASE}", "${BASE}"], froms
