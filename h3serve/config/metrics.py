"""The diffusion signals each stage scales on: Prometheus metric names (also the custom-metrics API names the HPA
asks for) and the per-pod targets used when `spec.<stage>.autoscaling.target` is not given.

The stage processes export these names; a metrics adapter (prometheus-adapter, see docs/operator-dev.md) serves them
under custom.metrics.k8s.io; the operator renders autoscaling/v2 HPAs on them.
"""

from __future__ import annotations

from dataclasses import dataclass


# A pipeline stage process serves /metrics on METRICS_PORT + its port offset (h3serve.config.vocab.PORT_OFFSETS: the
# stages of a colocated pod share it); the gateway serves its own at GET /metrics on its HTTP port.
METRICS_PORT = 9400


@dataclass(frozen=True)
class Signal:
    metric: str
    target: str  # per-pod average the HPA holds (a Kubernetes quantity)
    doc: str


SIGNALS: dict[str, tuple[Signal, ...]] = {
    "encoder": (Signal("h3serve_encoder_queued_requests", "8", "prompts admitted and not yet encoded"),),
    "dit": (Signal("h3serve_dit_queued_step_seconds", "120",
                   "denoise steps admitted and not yet run, times the measured seconds per step"),),
    "vae": (Signal("h3serve_vae_queued_clips", "2", "latent clips admitted and not yet decoded"),),
    "muxer": (Signal("h3serve_muxer_open_sessions", "4", "MP4 sessions open"),),
    "gateway": (Signal("h3serve_queue_depth", "8", "requests admitted and waiting to start"),
                Signal("h3serve_rtf", "1", "real-time factor of completed requests (t_client / t_media)")),
}
