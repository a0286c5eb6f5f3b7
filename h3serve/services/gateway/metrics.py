"""Prometheus metrics of the gateway (served at GET /metrics), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from h3serve.config.vocab import NIXL, PIPELINE_STAGES

STAGE_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
RTF_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2, 3, 5, 10, 20, 50)
# timings key -> stage label of h3serve_stage_seconds
STAGE_KEYS = {"queue_s": "queue", "encoder_s": "encoder", "dit_s": "dit", "vae_video_s": "vae_video",
              "vae_audio_s": "vae_audio", "mux_tail_s": "mux_tail", "fetch_s": "fetch", "tail_s": "tail"}


class GatewayMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("h3serve_queue_depth", "Requests admitted and waiting to start", registry=r)
        self.inflight = Gauge("h3serve_inflight_requests", "Requests running through the stages", registry=r)
        self.requests = Counter("h3serve_requests", "Requests by outcome (completed, or the error code)",
                                ["outcome"], registry=r)
        self.stage_seconds = Histogram("h3serve_stage_seconds", "Seconds a completed request spent per stage",
                                       ["stage"], buckets=STAGE_SECONDS_BUCKETS, registry=r)
        self.request_seconds = Histogram("h3serve_request_seconds", "Admission to MP4 ready (t_client)",
                                         buckets=STAGE_SECONDS_BUCKETS, registry=r)
        self.rtf = Histogram("h3serve_rtf", "Real-time factor t_client / t_media of completed requests",
                             buckets=RTF_BUCKETS, registry=r)
        self.stage_up = Gauge("h3serve_stage_up", "1 when the stage reports SERVING", ["stage"], registry=r)
        self.transport_info = Gauge(
            "h3serve_transport_info", "1 for the transport the edge used last (requested = configured, chosen = "
            "used; reason says why)", ["edge", "requested", "chosen", "reason"], registry=r)
        self.transport_fallbacks = Counter(
            "h3serve_transport_fallbacks", "Requests whose edge used grpc although nixl was requested", ["edge"],
            registry=r)
        self.transport_requests = Counter("h3serve_transport_requests", "Requests by edge and transport used",
                                          ["edge", "chosen"], registry=r)
        self.latents_relayed_bytes = Counter(
            "h3serve_gateway_latents_bytes", "Latent bytes the gateway carried from the DiT to the VAE (0 while the "
            "dit->vae edge goes direct)", registry=r)
        self.encoder_cache = Counter("h3serve_encoder_cache", "Encodes served from the encoder's cache (hit) or "
                                     "computed (miss)", ["result"], registry=r)
        for result in ("hit", "miss"):
            self.encoder_cache.labels(result=result)
        self.usage_jobs = Counter("h3serve_usage_jobs", "Finished jobs per caller and outcome", ["caller", "outcome"],
                                  registry=r)
        self.usage_video_seconds = Counter("h3serve_usage_video_seconds", "Seconds of video delivered per caller",
                                           ["caller", "model"], registry=r)
        self.usage_gpu_seconds = Counter("h3serve_usage_gpu_seconds", "GPU-seconds jobs occupied per caller and "
                                         "stage (completed or not)", ["caller", "stage"], registry=r)
        self.webhooks = Counter("h3serve_webhook_deliveries", "Webhook attempts by outcome (delivered, retried, "
                                "failed: no more attempts)", ["outcome"], registry=r)
        self._transport_labels: dict[str, tuple] = {}
        for outcome in ("completed", "invalid_request", "queue_full", "draining", "stage_unavailable",
                        "deadline_exceeded", "cancelled", "stage_failed", "internal"):
            self.requests.labels(outcome=outcome)
        for stage in PIPELINE_STAGES:
            self.stage_up.labels(stage=stage).set(0)

    def observe(self, timings: dict) -> None:
        for key, stage in STAGE_KEYS.items():
            if key in timings:
                self.stage_seconds.labels(stage=stage).observe(timings[key])
        if "t_client" in timings:
            self.request_seconds.observe(timings["t_client"])
        if "rtf_client" in timings:
            self.rtf.observe(timings["rtf_client"])

    def set_transport(self, edge: str, requested: str, chosen: str, reason: str, *, request: bool = True) -> None:
        """Record the transport an edge used (one h3serve_transport_info series per edge, the latest)."""
        labels = (edge, requested, chosen, reason)
        old = self._transport_labels.get(edge)
        if old is not None and old != labels:
            try:
                self.transport_info.remove(*old)
            except KeyError:
                pass
        self._transport_labels[edge] = labels
        self.transport_info.labels(*labels).set(1)
        if request:
            self.transport_requests.labels(edge=edge, chosen=chosen).inc()
            if requested == NIXL and chosen != NIXL:
                self.transport_fallbacks.labels(edge=edge).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
