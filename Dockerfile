# syntax=docker/dockerfile:1
# The h3serve image: every serving pod (gateway, encoder, dit, vae, muxer, colocated engine) and the operator.
#   docker build -t registry.example/h3serve:0.1.0 .
# The operator chart and the H3Deployment `image` field both point at it.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY h3serve ./h3serve
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp
COPY --from=build /wheels /wheels
# torch first and alone (pinned) so that resolving the rest cannot move it; PyAV wheels bundle FFmpeg.
RUN pip install "torch==2.13.0" \
 && pip install "$(ls /wheels/h3serve-*.whl)[operator]" \
 && rm -rf /wheels
# Pods run as this user (restricted Pod Security: runAsNonRoot, read-only root filesystem, /tmp an emptyDir).
USER 65532:65532
WORKDIR /tmp
EXPOSE 50051 8000 9090 8080
CMD ["h3serve", "--help"]
