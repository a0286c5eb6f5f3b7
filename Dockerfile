# syntax=docker/dockerfile:1
# The h3serve image: every serving pod (gateway, encoder, dit, vae, muxer, colocated engine) and the operator.
#   docker build -t registry.example/h3serve:0.1.0 .
# The operator chart and the H3Deployment `image` field both point at it.
# BASE: any Debian-like image with CPython 3.11 at `python`/`pip` on PATH, e.g. a mirror of python:3.11-slim:
#   docker build --build-arg BASE=mirror.example/python:3.11-slim -t registry.example/h3serve:0.1.0 .
# (The test cluster's image is built without a registry or a container engine: scripts/image.sh.)
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY h3serve ./h3serve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp
COPY --from=build /wheels /wheels
# The versions the test suite last passed with (scripts/constraints.txt); the GPU-only packages, which it does not
# run, are pinned where they are named below.
COPY scripts/constraints.txt /constraints.txt
# What the GPU stages use, so that no pod falls back for want of a package:
# - torch first and alone (pinned; PyPI's Linux wheels are the CUDA build) so that resolving the rest cannot move it;
# - PyAV (a dependency of h3serve; its wheels bundle FFmpeg) for the muxer;
# - NIXL (the `nixl` extra: UCX transport of latents and frames between stages);
# - FlashAttention-3 forward (`fa3-fwd`, the DiT's attention kernel on Hopper; the version bench/RESULTS.md measured);
# - FlashAttention-4 (`flash-attn-4`, the block-sparse attention lever's kernel; JIT-compiled by its CuTe DSL on first
#   use; the version bench/RESULTS.md §16 measured).
# torch is named again in the second install so that pip keeps the pinned build.
RUN pip install "torch==2.13.0" -c /constraints.txt \
 && pip install "torch==2.13.0" "$(ls /wheels/h3serve-*.whl)[operator,nixl]" "fa3-fwd==0.0.3" \
      "flash-attn-4==4.0.0b36" -c /constraints.txt \
 && python -c "from importlib.metadata import version as v; print({p: v(p) for p in ('torch', 'av', 'nixl', 'fa3-fwd', 'flash-attn-4', 'kopf')})" \
 && rm -rf /wheels /constraints.txt
# Pods run as this user (restricted Pod Security: runAsNonRoot, read-only root filesystem, /tmp an emptyDir).
USER 65532:65532
WORKDIR /tmp
# gRPC, HTTP (and the gateway's /metrics), the stages' /metrics (9400 + offset), the operator's liveness
EXPOSE 50051 8000 9401 9402 9403 9404 8080
CMD ["h3serve", "--help"]
