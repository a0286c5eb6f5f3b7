"""The one vocabulary of h3serve: stage names, ports, gRPC service names, in one place."""

from __future__ import annotations

STAGES = ("encoder", "dit", "vae", "muxer", "gateway")
MODEL_STAGES = ("encoder", "dit", "vae")
SERVICE_NAMES = {"encoder": "h3serve.v1.Encoder", "dit": "h3serve.v1.DiT", "vae": "h3serve.v1.VAE",
                 "muxer": "h3serve.v1.Muxer", "gateway": "h3serve.v1.Gateway"}
PORT_OFFSETS = {"gateway": 0, "encoder": 1, "dit": 2, "vae": 3, "muxer": 4}
START_ORDER = ("muxer", "vae", "dit", "encoder", "gateway")
