"""Prometheus metrics of a pipeline stage process (encoder, DiT, VAE, muxer), served on $H3SERVE_METRICS_PORT.

The gateway keeps its own registry at GET /metrics on its HTTP port (h3serve.services.gateway.metrics). Each stage
exports the signal its autoscaler reads (h3serve.config.metrics.SIGNALS), computed at scrape time from what the stage
already tracks (its admitted requests and their work units), plus request counters, readiness and the attention
kernel and transport it chose. Without the variable (a laptop, the tests) nothing listens.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from h3serve.config.metrics import SIGNALS
from h3serve.config.request import DEFAULT_STEPS
from h3serve.config.vocab import PIPELINE_STAGES, PORT_OFFSETS

METRICS_PORT_ENV = "H3SERVE_METRICS_PORT"
log = logging.getLogger("h3serve.metrics")


class StageCollector:
    """Reads a StageBase servicer at each scrape (no counters of its own to keep in step)."""

    def __init__(self, servicer):
        self.s = servicer

    def queued(self) -> float:
        """The stage's autoscaling signal: queued work of the admitted requests."""
        s = self.s
        with s.lock:
            active = list(s.active.values())
            last = s.last
            last_seconds = s.last_seconds
        if s.stage != "dit":
            return float(len(active))  # prompts / clips / sessions admitted and not finished
        forwards = DEFAULT_STEPS[s.config.model.profile or "base"] - 1
        per_step = last_seconds / last.units if last is not None and last.units else 1.0
        return sum(max(0, forwards - sc.units) for sc in active) * per_step

    def collect(self):
        s, stage = self.s, self.s.stage
        sig = SIGNALS[stage][0]
        g = GaugeMetricFamily(sig.metric, sig.doc)
        g.add_metric([], self.queued())
        yield g
        for name, doc, value in (("h3serve_stage_requests", "Requests admitted", s.requests_total),
                                 ("h3serve_stage_cancelled", "Requests cancelled or past their deadline",
                                  s.cancelled_total),
                                 ("h3serve_stage_work_units", "Work units done (denoise steps, clips, frames)",
                                  s.work_units_total)):
            c = CounterMetricFamily(name, doc, labels=["stage"])
            c.add_metric([stage], value)
            yield c
        for name, doc, value in (("h3serve_stage_active_requests", "Requests admitted and not finished",
                                  len(s.active)),
                                 ("h3serve_stage_ready", "1 once the weights are loaded and warmed up", int(s.ready)),
                                 ("h3serve_stage_load_seconds", "Seconds the stage took to load", s.load_seconds)):
            g = GaugeMetricFamily(name, doc, labels=["stage"])
            g.add_metric([stage], value)
            yield g
        attention = s.attention()
        g = GaugeMetricFamily("h3serve_stage_choice", "1: the attention kernel (none: no attention, or not loaded) "
                              "and the transport the stage chose; the reasons are in its Status",
                              labels=["stage", "attention", "transport"])
        g.add_metric([stage, attention["kernel"] if attention else "none", s.transport.chosen], 1)
        yield g


def metrics_port(stage: str, env: dict | None = None) -> int | None:
    """$H3SERVE_METRICS_PORT plus the stage's port offset (several stages share a colocated pod), or None."""
    raw = (os.environ if env is None else env).get(METRICS_PORT_ENV)
    if not raw or stage not in PIPELINE_STAGES:
        return None
    return int(raw) + PORT_OFFSETS[stage]


def serve_metrics(servicer, host: str = "0.0.0.0") -> int | None:
    """Start the stage's /metrics endpoint when $H3SERVE_METRICS_PORT is set; the port, or None."""
    port = metrics_port(servicer.stage)
    if port is None:
        return None
    registry = CollectorRegistry()
    registry.register(StageCollector(servicer))
    start_http_server(port, addr=host, registry=registry)
    log.info("%s: Prometheus metrics on %s:%d/metrics", servicer.stage, host, port)
    return port
