"""A pipeline stage's Prometheus endpoint: the autoscaling signal computed from the stage's admitted requests."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from h3serve.config.stage import StageConfig
from h3serve.runtime import metrics as SM
from h3serve.runtime.stage import StageBase


class DiT(StageBase):
    stage = "dit"


class VAE(StageBase):
    stage = "vae"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""):
            s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dit_exports_queued_denoise_step_seconds(monkeypatch):
    base = _free_port() - 2  # the DiT's offset is +2
    monkeypatch.setenv(SM.METRICS_PORT_ENV, str(base))
    dit = DiT(StageConfig.from_knobs(stage="dit", profile="base"))
    try:
        port = SM.serve_metrics(dit, "127.0.0.1")
        assert port == base + 2
        assert scrape(port)["h3serve_dit_queued_step_seconds"] == 0
        a, b = dit.scope(None, "a"), dit.scope(None, "b")
        a.unit_done(9)  # 40 of 49 forwards left; b: 49
        # no request finished yet: a step counts one second
        m = scrape(port)
        assert m["h3serve_dit_queued_step_seconds"] == 89
        assert m["h3serve_stage_active_requests{stage=dit}"] == 2 and m["h3serve_stage_requests_total{stage=dit}"] == 2
        a.units = 49
        dit.finish(a)
        dit.last_seconds = 98.0  # the last request: 49 forwards in 98 s, 2 s a step
        assert scrape(port)["h3serve_dit_queued_step_seconds"] == 49 * 2.0
        assert scrape(port)["h3serve_stage_work_units_total{stage=dit}"] == 9
    finally:
        dit.close()


def test_vae_counts_queued_clips_and_nothing_listens_without_the_variable(monkeypatch):
    monkeypatch.delenv(SM.METRICS_PORT_ENV, raising=False)
    vae = VAE(StageConfig.from_knobs(stage="vae"))
    try:
        assert SM.serve_metrics(vae) is None
        vae.scope(None, "x")
        assert SM.StageCollector(vae).queued() == 1.0
        assert SM.metrics_port("gateway", {SM.METRICS_PORT_ENV: "9100"}) is None  # it has its own /metrics
        assert SM.metrics_port("muxer", {SM.METRICS_PORT_ENV: "9100"}) == 9104
    finally:
        vae.close()
